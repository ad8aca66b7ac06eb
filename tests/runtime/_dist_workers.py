"""Worker functions for the spawned multi-process gloo tests (importable by the spawned children)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_gloo(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def changing_weights_worker(rank: int, world_size: int, port: int, iterations: int, result_queue) -> None:
    """Many gathers of slowly changing weights (several shards, both dtypes, both detectors, a
    recompute-style repeat and a simulated restart); every result must equal the raw all-gather."""
    from ciera_runtime import CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(1000 + rank)
        engines = {
            "hash": CompressedAllGather(config=CodecConfig(block_size=512, detector="hash", verify_every=3)),
            "exact": CompressedAllGather(config=CodecConfig(block_size=100, detector="exact")),
        }
        shapes = {
            0: (5000, torch.bfloat16),
            1: (1537, torch.float16),
            2: (0, torch.bfloat16),
            3: (7, torch.float16),
        }
        weights = {
            sid: (torch.randn(n, generator=generator) * 0.02).to(dt) for sid, (n, dt) in shapes.items()
        }
        mismatches = 0
        for iteration in range(iterations):
            for shard_id, weight in weights.items():
                for engine in engines.values():
                    repeats = 2 if iteration % 4 == 1 else 1  # same weights gathered again: no exponents
                    for _ in range(repeats):
                        expected = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
                        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, weight)
                        got = engine.all_gather(weight, shard_id).wait()
                        if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                            mismatches += 1
                # A small update: multiply a few values, so some exponents cross a power of two.
                if weight.numel():
                    index = torch.randint(0, weight.numel(), (3,), generator=generator)
                    weight[index] = weight[index] * 1.7
            if iteration == iterations // 2 and rank == world_size - 1:
                # Simulated restart of the last rank: fresh engines, empty caches, generation 0.
                engines = {
                    name: CompressedAllGather(config=engine.config) for name, engine in engines.items()
                }
            dist.barrier()
        resyncs = sum(engine.stats.resyncs for engine in engines.values())
        result_queue.put((rank, mismatches, resyncs))
    finally:
        dist.destroy_process_group()


def pipeline_and_selection_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """CCP pipeline over a few layers (compared with the raw all-gather) and a BSC decision table."""
    from ciera_runtime import (
        CodecConfig,
        CompressedAllGather,
        ShardInfo,
        broadcast_decisions,
        gather_pipelined,
        measure_codec_times,
        profile_comm,
        select_shards,
    )

    init_gloo(rank, world_size, port)
    try:
        generator = torch.Generator().manual_seed(7 + rank)
        layers = [
            (layer, (torch.randn(4096, generator=generator) * 0.02).to(torch.bfloat16)) for layer in range(4)
        ]
        engine = CompressedAllGather(config=CodecConfig())
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        mismatches = 0
        for _ in range(3):
            order = layers + layers[::-1]  # forward then backward: second gather of a layer is unchanged
            outputs, report = gather_pipelined(engine, order)
            for (_, weight), got in zip(order, outputs, strict=True):
                expected = torch.empty(world_size * weight.numel(), dtype=weight.dtype)
                gather(expected, weight)
                mismatches += int(not torch.equal(got.view(torch.int16), expected.view(torch.int16)))
            for _, weight in layers:
                weight[:5] = weight[:5] * 3.0
        profile = profile_comm(sizes_bytes=(256, 4096, 65536), repeats=2)
        # A larger gather never costs less in the profile (noise must not make bytes look free).
        assert list(profile.time_s) == sorted(profile.time_s), profile.time_s
        shards = [
            ShardInfo(0, 65536, "bf16", "norm", 0.0),
            ShardInfo(1, 65536, "bf16", "attention", 1.0),
            ShardInfo(2, 65536, "bf16", "expert_ffn", 0.05),
        ]
        times = {}

        def codec_times(shard):
            if shard.shard_id not in times:
                times[shard.shard_id] = measure_codec_times(shard.numel, shard.dtype, shard.block_change_rate)
            return times[shard.shard_id]

        local_table = select_shards(shards, profile.comm_s, world_size, 2 * 65536, codec_times)
        table = broadcast_decisions(local_table)
        agreed = [row.as_dict() for row in table]
        # Everyone holds rank 0's table; rank 0's own table is unchanged by the broadcast.
        if rank == 0:
            assert agreed == [row.as_dict() for row in local_table]
        result_queue.put((rank, mismatches, report.as_dict(), agreed))
    finally:
        dist.destroy_process_group()


def budget_and_pipelined_resync_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """(a) The cache budget counts every byte the engine keeps, and a shard over it is a logged, visible
    decision. (b) Under gather_pipelined a resync is stamped with the generation of the gather it
    replaces, so a shard gathered again and again after one restart resyncs once, then sends the fixed
    part only (it used to resync on every gather)."""
    import logging

    from ciera_runtime import CodecConfig, CompressedAllGather, gather_pipelined
    from ciera_runtime.protocol import control_row_bytes, status_row_bytes

    init_gloo(rank, world_size, port)
    try:
        warnings: list[str] = []

        class _Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warnings.append(record.getMessage())

        logging.getLogger("ciera_runtime").addHandler(_Collect(level=logging.WARNING))
        numel = 20_000
        scratch = CompressedAllGather(config=CodecConfig())
        scratch.register(0, numel, "bf16")
        scratch.register(1, numel, "bf16")
        budget = scratch.cache_used_bytes + 10  # room for two shards, not three
        engine = CompressedAllGather(config=CodecConfig(), cache_budget_bytes=budget)
        generator = torch.Generator().manual_seed(rank)
        weights = [(torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16) for _ in range(3)]
        decisions = [engine.register(shard_id, numel, "bf16", category="expert_ffn") for shard_id in range(3)]
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        mismatches = 0
        for _ in range(3):
            for shard_id, weight in enumerate(weights):
                weight[:7] = weight[:7] * 1.9
                expected = torch.empty(world_size * numel, dtype=torch.bfloat16)
                gather(expected, weight)
                got = engine.all_gather(weight, shard_id).wait()
                mismatches += int(not torch.equal(got.view(torch.int16), expected.view(torch.int16)))
        budget_result = {
            "decisions": decisions,
            "reason": engine.registrations[2].reason,
            "warnings": warnings,
            "memory_bytes": engine.memory_bytes(),
            "send_buffer_bytes": engine.send_buffer_bytes,
            "cache_used_bytes": engine.cache_used_bytes,
            "budget": budget,
        }

        pipeline_engine = CompressedAllGather(config=CodecConfig())
        weight = weights[0]
        gather_pipelined(pipeline_engine, [(0, weight)] * 3)
        if rank == world_size - 1:  # restart: empty caches, a new epoch
            pipeline_engine = CompressedAllGather(config=CodecConfig())
        sent_before = pipeline_engine.stats.bytes_sent
        outputs, _ = gather_pipelined(pipeline_engine, [(0, weight)] * 6)
        expected = torch.empty(world_size * numel, dtype=torch.bfloat16)
        gather(expected, weight)
        mismatches += sum(
            int(not torch.equal(o.view(torch.int16), expected.view(torch.int16))) for o in outputs
        )
        fixed_bytes = pipeline_engine._shards[0].encoder.layout.fixed_bytes
        pipeline_result = {
            "resyncs": pipeline_engine.stats.resyncs,
            "row_bytes": [entry["row_bytes"] for entry in pipeline_engine.stats.history[-6:]],
            "bytes_sent": pipeline_engine.stats.bytes_sent - sent_before,
            "fixed_bytes": fixed_bytes,
            "round_overhead_bytes": control_row_bytes(world_size) + status_row_bytes(),
            "memory_bytes": pipeline_engine.memory_bytes(),
            "cache_used_bytes": pipeline_engine.cache_used_bytes,
        }
        result_queue.put((rank, mismatches, budget_result, pipeline_result))
    finally:
        dist.destroy_process_group()


def bad_first_call_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """The first gather of a shard passes a wrong-size shard on rank 0 (so it registers that size) and
    fails on every rank; the next, correct gather must not inherit the bad call's registration."""
    from ciera_runtime import CieraError, CodecConfig, CompressedAllGather

    init_gloo(rank, world_size, port)
    try:
        engine = CompressedAllGather(config=CodecConfig(block_size=256))
        weight = (torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * 0.02).to(torch.bfloat16)
        outcomes = []
        try:
            engine.all_gather(weight[:-3].clone() if rank == 0 else weight, 5).wait()
            outcomes.append("returned")
        except CieraError as error:
            outcomes.append(f"error: {error}")
        expected = torch.empty(world_size * 3000, dtype=torch.bfloat16)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, weight)
        got = engine.all_gather(weight, 5).wait()
        outcomes.append(
            "exact" if torch.equal(got.view(torch.int16), expected.view(torch.int16)) else "wrong"
        )
        result_queue.put((rank, outcomes, engine.memory_bytes() <= engine.cache_used_bytes))
    finally:
        dist.destroy_process_group()
