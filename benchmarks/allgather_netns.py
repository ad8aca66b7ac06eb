"""Raw vs compressed vs CCP all-gather on a tc-limited link: 2 gloo ranks on 2 emulated nodes.

    python benchmarks/allgather_netns.py --json out/allgather_netns.json [--rate 1gbit] [--delay-ms 0]
        [--numel 4194304] [--shards 4] [--iters 8] [--q 0.01]

Needs root and iproute2 (`ip`, `tc`); otherwise it prints one line saying why and exits 2. The link is
``measure.emulated.EmulatedCluster(2 nodes, 1 rank per node, RATE)``: network namespaces
``ciera-m-<pid>-n0`` / ``-n1``, each joined by a veth pair to a bridge in ``ciera-m-<pid>-hub``
(addresses 10.214.<pid % 256>.1 and .2, used only inside them), ``tbf rate RATE`` on both ends of each
veth (``--delay-ms``: a netem delay in front of the node ends' tbf, where the kernel has netem: one-way
delay between the ranks = delay-ms), always removed on exit (finally, atexit, SIGINT/SIGTERM/SIGHUP;
``ciera-m-`` namespaces left by a run that no longer exists are removed at start). See
docs/emulated-cluster.md. Rank 0 runs on node 0, rank 1 on node 1, each with one torch and one numba
thread (2 cores, 2 ranks), gloo bound to the node's veth (GLOO_SOCKET_IFNAME).

Each rank holds ``--shards`` BF16 N(0, 0.02) shards of ``--numel`` values. Every iteration perturbs every
shard (a share q of its 512-value blocks get one exponent moved, ``selection.perturb_blocks``), then
gathers all shards three ways, one after the other: (a) raw ``all_gather_single``, (b) the compressed
engine, gather by gather, (c) CCP: ``gather_pipelined`` over the shards, encode of shard i+1 on a worker
thread while gather i is on the link. (b) and (c) are checked bit for bit against (a) on every gather.
Every gather carries q-changed exponents (no unchanged recompute/backward re-gathers), so round 2 runs
every time. Time per gather = the iteration's time for the mode / shards, slowest rank; bytes are those
sent by a rank per gather.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

from measure.emulated import (  # noqa: E402
    EmulatedCluster,
    EmulationError,
    node_address,
    wait_for_ranks,
)
from measure.emulated import EmulationUnavailable as Unavailable  # noqa: E402
from measure.emulated import check_environment as _check_environment  # noqa: E402
from measure.emulated import clean_leftovers as _clean_leftovers  # noqa: E402

# The addresses of the link this process opens (the subnet comes from the pid that creates it).
ADDRESSES = (node_address(os.getpid(), 0), node_address(os.getpid(), 1))
PORT = 29613
CHILD_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------- rank side


def _rank_main(args) -> None:
    rank = args.rank
    # MASTER_ADDR and GLOO_SOCKET_IFNAME come from EmulatedCluster.popen.
    os.environ.update(MASTER_PORT=str(PORT), RANK=str(rank), WORLD_SIZE="2")
    import numba
    import numpy as np
    import torch
    import torch.distributed as dist

    from ciera_runtime import CodecConfig, CompressedAllGather, gather_pipelined, profile_comm
    from ciera_runtime.selection import perturb_blocks

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world_size = 2
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    numel, n_shards = args.numel, args.shards
    rng = np.random.default_rng(1000 + rank)
    bits = [
        ((rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for _ in range(n_shards)
    ]

    def as_tensor(pattern: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(pattern.view(np.int16).copy()).view(torch.bfloat16)

    raw_out = [torch.empty(world_size * numel, dtype=torch.bfloat16) for _ in range(n_shards)]
    output = torch.empty(world_size * numel, dtype=torch.bfloat16)
    mismatches: list[str] = []

    def check(mode: str, iteration: int, index: int, gathered: torch.Tensor) -> None:
        if not torch.equal(gathered.view(torch.int16), raw_out[index].view(torch.int16)):
            mismatches.append(f"{mode} iteration {iteration} shard {index}")
            raise AssertionError(
                f"rank {rank}: {mode} gather of shard {index} (iteration {iteration}) "
                "differs from the raw all-gather"
            )

    # Latency of a small all-gather: what round 2 of a changed shard adds (median over 20).
    small_round_s = profile_comm(sizes_bytes=(8,), repeats=20, summary=np.median).time_s[0]

    engine = CompressedAllGather(config=CodecConfig())
    ccp_engine = CompressedAllGather(config=CodecConfig())
    for shard_id in range(n_shards):
        engine.register(shard_id, numel, "bf16")
        ccp_engine.register(shard_id, numel, "bf16")

    times: dict[str, list[float]] = {"raw": [], "compressed": [], "ccp": []}
    bytes_sent: dict[str, list[float]] = {"raw": [], "compressed": [], "ccp": []}
    overlap_fraction: list[float] = []
    overlapped = None
    total = args.warmup + args.iters
    for iteration in range(total):
        measured = iteration >= args.warmup
        # Iteration 0 gathers the unperturbed shards: full exponents (first payload of every encoder).
        if iteration > 0:
            bits = [perturb_blocks(b, args.q, 512, "bf16", rng) for b in bits]
        shards = [as_tensor(b) for b in bits]

        dist.barrier()
        start_s = time.perf_counter()
        for index, shard in enumerate(shards):
            gather(raw_out[index], shard)
        raw_s = time.perf_counter() - start_s

        dist.barrier()
        sent_before = engine.stats.bytes_sent
        elapsed_s = 0.0
        for index, shard in enumerate(shards):
            start_s = time.perf_counter()
            gathered = engine.all_gather(shard, index, output=output).wait()
            elapsed_s += time.perf_counter() - start_s
            check("compressed", iteration, index, gathered)  # outside the timed part
        compressed_s, compressed_bytes = elapsed_s, engine.stats.bytes_sent - sent_before

        dist.barrier()
        sent_before = ccp_engine.stats.bytes_sent
        # The check runs inside compute (the output buffer is reused), so it is timed: subtract it.
        check_s = [0.0]

        def consume(index: int, gathered: torch.Tensor, iteration=iteration, check_s=check_s) -> None:
            start_s = time.perf_counter()
            check("ccp", iteration, index, gathered)
            check_s[0] += time.perf_counter() - start_s

        _, report = gather_pipelined(
            ccp_engine, list(enumerate(shards)), compute=consume, overlap=True, output=output
        )
        ccp_s, ccp_bytes = report.total_s - check_s[0], ccp_engine.stats.bytes_sent - sent_before
        if iteration == args.warmup - 1:
            breakdown_before = (engine.stats.encode_s, engine.stats.wait_s, engine.stats.decode_s)
        if measured:
            for mode, seconds, sent in (
                ("raw", raw_s, numel * 2 * n_shards),
                ("compressed", compressed_s, compressed_bytes),
                ("ccp", ccp_s, ccp_bytes),
            ):
                times[mode].append(seconds / n_shards)
                bytes_sent[mode].append(sent / n_shards)
            overlap_fraction.append(report.overlap_fraction)
            overlapped = report.overlapped

    stats = engine.stats
    measured_gathers = args.iters * n_shards
    breakdown = {
        f"{name}_s_per_gather": (now - before) / measured_gathers
        for name, now, before in zip(
            ("encode", "wait", "decode"),
            (stats.encode_s, stats.wait_s, stats.decode_s),
            breakdown_before,
            strict=True,
        )
    }
    result = {
        "compressed_breakdown": breakdown,
        "rank": rank,
        "s_per_gather": times,
        "bytes_sent_per_gather": bytes_sent,
        "small_round_s": small_round_s,
        "ccp_overlapped": overlapped,
        "ccp_overlap_fraction": overlap_fraction,
        "compressed_rounds": stats.rounds,
        "compressed_resyncs": stats.resyncs,
        "compressed_gathers": stats.gathers,
        "bit_exact": not mismatches,
        "numba_threading_layer": numba.threading_layer(),
        "numba_threads": numba.get_num_threads(),
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- root side


class Link(EmulatedCluster):
    """Two emulated nodes of one rank each (``namespaces``, ``devices``: node 0's and node 1's); the
    rate-limited link between them; ``close()`` removes everything (also at exit and on signals)."""

    def __init__(self, rate: str, delay_ms: float) -> None:
        super().__init__(2, 1, rate, delay_ms / 1e3)
        self.namespaces = tuple(self.node_namespaces)
        self.devices = (self.interface(0), self.interface(1))


def _rank_command(args, rank: int, result: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--result", str(result),
        "--numel", str(args.numel), "--shards", str(args.shards), "--iters", str(args.iters),
        "--warmup", str(args.warmup), "--q", str(args.q),
    ]  # fmt: skip


def _summary(values: list[float]) -> dict:
    import numpy as np

    array = np.asarray(values) * 1e3
    return {
        "median_ms": round(float(np.median(array)), 3),
        "p10_ms": round(float(np.percentile(array, 10)), 3),
        "p90_ms": round(float(np.percentile(array, 90)), 3),
    }


def _report(args, link: Link, ranks: list[dict], load_before, load_after, wall_s: float) -> dict:
    import numpy as np

    modes = {}
    shard_bytes = args.numel * 2
    for mode in ("raw", "compressed", "ccp"):
        # Slowest rank per iteration: a collective step ends when its last rank is done.
        slowest = np.max([r["s_per_gather"][mode] for r in ranks], axis=0)
        sent = float(np.mean([np.mean(r["bytes_sent_per_gather"][mode]) for r in ranks]))
        median_s = float(np.median(slowest))
        modes[mode] = _summary(slowest.tolist()) | {
            "bytes_sent_per_gather_per_rank": round(sent),
            "wire_MBps_per_rank": round(sent / median_s / 1e6, 1),
            "effective_MBps_per_rank": round(shard_bytes / median_s / 1e6, 1),
        }
    raw_ms = modes["raw"]["median_ms"]
    for mode in ("compressed", "ccp"):
        modes[mode]["speedup_vs_raw"] = round(raw_ms / modes[mode]["median_ms"], 3)
        modes[mode]["bytes_ratio_vs_raw"] = round(
            modes[mode]["bytes_sent_per_gather_per_rank"] / modes["raw"]["bytes_sent_per_gather_per_rank"], 4
        )
    return {
        "link": {
            "rate": args.rate,
            "delay_ms": args.delay_ms,
            "qdiscs": link.qdiscs(),
            "addresses": [link.address(0), link.address(1)],
            "small_round_ms": round(max(r["small_round_s"] for r in ranks) * 1e3, 3),
        },
        "numel_per_shard": args.numel,
        "shards_per_iteration": args.shards,
        "dtype": "bf16",
        "q": args.q,
        "iterations": args.iters,
        "warmup_iterations": args.warmup,
        "world_size": 2,
        "threads_per_rank": {"torch": ranks[0]["torch_threads"], "numba": ranks[0]["numba_threads"]},
        "numba_threading_layer": ranks[0]["numba_threading_layer"],
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "bit_exact": all(r["bit_exact"] for r in ranks),
        "modes": modes,
        "ccp_overlapped": all(r["ccp_overlapped"] for r in ranks),
        "ccp_overlap_fraction_median": round(
            float(np.median([f for r in ranks for f in r["ccp_overlap_fraction"]])), 3
        ),
        "compressed_rounds_per_gather": round(
            ranks[0]["compressed_rounds"] / ranks[0]["compressed_gathers"], 3
        ),
        "compressed_resyncs": sum(r["compressed_resyncs"] for r in ranks),
        # Plain compressed loop, per gather, mean of the ranks: encode (detect + split + rANS), wait (both
        # rounds on the link), decode (+ merge of the other rank's shard).
        "compressed_breakdown_ms": {
            name.replace("_s_per_gather", "_ms"): round(
                float(np.mean([r["compressed_breakdown"][name] for r in ranks])) * 1e3, 3
            )
            for name in ranks[0]["compressed_breakdown"]
        },
        "wall_s": round(wall_s, 1),
    }


def _main(args) -> int:
    try:
        _check_environment()
    except Unavailable as reason:
        print(f"allgather_netns: skipped: {reason}")
        return 2
    removed = _clean_leftovers()
    if removed:
        print(f"allgather_netns: removed leftover namespaces {removed}", file=sys.stderr)
    try:
        link = Link(args.rate, args.delay_ms)
    except EmulationError as reason:
        print(f"allgather_netns: error: {reason}")
        return 2
    start_s = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="ciera-netns-") as scratch:
            try:
                link.open()
            except Unavailable as reason:
                print(f"allgather_netns: skipped: {reason}")
                return 2
            env = os.environ | {
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "NUMBA_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
            }
            results = [Path(scratch) / f"rank{rank}.json" for rank in (0, 1)]
            load_before = os.getloadavg()
            for rank in (0, 1):
                link.popen(rank, _rank_command(args, rank, results[rank]), env=env, cwd=_REPO_ROOT)
            failed = wait_for_ranks(link.processes, CHILD_TIMEOUT_S)
            if failed or any(not path.exists() for path in results):
                print(
                    f"allgather_netns: FAILED: {'; '.join(failed) or 'a rank wrote no result'}",
                    file=sys.stderr,
                )
                return 1
            load_after = os.getloadavg()
            ranks = [json.loads(path.read_text()) for path in results]
            result = _report(args, link, ranks, load_before, load_after, time.perf_counter() - start_s)
    finally:
        link.close()
    emit_json(result, args.json)
    if not result["bit_exact"]:
        print("allgather_netns: FAILED: a compressed gather was not bit-exact", file=sys.stderr)
        return 1
    return 0


def close_on_exit(link) -> None:
    """Close ``link`` at exit, and turn SIGINT/SIGTERM/SIGHUP into an exit so that it runs then too (for
    links that are not an EmulatedCluster, whose ``open()`` arranges this itself)."""
    atexit.register(link.close)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rate", default="1gbit", help="tbf rate on each veth end (tc syntax)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way netem delay per end")
    parser.add_argument("--numel", type=int, default=1 << 22, help="values per shard per rank (default 4 Mi)")
    parser.add_argument("--shards", type=int, default=4, help="shards gathered per iteration (CCP depth)")
    parser.add_argument("--iters", type=int, default=8, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured iterations first (at least 1)")
    parser.add_argument("--q", type=float, default=0.01, help="share of blocks changed per iteration")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.warmup = max(1, args.warmup)
    if args.rank is not None:
        from measure.rank import leave_rank

        _rank_main(args)
        leave_rank(0)  # result written, group destroyed (measure/rank.py says why)
    sys.exit(_main(args))


if __name__ == "__main__":
    main()
