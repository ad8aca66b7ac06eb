"""benchmarks/bytes_only.py: what CIERA's bytes alone buy on a captured run, by the simulator's CIERA rewrite
with the codec's costs at zero; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark, run_benchmark  # noqa: E402

from sim.ciera_rewrite import CodecFigures  # noqa: E402


def _figures() -> CodecFigures:
    """Codec figures with every cost nonzero."""
    return CodecFigures(
        encode_s=(1e-4, 2e-5, 1e-9), decode_s=(5e-5, 1e-5, 2e-9), glue_s_per_gather=3e-4,
        shard_overhead_bytes=40.0, first_ratio=0.55, repeat_ratio=0.5, block_change_rate=0.4,
        overflow_rate=0.02, overflow_s=4e-3, runs=("a",), gather_host_s_per_call=6e-4,
    )  # fmt: skip


def test_bytes_only_keeps_the_bytes_and_drops_every_cost() -> None:
    figures = _figures()
    free = load_benchmark("bytes_only").bytes_only(figures)
    assert (free.encode_s, free.decode_s, free.glue_s_per_gather, free.gather_host_s_per_call) == (
        (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 0.0, None,
    )  # fmt: skip
    costs = ("encode_s", "decode_s", "glue_s_per_gather", "gather_host_s_per_call")
    for name in (f.name for f in dataclasses.fields(CodecFigures) if f.name not in costs):
        assert getattr(free, name) == getattr(figures, name), name


def test_the_kernel_floor_charges_the_codec_calls_per_byte_over_the_engines_cycle() -> None:
    figures = _figures()
    bench = load_benchmark("bytes_only")
    seconds = {"encode_first": 90e-6, "encode_repeat": 30e-6, "decode_first": 40e-6, "decode_repeat": 10e-6}
    numel = 1000  # 2,000 bytes
    zero3 = bench.kernel_floor(figures, "zero3", numel, seconds)  # forward, recompute, backward
    fsdp = bench.kernel_floor(figures, "fsdp", numel, seconds)  # forward, backward
    assert zero3.encode_s == (0.0, 0.0, (90e-6 + 2 * 30e-6) / 3 / 2000)
    assert zero3.decode_s == (0.0, 0.0, (40e-6 + 2 * 10e-6) / 3 / 2000)
    assert fsdp.encode_s == (0.0, 0.0, (90e-6 + 30e-6) / 2 / 2000)
    assert (fsdp.glue_s_per_gather, fsdp.gather_host_s_per_call) == (0.0, None)
    for name in (f.name for f in dataclasses.fields(CodecFigures) if f.name not in ("encode_s", "decode_s")):
        assert getattr(zero3, name) == getattr(bench.bytes_only(figures), name), name


def test_the_kernel_timing_rebuilds_the_shard_it_times() -> None:
    seconds = load_benchmark("bytes_only").kernel_seconds(4096, 64, 0.4, samples=5)
    assert set(seconds) == {"encode_first", "encode_repeat", "decode_first", "decode_repeat"}
    assert all(value > 0 for value in seconds.values())


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_on_the_shipped_bundle_the_bytes_alone_bracket_the_rewrite(tmp_path: Path) -> None:
    out = tmp_path / "bytes_only.json"
    done = run_benchmark(
        "bytes_only.py", "--runs", "L2-emulated-2x1-200mbit", "--json", str(out), timeout=180
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = {row["system"]: row for row in result["rows"]}
    assert set(rows) == {"ciera", "ciera-fsdp"}
    for row in rows.values():
        # Fewer bytes, nothing else: never slower than plain; the codec's costs on top: never faster.
        assert row["plain_s"] >= row["bytes_only_s"] and row["ciera_s"] >= row["bytes_only_s"]
        # The kernels on top of the bytes: never faster than the bytes alone.
        assert row["kernel_floor_s"] >= row["bytes_only_s"]
        assert row["kernel_floor_speedup"] == row["plain_s"] / row["kernel_floor_s"]
        assert row["kernels"]["encode_ns_per_byte"] > 0 and row["kernels"]["decode_ns_per_byte"] > 0
        assert row["bytes_only_speedup"] == row["plain_s"] / row["bytes_only_s"] >= 1.0
        assert row["codec_cost_s"] > 0 and row["in_sample"]  # L = 2 on 2 x 1: the held-out file's codec runs
    # FSDP2's gathers are what its iteration waits for; ZeRO-3's prefetched ones mostly are not.
    assert rows["ciera-fsdp"]["bytes_only_speedup"] > rows["ciera"]["bytes_only_speedup"]
    assert done.stderr.count("bytes only") == done.stderr.count("kernels only") == 2


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_bad_input_is_one_line(tmp_path: Path) -> None:
    outcomes = {}
    for name, args in {
        "no bundle": ["--bundle", str(tmp_path / "nope")],
        "no held-out": ["--held-out", str(tmp_path / "nope.toml")],
        "no twin": ["--runs", "no-such-run"],
        "bad option": ["--layers", "2"],
    }.items():
        done = run_benchmark("bytes_only.py", *args, timeout=120)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        outcomes[name] = (done.returncode, len(lines))
        assert "Traceback" not in done.stderr, (name, done.stderr)
    assert outcomes == dict.fromkeys(outcomes, (2, 1))
