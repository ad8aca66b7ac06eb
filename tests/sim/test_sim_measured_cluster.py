"""`ciera simulate --cluster <measured cluster>`: the simulator reproduces its own input (replay at a traced
configuration), projects other depths and world sizes of its kind by rewriting its graphs, and refuses what
it cannot answer with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import traces
from sim import SimInputError
from sim.measured_cluster import simulate_measured_cluster

CLUSTER = "emulated-2x1-200mbit"
# The preset path profiles the first measured cluster by name at each (L, W).
PRESET_PATH_CLUSTER = "emulated-2x1-1gbit"


@pytest.fixture(scope="module")
def measured(shipped_measured_bundle: traces.TraceBundle) -> traces.TraceBundle:
    return shipped_measured_bundle


def _cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "simulate", "--bundle", "measured", *arguments],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_every_traced_configuration_of_a_cluster_is_reproduced(measured: traces.TraceBundle) -> None:
    records = simulate_measured_cluster(measured, CLUSTER, layers=2)
    measured_s = measured.iterations.groupby("run_id")["iteration_s"].median()
    runs = measured.runs[(measured.runs["cluster"] == CLUSTER) & (measured.runs["layers"] == 2)]
    assert len(records) == len(runs)  # every system at that depth, nothing else
    for record in records:
        assert record.kind == "replayed" and record.compute == "traced"
        run_id = runs[runs["system"] == record.system].iloc[0]["run_id"]
        assert record.measured_s == pytest.approx(float(measured_s[run_id]))
        assert abs(record.iteration_s / record.measured_s - 1) <= 0.01
    zero3 = next(r.iteration_s for r in records if r.system == "zero3")
    for record in records:
        assert record.speedup_vs_zero3 == pytest.approx(zero3 / record.iteration_s)


def test_another_depth_and_world_size_are_rewrites_of_this_clusters_runs(
    measured: traces.TraceBundle,
) -> None:
    (deeper,) = simulate_measured_cluster(measured, CLUSTER, systems=["fsdp"], layers=12)
    assert deeper.kind == "projected" and deeper.measured_s is None and deeper.cluster == CLUSTER
    assert CLUSTER in deeper.basis and "blocks repeated 8 → 12" in deeper.basis
    # What each block added costs is stated where the user looks, not only in the basis.
    (depth_note,) = [note for note in deeper.notes if note.startswith("depth rewrite of fsdp")]
    assert f"on {CLUSTER}: blocks 8 → 12, " in depth_note
    assert "ms of compute per block added (the mean of 20 traced blocks, L = 2, 4, 6, 8)" in depth_note
    (traced,) = simulate_measured_cluster(measured, CLUSTER, systems=["fsdp"], layers=8)
    assert deeper.iteration_s > traced.iteration_s
    wider = simulate_measured_cluster(measured, CLUSTER, systems=["fsdp"], layers=2, gpus=[4, 16])
    assert [r.gpus for r in wider] == [4, 16]
    for record in wider:
        assert record.kind == "projected" and record.cluster.startswith(f"{CLUSTER}-kind-")
        assert "each node its own host" in record.compute
    assert wider[0].iteration_s < wider[1].iteration_s  # more ranks over the same slow link


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_ciera_is_projected_by_the_rewrite_validate_sim_checks(measured: traces.TraceBundle) -> None:
    """Off its traced configuration, a CIERA system is its plain engine's graph with CIERA written in at the
    target W (predict_run with CieraOn: what `ciera validate sim` scores as its system category), with
    codec figures fitted to all its runs on the cluster — never its own W = 2 codec ops carried to W = 128."""
    from sim.ciera_rewrite import PLAIN_ENGINE, fit_system_figures
    from sim.measured_cluster import _target_cluster
    from sim.predict import CieraOn, predict_run

    records = simulate_measured_cluster(
        measured, CLUSTER, systems=["ciera", "ciera-fsdp"], layers=4, gpus=[8]
    )
    runs = measured.runs[(measured.runs["cluster"] == CLUSTER) & (measured.runs["source"] == "measured")]
    for record in records:
        plain = PLAIN_ENGINE[record.system]
        assert record.kind == "projected"
        assert (
            record.basis.startswith(f"mixtral-8x7b-w32-{plain}-L4-{CLUSTER}")
            and "CIERA written in" in record.basis
        )
        assert any("the rewrite `ciera validate sim` checks" in note for note in record.notes)
        codec_runs = sorted(runs.loc[runs["system"] == record.system, "run_id"])
        figures = fit_system_figures(measured, record.system, codec_runs, runs)
        anchor = runs[(runs["system"] == plain) & (runs["layers"] == 4)].iloc[0]
        expected = predict_run(
            measured, anchor, _target_cluster(measured, anchor, 8), measured.collectives,
            CieraOn(figures, plain, plain),
        )  # fmt: skip
        assert record.iteration_s == pytest.approx(expected.iteration_s)
    # Each rank rebuilds W − 1 sources per shard: ZeRO-3 + CIERA's edge shrinks with W.
    wide = simulate_measured_cluster(measured, CLUSTER, systems=["zero3", "ciera"], layers=4, gpus=[4, 128])
    speedup = {r.gpus: r.speedup_vs_zero3 for r in wide if r.system == "ciera"}
    assert speedup[128] < speedup[4]
    # Its memory is still CIERA's (the receivers' exponent cache on top of the plain engine's states).
    memory = {(r.gpus, r.system): r.memory["total_bytes"] for r in wide}
    assert memory[(128, "ciera")] > memory[(128, "zero3")]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"gpus": [5000]}, "--gpus 5000: expected at most 4096 ranks"),
        ({"systems": ["zeropp"]}, "--systems: 'zeropp' was not measured on 'emulated-2x1-200mbit'"),
        ({"models": ["olmoe-1b-7b"]}, "--models: model 'olmoe-1b-7b' was not measured on"),
        ({"layers": 0}, "--layers 0: model 'mixtral-8x7b-w32' has 1..32 blocks"),
        # Past the model's published depth, as the analytic path refuses it (1000 built a graph for minutes).
        ({"layers": 33}, "--layers 33: model 'mixtral-8x7b-w32' has 1..32 blocks"),
        ({"layers": 1000}, "--layers 1000: model 'mixtral-8x7b-w32' has 1..32 blocks"),
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
    with pytest.raises(SimInputError, match="has 2 ranks per node; expected a multiple of 2"):
        simulate_measured_cluster(measured, "emulated-2x2-200mbit", systems=["fsdp"], layers=2, gpus=[6 + 1])


@pytest.mark.heavy
def test_cli_replays_projects_writes_json_and_refuses_preset_options(tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    done = _cli(
        "--cluster", CLUSTER, "--layers", "2", "--gpus", "2,8", "--systems", "zero3,fsdp", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "replayed" in done.stdout and "+0.00 %" in done.stdout and "projected" in done.stdout
    assert "events/s" in done.stdout
    document = json.loads(out.read_text())
    assert document["schema"] == "ciera.simulate.measured/2"
    assert {(r["gpus"], r["kind"]) for r in document["records"]} == {(2, "replayed"), (8, "projected")}
    for option in (["--sweep", "inter_node.beta_Bps=1e9,2e9"], ["--set", "gpus_per_node=2"]):
        refused = _cli("--cluster", CLUSTER, *option)
        assert refused.returncode == 2
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "a measured cluster is replayed as captured" in lines[0], refused.stderr
    unknown = _cli("--cluster", "nowhere")
    assert unknown.returncode == 2
    assert CLUSTER in unknown.stderr and len(unknown.stderr.strip().splitlines()) == 1


def test_measured_compute_is_never_put_under_another_device(measured: traces.TraceBundle) -> None:
    """A preset of another device than the capture's: refused, naming both and what to run instead."""
    import sim

    with pytest.raises(
        sim.SimInputError, match=r"measured on 'cpu: .*the preset is A100-SXM4-80GB.*--cluster emulated-"
    ):
        sim.simulate(measured, sim.load_cluster("a100-hdr-testbed"), gpus=[16], dtypes=["bf16"])


def test_a_checkpointed_block_is_gathered_about_twice_by_deepspeed(measured: traces.TraceBundle) -> None:
    """The engines' schedules as captured: DeepSpeed gathers a checkpointed block ~2.1 times per
    iteration, FSDP2 twice (the op graph takes them from the events as they are)."""
    gathers = measured.events[measured.events["stream"] == "allgather"]
    per_rank = gathers.groupby(["run_id", "iteration", "rank"])["raw_bytes"].sum().groupby("run_id").median()
    block_bytes = float(
        per_rank[f"mixtral-8x7b-w32-fsdp-L4-{PRESET_PATH_CLUSTER}"]
        - per_rank[f"mixtral-8x7b-w32-fsdp-L2-{PRESET_PATH_CLUSTER}"]
    )
    zero3_block_bytes = float(
        per_rank[f"mixtral-8x7b-w32-zero3-L4-{PRESET_PATH_CLUSTER}"]
        - per_rank[f"mixtral-8x7b-w32-zero3-L2-{PRESET_PATH_CLUSTER}"]
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
