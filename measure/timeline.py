"""A measured iteration as Chrome-trace JSON: one process per rank, one thread per stream, complete events
with µs timestamps from the iteration's start — the format `ciera simulate --timeline` writes
(`otherData.schema = "ciera.timeline/1"`), so a measured and a simulated iteration open side by side in
Perfetto (ui.perfetto.dev: open both files, or chrome://tracing)."""

from __future__ import annotations

from typing import Any

import traces

from .launch import CaptureError

STREAM_ORDER = (
    "compute", "gather_host", "allgather", "reduce_scatter", "all_reduce", "codec_send", "codec_recv", "optim",
)  # fmt: skip


def _event_name(layer: int, phase: str, stream: str) -> str:
    where = "all layers" if layer < 0 else f"layer {layer}"
    return f"{stream} {phase} {where}"


def measured_timeline(bundle: traces.TraceBundle, run_id: str, iteration: int) -> dict[str, Any]:
    """The events of `run_id`'s `iteration` in Chrome-trace JSON."""
    runs = bundle.runs[bundle.runs["run_id"] == run_id]
    if runs.empty:
        known = sorted(set(bundle.events["run_id"].unique()))
        shown = ", ".join(known[:4]) + (f", … {len(known) - 4} more" if len(known) > 4 else "")
        raise CaptureError(
            f"--run {run_id!r}: not in the bundle ({len(known)} runs with events: {shown or 'none'}; "
            "`ciera replay --bundle B` lists them)"
        )
    events = bundle.events[(bundle.events["run_id"] == run_id)]
    if events.empty:
        raise CaptureError(f"--run {run_id!r}: has no events (an analytic or exponent-statistics run)")
    iterations = sorted(int(i) for i in set(events["iteration"]))
    if iteration not in iterations:
        raise CaptureError(
            f"--iteration {iteration}: run {run_id!r} has iterations {iterations[0]}..{iterations[-1]}"
        )
    run = runs.iloc[0]
    events = events[events["iteration"] == iteration].sort_values(["rank", "start_s"])
    trace: list[dict[str, Any]] = []
    for rank in sorted(int(r) for r in set(events["rank"])):
        pid = rank + 1
        label = f"measured {run.system} — {run.model} L={run.layers} W={run.world_size} rank {rank}"
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        trace.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        for tid, stream in enumerate(STREAM_ORDER, start=1):
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}})
            trace.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
    tids = {stream: tid for tid, stream in enumerate(STREAM_ORDER, start=1)}
    for event in events.itertuples():
        duration_us = (event.end_s - event.start_s) * 1e6
        if duration_us <= 0:
            continue
        args: dict[str, Any] = {"issued_us": round(event.issued_s * 1e6, 3)}
        if event.raw_bytes or event.wire_bytes:
            args |= {"raw_bytes": int(event.raw_bytes), "wire_bytes": int(event.wire_bytes)}
        trace.append(
            {
                "ph": "X",
                "name": _event_name(int(event.layer), event.phase, event.stream),
                "cat": event.stream,
                "pid": int(event.rank) + 1,
                "tid": tids[event.stream],
                "ts": float(event.start_s) * 1e6,
                "dur": duration_us,
                "args": args,
            }
        )
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": "ciera.timeline/1",
            "source": "measured",
            "run_id": run_id,
            "iteration": iteration,
        },
    }
