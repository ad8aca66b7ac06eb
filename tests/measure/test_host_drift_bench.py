"""benchmarks/host_drift.py: fixed blocks of work timed on every core, summarised as the spread a capture's
noise line is measured as; its figures follow from the block times it reports; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _bench_script import load_benchmark, run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_short_run_times_blocks_on_each_worker_and_summarises_them(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    done = run_benchmark(
        "host_drift.py", "--seconds", "1.5", "--block-s", "0.1", "--workers", "2", "--json", str(out),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["workers"]) == 2
    summarise = load_benchmark("host_drift").summarize
    for worker in result["workers"]:
        assert worker["blocks"] == len(worker["blocks_s"]) >= 3
        assert worker["matmuls_per_block"] >= 1
        # Each worker's figures are its own block times' (recomputed here, not trusted).
        assert {k: worker[k] for k in summarise(worker["blocks_s"])} == pytest.approx(
            summarise(worker["blocks_s"])
        )
    spreads = [worker["spread"] for worker in result["workers"]]
    assert result["all_workers"]["spread_max"] == max(spreads)
    assert result["all_workers"]["spread_mean"] == pytest.approx(sum(spreads) / 2)
    assert 0.0 <= result["host"]["other_cpu_share"] <= 1.0 and 0.0 <= result["host"]["steal_share"] <= 1.0


def test_the_summary_of_known_block_times() -> None:
    figures = load_benchmark("host_drift").summarize([1.0, 1.0, 1.2, 1.1, 1.0, 0.9, 1.0])
    assert figures["median_s"] == 1.0 and figures["fastest_s"] == 0.9 and figures["slowest_s"] == 1.2
    assert figures["spread"] == pytest.approx(0.3)
    # 1.2 and 1.1 are ≥ 5 % over the median and consecutive: one slow phase of 2.3 s.
    assert figures["longest_slow_phase_s"] == pytest.approx(2.3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seconds", "0"], "--seconds 0.0: expected a positive number of seconds"),
        (
            ["--seconds", "2", "--block-s", "3"],
            "--block-s 3.0: expected a positive time no longer than --seconds",
        ),
        (["--workers", "0"], "--workers 0: expected at least 1"),
        (["--seconds", "soon"], "argument --seconds: invalid float value: 'soon'"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    done = run_benchmark("host_drift.py", *args, timeout=60)
    assert done.returncode == 2
    assert done.stdout.strip() == f"host_drift: error: {message}" and "Traceback" not in done.stderr


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_both_kinds_of_work_are_timed_in_the_same_windows(tmp_path: Path) -> None:
    """`--work both`: every worker alternates a matmul and a Python block; each kind summarised apart, the
    top-level figures the first kind's (matmul)."""
    out = tmp_path / "drift.json"
    done = run_benchmark(
        "host_drift.py", "--seconds", "1.5", "--block-s", "0.1", "--workers", "1", "--work", "both",
        "--json", str(out), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["work"] == "both" and set(result["by_work"]) == {"matmul", "python"}
    assert result["workers"] == result["by_work"]["matmul"]["workers"]
    summarise = load_benchmark("host_drift").summarize
    (matmul,), (python,) = result["by_work"]["matmul"]["workers"], result["by_work"]["python"]["workers"]
    # Alternating blocks: one of each per round, the last round possibly cut after its matmul block.
    assert python["iterations_per_block"] >= 1 and matmul["matmuls_per_block"] >= 1
    assert len(matmul["blocks_s"]) - len(python["blocks_s"]) in (0, 1) and len(python["blocks_s"]) >= 3
    assert {k: python[k] for k in summarise(python["blocks_s"])} == pytest.approx(
        summarise(python["blocks_s"])
    )
    bad = run_benchmark("host_drift.py", "--work", "gpu", timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stdout.strip().startswith("host_drift: error: argument --work: invalid choice: 'gpu'")
