"""The recorder's main-thread segments: inside the engine's gather call (`engine_gather`) they go to the
`gather_host` stream, outside to `compute` (or `optim` in the optimizer step); every boundary is kept."""

from __future__ import annotations

import threading

from measure.clock import HostBoundaryClock
from measure.events import EventRecorder


class _TickClock(HostBoundaryClock):
    """A boundary per call, one second apart: every segment's length is known."""

    def __init__(self) -> None:
        self.now = 0.0

    def begin(self) -> float:
        return self.now

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _segments(recorder: EventRecorder, body) -> list[tuple[str, float]]:
    recorder.use_clock(_TickClock())
    with recorder.iteration(0) as log:
        body()
    # The segments tile the iteration: each starts where the one before ended.
    ends = [log.start_s] + [event.end_s for event in log.events]
    assert [event.start_s for event in log.events] == ends[:-1] and ends[-1] == log.end_s
    return [(event.stream, event.end_s - event.start_s) for event in log.events]


def test_the_engines_gather_call_is_its_own_stream_nested_or_not() -> None:
    recorder = EventRecorder()  # not installed: only the main thread's segments are recorded

    def body() -> None:
        with recorder.phase("fwd"):
            with recorder.engine_gather():  # an issue
                with recorder.engine_gather():  # CIERA finishing an older call inside it
                    pass
            with recorder.engine_gather():  # a wait
                pass
        with recorder.phase("optim"), recorder.engine_gather():
            pass  # the optimizer step stays optim

    streams = [stream for stream, _ in _segments(recorder, body)]
    assert streams == [
        "compute", "compute",  # the iteration's start, the phase's
        "gather_host", "gather_host", "gather_host",  # the issue, cut where the nested call enters and leaves
        "compute",  # between the calls
        "gather_host",  # the wait
        "compute", "compute",  # to the phase's end, and to the optimizer step's start
        "optim", "optim", "optim", "optim",  # the optimizer step, a gather call in it included
    ]  # fmt: skip
    assert recorder._engine_calls == 0  # balanced


def test_a_gather_call_on_another_thread_changes_nothing_on_the_main_thread() -> None:
    recorder = EventRecorder()

    def body() -> None:
        with recorder.phase("fwd"):
            worker = threading.Thread(target=lambda: recorder.engine_gather().__enter__())
            worker.start()
            worker.join()

    assert {stream for stream, _ in _segments(recorder, body)} == {"compute"}
    assert recorder._engine_calls == 0
