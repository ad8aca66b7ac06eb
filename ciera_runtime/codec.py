"""Per-shard codec: sender-side :class:`ShardEncoder`, receiver-side :class:`ShardDecoder`, payload format.

Payload (little-endian; sections start on 8-byte boundaries)::

    header      64 bytes, see HEADER_FORMAT
    bitmap      ceil(n_blocks / 8) bytes, bit k (LSB first) set = block k carries exponents
    sign+mant   BF16: n bytes; FP16: n bytes + ceil(3n / 8) bytes (see kernels.pack_sign_mantissa)
    exponents   exp_bytes: rANS stream of the changed blocks' exponents, or them raw (FLAG_RAW_EXPONENTS)

Everything before ``exponents`` has a size fixed by (dtype, numel, block size): the *fixed part*. The
all-gather sends it in its first round and the variable part in a second one.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ciera_runtime import kernels
from ciera_runtime.backend import CodecBackend, get_backend
from ciera_runtime.errors import ChecksumMismatchError, OutOfStepError, PayloadError
from ciera_runtime.rans import RansFormatError

MAGIC = b"CIER"
# 2: rANS streams use 8 interleaved lanes (8 lane states per chunk; version 1 had 4).
# 3: the last header field carries a 64-bit checksum of the sign+mantissa plane (was reserved).
FORMAT_VERSION = 3
# magic, version, dtype, flags, shard_id, source_rank, generation, numel, block_size, changed_blocks,
# exp_bytes, shard_crc32, meta_crc32, sign_mantissa_checksum64
HEADER_FORMAT = "<4sHBBIIQQIIQIIQ"
HEADER_BYTES = 64
_META_CRC_OFFSET = struct.calcsize("<4sHBBIIQQIIQI")
assert struct.calcsize(HEADER_FORMAT) <= HEADER_BYTES

FLAG_FULL_EXPONENTS = 1  # every block carries exponents: decodable without any cache
FLAG_RAW_EXPONENTS = 2  # exponent section is raw bytes (rANS did not pay off, or a resync payload)
FLAG_CHECKSUM = 4  # shard_crc32 holds the CRC-32 of the shard's 16-bit patterns (verify mode)


class DType(IntEnum):
    BF16 = 1
    FP16 = 2


_EXP_LAYOUT = {
    DType.BF16: (kernels.BF16_EXP_SHIFT, kernels.BF16_EXP_MASK),
    DType.FP16: (kernels.FP16_EXP_SHIFT, kernels.FP16_EXP_MASK),
}


def dtype_from_name(name: object) -> DType:
    """DType from a DType, torch dtype or string ('bf16', 'bfloat16', 'fp16', 'float16')."""
    if isinstance(name, DType):
        return name
    text = str(name).removeprefix("torch.").lower()
    if text in ("bf16", "bfloat16"):
        return DType.BF16
    if text in ("fp16", "float16", "half"):
        return DType.FP16
    raise ValueError(f"dtype {name!r} is not supported: expected bfloat16 or float16")


@dataclass(frozen=True)
class CodecConfig:
    """Codec settings shared by senders and receivers of one group.

    block_size: values per change-detection block. detector: 'hash' (16 B of sender state per block)
    or 'exact' (sender keeps the last exponents it sent, 1 B per value, no collision risk).
    verify_every: put a CRC-32 of the shard in every K-th payload (0 = never); receivers check it.
    backend: name of the codec backend (see backend.get_backend).
    """

    block_size: int = 512
    detector: str = "hash"
    verify_every: int = 0
    backend: str = "cpu"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: expected a positive integer")
        if self.detector not in ("hash", "exact"):
            raise ValueError(f"detector={self.detector!r}: expected 'hash' or 'exact'")
        if self.verify_every < 0:
            raise ValueError(f"verify_every={self.verify_every}: expected >= 0")


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of the sections of one shard's payload."""

    numel: int
    n_blocks: int
    bitmap_offset: int
    bitmap_bytes: int
    sign_mantissa_offset: int
    sign_mantissa_bytes: int
    fixed_bytes: int

    @staticmethod
    def of(numel: int, dtype: DType, block_size: int) -> PayloadLayout:
        n_blocks = (numel + block_size - 1) // block_size
        bitmap_bytes = (n_blocks + 7) // 8
        sm_offset = HEADER_BYTES + _align8(bitmap_bytes)
        sm_bytes = kernels.sign_mantissa_bytes(numel, dtype == DType.FP16)
        return PayloadLayout(
            numel, n_blocks, HEADER_BYTES, bitmap_bytes, sm_offset, sm_bytes, sm_offset + _align8(sm_bytes)
        )


@dataclass(frozen=True)
class PayloadHeader:
    dtype: DType
    flags: int
    shard_id: int
    source_rank: int
    generation: int
    numel: int
    block_size: int
    changed_blocks: int
    exp_bytes: int
    shard_crc32: int
    meta_crc32: int
    sign_mantissa_checksum64: int

    @property
    def full(self) -> bool:
        return bool(self.flags & FLAG_FULL_EXPONENTS)


def parse_header(payload: np.ndarray, shard_id: int, source_rank: int) -> PayloadHeader:
    """Header of ``payload`` (uint8 array); errors name the shard and rank the caller expected."""
    if payload.size < HEADER_BYTES:
        raise PayloadError(shard_id, source_rank, f"payload truncated: {payload.size} bytes < header")
    fields = struct.unpack_from(HEADER_FORMAT, payload.data)
    magic, version, dtype_code = fields[0], fields[1], fields[2]
    if magic != MAGIC:
        raise PayloadError(shard_id, source_rank, f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise PayloadError(
            shard_id, source_rank, f"format version {version}, this build reads {FORMAT_VERSION}"
        )
    if dtype_code not in (DType.BF16, DType.FP16):
        raise PayloadError(shard_id, source_rank, f"unknown dtype code {dtype_code}")
    return PayloadHeader(DType(dtype_code), *fields[3:14])


def _meta_crc(payload: np.ndarray, layout: PayloadLayout, exp_section: np.ndarray) -> int:
    """CRC-32 over header (CRC field zeroed), bitmap and exponent section. The sign+mantissa plane has
    its own checksum in the header (kernels.checksum64: a faster pass than CRC-32 over half the shard)."""
    header = bytearray(payload[:HEADER_BYTES].tobytes())
    header[_META_CRC_OFFSET : _META_CRC_OFFSET + 4] = b"\0\0\0\0"
    crc = zlib.crc32(header)
    crc = zlib.crc32(payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes], crc)
    return zlib.crc32(exp_section, crc)


def shard_bits(shard) -> np.ndarray:
    """The shard as a flat uint16 numpy view (torch bf16/fp16 tensor or any 16-bit numpy array)."""
    if hasattr(shard, "numpy") and hasattr(shard, "view"):  # torch.Tensor without importing torch here
        import torch

        return shard.detach().reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)
    array = np.asarray(shard)
    if array.dtype.itemsize != 2:
        raise ValueError(f"shard dtype {array.dtype}: expected 16-bit values")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint16)


class ShardEncoder:
    """Sender side of one shard: keeps the HashCache (or last-sent exponents) and the generation."""

    def __init__(
        self, shard_id: int, numel: int, dtype, source_rank: int = 0, config: CodecConfig | None = None
    ) -> None:
        self.config = config or CodecConfig()
        self.shard_id = shard_id
        self.numel = numel
        self.dtype = dtype_from_name(dtype)
        self.source_rank = source_rank
        self.layout = PayloadLayout.of(numel, self.dtype, self.config.block_size)
        self.backend: CodecBackend = get_backend(self.config.backend)
        self.generation = 0  # generation of the last payload made; 0 = none yet (next one is full)
        n_blocks = self.layout.n_blocks
        self._exp_scratch = np.empty(numel, dtype=np.uint8)
        if self.config.detector == "hash":
            self._hash_cache = np.zeros((n_blocks, 2), dtype=np.uint64)
        else:
            self._last_exp = np.zeros(numel, dtype=np.uint8)
        self._changed = np.zeros(n_blocks, dtype=np.uint8)
        self.last_changed_blocks = 0

    @property
    def state_bytes(self) -> int:
        """Persistent sender memory: 16 B per block (hash) or 1 B per value (exact)."""
        return self._hash_cache.nbytes if self.config.detector == "hash" else self._last_exp.nbytes

    def encode(self, shard, force_full: bool = False) -> np.ndarray:
        """Payload for this gather (uint8 array); advances the generation and the change-detection state."""
        bits = shard_bits(shard)
        if bits.size != self.numel:
            raise ValueError(f"shard {self.shard_id}: {bits.size} values, encoder was built for {self.numel}")
        full = force_full or self.generation == 0
        shift, mask = _EXP_LAYOUT[self.dtype]
        block_size = self.config.block_size
        exp_source = self._exp_scratch
        if self.config.detector == "hash":
            self.backend.detect_changes_hash(
                bits, shift, mask, block_size, self._hash_cache, exp_source, self._changed, full
            )
        else:
            self.backend.detect_changes_exact(
                bits, shift, mask, block_size, exp_source, self._last_exp, self._changed, full
            )
        changed_blocks = np.flatnonzero(self._changed)
        self.last_changed_blocks = int(changed_blocks.size)
        offsets, changed_values = kernels.changed_block_offsets(changed_blocks, block_size, self.numel)
        packed_exp = np.empty(changed_values, dtype=np.uint8)
        if changed_values:
            self.backend.gather_blocks(exp_source, changed_blocks, offsets, block_size, packed_exp)
        flags = FLAG_FULL_EXPONENTS if full else 0
        exp_section: np.ndarray | bytes = b""
        if changed_values:
            exp_section = self.backend.ans_encode(packed_exp)
            if len(exp_section) >= changed_values:
                exp_section, flags = packed_exp, flags | FLAG_RAW_EXPONENTS
        self.generation += 1
        return self._assemble(bits, flags, self._changed, changed_blocks.size, exp_section)

    def encode_resync(self, shard) -> np.ndarray:
        """Full-exponent payload (raw exponents, known size) for the generation last encoded.

        Used when a receiver is out of step; it does not touch the change-detection state.
        """
        bits = shard_bits(shard)
        shift, mask = _EXP_LAYOUT[self.dtype]
        exps = np.empty(self.numel, dtype=np.uint8)
        self.backend.extract_exponents(bits, shift, mask, exps)
        all_blocks = np.ones(self.layout.n_blocks, dtype=np.uint8)
        return self._assemble(
            bits, FLAG_FULL_EXPONENTS | FLAG_RAW_EXPONENTS, all_blocks, all_blocks.size, exps
        )

    def resync_payload_bytes(self) -> int:
        return self.layout.fixed_bytes + self.numel

    def _assemble(self, bits, flags, changed, changed_count, exp_section) -> np.ndarray:
        layout = self.layout
        exp_view = (
            np.frombuffer(exp_section, dtype=np.uint8) if isinstance(exp_section, bytes) else exp_section
        )
        payload = np.zeros(layout.fixed_bytes + exp_view.size, dtype=np.uint8)
        if changed.size:
            payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes] = np.packbits(
                changed, bitorder="little"
            )
        sm_end = layout.sign_mantissa_offset + layout.sign_mantissa_bytes
        sign_mantissa = payload[layout.sign_mantissa_offset : sm_end]
        self.backend.pack_sign_mantissa(bits, self.dtype == DType.FP16, sign_mantissa)
        payload[layout.fixed_bytes :] = exp_view
        shard_crc = 0
        verify_every = self.config.verify_every
        if verify_every and self.generation % verify_every == 0:
            flags |= FLAG_CHECKSUM
            shard_crc = zlib.crc32(bits)
        header = struct.pack(
            HEADER_FORMAT,
            MAGIC,
            FORMAT_VERSION,
            int(self.dtype),
            flags,
            self.shard_id,
            self.source_rank,
            self.generation,
            self.numel,
            self.config.block_size,
            changed_count,
            exp_view.size,
            shard_crc,
            0,
            self.backend.checksum64(sign_mantissa),
        )
        payload[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        meta_crc = _meta_crc(payload, layout, exp_view)
        payload[_META_CRC_OFFSET : _META_CRC_OFFSET + 4] = np.frombuffer(
            struct.pack("<I", meta_crc), np.uint8
        )
        return payload


class ShardDecoder:
    """Receiver side of one (shard, source rank): the ExpCache and the generation it reflects."""

    def __init__(
        self, shard_id: int, source_rank: int, numel: int, dtype, config: CodecConfig | None = None
    ) -> None:
        self.config = config or CodecConfig()
        self.shard_id = shard_id
        self.source_rank = source_rank
        self.numel = numel
        self.dtype = dtype_from_name(dtype)
        self.layout = PayloadLayout.of(numel, self.dtype, self.config.block_size)
        self.backend: CodecBackend = get_backend(self.config.backend)
        self.exp_cache = np.zeros(numel, dtype=np.uint8)
        self.generation = 0  # generation of the last payload applied; 0 = cache empty

    @property
    def cache_bytes(self) -> int:
        return self.exp_cache.nbytes

    def _fail(self, reason: str, error: type[PayloadError] = PayloadError) -> PayloadError:
        return error(self.shard_id, self.source_rank, reason)

    def decode(
        self, payload, out: np.ndarray | None = None, exp_section: np.ndarray | None = None
    ) -> np.ndarray:
        """Rebuild the shard (uint16 patterns) from ``payload``.

        ``payload`` is the whole payload, or only its fixed part when ``exp_section`` is passed separately
        (the all-gather receives them in two rounds). Raises PayloadError (corrupt, truncated, foreign),
        OutOfStepError (cache not at generation - 1 for a delta payload) or ChecksumMismatchError.
        """
        payload = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload
        layout = self.layout
        header = parse_header(payload, self.shard_id, self.source_rank)
        expected = (self.shard_id, self.source_rank, self.dtype, self.numel, self.config.block_size)
        found = (header.shard_id, header.source_rank, header.dtype, header.numel, header.block_size)
        if found != expected:
            raise self._fail(f"header (shard, rank, dtype, numel, block) = {found}, expected {expected}")
        if exp_section is None:
            if payload.size != layout.fixed_bytes + header.exp_bytes:
                raise self._fail(
                    f"payload is {payload.size} bytes, header describes {layout.fixed_bytes + header.exp_bytes}"
                )
            exp_section = payload[layout.fixed_bytes :]
        elif payload.size < layout.fixed_bytes or exp_section.size != header.exp_bytes:
            raise self._fail(
                f"parts are {payload.size}+{exp_section.size} bytes, expected "
                f"{layout.fixed_bytes}+{header.exp_bytes}"
            )
        if _meta_crc(payload, layout, exp_section) != header.meta_crc32:
            raise self._fail("header/bitmap/exponent CRC mismatch: payload corrupted in transit")
        sign_mantissa = payload[
            layout.sign_mantissa_offset : layout.sign_mantissa_offset + layout.sign_mantissa_bytes
        ]
        if self.backend.checksum64(sign_mantissa) != header.sign_mantissa_checksum64:
            raise self._fail("sign+mantissa checksum mismatch: payload corrupted in transit")
        bitmap = payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes]
        changed = np.unpackbits(bitmap, count=layout.n_blocks, bitorder="little")
        changed_blocks = np.flatnonzero(changed)
        if changed_blocks.size != header.changed_blocks:
            raise self._fail(
                f"bitmap has {changed_blocks.size} blocks set, header says {header.changed_blocks}"
            )
        if header.full and changed_blocks.size != layout.n_blocks:
            raise self._fail("full-exponent payload does not flag every block")
        if not header.full and self.generation != header.generation - 1:
            raise self._fail(
                f"cache is at generation {self.generation}, payload {header.generation} is a delta on "
                f"{header.generation - 1}: receiver out of step, needs full exponents",
                OutOfStepError,
            )
        offsets, changed_values = kernels.changed_block_offsets(
            changed_blocks, self.config.block_size, self.numel
        )
        packed_exp = np.empty(changed_values, dtype=np.uint8)
        if header.flags & FLAG_RAW_EXPONENTS:
            if exp_section.size != changed_values:
                raise self._fail(
                    f"raw exponent section is {exp_section.size} bytes, expected {changed_values}"
                )
            packed_exp[:] = exp_section
        elif changed_values:
            try:
                self.backend.ans_decode(exp_section, packed_exp)
            except RansFormatError as error:
                raise self._fail(f"exponent stream invalid: {error}") from None
        elif exp_section.size:
            raise self._fail(f"no changed blocks but {exp_section.size} exponent bytes")
        # Only now, with every check passed, touch the cache.
        if changed_values:
            self.backend.scatter_blocks(
                packed_exp, changed_blocks, offsets, self.config.block_size, self.exp_cache
            )
        if out is None:
            out = np.empty(self.numel, dtype=np.uint16)
        shift, _ = _EXP_LAYOUT[self.dtype]
        self.backend.merge_planes(self.exp_cache, sign_mantissa, shift, self.dtype == DType.FP16, out)
        self.generation = header.generation
        if header.flags & FLAG_CHECKSUM and zlib.crc32(out) != header.shard_crc32:
            self.generation = -1  # cache no longer trusted: the next delta fails as out of step
            raise self._fail("rebuilt shard does not match the sender's checksum", ChecksumMismatchError)
        return out
