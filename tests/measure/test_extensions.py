"""measure/extensions.py: DeepSpeed's build locks — a killed capture's are removed, a rank never waits for
one forever."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from measure.extensions import BuildLockError, build_locks, remove_locks_since, wait_for_locks


def _lock(cache: Path, op: str, mtime_s: float | None = None) -> Path:
    path = cache / op / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    if mtime_s is not None:
        os.utime(path, (mtime_s, mtime_s))
    return path


def test_only_locks_made_since_the_killed_capture_started_are_removed(tmp_path: Path) -> None:
    started_s = time.time() - 60
    old = _lock(tmp_path, "older_op", started_s - 3600)  # another process's, from before: left alone
    held = _lock(tmp_path, "deepspeed_shm_comm", started_s + 5)
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").touch()  # the op itself stays
    assert remove_locks_since(tmp_path, started_s) == [held]
    assert not held.exists() and old.exists()
    assert (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()
    assert build_locks(tmp_path) == [old]


def test_a_missing_cache_has_no_locks(tmp_path: Path) -> None:
    assert build_locks(tmp_path / "nope") == []
    assert remove_locks_since(tmp_path / "nope", 0.0) == []
    assert wait_for_locks(tmp_path / "nope", timeout_s=0.0) < 0.1


def test_a_lock_released_meanwhile_is_waited_for(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "deepspeed_shm_comm")
    releaser = threading.Timer(0.3, lock.unlink)
    releaser.start()
    try:
        waited_s = wait_for_locks(tmp_path, timeout_s=10.0, poll_s=0.05)
    finally:
        releaser.join()
    assert 0.2 <= waited_s < 5.0


def test_a_lock_held_past_the_timeout_is_one_line_naming_it(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "deepspeed_shm_comm")
    started_s = time.monotonic()
    with pytest.raises(BuildLockError) as raised:
        wait_for_locks(tmp_path, timeout_s=0.2, poll_s=0.05)
    assert time.monotonic() - started_s < 5.0
    message = str(raised.value)
    assert "\n" not in message and str(lock) in message and "delete the file" in message
    assert lock.exists()  # the rank never deletes it: another process may be building
