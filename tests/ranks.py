"""Spawned ranks for the multi-process tests: one way to start them, read their results under a deadline,
and leave.

Each rank runs its worker through ``_rank_main``, which ends the process with ``measure.rank.leave_rank``
once the worker returns (results sent, process group destroyed): a normal interpreter exit can abort a
finished gloo rank (SIGABRT, "terminate called without an active exception"; leave_rank says why).
"""

from __future__ import annotations

import multiprocessing.queues
import time
import traceback
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp

from measure.rank import leave_rank
from measure.train import free_port

__all__ = ["free_port", "read_until_done", "spawn_ranks", "start_ranks"]


def _rank_main(rank: int, worker: Callable, *args) -> None:
    code = 0
    try:
        worker(rank, *args)
    except BaseException:  # noqa: BLE001 — reported here, then the exit code says the rank failed
        traceback.print_exc()
        code = 1
    for arg in args:  # a Queue's feeder thread must have written everything before the process vanishes
        if isinstance(arg, multiprocessing.queues.Queue):
            arg.close()
            arg.join_thread()
    leave_rank(code)


def start_ranks(worker: Callable, nprocs: int, args: tuple, join: bool) -> mp.ProcessContext | None:
    """``torch.multiprocessing.start_processes(worker, args, nprocs, join)``, each rank leaving through
    ``_rank_main``."""
    return mp.start_processes(
        _rank_main, args=(worker, *args), nprocs=nprocs, join=join, start_method="spawn"
    )


def read_until_done(processes: mp.ProcessContext, results, timeout_s: float) -> list:
    """Every message the ranks put on ``results``, read while they run (a message larger than a pipe's
    buffer blocks its put() until someone reads) until all have exited; a hang fails the test at the
    deadline instead of stalling CI."""
    deadline = time.monotonic() + timeout_s
    collected, finished = [], False
    while not finished or not results.empty():
        if not results.empty():
            collected.append(results.get())
            continue
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"ranks still running after {timeout_s:g} s: a hang ({len(collected)} messages in)")
        finished = processes.join(timeout=0.1)
    return collected


def spawn_ranks(worker: Callable, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """``world_size`` ranks of ``worker(rank, world_size, port, *args, results)``; one result per rank,
    sorted."""
    results = mp.get_context("spawn").SimpleQueue()
    processes = start_ranks(worker, world_size, (world_size, free_port(), *args, results), join=False)
    collected = read_until_done(processes, results, timeout_s)
    assert len(collected) == world_size, f"{len(collected)} results from {world_size} ranks"
    return sorted(collected)
