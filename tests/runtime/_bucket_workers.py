"""Spawned gloo workers for the bucket path (one collective per engine all-gather)."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from _dist_workers import init_gloo
from _fault_workers import CALLER_FAULTS, CONTROL_FAULTS, RECEIVER_FAULTS, SENDER_FAULTS, Injector

# Shards of one bucket: sizes that need padding, both dtypes, a tiny one (goes raw: payload > raw).
BUCKET_SHAPES = {
    10: (5000, torch.bfloat16),
    11: (1537, torch.bfloat16),
    12: (7, torch.bfloat16),
    13: (3000, torch.float16),
}


def raw_gather(weight: torch.Tensor, world_size: int) -> torch.Tensor:
    expected = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, weight)
    return expected


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.numel() == expected.numel() and torch.equal(
        got.reshape(-1).view(torch.int16), expected.reshape(-1).view(torch.int16)
    )


def _perturb(weights, fraction: float, generator: torch.Generator) -> None:
    """Scale a share ``fraction`` of each weight's values by 1.7 (their exponents move)."""
    for weight in weights:
        picked = torch.rand(weight.numel(), generator=generator) < fraction
        weight[picked] = weight[picked] * 1.7


def bucket_steady_worker(
    rank: int, world_size: int, port: int, iterations: int, entropy: str, result_queue
) -> None:
    """Buckets of changing weights, three gathers per iteration (forward, recompute, backward), and a
    churn burst half-way (overflow rounds); every result equals the raw all-gather."""
    from ciera_runtime import CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(7 + rank)
        config = CodecConfig(block_size=64, detector="hash", verify_every=4, entropy=entropy)
        engine = CompressedAllGather(config=config)
        weights = {
            sid: (torch.randn(n, generator=generator) * 0.02).to(dt) for sid, (n, dt) in BUCKET_SHAPES.items()
        }
        buckets = [(10, 11), (12, 13), (10, 11, 12, 13)]
        mismatches = gathers = 0
        for iteration in range(iterations):
            _perturb(weights.values(), 0.5 if iteration == iterations // 2 else 0.01, generator)
            for _ in range(3):
                for ids in buckets:
                    shards = [weights[sid] for sid in ids]
                    outputs = [torch.empty(world_size * s.numel(), dtype=s.dtype) for s in shards]
                    got = engine.all_gather_bucket(shards, ids, outputs).wait()
                    for shard, result in zip(shards, got, strict=True):
                        mismatches += not same_bits(result, raw_gather(shard, world_size))
                        gathers += 1
        stats, bucket_stats = engine.stats, engine.bucket_stats
        result_queue.put(
            (
                rank,
                mismatches,
                gathers,
                bucket_stats.calls,
                bucket_stats.overflow_rounds,
                bucket_stats.registrations,
                stats.rounds,
                stats.bytes_sent,
                stats.raw_bytes_equivalent,
                bucket_stats.raw_messages,
                bucket_stats.seed_messages,
                bucket_stats.payload_messages,
            )
        )
    finally:
        dist.destroy_process_group()


def _all_weights(seed: int, world_size: int, step: int) -> list[list[torch.Tensor]]:
    """Every rank's weights at ``step``, computable on any rank: expected results need no collective (a
    rank that failed must not run collectives the others do not)."""
    result = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(seed * 100 + rank)
        weights = [(torch.randn(4000, generator=generator) * 0.02).to(torch.bfloat16) for _ in range(2)]
        for past in range(step + 1):
            weights[0][past] = weights[0][past] * 1.5
        result.append(weights)
    return result


def bucket_failure_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """A decode failure on rank 1 (a received message corrupted): it raises now; the others return exact
    weights now and raise the same error at their next call (from the group's store); then every rank's
    next call re-creates the CIERA groups and every gather is exact again."""
    from ciera_runtime import CieraError, CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        engine = CompressedAllGather(config=CodecConfig(block_size=64), timeout_s=30)
        armed = [False]

        def corrupt(point: str, shard_id: int, data: np.ndarray) -> None:
            if point == "receive" and rank == 1 and armed[0]:
                data[0, 100] ^= 0x40  # a byte inside rank 0's first message

        engine.fault_injector = corrupt
        log = []
        for call in range(7):
            armed[0] = call == 2
            everyone = _all_weights(3, world_size, call)
            try:
                got = engine.all_gather_bucket(everyone[rank], (0, 1)).wait()
                exact = all(
                    same_bits(got[i], torch.cat([everyone[r][i] for r in range(world_size)]))
                    for i in range(2)
                )
                log.append((call, "exact" if exact else "wrong", ""))
            except CieraError as error:
                log.append((call, "error", str(error)))
        result_queue.put((rank, log, engine._bucket_path.recoveries))
    finally:
        dist.destroy_process_group()


def bucket_stall_worker(rank: int, world_size: int, port: int, timeout_s: float, result_queue) -> None:
    """Rank 1 stalls past the timeout before its fourth call: rank 0 gives up on that round. Rank 1's
    round then pairs with the one rank 0 abandoned (exact), and its next call must learn of rank 0's
    failure from the store at once, not by its own timeout, so both meet at the recovery. Each rank makes
    two more calls after its error: the recovery and one more, exact."""
    from ciera_runtime import CieraError, CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        engine = CompressedAllGather(config=CodecConfig(block_size=64), timeout_s=timeout_s)
        log, errors_at, call = [], None, 0
        while errors_at is None or call <= errors_at + 2:
            if rank == 1 and call == 3:
                time.sleep(timeout_s + 1.0)
            # From the stall on, rank 1's calls are one behind rank 0's: the weights stay put, so what
            # each call pairs with is still known.
            everyone = _all_weights(3, world_size, min(call, 3))
            start_s = time.perf_counter()
            try:
                got = engine.all_gather_bucket(everyone[rank], (0, 1)).wait()
                exact = all(
                    same_bits(got[i], torch.cat([everyone[r][i] for r in range(world_size)]))
                    for i in range(2)
                )
                log.append((call, "exact" if exact else "wrong", "", time.perf_counter() - start_s))
            except CieraError as error:
                log.append((call, "error", str(error), time.perf_counter() - start_s))
                errors_at = call if errors_at is None else errors_at
            call += 1
            if call > 12:
                break
        path = engine._bucket_path
        result_queue.put((rank, log, path.recoveries, path.unfinished_rounds()))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- fault injection

# The per-shard suite's faults (a bucket has no other shard's row to swap in), and the bucket path's own.
BUCKET_FAULTS = (
    *(fault for fault in SENDER_FAULTS if fault != "send_swap_shard"),
    *RECEIVER_FAULTS,
    *CONTROL_FAULTS,
    *CALLER_FAULTS,
    "numel_mismatch",
    "dtype_mismatch",
    "different_bucket",
    "churn_burst",
    "none",
)
FAULT_SHAPES = ((3000, torch.bfloat16), (1537, torch.float16), (40, torch.bfloat16))


def bucket_fault_worker(
    rank: int, world_size: int, port: int, injections: int, seed: int, detector: str, result_queue
) -> None:
    """Each injection: one gather of the bucket under one fault (drawn from the same plan on every rank,
    injected by one rank), then two clean gathers. Every rank records (outcome, message) of all three.
    Expected results are computed locally (every rank replays every rank's weights), so a rank that
    failed runs no collective the others do not."""
    from ciera_runtime import CieraError, CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        plan_rng = np.random.default_rng(seed)
        # Odd seeds run without an entropy stage: every full payload is then raw-sized and goes as a seed
        # (raw values that fill the receivers' caches), so the faults meet seeds as often as payloads.
        entropy = "none" if seed % 2 else "rans"
        # The exact detector takes the one-call bucket passes (ciera_runtime/bucket_codec.py) wherever they
        # apply (here at any shard count), the hash detector the per-shard loop.
        from ciera_runtime import bucket_codec

        bucket_codec.MIN_SHARDS = 1
        config = CodecConfig(block_size=64, detector=detector, verify_every=5, entropy=entropy)
        engine = CompressedAllGather(config=config, timeout_s=20.0)
        injector = Injector(rank, world_size, np.random.default_rng(seed * 1000 + rank))
        engine.fault_injector = injector
        generators = [torch.Generator().manual_seed(seed * 100 + r) for r in range(world_size)]
        weights = [
            [(torch.randn(n, generator=generators[r]) * 0.02).to(dt) for n, dt in FAULT_SHAPES]
            for r in range(world_size)
        ]
        ids = tuple(range(len(FAULT_SHAPES)))
        records = []
        fresh = 1000

        def step(fraction: float) -> None:
            for r in range(world_size):
                for weight in weights[r]:
                    picked = torch.rand(weight.numel(), generator=generators[r]) < fraction
                    weight[picked] = weight[picked] * 1.9

        def gather(shards, gather_ids, outputs=None):
            try:
                got = engine.all_gather_bucket(shards, gather_ids, outputs).wait()
            except CieraError as error:
                return "error", str(error)
            return "got", got

        def check(result, expected_ids) -> tuple[str, str]:
            kind, value = result
            if kind == "error":
                return kind, value
            exact = all(
                same_bits(got, torch.cat([weights[r][i] for r in range(world_size)]))
                for got, i in zip(value, expected_ids, strict=True)
            )
            return ("exact" if exact else "wrong"), ""

        order: list[int] = []
        for index in range(injections):
            if not order:
                order = list(plan_rng.permutation(len(BUCKET_FAULTS)))
            fault = BUCKET_FAULTS[order.pop()]
            target = int(plan_rng.integers(0, world_size))
            step(float(plan_rng.choice([0.0, 0.001, 0.01])))
            me = rank == target
            shards = list(weights[rank])
            gather_ids, outputs, expected_ids = ids, None, list(range(len(ids)))
            injector.fault = fault if me else None
            if fault == "churn_burst":  # every rank: far more changed blocks than the area was sized for
                step(0.5)
                shards = list(weights[rank])
            elif fault == "control_flip" or fault in ("numel_mismatch", "dtype_mismatch", "different_bucket"):
                fresh += 10  # a new bucket: its first gather registers it
                gather_ids = (fresh, fresh + 1)
                shards, expected_ids = shards[:2], [0, 1]
                if me and fault == "numel_mismatch":
                    shards[0] = shards[0][:-1].clone()
                elif me and fault == "dtype_mismatch":
                    shards[0] = shards[0].to(torch.float16)
                elif me and fault == "different_bucket":
                    gather_ids = (fresh + 2, fresh + 1)
            elif me and fault.startswith(("output_", "shard_")):
                n = [s.numel() for s in shards]
                outputs = [torch.empty(world_size * k, dtype=s.dtype) for k, s in zip(n, shards, strict=True)]
                if fault == "output_float32":
                    outputs[0] = torch.empty(world_size * n[0])
                elif fault == "output_short":
                    outputs[0] = torch.empty(world_size * n[0] - 1, dtype=shards[0].dtype)
                elif fault == "output_noncontiguous":
                    outputs[0] = torch.empty(2 * world_size * n[0], dtype=shards[0].dtype)[::2]
                elif fault == "output_2d":
                    outputs[0] = torch.empty(world_size, n[0], dtype=shards[0].dtype)
                elif fault == "shard_float32":
                    shards[0] = shards[0].float()
                elif fault == "shard_wrong_numel":
                    shards[0] = shards[0][:-3]
                elif fault == "shard_not_tensor":
                    shards[0] = shards[0].tolist()
                elif fault == "shard_noncontiguous":
                    doubled = torch.empty(2 * n[0], dtype=shards[0].dtype)
                    doubled[::2] = shards[0]
                    shards[0] = doubled[::2]
            start_s = time.perf_counter()
            outcomes = [check(gather(shards, gather_ids, outputs), expected_ids)]
            injector.fault = None
            for _ in range(2):
                outcomes.append(check(gather(list(weights[rank]), ids), list(range(len(ids)))))
            records.append((index, fault, target, outcomes, time.perf_counter() - start_s))
        stats = engine.bucket_stats
        path = engine._bucket_path
        result_queue.put(
            (
                rank,
                records,
                stats.overflow_rounds,
                stats.calls,
                path.recoveries,
                path.drained_rounds,
                path.unfinished_rounds(),
                stats.seed_messages,
                stats.one_call_rebuilds,
            )
        )
    finally:
        # No destroy_process_group: like a training script that forgets it, the process just ends. It
        # must end cleanly: every round a failure left unpaired was paired at the recovery (a drain).
        pass


# Shards of the one-call bucket test: both dtypes, a tiny one (never smaller than raw: goes raw), and one
# too large for the one-call passes (a bucket holding it takes the per-shard loop, and it shares shard 20
# with a one-call bucket: the loop's plane swap must not confuse the one-call path).
ONE_CALL_SHAPES = {
    20: (3000, torch.bfloat16),
    21: (1537, torch.float16),
    22: (40, torch.bfloat16),
    23: (700, torch.bfloat16),
    24: (70000, torch.bfloat16),
}
ONE_CALL_BUCKETS = ((20, 21, 22, 23), (21, 23), (24, 20))


def one_call_rows_worker(
    rank: int, world_size: int, port: int, entropy: str, verify_every: int, result_queue
) -> None:
    """The same gathers twice, with the one-call bucket passes and with the per-shard loop (the module's
    switch turned off): every row sent, every result and every cache position must be the same (epochs
    are fixed per shard, so the rows can be compared byte for byte)."""
    from ciera_runtime import CodecConfig, CompressedAllGather, bucket_codec

    init_gloo(rank, world_size, port)
    usable = bucket_codec.usable
    bucket_codec.MIN_SHARDS = 1  # buckets this small take the per-shard loop in training (slower there)
    try:
        runs = []
        for one_call in (True, False):
            bucket_codec.usable = usable if one_call else (lambda: False)
            config = CodecConfig(block_size=64, detector="exact", verify_every=verify_every, entropy=entropy)
            engine = CompressedAllGather(config=config, timeout_s=60)
            rows: list[bytes] = []

            def record(point: str, shard_id: int, data: np.ndarray, rows=rows) -> None:
                if point == "send":
                    rows.append(data.tobytes())

            engine.fault_injector = record
            for sid, (n, dtype) in ONE_CALL_SHAPES.items():
                engine.register(sid, n, dtype)
                engine._shards[sid].encoder.epoch = 1000 * sid + 7 * rank + 1
            generator = torch.Generator().manual_seed(11 + rank)
            weights = {
                sid: (torch.randn(n, generator=generator) * 0.02).to(dt)
                for sid, (n, dt) in ONE_CALL_SHAPES.items()
            }
            mismatches = gathers = 0
            for iteration in range(10):
                # A churn burst at iteration 5: overflow rounds, maybe seeds.
                _perturb(weights.values(), 0.6 if iteration == 5 else 0.01, generator)
                for phase in range(3):
                    for ids in ONE_CALL_BUCKETS:
                        shards = [weights[sid] for sid in ids]
                        outputs = None
                        if phase == 1:  # the engines' layout: one buffer for the bucket's outputs
                            sizes = [world_size * s.numel() for s in shards]
                            flat = torch.empty(sum(sizes), dtype=torch.int16)
                            outputs = [
                                part.view(s.dtype) for part, s in zip(flat.split(sizes), shards, strict=True)
                            ]
                        elif phase == 2:  # separate outputs: the per-shard loop rebuilds into each
                            outputs = [torch.empty(world_size * s.numel(), dtype=s.dtype) for s in shards]
                        got = engine.all_gather_bucket(shards, ids, outputs).wait()
                        for shard, result in zip(shards, got, strict=True):
                            mismatches += not same_bits(result, raw_gather(shard, world_size))
                            gathers += 1
            positions = sorted(
                (sid, source, decoder.generation)
                for sid, state in engine._shards.items()
                for source, decoder in state.decoders.items()
            )
            batched = sum(bucket.batch_encoder is not None for bucket in engine._bucket_path.buckets.values())
            stats = engine.bucket_stats
            runs.append(
                (
                    rows, mismatches, gathers, positions, batched, stats.overflow_rounds, stats.seed_messages,
                    stats.raw_messages, engine.stats.bytes_sent,
                    (stats.one_call_encodes, stats.one_call_rebuilds, stats.one_call_handoffs),
                )
            )  # fmt: skip
        result_queue.put((rank, runs))
    finally:
        bucket_codec.usable = usable
        dist.destroy_process_group()
