"""benchmarks/compute_after_gather.py: a tiny run times the compute block after each kind of gather, CIERA's
gathers exact against the raw gather's; bad arguments are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_tiny_run_times_the_block_after_each_gather_and_gathers_exactly(tmp_path: Path) -> None:
    out = tmp_path / "compute_after_gather.json"
    done = run_benchmark(
        "compute_after_gather.py", "--json", str(out), "--segments", "6", "--rounds", "3", "--shards", "4",
        "--values", "2048", timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [rank["rank"] for rank in result["ranks"]] == [0, 1]
    assert result["rounds_timed"] == 2 and not result["pinned"]
    for rank in result["ranks"]:
        assert rank["mismatches"] == 0
        assert set(rank["modes"]) == {"none", "plain", "ciera"}
        for mode in rank["modes"].values():
            assert mode["segments"] == 12  # 6 per round, 2 timed rounds
            assert mode["wall_median_us"] > 0 and mode["cpu_median_us"] > 0
        assert rank["modes"]["none"]["wall_median_over_none"] == 1.0
    assert "after a ciera gather" in done.stderr


def test_bad_arguments_are_one_line_errors() -> None:
    for args, expected in (
        (("--segments", "0"), "--segments 0: expected >= 1"),
        (("--rounds", "1"), "expected >= 2 (the first one is warm-up)"),
        (("--values", "-3"), "--values -3: expected >= 1"),
        (("--shards", "x"), "invalid int value"),
    ):
        done = run_benchmark("compute_after_gather.py", *args, timeout=60)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert expected in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
