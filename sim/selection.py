"""Benefit-driven shard selection (BSC) as a pure function over a shard table.

For each parameter shard i the per-iteration gain of compressing it is
    g_i = Σ_gathers [Comm(S_i) − Comm(P_i(q))] − Σ_gathers T_critical,i
where P_i(q) is the compressed payload when a fraction q of its blocks changed since the last gather
(q_i for the first gather after an optimizer step, 0 for the recompute and backward gathers of the same
iteration), and T_critical is hash + compress + decompress without overlap, decompress alone with
computation–communication pipelining (CCP). Comm differences use the collective model's cost per gathered
byte at the target world size (the α terms of two gathers of the same group cancel). Shards with g_i > 0
are ranked by g_i / M_i, M_i = (W − 1)·S_e the receiver cache they need, and taken greedily while the
per-GPU cache budget lasts (a shard that does not fit is skipped and smaller ones are still tried).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .payload import compressed_gather_bytes, exponent_cache_bytes, raw_bytes

DECISION_COLUMNS = [
    "layer",
    "shard",
    "category",
    "q",
    "numel",
    "gain_s",
    "memory_bytes",
    "selected",
    "changed_payload_bytes",
    "unchanged_payload_bytes",
]


def select_shards(
    shards: pd.DataFrame,
    *,
    world_size: int,
    dtype: str,
    block_size: int,
    entropy_bits: float,
    header_bytes: int,
    comm_s_per_byte: float,
    cache_budget_bytes: float,
    changed_gathers: int,
    unchanged_gathers: int,
    overlap_codec: bool,
    select_all: bool = False,
) -> pd.DataFrame:
    """Decision table (DECISION_COLUMNS) for `shards` (columns layer, shard, category, numel, q, hash_s,
    compress_s, decompress_s — codec times per gather). `select_all` takes every shard regardless of gain
    and budget (exponent reuse without selection)."""
    numel = shards["numel"].to_numpy(dtype=float)
    change_rate = np.clip(shards["q"].to_numpy(dtype=float), 0.0, 1.0)
    common = dict(
        dtype=dtype,
        world_size=world_size,
        block_size=block_size,
        entropy_bits=entropy_bits,
        header_bytes=header_bytes,
    )
    changed_payload = compressed_gather_bytes(numel, change_rate, **common)
    unchanged_payload = compressed_gather_bytes(numel, 0.0, **common)
    raw = raw_bytes(numel)
    saved_bytes = changed_gathers * (raw - changed_payload) + unchanged_gathers * (raw - unchanged_payload)
    critical_s = shards["decompress_s"].to_numpy(dtype=float)
    if not overlap_codec:
        critical_s = (
            critical_s + shards["hash_s"].to_numpy(dtype=float) + shards["compress_s"].to_numpy(dtype=float)
        )
    gain_s = comm_s_per_byte * saved_bytes - (changed_gathers + unchanged_gathers) * critical_s
    memory = np.asarray(exponent_cache_bytes(numel, world_size), dtype=float)

    if select_all:
        selected = np.ones(len(shards), dtype=bool)
    else:
        selected = np.zeros(len(shards), dtype=bool)
        with np.errstate(divide="ignore", invalid="ignore"):
            gain_per_byte = np.where(memory > 0, gain_s / memory, np.inf)
        gain_per_byte = np.where(gain_s > 0, gain_per_byte, -np.inf)
        # Stable ranking: best gain per cache byte first, ties by table order (deterministic).
        order = np.argsort(-gain_per_byte, kind="stable")
        left = float(cache_budget_bytes)
        for index in order:
            if gain_s[index] <= 0:
                break
            if memory[index] <= left:
                selected[index] = True
                left -= memory[index]
    return pd.DataFrame(
        {
            "layer": shards["layer"].to_numpy(),
            "shard": shards["shard"].to_numpy(),
            "category": shards["category"].to_numpy(),
            "q": change_rate,
            "numel": shards["numel"].to_numpy(),
            "gain_s": gain_s,
            "memory_bytes": memory,
            "selected": selected,
            "changed_payload_bytes": changed_payload,
            "unchanged_payload_bytes": unchanged_payload,
        },
        columns=DECISION_COLUMNS,
    )
