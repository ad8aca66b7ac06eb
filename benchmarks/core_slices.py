"""How this host's cores are shared when more threads want them than it has, and how that shows in a
bundle's runs — the figures behind "Ranks sharing cores: time slices, not even sharing"
(docs/validation.md). The simulator's evaluator shares a host's cores evenly moment by moment
(processor sharing: three ranks on two cores each at 2/3 speed); this measures what the kernel does.

    python benchmarks/core_slices.py [--processes 2,3,4] [--seconds 4] [--segments-ms 0.5,2,8]
        [--bundle measured] [--json F]

- **Host** (``host``): for each count k of ``--processes``, k processes spin for ``--seconds``, each
  reading the clock in a tight loop. A jump of more than 50 µs between two readings is time the process
  was not running (``descheduled_ms``: quantiles of those gaps), and the time between two jumps is how long
  it ran in one go (``ran_ms``); ``descheduled_share``: the share of its time it did not run.
- **Coupled** (``coupled``): ranks that wait for each other, as a collective makes them. For each segment
  length of ``--segments-ms`` and each count k (and 1), k processes each run rounds of the same fixed CPU
  work (a loop calibrated to the segment on one idle core), every round ending at a barrier of all k.
  ``round_ms``: the slowest process's time per round; ``over_one``: that over one process's;
  ``even_sharing``: what even sharing of the host's cores gives, max(1, k / cores).
- **Bundle** (``runs``, with ``--bundle``): for each system and depth with a run on a 2 × 1 cluster and
  on a cluster whose ranks share the host's cores more (3 × 1, 2 × 2) at the same link rate, each main
  thread ``compute`` segment of the shared-cores run against the median of the same segment (the k-th of
  its rank's iteration) over the 2 × 1 run's ranks and iterations: the quantiles of that ratio
  (``segment_ratio``), and the ratio of their sums per rank and iteration (``sum_ratio``). Even sharing
  would stretch every segment alike.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import traces  # noqa: E402

GAP_S = 50e-6  # a clock jump longer than this: the process was not running
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
SHARED_TOPOLOGIES = ("3x1", "2x2")


def _spin(seconds: float, results) -> None:
    gaps, runs = [], []
    start = last = run_start = time.perf_counter()
    while last - start < seconds:
        now = time.perf_counter()
        if now - last > GAP_S:
            gaps.append(now - last)
            runs.append(last - run_start)
            run_start = now
        last = now
    results.put((gaps, runs[1:], last - start))


def _in_processes(context, count: int, target, *args) -> list:
    """Run `target(*args, results)` in `count` processes at once; what each put on `results`."""
    results = context.SimpleQueue()
    processes = [context.Process(target=target, args=(*args, results)) for _ in range(count)]
    for process in processes:
        process.start()
    done = [results.get() for _ in processes]
    for process in processes:
        process.join()
    return done


def _loop(iterations: int) -> int:
    total = 0
    for step in range(iterations):
        total += step
    return total


def _coupled(iterations: int, rounds: int, barrier, results) -> None:
    barrier.wait()
    start = time.perf_counter()
    for _ in range(rounds):
        _loop(iterations)
        barrier.wait()
    results.put(time.perf_counter() - start)


def coupled_rounds(counts: list[int], segments_s: list[float], seconds_each: float = 0.75) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    start = time.perf_counter()
    _loop(2_000_000)
    per_iteration_s = (time.perf_counter() - start) / 2_000_000
    rows = []
    for segment_s in segments_s:
        rounds = max(int(seconds_each / segment_s), 10)
        alone = None
        for count in sorted({1, *counts}):
            barrier = context.Barrier(count)
            iterations = int(segment_s / per_iteration_s)
            round_s = max(_in_processes(context, count, _coupled, iterations, rounds, barrier)) / rounds
            alone = round_s if count == 1 else alone
            rows.append({
                "segment_ms": 1e3 * segment_s, "processes": count, "round_ms": 1e3 * round_s,
                "over_one": round_s / alone, "even_sharing": max(1.0, count / cores),
            })  # fmt: skip
    return rows


def _quantiles_ms(values: list[float]) -> list[float] | None:
    return [round(1e3 * float(q), 3) for q in np.quantile(values, QUANTILES)] if values else None


def host_slices(counts: list[int], seconds: float) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for count in counts:
        measured = _in_processes(context, count, _spin, seconds)
        gaps = [gap for done in measured for gap in done[0]]
        runs = [run for done in measured for run in done[1]]
        rows.append({
            "processes": count,
            "descheduled_ms": _quantiles_ms(gaps),
            "ran_ms": _quantiles_ms(runs),
            "descheduled_share": sum(gaps) / sum(done[2] for done in measured),
        })  # fmt: skip
    return rows


def _segments(events: pd.DataFrame) -> pd.DataFrame:
    compute = events[events["stream"] == "compute"].sort_values(["iteration", "rank", "start_s"])
    return pd.DataFrame({
        "rank": compute["rank"].to_numpy(),
        "k": compute.groupby(["iteration", "rank"]).cumcount().to_numpy(),  # its place in its rank's iteration
        "duration_s": (compute["end_s"] - compute["start_s"]).to_numpy(),
        "iteration": compute["iteration"].to_numpy(),
    })  # fmt: skip


def _per_rank_iteration_s(segments: pd.DataFrame) -> float:
    return float(segments["duration_s"].sum()) / segments.groupby(["iteration", "rank"]).ngroups


def segment_stretch(bundle: traces.TraceBundle) -> list[dict]:
    """Per (system, depth) and shared-cores topology with a 2 × 1 twin at its link rate: `runs` rows."""
    runs = bundle.runs_with_events()
    rows = []
    for (system, layers), chosen in runs.groupby(["system", "layers"], sort=True):
        shapes = {
            (f"{int(run.nodes)}x{int(run.world_size) // int(run.nodes)}", float(run.link_rate_Bps)): run
            for run in chosen.itertuples()
        }
        for (shape, rate), other in sorted(shapes.items()):
            base = shapes.get(("2x1", rate))
            if shape not in SHARED_TOPOLOGIES or base is None:
                continue
            reference = _segments(bundle.events[bundle.events["run_id"] == base.run_id])
            medians = reference.groupby("k")["duration_s"].median()
            segments = _segments(bundle.events[bundle.events["run_id"] == other.run_id])
            baseline = medians.reindex(segments["k"]).to_numpy()
            known = np.isfinite(baseline) & (baseline > 0)
            ratio = segments["duration_s"].to_numpy()[known] / baseline[known]
            rows.append({
                "system": str(system), "layers": int(layers),
                "base_run": str(base.run_id), "shared_run": str(other.run_id),
                "segment_ratio": [round(float(q), 3) for q in np.quantile(ratio, QUANTILES)],
                "sum_ratio": _per_rank_iteration_s(segments) / _per_rank_iteration_s(reference),
            })  # fmt: skip
    return rows


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,3,4", help="spinning process counts (default 2,3,4)")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each count spins (default 4)")
    parser.add_argument(
        "--segments-ms", default="0.5,2,8", help="coupled rounds' segment lengths, ms (default 0.5,2,8)"
    )
    parser.add_argument("--bundle", default=None, help="also read this bundle's runs (name or directory)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        counts = [int(part) for part in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes {args.processes!r}: expected comma-separated counts")
    if not counts or min(counts) < 1 or not 0 < args.seconds <= 600:
        parser.error(
            f"--processes {args.processes!r} / --seconds {args.seconds}: expected counts >= 1, (0, 600] s"
        )
    try:
        segments_s = [float(part) / 1e3 for part in args.segments_ms.split(",")]
    except ValueError:
        parser.error(f"--segments-ms {args.segments_ms!r}: expected comma-separated lengths in ms")
    if not segments_s or not all(0 < value <= 1.0 for value in segments_s):
        parser.error(f"--segments-ms {args.segments_ms!r}: expected lengths in (0, 1000] ms")
    bundle = None
    if args.bundle is not None:  # read first: a bad path fails before a minute of measuring
        try:
            bundle = traces.read_bundle(traces.resolve_bundle(args.bundle))
        except (traces.TraceError, OSError) as error:  # one line, no traceback
            parser.exit(2, f"core_slices.py: {error}\n")
    result: dict = {
        "benchmark": "core_slices",
        "seconds": args.seconds,
        "host": host_slices(counts, args.seconds),
        "coupled": coupled_rounds(counts, segments_s),
    }
    if bundle is not None:
        result["bundle"] = args.bundle
        result["runs"] = segment_stretch(bundle)
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
