"""How steady this host's CPU speed is with nothing else running: the noise floor of any capture on it.

    python benchmarks/host_drift.py --json out/host_drift.json [--seconds 120] [--block-s 1.4] [--workers N]
        [--work matmul|python|both]

One single-threaded worker process per core (default: every core) times the same fixed block of work
again and again for ``--seconds``: 256 × 256 float32 matmuls with torch, the kind of work a rank's
compute is, each block sized at the start to take about ``--block-s`` (a run's iteration is 0.3–6 s
here). ``--work python`` times a loop of Python integer arithmetic instead (the interpreter alone, no
allocation: the kind of work an engine's hooks and a runtime's per-call code are); ``--work both``
alternates a block of each in every worker, so both are timed in the same windows and each is the
other's baseline (``by_work``: per kind, the same figures; the top-level ones are the first kind's).
Nothing else should run meanwhile; the host's own counters say what else did, over the whole run
(`measure.launch.host_cpu_record`, as `ciera measure` records it per run): the CPU share of other
processes, and the hypervisor's steal time (Linux ``/proc/stat``).

Per worker: the median block time, the fastest (the baseline, measured in the same
run), ``spread`` = (slowest − fastest) / median (what a run's timed iterations' spread is measured as
in `ciera validate sim`'s noise line), ``p90_over_median``, and the longest stretch of consecutive blocks
at least 5 % slower than the median, in seconds (a slow phase long enough to take a whole run with it);
over all workers (``all_workers``), the mean and largest spread, the largest p90 / median and slow phase.

A capture of ``ciera measure`` on a host whose blocks of fixed work drift by X % cannot be checked to
better than about X % per run: `ciera validate sim`'s held-out errors include that drift.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's packages

MATMUL_SIZE = 256
SLOW_PHASE_FACTOR = 1.05  # a block this much slower than the median counts toward a slow phase


def _python_block(iterations: int) -> float:
    start = time.perf_counter()
    total = 0
    for value in range(iterations):
        total += value * 3 % 7
    return time.perf_counter() - start


def _worker(
    seconds: float, block_s: float, start_at: float, queue, kinds: tuple[str, ...] = ("matmul",)
) -> None:
    import gc

    import torch

    gc.disable()  # the Python block allocates nothing; the collector's pauses are not the host's speed
    torch.set_num_threads(1)
    left = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    right = torch.randn(MATMUL_SIZE, MATMUL_SIZE)

    def matmul_block(matmuls: int) -> float:
        start = time.perf_counter()
        for _ in range(matmuls):
            torch.mm(left, right)
        return time.perf_counter() - start

    blocks = {"matmul": matmul_block, "python": _python_block}
    probes = {"matmul": 50, "python": 200_000}
    blocks["matmul"](20)  # warm the kernels
    sizes = {
        kind: max(int(probes[kind] * block_s / max(blocks[kind](probes[kind]), 1e-9)), 1) for kind in kinds
    }
    while time.time() < start_at:  # every worker starts its timed blocks together
        time.sleep(0.001)
    timed: dict[str, list[float]] = {kind: [] for kind in kinds}
    end = time.time() + seconds
    while time.time() < end:
        for kind in kinds:
            timed[kind].append(blocks[kind](sizes[kind]))
    queue.put({"sizes": sizes, "blocks_s": timed})


def summarize(blocks_s: list[float]) -> dict[str, float]:
    """The figures of one list of block times (see the module docstring)."""
    import numpy as np

    times = np.asarray(blocks_s, dtype=float)
    median = float(np.median(times))
    longest = current = 0.0
    for value in times:
        current = current + value if value >= SLOW_PHASE_FACTOR * median else 0.0
        longest = max(longest, current)
    return {
        "blocks": int(times.size),
        "median_s": median,
        "fastest_s": float(times.min()),
        "slowest_s": float(times.max()),
        "spread": float((times.max() - times.min()) / median),
        "p90_over_median": float(np.percentile(times, 90) / median),
        "longest_slow_phase_s": float(longest),
    }


def _summarize_workers(kind: str, results: list[dict]) -> dict:
    """One kind of block over every worker: each worker's figures, and the relative ones pooled (each
    worker's block is sized on its own, so only the relative figures are pooled)."""
    per_worker = [summarize(result["blocks_s"][kind]) for result in results]
    return {
        "all_workers": {
            "spread_mean": sum(w["spread"] for w in per_worker) / len(per_worker),
            "spread_max": max(w["spread"] for w in per_worker),
            "p90_over_median_max": max(w["p90_over_median"] for w in per_worker),
            "longest_slow_phase_s": max(w["longest_slow_phase_s"] for w in per_worker),
        },
        "workers": [
            {
                f"{'matmuls' if kind == 'matmul' else 'iterations'}_per_block": result["sizes"][kind],
                **figures,
                "blocks_s": result["blocks_s"][kind],
            }
            for result, figures in zip(results, per_worker, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long each worker times blocks")
    parser.add_argument("--block-s", type=float, default=1.4, help="the time one block should take")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument(
        "--work",
        choices=("matmul", "python", "both"),
        default="matmul",
        help="what a block does: torch matmuls, Python arithmetic, or both alternately",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        parser.error(f"--seconds {args.seconds}: expected a positive number of seconds")
    if not 0 < args.block_s <= args.seconds:
        parser.error(f"--block-s {args.block_s}: expected a positive time no longer than --seconds")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: expected at least 1")

    from measure.launch import host_cpu_record, host_cpu_sample

    kinds = ("matmul", "python") if args.work == "both" else (args.work,)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start_at = time.time() + 5.0  # time for every worker to import torch and size its block
    workers = [
        context.Process(target=_worker, args=(args.seconds, args.block_s, start_at, queue, kinds))
        for _ in range(args.workers)
    ]
    # Around the whole run, workers reaped: their CPU is the benchmark's own, the rest is other processes'.
    before = host_cpu_sample()
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=args.seconds + 120) for _ in workers]
    for worker in workers:
        worker.join()
    after = host_cpu_sample()
    host = {"window_s": args.seconds, **host_cpu_record(before, after)}
    by_work = {kind: _summarize_workers(kind, results) for kind in kinds}
    emit_json(
        {
            "benchmark": "host_drift",
            "work": args.work,
            "matmul_size": MATMUL_SIZE,
            "block_s_asked": args.block_s,
            "host": host,
            **by_work[kinds[0]],
            "by_work": by_work,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
