"""Clocks for timing training on the rank's device, in `time.perf_counter` seconds (the host clock the
capture aligns across ranks).

On the CPU the work is done when the host's call returns, so the host clock is the clock. On CUDA a call
returns once its kernels are queued: the host clock alone would time the queueing.

- `StepClock` times a training step. CPU: `time.perf_counter`. CUDA: two CUDA events on the current
  stream, resolved at the step's end (one synchronize) into host seconds anchored to a host timestamp
  taken right after a synchronize at the step's start.
- `boundary_clock(placement)` is a plain ``() -> seconds`` for code that needs a number at once (the event
  recorder's segment boundaries): on CUDA it synchronizes the current stream first, so the time read is
  when the work queued so far has finished — correct, but the host no longer runs ahead of the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .placement import Placement


class StepClock:
    """One step at a time: `start()`, then `stop()` (returns the end in host seconds); `elapsed_s` after."""

    def __init__(self, device: str = "cpu") -> None:
        self.cuda = device.startswith("cuda")
        self.device = device
        self.start_s = 0.0
        self.end_s = 0.0
        self._running = False
        self._start_event: Any = None

    def start(self) -> float:
        """Begin a step; its start in host seconds."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)  # nothing queued before the start is counted in it
            self.start_s = time.perf_counter()
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self.start_s = time.perf_counter()
        self._running = True
        return self.start_s

    def stop(self) -> float:
        """End the step (CUDA: an event on the current stream, then the one synchronize); its end in host
        seconds."""
        if not self._running:
            raise RuntimeError("StepClock.stop() without start()")
        self._running = False
        if not self.cuda:
            self.end_s = time.perf_counter()
            return self.end_s
        import torch

        end_event = torch.cuda.Event(enable_timing=True)
        end_event.record()
        torch.cuda.synchronize(self.device)  # every stream, not only the one the end event is on
        self.end_s = self.start_s + self._start_event.elapsed_time(end_event) / 1e3  # elapsed_time: ms
        return self.end_s

    @property
    def elapsed_s(self) -> float:
        return self.end_s - self.start_s


def boundary_clock(placement: Placement) -> Callable[[], float]:
    """``() -> host seconds`` at which the work queued so far on this rank's current stream has finished."""
    if not placement.cuda:
        return time.perf_counter
    import torch

    def now_s() -> float:
        torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    return now_s
