"""benchmarks/allgather_netns.py: 2 gloo ranks on 2 emulated nodes (measure.emulated) over a tc-limited link.

Slow (spawns two torch processes); needs root and iproute2, skipped otherwise. Checks the gathers were
bit-exact and that the namespaces and interfaces the run created are gone afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = _REPO_ROOT / "benchmarks" / "allgather_netns.py"
_PREFIX = "ciera-m-"


def _netns_names() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _can_run() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "'ip netns' does not work here"
    return None


@pytest.mark.slow
def test_netns_benchmark_bit_exact_and_cleans_up(tmp_path):
    reason = _can_run()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "netns.json"
    process = subprocess.Popen(
        [
            sys.executable, str(_SCRIPT), "--json", str(out), "--rate", "1gbit",
            "--numel", "65536", "--shards", "3", "--iters", "3", "--warmup", "1",
        ],
        cwd=_REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    ours = f"{_PREFIX}{process.pid}-"
    assert not [name for name in _netns_names() if name.startswith(ours)], "namespaces left behind"
    # Nothing was ever created in the root namespace (the veth ends live in the run's namespaces).
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"cm{process.pid}" not in links

    result = json.loads(out.read_text())
    assert result["bit_exact"] is True
    assert result["ccp_overlapped"] in (True, False)
    assert result["compressed_resyncs"] == 0
    modes = result["modes"]
    assert modes["raw"]["bytes_sent_per_gather_per_rank"] == 65536 * 2
    # Sign+mantissa (1 B/value) + bitmap + header + exponents of ~1% of blocks: about half the raw bytes.
    for mode in ("compressed", "ccp"):
        assert 0.45 < modes[mode]["bytes_ratio_vs_raw"] < 0.6
        assert modes[mode]["median_ms"] > 0
    # tbf on both ends of both veths: what each node sends and what it receives.
    assert sum("tbf" in line for line in result["link"]["qdiscs"]) == 4
    assert result["link"]["addresses"] == [f"10.214.{process.pid % 256}.1", f"10.214.{process.pid % 256}.2"]


def test_netns_benchmark_refuses_politely_without_root():
    """Not root: one line, exit 2, no traceback (only checkable when this test is not run as root)."""
    if os.geteuid() == 0:
        pytest.skip("running as root")
    done = subprocess.run(
        [sys.executable, str(_SCRIPT), "--iters", "1"], cwd=_REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stdout.strip().splitlines()) == 1
