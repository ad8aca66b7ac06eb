"""Where a captured run's time goes: per run of a bundle, its median iteration and, per rank and
iteration, each stream's summed event time, its events and bytes.

    python benchmarks/run_streams.py --bundle DIR|measured [--runs SUBSTRING] [--json FILE]

Compute, optim and the codec streams (codec_send: encode, codec_recv: decode) are the rank's main
thread at work; the collective streams (allgather, reduce_scatter, all_reduce) are time in flight, which
overlaps whatever ran meanwhile. Compute is the main thread's time outside blocking waits and the codec
(measure/events.py), so a system's own thread work besides the codec — CIERA's headers, area plan and
collective issue — counts there. Two runs of one model at one depth side by side show where a system's
iteration differs from another's: e.g. whether a gather carrying half the bytes is in flight for less time
(the link was what it waited for) or not (something else was). Reads the bundle only (`traces.run_summaries`,
`traces.stream_summaries`); no rank is started.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _output import OneLineParser, add_bundle_argument, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarise(bundle_name: str, runs_containing: str = "") -> dict:
    import traces

    bundle = traces.read_bundle(traces.resolve_bundle(bundle_name))
    runs = traces.run_summaries(bundle).set_index("run_id")
    streams = traces.stream_summaries(bundle)
    rows = []
    for run_id in sorted(runs.index):
        if runs_containing not in run_id:
            continue
        of_run = streams[streams["run_id"] == run_id].set_index("stream")
        rows.append(
            {
                "run_id": run_id,
                "iteration_median_s": float(runs.loc[run_id, "iteration_median_s"]),
                "streams": {
                    stream: {
                        "seconds": float(row["seconds"]),
                        "events": float(row["events"]),
                        "mean_event_s": float(row["mean_event_s"]),
                        "raw_bytes": float(row["raw_bytes"]),
                        "wire_bytes": float(row["wire_bytes"]),
                    }
                    for stream, row in of_run.iterrows()
                },
            }
        )
    return {"benchmark": "run_streams", "bundle": str(bundle_name), "per": "rank and timed iteration",
            "runs": rows}  # fmt: skip


def main() -> None:
    import traces

    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_bundle_argument(parser)
    parser.add_argument("--runs", default="", help="only runs whose id contains this")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    try:
        result = summarise(args.bundle, args.runs)
    except (traces.TraceError, OSError, ValueError) as error:  # a bad bundle: one line, not a traceback
        parser.exit(2, f"run_streams.py: {error}\n")
    for run in result["runs"]:
        median_ms = 1e3 * run["iteration_median_s"]
        print(f"{run['run_id']}: iteration {median_ms:.0f} ms (median); per rank and iteration:")
        for stream, row in run["streams"].items():
            line = f"  {stream:15s} {1e3 * row['seconds']:8.0f} ms  {row['events']:7.1f} events"
            if row["raw_bytes"]:
                line += f"  mean {1e3 * row['mean_event_s']:6.2f} ms  raw {row['raw_bytes'] / 1e6:6.2f} MB"
                line += f"  wire {row['wire_bytes'] / 1e6:6.2f} MB"
            print(line)
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
