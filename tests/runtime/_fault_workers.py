"""Distributed fault injection: spawned gloo ranks run many gathers, each under one injected fault, and
report per gather what they got — exact weights, an error (its message), or wrong weights.

Every rank draws the same fault plan from a shared seed (which fault, which rank injects it, which
shard), so all ranks know what was injected; weights and their updates differ per rank.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from _dist_workers import init_gloo

SENDER_FAULTS = ("send_flip", "send_truncate", "send_garbage", "send_replay", "send_swap_shard")
RECEIVER_FAULTS = ("recv_flip", "recv_truncate", "recv_garbage", "recv_replay", "recv_swap_rows")
CONTROL_FAULTS = ("control_flip",)
CALLER_FAULTS = (
    "output_float32",
    "output_short",
    "output_noncontiguous",
    "output_2d",
    "shard_float32",
    "shard_wrong_numel",
    "shard_not_tensor",
    "shard_noncontiguous",
)
CONFIG_FAULTS = (
    "block_size_mismatch",
    "detector_mismatch",
    "budget_mismatch",
    "compress_false_on_one",
    "registration_order",
    "numel_mismatch",
    "dtype_mismatch",
    "different_shard",
)
LIFECYCLE_FAULTS = ("restart", "none")
ALL_FAULTS = (
    SENDER_FAULTS + RECEIVER_FAULTS + CONTROL_FAULTS + CALLER_FAULTS + CONFIG_FAULTS + LIFECYCLE_FAULTS
)

SHAPES = {0: (3000, torch.bfloat16), 1: (1537, torch.float16)}


class Injector:
    """The engine's fault hook: records this rank's sent and received bulk rows (for replays) and, when
    armed, corrupts one of them."""

    def __init__(self, rank: int, world_size: int, rng: np.random.Generator) -> None:
        self.rank, self.world_size, self.rng = rank, world_size, rng
        self.fault: str | None = None
        self.sent: dict[int, list[np.ndarray]] = {}
        self.received: dict[int, list[np.ndarray]] = {}

    def _corrupt(self, data: np.ndarray, kind: str) -> None:
        size = data.size
        if kind.endswith("flip"):
            for _ in range(int(self.rng.integers(1, 4))):
                data[int(self.rng.integers(0, size))] ^= np.uint8(1 << int(self.rng.integers(0, 8)))
        elif kind.endswith("truncate"):  # the tail never arrived: zeros from a random point on
            data[int(self.rng.integers(0, size)) :] = 0
        elif kind.endswith("garbage"):
            start = int(self.rng.integers(0, size))
            stop = min(size, start + int(self.rng.integers(1, 256)))
            data[start:stop] = self.rng.integers(0, 256, stop - start, dtype=np.uint8)

    @staticmethod
    def _overwrite(data: np.ndarray, old: np.ndarray) -> None:
        n = min(data.size, old.size)
        data[:n] = old[:n]
        data[n:] = 0

    def __call__(self, point: str, shard_id: int, data: np.ndarray) -> None:
        fault = self.fault
        if point == "control":
            if fault == "control_flip":
                self._corrupt(data, "flip")
            return
        if point == "send":
            history = self.sent.setdefault(shard_id, [])
            if fault in ("send_flip", "send_truncate", "send_garbage"):
                self._corrupt(data, fault)
            elif fault == "send_replay" and history:
                self._overwrite(data, history[int(self.rng.integers(0, len(history)))])
            elif fault == "send_swap_shard":
                other = self.sent.get(1 - shard_id)
                if other:
                    self._overwrite(data, other[-1])
            history.append(data.copy())
            del history[:-4]
            return
        # point == "receive": rows of every source, this rank only
        history = self.received.setdefault(shard_id, [])
        sources = [s for s in range(self.world_size) if s != self.rank]
        source = sources[int(self.rng.integers(0, len(sources)))]
        if fault in ("recv_flip", "recv_truncate", "recv_garbage"):
            self._corrupt(data[source], fault)
        elif fault == "recv_replay" and history:
            self._overwrite(data[source], history[int(self.rng.integers(0, len(history)))][source])
        elif fault == "recv_swap_rows":
            if len(sources) > 1:
                a, b = sources[0], sources[1]
                data[[a, b]] = data[[b, a]]
            elif history:
                self._overwrite(data[source], history[-1][source])
        history.append(data.copy())
        del history[:-4]


def _raw_gather(weight: torch.Tensor, world_size: int) -> torch.Tensor:
    expected = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, weight)
    return expected


def _outcome(got: torch.Tensor, expected: torch.Tensor) -> str:
    same = got.numel() == expected.numel() and torch.equal(
        got.reshape(-1).view(torch.int16), expected.view(torch.int16)
    )
    return "exact" if same else "wrong"


def fault_injection_worker(
    rank: int, world_size: int, port: int, injections: int, seed: int, faults: tuple, result_queue
) -> None:
    from ciera_runtime import CieraError, CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        plan_rng = np.random.default_rng(seed)  # identical on every rank
        local_rng = np.random.default_rng(seed * 1000 + rank)
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        config = CodecConfig(block_size=256, detector="hash", verify_every=5)
        timeout_s = 30.0
        engine = CompressedAllGather(config=config, timeout_s=timeout_s)
        injector = Injector(rank, world_size, local_rng)
        engine.fault_injector = injector
        weights = {
            sid: (torch.randn(n, generator=generator) * 0.02).to(dt) for sid, (n, dt) in SHAPES.items()
        }
        records = []
        order: list[int] = []
        for index in range(injections):
            if not order:  # every fault once per cycle, in a shuffled order
                order = list(plan_rng.permutation(len(faults)))
            fault = faults[order.pop()]
            target = int(plan_rng.integers(0, world_size))
            shard_id = int(plan_rng.integers(0, len(SHAPES)))
            changes = int(plan_rng.integers(0, 4))  # 0: an unchanged re-gather (recompute, backward)
            weight = weights[shard_id]
            if changes:
                picked = torch.randint(0, weight.numel(), (changes,), generator=generator)
                weight[picked] = weight[picked] * 1.9
            expected = _raw_gather(weight, world_size)
            me = rank == target
            use_engine, shard, gather_id = engine, weight, shard_id
            output = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
            injector.fault = fault if me else None
            if me and fault == "restart":  # fresh engine: empty caches, new epochs
                engine = CompressedAllGather(config=config, timeout_s=timeout_s)
                engine.fault_injector = injector
                use_engine = engine
            elif fault in CONFIG_FAULTS:
                use_engine, shard, gather_id, output = _config_fault(
                    fault, me, config, timeout_s, weight, shard_id, weights, world_size, index
                )
            elif me and fault in CALLER_FAULTS:
                shard, output = _caller_fault(fault, weight, output, world_size)
            start_s = time.perf_counter()
            try:
                got = use_engine.all_gather(shard, gather_id, output=output).wait()
                outcome, message = _outcome(got, expected), ""
            except CieraError as error:
                outcome, message = "error", str(error)
            records.append((index, fault, target, outcome, message, time.perf_counter() - start_s))
            injector.fault = None
        # Whatever happened, the engine is still usable: a clean gather of every shard is exact.
        final = []
        for shard_id, weight in weights.items():
            final.append(
                _outcome(engine.all_gather(weight, shard_id).wait(), _raw_gather(weight, world_size))
            )
        result_queue.put((rank, records, final, engine.stats.resyncs, engine.stats.failed_gathers))
    finally:
        dist.destroy_process_group()


def _config_fault(fault, me, config, timeout_s, weight, shard_id, weights, world_size, index):
    """A throw-away engine (or shard) for this gather, configured differently on the target rank."""
    from dataclasses import replace

    from ciera_runtime import CompressedAllGather

    output = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
    fresh_id = 100 + index
    if fault == "block_size_mismatch":
        engine_config = replace(config, block_size=128) if me else config
        return CompressedAllGather(config=engine_config, timeout_s=timeout_s), weight, fresh_id, output
    if fault == "detector_mismatch":
        engine_config = replace(config, detector="exact") if me else config
        return CompressedAllGather(config=engine_config, timeout_s=timeout_s), weight, fresh_id, output
    if fault == "budget_mismatch":  # the target's budget is too small for this shard
        budget = 1000 if me else 1 << 30
        return (
            CompressedAllGather(config=config, cache_budget_bytes=budget, timeout_s=timeout_s),
            weight,
            0,
            output,
        )
    engine = CompressedAllGather(config=config, timeout_s=timeout_s)
    if fault == "compress_false_on_one":
        engine.register(fresh_id, weight.numel(), weight.dtype, compress=not me)
        return engine, weight, fresh_id, output
    if fault == "registration_order":  # same budget; the target registers another shard first
        other = weights[1 - shard_id]
        budget_for_one = engine.memory_for(max(weight.numel(), other.numel()), "bf16") + 16
        engine = CompressedAllGather(config=config, cache_budget_bytes=budget_for_one, timeout_s=timeout_s)
        order = (
            [(1 - shard_id, other), (shard_id, weight)] if me else [(shard_id, weight), (1 - shard_id, other)]
        )
        for sid, tensor in order:
            engine.register(sid, tensor.numel(), tensor.dtype)
        return engine, weight, shard_id, output
    if fault == "numel_mismatch":
        shard = weight[:-1].clone() if me else weight
        output = torch.empty(world_size * shard.numel(), dtype=weight.dtype)
        return engine, shard, fresh_id, output
    if fault == "dtype_mismatch":
        other_dtype = torch.float16 if weight.dtype == torch.bfloat16 else torch.bfloat16
        shard = weight.to(other_dtype) if me else weight
        output = torch.empty(world_size * shard.numel(), dtype=shard.dtype)
        return engine, shard, fresh_id, output
    # different_shard: the target gathers the other shard in this call
    for sid, tensor in weights.items():
        engine.register(sid, tensor.numel(), tensor.dtype)
    if me:
        other = weights[1 - shard_id]
        return engine, other, 1 - shard_id, torch.empty(world_size * other.numel(), dtype=other.dtype)
    return engine, weight, shard_id, output


def _caller_fault(fault, weight, output, world_size):
    n = weight.numel()
    if fault == "output_float32":
        return weight, torch.empty(world_size * n)
    if fault == "output_short":
        return weight, torch.empty(world_size * n - 1, dtype=weight.dtype)
    if fault == "output_noncontiguous":  # handled like the raw all-gather: exact weights
        return weight, torch.empty(2 * world_size * n, dtype=weight.dtype)[::2]
    if fault == "output_2d":  # (W, n): the right number of elements, handled
        return weight, torch.empty(world_size, n, dtype=weight.dtype)
    if fault == "shard_float32":
        return weight.float(), output
    if fault == "shard_wrong_numel":
        return weight[:-3], output
    if fault == "shard_not_tensor":
        return weight.tolist(), output
    # shard_noncontiguous: handled (read through a contiguous copy): exact weights
    doubled = torch.empty(2 * n, dtype=weight.dtype)
    doubled[::2] = weight
    return doubled[::2], output


def missing_rank_worker(rank: int, world_size: int, port: int, timeout_s: float, result_queue) -> None:
    """The last rank never arrives at the second gather: every other rank must raise within the timeout."""
    from ciera_runtime import CodecConfig, CompressedAllGather, GatherTimeoutError

    init_gloo(rank, world_size, port)
    engine = CompressedAllGather(config=CodecConfig(), timeout_s=timeout_s)
    weight = (torch.randn(4096, generator=torch.Generator().manual_seed(rank)) * 0.02).to(torch.bfloat16)
    engine.all_gather(weight, 0).wait()
    if rank == world_size - 1:
        time.sleep(timeout_s + 3)  # "crashed": never reaches the gather
        result_queue.put((rank, "absent", 0.0))
        return
    start_s = time.perf_counter()
    try:
        engine.all_gather(weight, 0).wait()
        outcome = "returned"
    except GatherTimeoutError as error:
        outcome = f"timeout: {error}"
    result_queue.put((rank, outcome, time.perf_counter() - start_s))
