"""benchmarks/core_slices.py: how a shared-cores run's compute segments stretch against the 2 × 1 run's,
segment by segment, and the host's turns; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark, one_line_error, run_benchmark  # noqa: E402


def _run(run_id: str, nodes: int, world_size: int, link_rate_Bps: float = 25e6) -> dict:
    return {"run_id": run_id, "system": "zero3", "layers": 2, "nodes": nodes, "world_size": world_size,
            "link_rate_Bps": link_rate_Bps}  # fmt: skip


def _events(run_id: str, ranks: int, durations_s: list[float], iterations: int = 2) -> list[dict]:
    rows = []
    for iteration in range(iterations):
        for rank in range(ranks):
            start = 0.0
            for duration in durations_s:
                rows.append({"run_id": run_id, "iteration": iteration, "rank": rank, "stream": "compute",
                             "start_s": start, "end_s": start + duration})  # fmt: skip
                start += duration + 1e-3
    return rows


def _bundle(runs: list[dict], events: list[dict]) -> SimpleNamespace:
    frame = pd.DataFrame(runs)
    return SimpleNamespace(runs_with_events=lambda: frame, events=pd.DataFrame(events))


def test_a_segment_that_waits_out_a_turn_shows_in_the_quantiles_not_only_in_the_sum() -> None:
    # Four segments of 1 ms on 2 × 1; on 3 × 1 two of them run as fast and two take 3 ms (they waited).
    bundle = _bundle(
        [_run("base", 2, 2), _run("shared", 3, 3)],
        _events("base", 2, [1e-3] * 4) + _events("shared", 3, [1e-3, 3e-3, 1e-3, 3e-3]),
    )
    (row,) = load_benchmark("core_slices").segment_stretch(bundle)
    assert (row["base_run"], row["shared_run"]) == ("base", "shared")
    assert row["sum_ratio"] == pytest.approx(2.0)
    low, _, median, _, high = row["segment_ratio"]
    assert low == pytest.approx(1.0) and high == pytest.approx(3.0) and median == pytest.approx(2.0)


def test_runs_at_another_link_rate_or_without_a_2x1_twin_are_not_compared() -> None:
    bundle = _bundle(
        [_run("base", 2, 2), _run("other-rate", 3, 3, link_rate_Bps=125e6), _run("alone", 2, 4)],
        _events("base", 2, [1e-3]) + _events("other-rate", 3, [2e-3]) + _events("alone", 4, [2e-3]),
    )
    assert load_benchmark("core_slices").segment_stretch(bundle)[0]["shared_run"] == "alone"
    bundle = _bundle([_run("other-rate", 3, 3)], _events("other-rate", 3, [2e-3]))
    assert load_benchmark("core_slices").segment_stretch(bundle) == []


def test_one_spinning_process_is_seldom_off_its_core_and_coupled_rounds_are_timed_against_one(
    tmp_path: Path,
) -> None:
    done = run_benchmark(
        "core_slices.py", "--processes", "1", "--seconds", "0.3", "--segments-ms", "5",
        "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    (row,) = result["host"]
    assert row["processes"] == 1
    assert 0.0 <= row["descheduled_share"] < 0.5
    for key in ("descheduled_ms", "ran_ms"):
        assert row[key] is None or (len(row[key]) == 5 and np.all(np.diff(row[key]) >= 0))
    # One process alone: the baseline of its own rounds, about the segment it was calibrated to.
    (alone,) = result["coupled"]
    assert (alone["processes"], alone["segment_ms"], alone["over_one"], alone["even_sharing"]) == (
        1,
        5.0,
        1.0,
        1.0,
    )
    assert 1.0 < alone["round_ms"] < 50.0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--processes", "two"], "expected comma-separated counts"),
        (["--processes", "0"], "expected counts >= 1"),
        (["--seconds", "-1"], "expected counts >= 1"),
        (["--processes", "1", "--seconds", "0.1", "--bundle", "/nonexistent-bundle"], "not a trace bundle"),
        (["--segments-ms", "x"], "expected comma-separated lengths in ms"),
        (["--segments-ms", "0,2"], "expected lengths in (0, 1000] ms"),
        (["--nope"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line(args: list[str], fragment: str) -> None:
    line = one_line_error(run_benchmark("core_slices.py", *args, timeout=120))
    assert fragment in line, line
