"""Projection = stated rewrites of a traced op graph (sim/opgraph.py); `sim.evaluate` runs the result.

A graph traced on one cluster (the anchor) is moved to a target cluster:

- **Collectives** are re-costed from the two clusters' size-resolved curves (sim/curves.py). Of each
  collective group the anchor's measured time from its last issue is split into what the anchor's curve
  explains — its fixed part, and its link part stretched by how many link-bearing collectives were in
  flight beside it (the contention the anchor saw) — and the rest (in-run overhead beyond the sweep). The
  target keeps that rest, takes its own fixed part, and moves its own link bytes through the shared link,
  where overlapping collectives share the bandwidth. A rank's collectives are not serialised on their
  stream: gloo's worker threads run them side by side, and the link decides.
- **Compute** (main-thread ops) keeps the traced device's times: per-rank work at a fixed per-rank batch
  does not depend on W. Its work is the measured duration times the core share the anchor's rank had
  (ranks sharing a host's cores); on the target it runs on the target's shared cores.
- **World size**: the target's ranks are copies of the traced ones (rank classes weighing W_t / W_a each
  on shared cores); gathered and scattered sizes are full sizes, so they do not change with W. The
  optimizer step follows the engine's partitioning (`OPTIMIZER_WORK`): ZeRO-3 steps its flat partition,
  1/W of the elements, so its work scales by W_a / W_t; FSDP2 steps every parameter's 1/W slice, one
  tensor per parameter on every rank, and its traced step's work is kept (docs/simulator.md).
- **Depth**: `repeat_blocks` (see there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .cluster import ClusterPreset, load_cluster
from .collectives import CollectiveModel
from .curves import GRAPH_STREAM_OPS, Curve, PresetCurve, level_curves, sweep_curves
from .errors import SimInputError
from .evaluate import Costs, evaluate, evaluation_key
from .opgraph import KERNEL_STREAMS, OpGraph


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster as the rewrites see it: its shape, its link, its hosts' cores and its collective curves."""

    name: str
    nodes: int
    ranks_per_node: int
    link_Bps: float  # what gloo measured across one node's link (0: one node)
    host_cores: int  # cores of one host (0: not recorded, compute not shared)
    ranks_per_host: int  # ranks sharing one host's cores
    curves: dict[str, Curve]
    measured: bool  # its curves are its own measured sweep

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        curves = (
            "its measured sweep"
            if self.measured
            else "the preset's α–β"
            if any(isinstance(c, PresetCurve) for c in self.curves.values())
            else "α–β per level from measured sweeps of its kind"
        )
        cores = (
            f"{self.ranks_per_host} ranks on {self.host_cores} cores per host"
            if self.host_cores
            else "host cores not recorded (compute not shared)"
        )
        return f"{self.name}: {self.nodes}×{self.ranks_per_node}, collectives from {curves}, {cores}"


def _versions(run: pd.Series) -> dict:
    try:
        return json.loads(run["versions"]) if isinstance(run["versions"], str) else {}
    except json.JSONDecodeError:
        return {}


def measured_cluster(collectives: pd.DataFrame, run: pd.Series) -> ClusterSpec:
    """The cluster a measured run ran on, with its own sweep."""
    versions = _versions(run)
    cores = versions.get("host_cpus") if isinstance(versions.get("host_cpus"), int) else 0
    shared = versions.get("clock") == "shared"
    world_size, nodes = int(run["world_size"]), int(run["nodes"])
    curves = sweep_curves(
        collectives, str(run["cluster"]), world_size, nodes, float(run["measured_link_Bps"])
    )
    if not curves:
        raise SimInputError(
            f"bundle: cluster {run['cluster']!r} has no complete collectives sweep to re-cost collectives with"
        )
    return ClusterSpec(
        name=str(run["cluster"]),
        nodes=nodes,
        ranks_per_node=int(run["gpus_per_node"]),
        link_Bps=float(run["measured_link_Bps"]),
        host_cores=int(cores or 0),
        ranks_per_host=world_size if shared else int(run["gpus_per_node"]),
        curves=curves,
        measured=True,
    )


def traced_cluster(collectives: pd.DataFrame, run: pd.Series) -> ClusterSpec:
    """The cluster a run was traced on: a measured run's with its own sweep; an analytic run's preset
    (by name, as shipped: overrides the generator was run with are not recorded) at the run's W."""
    if run["source"] != "analytic":
        return measured_cluster(collectives, run)
    preset = load_cluster(str(run["cluster"]))
    return preset_cluster(preset, CollectiveModel.from_preset(preset, None), int(run["world_size"]))


def preset_cluster(preset: ClusterPreset, model: CollectiveModel, world_size: int) -> ClusterSpec:
    """`world_size` GPUs of a cluster preset: its nodes of `gpus_per_node`, collectives from its own
    α–β model. Compute is not a shared resource (one GPU per rank)."""
    per_node = min(preset.gpus_per_node, world_size)
    nodes = -(-world_size // preset.gpus_per_node)
    return ClusterSpec(
        name=preset.name,
        nodes=nodes,
        ranks_per_node=per_node,
        link_Bps=model.inter_beta_Bps if nodes > 1 else 0.0,
        host_cores=0,
        ranks_per_host=1,
        curves={op: PresetCurve(op, model, world_size) for op in GRAPH_STREAM_OPS.values()},
        measured=False,
    )


def projected_cluster(kind: list[ClusterSpec], nodes: int, ranks_per_node: int, name: str) -> ClusterSpec:
    """A topology of a measured kind (the same link and hosts) that was not measured: every node its own
    host with the kind's cores, collectives by α–β per level from the kind's sweeps."""
    if not kind:
        raise SimInputError("no measured cluster of this kind to project from")
    link_Bps = float(np.median([c.link_Bps for c in kind]))
    curves = level_curves(
        [c.curves for c in kind], nodes * ranks_per_node, nodes, link_Bps if nodes > 1 else 0.0
    )
    return ClusterSpec(
        name=name,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        link_Bps=link_Bps if nodes > 1 else 0.0,
        host_cores=kind[0].host_cores,
        ranks_per_host=ranks_per_node,
        curves=curves,
        measured=False,
    )


def mean_concurrency(start_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """For each interval, the mean number of the intervals (itself included) open during it (1 for an
    empty one)."""
    open_count = weighted_concurrency(start_s, end_s, start_s, end_s, np.ones(len(start_s)))
    return np.where(end_s - start_s > 0, open_count, 1.0)


def transport_cpu(graph: OpGraph, cluster: ClusterSpec) -> np.ndarray | None:
    """Per op, the core-seconds its transport takes from its rank's host on `cluster` (collectives: the
    cluster's transport CPU at the op's size; other ops 0); None when the cluster's sweep did not measure
    it or its cores are not simulated."""
    if not cluster.host_cores:
        return None
    cpu = np.zeros(graph.size)
    collective = np.flatnonzero((graph.group >= 0) & ~np.isin(graph.stream, KERNEL_STREAMS))
    for stream in set(graph.stream[collective].tolist()):
        chosen = collective[graph.stream[collective] == stream]
        values = cluster.curves[GRAPH_STREAM_OPS[stream]].transport_cpu_s(graph.wire_bytes[chosen])
        if values is None:
            return None
        cpu[chosen] = values
    return cpu


def transport_scale(run: pd.Series, graphs: list[OpGraph], cluster: ClusterSpec) -> tuple[float, str | None]:
    """The traced run's transport CPU measured in the run (per rank and iteration, beside its main thread)
    over what its cluster's sweep says its collectives take: the sweep times each size alone and back to
    back, so its per-call CPU overstates the engine's (1.3–2.4× on the emulated cluster). Both the anchor's
    and the target's modelled transport are scaled by it. 1 with a note when the run did not record it."""
    modelled = [transport_cpu(graph, cluster) for graph in graphs]
    if not graphs or any(values is None for values in modelled):
        return 1.0, None  # transport not simulated: nothing to scale
    measured = _versions(run).get("transport_cpu_median_s")
    if not isinstance(measured, int | float) or not np.isfinite(measured):
        return 1.0, (
            f"run {run['run_id']}: transport CPU not recorded in the run — the sweep's per-call transport "
            "CPU is used as is (recapture with `ciera measure` to calibrate it)"
        )
    per_rank = float(
        np.median([values.sum() / g.world_size for values, g in zip(modelled, graphs, strict=True)])
    )
    return (float(measured) / per_rank if per_rank > 0 else 1.0), None


def weighted_concurrency(
    start_s: np.ndarray, end_s: np.ndarray, from_s: np.ndarray, to_s: np.ndarray, rate: np.ndarray
) -> np.ndarray:
    """For each interval [start, end], the mean over it of Σ rate_k over the intervals [from_k, to_k] open."""
    if not len(from_s) or not len(start_s):
        return np.zeros(len(start_s))
    times = np.concatenate([from_s, to_s])
    steps = np.concatenate([rate, -rate])
    order = np.argsort(times, kind="stable")
    times, steps = times[order], steps[order]
    level = np.cumsum(steps)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])

    def integral(at: np.ndarray) -> np.ndarray:
        position = np.clip(np.searchsorted(times, at, side="right") - 1, 0, len(times) - 1)
        return np.where(at < times[0], 0.0, area[position] + level[position] * (at - times[position]))

    length = end_s - start_s
    return np.where(
        length > 0, (integral(end_s) - integral(start_s)) / np.where(length > 0, length, 1.0), 0.0
    )


def _core_share(graph: OpGraph, cluster: ClusterSpec, transport_s: np.ndarray | None) -> np.ndarray:
    """Per main op, the share of a core its rank had: min(1, cores / (ranks computing beside it + the
    cores the collectives in flight on its host took for their transport, spread over their measured
    durations))."""
    share = np.ones(graph.size)
    if not cluster.host_cores:
        return share
    is_main = graph.is_main
    host = graph.rank // max(cluster.ranks_per_host, 1)
    start, end = graph.measured_start_s, graph.measured_end_s
    for h in set(host[is_main].tolist()):
        chosen = np.flatnonzero(is_main & (host == h))
        busy = mean_concurrency(start[chosen], end[chosen])
        if transport_s is not None:
            moving = np.flatnonzero((transport_s > 0) & (host == h))
            duration = np.maximum(end[moving] - start[moving], 1e-9)
            rate = np.minimum(transport_s[moving] / duration, 1.0)  # one thread: at most a core
            busy = busy + weighted_concurrency(start[chosen], end[chosen], start[moving], end[moving], rate)
        share[chosen] = np.minimum(1.0, cluster.host_cores / np.maximum(busy, 1.0))
    return share


def main_work_s(graph: OpGraph, cluster: ClusterSpec, transport_s: np.ndarray | None) -> np.ndarray:
    """Per op, what a main-thread op would take at a full core: its measured duration times the core
    share its rank had on `cluster` (`transport_s`: each collective's transport CPU, or None to count
    only the ranks); 0 for every other op. The one reading of a measured main-thread time as work — the
    anchor's compute and the codec runs' encode, decode and glue alike, so that the evaluator's shared
    cores slow each of them once, not on top of the sharing their measurement already holds."""
    return np.where(graph.is_main, graph.duration_s * _core_share(graph, cluster, transport_s), 0.0)


def run_transport_s(graph: OpGraph, cluster: ClusterSpec, transport_scale: float = 1.0) -> np.ndarray | None:
    """Each collective's transport CPU on `cluster`, scaled by the run's in-run calibration (None when
    the cluster's sweep did not measure it or its cores are not simulated)."""
    values = transport_cpu(graph, cluster)
    return None if values is None else values * transport_scale


# The compute calibration stops when the simulated main-thread time is within this share of the
# measured one, or after COMPUTE_SCALE_ROUNDS evaluations.
COMPUTE_SCALE_TOLERANCE = 0.003
COMPUTE_SCALE_ROUNDS = 4
COMPUTE_SCALE_RANGE = (0.25, 4.0)
_compute_scales: dict[bytes, float] = {}  # by a digest of every input: validation asks per target


def compute_scale(graphs: list[OpGraph], cluster: ClusterSpec, transport_scale: float = 1.0) -> float:
    """The factor on the anchor's compute work (`main_work_s`) at which its iteration of median
    main-thread time, re-costed onto its own cluster by `rewrite_costs` and evaluated, spends its measured
    main-thread time (summed over ranks; the factor varies by ~1 % between iterations). `main_work_s`
    reads each op's core share from overlaps averaged over the op; the evaluator shares the cores moment
    by moment, with each collective's transport CPU from its last issue — with many small collectives the
    two disagree (ZeRO-3 on OLMoE-1B-7B: compute 10 % slower in the evaluator than measured, the
    iteration 13 % longer). Calibrated in sample, on the anchor alone, like `transport_scale`; 1 where the
    cluster's cores are not simulated."""
    if not cluster.host_cores or not graphs:
        return 1.0
    main_s = [float(graph.duration_s[graph.is_main].sum()) for graph in graphs]
    graph = graphs[int(np.argsort(main_s)[len(main_s) // 2])]
    unscaled = rewrite_costs(graph, cluster, cluster, transport_scale)[0]
    key = evaluation_key(graph, unscaled)  # every input of the solve: graph, costs, measured durations
    if key not in _compute_scales:
        if len(_compute_scales) > 256:
            _compute_scales.clear()
        _compute_scales[key] = _solve_compute_scale(graph, cluster, transport_scale, unscaled)
    return _compute_scales[key]


def _solve_compute_scale(
    graph: OpGraph, cluster: ClusterSpec, transport_scale: float, unscaled: Costs
) -> float:
    """Solve simulated(c) = measured main-thread time by the secant method from c = 1 and the
    proportional step (a plain fixed-point step overshoots where ranks share cores with the transport)."""
    measured_s = float(graph.duration_s[graph.is_main].sum())

    def simulated_s(costs: Costs) -> float:
        result = evaluate(graph, costs)
        return float((result.end_s - result.start_s)[graph.is_main].sum())

    previous, previous_s = 1.0, simulated_s(unscaled)
    if previous_s <= 0 or measured_s <= 0:
        return 1.0
    scale = measured_s / previous_s
    for _ in range(COMPUTE_SCALE_ROUNDS - 1):
        now_s = simulated_s(rewrite_costs(graph, cluster, cluster, transport_scale, scale)[0])
        if abs(now_s / measured_s - 1.0) < COMPUTE_SCALE_TOLERANCE or now_s == previous_s:
            break
        step = (measured_s - now_s) * (scale - previous) / (now_s - previous_s)
        previous, previous_s = scale, now_s
        scale = float(np.clip(scale + step, COMPUTE_SCALE_RANGE[0], COMPUTE_SCALE_RANGE[1]))
    return scale


# How an engine's optimizer step's work changes with the world size, per rank. ZeRO-3 (DeepSpeed) steps
# its flat fp32 partition: 1/W of the elements, work ∝ W_a / W_t. FSDP2 steps each parameter's 1/W slice
# (a DTensor per parameter, the same count on every rank at any W), and on the traced runs that step is
# per-parameter work: scaled by 1/W it came out short on every held-out run of another W, kept it is the
# nearer (`python benchmarks/main_thread_split.py`, docs/simulator.md "The optimizer step").
OPTIMIZER_WORK = {"zero3": "per_element", "fsdp": "per_parameter"}


def optimizer_world_factor(engine: str | None, anchor_world_size: int, target_world_size: int) -> float:
    """The factor on an optimizer step's work traced at W_a when the graph moves to W_t (OPTIMIZER_WORK)."""
    if anchor_world_size == target_world_size:
        return 1.0
    rule = OPTIMIZER_WORK.get(str(engine))
    if rule is None:
        raise SimInputError(
            f"engine {engine!r}: no rule for its optimizer step at another world size "
            f"(expected one of {', '.join(sorted(OPTIMIZER_WORK))})"
        )
    return anchor_world_size / target_world_size if rule == "per_element" else 1.0


def rewrite_costs(
    graph: OpGraph,
    anchor: ClusterSpec,
    target: ClusterSpec,
    transport_scale: float = 1.0,
    compute_scale: float = 1.0,
    engine: str | None = None,
) -> tuple[Costs, list[str]]:
    """The costs of `graph` (traced on `anchor`) on `target`; notes say what was assumed. The sweeps'
    transport CPU is multiplied by `transport_scale` (the anchor run's in-run calibration), the main
    thread's work by `compute_scale` (the anchor's compute calibration, `compute_scale()`). `engine` (the
    anchor run's: zero3, fsdp) sets how its optimizer step moves to another world size; needed only then."""
    notes: list[str] = []
    world_scale = optimizer_world_factor(engine, anchor.world_size, target.world_size)
    if anchor.world_size != target.world_size:
        notes.append(
            f"optimizer step at another world size: {engine}'s is per-element work, × W_traced / W"
            if OPTIMIZER_WORK[str(engine)] == "per_element"
            else f"optimizer step at another world size: {engine}'s is per-parameter work, kept as traced"
        )
    anchor_transport = run_transport_s(graph, anchor, transport_scale)
    target_transport = run_transport_s(graph, target, transport_scale)
    if target.host_cores and (target_transport is None or anchor_transport is None):
        # Both or neither: the anchor's compute is read net of its transport only if the target adds it back.
        unmeasured = target.name if target_transport is None else anchor.name
        notes.append(
            f"{unmeasured}: transport CPU not measured by its collectives sweep — collectives take no cores "
            "from compute (re-sweep with `ciera measure collectives`)"
        )
        anchor_transport = target_transport = None
    work = main_work_s(graph, anchor, anchor_transport) * compute_scale
    optimizer = graph.stream == "optim"
    work[optimizer] *= world_scale
    own_link = np.zeros(graph.size)
    floor = np.zeros(graph.size)
    kernel = np.isin(graph.stream, KERNEL_STREAMS)
    # A side-stream kernel (a rewrite's device work) runs its duration on its stream: no curve, no link.
    own = np.where(kernel, graph.duration_s, 0.0)
    collective = np.flatnonzero((graph.group >= 0) & ~kernel)
    op = np.array([GRAPH_STREAM_OPS[name] for name in graph.stream[collective]], dtype=object)
    size = graph.wire_bytes[collective]
    anchor_time, anchor_link, target_time, target_link, target_fastest = (
        np.zeros(len(collective)) for _ in range(5)
    )
    for name in set(op.tolist()):
        chosen = op == name
        anchor_time[chosen] = anchor.curves[name].time_s(size[chosen])
        anchor_link[chosen] = anchor.curves[name].link_s(size[chosen])
        target_time[chosen] = target.curves[name].time_s(size[chosen])
        target_fastest[chosen] = target.curves[name].fastest_time_s(size[chosen])
        target_link[chosen] = target.curves[name].link_s(size[chosen])
    # The rank's own time on its stream beyond what the anchor's sweep explains is in-run overhead
    # (the CPU it shared with compute, Python in hooks): kept. The target's fixed part and link part
    # replace the anchor's; the link part goes through the shared link, a 1/W_a share per traced rank.
    # What the anchor's curve explains of a collective's measured time: its fixed part, and its link part
    # stretched by the link-bearing collectives its rank had in flight beside it (they shared the link).
    # Only the remainder is in-run overhead; the target's own contention comes from the shared link.
    beside = np.ones(len(collective))
    start, end = graph.measured_start_s[collective], graph.measured_end_s[collective]
    ranks = graph.rank[collective]
    for r in set(ranks.tolist()):
        mine = ranks == r
        beside[mine] = mean_concurrency(start[mine], end[mine])
    explained = anchor_time - anchor_link + anchor_link * beside
    in_run_rest = graph.duration_s[collective] - explained
    own[collective] = np.maximum(0.0, target_time - target_link + in_run_rest)
    own_link[collective] = target_link / graph.world_size
    # No rank finishes a collective before every rank has issued it and it has moved its bytes.
    floor[collective] = target_fastest
    hosts = np.zeros(graph.size, dtype=int)  # the emulated cluster's ranks share one host
    multiplicity = np.full(graph.world_size, target.world_size / graph.world_size)
    if target.host_cores:
        # Rank classes stand for W_t / W_a ranks each; on a host of `ranks_per_host` ranks they weigh that.
        per_host = min(target.ranks_per_host, target.world_size)
        multiplicity = np.full(graph.world_size, per_host / graph.world_size)
        if per_host < graph.world_size:
            notes.append(
                f"{graph.world_size} traced ranks stand for {per_host} ranks per host: each weighs "
                f"{per_host / graph.world_size:.2g} on the host's {target.host_cores} cores"
            )
    costs = Costs(
        work_s=work,
        own_s=own,
        own_link_work_s=own_link,
        fixed_s=np.zeros(graph.size),
        link_work_s=np.zeros(graph.size),
        residual_s=floor,
        lag_s=graph.lag_s,
        host=hosts,
        multiplicity=multiplicity,
        host_cores=float(target.host_cores),
        comm_cpu_s=target_transport,
    )
    return costs, notes
