"""Crafted simulation records, timeline and trace bundle for the report tests (no simulator needed)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest

from sim import SYSTEMS
from traces import TraceBundle, empty_table

STREAMS = ("compute", "allgather", "reduce_scatter", "codec_send", "codec_recv")
GPUS = (4, 8, 16, 32, 64, 128)


def crafted_records(
    models: tuple[str, ...] = ("Model-A", "Model-B"), measured_model: str = "Model-A"
) -> list[dict]:
    """A sweep shaped like `ciera simulate --json`; W <= 8 of `measured_model` is marked measured."""
    records: list[dict[str, Any]] = []
    for model_index, model in enumerate(models):
        for dtype in ("bf16", "fp16"):
            for gpus in GPUS:
                compute_s = 1.0 + 0.1 * model_index
                allgather_s = 0.2 * math.log2(gpus)
                iteration_by_system = {
                    "zero3": compute_s + allgather_s,
                    "fsdp": compute_s + 0.9 * allgather_s,
                    "zeropp": compute_s + 0.6 * allgather_s,
                    "ciera-er": compute_s + 0.7 * allgather_s,
                    "ciera-er-bsc": compute_s + 0.6 * allgather_s,
                    "ciera": compute_s + 0.4 * allgather_s,
                }
                for system in SYSTEMS:
                    if system == "zeropp" and dtype == "bf16":
                        continue
                    iteration_s = iteration_by_system[system]
                    exposed_s = iteration_s - compute_s
                    source = "measured" if model == measured_model and gpus <= 8 else "analytic"
                    records.append(
                        {
                            "model": model,
                            "dtype": dtype,
                            "gpus": gpus,
                            "system": system,
                            "source": source,
                            "iteration_s": {
                                "p5": 0.97 * iteration_s,
                                "p50": iteration_s,
                                "p95": 1.04 * iteration_s,
                            },
                            "breakdown_s": {
                                "compute": compute_s * 0.95,
                                "exposed_allgather": exposed_s * 0.7,
                                "exposed_reduce_scatter": exposed_s * 0.2,
                                "codec_critical": exposed_s * 0.1 if system.startswith("ciera") else 0.0,
                                "other": compute_s * 0.05
                                + (0.0 if system.startswith("ciera") else exposed_s * 0.1),
                            },
                            "allgather_bytes_per_iter": int(
                                3e9 * (0.55 if system.startswith("ciera") else 1.0)
                            ),
                            "speedup_vs_zero3": iteration_by_system["zero3"] / iteration_s,
                            "speedup_vs_zeropp": iteration_by_system["zeropp"] / iteration_s
                            if dtype == "fp16"
                            else None,
                            "shards_selected": 40 if system.startswith("ciera") else None,
                            "bound_speedup": iteration_by_system["zero3"] / max(compute_s, 0.5 * allgather_s),
                            "overlap_only_speedup": iteration_by_system["zero3"]
                            / max(compute_s, allgather_s),
                        }
                    )
    return records


def crafted_timeline() -> list[dict]:
    """A few events per stream per system, microseconds, Chrome-trace 'X' events."""
    events: list[dict[str, Any]] = []
    for system_index, system in enumerate(SYSTEMS):
        for stream_index, stream in enumerate(STREAMS):
            if stream.startswith("codec") and not system.startswith("ciera"):
                continue
            for layer in range(4):
                start_us = 1000.0 * layer + 100.0 * stream_index
                events.append(
                    {
                        "name": f"fwd L{layer} {stream}",
                        "ph": "X",
                        "pid": system,
                        "tid": stream,
                        "ts": start_us,
                        "dur": 600.0 - 50.0 * system_index,
                        "args": {"layer": layer},
                    }
                )
    return events


def crafted_bundle() -> TraceBundle:
    runs = empty_table("runs")
    runs = pd.DataFrame(
        [
            {
                **{column: None for column in runs.columns},
                "run_id": "r0",
                "source": "analytic",
                "model": "Model-A",
                "dtype": "bf16",
            },
        ]
    )
    rows = []
    for iteration in range(1, 6):
        for category_index, category in enumerate(("expert_ffn", "attention", "router", "norm", "embedding")):
            for shard in range(3):
                rate = 0.01 * (category_index + 1) / iteration
                rows.append(
                    {
                        "run_id": "r0",
                        "iteration": iteration,
                        "layer": 1,
                        "shard": f"layer1.{category}.{shard}",
                        "category": category,
                        "numel": 4096 * (shard + 1),
                        "block_size": 512,
                        "exp_change_rate": rate,
                        "block_change_rate": min(1.0, rate * 20),
                    }
                )
    return TraceBundle(
        runs=runs,
        layers=empty_table("layers"),
        iterations=empty_table("iterations"),
        collectives=empty_table("collectives"),
        exponents=pd.DataFrame(rows),
    )


@pytest.fixture
def records() -> list[dict]:
    return crafted_records()


@pytest.fixture
def timeline_events() -> list[dict]:
    return crafted_timeline()


@pytest.fixture
def bundle() -> TraceBundle:
    return crafted_bundle()
