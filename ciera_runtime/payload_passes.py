"""A small shard's payload work in one compiled call each way (the CPU backend's serial path).

An engine's bucket holds many shards of a few thousand values; at that size each payload's fixed cost —
a dozen numpy and numba calls between the kernels, each with its own dispatch — was larger than the
kernels themselves (benchmarks/bucket_host.py). For shards under ``kernels.PARALLEL_MIN_VALUES`` (which
always run serially) the CPU backend does the same steps, in the same order, inside numba:

- ``encode_exact``: the exact detector's fused pass (exponent plane, changed blocks, sign+mantissa plane
  and its checksum), the changed blocks' exponents (or their deltas against the receivers' cache)
  gathered and rANS-coded into the payload — raw when coding would not be smaller — the bitmap, and the
  header (flags, sizes, checksums and the CRC-32s, on a template of the fields fixed per encoder);
- ``rebuild``: the bitmap and exponent section checked against their CRC-32, the bitmap read and checked
  against the header, the exponent section decoded (and
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

HEADER_BYTES = 80  # codec.HEADER_BYTES
# Header fields encode_exact writes (codec.HEADER_FORMAT, little-endian); the rest come from the template.
FLAGS_AT, GENERATION_AT, CHANGED_AT, EXP_BYTES_AT, SHARD_CRC_AT, META_CRC_AT, SM_CHECKSUM_AT = (
    7, 16, 44, 48, 56, 60, 64,
)  # fmt: skip
HEADER_CRC_AT = 76
# The fields rebuild_bucket reads besides those (fields 1, 2, 4, 5, 7-9, 15: version, dtype, shard, source
# rank, epoch, numel, block size, configuration fingerprint); codec.py checks every offset against its format.
VERSION_AT, DTYPE_AT, SHARD_AT, SOURCE_AT, EPOCH_AT, NUMEL_AT, BLOCK_SIZE_AT, FINGERPRINT_AT = (
    4, 6, 8, 12, 24, 32, 40, 72,
)  # fmt: skip
FLAG_FULL, FLAG_RAW, FLAG_CHECKSUM, FLAG_DELTAS = 1, 2, 4, 8  # codec.FLAG_* (codec imports this module)


def _crc_table() -> np.ndarray:
    table = np.empty(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
        table[byte] = crc
    return table


_CRC_TABLE = _crc_table()


@njit(cache=True, nogil=True)
def crc32(data, crc):
    """zlib.crc32(data, crc) (CRC-32/ISO-HDLC) for the few hundred bytes of a header, bitmap and coded
    exponent section: a table per byte, slower than zlib's per byte but with no call out of numba."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    for i in range(data.size):
        c = _CRC_TABLE[(c ^ np.uint32(data[i])) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
    return c ^ np.uint32(0xFFFFFFFF)


@njit(inline="always")
def _put(payload, at, value, size):
    for k in range(size):  # little-endian
        payload[at + k] = np.uint8((value >> np.uint64(8 * k)) & np.uint64(0xFF))


# rebuild's status: 0 valid; RANS_STATUS + s: the exponent stream failed with rANS status s.
BITMAP_COUNT, NOT_FULL, DELTAS_FLAG, RAW_SECTION_SIZE, STRAY_EXPONENTS, META_CRC = 1, 2, 3, 4, 5, 6
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
    bits, exp_shift, exp_mask, is_fp16, block_size, exp, last_exp, base, changed, full, payload, template,
    bitmap_bytes, sm_offset, sm_bytes, fixed_bytes, use_rans, generation, shard_crc, checksum_flag,
):  # fmt: skip
    """One whole payload (exact detector) written into ``payload`` (at least fixed part + one byte per
    value): planes, bitmap, exponent section and header. ``base``: the plane the receivers hold (the
    deltas' base, used unless ``full``); ``template``: the header with the fields fixed per encoder;
    ``shard_crc`` (with ``checksum_flag``): the shard's CRC-32 in verify mode, else 0. Returns (changed
    blocks, payload bytes)."""
    n = bits.size
    bitmap = payload[HEADER_BYTES : HEADER_BYTES + bitmap_bytes]
    sm = payload[sm_offset : sm_offset + sm_bytes]
    exp_region = payload[fixed_bytes:]
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
    # Alignment padding zeroed (deterministic bytes on the wire), then the header.
    payload[HEADER_BYTES + bitmap_bytes : sm_offset] = 0
    payload[sm_offset + sm.size : fixed_bytes] = 0
    flags = FLAG_FULL if full else 0
    if exp_bytes:
        flags |= 0 if full else FLAG_DELTAS
        flags |= FLAG_RAW if raw else 0
    flags |= FLAG_CHECKSUM if checksum_flag else 0
    payload[:HEADER_BYTES] = template
    payload[FLAGS_AT] = np.uint8(flags)
    _put(payload, GENERATION_AT, np.uint64(generation), 8)
    _put(payload, CHANGED_AT, np.uint64(blocks.size), 4)
    _put(payload, EXP_BYTES_AT, np.uint64(exp_bytes), 8)
    _put(payload, SHARD_CRC_AT, np.uint64(shard_crc), 4)
    meta_crc = crc32(exp_region[:exp_bytes], crc32(bitmap, 0))
    _put(payload, META_CRC_AT, np.uint64(meta_crc), 4)
    _put(payload, SM_CHECKSUM_AT, checksum, 8)
    _put(payload, HEADER_CRC_AT, np.uint64(crc32(payload[:HEADER_CRC_AT], 0)), 4)
    return blocks.size, fixed_bytes + exp_bytes


# A bucket's message kinds (bucket.py takes them from here) and the size of a seed's prefix (bucket.SEED_PREFIX:
# sender epoch, generation, flags; flag 1 = a full payload's seed).
KIND_PAYLOAD, KIND_RAW, KIND_SEED = 1, 2, 3
SEED_PREFIX_BYTES = 24


@njit(cache=True, nogil=True)
def encode_exact_bucket(
    bits, starts, exp_planes, last_planes, base_planes, changed_flags, templates, exp_shifts, exp_masks, fp16,
    block_size, full, generations, epochs, shard_crcs, checksum_flags, bitmap_bytes, sm_offsets, sm_bytes,
    fixed_bytes, use_rans, out, kinds, sizes, changed_counts,
):  # fmt: skip
    """Every shard's message of a bucket, one ``encode_exact`` each, in one call: written one after the
    other into ``out``, each at an 8-aligned offset with its padding zeroed (the bucket row's area as a
    stream). Shard i is ``bits[starts[i]:starts[i + 1]]``; its encoder's planes, flags and header template
    come as the i-th item of each typed list, its settings as the i-th item of each array. A payload not
    smaller than the shard's raw values is replaced by a seed (epoch, generation, flags, then the values)
    or, where no payload of the shard can ever be smaller (``fixed_bytes`` >= raw), by the raw values.
    ``kinds``, ``sizes`` and ``changed_counts`` receive each message's kind, length and changed blocks;
    returns the stream's length.

    Unlike the encoder's own call this keeps every plane where it is: the new plane is copied into the
    receivers' plane (``base``), as the encoder's swap of the two gives."""
    position = 0
    for i in range(starts.size - 1):
        shard = bits[starts[i] : starts[i + 1]]
        exp, base = exp_planes[i], base_planes[i]
        buffer = out[position:]
        changed_count, payload_bytes = encode_exact(
            shard, exp_shifts[i], exp_masks[i], fp16[i] != 0, block_size, exp, last_planes[i], base,
            changed_flags[i], full[i] != 0, buffer, templates[i], bitmap_bytes[i], sm_offsets[i], sm_bytes[i], fixed_bytes[i],
            use_rans, generations[i], shard_crcs[i], checksum_flags[i] != 0,
        )  # fmt: skip
        base[:] = exp  # one copy of the plane: cheaper than block by block for any share of changed blocks
        raw = shard.view(np.uint8)
        if payload_bytes < raw.size:
            kind, size = KIND_PAYLOAD, payload_bytes
        elif fixed_bytes[i] < raw.size:
            kind, size = KIND_SEED, SEED_PREFIX_BYTES + raw.size
            _put(buffer, 0, np.uint64(epochs[i]), 8)
            _put(buffer, 8, np.uint64(generations[i]), 8)
            _put(buffer, 16, np.uint64(1 if full[i] else 0), 8)
            buffer[SEED_PREFIX_BYTES:size] = raw
        else:
            kind, size = KIND_RAW, raw.size
            buffer[:size] = raw
        end = (position + size + 7) & ~7
        out[position + size : end] = 0
        kinds[i], sizes[i], changed_counts[i] = kind, size, changed_count
        position = end
    return position


@njit(cache=True, nogil=True)
def rebuild(
    payload, exp_section, meta_crc, bitmap_bytes, sm_offset, sm_bytes, n_blocks, header_changed, full, deltas,
    exact_detector, raw_exponents, block_size, exp_cache, exp_shift, is_fp16, out,
):  # fmt: skip
    """Check the bitmap and exponent section of ``payload`` against the header's CRC-32 (``meta_crc``) and
    fields, apply them to ``exp_cache`` and merge the planes into ``out``: (status, detail, sm
    checksum64). The cache is written only once everything but the sign+mantissa plane (whose checksum
    the caller compares) has been verified."""
    n = out.size
    zero = np.uint64(0)
    bitmap = payload[HEADER_BYTES : HEADER_BYTES + bitmap_bytes]
    sm = payload[sm_offset : sm_offset + sm_bytes]
    if crc32(exp_section, crc32(bitmap, 0)) != np.uint32(meta_crc):
        return META_CRC, 0, zero
    blocks = np.empty(n_blocks, dtype=np.int64)
    count = 0
    for k in range(n_blocks):  # np.unpackbits(bitmap, count=n_blocks, bitorder="little")
        if (bitmap[k >> 3] >> (k & 7)) & 1:
            blocks[count] = k
            count += 1
    blocks = blocks[:count]
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


@njit(inline="always")
def _get(payload, at, size):
    value = np.uint64(0)
    for k in range(size):  # little-endian
        value |= np.uint64(payload[at + k]) << np.uint64(8 * k)
    return value


MAGIC = np.frombuffer(b"CIER", dtype=np.uint8)  # codec.MAGIC (checked there)
FORMAT_VERSION = 5  # codec.FORMAT_VERSION (checked there)
# rebuild_bucket's stops: every item done; an item for the per-shard path (a raw message or seed, one that
# spills into the overflow round, anything but a payload of the steady state); an item whose rebuild
# failed (status != 0: the cache is untouched); an item whose sign+mantissa checksum did not match (its
# cache was written and is at the payload's generation, as the per-shard path leaves it).
STOP_DONE, STOP_OTHER, STOP_REBUILD, STOP_SM_CHECKSUM = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def rebuild_bucket(
    received, head, entries, offsets, item, rank, bits, out, out_starts, numels, n_blocks, bitmap_bytes,
    sm_offsets, sm_bytes, fixed_bytes, shard_ids, dtype_codes, block_size, fingerprint, exp_shifts, fp16,
    caches, epochs, generations, done,
):  # fmt: skip
    """Rebuild a bucket's received payloads in one call, item by item from ``item`` (item = shard × world
    + source, in the per-shard loop's order), while each is a payload of the steady state: in the row's
    area, header intact and this shard's, no verify-mode CRC, a delta or full payload of the epoch the
    cache holds at a newer generation. Shard i's values go to ``out[out_starts[i]:]`` (source-major, as
    all_gather_into_tensor places them); at item 0 this rank's own values are copied there first. Returns
    (stop, item): the item the caller hands to the per-shard path (see STOP_*). ``epochs``, ``generations``
    and ``done`` receive, per item rebuilt, the (epoch, generation) its cache is now at."""
    world = received.shape[0]
    area_size = received.shape[1] - head
    n_items = numels.size * world
    if item == 0:
        for shard in range(numels.size):
            numel = numels[shard]
            start = out_starts[shard] + rank * numel
            out[start : start + numel] = bits[out_starts[shard] // world : out_starts[shard] // world + numel]
    while item < n_items:
        shard, source = item // world, item % world
        if source == rank:
            item += 1
            continue
        entry = entries[source, shard]
        length, offset = entry >> 2, offsets[source, shard]
        if (entry & 3) != KIND_PAYLOAD or offset < 0 or offset + length > area_size or length < HEADER_BYTES:
            return STOP_OTHER, item
        payload = received[source, head + offset : head + offset + length]
        numel = numels[shard]
        fixed = fixed_bytes[shard]
        flags = payload[FLAGS_AT]
        if (
            payload[0] != MAGIC[0] or payload[1] != MAGIC[1] or payload[2] != MAGIC[2]
            or payload[3] != MAGIC[3] or _get(payload, VERSION_AT, 2) != FORMAT_VERSION
            or np.uint64(crc32(payload[:HEADER_CRC_AT], 0)) != _get(payload, HEADER_CRC_AT, 4)
            or payload[DTYPE_AT] != dtype_codes[shard]
            or (flags & ~np.uint8(FLAG_FULL | FLAG_RAW | FLAG_DELTAS)) != 0
            or _get(payload, SHARD_AT, 4) != shard_ids[shard] or _get(payload, SOURCE_AT, 4) != source
            or _get(payload, NUMEL_AT, 8) != numel or _get(payload, BLOCK_SIZE_AT, 4) != block_size
            or _get(payload, FINGERPRINT_AT, 4) != fingerprint
        ):  # fmt: skip
            return STOP_OTHER, item
        generation = np.int64(_get(payload, GENERATION_AT, 8))
        epoch = np.int64(_get(payload, EPOCH_AT, 8))
        changed = np.int64(_get(payload, CHANGED_AT, 4))
        exp_bytes = np.int64(_get(payload, EXP_BYTES_AT, 8))
        full = (flags & FLAG_FULL) != 0
        if (
            changed > n_blocks[shard] or exp_bytes > numel or length != fixed + exp_bytes or epoch == 0
            or epoch != epochs[item] or generation <= generations[item]
            or not (full or generations[item] == generation - 1)
        ):  # fmt: skip
            return STOP_OTHER, item
        target = out[out_starts[shard] + source * numel : out_starts[shard] + (source + 1) * numel]
        status, _, checksum = rebuild(
            payload, payload[fixed:], _get(payload, META_CRC_AT, 4), bitmap_bytes[shard], sm_offsets[shard],
            sm_bytes[shard], n_blocks[shard], changed, full, (flags & FLAG_DELTAS) != 0, True,
            (flags & FLAG_RAW) != 0, block_size, caches[item], exp_shifts[shard], fp16[shard] != 0, target,
        )  # fmt: skip
        if status:
            return STOP_REBUILD, item
        generations[item] = generation
        done[item] = 1
        if checksum != _get(payload, SM_CHECKSUM_AT, 8):
            return STOP_SM_CHECKSUM, item
        item += 1
    return STOP_DONE, item
