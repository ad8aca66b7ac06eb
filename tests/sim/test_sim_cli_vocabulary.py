"""The CLI knows its own vocabulary: versions, listings of models and clusters, short model names, and
one-line refusals of what cannot be meant (duplicates, absurd world sizes, outputs into missing
directories), with hints that name the fix."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import traces
from sim import SimInputError
from sim.simulate import check_output_path, resolve_models


def _ciera(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", *arguments], capture_output=True, text=True, timeout=300
    )


def _one_line_error(done: subprocess.CompletedProcess[str], expected: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_version_models_and_clusters_are_listed() -> None:
    version = _ciera("--version")
    assert version.returncode == 0 and version.stdout.startswith("ciera ")
    models = _ciera("models")
    assert models.returncode == 0 and "short names" in models.stdout and "olmoe" in models.stdout
    clusters = _ciera("clusters")
    assert clusters.returncode == 0
    assert "a100-hdr-testbed" in clusters.stdout and "emulated-2x2-200mbit" in clusters.stdout
    # A bad --bundle is refused before anything is printed (the presets table came first).
    missing = _ciera("clusters", "--bundle", "/nonexistent-bundle")
    _one_line_error(missing, "/nonexistent-bundle: not a trace bundle directory")
    assert missing.stdout == ""
    help_text = " ".join(re.sub("[│╭╮╰╯─]", " ", _ciera("simulate", "--help").stdout).split())
    for phrase in ("ciera models", "ciera clusters", "ZeRO++", "benefit-driven", "critical path"):
        assert phrase in help_text


def test_short_names_any_case_and_no_model_twice() -> None:
    bundle = traces.read_bundle(traces.default_bundle_path())
    assert resolve_models(bundle, ["olmoe", "MIXTRAL", "Qwen2-57B-A14B"]) == [
        "OLMoE-1B-7B", "Mixtral-8x7B", "Qwen2-57B-A14B",
    ]  # fmt: skip
    with pytest.raises(SimInputError, match="names OLMoE-1B-7B again"):
        resolve_models(bundle, ["olmoe", "olmoe-1b-7b"])
    with pytest.raises(SimInputError, match="'gpt-5' is not in the bundle.*ciera models"):
        resolve_models(bundle, ["gpt-5"])


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--gpus", "1000000"], "--gpus: value 1000000, expected at most 65536"),
        (["--gpus", "16,16"], "--gpus: 16 given twice"),
        (["--systems", "zero3,ciera,zero3"], "--systems: zero3 given twice"),  # printed every row twice
        (["--models", "olmoe,OLMoE-1B-7B"], "names OLMoE-1B-7B again"),
        (["--json", "/nonexistent-ciera-dir/x.json"], "directory /nonexistent-ciera-dir does not exist"),
        (["--timeline", "/nonexistent-ciera-dir/t.json"], "directory /nonexistent-ciera-dir does not exist"),
    ],
)
def test_simulate_refuses_what_cannot_be_meant(arguments: list[str], expected: str) -> None:
    _one_line_error(_ciera("simulate", *arguments), expected)
    assert not Path("/nonexistent-ciera-dir").exists()


def test_an_output_is_never_written_into_a_directory_created_on_the_way(tmp_path: Path) -> None:
    with pytest.raises(SimInputError, match="does not exist"):
        check_output_path(tmp_path / "a" / "b" / "x.json", "--json")
    assert not (tmp_path / "a").exists()


def test_simulate_ends_with_the_summary() -> None:
    done = _ciera(
        "simulate", "--models", "OLMOE", "--gpus", "8,16", "--dtype", "bf16", "--systems", "zero3,ciera"
    )
    assert done.returncode == 0, done.stderr[-1500:]
    summary_at, table_at = done.stdout.index("Summary"), done.stdout.index("Simulated iteration time")
    assert table_at < summary_at and "CIERA pays" in done.stdout
    # The summary is the last thing printed: its caption's last line closes the output.
    assert done.stdout.rstrip().splitlines()[-1].strip().endswith("not measurements.")


def test_bundle_errors_name_the_fix(tmp_path: Path) -> None:
    bundle = traces.read_bundle(traces.default_bundle_path())
    small = dataclasses.replace(bundle, runs=bundle.runs.iloc[:1])
    small = dataclasses.replace(
        small,
        layers=bundle.layers[bundle.layers["run_id"].isin(small.runs["run_id"])],
        iterations=bundle.iterations[bundle.iterations["run_id"].isin(small.runs["run_id"])],
        exponents=bundle.exponents[bundle.exponents["run_id"].isin(small.runs["run_id"])],
        events=bundle.events[bundle.events["run_id"].isin(small.runs["run_id"])],
    )
    target = traces.write_bundle(small, tmp_path / "b")
    with pytest.raises(traces.TraceError, match="--overwrite"):
        traces.write_bundle(small, target)
    runs = pq.read_table(target / "runs.parquet").to_pandas()
    runs.to_parquet(target / "runs.parquet")  # what an edit with pandas does: the schema metadata is gone
    with pytest.raises(traces.TraceError, match="traces.write_bundle"):
        traces.read_bundle(target)
