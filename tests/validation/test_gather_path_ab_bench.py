"""benchmarks/gather_path_ab.py: the CIERA rewrite with the engine's gather path measured against the same
bundle read without it; a bundle that never recorded the path, or bad input, is one line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark, run_benchmark  # noqa: E402

import traces  # noqa: E402


def test_without_the_path_its_time_is_compute_and_nothing_else_moves() -> None:
    bundle = traces.read_bundle(traces.resolve_bundle("measured"))
    runs = bundle.runs[bundle.runs["layers"] == 2]
    events = bundle.events[bundle.events["run_id"].isin(set(runs["run_id"]))]
    short = (events["end_s"] - events["start_s"] < 2e-4) & (events["stream"] == "compute")
    stream = events["stream"].astype(object).where(~short, "gather_host").astype(events["stream"].dtype)
    recorded = dataclasses.replace(bundle, runs=runs, events=events.assign(stream=stream))
    assert (recorded.events["stream"] == "gather_host").sum() == short.sum() > 0
    stripped = load_benchmark("gather_path_ab").without_gather_path(recorded)
    assert not (stripped.events["stream"] == "gather_host").any()
    assert stripped.events["stream"].tolist() == events["stream"].tolist()
    columns = [c for c in events.columns if c != "stream"]
    assert stripped.events[columns].equals(events[columns])


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_bundle_without_the_path_and_bad_input_are_one_line(tmp_path: Path) -> None:
    held_out = "traces/data/measured.held-out.toml"
    outcomes = {}
    for name, args in {
        "no path": ["--bundle", "measured", "--held-out", held_out],
        "no bundle": ["--bundle", str(tmp_path / "nope"), "--held-out", held_out],
        "no held-out": ["--bundle", "measured", "--held-out", str(tmp_path / "nope.toml")],
        "no arguments": [],
    }.items():
        done = run_benchmark("gather_path_ab.py", *args, timeout=120)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        outcomes[name] = (done.returncode, len(lines))
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in lines[0], (name, lines)
    assert (
        "gather_host"
        in run_benchmark("gather_path_ab.py", "--bundle", "measured", "--held-out", held_out).stderr
    )
    assert outcomes == dict.fromkeys(outcomes, (2, 1))
