"""Compressed all-gather over torch.distributed (gloo and NCCL).

Wire scheme ("fixed part + variable part", two rounds, no padding in the common case):

round 1  every rank sends  [fixed part of its payload | its ExpCache generation for every source rank].
         The fixed part (header, bitmap, sign+mantissa) has a size set by (dtype, numel, block size), equal
         on every rank because all-gather shards have equal numel: a plain all_gather_into_tensor.
round 2  only if some rank has a non-empty variable part: every rank sends its variable part (rANS-coded
         exponents of changed blocks) padded to the largest one, whose size everybody read in round 1.

Resync: the generations in round 1 tell every rank, before round 2, whether some receiver's cache is not
at ``generation - 1`` of a sender's delta (restarted or lagging rank, a skipped gather). Such a sender puts
a full raw-exponent payload in round 2 instead (size fixed_bytes + numel, known to all), every receiver
rebuilds that source from it, and nobody ever merges against a wrong cache.

Shards that are not selected for compression, or do not fit the cache budget, use the plain
all_gather_into_tensor of the raw shard. The result is bit for bit that of all_gather_into_tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ciera_runtime.codec import CodecConfig, ShardDecoder, ShardEncoder, dtype_from_name, shard_bits

_GENERATION_BYTES = 8


# torch >= 2.13 names all_gather_into_tensor all_gather_single (the old name warns); same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_bytes(output: torch.Tensor, send: torch.Tensor, group, async_op: bool):
    return _all_gather_single(output, send, group=group, async_op=async_op)


@dataclass
class GatherStats:
    """What the last gathers cost; times in seconds, bytes sent by this rank."""

    gathers: int = 0
    raw_gathers: int = 0
    resyncs: int = 0
    second_rounds: int = 0
    bytes_sent: int = 0
    raw_bytes_equivalent: int = 0
    encode_s: float = 0.0
    wait_s: float = 0.0
    decode_s: float = 0.0
    history: list[dict] = field(default_factory=list)


@dataclass
class PreparedShard:
    """A shard encoded ahead of its gather (CCP): the payload and the tensor it was made from."""

    shard_id: int
    shard: torch.Tensor
    payload: np.ndarray | None  # None: raw path
    encode_s: float


class AllGatherHandle:
    """Async result of :meth:`CompressedAllGather.all_gather`; ``wait()`` returns the gathered tensor.

    Round 1 (the bulk: sign+mantissa planes) is in flight when the handle is returned. ``wait()`` finishes
    it, runs round 2 if needed, decodes every source into the output and returns it.
    """

    def __init__(self, finish) -> None:
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish()
            self._finish = None
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None


@dataclass
class _ShardState:
    numel: int
    dtype: torch.dtype
    category: str
    compressed: bool
    encoder: ShardEncoder | None = None
    decoders: dict[int, ShardDecoder] = field(default_factory=dict)
    memory_bytes: int = 0


class CompressedAllGather:
    """Per-group engine: the codec state of every registered shard, the cache budget, gather stats.

    Every rank must register the same shards in the same order with the same arguments (the budget
    decision then matches everywhere) and gather them in the same order, as with any collective.
    """

    def __init__(
        self, group=None, config: CodecConfig | None = None, cache_budget_bytes: int | None = None
    ) -> None:
        self.group = group
        self.config = config or CodecConfig()
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.cache_budget_bytes = cache_budget_bytes
        self.cache_used_bytes = 0
        self.stats = GatherStats()
        self._shards: dict[int, _ShardState] = {}

    def memory_for(self, numel: int) -> int:
        """Cache bytes a compressed shard costs this rank: (W-1)*S_e receiver caches + sender state."""
        n_blocks = (numel + self.config.block_size - 1) // self.config.block_size
        sender = 16 * n_blocks if self.config.detector == "hash" else numel
        return (self.world_size - 1) * numel + sender

    def register(self, shard_id: int, numel: int, dtype, category: str = "", compress: bool = True) -> bool:
        """Declare a shard; returns whether it will be compressed (False beyond the cache budget)."""
        if shard_id in self._shards:
            return self._shards[shard_id].compressed
        torch_dtype = torch.bfloat16 if dtype_from_name(dtype).name == "BF16" else torch.float16
        memory = self.memory_for(numel)
        fits = self.cache_budget_bytes is None or self.cache_used_bytes + memory <= self.cache_budget_bytes
        state = _ShardState(numel, torch_dtype, category, compress and fits and self.world_size > 1)
        if state.compressed:
            state.encoder = ShardEncoder(shard_id, numel, dtype, self.rank, self.config)
            state.decoders = {
                source: ShardDecoder(shard_id, source, numel, dtype, self.config)
                for source in range(self.world_size)
                if source != self.rank
            }
            state.memory_bytes = memory
            self.cache_used_bytes += memory
        self._shards[shard_id] = state
        return state.compressed

    def is_compressed(self, shard_id: int) -> bool:
        return self._shards[shard_id].compressed

    def _state_for(self, shard_id: int, shard: torch.Tensor) -> _ShardState:
        if shard_id not in self._shards:
            self.register(shard_id, shard.numel(), shard.dtype)
        state = self._shards[shard_id]
        if shard.numel() != state.numel or shard.dtype != state.dtype:
            raise ValueError(
                f"shard {shard_id}: got {shard.numel()} x {shard.dtype}, registered {state.numel} x {state.dtype}"
            )
        return state

    def prepare(self, shard: torch.Tensor, shard_id: int) -> PreparedShard:
        """Encode ``shard`` for its next gather (change detection + rANS); safe to run on a worker thread."""
        state = self._state_for(shard_id, shard)
        start_s = time.perf_counter()
        payload = state.encoder.encode(shard) if state.compressed else None
        return PreparedShard(shard_id, shard, payload, time.perf_counter() - start_s)

    def all_gather(
        self,
        shard: torch.Tensor | None = None,
        shard_id: int | None = None,
        output: torch.Tensor | None = None,
        prepared: PreparedShard | None = None,
    ) -> AllGatherHandle:
        """Start gathering ``shard`` (or a :class:`PreparedShard`) from every rank into ``output``
        (shape (W * numel,), like all_gather_into_tensor); returns an :class:`AllGatherHandle`."""
        if prepared is None:
            prepared = self.prepare(shard, shard_id)
        shard, shard_id = prepared.shard, prepared.shard_id
        state = self._shards[shard_id]
        flat = shard.detach().reshape(-1).contiguous()
        if output is None:
            output = torch.empty(self.world_size * state.numel, dtype=state.dtype)
        stats = self.stats
        stats.gathers += 1
        stats.encode_s += prepared.encode_s
        stats.raw_bytes_equivalent += flat.numel() * 2
        if self.world_size == 1:
            output.copy_(flat)
            return AllGatherHandle(lambda: output)
        if not state.compressed:
            stats.raw_gathers += 1
            stats.bytes_sent += flat.numel() * 2
            work = _all_gather_bytes(output, flat, self.group, async_op=True)

            def finish_raw() -> torch.Tensor:
                wait_start_s = time.perf_counter()
                work.wait()
                stats.wait_s += time.perf_counter() - wait_start_s
                return output

            return AllGatherHandle(finish_raw)
        return self._start_compressed(state, prepared, flat, output)

    def _start_compressed(self, state: _ShardState, prepared: PreparedShard, flat, output) -> AllGatherHandle:
        world_size, rank, group, stats = self.world_size, self.rank, self.group, self.stats
        encoder = state.encoder
        layout = encoder.layout
        fixed_bytes = layout.fixed_bytes
        payload = prepared.payload
        generations = np.zeros(world_size, dtype=np.int64)
        for source, decoder in state.decoders.items():
            generations[source] = decoder.generation
        row_bytes = fixed_bytes + _GENERATION_BYTES * world_size
        send_round1 = torch.empty(row_bytes, dtype=torch.uint8)
        send_view = send_round1.numpy()
        send_view[:fixed_bytes] = payload[:fixed_bytes]
        send_view[fixed_bytes:] = generations.view(np.uint8)
        recv_round1 = torch.empty(world_size * row_bytes, dtype=torch.uint8)
        work = _all_gather_bytes(recv_round1, send_round1, group, async_op=True)
        stats.bytes_sent += row_bytes

        def finish() -> torch.Tensor:
            from ciera_runtime.codec import parse_header

            wait_start_s = time.perf_counter()
            work.wait()
            rows = recv_round1.numpy().reshape(world_size, row_bytes)
            cache_generations = rows[:, fixed_bytes:].copy().view(np.int64)  # [receiver, source]
            headers = {}
            variable_bytes = np.zeros(world_size, dtype=np.int64)
            needs_resync = np.zeros(world_size, dtype=bool)
            for source in range(world_size):
                header = parse_header(rows[source, :fixed_bytes], prepared.shard_id, source)
                headers[source] = header
                receivers = [r for r in range(world_size) if r != source]
                in_step = all(cache_generations[r, source] == header.generation - 1 for r in receivers)
                needs_resync[source] = not header.full and not in_step
                variable_bytes[source] = (
                    encoder.resync_payload_bytes() if needs_resync[source] else header.exp_bytes
                )
            round2_bytes = int(variable_bytes.max())
            recv_rows2 = None
            if round2_bytes:
                stats.second_rounds += 1
                if needs_resync[rank]:
                    stats.resyncs += 1
                    mine = encoder.encode_resync(flat)
                else:
                    mine = payload[fixed_bytes:]
                send_round2 = torch.zeros(round2_bytes, dtype=torch.uint8)
                send_round2.numpy()[: mine.size] = mine
                recv_round2 = torch.empty(world_size * round2_bytes, dtype=torch.uint8)
                _all_gather_bytes(recv_round2, send_round2, group, async_op=False)
                stats.bytes_sent += round2_bytes
                recv_rows2 = recv_round2.numpy().reshape(world_size, round2_bytes)
            stats.wait_s += time.perf_counter() - wait_start_s
            decode_start_s = time.perf_counter()
            out_bits = shard_bits(output)
            numel = state.numel
            for source in range(world_size):
                target = out_bits[source * numel : (source + 1) * numel]
                if source == rank:
                    target[:] = shard_bits(flat)
                    continue
                decoder = state.decoders[source]
                size = int(variable_bytes[source])
                if needs_resync[source]:
                    decoder.decode(recv_rows2[source, :size], out=target)
                else:
                    exp_section = recv_rows2[source, :size] if recv_rows2 is not None else rows[source, :0]
                    decoder.decode(rows[source, :fixed_bytes], out=target, exp_section=exp_section)
            stats.decode_s += time.perf_counter() - decode_start_s
            stats.history.append(
                {
                    "shard_id": prepared.shard_id,
                    "round2_bytes": round2_bytes,
                    "resync": bool(needs_resync.any()),
                }
            )
            if len(stats.history) > 1024:
                del stats.history[:512]
            return output

        return AllGatherHandle(finish)


def compressed_all_gather(
    shard: torch.Tensor,
    shard_id: int,
    engine: CompressedAllGather,
    output: torch.Tensor | None = None,
) -> AllGatherHandle:
    """Gather ``shard`` from every rank of ``engine.group``; ``.wait()`` on the handle gives a tensor equal
    bit for bit to ``all_gather_into_tensor`` of the raw shards."""
    return engine.all_gather(shard, shard_id, output=output)
