"""The discrete-event core: simpy replay vs the max-plus recurrence, monotonicity, attribution."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import Op, OpGraph, attribute, replay, sample_iteration_s


def two_layer_graph(gather_s: float, compute_s: float, scatter_s: float) -> OpGraph:
    """Gather L0 → compute L0 (while gathering L1) → compute L1 → reduce-scatter L1 → optimizer."""
    graph = OpGraph()
    g0 = graph.add(Op("ag0", "allgather", gather_s, "allgather", uses_link=True, issue_key=(-1, 0, 0)))
    g1 = graph.add(Op("ag1", "allgather", gather_s, "allgather", uses_link=True, issue_key=(0, 0, 1)))
    c0 = graph.add(Op("c0", "compute", compute_s, "compute", deps_done=(g0,)))
    graph.ops[g1].deps_start = (c0,)
    c1 = graph.add(Op("c1", "compute", compute_s, "compute", deps_done=(g1,)))
    rs = graph.add(
        Op(
            "rs1",
            "reduce_scatter",
            scatter_s,
            "reduce_scatter",
            deps_done=(c1,),
            uses_link=True,
            issue_key=(1, 1, 1),
        )
    )
    graph.add(Op("optim", "compute", 0.1, "compute", deps_done=(rs,)))
    return graph


def test_hand_computed_schedule() -> None:
    # ag0 [0,1], c0 [1,3], ag1 [1,2] (prefetched under c0), c1 [3,5], rs [5,5.5], optim [5.5,5.6].
    graph = two_layer_graph(gather_s=1.0, compute_s=2.0, scatter_s=0.5)
    result = replay(graph)
    assert result.iteration_s == pytest.approx(5.6)
    assert result.start_s.tolist() == pytest.approx([0.0, 1.0, 1.0, 3.0, 5.0, 5.5])
    parts = attribute(graph, result)
    assert parts["compute"] == pytest.approx(4.1)
    assert parts["exposed_allgather"] == pytest.approx(1.0)
    assert parts["exposed_reduce_scatter"] == pytest.approx(0.5)
    assert sum(parts.values()) == pytest.approx(result.iteration_s)


def test_communication_bound_schedule_exposes_the_gather() -> None:
    # ag1 [3,6] overlaps c0 [3,4]; c1 waits for it: 2 s of the second gather is exposed.
    graph = two_layer_graph(gather_s=3.0, compute_s=1.0, scatter_s=0.5)
    result = replay(graph)
    assert result.iteration_s == pytest.approx(3 + 3 + 1 + 0.5 + 0.1)
    parts = attribute(graph, result)
    assert parts["exposed_allgather"] == pytest.approx(5.0)
    assert sum(parts.values()) == pytest.approx(result.iteration_s)


durations = st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=3, max_size=3)


@settings(max_examples=60, deadline=None)
@given(durations, st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=3, max_size=3))
def test_recurrence_matches_simpy_and_is_monotone(values: list[float], shrink: list[float]) -> None:
    graph = two_layer_graph(*values)
    nominal = np.array([[op.duration_s] for op in graph.ops])
    assert sample_iteration_s(graph, nominal)[0] == pytest.approx(replay(graph).iteration_s)
    faster = two_layer_graph(*(v * s for v, s in zip(values, shrink, strict=True)))
    assert replay(faster).iteration_s <= replay(graph).iteration_s + 1e-12
