"""`ciera validate sim`: the simulator's replay and prediction checked against measured runs it was not
given. A held-out file, fixed before any prediction is compared with its measurement, names the runs the
simulator may see (clusters and depths); every other measured run of the bundle is predicted from those
(`sim.predict`) and compared with what was measured."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import traces
from sim.predict import SweepModel, predict_iteration_s
from sim.replay import replay_run

SCHEMA = "ciera.validate.sim/1"


class ValidationInputError(ValueError):
    """A held-out file or bundle that cannot be used: one line."""


@dataclass(frozen=True)
class HeldOut:
    """What the simulator may see; every other measured run with events is held out."""

    seen_clusters: tuple[str, ...]
    seen_layers: tuple[int, ...]
    origin: str
    fixed: str = ""  # when and how the file was fixed (its own words)


def default_held_out_path() -> Path:
    return traces.measured_bundle_path().with_name("measured.held-out.toml")


def load_held_out(path: Path) -> HeldOut:
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValidationInputError(f"{path}: cannot read the held-out file ({error})") from None
    seen = document.get("seen")
    if not isinstance(seen, dict):
        raise ValidationInputError(f"{path}: table [seen] missing (clusters = [...], layers = [...])")
    clusters, layers = seen.get("clusters"), seen.get("layers")
    if not (isinstance(clusters, list) and clusters and all(isinstance(c, str) for c in clusters)):
        raise ValidationInputError(
            f"{path}: field 'seen.clusters' is {clusters!r}, expected a list of cluster names"
        )
    if not (isinstance(layers, list) and layers and all(isinstance(n, int) and n >= 1 for n in layers)):
        raise ValidationInputError(
            f"{path}: field 'seen.layers' is {layers!r}, expected a list of depths >= 1"
        )
    return HeldOut(tuple(clusters), tuple(sorted(layers)), str(path), str(document.get("fixed", "")))


def _subset(bundle: traces.TraceBundle, run_ids: set[str]) -> traces.TraceBundle:
    keep = {name: bundle.table(name)[bundle.table(name)["run_id"].isin(run_ids)] for name in
            ("runs", "layers", "iterations", "exponents", "events", "shard_changes")}  # fmt: skip
    return dataclasses.replace(bundle, **keep)


def _category(run: pd.Series, seen_runs: pd.DataFrame) -> str:
    same_topology = seen_runs["gpus_per_node"].eq(run["gpus_per_node"]).any()
    same_link = seen_runs["link_rate_Bps"].eq(run["link_rate_Bps"]).any()
    if not same_topology:
        return "topology"
    if not same_link:
        return "link"
    return "depth"


def measurement_noise(bundle: traces.TraceBundle, measured_runs: pd.DataFrame) -> dict[str, Any]:
    """How repeatable the measurements are, independent of any model: the spread of a run's timed
    iterations ((max − min) / median), and how far a line a + b·L fitted to *all* measured depths of one
    (cluster, system) — in sample, the best any depth-linear model can do — misses its own points."""
    times = bundle.iterations[bundle.iterations["run_id"].isin(measured_runs["run_id"])]
    per_run = times.groupby("run_id")["iteration_s"].agg(["median", "min", "max", "size"])
    spread = (per_run["max"] - per_run["min"]) / per_run["median"]
    timed = measured_runs.join(per_run, on="run_id", how="inner")
    residuals: list[float] = []
    for _, group in timed.groupby(["cluster", "system"]):
        if group["layers"].nunique() < 3:  # a line through two points has no residual to speak of
            continue
        depths, medians = group["layers"].to_numpy(dtype=float), group["median"].to_numpy()
        slope, intercept = np.polyfit(depths, medians, 1)
        residuals += list(np.abs((intercept + slope * depths) / medians - 1.0))
    return {
        "timed_iterations_per_run": int(per_run["size"].min()) if len(per_run) else 0,
        "iteration_spread_mean": float(spread.mean()) if len(spread) else 0.0,
        "iteration_spread_max": float(spread.max()) if len(spread) else 0.0,
        "depth_line_residual_mean": float(np.mean(residuals)) if residuals else None,
        "depth_line_residual_max": float(np.max(residuals)) if residuals else None,
    }


def validate_sim(bundle: traces.TraceBundle, held_out: HeldOut, tolerance: float) -> dict[str, Any]:
    measured_runs = bundle.runs[
        (bundle.runs["source"] == "measured") & bundle.runs["run_id"].isin(set(bundle.events["run_id"]))
    ]
    if measured_runs.empty:
        raise ValidationInputError("bundle: no measured run with events (capture one with `ciera measure`)")
    unknown = sorted(set(held_out.seen_clusters) - set(measured_runs["cluster"]))
    if unknown:
        raise ValidationInputError(
            f"{held_out.origin}: seen cluster {unknown[0]!r} is not in the bundle "
            f"(it has {', '.join(sorted(set(measured_runs['cluster'])))})"
        )
    is_seen = measured_runs["cluster"].isin(held_out.seen_clusters) & measured_runs["layers"].isin(
        held_out.seen_layers
    )
    seen_runs, target_runs = measured_runs[is_seen], measured_runs[~is_seen]
    if target_runs.empty:
        raise ValidationInputError(f"{held_out.origin}: every measured run is seen; nothing is held out")
    seen = _subset(bundle, set(seen_runs["run_id"]))
    measured_s = bundle.iterations.groupby("run_id")["iteration_s"].median()

    replay_rows = []
    for run in seen_runs.sort_values(["cluster", "layers", "system"]).itertuples():
        per_iteration = replay_run(seen, run.run_id)
        replayed = float(per_iteration["replayed_s"].median())
        replay_rows.append({
            "run_id": run.run_id, "cluster": run.cluster, "layers": int(run.layers), "system": run.system,
            "measured_s": float(measured_s[run.run_id]), "replayed_s": replayed,
            "error": replayed / float(measured_s[run.run_id]) - 1.0,
        })  # fmt: skip

    predicted: dict[str, tuple[float, str]] = {}
    for run in target_runs.itertuples():
        prediction = predict_iteration_s(seen, pd.Series(run._asdict()))
        predicted[run.run_id] = (prediction.iteration_s, prediction.basis)
    baseline = {(r.cluster, int(r.layers)): r.run_id for r in target_runs.itertuples() if r.system == "zero3"}
    held_rows = []
    for run in target_runs.sort_values(["cluster", "layers", "system"]).itertuples():
        value, basis = predicted[run.run_id]
        measured = float(measured_s[run.run_id])
        base_id = baseline.get((run.cluster, int(run.layers)))
        speedup_error = None
        if base_id is not None and run.system != "zero3":
            measured_speedup = float(measured_s[base_id]) / measured
            predicted_speedup = predicted[base_id][0] / value
            speedup_error = predicted_speedup / measured_speedup - 1.0
        held_rows.append({
            "run_id": run.run_id, "cluster": run.cluster, "layers": int(run.layers), "system": run.system,
            "category": _category(pd.Series(run._asdict()), seen_runs),
            "measured_s": measured, "predicted_s": value, "error": value / measured - 1.0,
            "speedup_error": speedup_error, "basis": basis,
        })  # fmt: skip
    replay_errors = np.abs([row["error"] for row in replay_rows])
    held_errors = np.abs([row["error"] for row in held_rows])
    by_category = {
        category: float(np.mean([abs(r["error"]) for r in held_rows if r["category"] == category]))
        for category in sorted({r["category"] for r in held_rows})
    }
    calibration = []
    for cluster in sorted(set(measured_runs["cluster"])):
        run = measured_runs[measured_runs["cluster"] == cluster].iloc[0]
        model = SweepModel.for_cluster(bundle.collectives, run)
        if model is None:
            continue
        for op in sorted(model.alpha_s):
            calibration.append({
                "cluster": cluster, "op": op, "world_size": int(run.world_size), "nodes": int(run.nodes),
                "alpha_s": model.alpha_s[op],
                "beta_Bps": 1.0 / model.inverse_beta[op] if model.inverse_beta[op] > 0 else None,
                "relative_rms_residual": model.residual[op],
            })  # fmt: skip
    document = {
        "schema": SCHEMA,
        "calibration": calibration,
        "tolerance": tolerance,
        "held_out_file": held_out.origin,
        "seen": {"clusters": list(held_out.seen_clusters), "layers": list(held_out.seen_layers)},
        "replay": replay_rows,
        "held_out": held_rows,
        "replay_mean_abs_error": float(replay_errors.mean()) if len(replay_errors) else 0.0,
        "replay_max_abs_error": float(replay_errors.max()) if len(replay_errors) else 0.0,
        "held_out_mean_abs_error": float(held_errors.mean()),
        "held_out_max_abs_error": float(held_errors.max()),
        "held_out_mean_abs_error_by_category": by_category,
        "measurement_noise": measurement_noise(bundle, measured_runs),
    }
    document["passed"] = bool(
        document["replay_max_abs_error"] <= 0.02
        and document["held_out_mean_abs_error"] <= tolerance
        and document["held_out_max_abs_error"] <= 2 * tolerance
    )
    return document
