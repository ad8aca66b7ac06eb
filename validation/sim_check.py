"""`ciera validate sim`: the simulator's replay and prediction checked against measured runs it was not
given. A held-out file, fixed before any prediction is compared with its measurement, names the runs the
simulator may see (clusters, depths, systems); every other measured run of the bundle is predicted from
those by exactly the graph rewrites that make `ciera simulate` projections (`sim.predict.predict_run`)
and compared with what was measured.

Categories, by what the held-out run has that no seen run has (first match): `system` (a system no seen
run ran: the CIERA rewrite of the plain engine's graph), `topology` (another nodes × ranks-per-node
shape, a larger world size among them), `link` (another link rate), `depth` (another depth)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import traces
from sim.ciera_rewrite import PLAIN_ENGINE, CodecFigures, fit_system_figures
from sim.errors import SimInputError
from sim.evaluate import BREAKDOWN_KEYS
from sim.predict import CieraOn, Prediction, predict_run
from sim.replay import measured_critical_path, replay_run
from sim.rewrite import measured_cluster

SCHEMA = "ciera.validate.sim/1"
CATEGORIES = ("depth", "link", "topology", "system")


class ValidationInputError(ValueError):
    """A held-out file or bundle that cannot be used: one line."""


@dataclass(frozen=True)
class HeldOut:
    """What the simulator may see; every other measured run with events is held out."""

    seen_clusters: tuple[str, ...]
    seen_layers: tuple[int, ...]
    origin: str
    fixed: str = ""  # when and how the file was fixed (its own words)
    seen_systems: tuple[str, ...] | None = None  # None: every system
    codec_runs: tuple[str, ...] = ()  # runs whose codec events only the CIERA rewrite may read


def default_held_out_path(bundle: str = "measured") -> Path | None:
    """The held-out file shipped beside a shipped bundle (`<name>.held-out.toml`), None for any other."""
    if bundle not in traces.NAMED_BUNDLES:
        return None
    path = traces.resolve_bundle(bundle)
    held_out = path.with_name(f"{path.name}.held-out.toml")
    return held_out if held_out.is_file() else None


def _given(value: object) -> str:
    """A field's value as an error names it: 'missing' where the file has none (not 'None')."""
    return "missing" if value is None else f"is {value!r}"


def _string_list(path: Path, document: dict, table: str, key: str, required: bool) -> tuple[str, ...] | None:
    section = document.get(table, {})
    if not isinstance(section, dict):
        raise ValidationInputError(f"{path}: '{table}' is {section!r}, expected a table [{table}]")
    value = section.get(key)
    if value is None and not required:
        return None
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise ValidationInputError(f"{path}: field '{table}.{key}' {_given(value)}, expected a list of names")
    return tuple(value)


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
            f"{path}: field 'seen.clusters' {_given(clusters)}, expected a list of cluster names"
        )
    depths_ok = isinstance(layers, list) and layers
    # bool is an int in Python: `layers = [true]` would read as depth 1.
    if not (depths_ok and all(type(n) is int and n >= 1 for n in layers)):
        raise ValidationInputError(
            f"{path}: field 'seen.layers' {_given(layers)}, expected a list of depths >= 1"
        )
    systems = _string_list(path, document, "seen", "systems", required=False)
    codec = _string_list(path, document, "codec", "runs", required=False) if "codec" in document else None
    return HeldOut(
        tuple(clusters),
        tuple(sorted(layers)),
        str(path),
        str(document.get("fixed", "")),
        systems,
        codec or (),
    )


def category(run: pd.Series, seen_runs: pd.DataFrame) -> str:
    """What the held-out run has that no seen run has (the first of system, topology, link, depth)."""
    if not seen_runs["system"].eq(run["system"]).any():
        return "system"
    shape = seen_runs["nodes"].eq(run["nodes"]) & seen_runs["gpus_per_node"].eq(run["gpus_per_node"])
    if not shape.any():
        return "topology"
    if not (shape & seen_runs["link_rate_Bps"].eq(run["link_rate_Bps"])).any():
        return "link"
    return "depth"


def ciera_verdicts(held_rows: list[dict], replay_rows: list[dict]) -> list[dict[str, Any]]:
    """Turning CIERA on, as measured and as predicted: for every predicted held-out CIERA run whose plain
    engine (ZeRO-3 for `ciera`, FSDP2 for `ciera-fsdp`) ran the same cluster and depth, CIERA's speedup over
    that run, measured and predicted, and whether the prediction falls on the measured side of 1.0× — the
    question a projection answers for its user. The plain run's predicted time is its prediction when held
    out and its replay when seen (the replay is what the simulator makes of a seen run)."""
    plain_s: dict[tuple[str, int, str], tuple[float, float | None]] = {}
    for row in replay_rows:
        plain_s[(row["cluster"], row["layers"], row["system"])] = (row["measured_s"], row["replayed_s"])
    for row in held_rows:
        plain_s[(row["cluster"], row["layers"], row["system"])] = (row["measured_s"], row["predicted_s"])
    verdicts = []
    for row in held_rows:
        plain = PLAIN_ENGINE.get(row["system"])
        base = plain_s.get((row["cluster"], row["layers"], plain)) if plain else None
        if base is None or base[1] is None or row["predicted_s"] is None:
            continue
        measured, predicted = base[0] / row["measured_s"], base[1] / row["predicted_s"]
        verdicts.append({
            "cluster": row["cluster"], "layers": row["layers"], "system": row["system"], "plain_system": plain,
            "measured_speedup": measured, "predicted_speedup": predicted,
            "speedup_error": predicted / measured - 1.0, "same_side": bool((measured > 1.0) == (predicted > 1.0)),
        })  # fmt: skip
    return verdicts


def measurement_noise(bundle: traces.TraceBundle, measured_runs: pd.DataFrame) -> dict[str, Any]:
    """How repeatable the measurements are, independent of any model: the spread of a run's timed
    iterations ((max − min) / median), and how far a line a + b·L fitted to *all* measured depths of one
    (cluster, system) — in sample, the best any depth-linear model can do — misses its own points; and
    how many runs were measured while other processes took more than ``traces.BUSY_HOST_SHARE`` of the
    host's CPU (of those that recorded it: `ciera measure` from 2026-12-04 on); and, for runs pooled from
    several launches, how far their launches differ."""
    times = bundle.iterations[bundle.iterations["run_id"].isin(measured_runs["run_id"])]
    per_run = times.groupby("run_id")["iteration_s"].agg(["median", "min", "max", "size"])
    spread = (per_run["max"] - per_run["min"]) / per_run["median"]
    timed = measured_runs.join(per_run, on="run_id", how="inner")
    by_run: dict[str, float] = {}
    for _, group in timed.groupby(["cluster", "system"]):
        if group["layers"].nunique() < 3:  # a line through two points has no residual to speak of
            continue
        depths, medians = group["layers"].to_numpy(dtype=float), group["median"].to_numpy()
        slope, intercept = np.polyfit(depths, medians, 1)
        misses = np.abs((intercept + slope * depths) / medians - 1.0)
        by_run.update(zip(group["run_id"].astype(str), misses.astype(float).tolist(), strict=True))
    residuals = list(by_run.values())
    summaries = traces.run_summaries(bundle)
    measured_summaries = summaries[summaries["run_id"].isin(measured_runs["run_id"])]
    host = traces.busy_host_summary(measured_summaries)
    launches = traces.launch_spread_summary(measured_summaries)
    return {
        "runs_with_host_cpu_recorded": host["recorded"],
        "runs_on_a_busy_host": host["busy"],
        "other_cpu_share_max": host["largest_share"],
        "timed_iterations_per_run": int(per_run["size"].min()) if len(per_run) else 0,
        "iteration_spread_mean": float(spread.mean()) if len(spread) else 0.0,
        "iteration_spread_max": float(spread.max()) if len(spread) else 0.0,
        "depth_line_residual_mean": float(np.mean(residuals)) if residuals else None,
        "depth_line_residual_max": float(np.max(residuals)) if residuals else None,
        # Runs pooled from several launches of fresh ranks (`ciera measure --launches`): how many, and how
        # far a run's launch medians differ, (max − min) / median (None: no run pooled launches).
        "runs_pooled_from_launches": launches["runs"],
        "launches_per_run": launches["launches"],
        "launch_spread_mean": launches["mean"],
        "launch_spread_max": launches["max"],
        # Per run: how far the line through its (cluster, system)'s measured depths misses it (runs of a
        # pair with fewer than three depths have none).
        "depth_line_residual_by_run": by_run,
        # The same lines per system: where a capture's noise sits (one engine's launches can be the noisy
        # ones while the others repeat).
        "by_system": _noise_by_system(measured_runs, spread, by_run, measured_summaries),
    }


def _noise_by_system(
    measured_runs: pd.DataFrame, spread: pd.Series, by_run: dict[str, float], summaries: pd.DataFrame
) -> dict[str, dict[str, Any]]:
    """Per system of `measured_runs`: its runs, and the mean and largest iteration spread, depth-line miss
    and launch spread over them (None where none of its runs has one)."""
    out: dict[str, dict[str, Any]] = {}
    for system, runs in measured_runs.groupby("system", sort=True):
        ids = runs["run_id"].astype(str)
        values = {
            "iteration_spread": spread.reindex(ids).dropna(),
            "depth_line_residual": pd.Series([by_run[r] for r in ids if r in by_run], dtype=float),
        }
        launches = traces.launch_spread_summary(summaries[summaries["run_id"].isin(ids)])
        out[str(system)] = (
            {"runs": int(len(ids))}
            | {
                f"{name}_{stat}": (float(getattr(series, stat)()) if len(series) else None)
                for name, series in values.items()
                for stat in ("mean", "max")
            }
            | {"launch_spread_mean": launches["mean"], "launch_spread_max": launches["max"]}
        )
    return out


def codec_figures(
    bundle: traces.TraceBundle, seen: traces.TraceBundle, held_out: HeldOut, seen_runs: pd.DataFrame
) -> dict[str, CodecFigures | None]:
    """Per CIERA system: its codec figures, fitted to the held-out file's codec runs of that system (each
    paired with its plain twin among `seen_runs`; the statistics from `seen`)."""
    runs = bundle.runs.set_index("run_id")
    figures: dict[str, CodecFigures | None] = {}
    for system in PLAIN_ENGINE:
        chosen = [r for r in held_out.codec_runs if runs.loc[r, "system"] == system]
        try:
            figures[system] = fit_system_figures(bundle, system, chosen, seen_runs, seen) if chosen else None
        except SimInputError as error:
            raise ValidationInputError(f"{held_out.origin}: {error}") from None
    return figures


@dataclass(frozen=True)
class Split:
    """A bundle's measured runs as a held-out file divides them: what the simulator sees and what it
    predicts (codec runs are neither: their codec events are fitted, their times not predicted)."""

    seen: traces.TraceBundle  # the bundle with only the seen runs
    measured_runs: pd.DataFrame  # every measured run with events
    seen_runs: pd.DataFrame
    codec_runs: pd.DataFrame
    target_runs: pd.DataFrame


def split_runs(bundle: traces.TraceBundle, held_out: HeldOut) -> Split:
    """The seen and the held-out runs of `bundle` by `held_out`; one-line errors for a file that does not
    fit the bundle."""
    with_events = bundle.runs_with_events()
    measured_runs = with_events[with_events["source"] == "measured"]
    if measured_runs.empty:
        raise ValidationInputError("bundle: no measured run with events (capture one with `ciera measure`)")
    unknown = sorted(set(held_out.seen_clusters) - set(measured_runs["cluster"]))
    if unknown:
        raise ValidationInputError(
            f"{held_out.origin}: seen cluster {unknown[0]!r} is not in the bundle "
            f"(it has {', '.join(sorted(set(measured_runs['cluster'])))})"
        )
    for field, wanted, column in (
        ("system", held_out.seen_systems or [], "system"),
        ("depth", held_out.seen_layers, "layers"),
    ):
        absent = sorted(set(wanted) - set(measured_runs[column]))
        if absent:  # a typo would otherwise hold out every run of it and fail far from the file
            raise ValidationInputError(
                f"{held_out.origin}: seen {field} {absent[0]!r} is not in the bundle "
                f"(it has {', '.join(str(v) for v in sorted(set(measured_runs[column])))})"
            )
    missing_codec = sorted(set(held_out.codec_runs) - set(measured_runs["run_id"]))
    if missing_codec:
        raise ValidationInputError(f"{held_out.origin}: codec run {missing_codec[0]!r} is not in the bundle")
    is_seen = measured_runs["cluster"].isin(held_out.seen_clusters) & measured_runs["layers"].isin(
        held_out.seen_layers
    )
    if held_out.seen_systems is not None:
        is_seen &= measured_runs["system"].isin(held_out.seen_systems)
    is_codec = measured_runs["run_id"].isin(held_out.codec_runs)
    seen_runs, target_runs = measured_runs[is_seen], measured_runs[~is_seen & ~is_codec]
    if target_runs.empty:
        raise ValidationInputError(f"{held_out.origin}: every measured run is seen; nothing is held out")
    return Split(
        bundle.with_runs(set(seen_runs["run_id"])),
        measured_runs,
        seen_runs,
        measured_runs[is_codec],
        target_runs,
    )


def path_miss(row: dict[str, Any]) -> dict[str, float] | None:
    """Where one held-out prediction misses: per critical-path part (`sim.evaluate.critical_path`),
    predicted minus measured seconds over the measured middle iteration (whose parts sum to it)."""
    paths = row.get("critical_path_s")
    if not paths:
        return None
    measured, predicted = paths["measured"], paths["predicted"]
    total = sum(measured.values())
    if total <= 0:
        return None
    return {part: (predicted.get(part, 0.0) - measured.get(part, 0.0)) / total for part in BREAKDOWN_KEYS}


def path_miss_by_category(held_rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per category, the mean over its predicted runs of `path_miss`: which part of the iteration the
    predictions of that kind of change get wrong, and in which direction (signed, so a part predicted
    short in some runs and long in others averages out — the per-run values are in each row)."""
    result: dict[str, dict[str, float]] = {}
    for name in CATEGORIES:
        misses = [miss for row in held_rows if row["category"] == name and (miss := path_miss(row))]
        if misses:
            result[name] = {part: float(np.mean([miss[part] for miss in misses])) for part in BREAKDOWN_KEYS}
    return result


def predict_held_out(
    bundle: traces.TraceBundle, split: Split, figures: dict[str, CodecFigures | None], run: pd.Series
) -> Prediction | str:
    """The prediction `ciera validate sim` makes of `run` (a runs row) from the split's seen runs — a CIERA
    system the seen runs lack written into its plain engine's graph with `figures` — or, where it makes
    none, why not."""
    ciera_on = None
    if run["system"] in PLAIN_ENGINE and not split.seen_runs["system"].eq(run["system"]).any():
        if figures.get(run["system"]) is None:
            return f"not predicted: no codec run of {run['system']} to fit codec figures to"
        engine = PLAIN_ENGINE[run["system"]]
        ciera_on = CieraOn(figures[run["system"]], engine, engine)
    return predict_run(
        split.seen, run, measured_cluster(bundle.collectives, run), bundle.collectives, ciera_on
    )


def validate_sim(bundle: traces.TraceBundle, held_out: HeldOut, tolerance: float) -> dict[str, Any]:
    split = split_runs(bundle, held_out)
    seen, measured_runs, seen_runs, target_runs = (
        split.seen,
        split.measured_runs,
        split.seen_runs,
        split.target_runs,
    )
    measured_s = bundle.iterations.groupby("run_id")["iteration_s"].median()

    replay_rows = []
    for run in seen_runs.sort_values(["cluster", "layers", "system"]).itertuples():
        per_iteration = replay_run(seen, run.run_id)
        replayed = float(per_iteration["replayed_s"].median())
        replay_rows.append({
            "run_id": run.run_id, "cluster": run.cluster, "layers": int(run.layers), "system": run.system,
            "measured_s": float(measured_s[run.run_id]), "replayed_s": replayed,
            "error": replayed / float(measured_s[run.run_id]) - 1.0,
            "max_iteration_error": float(per_iteration["error"].abs().max()),
        })  # fmt: skip

    figures = codec_figures(bundle, seen, held_out, seen_runs)
    predicted: dict[str, tuple[float | None, str]] = {}
    paths: dict[str, dict[str, float]] = {}  # run → its prediction's critical path (middle iteration)
    anchors: dict[str, dict[str, Any]] = {}  # each anchor's in-sample calibration, as predictions used it
    simulated_events = 0
    for run in target_runs.itertuples():
        prediction = predict_held_out(bundle, split, figures, pd.Series(run._asdict()))
        if isinstance(prediction, str):
            predicted[run.run_id] = (None, prediction, ())
            continue
        predicted[run.run_id] = (prediction.iteration_s, prediction.basis, prediction.notes)
        paths[run.run_id] = prediction.critical_path_s
        simulated_events += prediction.events
        anchors[prediction.anchor_run] = {
            "anchor_run": prediction.anchor_run,
            "transport_scale": prediction.transport_scale,
            "compute_scale": prediction.compute_scale,
        }
    # The codec runs, predicted by the same rewrite from the plain engine's run of their configuration: in
    # sample (their codec events set the figures), so what is left is the rewrite's own bias — reported
    # beside the held-out errors, never counted in them.
    codec_rows = []
    for run in split.codec_runs.sort_values(["cluster", "layers", "system"]).itertuples():
        if seen_runs["system"].eq(run.system).any():
            continue
        prediction = predict_held_out(bundle, split, figures, pd.Series(run._asdict()))
        if isinstance(prediction, str):
            continue
        simulated_events += prediction.events
        measured = float(measured_s[run.run_id])
        codec_rows.append({
            "run_id": run.run_id, "cluster": run.cluster, "layers": int(run.layers), "system": run.system,
            "measured_s": measured, "predicted_s": prediction.iteration_s,
            "error": prediction.iteration_s / measured - 1.0, "basis": prediction.basis,
        })  # fmt: skip
    baseline = {(r.cluster, int(r.layers)): r.run_id for r in target_runs.itertuples() if r.system == "zero3"}
    held_rows = []
    for run in target_runs.sort_values(["cluster", "layers", "system"]).itertuples():
        value, basis, notes = predicted[run.run_id]
        measured = float(measured_s[run.run_id])
        base_id = baseline.get((run.cluster, int(run.layers)))
        speedup_error = None
        if value is not None and base_id is not None and run.system != "zero3" and predicted[base_id][0]:
            measured_speedup = float(measured_s[base_id]) / measured
            predicted_speedup = predicted[base_id][0] / value
            speedup_error = predicted_speedup / measured_speedup - 1.0
        held_rows.append({
            "run_id": run.run_id, "cluster": run.cluster, "layers": int(run.layers), "system": run.system,
            "world_size": int(run.world_size), "nodes": int(run.nodes), "ranks_per_node": int(run.gpus_per_node),
            "category": category(pd.Series(run._asdict()), seen_runs),
            "measured_s": measured, "predicted_s": value,
            "error": None if value is None else value / measured - 1.0,
            "speedup_error": speedup_error, "basis": basis, "notes": list(notes),
            "critical_path_s": None if value is None else {
                "measured": measured_critical_path(bundle, run.run_id), "predicted": paths[run.run_id],
            },
        })  # fmt: skip
    noise = measurement_noise(bundle, measured_runs)
    for row in held_rows:
        # The same run's miss with no model involved: the floor its own prediction error stands on.
        row["own_depth_line_miss"] = noise["depth_line_residual_by_run"].get(str(row["run_id"]))
    verdicts = ciera_verdicts(held_rows, replay_rows)
    replay_errors = np.abs([row["error"] for row in replay_rows])
    predicted_rows = [row for row in held_rows if row["error"] is not None]
    held_errors = np.abs([row["error"] for row in predicted_rows]) if predicted_rows else np.zeros(0)
    by_category: dict[str, float] = {}
    max_by_category: dict[str, float] = {}
    unpredicted: dict[str, int] = {}
    for name in CATEGORIES:
        rows = [row for row in held_rows if row["category"] == name]
        if not rows:
            continue
        errors = [abs(row["error"]) for row in rows if row["error"] is not None]
        if errors:
            by_category[name], max_by_category[name] = float(np.mean(errors)), float(np.max(errors))
        unpredicted[name] = sum(row["error"] is None for row in rows)
    path_miss = path_miss_by_category(held_rows)
    calibration = []
    for cluster in sorted(set(measured_runs["cluster"])):
        run = measured_runs[measured_runs["cluster"] == cluster].iloc[0]
        spec = measured_cluster(bundle.collectives, run)
        for op, curve in sorted(spec.curves.items()):
            at = np.array([112 << 10, 1 << 20, 16 << 20], dtype=float)
            transport = curve.transport_cpu_s(at)
            calibration.append({
                "cluster": cluster, "op": op, "world_size": int(run.world_size), "nodes": int(run.nodes),
                "sizes": len(curve.sizes_bytes), "link_Bps": spec.link_Bps, "link_factor": curve.link_factor,
                "time_at_112KiB_s": float(curve.time_s(at)[0]), "time_at_1MiB_s": float(curve.time_s(at)[1]),
                "time_at_16MiB_s": float(curve.time_s(at)[2]),
                "transport_cpu_at_112KiB_s": None if transport is None else float(transport[0]),
                "transport_cpu_at_1MiB_s": None if transport is None else float(transport[1]),
            })  # fmt: skip
    document = {
        "schema": SCHEMA,
        "calibration": calibration,
        "tolerance": tolerance,
        "held_out_file": held_out.origin,
        "held_out_fixed": held_out.fixed,
        "seen": {
            "clusters": list(held_out.seen_clusters),
            "layers": list(held_out.seen_layers),
            "systems": None if held_out.seen_systems is None else list(held_out.seen_systems),
            "codec_runs": list(held_out.codec_runs),
        },
        "replay": replay_rows,
        "held_out": held_rows,
        "codec_runs_in_sample": codec_rows,
        "anchor_calibration": [anchors[key] for key in sorted(anchors)],
        "replay_mean_abs_error": float(replay_errors.mean()) if len(replay_errors) else 0.0,
        "replay_max_abs_error": float(replay_errors.max()) if len(replay_errors) else 0.0,
        "held_out_mean_abs_error": float(held_errors.mean()) if len(held_errors) else None,
        "held_out_max_abs_error": float(held_errors.max()) if len(held_errors) else None,
        "held_out_mean_abs_error_by_category": by_category,
        "held_out_max_abs_error_by_category": max_by_category,
        "held_out_not_predicted_by_category": unpredicted,
        "held_out_path_miss_by_category": path_miss,
        "simulated_events": simulated_events,
        "codec_figures": {
            system: None
            if f is None
            else {
                **dataclasses.asdict(f),
                "runs": list(f.runs),
                "changed_exponent_bits": f.changed_exponent_bits,
                "description": f.describe(),
            }
            for system, f in figures.items()
        },
        "measurement_noise": noise,
        "ciera_verdicts": verdicts,
        "ciera_verdicts_on_the_measured_side": sum(row["same_side"] for row in verdicts),
    }
    document["passed"] = bool(
        document["replay_max_abs_error"] <= 0.01
        and not any(unpredicted.values())
        and document["held_out_mean_abs_error"] is not None
        and document["held_out_mean_abs_error"] <= tolerance
        and document["held_out_max_abs_error"] <= 2 * tolerance
        and all(value <= tolerance for value in by_category.values())
    )
    return document
