"""`ciera simulate --cluster <measured cluster>`: the simulator reproduces its own input (replay at a traced
configuration), projects other depths of that cluster from it, and refuses what a measured cluster cannot
answer with one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import traces
from sim import SimInputError
from sim.measured_cluster import measured_clusters, simulate_measured_cluster

CLUSTER = "emulated-2x1-1gbit"


@pytest.fixture(scope="module")
def measured() -> traces.TraceBundle:
    return traces.read_bundle(traces.measured_bundle_path())


def _cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "simulate", "--bundle", "measured", *arguments],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_every_traced_configuration_of_a_cluster_is_reproduced(measured: traces.TraceBundle) -> None:
    records = simulate_measured_cluster(measured, CLUSTER)
    measured_s = measured.iterations.groupby("run_id")["iteration_s"].median()
    runs = measured.runs[measured.runs["cluster"] == CLUSTER]
    assert len(records) == len(runs)  # every system at every traced depth, nothing else
    for record in records:
        assert record.kind == "replayed"
        run_id = runs[(runs["system"] == record.system) & (runs["layers"] == record.layers)].iloc[0]["run_id"]
        assert record.measured_s == pytest.approx(float(measured_s[run_id]))
        assert abs(record.iteration_s / record.measured_s - 1) <= 0.02
    zero3 = {r.layers: r.iteration_s for r in records if r.system == "zero3"}
    for record in records:
        assert record.speedup_vs_zero3 == pytest.approx(zero3[record.layers] / record.iteration_s)


def test_another_depth_is_a_projection_from_this_cluster_only(measured: traces.TraceBundle) -> None:
    (record,) = simulate_measured_cluster(measured, CLUSTER, systems=["zero3"], layers=32)
    assert record.kind == "projected" and record.measured_s is None
    assert CLUSTER in record.basis and "a + b·L" in record.basis
    # A twin cluster of the same shape but twice as slow must not change this cluster's projection.
    runs = measured.runs[measured.runs["cluster"] == CLUSTER]
    twin_runs = runs.assign(run_id=runs["run_id"] + "-twin", cluster="aaa-twin")
    events = measured.events[measured.events["run_id"].isin(runs["run_id"])].copy()
    for column in ("issued_s", "start_s", "end_s"):
        events[column] *= 2
    events["run_id"] = events["run_id"] + "-twin"
    iterations = measured.iterations[measured.iterations["run_id"].isin(runs["run_id"])].copy()
    iterations["iteration_s"] *= 2
    iterations["run_id"] = iterations["run_id"] + "-twin"
    doubled = dataclasses.replace(
        measured,
        runs=pd.concat([measured.runs, twin_runs], ignore_index=True),
        events=pd.concat([measured.events, events], ignore_index=True),
        iterations=pd.concat([measured.iterations, iterations], ignore_index=True),
    )
    assert "aaa-twin" in measured_clusters(doubled)
    (again,) = simulate_measured_cluster(doubled, CLUSTER, systems=["zero3"], layers=32)
    assert again.iteration_s == pytest.approx(record.iteration_s)
    (twin,) = simulate_measured_cluster(doubled, "aaa-twin", systems=["zero3"], layers=32)
    assert twin.iteration_s == pytest.approx(2 * record.iteration_s, rel=0.01)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"gpus": [8]}, "--gpus 8: cluster 'emulated-2x1-1gbit' was measured at W=2"),
        ({"systems": ["zeropp"]}, "--systems: 'zeropp' was not measured on 'emulated-2x1-1gbit'"),
        ({"models": ["olmoe-1b-7b"]}, "--models: model 'olmoe-1b-7b' was not measured on"),
        ({"layers": 0}, "--layers: value 0, expected a depth >= 1"),
        ({"dtypes": ["fp16"]}, "no measured run matches"),
    ],
)
def test_what_a_measured_cluster_cannot_answer_is_refused(
    measured: traces.TraceBundle, changes: dict, expected: str
) -> None:
    with pytest.raises(SimInputError, match=expected.replace("(", r"\(")):
        simulate_measured_cluster(measured, CLUSTER, **changes)
    with pytest.raises(SimInputError, match="no measured run with events on it"):
        simulate_measured_cluster(measured, "a100-hdr-testbed")


def test_cli_replays_writes_json_and_refuses_preset_options(tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    done = _cli("--cluster", CLUSTER, "--layers", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "replayed" in done.stdout and "+0.00 %" in done.stdout
    document = json.loads(out.read_text())
    assert document["schema"] == "ciera.simulate.measured/1"
    assert {r["system"] for r in document["records"]} == {"ciera", "fsdp", "zero3"}
    assert all(r["layers"] == 2 and r["kind"] == "replayed" for r in document["records"])
    for option in (["--sweep", "inter_node.beta_Bps=1e9,2e9"], ["--set", "gpus_per_node=2"]):
        refused = _cli("--cluster", CLUSTER, *option)
        assert refused.returncode == 2
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "a measured cluster is replayed as captured" in lines[0], refused.stderr
    unknown = _cli("--cluster", "nowhere")
    assert unknown.returncode == 2
    assert "emulated-2x1-1gbit" in unknown.stderr and len(unknown.stderr.strip().splitlines()) == 1


def test_simulated_gathers_move_the_bytes_the_capture_gathered(measured: traces.TraceBundle) -> None:
    """The engines' schedules: at a traced depth the simulated ZeRO-3 and FSDP2 gather per iteration what
    each rank's all-gathers moved in the capture (DeepSpeed: a checkpointed block ~2.1 times, not 3)."""
    import sim

    preset = sim.load_cluster("a100-hdr-testbed")
    gathers = measured.events[measured.events["stream"] == "allgather"]
    per_rank = gathers.groupby(["run_id", "iteration", "rank"])["raw_bytes"].sum().groupby("run_id").median()
    for depth in (2, 8):
        records = sim.simulate(
            measured, preset, gpus=[2], systems=["zero3", "fsdp"], dtypes=["bf16"], layers=depth
        )
        for record in records:
            run = measured.runs[
                (measured.runs["system"] == record.system)
                & (measured.runs["layers"] == depth)
                & (measured.runs["cluster"] == CLUSTER)
            ].iloc[0]
            assert record.allgather_bytes_per_iter == pytest.approx(float(per_rank[run["run_id"]]), rel=0.01)
    block_bytes = float(
        per_rank[f"mixtral-8x7b-w32-fsdp-L4-{CLUSTER}"] - per_rank[f"mixtral-8x7b-w32-fsdp-L2-{CLUSTER}"]
    )
    zero3_block_bytes = float(
        per_rank[f"mixtral-8x7b-w32-zero3-L4-{CLUSTER}"] - per_rank[f"mixtral-8x7b-w32-zero3-L2-{CLUSTER}"]
    )
    assert 2.0 <= 2 * zero3_block_bytes / block_bytes <= 2.2  # gathers of a block per iteration


def test_the_analytic_generator_gathers_a_checkpointed_block_twice() -> None:
    analytic = traces.read_bundle(traces.default_bundle_path())
    layers = analytic.layers
    blocks = layers[layers["layer_kind"] == "block"]
    assert (blocks.loc[blocks["phase"] == "bwd", "allgather_bytes"] == 0).all()
    assert (blocks.loc[blocks["phase"].isin(["fwd", "recompute"]), "allgather_bytes"] > 0).all()
    edges = layers[layers["layer_kind"] != "block"]
    assert (edges.loc[edges["phase"] == "bwd", "allgather_bytes"] > 0).all()
