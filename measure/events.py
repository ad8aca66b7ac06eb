"""Per-event timelines of real training iterations on one rank (`EventRecorder`).

What is recorded, on `time.perf_counter`'s clock (converted to seconds from the iteration's start when the
capture aligns the ranks' clocks). On a CUDA rank the boundaries are CUDA events
(`measure.clock.CudaBoundaryClock`, `use_clock`): each is recorded on the current stream and resolved at
the iteration's end, so a segment ends when the stream has run its kernels and a wait ends when the
compute stream has caught up with the collective, without a synchronize inside the iteration; an
asynchronous collective ends at the wait that consumes it (NCCL completes its future when the op is
queued, not when it is done).

- **compute / gather_host / optim**: the main thread's time, cut into segments. A segment ends whenever
  the main thread blocks in a collective (a synchronous call, or `Work.wait()`), runs the codec, enters or
  leaves a layer, or enters or leaves the engine's own gather call (`engine_gather`); each segment is
  attributed to the layer and phase it ran in. Segments inside the engine's gather call (its issue or its
  wait: the engine's host path, or CIERA's) go to the `gather_host` stream, segments in the optimizer step
  to the `optim` stream. Time the main thread spends blocked is on no compute stream: it is exactly what
  the collectives did not hide.
- **allgather / reduce_scatter / all_reduce**: every collective this process issues (wrapped where every
  engine's collectives pass: `torch.distributed`'s `all_gather_single`, `reduce_scatter_single`,
  `all_reduce`), from the moment the rank issued it (`issued_s`) to its completion (the completion
  callback of its future for an asynchronous op, the return for a synchronous one). On a stream, an op
  starts when it was issued or when the previous op on that stream ended, whichever is later (a rank's
  collectives on one group run one after the other).
- **codec_send / codec_recv**: CIERA's encode and decode + merge (the runtime's `codec_timer` hook).

Layers follow the trace format: 0 = embedding, 1..L = blocks, L+1 = head (final norm, LM-head matmul and
loss), −1 = not tied to one layer (the optimizer step, collectives issued outside any layer). The phase of
a forward pass run inside backward (activation checkpointing) is `recompute`. A collective is attributed to
the layer whose parameters it moves when the engine says so (`gather_layer`, set by the capture around
ZeRO-3's and FSDP2's per-parameter gathers), else to the layer the main thread is in.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .clock import CudaBoundaryClock, HostBoundaryClock

_UINT8 = None  # torch.uint8, set by install() (torch is imported only there)

COLLECTIVE_STREAMS = {
    "all_gather_single": "allgather",
    "reduce_scatter_single": "reduce_scatter",
    "all_reduce": "all_reduce",
}


@dataclass
class Event:
    layer: int
    phase: str
    stream: str
    issued_s: float
    start_s: float
    end_s: float = -1.0  # < 0 while an asynchronous collective is in flight
    raw_bytes: int = 0
    wire_bytes: int = 0


@dataclass
class _IterationLog:
    iteration: int
    start_s: float
    events: list[Event] = field(default_factory=list)
    end_s: float = 0.0
    # CPU seconds this process spent beside its main thread over the iteration: the process group's
    # transport threads (and any other worker thread), what the sweep's transport_cpu_s measures per call.
    transport_cpu_s: float = 0.0


class EventRecorder:
    """One per process. `install()` wraps torch.distributed's collectives and `Work.wait` (before any engine
    is created, so the references engines keep are the wrapped ones); `attach(...)` hooks the model's layer
    modules; `iteration(i)` records one iteration; `phase(p)` marks fwd / bwd / optim inside it."""

    _installed: EventRecorder | None = None

    def __init__(self) -> None:
        self._main = threading.get_ident()
        self._log: _IterationLog | None = None
        self._phase = "fwd"
        self._stack: list[int] = [-1]  # layer context of the main thread
        self._engine_calls = 0  # how deep the main thread is in the engine's own gather calls
        self._segment_start_s = 0.0
        self._gather_layer = threading.local()
        self._last_collective = threading.local()
        # CIERA shard id -> layer (ZeRO-3: the parameter's ds_id). A gather's rounds run inside whatever
        # wait finishes them (CIERA finishes gathers in order), so the codec calls, which know their
        # shard, attribute the rounds around them: the round before a decode (bulk) and the one after an
        # encode or a decode (control, status).
        self.shard_layers: dict[int, int] = {}
        # CIERA bucket rows issued and not yet decoded, per the bucket's first shard: a bucket's calls
        # finish in start order, so its decode belongs to the oldest (other rows may have been issued
        # since: DeepSpeed's prefetch; the last collective is not the one being decoded).
        self._awaiting_decode: dict[int, collections.deque] = {}
        self._lock = threading.Lock()
        self.iterations: list[_IterationLog] = []
        # Segment boundaries: the host clock on the CPU; CUDA events on CUDA (measure.clock).
        self.clock: HostBoundaryClock | CudaBoundaryClock = HostBoundaryClock()
        self._in_flight: dict[int, tuple[object, Event]] = {}  # CUDA: id(work) -> (work, its event)

    def use_clock(self, clock: HostBoundaryClock | CudaBoundaryClock) -> None:
        """Read segment boundaries with ``clock`` (``measure.clock.boundary_clock``); a device clock means
        the rank computes on a GPU (see the module docstring: asynchronous collectives end at their wait)."""
        self.clock = clock

    # ------------------------------------------------------------------ installation

    @classmethod
    def install(cls) -> EventRecorder:
        if cls._installed is not None:
            return cls._installed
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        global _UINT8
        _UINT8 = torch.uint8
        recorder = cls()
        for name, stream in COLLECTIVE_STREAMS.items():
            original = getattr(c10d, name)
            wrapped = recorder._wrap_collective(original, stream, name)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        work_class = torch._C._distributed_c10d.Work
        original_wait = work_class.wait

        def wait(work, *args, **kwargs):
            if not recorder._recording_here():
                return original_wait(work, *args, **kwargs)
            start_s = recorder.clock()
            try:
                return original_wait(work, *args, **kwargs)
            finally:
                end_s = recorder.clock()
                pending = recorder._in_flight.pop(id(work), None)
                if pending is not None and pending[1].end_s < 0:
                    pending[1].end_s = end_s  # CUDA: the compute stream has caught up with it here
                recorder._main_thread_elsewhere(start_s, end_s)

        work_class.wait = wait
        cls._installed = recorder
        return recorder

    def _recording_here(self) -> bool:
        return self._log is not None and threading.get_ident() == self._main

    def _wrap_collective(self, original: Callable, stream: str, name: str) -> Callable:
        recorder = self
        signature = inspect.signature(original)
        tensor_argument = {
            "all_gather_single": "output_tensor",
            "reduce_scatter_single": "input",
            "all_reduce": "tensor",
        }[name]

        def collective(*args, **kwargs):
            log = recorder._log
            if log is None:
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            async_op = bool(bound.get("async_op", False))
            tensor = bound.get(tensor_argument)
            size_bytes = 0 if tensor is None else int(tensor.numel() * tensor.element_size())
            # CIERA's rounds move bytes (uint8): their raw size is known only once the codec has decoded
            # (codec_timer assigns the gather's raw size to its bulk round); until then they count 0 raw.
            raw_bytes = 0 if tensor is not None and tensor.dtype == _UINT8 else size_bytes
            issued_s = recorder.clock()
            pending = getattr(recorder._last_collective, "pending_layer", None)
            recorder._last_collective.pending_layer = None
            pending_shard = getattr(recorder._last_collective, "pending_shard", None)
            recorder._last_collective.pending_shard = None
            event = Event(
                recorder.current_layer() if pending is None else pending, recorder._phase_in_layer(), stream,
                issued_s, issued_s, -1.0, raw_bytes, size_bytes,
            )  # fmt: skip
            with recorder._lock:
                log.events.append(event)
            recorder._last_collective.event = event
            if pending_shard is not None:  # a CIERA bucket row, issued right after its encode
                with recorder._lock:
                    recorder._awaiting_decode.setdefault(pending_shard, collections.deque()).append(event)
            if not async_op:
                try:
                    return original(*args, **kwargs)
                finally:
                    event.end_s = recorder.clock()
                    if threading.get_ident() == recorder._main:
                        recorder._main_thread_elsewhere(issued_s, event.end_s)
            work = original(*args, **kwargs)
            if work is None:  # this rank is not in the group
                event.end_s = recorder.clock()
                return work

            if recorder.clock.device:  # NCCL's future completes when queued: the op ends at its wait
                with recorder._lock:
                    recorder._in_flight[id(work)] = (work, event)
                return work

            def done(_future, event=event) -> None:
                event.end_s = time.perf_counter()

            try:
                work.get_future().add_done_callback(done)
            except (RuntimeError, AttributeError):  # no future on this backend: completion unknown
                pass  # finish_events ends it at its wait or, failing that, at the iteration's end
            return work

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        return collective

    def attach(
        self, layer_modules: list[tuple[int, object]], head_module: object, top_module: object
    ) -> None:
        """Hook the layer modules: `layer_modules` (layer, module) for the embedding and the blocks;
        `head_module` (the final norm: from its forward on, the rest of the forward is the head's);
        `top_module` (the model: its forward ends the head)."""
        for layer, module in layer_modules:
            module.register_forward_pre_hook(self._enter_hook(layer), prepend=False)
            module.register_forward_hook(self._leave_hook(), always_call=True)
            module.register_full_backward_pre_hook(self._backward_hook(layer))
        head_layer = max(layer for layer, _ in layer_modules) + 1
        head_module.register_forward_pre_hook(self._head_hook(head_layer))
        head_module.register_full_backward_pre_hook(self._backward_hook(head_layer))
        top_module.register_forward_hook(self._top_done_hook(), always_call=True)

    # ------------------------------------------------------------------ layer and phase context

    def current_layer(self) -> int:
        override = getattr(self._gather_layer, "layer", None)
        return override if override is not None else self._stack[-1]

    def _phase_in_layer(self) -> str:
        if self._phase == "bwd" and len(self._stack) > 1:
            return "recompute"  # a forward pass inside backward
        return self._phase

    @contextlib.contextmanager
    def gather_layer(self, layer: int) -> Iterator[None]:
        """Attribute the collectives and codec work issued inside to `layer` (the engine knows which
        parameters it gathers; the main thread may be in another layer, e.g. when prefetching)."""
        previous = getattr(self._gather_layer, "layer", None)
        self._gather_layer.layer = layer
        try:
            yield
        finally:
            self._gather_layer.layer = previous

    @contextlib.contextmanager
    def engine_gather(self) -> Iterator[None]:
        """The main thread inside the engine's own gather call — its issue (DeepSpeed's
        `all_gather_coalesced`, FSDP2's `unshard`) or its wait — running the engine's host path (or CIERA's,
        when CIERA replaces it) rather than the model: its segments go to the `gather_host` stream, not to
        `compute`, so a system rewrite can replace one engine's path by another's as measured."""
        if threading.get_ident() != self._main:
            yield
            return

        def enter() -> None:
            self._engine_calls += 1

        def leave() -> None:
            self._engine_calls -= 1

        self._switch(enter)
        try:
            yield
        finally:
            self._switch(leave)

    def _switch(self, change: Callable[[], None]) -> None:
        if not self._recording_here():
            change()
            return
        now = self.clock()
        self._close_segment(now)
        change()
        self._segment_start_s = now

    def _enter_hook(self, layer: int):
        def hook(_module, _args):
            self._switch(lambda: self._stack.append(layer))

        return hook

    def _leave_hook(self):
        def hook(_module, _args, _output):
            if len(self._stack) > 1:
                self._switch(self._stack.pop)

        return hook

    def _head_hook(self, head_layer: int):
        def hook(_module, _args):
            def change() -> None:
                self._stack[0] = head_layer

            self._switch(change)

        return hook

    def _top_done_hook(self):
        def hook(_module, _args, _output):
            def change() -> None:
                self._stack[:] = [-1]

            self._switch(change)

        return hook

    def _backward_hook(self, layer: int):
        def hook(_module, _grad_output):
            def change() -> None:
                self._stack[:] = [layer]

            if self._phase == "bwd":
                self._switch(change)

        return hook

    # ------------------------------------------------------------------ main-thread segments

    def _close_segment(self, now_s: float) -> None:
        log = self._log
        if log is None or now_s <= self._segment_start_s:
            return
        if self._phase == "optim":
            stream = "optim"
        else:
            stream = "gather_host" if self._engine_calls > 0 else "compute"
        event = Event(
            self._stack[-1],
            self._phase_in_layer(),
            stream,
            self._segment_start_s,
            self._segment_start_s,
            now_s,
        )
        with self._lock:
            log.events.append(event)

    def _main_thread_elsewhere(self, start_s: float, end_s: float) -> None:
        """The main thread was blocked or running the codec from start_s to end_s: the compute segment
        open then ends at start_s, the next one starts at end_s."""
        self._close_segment(start_s)
        self._segment_start_s = max(self._segment_start_s, end_s)

    def codec_timer(self, stream: str, shard_id: int, start_s: float, end_s: float, raw_bytes: int) -> None:
        """The runtime's `codec_timer` hook (CompressedAllGather.codec_timer). A decode follows its gather's
        bulk round, the last collective this thread issued: that round gets the gather's raw size."""
        log = self._log
        if log is None:
            return
        layer = self.shard_layers.get(shard_id, self.current_layer())
        bulk = getattr(self._last_collective, "event", None)
        if stream == "codec_recv":
            with self._lock:
                awaiting = self._awaiting_decode.get(shard_id)
                if awaiting:
                    bulk = awaiting.popleft()
        if stream == "codec_send":
            self._last_collective.pending_shard = shard_id
        if stream == "codec_recv" and bulk is not None:
            if bulk.raw_bytes == 0:
                bulk.raw_bytes = raw_bytes
            bulk.layer = layer
        self._last_collective.pending_layer = layer  # the control (after encode) or status (after decode)
        if threading.get_ident() == self._main:
            self._main_thread_elsewhere(start_s, end_s)
        event = Event(layer, self._phase_in_layer(), stream, start_s, start_s, end_s)
        with self._lock:
            log.events.append(event)

    # ------------------------------------------------------------------ iterations

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[_IterationLog]:
        log = _IterationLog(index, self.clock.begin())
        process_s, thread_s = time.process_time(), time.thread_time()  # the main thread runs iterations
        self._stack[:] = [-1]
        self._phase = "fwd"
        self._segment_start_s = log.start_s
        self._log = log
        try:
            yield log
        finally:
            end_s = self.clock()
            log.transport_cpu_s = max(
                0.0, (time.process_time() - process_s) - (time.thread_time() - thread_s)
            )
            self._close_segment(end_s)
            self._log = None
            with self._lock:
                self._in_flight.clear()  # never waited for: finish_events ends them at the iteration end
            resolve = self.clock.finish()  # CUDA: every boundary's event time, in host seconds
            for event in log.events:
                event.issued_s, event.start_s = resolve(event.issued_s), resolve(event.start_s)
                event.end_s = resolve(event.end_s) if event.end_s >= 0 else event.end_s
            log.end_s = resolve(end_s)
            self.iterations.append(log)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        def enter() -> None:
            self._phase = name
            self._stack[:] = [-1]

        self._switch(enter)
        try:
            yield
        finally:
            self._switch(lambda: None)

    def set_backward_layer(self, layer: int) -> None:
        """Backward starts with the head (the loss and the LM-head matmul come before any hook fires)."""

        def change() -> None:
            self._stack[:] = [layer]

        self._switch(change)


def finish_events(log: _IterationLog) -> list[Event]:
    """The iteration's events with collective start times resolved: per stream, in order of completion, an
    op starts at max(issued, previous end). Ops whose completion was never seen end at the iteration end."""
    events = list(log.events)
    for event in events:
        if event.end_s < 0:
            event.end_s = log.end_s
    by_stream: dict[str, list[Event]] = {}
    for event in events:
        if event.stream in COLLECTIVE_STREAMS.values():
            by_stream.setdefault(event.stream, []).append(event)
    for stream_events in by_stream.values():
        stream_events.sort(key=lambda event: (event.end_s, event.issued_s))
        previous_end_s = -float("inf")
        for event in stream_events:
            event.start_s = min(max(event.issued_s, previous_end_s), event.end_s)
            previous_end_s = event.end_s
    return events
