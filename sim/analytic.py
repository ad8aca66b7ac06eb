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
- iteration_s: Σ over layers and phases of max(compute_s, allgather_s + reduce_scatter_s) plus the
  optimizer step — a prefetch-overlapped estimate, not a simulation.
- exponents: per shard a block change rate drawn from Beta around the model's category prior
  (traces/data/models/*.toml), varied per iteration as 1 − (1 − q)^f with f log-normal of mean 1 (so a
  rate below 1 never becomes 1); at other block sizes q_B = 1 − (1 − q_512)^(B/512); the element rate is
  1 − (1 − q_B)^(1/B). Both assume changes independent across blocks and elements — stated, not measured.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

import traces

from .cluster import ClusterPreset, load_cluster
from .collectives import CollectiveModel
from .errors import SimInputError
from .model_config import ModelConfig, forward_flops, layer_parameters, load_model_config

GENERATOR_VERSION = "analytic/2"  # 2: per-iteration change-rate spread no longer clips to 1
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
    """Read generator settings (default: sim/data/analytic_bundle.toml)."""
    source = Path(path) if path else Path(str(resources.files("sim") / "data" / "analytic_bundle.toml"))
    try:
        with source.open("rb") as handle:
            raw = tomllib.load(handle)
        return AnalyticSettings(**raw)
    except FileNotFoundError:
        raise SimInputError(f"{source}: no such settings file") from None
    except (tomllib.TOMLDecodeError, TypeError) as error:
        raise SimInputError(f"{source}: bad generator settings: {error}") from None


def _noise(rng: np.random.Generator, cv: float, size: int) -> np.ndarray:
    """Log-normal multipliers with mean 1 and the given coefficient of variation."""
    sigma = np.sqrt(np.log1p(cv * cv))
    return rng.lognormal(-0.5 * sigma * sigma, sigma, size)


def _run_tables(
    model: ModelConfig,
    dtype: str,
    traced_layers: int,
    world_size: int,
    settings: AnalyticSettings,
    cluster: ClusterPreset,
    collectives: CollectiveModel,
    rng: np.random.Generator,
) -> tuple[dict, list[dict], list[dict], list[dict]]:
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
    }
    layer_rows: list[dict] = []
    iteration_rows: list[dict] = []
    exponent_rows: list[dict] = []
    per_layer = [layer_parameters(model, layer, traced_layers) for layer in range(traced_layers + 2)]
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
        iteration_s = 0.0
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
                compute_s *= compute_noise[index]
                gather_s = (
                    collectives.allgather_s(gather_bytes, world_size) * comm_noise[2 * index]
                    if gather_bytes
                    else 0.0
                )
                scatter_s = (
                    collectives.reduce_scatter_s(scatter_bytes, world_size) * comm_noise[2 * index + 1]
                    if scatter_bytes
                    else 0.0
                )
                iteration_s += max(compute_s, gather_s + scatter_s)
                layer_rows.append(
                    {
                        "run_id": run_id,
                        "iteration": iteration,
                        "layer": layer,
                        "layer_kind": kind,
                        "phase": phase,
                        "numel": numel,
                        "compute_s": compute_s,
                        "allgather_bytes": gather_bytes,
                        "allgather_s": gather_s,
                        "reduce_scatter_bytes": scatter_bytes,
                        "reduce_scatter_s": scatter_s,
                        "hash_s": 0.0,
                        "compress_s": 0.0,
                        "decompress_s": 0.0,
                    }
                )
        iteration_rows.append({"run_id": run_id, "iteration": iteration, "iteration_s": iteration_s})
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
    return run, layer_rows, iteration_rows, exponent_rows


def generate_bundle(
    settings: AnalyticSettings, overrides: dict[str, str] | None = None
) -> traces.TraceBundle:
    """Build the analytic bundle the settings describe (deterministic for a given seed)."""
    cluster = load_cluster(settings.cluster, overrides or {})
    collectives = CollectiveModel.from_preset(cluster, None)
    rng = np.random.default_rng(settings.seed)
    runs, layers, iterations, exponents = [], [], [], []
    for model_name in settings.models:
        model = load_model_config(model_name)
        for dtype in settings.dtypes:
            for traced_layers in settings.traced_layers:
                for world_size in settings.world_sizes:
                    run, layer_rows, iteration_rows, exponent_rows = _run_tables(
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
                    layers += layer_rows
                    iterations += iteration_rows
                    exponents += exponent_rows

    def frame(name: str, rows: list[dict]) -> pd.DataFrame:
        empty = traces.empty_table(name)
        return pd.DataFrame(rows, columns=empty.columns).astype(empty.dtypes.to_dict()) if rows else empty

    return traces.TraceBundle(
        runs=frame("runs", runs),
        layers=frame("layers", layers),
        iterations=frame("iterations", iterations),
        collectives=traces.empty_table("collectives"),
        exponents=frame("exponents", exponents),
    )
