"""measure.rank.release_deepspeed_shm: the buffers DeepSpeed's CPU accelerator leaves in /dev/shm are
removed for this job's MASTER_ADDR/PORT only."""

from __future__ import annotations

import os
from pathlib import Path

from measure.rank import release_deepspeed_shm


def _buffer(shm_dir: Path, port: int, rank: int, uid: int | None = None) -> Path:
    path = (
        shm_dir / f"deepspeed_allreduce_buffer_{os.getuid() if uid is None else uid}_127.0.0.1_{port}_{rank}"
    )
    path.write_bytes(b"\0" * 16)
    return path


def test_this_jobs_buffers_go_and_no_one_elses(tmp_path: Path) -> None:
    mine = [_buffer(tmp_path, 29500, rank) for rank in range(3)]
    other_job = _buffer(tmp_path, 29501, 0)
    other_user = _buffer(tmp_path, 29500, 0, uid=os.getuid() + 1)
    unrelated = tmp_path / "torch_shm_1234"
    unrelated.write_bytes(b"x")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert release_deepspeed_shm(env, tmp_path) == 3
    assert not any(path.exists() for path in mine)
    assert other_job.exists() and other_user.exists() and unrelated.exists()
    assert release_deepspeed_shm(env, tmp_path) == 0  # the other ranks of the job find nothing left


def test_without_a_rendezvous_address_nothing_is_touched(tmp_path: Path) -> None:
    kept = _buffer(tmp_path, 29500, 0)
    assert release_deepspeed_shm({}, tmp_path) == 0
    assert release_deepspeed_shm({"MASTER_ADDR": "127.0.0.1"}, tmp_path) == 0
    assert kept.exists()
