"""Discrete-event replay of one training iteration on one representative rank (ranks are symmetric).

An iteration is an operation graph: every operation runs on one per-rank stream (compute, allgather,
reduce_scatter, codec_send, codec_recv), in that stream's program order like a CUDA stream, after the
operations it depends on have finished (or, for prefetch triggers, started). Collectives also hold the
rank's network link, granted in the order they are issued, so an AllGather and a ReduceScatter never move
bytes at the same time at full speed each.

`replay` runs the graph in simpy for the nominal durations and records (stream, name, start, end) per
operation. Because every stream and the link serve in a fixed order, the schedule is a max-plus system:
each start is the max of its predecessors' ends. `sample_iteration_s` evaluates that recurrence for many
Monte Carlo duration draws at once with numpy (identical to the simpy replay at nominal durations), and
the result is monotone: no duration getting shorter can make the iteration longer.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import simpy

from .evaluate import CountingEnvironment as _CountingEnvironment

# The per-rank streams, in the order timelines list them.
STREAMS = ("compute", "allgather", "reduce_scatter", "codec_send", "codec_recv")
# What an operation's time is when it holds up the compute stream (see `attribute`).
CATEGORY_TO_BREAKDOWN = {
    "compute": "compute",
    "allgather": "exposed_allgather",
    "reduce_scatter": "exposed_reduce_scatter",
    "codec": "codec_critical",
}
BREAKDOWN_KEYS = ("compute", "exposed_allgather", "exposed_reduce_scatter", "codec_critical", "other")


@dataclass
class Op:
    name: str
    stream: str
    duration_s: float
    category: str  # compute | allgather | reduce_scatter | codec
    deps_done: tuple[int, ...] = ()
    deps_start: tuple[int, ...] = ()
    uses_link: bool = False
    issue_key: tuple[float, ...] = ()
    bytes: float = 0.0
    # Monte Carlo: coefficient of variation and the index of the shared standard-normal draw it uses.
    cv: float = 0.0
    noise_index: int = -1


@dataclass
class OpGraph:
    ops: list[Op] = field(default_factory=list)

    def add(self, op: Op) -> int:
        self.ops.append(op)
        self._predecessors = None
        return len(self.ops) - 1

    _predecessors: tuple[list[int], list[int]] | None = None

    def predecessors(self) -> tuple[list[int], list[int]]:
        """(previous op on the same stream, previous op on the link) per op, -1 when none."""
        if self._predecessors is None:
            self._predecessors = self._compute_predecessors()
        return self._predecessors

    def _compute_predecessors(self) -> tuple[list[int], list[int]]:
        stream_prev = [-1] * len(self.ops)
        last_on_stream: dict[str, int] = {}
        for index, op in enumerate(self.ops):
            stream_prev[index] = last_on_stream.get(op.stream, -1)
            last_on_stream[op.stream] = index
        link_prev = [-1] * len(self.ops)
        link_ops = sorted((op.issue_key, index) for index, op in enumerate(self.ops) if op.uses_link)
        for position in range(1, len(link_ops)):
            link_prev[link_ops[position][1]] = link_ops[position - 1][1]
        return stream_prev, link_prev

    def topological_order(self) -> list[int]:
        stream_prev, link_prev = self.predecessors()
        waiting_on = [0] * len(self.ops)
        children: list[list[int]] = [[] for _ in self.ops]
        for index, op in enumerate(self.ops):
            parents = {*op.deps_done, *op.deps_start, stream_prev[index], link_prev[index]} - {-1}
            waiting_on[index] = len(parents)
            for parent in parents:
                children[parent].append(index)
        ready = [i for i, count in enumerate(waiting_on) if count == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            index = heapq.heappop(ready)
            order.append(index)
            for child in children[index]:
                waiting_on[child] -= 1
                if waiting_on[child] == 0:
                    heapq.heappush(ready, child)
        if len(order) != len(self.ops):
            raise RuntimeError("operation graph has a cycle (a schedule bug, not an input error)")
        return order


@dataclass(frozen=True)
class Replay:
    start_s: np.ndarray
    end_s: np.ndarray
    iteration_s: float
    events: int  # simpy events processed


class _LazyList:
    def __init__(self, mapping: dict[int, simpy.Process]) -> None:
        self._mapping = mapping

    def __getitem__(self, index: int) -> simpy.Process:
        return self._mapping[index]


def replay(graph: OpGraph) -> Replay:
    """Run the graph once in simpy at nominal durations."""
    env = _CountingEnvironment()
    streams = {name: simpy.Resource(env, capacity=1) for name in {op.stream for op in graph.ops}}
    link = simpy.Resource(env, capacity=1)
    stream_prev, link_prev = graph.predecessors()
    # Only prefetch triggers wait for an operation to start; other waits use the process itself, which
    # is an event that fires when the operation has finished.
    watched = {dep for op in graph.ops for dep in op.deps_start}
    started = {index: env.event() for index in watched}
    finished: list[simpy.Process] = []
    start_s = np.zeros(len(graph.ops))
    end_s = np.zeros(len(graph.ops))

    def run(index: int, op: Op):  # type: ignore[no-untyped-def]
        waits = [finished[d] for d in op.deps_done] + [started[d] for d in op.deps_start]
        for previous in (stream_prev[index], link_prev[index]):
            if previous >= 0:
                waits.append(finished[previous])
        pending = [event for event in waits if not event.processed]
        if pending:
            yield env.all_of(pending)
        with streams[op.stream].request() as stream_slot:
            yield stream_slot
            link_slot = link.request() if op.uses_link else None
            if link_slot is not None:
                yield link_slot
            start_s[index] = env.now
            if index in started:
                started[index].succeed()
            yield env.timeout(op.duration_s)
            end_s[index] = env.now
            if link_slot is not None:
                link.release(link_slot)

    # Processes are created in topological order so every wait refers to an existing process.
    order = graph.topological_order()
    by_index: dict[int, simpy.Process] = {}
    finished = _LazyList(by_index)  # type: ignore[assignment]
    for index in order:
        by_index[index] = env.process(run(index, graph.ops[index]))
    env.run()
    if not all(process.processed for process in by_index.values()):
        raise RuntimeError("simulation stalled: an operation never ran (a schedule bug, not an input error)")
    return Replay(
        start_s=start_s, end_s=end_s, iteration_s=float(end_s.max(initial=0.0)), events=env.scheduled_events
    )


def sample_durations(graph: OpGraph, normal_draws: np.ndarray) -> np.ndarray:
    """Durations [ops, samples]: nominal × log-normal factor of mean 1 and the op's coefficient of variation,
    driven by shared standard-normal draws (common random numbers across systems)."""
    nominal = np.array([op.duration_s for op in graph.ops])
    cv = np.array([op.cv for op in graph.ops])
    index = np.array([op.noise_index for op in graph.ops])
    sigma = np.sqrt(np.log1p(cv * cv))[:, None]
    draws = np.where((index >= 0)[:, None], normal_draws[np.maximum(index, 0)], 0.0)
    return nominal[:, None] * np.exp(sigma * draws - 0.5 * sigma * sigma)


def sample_iteration_s(graph: OpGraph, durations: np.ndarray) -> np.ndarray:
    """Iteration time per sample (the max-plus recurrence of the fixed-order schedule)."""
    stream_prev, link_prev = graph.predecessors()
    samples = durations.shape[1]
    start = np.zeros((len(graph.ops), samples))
    end = np.zeros((len(graph.ops), samples))
    zero = np.zeros(samples)
    for index in graph.topological_order():
        op = graph.ops[index]
        ready = zero
        for dep in op.deps_done:
            ready = np.maximum(ready, end[dep])
        for dep in op.deps_start:
            ready = np.maximum(ready, start[dep])
        for previous in (stream_prev[index], link_prev[index]):
            if previous >= 0:
                ready = np.maximum(ready, end[previous])
        start[index] = ready
        end[index] = ready + durations[index]
    return end.max(axis=0) if len(graph.ops) else zero


def attribute(graph: OpGraph, result: Replay) -> dict[str, float]:
    """Split the nominal iteration time into compute and what the compute stream waited for.

    This is the compute stream's view, not critical-path attribution: codec work charged here may have
    run while the link was the bottleneck, so removing it need not shorten the iteration. Records use
    `critical_path` for `breakdown_s`.

    Time on the compute stream counts as compute (or codec_critical for codec kernels placed there). Each
    idle gap before a compute-stream operation is walked back along the chain of operations that held it
    up; each piece of the gap goes to the category of the operation running then (exposed_allgather,
    exposed_reduce_scatter, codec_critical) and whatever no operation covers to `other`. The parts sum to
    the iteration time."""
    stream_prev, link_prev = graph.predecessors()
    parts = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    start, end = result.start_s, result.end_s
    tolerance = 1e-12
    previous_end = 0.0
    for index, op in enumerate(graph.ops):
        if op.stream != "compute":
            continue
        parts[CATEGORY_TO_BREAKDOWN.get(op.category, "other")] += op.duration_s
        window_start = previous_end
        cursor_time = start[index]
        current = index
        while cursor_time > window_start + tolerance:
            candidates = [(end[d], d) for d in graph.ops[current].deps_done]
            candidates += [(start[d], d) for d in graph.ops[current].deps_start]
            candidates += [(end[p], p) for p in (stream_prev[current], link_prev[current]) if p >= 0]
            if not candidates:
                parts["other"] += cursor_time - window_start
                break
            ready_time, blocker = max(candidates)
            if ready_time < cursor_time - tolerance:  # nothing ran in between: unexplained wait
                parts["other"] += cursor_time - max(ready_time, window_start)
                cursor_time = max(ready_time, window_start)
                if cursor_time <= window_start + tolerance:
                    break
            blocking_op = graph.ops[blocker]
            if blocking_op.stream == "compute":
                parts["other"] += cursor_time - window_start
                break
            if abs(end[blocker] - ready_time) <= tolerance:  # waited for it to finish: it was running
                running_from = max(start[blocker], window_start)
                parts[CATEGORY_TO_BREAKDOWN.get(blocking_op.category, "other")] += cursor_time - running_from
                cursor_time = running_from
            current = blocker
        previous_end = end[index]
    parts["other"] += max(0.0, result.iteration_s - previous_end)
    return parts


@dataclass(frozen=True)
class CriticalPath:
    """The chain of operations that set the iteration time, and its time per breakdown key."""

    parts_s: dict[str, float]  # BREAKDOWN_KEYS → seconds; sums to the iteration time
    ops: tuple[int, ...]  # the operations whose durations lie on the path, last first


def critical_path(graph: OpGraph, result: Replay) -> CriticalPath:
    """Walk back from the operation that ends last, each time to the predecessor that determined the start.

    A predecessor through a finish dependency (deps_done, the previous op on the stream or on the link)
    puts its whole duration on the path; a prefetch trigger (deps_start) is crossed at its start and
    adds no time. The durations on the path tile [0, iteration], so the parts sum to the iteration time;
    time that no predecessor explains (none in a max-plus replay, up to rounding) goes to `other`.
    Each part is therefore the most that shortening that category could save: the iteration is the
    path's length, and removing a category's durations shortens this path by exactly its part (another
    path may then set the time, so the saving can be smaller, never larger). Ties between predecessors
    that became ready at the same time go to finish dependencies in the order deps_done, stream, link."""
    stream_prev, link_prev = graph.predecessors()
    parts = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    if not graph.ops:
        return CriticalPath(parts, ())
    start, end = result.start_s, result.end_s
    tolerance = 1e-12 * max(result.iteration_s, 1.0)
    # The last op to end; on equal ends the later-added one (the optimizer step comes last).
    current = max(range(len(graph.ops)), key=lambda i: (end[i], i))
    path = [current]
    parts[CATEGORY_TO_BREAKDOWN.get(graph.ops[current].category, "other")] += end[current] - start[current]
    parts["other"] += result.iteration_s - end[current]
    cursor_s = float(start[current])
    while cursor_s > tolerance:
        op = graph.ops[current]
        candidates = [(end[d], 3, d, True) for d in op.deps_done]
        candidates += [
            (end[p], rank, p, True) for rank, p in ((2, stream_prev[current]), (1, link_prev[current]))
        ]
        candidates += [(start[d], 0, d, False) for d in op.deps_start]
        candidates = [c for c in candidates if c[2] >= 0]
        if not candidates:
            parts["other"] += cursor_s
            break
        latest = max(c[0] for c in candidates)
        tied = [c for c in candidates if c[0] >= latest - tolerance]
        _, _, blocker, finished = max(tied, key=lambda c: (c[1], c[2]))
        if latest < cursor_s - tolerance:  # nothing held the op up between `latest` and its start
            parts["other"] += cursor_s - latest
        if finished:
            blocking = graph.ops[blocker]
            parts[CATEGORY_TO_BREAKDOWN.get(blocking.category, "other")] += end[blocker] - start[blocker]
            path.append(blocker)
        cursor_s = float(start[blocker])
        current = blocker
    return CriticalPath({key: float(value) for key, value in parts.items()}, tuple(path))


def nominal_iteration_s(graph: OpGraph, durations_s: list[float]) -> float:
    """The max-plus recurrence for one set of durations, in plain floats (a what-if at nominal durations,
    e.g. with every codec kernel removed); identical to `sample_iteration_s` for one sample."""
    stream_prev, link_prev = graph.predecessors()
    start = [0.0] * len(graph.ops)
    end = [0.0] * len(graph.ops)
    for index in graph.topological_order():
        op = graph.ops[index]
        ready = 0.0
        for dep in op.deps_done:
            ready = max(ready, end[dep])
        for dep in op.deps_start:
            ready = max(ready, start[dep])
        for previous in (stream_prev[index], link_prev[index]):
            if previous >= 0:
                ready = max(ready, end[previous])
        start[index] = ready
        end[index] = ready + durations_s[index]
    return max(end, default=0.0)


def busy_s(graph: OpGraph, category: str, link_only: bool = False) -> float:
    return float(
        sum(op.duration_s for op in graph.ops if op.category == category and (op.uses_link or not link_only))
    )


def timeline_events(graph: OpGraph, result: Replay) -> list[dict[str, object]]:
    return [
        {
            "stream": op.stream,
            "name": op.name,
            "start_s": float(result.start_s[i]),
            "end_s": float(result.end_s[i]),
        }
        for i, op in enumerate(graph.ops)
    ]
