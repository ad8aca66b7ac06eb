"""Loaded into every Python process `benchmarks/engine_speed.py` starts (it puts this folder first on
PYTHONPATH and sets ENGINE_PROBE_OUT); nothing happens without that variable. In each process that imports
DeepSpeed's ZeRO-3 it times, in thread CPU time, DeepSpeed's own per-module work — the parameter
coordinator's `release_sub_module` (pure Python, no gather), ZeRO-3's Linear forward and backward — and,
every 97 timed calls, a fixed pure-Python reference loop: the host's speed at that moment, measured by the
same thread. Results go to ENGINE_PROBE_OUT.<pid>.json every 500 calls (spawned ranks exit without atexit).
"""

from __future__ import annotations

import json
import os
import sys
import time

REFERENCE_EVERY = 97
WRITE_EVERY = 500


def _install(prefix: str) -> None:
    import deepspeed.runtime.zero.linear as linear
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    totals: dict[str, list[float]] = {}  # name -> [calls, thread CPU s]
    path = f"{prefix}.{os.getpid()}.json"
    timed = [0]

    def reference() -> None:
        start = time.thread_time()
        total = 0
        for value in range(20_000):
            total += value
        entry = totals.setdefault("reference", [0, 0.0])
        entry[0] += 1
        entry[1] += time.thread_time() - start

    def wrap(owner: type, name: str, label: str, static: bool = False) -> None:
        function = getattr(owner, name)
        function = function.__func__ if isinstance(function, staticmethod) else function

        def timed_call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                entry = totals.setdefault(label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.thread_time() - start
                timed[0] += 1
                if timed[0] % REFERENCE_EVERY == 0:
                    reference()
                if timed[0] % WRITE_EVERY == 0:
                    try:
                        with open(path + ".tmp", "w") as handle:
                            json.dump(totals, handle)
                        os.replace(path + ".tmp", path)
                    except OSError:  # the probe never stops the run it times
                        pass

        setattr(owner, name, staticmethod(timed_call) if static else timed_call)

    wrap(coordinator.PartitionedParameterCoordinator, "release_sub_module", "release_sub_module")
    wrap(linear.LinearFunctionForZeroStage3, "forward", "linear_forward", static=True)
    wrap(linear.LinearFunctionForZeroStage3, "backward", "linear_backward", static=True)


if os.environ.get("ENGINE_PROBE_OUT"):
    try:
        _install(os.environ["ENGINE_PROBE_OUT"])
    except Exception as error:  # noqa: BLE001 — a probe that cannot load must not stop the process
        print(f"engine_speed probe not loaded: {error}", file=sys.stderr)
