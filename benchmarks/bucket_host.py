"""The training thread's time per engine all-gather on the bucket path, against the plain gather's.

    python benchmarks/bucket_host.py --json out/bucket_host.json [--values 65536] [--shards 1,4,16,32]
        [--iterations 20] [--q 0.4] [--one-call-min-shards N]

Two spawned gloo ranks on loopback, one torch and one numba thread each (what `ciera measure` gives a
rank). Each rank holds a bucket of ``--values`` BF16 values per rank, cut into S equal shards for every S
of ``--shards`` (the same bytes, more parameters): what DeepSpeed's coalesced fetch or an FSDP2 group
hands CIERA. Every iteration a share q of each shard's 64-value blocks get one exponent moved by one, then
the bucket is gathered three times (forward, recompute, backward), as the engines do.

Per S, two rows, one per ``path``: ``one_call`` (the bucket's shards encoded and rebuilt in one compiled
call each, ciera_runtime/bucket_codec.py) and ``per_shard`` (the same engine with those passes switched
off: the loop they replace), each its own engine, gathering the same values in turn, gather for gather;
the outputs are one buffer per bucket, as the engines pass them. Per engine call (each rank's median over
the timed calls, after 5 warm-up iterations; the mean of the two ranks):

- ``ciera_host_us``: CIERA's whole time on the calling thread (``CompressedAllGather.stats.host_s``:
  packing, encode, issue, unpack, decode; network waits left out), split into ``encode_us``,
  ``decode_us`` and ``glue_us`` (the rest: headers, area sizing, issue, bookkeeping);
- ``ciera_wall_us``: issue to results, waits included;
- the plain gather of the same bucket measured in this run: ``plain_issue_us`` (flatten the shards and
  issue one asynchronous ``all_gather_into_tensor``: the thread time DeepSpeed's coalesced call spends)
  and ``plain_wall_us`` (issue to result, on loopback);
- ``wire_over_raw``: CIERA's bytes sent over the raw bucket's; ``mismatches``: gathered values that
  differ from the raw gather's (the run fails unless 0).

On loopback both ranks share the two cores, so the wall times mostly show CPU cost; the host time is
what the codec and protocol take from the training thread on any link.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)
from _ranks import run_loopback_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP_ITERATIONS = 5
# Per call, in µs: CIERA's thread time and its parts, its wall time, the plain gather's issue and wall.
SAMPLED = (
    "ciera_host_us", "encode_us", "decode_us", "glue_us", "ciera_wall_us", "plain_issue_us", "plain_wall_us",
)  # fmt: skip
GATHERS_PER_ITERATION = 3  # forward, recompute, backward
# The bucket's shards encoded and rebuilt in one compiled call each (ciera_runtime/bucket_codec.py), and the
# per-shard loop it replaces where it applies (the baseline, measured in the same run, gather for gather).
PATHS = ("one_call", "per_shard")


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue) -> None:
    import numba
    import numpy as np
    import torch
    import torch.distributed as dist

    from ciera_runtime import CodecConfig, CompressedAllGather, bucket_codec
    from ciera_runtime.selection import perturb_blocks

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    usable = bucket_codec.usable
    if args.one_call_min_shards is not None:
        bucket_codec.MIN_SHARDS = args.one_call_min_shards
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rng = np.random.default_rng(100 + rank)
    rows = []
    for shards in args.shards:
        numel = args.values // shards
        bits = [
            ((rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for _ in range(shards)
        ]
        ids = tuple(range(shards))
        engines = {}
        for path in PATHS:
            engine = engines[path] = CompressedAllGather(config=CodecConfig())
            for shard_id in ids:
                engine.register(shard_id, numel, torch.bfloat16)
        flat_out = torch.empty(world_size * numel * shards, dtype=torch.bfloat16)
        mismatches = dict.fromkeys(PATHS, 0)
        samples = {path: {key: [] for key in SAMPLED} for path in PATHS}
        sent = dict.fromkeys(PATHS, 0)
        raw_bytes = 0
        for iteration in range(WARMUP_ITERATIONS + args.iterations):
            timed = iteration >= WARMUP_ITERATIONS
            bits = [perturb_blocks(b, args.q, 64, "bf16", rng) for b in bits]
            weights = [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bits]
            for _ in range(GATHERS_PER_ITERATION):
                dist.barrier()
                start_s = time.perf_counter()
                flat = torch.cat(weights)
                work = gather(flat_out, flat, async_op=True)
                issued_s = time.perf_counter() - start_s
                work.wait()
                plain_s = time.perf_counter() - start_s
                # The raw gather's layout: rank r's flat bucket, so shard k of rank r sits at r·S·n + k·n.
                expected = flat_out.view(world_size, shards, numel)
                for path, engine in engines.items():
                    # The engines' layout: one buffer for the bucket's outputs (zero3.py).
                    outputs = list(
                        torch.empty(world_size * numel * shards, dtype=torch.bfloat16).split(
                            world_size * numel
                        )
                    )
                    bucket_codec.usable = usable if path == "one_call" else (lambda: False)
                    dist.barrier()
                    before = (engine.stats.host_s, engine.stats.encode_s, engine.stats.decode_s)
                    sent_before = engine.stats.bytes_sent
                    start_s = time.perf_counter()
                    got = engine.all_gather_bucket(weights, ids, outputs).wait()
                    ciera_s = time.perf_counter() - start_s
                    bucket_codec.usable = usable
                    for k, result in enumerate(got):
                        mismatches[path] += int(
                            (
                                result.view(world_size, numel).view(torch.int16)
                                != expected[:, k].view(torch.int16)
                            )
                            .sum()
                            .item()
                        )
                    if timed:
                        host = engine.stats.host_s - before[0]
                        encode = engine.stats.encode_s - before[1]
                        decode = engine.stats.decode_s - before[2]
                        for key, value in zip(
                            SAMPLED,
                            (host, encode, decode, host - encode - decode, ciera_s, issued_s, plain_s),
                            strict=True,
                        ):
                            samples[path][key].append(1e6 * value)
                        sent[path] += engine.stats.bytes_sent - sent_before
                if timed:
                    raw_bytes += 2 * numel * shards
        for path in PATHS:
            rows.append(
                {
                    "shards": shards,
                    "path": path,
                    "values_per_shard": numel,
                    **{key: float(np.median(values)) for key, values in samples[path].items()},
                    "wire_over_raw": sent[path] / raw_bytes,
                    "mismatches": mismatches[path],
                }
            )
    queue.put({"rank": rank, "rows": rows})
    dist.destroy_process_group()
    from measure.rank import leave_rank

    leave_rank(0)  # result sent, group destroyed (measure/rank.py says why)


def _shard_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return counts


def _runtime_min_shards() -> int:
    from ciera_runtime import bucket_codec

    return bucket_codec.MIN_SHARDS


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--values", type=int, default=1 << 16, help="values per rank's bucket (default 64 Ki)"
    )
    parser.add_argument("--shards", type=_shard_counts, default=[1, 4, 16, 32], help="shards per bucket")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations (3 gathers each)")
    parser.add_argument("--q", type=float, default=0.4, help="block change rate per iteration (default 0.4)")
    parser.add_argument(
        "--one-call-min-shards",
        type=int,
        default=None,
        help="buckets of at least this many shards take the one-call passes (default: the runtime's, "
        "bucket_codec.MIN_SHARDS; 1 measures them at every count)",
    )
    args = parser.parse_args()
    if args.iterations < 1 or not 0.0 <= args.q <= 1.0:
        parser.error(f"--iterations {args.iterations} / --q {args.q}: expected >= 1 and within [0, 1]")
    if args.one_call_min_shards is not None and args.one_call_min_shards < 1:
        parser.error(f"--one-call-min-shards {args.one_call_min_shards}: expected >= 1")
    if args.values < max(args.shards):
        parser.error(f"--values {args.values}: expected at least one value per shard ({max(args.shards)})")
    world_size = 2
    ranks = run_loopback_ranks(_worker, args, world_size)
    rows = []
    for position, first in enumerate(ranks[0]["rows"]):
        row = {
            "shards": first["shards"],
            "path": first["path"],
            "values_per_shard": first["values_per_shard"],
        }
        for key in first:
            if key in row:
                continue
            values = [rank["rows"][position][key] for rank in ranks]
            row[key] = sum(values) if key == "mismatches" else sum(values) / len(values)
        rows.append(row)
    result = {
        "benchmark": "bucket_host",
        "world_size": world_size,
        "values_per_rank": args.values,
        "q": args.q,
        "iterations": args.iterations,
        "one_call_min_shards": args.one_call_min_shards or _runtime_min_shards(),
        "gathers_per_iteration": GATHERS_PER_ITERATION,
        "rows": rows,
    }
    emit_json(result, args.json)
    bad = sum(row["mismatches"] for row in rows)
    if bad:
        print(f"bucket_host: {bad} gathered values differ from the raw gather's", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
