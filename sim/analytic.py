"""The analytic trace generator: per-layer traces computed from model shapes and a cluster preset,
for when no cluster of the right kind is at hand. Every run it writes has `source = "analytic"`.

What it computes, per layer and phase, on one rank of a W-rank ZeRO-3 group (docs/simulator.md):
- compute_s: forward FLOPs (sim.model_config.forward_flops) at `compute.peak_flops × compute.efficiency`;
  recompute = forward (activation checkpointing), backward = 2 × forward; the optimizer step is
  memory-bound: (numel / W) × bytes-per-parameter / `compute.memory_Bps`.
- allgather_bytes: 2 bytes × numel for the fwd and recompute gathers (16-bit weights); a checkpointed
  block's backward reuses what its recompute gathered (as DeepSpeed ZeRO-3 was measured to do: 2.1
  gathers of a block per iteration in traces/data/measured), so its bwd gathers 0;
  reduce_scatter_bytes: 2 bytes × numel in bwd. Their times come from the collective model.
- hash_s / compress_s / decompress_s: 0 — not measured; the simulator then uses the preset's codec figures.
- Per-layer times are scaled by seeded log-normal noise (the settings' coefficients of variation).
- events: ZeRO-3's schedule of those costs on one rank (`schedule_graph`: program order, each gather
  issued `schedule.zero3_prefetch_layers` steps ahead and run in order on its stream, reduce-scatters after
  each backward, the optimizer after the last one, gathers and reduce-scatters sharing the link) run by
  the simulator's one evaluator (sim/evaluate.py); every rank of the W-rank group gets the same events. The
  layers and iterations tables are derived from them by the rules a capture's are (traces.derive), so
  `ciera replay` reproduces an analytic run exactly and every projection reads it as it reads a measured one.
- exponents: per shard a block change rate drawn from Beta around the model's category prior
  (traces/data/models/*.toml), varied per iteration as 1 − (1 − q)^f with f log-normal of mean 1 (so a
  rate below 1 never becomes 1); at other block sizes q_B = 1 − (1 − q_512)^(B/512); the element rate is
  1 − (1 − q_B)^(1/B). Both assume changes independent across blocks and elements — stated, not measured.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import numpy as np
import pandas as pd

import traces

from .cluster import ClusterPreset, load_cluster
from .collectives import CollectiveModel
from .errors import SimInputError
from .evaluate import Costs, evaluate
from .model_config import forward_flops, layer_parameters, load_model_config
from .opgraph import OpGraph

GENERATOR_VERSION = "analytic/3"  # 2: change-rate spread no longer clips to 1; 3: events from the evaluator
BYTES_PER_16BIT_VALUE = 2
# DeepSpeed's defaults for stage3_prefetch_bucket_size, stage3_max_reuse_distance and
# stage3_max_live_parameters (elements), recorded in every analytic run's `runs` row.
DEEPSPEED_STAGE3_DEFAULTS = {
    "prefetch_bucket_size": 50_000_000,
    "max_reuse_distance": 1_000_000_000,
    "max_live_parameters": 1_000_000_000,
}


@dataclass(frozen=True)
class AnalyticSettings:
    cluster: str
    models: list[str]
    traced_layers: list[int]
    world_sizes: list[int]
    dtypes: list[str]
    seq_len: int
    micro_batch_size: int
    iterations: int
    activation_checkpointing: bool
    default_optimizer: str
    compute_time_cv: float
    comm_time_cv: float
    change_rate_concentration: float
    block_sizes: list[int]
    seed: int
    optimizer_bytes_per_param: dict[str, float]


def load_settings(path: str | Path | None = None) -> AnalyticSettings:
    """Read generator settings (default: sim/data/analytic_bundle.toml); one line naming the field for a
    missing, unknown or mistyped one."""
    source = Path(path) if path else Path(str(resources.files("sim") / "data" / "analytic_bundle.toml"))
    try:
        with source.open("rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise SimInputError(f"{source}: no such settings file") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SimInputError(f"{source}: bad generator settings: {error}") from None
    _check_settings(source, raw)
    return AnalyticSettings(**raw)


# Fields whose numbers may be zero or negative: the seed, and the spreads (>= 0, checked apart).
_ANY_SIGN = {"seed", "compute_time_cv", "comm_time_cv"}


def _check_settings(source: Path, raw: dict) -> None:
    """Every field of AnalyticSettings present, none other, each of its annotated type (bool is not an
    int here); counts and sizes positive, spreads >= 0."""
    hints = get_type_hints(AnalyticSettings)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise SimInputError(f"{source}: unknown field {unknown[0]!r}, expected one of {', '.join(hints)}")
    for name, hint in hints.items():
        if name not in raw:
            raise SimInputError(f"{source}: field {name!r} missing")
        value, (origin, arguments) = raw[name], (get_origin(hint), get_args(hint))
        if origin is list:
            ok = isinstance(value, list) and value and all(_is(item, arguments[0]) for item in value)
            expected = f"a non-empty list of {arguments[0].__name__}"
        elif origin is dict:
            ok = isinstance(value, dict) and all(_is(v, arguments[1]) for v in value.values())
            expected = f"a table of {arguments[1].__name__} values"
        else:
            ok, expected = _is(value, hint), hint.__name__
        if ok and name in ("compute_time_cv", "comm_time_cv"):
            ok, expected = value >= 0, "a number >= 0"
        elif ok and name not in _ANY_SIGN and hint in (int, float, list[int]):
            ok, expected = min(value if isinstance(value, list) else [value]) > 0, f"{expected} > 0"
        if not ok:
            raise SimInputError(f"{source}: field {name!r} is {value!r}, expected {expected}")


def _is(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and not isinstance(value, bool)


def _noise(rng: np.random.Generator, cv: float, size: int) -> np.ndarray:
    """Log-normal multipliers with mean 1 and the given coefficient of variation."""
    sigma = np.sqrt(np.log1p(cv * cv))
    return rng.lognormal(-0.5 * sigma * sigma, sigma, size)


@dataclass(frozen=True)
class _Step:
    """One (layer, phase) of the main thread, with what it gathers before and scatters after it."""

    layer: int
    phase: str
    compute_s: float
    gather_bytes: float
    gather_s: float
    gather_link_s: float
    scatter_bytes: float
    scatter_s: float
    scatter_link_s: float


def _main_order(steps_by_key: dict[tuple[int, str], _Step], layers: int) -> list[_Step]:
    """ZeRO-3's program order: forward 0..L+1; backward from the head down, each checkpointed block
    recomputing its forward before its backward; then the optimizer step layer by layer."""
    order = [(layer, "fwd") for layer in range(layers + 2)]
    for layer in range(layers + 1, -1, -1):
        order += [(layer, phase) for phase in ("recompute", "bwd") if (layer, phase) in steps_by_key]
    order += [(layer, "optim") for layer in range(layers + 2)]
    return [steps_by_key[key] for key in order]


def schedule_graph(steps: list[_Step], prefetch: int) -> tuple[OpGraph, Costs]:
    """The op graph of one rank's iteration (sim/opgraph.py) and its costs: each step on the main thread,
    waiting for its gather; the gather of step j issued when step j − `prefetch` starts (at prefetch 0: once
    step j − 1 is done) and run in order on the gather stream; a backward's reduce-scatter issued when it
    ends, in order on its stream; the optimizer after the last reduce-scatter. A collective moves its link
    part through the shared link (a gather beside a reduce-scatter gets half of it)."""
    main_count = len(steps)
    rows: list[dict] = [
        {"stream": "optim" if s.phase == "optim" else "compute", "layer": s.layer, "phase": s.phase}
        for s in steps
    ]
    main_prev = list(range(-1, main_count - 1))
    blocker = [-1] * main_count
    stream_prev: list[int] = [-1] * main_count
    work = [s.compute_s for s in steps]
    own, own_link, size = [0.0] * main_count, [0.0] * main_count, [0.0] * main_count
    last_on: dict[str, int] = {}

    def add_collective(
        stream: str, step: _Step, issuer: int, seconds: float, link_s: float, nbytes: float
    ) -> int:
        index = len(rows)
        rows.append({"stream": stream, "layer": step.layer, "phase": step.phase})
        main_prev.append(issuer)
        blocker.append(-1)
        stream_prev.append(last_on.get(stream, -1))
        last_on[stream] = index
        work.append(0.0)
        own.append(max(seconds - link_s, 0.0))
        own_link.append(min(link_s, seconds))
        size.append(nbytes)
        return index

    for j, step in enumerate(steps):
        if step.gather_bytes > 0:
            issuer = j - prefetch - 1 if prefetch > 0 else j - 1
            gather = add_collective(
                "allgather", step, max(issuer, -1), step.gather_s, step.gather_link_s, step.gather_bytes
            )
            blocker[j] = gather
    # Reduce-scatters are issued when their backward ends; add them after the gathers so that the stream
    # order is their issue order.
    last_scatter = -1
    for j, step in enumerate(steps):
        if step.scatter_bytes > 0:
            last_scatter = add_collective(
                "reduce_scatter", step, j, step.scatter_s, step.scatter_link_s, step.scatter_bytes
            )
    first_optim = next((j for j, s in enumerate(steps) if s.phase == "optim"), -1)
    if first_optim >= 0 and last_scatter >= 0:
        blocker[first_optim] = last_scatter
    count = len(rows)
    zeros = np.zeros(count)
    graph = OpGraph(
        rank=np.zeros(count, dtype=int),
        stream=np.array([r["stream"] for r in rows], dtype=object),
        layer=np.array([r["layer"] for r in rows], dtype=int),
        phase=np.array([r["phase"] for r in rows], dtype=object),
        duration_s=np.array(work) + np.array(own) + np.array(own_link),
        tail_s=zeros,
        lag_s=zeros,
        main_prev=np.array(main_prev),
        stream_prev=np.array(stream_prev),
        blocker=np.array(blocker),
        offset_s=zeros,
        raw_bytes=np.array(size),
        wire_bytes=np.array(size),
        group=np.where(np.arange(count) >= main_count, np.arange(count), -1),
        world_size=1,
        measured_start_s=zeros,
        measured_end_s=zeros,
        issued_s=zeros,
    )
    costs = Costs(
        work_s=np.array(work),
        own_s=np.array(own),
        own_link_work_s=np.array(own_link),
        fixed_s=zeros,
        link_work_s=zeros,
        residual_s=zeros,
        lag_s=zeros,
        host=np.zeros(count, dtype=int),
        multiplicity=np.ones(1),
    )
    return graph, costs


def _schedule_events(steps: list[_Step], prefetch: int) -> pd.DataFrame:
    """One rank's events of the iteration the schedule gives (the one evaluator runs it)."""
    graph, costs = schedule_graph(steps, prefetch)
    result = evaluate(graph, costs)
    issuer_end = np.where(graph.main_prev >= 0, result.end_s[np.maximum(graph.main_prev, 0)], 0.0)
    issued = np.where(graph.is_main, result.start_s, issuer_end)
    events = pd.DataFrame(
        {
            "layer": graph.layer,
            "phase": graph.phase,
            "stream": graph.stream,
            "issued_s": issued,
            "start_s": result.start_s,
            "end_s": result.end_s,
            "raw_bytes": np.rint(graph.raw_bytes).astype(np.int64),
            "wire_bytes": np.rint(graph.wire_bytes).astype(np.int64),
        }
    )
    return events.sort_values(["start_s", "end_s"], kind="stable")


def _run_tables(
    model: traces.ModelShape,
    dtype: str,
    traced_layers: int,
    world_size: int,
    settings: AnalyticSettings,
    cluster: ClusterPreset,
    collectives: CollectiveModel,
    rng: np.random.Generator,
) -> tuple[dict, list[pd.DataFrame], list[dict], list[dict]]:
    """(runs row, event frames, layer numel rows, exponent rows) of one analytic run."""
    run_id = f"analytic-{model.key}-{dtype}-L{traced_layers}-W{world_size}"
    optimizer = model.optimizer or settings.default_optimizer
    tokens = settings.seq_len * settings.micro_batch_size
    sustained_flops = cluster.compute.peak_flops * cluster.compute.efficiency
    run = {
        "run_id": run_id,
        "source": "analytic",
        "model": model.name,
        "dtype": dtype,
        "layers": traced_layers,
        "full_layers": model.num_layers,
        "seq_len": settings.seq_len,
        "micro_batch_size": settings.micro_batch_size,
        "world_size": world_size,
        "gpus_per_node": cluster.gpus_per_node,
        "hardware": cluster.hardware,
        "cluster": cluster.name,
        "system": "zero3",
        "block_size": cluster.ciera.block_size,
        "activation_checkpointing": settings.activation_checkpointing,
        "optimizer": optimizer,
        "versions": json.dumps(
            {"generator": GENERATOR_VERSION, "ciera_traces_schema": traces.SCHEMA_VERSION}
        ),
        # The schedule modelled is ZeRO-3's with DeepSpeed's default stage-3 settings; no link is shaped or
        # measured and nothing is warmed up or clock-aligned (these are model outputs, not captures).
        "engine": "zero3",
        "backend": "analytic",
        "nodes": -(-world_size // cluster.gpus_per_node),
        **DEEPSPEED_STAGE3_DEFAULTS,
        "reshard_after_forward": False,
        "link_rate_Bps": 0.0,
        "link_latency_s": 0.0,
        "measured_link_Bps": 0.0,
        "warmup_iterations": 0,
        "clock_spread_s": 0.0,
        # Not a bucket: the generator reduce-scatters each layer's gradients in that layer's backward.
        "reduce_bucket_size": float("nan"),
    }
    event_frames: list[pd.DataFrame] = []
    exponent_rows: list[dict] = []
    per_layer = [layer_parameters(model, layer, traced_layers) for layer in range(traced_layers + 2)]
    numel_rows = [
        {"run_id": run_id, "layer": layer, "numel": sum(p.numel for p in params)}
        for layer, params in enumerate(per_layer)
    ]
    shards = [p for params in per_layer for p in params]
    # Per-shard change rate at B = 512, fixed for the run; iterations vary around it.
    concentration = settings.change_rate_concentration
    shard_rate_512 = np.array(
        [
            rng.beta(max(q, 1e-4) * concentration, max(1 - q, 1e-4) * concentration) if 0 < q < 1 else q
            for q in (model.block_change_rate_prior[s.category] for s in shards)
        ]
    )
    for iteration in range(settings.iterations):
        steps: dict[tuple[int, str], _Step] = {}
        for layer, params in enumerate(per_layer):
            kind = "embedding" if layer == 0 else "head" if layer == traced_layers + 1 else "block"
            numel = sum(p.numel for p in params)
            gathered_bytes = BYTES_PER_16BIT_VALUE * numel
            if kind == "embedding":  # a lookup: memory-bound, read one row per token
                fwd_s = tokens * model.hidden_size * BYTES_PER_16BIT_VALUE / cluster.compute.memory_Bps
            else:
                fwd_s = forward_flops(model, params, settings.seq_len, tokens) / sustained_flops
            phases = ["fwd"]
            if kind == "block" and settings.activation_checkpointing:
                phases.append("recompute")
            phases += ["bwd", "optim"]
            compute_noise = _noise(rng, settings.compute_time_cv, len(phases))
            comm_noise = _noise(rng, settings.comm_time_cv, 2 * len(phases))
            for index, phase in enumerate(phases):
                if phase == "optim":
                    optimizer_bytes = settings.optimizer_bytes_per_param[optimizer] * numel / world_size
                    compute_s = optimizer_bytes / cluster.compute.memory_Bps
                    gather_bytes = scatter_bytes = 0
                else:
                    compute_s = fwd_s * (2.0 if phase == "bwd" else 1.0)
                    # The recompute's gather also serves the backward: DeepSpeed ZeRO-3 was measured
                    # gathering a checkpointed block 2.1 times per iteration, not 3 (traces/data/measured).
                    reused = phase == "bwd" and "recompute" in phases
                    gather_bytes = 0 if reused else gathered_bytes
                    scatter_bytes = gathered_bytes if phase == "bwd" else 0
                gather_scale, scatter_scale = comm_noise[2 * index], comm_noise[2 * index + 1]
                steps[(layer, phase)] = _Step(
                    layer=layer,
                    phase=phase,
                    compute_s=compute_s * compute_noise[index],
                    gather_bytes=gather_bytes,
                    gather_s=collectives.allgather_s(gather_bytes, world_size) * gather_scale,
                    gather_link_s=collectives.link_s("all_gather", gather_bytes, world_size) * gather_scale,
                    scatter_bytes=scatter_bytes,
                    scatter_s=collectives.reduce_scatter_s(scatter_bytes, world_size) * scatter_scale,
                    scatter_link_s=collectives.link_s("reduce_scatter", scatter_bytes, world_size)
                    * scatter_scale,
                )
        rank_events = _schedule_events(
            _main_order(steps, traced_layers), cluster.schedule.zero3_prefetch_layers
        )
        # Every rank of the group runs the same schedule (the analytic ranks are identical).
        for rank in range(world_size):
            event_frames.append(rank_events.assign(run_id=run_id, rank=rank, iteration=iteration))
        if iteration == 0:
            continue  # change rates compare iteration t with t-1
        # Iteration-to-iteration spread acts on the per-element change hazard: the chance that a 512-block
        # is unchanged, 1 − q, is raised to a log-normal power of mean 1. The rate stays in [0, 1) and only
        # a prior of exactly 1 gives 1 (scaling q itself and clipping set 6–7 % of attention and router
        # shards to q = 1, hence an exponent change rate of 1 — every value changed — which no prior said).
        rate_512 = 1.0 - (1.0 - shard_rate_512) ** _noise(rng, 0.05, len(shards))
        for block_size in settings.block_sizes:
            rate_b = 1.0 - (1.0 - rate_512) ** (block_size / 512)
            element_rate = 1.0 - (1.0 - rate_b) ** (1.0 / block_size)
            exponent_rows.extend(
                {
                    "run_id": run_id,
                    "iteration": iteration,
                    "layer": shard.layer,
                    "shard": shard.name,
                    "category": shard.category,
                    "numel": shard.numel,
                    "block_size": block_size,
                    "exp_change_rate": float(element_rate[i]),
                    "block_change_rate": float(rate_b[i]),
                }
                for i, shard in enumerate(shards)
            )
    return run, event_frames, numel_rows, exponent_rows


def generate_bundle(
    settings: AnalyticSettings, overrides: dict[str, str] | None = None
) -> traces.TraceBundle:
    """Build the analytic bundle the settings describe (deterministic for a given seed): each run's
    events from its schedule evaluated by the one evaluator, and its layers and iterations derived from
    those events by the same rules as a capture's (traces.derive_layer_tables)."""
    cluster = load_cluster(settings.cluster, overrides or {})
    collectives = CollectiveModel.from_preset(cluster, None)
    rng = np.random.default_rng(settings.seed)
    runs, event_frames, numel_rows, exponents = [], [], [], []
    for model_name in settings.models:
        model = load_model_config(model_name)
        for dtype in settings.dtypes:
            for traced_layers in settings.traced_layers:
                for world_size in settings.world_sizes:
                    run, run_events, run_numel, exponent_rows = _run_tables(
                        model,
                        dtype,
                        min(traced_layers, model.num_layers),
                        world_size,
                        settings,
                        cluster,
                        collectives,
                        rng,
                    )
                    runs.append(run)
                    event_frames += run_events
                    numel_rows += run_numel
                    exponents += exponent_rows

    def frame(name: str, rows: list[dict] | pd.DataFrame) -> pd.DataFrame:
        empty = traces.empty_table(name)
        if not len(rows):
            return empty
        return pd.DataFrame(rows, columns=empty.columns).astype(empty.dtypes.to_dict())

    runs_frame = frame("runs", runs)
    events = (
        frame("events", pd.concat(event_frames, ignore_index=True)) if event_frames else frame("events", [])
    )
    layers, iterations = traces.derive_layer_tables(runs_frame, events, pd.DataFrame(numel_rows))
    return traces.TraceBundle(
        runs=runs_frame,
        layers=layers,
        iterations=iterations,
        collectives=traces.empty_table("collectives"),
        exponents=frame("exponents", exponents),
        events=events,
    )
