"""The stated rewrites (sim/curves.py, sim/rewrite.py, sim/depth.py, sim/ciera_rewrite.py): the size-resolved
collective curve, contention read from overlaps, the depth and world-size rewrites and "turn CIERA on" —
each on cases whose answer is known."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

import sim.rewrite as sim_rewrite
import traces
from sim.ciera_rewrite import (
    CodecFigures,
    ParameterLayout,
    ciera_graph,
    fit_codec_figures,
    main_thread_lag_s,
    main_thread_work_s,
    mean_block_change_rate,
    parameter_sizes,
    payload_bytes,
    shards_per_call,
    split_bucket,
)
from sim.curves import SweepCurve, level_curves, monotone_fit, sweep_curves
from sim.depth import block_map, repeat_blocks
from sim.errors import SimInputError
from sim.evaluate import evaluate
from sim.opgraph import build_graph
from sim.predict import CieraOn, predict_run
from sim.rewrite import (
    ClusterSpec,
    compute_scale,
    main_work_s,
    mean_concurrency,
    measured_cluster,
    optimizer_world_factor,
    projected_cluster,
    rewrite_costs,
    run_transport_s,
    transport_cpu,
    transport_scale,
)


def _sweep(cluster: str, world: int, nodes: int, link_Bps: float, alpha_s: float) -> pd.DataFrame:
    sizes = 2.0 ** np.arange(10, 27)
    rows = []
    for op, factor in (("all_gather", 1.0), ("reduce_scatter", 1.5), ("all_reduce", 2.0)):
        times = (world - 1) * alpha_s + factor * (world - 1) / world * sizes / link_Bps
        rows += [
            {"cluster": cluster, "op": op, "world_size": world, "nodes": nodes, "bytes": int(s), "time_s": t,
             "source": "measured"}
            for s, t in zip(sizes, times, strict=True)
        ]  # fmt: skip
    return pd.DataFrame(rows)


def test_the_curve_goes_through_every_measured_size_and_between_them() -> None:
    sweep = _sweep("c", 2, 2, 1e7, 1e-4)
    curve = sweep_curves(sweep, "c", 2, 2, 1e7)["all_gather"]
    measured = sweep[sweep["op"] == "all_gather"]
    np.testing.assert_allclose(curve.time_s(measured["bytes"].to_numpy()), measured["time_s"], rtol=1e-9)
    middle = curve.time_s(np.array([112 << 10]))[0]
    low, high = curve.time_s(np.array([64 << 10, 128 << 10]))
    assert low < middle < high
    assert curve.link_factor == pytest.approx(1.0, rel=1e-3)
    assert sweep_curves(sweep, "c", 2, 2, 1e7)["reduce_scatter"].link_factor == pytest.approx(1.5, rel=1e-3)
    # Beyond the largest size it goes on linearly.
    largest = float(measured["bytes"].max())
    assert curve.time_s(np.array([2 * largest]))[0] == pytest.approx(
        curve.time_s(np.array([largest]))[0] + 0.5 * largest / 1e7, rel=1e-3
    )


def test_a_noisy_sweep_never_makes_a_larger_collective_cheaper() -> None:
    curve = SweepCurve(
        "all_gather", np.array([1e3, 2e3, 4e3]), monotone_fit(np.array([3e-4, 2e-4, 5e-4])), 2, 2, 1e7, 1.0
    )
    assert np.all(np.diff(curve.time_s(np.linspace(1e3, 4e3, 50))) >= 0)


def test_one_slow_small_size_is_pooled_not_carried_to_every_larger_size() -> None:
    # One slow repetition median at the smallest size (3 ms) among 0.5–0.7 ms: the running maximum made
    # every size up to the next real rise cost 3 ms; the least-squares monotone fit averages it in.
    sweep = _sweep("c", 2, 2, 1e7, 1e-4)
    small = (sweep["op"] == "all_gather") & (sweep["bytes"] == sweep["bytes"].min())
    sweep.loc[small, "time_s"] = 3e-3
    curve = sweep_curves(sweep, "c", 2, 2, 1e7)["all_gather"]
    fitted = monotone_fit(np.array([3.0, 0.5, 0.6, 0.7, 4.0]))
    np.testing.assert_allclose(fitted, [1.2, 1.2, 1.2, 1.2, 4.0])
    assert np.all(np.diff(curve.times_s) >= 0)
    assert curve.times_s[0] < 3e-3 and curve.times_s[0] == pytest.approx(curve.times_s[1])


def test_projected_topologies_fit_a_per_call_and_a_per_step_cost() -> None:
    measured = [sweep_curves(_sweep(f"c{w}", w, w, 1e7, 2e-4), f"c{w}", w, w, 1e7) for w in (2, 3, 4)]
    curve = level_curves(measured, 64, 64, 1e7)["all_gather"]
    assert curve.alpha_s == pytest.approx(2e-4, rel=0.05) and curve.call_s == pytest.approx(0.0, abs=2e-5)
    assert curve.time_s(np.array([0.0]))[0] == pytest.approx(63 * 2e-4, rel=0.05)


def test_transport_cpu_is_interpolated_by_size_and_projected_per_step_and_byte() -> None:
    # Per rank: 0.1 ms per ring step + 2 ns per byte moved (W − 1)/W · S, swept at W = 2, 3, 4.
    def with_cpu(world: int) -> pd.DataFrame:
        sweep = _sweep(f"c{world}", world, world, 1e7, 2e-4)
        moved = sweep["bytes"] * (world - 1) / world
        return sweep.assign(transport_cpu_s=(world - 1) * 1e-4 + moved * 2e-9)

    measured = [sweep_curves(with_cpu(w), f"c{w}", w, w, 1e7) for w in (2, 3, 4)]
    curve = measured[0]["all_gather"]
    np.testing.assert_allclose(
        curve.transport_cpu_s(np.array([1 << 20])), [1e-4 + (1 << 19) * 2e-9], rtol=1e-6
    )
    low, middle, high = curve.transport_cpu_s(np.array([64 << 10, 100 << 10, 128 << 10]))
    assert low < middle < high
    projected = level_curves(measured, 64, 64, 1e7)["all_gather"]
    assert projected.transport_cpu_fit == pytest.approx((1e-4, 2e-9), rel=1e-3)
    # A sweep without it (older, CUDA) has none, and neither has a projection from it.
    plain = sweep_curves(_sweep("c", 2, 2, 1e7, 1e-4), "c", 2, 2, 1e7)
    assert plain["all_gather"].transport_cpu_s(np.array([1024])) is None
    assert (
        level_curves([plain, measured[1]], 8, 8, 1e7)["all_gather"].transport_cpu_s(np.array([1024])) is None
    )


def test_mean_concurrency_counts_what_was_open_beside_each_interval() -> None:
    np.testing.assert_allclose(mean_concurrency(np.array([0.0, 1.0]), np.array([2.0, 2.0])), [1.5, 2.0])
    np.testing.assert_allclose(mean_concurrency(np.array([0.0, 2.0]), np.array([1.0, 3.0])), [1.0, 1.0])


def test_block_map_keeps_the_first_and_last_block_and_cycles_the_interior() -> None:
    assert block_map(6, 8) == [1, 2, 3, 4, 5, 2, 3, 6]
    assert block_map(2, 4) == [1, 1, 1, 2] or block_map(2, 4) == [1, 2, 2, 2]
    assert block_map(6, 2) == [1, 6]
    assert block_map(4, 4) == [1, 2, 3, 4]


def test_buckets_split_into_runs_of_consecutive_parameters() -> None:
    parameters = {0: [10.0], 1: [2.0, 3.0, 5.0], 2: [2.0, 3.0, 5.0], 3: [10.0]}
    assert split_bucket(8.0, 1, parameters) == [3.0, 5.0]
    assert split_bucket(7.0, 2, parameters) in ([5.0, 2.0], [2.0, 5.0])  # across a layer boundary
    assert split_bucket(11.0, 1, parameters) == [11.0]  # no run adds up: one gather


@pytest.fixture(scope="module")
def measured(shipped_measured_bundle: traces.TraceBundle) -> traces.TraceBundle:
    return shipped_measured_bundle


def _run(bundle: traces.TraceBundle, system: str, layers: int, cluster: str) -> pd.Series:
    runs = bundle.runs
    chosen = runs[(runs["system"] == system) & (runs["layers"] == layers) & (runs["cluster"] == cluster)]
    return chosen.iloc[0]


def _iteration(bundle: traces.TraceBundle, run_id: str) -> pd.DataFrame:
    return bundle.events[(bundle.events["run_id"] == run_id) & (bundle.events["iteration"] == 0)]


CLUSTER = "emulated-2x1-200mbit"


def test_repeating_blocks_to_the_traced_depth_changes_nothing(measured: traces.TraceBundle) -> None:
    run = _run(measured, "zero3", 4, CLUSTER)
    graph = build_graph(_iteration(measured, run.run_id))
    assert repeat_blocks(graph, 4, 4, 1.0) is graph


def test_deeper_rewrites_add_the_block_windows_and_their_collectives(measured: traces.TraceBundle) -> None:
    for system in ("zero3", "fsdp"):
        run = _run(measured, system, 4, CLUSTER)
        graph = build_graph(_iteration(measured, run.run_id))
        deeper = repeat_blocks(graph, 4, 6, 1.2)
        counts = {s: int((graph.stream == s).sum()) for s in ("allgather", "compute")}
        grown = {s: int((deeper.stream == s).sum()) for s in ("allgather", "compute")}
        assert grown["allgather"] > counts["allgather"] and grown["compute"] > counts["compute"]
        assert evaluate(deeper).iteration_s > evaluate(graph).iteration_s


def test_the_rewrite_onto_its_own_cluster_stays_near_the_replay(measured: traces.TraceBundle) -> None:
    run = _run(measured, "fsdp", 4, CLUSTER)
    graph = build_graph(_iteration(measured, run.run_id))
    spec = measured_cluster(measured.collectives, run)
    costs, _ = rewrite_costs(graph, spec, spec)
    assert evaluate(graph, costs).iteration_s == pytest.approx(evaluate(graph).iteration_s, rel=0.10)


def test_zero3_re_costed_onto_its_own_cluster_spends_its_measured_time_once_calibrated(
    measured: traces.TraceBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four ranks on two cores with many small gathers: the core shares read off the overlaps and the
    # evaluator's moment-by-moment sharing disagree; the anchor's compute calibration closes the gap.
    run = _run(measured, "zero3", 4, "emulated-2x2-200mbit")
    events = measured.events[measured.events["run_id"] == run.run_id]
    graphs = [build_graph(rows) for _, rows in events.groupby("iteration")]
    spec = measured_cluster(measured.collectives, run)
    scale = transport_scale(run, graphs, spec)[0]
    factor = compute_scale(graphs, spec, scale)
    assert 0.5 < factor < 1.0
    graph = graphs[0]
    main_s = graph.duration_s[graph.is_main].sum()

    def simulated(work_scale: float) -> tuple[float, float]:
        result = evaluate(graph, rewrite_costs(graph, spec, spec, scale, work_scale)[0])
        return result.iteration_s, (result.end_s - result.start_s)[graph.is_main].sum()

    replay_s = evaluate(graph).iteration_s
    uncalibrated_s, uncalibrated_main_s = simulated(1.0)
    calibrated_s, calibrated_main_s = simulated(factor)
    assert uncalibrated_main_s > 1.05 * main_s and uncalibrated_s > 1.05 * replay_s
    assert calibrated_main_s == pytest.approx(main_s, rel=0.03)
    assert calibrated_s == pytest.approx(replay_s, rel=0.03)

    # Asked again with the same inputs (every target of one anchor), the factor is not re-solved.
    def no_second_solve(*_args: object) -> float:
        raise AssertionError("compute_scale solved the same anchor twice")

    monkeypatch.setattr(sim_rewrite, "_solve_compute_scale", no_second_solve)
    assert compute_scale(graphs, spec, scale) == factor
    # Where the cluster's cores are not simulated there is nothing to calibrate.
    assert compute_scale(graphs, dataclasses.replace(spec, host_cores=0), scale) == 1.0


def test_the_sweeps_transport_cpu_is_scaled_to_what_the_run_itself_measured(
    measured: traces.TraceBundle,
) -> None:
    run = _run(measured, "zero3", 2, CLUSTER)
    graph = build_graph(_iteration(measured, run.run_id))
    spec = measured_cluster(measured.collectives, run)
    modelled = transport_cpu(graph, spec)
    assert modelled is not None and modelled.sum() > 0
    per_rank_s = float(modelled.sum()) / graph.world_size
    recorded = run.copy()
    recorded["versions"] = json.dumps(
        {**json.loads(run["versions"]), "transport_cpu_median_s": per_rank_s / 2}
    )
    scale, note = transport_scale(recorded, [graph], spec)
    assert scale == pytest.approx(0.5) and note is None
    # Less transport CPU beside compute: the compute read off the anchor is less, the iteration no longer.
    half = evaluate(graph, rewrite_costs(graph, spec, spec, scale)[0]).iteration_s
    full = evaluate(graph, rewrite_costs(graph, spec, spec, 1.0)[0]).iteration_s
    assert half == pytest.approx(full, rel=0.05)
    # A run captured before runs recorded it: the sweep as is, said.
    missing = run.copy()
    missing["versions"] = json.dumps(
        {k: v for k, v in json.loads(run["versions"]).items() if k != "transport_cpu_median_s"}
    )
    scale, note = transport_scale(missing, [graph], spec)
    assert scale == 1.0 and note is not None and run.run_id in note and "not recorded" in note


def test_a_faster_link_and_a_larger_world_move_the_iteration_the_right_way(
    measured: traces.TraceBundle,
) -> None:
    run = _run(measured, "zero3", 2, CLUSTER)
    graph = build_graph(_iteration(measured, run.run_id))
    spec = measured_cluster(measured.collectives, run)
    same_kind = projected_cluster([spec], 2, 1, "2x1")
    faster = projected_cluster([dataclasses.replace(spec, link_Bps=spec.link_Bps * 10)], 2, 1, "2x1-fast")
    base = evaluate(graph, rewrite_costs(graph, spec, same_kind)[0]).iteration_s
    quick = evaluate(graph, rewrite_costs(graph, spec, faster)[0]).iteration_s
    assert quick < base
    wide: ClusterSpec = projected_cluster([spec], 16, 1, "16x1")
    assert evaluate(graph, rewrite_costs(graph, spec, wide, engine="zero3")[0]).iteration_s > base


def test_the_optimizer_step_moves_to_another_world_size_by_its_engines_partitioning(
    measured: traces.TraceBundle,
) -> None:
    """ZeRO-3 steps its flat partition (work ∝ 1/W); FSDP2 steps every parameter's slice, per-parameter
    work that the rewrite keeps (sim/rewrite.py OPTIMIZER_WORK, measured there). Anything else, at another
    W, is refused in one line; at the traced W no rule is needed."""
    assert optimizer_world_factor("zero3", 2, 16) == pytest.approx(2 / 16)
    assert optimizer_world_factor("fsdp", 2, 16) == 1.0
    assert optimizer_world_factor(None, 4, 4) == 1.0
    with pytest.raises(SimInputError, match="engine 'megatron'.*expected one of fsdp, zero3"):
        optimizer_world_factor("megatron", 2, 4)
    with pytest.raises(SimInputError, match="engine None"):
        optimizer_world_factor(None, 2, 4)
    for system, factor in (("zero3", 2 / 16), ("fsdp", 1.0)):
        run = _run(measured, system, 2, CLUSTER)
        graph = build_graph(_iteration(measured, run.run_id))
        spec = measured_cluster(measured.collectives, run)
        wide = projected_cluster([spec], 16, 1, "16x1")
        optim = graph.stream == "optim"
        at_home = rewrite_costs(graph, spec, spec, engine=system)[0].work_s[optim]
        moved = rewrite_costs(graph, spec, wide, engine=system)[0].work_s[optim]
        assert optim.any() and moved == pytest.approx(at_home * factor)


def test_zero3s_one_gradient_bucket_grows_with_depth_and_fsdps_root_reduction_does_not(
    measured: traces.TraceBundle,
) -> None:
    # ZeRO-3 reduces every gradient in one bucket once the embedding's last gradient is in (labelled
    # layer 0); FSDP2's layer-0 reduce-scatter is the root group's own.
    for system, grows in (("zero3", True), ("fsdp", False)):
        run = _run(measured, system, 4, CLUSTER)
        graph = build_graph(_iteration(measured, run.run_id))
        deeper = repeat_blocks(graph, 4, 8, 1.7)
        before = graph.raw_bytes[(graph.stream == "reduce_scatter") & (graph.layer == 0)]
        after = deeper.raw_bytes[(deeper.stream == "reduce_scatter") & (deeper.layer == 0)]
        assert len(before) == len(after) > 0
        expected = np.round(before * 1.7) if grows else before
        np.testing.assert_allclose(np.sort(after), np.sort(expected))


def _codec_fit(measured: traces.TraceBundle, system: str) -> tuple[CodecFigures, pd.Series, pd.Series]:
    plain_system = {"ciera": "zero3", "ciera-fsdp": "fsdp"}[system]
    codec, plain = _run(measured, system, 2, CLUSTER), _run(measured, plain_system, 2, CLUSTER)
    figures = fit_codec_figures(
        measured,
        [codec.run_id],
        {codec.run_id: plain.run_id},
        {codec.run_id: parameter_sizes(measured, 2)},
        mean_block_change_rate(measured, int(codec.block_size)),
    )
    return figures, codec, plain


@pytest.mark.parametrize("system", ["ciera", "ciera-fsdp"])
def test_codec_figures_give_back_the_codec_runs_own_bytes_and_codec_seconds(
    measured: traces.TraceBundle, system: str
) -> None:
    figures, codec, _ = _codec_fit(measured, system)
    events = measured.events[measured.events["run_id"] == codec.run_id]
    rows = events[(events["stream"] == "allgather") & (events["raw_bytes"] > 0)]
    engine = "zero3" if system == "ciera" else "fsdp"
    sizes = parameter_sizes(measured, 2)
    world = int(codec.world_size)
    shards = [
        shards_per_call(engine, r, int(lay), sizes)
        for r, lay in zip(rows["raw_bytes"], rows["layer"], strict=True)
    ]
    predicted = sum(
        payload_bytes(r, phase == "fwd", n, world, figures)
        for r, phase, n in zip(rows["raw_bytes"], rows["phase"], shards, strict=True)
    )
    assert predicted == pytest.approx(rows["wire_bytes"].sum(), rel=0.03)
    a, b, c = figures.encode_s
    encode = sum(a + b * n + c * r / world for r, n in zip(rows["raw_bytes"], shards, strict=True))
    # Fitted to the encodes' work at a full core (their measured time times the core share they had).
    work = main_thread_work_s(measured, codec)
    measured_encode = work[events["stream"] == "codec_send"].sum()
    assert encode == pytest.approx(measured_encode, rel=0.05)
    # A payload carries at least the sign+mantissa plane (half of BF16's bytes): the fit keeps to that floor.
    assert 0.5 <= figures.repeat_ratio <= figures.first_ratio < 1.0
    assert 0.0 <= figures.overflow_rate < 0.5


def test_main_thread_work_is_each_events_time_at_its_core_share_with_cut_ops_added_back(
    measured: traces.TraceBundle,
) -> None:
    # Three ranks on two cores: every main-thread op shared its cores, so its work is below its time
    # (read at its core share, times the run's compute calibration).
    codec = _run(measured, "ciera", 2, "emulated-3x1-200mbit")
    events = measured.events[measured.events["run_id"] == codec.run_id]
    work = main_thread_work_s(measured, codec)
    main = events["stream"].isin(("compute", "optim", "codec_send", "codec_recv"))
    assert work[~main].isna().all() and work[main].notna().all()
    duration = (events["end_s"] - events["start_s"])[main]
    assert (work[main] >= 0).all() and (work[main] <= duration + 1e-12).all()
    assert work[main].sum() < 0.8 * duration.sum()
    # The graph cuts ops at issue points; their parts' work adds back to their events, none lost.
    cluster = measured_cluster(measured.collectives, codec)
    iterations = [rows for _, rows in events.groupby("iteration")]
    graphs = [build_graph(rows) for rows in iterations]
    scale = transport_scale(codec, graphs, cluster)[0]
    work_scale = compute_scale(graphs, cluster, scale)  # the run's own compute calibration
    assert 0.5 < work_scale < 1.0
    for rows, graph in zip(iterations, graphs, strict=True):
        per_op = main_work_s(graph, cluster, run_transport_s(graph, cluster, scale)) * work_scale
        assert graph.size > len(rows)  # some ops were cut
        assert work[rows.index].sum() == pytest.approx(per_op.sum(), rel=1e-9)


def test_the_zero3_codec_run_predicted_in_sample_from_its_plain_run(measured: traces.TraceBundle) -> None:
    # The codec figures come from this run; what is left is the rewrite's own bias (+3.9 % when the
    # figures were fitted to measured durations, which the evaluator's shared cores then slowed again).
    figures, codec, plain = _codec_fit(measured, "ciera")
    assert abs(_in_sample_error(measured, figures, codec, plain)) < 0.025


def _in_sample_error(
    bundle: traces.TraceBundle, figures: CodecFigures, codec: pd.Series, plain: pd.Series
) -> float:
    """The codec run predicted from its plain twin alone (the seen bundle holds only that run), as an error."""
    seen = dataclasses.replace(bundle, events=bundle.events[bundle.events["run_id"] == plain.run_id])
    seen = dataclasses.replace(seen, runs=bundle.runs[bundle.runs["run_id"] == plain.run_id])
    prediction = predict_run(
        seen, codec, measured_cluster(bundle.collectives, codec), bundle.collectives,
        CieraOn(figures, "zero3", "zero3"),
    )  # fmt: skip
    measured_s = bundle.iterations.loc[bundle.iterations["run_id"] == codec.run_id, "iteration_s"].median()
    return prediction.iteration_s / measured_s - 1


@pytest.mark.parametrize("system", ["ciera", "ciera-fsdp"])
def test_turning_ciera_on_gives_each_engine_gather_one_encode_before_its_issue_and_one_decode_after_it(
    measured: traces.TraceBundle, system: str
) -> None:
    figures, codec, plain = _codec_fit(measured, system)
    graph = build_graph(_iteration(measured, plain.run_id))
    spec = measured_cluster(measured.collectives, plain)
    counts: dict[str, int] = {}
    engine = "zero3" if system == "ciera" else "fsdp"
    rewritten = ciera_graph(
        graph, engine, figures, parameter_sizes(measured, 2), lambda op, w: spec.curves[op].time_s(w), counts
    )
    gathers = np.flatnonzero(rewritten.stream == "allgather")
    assert len(gathers) == int((graph.stream == "allgather").sum())  # one CIERA call per engine call
    assert counts["ciera_gathers"] == len(gathers) // graph.world_size
    # Issued by its own encode, on the main thread right before; decoded once, blocked on it.
    assert (rewritten.stream[rewritten.main_prev[gathers]] == "codec_send").all()
    decodes = np.flatnonzero(rewritten.stream == "codec_recv")
    assert sorted(rewritten.blocker[decodes].tolist()) == sorted(gathers.tolist())
    # The bytes the run it stands for moved per iteration (its mean: early steps change more exponents),
    # within a few per cent.
    events = measured.events[measured.events["run_id"] == codec.run_id]
    rows = events[(events["stream"] == "allgather") & (events["raw_bytes"] > 0)]
    ciera_wire = rows["wire_bytes"].sum() / events["iteration"].nunique()
    assert rewritten.wire_bytes[gathers].sum() == pytest.approx(ciera_wire, rel=0.05)
    result = evaluate(rewritten, rewrite_costs(rewritten, spec, spec)[0])
    measured_s = measured.iterations.loc[measured.iterations["run_id"] == codec.run_id, "iteration_s"]
    assert result.iteration_s == pytest.approx(float(measured_s.median()), rel=0.15)


def test_ciera_written_in_for_a_larger_world_costs_its_calls_at_that_world(
    measured: traces.TraceBundle,
) -> None:
    """A graph traced at W = 2 and re-costed at W = 8 gets W = 8's calls: an own shard of raw / 8, seven
    sources to rebuild per shard, eight rows of per-shard overhead — and stays a two-rank graph."""
    figures, _, plain = _codec_fit(measured, "ciera")
    graph = build_graph(_iteration(measured, plain.run_id))
    spec = measured_cluster(measured.collectives, plain)
    sizes = parameter_sizes(measured, 2)

    def curve(op: str, wire: float) -> float:
        return spec.curves[op].time_s(wire)

    traced = ciera_graph(graph, "zero3", figures, sizes, curve)
    larger = ciera_graph(graph, "zero3", figures, sizes, curve, world_size=8)
    assert larger.world_size == traced.world_size == graph.world_size
    layout = ParameterLayout(sizes)
    gathers = np.flatnonzero((traced.stream == "allgather") & (traced.rank == 0))
    raw = traced.raw_bytes[gathers]
    shards = np.array(
        [layout.shards("zero3", r, int(lay)) for r, lay in zip(raw, traced.layer[gathers], strict=True)]
    )
    rows = larger.wire_bytes[np.flatnonzero((larger.stream == "allgather") & (larger.rank == 0))]
    overhead = figures.shard_overhead_bytes * shards
    assert rows - traced.wire_bytes[gathers] == pytest.approx((8 - 2) * overhead)
    d, e, f = figures.decode_s
    decode = lambda graph: graph.duration_s[(graph.stream == "codec_recv") & (graph.rank == 0)].sum()  # noqa: E731
    glue = figures.glue_s_per_gather / 2 * len(gathers)
    expected = {
        w: sum(d + e * n * (w - 1) + f * r * (w - 1) / w for r, n in zip(raw, shards, strict=True)) + glue
        for w in (2, 8)
    }
    assert decode(traced) == pytest.approx(expected[2], rel=1e-6)
    assert decode(larger) == pytest.approx(expected[8], rel=1e-6)


@pytest.mark.parametrize("system", ["ciera", "ciera-fsdp"])
def test_decode_at_a_world_size_the_codec_runs_lack_says_its_growth_is_assumed(
    measured: traces.TraceBundle, system: str
) -> None:
    """At one W, (W − 1) is a constant: the fit cannot tell decode's cost per shard and source from one
    per shard. At another W the note gives the fixed part of a median call both ways and the fit's; at the
    codec runs' own W, or with runs at several, nothing is said."""
    figures, codec, _ = _codec_fit(measured, system)
    assert figures.world_sizes == (int(codec.world_size),) == (2,)
    assert figures.shards_per_call >= 1
    assert figures.decode_sources_note(2) is None
    assert dataclasses.replace(figures, world_sizes=(2, 4)).decode_sources_note(8) is None
    d, e, _ = figures.decode_s
    n = figures.shards_per_call
    note = figures.decode_sources_note(4)
    fitted, used = d + e * n, d + e * n * 3
    assert note.startswith("decode at W = 4, fitted at W = 2 only: how its fixed part grows")
    assert f"a {n}-shard call's (the codec runs' median) is {fitted * 1e6:.0f} µs at W = 2" in note
    assert f"{fitted * 1e6:.0f} µs if it does not grow and {fitted * 3e6:.0f} µs if all of it does" in note
    assert f"the rewrite counts {used * 1e6:.0f} µs" in note
    one = dataclasses.replace(figures, decode_s=(1e-4, 2e-5, 1e-9), shards_per_call=3)
    assert (
        "a 3-shard call's (the codec runs' median) is 160 µs at W = 2, at W = 3 160 µs if it does not grow"
        in (one.decode_sources_note(3))
    )
    assert "320 µs if all of it does; the rewrite counts 220 µs" in one.decode_sources_note(3)


def test_a_codec_run_of_another_protocol_is_one_line_not_a_wrong_fit(measured: traces.TraceBundle) -> None:
    codec = _run(measured, "ciera", 2, CLUSTER)
    events = measured.events
    drop = (events["run_id"] == codec.run_id) & (events["stream"] == "codec_recv")
    broken = dataclasses.replace(measured, events=events[~drop])
    with pytest.raises(SimInputError, match="expected one of each per engine call"):
        fit_codec_figures(broken, [codec.run_id], {}, {codec.run_id: parameter_sizes(measured, 2)}, 0.5)


def test_one_decode_missing_on_one_rank_names_that_rank_iterations_counts(
    measured: traces.TraceBundle,
) -> None:
    codec = _run(measured, "ciera", 2, CLUSTER)
    events = measured.events
    of_run = events[(events["run_id"] == codec.run_id) & (events["stream"] == "codec_recv")]
    last = of_run[(of_run["rank"] == 1) & (of_run["iteration"] == of_run["iteration"].max())].index[-1]
    gathers = events[
        (events["run_id"] == codec.run_id) & (events["stream"] == "allgather") & (events["raw_bytes"] > 0)
        & (events["rank"] == 1) & (events["iteration"] == of_run["iteration"].max())
    ]  # fmt: skip
    broken = dataclasses.replace(measured, events=events.drop(index=last))
    calls = len(gathers)
    with pytest.raises(
        SimInputError, match=f"{calls} encodes, {calls - 1} decodes and {calls} gathers per rank"
    ):
        fit_codec_figures(broken, [codec.run_id], {}, {codec.run_id: parameter_sizes(measured, 2)}, 0.5)


def test_a_block_size_the_statistics_lack_is_one_line_naming_those_they_have(
    measured: traces.TraceBundle,
) -> None:
    with pytest.raises(SimInputError, match=r"no exponent statistics at block size 4096 \(it has \[64, 128"):
        mean_block_change_rate(measured, 4096)


def _with_gather_path(
    bundle: traces.TraceBundle, run_ids: list[str], below_s: float = 2e-4
) -> traces.TraceBundle:
    """`bundle` as if `run_ids` had been captured with the engine's gather path recorded: their short
    compute segments (under `below_s`: the host work around each engine call) relabelled `gather_host`."""
    events = bundle.events
    short = (events["end_s"] - events["start_s"]) < below_s
    chosen = events["run_id"].isin(run_ids) & (events["stream"] == "compute") & short
    stream = events["stream"].astype(object).where(~chosen, "gather_host")
    return dataclasses.replace(bundle, events=events.assign(stream=stream.astype(events["stream"].dtype)))


def test_a_recorded_engine_gather_path_replaces_the_plain_one_with_cieras_measured_one(
    measured: traces.TraceBundle,
) -> None:
    codec, plain = _run(measured, "ciera", 2, CLUSTER), _run(measured, "zero3", 2, CLUSTER)
    bundle = _with_gather_path(measured, [codec.run_id, plain.run_id])
    figures = fit_codec_figures(
        bundle, [codec.run_id], {codec.run_id: plain.run_id}, {codec.run_id: parameter_sizes(bundle, 2)},
        mean_block_change_rate(bundle, int(codec.block_size)),
    )  # fmt: skip
    # CIERA's path per call: its gather_host work per rank and iteration over its calls; no glue by difference.
    events = bundle.events[bundle.events["run_id"] == codec.run_id]
    work = main_thread_work_s(bundle, codec)
    rank_iterations = events.groupby(["iteration", "rank"]).ngroups
    calls = int(((events["stream"] == "allgather") & (events["raw_bytes"] > 0)).sum()) / rank_iterations
    path = work[events["stream"] == "gather_host"].sum() / rank_iterations / calls
    assert figures.gather_host_s_per_call == pytest.approx(path, rel=1e-9) and path > 0
    # Beside it only the lag's difference, per call: nothing read from a difference of the compute.
    plain_events = bundle.events[bundle.events["run_id"] == plain.run_id]
    lag = (main_thread_lag_s(events) - main_thread_lag_s(plain_events)) / calls
    assert figures.glue_s_per_gather == pytest.approx(lag, rel=1e-9, abs=1e-12)
    assert "replaced by CIERA's" in figures.describe() and "(measured), lag" in figures.describe()
    # The rewrite drops the plain run's gather path and spends CIERA's, half at each encode and decode: a
    # gather_host op of its own just before each encode and just after each decode, where a measured CIERA
    # run records that work, so the critical path counts it as the measured one does.
    graph = build_graph(_iteration(bundle, plain.run_id))
    assert (graph.stream == "gather_host").sum() > 0
    spec = measured_cluster(bundle.collectives, plain)
    sizes = parameter_sizes(bundle, 2)
    rewritten = ciera_graph(graph, "zero3", figures, sizes, lambda op, w: spec.curves[op].time_s(w))
    on_path = rewritten.stream == "gather_host"
    dropped = on_path & (rewritten.duration_s == 0)
    added = on_path & (rewritten.duration_s > 0)
    assert dropped.sum() == (graph.stream == "gather_host").sum()
    encodes = np.flatnonzero(rewritten.stream == "codec_send")
    decodes = np.flatnonzero(rewritten.stream == "codec_recv")
    assert added.sum() == len(encodes) + len(decodes) > 0
    assert rewritten.duration_s[added] == pytest.approx(path / 2, rel=1e-9)
    assert added[rewritten.main_prev[encodes]].all()  # each encode right after its host op
    assert set(rewritten.main_prev[np.flatnonzero(added)]) >= set(decodes)  # each decode right before one
    gathers = np.flatnonzero((rewritten.stream == "allgather") & (rewritten.rank == 0))
    layout = ParameterLayout(sizes)
    d, e, f = figures.decode_s
    expected = sum(
        d + e * layout.shards("zero3", r, int(lay)) + f * r / 2 + (path + lag) / 2
        for r, lay in zip(rewritten.raw_bytes[gathers], rewritten.layer[gathers], strict=True)
    )
    rank0_decodes = decodes[rewritten.rank[decodes] == 0]
    decode = rewritten.duration_s[rank0_decodes].sum() + len(rank0_decodes) * path / 2
    assert decode == pytest.approx(expected, rel=1e-6)
    # End to end through the depth rewrite and the evaluator: in sample, near the codec run's time.
    assert abs(_in_sample_error(bundle, figures, codec, plain)) < 0.05


def test_the_glue_by_difference_counts_the_main_threads_time_between_its_segments(
    measured: traces.TraceBundle,
) -> None:
    codec, plain = _run(measured, "ciera", 2, CLUSTER), _run(measured, "zero3", 2, CLUSTER)
    figures = fit_codec_figures(
        measured, [codec.run_id], {codec.run_id: plain.run_id}, {codec.run_id: parameter_sizes(measured, 2)},
        mean_block_change_rate(measured, int(codec.block_size)),
    )  # fmt: skip
    per_run = {}
    for run in (codec, plain):
        events = measured.events[measured.events["run_id"] == run.run_id]
        work = main_thread_work_s(measured, run)
        rank_iterations = events.groupby(["iteration", "rank"]).ngroups
        main = work[events["stream"].isin(["compute", "optim"])].sum() / rank_iterations
        per_run[run.system] = (main + main_thread_lag_s(events), rank_iterations)
    events = measured.events[measured.events["run_id"] == codec.run_id]
    calls = ((events["stream"] == "allgather") & (events["raw_bytes"] > 0)).sum() / per_run["ciera"][1]
    expected = (per_run["ciera"][0] - per_run["zero3"][0]) / calls
    assert figures.glue_s_per_gather == pytest.approx(expected, rel=1e-9)


def test_the_main_threads_lag_is_its_idle_time_that_no_collective_explains() -> None:
    # One rank, one iteration: compute 0-1 ms issues a gather that ends at 1.5 ms; the next compute
    # starts at 1.7 ms (0.5 ms held by the gather, 0.2 ms lag), the one after it 0.3 ms after the
    # previous end with nothing in flight (0.3 ms lag). Per rank and iteration over two iterations.
    def row(iteration, stream, start_ms, end_ms, issued_ms=None):
        return {
            "run_id": "r", "rank": 0, "iteration": iteration, "layer": 1, "phase": "fwd", "stream": stream,
            "issued_s": (start_ms if issued_ms is None else issued_ms) / 1e3, "start_s": start_ms / 1e3,
            "end_s": end_ms / 1e3, "raw_bytes": 0 if stream == "compute" else 4096,
            "wire_bytes": 0 if stream == "compute" else 4096,
        }  # fmt: skip

    events = pd.DataFrame([
        row(i, stream, *times)
        for i in (0, 1)
        for stream, *times in (
            ("compute", 0.0, 1.0), ("allgather", 0.5, 1.5, 0.5), ("compute", 1.7, 2.0), ("compute", 2.3, 3.0),
        )
    ])  # fmt: skip
    assert main_thread_lag_s(events) == pytest.approx(0.5e-3)


def test_without_the_plain_runs_gather_path_the_glue_is_read_by_difference(
    measured: traces.TraceBundle,
) -> None:
    codec, plain = _run(measured, "ciera", 2, CLUSTER), _run(measured, "zero3", 2, CLUSTER)
    only_codec = _with_gather_path(measured, [codec.run_id])
    figures = fit_codec_figures(
        only_codec, [codec.run_id], {codec.run_id: plain.run_id}, {codec.run_id: parameter_sizes(measured, 2)},
        mean_block_change_rate(measured, int(codec.block_size)),
    )  # fmt: skip
    assert figures.gather_host_s_per_call is None and "minus the plain run's" in figures.describe()
    # Figures that replace the path, on an anchor that never recorded it: one line, not a double count.
    both = _with_gather_path(measured, [codec.run_id, plain.run_id])
    replacing = fit_codec_figures(
        both, [codec.run_id], {codec.run_id: plain.run_id}, {codec.run_id: parameter_sizes(measured, 2)},
        mean_block_change_rate(measured, int(codec.block_size)),
    )  # fmt: skip
    graph = build_graph(_iteration(measured, plain.run_id))
    spec = measured_cluster(measured.collectives, plain)
    with pytest.raises(SimInputError, match="records no engine gather path"):
        ciera_graph(
            graph, "zero3", replacing, parameter_sizes(measured, 2), lambda op, w: spec.curves[op].time_s(w)
        )
