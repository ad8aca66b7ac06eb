"""The one critical-path attribution (sim.evaluate.critical_path) on hand-computed schedules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.analytic import _Step, schedule_graph
from sim.evaluate import BREAKDOWN_KEYS, critical_path, evaluate


def two_layer(gather_s: float, compute_s: float, scatter_s: float):  # noqa: ANN201
    """Gather L0 → compute L0 (gathering L1 under it) → compute L1 (backward) → reduce-scatter → optimizer."""
    steps = [
        _Step(0, "fwd", compute_s, 1.0, gather_s, 0.0, 0.0, 0.0, 0.0),
        _Step(1, "bwd", compute_s, 1.0, gather_s, 0.0, 1.0, scatter_s, 0.0),
        _Step(1, "optim", 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ]
    return schedule_graph(steps, prefetch=1)


def test_hand_computed_compute_bound_schedule() -> None:
    # ag0 [0,1], c0 [1,3] with ag1 [0,1] prefetched ahead (issued at the start), c1 [3,5], rs [5,5.5],
    # optimizer [5.5,5.6].
    graph, costs = two_layer(gather_s=1.0, compute_s=2.0, scatter_s=0.5)
    result = evaluate(graph, costs)
    assert result.iteration_s == pytest.approx(5.6)
    parts = critical_path(graph, result)
    assert parts["compute"] == pytest.approx(4.1)
    assert parts["exposed_allgather"] == pytest.approx(1.0)
    assert parts["exposed_reduce_scatter"] == pytest.approx(0.5)
    assert parts["codec_critical"] == 0 and parts["other"] == pytest.approx(0.0)
    assert sum(parts.values()) == pytest.approx(result.iteration_s)


def test_communication_bound_schedule_exposes_the_gathers() -> None:
    # Both gathers start at 0 on one stream: ag0 [0,3], ag1 [3,6]; c0 [3,4], c1 [6,7], rs [7,7.5], opt.
    graph, costs = two_layer(gather_s=3.0, compute_s=1.0, scatter_s=0.5)
    result = evaluate(graph, costs)
    assert result.iteration_s == pytest.approx(7.6)
    parts = critical_path(graph, result)
    assert parts["exposed_allgather"] == pytest.approx(6.0)
    assert parts["compute"] == pytest.approx(1.1)
    assert sum(parts.values()) == pytest.approx(result.iteration_s)


def test_codec_seconds_inside_a_collective_are_codec_on_the_path() -> None:
    graph, costs = two_layer(gather_s=3.0, compute_s=1.0, scatter_s=0.5)
    result = evaluate(graph, costs)
    embedded = np.where(graph.stream == "allgather", 0.4, 0.0)
    parts = critical_path(graph, result, embedded)
    assert parts["codec_critical"] == pytest.approx(0.8)
    assert parts["exposed_allgather"] == pytest.approx(5.2)
    assert sum(parts.values()) == pytest.approx(result.iteration_s)


durations = st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=3, max_size=3)


@settings(max_examples=60, deadline=None)
@given(durations, st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=3, max_size=3))
def test_parts_sum_to_the_iteration_and_no_part_is_below_what_removing_it_saves(
    values: list[float], shrink: list[float]
) -> None:
    graph, costs = two_layer(*values)
    result = evaluate(graph, costs)
    parts = critical_path(graph, result)
    assert set(parts) == set(BREAKDOWN_KEYS)
    assert sum(parts.values()) == pytest.approx(result.iteration_s, abs=1e-9)
    assert min(parts.values()) >= -1e-12
    # Shorter ops never make the iteration longer (the evaluator is monotone here).
    faster_graph, faster_costs = two_layer(*(v * s for v, s in zip(values, shrink, strict=True)))
    assert evaluate(faster_graph, faster_costs).iteration_s <= result.iteration_s + 1e-9
    # Removing every compute op saves at most the compute on the path.
    no_compute = dataclasses.replace(costs, work_s=np.where(graph.stream == "compute", 0.0, costs.work_s))
    saving = result.iteration_s - evaluate(graph, no_compute).iteration_s
    assert saving <= parts["compute"] + 1e-9


def test_the_middle_iteration_is_the_median_or_the_upper_of_the_two_middle_ones() -> None:
    from sim.evaluate import middle_index

    assert middle_index([3.0, 1.0, 2.0]) == 2
    assert middle_index([4.0, 1.0, 3.0, 2.0]) == 2  # sorted 1, 2, 3, 4: the upper middle is 3.0
    assert middle_index([5.0]) == 0


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_measured_runs_path_is_its_middle_iteration_replayed(shipped_measured_bundle) -> None:  # noqa: ANN001
    """Replay is exact, so the measured parts sum to the middle iteration's measured time; a run without
    events is one line."""
    from sim.errors import SimInputError
    from sim.replay import measured_critical_path

    bundle = shipped_measured_bundle
    run_id = "mixtral-8x7b-w32-ciera-L2-emulated-2x1-200mbit"
    parts = measured_critical_path(bundle, run_id)
    times = np.sort(bundle.iterations[bundle.iterations["run_id"] == run_id]["iteration_s"].to_numpy())
    assert sum(parts.values()) == pytest.approx(times[len(times) // 2], rel=1e-9)
    assert parts["codec_critical"] > 0 and parts["compute"] > 0
    statistics_run = next(r for r in bundle.runs["run_id"] if r not in set(bundle.events["run_id"]))
    with pytest.raises(SimInputError, match="has no events to replay"):
        measured_critical_path(bundle, statistics_run)
