"""The one evaluator: simpy runs an op graph (sim/opgraph.py) with its streams, its ranks' main threads,
the hosts' cores and the nodes' network links as resources.

- Each rank's **main thread** is a process that runs its ops in program order; an op waits for the
  collective it was blocked on, then its lag, then its work.
- Each **collective** of a rank is a chain of callbacks on simpy events (the waits of a process, without
  its start event and generator resumes): issued after its issuing op (plus lag), started after the
  previous op on its stream. Once every participant has issued it (coupling across ranks) the group runs
  its fixed part and its **link transfer**; each rank ends its part `residual_s` after that, and not
  before `own_s` after its own start (its stream path).
- **Shared resources** (processor sharing, `SharedResource`): a node's inter-node link is shared by the
  collectives in flight on it (a prefetched gather beside a reduce-scatter gets half the bandwidth each),
  and a host's cores are shared by the ranks computing on it (three ranks on two cores run at 2/3 speed
  while all three compute, at full speed while one of them waits) and by the collectives' transport
  (`comm_cpu_s`: gloo's threads moving the bytes, from when every rank has issued; load on the cores,
  not a second clock on the collective's end). Work given in seconds at full speed.

At the measured durations (`Costs.measured(graph)`: no resource use, every collective ending when it
ended) the evaluation reproduces the measured iteration; `sim.rewrite` produces the costs of a rewritten
graph. A rank class with `multiplicity` m stands for m identical ranks (world-size rewrites copy ranks):
it is simulated once and weighs m on the shared cores.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from functools import partial

import numpy as np
import simpy

from .opgraph import OpGraph

RESOURCE_EPSILON = 1e-12


class SharedResource:
    """A capacity shared equally by the flows in it (processor sharing), each flow at most `per_flow_cap`;
    a flow of `count` c stands for c identical flows. `use(work, count)` returns the event that fires when
    `work` (seconds at full per-flow speed) is done."""

    def __init__(self, env: simpy.Environment, capacity: float, per_flow_cap: float) -> None:
        self.env = env
        self.capacity = capacity
        self.per_flow_cap = per_flow_cap
        self._flows: dict[int, list] = {}  # id -> [remaining work, count, event]
        self._next_id = 0
        self._last_s = 0.0
        self._version = 0
        # The share each flow gets, kept from the last change of the flows (it only changes with them):
        # recomputing it at every advance was a large part of an evaluation.
        self._current_rate = 0.0
        self.busy_s = 0.0  # time with at least one flow in it

    def _rate(self, total: float) -> float:
        """Each flow's share of its cap when the flows' counts sum to `total`."""
        return min(self.per_flow_cap, self.capacity / total) / self.per_flow_cap if total else 0.0

    def _advance(self) -> None:
        now = self.env.now
        elapsed = now - self._last_s
        if elapsed > 0 and self._flows:
            rate = self._current_rate
            for flow in self._flows.values():
                flow[0] -= elapsed * rate
            self.busy_s += elapsed
        self._last_s = now

    def use(self, work_s: float, count: float = 1.0) -> simpy.Event:
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        self._flows[self._next_id] = [work_s, count, done]
        self._next_id += 1
        self._reschedule()
        return done

    def _reschedule(self) -> None:
        # One pass over the flows: the finished ones, and of the others (in order) their counts' sum and
        # the least work left.
        flows = self._flows
        finished = []
        total = 0
        smallest = math.inf
        for key, flow in flows.items():
            work = flow[0]
            if work <= RESOURCE_EPSILON:
                finished.append(key)
            else:
                total += flow[1]
                if work < smallest:  # min() per flow was a visible share of an evaluation
                    smallest = work
        for key in finished:
            flows.pop(key)[2].succeed()
        self._version += 1
        self._current_rate = rate = self._rate(total)
        if not flows:
            return
        timer = self.env.timeout(max(smallest / rate, 0.0))
        timer.callbacks.append(partial(self._on_timer, self._version))

    def _on_timer(self, version: int, _event: simpy.Event) -> None:
        if version != self._version:
            return
        self._advance()
        # The flow that was due may be left a rounding error short: finish it now.
        flows = self._flows.values()
        smallest = math.inf
        for flow in flows:
            if flow[0] < smallest:
                smallest = flow[0]
        for flow in flows:
            if flow[0] <= smallest + RESOURCE_EPSILON:
                flow[0] = 0.0
        self._reschedule()


@dataclass(frozen=True)
class Costs:
    """What each op of a graph costs in one evaluation.

    Main ops: `work_s` seconds at a full core (on the host's shared cores when `host_cores` > 0, else a
    plain delay). Collectives, two paths, the later one ends it: its **own path** from its start on its
    stream, `own_s` then `own_link_work_s` (seconds of the whole link) over the shared link; its **group
    path** from the group's last issue, `fixed_s` and `link_work_s` (per group, its first member's
    values), then `residual_s` of its own."""

    work_s: np.ndarray
    own_s: np.ndarray
    own_link_work_s: np.ndarray  # collective: link work of this rank's part, after own_s
    fixed_s: np.ndarray
    link_work_s: np.ndarray
    residual_s: np.ndarray
    lag_s: np.ndarray
    host: np.ndarray  # main ops: host index of the op's rank
    multiplicity: np.ndarray  # per rank: identical ranks this rank stands for
    host_cores: float = 0.0  # 0: cores are not a shared resource (durations as given)
    # Collectives wait for the previous op on their stream (the capture's recorded order). Rewrites let a
    # rank's collectives overlap instead and share the link: gloo's worker threads run them concurrently.
    stream_order: bool = True
    # Collective: core-seconds its transport (the process group's threads, the kernel's network stack)
    # takes from its rank's host while it moves its bytes, beside the ranks' compute (None: nothing).
    comm_cpu_s: np.ndarray | None = None

    @classmethod
    def measured(cls, graph: OpGraph) -> Costs:
        """The measured durations, no shared resource: the replay of a traced configuration."""
        zeros = np.zeros(graph.size)
        is_main = graph.is_main
        return cls(
            work_s=np.where(is_main, graph.duration_s, 0.0),
            own_s=np.where(is_main, 0.0, graph.duration_s),
            own_link_work_s=zeros,
            fixed_s=zeros,
            link_work_s=zeros,
            residual_s=np.where(is_main, 0.0, graph.tail_s),
            lag_s=graph.lag_s,
            host=np.zeros(graph.size, dtype=int),
            multiplicity=np.ones(graph.world_size),
        )


@dataclass(frozen=True)
class Evaluation:
    start_s: np.ndarray
    end_s: np.ndarray
    iteration_s: float  # last end over all ranks on the aligned clock (origin: the earliest barrier exit)
    events: int  # simpy events processed
    link_busy_s: float


def _scheduled_events(env: simpy.Environment) -> int:
    """How many events `env` has scheduled: simpy numbers each one it schedules from 0 (its queue's
    tie-breaker), so the next number is the count — read at no cost per event."""
    return next(env._eid)  # noqa: SLF001


def evaluation_key(graph: OpGraph, costs: Costs) -> bytes:
    """A digest of everything `evaluate(graph, costs)` reads: equal keys, equal evaluations. A sweep
    evaluates some graphs twice at the same costs (a plain engine's BF16 and FP16 runs move the same
    bytes); the caller may keep one evaluation per key."""
    digest = hashlib.blake2b(digest_size=20)
    for array in (graph.rank, graph.main_prev, graph.stream_prev, graph.blocker, graph.offset_s, graph.group):
        digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(np.packbits(graph.is_main).tobytes())
    for field in fields(costs):
        value = getattr(costs, field.name)
        digest.update(field.name.encode())
        if isinstance(value, np.ndarray):
            digest.update(str(value.dtype).encode() + np.ascontiguousarray(value).tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.digest()


def evaluate(graph: OpGraph, costs: Costs | None = None) -> Evaluation:
    """Run `graph` at `costs` (default: the measured durations) in simpy."""
    costs = Costs.measured(graph) if costs is None else costs
    env = simpy.Environment()
    timeout, event = env.timeout, env.event
    count = graph.size
    # Each op's end as an event, made when first needed: by a waiter (a plain event the op succeeds when
    # it ends) or by the op itself, whose last delay then is the event (one event per op instead of a
    # delay and an event: an evaluation's time is mostly simpy's, per event).
    done: list[simpy.Event | None] = [None] * count
    start = [0.0] * count
    end = [0.0] * count
    is_main = graph.is_main
    # Per-op values as Python lists: the processes read them once per op, and indexing numpy arrays
    # element by element costs several times more than a list (the values are the same floats).
    blocker = graph.blocker.tolist()
    main_prev = graph.main_prev.tolist()
    stream_prev = graph.stream_prev.tolist()
    offset_s = graph.offset_s.tolist()
    lag_s = costs.lag_s.tolist()
    work_s = costs.work_s.tolist()
    own_s = costs.own_s.tolist()
    own_link_work_s = costs.own_link_work_s.tolist()
    residual_s = costs.residual_s.tolist()
    fixed_s = costs.fixed_s.tolist()
    link_work_s = costs.link_work_s.tolist()
    # Transport CPU needs the shared cores; without them it is nothing to wait for (and no events).
    transport_on = costs.comm_cpu_s is not None and costs.host_cores > 0
    comm_cpu_s = costs.comm_cpu_s.tolist() if transport_on else [0.0] * count
    group_of = graph.group.tolist()
    stream_order = costs.stream_order
    cores = (
        {h: SharedResource(env, costs.host_cores, 1.0) for h in set(costs.host[is_main].tolist())}
        if costs.host_cores > 0
        else {}
    )
    # Per main op: the shared cores it runs on (None: a plain delay) and the ranks its rank stands for.
    host = costs.host.tolist()
    weight = costs.multiplicity[graph.rank].tolist()
    link = SharedResource(env, 1.0, 1.0)
    # Per group: members, how many have started, the event when the last has, and when its transfer
    # ended (None: not yet; `transferred` holds the event its early members wait on, made when needed).
    members: dict[int, list[int]] = {}
    for index in np.flatnonzero(graph.group >= 0).tolist():
        members.setdefault(group_of[index], []).append(index)
    issued = dict.fromkeys(members, 0)
    all_issued = {g: event() for g in members} if transport_on else {}
    transferred: dict[int, simpy.Event] = {}
    transfer_end: dict[int, float | None] = dict.fromkeys(members)

    def ended(index: int) -> simpy.Event | None:
        """The event to wait on for op `index` to end; None when it has (no wait)."""
        waited = done[index]
        if waited is None:
            waited = done[index] = event()
            return waited
        return None if waited.processed else waited

    def end_after(index: int, delay_s: float) -> simpy.Event | None:
        """End op `index` `delay_s` from now: the event to yield (None: it has ended now)."""
        waited = done[index]
        if delay_s <= 0:
            if waited is None:
                waited = done[index] = event()
            waited.succeed()
            return None
        if waited is None:
            done[index] = waited = timeout(delay_s)
        else:
            timeout(delay_s).callbacks.append(lambda _timer: waited.succeed())
        return waited

    def transfer_done(group: int) -> None:
        transfer_end[group] = env.now
        waiting = transferred.pop(group, None)
        if waiting is not None:
            waiting.succeed()

    def group_transfer(group: int):  # noqa: ANN202 — a simpy process
        first = members[group][0]
        if fixed_s[first] > 0:
            yield timeout(fixed_s[first])
        if link_work_s[first] > 0:
            yield link.use(link_work_s[first])
        transfer_done(group)

    def main_thread(indices: list[int]):  # noqa: ANN202
        for index in indices:
            waits_for = blocker[index]
            if waits_for >= 0:
                waited = ended(waits_for)
                if waited is not None:
                    yield waited
            if main_prev[index] < 0 and waits_for < 0:
                # The rank's first op: its barrier exit on the aligned clock (its lag is that offset).
                if offset_s[index] > env.now:
                    yield timeout(offset_s[index] - env.now)
            elif lag_s[index] > 0:
                yield timeout(lag_s[index])
            start[index] = env.now
            work = work_s[index]
            resource = cores.get(host[index]) if work > 0 else None
            if resource is None:
                finishing = end_after(index, max(work, 0.0))
                if finishing is not None:
                    yield finishing
            else:
                used = resource.use(work, weight[index])
                if done[index] is None:
                    done[index] = used
                    yield used
                else:
                    yield used
                    done[index].succeed()
            end[index] = env.now

    def transport_cpu(index: int, group: int):  # noqa: ANN202
        yield all_issued[group]
        yield cores[host[index]].use(comm_cpu_s[index], weight[index])

    # A collective is a chain of callbacks rather than a process: the same waits in the same order,
    # without a process's start event and generator resumes (most of an evaluation's ops are collectives).
    def after(waited: simpy.Event | None, step, *args) -> None:
        if waited is None:
            step(*args)
        else:
            waited.callbacks.append(lambda _event: step(*args))

    def collective_issue(index: int) -> None:  # its issuing op has ended
        if lag_s[index] > 0:
            after(timeout(lag_s[index]), collective_issued, index)
        else:
            collective_issued(index)

    def collective_issued(index: int) -> None:
        group = group_of[index]
        issued[group] += 1
        if issued[group] == len(members[group]):
            if transport_on:
                all_issued[group].succeed()
            first = members[group][0]
            if fixed_s[first] > 0 or link_work_s[first] > 0:
                env.process(group_transfer(group))
            else:  # nothing to run after the last issue: it ends now (no process, no events)
                transfer_done(group)
        previous = stream_prev[index]
        waited = ended(previous) if previous >= 0 and stream_order else None
        after(waited, collective_started, index)

    def collective_started(index: int) -> None:
        start[index] = env.now
        # The transport's CPU runs on the rank's host once every rank has issued (the bytes move): load
        # on the cores beside the ranks' compute. It does not hold the collective's end: the own path
        # already holds the transport time the anchor measured under its own contention, and a second
        # clock for it, at the sweep's mean CPU per call, kept ZeRO-3's many small collectives longer
        # than measured (the anchor re-costed onto itself: +10 % on OLMoE-1B-7B).
        if transport_on and comm_cpu_s[index] > 0:
            env.process(transport_cpu(index, group_of[index]))
        if own_s[index] > 0:
            after(timeout(own_s[index]), collective_on_link, index)
        else:
            collective_on_link(index)

    def collective_on_link(index: int) -> None:
        if own_link_work_s[index] > 0:
            after(link.use(own_link_work_s[index]), collective_own_done, index)
        else:
            collective_own_done(index)

    def collective_own_done(index: int) -> None:
        own_end = env.now
        group = group_of[index]
        waiting = None
        if transfer_end[group] is None:
            waiting = transferred.get(group)
            if waiting is None:
                waiting = transferred[group] = event()
        after(waiting, collective_end, index, own_end)

    def collective_end(index: int, own_end: float) -> None:
        delay_s = max(max(own_end, transfer_end[group_of[index]] + residual_s[index]) - env.now, 0.0)
        end_after(index, delay_s)
        end[index] = env.now + delay_s  # when that event fires (simpy schedules at now + delay)

    for rank in sorted(set(graph.rank.tolist())):
        indices = np.flatnonzero((graph.rank == rank) & is_main).tolist()
        env.process(main_thread(indices))
    for index in np.flatnonzero(~is_main).tolist():
        issuer = main_prev[index]
        after(ended(issuer) if issuer >= 0 else None, collective_issue, index)
    env.run()
    unfinished = [i for i in range(count) if done[i] is None or not done[i].processed]
    if unfinished:
        raise RuntimeError(f"op graph deadlocked at {len(unfinished)} ops (a graph bug, not an input error)")
    end_s = np.array(end, dtype=float)
    return Evaluation(
        start_s=np.array(start, dtype=float),
        end_s=end_s,
        iteration_s=float(end_s.max(initial=0.0)),
        events=_scheduled_events(env),
        link_busy_s=link.busy_s,
    )


# What an op's time is when it lies on the critical path (`critical_path`).
BREAKDOWN_KEYS = ("compute", "exposed_allgather", "exposed_reduce_scatter", "codec_critical", "other")
# Each part in words, as the console, the report's captions and its figures name it.
BREAKDOWN_LABELS = {
    "compute": "compute",
    "exposed_allgather": "exposed all-gather",
    "exposed_reduce_scatter": "exposed reduce-scatter",
    "codec_critical": "codec",
    "other": "other",
}
_GATHER_STREAMS = ("allgather", "allgather_intra")
_CODEC_STREAMS = ("codec_send", "codec_recv", "ccp_send", "ccp_recv")


def middle_index(iteration_s: list[float] | np.ndarray) -> int:
    """Which of several iterations is the middle one: the median of an odd count, the upper of the two
    middle ones of an even count. The iteration whose critical path stands for a run (measured or
    predicted) in `ciera validate sim`."""
    return int(np.argsort(np.asarray(iteration_s, dtype=float), kind="stable")[len(iteration_s) // 2])


def critical_path(
    graph: OpGraph, result: Evaluation, embedded_codec_s: np.ndarray | None = None
) -> dict[str, float]:
    """The evaluated iteration's critical path by category — the one attribution of the simulator. From
    the op that ended last, back through what each op waited for last (a main op: its blocker or its
    predecessor on the main thread; a collective: its issuer or the op before it on its stream), every
    interval of [0, iteration] is attributed once: a main op's run to compute (or codec_critical for codec
    kernels), a collective's time from its start to its end to exposed_allgather or exposed_reduce_scatter
    (its `embedded_codec_s` share to codec_critical), waits in between (lags, barrier offsets) to other.
    The parts sum to `result.iteration_s`."""
    parts = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    if graph.size == 0:
        return parts
    embedded = np.zeros(graph.size) if embedded_codec_s is None else embedded_codec_s
    is_main = graph.is_main
    current = int(np.argmax(result.end_s))
    until = float(result.end_s[current])
    while True:
        start = min(float(result.start_s[current]), until)
        span = until - start
        stream = str(graph.stream[current])
        if is_main[current]:
            parts["codec_critical" if stream in _CODEC_STREAMS else "compute"] += span
            candidates = [int(graph.blocker[current]), int(graph.main_prev[current])]
        elif stream in _CODEC_STREAMS:  # a side-stream kernel
            parts["codec_critical"] += span
            candidates = [int(graph.main_prev[current]), int(graph.stream_prev[current])]
        else:
            codec = min(float(embedded[current]), span)
            parts["codec_critical"] += codec
            key = "exposed_allgather" if stream in _GATHER_STREAMS else "exposed_reduce_scatter"
            parts[key] += span - codec
            candidates = [int(graph.main_prev[current]), int(graph.stream_prev[current])]
        candidates = [c for c in candidates if c >= 0]
        if not candidates:
            parts["other"] += start
            return parts
        previous = max(candidates, key=lambda c: result.end_s[c])
        until = min(float(result.end_s[previous]), start)
        parts["other"] += start - until
        current = previous
