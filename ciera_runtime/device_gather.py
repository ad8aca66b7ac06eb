"""The device path of the compressed all-gather: no host read per gather.

On a GPU every host read of device data (``.item()``, a size round read on the host, a boolean-mask
index) stalls the stream, so the bucket path's design — capacity planned from the rows every rank read
on the host, an overflow round decided on the host — does not carry over. This path moves the host read
to the step boundary instead:

1. **After each optimizer step** (:meth:`DeviceGather.prepare`) every rank encodes each of its shards
   once, on the device: the sign+mantissa plane, the block-change bitmap against the exponents it last
   sent, and the changed blocks' exponents, compacted by a prefix sum and a scatter (no data-dependent
   shapes). The payload sizes go through one all-reduce (max) and are read on the host: the step's only
   host read of device data on the steady path. From then on every rank knows every slot's size exactly:
   no capacity plan, no overflow.
2. **Each gather** (:meth:`DeviceGather.all_gather`) lays the call's payloads into the rank's slot
   (the first gather of a shard after ``prepare`` at the agreed size; later ones — recompute, backward —
   carry no changed block, at the payload's fixed size), moves the slots with ``all_gather_into_tensor``
   (NCCL on GPU, gloo on CPU) and rebuilds every other rank's part on the device: on a GPU on a side
   stream as soon as the bytes arrive (the caller's stream waits for it at ``wait()``), on the CPU at
   ``wait()``.
3. **Failures** (a checksum, count or generation that does not match; a shard that changed after
   ``prepare``) never raise inside a gather: they set a device flag and leave that source's cache as it
   was. :meth:`DeviceGather.check`, called before
   the optimizer applies the step, agrees the flag over the group (one all-reduce, one host read) and
   raises the same :class:`GatherError` on every rank; the next ``prepare`` then sends every shard in
   full. So no step computed from a wrong weight is ever applied.

Changed exponents travel rANS-coded (``entropy="rans"``, :mod:`ciera_runtime.device_rans`: the host's
rANS format, coded on the device) where the stream is smaller than one byte per value, else uncoded; with
``entropy="none"`` always uncoded (no entropy stage on either side).
"""

from __future__ import annotations

import collections
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ciera_runtime import kernels
from ciera_runtime.allgather import _all_gather_single
from ciera_runtime.codec import ENTROPY_STAGES
from ciera_runtime.device_rans import DeviceRans
from ciera_runtime.errors import ConfigMismatchError, GatherError
from ciera_runtime.torch_backend import (
    _CHECKSUM_SEED,
    _GOLDEN_GAMMA,
    TorchBackend,
    _mix64,
    _to_int16_patterns,
)

# Per shard payload: [generation, changed values, checksum64(sign+mantissa), checksum64(exponents), shard
# id, source rank, bytes of the changed exponents' area, 1 if that area is a rANS stream else 0] as int64,
# then the sign+mantissa plane and the block bitmap (each padded to 8 bytes), then the changed blocks'
# exponents — a rANS stream, or one byte each. A slot holds the payloads of a call's shards.
_HEADER_WORDS = 8
_HEADER_BYTES = 8 * _HEADER_WORDS
_EXP_LAYOUT = {
    torch.bfloat16: (kernels.BF16_EXP_SHIFT, kernels.BF16_EXP_MASK),
    torch.float16: (kernels.FP16_EXP_SHIFT, kernels.FP16_EXP_MASK),
}


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class DeviceGatherStats:
    """What one DeviceGather did on this rank (names as CompressedAllGather.stats where they mean the same)."""

    gathers: int = 0  # all_gather calls (one collective each)
    bytes_sent: int = 0  # this rank's slots
    raw_bytes_equivalent: int = 0  # what the plain all-gather would have sent for the same shards
    host_reads: int = 0  # host reads of device data: one per prepare (the sizes), one per check (the flag)
    host_s: float = (
        0.0  # time in prepare, all_gather and wait on the calling thread, the wait itself left out
    )


@dataclass
class _Shard:
    """One registered shard: its static facts and its per-step state, all on the device."""

    shard_id: int
    index: int  # position in the registration order (the size vector's entry)
    numel: int
    dtype: torch.dtype
    last_sent: torch.Tensor  # uint8 exponents this rank sent last (its receivers' view of them)
    caches: torch.Tensor  # (W, numel) uint8: row s, the exponents rebuilt from rank s (this rank's: unused)
    block_size: int
    area_capacity: int  # the payload's room for the changed exponents: uncoded, or the longest stream
    payload: torch.Tensor | None = None  # this step's payload (uint8, its largest possible size)
    prepared_checksum: torch.Tensor | None = None  # checksum64 of the values prepare() encoded (0-d)
    # The exponents the payload brings its receivers to: they become last_sent only when it is sent (a
    # shard prepared but not gathered in a step leaves its receivers where they were).
    prepared_exp: torch.Tensor | None = None
    gathered_this_step: bool = False

    @property
    def is_fp16(self) -> bool:
        return self.dtype == torch.float16

    @property
    def n_blocks(self) -> int:
        return (self.numel + self.block_size - 1) // self.block_size

    @property
    def sign_mantissa_bytes(self) -> int:
        return kernels.sign_mantissa_bytes(self.numel, self.is_fp16)

    @property
    def fixed_bytes(self) -> int:
        """The payload without changed exponents: what a gather with no changed block carries."""
        return _HEADER_BYTES + _align8(self.sign_mantissa_bytes) + _align8((self.n_blocks + 7) // 8)


class DeviceGather:
    """Compressed all-gather of registered shards on their device, one host read per step.

    ``register`` once (every rank the same shard ids, sizes and dtype: checked), then per step:
    ``prepare(shards)`` after the optimizer step, ``all_gather(ids, shards)`` (and ``handle.wait()``) as
    the engine gathers, ``check()`` before the next optimizer step. Every call is collective on
    ``group``."""

    def __init__(
        self, device: str | torch.device, group=None, block_size: int = 64, entropy: str = "rans"
    ) -> None:
        self.device = torch.device(device)
        self.group = group
        self.block_size = block_size
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.codec = DevicePayloadCodec(self.device, block_size, entropy)  # checks both
        self._shards: dict[int, _Shard] = {}
        self._slot_bytes: list[int] = []  # per registered shard: this step's agreed payload size (host)
        self._generation = 0
        self._full_next = True  # the next prepare sends every block (start, or after a failure)
        # A failed check: the owner must prepare again before the next gather (a retried step).
        self.needs_prepare = False
        # Device flags since the last check: [a received part failed its checks, this rank's own shard
        # changed after prepare].
        self._failed = torch.zeros(2, dtype=torch.int64, device=self.device)
        others = [source for source in range(self.world_size) if source != self.rank]
        self._other_ranks = torch.tensor(others, dtype=torch.int64, device=self.device)
        self.stats = DeviceGatherStats()
        # On a GPU each gather's decode runs on this side stream as soon as its bytes arrive (CCP): the
        # stream waits for the NCCL work, decodes, and records an event that wait() makes the caller's
        # stream wait on — the host never blocks, and the decode overlaps the caller's compute. On the
        # CPU (gloo: a wait blocks the host anyway) the decode runs at wait().
        self._codec_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # A testing hook: called with each received slot tensor (W x slot bytes) before decoding.
        self.fault_injector = None

    def memory_bytes(self) -> int:
        """Device memory this gather keeps: per shard the exponents last sent, one cache per other rank and
        the step's payload."""
        total = 0
        for state in self._shards.values():
            total += state.numel * (self.world_size + 1)  # last_sent + a cache row per rank
            total += 0 if state.payload is None else state.payload.numel()
        return total

    # ---- registration ------------------------------------------------------------------------------

    def register(self, shards: dict[int, torch.Tensor]) -> None:
        """Agree the shard set (ids, sizes, dtypes) with every rank; a rank that differs fails the same
        ConfigMismatchError everywhere."""
        described = []
        for shard_id in sorted(shards):
            tensor = shards[shard_id]
            if tensor.dtype not in _EXP_LAYOUT:
                raise ValueError(f"shard {shard_id} has dtype {tensor.dtype}: expected bfloat16 or float16")
            if tensor.device != self.device:
                raise ValueError(f"shard {shard_id} is on {tensor.device}, this gather on {self.device}")
            described.append(f"{shard_id}:{tensor.numel()}:{tensor.dtype}")
        settings = [str(self.block_size), self.codec.entropy]
        fingerprint = zlib.crc32("|".join(described + settings).encode())
        mine = torch.tensor([fingerprint], dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        _all_gather_single(every, mine, group=self.group)
        prints = every.tolist()  # once, at registration
        if len(set(prints)) > 1:
            raise ConfigMismatchError(
                None,
                {rank: f"shard set fingerprint {value:08x}" for rank, value in enumerate(prints)},
                "ranks registered different shard sets for the device gather",
            )
        for index, shard_id in enumerate(sorted(shards)):
            tensor = shards[shard_id]
            self._shards[shard_id] = self.codec.new_shard(
                shard_id, index, tensor.numel(), tensor.dtype, self.rank, self.world_size
            )
        self._full_next = True

    # ---- once per step -----------------------------------------------------------------------------

    def prepare(self, shards: dict[int, torch.Tensor]) -> None:
        """Encode every registered shard's current values (call after the optimizer step, before the
        first gather) and agree the payload sizes: one all-reduce, one host read."""
        if set(shards) != set(self._shards):
            raise ValueError("prepare: expected a tensor for every registered shard, and no other")
        start_s = time.perf_counter()
        self._generation += 1
        # Per shard: this rank's payload size and the checksum of its values, gathered from every rank:
        # the largest size sets the slot, the checksums stay on the device (a raw slot's only check).
        mine = torch.zeros((len(self._shards), 2), dtype=torch.int64, device=self.device)
        for shard_id, state in self._shards.items():
            _, size = self.codec.encode(state, shards[shard_id], self._full_next, self._generation, self.rank)
            mine[state.index, 0] = size
            mine[state.index, 1] = state.prepared_checksum
            state.gathered_this_step = False
        table = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device=self.device)
        _all_gather_single(table, mine.reshape(-1), group=self.group)
        table = table.view(self.world_size, *mine.shape)
        self._values_checksums = table[:, :, 1]
        self._slot_bytes = table[:, :, 0].amax(dim=0).tolist()
        self.stats.host_reads += 1
        self.stats.bytes_sent += mine.numel() * mine.element_size()
        self._full_next = False
        self.needs_prepare = False
        self.stats.host_s += time.perf_counter() - start_s

    def check(self) -> None:
        """Before the optimizer applies the step: raise the same GatherError on every rank — naming every
        rank that failed and why — if any gather since the last check did not rebuild exactly (one
        all-gather of the flags, one host read)."""
        if self._codec_stream is not None:  # the flags the side stream's decodes set
            torch.cuda.current_stream(self.device).wait_stream(self._codec_stream)
        flags = torch.empty(self.world_size * 2, dtype=torch.int64, device=self.device)
        _all_gather_single(flags, self._failed.clone(), group=self.group)
        self.stats.host_reads += 1
        self.stats.bytes_sent += self._failed.numel() * self._failed.element_size()  # protocol bytes
        table = flags.view(self.world_size, 2).tolist()
        self._failed.zero_()
        failures = {}
        for rank, (received, edited) in enumerate(table):
            reasons = []
            if received:
                reasons.append(
                    "a received part failed its checks (corrupted in transit, or ranks out of step)"
                )
            if edited:
                reasons.append(
                    "its shard changed after prepare() (edited outside the optimizer step: prepare again)"
                )
            if reasons:
                failures[rank] = "; ".join(reasons)
        if failures:
            self._full_next = self.needs_prepare = True  # every rank resends in full, caches rebuilt
            raise GatherError(
                None, failures, "the step is not applied on any rank; the next step sends every shard in full"
            )

    # ---- gathers -----------------------------------------------------------------------------------

    def all_gather(
        self, shard_ids: list[int], shards: list[torch.Tensor], outputs=None
    ) -> DeviceGatherHandle:
        """Start gathering ``shards`` (this rank's parts of ``shard_ids``, as given to ``prepare``);
        ``wait()`` gives each shard's W parts concatenated (into ``outputs`` when given)."""
        start_s = time.perf_counter()
        unknown = [shard_id for shard_id in shard_ids if shard_id not in self._shards]
        if unknown or len(set(shard_ids)) != len(shard_ids) or len(shards) != len(shard_ids):
            raise ValueError(
                f"all_gather: shard ids {list(shard_ids)} with {len(shards)} tensors: expected distinct "
                f"registered ids, one tensor each (unknown: {unknown})"
            )
        states = [self._shards[shard_id] for shard_id in shard_ids]
        if any(state.payload is None for state in states):
            raise ValueError("all_gather before prepare(): encode the step's shards first")
        for state, shard in zip(states, shards, strict=True):
            if shard.numel() != state.numel or shard.dtype != state.dtype or shard.device != self.device:
                raise ValueError(
                    f"all_gather: a shard of {shard.numel()} {shard.dtype} values on {shard.device}, "
                    f"registered as {state.numel} {state.dtype} on {self.device}"
                )
            # The others rebuild what prepare() encoded: a shard changed since (a checkpoint loaded, a
            # manual edit) would leave ranks with different weights. Checked on the device: the flag.
            changed = self.codec.values_checksum(shard) != state.prepared_checksum
            self._failed[1] |= changed.to(torch.int64)
        # Each shard's part of the slot: its payload — the step's first gather at the agreed size, a
        # repeat at the fixed size — or, where that would not be smaller than the raw values, the values
        # themselves (every rank decides alike, from sizes every rank has).
        sizes, raw = [], []
        for state in states:
            size = state.fixed_bytes if state.gathered_this_step else self._slot_bytes[state.index]
            raw.append(size >= 2 * state.numel)
            sizes.append(2 * state.numel if raw[-1] else size)
        slot_bytes = sum(sizes)
        send = torch.zeros(slot_bytes, dtype=torch.uint8, device=self.device)
        at = 0
        for state, shard, size, as_raw in zip(states, shards, sizes, raw, strict=True):
            if as_raw:
                send[at : at + size] = shard.detach().reshape(-1).view(torch.uint8)
            elif state.gathered_this_step:
                send[at : at + size] = self.codec.repeat_payload(state)
            else:
                send[at : at + size] = state.payload[:size]
            if not state.gathered_this_step:
                self.codec.commit(state)
            state.gathered_this_step = True
            at += size
        self.stats.gathers += 1
        self.stats.bytes_sent += slot_bytes
        self.stats.raw_bytes_equivalent += sum(2 * state.numel for state in states)
        parts = list(zip(sizes, raw, strict=True))
        if self._codec_stream is None:
            recv = torch.empty(self.world_size * slot_bytes, dtype=torch.uint8, device=self.device)
            work = _all_gather_single(recv, send, group=self.group, async_op=True)
            self.stats.host_s += time.perf_counter() - start_s
            return DeviceGatherHandle(self, work, recv, states, parts, shards, outputs)
        stream = self._codec_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the slot, shards and outputs written
        send.record_stream(stream)
        with torch.cuda.stream(stream):
            recv = torch.empty(self.world_size * slot_bytes, dtype=torch.uint8, device=self.device)
            work = _all_gather_single(recv, send, group=self.group, async_op=True)
            work.wait()  # the side stream waits for the transfer; the host does not
            results = self._finish(recv, states, parts, shards, outputs)
            decoded = torch.cuda.Event()
            decoded.record(stream)
        self.stats.host_s += time.perf_counter() - start_s
        return DeviceGatherHandle(self, None, None, states, parts, shards, outputs, results, decoded)

    def _finish(self, recv, states, sizes, shards, outputs) -> list[torch.Tensor]:
        start_s = time.perf_counter()
        rows = recv.view(self.world_size, -1)
        if self.fault_injector is not None:
            self.fault_injector(rows)
        results = []
        others = self._other_ranks
        for index, state in enumerate(states):
            at = sum(size for size, _ in sizes[:index])
            size, as_raw = sizes[index]
            numel = state.numel
            result = outputs[index] if outputs is not None else None
            if result is None:
                result = torch.empty(self.world_size * numel, dtype=state.dtype, device=self.device)
            by_rank = result.view(-1).view(torch.int16).view(self.world_size, numel)
            own = by_rank[self.rank]
            if own.data_ptr() != shards[index].data_ptr():  # FSDP2 hands the input inside the output
                own.copy_(shards[index].reshape(-1).view(torch.int16))
            # Every other rank's part of this shard at once: one batch of tensor ops, not one per source.
            parts = rows[:, at : at + size].index_select(0, others)
            expected = self._values_checksums[:, state.index].index_select(0, others)
            if as_raw:
                values, ok = self.codec.take_raw_rows(state, others, parts, expected)
            else:
                values, ok = self.codec.decode_rows(state, others, parts, self._generation, expected)
            by_rank.index_copy_(0, others, values)
            self._failed[0] |= (~ok).any().to(torch.int64)
            results.append(result)
        self.stats.host_s += time.perf_counter() - start_s
        return results


class DevicePayloadCodec:
    """The device payload of one shard, in tensor ops with static shapes (no host read): encode against the
    exponents the receivers hold, decode against a receiver's cache. No process group: DeviceGather runs
    it between ranks, benchmarks/gpu_check.py between emulated ranks in one process."""

    def __init__(self, device: str | torch.device, block_size: int = 64, entropy: str = "rans") -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size!r}: expected a power of two")
        if entropy not in ENTROPY_STAGES:
            raise ValueError(f"entropy={entropy!r}: expected 'rans' or 'none'")
        self.device = torch.device(device)
        self.block_size = block_size
        self.entropy = entropy
        self.backend = TorchBackend(self.device)
        self.rans = DeviceRans(self.device) if entropy == "rans" else None

    def new_shard(
        self, shard_id: int, index: int, numel: int, dtype: torch.dtype, rank: int, world_size: int
    ) -> _Shard:
        """The state of one shard on ``rank``: nothing sent yet, an empty cache per other rank."""
        if dtype not in _EXP_LAYOUT:
            raise ValueError(f"shard {shard_id} has dtype {dtype}: expected bfloat16 or float16")
        caches = torch.zeros((world_size, numel), dtype=torch.uint8, device=self.device)
        area_capacity = _align8(numel)
        if self.rans is not None:
            area_capacity = max(area_capacity, self.rans.max_stream_bytes(numel))
        return _Shard(
            shard_id=shard_id,
            index=index,
            numel=numel,
            dtype=dtype,
            last_sent=torch.zeros(numel, dtype=torch.uint8, device=self.device),
            caches=caches,
            block_size=self.block_size,
            area_capacity=area_capacity,
        )

    def _changed_values(self, changed_blocks: torch.Tensor, numel: int) -> torch.Tensor:
        return changed_blocks.repeat_interleave(self.block_size)[:numel]

    def encode(
        self, state: _Shard, shard: torch.Tensor, full: bool, generation: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``shard``'s payload (at its largest size, zero-padded) against what ``state``'s receivers hold,
        and its size (0-d); every block when ``full``. It becomes their state only on :meth:`commit`."""
        backend, numel = self.backend, state.numel
        shift, mask = _EXP_LAYOUT[state.dtype]
        patterns = shard.detach().reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        exp = ((patterns >> shift) & (mask & 0xFF)).to(torch.uint8)
        changed_blocks = backend._blocks_any(exp != state.last_sent, self.block_size)
        if full:
            changed_blocks = torch.ones_like(changed_blocks)
        changed = self._changed_values(changed_blocks, numel)
        positions = torch.cumsum(changed.to(torch.int64), 0) - 1
        count = changed.sum()
        # Unchanged values land on a spare byte past the end: a scatter, no mask-shaped tensor.
        area = torch.zeros(numel + 1, dtype=torch.uint8, device=self.device)
        area.scatter_(0, torch.where(changed, positions, numel), exp)
        sign_mantissa = backend._sign_mantissa(patterns, state.is_fp16)
        payload = torch.zeros(state.fixed_bytes + state.area_capacity, dtype=torch.uint8, device=self.device)
        # The changed exponents: a rANS stream where it is shorter than one byte each, else uncoded.
        body = payload[state.fixed_bytes :]
        body[:numel] = area[:numel]
        area_bytes, coded = count, torch.zeros((), dtype=torch.int64, device=self.device)
        if self.rans is not None:
            stream, length = self.rans.encode(area[:numel], count)
            coded = (length < count).to(torch.int64)
            area_bytes = torch.where(coded == 1, length, count)
            body[: stream.numel()] = torch.where(coded == 1, stream, body[: stream.numel()])
        header = payload[:_HEADER_BYTES].view(torch.int64)
        header[0] = generation
        header[1] = count
        header[2] = backend.checksum64_tensor(sign_mantissa)
        header[3] = backend.checksum64_tensor(exp)
        header[4] = state.shard_id
        header[5] = rank
        header[6] = area_bytes
        header[7] = coded
        at = _HEADER_BYTES
        payload[at : at + sign_mantissa.numel()] = sign_mantissa
        at += _align8(state.sign_mantissa_bytes)
        bitmap = self._pack_bits(changed_blocks)
        payload[at : at + bitmap.numel()] = bitmap
        state.payload, state.prepared_exp = payload, exp
        state.prepared_checksum = self.values_checksum(shard)
        return payload, state.fixed_bytes + area_bytes

    def values_checksum(self, shard: torch.Tensor) -> torch.Tensor:
        """checksum64 of the shard's bytes (0-d, no host read)."""
        return self.backend.checksum64_tensor(shard.detach().reshape(-1).view(torch.uint8))

    def take_raw_rows(
        self, state: _Shard, sources: torch.Tensor, parts: torch.Tensor, expected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw parts of ``sources`` (one row each, 2·numel bytes): their values as 16-bit patterns (k, numel)
        and whether each is exact (its checksum is ``expected``); the exact ones' exponents fill their
        cache rows (each source's next payload is a delta on them)."""
        if state.numel:
            values = _dense(parts).view(torch.int16)
        else:  # an empty shard: no bytes to view as 16-bit values
            values = torch.empty((len(sources), 0), dtype=torch.int16, device=self.device)
        ok = _checksum_rows(parts) == expected
        shift, mask = _EXP_LAYOUT[state.dtype]
        exponents = (((values.to(torch.int32) & 0xFFFF) >> shift) & (mask & 0xFF)).to(torch.uint8)
        cache = state.caches.index_select(0, sources)
        state.caches.index_copy_(0, sources, torch.where(ok.unsqueeze(1), exponents, cache))
        return values, ok

    @staticmethod
    def commit(state: _Shard) -> None:
        """The prepared payload was sent: its exponents are now what the receivers hold."""
        state.last_sent.copy_(state.prepared_exp)

    def repeat_payload(self, state: _Shard) -> torch.Tensor:
        """The payload of a later gather in the same step: no changed block (the bitmap zeroed)."""
        repeat = state.payload[: state.fixed_bytes].clone()
        header = repeat[:_HEADER_BYTES].view(torch.int64)
        header[1] = header[6] = header[7] = 0  # no changed value, an empty uncoded area
        at = _HEADER_BYTES + _align8(state.sign_mantissa_bytes)
        repeat[at:] = 0
        return repeat

    def _pack_bits(self, flags: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(_align8(flags.numel()), dtype=torch.int32, device=self.device)
        padded[: flags.numel()] = flags.to(torch.int32)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=self.device)
        return (padded.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)

    def _unpack_bits(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        shifts = torch.arange(8, dtype=torch.int32, device=self.device)
        return ((packed.to(torch.int32).unsqueeze(1) >> shifts) & 1).reshape(-1)[:count].to(torch.bool)

    def decode_rows(
        self,
        state: _Shard,
        sources: torch.Tensor,
        parts: torch.Tensor,
        generation: int,
        expected: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild the payload parts of ``sources`` (int64, k; ``parts`` (k, part bytes)) in one batch of
        tensor ops: their values as 16-bit patterns (k, numel) and whether each is exact (k bools) — its
        header names this generation, this shard and that source, the bitmap's count matches and fits, both
        plane checksums hold, and (with ``expected``) the values have the checksum their source gave. A
        source's cache row takes the rebuilt exponents only if exact. No host read."""
        numel, rows = state.numel, len(sources)
        shift, _ = _EXP_LAYOUT[state.dtype]
        header = _dense(parts[:, :_HEADER_BYTES]).view(torch.int64)  # (k, 6)
        at = _HEADER_BYTES
        sign_mantissa = parts[:, at : at + state.sign_mantissa_bytes]
        at += _align8(state.sign_mantissa_bytes)
        bitmap = parts[:, at : at + (state.n_blocks + 7) // 8]
        shifts = torch.arange(8, dtype=torch.int32, device=self.device)
        changed_blocks = ((bitmap.to(torch.int32).unsqueeze(2) >> shifts) & 1).reshape(rows, -1)
        changed = changed_blocks[:, : state.n_blocks].repeat_interleave(self.block_size, dim=1)[:, :numel]
        changed = changed.to(torch.bool)
        positions = torch.cumsum(changed.to(torch.int64), dim=1) - 1
        count = changed.sum(dim=1)
        area = parts[:, state.fixed_bytes :]
        room = area.shape[1]
        cache = state.caches.index_select(0, sources)
        # The changed exponents, one byte each: uncoded in the part (zero past its end), or decoded from
        # its rANS stream. A changed value past the area's end reads a zero: the count check fails it.
        symbols = torch.zeros((rows, numel), dtype=torch.uint8, device=self.device)
        symbols[:, : min(room, numel)] = area[:, :numel]
        area_bytes, coded = header[:, 6], header[:, 7]
        area_ok = (coded == 0) & (area_bytes == count) & (count <= room)
        if self.rans is not None:
            decoded, decoded_count, stream_ok = self.rans.decode_rows(area, numel, area_bytes)
            symbols = torch.where((coded == 1).unsqueeze(1), decoded, symbols)
            area_ok |= (coded == 1) & stream_ok & (decoded_count == count)
        gathered = torch.gather(symbols, 1, positions.clamp(0, max(numel - 1, 0)))
        rebuilt = torch.where(changed, gathered, cache)
        values = _merge_rows(rebuilt, sign_mantissa, shift, state.is_fp16)
        ok = (
            (header[:, 0] == generation)
            & (header[:, 4] == state.shard_id)
            & (header[:, 5] == sources)
            & (header[:, 1] == count)
            & area_ok
            & (_checksum_rows(sign_mantissa) == header[:, 2])
            & (_checksum_rows(rebuilt) == header[:, 3])
        )
        if expected is not None:
            ok = ok & (_checksum_rows(values.view(torch.uint8).reshape(rows, -1)) == expected)
        state.caches.index_copy_(0, sources, torch.where(ok.unsqueeze(1), rebuilt, cache))
        return values, ok

    def decode(
        self, state: _Shard, source: int, payload: torch.Tensor, out: torch.Tensor, generation: int
    ) -> torch.Tensor:
        """One source's payload into ``out`` (``decode_rows`` for one row); whether it is exact (0-d)."""
        sources = torch.tensor([source], dtype=torch.int64, device=self.device)
        values, ok = self.decode_rows(state, sources, payload.reshape(1, -1), generation)
        out.reshape(-1).view(torch.int16).copy_(values[0])
        return ok[0]


def _dense(rows: torch.Tensor) -> torch.Tensor:
    """A copy of a 2-D slice with standard strides: a wider dtype view needs them, and a one-row slice
    counts as contiguous whatever its row stride (so ``.contiguous()`` may not copy it)."""
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device).copy_(rows)


def _checksum_rows(data: torch.Tensor) -> torch.Tensor:
    """checksum64 (``kernels.checksum64``, as ``TorchBackend.checksum64_tensor``) of every row of a 2-D
    uint8 tensor, as int64 (k,): the rows' little-endian words, the partial last word zero-filled."""
    rows, n_bytes = data.shape
    words_per_row = (n_bytes + 7) // 8
    padded = torch.zeros((rows, 8 * words_per_row), dtype=torch.uint8, device=data.device)
    padded[:, :n_bytes] = data
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=data.device)
    # The bytes occupy disjoint bits, so their sum is their OR (the top byte wraps into the sign bit).
    words = (padded.view(rows, words_per_row, 8).to(torch.int64) << shifts).sum(dim=2)
    index = torch.arange(1, words_per_row + 1, dtype=torch.int64, device=data.device)
    terms = _mix64((index * _GOLDEN_GAMMA + _CHECKSUM_SEED) ^ words).sum(dim=1)
    return _mix64(terms ^ n_bytes)


def _merge_rows(
    exp: torch.Tensor, sign_mantissa: torch.Tensor, exp_shift: int, is_fp16: bool
) -> torch.Tensor:
    """``kernels.merge_planes`` of every row: (k, numel) exponents and (k, plane bytes) sign+mantissa
    planes into (k, numel) int16 patterns."""
    rows, numel = exp.shape
    exp32 = exp.to(torch.int32)
    low = sign_mantissa[:, :numel].to(torch.int32)
    if not is_fp16:
        return _to_int16_patterns(((low & 0x80) << 8) | (exp32 << exp_shift) | (low & 0x7F))
    groups = (numel + 7) // 8
    tail = torch.zeros((rows, groups * 3), dtype=torch.int32, device=exp.device)
    tail[:, : sign_mantissa.shape[1] - numel] = sign_mantissa[:, numel:].to(torch.int32)
    tail = tail.view(rows, groups, 3)
    packed = tail[:, :, 0] | (tail[:, :, 1] << 8) | (tail[:, :, 2] << 16)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=exp.device)
    high = ((packed.unsqueeze(2) >> shifts) & 0x7).reshape(rows, -1)[:, :numel]
    values = (exp32 << exp_shift) | low | ((high & 0x4) << 13) | ((high & 0x3) << 8)
    return _to_int16_patterns(values)


class DeviceGatherHandle:
    def __init__(
        self, gather: DeviceGather, work, recv, states, sizes, shards, outputs, results=None, decoded=None
    ) -> None:
        self._gather, self._work, self._recv = gather, work, recv
        self._states, self._sizes, self._shards, self._outputs = states, sizes, shards, outputs
        self._results: list[torch.Tensor] | None = results
        self._decoded = decoded  # on a GPU: the side stream's event after the decode

    def wait(self) -> list[torch.Tensor]:
        """The gathered shards; on a GPU the caller's stream waits for their decode (no host wait)."""
        if self._decoded is not None:
            current = torch.cuda.current_stream(self._gather.device)
            current.wait_event(self._decoded)
            for result in self._results:  # made on the side stream, used on the caller's
                result.record_stream(current)
            self._decoded = None
        if self._results is None:
            self._work.wait()
            self._results = self._gather._finish(
                self._recv, self._states, self._sizes, self._shards, self._outputs
            )
        return self._results


# aten ops that read device data on the host (a stream sync on a GPU): a scalar read (`.item()`, bool(),
# int()), a shape that depends on values (nonzero, boolean-mask indexing, unique, repeat_interleave by
# a tensor), a comparison returning a Python bool.
SYNCING_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.equal",
    "aten.is_nonzero",
    "aten.allclose",
}


class HostReadCounter(TorchDispatchMode):
    """Counts, per op, the aten ops run under it that would make a GPU stream wait for the host: a check
    that runs on CPU (``with HostReadCounter() as counter: ...; counter.counts``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.replace("::", ".")  # e.g. aten.index; str(func) adds the overload
        if name in SYNCING_OPS:
            self.counts[name] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] or [])
        ):
            self.counts[f"{name}(bool mask)"] += 1
        elif str(func) == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self.counts["aten.repeat_interleave(tensor repeats)"] += 1
        return func(*args, **kwargs)
