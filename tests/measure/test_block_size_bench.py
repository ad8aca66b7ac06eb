"""benchmarks/block_size.py: bad arguments are one line and exit 2; a tiny run (heavy: two ranks train, the
codec runs over the snapshots) writes a well-formed JSON, decodes every shard bit for bit and names the B
of the smallest r in each window."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _bench_script import run_benchmark  # noqa: E402


def _run(*args: str, timeout: float = 60, env: dict | None = None):
    return run_benchmark("block_size.py", *args, timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--window", "0"], "--window is 0"),
        (["--warm-steps", "5", "--window", "10"], "--warm-steps is 5: expected at least --window (10)"),
        (["--block-sizes", "64,100"], "a block size is 100: expected a power of two"),
        (["--block-sizes", "64,64"], "--block-sizes '64,64': expected distinct"),
        (["--block-sizes", "big"], "--block-sizes 'big'"),
        (["--block-sizes", "0"], "a block size is 0"),
        (["--engine", "ddp"], "--engine"),
        (["--global-batch", "3"], "--global-batch is 3"),
        (["--layers", "0"], "--layers is 0"),
        (["--warm-steps", "many"], "--warm-steps"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], words: str) -> None:
    done = _run(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("block_size: error:") and words in lines[0]


@pytest.mark.heavy  # two ranks train: CI runs it with -m heavy
def test_tiny_run_is_well_formed_and_lossless(tmp_path: Path) -> None:
    out, scratch = tmp_path / "block_size.json", tmp_path / "tmp"
    scratch.mkdir()
    done = _run(
        "--json", str(out), "--warm-steps", "3", "--window", "2", "--layers", "1", "--seq-len", "16",
        "--block-sizes", "64,512",
        timeout=600, env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "ciera.bench.block_size/1"
    assert result["config"]["block_sizes"] == [64, 512] and result["config"]["warm_steps"] == 3
    assert result["training"]["steps"] == 5 and len(result["training"]["losses"]["late"]) == 2
    assert result["training"]["config"]["parameter_snapshot_steps"] == [0, 1, 2, 3, 4, 5]
    for name, steps in (("early", [0, 2]), ("late", [3, 5])):
        window = result["windows"][name]
        assert window["snapshot_steps"] == steps and window["gathers_counted"] == 2
        assert window["lossless"] is True
        for block_size, figures in window["by_block_size"].items():
            assert 0 < figures["changed_block_share"] <= 1
            assert figures["r_floor"] == pytest.approx(0.5 + 1 / (16 * int(block_size)), abs=1e-5)
            assert figures["r_floor"] - 1e-3 < figures["r"] < 1
            assert figures["encode_ms_per_MB"] > 0 and figures["decode_ms_per_MB"] > 0
            assert "expert_ffn" in figures["by_category"]
        best = min((figures["r"], int(b)) for b, figures in window["by_block_size"].items())[1]
        assert result["smallest_r_block_size"][name] == best
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("smallest r: early B = ") and ", late B = " in last
    assert not list(scratch.glob("ciera-block-size-*"))  # the snapshots are removed at exit
