"""Per-shard codec: sender-side :class:`ShardEncoder`, receiver-side :class:`ShardDecoder`, payload format.

Payload (little-endian; sections start on 8-byte boundaries)::

    header      80 bytes, see HEADER_FORMAT; its own CRC-32 is checked before any field is used
    bitmap      ceil(n_blocks / 8) bytes, bit k (LSB first) set = block k carries exponents
    sign+mant   BF16: n bytes; FP16: n bytes + ceil(3n / 8) bytes (see kernels.pack_sign_mantissa)
    exponents   exp_bytes: rANS stream of the changed blocks' exponents, or them raw (FLAG_RAW_EXPONENTS);
                with FLAG_EXPONENT_DELTAS (exact detector, not a full payload) each value's difference
                (new - cached, mod 256) instead of the exponent itself

Everything before ``exponents`` has a size fixed by (dtype, numel, block size): the *fixed part*. The
all-gather sends it in its first round and the variable part in a second one.
"""

from __future__ import annotations

import functools
import re
import secrets
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from ciera_runtime import kernels, payload_passes, rans
from ciera_runtime.backend import CodecBackend, get_backend
from ciera_runtime.errors import ChecksumMismatchError, OutOfStepError, PayloadError, StalePayloadError
from ciera_runtime.rans import RansFormatError

MAGIC = b"CIER"
# 2: rANS streams use 8 interleaved lanes (8 lane states per chunk; version 1 had 4).
# 3: the last header field carries a 64-bit checksum of the sign+mantissa plane (was reserved).
# 4: 80-byte header: the sender's epoch (replay protection), a configuration fingerprint and a CRC-32
#    of the header itself, checked before any field steers the decoder; meta_crc32 covers bitmap and
#    exponent section only.
# 5: exponent deltas (FLAG_EXPONENT_DELTAS) under the exact detector, its default since.
FORMAT_VERSION = 5
# magic, version, dtype, flags, shard_id, source_rank, generation, epoch, numel, block_size,
# changed_blocks, exp_bytes, shard_crc32, meta_crc32, sign_mantissa_checksum64, config_fingerprint,
# header_crc32
HEADER_FORMAT = "<4sHBBIIQQQIIQIIQII"
HEADER_BYTES = 80
_HEADER_CRC_OFFSET = HEADER_BYTES - 4
HEADER_FLAGS_OFFSET = struct.calcsize("<4sHB")  # the flags byte: magic, version, dtype come first
assert struct.calcsize(HEADER_FORMAT) == HEADER_BYTES
_HEADER_STRUCT = struct.Struct(HEADER_FORMAT)

FLAG_FULL_EXPONENTS = 1  # every block carries exponents: decodable without any cache
FLAG_RAW_EXPONENTS = 2  # exponent section is raw bytes (rANS did not pay off, or a resync payload)
FLAG_CHECKSUM = 4  # shard_crc32 holds the CRC-32 of the shard's 16-bit patterns (verify mode)
# The exponent section codes, per value of a changed block, (new exponent - the receiver's cached one)
# mod 256. Set on every non-full payload of the exact detector (whose sender keeps exactly what the
# receivers' caches hold) and on no other: a changed block's exponents mostly equal the cached ones (one
# value in ~100 crosses a power of two per step), so its deltas are nearly all 0 and code to well under a
# bit per value, where the exponents themselves take ~2.6 bits.
FLAG_EXPONENT_DELTAS = 8
# What a receiver raises when the rebuilt sign+mantissa plane does not match the sender's checksum (the
# per-shard decode and the bucket's one-call rebuild alike).
SM_CHECKSUM_MISMATCH = "sign+mantissa checksum mismatch: payload corrupted in transit"

# The one-call encode (payload_passes.py, which this module imports, so it keeps its own copies as numba
# globals) writes the header fields that change per payload at fixed offsets: they must be this format's
# (fields 3, 6, 10-14, 16: flags, generation, changed_blocks, exp_bytes, the three CRCs and checksum64).
_FIELDS = re.findall(r"\d*[a-zA-Z]", HEADER_FORMAT[1:])  # "4s", "H", "B", ...: one per field


def _field_at(k: int) -> int:
    return struct.calcsize("<" + "".join(_FIELDS[:k]))


assert (
    payload_passes.HEADER_BYTES,
    payload_passes.FLAGS_AT,
    payload_passes.GENERATION_AT,
    payload_passes.CHANGED_AT,
    payload_passes.EXP_BYTES_AT,
    payload_passes.SHARD_CRC_AT,
    payload_passes.META_CRC_AT,
    payload_passes.SM_CHECKSUM_AT,
    payload_passes.HEADER_CRC_AT,
) == (HEADER_BYTES, *(_field_at(k) for k in (3, 6, 10, 11, 12, 13, 14, 16)))
assert (
    payload_passes.VERSION_AT,
    payload_passes.DTYPE_AT,
    payload_passes.SHARD_AT,
    payload_passes.SOURCE_AT,
    payload_passes.EPOCH_AT,
    payload_passes.NUMEL_AT,
    payload_passes.BLOCK_SIZE_AT,
    payload_passes.FINGERPRINT_AT,
) == tuple(_field_at(k) for k in (1, 2, 4, 5, 7, 8, 9, 15))
assert (bytes(payload_passes.MAGIC), payload_passes.FORMAT_VERSION) == (MAGIC, FORMAT_VERSION)
assert (
    payload_passes.FLAG_FULL,
    payload_passes.FLAG_RAW,
    payload_passes.FLAG_CHECKSUM,
    payload_passes.FLAG_DELTAS,
) == (FLAG_FULL_EXPONENTS, FLAG_RAW_EXPONENTS, FLAG_CHECKSUM, FLAG_EXPONENT_DELTAS)


class DType(IntEnum):
    BF16 = 1
    FP16 = 2


_DTYPES = {int(dtype): dtype for dtype in DType}  # header code → DType


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


_DETECTOR_CODES = {"hash": 1, "exact": 2}
ENTROPY_STAGES = {"rans": 1, "none": 2}  # CodecConfig.entropy → its code in the control row


@dataclass(frozen=True)
class CodecConfig:
    """Codec settings shared by senders and receivers of one group.

    block_size: values per change-detection block — any positive size on the host codec; the device path
    (`device_gather.DevicePayloadCodec`) takes a power of two, and so do `ciera train` and `ciera measure`,
    so that one setting runs on either. detector: 'exact' (the sender keeps the last exponents
    it sent, 1 B per value, and one more plane as the deltas' base: no collision risk, and changed blocks
    travel as deltas against the receivers' caches) or 'hash' (16 B of sender state per block; changed
    blocks travel as exponents).
    verify_every: put a CRC-32 of the shard in every K-th payload (0 = never); receivers check it.
    backend: name of the codec backend (see backend.get_backend).
    entropy: 'rans' (changed blocks' exponents, or their deltas, rANS-coded when that is smaller) or
    'none' (always sent uncoded, one byte per value: no entropy stage on either side — the configuration a
    device without an entropy coder runs; what it costs in bytes and time: benchmarks/codec.py).
    """

    block_size: int = 64
    detector: str = "exact"
    verify_every: int = 0
    backend: str = "cpu"
    entropy: str = "rans"

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r}: expected a positive integer")
        if self.block_size >= 1 << 31:
            raise ValueError(f"block_size={self.block_size}: expected < 2**31 (a u32 header field)")
        if self.detector not in _DETECTOR_CODES:
            raise ValueError(f"detector={self.detector!r}: expected 'hash' or 'exact'")
        if self.entropy not in ENTROPY_STAGES:
            raise ValueError(f"entropy={self.entropy!r}: expected 'rans' or 'none'")
        if (
            isinstance(self.verify_every, bool)
            or not isinstance(self.verify_every, int)
            or self.verify_every < 0
        ):
            raise ValueError(f"verify_every={self.verify_every!r}: expected an integer >= 0")

    @property
    def detector_code(self) -> int:
        return _DETECTOR_CODES[self.detector]

    @property
    def entropy_code(self) -> int:
        return ENTROPY_STAGES[self.entropy]

    @functools.cached_property
    def fingerprint(self) -> int:
        """32-bit fingerprint of everything sender and receivers must agree on (the backend may differ:
        every backend writes the same bytes). Computed once: every payload's header carries it."""
        text = f"ciera/{FORMAT_VERSION}/{self.block_size}/{self.detector}/{self.verify_every}"
        if self.entropy != "rans":  # the default's fingerprint is the one it always had
            text += f"/{self.entropy}"
        return zlib.crc32(text.encode())


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

    @property
    def max_payload_bytes(self) -> int:
        """Largest payload this shard can have: the fixed part plus every exponent raw (a resync)."""
        return self.fixed_bytes + self.numel


class PayloadHeader(NamedTuple):
    """A payload's parsed header (a tuple: built for every payload received, so it must be cheap)."""

    dtype: DType
    flags: int
    shard_id: int
    source_rank: int
    generation: int
    epoch: int
    numel: int
    block_size: int
    changed_blocks: int
    exp_bytes: int
    shard_crc32: int
    meta_crc32: int
    sign_mantissa_checksum64: int
    config_fingerprint: int

    @property
    def full(self) -> bool:
        return bool(self.flags & FLAG_FULL_EXPONENTS)


_KNOWN_FLAGS = FLAG_FULL_EXPONENTS | FLAG_RAW_EXPONENTS | FLAG_CHECKSUM | FLAG_EXPONENT_DELTAS


def as_payload_bytes(payload, shard_id: int, source_rank: int) -> np.ndarray:
    """``payload`` as a 1-D contiguous uint8 array (bytes-likes are viewed, not copied)."""
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1 or not payload.flags.c_contiguous:
            raise PayloadError(
                shard_id,
                source_rank,
                f"payload is a {payload.dtype} array of shape {payload.shape}: expected contiguous 1-D uint8",
            )
        return payload
    if isinstance(payload, bytes | bytearray | memoryview):
        return np.frombuffer(payload, dtype=np.uint8)
    raise PayloadError(
        shard_id, source_rank, f"payload is {type(payload).__name__}: expected bytes or uint8 array"
    )


def parse_header(payload: np.ndarray, shard_id: int, source_rank: int) -> PayloadHeader:
    """Header of ``payload`` (uint8 array); errors name the shard and rank the caller expected.

    The header's own CRC-32 is checked first, so no corrupted field can steer what happens next; then
    magic, version, dtype and flags."""
    if payload.size < HEADER_BYTES:
        raise PayloadError(shard_id, source_rank, f"payload truncated: {payload.size} bytes < header")
    header_bytes = payload[:HEADER_BYTES].tobytes()
    fields = _HEADER_STRUCT.unpack(header_bytes)
    magic, version = fields[0], fields[1]
    if magic != MAGIC:
        raise PayloadError(shard_id, source_rank, f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise PayloadError(
            shard_id, source_rank, f"format version {version}, this build reads {FORMAT_VERSION}"
        )
    if zlib.crc32(header_bytes[:_HEADER_CRC_OFFSET]) != fields[16]:
        raise PayloadError(shard_id, source_rank, "header CRC mismatch: payload header corrupted")
    dtype = _DTYPES.get(fields[2])
    if dtype is None:
        raise PayloadError(shard_id, source_rank, f"unknown dtype code {fields[2]}")
    if fields[3] & ~_KNOWN_FLAGS:
        raise PayloadError(shard_id, source_rank, f"unknown flags {fields[3]:#x}")
    return PayloadHeader(dtype, *fields[3:16])


def _meta_crc(payload: np.ndarray, layout: PayloadLayout, exp_section: np.ndarray) -> int:
    """CRC-32 over bitmap and exponent section (the header has its own CRC, the sign+mantissa plane its
    own checksum in the header: kernels.checksum64, a faster pass than CRC-32 over half the shard)."""
    crc = zlib.crc32(payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes])
    return zlib.crc32(exp_section, crc)


_TORCH_DTYPES: dict = {}  # torch dtype → DType, filled at the first tensor (torch is imported lazily)


def shard_bits(shard, expected_dtype: DType | None = None, what: str = "shard") -> np.ndarray:
    """The shard as a flat uint16 numpy view (torch bf16/fp16 CPU tensor or any 16-bit numpy array).

    Raises ValueError (one line) for a tensor of another dtype, on another device, or not 16-bit. Called
    for every shard of every gather, so the common case — a contiguous CPU tensor that does not require
    grad — takes three torch calls (each costs ~1 us; a bucket has dozens of shards)."""
    if isinstance(shard, np.ndarray):
        if shard.dtype.itemsize != 2 or shard.dtype.kind not in "uif":
            raise ValueError(f"{what} dtype {shard.dtype}: expected 16-bit values")
        return np.ascontiguousarray(shard).reshape(-1).view(np.uint16)
    if hasattr(shard, "numpy") and hasattr(shard, "view"):  # torch.Tensor without importing torch here
        import torch

        if not _TORCH_DTYPES:
            _TORCH_DTYPES.update({torch.bfloat16: DType.BF16, torch.float16: DType.FP16})
        if not shard.is_cpu:
            raise ValueError(
                f"{what} is on {shard.device}: the codec backends in this build work on CPU tensors"
            )
        found = _TORCH_DTYPES.get(shard.dtype)
        if found is None:
            raise ValueError(f"{what} has dtype {shard.dtype}: expected torch.bfloat16 or torch.float16")
        if expected_dtype is not None and found != expected_dtype:
            raise ValueError(f"{what} has dtype {shard.dtype}, expected {expected_dtype.name.lower()}")
        if shard.requires_grad:
            shard = shard.detach()
        if not shard.is_contiguous():
            shard = shard.contiguous()
        return shard.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    raise ValueError(f"{what} is {type(shard).__name__}: expected a torch tensor or a numpy array")


def _one_call_capable(backend: CodecBackend, numel: int) -> bool:
    """Whether a payload of ``numel`` values can take the backend's one-call serial passes (the CPU
    backend, a shard that runs serially anyway: under PARALLEL_MIN_VALUES). The caller also checks, per
    payload, that parallel kernels are not forced (kernels.use_parallel_detect)."""
    return numel < kernels.PARALLEL_MIN_VALUES and getattr(backend, "serial_payload_passes", False)


def new_epoch() -> int:
    """Random non-zero 63-bit identity of one encoder instance (a restarted sender gets a new one)."""
    return secrets.randbits(63) | 1


class ShardEncoder:
    """Sender side of one shard: keeps the HashCache (or last-sent exponents), its epoch and generation.

    ``epoch`` is random per instance: receivers tell a restarted sender (new epoch) from a replayed old
    payload (an epoch they have retired, or a generation they have already applied)."""

    def __init__(
        self, shard_id: int, numel: int, dtype, source_rank: int = 0, config: CodecConfig | None = None
    ) -> None:
        self.config = config or CodecConfig()
        _check_ids(shard_id, source_rank, numel)
        self.shard_id = shard_id
        self.numel = numel
        self.dtype = dtype_from_name(dtype)
        self.source_rank = source_rank
        self.layout = PayloadLayout.of(numel, self.dtype, self.config.block_size)
        self.backend: CodecBackend = get_backend(self.config.backend)
        self.epoch = new_epoch()
        self.generation = 0  # generation of the last payload made; 0 = none yet (next one is full)
        n_blocks = self.layout.n_blocks
        self._exp_scratch = np.empty(numel, dtype=np.uint8)
        if self.config.detector == "hash":
            self._hash_cache = np.zeros((n_blocks, 2), dtype=np.uint64)
        else:
            self._last_exp = np.zeros(numel, dtype=np.uint8)
            # What the receivers hold, the deltas' base; equal to _last_exp between gathers, but the
            # encode pass updates _last_exp, so encode rotates it with the scratch plane.
            self._sent_exp = np.zeros(numel, dtype=np.uint8)
        self._changed = np.zeros(n_blocks, dtype=np.uint8)
        self.last_changed_blocks = 0
        self._full_next = False  # the next payload carries every exponent (after a failed or raw gather)
        # A small shard's payload in one compiled call (exact detector, the CPU backend).
        self._serial = self.config.detector == "exact" and _one_call_capable(self.backend, numel)

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        """The one-call encode writes its header onto this template of the fields fixed per encoder (the
        others are zero here), so it follows the epoch."""
        self._epoch = epoch
        self._header_template = np.frombuffer(
            _HEADER_STRUCT.pack(
                MAGIC, FORMAT_VERSION, int(self.dtype), 0, self.shard_id, self.source_rank, 0, epoch,
                self.numel, self.config.block_size, 0, 0, 0, 0, 0, self.config.fingerprint, 0,
            ),
            dtype=np.uint8,
        )  # fmt: skip

    @staticmethod
    def state_bytes_for(numel: int, block_size: int, detector: str) -> int:
        """Memory an encoder keeps between gathers: change-detection state (16 B per block for hash; for
        exact 1 B per value, and 1 B per value more for the deltas' base), the exponent-plane scratch (1 B
        per value) and the changed flags (1 B per block)."""
        n_blocks = (numel + block_size - 1) // block_size
        detection = 16 * n_blocks if detector == "hash" else 2 * numel
        return detection + numel + n_blocks

    @property
    def state_bytes(self) -> int:
        """Persistent sender memory, counted from the arrays themselves."""
        if self.config.detector == "hash":
            detection = self._hash_cache.nbytes
        else:
            detection = self._last_exp.nbytes + self._sent_exp.nbytes
        return detection + self._exp_scratch.nbytes + self._changed.nbytes

    def encode(self, shard, out: np.ndarray | None = None) -> np.ndarray:
        """Payload for this gather (uint8 array); advances the generation and the change-detection state.

        ``out``: a contiguous uint8 buffer of at least ``layout.max_payload_bytes``; the payload is
        written at its start and a view of it returned (no fresh buffer per gather). One fused parallel
        pass extracts the exponent plane, detects changed blocks, writes the sign+mantissa plane straight
        into the payload and checksums it; rANS writes straight after it."""
        bits, buffer = self._bits_and_buffer(shard, out)
        return self._encode_bits(bits, buffer)

    def _encode_bits(self, bits: np.ndarray, buffer: np.ndarray) -> np.ndarray:
        """``encode`` for a caller that has checked its inputs (the bucket path, which holds the shard's
        bits and a scratch buffer already): ``bits`` contiguous uint16 of ``numel`` values, ``buffer``
        contiguous uint8 of at least ``layout.max_payload_bytes``."""
        layout = self.layout
        full = self.generation == 0 or self._full_next
        self._full_next = False
        shift, mask = _EXP_LAYOUT[self.dtype]
        block_size = self.config.block_size
        is_fp16 = self.dtype == DType.FP16
        exp_plane = self._exp_scratch  # the pass writes this gather's exponent plane here
        base_plane = None  # what the receivers hold (exact detector): the deltas' base
        if self._serial and kernels._parallel_detect is not True:
            # The steps below, header included, in one compiled call (ciera_runtime/payload_passes.py).
            generation = self.generation + 1
            verify_every = self.config.verify_every
            checksum_flag = bool(verify_every) and generation % verify_every == 0
            base_plane = self._sent_exp
            changed_count, payload_bytes = self.backend.encode_exact_payload(
                bits, shift, mask, is_fp16, block_size, exp_plane, self._last_exp, base_plane, self._changed,
                full, buffer, self._header_template, layout.bitmap_bytes, layout.sign_mantissa_offset,
                layout.sign_mantissa_bytes, layout.fixed_bytes, self.config.entropy == "rans", generation,
                zlib.crc32(bits) if checksum_flag else 0, checksum_flag,
            )  # fmt: skip
            self._sent_exp, self._exp_scratch = exp_plane, base_plane
            self.last_changed_blocks = changed_count
            self.generation = generation
            return buffer[:payload_bytes]
        sm_out = buffer[
            layout.sign_mantissa_offset : layout.sign_mantissa_offset + layout.sign_mantissa_bytes
        ]
        if self.config.detector == "hash":
            sm_checksum = self.backend.encode_planes_hash(
                bits, shift, mask, is_fp16, block_size, self._hash_cache, exp_plane, self._changed,
                full, sm_out,
            )  # fmt: skip
        else:
            sm_checksum = self.backend.encode_planes_exact(
                bits, shift, mask, is_fp16, block_size, exp_plane, self._last_exp, self._changed,
                full, sm_out,
            )  # fmt: skip
            # The pass leaves _last_exp equal to the new plane (changed blocks copied, the others equal),
            # so the new plane is the next gather's base and the old base becomes scratch: no copy.
            base_plane = self._sent_exp
            self._sent_exp, self._exp_scratch = exp_plane, base_plane
        changed_blocks = np.flatnonzero(self._changed)
        self.last_changed_blocks = int(changed_blocks.size)
        offsets, changed_values = kernels.changed_block_offsets(changed_blocks, block_size, self.numel)
        flags = FLAG_FULL_EXPONENTS if full else 0
        deltas = not full and base_plane is not None
        exp_region = buffer[layout.fixed_bytes : layout.fixed_bytes + changed_values]
        exp_bytes = 0
        if changed_values:
            if changed_values == self.numel and not deltas:  # a full payload (or early training)
                packed_exp = exp_plane
            else:
                packed_exp = np.empty(changed_values, dtype=np.uint8)
                self.backend.gather_blocks(exp_plane, changed_blocks, offsets, block_size, packed_exp)
            if deltas:
                flags |= FLAG_EXPONENT_DELTAS
                base = np.empty(changed_values, dtype=np.uint8)
                self.backend.gather_blocks(base_plane, changed_blocks, offsets, block_size, base)
                np.subtract(packed_exp, base, out=packed_exp)  # mod 256: uint8 wraps
            # rANS straight into the payload; it must come out smaller than the raw exponents to be used.
            exp_bytes = (
                self.backend.ans_encode_into(packed_exp, exp_region) if self.config.entropy == "rans" else -1
            )
            if exp_bytes < 0 or exp_bytes >= changed_values:
                exp_region[:] = packed_exp
                exp_bytes, flags = changed_values, flags | FLAG_RAW_EXPONENTS
        self.generation += 1
        return self._finish_payload(
            buffer, bits, flags, self._changed, changed_blocks.size, exp_bytes, sm_checksum, self.generation
        )

    def force_full(self) -> None:
        """Make the next payload full (every block's exponents, at the next generation), so it decodes
        against any cache: used when receivers may not hold the last payload (a failed or raw gather)."""
        self._full_next = True

    def encode_resync(
        self, shard, generation: int | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Full-exponent payload (raw exponents, ``layout.max_payload_bytes``) stamped ``generation``
        (default: the last one encoded) — what an out-of-step receiver rebuilds from. It does not touch
        the change-detection state. The all-gather passes the generation of the gather it replaces, which
        under CCP is not the last one encoded (the next gather may already be prepared)."""
        generation = self.generation if generation is None else generation
        if not 1 <= generation <= self.generation:
            raise ValueError(
                f"shard {self.shard_id}: resync for generation {generation}, encoder made 1..{self.generation}"
            )
        bits, buffer = self._bits_and_buffer(shard, out)
        layout = self.layout
        shift, mask = _EXP_LAYOUT[self.dtype]
        self.backend.extract_exponents(
            bits, shift, mask, buffer[layout.fixed_bytes : layout.max_payload_bytes]
        )
        sm_out = buffer[
            layout.sign_mantissa_offset : layout.sign_mantissa_offset + layout.sign_mantissa_bytes
        ]
        self.backend.pack_sign_mantissa(bits, self.dtype == DType.FP16, sm_out)
        all_blocks = np.ones(layout.n_blocks, dtype=np.uint8)
        flags = FLAG_FULL_EXPONENTS | FLAG_RAW_EXPONENTS
        checksum = self.backend.checksum64(sm_out)
        return self._finish_payload(
            buffer, bits, flags, all_blocks, layout.n_blocks, self.numel, checksum, generation
        )

    def _bits_and_buffer(self, shard, out) -> tuple[np.ndarray, np.ndarray]:
        """The shard's 16-bit patterns (checked: dtype, numel) and the buffer the payload goes into."""
        bits = shard_bits(shard, self.dtype, f"shard {self.shard_id}")
        if bits.size != self.numel:
            raise ValueError(f"shard {self.shard_id}: {bits.size} values, encoder was built for {self.numel}")
        _check_out_buffer(out, self.layout, self.shard_id)
        return bits, np.empty(self.layout.max_payload_bytes, dtype=np.uint8) if out is None else out

    def resync_payload_bytes(self) -> int:
        return self.layout.max_payload_bytes

    def _finish_payload(
        self, buffer, bits, flags, changed, changed_count, exp_bytes, sm_checksum, generation
    ) -> np.ndarray:
        """Bitmap, alignment padding (zeroed: deterministic bytes on the wire), CRCs and header around the
        planes already written into ``buffer``; returns the payload view."""
        layout = self.layout
        payload = buffer[: layout.fixed_bytes + exp_bytes]
        bitmap_end = layout.bitmap_offset + layout.bitmap_bytes
        payload[bitmap_end : layout.sign_mantissa_offset] = 0
        payload[layout.sign_mantissa_offset + layout.sign_mantissa_bytes : layout.fixed_bytes] = 0
        if changed.size:
            payload[layout.bitmap_offset : bitmap_end] = np.packbits(changed, bitorder="little")
        shard_crc = 0
        verify_every = self.config.verify_every
        if verify_every and generation % verify_every == 0:
            flags |= FLAG_CHECKSUM
            shard_crc = zlib.crc32(bits)
        meta_crc = _meta_crc(payload, layout, payload[layout.fixed_bytes :])
        header = bytearray(
            struct.pack(
                HEADER_FORMAT,
                MAGIC,
                FORMAT_VERSION,
                int(self.dtype),
                flags,
                self.shard_id,
                self.source_rank,
                generation,
                self.epoch,
                self.numel,
                self.config.block_size,
                changed_count,
                exp_bytes,
                shard_crc,
                meta_crc,
                sm_checksum,
                self.config.fingerprint,
                0,
            )
        )
        struct.pack_into("<I", header, _HEADER_CRC_OFFSET, zlib.crc32(header[:_HEADER_CRC_OFFSET]))
        payload[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
        return payload


def _check_ids(shard_id, source_rank, numel) -> None:
    for name, value, limit in (("shard_id", shard_id, 1 << 32), ("source_rank", source_rank, 1 << 32)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise ValueError(f"{name}={value!r}: expected an integer in [0, 2**32)")
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel < 1 << 40:
        raise ValueError(f"numel={numel!r}: expected an integer in [0, 2**40)")


def _check_out_buffer(out, layout: PayloadLayout, shard_id: int) -> None:
    if out is None:
        return
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.ndim != 1
        or not out.flags.c_contiguous
    ):
        raise ValueError(f"shard {shard_id}: payload buffer must be a contiguous 1-D uint8 array")
    if out.size < layout.max_payload_bytes:
        raise ValueError(
            f"shard {shard_id}: payload buffer holds {out.size} bytes, a payload can take "
            f"{layout.max_payload_bytes}"
        )


class ShardDecoder:
    """Receiver side of one (shard, source rank): the ExpCache, and the sender epoch and generation it
    reflects.

    A delta payload applies only to a cache at (same epoch, generation - 1). A full payload applies to an
    empty cache, to the same epoch at a newer generation, or to a new epoch (a restarted sender: the old
    epoch is retired). An old payload — a generation already applied, or a retired epoch — is rejected
    (StalePayloadError), so a replay can never roll the cache back."""

    _RETIRED_EPOCHS_KEPT = 64

    def __init__(
        self, shard_id: int, source_rank: int, numel: int, dtype, config: CodecConfig | None = None
    ) -> None:
        self.config = config or CodecConfig()
        _check_ids(shard_id, source_rank, numel)
        self.shard_id = shard_id
        self.source_rank = source_rank
        self.numel = numel
        self.dtype = dtype_from_name(dtype)
        self.layout = PayloadLayout.of(numel, self.dtype, self.config.block_size)
        self.backend: CodecBackend = get_backend(self.config.backend)
        self.exp_cache = np.zeros(numel, dtype=np.uint8)
        self.epoch = 0  # epoch of the sender whose payloads the cache reflects; 0 = cache empty
        self.generation = 0  # generation of the last payload applied; 0 = cache empty, -1 = untrusted
        self.retired_epochs: list[int] = []
        self._exact = self.config.detector == "exact"
        self._exp_shift = _EXP_LAYOUT[self.dtype][0]
        # A small shard's payload rebuilt in one compiled call (the CPU backend).
        self._serial = _one_call_capable(self.backend, numel)

    @property
    def cache_bytes(self) -> int:
        return self.exp_cache.nbytes

    def _fail(self, reason: str, error: type[PayloadError] = PayloadError) -> PayloadError:
        return error(self.shard_id, self.source_rank, reason)

    def _check_out(self, out) -> np.ndarray:
        if out is None:
            return np.empty(self.numel, dtype=np.uint16)
        if not isinstance(out, np.ndarray):
            raise ValueError(f"shard {self.shard_id}: out is {type(out).__name__}, expected a numpy array")
        if out.dtype.itemsize != 2 or out.dtype.kind not in "uif" or out.ndim != 1:
            raise ValueError(
                f"shard {self.shard_id}: out has dtype {out.dtype} and shape {out.shape}, "
                f"expected 1-D 16-bit values"
            )
        if out.size != self.numel:
            raise ValueError(f"shard {self.shard_id}: out holds {out.size} values, expected {self.numel}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"shard {self.shard_id}: out must be contiguous and writeable")
        return out.view(np.uint16)

    def check_sequence(self, header: PayloadHeader) -> None:
        """Raise unless ``header``'s (epoch, generation) may be applied to this cache (see the class)."""
        self._check_sequence(header.epoch, header.generation, header.full)

    def _check_sequence(self, epoch: int, generation: int, full: bool) -> None:
        if epoch == 0:
            raise self._fail("payload carries epoch 0: not made by an encoder")
        if epoch in self.retired_epochs:
            raise self._fail(
                f"payload from a retired sender epoch {epoch:#x} (the sender restarted since): "
                "replayed or delayed payload",
                StalePayloadError,
            )
        same_epoch = epoch == self.epoch
        if same_epoch and 0 < generation <= self.generation:
            raise self._fail(
                f"payload generation {generation} is not newer than the cache's {self.generation}: "
                "replayed or delayed payload",
                StalePayloadError,
            )
        if not full and not (same_epoch and self.generation == generation - 1):
            cache_at = f"epoch {self.epoch:#x} generation {self.generation}" if self.epoch else "empty"
            raise self._fail(
                f"cache is at {cache_at}, payload {generation} (epoch {epoch:#x}) is a delta "
                f"on {generation - 1}: receiver out of step, needs full exponents",
                OutOfStepError,
            )

    def _advance_to(self, epoch: int, generation: int) -> None:
        """The cache now reflects the sender's (epoch, generation); a replaced epoch is retired."""
        if epoch != self.epoch and self.epoch:
            self.retired_epochs = [*self.retired_epochs, self.epoch][-self._RETIRED_EPOCHS_KEPT :]
        self.epoch, self.generation = epoch, generation

    def seed(self, values, epoch: int, generation: int) -> None:
        """Fill the cache from the sender's raw 16-bit values (already verified by the caller), as if its
        full payload of (``epoch``, ``generation``) had been applied: the sender sent its values raw
        because the payload would not have been smaller, and its next payload is a delta on this one.
        The same sequence rule as a full payload (a retired epoch or an old generation is refused, and
        the cache is left untouched)."""
        bits = np.asarray(values)
        if bits.dtype.itemsize != 2 or bits.ndim != 1 or bits.size != self.numel:
            raise ValueError(
                f"shard {self.shard_id}: seed of {bits.size} x {bits.dtype}, expected {self.numel} 16-bit values"
            )
        self._check_sequence(epoch, generation, full=True)
        shift, mask = _EXP_LAYOUT[self.dtype]
        self.backend.extract_exponents(
            np.ascontiguousarray(bits.view(np.uint16)), shift, mask, self.exp_cache
        )
        self._advance_to(epoch, generation)

    def decode(
        self,
        payload,
        out: np.ndarray | None = None,
        exp_section: np.ndarray | None = None,
        expected: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Rebuild the shard (uint16 patterns) from ``payload``.

        ``payload`` is the whole payload, or only its fixed part when ``exp_section`` is passed separately.
        ``out``: a contiguous 1-D 16-bit array of exactly numel values (anything else raises ValueError).
        ``expected``: the (epoch, generation) the caller was told to expect (the all-gather's control
        round); a payload that carries others is rejected. Raises PayloadError (corrupt, truncated,
        foreign), StalePayloadError (replayed), OutOfStepError (delta on another cache state) or
        ChecksumMismatchError. A failed decode leaves the cache untouched, except for a corrupted
        sign+mantissa plane: found in the merge pass, after the verified exponents were applied.
        """
        out = self._check_out(out)
        payload = as_payload_bytes(payload, self.shard_id, self.source_rank)
        return self._decode_into(payload, out, exp_section, expected)

    def _decode_into(
        self, payload: np.ndarray, out: np.ndarray, exp_section=None, expected: tuple[int, int] | None = None
    ) -> np.ndarray:
        """``decode`` for a caller that has checked its buffers (the bucket path): ``payload`` contiguous
        1-D uint8, ``out`` contiguous writeable uint16 of ``numel`` values."""
        layout = self.layout
        header = parse_header(payload, self.shard_id, self.source_rank)
        if (
            header.shard_id != self.shard_id
            or header.source_rank != self.source_rank
            or header.dtype != self.dtype
            or header.numel != self.numel
            or header.block_size != self.config.block_size
        ):
            expected_ids = (
                self.shard_id,
                self.source_rank,
                self.dtype.name,
                self.numel,
                self.config.block_size,
            )
            found = (header.shard_id, header.source_rank, header.dtype.name, header.numel, header.block_size)
            raise self._fail(
                "header (shard, rank, dtype, numel, block_size) = ({}), expected ({}): foreign payload".format(
                    ", ".join(map(str, found)), ", ".join(map(str, expected_ids))
                )
            )
        if header.config_fingerprint != self.config.fingerprint:
            raise self._fail(
                f"sender's codec configuration (fingerprint {header.config_fingerprint:#010x}) differs from "
                f"this receiver's ({self.config.fingerprint:#010x}: {self.config})"
            )
        if expected is not None and (header.epoch, header.generation) != tuple(expected):
            raise self._fail(
                f"payload is epoch {header.epoch:#x} generation {header.generation}, the gather announced "
                f"epoch {expected[0]:#x} generation {expected[1]}: swapped or replayed payload"
            )
        if header.changed_blocks > layout.n_blocks or header.exp_bytes > self.numel:
            raise self._fail(
                f"header claims {header.changed_blocks} changed blocks and {header.exp_bytes} exponent bytes; "
                f"a shard of {self.numel} values has {layout.n_blocks} blocks and at most {self.numel} bytes"
            )
        if exp_section is None:
            if payload.size != layout.fixed_bytes + header.exp_bytes:
                raise self._fail(
                    f"payload is {payload.size} bytes, header describes {layout.fixed_bytes + header.exp_bytes}"
                )
            exp_section = payload[layout.fixed_bytes :]
        else:
            exp_section = as_payload_bytes(exp_section, self.shard_id, self.source_rank)
            if payload.size < layout.fixed_bytes or exp_section.size != header.exp_bytes:
                raise self._fail(
                    f"parts are {payload.size}+{exp_section.size} bytes, expected "
                    f"{layout.fixed_bytes}+{header.exp_bytes}"
                )
        self.check_sequence(header)
        deltas = bool(header.flags & FLAG_EXPONENT_DELTAS)
        shift = self._exp_shift
        is_fp16 = self.dtype == DType.FP16
        checksum = None
        if self._serial and kernels._parallel_detect is not True:
            # The steps below, CRC included, in one compiled call (ciera_runtime/payload_passes.py).
            status, detail, checksum = self.backend.rebuild_payload(
                payload, exp_section, header.meta_crc32, layout.bitmap_bytes, layout.sign_mantissa_offset,
                layout.sign_mantissa_bytes, layout.n_blocks, header.changed_blocks, header.full, deltas,
                self._exact, bool(header.flags & FLAG_RAW_EXPONENTS), self.config.block_size,
                self.exp_cache, shift, is_fp16, out,
            )  # fmt: skip
            if status:
                bitmap = payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes]
                raise self._fail(self._rebuild_problem(int(status), int(detail), header, bitmap, exp_section))
            sign_mantissa = None
        else:
            if _meta_crc(payload, layout, exp_section) != header.meta_crc32:
                raise self._fail(self._rebuild_problem(payload_passes.META_CRC, 0, header))
            sign_mantissa = payload[
                layout.sign_mantissa_offset : layout.sign_mantissa_offset + layout.sign_mantissa_bytes
            ]
            bitmap = payload[layout.bitmap_offset : layout.bitmap_offset + layout.bitmap_bytes]
            changed = np.unpackbits(bitmap, count=layout.n_blocks, bitorder="little")
            changed_blocks = np.flatnonzero(changed)
            if changed_blocks.size != header.changed_blocks:
                raise self._fail(
                    self._rebuild_problem(payload_passes.BITMAP_COUNT, changed_blocks.size, header)
                )
            if header.full and changed_blocks.size != layout.n_blocks:
                raise self._fail(self._rebuild_problem(payload_passes.NOT_FULL, 0, header))
            if deltas != (not header.full and self._exact and bool(changed_blocks.size)):
                raise self._fail(self._rebuild_problem(payload_passes.DELTAS_FLAG, 0, header))
            offsets, changed_values = kernels.changed_block_offsets(
                changed_blocks, self.config.block_size, self.numel
            )
            packed_exp = np.empty(changed_values, dtype=np.uint8)
            if header.flags & FLAG_RAW_EXPONENTS:
                if exp_section.size != changed_values:
                    raise self._fail(
                        self._rebuild_problem(
                            payload_passes.RAW_SECTION_SIZE, changed_values, header, bitmap, exp_section
                        )
                    )
                packed_exp[:] = exp_section
            elif changed_values:
                try:
                    self.backend.ans_decode(exp_section, packed_exp)
                except RansFormatError as error:
                    raise self._fail(f"exponent stream invalid: {error}") from None
            elif exp_section.size:
                raise self._fail(
                    self._rebuild_problem(
                        payload_passes.STRAY_EXPONENTS, exp_section.size, header, bitmap, exp_section
                    )
                )
            if deltas:  # exponent = cached exponent + delta, mod 256
                base = np.empty(changed_values, dtype=np.uint8)
                self.backend.gather_blocks(
                    self.exp_cache, changed_blocks, offsets, self.config.block_size, base
                )
                np.add(packed_exp, base, out=packed_exp)
            # Only now, with header, bitmap and exponents verified, touch the cache.
            if changed_values:
                self.backend.scatter_blocks(
                    packed_exp, changed_blocks, offsets, self.config.block_size, self.exp_cache
                )
        self._advance_to(header.epoch, header.generation)
        # The sign+mantissa plane is checksummed in the same pass that merges it; on a mismatch the
        # rebuilt values are discarded (raise), while the cache, built from verified exponents, stays
        # correct at this generation.
        if checksum is None:
            checksum = self.backend.merge_planes_checked(self.exp_cache, sign_mantissa, shift, is_fp16, out)
        if int(checksum) != header.sign_mantissa_checksum64:
            raise self._fail(SM_CHECKSUM_MISMATCH)
        if header.flags & FLAG_CHECKSUM and zlib.crc32(out) != header.shard_crc32:
            self.generation = -1  # cache no longer trusted: the next delta fails as out of step
            raise self._fail("rebuilt shard does not match the sender's checksum", ChecksumMismatchError)
        return out

    def _rebuild_problem(
        self, status: int, detail: int, header: PayloadHeader, bitmap=None, exp_section=None
    ) -> str:
        """What is wrong with a payload's bitmap or exponent section (a ``payload_passes`` status)."""
        if status == payload_passes.META_CRC:
            return "bitmap/exponent CRC mismatch: payload corrupted in transit"
        if status == payload_passes.BITMAP_COUNT:
            return f"bitmap has {detail} blocks set, header says {header.changed_blocks}"
        if status == payload_passes.NOT_FULL:
            return "full-exponent payload does not flag every block"
        if status == payload_passes.DELTAS_FLAG:
            deltas = bool(header.flags & FLAG_EXPONENT_DELTAS)
            return (
                f"exponent deltas flag is {'set' if deltas else 'clear'} on a "
                f"{'full' if header.full else 'delta'} payload of the {self.config.detector} detector"
            )
        if status == payload_passes.RAW_SECTION_SIZE:
            return f"raw exponent section is {exp_section.size} bytes, expected {detail}"
        if status == payload_passes.STRAY_EXPONENTS:
            return f"no changed blocks but {exp_section.size} exponent bytes"
        # The exponent stream: the error rans.decode raises, for the values the bitmap flags.
        changed_blocks = np.flatnonzero(np.unpackbits(bitmap, count=self.layout.n_blocks, bitorder="little"))
        _, values = kernels.changed_block_offsets(changed_blocks, self.config.block_size, self.numel)
        error = rans.stream_error(status - payload_passes.RANS_STATUS, detail, exp_section, values)
        return f"exponent stream invalid: {error}"
