"""Raw vs compressed all-gather on gloo: 2 spawned local ranks, time and bytes per gather.

    python benchmarks/allgather_gloo.py --json out/allgather_gloo.json [--numel 4194304] [--iterations 10]

Each rank holds a BF16 N(0, 0.02) shard; before every "iteration" a share q of its blocks get one
exponent changed, then the shard is gathered three times (forward, recompute, backward: the last two
carry no exponents). Reported per gather: wall time (raw all_gather_single vs compressed, both measured
in this run), bytes sent per rank, and the compressed engine's breakdown (encode, wait, decode). Also
the cost of one small round (each compressed gather has two: control and status), measured as an
all-gather of a few bytes. On one machine over loopback the link is fast and the 2 cores are shared by
both ranks, so the time column mostly shows codec cost; bytes are what a real link would carry.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(
    rank: int, world_size: int, port: int, numel: int, iterations: int, q: float, numba_threads: int, queue
) -> None:
    import numba
    import numpy as np
    import torch
    import torch.distributed as dist

    from ciera_runtime import CodecConfig, CompressedAllGather, gather_pipelined, profile_comm
    from ciera_runtime.selection import perturb_blocks

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    numba.set_num_threads(numba_threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rng = np.random.default_rng(rank)
    bits = ((rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    versions = [torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)]
    for _ in range(iterations):
        bits = perturb_blocks(bits, q, 512, "bf16", rng)
        versions.append(torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16))

    output = torch.empty(world_size * numel, dtype=torch.bfloat16)
    # Latency of a small all-gather: what round 2 of a changed shard adds (median over 50).
    small_round_s = profile_comm(sizes_bytes=(8,), repeats=50, summary=np.median).time_s[0]

    gather(output, versions[0])
    dist.barrier()
    raw_s = []
    for version in versions[1:]:
        for _ in range(3):
            start_s = time.perf_counter()
            gather(output, version)
            raw_s.append(time.perf_counter() - start_s)

    engine = CompressedAllGather(config=CodecConfig())
    engine.all_gather(versions[0], 0).wait()  # first gather: full exponents, and numba warm-up
    engine.stats = type(engine.stats)()
    dist.barrier()
    compressed_s = []
    for version in versions[1:]:
        for _ in range(3):
            start_s = time.perf_counter()
            engine.all_gather(version, 0, output=output).wait()
            compressed_s.append(time.perf_counter() - start_s)
    stats = engine.stats

    # CCP: the same sequence with encode of gather i+1 on a worker thread while gather i is in flight,
    # against the same pipeline run inline. Both warmed up first (the first pipelined call starts the
    # worker thread and its numba state: ~50 ms here, which used to dominate the figure).
    sequence = [(0, version) for version in versions[1:] for _ in range(3)]
    ccp = {}
    for overlap_on in (True, False):
        warm_engine = CompressedAllGather(config=CodecConfig())
        warm_engine.all_gather(versions[0], 0).wait()
        gather_pipelined(warm_engine, sequence[:3], overlap=overlap_on, output=output)
        pipeline_engine = CompressedAllGather(config=CodecConfig())
        pipeline_engine.all_gather(versions[0], 0).wait()
        dist.barrier()
        _, ccp[overlap_on] = gather_pipelined(pipeline_engine, sequence, overlap=overlap_on, output=output)
    overlap, sequential = ccp[True], ccp[False]

    gathers = len(compressed_s)
    queue.put(
        {
            "rank": rank,
            "raw_s_per_gather": float(np.median(raw_s)),
            "compressed_s_per_gather": float(np.median(compressed_s)),
            "raw_bytes_sent_per_gather": numel * 2,
            "compressed_bytes_sent_per_gather": stats.bytes_sent / gathers,
            "rounds_per_gather": stats.rounds / gathers,
            "small_round_s": small_round_s,
            "encode_s_per_gather": stats.encode_s / gathers,
            "wait_s_per_gather": stats.wait_s / gathers,
            "decode_s_per_gather": stats.decode_s / gathers,
            "ccp": {
                "overlapped_total_s": overlap.total_s,
                "sequential_total_s": sequential.total_s,
                "overlapped_s_per_gather": overlap.total_s / overlap.gathers,
                "sequential_s_per_gather": sequential.total_s / sequential.gathers,
                "overlap_fraction": overlap.overlap_fraction,
                "overlapped": overlap.overlapped,
            },
        }
    )
    dist.destroy_process_group()
    from measure.rank import leave_rank

    leave_rank(0)  # result sent, group destroyed (measure/rank.py says why)


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--numel", type=int, default=1 << 22, help="values per rank's shard (default 4 Mi)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--q", type=float, default=0.01, help="block change rate per iteration")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--numba-threads",
        type=int,
        default=0,
        help="numba threads per rank (default: cores // world size, at least 1, so ranks do not oversubscribe)",
    )
    args = parser.parse_args()
    numba_threads = args.numba_threads or max(1, (os.cpu_count() or 1) // args.world_size)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        args=(args.world_size, port, args.numel, args.iterations, args.q, numba_threads, queue),
        nprocs=args.world_size,
        join=True,
        start_method="spawn",
    )
    ranks = sorted((queue.get() for _ in range(args.world_size)), key=lambda row: row["rank"])
    rank0 = ranks[0]
    result = {
        "world_size": args.world_size,
        "numel_per_rank": args.numel,
        "q": args.q,
        "numba_threads_per_rank": numba_threads,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "gathers_per_iteration": 3,
        "bytes_ratio": rank0["compressed_bytes_sent_per_gather"] / rank0["raw_bytes_sent_per_gather"],
        "time_ratio": max(r["compressed_s_per_gather"] for r in ranks)
        / max(r["raw_s_per_gather"] for r in ranks),
        "ranks": ranks,
    }
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
