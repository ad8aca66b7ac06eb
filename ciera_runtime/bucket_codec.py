"""A bucket's shards encoded, and its received messages rebuilt, in one compiled call each way
(``payload_passes.encode_exact_bucket`` and ``payload_passes.rebuild_bucket``).

An engine's bucket can hold many small shards (DeepSpeed's coalesced fetch of a module's parameters).
Shard by shard, each costs the training thread ~20 us on top of its share of the bucket's values on
loopback (``benchmarks/bucket_host.py``): the tensor's numpy view, a compiled call and its dispatch per
shard and per source, the message's copy into the row, header parsing and bookkeeping. Here the bucket's
shards are flattened by one ``torch.cat``, one compiled call encodes every shard straight into the row,
and one compiled call checks and rebuilds every received payload of the steady state into one output
buffer (the engines' layout); that cuts the growth to ~9 us per shard — the format's own per-shard work
(header, bitmap, rANS tables, checksums) — at a fixed cost of ~90 us per call, so buckets of fewer than
``MIN_SHARDS`` shards keep the per-shard loop.

The bytes are those of the per-shard loop (``bucket.BucketGather``), shard for shard — both make each
payload with ``payload_passes.encode_exact`` — and the tests compare the two row for row. On the receive
side anything but a payload of the steady state — a raw message or seed, a message that spills into the
overflow round, a verify-mode payload, a new sender epoch, any payload that fails a check — is handed,
in the per-shard loop's order, to the per-shard path, which raises its own error for it.

Which buckets: at least ``MIN_SHARDS`` shards, every one compressed, the exact detector (the default),
each shard small enough for the encoder's one-call pass (``codec._one_call_capable``); on the receive
side also outputs that tile one buffer (or none given). Anything else, or a forced parallel detector,
takes the per-shard loop.
"""

from __future__ import annotations

import operator
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch
from numba.typed import List

from ciera_runtime import kernels, payload_passes
from ciera_runtime.codec import _EXP_LAYOUT, SM_CHECKSUM_MISMATCH, DType, _align8

if TYPE_CHECKING:
    from ciera_runtime.allgather import _ShardState
    from ciera_runtime.codec import CodecConfig, ShardEncoder

_SIXTEEN_BIT = (torch.bfloat16, torch.float16, torch.int16)
# The encoder's planes the compiled call reads and writes, in the order of its typed lists.
_PLANES = ("_exp_scratch", "_last_exp", "_sent_exp", "_changed", "_header_template")


# Buckets of fewer shards take the per-shard loop: the one-call path costs ~90 us more per call at one
# shard and ~12 us less per further shard; `python benchmarks/bucket_host.py --values 32768 --shards
# 1,2,4,8,16,32 --one-call-min-shards 1` put the break-even between 4 and 8 shards (docs/runtime.md).
MIN_SHARDS = 8


def batchable(states: list[_ShardState], config: CodecConfig) -> bool:
    """Whether a bucket of these shards is encoded and rebuilt in one compiled call (see the module)."""
    if config.detector != "exact" or len(states) < MIN_SHARDS:
        return False
    for state in states:
        encoder = state.encoder
        if not state.compressed or encoder is None or not encoder._serial:
            return False
        if not getattr(encoder.backend, "bucket_payload_passes", False):
            return False
    return True


class BucketEncoder:
    """The constant facts of one bucket's shards (sizes, layouts) as arrays, and the typed lists of their
    encoders' planes, rebuilt only when an encoder's planes were replaced (its own one-call encode swaps
    two of them; a new epoch replaces the header template)."""

    def __init__(self, states: list[_ShardState], config: CodecConfig) -> None:
        n = len(states)
        self.dtypes = [state.dtype for state in states]
        self.torch_dtypes = [state.torch_dtype for state in states]
        numels = [state.numel for state in states]
        self.starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(numels, out=self.starts[1:])
        self.values = int(self.starts[-1])
        self.bounds = list(zip(self.starts[:-1].tolist(), self.starts[1:].tolist(), strict=True))
        self.exp_shifts = np.array([_EXP_LAYOUT[dtype][0] for dtype in self.dtypes], dtype=np.int64)
        self.exp_masks = np.array([_EXP_LAYOUT[dtype][1] for dtype in self.dtypes], dtype=np.int64)
        self.fp16 = np.array([dtype == DType.FP16 for dtype in self.dtypes], dtype=np.uint8)
        self.dtype_codes = np.array([int(dtype) for dtype in self.dtypes], dtype=np.int64)
        layouts = [state.encoder.layout for state in states]
        self.n_blocks = np.array([layout.n_blocks for layout in layouts], dtype=np.int64)
        self.bitmap_bytes = np.array([layout.bitmap_bytes for layout in layouts], dtype=np.int64)
        self.sm_offsets = np.array([layout.sign_mantissa_offset for layout in layouts], dtype=np.int64)
        self.sm_bytes = np.array([layout.sign_mantissa_bytes for layout in layouts], dtype=np.int64)
        self.fixed_bytes = np.array([layout.fixed_bytes for layout in layouts], dtype=np.int64)
        # The stream's room: each payload is made in place before it is known to be smaller than raw (its
        # largest size), a seed is its values plus a prefix.
        self.stream_bytes = sum(
            _align8(max(layout.max_payload_bytes, payload_passes.SEED_PREFIX_BYTES + 2 * numel))
            for layout, numel in zip(layouts, numels, strict=True)
        )
        self.block_size = config.block_size
        self.use_rans = config.entropy == "rans"
        self.verify_every = config.verify_every
        self.kinds = np.zeros(n, dtype=np.int64)
        self.sizes = np.zeros(n, dtype=np.int64)
        self.changed_counts = np.zeros(n, dtype=np.int64)
        self._planes: list[np.ndarray] = []
        self._lists: tuple | None = None

    def flat_bits(self, shards: list) -> np.ndarray:
        """The bucket's 16-bit patterns as one uint16 array (one copy; the caller has checked each shard's
        dtype and size against its registration); ValueError when they are not CPU tensors of the
        registered sizes (the per-shard loop then names the shard)."""
        with torch.no_grad():
            try:  # shards of one dtype and shape rank (the engines' case): one call
                flat = torch.cat(shards)
            except RuntimeError:
                flat = None
            if flat is None or flat.dtype not in _SIXTEEN_BIT:  # mixed dtypes would have been promoted
                flat = torch.cat([shard.reshape(-1).view(torch.int16) for shard in shards])
            flat = flat.reshape(-1).view(torch.int16)
        if flat.numel() != self.values or not flat.is_cpu:
            raise ValueError("bucket shards are not the registered CPU tensors")
        return flat.numpy().view(np.uint16)

    def encode(self, encoders: list[ShardEncoder], bits: np.ndarray, out: np.ndarray) -> int:
        """Every shard's message into ``out`` (at least ``stream_bytes``), advancing each encoder as its own
        encode would; ``kinds``, ``sizes`` and ``changed_counts`` hold each message's facts. Returns the
        stream's length (the messages, 8-aligned)."""
        planes = [getattr(encoder, name) for encoder in encoders for name in _PLANES]
        if (
            self._lists is None
            or len(planes) != len(self._planes)
            or not all(map(operator.is_, planes, self._planes))
        ):
            self._lists = tuple(List(planes[k :: len(_PLANES)]) for k in range(len(_PLANES)))
            self._planes = planes
        n = len(encoders)
        generations = np.empty(n, dtype=np.int64)
        full = np.empty(n, dtype=np.uint8)
        epochs = np.empty(n, dtype=np.int64)
        for index, encoder in enumerate(encoders):
            generations[index] = encoder.generation + 1
            full[index] = encoder.generation == 0 or encoder._full_next
            epochs[index] = encoder._epoch
        shard_crcs = np.zeros(n, dtype=np.int64)
        checksum_flags = np.zeros(n, dtype=np.uint8)
        if self.verify_every:
            for index in np.flatnonzero(generations % self.verify_every == 0):
                checksum_flags[index] = 1
                shard_crcs[index] = zlib.crc32(bits[self.starts[index] : self.starts[index + 1]])
        exp_planes, last_planes, base_planes, changed_flags, templates = self._lists
        stream_bytes = payload_passes.encode_exact_bucket(
            bits, self.starts, exp_planes, last_planes, base_planes, changed_flags, templates,
            self.exp_shifts, self.exp_masks, self.fp16, self.block_size, full, generations, epochs,
            shard_crcs, checksum_flags, self.bitmap_bytes, self.sm_offsets, self.sm_bytes, self.fixed_bytes,
            self.use_rans, out, self.kinds, self.sizes, self.changed_counts,
        )  # fmt: skip
        for encoder, changed, kind in zip(
            encoders, self.changed_counts.tolist(), self.kinds.tolist(), strict=True
        ):
            encoder.generation += 1
            encoder._full_next = kind == payload_passes.KIND_RAW  # a raw message: the next payload is full
            encoder.last_changed_blocks = changed
        return int(stream_bytes)


def usable() -> bool:
    """Per call: the one-call passes run unless a test forced the parallel kernels."""
    return kernels._parallel_detect is not True


class BucketDecoder:
    """The receive side of :class:`BucketEncoder`'s buckets: every received payload of the steady state
    rebuilt in one compiled call (``payload_passes.rebuild_bucket``), anything else — raw messages, seeds,
    messages that spill into the overflow round, verify-mode payloads, a new sender epoch, any error —
    handed item by item to the per-shard path (``decode_one``), in the per-shard loop's order, so every
    error is the one that path raises."""

    def __init__(
        self, encoder: BucketEncoder, shard_ids: tuple[int, ...], config: CodecConfig, world: int
    ) -> None:
        self.encoder = encoder
        self.world = world
        self.shard_id_list = list(shard_ids)
        self.shard_ids = np.array(shard_ids, dtype=np.int64)
        self.numels = np.diff(encoder.starts)
        self.out_starts = world * encoder.starts[:-1]
        self.out_sizes = (world * self.numels).tolist()
        self.fingerprint = config.fingerprint
        self._decoders: list = []
        self._caches: List | None = None

    def flat_output(self, outputs: list | None) -> tuple[np.ndarray, list] | None:
        """One uint16 array over the bucket's outputs and the tensors to return: a new buffer when the
        caller gave none; the caller's own when its outputs tile one buffer in order (what the engines
        pass); None otherwise (the per-shard path copies into each)."""
        total = self.world * self.encoder.values
        if outputs is None:
            flat = torch.empty(total, dtype=torch.int16)
            results = [
                part.view(dtype)
                for part, dtype in zip(flat.split(self.out_sizes), self.encoder.torch_dtypes, strict=True)
            ]
        else:
            first = outputs[0]
            base = first.data_ptr()
            for output, start in zip(outputs, self.out_starts.tolist(), strict=True):
                if output.data_ptr() != base + 2 * start or not output.is_contiguous():
                    return None
            if first.untyped_storage().nbytes() < 2 * (first.storage_offset() + total):
                return None
            flat, results = first.view(torch.int16).as_strided((total,), (1,)), outputs
        return flat.numpy().view(np.uint16), results

    def _cache_list(self, states: list[_ShardState], rank: int) -> list:
        """Each item's decoder (None for this rank's own), and the typed list of their caches, rebuilt only
        when a decoder was replaced."""
        decoders = [
            None if source == rank else state.decoders[source]
            for state in states
            for source in range(self.world)
        ]
        if self._caches is None or not all(map(operator.is_, decoders, self._decoders)):
            empty = np.zeros(0, dtype=np.uint8)
            self._caches = List([empty if decoder is None else decoder.exp_cache for decoder in decoders])
            self._decoders = decoders
        return decoders

    def decode(
        self, states, headers, received, head: int, rank: int, bits, out, decode_one
    ) -> tuple[tuple[int, str] | None, int]:
        """Rebuild every other rank's part of every shard into ``out``; ``decode_one(shard index, source,
        offset, target)`` runs the per-shard path on one item and returns its failure or None. Returns
        the first failure (shard id, reason), or None, and how many items went to ``decode_one``."""
        world, encoder = self.world, self.encoder
        decoders = self._cache_list(states, rank)
        entries = np.array([header.entries for header in headers], dtype=np.int64)
        aligned = ((entries >> 2) + 7) & ~7
        offsets = np.cumsum(aligned, axis=1) - aligned
        n_items = len(decoders)
        epochs = np.zeros(n_items, dtype=np.int64)
        generations = np.zeros(n_items, dtype=np.int64)
        for item, decoder in enumerate(decoders):
            if decoder is not None:
                epochs[item], generations[item] = decoder.epoch, decoder.generation
        done = np.zeros(n_items, dtype=np.uint8)
        item, handoffs = 0, 0
        try:
            while True:
                stop, item = payload_passes.rebuild_bucket(
                    received, head, entries, offsets, item, rank, bits, out, self.out_starts, self.numels,
                    encoder.n_blocks, encoder.bitmap_bytes, encoder.sm_offsets, encoder.sm_bytes,
                    encoder.fixed_bytes, self.shard_ids, encoder.dtype_codes, encoder.block_size, self.fingerprint,
                    encoder.exp_shifts, encoder.fp16, self._caches, epochs, generations, done,
                )  # fmt: skip
                if stop == payload_passes.STOP_DONE:
                    return None, handoffs
                shard, source = divmod(int(item), world)
                if stop == payload_passes.STOP_SM_CHECKSUM:
                    error = decoders[item]._fail(SM_CHECKSUM_MISMATCH)
                    return (self.shard_id_list[shard], f"rebuilding rank {source}'s shard: {error}"), handoffs
                start = int(self.out_starts[shard]) + source * int(self.numels[shard])
                handoffs += 1
                failure = decode_one(
                    shard, source, int(offsets[source, shard]), out[start : start + int(self.numels[shard])]
                )
                if failure is not None:
                    return failure, handoffs
                item += 1
        finally:
            for item in np.flatnonzero(done).tolist():
                decoders[item]._advance_to(int(epochs[item]), int(generations[item]))
