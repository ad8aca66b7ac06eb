"""The one intermediate form and its evaluator (sim/opgraph.py, sim/evaluate.py): hand-built iterations
whose dependencies are known, coupling across ranks, the shared resources, exact replay of the shipped
measured bundle, and monotonicity."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from sim.errors import SimInputError
from sim.evaluate import Costs, SharedResource, evaluate, evaluation_key
from sim.opgraph import build_graph, iteration_graphs


def _events(rows: list[tuple], rank: int = 0) -> pd.DataFrame:
    """(stream, issued, start, end[, raw bytes]) rows of one rank and iteration."""
    frame = pd.DataFrame(
        [(*row, 0)[:5] for row in rows], columns=["stream", "issued_s", "start_s", "end_s", "raw_bytes"]
    )
    return frame.assign(
        run_id="r", rank=rank, iteration=0, layer=1, phase="fwd", wire_bytes=frame["raw_bytes"]
    )


def _with(graph, durations: list[float]) -> Costs:
    base = Costs.measured(graph)
    durations = np.asarray(durations, dtype=float)
    is_main = graph.is_main
    return Costs(
        **{
            **base.__dict__,
            "work_s": np.where(is_main, durations, 0.0),
            "own_s": np.where(is_main, 0.0, durations),
            "residual_s": np.zeros(graph.size),
        }
    )


def test_the_main_thread_waits_for_the_gather_it_blocked_on() -> None:
    # compute 0–1 issues a gather (1–3); the main thread is blocked until 3, then computes 3–4.
    graph = build_graph(_events([("compute", 0, 0, 1), ("allgather", 1, 1, 3), ("compute", 3, 3, 4)]))
    assert graph.blocker[2] == 1 and graph.main_prev[1] == 0
    np.testing.assert_allclose(evaluate(graph).end_s, [1, 3, 4])
    # A gather twice as fast: the second compute starts when it ends.
    np.testing.assert_allclose(evaluate(graph, _with(graph, [1, 1, 1])).end_s, [1, 2, 3])


def test_an_overlapped_gather_does_not_hold_the_main_thread() -> None:
    graph = build_graph(_events([("compute", 0, 0, 2), ("allgather", 0.5, 0.5, 1.5), ("compute", 2, 2, 3)]))
    # The compute is cut at the gather's issue point: 0–0.5 issues it, 0.5–2 runs beside it.
    assert list(graph.stream) == ["compute", "allgather", "compute", "compute"]
    assert graph.blocker[3] == -1
    assert evaluate(graph, _with(graph, [0.5, 1, 1.5, 1])).iteration_s == pytest.approx(3.0)


def test_a_gather_issued_inside_compute_is_issued_after_that_share_of_its_work() -> None:
    # A segment 0–2 issues a gather at 1.5 (asynchronous calls do not end a segment). On cores shared by
    # twice the ranks the segment's work takes twice as long, and the issue moves with it: at 3, not at
    # the fixed 1.5 s after the segment's start a lag would give.
    graph = build_graph(
        _events([("compute", 0, 0, 2), ("allgather", 1.5, 1.5, 2.5, 100), ("compute", 2.5, 2.5, 3)])
    )
    assert graph.lag_s[graph.stream == "allgather"] == pytest.approx([0.0])
    base = Costs.measured(graph)
    slowed = evaluate(graph, Costs(**{**base.__dict__, "work_s": base.work_s * 2}))
    gather = np.flatnonzero(graph.stream == "allgather")[0]
    assert slowed.start_s[gather] == pytest.approx(3.0)
    assert evaluate(graph).iteration_s == pytest.approx(3.0)  # the replay is unchanged


def test_idle_time_not_explained_by_a_collective_stays_a_fixed_lag() -> None:
    graph = build_graph(_events([("compute", 0, 0, 1), ("compute", 1.2, 1.2, 2)]))
    assert graph.lag_s[1] == pytest.approx(0.2)
    assert evaluate(graph, _with(graph, [0.5, 0.8])).iteration_s == pytest.approx(1.5)


def test_collectives_on_one_stream_run_in_order() -> None:
    events = _events(
        [("compute", 0, 0, 0.1), ("allgather", 0.1, 0.1, 1), ("allgather", 0.1, 1, 2), ("compute", 2, 2, 2.5)]
    )
    graph = build_graph(events)
    assert graph.stream_prev[2] == 1 and graph.blocker[3] == 2
    np.testing.assert_allclose(evaluate(graph, _with(graph, [0.1, 2, 1, 0.5])).end_s, [0.1, 2.1, 3.1, 3.6])


def test_a_collective_ends_no_earlier_than_its_last_participant_issued_it() -> None:
    # Rank 1 issues the gather at 2 (its compute is long); rank 0 issued it at 1 and measured its end at
    # 2.5. Make rank 1's compute one second longer: rank 0's gather, and its next compute, move with it.
    rank0 = _events([("compute", 0, 0, 1), ("allgather", 1, 1, 2.5, 100), ("compute", 2.5, 2.5, 3)], rank=0)
    rank1 = _events([("compute", 0, 0, 2), ("allgather", 2, 2, 2.5, 100), ("compute", 2.5, 2.5, 3)], rank=1)
    graph = build_graph(pd.concat([rank0, rank1]))
    assert graph.group[1] == graph.group[4] >= 0
    assert graph.tail_s[1] == pytest.approx(0.5)  # from rank 1's issue at 2
    assert evaluate(graph).iteration_s == pytest.approx(3.0)
    base = Costs.measured(graph)
    longer = base.work_s.copy()
    longer[3] += 1.0
    moved = evaluate(graph, Costs(**{**base.__dict__, "work_s": longer}))
    np.testing.assert_allclose(moved.end_s[[1, 2]], [3.5, 4.0])


def test_ranks_that_ran_different_collectives_are_refused() -> None:
    rank0 = _events([("compute", 0, 0, 1), ("allgather", 1, 1, 2, 100)], rank=0)
    rank1 = _events([("compute", 0, 0, 1)], rank=1)
    with pytest.raises(SimInputError, match="different numbers of allgather"):
        build_graph(pd.concat([rank0, rank1]))


def test_a_shared_link_serves_concurrent_flows_at_a_share_each() -> None:
    env = simpy.Environment()
    link = SharedResource(env, 1.0, 1.0)
    ends = {}

    def flow(name: str, start: float, work: float):  # noqa: ANN202
        yield env.timeout(start)
        yield link.use(work)
        ends[name] = env.now

    env.process(flow("a", 0.0, 2.0))
    env.process(flow("b", 1.0, 1.0))
    env.run()
    # a alone for 1 s (1 done), then both at 1/2: b needs 2 s, a's last 1 needs 2 s → both end at 3.
    assert ends == pytest.approx({"a": 3.0, "b": 3.0})


def test_shared_cores_cap_each_flow_at_one_core() -> None:
    env = simpy.Environment()
    cores = SharedResource(env, 2.0, 1.0)  # two cores, a thread uses at most one
    ends = []

    def thread():  # noqa: ANN202
        yield cores.use(1.0)
        ends.append(env.now)

    for _ in range(3):
        env.process(thread())
    env.run()
    assert ends == pytest.approx([1.5, 1.5, 1.5])  # three threads on two cores
    env = simpy.Environment()
    cores = SharedResource(env, 2.0, 1.0)
    done = cores.use(1.0, count=1.0)
    env.run()
    assert done.processed and env.now == pytest.approx(1.0)  # one thread does not go faster than a core


def test_a_collectives_transport_takes_host_cores_from_compute_once_every_rank_has_issued() -> None:
    # Two ranks on one 2-core host. Rank 0 computes 0–1, issues a gather and waits for it (1–3); rank 1
    # issues it at 1 inside a segment that computes on to 3. The transfer runs from 1 (the last issue).
    rank0 = _events([("compute", 0, 0, 1), ("allgather", 1, 1, 3, 100), ("compute", 3, 3, 4)], rank=0)
    rank1 = _events([("compute", 0, 0, 3), ("allgather", 1, 1, 3, 100), ("compute", 3, 3, 4)], rank=1)
    graph = build_graph(pd.concat([rank0, rank1]))
    base = Costs.measured(graph)
    cores = Costs(**{**base.__dict__, "host_cores": 2.0})
    compute_end = np.flatnonzero(graph.is_main & (graph.rank == 1))[1]  # rank 1's work after the issue
    assert evaluate(graph, cores).end_s[compute_end] == pytest.approx(3.0)
    # 1 core-second of transport per rank from 1: three flows (two transports, rank 1's compute) on two
    # cores run at 2/3 until the transports end at 2.5; rank 1's compute, 1.5 s short then, ends at 3.5.
    transport = Costs(**{**cores.__dict__, "comm_cpu_s": np.where(graph.is_main, 0.0, 1.0)})
    loaded = evaluate(graph, transport)
    assert loaded.end_s[compute_end] == pytest.approx(3.5)
    assert loaded.iteration_s == pytest.approx(evaluate(graph, cores).iteration_s + 0.5)
    # Without shared cores, transport CPU is nothing to wait for.
    free = Costs(**{**base.__dict__, "comm_cpu_s": np.where(graph.is_main, 0.0, 5.0)})
    assert evaluate(graph, free).iteration_s == pytest.approx(evaluate(graph).iteration_s)


def test_a_collectives_transport_loads_the_cores_but_does_not_hold_its_end() -> None:
    # The gather's own path (2 s, measured under the anchor's contention) ends it; 3 core-seconds of
    # transport per rank keep the cores busy past that and slow rank 1's compute, not the gather.
    rank0 = _events([("compute", 0, 0, 1), ("allgather", 1, 1, 3, 100), ("compute", 3, 3, 4)], rank=0)
    rank1 = _events([("compute", 0, 0, 3), ("allgather", 1, 1, 3, 100), ("compute", 3, 3, 4)], rank=1)
    graph = build_graph(pd.concat([rank0, rank1]))
    base = Costs.measured(graph)
    heavy = Costs(**{**base.__dict__, "host_cores": 2.0, "comm_cpu_s": np.where(graph.is_main, 0.0, 3.0)})
    result = evaluate(graph, heavy)
    gathers = np.flatnonzero(graph.stream == "allgather")
    assert result.end_s[gathers] == pytest.approx([3.0, 3.0])
    compute_end = np.flatnonzero(graph.is_main & (graph.rank == 1))[1]
    assert result.end_s[compute_end] > 3.0


@pytest.fixture(scope="module")
def measured(shipped_measured_bundle: traces.TraceBundle) -> traces.TraceBundle:
    return shipped_measured_bundle


def test_every_shipped_measured_run_replays_within_a_microsecond(measured: traces.TraceBundle) -> None:
    iterations = measured.iterations.set_index(["run_id", "iteration"])["iteration_s"]
    run_ids = sorted(set(measured.events["run_id"]))
    # One iteration of every third run keeps this quick; `ciera replay` replays every iteration.
    for run_id in run_ids[::3]:
        events = measured.events[(measured.events["run_id"] == run_id) & (measured.events["iteration"] == 0)]
        (graph,) = iteration_graphs(events).values()
        assert evaluate(graph).iteration_s == pytest.approx(iterations[(run_id, 0)], abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=200), st.integers(0, 2**31))
def test_longer_work_never_shortens_the_iteration(extra: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, now = [], 0.0
    for _ in range(20):
        compute = rng.uniform(0.01, 0.1)
        rows.append(("compute", now, now, now + compute))
        issue = now + compute
        gather = rng.uniform(0.01, 0.2)
        rows.append(("allgather", issue, issue, issue + gather, 100))
        now = issue + (gather if rng.random() < 0.5 else 0.0)
    graph = build_graph(pd.concat([_events(rows, 0), _events(rows, 1)]))
    base = evaluate(graph).iteration_s
    costs = Costs.measured(graph)
    grow = np.resize(np.asarray(extra), graph.size)
    longer = Costs(
        **{**costs.__dict__, "work_s": costs.work_s * (1 + grow), "own_s": costs.own_s * (1 + grow)}
    )
    assert evaluate(graph, longer).iteration_s >= base - 1e-9


def test_the_evaluation_key_changes_with_everything_the_evaluator_reads() -> None:
    """`evaluation_key` lets a caller keep one evaluation per key: equal inputs give equal keys, and a change
    of any cost or of an edge gives another key (a stale key would hand back another graph's times)."""
    rows = [("compute", 0, 0, 1), ("allgather", 1, 1, 3), ("compute", 3, 3, 4)]
    graph = build_graph(_events(rows))
    costs = _with(graph, [1, 2, 1])
    key = evaluation_key(graph, costs)
    assert key == evaluation_key(build_graph(_events(rows)), _with(graph, [1, 2, 1]))
    assert key != evaluation_key(graph, _with(graph, [1, 2.000001, 1]))
    for name in ("own_link_work_s", "residual_s", "lag_s", "multiplicity"):
        changed = getattr(costs, name).copy()
        changed[0] += 1
        assert key != evaluation_key(graph, Costs(**{**costs.__dict__, name: changed})), name
    assert key != evaluation_key(graph, Costs(**{**costs.__dict__, "host_cores": 2.0}))
    assert key != evaluation_key(graph, Costs(**{**costs.__dict__, "stream_order": False}))
    unblocked = dataclasses.replace(graph, blocker=np.full(graph.size, -1))
    assert key != evaluation_key(unblocked, costs)
    assert evaluate(unblocked, costs).iteration_s != evaluate(graph, costs).iteration_s
