"""Two (or more) spawned gloo ranks on loopback for a benchmark, each putting one result on a queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_loopback_ranks(worker: Callable, args: Any, world_size: int = 2) -> list[dict]:
    """Spawn ``worker(rank, world_size, port, args, queue)`` on ``world_size`` processes with a free
    loopback port for the group; return what each put on the queue, by rank (each result is a dict with
    its ``rank``). torch is imported here, after the caller checked its arguments."""
    import torch.multiprocessing as mp

    from measure.train import free_port

    port = free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world_size, port, args, queue), nprocs=world_size, start_method="spawn")
    return sorted((queue.get() for _ in range(world_size)), key=lambda result: result["rank"])
