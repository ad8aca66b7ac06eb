"""From a capture directory (`measure.campaign`) to a trace bundle: the runs table from each run's job,
result and topology; events from every rank's file; the per-layer and iteration tables derived from the
events (`traces.derive_layer_tables`, with the measured end-to-end iteration times); collectives from the
sweeps; exponents and shard changes from the exponent-statistics run."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

import traces

from .capture import SYSTEMS, LayersJob
from .launch import CaptureError
from .zoo import scaled_shape


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CaptureError(f"{path}: cannot read the capture's record ({error})") from None


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _versions(run: dict[str, Any], extra: dict[str, Any]) -> str:
    versions = json.loads(run.get("versions", "{}"))
    versions.update(extra)
    return json.dumps(versions, sort_keys=True)


def _run_row(
    run_id: str,
    label: str,
    train: dict[str, Any],
    system: str,
    world_size: int,
    topology: dict[str, Any],
    run: dict[str, Any],
    schedule: dict[str, Any],
    warmup: int,
    extra_versions: dict[str, Any],
) -> dict[str, Any]:
    shape = scaled_shape(train["model"], train["width_scale"], train["layers"])
    full = scaled_shape(train["model"], train["width_scale"], None)
    ranks_per_node = int(topology["ranks_per_node"])
    return {
        "run_id": run_id,
        "source": "measured",
        "model": label,
        "dtype": "bf16",
        "layers": shape.num_layers,
        "full_layers": full.num_layers,
        "seq_len": train["seq_len"],
        "micro_batch_size": train["global_batch"] // world_size,
        "world_size": world_size,
        "gpus_per_node": ranks_per_node,
        "hardware": run["hardware"],
        "cluster": topology["name"],
        "system": system,
        "block_size": train["block_size"],
        "activation_checkpointing": bool(train["activation_checkpointing"]),
        "optimizer": "adam",
        "versions": _versions(run, extra_versions),
        "engine": train["engine"],
        "backend": run.get("backend", "gloo"),  # run.json before the placement said gloo
        "nodes": math.ceil(world_size / ranks_per_node),
        "prefetch_bucket_size": int(schedule["prefetch_bucket_size"]),
        "max_reuse_distance": int(schedule["max_reuse_distance"]),
        "max_live_parameters": int(schedule["max_live_parameters"]),
        "reshard_after_forward": bool(schedule["reshard_after_forward"]),
        "link_rate_Bps": float(topology["link_rate_Bps"]),
        "link_latency_s": float(topology["link_latency_s"]),
        "measured_link_Bps": float(topology["measured_link_Bps"]),
        "warmup_iterations": warmup,
        "clock_spread_s": float(run.get("clock_spread_s", 0.0)),
        # Runs captured before it was recorded (and the exponent-statistics run) leave it NaN.
        "reduce_bucket_size": float(schedule.get("reduce_bucket_size", math.nan)),
    }


def _read_json_if_present(path: Path) -> dict[str, Any]:
    """A record a capture may lack (written by a later version): {} when absent."""
    return _read_json(path) if path.exists() else {}


def finished_sweeps(out_dir: Path) -> list[tuple[Path, str, list[dict[str, Any]]]]:
    """Each finished collectives sweep in a capture directory: its directory, its cluster's name, its rows."""
    return [
        (
            sweep_dir,
            _read_json(sweep_dir / "topology.json")["name"],
            _read_json(sweep_dir / "collectives.json")["rows"],
        )
        for sweep_dir in sorted((out_dir / "collectives").glob("*/"))
    ]


def _launches_by_run(out_dir: Path) -> list[list[tuple[Path, LayersJob, dict[str, Any]]]]:
    """The finished layer runs of a capture directory, each as its launches (directory, job, result) in
    launch order; a run captured in one launch has one."""
    by_run: dict[str, list[tuple[Path, LayersJob, dict[str, Any]]]] = {}
    for run_dir in sorted((out_dir / "runs").glob("*/")):
        job = LayersJob.from_json(_read_json(run_dir / "job.json"))
        by_run.setdefault(job.run_id, []).append((run_dir, job, _read_json(run_dir / "run.json")))
    for run_id, launches in by_run.items():
        launches.sort(key=lambda launch: launch[1].launch)
        numbers = [job.launch for _, job, _ in launches]
        for earlier, later in itertools.pairwise(numbers):  # sorted: a launch twice sits side by side
            if earlier == later:
                raise CaptureError(
                    f"{out_dir / 'runs'}: run {run_id} has launch {later} twice; expected each launch once"
                )
    return [by_run[run_id] for run_id in sorted(by_run)]


def assemble_bundle(out_dir: Path) -> traces.TraceBundle:
    """The bundle of every finished step in `out_dir`."""
    from .campaign import model_label

    runs, events, iteration_rows, numel_rows = [], [], [], []
    for launches in _launches_by_run(out_dir):
        first_dir, job, first = launches[0]
        topology = _read_json(first_dir / "topology.json")
        train = _read_json(first_dir / "job.json")["train"]
        label = model_label(job.train.model, job.train.width_scale or 1)
        results = [run for _, _, run in launches]
        cpu_shares = [
            _read_json_if_present(run_dir / "host_cpu.json").get("other_cpu_share")
            for run_dir, _, _ in launches
        ]
        runs.append(
            _run_row(
                job.run_id,
                label,
                train,
                job.system,
                first["world_size"],
                topology,
                first | {"clock_spread_s": max(float(run.get("clock_spread_s", 0.0)) for run in results)},
                first["schedule"],
                job.warm_steps + job.warmup_iterations,  # every iteration before the first traced
                {
                    "clock": first["clock"],
                    "threads_per_rank": first["threads_per_rank"],
                    "ciera_enabled": SYSTEMS[job.system][1],
                    "ciera_select": bool(job.train.select),
                    "warm_steps": job.warm_steps,
                    # Each run timed at least this long (0: `iterations` timed), and the warm-up iteration
                    # the count was read from (measure/capture.py, timed_iterations): the first launch's.
                    "min_timed_s": job.min_timed_s,
                    "warmup_iteration_s": first.get("warmup_iteration_s"),
                    # Python's GC, run before each timed iteration outside its time (measure/capture.py)
                    "gc_collect_median_s": _median(
                        [s for run in results for s in run.get("gc_collect_s", [])]
                    ),
                    # CPU per rank and iteration beside the main thread (transport threads), median; None
                    # for runs captured before it was recorded.
                    "transport_cpu_median_s": _median(
                        [s for run in results for s in run.get("transport_cpu_s", [])]
                    ),
                    # Share of the host's CPU other processes used while the run's job ran (launch.py), the
                    # largest over its launches; None for runs captured before it was recorded.
                    "other_cpu_share": max((c for c in cpu_shares if c is not None), default=None),
                    # Fresh-rank launches whose timed iterations the run pools (CapturePlan.launches), and
                    # each launch's median iteration: how far the launches' speeds differ.
                    "launches": len(launches),
                    "launch_median_s": [_median(run["iteration_s"]) for run in results],
                },
            )
        )
        offset = 0  # each launch's iterations follow the previous launch's: one run, its iterations pooled
        for run_dir, _, run in launches:
            for rank in range(run["world_size"]):
                rank_events = pd.read_parquet(run_dir / f"events-rank{rank}.parquet")
                events.append(rank_events.assign(iteration=rank_events["iteration"] + offset))
            for index, seconds in enumerate(run["iteration_s"]):
                iteration_rows.append(
                    {"run_id": job.run_id, "iteration": offset + index, "iteration_s": seconds}
                )
            offset += len(run["iteration_s"])
        for layer, numel in enumerate(first["layer_numel"]):
            numel_rows.append({"run_id": job.run_id, "layer": layer, "numel": numel})
    exponents, shard_changes = [], []
    for run_dir in sorted((out_dir / "exponents").glob("*/")):
        job = _read_json(run_dir / "job.json")
        run = _read_json(run_dir / "run.json")
        topology = _read_json(run_dir / "topology.json")
        train = job["train"]
        runs.append(
            _run_row(
                job["run_id"],
                model_label(train["model"], train["width_scale"] or 1),
                train,
                "zero3",
                run["world_size"],
                topology,
                run,
                {
                    "prefetch_bucket_size": 0,
                    "max_reuse_distance": 0,
                    "max_live_parameters": 0,
                    "reshard_after_forward": False,
                },
                int(job.get("warm_steps", 0)) + int(job["warmup_steps"]),
                {
                    "purpose": "exponent statistics",
                    "steps": train["steps"],
                    "warm_steps": int(job.get("warm_steps", 0)),
                },
            )
        )
        exponents.append(pd.read_parquet(run_dir / "exponents.parquet"))
        shard_changes.append(pd.read_parquet(run_dir / "shard_changes.parquet"))
    collectives = []
    for _, cluster, rows in finished_sweeps(out_dir):
        for row in rows:
            # A sweep written before transport CPU was measured: not measured (NaN), said by the simulator.
            collectives.append(
                {"cluster": cluster, "transport_cpu_s": float("nan"), **row, "source": "measured"}
            )
    if not runs:
        raise CaptureError(f"{out_dir}: no finished run to assemble (runs/ and exponents/ are empty)")
    runs_frame = pd.DataFrame(runs, columns=traces.empty_table("runs").columns)
    events_frame = _concat(events, "events")
    layers_frame, iterations_frame = traces.derive_layer_tables(
        runs_frame,
        events_frame,
        pd.DataFrame(numel_rows, columns=["run_id", "layer", "numel"]),
        iteration_s=pd.DataFrame(iteration_rows, columns=["run_id", "iteration", "iteration_s"]),
    )
    return traces.TraceBundle(
        runs=_typed(runs_frame, "runs"),
        layers=_typed(layers_frame, "layers"),
        iterations=_typed(iterations_frame, "iterations"),
        collectives=_typed(pd.DataFrame(collectives), "collectives"),
        exponents=_concat(exponents, "exponents"),
        events=events_frame,
        shard_changes=_concat(shard_changes, "shard_changes"),
    )


def _concat(frames: list[pd.DataFrame], table: str) -> pd.DataFrame:
    if not frames:
        return traces.empty_table(table)
    return _typed(pd.concat(frames, ignore_index=True), table)


def _typed(frame: pd.DataFrame, table: str) -> pd.DataFrame:
    """Columns in the schema's order and dtypes (an empty frame gets the schema's empty table)."""
    empty = traces.empty_table(table)
    if frame.empty:
        return empty
    return frame[list(empty.columns)].astype(empty.dtypes.to_dict())
