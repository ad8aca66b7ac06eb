"""A small shard's payload work in one compiled call each way (the CPU backend's serial path).

An engine's bucket holds many shards of a few thousand values; at that size each payload's fixed cost —
a dozen numpy and numba calls between the kernels, each with its own dispatch — was larger than the
kernels themselves (benchmarks/bucket_host.py). For shards under ``kernels.PARALLEL_MIN_VALUES`` (which
always run serially) the CPU backend does the same steps, in the same order, inside numba:

- ``encode_exact``: the exact detector's fused pass (exponent plane, changed blocks, sign+mantissa plane
  and its checksum), the changed blocks' exponents (or their deltas against the receivers' cache)
  gathered and rANS-coded into the payload — raw when coding would not be smaller — and the bitmap;
- ``rebuild``: the bitmap read and checked against the header, the exponent section decoded (and
  checked) into a scratch array, deltas added to the cache's exponents, and only then the cache written
  and the two planes merged (with the sign+mantissa checksum, which the caller compares).

The bytes are those of the composed path (codec.py with any backend): the torch backend, which always
composes, is compared with this one payload for payload (tests/runtime/test_runtime_torch_backend.py).
A status other than 0 names what was wrong; codec.py turns it into the error the composed path raises.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ciera_runtime import kernels, rans

# rebuild's status: 0 valid; RANS_STATUS + s: the exponent stream failed with rANS status s.
BITMAP_COUNT, NOT_FULL, DELTAS_FLAG, RAW_SECTION_SIZE, STRAY_EXPONENTS = 1, 2, 3, 4, 5
RANS_STATUS = 100


@njit(cache=True, nogil=True)
def _changed_blocks(changed):
    count = 0
    for k in range(changed.size):
        count += changed[k] != 0
    blocks = np.empty(count, dtype=np.int64)
    j = 0
    for k in range(changed.size):
        if changed[k]:
            blocks[j] = k
            j += 1
    return blocks


@njit(cache=True, nogil=True)
def encode_exact(
    bits, exp_shift, exp_mask, is_fp16, block_size, exp, last_exp, base, changed, full, sm, bitmap,
    exp_region, use_rans,
):  # fmt: skip
    """One payload's planes, bitmap and exponent section (exact detector); ``base``: the plane the
    receivers hold (the deltas' base, used unless ``full``); ``exp_region``: the payload from its fixed
    part on, at least one byte per value. Returns (sm checksum64, changed blocks,
    exponent section bytes, whether the exponents went raw)."""
    n = bits.size
    partials = np.empty(changed.size, dtype=np.uint64)
    tail_partials = np.empty(kernels._tail_tasks(n, sm.size), dtype=np.uint64)
    checksum = kernels.encode_planes_exact_blocks_serial(
        bits, exp_shift, exp_mask, is_fp16, block_size, exp, exp[: n - n % 8].view(np.uint64),
        last_exp, last_exp[: n - n % 8].view(np.uint64), changed, full, sm,
        sm[: sm.size - sm.size % 8].view(np.uint64), partials, tail_partials,
    )  # fmt: skip
    blocks = _changed_blocks(changed)
    offsets, values = kernels._changed_block_offsets(blocks, block_size, n)
    bitmap[:] = 0
    for k in range(blocks.size):  # np.packbits(changed, bitorder="little")
        bitmap[blocks[k] >> 3] |= np.uint8(1 << (blocks[k] & 7))
    exp_bytes, raw = 0, False
    if values:
        deltas = not full
        if values == n and not deltas:
            packed = exp
        else:
            packed = np.empty(values, dtype=np.uint8)
            kernels.gather_blocks(exp, blocks, offsets, block_size, packed)
        if deltas:
            held = np.empty(values, dtype=np.uint8)
            kernels.gather_blocks(base, blocks, offsets, block_size, held)
            for i in range(values):  # mod 256, as np.subtract on uint8
                packed[i] = np.uint8((np.int64(packed[i]) - np.int64(held[i])) & 0xFF)
        exp_bytes = -1
        if use_rans:
            chunk_symbols = rans._chunk_symbols(values, rans.CHUNK_SHARES)
            exp_bytes = rans._encode_serial_into(packed, exp_region[:values], chunk_symbols)
        if exp_bytes < 0 or exp_bytes >= values:
            exp_region[:values] = packed
            exp_bytes, raw = values, True
    return checksum, blocks.size, exp_bytes, raw


@njit(cache=True, nogil=True)
def rebuild(
    bitmap, n_blocks, header_changed, full, deltas, exact_detector, raw_exponents, exp_section, block_size,
    exp_cache, sm, exp_shift, is_fp16, out,
):  # fmt: skip
    """Check the bitmap and exponent section against the header, apply them to ``exp_cache`` and merge
    the planes into ``out``: (status, detail, sm checksum64). The cache is written only once everything
    but the sign+mantissa plane (whose checksum the caller compares) has been verified."""
    n = out.size
    blocks = np.empty(n_blocks, dtype=np.int64)
    count = 0
    for k in range(n_blocks):  # np.unpackbits(bitmap, count=n_blocks, bitorder="little")
        if (bitmap[k >> 3] >> (k & 7)) & 1:
            blocks[count] = k
            count += 1
    blocks = blocks[:count]
    zero = np.uint64(0)
    if count != header_changed:
        return BITMAP_COUNT, count, zero
    if full and count != n_blocks:
        return NOT_FULL, 0, zero
    if deltas != ((not full) and exact_detector and count > 0):
        return DELTAS_FLAG, 0, zero
    offsets, values = kernels._changed_block_offsets(blocks, block_size, n)
    packed = np.empty(values, dtype=np.uint8)
    if raw_exponents:
        if exp_section.size != values:
            return RAW_SECTION_SIZE, values, zero
        packed[:] = exp_section
    elif values:
        status, detail = rans.decode_checked(exp_section, packed)
        if status:
            return RANS_STATUS + status, detail, zero
    elif exp_section.size:
        return STRAY_EXPONENTS, exp_section.size, zero
    if deltas:  # exponent = cached exponent + delta, mod 256
        held = np.empty(values, dtype=np.uint8)
        kernels.gather_blocks(exp_cache, blocks, offsets, block_size, held)
        for i in range(values):
            packed[i] = np.uint8((np.int64(packed[i]) + np.int64(held[i])) & 0xFF)
    if values:
        kernels.scatter_blocks(packed, blocks, offsets, block_size, exp_cache)
    partials = np.empty((n + kernels._MERGE_CHUNK - 1) // kernels._MERGE_CHUNK, dtype=np.uint64)
    tail_partials = np.empty(kernels._tail_tasks(n, sm.size), dtype=np.uint64)
    checksum = kernels.merge_planes_checked_chunks_serial(
        exp_cache, sm, sm[: sm.size - sm.size % 8].view(np.uint64), exp_shift, is_fp16, out, partials,
        tail_partials,
    )  # fmt: skip
    return 0, 0, checksum
