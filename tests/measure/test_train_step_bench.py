"""benchmarks/train_step.py: bad arguments are one line and exit 2; a tiny loopback run (slow: two ranks,
four systems, real DeepSpeed and FSDP2 steps) writes a well-formed JSON with bit-identical losses, also
after a warm start (every system resumed from its engine's plain checkpoint)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _bench_script import run_benchmark  # noqa: E402


def _run(*args: str, timeout: float = 60, env: dict | None = None):
    return run_benchmark("train_step.py", *args, timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--steps", "0"], "--steps is 0"),
        (["--warmup", "-1"], "--warmup is -1"),
        (["--layers", "0"], "--layers is 0"),
        (["--global-batch", "3"], "--global-batch is 3"),
        (["--rate", "fast"], "--rate 'fast'"),
        (["--systems", "zero3,zero2"], "--systems"),
        (["--systems", "fsdp,fsdp"], "--systems"),
        (["--link", "wifi"], "--link"),
        (["--steps", "two"], "--steps"),
        (["--probe-mib", "0"], "--probe-mib is 0"),
        (["--warm-steps", "-1"], "--warm-steps is -1"),
        (["--block-size", "100"], "--block-size is 100: expected a power of two"),
        (["--block-size", "0"], "--block-size is 0"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], words: str) -> None:
    done = _run(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("train_step: error:") and words in lines[0]


def test_netns_without_root_is_one_line_and_exit_2() -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root")
    done = _run("--link", "netns")
    assert done.returncode == 2
    assert len((done.stdout + done.stderr).strip().splitlines()) == 1


@pytest.mark.slow
def test_tiny_loopback_run_is_well_formed_and_bit_identical(tmp_path) -> None:
    out = tmp_path / "train_step.json"
    done = _run(
        "--json", str(out), "--link", "loopback", "--steps", "1", "--warmup", "1", "--rounds", "1",
        "--layers", "1", "--seq-len", "16", "--probe-mib", "0.25",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "ciera.bench.train_step/1"
    assert result["config"]["layers"] == 1 and result["config"]["timed_steps"] == 1
    assert set(result["systems"]) == {"zero3", "zero3+ciera", "fsdp", "fsdp+ciera"}
    for system, figures in result["systems"].items():
        assert figures["step_ms"]["median"] > 0
        assert figures["step_ms"]["p10"] <= figures["step_ms"]["median"] <= figures["step_ms"]["p90"]
        assert figures["raw_bytes_per_step"] > 0
        if "+" in system:
            assert 0.45 < figures["r"] < 1.0
        else:
            assert figures["r"] == 1.0
    assert set(result["comparisons"]) == {"zero3 vs zero3+ciera", "fsdp vs fsdp+ciera"}
    for comparison in result["comparisons"].values():
        assert comparison["loss_bits_identical_every_step"] is True
        assert comparison["final_parameters_identical"] is True
        assert comparison["raw_bytes_equal"] is True
        assert comparison["allgather_bytes_bound_1_over_r"] == pytest.approx(1 / comparison["r"], rel=1e-2)
        profile = comparison["profile"]
        assert profile["profiled_losses_identical"] is True
        assert profile["T_allgather_ms"] > 0 and profile["T_compute_ms"] > 0
        assert profile["bound_speedup"] > 0 and profile["bound_speedup"] >= profile["overlap_only_speedup"]
        assert profile["collective_calls_per_profiled_run"]["all_gather_single"] > 0
    assert result["link"]["gloo_probe_before"]["MBps_per_rank"] > 0
    assert len(result["load_average_before"]) == 3


@pytest.mark.slow
def test_warm_start_resumes_every_system_from_its_engines_plain_checkpoint(tmp_path) -> None:
    out, scratch = tmp_path / "train_step.json", tmp_path / "tmp"
    scratch.mkdir()
    done = _run(
        "--json", str(out), "--link", "loopback", "--steps", "1", "--warmup", "1", "--rounds", "1",
        "--layers", "1", "--seq-len", "16", "--probe-mib", "0.25", "--warm-steps", "3",
        "--block-size", "256",
        timeout=600, env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["warm_steps"] == 3 and result["config"]["first_timed_step"] == 4
    assert result["config"]["block_size"] == 256 and result["config"]["train_config"]["block_size"] == 256
    assert result["config"]["train_config"]["resume"] is True
    warm = result["warm"]
    assert warm["link"] == "loopback" and set(warm["engines"]) == {"zero3", "fsdp"}
    for engine in warm["engines"].values():
        assert engine["steps"] == 3 and engine["final_parameters_equal_across_ranks"] is True
        assert 0 < engine["final_loss"] < 20
    for system in result["systems"].values():
        assert len(system["losses"]) == 2  # steps 3 and 4: warm-up and timed, after the checkpoint
    for comparison in result["comparisons"].values():  # a plain checkpoint loads into the CIERA engine
        assert comparison["loss_bits_identical_every_step"] is True
        assert comparison["final_parameters_identical"] is True
    assert "warm start: 3 steps" in done.stdout
    assert not list(scratch.glob("ciera-train-step-*"))  # the checkpoints' directory is removed at exit
