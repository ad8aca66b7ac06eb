"""The parameters (shards) of a model at a target depth with their block change rates: what benefit-driven
selection and the CIERA rewrite read from a bundle's exponent statistics."""

from __future__ import annotations

import numpy as np
import pandas as pd

import traces

from .cluster import ClusterPreset


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


def shard_table(
    bundle: traces.TraceBundle,
    model: str,
    dtype: str,
    target_layers: int,
    layer_numel: dict[int, float],
    preset: ClusterPreset,
    notes: list[str],
) -> pd.DataFrame:
    """One row per parameter of `model` at `target_layers` blocks: layer, shard, category, numel, q (the
    block change rate at the preset's block size, before `change_rate_scale`). Block l of the target takes
    the statistics of block ((l − 1) mod L) + 1 of the deepest run of the model with statistics (L its
    depth); the head those of its head. Without statistics every layer (`layer_numel`: the target's
    parameters per layer) changes at `ciera.fallback_block_change_rate`, and a note says so."""
    runs = bundle.runs
    of_model = runs[(runs["model"] == model) & (runs["dtype"] == dtype)]
    with_stats = of_model[of_model["run_id"].isin(set(bundle.exponents["run_id"].unique()))]
    fallback_q = preset.ciera.fallback_block_change_rate
    if with_stats.empty:
        notes.append(f"no exponent statistics, every layer assumed to change at q={fallback_q}")
        layers = sorted(layer_numel)
        return pd.DataFrame(
            {
                "layer": np.array(layers, dtype=np.int64),
                "shard": [f"layer{layer}" for layer in layers],
                "category": ["embedding" if layer in (0, target_layers + 1) else "block" for layer in layers],
                "numel": np.array([round(layer_numel[layer]) for layer in layers], dtype=np.int64),
                "q": fallback_q,
            }
        )
    source = with_stats.sort_values(["layers", "run_id"]).iloc[-1]
    traced_depth = int(source["layers"])
    statistics = bundle.exponents[bundle.exponents["run_id"] == source["run_id"]]
    rates = _rates_at_block_size(statistics, preset.ciera.block_size, notes)
    traced_layer = rates["layer"].to_numpy()
    target = [0, *range(1, target_layers + 1), target_layers + 1]
    origin = [
        0,
        *(((block - 1) % traced_depth) + 1 for block in range(1, target_layers + 1)),
        traced_depth + 1,
    ]
    picks, new_layer = [], []
    for to_layer, from_layer in zip(target, origin, strict=True):
        rows = np.flatnonzero(traced_layer == from_layer)
        picks.append(rows)
        new_layer.append(np.full(len(rows), to_layer))
    take = np.concatenate(picks)
    return pd.DataFrame(
        {
            "layer": np.concatenate(new_layer).astype(np.int64),
            "shard": rates["shard"].to_numpy()[take],
            "category": rates["category"].to_numpy()[take],
            "numel": rates["numel"].to_numpy()[take].astype(np.int64),
            "q": rates["q"].to_numpy(dtype=float)[take],
        }
    )
