"""From a trace bundle to a full-depth per-layer cost profile of one (model, dtype) at one traced world size.

Projection to depth: for every phase and quantity (compute_s, allgather_bytes, reduce_scatter_bytes,
numel, codec times) the total over the traced transformer blocks is fitted as a + b·L over the traced
depths L (e.g. 2, 4, 6, 8); the full model's blocks each get (a + b·N)/N. The embedding (layer 0) and the
head (layer L+1) are kept as traced. The fit's relative RMS residual is reported.

Projection to world size W: per-rank compute does not change with W in data parallelism, so compute comes
from the run traced at W when there is one, else from the largest traced W; gathered and reduced byte
counts are full sizes and do not depend on W; collective times are recomputed by the cost model.
Measured runs replace analytic ones of the same (model, dtype, L, W).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import traces

from .cluster import ClusterPreset
from .errors import SimInputError

PHASE_ORDER = ("fwd", "recompute", "bwd", "optim")
FITTED_QUANTITIES = (
    "numel",
    "compute_s",
    "allgather_bytes",
    "reduce_scatter_bytes",
    "hash_s",
    "compress_s",
    "decompress_s",
)


@dataclass(frozen=True)
class ModelProfile:
    """Nominal per-layer costs of one iteration at full depth, plus what the simulator needs to know about
    where they came from."""

    model: str
    dtype: str
    source: str  # measured | analytic | mixed
    full_layers: int
    traced_layers: tuple[int, ...]
    traced_world_sizes: tuple[int, ...]
    compute_world_size: int
    activation_checkpointing: bool
    # One row per (layer, phase) of the full-depth model: layer, layer_kind, phase, numel, compute_s,
    # allgather_bytes, reduce_scatter_bytes, hash_s, compress_s, decompress_s (codec times at
    # compute_world_size, 0 = not traced), compute_cv, allgather_cv, reduce_scatter_cv.
    layers: pd.DataFrame
    # One row per parameter tensor of the full-depth model: layer, shard, category, numel, q
    # (block change rate at the preset block size, before change_rate_scale).
    shards: pd.DataFrame
    fit_residual: float
    notes: tuple[str, ...] = field(default=())


class BundleIndex:
    """The bundle split once by run (string columns as plain objects: far faster to filter and iterate)."""

    def __init__(self, bundle: traces.TraceBundle) -> None:
        self.bundle = bundle
        self.runs = bundle.runs.astype({c: object for c in ("run_id", "source", "model", "dtype")})
        layers = bundle.layers.astype({"run_id": object, "layer_kind": object, "phase": object})
        self.layers_by_run = {run_id: frame for run_id, frame in layers.groupby("run_id", sort=False)}
        exponents = bundle.exponents.astype({"run_id": object, "shard": object, "category": object})
        self.exponents_by_run = {run_id: frame for run_id, frame in exponents.groupby("run_id", sort=False)}
        self._selected: dict[tuple[str, str], pd.DataFrame] = {}
        self._shards: dict[tuple[str, str, int, int], pd.DataFrame] = {}

    def selected_runs(self, model: str, dtype: str) -> pd.DataFrame:
        key = (model, dtype)
        if key not in self._selected:
            # Runs without layer rows (exponent-statistics runs) carry no iteration to profile.
            with_layers = self.runs[self.runs["run_id"].isin(self.layers_by_run.keys())]
            self._selected[key] = _select_runs(with_layers, model, dtype)
        return self._selected[key]


def _select_runs(all_runs: pd.DataFrame, model: str, dtype: str) -> pd.DataFrame:
    """One run per traced (L, W): measured before analytic, and the baseline engine's run (`zero3`, then
    `fsdp`) before a run captured under CIERA — the profile is the plain engine's iteration, which every
    simulated system then transforms. Runs of several clusters at one (L, W): the first cluster by name
    (`cluster_choices` names them, and the simulator says so)."""
    runs = all_runs[(all_runs["model"] == model) & (all_runs["dtype"] == dtype)]
    system_rank = runs["system"].map({"zero3": 0, "fsdp": 1}).fillna(2).astype(int)
    ranked = runs.assign(_rank=(runs["source"] != "measured").astype(int), _system=system_rank).sort_values(
        ["_rank", "_system", "cluster", "run_id"]
    )
    return ranked.drop_duplicates(["layers", "world_size"]).drop(columns=["_rank", "_system"])


def cluster_choices(all_runs: pd.DataFrame, model: str, dtype: str) -> list[str]:
    """The clusters whose runs of (model, dtype) the bundle holds; more than one means a choice was made."""
    runs = all_runs[(all_runs["model"] == model) & (all_runs["dtype"] == dtype)]
    return sorted(set(runs["cluster"]))


def available_models(bundle: traces.TraceBundle) -> list[str]:
    return sorted(set(bundle.runs["model"]))


def traced_world_sizes(index: BundleIndex, model: str, dtype: str) -> list[int]:
    return sorted(int(w) for w in set(index.selected_runs(model, dtype)["world_size"]))


def compute_world_size_for(index: BundleIndex, model: str, dtype: str, world_size: int) -> int:
    traced = traced_world_sizes(index, model, dtype)
    if not traced:
        raise SimInputError(f"bundle: model {model!r} has no {dtype} runs")
    return world_size if world_size in traced else max(traced)


def _coefficient_of_variation(values: pd.Series) -> float:
    mean = float(values.mean())
    if len(values) < 2 or mean <= 0:
        return 0.0
    return float(values.std(ddof=1) / mean)


def _linear_fit(depths: np.ndarray, totals: np.ndarray) -> tuple[float, float, float]:
    """(a, b, relative RMS residual) of totals ≈ a + b·L; one depth → a line through the origin."""
    if len(set(depths.tolist())) < 2:
        slope = float(np.mean(totals / depths))
        intercept = 0.0
    else:
        slope, intercept = (float(c) for c in np.polyfit(depths, totals, 1))
    predicted = intercept + slope * depths
    nonzero = totals != 0
    residual = (
        float(np.sqrt(np.mean(((predicted[nonzero] - totals[nonzero]) / totals[nonzero]) ** 2)))
        if nonzero.any()
        else 0.0
    )
    return intercept, slope, residual


def build_profile(
    index: BundleIndex,
    model: str,
    dtype: str,
    compute_world_size: int,
    preset: ClusterPreset,
    target_layers: int | None = None,
) -> ModelProfile:
    """The profile at the model's full depth, or at `target_layers` blocks (a traced depth replays the
    traced configuration; any other is projected by the same fit)."""
    runs = index.selected_runs(model, dtype)
    runs = runs[runs["world_size"] == compute_world_size]
    if runs.empty:
        raise SimInputError(f"bundle: model {model!r} has no {dtype} run at world size {compute_world_size}")
    # A depth fit needs the traced depths to differ in depth only.
    for column in ("seq_len", "micro_batch_size", "hardware", "gpus_per_node", "full_layers"):
        values = sorted(set(runs[column]))
        if len(values) > 1:
            raise SimInputError(
                f"bundle: the {dtype} runs of {model!r} at world size {compute_world_size} differ in runs.{column} "
                f"({', '.join(map(str, values))}): a projection over depth needs one configuration"
            )
    model_layers = int(runs["full_layers"].max())
    if target_layers is not None and not 1 <= target_layers <= model_layers:
        raise SimInputError(f"--layers {target_layers}: model {model!r} has 1..{model_layers} blocks")
    full_layers = target_layers or model_layers
    rows = pd.concat(
        [index.layers_by_run[run_id] for run_id in runs["run_id"] if run_id in index.layers_by_run]
    )
    per_iteration = rows.groupby(["run_id", "layer", "phase"], sort=False)
    nominal = per_iteration[list(FITTED_QUANTITIES)].median().reset_index()
    spread = (
        per_iteration.agg(
            compute_cv=("compute_s", _coefficient_of_variation),
            allgather_cv=("allgather_s", _coefficient_of_variation),
            reduce_scatter_cv=("reduce_scatter_s", _coefficient_of_variation),
        )
        .reset_index()
        .fillna(0.0)
    )
    nominal = nominal.merge(spread, on=["run_id", "layer", "phase"])
    depth = nominal["run_id"].map(runs.set_index("run_id")["layers"])
    nominal["layer_kind"] = np.where(
        nominal["layer"] == 0, "embedding", np.where(nominal["layer"] == depth + 1, "head", "block")
    )
    nominal["traced_depth"] = depth

    # Embedding and head as traced, from the deepest run (its numbers are the most representative).
    deepest = runs.sort_values(["layers", "run_id"]).iloc[-1]
    ends = nominal[(nominal["run_id"] == deepest.run_id) & (nominal["layer_kind"] != "block")].copy()
    ends.loc[ends["layer_kind"] == "head", "layer"] = full_layers + 1

    # Blocks: fit totals over traced depth per phase and quantity.
    blocks = nominal[nominal["layer_kind"] == "block"]
    worst_residual = 0.0
    block_rows = []
    for phase, phase_rows in blocks.groupby("phase", sort=False):
        totals = phase_rows.groupby("traced_depth")[list(FITTED_QUANTITIES)].sum()
        depths = totals.index.to_numpy(dtype=float)
        per_block: dict[str, float] = {}
        for quantity in FITTED_QUANTITIES:
            intercept, slope, residual = _linear_fit(depths, totals[quantity].to_numpy(dtype=float))
            if quantity in ("compute_s", "allgather_bytes", "reduce_scatter_bytes"):
                worst_residual = max(worst_residual, residual)
            per_block[quantity] = max(0.0, (intercept + slope * full_layers) / full_layers)
        for cv_column in ("compute_cv", "allgather_cv", "reduce_scatter_cv"):
            per_block[cv_column] = float(phase_rows[cv_column].mean())
        for layer in range(1, full_layers + 1):
            block_rows.append({"layer": layer, "layer_kind": "block", "phase": phase, **per_block})
    columns = [
        "layer",
        "layer_kind",
        "phase",
        *FITTED_QUANTITIES,
        "compute_cv",
        "allgather_cv",
        "reduce_scatter_cv",
    ]
    layers = pd.concat([ends[columns], pd.DataFrame(block_rows, columns=columns)], ignore_index=True)
    layers["phase_rank"] = layers["phase"].map({p: i for i, p in enumerate(PHASE_ORDER)})
    layers = layers.sort_values(["layer", "phase_rank"]).drop(columns="phase_rank").reset_index(drop=True)

    sources = set(runs["source"])
    source = sources.pop() if len(sources) == 1 else "mixed"
    notes: list[str] = []
    clusters = cluster_choices(index.runs, model, dtype)
    if len(clusters) > 1:
        used = ", ".join(sorted(set(runs["cluster"])))
        notes.append(
            f"{model}: the bundle holds runs of {len(clusters)} clusters ({', '.join(clusters)}); the profile "
            f"uses {used} (per-cluster simulation is not built yet)"
        )
    if (
        not (rows["phase"] == "optim").any()
        or float(rows.loc[rows["phase"] == "optim", "compute_s"].sum()) == 0
    ):
        notes.append(f"{model}: the traced runs carry no optimizer time; the optimizer step is taken as 0 s")
    measured_clusters = sorted(set(runs[runs["source"] == "measured"]["cluster"]))
    if measured_clusters and preset.name not in measured_clusters:
        notes.append(
            f"{model}: compute and codec times measured on {', '.join(measured_clusters)}, collectives modelled "
            f"with preset {preset.name!r} (its α–β), not the measured ones: even at a traced depth and world "
            f"size this is not a replay (`--cluster {measured_clusters[0]}` replays the measured events)"
        )
    systems_used = sorted(set(runs["system"]))
    if systems_used != ["zero3"]:
        notes.append(
            f"{model}: profile built from runs of system {', '.join(systems_used)} (no zero3 run there)"
        )
    shards = _shard_table(index, runs, deepest, full_layers, layers, preset, notes)
    return ModelProfile(
        model=model,
        dtype=dtype,
        source=source,
        full_layers=full_layers,
        traced_layers=tuple(sorted(int(x) for x in runs["layers"])),
        traced_world_sizes=tuple(traced_world_sizes(index, model, dtype)),
        compute_world_size=compute_world_size,
        activation_checkpointing=bool(runs["activation_checkpointing"].any()),
        layers=layers,
        shards=shards,
        fit_residual=worst_residual,
        notes=tuple(notes),
    )


def _rates_at_block_size(exponents: pd.DataFrame, block_size: int, notes: list[str]) -> pd.DataFrame:
    """Mean block change rate per parameter at `block_size`; from the nearest traced block size B0 when
    absent, assuming independent blocks: q_B = 1 − (1 − q_B0)^(B/B0)."""
    available = sorted(set(int(b) for b in exponents["block_size"]))
    nearest = min(available, key=lambda b: (abs(np.log(b / block_size)), b))
    rows = exponents[exponents["block_size"] == nearest]
    rates = rows.groupby(["layer", "shard"], sort=False).agg(
        category=("category", "first"), numel=("numel", "first"), q=("block_change_rate", "mean")
    )
    if nearest != block_size:
        rates["q"] = 1.0 - (1.0 - rates["q"]) ** (block_size / nearest)
        notes.append(f"block change rates converted from B={nearest} to B={block_size} (independent blocks)")
    return rates.reset_index()


def _shard_table(
    index: BundleIndex,
    runs: pd.DataFrame,
    deepest: pd.Series,
    full_layers: int,
    layers: pd.DataFrame,
    preset: ClusterPreset,
    notes: list[str],
) -> pd.DataFrame:
    """Parameters of the full-depth model with their block change rates; full-depth block l reuses the
    statistics of traced block ((l − 1) mod L) + 1 of the deepest run that has exponent statistics
    (a run at the same world size when there is one: rates are per parameter, W only re-partitions them)."""
    with_stats = runs[runs["run_id"].isin(index.exponents_by_run.keys())]
    if with_stats.empty:  # any run of the model with statistics (e.g. a dedicated exponent-statistics run)
        # deepest["dtype"], not deepest.dtype: a Series' .dtype is its own dtype, not the column.
        same_model = index.runs[
            (index.runs["model"] == deepest["model"]) & (index.runs["dtype"] == deepest["dtype"])
        ]
        with_stats = same_model[same_model["run_id"].isin(index.exponents_by_run.keys())]
    layer_numel = layers.groupby("layer")["numel"].max()
    fallback_q = preset.ciera.fallback_block_change_rate
    if with_stats.empty:
        notes.append(f"no exponent statistics: every layer assumed to change at q={fallback_q}")
        return pd.DataFrame(
            {
                "layer": layer_numel.index.astype(int),
                "shard": [f"layer{int(i)}" for i in layer_numel.index],
                "category": [
                    "embedding" if i in (0, full_layers + 1) else "block" for i in layer_numel.index
                ],
                "numel": layer_numel.to_numpy().round().astype(np.int64),
                "q": fallback_q,
            }
        )
    source_run = with_stats.sort_values(["layers", "run_id"]).iloc[-1]
    cache_key = (str(source_run.run_id), str(source_run.run_id), full_layers, preset.ciera.block_size)
    if cache_key in index._shards:
        return index._shards[cache_key]
    traced_depth = int(source_run.layers)
    rates = _rates_at_block_size(index.exponents_by_run[source_run.run_id], preset.ciera.block_size, notes)
    traced_layer = rates["layer"].to_numpy()
    rows_of_layer = {int(layer): np.flatnonzero(traced_layer == layer) for layer in np.unique(traced_layer)}
    target_layers = [0, *range(1, full_layers + 1), full_layers + 1]
    source_layers = [
        0,
        *(((block - 1) % traced_depth) + 1 for block in range(1, full_layers + 1)),
        traced_depth + 1,
    ]
    picks, new_layer = [], []
    for target, source in zip(target_layers, source_layers, strict=True):
        rows = rows_of_layer.get(source, np.empty(0, dtype=int))
        picks.append(rows)
        new_layer.append(np.full(len(rows), target))
    take = np.concatenate(picks)
    shards = pd.DataFrame(
        {
            "layer": np.concatenate(new_layer).astype(np.int64),
            "shard": rates["shard"].to_numpy()[take],
            "category": rates["category"].to_numpy()[take],
            "numel": rates["numel"].to_numpy()[take].astype(np.int64),
            "q": rates["q"].to_numpy(dtype=float)[take],
        }
    )
    # Parameters of a layer the statistics do not cover travel at the fallback rate.
    covered = shards.groupby("layer")["numel"].sum()
    rest = (layer_numel - covered.reindex(layer_numel.index, fill_value=0)).round()
    rest = rest[rest > 1e-3 * layer_numel.reindex(rest.index)]  # ignore rounding of the depth fit
    if len(rest):
        shards = pd.concat(
            [
                shards,
                pd.DataFrame(
                    {
                        "layer": rest.index.astype(np.int64),
                        "shard": [f"layer{int(i)}.uncovered" for i in rest.index],
                        "category": "block",
                        "numel": rest.to_numpy().astype(np.int64),
                        "q": fallback_q,
                    }
                ),
            ],
            ignore_index=True,
        )
    shards = shards.sort_values("layer", kind="stable").reset_index(drop=True)
    index._shards[cache_key] = shards
    return shards
