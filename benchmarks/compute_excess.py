"""How much heavier a CIERA run's compute is than its plain engine's, per engine call — the figure behind
"Why ZeRO-3 + CIERA is predicted fast" (docs/validation.md). Reads a bundle; starts no rank.

    python benchmarks/compute_excess.py [--bundle measured] [--plain zero3] [--codec ciera] [--json F]

For every (cluster, depth) with a run of both systems, per rank and iteration (medians over iterations):

- ``compute_s``: the main thread's ``compute`` and ``optim`` segments, as measured;
- ``work_s``: the same read as work at a full core with the run's own calibrations
  (``sim.main_thread_work_s``, what the CIERA rewrite's codec figures are fitted to; absent where the
  bundle has no collectives sweep of that cluster);
- ``calls``: CIERA calls (``codec_send`` events), and the excess per call, ``(codec − plain) / calls``;
- the host work visible beside each call's codec: from the end of its encode to its collective's issue
  (``send_gap_s``, median) and the main-thread segment just before its decode (``before_decode_s``);
- where the runs record the engine's gather path (the ``gather_host`` stream, captures since 2026-12-05):
  each system's ``gather_host`` time per call, measured and as work (``*_gather_host_per_call_s``,
  ``*_gather_host_work_per_call_s``) — what the CIERA rewrite then replaces directly — and the compute
  excess without it (``compute_s`` and ``work_s`` count ``compute`` and ``optim`` only).

The CIERA rewrite adds one glue per call fitted on its in-sample run(s); the excess per call here is what
that glue would have to be in each run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sim  # noqa: E402
import traces  # noqa: E402


def _per_rank_iteration(frame: pd.DataFrame, value: pd.Series) -> float:
    groups = frame.assign(_value=value).groupby(["iteration", "rank"])["_value"].sum()
    return float(groups.groupby(level="iteration").mean().median())


def _visible_glue_s(events: pd.DataFrame) -> tuple[float, float]:
    """(median encode end → next issue on the rank, median main op just before a decode)."""
    gaps, before = [], []
    main_streams = ("compute", "gather_host", "optim", "codec_send", "codec_recv")
    for _, rows in events.groupby(["iteration", "rank"]):
        rows = rows.sort_values(["start_s", "end_s"], kind="stable")
        main = rows[rows["stream"].isin(main_streams)].reset_index(drop=True)
        issued = np.sort(rows.loc[rows["stream"] == "allgather", "issued_s"].to_numpy())
        send_end = main.loc[main["stream"] == "codec_send", "end_s"].to_numpy()
        following = np.searchsorted(issued, send_end)
        found = following < len(issued)
        gaps.extend((issued[following[found]] - send_end[found]).tolist())
        decodes = main.index[main["stream"] == "codec_recv"]
        previous = main.loc[decodes[decodes > 0] - 1]
        previous = previous[previous["stream"].isin(("compute", "gather_host"))]
        before.extend((previous["end_s"] - previous["start_s"]).tolist())
    return (
        float(np.median(gaps)) if gaps else float("nan"),
        float(np.median(before)) if before else float("nan"),
    )


def compute_excess(bundle: traces.TraceBundle, plain: str, codec: str) -> list[dict]:
    runs = bundle.runs_with_events()
    rows = []
    for (cluster, layers), chosen in runs.groupby(["cluster", "layers"], sort=True):
        pair = {system: chosen[chosen["system"] == system] for system in (plain, codec)}
        if any(frame.empty for frame in pair.values()):
            continue
        figures: dict[str, dict] = {}
        for system, frame in pair.items():
            run = frame.iloc[0]
            events = bundle.events[bundle.events["run_id"] == run["run_id"]]
            computing = events["stream"].isin(("compute", "optim"))
            measured = (events["end_s"] - events["start_s"]).where(computing, 0.0)
            try:
                all_work = sim.main_thread_work_s(bundle, run)
            except sim.SimInputError:  # no sweep of that cluster: the work cannot be read
                all_work = None
            work_s = None if all_work is None else _per_rank_iteration(events, all_work.where(computing, 0.0))
            calls = (events["stream"] == "codec_send").astype(float)
            path = events["stream"] == "gather_host"
            host_s = host_work_s = None
            if path.any():
                host_s = _per_rank_iteration(events, (events["end_s"] - events["start_s"]).where(path, 0.0))
                if all_work is not None:
                    host_work_s = _per_rank_iteration(events, all_work.where(path, 0.0))
            figures[system] = {
                "gather_host_s": host_s,
                "gather_host_work_s": host_work_s,
                "run_id": str(run["run_id"]),
                "compute_s": _per_rank_iteration(events, measured),
                "work_s": work_s,
                "calls": _per_rank_iteration(events, calls),
                "glue": _visible_glue_s(events) if system == codec else None,
            }
        calls = figures[codec]["calls"]
        both_work = figures[plain]["work_s"] is not None and figures[codec]["work_s"] is not None
        send_gap_s, before_decode_s = figures[codec]["glue"]
        rows.append({
            "cluster": cluster, "layers": int(layers),
            "plain_run": figures[plain]["run_id"], "codec_run": figures[codec]["run_id"],
            "plain_compute_s": figures[plain]["compute_s"], "codec_compute_s": figures[codec]["compute_s"],
            "plain_work_s": figures[plain]["work_s"], "codec_work_s": figures[codec]["work_s"],
            "calls": calls,
            "excess_per_call_s": (figures[codec]["compute_s"] - figures[plain]["compute_s"]) / max(calls, 1.0),
            "work_excess_per_call_s": (
                (figures[codec]["work_s"] - figures[plain]["work_s"]) / max(calls, 1.0) if both_work else None
            ),
            "send_gap_s": send_gap_s, "before_decode_s": before_decode_s,
            **{
                f"{side}_gather_host{kind}_per_call_s": (
                    None if figures[system][f"gather_host{kind}_s"] is None
                    else figures[system][f"gather_host{kind}_s"] / max(calls, 1.0)
                )
                for side, system in (("plain", plain), ("codec", codec))
                for kind in ("", "_work")
            },
        })  # fmt: skip
    return rows


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="measured", help="bundle name or directory (default measured)")
    parser.add_argument("--plain", default="zero3", help="the plain engine's system (default zero3)")
    parser.add_argument("--codec", default="ciera", help="the CIERA system on it (default ciera)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        bundle = traces.read_bundle(traces.resolve_bundle(args.bundle))
        rows = compute_excess(bundle, args.plain, args.codec)
    except (traces.TraceError, sim.SimInputError, OSError, ValueError) as error:  # one line, no traceback
        parser.exit(2, f"compute_excess.py: {error}\n")
    if not rows:
        parser.exit(2, f"compute_excess.py: {args.bundle}: no cluster and depth with runs of both {args.plain} "
                    f"and {args.codec}\n")  # fmt: skip
    for row in rows:  # the table first, for a reader; every number in the JSON after it
        work = row["work_excess_per_call_s"]
        print(
            f"{row['cluster']} L = {row['layers']}: compute {row['plain_compute_s'] * 1e3:.0f} → "
            f"{row['codec_compute_s'] * 1e3:.0f} ms per rank and iteration, {row['calls']:.0f} calls, "
            f"{row['excess_per_call_s'] * 1e6:+.0f} µs per call measured"
            f"{'' if work is None else f', {work * 1e6:+.0f} µs as work'}; beside the codec "
            f"{row['send_gap_s'] * 1e6:.0f} µs after the encode, {row['before_decode_s'] * 1e6:.0f} µs before "
            "the decode"
            + (
                f"; the engine's gather path {row['plain_gather_host_per_call_s'] * 1e6:.0f} → "
                f"{row['codec_gather_host_per_call_s'] * 1e6:.0f} µs per call measured"
                if row["plain_gather_host_per_call_s"] is not None
                and row["codec_gather_host_per_call_s"] is not None
                else ""
            ),
            file=sys.stderr,
        )
    emit_json({"benchmark": "compute_excess", "bundle": args.bundle, "plain": args.plain,
               "codec": args.codec, "rows": rows}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
