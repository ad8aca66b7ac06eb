"""DeepSpeed's compiled-op cache (TORCH_EXTENSIONS_DIR) and the build locks in it.

On the CPU accelerator every DeepSpeed process loads its shared-memory op through torch's JIT loader,
which holds ``<cache>/<op>/lock`` while it checks (or first builds, ~60 s here) the op, and every other
process waits for that file to go — with no timeout. A process killed while it holds the lock (a capture
SIGKILLed during its ranks' start, whose leftovers the next capture then kills) leaves the file behind,
and every later DeepSpeed process on that cache waits forever. So:

- the capture that removes a killed capture's leftovers also removes the locks created while that capture
  ran (`remove_locks_since`), and says so;
- a rank waits for a lock at most its run's timeout before it loads DeepSpeed (`wait_for_locks`), then
  stops with one line naming the file, instead of hanging.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

LOCK_POLL_S = 0.5


def extensions_dir() -> Path:
    """The cache the ranks use: TORCH_EXTENSIONS_DIR, or `.torch_extensions` in the working directory
    (not the home directory)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.cwd() / ".torch_extensions")


def build_locks(cache: Path) -> list[Path]:
    """The op build locks in `cache` now (one per op directory)."""
    return sorted(cache.glob("*/lock")) if cache.is_dir() else []


def remove_locks_since(cache: Path, since_s: float) -> list[Path]:
    """Remove the build locks in `cache` last modified at or after `since_s` (epoch seconds): those a
    capture started then and killed since may have held. Older ones are left alone."""
    removed = []
    for lock in build_locks(cache):
        try:
            if lock.stat().st_mtime >= since_s:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:  # released meanwhile
            continue
    return removed


class BuildLockError(RuntimeError):
    """A build lock held past the wait: one line."""


def wait_for_locks(cache: Path, timeout_s: float, poll_s: float = LOCK_POLL_S) -> float:
    """Wait until `cache` holds no build lock, at most `timeout_s`; the seconds waited. A lock still there
    then raises BuildLockError naming it (a build still running elsewhere, or a killed process's leftover)."""
    started_s = time.monotonic()
    while True:
        locks = build_locks(cache)
        waited_s = time.monotonic() - started_s
        if not locks:
            return waited_s
        if waited_s >= timeout_s:
            raise BuildLockError(
                f"DeepSpeed's op build lock {locks[0]} has been held for {waited_s:.0f} s: a build still "
                "running in another process, or the leftover of a killed one — delete the file if no other "
                "DeepSpeed process uses this cache"
            )
        time.sleep(poll_s)
