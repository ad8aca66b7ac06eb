"""One compressed collective per engine all-gather: a *bucket* of shards, one round in steady state.

An engine (DeepSpeed's coalesced fetch, FSDP2's parameter group) gathers several shards at once. Here
the whole bucket travels in one all-gather of one row per rank::

    row = header | entry table (per shard: message kind and length; CRC-32 of a raw message) | area (C bytes)

Every shard's *message* — its codec payload, or its raw 16-bit values when the payload would not be
smaller (a *seed*: the values after the sender's epoch and generation, from which every receiver fills
its exponent cache as if the payload had arrived, so the sender's next payload is a delta again) — is
packed, 8-aligned, into the area; whatever does not fit goes into an **overflow round**
(one more all-gather, sized from the headers every rank received). The area size C is **replicated
state**: every rank computes it from the same received headers (the same-phase gathers of this bucket's
cycle, plus a margin: ``Bucket.capacity_for``), so no round is spent agreeing on sizes.

A bucket's first gather is preceded by a fixed-size **registration round** that checks every rank
gathers the same shards the same way (ids, sizes, dtypes, codec settings, budget, compressed or raw);
only then does any size depend on state.

Failures (docs/runtime.md, "When a failure surfaces"):

- a rank's own bad input or encode error travels in its header: every rank raises the same
  :class:`GatherError` **in this gather**, and the group stays in step;
- a rank that cannot rebuild a received message raises in this gather and posts the error in the
  group's store; the others, whose weights are exact, raise the same error at their next CIERA call
  (they find it in the store while they wait for that rank's row, which never comes). No caller receives
  a wrong weight. The CIERA groups are then out of step: every rank's next call drains them (pairs the
  rounds the failure left unpaired), re-creates them (a rendezvous), re-registers its buckets and sends
  full exponents;
- after any error every encoder of the engine sends full exponents next, so caches are rebuilt.

Every decision that sizes a collective is made from the received rows only (the rank's own row
included), so every rank takes it alike. Sizes never depend on a field a single rank could read
differently: the transport delivers the bytes that were sent (gloo over TCP, NCCL), and what CRCs guard
against is a sender's corrupted row, which every rank sees the same way.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import struct
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch

from ciera_runtime import bucket_codec, payload_passes, protocol
from ciera_runtime.codec import FLAG_FULL_EXPONENTS, HEADER_FLAGS_OFFSET, dtype_from_name, shard_bits
from ciera_runtime.errors import CieraError, ConfigMismatchError, GatherError, GatherTimeoutError

if TYPE_CHECKING:
    from ciera_runtime.allgather import CompressedAllGather

logger = logging.getLogger("ciera_runtime")

BUCKET_MAGIC = 0x4349455242 << 8 | 2  # "CIERB" + version (2: seeds)
# A message is a codec payload, raw values (a shard registered raw, or one whose payloads can never be
# smaller than raw), or a seed: raw values after SEED_PREFIX (sender epoch, generation, flags).
KIND_PAYLOAD, KIND_RAW, KIND_SEED = (
    payload_passes.KIND_PAYLOAD,
    payload_passes.KIND_RAW,
    payload_passes.KIND_SEED,
)
SEED_PREFIX = struct.Struct("<QQQ")
assert SEED_PREFIX.size == payload_passes.SEED_PREFIX_BYTES
SEED_FULL = 1  # flags: the seed replaces a full-exponent payload (a bucket's first gather, after an error)
SEED_FLAGS_OFFSET = 16  # the flags word of SEED_PREFIX (after epoch and generation)
_HEADER_FIELDS = ("magic", "fingerprint", "call", "failed", "overflow_bytes", "message_bytes")
_HEADER_FIXED_BYTES = 8 * len(_HEADER_FIELDS) + protocol.REASON_BYTES
_REGISTRATION_FIELDS = ("magic", "fingerprint", "shards", "first_shard", "failed")
REGISTRATION_ROW_BYTES = 8 * len(_REGISTRATION_FIELDS) + protocol.REASON_BYTES + 8
# Without a cycle to predict from, the area is sized from the largest message total of this many recent
# gathers of the bucket (an iteration's worth: ZeRO-3 gathers a layer up to three times). The margin applies
# to what lies above the bucket's floor (every payload's fixed part — header, bitmap, sign+mantissa plane —
# whose size is known exactly), i.e. to the exponent sections, the only part that varies; plus a few bytes.
CAPACITY_WINDOW = 8
CAPACITY_MARGIN = 0.25
CAPACITY_SLACK_BYTES = 64
# Non-full gathers a bucket needs finished before full-exponent gathers stop counting in its prediction: a
# whole cycle of up to three phases (ZeRO-3: forward, recompute, backward), so that the first phase's
# non-full gather is among them; until then the full gather bounds the first cycle's sizes from above.
STEADY_HISTORY = 3
# What one overflow round is worth in padding bytes when the area size is predicted: about one small
# round's latency at 200 Mbit (1.3 ms); small buckets are padded rather than overflow, large ones are not.
OVERFLOW_PENALTY_BYTES = 32 << 10
# The area of call m is sized from the gathers of its bucket among calls 1..m-CALL_LAG, which every rank
# has finished by then (starting call m finishes them first, in order): ranks may interleave starts and
# waits differently (DeepSpeed's prefetch, FSDP2's async unshard), and no size may depend on that.
CALL_LAG = 4
# First gathers of a bucket (no history yet): the fixed part plus ~3.6 bits per value of exponents (a
# full payload: every exponent rANS-coded at 2.5-3 bits, as the method measures); a larger one overflows once.
_INITIAL_PAYLOAD_RATIO = 0.45
# Pipelined buckets: an engine call of at least twice part_bytes (raw bytes per rank) travels as up to
# MAX_PARTS buckets of about part_bytes, encoded and issued in turn, decoded in turn (the link carries one
# while the next is encoded). The engines cut their calls (zero3, fsdp2); the rule is shared. 2 MiB: at
# 200 Mbit it keeps ZeRO-3's gain (1.250x against 1.255x with 1 MiB) and most of FSDP2's (1.258x against
# 1.310x, both above their bytes bound) with 8 and 13 collectives per step against 12 and 25 (the plain
# engines: 6 and 11); docs/training-steps.md.
DEFAULT_PART_BYTES = 2 << 20
MAX_PARTS = 8
# Pipelining adds collectives: a step's extra calls stay within max(EXTRA_CALLS_PER_STEP, EXTRA_CALLS_SHARE ×
# the step's engine calls) (PartBudget). Without it a zoo model with many calls over 4 MiB made 15-27
# collectives per step against FSDP2's 11.
EXTRA_CALLS_SHARE = 0.1
EXTRA_CALLS_PER_STEP = 4


def extra_calls_budget(step_calls: int) -> int:
    """Extra collectives pipelining may add to a step of ``step_calls`` engine calls."""
    return max(EXTRA_CALLS_PER_STEP, int(EXTRA_CALLS_SHARE * step_calls))


def parts_wanted(raw_bytes_per_rank: int, part_bytes: int) -> int:
    """Parts an engine call of ``raw_bytes_per_rank`` would travel as without a budget: one below twice
    ``part_bytes`` (and with 0: never cut), else one per ``part_bytes``, at most MAX_PARTS."""
    if part_bytes <= 0 or raw_bytes_per_rank < 2 * part_bytes:
        return 1
    return min(MAX_PARTS, raw_bytes_per_rank // part_bytes)


class PartBudget:
    """How many parts each engine call travels as, the same on every rank. Each step's calls are recorded
    (key, raw bytes per rank, how often); at a step's start, when the step before made other calls than
    the plan was made from (the first step; DeepSpeed's first step, which records its trace and gathers
    module by module, then its prefetching steps), the extra calls are handed out again from that step:
    largest call first (ties: first seen first), each up to ``parts_wanted``, within the step's budget,
    max(EXTRA_CALLS_PER_STEP, EXTRA_CALLS_SHARE × its calls). It reads only what every rank sees alike —
    the engine's calls, their sizes and their order — so every rank cuts alike. A call the plan's step
    did not make travels whole."""

    def __init__(self, part_bytes: int) -> None:
        self.part_bytes = part_bytes
        self._step: dict[object, list[int]] = {}  # this step: key -> [raw bytes per rank, calls]
        self._planned_from: dict[object, list[int]] | None = None  # the step the plan was made from
        self._plan: dict[object, int] = {}  # key -> parts
        self.plans = 0  # plans made so far (a stable schedule: 1, or 2 under DeepSpeed)
        self.planned_step_calls = 0
        self.extra_calls_per_step = 0

    def parts(self, key: object, raw_bytes_per_rank: int) -> int:
        entry = self._step.setdefault(key, [raw_bytes_per_rank, 0])
        entry[1] += 1
        return self._plan.get(key, 1)

    def describe(self) -> dict:
        """The plan as counted: calls of the step it was made from, extra calls per step (None before a
        plan), the budget they kept within, and how many plans were made."""
        return {
            "planned_step_calls": self.planned_step_calls,
            "extra_calls_per_step": self.extra_calls_per_step if self.plans else None,
            "budget_per_step": extra_calls_budget(self.planned_step_calls),
            "plans": self.plans,
        }

    def start_step(self) -> None:
        """A training step starts (the model's top-level forward): re-plan if the last step's calls differ
        from those the plan was made from."""
        finished, self._step = self._step, {}
        if not finished or finished == self._planned_from:
            return
        self.planned_step_calls = sum(count for _, count in finished.values())
        budget = extra_calls_budget(self.planned_step_calls)
        order = {key: index for index, key in enumerate(finished)}
        plan: dict[object, int] = {}
        extra_calls = 0
        for key, (raw, count) in sorted(finished.items(), key=lambda item: (-item[1][0], order[item[0]])):
            extra = min(parts_wanted(raw, self.part_bytes) - 1, (budget - extra_calls) // count)
            if extra > 0:
                plan[key] = 1 + extra
                extra_calls += extra * count
        self._plan, self._planned_from = plan, finished
        self.extra_calls_per_step = extra_calls
        self.plans += 1


def check_part_bytes(part_bytes) -> int:
    """``part_bytes`` as given, or a one-line ValueError."""
    if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 0:
        raise ValueError(
            f"part_bytes={part_bytes!r}: expected an integer >= 0 (bytes per rank; 0: one bucket)"
        )
    return part_bytes


# A rank that could not rebuild a gather: the same summary on that rank and, later, on the others.
NOTICE_SUMMARY = "a rank could not rebuild its gathered weights, no rank returns them"
# A rank that gave up on a round (timeout, a failed collective) says so too: without the notice the others
# learn of it only by their own timeout, one timeout later, and their recovery misses its rendezvous.
GAVE_UP_SUMMARY = "a rank gave up on a CIERA round, no rank returns this gather"
# Waits are cut into slices; between two, the group's store is checked for another rank's failure.
WAIT_SLICE_S = 0.1
DRAIN_TIMEOUTS = 2


def _align8(n: int) -> int:
    return (n + 7) & ~7


def header_bytes(n_shards: int) -> int:
    return _HEADER_FIXED_BYTES + 16 * n_shards + 8


@dataclass
class _Header:
    fingerprint: int
    call: int
    failed: int
    overflow_bytes: int
    message_bytes: int
    reason: str
    entries: tuple[int, ...]  # kind | length << 2, per shard
    # CRC-32 per shard of a raw message (a payload carries its own CRCs: 0): raw values are checked too.
    crcs: tuple[int, ...]


_HEADER_STRUCT = struct.Struct(f"<{len(_HEADER_FIELDS)}q")
_HEADER_CRC = struct.Struct("<II")
_NO_REASON_BYTES = protocol._encode_reason("")
_NO_REASON = np.frombuffer(_NO_REASON_BYTES, dtype=np.uint8)
_ENTRY_TABLES: dict[int, struct.Struct] = {}  # shards per bucket → the entry table's layout


def _entry_table(n_shards: int) -> struct.Struct:
    table = _ENTRY_TABLES.get(n_shards)
    if table is None:
        table = _ENTRY_TABLES[n_shards] = struct.Struct(f"<{2 * n_shards}q")
    return table


def _pack_header(values: dict, reason: str, entries: list[int], crcs: list[int], out: np.ndarray) -> None:
    """Write the header (fields, reason, entry table, CRC-32 of all that) at the start of ``out``; every
    call of every bucket writes one, so it is packed in place."""
    table = _entry_table(len(entries))
    _HEADER_STRUCT.pack_into(out, 0, BUCKET_MAGIC, *(int(values[name]) for name in _HEADER_FIELDS[1:]))
    out[_HEADER_STRUCT.size : _HEADER_FIXED_BYTES] = (
        np.frombuffer(protocol._encode_reason(reason), dtype=np.uint8) if reason else _NO_REASON
    )
    table.pack_into(out, _HEADER_FIXED_BYTES, *entries, *crcs)
    end = _HEADER_FIXED_BYTES + table.size
    _HEADER_CRC.pack_into(out, end, zlib.crc32(out[:end]), 0)


def _unpack_header(row: np.ndarray, n_shards: int) -> _Header | None:
    """The header of one received row, or None when its CRC or magic is wrong."""
    end = _HEADER_FIXED_BYTES + 16 * n_shards  # header_bytes(n_shards) less its CRC word
    data = row[: end + _HEADER_CRC.size].tobytes()
    if zlib.crc32(memoryview(data)[:end]) != _HEADER_CRC.unpack_from(data, end)[0]:
        return None
    fields = _HEADER_STRUCT.unpack_from(data)
    if fields[0] != BUCKET_MAGIC:
        return None
    reason = data[_HEADER_STRUCT.size : _HEADER_FIXED_BYTES]
    table = _entry_table(n_shards).unpack_from(data, _HEADER_FIXED_BYTES)
    return _Header(
        *fields[1:],
        reason="" if reason == _NO_REASON_BYTES else protocol._decode_reason(reason),
        entries=table[:n_shards],
        crcs=table[n_shards:],
    )


@dataclass
class Bucket:
    """Replicated state of one bucket (the same on every rank): its shards and its message area size."""

    shard_ids: tuple[int, ...]
    numels: tuple[int, ...]
    fingerprint: int
    initial_capacity_bytes: int
    max_capacity_bytes: int
    # The smallest message total this bucket can have (compressed shards: their payloads' fixed parts;
    # raw shards: their values), 8-aligned per shard: the capacity margin applies above it.
    floor_bytes: int = 0
    # (call number, gather index, largest message total every rank saw, whether a message was a full
    # payload) of this bucket's finished gathers.
    totals: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    started: int = 0  # gathers of this bucket started (the next one's index)
    _period: int | None = None  # the cycle length capacity_for predicts with
    _period_chosen_at: int = -1
    _in_call_order: bool = True  # every record() so far came with a call number >= the one before
    # ... and a gather index above the one before: then _recent_history reads the history in place, with
    # the count of non-full entries in it and each entry by gather index kept as records arrive.
    _rising: bool = True
    _steady_entries: int = 0
    _entry_of: dict = field(default_factory=dict)
    # Its shards encoded and rebuilt in one compiled call each way (bucket_codec), or None: one by one.
    batch_encoder: bucket_codec.BucketEncoder | None = None
    batch_decoder: bucket_codec.BucketDecoder | None = None

    def capacity_for(self, call: int, index: int) -> int:
        """The message area of this bucket's gather number ``index``, at engine call ``call``: predicted
        from its gathers among calls 1..call-CALL_LAG only (finished on every rank by then), so every rank
        computes the same size.

        Engines gather a bucket in a cycle — FSDP2 forward then backward, ZeRO-3 forward, recompute,
        backward — and only the first gather after an optimizer step carries changed exponents. The
        prediction for gather ``index`` is the largest of the same-phase gathers one and two cycles back,
        for the cycle length P that would have fitted the recent gathers best, counting each overflow
        as OVERFLOW_PENALTY_BYTES of padding (P = 0: the largest of the last 8, whatever the phase).

        Sizes are planned from totals by a non-decreasing rule, so the plan of the largest total is the
        largest plan. Between two choices of P (every 4 gathers) the steady state reads only the few
        entries it needs (:meth:`_recent_history`); choosing P reads the whole history."""
        recent = self._recent_history(call) if self._period is not None else None
        steady = False  # P stays: the few entries the size needs are read in place
        if recent is not None:
            lookup, newest, last_window = recent
            if newest is None:
                return self.initial_capacity_bytes
            steady = newest // 4 == self._period_chosen_at and index > newest
        if not steady:
            known, gathers, position = self._finished_history(call)
            if not known:
                return self.initial_capacity_bytes
            # The cycle length is re-chosen when the newest known gather index passes a multiple of 4 (the
            # same count on every rank), not at every call: choosing it scores 7 candidates over 12 gathers.
            if self._period is None or gathers[-1] // 4 != self._period_chosen_at:
                self._period = self._best_period(known, gathers)
                self._period_chosen_at = gathers[-1] // 4
            end = position.get(index, len(gathers))

            def lookup(gather: int) -> int:
                return known.get(gather, -1)

            def last_window() -> list[int]:
                return [known[gather] for gather in gathers[max(0, end - CAPACITY_WINDOW) : end]]

        period = self._period
        if period:
            largest = max(lookup(index - period), lookup(index - 2 * period))
            if largest >= 0 and (size := self._planned(largest)):
                return size
        # Period 0, or no same-phase history: the last CAPACITY_WINDOW known gathers before index.
        return self._window_size(last_window())

    def _best_period(self, known: dict[int, int], gathers: list[int]) -> int:
        """The cycle length (0-6) whose predictions would have fitted the last 12 known gathers best: the
        least padding, each overflow counted as OVERFLOW_PENALTY_BYTES. Every candidate is scored on the
        same gathers: where a period has no history yet it is scored by the fallback it would use (period
        0's prediction, made once), so a longer period cannot win by predicting fewer."""
        count = len(gathers)
        # Indices are distinct integers, so every gather a candidate looks back to (at most 12 indices
        # before the first scored one) and every fallback window (CAPACITY_WINDOW before it) is among the
        # last 24 known: each of those planned once.
        tail = gathers[-24:]
        planned_of: dict[int, int] = {}  # totals repeat from cycle to cycle: each planned once
        for gather in tail:
            total = known[gather]
            if total not in planned_of:
                planned_of[total] = self._planned(total)
        tail_sizes = [planned_of[known[gather]] for gather in tail]
        size_of = dict(zip(tail, tail_sizes, strict=True))
        scored = gathers[-12:]
        offset = count - len(tail)  # position in gathers of tail[0]
        fallback = []
        for at in range(count - len(scored), count):
            start = max(0, at - CAPACITY_WINDOW)
            fallback.append(max(tail_sizes[start - offset : at - offset]) if at > start else None)
        actual = [known[gather] for gather in scored]
        best, best_score = 0, float("inf")
        for period in range(7):
            overflows, used = 0, 0
            for gather, other, total in zip(scored, fallback, actual, strict=True):
                size = other
                if period:
                    one, two = size_of.get(gather - period), size_of.get(gather - 2 * period)
                    same_phase = one if two is None else two if one is None else max(one, two)
                    size = same_phase or other
                if size is not None:
                    overflows += total > size
                    used += size
            score = used + overflows * OVERFLOW_PENALTY_BYTES if used else float("inf")
            if score < best_score:
                best, best_score = period, score
        return best

    def _planned(self, largest: int) -> int:
        """The area planned for a largest message total: the margin above the floor, 8-aligned, capped."""
        floor_bytes = self.floor_bytes
        above_floor = largest - floor_bytes if largest > floor_bytes else 0
        return min(
            self.max_capacity_bytes,
            _align8(floor_bytes + int(above_floor * (1 + CAPACITY_MARGIN)) + CAPACITY_SLACK_BYTES),
        )

    def _window_size(self, window: list[int]) -> int:
        return (self._planned(max(window)) if window else 0) or self.initial_capacity_bytes

    def _recent_history(self, call: int):
        """What the steady state reads of the history, without building it: (the total of a known gather
        index, or -1; the newest known index, or None; a function giving the totals of the last
        CAPACITY_WINDOW known gathers) — the same entries :meth:`_finished_history` keeps. Only while
        records came in call order with rising gather indices (None otherwise: the caller builds it)."""
        if not self._rising:
            return None
        totals, limit = self.totals, call - CALL_LAG
        end = len(totals)
        steady = self._steady_entries
        while end and totals[end - 1][0] > limit:  # at most CALL_LAG unfinished entries at the end
            end -= 1
            steady -= not totals[end][3]
        skip_full = steady >= STEADY_HISTORY
        by_gather = self._entry_of

        def lookup(gather: int) -> int:
            entry = by_gather.get(gather)
            if entry is None or entry[0] > limit or (skip_full and entry[3]):
                return -1
            return entry[2]

        newest = None
        for at in range(end - 1, -1, -1):
            if not (skip_full and totals[at][3]):
                newest = totals[at][1]
                break

        def last_window() -> list[int]:
            window: list[int] = []
            for at in range(end - 1, -1, -1):
                entry = totals[at]
                if not (skip_full and entry[3]):
                    window.append(entry[2])
                    if len(window) == CAPACITY_WINDOW:
                        break
            return window

        return lookup, newest, last_window

    def _finished_history(self, call: int) -> tuple[dict[int, int], list[int], dict[int, int]]:
        """The totals of the gathers among calls 1..call-CALL_LAG, by gather index; the indices sorted;
        each one's position."""
        totals, limit = self.totals, call - CALL_LAG
        if self._in_call_order:  # the usual case: the finished ones are a prefix (at most CALL_LAG left out)
            end = len(totals)
            while end and totals[end - 1][0] > limit:
                end -= 1
            finished = list(itertools.islice(totals, end))
        else:
            finished = [entry for entry in totals if entry[0] <= limit]
        # A gather that carried full exponents (a bucket's first, the one after an error) is an outlier no
        # later gather repeats: sized from the others once they cover a cycle (STEADY_HISTORY).
        steady = [entry for entry in finished if not entry[3]]
        known = {
            gather: total for _, gather, total, _ in (steady if len(steady) >= STEADY_HISTORY else finished)
        }
        gathers = sorted(known)
        return known, gathers, {gather: at for at, gather in enumerate(gathers)}

    def record(self, call: int, index: int, largest_total_bytes: int, full: bool = False) -> None:
        # Gathers finish in start order, so calls and gather indices arrive increasing; the history
        # readers rely on it while it holds (_in_call_order, _rising).
        totals = self.totals
        if totals:
            last_call, last_index = totals[-1][:2]
            if call < last_call:
                self._in_call_order = self._rising = False
            elif index <= last_index:
                self._rising = False
        if len(totals) == totals.maxlen:  # the oldest entry leaves the window
            oldest = totals[0]
            self._steady_entries -= not oldest[3]
            if self._entry_of.get(oldest[1]) is oldest:
                del self._entry_of[oldest[1]]
        entry = (call, index, largest_total_bytes, full)
        totals.append(entry)
        self._steady_entries += not full
        self._entry_of[index] = entry


@dataclass
class BucketStats:
    calls: int = 0
    registrations: int = 0
    overflow_rounds: int = 0
    raw_messages: int = 0  # seeds included
    seed_messages: int = 0
    payload_messages: int = 0
    failed_calls: int = 0
    # Calls whose shards were encoded, and calls whose received messages were rebuilt, in one compiled call
    # (bucket_codec; the rest went shard by shard), and messages that pass handed to the per-shard path.
    one_call_encodes: int = 0
    one_call_rebuilds: int = 0
    one_call_handoffs: int = 0
    # This rank's bytes on the wire in bucket rows and overflow rounds, by what they carry: codec
    # payloads, raw messages, headers (bucket header and entry table), and padding (the planned area's
    # unused end and 8-byte alignment). Registration rounds are not counted here.
    payload_bytes: int = 0
    raw_message_bytes: int = 0
    header_bytes: int = 0
    padding_bytes: int = 0

    def wire_bytes_by_kind(self) -> dict[str, int]:
        return {
            "payload": self.payload_bytes,
            "raw": self.raw_message_bytes,
            "header": self.header_bytes,
            "padding": self.padding_bytes,
        }


class BucketHandle:
    """Async result of a bucket gather: the row is in flight; ``wait()`` decodes and returns the outputs."""

    def __init__(self, finish, owner: BucketGather | None = None) -> None:
        self._finish = finish
        self._owner = owner
        self._result: list[torch.Tensor] | None = None
        self._error: CieraError | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None and self._owner is not None:
            self._owner._finish_before(self)
        if self._result is None:
            if self._error is not None:
                raise self._error
            finish, self._finish = self._finish, None
            if finish is None:
                raise CieraError("this gather already failed; its handle has no result")
            try:
                self._result = finish()
            except CieraError as error:
                self._error = error
                raise
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None


def _carries_full(headers: list[_Header], received: np.ndarray, head: int) -> bool:
    """Whether any rank's row carries a full-exponent payload, or a seed in place of one (its flags byte,
    read from the received rows: the same bytes, so the same answer, on every rank; a message starting
    past the area counts as not full)."""
    area_bytes = received.shape[1] - head
    flag_of = {
        KIND_PAYLOAD: (HEADER_FLAGS_OFFSET, FLAG_FULL_EXPONENTS),
        KIND_SEED: (SEED_FLAGS_OFFSET, SEED_FULL),
    }
    for source, header in enumerate(headers):
        offset = 0
        for entry in header.entries:
            where = flag_of.get(_entry_kind(entry))
            if where is not None and offset + where[0] < area_bytes:
                if received[source, head + offset + where[0]] & where[1]:
                    return True
            offset += _align8(_entry_length(entry))
    return False


def _entry(kind: int, length: int) -> int:
    return kind | (length << 2)


def _entry_kind(entry: int) -> int:
    return entry & 3


def _entry_length(entry: int) -> int:
    return entry >> 2


class BucketGather:
    """The bucket path of one :class:`~ciera_runtime.allgather.CompressedAllGather` (same group, same
    shards' codec state, same stats)."""

    def __init__(self, engine: CompressedAllGather) -> None:
        self.engine = engine
        self.buckets: dict[tuple[int, ...], Bucket] = {}
        self.stats = BucketStats()
        self._call = 0
        # Set when this engine's CIERA groups are out of step (a failure on one rank, a timeout): every
        # pending call raises it, and the next call re-creates the groups first.
        self._poison: GatherError | None = None
        # This rank failed first (one call before the others learn of it): its next call raises the same
        # error again, without posting, so every rank's call after that one is the rendezvous.
        self._raise_again = False
        self.recoveries = 0
        # Calls started and not finished, oldest first: they are finished in this order on every rank.
        self._pending: collections.deque = collections.deque()
        # CIERA's rows run on their own groups: an abandoned row (a failure on one rank) then never pairs
        # with the engine's own collectives. Overflow rounds have a second group: they are issued when a
        # call is finished, and ranks may interleave finishes with other calls' starts differently.
        self.row_group = self.overflow_group = None
        # Per CIERA group (by name): rounds posted on it, and those not yet seen finished (index, send
        # bytes, work) — what the drain after a failure needs to pair the rounds it left unpaired.
        self._rounds_posted: collections.Counter = collections.Counter()
        self._rounds_open: dict[str, list[tuple[int, int, object]]] = collections.defaultdict(list)
        self.drained_rounds = 0  # rounds posted to pair another rank's unpaired one (a drain)
        self.rounds_left_open = 0  # unpaired rounds a drain could not finish (the log says why)
        self._store = None
        self._notice_key = ""
        if engine.world_size > 1:
            self._make_groups()

    def _make_groups(self) -> None:
        """New CIERA groups over the engine's ranks; every member calls this at the same point (the
        first bucket gather; the first call after a failure), which is the rendezvous."""
        import torch.distributed as dist

        engine = self.engine
        ranks = dist.get_process_group_ranks(engine.group) if engine.group is not None else None
        ranks = ranks or list(range(dist.get_world_size()))
        self.row_group = dist.new_group(ranks, use_local_synchronization=True)
        self.overflow_group = dist.new_group(ranks, use_local_synchronization=True)
        try:  # the store every rank of the job shares (private in torch 2.13; without it: timeouts)
            self._store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            self._store = None
        self._notice_key = f"ciera/failure/{self.row_group.group_name}"

    def _recover(self) -> None:
        """After a failure that left the groups out of step: new groups, no buckets, full exponents."""
        self._drain()
        # The old groups are dropped, not destroyed: destroying one renames later groups on this rank only
        # (names count the groups a process has), and the rendezvous of the new ones would not meet.
        self._make_groups()
        self.buckets.clear()
        self._pending.clear()
        self._call = 0  # call numbers count on the new groups
        self._poison = None
        self.recoveries += 1
        self._reset_after_error()

    def _post(self, recv: torch.Tensor, send: np.ndarray, group):
        """Post one async all-gather on a CIERA group; counted, so a failure's unpaired rounds can be
        paired later (:meth:`_drain`)."""
        from ciera_runtime.allgather import _all_gather_single

        name = group.group_name
        work = _all_gather_single(recv, torch.from_numpy(send), group=group, async_op=True)
        # Dropped again when a wait sees it finished (_wait); the drain skips any that finished since.
        self._rounds_open[name].append((self._rounds_posted[name], send.size, work))
        self._rounds_posted[name] += 1
        return work

    def _round_finished(self, work) -> None:
        for open_rounds in self._rounds_open.values():
            for at, entry in enumerate(open_rounds):
                if entry[2] is work:
                    del open_rounds[at]
                    return

    def _drain(self) -> None:
        """Pair the rounds a failure left unpaired on the old groups, then wait for them.

        After a one-sided failure some ranks have posted a round that the others never will (the failing
        rank raises without posting; a rank that timed out gave up on its round). gloo's worker threads
        hold such a round until a peer exits, and then free its tensors — which takes the GIL, and during
        interpreter shutdown aborts the process ("terminate called without an active exception",
        SIGABRT; torch 2.13). So at the rendezvous every rank publishes, per old group, how many rounds
        it posted and the sizes of those still open; a rank that posted fewer posts the missing ones
        (zeros, the same sizes — sizes come from replicated state, so the posting ranks agree) and every
        rank waits for its open rounds. When a rank does not publish in time (it is not at the
        rendezvous), or the sizes disagree, the rounds stay open, as before, and the log says so."""
        engine = self.engine
        if self._store is None or self.row_group is None:
            return
        # Two timeouts: a rank that learns of the failure only by its own timeout (its peer died before
        # posting a notice) arrives one timeout after the others.
        deadline_s = time.perf_counter() + DRAIN_TIMEOUTS * engine.timeout_s
        for group in (self.row_group, self.overflow_group):
            name = group.group_name
            open_rounds = [entry for entry in self._rounds_open.pop(name, []) if not entry[2].is_completed()]
            posted = self._rounds_posted.pop(name, 0)
            prefix = f"ciera/drain/{name}/"
            self._store.set(
                prefix + str(engine.rank),
                json.dumps([posted, [[index, size] for index, size, _ in open_rounds]]),
            )
            try:
                self._store.wait(
                    [prefix + str(rank) for rank in range(engine.world_size)],
                    timedelta(seconds=max(1e-3, deadline_s - time.perf_counter())),
                )
                published = [
                    json.loads(self._store.get(prefix + str(rank))) for rank in range(engine.world_size)
                ]
            except (RuntimeError, ValueError) as error:
                logger.warning(
                    "ciera_runtime: rounds of group %s left open: %s", name, str(error).splitlines()[0]
                )
                continue
            sizes: dict[int, set[int]] = collections.defaultdict(set)
            for _, entries in published:
                for index, size in entries:
                    sizes[index].add(size)
            target = max(count for count, _ in published)
            missing = range(posted, target)
            if any(len(sizes[index]) != 1 for index in missing):
                self.rounds_left_open += len(open_rounds)
                logger.warning(
                    "ciera_runtime: rounds of group %s left open: ranks disagree on their sizes", name
                )
                continue
            for index in missing:
                (size,) = sizes[index]
                recv = torch.empty(engine.world_size * size, dtype=torch.uint8)
                work = _all_gather_dummy(recv, size, group)
                open_rounds.append((index, size, work))
                self.drained_rounds += 1
            for position, (_, _, work) in enumerate(open_rounds):
                try:
                    work.wait(timeout=timedelta(seconds=max(1e-3, deadline_s - time.perf_counter())))
                except RuntimeError as error:
                    self.rounds_left_open += len(open_rounds) - position
                    logger.warning(
                        "ciera_runtime: a round of group %s left open: %s", name, str(error).splitlines()[0]
                    )
                    break

    def unfinished_rounds(self) -> int:
        """CIERA rounds this rank posted that have not finished (after a drain that could not pair them,
        too): 0 whenever no gather is in flight, or the process may abort at exit (see :meth:`_drain`)."""
        tracked = sum(
            not work.is_completed() for entries in self._rounds_open.values() for *_, work in entries
        )
        return tracked + self.rounds_left_open

    def _poisoned(self, error: GatherError) -> GatherError:
        self._poison = error
        return error

    # ----------------------------------------------------------------- registration

    def _fingerprint(self, shard_ids, numels, dtypes, compressed) -> int:
        engine = self.engine
        facts = repr(
            (
                engine.world_size,
                engine.config.fingerprint,
                engine.cache_budget_bytes,
                tuple(zip(shard_ids, numels, dtypes, compressed, strict=True)),
            )
        )
        return int.from_bytes(hashlib.blake2b(facts.encode(), digest_size=8).digest(), "little") >> 1

    def _register(self, shard_ids: tuple[int, ...], shards: list, error: str | None) -> Bucket:
        """Register the bucket on every rank alike (one fixed-size round), or raise the same error."""
        engine = self.engine
        registered_here: list[int] = []
        numels: list[int] = []
        fingerprint = 0
        if error is None:
            try:
                dtypes, compressed = [], []
                for shard_id, shard in zip(shard_ids, shards, strict=True):
                    if shard_id not in engine._shards:
                        engine.register(shard_id, shard.numel(), shard.dtype)
                        registered_here.append(shard_id)
                    state = engine._shards[shard_id]
                    numels.append(state.numel)
                    dtypes.append(int(state.dtype))
                    compressed.append(state.compressed)
                fingerprint = self._fingerprint(shard_ids, numels, dtypes, compressed)
            except (ValueError, CieraError) as failure:
                error = str(failure)
        body = struct.pack(
            f"<{len(_REGISTRATION_FIELDS)}q",
            BUCKET_MAGIC,
            fingerprint,
            len(shard_ids),
            shard_ids[0],
            int(error is not None),
        ) + protocol._encode_reason(error or "")
        send = np.frombuffer(body + struct.pack("<II", zlib.crc32(body), 0), dtype=np.uint8).copy()
        if engine.fault_injector is not None:
            engine.fault_injector("control", shard_ids[0], send)
        received = self._exchange(send, "registration", shard_ids[0])
        self.stats.registrations += 1
        rows = [self._unpack_registration(row) for row in received]
        problem = self._registration_problem(rows, shard_ids[0])
        if problem is not None:
            for shard_id in registered_here:
                engine._unregister(shard_id)
            raise problem
        states = [engine._shards[shard_id] for shard_id in shard_ids]
        initial, largest, floor = 0, 0, 0
        for state in states:
            raw_bytes = _align8(2 * state.numel)
            largest_message = raw_bytes
            if state.compressed:
                layout = state.encoder.layout
                if layout.fixed_bytes < 2 * state.numel:  # it may send a seed
                    largest_message = _align8(SEED_PREFIX.size + 2 * state.numel)
                if engine.config.entropy == "none":  # a first (full) payload is raw-sized: a seed
                    initial += largest_message
                else:
                    initial += min(
                        raw_bytes, _align8(layout.fixed_bytes + int(_INITIAL_PAYLOAD_RATIO * state.numel))
                    )
                floor += min(raw_bytes, _align8(layout.fixed_bytes))
            else:
                initial += raw_bytes
                floor += raw_bytes
            largest += largest_message
        bucket = Bucket(shard_ids, tuple(numels), fingerprint, initial, largest, floor)
        if bucket_codec.batchable(states, engine.config):
            bucket.batch_encoder = bucket_codec.BucketEncoder(states, engine.config)
            bucket.batch_decoder = bucket_codec.BucketDecoder(
                bucket.batch_encoder, shard_ids, engine.config, engine.world_size
            )
        self.buckets[shard_ids] = bucket
        return bucket

    @staticmethod
    def _unpack_registration(row: np.ndarray):
        data = row.tobytes()
        body, (crc, _) = data[:-8], struct.unpack("<II", data[-8:])
        if zlib.crc32(body) != crc:
            return None
        fields = struct.unpack_from(f"<{len(_REGISTRATION_FIELDS)}q", body)
        if fields[0] != BUCKET_MAGIC:
            return None
        return fields[1:], protocol._decode_reason(body[8 * len(_REGISTRATION_FIELDS) :])

    @staticmethod
    def _registration_problem(rows, shard_id: int) -> GatherError | None:
        """The same error on every rank, from the received rows only (rank 0's first shard names it)."""
        unreadable = {
            rank: "registration row unreadable (corrupted)" for rank, row in enumerate(rows) if row is None
        }
        if unreadable:
            return GatherError(None, unreadable, "bucket registration aborted")
        named = rows[0][0][2]
        failed = {rank: reason or "failed locally" for rank, ((*_, bad), reason) in enumerate(rows) if bad}
        if failed:
            return GatherError(named, failed, "gather aborted on every rank")
        if len({fingerprint for (fingerprint, *_), _ in rows}) > 1:
            per_rank = {
                rank: f"bucket of {shards} shards from shard {first}, fingerprint {fingerprint:#018x}"
                for rank, ((fingerprint, shards, first, _), _) in enumerate(rows)
            }
            return ConfigMismatchError(
                named,
                per_rank,
                "ranks disagree on the bucket (shard ids, sizes, dtypes, codec settings, budget or mode)",
            )
        return None

    # ----------------------------------------------------------------- collectives

    def _exchange(self, send: np.ndarray, round_name: str, shard_id: int, group=None) -> np.ndarray:
        engine = self.engine
        recv = torch.empty(engine.world_size * send.size, dtype=torch.uint8)
        group = self.row_group if group is None else group
        work = self._post(recv, send, group)
        engine.stats.rounds += 1
        engine.stats.bytes_sent += send.size
        self._wait(work, round_name, shard_id)
        return recv.numpy().reshape(engine.world_size, send.size)

    def _wait(self, work, round_name: str, shard_id: int) -> None:
        """Wait for a round in slices; between slices, look for another rank's failure in the store. A
        timeout or a failed round leaves the groups out of step (poison)."""
        engine = self.engine
        start_s = time.perf_counter()
        deadline_s = start_s + engine.timeout_s
        try:
            while True:
                left_s = deadline_s - time.perf_counter()
                try:
                    work.wait(timeout=timedelta(seconds=max(1e-3, min(WAIT_SLICE_S, left_s))))
                    self._round_finished(work)
                    return
                except RuntimeError as error:
                    text = str(error)
                    if "timed out" not in text.lower() and "timeout" not in text.lower():
                        reason = f"{round_name} round failed: {text.splitlines()[0]}"
                        self._post_notice(shard_id, reason, GAVE_UP_SUMMARY)
                        raise self._poisoned(GatherError(shard_id, {engine.rank: reason})) from error
                notice = self._read_notice()
                if notice is not None:
                    raise self._poisoned(notice)
                if time.perf_counter() >= deadline_s:
                    reason = f"waited {engine.timeout_s:g} s in the {round_name} round"
                    self._post_notice(shard_id, reason, GAVE_UP_SUMMARY)
                    raise self._poisoned(
                        GatherTimeoutError(
                            shard_id,
                            {engine.rank: reason},
                            "a rank did not reach the gather (crashed, restarted, or gathering another shard)",
                        )
                    )
        finally:
            engine.stats.wait_s += time.perf_counter() - start_s

    def _read_notice(self) -> GatherError | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([self._notice_key]):
                return None
            shard, rank, summary, reason = self._store.get(self._notice_key).decode().split("|", 3)
            return GatherError(int(shard), {int(rank): reason}, summary)
        except (RuntimeError, ValueError):
            return None

    def _post_notice(self, shard_id: int, reason: str, summary: str = NOTICE_SUMMARY) -> None:
        """Tell every rank of this group's generation that this rank failed (the first notice stays)."""
        if self._store is not None:
            try:  # set only where unset, atomically: the first notice stays
                self._store.compare_set(
                    self._notice_key, "", f"{shard_id}|{self.engine.rank}|{summary}|{reason}"
                )
            except RuntimeError:
                pass

    # ----------------------------------------------------------------- the gather

    def _validate(self, shards, shard_ids, outputs) -> str | None:
        """None when the call's shards and outputs match their registration, else what does not (one line)."""
        if self._as_registered(shards, shard_ids, outputs):
            return None
        engine = self.engine
        if len(shards) != len(shard_ids) or (outputs is not None and len(outputs) != len(shards)):
            return f"{len(shards)} shards, {len(shard_ids)} ids, {len(outputs or ())} outputs: expected equal counts"
        for index, shard in enumerate(shards):
            if not isinstance(shard, torch.Tensor):
                return f"shard {shard_ids[index]} is {type(shard).__name__}, expected a torch.Tensor"
            if shard.dtype not in (torch.bfloat16, torch.float16):
                return f"shard {shard_ids[index]} has dtype {shard.dtype}, expected bfloat16 or float16"
            state = engine._shards.get(shard_ids[index])
            if state is not None and (shard.numel(), dtype_from_name(shard.dtype)) != (
                state.numel,
                state.dtype,
            ):
                return (
                    f"shard {shard_ids[index]} has {shard.numel()} x {shard.dtype}, registered as "
                    f"{state.numel} x {state.dtype.name.lower()}"
                )
            if outputs is not None:
                output = outputs[index]
                if not isinstance(output, torch.Tensor) or output.dtype != shard.dtype:
                    return f"output of shard {shard_ids[index]} is not a {shard.dtype} tensor"
                if output.device.type != "cpu":
                    return (
                        f"output is on {output.device}: the codec backends in this build work on CPU tensors"
                    )
                if output.numel() != engine.world_size * shard.numel():
                    return (
                        f"output of shard {shard_ids[index]} has {output.numel()} elements, expected "
                        f"world_size x numel = {engine.world_size * shard.numel()}"
                    )
        return None

    def _as_registered(self, shards, shard_ids, outputs) -> bool:
        """The usual call, checked in one pass: every shard registered, a CPU tensor of its registered
        dtype and size, every output a CPU tensor of that dtype and world_size times the size. Anything
        else is named by :meth:`_validate`'s full check."""
        states, world_size = self.engine._shards, self.engine.world_size
        if len(shards) != len(shard_ids) or (outputs is not None and len(outputs) != len(shards)):
            return False
        tensor = torch.Tensor
        for index, shard in enumerate(shards):
            state = states.get(shard_ids[index])
            if state is None or not isinstance(shard, tensor) or shard.numel() != state.numel:
                return False
            dtype = shard.dtype
            if dtype is not state.torch_dtype or not shard.is_cpu:
                return False
            if outputs is not None:
                output = outputs[index]
                if not isinstance(output, tensor) or output.dtype is not dtype or not output.is_cpu:
                    return False
                if output.numel() != world_size * state.numel:
                    return False
        return True

    def all_gather(self, shards: list, shard_ids: list[int], outputs: list | None = None) -> BucketHandle:
        """Start gathering every shard of the bucket (one row in flight on return); ``wait()`` on the
        handle returns the gathered tensors, bit for bit ``all_gather_into_tensor`` of each shard, or
        raises (see the module's docstring for which gather raises)."""
        engine = self.engine
        shards, shard_ids = list(shards), tuple(shard_ids)
        if not shard_ids or len(set(shard_ids)) != len(shard_ids):
            raise ValueError(f"shard_ids={shard_ids!r}: expected distinct ids, at least one")
        for shard_id in shard_ids:
            if isinstance(shard_id, bool) or not isinstance(shard_id, int) or not 0 <= shard_id < 1 << 32:
                raise ValueError(f"shard_id={shard_id!r}: expected an integer in [0, 2**32)")
        outputs = list(outputs) if outputs is not None else None
        error = self._validate(shards, shard_ids, outputs)
        if engine.world_size == 1:
            if error is not None:
                raise GatherError(shard_ids[0], {0: error}, "gather aborted")
            results = outputs or [torch.empty_like(shard.reshape(-1)) for shard in shards]
            for shard, result in zip(shards, results, strict=True):
                result.view(-1).copy_(shard.reshape(-1)) if result.is_contiguous() else result.copy_(
                    shard.reshape(result.shape)
                )
            return BucketHandle(lambda: results)
        if self._poison is not None and self._raise_again:
            self._raise_again = False
            raise self._poison
        if self._poison is not None:
            self._recover()
        bucket = self.buckets.get(shard_ids)
        if bucket is None:
            bucket = self._register(shard_ids, shards, error)
        return self._start(bucket, shards, outputs, error)

    def _finish_pending(self, until) -> None:
        """Finish pending calls, oldest first, while ``until(call number, handle)`` holds; their errors
        stay with their handles. Finishing order (and so the overflow rounds' order) is start order on
        every rank, whatever order the caller waits in."""
        while self._pending and until(*self._pending[0]):
            try:
                self._pending[0][1].wait()
            except CieraError:
                pass

    def _finish_before(self, handle: BucketHandle) -> None:
        self._finish_pending(lambda _, pending: pending is not handle)

    def _start(self, bucket: Bucket, shards, outputs, error: str | None) -> BucketHandle:
        engine, stats = self.engine, self.stats
        self._call += 1
        call = self._call
        # Calls numbered call-CALL_LAG or lower are finished now (usually long arrived): the area size of
        # this call depends on them.
        self._finish_pending(lambda number, _: number <= call - CALL_LAG)
        host_start_s = time.perf_counter()
        gather_index = bucket.started
        bucket.started += 1
        capacity_bytes = bucket.capacity_for(call, gather_index)
        stats.calls += 1
        encode_start_s = time.perf_counter()
        n = len(bucket.shard_ids)
        head = header_bytes(n)
        overflow = bytearray()
        entries = [0] * n
        crcs = [0] * n
        bits_of: list[np.ndarray | None] = [None] * n
        position = 0
        batch = bucket.batch_encoder if error is None and bucket_codec.usable() else None
        bucket_bits = None  # the bucket's values, flat, when it is encoded in one call
        if batch is not None:
            try:
                bucket_bits = batch.flat_bits(shards)
            except (ValueError, TypeError, RuntimeError):
                batch = None  # the per-shard loop names what is wrong with which shard
        if batch is not None:
            send, overflow, entries, crcs = self._encode_in_one_call(
                bucket, batch, bucket_bits, head, capacity_bytes
            )
        else:
            send = np.zeros(head + capacity_bytes, dtype=np.uint8)
        area = send[head:]
        if error is None and batch is None:
            payload_messages = seed_messages = payload_bytes = raw_bytes = 0
            shard_states = engine._shards
            try:
                for index, (shard_id, shard) in enumerate(zip(bucket.shard_ids, shards, strict=True)):
                    state = shard_states[shard_id]
                    bits = shard_bits(shard, state.dtype, f"shard {shard_id}")
                    bits_of[index] = bits
                    message = bits.view(np.uint8)
                    kind = KIND_RAW
                    if state.compressed:
                        encoder = state.encoder
                        # bits: checked by shard_bits and _validate; the scratch fits any payload of it.
                        payload = encoder._encode_bits(bits, engine._scratch_for(state))
                        if payload.size < message.size:
                            message, kind = payload, KIND_PAYLOAD
                        elif encoder.layout.fixed_bytes < message.size:
                            # Not smaller than raw this time (churn, a full payload without an entropy
                            # stage): raw values that seed the receivers' caches at this generation.
                            full = bool(payload[HEADER_FLAGS_OFFSET] & FLAG_FULL_EXPONENTS)
                            message = _seed_message(encoder.epoch, encoder.generation, full, message)
                            kind = KIND_SEED
                        else:  # no payload of this shard is ever smaller than raw: plain raw
                            encoder.force_full()
                    size = message.size
                    if kind == KIND_PAYLOAD:
                        payload_messages += 1
                        payload_bytes += size
                    else:
                        seed_messages += kind == KIND_SEED
                        raw_bytes += size
                        crcs[index] = zlib.crc32(message)
                    entries[index] = _entry(kind, size)
                    fits = max(0, min(size, area.size - position))
                    area[position : position + fits] = message[:fits]
                    if fits < size:
                        overflow += message[fits:].tobytes()
                        overflow += bytes(_align8(size) - size)
                    position = min(area.size, _align8(position + size))
            except (ValueError, CieraError) as failure:
                error = str(failure)
            if error is None:  # a failed call sends no message
                stats.payload_messages += payload_messages
                stats.raw_messages += n - payload_messages
                stats.seed_messages += seed_messages
                stats.payload_bytes += payload_bytes
                stats.raw_message_bytes += raw_bytes
        message_bytes = sum(_align8(_entry_length(e)) for e in entries)
        reason = error or ""
        if error is not None:
            entries, crcs, overflow, message_bytes = [0] * n, [0] * n, bytearray(), 0
            area[:] = 0
        header_values = {
            "fingerprint": bucket.fingerprint,
            "call": call,
            "failed": int(error is not None),
            "overflow_bytes": len(overflow),
            "message_bytes": message_bytes,
        }
        _pack_header(header_values, reason, entries, crcs, send)
        stats.header_bytes += head
        # The row and this rank's share of the overflow round (sized by the largest rank's spill: the
        # rest of it is padding, added when the round runs).
        stats.padding_bytes += send.size + len(overflow) - head - sum(_entry_length(e) for e in entries)
        encode_end_s = time.perf_counter()
        engine.stats.encode_s += encode_end_s - encode_start_s
        if engine.codec_timer is not None and error is None:
            engine.codec_timer("codec_send", bucket.shard_ids[0], encode_start_s, encode_end_s, 0)
        if engine.fault_injector is not None:
            engine.fault_injector("send", bucket.shard_ids[0], send)
        recv = torch.empty(engine.world_size * send.size, dtype=torch.uint8)
        work = self._post(recv, send, self.row_group)
        engine.stats.rounds += 1
        engine.stats.bytes_sent += send.size
        engine.stats.gathers += n  # shard gathers, as on the per-shard path
        engine.stats.raw_bytes_equivalent += sum(2 * numel for numel in bucket.numels)

        def finish() -> list[torch.Tensor]:
            host_start_s, wait_before_s = time.perf_counter(), engine.stats.wait_s
            try:
                if self._poison is not None:
                    raise self._poison
                return self._finish(
                    bucket,
                    call,
                    gather_index,
                    work,
                    recv,
                    capacity_bytes,
                    bytes(overflow),
                    bits_of,
                    outputs,
                    bucket_bits,
                )
            except GatherError:
                stats.failed_calls += 1
                engine.stats.failed_gathers += 1
                raise
            finally:
                if self._pending and self._pending[0][1] is handle:
                    self._pending.popleft()
                waited_s = engine.stats.wait_s - wait_before_s  # network waits are not the thread's work
                engine.stats.host_s += time.perf_counter() - host_start_s - waited_s

        handle = BucketHandle(finish, self)
        self._pending.append((call, handle))
        engine.stats.host_s += time.perf_counter() - host_start_s
        return handle

    def _encode_in_one_call(
        self, bucket: Bucket, batch: bucket_codec.BucketEncoder, bucket_bits, head: int, capacity_bytes: int
    ) -> tuple[np.ndarray, bytearray, list[int], list[int]]:
        """The bucket's row (header space, then the area) with every message written by one compiled call,
        the overflow after it, and the entry table's kinds and lengths and CRC-32s (bucket_codec)."""
        stats, n = self.stats, len(bucket.shard_ids)
        row = np.empty(head + max(capacity_bytes, batch.stream_bytes), dtype=np.uint8)
        encoders = [self.engine._shards[shard_id].encoder for shard_id in bucket.shard_ids]
        stream_bytes = batch.encode(encoders, bucket_bits, row[head:])
        overflow = bytearray()
        if stream_bytes < capacity_bytes:
            row[head + stream_bytes : head + capacity_bytes] = 0
        else:
            overflow = bytearray(row[head + capacity_bytes : head + stream_bytes])
        kinds, sizes = batch.kinds.tolist(), batch.sizes.tolist()
        entries = [kind | size << 2 for kind, size in zip(kinds, sizes, strict=True)]
        crcs = [0] * n
        payload_messages = kinds.count(KIND_PAYLOAD)
        if payload_messages == n:  # the steady state
            stats.payload_bytes += sum(sizes)
        else:  # raw values and seeds carry a CRC-32 in the entry table
            start = head
            for index, (kind, size) in enumerate(zip(kinds, sizes, strict=True)):
                if kind == KIND_PAYLOAD:
                    stats.payload_bytes += size
                else:
                    crcs[index] = zlib.crc32(row[start : start + size])
                    stats.raw_message_bytes += size
                    stats.seed_messages += kind == KIND_SEED
                start += _align8(size)
        stats.payload_messages += payload_messages
        stats.raw_messages += n - payload_messages
        stats.one_call_encodes += 1
        return row[: head + capacity_bytes], overflow, entries, crcs

    def _finish(
        self,
        bucket: Bucket,
        call: int,
        gather_index: int,
        work,
        recv,
        capacity_bytes: int,
        overflow: bytes,
        bits_of,
        outputs,
        bucket_bits: np.ndarray | None = None,
    ) -> list[torch.Tensor]:
        engine = self.engine
        world_size, rank, n = engine.world_size, engine.rank, len(bucket.shard_ids)
        first = bucket.shard_ids[0]
        self._wait(work, "bucket", first)
        head = header_bytes(n)
        received = recv.numpy().reshape(world_size, head + capacity_bytes)
        headers = [_unpack_header(row, n) for row in received]
        # The overflow round: sized from the headers every rank received, so every rank runs it alike.
        limit = bucket.max_capacity_bytes + 8 * n
        overflow_bytes = max(
            (h.overflow_bytes for h in headers if h is not None and 0 <= h.overflow_bytes <= limit), default=0
        )
        overflow_rows = None
        if overflow_bytes:
            send = np.zeros(overflow_bytes, dtype=np.uint8)
            send[: len(overflow)] = np.frombuffer(overflow, dtype=np.uint8)[:overflow_bytes]
            self.stats.padding_bytes += overflow_bytes - len(overflow)
            overflow_rows = self._exchange(send, "overflow", first, self.overflow_group)
            self.stats.overflow_rounds += 1
        problem = self._problem(headers, bucket, limit)
        if problem is not None:
            self._reset_after_error()
            raise problem
        bucket.record(
            call, gather_index, max(h.message_bytes for h in headers), _carries_full(headers, received, head)
        )
        if self.engine.fault_injector is not None:
            self.engine.fault_injector("receive", first, received[:, head:])
        decode_start_s = time.perf_counter()
        failure: tuple[int, str] | None = None
        # The bucket's messages rebuilt in one compiled call when its encode was (bucket_bits: its values,
        # flat) and the outputs tile one buffer; anything else, one shard and source at a time.
        batch = bucket.batch_decoder if bucket_bits is not None else None
        flat = batch.flat_output(outputs) if batch is not None else None
        if flat is not None:
            out, results = flat
            states = [engine._shards[shard_id] for shard_id in bucket.shard_ids]

            def decode_one(index: int, source: int, offset: int, target: np.ndarray):
                state = states[index]
                return self._decode_one(
                    index, bucket.shard_ids[index], state, source, headers, offset, received, overflow_rows,
                    head, target,
                )  # fmt: skip

            failure, handoffs = batch.decode(
                states, headers, received, head, rank, bucket_bits, out, decode_one
            )
            self.stats.one_call_rebuilds += 1
            self.stats.one_call_handoffs += handoffs
        else:
            if bucket_bits is not None:  # encoded in one call: each shard's own values, as the loop has them
                bits_of = [bucket_bits[start:stop] for start, stop in bucket.batch_encoder.bounds]
            results = self._decode_shards(bucket, headers, received, overflow_rows, head, bits_of, outputs)
            if isinstance(results, tuple):
                failure, results = results, []
        decode_end_s = time.perf_counter()
        engine.stats.decode_s += decode_end_s - decode_start_s
        if engine.codec_timer is not None:
            engine.codec_timer(
                "codec_recv", first, decode_start_s, decode_end_s, 2 * sum(bucket.numels) * world_size
            )
        if failure is not None:
            # The others' weights are exact; they learn of this from the store at their next call.
            self._post_notice(*failure)
            self._raise_again = True
            raise self._poisoned(GatherError(failure[0], {rank: failure[1]}, NOTICE_SUMMARY))
        return results

    def _decode_shards(
        self, bucket: Bucket, headers, received, overflow_rows, head: int, bits_of, outputs
    ) -> list[torch.Tensor] | tuple[int, str]:
        """Rebuild the bucket one shard and source at a time: the gathered tensors, or the first failure
        (shard id, reason)."""
        engine = self.engine
        world_size, rank = engine.world_size, engine.rank
        results = []
        failure: tuple[int, str] | None = None
        # Where each source's message of each shard starts in its area (8-aligned, in entry order): one
        # running sum per source, not one per shard and source (that grew with the square of the shards).
        starts = [
            list(itertools.accumulate((_align8(_entry_length(e)) for e in header.entries), initial=0))
            for header in headers
        ]
        for index, shard_id in enumerate(bucket.shard_ids):
            state = engine._shards[shard_id]
            numel = state.numel
            output = outputs[index] if outputs is not None else None
            contiguous = output is not None and output.is_contiguous()
            result = output if contiguous else torch.empty(world_size * numel, dtype=state.torch_dtype)
            out_bits = result.view(torch.int16).numpy().reshape(-1).view(np.uint16)
            out_bits[rank * numel : (rank + 1) * numel] = bits_of[index]
            if failure is None:
                failure = self._decode_sources(
                    index, shard_id, state, headers, starts, received, overflow_rows, head, out_bits
                )
            if output is not None and not contiguous:
                output.copy_(result.view(output.shape))
            results.append(output if output is not None else result)
        return failure if failure is not None else results

    def _problem(self, headers: list[_Header | None], bucket: Bucket, limit: int) -> GatherError | None:
        """The error every rank raises for this gather, derived from the received headers only."""
        first = bucket.shard_ids[0]
        n = len(bucket.shard_ids)
        unreadable = {}
        for rank, header in enumerate(headers):
            if header is None:
                unreadable[rank] = "bucket header unreadable (corrupted, or another CIERA version)"
            elif not 0 <= header.overflow_bytes <= limit or not 0 <= header.message_bytes <= limit:
                unreadable[rank] = (
                    f"header sizes out of bounds ({header.message_bytes}, {header.overflow_bytes})"
                )
        if unreadable:
            return GatherError(first, unreadable, "gather aborted")
        calls = {h.call for h in headers}
        if len(calls) > 1:
            per_rank = {rank: f"CIERA call {h.call}" for rank, h in enumerate(headers)}
            return GatherError(
                first, per_rank, "ranks are at different CIERA calls (a rank skipped or repeated one)"
            )
        prints = {h.fingerprint for h in headers}
        if len(prints) > 1:
            per_rank = {rank: f"bucket fingerprint {h.fingerprint:#018x}" for rank, h in enumerate(headers)}
            return ConfigMismatchError(first, per_rank, "ranks gather different buckets in the same call")
        failed = {rank: h.reason or "failed locally" for rank, h in enumerate(headers) if h.failed}
        if failed:
            return GatherError(first, failed, "gather aborted on every rank")
        for rank, header in enumerate(headers):
            total = 0
            for entry in header.entries:
                if _entry_kind(entry) not in (KIND_PAYLOAD, KIND_RAW, KIND_SEED):
                    return GatherError(first, {rank: f"message kind {_entry_kind(entry)}"}, "gather aborted")
                total += _align8(_entry_length(entry))
            if total != header.message_bytes or len(header.entries) != n:
                return GatherError(first, {rank: "entry table does not add up"}, "gather aborted")
        return None

    def _decode_sources(
        self, index, shard_id, state, headers, starts, received, overflow_rows, head, out_bits
    ):
        """Rebuild every other rank's part of shard ``index`` (``starts[source][index]``: where its message
        begins in that source's area); (shard, reason) of the first failure."""
        engine = self.engine
        numel = state.numel
        for source in range(engine.world_size):
            if source == engine.rank:
                continue
            target = out_bits[source * numel : (source + 1) * numel]
            failure = self._decode_one(
                index, shard_id, state, source, headers, starts[source][index], received, overflow_rows, head,
                target,
            )  # fmt: skip
            if failure is not None:
                return failure
        return None

    def _decode_one(
        self, index, shard_id, state, source, headers, offset, received, overflow_rows, head, target
    ) -> tuple[int, str] | None:
        """Rebuild rank ``source``'s part of shard ``index`` (its message begins at ``offset`` in that
        source's area) into ``target``; (shard, reason) when it cannot be."""
        numel = state.numel
        entry = headers[source].entries[index]
        kind, length = _entry_kind(entry), _entry_length(entry)
        area = received[source, head:]
        if offset + length <= area.size:
            message = area[offset : offset + length]
        else:
            spill = overflow_rows[source] if overflow_rows is not None else np.zeros(0, dtype=np.uint8)
            inside = area[min(offset, area.size) :]
            start_in_spill = max(0, offset - area.size)
            message = np.concatenate([inside, spill[start_in_spill : start_in_spill + length - inside.size]])
            if message.size != length:
                return shard_id, f"rebuilding rank {source}'s shard: message truncated"
        try:
            if kind in (KIND_RAW, KIND_SEED):
                prefix = SEED_PREFIX.size if kind == KIND_SEED else 0
                if length != prefix + 2 * numel:
                    raise CieraError(f"raw message of {length} bytes, expected {prefix + 2 * numel}")
                if zlib.crc32(message) != headers[source].crcs[index]:
                    raise CieraError("raw values CRC mismatch: corrupted in transit")
                values = message[prefix:].view(np.uint16)
                if kind == KIND_SEED:
                    if not state.compressed:
                        raise CieraError("seed for a shard registered raw")
                    epoch, generation, _ = SEED_PREFIX.unpack(message[: SEED_PREFIX.size].tobytes())
                    state.decoders[source].seed(values, epoch, generation)
                # A plain raw message leaves a compressed shard's cache alone: the next payload is full.
                target[:] = values
            else:
                if not state.compressed:
                    raise CieraError("payload for a shard registered raw")
                # message: a uint8 slice of the received row; target: this source's part of the output.
                state.decoders[source]._decode_into(message, target)
        except (CieraError, ValueError) as error:
            return shard_id, f"rebuilding rank {source}'s shard: {error}"
        return None

    def _reset_after_error(self) -> None:
        """Every rank reaches this at the same gather: every encoder sends full exponents next."""
        for state in self.engine._shards.values():
            if state.compressed:
                state.encoder.force_full()


def _seed_message(epoch: int, generation: int, full: bool, values: np.ndarray) -> np.ndarray:
    """A seed: the sender's (epoch, generation, flags), then its raw values (bytes)."""
    message = np.empty(SEED_PREFIX.size + values.size, dtype=np.uint8)
    SEED_PREFIX.pack_into(message, 0, epoch, generation, SEED_FULL if full else 0)
    message[SEED_PREFIX.size :] = values
    return message


def _all_gather_dummy(recv: torch.Tensor, size: int, group):
    """A round of ``size`` zero bytes per rank: the pair of another rank's unpaired round (a drain)."""
    from ciera_runtime.allgather import _all_gather_single

    return _all_gather_single(recv, torch.zeros(size, dtype=torch.uint8), group=group, async_op=True)
