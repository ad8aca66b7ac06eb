"""Predict the iteration time of a measured configuration that was not seen, from the replay graphs of runs
that were (sim/replay.py). The model, and nothing fitted to the configuration being predicted:

- **Link.** Each seen collective keeps its measured duration except for the time its bytes spend on the
  inter-node link, which is moved from the seen cluster's link to the target's: a ring over W ranks on
  N > 1 nodes sends (W − 1)/W · S across each node's link per direction (2× that for all_reduce), at the
  rate gloo measured on that link (`runs.measured_link_Bps`). Per-call overheads, waits and intra-node
  hops stay as measured.
- **Depth.** Replayed iteration times of the seen depths of (cluster, system) are fitted as a + b·L and
  evaluated at the target depth (the blocks are identical).
- **Compute** stays as measured on the seen runs: a target whose ranks share the CPU differently (more
  ranks per core) is predicted as if they did not — the validation shows what that misses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .replay import build_rank_graph, evaluate

_RING_FACTOR_STREAMS = {"allgather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}


def link_seconds(size_bytes: np.ndarray, world_size: int, nodes: int, link_Bps: float) -> np.ndarray:
    """Time the bytes of a ring collective of full size S spend on one node's inter-node link."""
    if nodes <= 1 or link_Bps <= 0:
        return np.zeros_like(size_bytes, dtype=float)
    return (world_size - 1) / world_size * size_bytes / link_Bps


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    basis: str  # what it was predicted from


def _replayed_median(events: pd.DataFrame, anchor: pd.Series, target: pd.Series) -> float:
    """Median over iterations of the replayed iteration time of `anchor`'s events moved to `target`'s link."""
    times = []
    for _, per_iteration in events.groupby("iteration", sort=True):
        last_end = 0.0
        for _, per_rank in per_iteration.groupby("rank", sort=True):
            ordered = per_rank.sort_values(["start_s", "end_s"], kind="stable")
            graph = build_rank_graph(ordered)
            durations = graph.duration_s.copy()
            factor = ordered["stream"].map(_RING_FACTOR_STREAMS).fillna(0.0).to_numpy(dtype=float)
            size = ordered["wire_bytes"].to_numpy(dtype=float) * factor
            durations += link_seconds(
                size, int(target.world_size), int(target.nodes), float(target.measured_link_Bps)
            )
            durations -= link_seconds(
                size, int(anchor.world_size), int(anchor.nodes), float(anchor.measured_link_Bps)
            )
            _, end = evaluate(graph, np.maximum(durations, 0.0))
            last_end = max(last_end, float(end.max(initial=0.0)))
        times.append(last_end)
    return float(np.median(times))


def predict_iteration_s(seen: traces.TraceBundle, target: pd.Series) -> Prediction:
    """The median iteration time of the configuration `target` (a runs row), from the seen runs of the same
    model and system (the cluster whose topology is closest: same ranks per node first, then the same
    link)."""
    runs = seen.runs
    candidates = runs[
        (runs["model"] == target["model"])
        & (runs["system"] == target["system"])
        & (runs["run_id"].isin(set(seen.events["run_id"])))
    ]
    if candidates.empty:
        raise SimInputError(
            f"no seen run of model {target['model']!r} and system {target['system']!r} to predict {target['run_id']!r} from"
        )
    closeness = (candidates["gpus_per_node"] != target["gpus_per_node"]).astype(int) * 2 + (
        candidates["link_rate_Bps"] != target["link_rate_Bps"]
    ).astype(int)
    cluster = candidates.assign(_distance=closeness).sort_values(["_distance", "cluster"]).iloc[0]["cluster"]
    anchors = candidates[candidates["cluster"] == cluster].sort_values("layers")
    by_run = dict(tuple(seen.events[seen.events["run_id"].isin(anchors["run_id"])].groupby("run_id")))
    depths, times = [], []
    for anchor in anchors.itertuples():
        depths.append(int(anchor.layers))
        times.append(_replayed_median(by_run[anchor.run_id], anchor, target))
    depths_a, times_a = np.array(depths, dtype=float), np.array(times)
    if int(target["layers"]) in depths:
        value = float(times_a[depths.index(int(target["layers"]))])
        basis = f"replay of {cluster} at L={int(target['layers'])}"
    elif len(set(depths)) >= 2:
        slope, intercept = np.polyfit(depths_a, times_a, 1)
        value = float(intercept + slope * int(target["layers"]))
        basis = f"replays of {cluster} at L={','.join(map(str, depths))}, fitted a + b·L"
    else:
        value = float(times_a[0] / depths_a[0] * int(target["layers"]))
        basis = f"replay of {cluster} at L={depths[0]}, scaled by depth"
    if cluster != target["cluster"]:
        basis += f", link moved to {target['cluster']}"
    return Prediction(value, basis)
