"""Predict the iteration time of a measured configuration that was not seen, from the replay graphs of runs
that were (sim/replay.py). The model, and nothing fitted to the configuration being predicted:

- **Link.** Each seen collective keeps its measured duration except for the time its bytes spend on the
  inter-node link, which is moved from the seen cluster's link to the target's: a ring over W ranks on
  N > 1 nodes sends (W − 1)/W · S across each node's link per direction (2× that for all_reduce), at the
  rate gloo measured on that link (`runs.measured_link_Bps`). Per-call overheads, waits and intra-node
  hops stay as measured.
- **Depth.** Replayed iteration times of the seen depths of (cluster, system) are fitted as a + b·L and
  evaluated at the target depth (the blocks are identical).
- **Cores.** Ranks that share a host's cores run their main thread (compute, optimizer, codec) slower by
  max(1, ranks on the host / host cores): synchronous data-parallel ranks compute at the same time. Ranks
  share a host when the capture says so (`versions.clock = "shared"`: every rank of the run on one host,
  as in the emulated cluster), else `gpus_per_node` of them do; the cores are `versions.host_cpus`. The
  seen run's main-thread durations are scaled by the target's factor over the seen run's. Where a run does
  not record its host's cores they are not scaled, and the prediction says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .replay import MAIN_THREAD_STREAMS, build_rank_graph, evaluate

_RING_FACTOR_STREAMS = {"allgather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}


_SWEEP_OPS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}


class SweepModel:
    """A cluster's collective time T(S) = α + S/β per op, fitted to its measured sweep over the whole
    group: α the median time of the sizes up to 64 KiB (small collectives on a shared CPU are noisy, so
    not a least-squares intercept), 1/β the least-squares slope of T − α over the sizes from 1 MiB.
    `residual` is the fit's relative RMS error over every measured size."""

    SMALL_BYTES = 64 << 10
    LARGE_BYTES = 1 << 20

    def __init__(self, rows: pd.DataFrame) -> None:
        self.alpha_s: dict[str, float] = {}
        self.inverse_beta: dict[str, float] = {}
        self.residual: dict[str, float] = {}
        for op, group in rows.groupby("op"):
            sizes = group["bytes"].to_numpy(dtype=float)
            times = group["time_s"].to_numpy(dtype=float)
            small, large = sizes <= self.SMALL_BYTES, sizes >= self.LARGE_BYTES
            alpha = float(np.median(times[small])) if small.any() else 0.0
            slope = (
                float(np.sum(sizes[large] * (times[large] - alpha)) / np.sum(sizes[large] ** 2))
                if large.any()
                else 0.0
            )
            self.alpha_s[str(op)], self.inverse_beta[str(op)] = alpha, max(slope, 0.0)
            fitted = alpha + self.inverse_beta[str(op)] * sizes
            self.residual[str(op)] = float(np.sqrt(np.mean(((fitted - times) / times) ** 2)))

    @classmethod
    def for_cluster(cls, collectives: pd.DataFrame, run: pd.Series) -> SweepModel | None:
        rows = collectives[
            (collectives["cluster"] == run["cluster"])
            & (collectives["world_size"] == run["world_size"])
            & (collectives["nodes"] == run["nodes"])
        ]
        return cls(rows) if len(rows) and set(rows["op"]) >= set(_SWEEP_OPS.values()) else None

    def time_s(self, op: str, size_bytes: np.ndarray) -> np.ndarray:
        return self.alpha_s[op] + self.inverse_beta[op] * size_bytes


def link_seconds(size_bytes: np.ndarray, world_size: int, nodes: int, link_Bps: float) -> np.ndarray:
    """Time the bytes of a ring collective of full size S spend on one node's inter-node link."""
    if nodes <= 1 or link_Bps <= 0:
        return np.zeros_like(size_bytes, dtype=float)
    return (world_size - 1) / world_size * size_bytes / link_Bps


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    basis: str  # what it was predicted from


def core_sharing(run: pd.Series) -> float | None:
    """How much slower a rank's main thread runs because ranks share the host's cores: max(1, ranks on the
    host / its cores); None when the run does not record its host's cores."""
    try:
        versions = json.loads(run["versions"]) if isinstance(run["versions"], str) else {}
    except (json.JSONDecodeError, KeyError):
        versions = {}
    cores = versions.get("host_cpus")
    if not isinstance(cores, int) or cores < 1:
        return None
    ranks_on_host = int(run["world_size"]) if versions.get("clock") == "shared" else int(run["gpus_per_node"])
    return max(1.0, ranks_on_host / cores)


def _collective_shift(ordered: pd.DataFrame, anchor: pd.Series, target: pd.Series, sweeps) -> np.ndarray:
    """Per event: what its collective costs more (or less) on the target cluster than on the anchor's."""
    streams = ordered["stream"].to_numpy(dtype=object)
    size = ordered["wire_bytes"].to_numpy(dtype=float)
    shift = np.zeros(len(ordered))
    anchor_sweep, target_sweep = sweeps
    for stream, op in _SWEEP_OPS.items():
        chosen = streams == stream
        if not chosen.any():
            continue
        if anchor_sweep is not None and target_sweep is not None:
            shift[chosen] = target_sweep.time_s(op, size[chosen]) - anchor_sweep.time_s(op, size[chosen])
        else:
            ring = size[chosen] * _RING_FACTOR_STREAMS[stream]
            shift[chosen] = link_seconds(
                ring, int(target.world_size), int(target.nodes), float(target.measured_link_Bps)
            ) - link_seconds(ring, int(anchor.world_size), int(anchor.nodes), float(anchor.measured_link_Bps))
    return shift


def _replayed_median(
    events: pd.DataFrame,
    anchor: pd.Series,
    target: pd.Series,
    sweeps=(None, None),
    main_thread_scale: float = 1.0,
) -> float:
    """Median over iterations of the replayed iteration time of `anchor`'s events moved to `target`'s
    cluster (by the two clusters' measured sweeps when both have one, else by their measured link rates),
    with main-thread durations scaled by `main_thread_scale` (core sharing)."""
    times = []
    for _, per_iteration in events.groupby("iteration", sort=True):
        last_end = 0.0
        for _, per_rank in per_iteration.groupby("rank", sort=True):
            ordered = per_rank.sort_values(["start_s", "end_s"], kind="stable")
            graph = build_rank_graph(ordered)
            scale = np.where(np.isin(graph.stream, MAIN_THREAD_STREAMS), main_thread_scale, 1.0)
            durations = graph.duration_s * scale + (
                _collective_shift(ordered, anchor, target, sweeps)
                if anchor.cluster != target.cluster
                else 0.0
            )
            _, end = evaluate(graph, np.maximum(durations, 0.0))
            last_end = max(last_end, float(end.max(initial=0.0)))
        times.append(last_end)
    return float(np.median(times))


def predict_iteration_s(
    seen: traces.TraceBundle, target: pd.Series, collectives: pd.DataFrame | None = None
) -> Prediction:
    """The median iteration time of the configuration `target` (a runs row), from the seen runs of the same
    model and system (the cluster whose topology is closest: same ranks per node first, then the same
    link)."""
    collectives = seen.collectives if collectives is None else collectives
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
    target_sweep = SweepModel.for_cluster(collectives, target)
    depths, times, link_basis = [], [], "sweeps"
    target_sharing, unscaled = core_sharing(target), False
    for anchor in anchors.itertuples():
        anchor_row = pd.Series(anchor._asdict())
        anchor_sweep = SweepModel.for_cluster(collectives, anchor_row)
        if anchor_sweep is None or target_sweep is None:
            link_basis = "link rates"
        anchor_sharing = core_sharing(anchor_row)
        if anchor_sharing is None or target_sharing is None:
            scale, unscaled = 1.0, True
        else:
            scale = target_sharing / anchor_sharing
        depths.append(int(anchor.layers))
        times.append(
            _replayed_median(by_run[anchor.run_id], anchor, target, (anchor_sweep, target_sweep), scale)
        )
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
        basis += f", collectives moved to {target['cluster']} by the measured {link_basis}"
        if unscaled:
            basis += "; host cores not recorded, main-thread times not scaled for core sharing"
        elif target_sharing != core_sharing(anchors.iloc[0]):
            basis += (
                f", main-thread times × {target_sharing / core_sharing(anchors.iloc[0]):.2g} (core sharing)"
            )
    return Prediction(value, basis)
