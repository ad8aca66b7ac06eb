"""Predict a configuration from traced runs by the graph rewrites (sim/rewrite.py, sim/depth.py) and the
one evaluator — the code path of every projection, and the one `ciera validate sim` checks.

For a target (model, system, cluster, depth): the anchor is a traced run of the same model and system on
the closest cluster (same ranks per node first, then the same link); its depth the target's when traced
there, else the deepest traced. Each of the anchor's iterations is rewritten — depth (repeat the block
subgraphs; each block added or dropped changes the compute by the mean block of every traced depth),
cluster (re-cost every collective from the two clusters' curves, compute on the target's shared
cores, optimizer by the partitioning rule) — and evaluated; the prediction is the median.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import traces

from .ciera_rewrite import CodecFigures, ParameterLayout, ciera_graph, parameter_sizes
from .depth import block_map, repeat_blocks
from .errors import SimInputError
from .evaluate import critical_path, evaluate, middle_index
from .opgraph import KERNEL_STREAMS, iteration_graphs
from .rewrite import ClusterSpec, compute_scale, rewrite_costs, traced_cluster, transport_scale


@dataclass(frozen=True)
class Prediction:
    iteration_s: float  # median over the anchor's rewritten iterations
    basis: str  # what it was predicted from, in words
    anchor_run: str
    events: int  # simpy events the evaluations took
    notes: tuple[str, ...] = ()
    # The anchor's in-sample calibrations (sim/rewrite.py): its transport CPU over its sweep's, and the
    # factor on its compute work at which it re-costed onto its own cluster spends its measured time.
    transport_scale: float = 1.0
    compute_scale: float = 1.0
    # Where the predicted main thread's time goes: per main-thread stream (compute, optim, codec_send,
    # codec_recv), seconds per rank and iteration (the mean over ranks and iterations, as
    # traces.stream_summaries gives a measured run's) — to hold each part against the measured run's
    # (benchmarks/main_thread_split.py).
    main_thread_s: dict[str, float] = field(default_factory=dict)
    # The critical path (`sim.evaluate.critical_path`, seconds per part) of the rewritten iteration in the
    # middle (`middle_index`), the same attribution a measured run's replayed middle iteration gets.
    critical_path_s: dict[str, float] = field(default_factory=dict)
    # The collectives likewise: per collective stream (allgather, reduce_scatter, all_reduce), its ops' time
    # from start to end summed per rank and iteration (as traces.stream_summaries gives a measured run's) and
    # the median op's — to hold against the measured run's collectives (benchmarks/main_thread_split.py).
    collective_s: dict[str, float] = field(default_factory=dict)
    collective_median_s: dict[str, float] = field(default_factory=dict)


def parameter_ratio(
    bundle: traces.TraceBundle, anchor_id: str, anchor_layers: int, target_layers: int
) -> float:
    """The parameter count at `target_layers` (the anchor's blocks repeated like its events are) over the
    anchor's: what the depth rewrite scales the optimizer step and whole-model collectives by."""
    layers = bundle.layers[(bundle.layers["run_id"] == anchor_id) & (bundle.layers["phase"] == "fwd")]
    if layers.empty:
        raise SimInputError(f"bundle: run {anchor_id!r} has no layer rows to count its parameters")
    first = layers[layers["iteration"] == layers["iteration"].min()].set_index("layer")["numel"]
    blocks = [float(first.get(layer, 0.0)) for layer in range(1, anchor_layers + 1)]
    others = float(first.sum()) - sum(blocks)
    target = others + sum(blocks[source - 1] for source in block_map(anchor_layers, target_layers))
    return target / float(first.sum())


@dataclass(frozen=True)
class BlockComputeFit:
    """The depth rewrite's per-block compute (sim/depth.py): one block's main-thread compute per rank and
    iteration, the mean over every block of the traced runs of one model, system and cluster."""

    block_compute_s: float | None  # None: no traced block to pool
    depths: tuple[int, ...]  # the traced depths pooled
    blocks: int  # the blocks pooled (one per block and run)

    def describe(self) -> str:
        depths = ", ".join(str(depth) for depth in self.depths)
        if self.block_compute_s is None:
            return "each block added costs the traced blocks' compute (no traced block compute to pool)"
        return (
            f"{self.block_compute_s * 1e3:.0f} ms of compute per block added "
            f"(the mean of {self.blocks} traced blocks, L = {depths})"
        )


def fit_block_compute(bundle: traces.TraceBundle, runs: pd.DataFrame) -> BlockComputeFit:
    """The per-block compute of `runs` (the traced runs of one model, system and cluster): each block
    1..L of each run is one sample, its `compute` events summed per rank and iteration."""
    depth = runs.set_index("run_id")["layers"].astype(int)
    events = bundle.events[
        bundle.events["run_id"].isin(depth.index.tolist()) & (bundle.events["stream"] == "compute")
    ]
    samples: list[float] = []
    depths: set[int] = set()
    for run_id, of_run in events.groupby("run_id", sort=True, observed=True):
        layers = int(depth[run_id])
        blocks = of_run[(of_run["layer"] >= 1) & (of_run["layer"] <= layers)]
        if blocks.empty:
            continue
        per_rank_iteration = of_run["rank"].nunique() * of_run["iteration"].nunique()
        per_block = (blocks["end_s"] - blocks["start_s"]).groupby(blocks["layer"]).sum() / per_rank_iteration
        samples += per_block.tolist()
        depths.add(layers)
    mean_s = float(np.mean(samples)) if samples else None
    return BlockComputeFit(mean_s, tuple(sorted(depths)), len(samples))


def choose_anchor(seen: traces.TraceBundle, target: pd.Series, system: str | None = None) -> pd.DataFrame:
    """The seen runs of the target's model and `system` (default: the target's) on the closest cluster."""
    runs = seen.runs_with_events()
    system = system or target["system"]
    candidates = runs[(runs["model"] == target["model"]) & (runs["system"] == system)]
    if candidates.empty:
        raise SimInputError(
            f"no traced run of model {target['model']!r} and system {system!r} to predict {target['run_id']!r} from"
        )
    closeness = (
        (candidates["cluster"] != target["cluster"]).astype(int) * 8
        + (candidates["gpus_per_node"] != target["gpus_per_node"]).astype(int) * 4
        + (candidates["nodes"] != target["nodes"]).astype(int) * 2
        + (candidates["link_rate_Bps"] != target["link_rate_Bps"]).astype(int)
    )
    cluster = candidates.assign(_distance=closeness).sort_values(["_distance", "cluster"]).iloc[0]["cluster"]
    return candidates[candidates["cluster"] == cluster].sort_values("layers")


@dataclass(frozen=True)
class CieraOn:
    """What the "turn CIERA on" rewrite needs: the codec figures and the parameters' sizes."""

    figures: CodecFigures
    engine: str  # zero3 | fsdp: the plain engine whose graph is rewritten
    plain_system: str  # its system name in the bundle


def predict_run(
    seen: traces.TraceBundle,
    target: pd.Series,
    target_cluster: ClusterSpec,
    collectives: pd.DataFrame,
    ciera_on: CieraOn | None = None,
) -> Prediction:
    """The median iteration time of `target` (a runs row: model, system, layers, cluster) on
    `target_cluster`, from `seen`'s runs by the rewrites; with `ciera_on`, from the plain engine's runs
    with CIERA's gathers written in."""
    system = ciera_on.plain_system if ciera_on is not None else None
    anchors = choose_anchor(seen, target, system)
    depths = [int(d) for d in anchors["layers"]]
    target_layers = int(target["layers"])
    anchor = anchors.iloc[depths.index(target_layers)] if target_layers in depths else anchors.iloc[-1]
    anchor_id, anchor_layers = str(anchor["run_id"]), int(anchor["layers"])
    anchor_cluster = traced_cluster(collectives, anchor)
    ratio, block_fit = 1.0, None
    if anchor_layers != target_layers:
        ratio = parameter_ratio(seen, anchor_id, anchor_layers, target_layers)
        block_fit = fit_block_compute(seen, anchors)
    events = seen.events[seen.events["run_id"] == anchor_id]
    times, simulated, notes = [], 0, []
    evaluated = []  # (graph, evaluation) per iteration, for the middle one's critical path
    main_thread: dict[str, list[float]] = {}
    collective: dict[str, list[float]] = {}  # per collective stream: each iteration's per-rank sum
    collective_ops: dict[str, list[np.ndarray]] = {}  # … and its ops' durations
    counts: dict[str, int] = {}
    layout = ParameterLayout(parameter_sizes(seen, target_layers)) if ciera_on is not None else None
    traced = list(iteration_graphs(events).values())
    scale, scale_note = transport_scale(anchor, traced, anchor_cluster)
    work_scale = compute_scale(traced, anchor_cluster, scale)
    for traced_graph in traced:
        graph = repeat_blocks(
            traced_graph,
            anchor_layers,
            target_layers,
            ratio,
            block_fit.block_compute_s if block_fit else None,
        )
        if ciera_on is not None:
            graph = ciera_graph(
                graph,
                ciera_on.engine,
                ciera_on.figures,
                layout,
                lambda op, wire: anchor_cluster.curves[op].time_s(wire),
                counts,
                world_size=target_cluster.world_size,
                work_scale=work_scale,
            )
        costs, notes = rewrite_costs(
            graph, anchor_cluster, target_cluster, scale, work_scale, engine=str(anchor["engine"])
        )
        result = evaluate(graph, costs)
        times.append(result.iteration_s)
        evaluated.append((graph, result))
        simulated += result.events
        busy_s, ranks = result.end_s - result.start_s, len(np.unique(graph.rank))  # rank classes
        for stream in np.unique(graph.stream[graph.is_main]).tolist():
            main_thread.setdefault(stream, []).append(float(busy_s[graph.stream == stream].sum()) / ranks)
        collective_op = (graph.group >= 0) & ~np.isin(graph.stream, KERNEL_STREAMS)  # as sim.rewrite reads it
        for stream in np.unique(graph.stream[collective_op]).tolist():
            on_stream = busy_s[graph.stream == stream]
            collective.setdefault(stream, []).append(float(on_stream.sum()) / ranks)
            collective_ops.setdefault(stream, []).append(on_stream)
    if scale_note:
        notes = [*notes, scale_note]
    if block_fit is not None:  # what every block added costs: on the console, not only in the basis
        notes = [
            *notes,
            f"depth rewrite of {anchor['system']} on {anchor_cluster.name}: blocks {anchor_layers} → "
            f"{target_layers}, {block_fit.describe()}",
        ]
    basis = f"{anchor_id} ({len(times)} iterations)"
    if anchor_layers != target_layers:
        basis += f", blocks repeated {anchor_layers} → {target_layers}"
        if block_fit is not None:
            basis += f", {block_fit.describe()}"
    if anchor_cluster.name != target_cluster.name:
        basis += f", re-costed on {target_cluster.name}"
    elif anchor_cluster.world_size != target_cluster.world_size:
        basis += f", re-costed on {target_cluster.name} at W = {target_cluster.world_size}"
    if ciera_on is not None:
        basis += f", CIERA written in ({counts.get('ciera_gathers', 0) // max(len(times), 1)} gathers per iteration)"
        if counts.get("buckets_not_split"):
            notes = [*notes, f"{counts['buckets_not_split'] // max(len(times), 1)} gathered buckets per iteration "
                     "matched no run of parameters and count as one shard each"]  # fmt: skip
        if counts.get("pipelined_calls"):
            notes = [*notes, f"{counts['pipelined_calls'] // max(len(times), 1)} CIERA calls per iteration are large enough "
                     "for the runtime to pipeline (2 × part_bytes per rank); the rewrite sends each as one bucket"]  # fmt: skip
        if counts.get("calls_not_decoded"):
            notes = [*notes, f"{counts['calls_not_decoded'] // max(len(times), 1)} CIERA calls per iteration have no "
                     "op after them that uses them; their decode is left out"]  # fmt: skip
        split_note = ciera_on.figures.decode_sources_note(target_cluster.world_size)
        if split_note is not None:
            notes = [*notes, f"{target['system']}: {split_note}"]
        if counts.get("overflow_rounds"):
            basis += f", {counts['overflow_rounds'] // max(len(times), 1)} overflow rounds per iteration"
    return Prediction(
        float(np.median(times)),
        basis,
        anchor_id,
        simulated,
        tuple(notes),
        scale,
        work_scale,
        {stream: float(np.mean(values)) for stream, values in main_thread.items()},
        critical_path(*evaluated[middle_index(times)]) if evaluated else {},
        {stream: float(np.mean(values)) for stream, values in collective.items()},
        {stream: float(np.median(np.concatenate(ops))) for stream, ops in collective_ops.items()},
    )
