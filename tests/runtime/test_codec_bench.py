"""benchmarks/codec.py: a tiny run writes a well-formed JSON in which the entropy stage (rANS) and none
(exponent deltas sent uncoded) are both timed and sized, every payload decoded bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_tiny_run_sizes_and_times_both_entropy_stages(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    done = run_benchmark("codec.py", "--json", str(out), "--numel", "65536", "--repeats", "2", timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stages = json.loads(out.read_text())["entropy_stages"]
    by_key = {(row["entropy"], row["q"]): row for row in stages}
    assert set(by_key) == {(entropy, q) for entropy in ("rans", "none") for q in (0.01, 1.0)}
    for row in stages:
        assert row["encode_us"] > 0 and row["decode_us"] > 0
    for q in (0.01, 1.0):
        coded, uncoded = by_key[("rans", q)]["payload_ratio"], by_key[("none", q)]["payload_ratio"]
        assert 0.5 < coded <= uncoded  # never below the sign+mantissa plane; rANS never adds bytes
    # Every block changed: uncoded, the whole exponent plane travels (as much as raw, plus the bitmap and
    # header — the bucket path then sends the shard raw); coded deltas of one exponent step stay small.
    assert by_key[("none", 1.0)]["payload_ratio"] > 1.0 > 0.6 > by_key[("rans", 1.0)]["payload_ratio"]
