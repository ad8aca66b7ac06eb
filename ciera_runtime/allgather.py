"""Compressed all-gather over torch.distributed (gloo; NCCL needs a GPU codec backend, not in this build).

Every gather is the same short protocol on every rank (``protocol.py`` has the wire details):

control  all-gather of one fixed-size row per rank (size depends only on the world size): what the rank
         gathers and how, whether its caller-supplied tensors are valid, its payload's epoch, generation
         and exponent bytes, and its cache state for every source. Every rank derives the same plan from
         the same rows — the same error, or the same bulk size and resync decisions.
bulk     compressed: one all-gather of payload rows (header, bitmap, sign+mantissa, exponents), padded
         to the largest; a sender whose receivers are not all in step sends full raw exponents instead.
         raw: the plain all_gather_into_tensor.
status   compressed only: whether every rank rebuilt every source. If one did not, every rank raises the
         same GatherError; never wrong weights on one rank and an exception on another.

Every wait has the engine's timeout; a rank that never arrives makes the others raise GatherTimeoutError
instead of hanging. The result is bit for bit that of all_gather_into_tensor of the raw shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ciera_runtime import protocol
from ciera_runtime.codec import (
    CodecConfig,
    DType,
    PayloadLayout,
    ShardDecoder,
    ShardEncoder,
    dtype_from_name,
    parse_header,
    shard_bits,
)
from ciera_runtime.errors import CieraError, GatherError, GatherTimeoutError

logger = logging.getLogger("ciera_runtime")


# torch >= 2.13 names all_gather_into_tensor all_gather_single (the old name warns); same collective.
def _all_gather_single(output, input_tensor, group=None, async_op=False):
    # Looked up at each call, so a counter or timer that wraps torch.distributed later sees it too.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_tensor, group=group, async_op=async_op)


_TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}
# Send buffers kept per engine: one for the gather in flight, one for the next one CCP prepares.
_SEND_BUFFERS = 2

# A testing hook (fault injection): called with (point, shard_id, array) where point is "control" (this
# rank's control row before it is sent), "send" (its bulk row before it is sent) or "receive" (every
# received bulk row, W x row_bytes, before decoding); it may modify the array in place.
FaultInjector = Callable[[str, int, np.ndarray], None]
CodecTimer = Callable[[str, int, float, float, int], None]


@dataclass
class GatherStats:
    """What the gathers cost; times in seconds, bytes sent by this rank."""

    gathers: int = 0
    raw_gathers: int = 0
    resyncs: int = 0
    failed_gathers: int = 0
    rounds: int = 0
    bytes_sent: int = 0
    raw_bytes_equivalent: int = 0
    encode_s: float = 0.0
    wait_s: float = 0.0
    decode_s: float = 0.0
    # The bucket path's time on the calling thread, network waits left out: packing and encoding a row,
    # issuing it, unpacking and decoding what arrived (the codec's share is encode_s + decode_s).
    host_s: float = 0.0
    history: list[dict] = field(default_factory=list)


@dataclass
class PreparedShard:
    """A shard encoded ahead of its gather (CCP). ``error`` holds a local failure (bad tensor, encode
    error): it travels to every rank in the control round instead of being raised on this rank alone."""

    shard_id: int
    shard: torch.Tensor | None
    bits: np.ndarray | None = None
    payload: np.ndarray | None = None  # None: raw path (or failed)
    buffer: np.ndarray | None = None  # the send buffer the payload lives in
    generation: int = 0
    encode_s: float = 0.0
    error: str | None = None
    exception: BaseException | None = None
    registered_here: bool = False  # this call registered the shard (undone if the gather fails to agree)


@dataclass
class Registration:
    """The engine's decision for one shard, as every rank with the same configuration makes it."""

    shard_id: int
    numel: int
    dtype: str
    category: str
    compressed: bool
    reason: str
    memory_bytes: int


class AllGatherHandle:
    """Async result of :meth:`CompressedAllGather.all_gather`; ``wait()`` returns the gathered tensor.

    The control round is in flight when the handle is returned; ``wait()`` finishes the protocol."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            finish, self._finish = self._finish, None
            if finish is None:
                raise CieraError("this gather already failed; its handle has no result")
            self._result = finish()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None


@dataclass
class _ShardState:
    numel: int
    dtype: DType
    compressed: bool
    encoder: ShardEncoder | None = None
    decoders: dict[int, ShardDecoder] = field(default_factory=dict)
    memory_bytes: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{name}={value!r}: expected an integer in [{low}, {high})")


class CompressedAllGather:
    """Per-group engine: the codec state of every registered shard, the cache budget, gather stats.

    ``cache_budget_bytes`` bounds everything the engine keeps between gathers (receiver caches, sender
    state and scratch, the send buffers); ``timeout_s`` bounds every wait of a gather. Every rank must
    construct its engine with the same configuration and gather the same shards in the same order, as
    with any collective — a rank that does not is detected and every rank raises the same error.
    """

    def __init__(
        self,
        group=None,
        config: CodecConfig | None = None,
        cache_budget_bytes: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if cache_budget_bytes is not None:
            _check_int("cache_budget_bytes", cache_budget_bytes, 0, 1 << 62)
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        self.group = group
        self.config = config or CodecConfig()
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.cache_budget_bytes = cache_budget_bytes
        self.timeout_s = float(timeout_s)
        self.stats = GatherStats()
        self.registrations: dict[int, Registration] = {}
        self.fault_injector: FaultInjector | None = None
        # A measurement hook: called with (stream, shard_id, start_s, end_s, raw_bytes) on
        # time.perf_counter's clock for every encode ("codec_send", raw_bytes 0) and every decode + merge
        # ("codec_recv", raw_bytes: the gathered size uncompressed) of a compressed shard.
        self.codec_timer: CodecTimer | None = None
        self._shards: dict[int, _ShardState] = {}
        self._send_buffer_bytes = 0  # size of each kept send buffer: the largest compressed payload
        self._free_buffers: list[np.ndarray] = []
        self._bucket_path = None  # ciera_runtime.bucket.BucketGather, made on the first bucket gather

    # ----------------------------------------------------------------- registration and the budget

    def memory_for(self, numel: int, dtype="bf16") -> int:
        """Bytes a compressed shard keeps on this rank between gathers: (W-1)·numel receiver caches plus
        the encoder's state (see ShardEncoder.state_bytes_for), plus any growth of the send buffers."""
        per_shard = (self.world_size - 1) * numel + ShardEncoder.state_bytes_for(
            numel, self.config.block_size, self.config.detector
        )
        payload_bytes = PayloadLayout.of(numel, dtype_from_name(dtype), self.config.block_size)
        growth = _SEND_BUFFERS * max(0, payload_bytes.max_payload_bytes - self._send_buffer_bytes)
        return per_shard + growth

    @property
    def cache_used_bytes(self) -> int:
        """What the registered compressed shards keep between gathers, plus the engine's send buffers."""
        per_shard = sum(state.memory_bytes for state in self._shards.values() if state.compressed)
        return per_shard + _SEND_BUFFERS * self._send_buffer_bytes

    @property
    def send_buffer_bytes(self) -> int:
        """Size of each of the (up to two) send buffers the engine keeps: the largest possible payload."""
        return self._send_buffer_bytes

    def memory_bytes(self) -> int:
        """Bytes actually held between gathers, counted from the arrays. At most ``cache_used_bytes``;
        equal once both send buffers exist (one is allocated per gather in flight: CCP uses two)."""
        held = sum(buffer.nbytes for buffer in self._free_buffers)
        for state in self._shards.values():
            if state.compressed:
                held += state.encoder.state_bytes + sum(d.cache_bytes for d in state.decoders.values())
        return held

    def register(self, shard_id: int, numel: int, dtype, category: str = "", compress: bool = True) -> bool:
        """Declare a shard; returns whether it will be compressed. A shard that does not fit the cache
        budget is gathered raw, and the engine logs that decision (``registrations`` keeps it)."""
        _check_int("shard_id", shard_id, 0, 1 << 32)
        _check_int("numel", numel, 0, 1 << 40)
        dtype = dtype_from_name(dtype)
        if shard_id in self._shards:
            state = self._shards[shard_id]
            if (state.numel, state.dtype) != (numel, dtype):
                raise ValueError(
                    f"shard {shard_id} is registered as {state.numel} x {state.dtype.name.lower()}, "
                    f"not {numel} x {dtype.name.lower()}"
                )
            return state.compressed
        memory = self.memory_for(numel, dtype)
        left = None if self.cache_budget_bytes is None else self.cache_budget_bytes - self.cache_used_bytes
        if self.world_size == 1:
            compressed, reason = False, "world size 1: nothing to gather"
        elif not compress:
            compressed, reason = False, "registered with compress=False"
        elif left is not None and memory > left:
            compressed = False
            reason = f"needs {memory} bytes, {left} of the {self.cache_budget_bytes}-byte cache budget left"
            what = f"{numel} values" + (f", {category}" if category else "")
            logger.warning("ciera_runtime: shard %d (%s) is gathered raw: %s", shard_id, what, reason)
        else:
            compressed, reason = True, "compressed"
        state = _ShardState(numel, dtype, compressed)
        if compressed:
            state.encoder = ShardEncoder(shard_id, numel, dtype, self.rank, self.config)
            state.decoders = {
                source: ShardDecoder(shard_id, source, numel, dtype, self.config)
                for source in range(self.world_size)
                if source != self.rank
            }
            state.memory_bytes = memory - _SEND_BUFFERS * max(
                0, state.encoder.layout.max_payload_bytes - self._send_buffer_bytes
            )
            max_payload = state.encoder.layout.max_payload_bytes
            if max_payload > self._send_buffer_bytes:
                self._send_buffer_bytes = max_payload
                self._free_buffers.clear()  # reallocated at the new size on first use
        self._shards[shard_id] = state
        self.registrations[shard_id] = Registration(
            shard_id, numel, dtype.name.lower(), category, compressed, reason, memory if compressed else 0
        )
        return compressed

    def _unregister(self, shard_id: int) -> None:
        """Forget a shard registered by a gather that then failed (its first call had a bad shard, or the
        ranks disagreed): the next gather registers it afresh instead of inheriting the bad call's size."""
        state = self._shards.pop(shard_id, None)
        self.registrations.pop(shard_id, None)
        if state is None or not state.compressed:
            return
        largest = max(
            (s.encoder.layout.max_payload_bytes for s in self._shards.values() if s.compressed), default=0
        )
        if largest != self._send_buffer_bytes:
            self._send_buffer_bytes = largest
            self._free_buffers.clear()

    def is_compressed(self, shard_id: int) -> bool:
        return self._shards[shard_id].compressed

    # ----------------------------------------------------------------- send buffers

    def _take_buffer(self) -> np.ndarray:
        try:  # pop is atomic; the CCP worker may take a buffer while the main thread gives one back
            return self._free_buffers.pop()
        except IndexError:
            return np.empty(self._send_buffer_bytes, dtype=np.uint8)

    def _scratch_for(self, state: _ShardState) -> np.ndarray:
        """A kept buffer a payload of ``state`` can be encoded into (the bucket path copies it out)."""
        size = state.encoder.layout.max_payload_bytes
        scratch = getattr(self, "_encode_scratch", None)
        if scratch is None or scratch.size < size:
            scratch = self._encode_scratch = np.empty(max(size, self._send_buffer_bytes), dtype=np.uint8)
        return scratch

    def all_gather_bucket(self, shards, shard_ids, outputs=None):
        """Gather a bucket of shards in one collective (one round in steady state): see
        :mod:`ciera_runtime.bucket`. Returns a handle whose ``wait()`` gives the gathered tensors."""
        if self._bucket_path is None:
            from ciera_runtime.bucket import BucketGather

            self._bucket_path = BucketGather(self)
        return self._bucket_path.all_gather(shards, shard_ids, outputs)

    @property
    def bucket_stats(self):
        return None if self._bucket_path is None else self._bucket_path.stats

    def release(self, prepared: PreparedShard) -> None:
        """Return a prepared shard's send buffer without gathering it (a gather does this itself)."""
        buffer, prepared.buffer, prepared.payload = prepared.buffer, None, None
        if buffer is not None and buffer.size == self._send_buffer_bytes:
            if len(self._free_buffers) < _SEND_BUFFERS:
                self._free_buffers.append(buffer)

    # ----------------------------------------------------------------- the gather

    def prepare(self, shard: torch.Tensor, shard_id: int) -> PreparedShard:
        """Validate and encode ``shard`` for its next gather (change detection + rANS); safe to run on a
        worker thread. It never raises for bad input: the error travels with the PreparedShard to the
        gather, where every rank raises it."""
        prepared = PreparedShard(shard_id, shard)
        start_s = time.perf_counter()
        try:
            _check_int("shard_id", shard_id, 0, 1 << 32)
            if not isinstance(shard, torch.Tensor):
                raise ValueError(f"shard is {type(shard).__name__}, expected a torch.Tensor")
            if shard_id not in self._shards:
                self.register(shard_id, shard.numel(), shard.dtype)
                prepared.registered_here = True
            state = self._shards[shard_id]
            prepared.bits = shard_bits(shard, state.dtype, f"shard {shard_id}")
            if prepared.bits.size != state.numel:
                raise ValueError(
                    f"shard {shard_id} has {prepared.bits.size} values, registered with {state.numel}"
                )
            if state.compressed:
                prepared.buffer = self._take_buffer()
                prepared.payload = state.encoder.encode(prepared.bits, out=prepared.buffer)
                prepared.generation = state.encoder.generation
        except Exception as error:  # noqa: BLE001 — reported to every rank by the control round
            self.release(prepared)
            prepared.error, prepared.exception = str(error), error
        end_s = time.perf_counter()
        prepared.encode_s = end_s - start_s
        if self.codec_timer is not None and prepared.payload is not None:
            self.codec_timer("codec_send", prepared.shard_id, start_s, end_s, 0)
        return prepared

    def _check_output(self, output, state: _ShardState) -> str | None:
        if output is None:
            return None
        if not isinstance(output, torch.Tensor):
            return f"output is {type(output).__name__}, expected a torch.Tensor"
        if output.device.type != "cpu":
            return f"output is on {output.device}: the codec backends in this build work on CPU tensors"
        if output.dtype != state.torch_dtype:
            return f"output has dtype {output.dtype}, expected {state.torch_dtype}"
        if output.numel() != self.world_size * state.numel:
            return (
                f"output has {output.numel()} elements (shape {tuple(output.shape)}), expected "
                f"world_size x numel = {self.world_size * state.numel}"
            )
        return None

    def all_gather(
        self,
        shard: torch.Tensor | None = None,
        shard_id: int | None = None,
        output: torch.Tensor | None = None,
        prepared: PreparedShard | None = None,
    ) -> AllGatherHandle:
        """Start gathering ``shard`` (or a :class:`PreparedShard`) from every rank into ``output`` (any
        shape with world_size·numel elements, contiguous or not, like all_gather_into_tensor); returns an
        :class:`AllGatherHandle`. Every failure — here or on any other rank — is raised by ``wait()`` on
        every rank as the same GatherError."""
        if prepared is None:
            prepared = self.prepare(shard, shard_id)
        state = self._shards.get(prepared.shard_id) if prepared.error is None else None
        if state is not None and prepared.error is None:
            problem = self._check_output(output, state)
            if problem:
                self.release(prepared)
                prepared.error = problem
        row = self._control_row(prepared, state)
        self.stats.gathers += 1
        self.stats.encode_s += prepared.encode_s
        if self.world_size == 1:
            return AllGatherHandle(lambda: self._finish_alone(prepared, state, output))
        control_send = torch.from_numpy(row.pack(self.world_size).copy())
        if self.fault_injector is not None:
            self.fault_injector("control", prepared.shard_id, control_send.numpy())
        control_recv = torch.empty(self.world_size * control_send.numel(), dtype=torch.uint8)
        work = _all_gather_single(control_recv, control_send, group=self.group, async_op=True)
        self.stats.rounds += 1
        self.stats.bytes_sent += control_send.numel()

        def finish() -> torch.Tensor:
            try:
                return self._finish(prepared, state, output, work, control_recv)
            except GatherError:
                self.stats.failed_gathers += 1
                raise
            finally:
                self.release(prepared)

        return AllGatherHandle(finish)

    def _control_row(self, prepared: PreparedShard, state: _ShardState | None) -> protocol.ControlRow:
        config = self.config
        row = protocol.ControlRow(
            shard_id=prepared.shard_id if isinstance(prepared.shard_id, int) else -1,
            block_size=config.block_size,
            detector=config.detector_code,
            entropy=config.entropy_code,
            verify_every=config.verify_every,
            cache_budget_bytes=-1 if self.cache_budget_bytes is None else self.cache_budget_bytes,
            world_size=self.world_size,
        )
        if prepared.error is not None or state is None:
            row.failed = 1
            row.reason = prepared.error or "shard not registered"
            return row
        row.dtype, row.numel = int(state.dtype), state.numel
        row.mode = protocol.MODE_COMPRESSED if state.compressed else protocol.MODE_RAW
        if state.compressed:
            header = parse_header(prepared.payload, prepared.shard_id, self.rank)
            row.epoch, row.generation = header.epoch, header.generation
            row.full, row.exp_bytes = int(header.full), header.exp_bytes
            row.fixed_bytes = state.encoder.layout.fixed_bytes
            epochs = [0] * self.world_size
            generations = [0] * self.world_size
            for source, decoder in state.decoders.items():
                epochs[source], generations[source] = decoder.epoch, decoder.generation
            row.cache_epochs, row.cache_generations = tuple(epochs), tuple(generations)
        return row

    def _finish_alone(self, prepared: PreparedShard, state, output) -> torch.Tensor:
        self.release(prepared)
        if prepared.error is not None:
            if prepared.registered_here:
                self._unregister(prepared.shard_id)
            self.stats.failed_gathers += 1
            raise GatherError(
                prepared.shard_id, {0: prepared.error}, "gather aborted"
            ) from prepared.exception
        flat = torch.from_numpy(prepared.bits.view(np.int16)).view(state.torch_dtype)
        if output is None:
            return flat.clone()
        output.view(-1).copy_(flat) if output.is_contiguous() else output.copy_(flat.view(output.shape))
        return output

    def _wait(self, work, round_name: str, shard_id: int) -> None:
        start_s = time.perf_counter()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise GatherTimeoutError(
                    shard_id,
                    {self.rank: f"waited {self.timeout_s:g} s in the {round_name} round"},
                    "a rank did not reach the gather (crashed, restarted, or gathering another shard)",
                ) from None
            raise GatherError(
                shard_id, {self.rank: f"{round_name} round failed: {str(error).splitlines()[0]}"}
            ) from error
        finally:
            self.stats.wait_s += time.perf_counter() - start_s

    def _finish(self, prepared: PreparedShard, state, output, work, control_recv) -> torch.Tensor:
        world_size = self.world_size
        shard_id = prepared.shard_id
        self._wait(work, "control", shard_id)
        row_bytes = control_recv.numel() // world_size
        rows = [
            protocol.ControlRow.unpack(row, world_size)
            for row in control_recv.numpy().reshape(world_size, row_bytes)
        ]
        try:
            plan = protocol.make_plan(rows, world_size)
        except GatherError as error:
            if prepared.registered_here:
                self._unregister(shard_id)
            raise error from prepared.exception
        # From here on every rank holds the same plan: same rounds, same sizes.
        # A non-contiguous output is filled through a contiguous buffer, as gloo's raw all-gather does.
        contiguous = output is not None and output.is_contiguous()
        result = output if contiguous else torch.empty(world_size * plan.numel, dtype=state.torch_dtype)
        flat_result = result.view(-1)
        if plan.mode == protocol.MODE_RAW:
            own = torch.from_numpy(prepared.bits.view(np.int16)).view(state.torch_dtype)
            self.stats.raw_gathers += 1
            self.stats.raw_bytes_equivalent += 2 * plan.numel
            self.stats.bytes_sent += 2 * plan.numel
            raw_work = _all_gather_single(flat_result, own, group=self.group, async_op=True)
            self.stats.rounds += 1
            self._wait(raw_work, "raw all-gather", shard_id)
        else:
            self._gather_compressed(prepared, state, plan, flat_result)
        if output is not None and not contiguous:
            output.copy_(result.view(output.shape))
        return output if output is not None else result

    def _gather_compressed(self, prepared, state: _ShardState, plan, flat_result) -> None:
        world_size, rank, stats = self.world_size, self.rank, self.stats
        shard_id, encoder, numel = prepared.shard_id, state.encoder, plan.numel
        stats.raw_bytes_equivalent += 2 * numel
        send = prepared.buffer
        if plan.resync[rank]:
            stats.resyncs += 1
            resync_start_s = time.perf_counter()
            payload = encoder.encode_resync(prepared.bits, generation=prepared.generation, out=send)
            if self.codec_timer is not None:
                self.codec_timer("codec_send", shard_id, resync_start_s, time.perf_counter(), 0)
        else:
            payload = prepared.payload
        send[payload.size : plan.row_bytes] = 0
        if self.fault_injector is not None:
            self.fault_injector("send", shard_id, send[: plan.row_bytes])
        send_tensor = torch.from_numpy(send[: plan.row_bytes])
        recv = torch.empty(world_size * plan.row_bytes, dtype=torch.uint8)
        bulk_work = _all_gather_single(recv, send_tensor, group=self.group, async_op=True)
        stats.rounds += 1
        stats.bytes_sent += plan.row_bytes
        self._wait(bulk_work, "bulk", shard_id)
        received = recv.numpy().reshape(world_size, plan.row_bytes)
        if self.fault_injector is not None:
            self.fault_injector("receive", shard_id, received)
        decode_start_s = time.perf_counter()
        out_bits = flat_result.view(torch.int16).numpy().view(np.uint16)
        out_bits[rank * numel : (rank + 1) * numel] = prepared.bits
        failure = ""
        for source in range(world_size):
            if source == rank:
                continue
            target = out_bits[source * numel : (source + 1) * numel]
            row = received[source, : plan.fixed_bytes + plan.variable_bytes[source]]
            try:
                header = parse_header(row, shard_id, source)
                if plan.resync[source] and not header.full:
                    raise CieraError(f"shard {shard_id} from rank {source}: resync payload is not full")
                state.decoders[source].decode(row, out=target, expected=plan.expected[source])
            except (CieraError, ValueError) as error:
                failure = f"rebuilding rank {source}'s shard: {error}"
                break
        decode_end_s = time.perf_counter()
        stats.decode_s += decode_end_s - decode_start_s
        if self.codec_timer is not None:
            self.codec_timer("codec_recv", shard_id, decode_start_s, decode_end_s, 2 * numel * world_size)
        status_send = torch.from_numpy(protocol.pack_status(bool(failure), failure).copy())
        status_recv = torch.empty(world_size * status_send.numel(), dtype=torch.uint8)
        status_work = _all_gather_single(status_recv, status_send, group=self.group, async_op=True)
        stats.rounds += 1
        stats.bytes_sent += status_send.numel()
        self._wait(status_work, "status", shard_id)
        failures = protocol.status_failures(status_recv.numpy().reshape(world_size, -1))
        stats.history.append(
            {
                "shard_id": shard_id,
                "row_bytes": plan.row_bytes,
                "resync": any(plan.resync),
                "ok": not failures,
            }
        )
        if len(stats.history) > 1024:
            del stats.history[:512]
        if failures:
            raise GatherError(shard_id, failures, "gather failed, no rank returns weights")


def compressed_all_gather(
    shard: torch.Tensor,
    shard_id: int,
    engine: CompressedAllGather,
    output: torch.Tensor | None = None,
) -> AllGatherHandle:
    """Gather ``shard`` from every rank of ``engine.group``; ``.wait()`` on the handle gives a tensor equal
    bit for bit to ``all_gather_into_tensor`` of the raw shards, or raises the same error on every rank."""
    return engine.all_gather(shard, shard_id, output=output)
