"""Does a gather slow the compute that follows it, and does CIERA's more than the plain gather's?

    python benchmarks/compute_after_gather.py --json out/compute_after_gather.json [--segments 300]
        [--rounds 9] [--shards 300] [--values 28672] [--pin]

ZeRO-3 + CIERA's captured compute segments run longer than plain ZeRO-3's (docs/validation.md, "Why
ZeRO-3 + CIERA is predicted fast"); this isolates one candidate cause, the gather just before a segment.
Two spawned gloo ranks on loopback, one torch and one numba thread each (what `ciera measure` gives a rank).
Each rank holds ``--shards`` BF16 shards of ``--values`` values (registered with CIERA, as a model's
parameters are), each with its own output buffer. A *segment* is one gather of the next shard, then a fixed
block of compute — two expert MLPs at the 1/32-width Mixtral shape the shipped bundle trains (256 tokens ×
128 → 448 → 128, BF16, SiLU) — whose wall time and thread CPU time are recorded. Three modes, rotated in
order from round to round, ``--segments`` segments each per round (the first round is warm-up):

- ``none``: the compute block alone;
- ``plain``: ``all_gather_into_tensor`` of the shard, waited for, then the block (DeepSpeed's path);
- ``ciera``: ``CompressedAllGather.all_gather_bucket`` of the shard, waited for, then the block. Between
  rounds a share 0.4 of each shard's 64-value blocks get one exponent moved, as an optimizer step does.

Per rank and mode: the block's median and mean wall and thread CPU time (µs) and their ratio to ``none``'s.
CPU time rising with wall time means the block itself ran slower (caches, memory), not that the thread was
off its core. ``--pin`` puts each rank's process (all its threads) on core RANK.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)
from _ranks import run_loopback_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("none", "plain", "ciera")
TOKENS, HIDDEN, FFN, EXPERTS = 256, 128, 448, 2  # 1/32-width Mixtral: 4096 / 32 and 14336 / 32
CHANGE_RATE, BLOCK = 0.4, 64


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    import numba
    import numpy as np
    import torch
    import torch.distributed as dist

    from ciera_runtime import CodecConfig, CompressedAllGather
    from ciera_runtime.selection import perturb_blocks
    from measure.placement import quiet_engine_deprecations

    quiet_engine_deprecations()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rng = np.random.default_rng(100 + rank)
    bits = [
        ((rng.standard_normal(args.values) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for _ in range(args.shards)
    ]
    engine = CompressedAllGather(config=CodecConfig())
    for shard_id in range(args.shards):
        engine.register(shard_id, args.values, torch.bfloat16)
    outputs = [torch.empty(world_size * args.values, dtype=torch.bfloat16) for _ in range(args.shards)]
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16)
    up = [(torch.randn(HIDDEN, FFN, generator=generator) * 0.05).to(torch.bfloat16) for _ in range(EXPERTS)]
    down = [(torch.randn(FFN, HIDDEN, generator=generator) * 0.05).to(torch.bfloat16) for _ in range(EXPERTS)]

    def compute() -> None:
        y = x
        for w1, w2 in zip(up, down, strict=True):
            y = torch.nn.functional.silu(y @ w1) @ w2

    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    mismatches = 0
    for round_index in range(args.rounds):
        weights = [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bits]
        shift = round_index % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            dist.barrier()
            for segment in range(args.segments):
                shard = segment % args.shards
                if mode == "plain":
                    dist.all_gather_into_tensor(outputs[shard], weights[shard], async_op=True).wait()
                elif mode == "ciera":
                    engine.all_gather_bucket([weights[shard]], (shard,), [outputs[shard]]).wait()
                wall_start, cpu_start = time.perf_counter(), time.thread_time()
                compute()
                wall_s, cpu_s = time.perf_counter() - wall_start, time.thread_time() - cpu_start
                if round_index > 0:  # the first round warms every path up
                    wall[mode].append(wall_s)
                    cpu[mode].append(cpu_s)
        bits = [perturb_blocks(b, CHANGE_RATE, BLOCK, "bf16", rng) for b in bits]
    # Not timed: every shard gathered both ways once more, compared value for value (CIERA is lossless).
    weights = [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bits]
    raw = torch.empty(world_size * args.values, dtype=torch.bfloat16)
    for shard in range(args.shards):
        dist.all_gather_into_tensor(raw, weights[shard])
        (got,) = engine.all_gather_bucket([weights[shard]], (shard,), [outputs[shard]]).wait()
        mismatches += int((got.view(torch.int16) != raw.view(torch.int16)).sum())
    summary = {}
    for mode in MODES:
        summary[mode] = {
            "wall_median_us": float(np.median(wall[mode])) * 1e6,
            "wall_mean_us": float(np.mean(wall[mode])) * 1e6,
            "cpu_median_us": float(np.median(cpu[mode])) * 1e6,
            "cpu_mean_us": float(np.mean(cpu[mode])) * 1e6,
            "segments": len(wall[mode]),
        }
    for mode in MODES:
        for key in ("wall_median_us", "cpu_median_us"):
            summary[mode][key.replace("_us", "_over_none")] = summary[mode][key] / summary["none"][key]
    queue.put({"rank": rank, "modes": summary, "mismatches": mismatches})
    dist.barrier()
    dist.destroy_process_group()
    from measure.rank import leave_rank

    leave_rank(0)  # result sent, group destroyed (measure/rank.py says why)


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--segments", type=int, default=300, help="segments per mode and round (default 300)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds, the first one warm-up (default 9)")
    parser.add_argument(
        "--shards", type=int, default=300, help="distinct shards gathered in turn (default 300)"
    )
    parser.add_argument(
        "--values", type=int, default=28672, help="BF16 values per rank's shard (default 28672)"
    )
    parser.add_argument("--pin", action="store_true", help="each rank's process on core RANK")
    args = parser.parse_args()
    for name in ("segments", "shards", "values"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected >= 1")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: expected >= 2 (the first one is warm-up)")
    if args.pin and (os.cpu_count() or 1) < 2:
        parser.error("--pin: expected at least 2 cores (one per rank)")
    world_size = 2
    ranks = run_loopback_ranks(_worker, args, world_size)
    result = {
        "benchmark": "compute_after_gather",
        "world_size": world_size,
        "segments_per_mode_and_round": args.segments,
        "rounds_timed": args.rounds - 1,
        "shards": args.shards,
        "values_per_rank": args.values,
        "pinned": args.pin,
        "compute_block": f"{EXPERTS} x ({TOKENS}x{HIDDEN} @ {HIDDEN}x{FFN}, SiLU, @ {FFN}x{HIDDEN}), BF16",
        "ranks": ranks,
    }
    emit_json(result, args.json)
    for rank in ranks:
        modes = rank["modes"]
        print(
            f"rank {rank['rank']}: compute block {modes['none']['wall_median_us']:.0f} µs alone, "
            + ", ".join(
                f"after a {mode} gather {modes[mode]['wall_median_us']:.0f} µs "
                f"({modes[mode]['wall_median_over_none']:.3f}×; CPU {modes[mode]['cpu_median_over_none']:.3f}×)"
                for mode in ("plain", "ciera")
            ),
            file=sys.stderr,
        )
    bad = sum(rank["mismatches"] for rank in ranks)
    if bad:
        print(
            f"compute_after_gather: {bad} values CIERA gathered differ from the raw gather's", file=sys.stderr
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
