"""Benefit-driven shard selection on crafted shards."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.payload import compressed_gather_bytes, payload_ratio_bound
from sim.selection import DECISION_COLUMNS, select_shards

COMMON = dict(
    world_size=16,
    dtype="bf16",
    block_size=512,
    entropy_bits=2.6,
    header_bytes=0,
    comm_s_per_byte=1 / 4e9,
    changed_gathers=1,
    unchanged_gathers=0,
    overlap_codec=True,
)


def shards(rows: list[tuple[str, int, float]], decompress_s: float = 1e-4) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "layer": 1,
            "shard": [name for name, _, _ in rows],
            "category": "expert_ffn",
            "numel": [numel for _, numel, _ in rows],
            "q": [q for _, _, q in rows],
            "hash_s": 1e-4,
            "compress_s": 1e-4,
            "decompress_s": decompress_s,
        }
    )


def test_payload_matches_the_design_ratio() -> None:
    numel = 16 * 512 * 1024
    for q in (0.0, 0.3, 1.0):
        payload = compressed_gather_bytes(
            numel,
            q,
            **{k: COMMON[k] for k in ("dtype", "world_size", "block_size")},
            entropy_bits=2.6,
            header_bytes=0,
        )
        assert payload / (2 * numel) == pytest.approx(payload_ratio_bound(q, 512, 2.6), rel=1e-6)


def test_low_change_rate_selected_high_rejected() -> None:
    # 8 MiB shards at 4 GB/s: q = 0 saves ~1.05 ms of Allgather, q = 1 only ~0.70 ms; decompress costs 0.9 ms.
    table = shards([("stable", 1 << 22, 0.0), ("churning", 1 << 22, 1.0)], decompress_s=0.9e-3)
    decisions = select_shards(table, cache_budget_bytes=1e12, **COMMON)
    assert list(decisions.columns) == DECISION_COLUMNS
    chosen = dict(zip(decisions["shard"], decisions["selected"], strict=True))
    assert chosen == {"stable": True, "churning": False}
    gains = dict(zip(decisions["shard"], decisions["gain_s"], strict=True))
    assert gains["stable"] > 0 > gains["churning"]


def test_budget_respected_and_ranked_by_gain_per_cache_byte() -> None:
    table = shards(
        [("big_low_q", 1 << 24, 0.05), ("small_zero_q", 1 << 20, 0.0), ("mid_q", 1 << 22, 0.5)],
        decompress_s=0.0,
    ).assign(hash_s=0.0, compress_s=0.0)
    everything = select_shards(table, cache_budget_bytes=1e12, **COMMON)
    assert everything["selected"].all()
    per_byte = (everything["gain_s"] / everything["memory_bytes"]).tolist()
    # small_zero_q has the best gain per byte, then big_low_q, then mid_q.
    assert per_byte[1] > per_byte[0] > per_byte[2]
    budget = (
        everything["memory_bytes"].iloc[1] + everything["memory_bytes"].iloc[2]
    )  # room for two small ones
    limited = select_shards(table, cache_budget_bytes=budget, **COMMON)
    assert limited["selected"].tolist() == [False, True, True]  # big one does not fit, the next still does
    assert limited.loc[limited["selected"], "memory_bytes"].sum() <= budget
    assert not select_shards(table, cache_budget_bytes=0, **COMMON)["selected"].any()


def test_memory_is_w_minus_one_exponent_shards() -> None:
    decisions = select_shards(shards([("a", 1600, 0.0)]), cache_budget_bytes=1e12, **COMMON)
    assert decisions["memory_bytes"].iloc[0] == 15 * 100


def test_overlap_drops_hash_and_compress_from_the_gain() -> None:
    table = shards([("a", 1 << 20, 0.1)])
    with_ccp = select_shards(table, cache_budget_bytes=1e12, **COMMON)["gain_s"].iloc[0]
    without = select_shards(table, cache_budget_bytes=1e12, **{**COMMON, "overlap_codec": False})[
        "gain_s"
    ].iloc[0]
    assert with_ccp - without == pytest.approx(2e-4)


def test_select_all_ignores_gain_and_budget() -> None:
    table = shards([("churning", 1 << 22, 1.0)], decompress_s=1.0)
    decisions = select_shards(table, cache_budget_bytes=0, select_all=True, **COMMON)
    assert decisions["selected"].all()
