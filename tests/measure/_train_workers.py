"""Spawned ranks for the `ciera train` tests: several runs in one process group (one spawn, one DeepSpeed
start-up), each run the real `measure.train.run_rank`."""

from __future__ import annotations

import dataclasses
import os


def runs_worker(rank: int, world_size: int, port: int, runs: list, result_queue) -> None:
    import torch.distributed as dist

    from measure.train import _init_group, run_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    try:
        _init_group(rank, world_size, runs[0][1])
        results = {}
        for name, config in runs:
            results[name] = dataclasses.asdict(run_rank(rank, world_size, config, lambda record: None))
        result_queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def hung_rank(ready) -> None:
    """A rank stuck in a wait, with the stack dump `measure.train` registers in its spawned ranks."""
    import faulthandler
    import signal
    import time

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ready.set()
    while True:
        time.sleep(0.05)
