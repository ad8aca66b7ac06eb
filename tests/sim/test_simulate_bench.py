"""benchmarks/simulate.py's measured projections: one 128-rank projection of the measured bundle's deepest
ZeRO-3 run and the same with CIERA turned on, each the record `ciera simulate --cluster C --gpus 128` gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import traces
from sim.measured_cluster import simulate_measured_cluster

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark  # noqa: E402


@pytest.mark.heavy  # ~5 s on 2 cores: a codec fit and four 128-rank projections
def test_both_projections_are_the_commands_records() -> None:
    plain, ciera = load_benchmark("simulate")._measured_projections(traces.measured_bundle_path(), None)
    assert plain["system"] == "zero3" and ciera is not None and ciera["system"] == "ciera"
    assert plain["run"] == ciera["run"] and plain["cluster"] == ciera["cluster"]
    bundle = traces.read_bundle(traces.measured_bundle_path())
    run = bundle.runs[bundle.runs["run_id"] == plain["run"]].iloc[0]
    assert run["system"] == "zero3" and run["layers"] == bundle.runs["layers"].max()
    for result in (plain, ciera):
        (record,) = simulate_measured_cluster(
            bundle, str(run["cluster"]), systems=[result["system"]], layers=int(run["layers"]), gpus=[128]
        )
        assert result["projected_iteration_s"] == record.iteration_s
        assert result["projection_events"] == record.simulated_events > 0
        assert result["meets_target"] == (result["projection_128_ranks_s"] <= result["target_s"] == 2.0)


@pytest.mark.heavy  # ~3 s: the bundle written and read again
def test_a_run_without_ciera_beside_it_gives_no_ciera_projection(tmp_path: Path) -> None:
    bundle = traces.read_bundle(traces.measured_bundle_path())
    keep = set(bundle.runs.loc[bundle.runs["system"] == "zero3", "run_id"])
    traces.write_bundle(bundle.with_runs(keep), tmp_path / "plain")
    plain, ciera = load_benchmark("simulate")._measured_projections(tmp_path / "plain", None)
    assert plain["system"] == "zero3" and ciera is None
