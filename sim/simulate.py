"""The sweep: (model, dtype, world size, system) → one SimRecord, plus timelines and JSON output — every
number from the one op-graph path (docs/simulator.md).

For each (model, dtype, world size W, system) on a cluster preset:

1. **Anchor**: the bundle's run of that system (else of ZeRO-3, to be rewritten) of the model and dtype
   at W when traced, else at the largest traced W; at the target depth when traced, else the deepest.
2. Each of its iterations' events → **op graph** (`build_graph`) → **depth rewrite** (`repeat_blocks`, to
   the full model or `--layers`) → **system rewrite** (sim/system_rewrite.py, for a system the bundle has
   no runs of) → **cluster rewrite** onto W GPUs of the preset (`rewrite_costs` with `preset_cluster`) →
   **evaluate** (simpy, shared link).
3. The record: p5/p50/p95 over the anchor's iterations; the breakdown, the codec figures and the bounds
   from the iteration nearest the median (`iteration_nominal_s`), its critical path
   (`sim.evaluate.critical_path`).

Runs of an analytic bundle have identical ranks: one rank stands for all. A measured run's compute is
the traced device's; on a preset of another device it is refused (no compute model is built).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import traces

from .cluster import ClusterPreset
from .collectives import CollectiveModel
from .depth import check_target_depth, repeat_blocks
from .errors import SimInputError
from .evaluate import BREAKDOWN_KEYS, Costs, Evaluation, critical_path, evaluate, evaluation_key
from .memory import MemoryEstimate, ModelFootprint, activation_bytes, estimate, model_footprint
from .opgraph import OpGraph, build_graph
from .predict import BlockComputeFit, fit_block_compute, parameter_ratio
from .rewrite import (
    ClusterSpec,
    compute_scale,
    preset_cluster,
    rewrite_costs,
    traced_cluster,
    transport_scale,
)
from .shards import shard_table
from .system_rewrite import (
    BSC_SYSTEMS,
    CIERA_SYSTEMS,
    INTRA_NODE_GATHER_STREAM,
    AnchorTime,
    CieraPlan,
    CieraTemplate,
    SystemGraph,
    ciera_plan,
    system_graph,
)

SYSTEMS = ("zero3", "fsdp", "zeropp", "ciera-er", "ciera-er-bsc", "ciera")
FP16_ONLY_SYSTEMS = ("zeropp",)
# Timeline threads in this order (a stream an iteration does not use is left out).
TIMELINE_STREAMS = (
    "compute", "gather_host", "optim", "codec_send", "codec_recv", "ccp_send", "ccp_recv", "allgather",
    INTRA_NODE_GATHER_STREAM, "reduce_scatter", "all_reduce",
)  # fmt: skip
SCHEMA = "ciera.simulate/1"
DEFAULT_GPUS = (4, 8, 16, 32, 64, 128)
MAX_GPUS = 65536  # beyond the largest training clusters; a typo (1000000) is refused, not simulated
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class SimRecord:
    model: str
    dtype: str
    gpus: int
    system: str
    source: str  # trace source: measured | analytic | mixed
    projected: bool  # world size or depth not traced: the numbers are projections
    iteration_s: dict[str, float]  # p5, p50, p95 over the Monte Carlo samples
    iteration_nominal_s: float  # the simpy replay at nominal (median) durations
    breakdown_s: dict[str, float]  # critical path of the nominal replay; sums to iteration_nominal_s
    codec_busy_s: float  # every codec kernel of the iteration (any stream), nominal
    codec_off_critical_path_s: float  # codec_busy_s − breakdown_s["codec_critical"]: hidden under other work
    codec_removal_saving_s: float  # nominal iteration − the same schedule with every codec kernel at 0 s
    allgather_bytes_per_iter: float  # Σ gathered tensor sizes (wire format), as every rank assembles them
    allgather_bytes_inter_node_per_iter: float  # received by one rank over the inter-node network
    allgather_bytes_intra_node_per_iter: float  # received by one rank over NVLink inside its node
    reduce_scatter_bytes_per_iter: float
    speedup_vs_zero3: float
    speedup_vs_zeropp: float | None
    shards_selected: int
    shards_total: int
    receiver_cache_bytes: float  # ExpCache the selected shards need on each receiving GPU
    within_cache_budget: bool  # receiver_cache_bytes <= ciera.cache_budget_bytes (True without a cache)
    payload_ratio: float  # this system's gathered bytes / zero3's
    bound_speedup: float | None  # this system's own bound (bound_basis); None where none applies
    bound_basis: str  # bytes | link | none: which bound model (docs/simulator.md)
    overlap_only_speedup: float | None
    speedup_parts: dict[str, float]  # bytes × overlap × other = speedup_vs_zero3
    full_layers: int  # the depth simulated
    compute_world_size: int  # the anchor run's world size (its compute is per rank at a fixed batch)
    anchor_run: str  # the traced run the record is a rewrite of
    iterations: int  # the anchor's iterations, each rewritten and evaluated (the p5/p50/p95 are over them)
    cluster: str
    simulated_events: int
    notes: list[str] = field(default_factory=list)  # what the simulation substituted or assumed
    details: list[str] = field(default_factory=list)  # choices among valid plans (--verbose)
    # One GPU's memory by what holds it (sim/memory.py, bytes), its total and whether it fits the preset's
    # device (None: the preset states no device memory). A record that does not fit is left out of
    # "fastest" and "pays from".
    memory: dict[str, Any] = field(default_factory=dict)
    gpus_per_node: int = 0  # of the preset: where W starts to span nodes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quantiles(samples: np.ndarray) -> dict[str, float]:
    p5, p50, p95 = np.percentile(samples, [5, 50, 95])
    return {"p5": float(p5), "p50": float(p50), "p95": float(p95)}


def _speedup_parts(speedup: float, bound: float | None, overlap_only: float | None) -> dict[str, float]:
    """Split a speedup multiplicatively: first what less link time (fewer bytes, or for ZeRO++ also hpZ's
    intra-node gathers) can explain (at most bound/overlap_only), then what overlap the baseline lacked can
    explain (at most overlap_only), the rest is `other` (above 1: unexplained gain; below 1: the system's
    own overheads). Without a bound everything is `other`."""
    if bound is None or overlap_only is None:
        return {"bytes": 1.0, "overlap": 1.0, "other": float(speedup)}
    bytes_ceiling = max(bound / overlap_only, 1.0)
    from_bytes = min(max(speedup, 1.0), bytes_ceiling)
    from_overlap = min(max(speedup / from_bytes, 1.0), max(overlap_only, 1.0))
    return {
        "bytes": float(from_bytes),
        "overlap": float(from_overlap),
        "other": float(speedup / (from_bytes * from_overlap)),
    }


@dataclass
class _Outcome:
    """One system at one (model, dtype, W): every iteration evaluated, the representative one kept."""

    times_s: np.ndarray
    system: SystemGraph  # of the representative iteration
    result: Evaluation
    costs: Costs  # of the representative iteration on the target
    events: int
    plan: CieraPlan | None
    anchor_run: str
    selection: str  # benefit | all | none (CIERA systems with BSC)
    rewrite: str  # the system rewrite applied to the anchor's graphs ("zero3": none)
    representative: int  # index of the iteration nearest the median
    notes: tuple[str, ...] = ()


def _busy(graph: OpGraph, values: np.ndarray, streams: Iterable[str]) -> float:
    """Σ `values` over one rank's ops on `streams`."""
    return float(values[np.isin(graph.stream, list(streams)) & (graph.rank == graph.rank.min())].sum())


def _link_seconds(graph: OpGraph, costs: Costs, streams: Iterable[str]) -> float:
    """How long the ops on `streams` hold the shared link, every rank's part summed: a time no schedule
    can shorten (the link is serial), unlike the collectives' latencies, which overlap."""
    return float(costs.own_link_work_s[np.isin(graph.stream, list(streams))].sum())


_GATHERS = ("allgather", INTRA_NODE_GATHER_STREAM)
_OTHER_COMM = ("reduce_scatter", "all_reduce")


def _bound_speedup(
    system: str,
    outcome: _Outcome,
    zero3_nominal_s: float,
    compute_busy_s: float,
    allgather_busy_s: float,
    other_comm_busy_s: float,
    payload_ratio: float,
) -> tuple[float | None, str]:
    """(the most this system can gain over zero3, which model says so); docs/simulator.md.

    CIERA systems ("bytes", DESIGN.md): zero3's gathers shrunk to r of their time, perfectly overlapped.
    The others ("link"): the time the system's own collectives take alone on the target — for ZeRO++ its
    int8 forward gathers across W, hpZ gathers inside the node and int4 gradient scatters — perfectly
    overlapped. Both sides are zero3's compute, which no system here shortens. "none": zero3 has neither
    compute nor collective time, so no ratio exists."""
    if system in CIERA_SYSTEMS:
        link_s = payload_ratio * allgather_busy_s + other_comm_busy_s
        basis = "bytes"
    else:
        graph = outcome.system.graph
        link_s = _link_seconds(graph, outcome.costs, TIMELINE_STREAMS)
        basis = "link"
    denominator = max(compute_busy_s, link_s)
    if denominator <= 0:
        return None, "none"
    return zero3_nominal_s / denominator, basis


def resolve_models(bundle: traces.TraceBundle, models: Sequence[str] | None) -> list[str]:
    known = sorted(set(bundle.runs["model"]))
    if not known:
        raise SimInputError("bundle: table 'runs' is empty, nothing to simulate")
    if not models:
        return known
    lookup = {name.lower(): name for name in known}
    resolved: list[str] = []
    for name in models:
        canonical = lookup.get(name.lower()) or lookup.get(_shipped_model_name(name).lower())
        if canonical is None:
            raise SimInputError(
                f"--models: model {name!r} is not in the bundle, expected one of {known} "
                "(or a short name; `ciera models` lists them)"
            )
        if canonical in resolved:
            raise SimInputError(f"--models: {name!r} names {canonical} again; list each model once")
        resolved.append(canonical)
    return resolved


def _shipped_model_name(name: str) -> str:
    """The model name a key or alias of traces/data/models stands for (`olmoe` → `OLMoE-1B-7B`), else ''."""
    try:
        return traces.load_model_shape(name).name
    except (traces.ModelShapeError, OSError, ValueError):
        return ""


# Preset tables that shape how the analytic generator writes a bundle's events (its compute roofline, its
# prefetch rule), not how a traced run is rewritten: a simulation keeps the trace's compute and schedule.
GENERATOR_ONLY_TABLES = ("compute", "schedule")


def check_simulate_overrides(overrides: dict[str, str]) -> None:
    """Refuse a --set/--sweep of a field that a simulation of a traced bundle cannot change."""
    for key in overrides:
        table = key.split(".", 1)[0]
        if table in GENERATOR_ONLY_TABLES:
            raise SimInputError(
                f"--set {key}: a simulation keeps the traced run's {table} (its events); [{table}] shapes "
                "the analytic generator — regenerate a bundle with `ciera analytic-bundle --settings FILE` "
                "and a preset that sets it"
            )


def check_request(systems: Sequence[str], gpus: Sequence[int], dtypes: Sequence[str]) -> None:
    for system in systems:
        if system not in SYSTEMS:
            raise SimInputError(f"--systems: unknown system {system!r}, expected one of {list(SYSTEMS)}")
    for world_size in gpus:
        if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 2:
            raise SimInputError(f"--gpus: value {world_size!r}, expected integers >= 2")
        if world_size > MAX_GPUS:
            raise SimInputError(
                f"--gpus: value {world_size}, expected at most {MAX_GPUS} (the largest world size simulated)"
            )
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise SimInputError(f"--dtype: value {dtype!r}, expected one of {list(DTYPES)}")


class Simulator:
    """The op-graph path on one bundle and cluster preset, with what it can reuse cached: the depth-
    rewritten graphs of an anchor (they do not depend on W or the system) and the shard tables."""

    def __init__(self, bundle: traces.TraceBundle, preset: ClusterPreset, layers: int | None = None) -> None:
        self.bundle = bundle
        self.layers = layers  # simulate this many blocks instead of the full model
        self.preset = preset
        self.collectives = CollectiveModel.from_preset(preset, bundle.collectives)
        source = {
            "preset": "set in the preset",
            "measured": "fitted to the bundle's measured multi-node collectives",
            "calibration": "fitted to the preset's calibration points",
        }[self.collectives.inter_beta_source]
        self.calibration_note = (
            f"inter-node β {self.collectives.inter_beta_Bps / 1e9:.3g} GB/s of {preset.name}: {source}"
        )
        self.runs = bundle.runs_with_events()
        self.events_by_run = dict(tuple(bundle.events.groupby("run_id", sort=False, observed=True)))
        self._graphs: dict[tuple[str, int], list[OpGraph]] = {}
        self._traced_graphs: dict[str, list[OpGraph]] = {}  # per run, at its traced depth
        self._evaluations: dict[bytes, Evaluation] = {}  # by evaluation_key
        self._anchors: dict[tuple[str, str, int, str], pd.Series] = {}
        self._traced_systems: dict[tuple[str, str], frozenset[str]] = {}
        self._candidates: dict[tuple[str, str, str], tuple[pd.DataFrame, frozenset[int]]] = {}
        self._full_layers: dict[tuple[str, str], int] = {}
        self._picks: dict[tuple[str, str, str, int], pd.Series] = {}
        self._anchor_times: dict[str, AnchorTime] = {}
        # (anchor run, depth, iteration, system) → its system graph, for the rewrites without a CIERA plan:
        # they do not depend on W, so every W after the first reuses them.
        self._system_graphs: dict[tuple[str, int, int, str], SystemGraph] = {}
        # (anchor run, depth, iteration) → the CIERA rewrites of its graph by shape (CieraTemplate).
        self._ciera_templates: dict[tuple[str, int, int], dict[tuple, CieraTemplate]] = {}
        self._model_runs: dict[tuple[str, str], pd.DataFrame] = {}
        self._anchor_clusters: dict[str, ClusterSpec] = {}
        self._transport_scales: dict[str, tuple[float, str | None]] = {}
        self._compute_scales: dict[str, float] = {}
        self._block_fits: dict[str, BlockComputeFit] = {}
        self._targets: dict[int, ClusterSpec] = {}
        self._shards: dict[tuple[str, str, int], tuple[pd.DataFrame, tuple[str, ...]]] = {}
        self._outcomes: dict[tuple[str, str, str, int, str], _Outcome] = {}
        self._footprints: dict[tuple[str, int], ModelFootprint] = {}
        self._activations: dict[tuple[str, str, int], tuple[float, str]] = {}
        self.simulated_events = 0
        self.simpy_seconds = 0.0
        self.simulated_runs = 0
        # (system, model, dtype, W) where selecting every shard or none ran faster than BSC's choice.
        self.selection_overrides: dict[tuple[str, str, str, int], str] = {}

    # ------------------------------------------------------------------------------------ what is traced
    def model_runs(self, model: str, dtype: str) -> pd.DataFrame:
        if (model, dtype) not in self._model_runs:
            runs = self.runs[(self.runs["model"] == model) & (self.runs["dtype"] == dtype)]
            if runs.empty:
                raise SimInputError(f"bundle: model {model!r} has no {dtype} runs with events")
            self._model_runs[(model, dtype)] = runs
        return self._model_runs[(model, dtype)]

    def target_layers(self, model: str, dtype: str) -> int:
        if (model, dtype) not in self._full_layers:
            self._full_layers[(model, dtype)] = int(self.model_runs(model, dtype)["full_layers"].iloc[0])
        full = self._full_layers[(model, dtype)]
        if self.layers is not None:
            check_target_depth(self.layers, model, full)
        return self.layers or full

    def anchor(self, model: str, dtype: str, world_size: int, system: str) -> pd.Series:
        """The run `system` at (model, dtype, W) is simulated from (docs above)."""
        key = (model, dtype, world_size, system)
        if key not in self._anchors:
            self._anchors[key] = self._anchor(model, dtype, world_size, system)
        return self._anchors[key]

    def _anchor(self, model: str, dtype: str, world_size: int, system: str) -> pd.Series:
        runs = self.model_runs(model, dtype)
        traced = self._traced_systems.get((model, dtype))
        if traced is None:
            traced = self._traced_systems[(model, dtype)] = frozenset(runs["system"])
        source = system if system in traced else "zero3"
        if source not in traced:
            raise SimInputError(
                f"bundle: model {model!r} ({dtype}) has no run of {system!r} or of zero3 to rewrite into it"
            )
        # Every system the bundle lacks, and every W a system is not traced at, is simulated from the same
        # runs: they are filtered once per (model, dtype, system traced), the pick made once per traced W.
        if (model, dtype, source) not in self._candidates:
            candidates = runs[runs["system"] == source]
            self._candidates[(model, dtype, source)] = (
                candidates,
                frozenset(int(w) for w in candidates["world_size"]),
            )
        candidates, traced_w = self._candidates[(model, dtype, source)]
        chosen_w = world_size if world_size in traced_w else max(traced_w)
        key = (model, dtype, source, chosen_w)
        if key not in self._picks:
            self._picks[key] = self._pick(candidates, chosen_w, self.target_layers(model, dtype))
        return self._picks[key]

    def _pick(self, candidates: pd.DataFrame, chosen_w: int, depth: int) -> pd.Series:
        at_w = candidates[candidates["world_size"] == chosen_w]
        same_depth = at_w[at_w["layers"] == depth]
        pick = same_depth if len(same_depth) else at_w[at_w["layers"] == at_w["layers"].max()]
        anchor = pick.sort_values("run_id").iloc[0]
        refusal = _other_device(anchor, self.preset)
        if refusal:
            raise SimInputError(refusal)
        return anchor

    def graphs(self, anchor: pd.Series, target_layers: int) -> list[OpGraph]:
        """The anchor's iterations at `target_layers` blocks (one rank of an analytic run: its ranks are
        identical)."""
        run_id = str(anchor["run_id"])
        key = (run_id, target_layers)
        if key not in self._graphs:
            if run_id not in self._traced_graphs:  # a run serves several depths: built once
                events = self.events_by_run[run_id]
                if anchor["source"] == "analytic":
                    events = events[events["rank"] == events["rank"].min()]
                self._traced_graphs[run_id] = [
                    build_graph(rows) for _, rows in events.groupby("iteration", sort=True)
                ]
            traced_layers = int(anchor["layers"])
            ratio, block_compute_s = 1.0, None
            if traced_layers != target_layers:
                ratio = parameter_ratio(self.bundle, run_id, traced_layers, target_layers)
                block_compute_s = self.block_fit(anchor).block_compute_s
            self._graphs[key] = [
                repeat_blocks(graph, traced_layers, target_layers, ratio, block_compute_s)
                for graph in self._traced_graphs[run_id]
            ]
        return self._graphs[key]

    def block_fit(self, anchor: pd.Series) -> BlockComputeFit:
        """The depth rewrite's per-block compute for `anchor`: fitted over the traced depths of its model,
        dtype, system, world size and cluster (sim/depth.py)."""
        run_id = str(anchor["run_id"])
        if run_id not in self._block_fits:
            runs = self.model_runs(str(anchor["model"]), str(anchor["dtype"]))
            same = runs[
                (runs["system"] == anchor["system"])
                & (runs["world_size"] == anchor["world_size"])
                & (runs["cluster"] == anchor["cluster"])
            ]
            self._block_fits[run_id] = fit_block_compute(self.bundle, same)
        return self._block_fits[run_id]

    def anchor_cluster(self, anchor: pd.Series) -> ClusterSpec:
        run_id = str(anchor["run_id"])
        if run_id not in self._anchor_clusters:
            self._anchor_clusters[run_id] = traced_cluster(self.bundle.collectives, anchor)
        return self._anchor_clusters[run_id]

    def transport_scale(self, anchor: pd.Series) -> tuple[float, str | None]:
        """The anchor run's in-run transport CPU over its sweep's (sim/rewrite.py `transport_scale`), and
        a note when the run did not record it."""
        run_id = str(anchor["run_id"])
        if run_id not in self._transport_scales:
            traced = self.graphs(anchor, int(anchor["layers"]))
            self._transport_scales[run_id] = transport_scale(anchor, traced, self.anchor_cluster(anchor))
        return self._transport_scales[run_id]

    def compute_scale(self, anchor: pd.Series) -> float:
        """The anchor run's compute calibration (sim/rewrite.py `compute_scale`), once per run."""
        run_id = str(anchor["run_id"])
        if run_id not in self._compute_scales:
            traced = self.graphs(anchor, int(anchor["layers"]))
            self._compute_scales[run_id] = compute_scale(
                traced, self.anchor_cluster(anchor), self.transport_scale(anchor)[0]
            )
        return self._compute_scales[run_id]

    def anchor_time_s(self, anchor: pd.Series) -> AnchorTime:
        """The anchor cluster's collective times (what the system rewrites rescale durations by),
        remembered per (curve op, sizes): the rewrites ask for the same few sizes once per collective of
        every iteration, world size and system."""
        run_id = str(anchor["run_id"])
        if run_id not in self._anchor_times:
            curves = self.anchor_cluster(anchor).curves
            known: dict[tuple[str, str, bytes], np.ndarray] = {}

            def anchor_time_s(op: str, sizes: np.ndarray) -> np.ndarray:
                sizes = np.asarray(sizes)
                key = (op, sizes.dtype.str, sizes.tobytes())
                if key not in known:
                    times = np.asarray(curves[op].time_s(sizes))
                    times.flags.writeable = False  # shared by every caller of these sizes
                    known[key] = times
                return known[key]

            self._anchor_times[run_id] = anchor_time_s
        return self._anchor_times[run_id]

    def target(self, world_size: int) -> ClusterSpec:
        if world_size not in self._targets:
            self._targets[world_size] = preset_cluster(self.preset, self.collectives, world_size)
        return self._targets[world_size]

    def shards(self, model: str, dtype: str, graph: OpGraph) -> tuple[pd.DataFrame, tuple[str, ...]]:
        layers = int(graph.layer.max()) - 1
        key = (model, dtype, layers)
        if key not in self._shards:
            gathered = (graph.stream == "allgather") & (graph.rank == graph.rank.min())
            layer_numel: dict[int, float] = {}
            for layer, size in zip(graph.layer[gathered], graph.raw_bytes[gathered], strict=True):
                layer_numel[int(layer)] = max(layer_numel.get(int(layer), 0.0), float(size) / 2)
            notes: list[str] = []
            table = shard_table(self.bundle, model, dtype, layers, layer_numel, self.preset, notes)
            self._shards[key] = (table, tuple(notes))
        return self._shards[key]

    # --------------------------------------------------------------------------------- one system
    def plan(
        self, system: str, model: str, dtype: str, world_size: int, graph: OpGraph, selection: str
    ) -> tuple[CieraPlan, tuple[str, ...]]:
        shards, notes = self.shards(model, dtype, graph)
        first_rank = (graph.stream == "allgather") & (graph.rank == graph.rank.min())
        per_layer = np.unique(graph.layer[first_rank], return_counts=True)[1]
        gathers = int(per_layer.max()) if len(per_layer) else 1
        budget_bytes, budget_note = self.cache_budget(system, model, dtype, world_size)
        plan = ciera_plan(
            system, shards, dtype, world_size, gathers, self.preset, self.collectives, selection, budget_bytes
        )
        return plan, (*notes, *([budget_note] if budget_note else []))

    def run(
        self, system: str, model: str, dtype: str, world_size: int, selection: str = "benefit"
    ) -> _Outcome:
        key = (system, model, dtype, world_size, selection)
        if key in self._outcomes:
            return self._outcomes[key]
        anchor = self.anchor(model, dtype, world_size, system)
        rewrite = system if anchor["system"] != system else "zero3"
        anchor_cluster = self.anchor_cluster(anchor)
        if rewrite == "zeropp" and "all_gather_intra" not in anchor_cluster.curves:
            raise SimInputError(
                f"zeropp from run {anchor['run_id']!r}: its cluster has no intra-node gather curve for hpZ"
            )
        target = self.target(world_size)
        graphs = self.graphs(anchor, self.target_layers(model, dtype))
        plan, plan_notes = None, ()
        if rewrite in CIERA_SYSTEMS:
            plan, plan_notes = self.plan(rewrite, model, dtype, world_size, graphs[0], selection)

        anchor_time_s = self.anchor_time_s(anchor)
        scale, scale_note = self.transport_scale(anchor)
        work_scale = self.compute_scale(anchor)
        if scale_note:
            plan_notes = (*plan_notes, scale_note)
        depth = self.target_layers(model, dtype)
        if depth != int(anchor["layers"]):
            # Said only where nothing could be pooled: a preset's anchors are analytic runs (a measured one
            # is refused on another device), whose pooled block is the generator's own per-block cost — a
            # note per model on the default sweep's console would say nothing a measurement could contradict.
            block_fit = self.block_fit(anchor)
            if block_fit.block_compute_s is None:
                plan_notes = (*plan_notes, f"depth rewrite: {block_fit.describe()}")
        started = time.perf_counter()
        evaluated = []
        for iteration, graph in enumerate(graphs):
            graph_key = (str(anchor["run_id"]), depth, iteration, rewrite)
            rewritten = self._system_graphs.get(graph_key) if plan is None else None
            if rewritten is None:
                templates = self._ciera_templates.setdefault(graph_key[:3], {})
                rewritten = system_graph(
                    rewrite, graph, dtype, self.preset, anchor_time_s, plan, False, templates
                )
                if plan is None:
                    self._system_graphs[graph_key] = rewritten
            costs, _ = rewrite_costs(
                rewritten.graph, anchor_cluster, target, scale, work_scale, engine=str(anchor["engine"])
            )
            evaluated.append((rewritten, costs, self.evaluated(rewritten.graph, costs)))
        self.simpy_seconds += time.perf_counter() - started
        times = np.array([result.iteration_s for _, _, result in evaluated])
        nearest = int(np.argmin(np.abs(times - np.median(times))))
        rewritten, costs, result = evaluated[nearest]
        events = sum(result.events for _, _, result in evaluated)
        self.simulated_runs += 1
        outcome = _Outcome(
            times_s=times,
            system=rewritten,
            result=result,
            costs=costs,
            events=events,
            plan=plan,
            anchor_run=str(anchor["run_id"]),
            selection=selection,
            rewrite=rewrite,
            representative=nearest,
            notes=plan_notes,
        )
        self._outcomes[key] = outcome
        return outcome

    def evaluated(self, graph: OpGraph, costs: Costs) -> Evaluation:
        """`evaluate(graph, costs)`, once per `evaluation_key`; `simulated_events` counts the events
        simpy processed (a record's own count is its evaluations' whether or not they were reused)."""
        key = evaluation_key(graph, costs)
        result = self._evaluations.get(key)
        if result is None:
            result = self._evaluations[key] = evaluate(graph, costs)
            self.simulated_events += result.events
        return result

    def codec_free_s(self, outcome: _Outcome, model: str, dtype: str, world_size: int, system: str) -> float:
        """The representative iteration with every codec kernel at 0 s (same schedule)."""
        anchor = self.anchor(model, dtype, world_size, system)
        anchor_cluster = self.anchor_cluster(anchor)
        graphs = self.graphs(anchor, self.target_layers(model, dtype))
        nearest = outcome.representative
        # The rewrite the outcome was made with: a system traced in the bundle is its own graph.
        free = system_graph(
            outcome.rewrite,
            graphs[nearest],
            dtype,
            self.preset,
            self.anchor_time_s(anchor),
            outcome.plan,
            without_codec=True,
            templates=self._ciera_templates.setdefault(
                (str(anchor["run_id"]), self.target_layers(model, dtype), nearest), {}
            ),
        )
        costs, _ = rewrite_costs(
            free.graph,
            anchor_cluster,
            self.target(world_size),
            self.transport_scale(anchor)[0],
            self.compute_scale(anchor),
            engine=str(anchor["engine"]),
        )
        return self.evaluated(free.graph, costs).iteration_s

    def best(self, system: str, model: str, dtype: str, world_size: int) -> _Outcome:
        """`system`'s outcome; for BSC systems the fastest of BSC's choice, every shard (when the cache
        budget holds them all) and none — selection must never lose to either (the choice is noted)."""
        chosen = self.run(system, model, dtype, world_size)
        if system not in BSC_SYSTEMS or chosen.plan is None:
            return chosen
        plan = chosen.plan
        every_fits = float(plan.decisions["memory_bytes"].sum()) <= float(
            self.preset.ciera.cache_budget_bytes
        )
        total = len(plan.decisions)
        for selection, skip in (
            ("all", plan.shards_selected == total or not every_fits),
            ("none", plan.shards_selected == 0),
        ):
            if skip:
                continue
            # Every shard without CCP is ciera-er's plan; no shard is the plain engine's graph.
            same = {"all": "ciera-er" if system == "ciera-er-bsc" else None, "none": "zero3"}[selection]
            if same is not None:
                candidate = self.run(same, model, dtype, world_size)
            else:
                candidate = self.run(system, model, dtype, world_size, selection)
            if np.median(candidate.times_s) < np.median(chosen.times_s) * (1 - 1e-9):
                chosen = candidate
                self.selection_overrides[(system, model, dtype, world_size)] = selection
        return chosen

    # ----------------------------------------------------------------------------------- memory
    def footprint(self, anchor: pd.Series, layers: int) -> ModelFootprint:
        key = (str(anchor["run_id"]), layers)
        if key not in self._footprints:
            self._footprints[key] = model_footprint(self.bundle, key[0], int(anchor["layers"]), layers)
        return self._footprints[key]

    def activations(self, model: str, anchor: pd.Series, layers: int) -> tuple[float, str]:
        """(bytes, '' or a note saying why they are not counted) for one GPU of `model`."""
        key = (model, str(anchor["run_id"]), layers)
        if key not in self._activations:
            try:
                shape = traces.load_model_shape(model)
            except (traces.ModelShapeError, OSError, ValueError):
                self._activations[key] = (
                    0.0,
                    f"{model}: activations not in the memory estimate (no shape for it in traces/data/models)",
                )
            else:
                self._activations[key] = (
                    activation_bytes(
                        shape,
                        layers,
                        int(anchor["seq_len"]),
                        int(anchor["micro_batch_size"]),
                        bool(anchor["activation_checkpointing"]),
                    ),
                    "",
                )
        return self._activations[key]

    def memory(
        self,
        system: str,
        model: str,
        dtype: str,
        world_size: int,
        plan: CieraPlan | None = None,
    ) -> MemoryEstimate:
        """One GPU's memory for `system` at W; without `plan`, before CIERA's sender state and cache."""
        anchor = self.anchor(model, dtype, world_size, system)
        layers = self.target_layers(model, dtype)
        schedule = self.preset.schedule
        return estimate(
            system,
            world_size,
            self.preset.gpus_per_node,
            self.footprint(anchor, layers),
            schedule.fsdp_prefetch_layers if system == "fsdp" else schedule.zero3_prefetch_layers,
            self.activations(model, anchor, layers)[0],
            plan.sender_values(world_size) if plan is not None else 0.0,
            plan.receiver_cache_bytes if plan is not None else 0.0,
            self.preset.device_memory_bytes,
        )

    def cache_budget(self, system: str, model: str, dtype: str, world_size: int) -> tuple[float, str]:
        """(the receiver cache BSC may use, '' or a note): the preset's budget, cut to what one GPU's memory
        leaves after the rest of the step (the sender keeps 1/(W − 1) of the cache besides)."""
        budget = float(self.preset.ciera.cache_budget_bytes)
        device = float(self.preset.device_memory_bytes)
        if device <= 0 or system == "ciera-er":  # ciera-er compresses every shard: the upper reference
            return budget, ""
        left = max(device - self.memory(system, model, dtype, world_size).total_bytes, 0.0)
        usable = left * (world_size - 1) / world_size
        if usable >= budget:
            return budget, ""
        if usable <= 0:
            return 0.0, ""  # the plain step does not fit either: the record says so
        return usable, (
            f"BSC's receiver cache budget cut below ciera.cache_budget_bytes ({budget / 2**30:.0f} GiB) to what "
            f"one GPU's {device / 2**30:.0f} GiB leaves after the rest of the step (the record's memory shows it)"
        )

    # ----------------------------------------------------------------------------------- records
    def records_for(self, model: str, dtype: str, world_size: int, systems: Sequence[str]) -> list[SimRecord]:
        wanted = [s for s in systems if not (dtype == "bf16" and s in FP16_ONLY_SYSTEMS)]
        needed = list(dict.fromkeys(["zero3", *(["zeropp"] if dtype == "fp16" else []), *wanted]))
        outcomes = {system: self.best(system, model, dtype, world_size) for system in needed}
        baseline = outcomes["zero3"]
        base_graph = baseline.system.graph
        # Busy times of zero3 on the target: the main thread's work, and the link's time per collective kind.
        compute_busy = _busy(base_graph, baseline.costs.work_s, ("compute", "gather_host", "optim"))
        allgather_busy = _link_seconds(base_graph, baseline.costs, _GATHERS)
        other_comm_busy = _link_seconds(base_graph, baseline.costs, _OTHER_COMM)
        base_p50 = float(np.median(baseline.times_s))
        base_nominal = baseline.result.iteration_s
        zeropp_p50 = float(np.median(outcomes["zeropp"].times_s)) if "zeropp" in outcomes else None
        base_bytes = _gathered_bytes(base_graph)
        runs = self.model_runs(model, dtype)
        target_layers = self.target_layers(model, dtype)
        projected = world_size not in {int(w) for w in runs["world_size"]} or target_layers not in {
            int(n) for n in runs["layers"]
        }
        source = "measured" if (runs["source"] == "measured").all() else str(runs["source"].iloc[0])
        records = []
        for system in wanted:
            outcome = outcomes[system]
            graph = outcome.system.graph
            p50 = float(np.median(outcome.times_s))
            gathered = _gathered_bytes(graph)
            ratio = gathered / max(base_bytes, 1.0)
            bound, basis = _bound_speedup(
                system, outcome, base_nominal, compute_busy, allgather_busy, other_comm_busy, ratio
            )
            overlap_denominator = max(compute_busy, allgather_busy + other_comm_busy)
            overlap_only = base_nominal / overlap_denominator if overlap_denominator > 0 else None
            speedup = base_p50 / p50
            parts = critical_path(graph, outcome.result, outcome.system.embedded_codec_s)
            codec_busy = outcome.system.codec_busy_s
            codec_saving = (
                max(
                    outcome.result.iteration_s - self.codec_free_s(outcome, model, dtype, world_size, system),
                    0.0,
                )
                if codec_busy > 0
                else 0.0
            )
            inter, intra = self._traffic(graph, world_size)
            scatter_bytes = float(
                graph.wire_bytes[(graph.stream == "reduce_scatter") & (graph.rank == graph.rank.min())].sum()
            )
            plan = outcome.plan
            cache_bytes = plan.receiver_cache_bytes if plan is not None else 0.0
            budget_bytes = float(self.preset.ciera.cache_budget_bytes)
            anchor = self.anchor(model, dtype, world_size, system)
            activation_note = self.activations(model, anchor, target_layers)[1]
            memory = self.memory(system, model, dtype, world_size, plan)
            # Notes name neither model, dtype nor W (the record does): the console groups equal notes.
            notes = [self.calibration_note, *([activation_note] if activation_note else [])]
            if not (graph.stream == "optim").any():
                notes.append(f"run {outcome.anchor_run} has no optimizer step in its events")
            notes += list(outcome.notes)
            # Choices made among valid plans, not substitutions: printed with --verbose.
            details = []
            if (system, model, dtype, world_size) in self.selection_overrides:
                choice = self.selection_overrides[(system, model, dtype, world_size)]
                details.append(
                    f"{system}: BSC's per-shard choice ran slower than "
                    f"{'compressing every shard' if choice == 'all' else 'compressing no shard'}; that plan is used"
                )
            if cache_bytes > budget_bytes:
                details.append(
                    f"{system}: compressing every shard needs more receiver cache per GPU than the "
                    f"{budget_bytes / 2**30:.0f} GiB budget (ciera.cache_budget_bytes; the record carries the "
                    "figure): an upper reference, not a deployable plan; ciera and ciera-er-bsc keep within it"
                )
            records.append(
                SimRecord(
                    model=model,
                    dtype=dtype,
                    gpus=world_size,
                    system=system,
                    source=source,
                    projected=projected,
                    iteration_s=_quantiles(outcome.times_s),
                    iteration_nominal_s=outcome.result.iteration_s,
                    breakdown_s={key: parts[key] for key in BREAKDOWN_KEYS},
                    codec_busy_s=codec_busy,
                    codec_off_critical_path_s=max(codec_busy - parts["codec_critical"], 0.0),
                    codec_removal_saving_s=codec_saving,
                    allgather_bytes_per_iter=gathered,
                    allgather_bytes_inter_node_per_iter=inter,
                    allgather_bytes_intra_node_per_iter=intra,
                    reduce_scatter_bytes_per_iter=scatter_bytes,
                    speedup_vs_zero3=speedup,
                    speedup_vs_zeropp=(zeropp_p50 / p50) if zeropp_p50 is not None else None,
                    shards_selected=plan.shards_selected if plan is not None else 0,
                    shards_total=len(plan.decisions) if plan is not None else 0,
                    receiver_cache_bytes=cache_bytes,
                    within_cache_budget=cache_bytes <= budget_bytes,
                    payload_ratio=ratio,
                    bound_speedup=bound,
                    bound_basis=basis,
                    overlap_only_speedup=overlap_only,
                    speedup_parts=_speedup_parts(speedup, bound, overlap_only),
                    full_layers=target_layers,
                    compute_world_size=int(self.anchor(model, dtype, world_size, system)["world_size"]),
                    anchor_run=outcome.anchor_run,
                    iterations=len(outcome.times_s),
                    cluster=self.preset.name,
                    simulated_events=outcome.events,
                    notes=notes,
                    details=details,
                    memory=memory.to_dict(),
                    gpus_per_node=self.preset.gpus_per_node,
                )
            )
        return records

    def _traffic(self, graph: OpGraph, world_size: int) -> tuple[float, float]:
        """(inter-node, intra-node) bytes one rank receives in its gathers of an iteration."""
        first = graph.rank == graph.rank.min()
        inter = intra = 0.0
        for stream, size in zip(graph.stream[first], graph.wire_bytes[first], strict=True):
            if stream == "allgather":
                a, b = self.collectives.allgather_traffic_bytes(float(size), world_size)
            elif stream == INTRA_NODE_GATHER_STREAM:
                a, b = self.collectives.intra_node_allgather_traffic_bytes(float(size), world_size)
            else:
                continue
            inter += a
            intra += b
        return inter, intra


def _other_device(run: pd.Series, preset: ClusterPreset) -> str:
    """Why a measured run cannot be simulated on `preset` ('' when it can): its compute is the traced
    device's, and no compute model moves it to another."""
    hardware = str(run["hardware"])
    if run["source"] != "measured" or hardware == preset.hardware:
        return ""
    return (
        f"--cluster {preset.name}: run {run['run_id']!r} was measured on {hardware!r}, the preset is "
        f"{preset.hardware or 'another device'}; its compute cannot be moved to another device (no compute "
        f"model is built) — simulate it on its own cluster (--cluster {run['cluster']} --gpus ...) or give a "
        "bundle traced on the preset's device"
    )


def other_device(bundle: traces.TraceBundle, preset: ClusterPreset) -> str:
    """Why the bundle's runs cannot be simulated on `preset` ('' when they can; see `_other_device`)."""
    for _, run in bundle.runs.iterrows():
        refusal = _other_device(run, preset)
        if refusal:
            return refusal
    return ""


def _gathered_bytes(graph: OpGraph) -> float:
    """Σ gathered tensor sizes (wire format) of one rank's iteration."""
    first = graph.rank == graph.rank.min()
    return float(graph.wire_bytes[first & np.isin(graph.stream, _GATHERS)].sum())


# A sweep of at least this many (model, dtype, W) jobs runs in worker processes, one per core: a job
# takes ~0.1–0.25 s here, a worker ~1.5 s to start (imports and the bundle), so fewer jobs would not gain.
PARALLEL_MIN_JOBS = 16
MAX_WORKERS = 8


def sweep_workers(jobs: int) -> int:
    """How many processes `simulate` uses for `jobs` jobs by default: the cores this process may run on
    (at most MAX_WORKERS) when there are at least PARALLEL_MIN_JOBS jobs, else 1 (in this process)."""
    if jobs < PARALLEL_MIN_JOBS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS, jobs))


def simulate(
    bundle: traces.TraceBundle,
    cluster: ClusterPreset,
    models: Sequence[str] | None = None,
    gpus: Sequence[int] = DEFAULT_GPUS,
    systems: Sequence[str] = SYSTEMS,
    dtypes: Sequence[str] = DTYPES,
    progress: Callable[[int, int], None] | None = None,
    layers: int | None = None,
    counters: dict[str, int] | None = None,
    workers: int | None = None,
) -> list[SimRecord]:
    """One record per (model, dtype, gpus, system); zeropp only for fp16 (as in DeepSpeed's evaluation).
    `layers`: simulate that many blocks instead of each model's full depth. `counters`, when given, gets
    `simulated_events` (the events simpy processed; an evaluation records share, once per process) and
    `workers`. `workers`: processes to run the sweep in (default `sweep_workers`); each takes whole
    (model, dtype) groups, and the records come back in the order one process gives them — the same
    values, since every evaluation is deterministic."""
    check_request(systems, gpus, dtypes)
    names = resolve_models(bundle, models)
    groups = [(model, dtype) for model in names for dtype in dtypes if _has_runs(bundle, model, dtype)]
    if not groups:
        raise SimInputError(f"bundle: no runs of {names} with dtype {list(dtypes)}")
    total = len(groups) * len(gpus)
    if workers is None:
        workers = sweep_workers(total)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SimInputError(f"workers={workers!r}: expected a whole number >= 1")
    workers = min(workers, len(groups))
    done = 0

    def finished(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    records_by_group: list[list[SimRecord]] = [[] for _ in groups]
    events = 0
    if workers == 1:
        simulator = Simulator(bundle, cluster, layers=layers)
        for position, (model, dtype) in enumerate(groups):
            for world_size in gpus:
                records_by_group[position].extend(simulator.records_for(model, dtype, world_size, systems))
                finished(1)
        events = simulator.simulated_events
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn, not fork: the parent may hold threads (pyarrow's pools) that a forked child would inherit
        # mid-lock; each worker unpickles the bundle once and keeps its own Simulator (and caches).
        with ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_sweep_worker,
            initargs=(bundle, cluster, layers),
        ) as pool:
            futures = {
                pool.submit(_sweep_group, model, dtype, list(gpus), list(systems)): position
                for position, (model, dtype) in enumerate(groups)
            }
            for future in as_completed(futures):
                group_records, group_events = future.result()
                records_by_group[futures[future]] = group_records
                events += group_events
                finished(len(gpus))
    if counters is not None:
        counters["simulated_events"] = events
        counters["workers"] = workers
    return [record for group in records_by_group for record in group]


_sweep_simulator: Simulator | None = None  # a sweep worker's own, made by _start_sweep_worker


def _start_sweep_worker(bundle: traces.TraceBundle, cluster: ClusterPreset, layers: int | None) -> None:
    global _sweep_simulator
    _sweep_simulator = Simulator(bundle, cluster, layers=layers)


def _sweep_group(model: str, dtype: str, gpus: list[int], systems: list[str]) -> tuple[list[SimRecord], int]:
    """One (model, dtype) group of a sweep in a worker: its records at every W, and the simpy events its
    evaluations took."""
    simulator = _sweep_simulator
    assert simulator is not None, "sweep worker not started"
    before = simulator.simulated_events
    records = [
        record for world_size in gpus for record in simulator.records_for(model, dtype, world_size, systems)
    ]
    return records, simulator.simulated_events - before


def _has_runs(bundle: traces.TraceBundle, model: str, dtype: str) -> bool:
    runs = bundle.runs
    return bool(((runs["model"] == model) & (runs["dtype"] == dtype)).any())


def timeline(
    bundle: traces.TraceBundle,
    cluster: ClusterPreset,
    model: str,
    dtype: str,
    gpus: int,
    systems: Iterable[str] = SYSTEMS,
    layers: int | None = None,
) -> dict[str, Any]:
    """One simulated iteration per system as Chrome trace JSON (opens in Perfetto / chrome://tracing):
    one process per system, one thread per stream, complete events with µs timestamps."""
    check_request(list(systems), [gpus], [dtype])
    (model,) = resolve_models(bundle, [model])
    simulator = Simulator(bundle, cluster, layers=layers)
    events: list[dict[str, Any]] = []
    for pid, system in enumerate(systems, start=1):
        if dtype == "bf16" and system in FP16_ONLY_SYSTEMS:
            continue
        outcome = simulator.best(system, model, dtype, gpus)
        graph, result = outcome.system.graph, outcome.result
        label = f"{system} — {model} {dtype} W={gpus}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        shown = graph.rank == graph.rank.min()  # one rank (the ranks of a preset run are alike)
        streams = [name for name in TIMELINE_STREAMS if (graph.stream[shown] == name).any()]
        tids = {stream: tid for tid, stream in enumerate(streams, start=1)}
        for stream, tid in tids.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}}
            )
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        for index in np.flatnonzero(shown):
            duration_us = (result.end_s[index] - result.start_s[index]) * 1e6
            stream = str(graph.stream[index])
            if duration_us <= 0 or stream not in tids:
                continue
            events.append(
                {
                    "ph": "X",
                    "name": _op_name(graph, int(index)),
                    "cat": stream,
                    "pid": pid,
                    "tid": tids[stream],
                    "ts": float(result.start_s[index]) * 1e6,
                    "dur": float(duration_us),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schema": "ciera.timeline/1"}}


def _op_name(graph: OpGraph, index: int) -> str:
    """A timeline label: what the op is, of which layer and phase."""
    stream, layer, phase = str(graph.stream[index]), int(graph.layer[index]), str(graph.phase[index])
    what = {
        "compute": phase,
        "gather_host": "gather host path",
        "optim": "optimizer step",
        "codec_send": "hash+compress",
        "codec_recv": "decompress",
        "ccp_send": "hash+compress",
        "ccp_recv": "decompress",
        INTRA_NODE_GATHER_STREAM: "allgather (hpZ)",
    }.get(stream, stream)
    return what if layer < 0 else f"{what} L{layer}" + ("" if stream in ("compute", "optim") else f" {phase}")


def records_to_json(
    records: Sequence[SimRecord],
    cluster: ClusterPreset | None = None,
    *,
    cluster_option: str | None = None,
    overrides: Sequence[str] = (),
    bundle: str | None = None,
) -> dict[str, Any]:
    """The `ciera.simulate/1` document. `cluster_option`, `overrides` and `bundle` say how to simulate the
    same preset again (`ciera report --records` does, for its bandwidth sweep)."""
    document: dict[str, Any] = {"schema": SCHEMA, "records": [record.to_dict() for record in records]}
    if cluster is not None:
        document["cluster"] = cluster.name
    if cluster_option is not None:
        document["cluster_option"] = cluster_option
        document["overrides"] = list(overrides)
    if bundle is not None:
        document["bundle"] = bundle
    return document


def check_output_path(path: str | os.PathLike[str], option: str) -> Path:
    """Fail before any work when `path` can never be written as a file (a directory, or under a file)."""
    target = Path(path)
    if target.is_dir():
        raise SimInputError(f"{option} {target}: is a directory, expected a file path")
    directory = target.parent
    if not directory.is_dir():
        # Never create directories on the way: a typo would otherwise leave a tree behind (as root, anywhere).
        raise SimInputError(f"{option} {target}: directory {directory} does not exist")
    return target


def write_json_atomic(document: dict[str, Any], path: str | os.PathLike[str], option: str = "output") -> Path:
    """Write JSON next to `path` and rename it into place: readers never see a partial file."""
    target = check_output_path(path, option)
    try:
        handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    except OSError as error:
        raise SimInputError(f"{option} {target}: cannot write ({error.strerror or error})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes it private; an output file should not be
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=1, allow_nan=False)
            stream.write("\n")
        os.replace(staging, target)
    except BaseException as error:
        Path(staging).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise SimInputError(f"{option} {target}: cannot write ({error.strerror or error})") from None
        raise
    return target
