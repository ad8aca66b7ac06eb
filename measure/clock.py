"""Clocks for timing training on the rank's device, in `time.perf_counter` seconds (the host clock the
capture aligns across ranks).

On the CPU the work is done when the host's call returns, so the host clock is the clock. On CUDA a call
returns once its kernels are queued: the host clock alone would time the queueing.

`boundary_clock(placement)` times `ciera train`'s steps (`begin()`, one boundary at the end, `finish()`)
and the event recorder's segment boundaries. CPU
(`HostBoundaryClock`): the host clock. CUDA (`CudaBoundaryClock`): a CUDA event per boundary on the
caller's current stream, each returned as a provisional host-time key and resolved into host seconds at
the iteration's end (one synchronize at its start, one at its end, none between).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .placement import Placement


class HostBoundaryClock:
    """The CPU's segment boundaries: the host clock, nothing to resolve at the iteration's end."""

    device = False

    def __call__(self) -> float:
        return time.perf_counter()

    def begin(self) -> float:
        """An iteration starts: its start in host seconds."""
        return time.perf_counter()

    def finish(self) -> Callable[[float], float]:
        """The iteration ended: how to turn what the clock returned into host seconds (here: as is)."""
        return _as_is


def _as_is(value_s: float) -> float:
    return value_s


class CudaBoundaryClock:
    """A CUDA rank's segment boundaries: each call records a CUDA event on the caller's current stream and
    returns a provisional key — a host time, strictly increasing, so the recorder's order and comparisons
    hold during the iteration — which ``finish()`` maps to the time the stream reached that event. No
    synchronize during the iteration: the host runs ahead of the GPU as it does untimed. ``begin()``
    synchronizes once and anchors the events to the host clock; ``finish()`` synchronizes once."""

    device = True

    def __init__(self, device: str) -> None:
        self.device_name = device
        self._anchor_s = 0.0
        self._last_key_s = 0.0
        self._start_event: Any = None
        self._events: dict[float, Any] = {}

    def begin(self) -> float:
        import torch

        torch.cuda.synchronize(self.device_name)  # nothing queued before the start belongs to it
        self._anchor_s = self._last_key_s = time.perf_counter()
        self._start_event = torch.cuda.Event(enable_timing=True)
        self._start_event.record()
        self._events = {}
        return self._anchor_s

    def __call__(self) -> float:
        import torch

        key_s = max(time.perf_counter(), self._last_key_s + 1e-9)
        self._last_key_s = key_s
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events[key_s] = event
        return key_s

    def finish(self) -> Callable[[float], float]:
        import torch

        torch.cuda.synchronize(self.device_name)  # every stream: boundaries sit on the callers' streams
        times_s = {
            key_s: self._anchor_s + self._start_event.elapsed_time(event) / 1e3  # elapsed_time: ms
            for key_s, event in self._events.items()
        }
        self._events = {}
        return lambda value_s: times_s.get(value_s, value_s)


def boundary_clock(placement: Placement) -> HostBoundaryClock | CudaBoundaryClock:
    """The event recorder's clock for this rank's placement."""
    return CudaBoundaryClock(placement.device) if placement.cuda else HostBoundaryClock()
