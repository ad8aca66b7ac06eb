"""benchmarks/gpu_check.py on CPU (the same code a GPU runs): bad arguments are one line and exit 2; a tiny
run writes a well-formed JSON whose exactness checks all hold and which says it did not run on a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import one_line_error, run_benchmark  # noqa: E402


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--numel", "0"], "--numel is 0"),
        (["--world", "0"], "--world is 0"),
        (["--q", "1.5"], "--q is 1.5"),
        (["--repeats", "x"], "--repeats"),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], words: str) -> None:
    line = one_line_error(run_benchmark("gpu_check.py", *args))
    assert line.startswith("gpu_check: error:") and words in line, line


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_tiny_cpu_run_is_exact_and_says_it_is_not_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = run_benchmark(
        "gpu_check.py",
        *("--device", "cpu", "--numel", "8192", "--check-numel", "1001", "--world", "3", "--repeats", "1"),
        *("--json", str(out)),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "ciera.bench.gpu_check/1"
    assert result["environment"]["device_is_gpu"] is False
    assert result["bit_exact"] == {"cases": 18, "numel": 1001, "exact": True, "mismatches": []}
    gather = result["emulated_gather"]
    assert gather["exact"] and gather["wrong"] == 0 and gather["shards_rebuilt"] == 3 * 2 * 3
    assert 0.5 < gather["payload_bytes_over_raw"] < 1.0
    # One batch for all sources, not one per source (~300 with the rANS stage's decode, at any W).
    assert 0 < gather["aten_ops_per_shard_rebuild"] < 350
    assert set(result["device_path"]) == {"rans", "none"}
    assert all(part["exact"] is True for part in result["device_path"].values())
    entropy = result["entropy"]
    assert entropy["exact"] is True and entropy["rans_bytes"] < entropy["uncoded_bytes"]
    assert entropy["device"]["identical_to_host"] and entropy["device"]["exact"], entropy["device"]
    assert entropy["device"]["stream_bytes"] < entropy["uncoded_bytes"]
    syncs = result["host_syncs"]
    assert syncs["checked"] is True and syncs["total"] == 0, syncs
    assert set(syncs["host_reads_per_aten_op"]) == {"encode", "repeat_payload", "decode"}
    coded, uncoded = (result["device_path"][name]["payload_bytes_over_raw"] for name in ("rans", "none"))
    assert 0.5 < coded < uncoded < 1.0
    multi = result["multi_rank"]  # DeviceGather over 2 gloo ranks: the code NCCL runs with 2 GPUs
    assert multi["run"] and multi["backend"] == "gloo" and multi["exact"], multi
    assert multi["host_syncs_in_gathers"] == 0 and 0.5 < multi["bytes_over_raw"] < 1.0
    for name in ("split", "split_detect", "merge", "checksum"):
        assert result["kernels"][f"{name}_GBps"] > 0


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_the_whole_check_runs_the_cuda_kernels_in_numbas_simulator(tmp_path: Path) -> None:
    """The device rANS's CUDA kernels (not their CPU twin) through every section — the per-shard path,
    the emulated W-rank gather, the 2-rank gloo gather — on CPU tensors: what the GPU compiles, run here."""
    out = tmp_path / "gpu_check_sim.json"
    done = run_benchmark(
        "gpu_check.py",
        *("--device", "cpu", "--numel", "8192", "--check-numel", "1001", "--world", "3", "--repeats", "1"),
        *("--json", str(out)),
        timeout=300,
        env={"NUMBA_ENABLE_CUDASIM": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    device = result["entropy"]["device"]
    assert device["kernels"] == "CUDA (numba.cuda)" and device["identical_to_host"] and device["exact"]
    assert all(part["exact"] for part in result["device_path"].values())
    assert result["emulated_gather"]["exact"] and result["multi_rank"]["exact"]
    assert result["host_syncs"]["total"] == 0
