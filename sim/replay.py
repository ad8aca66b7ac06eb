"""Replay measured iterations from their events (trace schema v2): every rank's timeline rebuilt from the
measured durations and the dependencies between its streams, then evaluated again.

Per rank and iteration, the events form a graph:

- **the main thread** (compute, optim, and codec work that ran on it) is one chain in program order. Where
  it sat idle between two of its events it was blocked on a collective: the collective that ended last
  before it went on (within the idle interval) is its dependency. What remains of the idle time after that
  collective ended (Python between hooks, a wakeup) is kept as a fixed lag.
- **a collective** is issued by the main thread at `issued_s`: it depends on the main-thread event that
  ended last before that (plus the same kind of lag), and on the previous op of its own stream.
- durations are the measured ones (end − start on its stream).

Evaluating the graph (each start the max of its dependencies' ends plus lag: a max-plus recurrence) at the
measured durations gives back the measured timeline — the check that the graph holds every dependency that
shaped it. With other durations (a slower link, a faster codec) it says what the same schedule would take;
that is what projections from measured runs build on. The iteration time is the last end over all ranks,
on the clock the capture aligned across ranks.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError

MAIN_THREAD_STREAMS = ("compute", "optim", "codec_send", "codec_recv")
COLLECTIVE_STREAMS = ("allgather", "reduce_scatter", "all_reduce")
TOLERANCE_S = 1e-6

# A function of the events of one (rank, iteration), returning the durations to replay (seconds).
DurationModel = Callable[[pd.DataFrame], np.ndarray]


@dataclass(frozen=True)
class RankGraph:
    """One rank's iteration as arrays in measured start order."""

    stream: np.ndarray  # stream name per op
    duration_s: np.ndarray
    lag_s: np.ndarray  # fixed delay after the dependencies are met
    main_prev: (
        np.ndarray
    )  # index of the previous main-thread op (main ops), or the issuing one (collectives); -1
    stream_prev: np.ndarray  # previous op on the same collective stream, -1
    blocker: np.ndarray  # collective the main thread waited for before this op, -1
    offset_s: np.ndarray  # start when the op has no dependency at all (its measured start)


def build_rank_graph(events: pd.DataFrame) -> RankGraph:
    """The dependency graph of one rank's iteration (events of one run, rank and iteration)."""
    ordered = events.sort_values(["start_s", "end_s"], kind="stable").reset_index(drop=True)
    streams = ordered["stream"].to_numpy(dtype=object)
    start = ordered["start_s"].to_numpy(dtype=float)
    end = ordered["end_s"].to_numpy(dtype=float)
    issued = ordered["issued_s"].to_numpy(dtype=float)
    count = len(ordered)
    is_main = np.isin(streams, MAIN_THREAD_STREAMS)
    main_prev = np.full(count, -1)
    stream_prev = np.full(count, -1)
    blocker = np.full(count, -1)
    lag = np.zeros(count)
    offset = start.copy()
    collective_ends = [(end[i], i) for i in range(count) if not is_main[i]]
    collective_ends.sort()
    ends_only = np.array([e for e, _ in collective_ends]) if collective_ends else np.zeros(0)
    last_main = -1
    # Ends and indices of the main ops seen so far: the main thread runs one op at a time, so its ends
    # only grow and the issuer of a collective is found by bisection.
    main_ends: list[float] = []
    main_indices: list[int] = []
    last_on_stream: dict[str, int] = {}
    for index in range(count):
        if is_main[index]:
            previous_end = end[last_main] if last_main >= 0 else 0.0
            ready = previous_end
            if start[index] - previous_end > TOLERANCE_S and len(ends_only):
                # The collective that ended last inside the idle interval is what the thread waited for.
                position = int(np.searchsorted(ends_only, start[index] + TOLERANCE_S, side="right")) - 1
                if position >= 0 and ends_only[position] >= previous_end - TOLERANCE_S:
                    blocker[index] = collective_ends[position][1]
                    ready = max(ready, ends_only[position])
            main_prev[index] = last_main
            lag[index] = max(0.0, start[index] - ready)
            last_main = index
            main_ends.append(end[index])
            main_indices.append(index)
        else:
            # Issued by the main thread: after the last main op that had ended by then.
            position = bisect.bisect_right(main_ends, issued[index] + TOLERANCE_S) - 1
            issuer = main_indices[position] if position >= 0 else -1
            main_prev[index] = issuer
            issue_ready = end[issuer] if issuer >= 0 else 0.0
            lag[index] = max(0.0, issued[index] - issue_ready)
            stream_prev[index] = last_on_stream.get(streams[index], -1)
            last_on_stream[streams[index]] = index
    return RankGraph(
        stream=streams,
        duration_s=end - start,
        lag_s=lag,
        main_prev=main_prev,
        stream_prev=stream_prev,
        blocker=blocker,
        offset_s=offset,
    )


def evaluate(graph: RankGraph, duration_s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(start_s, end_s) of every op for these durations (default: the measured ones)."""
    durations = graph.duration_s if duration_s is None else duration_s
    count = len(durations)
    start = np.zeros(count)
    end = np.zeros(count)
    is_main = np.isin(graph.stream, MAIN_THREAD_STREAMS)
    for index in range(count):
        if is_main[index]:
            previous = graph.main_prev[index]
            ready = end[previous] if previous >= 0 else 0.0
            if graph.blocker[index] >= 0:
                ready = max(ready, end[graph.blocker[index]])
            begin = ready + graph.lag_s[index]
            if previous < 0 and graph.blocker[index] < 0:
                begin = graph.offset_s[index]  # the rank's first op: its barrier exit on the aligned clock
        else:
            issuer = graph.main_prev[index]
            issue = (end[issuer] if issuer >= 0 else 0.0) + graph.lag_s[index]
            previous = graph.stream_prev[index]
            begin = max(issue, end[previous] if previous >= 0 else 0.0)
        start[index] = begin
        end[index] = begin + durations[index]
    return start, end


def replay_run(
    bundle: traces.TraceBundle, run_id: str, durations: DurationModel | None = None
) -> pd.DataFrame:
    """Per iteration of `run_id`: the measured iteration time, the replayed one (measured durations, or
    `durations(events)` per rank), and the relative error."""
    events = bundle.events[bundle.events["run_id"] == run_id]
    if events.empty:
        raise SimInputError(f"bundle: run {run_id!r} has no events to replay (an analytic or statistics run)")
    measured = bundle.iterations[bundle.iterations["run_id"] == run_id].set_index("iteration")["iteration_s"]
    rows = []
    for iteration, per_iteration in events.groupby("iteration", sort=True):
        last_end = 0.0
        for _, per_rank in per_iteration.groupby("rank", sort=True):
            graph = build_rank_graph(per_rank)
            ordered = per_rank.sort_values(["start_s", "end_s"], kind="stable")
            _, end = evaluate(graph, None if durations is None else durations(ordered))
            last_end = max(last_end, float(end.max(initial=0.0)))
        measured_s = float(measured.get(iteration, np.nan))
        rows.append(
            {
                "run_id": run_id,
                "iteration": int(iteration),
                "measured_s": measured_s,
                "replayed_s": last_end,
                "error": (last_end - measured_s) / measured_s if measured_s > 0 else np.nan,
            }
        )
    return pd.DataFrame(rows)


def replay_bundle(bundle: traces.TraceBundle) -> pd.DataFrame:
    """`replay_run` for every run with events; one row per run: median measured and replayed iteration
    times and the median relative error."""
    rows = []
    for run_id in sorted(set(bundle.events["run_id"])):
        per_iteration = replay_run(bundle, run_id)
        run = bundle.runs[bundle.runs["run_id"] == run_id].iloc[0]
        rows.append(
            {
                "run_id": run_id,
                "cluster": run.cluster,
                "system": run.system,
                "layers": int(run.layers),
                "world_size": int(run.world_size),
                "iterations": len(per_iteration),
                "measured_s": float(per_iteration["measured_s"].median()),
                "replayed_s": float(per_iteration["replayed_s"].median()),
                "max_abs_error": float(per_iteration["error"].abs().max()),
            }
        )
    return pd.DataFrame(rows)
