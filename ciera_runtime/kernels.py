"""numba CPU kernels of the codec: plane split/merge, block change detection, block gather/scatter.

All kernels work on the raw 16-bit patterns (``uint16``) so NaN payloads, infinities, subnormals and
signed zeros pass through untouched.  Parallel kernels split work by blocks or by groups of values with
``prange``; ``cache=True`` keeps the start-up cost to one compile per machine, and ``nogil=True`` lets the
CCP worker thread encode while the main thread decodes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Bit layout of the two supported formats: exponent shift and mask inside the 16-bit pattern.
BF16_EXP_SHIFT, BF16_EXP_MASK = 7, 0xFF
FP16_EXP_SHIFT, FP16_EXP_MASK = 10, 0x1F

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# Two unrelated seeds: the two SplitMix64 streams that make up the 128-bit block hash.
HASH_SEED_A = np.uint64(0x243F6A8885A308D3)
HASH_SEED_B = np.uint64(0x13198A2E03707344)

# Values per parallel task in the element-wise kernels: large enough to amortise scheduling.
_ELEMENT_CHUNK = 1 << 16


@njit(inline="always")
def _splitmix64(state):
    z = state + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(parallel=True, cache=True, nogil=True)
def detect_changes_hash(bits, exp_shift, exp_mask, block_size, hash_cache, exp_out, changed_out, force_all):
    """Extract exponents into ``exp_out`` and flag blocks whose 128-bit hash differs from ``hash_cache``.

    ``hash_cache`` has shape (n_blocks, 2) and is updated in place for changed blocks, so the next call
    compares against this gather.  Each stream folds 8 exponent bytes at a time into SplitMix64.
    """
    numel = bits.size
    n_blocks = changed_out.size
    for block in prange(n_blocks):
        start = block * block_size
        stop = min(start + block_size, numel)
        hash_a = HASH_SEED_A ^ np.uint64(stop - start)
        hash_b = HASH_SEED_B
        word = np.uint64(0)
        filled = 0
        for i in range(start, stop):
            exponent = (bits[i] >> exp_shift) & exp_mask
            exp_out[i] = exponent
            word |= np.uint64(exponent) << np.uint64(8 * filled)
            filled += 1
            if filled == 8:
                hash_a = _splitmix64(hash_a ^ word)
                hash_b = _splitmix64(hash_b + (word * _GOLDEN_GAMMA))
                word = np.uint64(0)
                filled = 0
        if filled > 0:
            hash_a = _splitmix64(hash_a ^ word)
            hash_b = _splitmix64(hash_b + (word * _GOLDEN_GAMMA))
        changed = force_all or hash_cache[block, 0] != hash_a or hash_cache[block, 1] != hash_b
        if changed:
            hash_cache[block, 0] = hash_a
            hash_cache[block, 1] = hash_b
        changed_out[block] = changed


@njit(parallel=True, cache=True, nogil=True)
def detect_changes_exact(bits, exp_shift, exp_mask, block_size, last_exp, changed_out, force_all):
    """Flag blocks whose exponents differ from ``last_exp`` (the last ones sent) and update it in place."""
    numel = bits.size
    n_blocks = changed_out.size
    for block in prange(n_blocks):
        start = block * block_size
        stop = min(start + block_size, numel)
        changed = force_all
        if not changed:
            for i in range(start, stop):
                if ((bits[i] >> exp_shift) & exp_mask) != last_exp[i]:
                    changed = True
                    break
        if changed:
            for i in range(start, stop):
                last_exp[i] = (bits[i] >> exp_shift) & exp_mask
        changed_out[block] = changed


@njit(parallel=True, cache=True, nogil=True)
def extract_exponents(bits, exp_shift, exp_mask, exp_out):
    """Exponent plane only (used for full-exponent payloads and receiver resync)."""
    numel = bits.size
    n_chunks = (numel + _ELEMENT_CHUNK - 1) // _ELEMENT_CHUNK
    for chunk in prange(n_chunks):
        for i in range(chunk * _ELEMENT_CHUNK, min(numel, (chunk + 1) * _ELEMENT_CHUNK)):
            exp_out[i] = (bits[i] >> exp_shift) & exp_mask


def sign_mantissa_bytes(numel: int, is_fp16: bool) -> int:
    """Size of the sign+mantissa plane: BF16 1 byte/value; FP16 1 byte + 3 bit-packed bits per value."""
    if not is_fp16:
        return numel
    return numel + (3 * numel + 7) // 8


@njit(parallel=True, cache=True, nogil=True)
def pack_sign_mantissa(bits, is_fp16, out):
    """Write the sign+mantissa plane.

    BF16: ``out[i] = sign << 7 | mantissa7``.
    FP16: ``out[:n]`` holds the low 8 mantissa bits; then for every group of 8 values the 3-bit fields
    ``sign << 2 | mantissa >> 8`` are packed little-endian into 3 bytes (value j of the group at bit 3j).
    """
    numel = bits.size
    if not is_fp16:
        n_chunks = (numel + _ELEMENT_CHUNK - 1) // _ELEMENT_CHUNK
        for chunk in prange(n_chunks):
            for i in range(chunk * _ELEMENT_CHUNK, min(numel, (chunk + 1) * _ELEMENT_CHUNK)):
                value = bits[i]
                out[i] = ((value >> 8) & 0x80) | (value & 0x7F)
        return
    n_groups = (numel + 7) // 8
    for group in prange(n_groups):
        packed = 0
        base = group * 8
        for j in range(8):
            i = base + j
            if i < numel:
                value = bits[i]
                out[i] = value & 0xFF
                high = ((value >> 13) & 0x4) | ((value >> 8) & 0x3)
                packed |= np.int64(high) << (3 * j)
        out[numel + 3 * group] = packed & 0xFF
        out[numel + 3 * group + 1] = (packed >> 8) & 0xFF
        out[numel + 3 * group + 2] = (packed >> 16) & 0xFF


@njit(parallel=True, cache=True, nogil=True)
def merge_planes(exp, sign_mantissa, exp_shift, is_fp16, out):
    """Inverse of the split: rebuild the 16-bit patterns from the exponent and sign+mantissa planes."""
    numel = out.size
    if not is_fp16:
        n_chunks = (numel + _ELEMENT_CHUNK - 1) // _ELEMENT_CHUNK
        for chunk in prange(n_chunks):
            for i in range(chunk * _ELEMENT_CHUNK, min(numel, (chunk + 1) * _ELEMENT_CHUNK)):
                sm = np.uint16(sign_mantissa[i])
                out[i] = ((sm & 0x80) << 8) | (np.uint16(exp[i]) << exp_shift) | (sm & 0x7F)
        return
    n_groups = (numel + 7) // 8
    for group in prange(n_groups):
        base = group * 8
        packed = (
            np.int64(sign_mantissa[numel + 3 * group])
            | (np.int64(sign_mantissa[numel + 3 * group + 1]) << 8)
            | (np.int64(sign_mantissa[numel + 3 * group + 2]) << 16)
        )
        for j in range(8):
            i = base + j
            if i < numel:
                high = (packed >> (3 * j)) & 0x7
                value = ((high & 0x4) << 13) | (np.int64(exp[i]) << exp_shift) | ((high & 0x3) << 8)
                out[i] = np.uint16(value | sign_mantissa[i])


@njit(parallel=True, cache=True, nogil=True)
def gather_blocks(exp, changed_blocks, block_offsets, block_size, out):
    """Concatenate the exponents of ``changed_blocks``; ``block_offsets[k]`` is where block k goes in out."""
    numel = exp.size
    for k in prange(changed_blocks.size):
        start = changed_blocks[k] * block_size
        stop = min(start + block_size, numel)
        dst = block_offsets[k]
        for i in range(start, stop):
            out[dst + i - start] = exp[i]


@njit(parallel=True, cache=True, nogil=True)
def scatter_blocks(packed, changed_blocks, block_offsets, block_size, exp):
    """Inverse of ``gather_blocks``: write the received exponents of changed blocks into the cache."""
    numel = exp.size
    for k in prange(changed_blocks.size):
        start = changed_blocks[k] * block_size
        stop = min(start + block_size, numel)
        src = block_offsets[k]
        for i in range(start, stop):
            exp[i] = packed[src + i - start]


def changed_block_offsets(changed_blocks: np.ndarray, block_size: int, numel: int) -> tuple[np.ndarray, int]:
    """Start offset of each changed block inside the packed exponent array, and the total length."""
    lengths = np.full(changed_blocks.size, block_size, dtype=np.int64)
    if changed_blocks.size and (changed_blocks[-1] + 1) * block_size > numel:
        lengths[-1] = numel - changed_blocks[-1] * block_size
    offsets = np.zeros(changed_blocks.size, dtype=np.int64)
    if changed_blocks.size > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    return offsets, int(lengths.sum())
