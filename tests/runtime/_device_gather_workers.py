"""Workers of the device-gather tests (spawned gloo ranks on CPU tensors, the code the GPU runs)."""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _dist_workers import init_gloo

from ciera_runtime.device_gather import _HEADER_BYTES, HostReadCounter


def _close() -> None:
    """Leave the group together: a rank that tears down its gloo pairs while the other is still using
    them can abort the other's process."""
    dist.barrier()
    dist.destroy_process_group()


SHAPES = {0: (5000, torch.bfloat16), 1: (1537, torch.float16), 2: (0, torch.bfloat16), 3: (7, torch.float16)}
STEPS = 8


def _weights(rank: int) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return {sid: (torch.randn(n, generator=generator) * 0.02).to(dt) for sid, (n, dt) in SHAPES.items()}


def _update(weights: dict[int, torch.Tensor], generator: torch.Generator) -> None:
    """A small step: a few values scaled, so some exponents cross a power of two."""
    for weight in weights.values():
        if weight.numel():
            index = torch.randint(0, weight.numel(), (5,), generator=generator)
            weight[index] = weight[index] * 1.7


def _raw(weight: torch.Tensor, world_size: int) -> torch.Tensor:
    expected = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, weight)
    return expected


def steady_worker(rank: int, world_size: int, port: int, entropy: str, result_queue) -> None:
    """STEPS steps of prepare, gathers (one call of two shards, then each shard again, as recompute and
    backward do), check: bit-identical to the raw all-gather, host reads counted per phase."""
    from ciera_runtime.device_gather import DeviceGather

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(7 + rank)
        weights = _weights(rank)
        gather = DeviceGather("cpu", block_size=64, entropy=entropy)
        gather.register(weights)
        mismatches, gathers, over_raw, coded_payloads = 0, 0, 0, 0
        steady_reads: collections.Counter = collections.Counter()
        for step in range(STEPS):
            gather.prepare(weights)
            # Header word 7: whether the payload's changed exponents are a rANS stream.
            coded_payloads += sum(
                int(state.payload[:_HEADER_BYTES].view(torch.int64)[7]) for state in gather._shards.values()
            )
            expected = {sid: _raw(w, world_size) for sid, w in weights.items()}
            # At step 2 shard 0 is prepared but never gathered: its receivers stay where they were, and
            # its next payload must be a delta on that, not on what it was never sent.
            calls = [[0, 1], [2, 3], [0], [1], [3, 2]] if step != 2 else [[1], [2, 3], [1], [3, 2]]
            counter = HostReadCounter()
            handles = []
            with counter:
                for call in calls:
                    sent_before = gather.stats.bytes_sent
                    handles.append(gather.all_gather(call, [weights[s] for s in call]))
                    raw = sum(2 * weights[s].numel() for s in call)
                    over_raw += gather.stats.bytes_sent - sent_before > raw
                results = [handle.wait() for handle in handles]
            if step > 0:
                steady_reads.update(counter.counts)
            for call, gathered in zip(calls, results, strict=True):
                for sid, got in zip(call, gathered, strict=True):
                    gathers += 1
                    mismatches += not torch.equal(got.view(torch.int16), expected[sid].view(torch.int16))
            gather.check()
            _update(weights, generator)
        result_queue.put(
            (
                rank,
                mismatches,
                gathers,
                dict(steady_reads),
                gather.stats.host_reads,
                gather.stats.bytes_sent,
                gather.stats.raw_bytes_equivalent,
                over_raw,
                coded_payloads,
            )
        )
    finally:
        _close()


def fault_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """A byte of one received slot flipped on one rank at one step: that rank's outputs may be wrong, but
    check() raises the same error on every rank, the step is never 'applied', and the next step (sent in
    full) is exact again."""
    from ciera_runtime.device_gather import DeviceGather
    from ciera_runtime.errors import GatherError

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(7 + rank)
        weights = _weights(rank)
        gather = DeviceGather("cpu", block_size=64)
        gather.register(weights)
        outcomes = []
        for step in range(6):
            gather.prepare(weights)
            expected = {sid: _raw(w, world_size) for sid, w in weights.items()}

            def flip(rows: torch.Tensor, step: int = step) -> None:
                if step in (2, 4) and rank == 0 and rows.shape[1]:  # an empty shard's slot is empty
                    source = 1
                    rows[source, (37 * step) % rows.shape[1]] ^= 0x10

            gather.fault_injector = flip
            exact = True
            for sid, weight in weights.items():
                got = gather.all_gather([sid], [weight]).wait()[0]
                exact &= torch.equal(got.view(torch.int16), expected[sid].view(torch.int16))
            try:
                gather.check()
                outcomes.append(("applied", bool(exact)))
            except GatherError as error:
                outcomes.append(("refused", str(error).splitlines()[0][:60]))
            _update(weights, generator)
        result_queue.put((rank, outcomes))
    finally:
        _close()


def mismatch_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """Ranks that register different shard sets fail the same ConfigMismatchError."""
    from ciera_runtime.device_gather import DeviceGather
    from ciera_runtime.errors import ConfigMismatchError

    init_gloo(rank, world_size, port)
    try:
        weights = {0: torch.zeros(100 + rank, dtype=torch.bfloat16)}
        try:
            DeviceGather("cpu").register(weights)
            result_queue.put((rank, "registered"))
        except ConfigMismatchError as error:
            result_queue.put((rank, type(error).__name__))
    finally:
        _close()


FAULTS = ("none", "flip_byte", "zero_row", "swap_rows", "replay_row", "edit_shard", "flip_header")


@dataclass
class _Fault:
    """One step's fault, injected on the victim rank into the received rows of one source."""

    fault: str
    victim: int
    source: int
    position: float
    rank: int
    world_size: int
    previous_rows: dict

    def hook(self, rows: torch.Tensor, call: int) -> None:
        genuine = rows[self.source].clone()
        if self.rank == self.victim:
            self._inject(rows, call)
        self.previous_rows[call] = genuine

    def _inject(self, rows: torch.Tensor, call: int) -> None:
        source, width, fault = self.source, rows.shape[1], self.fault
        if width == 0:  # an empty shard's slot: nothing to corrupt
            return
        if fault == "flip_byte":
            rows[source, int(self.position * width)] ^= 1 << int(self.position * 8)
        elif fault == "flip_header":
            rows[source, int(self.position * 48) % width] ^= 0x40
        elif fault == "zero_row":
            rows[source] = 0
        elif fault == "swap_rows" and self.world_size > 2:
            other = next(r for r in range(self.world_size) if r not in (self.victim, source))
            rows[[source, other]] = rows[[other, source]].clone()
        elif fault == "swap_rows":
            rows[source] = rows[source].roll(8)
        elif fault == "replay_row":
            previous = self.previous_rows.get(call)
            if previous is not None and previous.shape == rows[source].shape:
                rows[source] = previous


def random_fault_worker(rank: int, world_size: int, port: int, steps: int, seed: int, result_queue) -> None:
    """`steps` steps, each with one fault drawn the same on every rank (which rank suffers it, where):
    per step, every rank either applies it with outputs equal to the raw all-gather, or refuses it at
    check() — the outcome is compared across ranks by the test."""
    import random

    from ciera_runtime.device_gather import DeviceGather
    from ciera_runtime.errors import GatherError

    init_gloo(rank, world_size, port)
    try:
        draw = random.Random(seed)
        generator = torch.Generator().manual_seed(7 + rank)
        weights = _weights(rank)
        gather = DeviceGather("cpu", block_size=64)
        gather.register(weights)
        previous_rows: dict[int, torch.Tensor] = {}
        outcomes = []
        for _ in range(steps):
            fault = draw.choice(FAULTS)
            victim = draw.randrange(world_size)
            source = draw.choice([r for r in range(world_size) if r != victim])
            position = draw.random()
            gather.prepare(weights)
            expected = {sid: _raw(w, world_size) for sid, w in weights.items()}
            if fault == "edit_shard" and rank == victim:
                weights[0][0] = weights[0][0] * 2  # after prepare: the others rebuild the old value

            fault_at = _Fault(fault, victim, source, position, rank, world_size, previous_rows)
            exact = True
            for call, sid in enumerate(sorted(weights)):
                gather.fault_injector = functools.partial(fault_at.hook, call=call)
                got = gather.all_gather([sid], [weights[sid]]).wait()[0]
                exact &= torch.equal(got.view(torch.int16), expected[sid].view(torch.int16))
            exact_everywhere = torch.tensor([int(exact)])
            dist.all_reduce(exact_everywhere, op=dist.ReduceOp.MIN)
            try:
                gather.check()
                outcomes.append((fault, "applied", bool(exact_everywhere.item())))
            except GatherError as error:
                outcomes.append((fault, "refused", str(error)))
            if fault == "edit_shard" and rank == victim:
                weights[0][0] = weights[0][0] / 2  # undo: the weights stay those of the reference
            _update(weights, generator)
        result_queue.put((rank, outcomes))
    finally:
        _close()
