"""benchmarks/capture_repeat.py: captures of one plan side by side — the same bundle twice differs by
nothing, a run measured 10 % slower in a second capture differs by what its medians say, and the noise
lines are `ciera validate sim`'s; bundles of different plans and missing bundles are one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import traces
from validation.sim_check import measurement_noise

sys.path.insert(0, str(Path(__file__).parent))
from _bench_script import run_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def measured() -> Path:
    return traces.resolve_bundle("measured")


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_run_slower_in_one_capture_differs_by_its_medians(measured: Path, tmp_path: Path) -> None:
    bundle = traces.read_bundle(measured)
    slow_run = "mixtral-8x7b-w32-zero3-L4-emulated-2x1-200mbit"
    iterations = bundle.iterations.copy()
    iterations.loc[iterations["run_id"] == slow_run, "iteration_s"] *= 1.1
    slower = tmp_path / "slower"
    traces.write_bundle(dataclasses.replace(bundle, iterations=iterations), slower)
    out = tmp_path / "repeat.json"
    arms = f"{measured},{slower}"
    done = run_benchmark("capture_repeat.py", "--bundles", arms, "--bundles", f"{measured},{measured}",
                         "--json", str(out), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first, same = json.loads(out.read_text())["arms"]
    assert first["runs"] == same["runs"] == bundle.iterations["run_id"].nunique() == 64
    # Identical captures differ by nothing; the slowed run by 0.1 / 1.05 of its mean median, no other run.
    assert same["between_bundles_max"] == 0.0
    by_run = first["between_bundles_by_run"]
    assert by_run[slow_run] == pytest.approx(0.1 / 1.05, abs=1e-4)
    assert max(value for run, value in by_run.items() if run != slow_run) == 0.0
    noise = measurement_noise(bundle, bundle.runs[bundle.runs["run_id"].isin(bundle.iterations["run_id"])])
    assert same["bundles"][0]["iteration_spread_mean"] == pytest.approx(noise["iteration_spread_mean"])
    assert same["bundles"][0]["depth_line_residual_max"] == pytest.approx(noise["depth_line_residual_max"])


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_bad_input_is_one_line(measured: Path, tmp_path: Path) -> None:
    for args, expected in (
        (["--bundles", str(tmp_path / "nope")], "not a trace bundle directory"),
        (["--bundles", f"{measured},{traces.resolve_bundle('measured-olmoe')}"], "no run id in common"),
        (["--bundles", ","], "expected comma-separated bundle directories"),
    ):
        done = run_benchmark("capture_repeat.py", *args, timeout=120)
        assert done.returncode == 2 and expected in done.stdout, done.stdout + done.stderr
        assert done.stdout.count("\n") == 1
