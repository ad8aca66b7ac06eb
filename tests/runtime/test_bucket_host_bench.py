"""benchmarks/bucket_host.py: a tiny run gathers every bucket bit for bit and reports the thread time per
call, split into encode, decode and the rest, next to the plain gather's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_tiny_run_times_every_bucket_size_and_gathers_exactly(tmp_path: Path) -> None:
    out = tmp_path / "bucket_host.json"
    done = run_benchmark(
        "bucket_host.py", "--json", str(out), "--values", "4096", "--shards", "1,8", "--iterations", "2",
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    # Per shard count the one-call passes and the per-shard loop, measured in the same run.
    assert [(row["shards"], row["path"]) for row in result["rows"]] == [
        (1, "one_call"), (1, "per_shard"), (8, "one_call"), (8, "per_shard"),
    ]  # fmt: skip
    assert result["one_call_min_shards"] >= 1
    for row in result["rows"]:
        assert row["mismatches"] == 0
        assert row["values_per_shard"] * row["shards"] == 4096
        assert row["ciera_host_us"] > 0 and row["plain_wall_us"] > 0
        assert row["encode_us"] > 0 and row["decode_us"] > 0 and "glue_us" in row
        assert 0 < row["wire_over_raw"] <= 1.0


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_bad_arguments_are_one_line_errors() -> None:
    for args, expected in (
        (("--shards", "0,2"), "expected comma-separated positive integers"),
        (("--values", "3", "--shards", "4"), "expected at least one value per shard"),
        (("--q", "2"), "expected >= 1 and within [0, 1]"),
        (("--one-call-min-shards", "0"), "--one-call-min-shards 0: expected >= 1"),
    ):
        done = run_benchmark("bucket_host.py", *args, timeout=60)
        assert done.returncode == 2
        assert expected in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
