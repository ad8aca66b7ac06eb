"""What `validation.lossless` and `validation.divergence` share: one step count across the runs of their
arms (for a progress bar), and a description of the host the arms ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

ProgressCallback = Callable[[str, int, int], None]  # (status, steps done, steps in all arms)


class ArmProgress:
    """Counts training steps over every arm and reports each one as `on_progress(status, done, total)`."""

    def __init__(self, total_steps: int, on_progress: ProgressCallback | None) -> None:
        self.total_steps, self.done, self.on_progress = total_steps, 0, on_progress

    def arm(self, name: str) -> Callable[[dict], None]:
        """The per-step callback `measure.train.train` calls for the arm `name`."""

        def on_step(record: dict) -> None:
            self.done += 1
            self.say(f"{name}: step {record['step'] + 1}, loss {record['loss']:.4f}")

        return on_step

    def say(self, status: str) -> None:
        if self.on_progress is not None:
            self.on_progress(status, self.done, self.total_steps)


def host_description() -> dict[str, Any]:
    """Where the arms ran (CPU ranks on one host): enough to tell two machines' results apart."""
    return {"hostname": platform.node(), "cpus": len(os.sched_getaffinity(0)), "machine": platform.machine()}
