"""`ciera validate sim` on the shipped measured bundle: replay exact, every non-seen run predicted and
categorised, the JSON contract, and one-line errors for bad held-out files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traces
from sim.predict import link_seconds
from validation.sim_check import (
    SCHEMA,
    ValidationInputError,
    default_held_out_path,
    load_held_out,
    validate_sim,
)


@pytest.fixture(scope="module")
def document() -> dict:
    bundle = traces.read_bundle(traces.measured_bundle_path())
    return validate_sim(bundle, load_held_out(default_held_out_path()), 0.04)


def test_seen_runs_replay_exactly_and_every_other_run_is_predicted(document: dict) -> None:
    assert document["schema"] == SCHEMA
    assert len(document["replay"]) == 9  # 1 cluster x depths 2, 4, 6 x 3 systems
    assert document["replay_max_abs_error"] < 1e-9
    assert len(document["held_out"]) == 48 - 9
    assert {row["category"] for row in document["held_out"]} == {"depth", "link", "topology"}
    for row in document["held_out"]:
        assert row["predicted_s"] > 0 and row["basis"]
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1.0)
        assert (row["speedup_error"] is None) == (row["system"] == "zero3")
    errors = np.abs([row["error"] for row in document["held_out"]])
    assert document["held_out_mean_abs_error"] == pytest.approx(errors.mean())
    calibrated = {(row["cluster"], row["op"]) for row in document["calibration"]}
    assert len(calibrated) == 4 * 3  # every cluster's sweep, three ops
    for row in document["calibration"]:
        assert row["alpha_s"] > 0 and row["beta_Bps"] > 0 and row["relative_rms_residual"] >= 0
    assert any("by the measured sweeps" in row["basis"] for row in document["held_out"])
    assert document["passed"] == (
        document["held_out_mean_abs_error"] <= 0.04 and document["held_out_max_abs_error"] <= 0.08
    )


def test_a_ring_collective_spends_w_minus_1_over_w_of_its_size_on_the_link() -> None:
    np.testing.assert_allclose(link_seconds(np.array([1e6]), 4, 2, 1e6), [0.75])
    np.testing.assert_allclose(link_seconds(np.array([1e6]), 4, 1, 1e6), [0.0])  # one node: no link


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", r"table \[seen\] missing"),
        ("[seen]\nclusters = []\nlayers = [2]\n", "field 'seen.clusters'"),
        ("[seen]\nclusters = ['x']\nlayers = [0]\n", "field 'seen.layers'"),
        ("[seen\n", "cannot read"),
    ],
)
def test_bad_held_out_files_are_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "held.toml"
    path.write_text(text)
    with pytest.raises(ValidationInputError, match=expected):
        load_held_out(path)


def test_unknown_seen_cluster_and_nothing_held_out_are_refused(tmp_path: Path) -> None:
    bundle = traces.read_bundle(traces.measured_bundle_path())
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[seen]\nclusters = ['nope']\nlayers = [2]\n")
    with pytest.raises(ValidationInputError, match="seen cluster 'nope' is not in the bundle"):
        validate_sim(bundle, load_held_out(unknown), 0.04)
    everything = tmp_path / "all.toml"
    clusters = sorted(set(bundle.runs["cluster"]))
    everything.write_text(f"[seen]\nclusters = {clusters!r}\nlayers = [2, 4, 6, 8]\n")
    with pytest.raises(ValidationInputError, match="nothing is held out"):
        validate_sim(bundle, load_held_out(everything), 0.04)


def test_cli_writes_the_json_and_exits_by_the_verdict(tmp_path: Path, document: dict) -> None:
    out = tmp_path / "validate.json"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "sim", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == (0 if document["passed"] else 1), done.stderr[-2000:]
    written = json.loads(out.read_text())
    assert written["held_out_mean_abs_error"] == pytest.approx(document["held_out_mean_abs_error"])
    assert ("PASSED" if document["passed"] else "FAILED") in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "sim", "--tolerance", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --tolerance 2.0")


def test_ranks_sharing_cores_scale_the_main_thread_and_a_missing_core_count_is_said(document: dict) -> None:
    import dataclasses

    import pandas as pd

    from sim.predict import core_sharing, predict_iteration_s

    def run(clock: str | None, cpus: int | None, world: int = 4, per_node: int = 2) -> pd.Series:
        versions = {k: v for k, v in (("clock", clock), ("host_cpus", cpus)) if v is not None}
        return pd.Series({"versions": json.dumps(versions), "world_size": world, "gpus_per_node": per_node})

    assert core_sharing(run("shared", 2)) == 2.0  # 4 ranks of one host on 2 cores
    assert core_sharing(run("shared", 8)) == 1.0  # never faster than one core per rank
    assert core_sharing(run(None, 1)) == 2.0  # one host per node: gpus_per_node ranks share it
    assert core_sharing(run("shared", None)) is None
    topology = [row for row in document["held_out"] if row["category"] == "topology"]
    assert all("× 2 (core sharing)" in row["basis"] for row in topology)

    bundle = traces.read_bundle(traces.measured_bundle_path())
    unrecorded = bundle.runs.assign(versions=bundle.runs["versions"].str.replace('"host_cpus": 2', '"x": 0'))
    stripped = dataclasses.replace(bundle, runs=unrecorded)
    seen = stripped.runs[stripped.runs["cluster"] == "emulated-2x1-1gbit"]
    target = stripped.runs[
        (stripped.runs["cluster"] == "emulated-2x2-1gbit") & (stripped.runs["layers"] == 2)
    ]
    prediction = predict_iteration_s(
        dataclasses.replace(stripped, runs=seen), target[target["system"] == "zero3"].iloc[0]
    )
    assert "host cores not recorded, main-thread times not scaled" in prediction.basis


def test_measurement_noise_is_computed_from_the_measurements_alone() -> None:
    import dataclasses

    import pandas as pd

    from validation.sim_check import measurement_noise

    bundle = traces.read_bundle(traces.measured_bundle_path())
    runs = bundle.runs[bundle.runs["cluster"] == "emulated-2x1-1gbit"].copy()
    runs = runs[runs["system"] == "fsdp"]
    # Exactly linear in depth, with iterations 1.0 and 1.2 of the line's value: spread 0.2 / 1.1.
    iterations = pd.DataFrame(
        [
            {"run_id": r.run_id, "iteration": i, "iteration_s": (0.1 + 0.05 * r.layers) * factor}
            for r in runs.itertuples()
            for i, factor in enumerate((1.0, 1.2))
        ]
    )
    noise = measurement_noise(dataclasses.replace(bundle, iterations=iterations), runs)
    assert noise["timed_iterations_per_run"] == 2
    assert noise["iteration_spread_mean"] == pytest.approx(0.2 / 1.1)
    assert noise["depth_line_residual_max"] == pytest.approx(0.0, abs=1e-9)
