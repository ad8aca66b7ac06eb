"""Raw vs compressed vs CCP all-gather on a tc-limited link: 2 gloo ranks in 2 network namespaces.

    python benchmarks/allgather_netns.py --json out/allgather_netns.json [--rate 1gbit] [--delay-ms 0]
        [--numel 4194304] [--shards 4] [--iters 8] [--q 0.01]

Needs root and iproute2 (`ip`, `tc`); otherwise it prints one line saying why and exits 2. It creates two
network namespaces ``ciera-bench-<pid>-a`` / ``-b`` joined by a veth pair (10.213.77.1/30 and .2, used
only inside them), puts ``tbf rate RATE burst 128kb latency 50ms`` on both veth ends (``--delay-ms``:
a netem delay in front of it, where the kernel has netem), and always removes them on exit (finally,
atexit, SIGINT/SIGTERM/SIGHUP; namespaces of this prefix left by a run that no longer exists are removed
at start). Rank 0 runs in namespace a, rank 1 in b, each with one torch and one numba thread (2 cores,
2 ranks), gloo bound to the veth (GLOO_SOCKET_IFNAME).

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

PREFIX = "ciera-bench-"
ADDRESSES = ("10.213.77.1", "10.213.77.2")
PORT = 29613
CHILD_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------- rank side


def _rank_main(args) -> None:
    rank = args.rank
    os.environ.update(MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(PORT), RANK=str(rank), WORLD_SIZE="2")
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
    small_round_s = profile_comm(sizes_bytes=(8,), repeats=20).time_s[0]

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


class Unavailable(Exception):
    """The machine cannot run this benchmark (not root, no iproute2, no network namespaces)."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _namespaces() -> list[str]:
    listing = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    # Processes of a dead run may still sit in it (rank processes whose parent was SIGKILLed): a deleted
    # name would not end the namespace while they live, so end them first (they are ours: this prefix).
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "delete", name, check=False)


def _clean_leftovers() -> list[str]:
    """Remove namespaces of this prefix whose creating process no longer exists."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and _pid_alive(int(owner)) and int(owner) != os.getpid():
            continue  # another live run
        _delete_namespace(name)
        removed.append(name)
    return removed


def _check_environment() -> None:
    if sys.platform != "linux":
        raise Unavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise Unavailable("needs root (creates network namespaces, a veth pair and tc qdiscs)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise Unavailable(f"'{tool}' not found (install iproute2)")
    done = _run("ip", "netns", "list", check=False)
    if done.returncode != 0:
        raise Unavailable(f"'ip netns' does not work here: {done.stderr.strip()}")


class Link:
    """Two namespaces and a rate-limited veth pair between them; ``close()`` removes everything."""

    def __init__(self, rate: str, delay_ms: float) -> None:
        pid = os.getpid()
        self.namespaces = (f"{PREFIX}{pid}-a", f"{PREFIX}{pid}-b")
        self.devices = (f"cb{pid}a", f"cb{pid}b")  # interface names: at most 15 characters
        self.rate, self.delay_ms = rate, delay_ms
        self.processes: list[subprocess.Popen] = []
        self._closed = False

    def open(self) -> None:
        (ns_a, ns_b), (dev_a, dev_b) = self.namespaces, self.devices
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
        # Both ends are created inside their namespaces: no interface ever appears in the root namespace,
        # and deleting the namespaces deletes the pair.
        _run("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, address in zip(self.namespaces, self.devices, ADDRESSES, strict=True):
            _run("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            tbf = ["tbf", "rate", self.rate, "burst", "128kb", "latency", "50ms"]
            if self.delay_ms > 0:
                netem = ["netem", "delay", f"{self.delay_ms}ms", "limit", "100000"]
                done = _run(
                    "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False
                )
                if done.returncode != 0:
                    raise Unavailable(
                        f"--delay-ms needs the netem qdisc, which this kernel lacks: {done.stderr.strip()}"
                    )
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)

    def qdiscs(self) -> list[str]:
        return [
            line.strip()
            for ns, dev in zip(self.namespaces, self.devices, strict=True)
            for line in _run("tc", "-n", ns, "qdisc", "show", "dev", dev).stdout.splitlines()
            if line.strip()
        ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for ns in self.namespaces:
            _delete_namespace(ns)


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
            "addresses": list(ADDRESSES),
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
    link = Link(args.rate, args.delay_ms)
    close_on_exit(link)
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
            for rank, ns in enumerate(link.namespaces):
                rank_env = env | {"GLOO_SOCKET_IFNAME": link.devices[rank]}
                link.processes.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *_rank_command(args, rank, results[rank])],
                        env=rank_env,
                        cwd=_REPO_ROOT,
                    )
                )
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
    """Close ``link`` (remove what it created) at exit, and turn SIGINT/SIGTERM/SIGHUP into an exit so
    that it runs then too."""
    atexit.register(link.close)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)


def wait_for_ranks(processes: list, timeout_s: float, poll_s: float = 0.1) -> list[str]:
    """Wait until every rank process has exited, one has failed, or ``timeout_s`` passed; what went wrong
    (empty when every rank exited 0). A failed rank ends the wait at once: the other would wait for it
    until gloo's timeout."""
    deadline = time.monotonic() + timeout_s
    failed = []
    while any(p.poll() is None for p in processes):
        if any(p.poll() not in (None, 0) for p in processes):
            break
        if time.monotonic() > deadline:
            failed.append(f"ranks still running after {timeout_s} s")
            break
        time.sleep(poll_s)
    for rank, process in enumerate(processes):
        if process.poll() not in (None, 0):
            failed.append(f"rank {rank} exited with {process.returncode}")
    return failed


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
        _rank_main(args)
        return
    sys.exit(_main(args))


if __name__ == "__main__":
    main()
