"""Does a cluster's collectives sweep overstate what its runs' collectives cost? A diagnostic of the
held-out misses of `ciera validate sim`, from a bundle alone (no rank is started).

    python benchmarks/sweep_skew.py [--bundle measured] [--cluster emulated-2x2-200mbit]
        [--held-out FILE] [--json FILE]

Sweeps captured before 2026-12-04 timed each collective from the barrier before it, so on a host with
more ranks than cores their mean holds the ranks' barrier-exit skew, which the simulator adds again
itself (a collective ends no earlier than its last participant's issue). Later sweeps time from the last
rank's start (docs/measurement.md). Two views of the same question:

1. **Data only.** Per cluster, the all-gathers of its ZeRO-3 runs at the engine's usual size (the
   median gathered size, ±15 %): the time from the last rank's start to each rank's end (median and
   p90 over every rank, gather and iteration) — the collective's own cost, cross-rank waiting left out —
   beside the simulator's own curve of the cluster's sweep at that size (`sim.sweep_curves`: the
   per-size median of the rows' means, made non-decreasing, log–log between sizes) and its fastest
   repetition.
2. **Through the simulator.** `validate_sim` (what `ciera validate sim` runs) on the bundle as it is, and
   on a copy in memory whose `--cluster` sweep has each size's fastest repetition in place of its mean:
   the held-out errors of that cluster's runs both ways. The fastest repetition is a lower bound of
   what a sweep timed from the last rank's start would give, the mean an upper one; a miss that
   changes sign between the two is explained by how the sweep was timed, one that does not is not.
   The copy is a bracket for a diagnosis, not a model: nothing in `sim` reads the fastest repetition
   as a time.

The figures in README ("What misses") and docs/validation.md come from
`python benchmarks/sweep_skew.py --json out/sweep_skew.json`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZE_TOLERANCE = 0.15  # gathers within ±15 % of the median size count as "the usual size"


def in_run_gathers(bundle, cluster: str) -> dict | None:
    """The ZeRO-3 runs' all-gathers at their usual size on `cluster`: their own time from the last
    rank's start, and the simulator's sweep curve (`sim.sweep_curves`) at that size, its time and its
    fastest repetition (None without such runs)."""
    import numpy as np

    from sim import sweep_curves

    runs = bundle.runs_with_events()
    chosen = runs[(runs["cluster"] == cluster) & (runs["system"] == "zero3")]
    run_ids = set(chosen["run_id"])
    if not run_ids:
        return None
    events = bundle.events
    gathers = events[events["run_id"].isin(run_ids) & (events["stream"] == "allgather")].copy()
    gathers = gathers.sort_values(["run_id", "iteration", "rank", "start_s"], kind="stable")
    # Every rank issues the same gathers in the same order: the k-th of each rank is one collective.
    gathers["position"] = gathers.groupby(["run_id", "iteration", "rank"]).cumcount()
    last_start = gathers.groupby(["run_id", "iteration", "position"])["start_s"].transform("max")
    gathers["own_s"] = gathers["end_s"] - last_start
    usual = float(gathers["wire_bytes"].median())
    near = gathers[(gathers["wire_bytes"] - usual).abs() <= SIZE_TOLERANCE * usual]
    first = chosen.iloc[0]
    # link_Bps only sets the curve's link share, which this view does not read.
    curve = sweep_curves(
        bundle.collectives, cluster, int(first["world_size"]), int(first["nodes"]), link_Bps=0.0
    ).get("all_gather")
    if curve is None:
        raise ValueError(f"--cluster {cluster!r}: its all-gather sweep has fewer than 3 sizes")
    at = np.array([usual])
    mean_at_s = float(curve.time_s(at)[0])
    fastest_at_s = float(curve.fastest_time_s(at)[0])
    own_median_s = float(near["own_s"].median())
    return {
        "cluster": cluster,
        "runs": len(run_ids),
        "usual_gather_bytes": usual,
        "gathers_counted": len(near),
        "in_run_own_median_s": own_median_s,
        "in_run_own_p90_s": float(near["own_s"].quantile(0.9)),
        "sweep_mean_s": mean_at_s,
        "sweep_fastest_s": fastest_at_s,
        "sweep_mean_over_in_run_median": mean_at_s / max(own_median_s, 1e-9),
    }


def with_fastest_sweep(bundle, cluster: str):
    """A copy of `bundle` whose `cluster` sweep rows have their fastest repetition as their time."""
    collectives = bundle.collectives.copy()
    chosen = collectives["cluster"] == cluster
    if not chosen.any():
        raise ValueError(f"--cluster {cluster!r} has no collectives sweep in the bundle")
    collectives.loc[chosen, "time_s"] = collectives.loc[chosen, "time_min_s"]
    return dataclasses.replace(bundle, collectives=collectives)


def _mean_abs(errors: list[float | None]) -> float | None:
    known = [abs(error) for error in errors if error is not None]
    return sum(known) / len(known) if known else None


def _max_abs(errors: list[float | None]) -> float | None:
    known = [abs(error) for error in errors if error is not None]
    return max(known) if known else None


def held_out_errors(document: dict, cluster: str) -> list[dict]:
    return [
        {
            "run_id": row["run_id"],
            "layers": row["layers"],
            "system": row["system"],
            "category": row["category"],
            "measured_s": row["measured_s"],
            "predicted_s": row["predicted_s"],
            "error": row["error"],
        }
        for row in document["held_out"]
        if row["cluster"] == cluster
    ]


def diagnose(bundle_name: str, cluster: str, held_out_path: str | None) -> dict:
    import traces
    from validation.sim_check import default_held_out_path, load_held_out, validate_sim

    bundle = traces.read_bundle(traces.resolve_bundle(bundle_name))
    path = Path(held_out_path) if held_out_path else default_held_out_path(bundle_name)
    if path is None:
        raise ValueError(f"--bundle {bundle_name}: no shipped held-out file; pass --held-out")
    held_out = load_held_out(path)
    clusters = sorted(set(bundle.runs_with_events()["cluster"]))
    if cluster not in clusters:
        raise ValueError(f"--cluster {cluster!r} is not in the bundle (it has {', '.join(clusters)})")
    started_s = time.perf_counter()
    as_recorded = validate_sim(bundle, held_out, tolerance=0.04)
    fastest = validate_sim(with_fastest_sweep(bundle, cluster), held_out, tolerance=0.04)
    recorded_rows = held_out_errors(as_recorded, cluster)
    fastest_rows = {row["run_id"]: row for row in held_out_errors(fastest, cluster)}
    return {
        "benchmark": "sweep_skew",
        "bundle": bundle_name,
        "held_out_file": str(path),
        "cluster": cluster,
        "in_run_against_sweep": [row for row in (in_run_gathers(bundle, name) for name in clusters) if row],
        "held_out": [
            {
                **row,
                "predicted_with_fastest_sweep_s": fastest_rows[row["run_id"]]["predicted_s"],
                "error_with_fastest_sweep": fastest_rows[row["run_id"]]["error"],
            }
            for row in recorded_rows
        ],
        "cluster_mean_abs_error": {
            "sweep_as_recorded": _mean_abs([row["error"] for row in recorded_rows]),
            "fastest_sweep": _mean_abs([row["error"] for row in fastest_rows.values()]),
        },
        "cluster_max_abs_error": {
            "sweep_as_recorded": _max_abs([row["error"] for row in recorded_rows]),
            "fastest_sweep": _max_abs([row["error"] for row in fastest_rows.values()]),
        },
        # Over every held-out run of the bundle, the other clusters' predictions included.
        "held_out_mean_abs_error": {
            "sweep_as_recorded": as_recorded["held_out_mean_abs_error"],
            "fastest_sweep": fastest["held_out_mean_abs_error"],
        },
        "held_out_max_abs_error": {
            "sweep_as_recorded": as_recorded["held_out_max_abs_error"],
            "fastest_sweep": fastest["held_out_max_abs_error"],
        },
        "wall_s": time.perf_counter() - started_s,
    }


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="measured", help="bundle name or directory (default measured)")
    parser.add_argument(
        "--cluster", default="emulated-2x2-200mbit", help="the cluster whose sweep to bracket"
    )
    parser.add_argument("--held-out", default=None, help="held-out file (default: the bundle's shipped one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import traces

    try:
        result = diagnose(args.bundle, args.cluster, args.held_out)
    except (traces.TraceError, OSError, ValueError) as error:  # bad input: one line, not a traceback
        parser.exit(2, f"sweep_skew.py: {error}\n")
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
