"""The agreement protocol of one compressed all-gather: control rows, the plan every rank derives from
them, and status rows. Pure numpy (no torch), so it is testable without a process group.

Every gather runs these rounds (see docs/runtime.md, "The all-gather"):

1. **control** — an all-gather of one fixed-size row per rank (its size depends only on the world size,
   so it can never mismatch): what the rank is gathering (shard id, mode, dtype, numel, codec settings,
   cache budget), whether its caller-supplied tensors passed validation, the sender's epoch, generation
   and exponent bytes, and the (epoch, generation) of this rank's cache for every source. Each row
   carries its own CRC-32.
2. every rank computes the **plan** from the same rows (:func:`make_plan`): identical input, identical
   plan — the same error on every rank, or the same bulk-round size and the same resync decisions. No
   field of a payload ever sizes a collective.
3. **bulk** — one all-gather of payload rows of the planned size (compressed), or the raw all-gather.
4. **status** — compressed gathers only: one fixed-size row per rank saying whether it rebuilt every
   source; if any rank failed, every rank raises the same :class:`GatherError`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ciera_runtime.errors import ConfigMismatchError, GatherError

PROTOCOL_VERSION = 2  # 2: the control row carries the codec entropy stage
_PROTOCOL_MAGIC = (0x43494552 << 16) | PROTOCOL_VERSION  # "CIER" + version
REASON_BYTES = 160  # UTF-8 text of a rank's local failure, travels to every rank

MODE_INVALID, MODE_RAW, MODE_COMPRESSED = 0, 1, 2
_MODE_NAMES = {MODE_INVALID: "invalid", MODE_RAW: "raw", MODE_COMPRESSED: "compressed"}

# Fixed int64 fields of a control row, in order.
CONTROL_FIELDS = (
    "magic",
    "shard_id",
    "mode",
    "dtype",
    "numel",
    "block_size",
    "detector",
    "verify_every",
    "entropy",
    "cache_budget_bytes",
    "world_size",
    "failed",
    "epoch",
    "generation",
    "full",
    "exp_bytes",
    "fixed_bytes",
)
# Fields every rank must agree on, with the words an error uses for them.
_AGREED_FIELDS = (
    ("shard_id", "shard id (ranks are gathering different shards in the same call)"),
    ("world_size", "world size"),
    ("block_size", "codec block_size"),
    ("detector", "codec detector"),
    ("verify_every", "codec verify_every"),
    ("entropy", "codec entropy stage"),
    ("cache_budget_bytes", "cache budget"),
    ("dtype", "dtype"),
    ("numel", "numel"),
    ("mode", "mode (compressed on some ranks, raw on others: registered differently, or over budget)"),
)


def control_row_bytes(world_size: int) -> int:
    """Size of one control row: the fixed fields, (epoch, generation) per source, the reason, a CRC."""
    return 8 * len(CONTROL_FIELDS) + 16 * world_size + REASON_BYTES + 8


def status_row_bytes() -> int:
    return 8 + REASON_BYTES + 8


def _encode_reason(reason: str) -> bytes:
    data = reason.encode("utf-8", "replace")[:REASON_BYTES]
    return data.decode("utf-8", "ignore").encode().ljust(REASON_BYTES, b"\0")


def _decode_reason(data: bytes) -> str:
    return data.rstrip(b"\0").decode("utf-8", "replace")


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<II", zlib.crc32(body), 0)


def _checked_body(row: np.ndarray) -> bytes | None:
    data = row.tobytes()
    body, (crc, _) = data[:-8], struct.unpack("<II", data[-8:])
    return body if zlib.crc32(body) == crc else None


@dataclass
class ControlRow:
    """One rank's control row. ``cache_epochs[s]``/``cache_generations[s]``: this rank's cache for source
    ``s`` (0, 0 when empty or when the shard is raw)."""

    shard_id: int = -1
    mode: int = MODE_INVALID
    dtype: int = 0
    numel: int = 0
    block_size: int = 0
    detector: int = 0
    verify_every: int = 0
    entropy: int = 0  # CodecConfig.entropy_code
    cache_budget_bytes: int = -1
    world_size: int = 0
    failed: int = 0
    epoch: int = 0
    generation: int = 0
    full: int = 0
    exp_bytes: int = 0
    fixed_bytes: int = 0
    cache_epochs: tuple[int, ...] = ()
    cache_generations: tuple[int, ...] = ()
    reason: str = ""

    def pack(self, world_size: int) -> np.ndarray:
        fields = [_PROTOCOL_MAGIC] + [int(getattr(self, name)) for name in CONTROL_FIELDS[1:]]
        epochs = list(self.cache_epochs) or [0] * world_size
        generations = list(self.cache_generations) or [0] * world_size
        body = (
            struct.pack(f"<{len(fields)}q", *fields)
            + struct.pack(f"<{world_size}q", *epochs)
            + struct.pack(f"<{world_size}q", *generations)
            + _encode_reason(self.reason)
        )
        return np.frombuffer(_with_crc(body), dtype=np.uint8)

    @staticmethod
    def unpack(row: np.ndarray, world_size: int) -> ControlRow | None:
        """The row, or None when its CRC or magic is wrong (corrupted, or another protocol version)."""
        body = _checked_body(row)
        if body is None:
            return None
        n = len(CONTROL_FIELDS)
        fields = struct.unpack_from(f"<{n}q", body)
        if fields[0] != _PROTOCOL_MAGIC:
            return None
        epochs = struct.unpack_from(f"<{world_size}q", body, 8 * n)
        generations = struct.unpack_from(f"<{world_size}q", body, 8 * n + 8 * world_size)
        reason = _decode_reason(body[8 * n + 16 * world_size :])
        values = dict(zip(CONTROL_FIELDS[1:], fields[1:], strict=True))
        return ControlRow(**values, cache_epochs=epochs, cache_generations=generations, reason=reason)


def pack_status(failed: bool, reason: str) -> np.ndarray:
    body = struct.pack("<q", int(failed)) + _encode_reason(reason)
    return np.frombuffer(_with_crc(body), dtype=np.uint8)


def status_failures(rows: np.ndarray) -> dict[int, str]:
    """rank -> reason for every rank whose status row reports a failure (or is unreadable)."""
    failures = {}
    for rank, row in enumerate(rows):
        body = _checked_body(row)
        if body is None:
            failures[rank] = "status row unreadable (corrupted)"
            continue
        (failed,) = struct.unpack_from("<q", body)
        if failed:
            failures[rank] = _decode_reason(body[8:])
    return failures


@dataclass(frozen=True)
class GatherPlan:
    """What every rank does in the bulk round; identical on every rank."""

    mode: int
    numel: int
    fixed_bytes: int
    row_bytes: int  # bulk-round row size (compressed); 0 when nothing but the raw gather runs
    resync: tuple[bool, ...]  # per source: sends a full raw-exponent payload instead of its delta
    variable_bytes: tuple[int, ...]  # per source: bytes after the fixed part in its bulk row
    expected: tuple[tuple[int, int], ...]  # per source: (epoch, generation) its payload must carry


def _describe(value: int, field: str) -> str:
    if field == "mode":
        return _MODE_NAMES.get(value, str(value))
    if field == "cache_budget_bytes" and value < 0:
        return "none"
    if field == "detector":
        return {1: "hash", 2: "exact"}.get(value, str(value))
    if field == "entropy":
        return {1: "rans", 2: "none"}.get(value, str(value))
    if field == "dtype":
        return {1: "bf16", 2: "fp16"}.get(value, str(value))
    return str(value)


def make_plan(rows: list[ControlRow | None], world_size: int) -> GatherPlan:
    """The plan for one gather from every rank's control row; raises the same GatherError on every rank
    when the rows show a failure, a disagreement, or values out of bounds."""
    shard_ids = {row.shard_id for row in rows if row is not None}
    shard_id = shard_ids.pop() if len(shard_ids) == 1 else None
    unreadable = {
        rank: "control row unreadable (corrupted, or another CIERA protocol version)"
        for rank, row in enumerate(rows)
        if row is None
    }
    if unreadable:
        raise GatherError(shard_id, unreadable, "gather aborted")
    failed = {rank: row.reason or "failed locally" for rank, row in enumerate(rows) if row.failed}
    if failed:
        raise GatherError(shard_id, failed, "gather aborted on every rank")
    for field, words in _AGREED_FIELDS:
        values = [getattr(row, field) for row in rows]
        if len(set(values)) > 1:
            per_rank = {rank: f"{field}={_describe(value, field)}" for rank, value in enumerate(values)}
            raise ConfigMismatchError(shard_id, per_rank, f"ranks disagree on the {words}")
    first = rows[0]
    if first.world_size != world_size:
        raise ConfigMismatchError(
            shard_id, {0: f"world_size={first.world_size}"}, f"this group has {world_size} ranks"
        )
    numel = first.numel
    if first.mode == MODE_RAW:
        return GatherPlan(MODE_RAW, numel, 0, 0, (False,) * world_size, (0,) * world_size, ())
    if first.mode != MODE_COMPRESSED:
        raise GatherError(shard_id, {0: f"mode {first.mode}"}, "unknown gather mode")
    fixed = {row.fixed_bytes for row in rows}
    bad = {}
    for rank, row in enumerate(rows):
        # Bounds on everything that sizes memory or a collective: a variable part never exceeds what
        # every exponent raw costs (numel bytes), so no corrupted value can blow up an allocation.
        if not 0 <= row.exp_bytes <= numel:
            bad[rank] = f"exp_bytes={row.exp_bytes} outside [0, numel={numel}]"
        elif row.epoch <= 0 or row.generation < 1:
            bad[rank] = f"epoch={row.epoch:#x} generation={row.generation}: not an encoder's payload"
        elif len(row.cache_epochs) != world_size:
            bad[rank] = "cache table of the wrong size"
    if len(fixed) != 1:
        bad.update({rank: f"fixed_bytes={row.fixed_bytes}" for rank, row in enumerate(rows)})
    if bad:
        raise GatherError(shard_id, bad, "control values out of bounds")
    resync, variable, expected = [], [], []
    for source, row in enumerate(rows):
        in_step = all(
            (rows[receiver].cache_epochs[source], rows[receiver].cache_generations[source])
            == (row.epoch, row.generation - 1)
            for receiver in range(world_size)
            if receiver != source
        )
        needs_resync = not row.full and not in_step
        resync.append(needs_resync)
        variable.append(numel if needs_resync else row.exp_bytes)
        expected.append((row.epoch, row.generation))
    fixed_bytes = fixed.pop()
    return GatherPlan(
        MODE_COMPRESSED,
        numel,
        fixed_bytes,
        fixed_bytes + max(variable),
        tuple(resync),
        tuple(variable),
        tuple(expected),
    )
