"""Replay of measured iterations: each iteration's op graph (sim/opgraph.py), unchanged, evaluated by the
one evaluator (sim/evaluate.py) at its measured durations. It gives back the measured iteration — the
check that the graph holds every dependency that shaped it, and the base every projection rewrites."""

from __future__ import annotations

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .evaluate import critical_path, evaluate, middle_index
from .opgraph import iteration_graphs


def replay_run(bundle: traces.TraceBundle, run_id: str) -> pd.DataFrame:
    """Per iteration of `run_id`: the measured iteration time, the replayed one, the relative error, and
    the simpy events the evaluation took."""
    events = bundle.events[bundle.events["run_id"] == run_id]
    if events.empty:
        raise SimInputError(f"bundle: run {run_id!r} has no events to replay (an analytic or statistics run)")
    measured = bundle.iterations[bundle.iterations["run_id"] == run_id].set_index("iteration")["iteration_s"]
    rows = []
    for iteration, graph in iteration_graphs(events).items():
        result = evaluate(graph)
        measured_s = float(measured.get(iteration, np.nan))
        rows.append(
            {
                "run_id": run_id,
                "iteration": int(iteration),
                "measured_s": measured_s,
                "replayed_s": result.iteration_s,
                "error": (result.iteration_s - measured_s) / measured_s if measured_s > 0 else np.nan,
                "events": result.events,
            }
        )
    return pd.DataFrame(rows)


def replay_bundle(bundle: traces.TraceBundle) -> pd.DataFrame:
    """`replay_run` for every run with events; one row per run: median measured and replayed iteration
    times, the largest relative error over its iterations, and the simpy events."""
    rows = []
    for run_id in sorted(set(bundle.events["run_id"].unique())):
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
                "events": int(per_iteration["events"].sum()),
            }
        )
    return pd.DataFrame(rows)


def measured_critical_path(bundle: traces.TraceBundle, run_id: str) -> dict[str, float]:
    """The critical path (`sim.evaluate.critical_path`, seconds per part) of `run_id`'s middle iteration
    (`middle_index` of its measured times), replayed at its measured durations — replay is exact, so the
    parts sum to that iteration's measured time. What a prediction's own parts are held against."""
    events = bundle.events[bundle.events["run_id"] == run_id]
    if events.empty:
        raise SimInputError(f"bundle: run {run_id!r} has no events to replay (an analytic or statistics run)")
    measured = bundle.iterations[bundle.iterations["run_id"] == run_id].set_index("iteration")["iteration_s"]
    iterations = sorted(set(events["iteration"].tolist()) & set(measured.index.tolist()))
    if not iterations:
        raise SimInputError(f"bundle: run {run_id!r} has no iteration with both events and a measured time")
    chosen = iterations[middle_index([float(measured[i]) for i in iterations])]
    graph = iteration_graphs(events[events["iteration"] == chosen])[chosen]
    return critical_path(graph, evaluate(graph))
