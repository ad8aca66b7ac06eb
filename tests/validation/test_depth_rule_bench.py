"""benchmarks/depth_rule.py: the depth rewrite's pooled per-block compute against the anchor's own blocks
and a line's slope, on the held-out depths of the shipped bundle; bad input is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark, one_line_error, run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_the_pooled_blocks_predict_held_out_compute_at_least_as_well_as_the_other_rules() -> None:
    """~13 s. Every cluster and system of the shipped bundle, L = 8 predicted from L = 2, 4, 6 (the
    shipped held-out file's seen depths)."""
    result = load_benchmark("depth_rule").compare("measured", None)
    assert result["traced_depths"] == [2, 4, 6]
    assert len(result["rows"]) == 16  # 4 clusters × 4 systems, each at L = 8
    summary = result["summary"]
    pooled = summary["pooled_blocks"]["mean_abs_error"]
    assert pooled <= summary["anchor_blocks"]["mean_abs_error"]
    assert pooled <= summary["line_slope"]["mean_abs_error"]
    for row in result["rows"]:
        assert row["target_run"].endswith(row["cluster"]) and "-L8-" in row["target_run"]
        assert 0.05 < row["per_block_s"]["pooled_blocks"] < 1.0  # one block's compute, seconds


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bundle", "/nonexistent-bundle"], "not a trace bundle directory"),
        (["--bundle", "measured", "--held-out", "/nonexistent.toml"], "cannot read the held-out file"),
    ],
)
def test_bad_input_is_one_line(args: list[str], expected: str) -> None:
    line = one_line_error(run_benchmark("depth_rule.py", *args))
    assert expected in line and line.startswith("depth_rule.py:"), line
