"""One rank of a capture: `python -m measure.rank JOB_DIR`.

Started by `measure.launch` (local processes, or processes inside the emulated cluster's namespaces) or by
torchrun / the deepspeed launcher on a real cluster. The process group comes from the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the rank's device and backend from LOCAL_RANK (`measure.placement`:
cuda:<LOCAL_RANK> with NCCL when CUDA is available, else the CPU with gloo); JOB_DIR/job.json says what to
run; results go to JOB_DIR. A failure is one line on stderr and exit code 1 (the launcher reports it and
stops the other ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

# Set to 1 and a failing rank also prints its traceback to its stderr (the launcher still reports one
# line): for a failure inside an engine, where the line alone does not say where it came from.
TRACEBACK_ENV = "CIERA_TRACEBACK"


def failure_text(error: BaseException, environ: Mapping[str, str] = os.environ) -> str:
    """A rank's failure as the one line its launcher reports (`Type: first line of the message`); with
    CIERA_TRACEBACK=1 the traceback of the exception being handled goes to stderr first."""
    if environ.get(TRACEBACK_ENV) == "1":
        import traceback

        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}"


def _progress_writer(out_dir: Path):
    path = out_dir / "progress.jsonl"

    def progress(record: dict) -> None:
        with path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")

    return progress


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    job = json.loads((out_dir / "job.json").read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        import torch.distributed as dist
    except ImportError as error:
        print(f'rank {rank}: {error}: pip install -e ".[runtime]"', file=sys.stderr, flush=True)
        return 1
    try:
        from .events import EventRecorder
        from .placement import init_group, place_rank

        placement = place_rank()  # cuda:<LOCAL_RANK> with NCCL when CUDA is available, else CPU with gloo
        if rank == 0:
            print(f"ciera measure: {placement.note()}", file=sys.stderr, flush=True)
        if job["kind"] == "layers":
            EventRecorder.install()  # wraps torch.distributed before any engine keeps a reference
        init_group(placement, rank, world_size, float(job.get("timeout_s", 300)))
        progress = _progress_writer(out_dir) if rank == 0 else (lambda record: None)
        if job["kind"] == "layers":
            from .capture import LayersJob, run_layers_rank

            run_layers_rank(LayersJob.from_json(job), out_dir, rank, world_size, progress)
        elif job["kind"] == "collectives":
            from .capture import run_collectives_rank

            run_collectives_rank(job, out_dir, rank, world_size, progress)
        elif job["kind"] == "exponents":
            from .capture import run_exponents_rank

            run_exponents_rank(job, out_dir, rank, world_size, progress)
        else:
            raise ValueError(f"job kind {job['kind']!r}: expected layers, collectives or exponents")
    except Exception as error:  # noqa: BLE001 — one line for the launcher, which stops every rank
        print(f"rank {rank}: {failure_text(error)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def release_deepspeed_shm(environ: Mapping[str, str] = os.environ, shm_dir: Path = Path("/dev/shm")) -> int:
    """Remove the shared-memory buffers DeepSpeed's CPU accelerator made for this job; returns how many.
    When every rank is local it maps one buffer per rank (``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
    <MASTER_PORT>_<rank>``, 66 MiB each, in RAM) and never unlinks them, so every run would leave them
    behind. Every rank maps every buffer while DeepSpeed initialises, so once a rank is done the names
    are no longer needed: whichever rank leaves first removes them all (the job's port keeps other jobs'
    buffers out of the pattern)."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not addr or not port:
        return 0
    removed = 0
    for path in shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        with contextlib.suppress(FileNotFoundError):  # another rank of the job removed it first
            path.unlink()
            removed += 1
    return removed


def leave_rank(code: int) -> NoReturn:
    """End a rank's process once its results are written and its process group destroyed, without the
    interpreter's finalization. A gloo worker thread can still hold the last reference to a finished
    collective's tensors; freeing them during finalization needs the GIL, the thread is made to exit, and
    its forced unwind calls std::terminate ("terminate called without an active exception", SIGABRT).
    Finished ranks aborted that way in CI after all their work, and their launcher counted the run as
    failed. After a successful run DeepSpeed's CPU shared-memory buffers go first (`release_deepspeed_shm`:
    every rank has run collectives with every other, so all of them have mapped every buffer; a failed
    rank leaves them, since a peer still initialising would wait for a removed name forever)."""
    if code == 0:
        release_deepspeed_shm()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave_rank(main(sys.argv[1:]))
