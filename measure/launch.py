"""Start the ranks of one capture job and watch them: plain local processes, or processes inside the
emulated cluster's node namespaces (`measure.emulated`). Each rank runs `python -m measure.rank JOB_DIR`
with its stdout/stderr in JOB_DIR/rank{r}.log (files, never pipes: a full pipe would stall a rank).

A rank that exits non-zero stops the job at once: the others are killed (they would wait for it until the
process group's timeout) and `CaptureError` names the rank, its exit code and its last log line. No progress
for `timeout_s` stops the job the same way; Ctrl-C kills every rank before the interrupt goes on.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .extensions import extensions_dir
from .train import TrainError, free_port


class CaptureError(TrainError):
    """A capture that cannot start or cannot finish: one line."""


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    # The rank's own one-line error, when it wrote one (a killed rank writes none; its log is in the
    # job directory).
    own = [line for line in lines if line.startswith("rank ")]
    return (own or [""])[-1].strip()[:300]


# How a rank's freed memory is handled (`CapturePlan.allocator`). "retain": glibc keeps what a rank frees
# (no mmap'd chunks, no trimming of the heap), as a GPU rank's caching allocator keeps its blocks; PyTorch's
# CPU allocator otherwise hands every large buffer back to the kernel when it is freed, and the next
# iteration faults it in again — on a VM that hands freed pages back to its host, at a cost measured by
# `python benchmarks/page_cost.py` (docs/measurement.md, "Freed memory kept in the ranks", has the figures).
# "system": glibc's defaults.
ALLOCATORS = ("retain", "system")
RETAIN_ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def allocator_in_use(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """What this process's allocator was told (its environment, read in the rank): ``allocator``
    "retain" when every setting of RETAIN_ALLOCATOR_ENV is in force, else "system"; ``malloc_env``: the
    glibc MALLOC_* variables set, whoever set them."""
    environ = os.environ if environ is None else environ
    malloc_env = {key: value for key, value in sorted(environ.items()) if key.startswith("MALLOC_")}
    retained = all(environ.get(key) == value for key, value in RETAIN_ALLOCATOR_ENV.items())
    return {"allocator": "retain" if retained else "system", "malloc_env": malloc_env}


def rank_environment(rank: int, world_size: int, ranks_per_node: int, port: int) -> dict[str, str]:
    threads = max(1, (os.cpu_count() or 1) // world_size)
    cache = str(extensions_dir())
    environment = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "MASTER_PORT": str(port),
        "TORCH_EXTENSIONS_DIR": cache,
        "OMP_NUM_THREADS": str(threads),
        "NUMBA_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    # DeepSpeed's accelerator follows the rank's placement (measure.rank sets it); a user's own is kept.
    if os.environ.get("DS_ACCELERATOR"):
        environment["DS_ACCELERATOR"] = os.environ["DS_ACCELERATOR"]
    return environment


def run_job(
    job: dict[str, Any],
    job_dir: Path,
    world_size: int,
    ranks_per_node: int,
    cluster=None,
    timeout_s: float = 600.0,
    on_progress: Callable[[dict], None] | None = None,
    allocator: str = "system",
) -> None:
    """Run `job` on `world_size` ranks; results are in `job_dir` when it returns, with
    ``host_cpu.json``: how much of the host's CPU other processes used meanwhile (:func:`host_cpu_record`).
    ``allocator`` "retain" runs every rank with RETAIN_ALLOCATOR_ENV; "system" leaves the environment's."""
    if allocator not in ALLOCATORS:
        raise CaptureError(f"allocator {allocator!r}: expected one of {', '.join(ALLOCATORS)}")
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.json").write_text(json.dumps(job, indent=1))
    port = free_port() if cluster is None else 29500 + (os.getpid() % 1000)
    processes: list[subprocess.Popen] = []
    logs = [job_dir / f"rank{rank}.log" for rank in range(world_size)]
    argv = [sys.executable, "-m", "measure.rank", str(job_dir)]
    start = host_cpu_sample()
    try:
        for rank in range(world_size):
            env = os.environ | rank_environment(rank, world_size, ranks_per_node, port)
            if allocator == "retain":
                env |= RETAIN_ALLOCATOR_ENV
            with logs[rank].open("w") as log:
                if cluster is None:
                    env["MASTER_ADDR"] = "127.0.0.1"
                    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
                else:
                    process = cluster.popen(rank, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            processes.append(process)
        _watch(processes, logs, job_dir / "progress.jsonl", timeout_s, on_progress)
        (job_dir / "host_cpu.json").write_text(json.dumps(host_cpu_record(start, host_cpu_sample())))
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _host_cpus_busy_and_steal_s() -> tuple[int, float, float] | None:
    """(CPUs, CPU-seconds in user, nice and system mode since boot, CPU-seconds the hypervisor stole) over
    the whole host, from /proc/stat; None where there is none. Interrupt time is left out of busy: the
    emulated link's shaping causes it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        fields = [int(value) for value in lines[0].split()[1:]]
        user, nice, system = fields[:3]
    except (OSError, ValueError, IndexError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    ticks = os.sysconf("SC_CLK_TCK")
    steal = fields[7] if len(fields) > 7 else 0  # absent on old kernels
    return cpus, (user + nice + system) / ticks, steal / ticks


def host_cpu_sample() -> dict[str, float] | None:
    """The host's busy and stolen CPU-seconds and this process's own, its finished children's included (the
    ranks, once reaped, with what they ran themselves); two samples make a `host_cpu_record`."""
    host = _host_cpus_busy_and_steal_s()
    if host is None:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "cpus": host[0],
        "host_busy_s": host[1],
        "host_steal_s": host[2],
        "own_cpu_s": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
        "wall_s": time.monotonic(),
    }


def host_cpu_record(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, Any]:
    """What other processes took from the host while a job ran: its CPU-seconds and their share of all the
    host's CPU time (``other_cpu_share``; None where it cannot be read), and the hypervisor's steal share. A capture's times include that
    contention; the console says so (`ciera measure`)."""
    if start is None or end is None:
        return {"other_cpu_share": None}
    wall_s = max(1e-9, end["wall_s"] - start["wall_s"])
    job_cpu_s = end["own_cpu_s"] - start["own_cpu_s"]
    other_cpu_s = max(0.0, end["host_busy_s"] - start["host_busy_s"] - job_cpu_s)
    host_cpu_s = wall_s * max(1, end["cpus"])
    return {
        "wall_s": wall_s,
        "host_cpus": end["cpus"],
        "job_cpu_s": job_cpu_s,
        "other_cpu_s": other_cpu_s,
        "other_cpu_share": other_cpu_s / host_cpu_s,
        # What the hypervisor took from this VM's CPUs meanwhile (0 on bare metal).
        "steal_share": (end["host_steal_s"] - start["host_steal_s"]) / host_cpu_s,
    }


def _watch(processes, logs, progress_path: Path, timeout_s: float, on_progress) -> None:
    seen = 0
    last_progress_s = time.monotonic()
    while True:
        if progress_path.exists():
            lines = progress_path.read_text().splitlines()
            for line in lines[seen:]:
                last_progress_s = time.monotonic()
                if on_progress is not None:
                    on_progress(json.loads(line))
            seen = len(lines)
        codes = [process.poll() for process in processes]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(0.5)  # let the others write what they saw
            described = []
            for rank, code in failed:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                line = _last_line(logs[rank])
                described.append(f"rank {rank} stopped ({why})" + (f": {line}" if line else ""))
            raise CaptureError("capture failed: " + "; ".join(described))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() - last_progress_s > timeout_s:
            raise CaptureError(
                f"capture failed: no progress for {timeout_s:.0f} s (a rank is missing or stuck); "
                f"rank logs in {logs[0].parent}"
            )
        time.sleep(0.2)
