"""Spawned gloo workers for the bucket path (one collective per engine all-gather)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from _dist_workers import init_gloo

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


def bucket_steady_worker(rank: int, world_size: int, port: int, iterations: int, result_queue) -> None:
    """Buckets of changing weights, three gathers per iteration (forward, recompute, backward), and a
    churn burst half-way (overflow rounds); every result equals the raw all-gather."""
    from ciera_runtime import CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(7 + rank)
        engine = CompressedAllGather(config=CodecConfig(block_size=64, detector="hash", verify_every=4))
        weights = {
            sid: (torch.randn(n, generator=generator) * 0.02).to(dt) for sid, (n, dt) in BUCKET_SHAPES.items()
        }
        buckets = [(10, 11), (12, 13), (10, 11, 12, 13)]
        mismatches = gathers = 0
        for iteration in range(iterations):
            fraction = 0.5 if iteration == iterations // 2 else 0.01
            for weight in weights.values():
                picked = torch.rand(weight.numel(), generator=generator) < fraction
                weight[picked] = weight[picked] * 1.7
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
