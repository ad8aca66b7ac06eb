"""Bytes on the wire for one gathered shard under CIERA's codec, and its receiver cache footprint.

Per value, BF16 splits into 8 sign+mantissa bits and 8 exponent bits; FP16 into 11 sign+mantissa bits
(packed tightly) and 5 exponent bits. A gather of a parameter of N values over W ranks carries, from each
rank's shard of N/W values: a header, a bitmap of one bit per block of B values, the sign+mantissa plane,
and the changed blocks' exponents ANS-coded to about H bits per value. Receivers cache one byte per
exponent of every other rank's shard: M = (W − 1) · N/W bytes.
"""

from __future__ import annotations

import numpy as np

SIGN_MANTISSA_BITS = {"bf16": 8, "fp16": 11}
EXPONENT_BITS = {"bf16": 8, "fp16": 5}
BYTES_PER_VALUE = 2


def raw_bytes(numel: np.ndarray | float) -> np.ndarray | float:
    return BYTES_PER_VALUE * numel


def exponent_cache_bytes(numel: np.ndarray | float, world_size: int) -> np.ndarray | float:
    """ExpCache footprint per GPU for one parameter: (W − 1) · S_e with S_e = N/W one-byte exponents."""
    return (world_size - 1) * np.ceil(np.asarray(numel, dtype=float) / world_size)


def compressed_gather_bytes(
    numel: np.ndarray,
    change_rate: np.ndarray | float,
    *,
    dtype: str,
    world_size: int,
    block_size: int,
    entropy_bits: float,
    header_bytes: int,
) -> np.ndarray:
    """Full gathered payload (all W ranks' pieces) of parameters of `numel` values whose blocks changed
    at rate `change_rate` since the last gather."""
    numel = np.asarray(numel, dtype=float)
    shard_values = np.ceil(numel / world_size)
    bitmap_bytes = np.ceil(np.ceil(shard_values / block_size) / 8)
    sign_mantissa_bytes = np.ceil(shard_values * SIGN_MANTISSA_BITS[dtype] / 8)
    # ANS cannot do worse than the plain exponent bits; it codes only the changed blocks.
    coded_bits = min(entropy_bits, EXPONENT_BITS[dtype])
    exponent_bytes = np.asarray(change_rate, dtype=float) * shard_values * coded_bits / 8
    return world_size * (header_bytes + bitmap_bytes + sign_mantissa_bytes + exponent_bytes)


def payload_ratio_bound(change_rate: float, block_size: int, entropy_bits: float) -> float:
    """DESIGN.md's BF16 ratio r(q) ≈ 0.5 + 1/(16B) + q·H/16 (header ignored)."""
    return 0.5 + 1 / (16 * block_size) + change_rate * entropy_bits / 16
