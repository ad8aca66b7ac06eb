"""The per-layer tables (`layers`, `iterations`) of a run, derived from its timed `events`.

docs/trace-format.md (*Deriving layers from events*) states the rules; in short, per run, iteration, layer
0..L+1 and phase (fwd, recompute when the run checkpoints activations, bwd, optim):

- compute_s: the summed durations of the compute- and gather_host-stream events of that (layer, phase)
  (the main thread's time outside the codec and the waits, as before gather_host was recorded); for phase optim
  also the optim-stream events of that layer, plus the layer's numel share (numel / the run's total numel)
  of the optim-stream events with layer -1 (an engine's single optimizer step over all parameters is
  apportioned to the layers by their parameter counts);
- allgather_s / allgather_bytes and reduce_scatter_s / reduce_scatter_bytes: durations and raw_bytes of
  that stream's events (bytes rounded to an integer); compress_s / decompress_s: durations of the
  codec_send / codec_recv events; hash_s = 0 (the codec hashes inside its encode pass);

each a mean over ranks of the per-rank sums: the total over the ranks that have events in that iteration,
divided by how many they are (all W ranks in a full capture). Events of other streams (all_reduce) and
other events with layer -1 belong to no layer and count only in the iteration's time.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from .errors import TraceError
from .schema import ITERATIONS, LAYERS, PHASES

KEY = ["run_id", "iteration", "layer", "phase"]
# The layers columns derived from events, and the stream each one sums (compute_s is assembled apart).
STREAM_COLUMNS = {
    "allgather": ("allgather_s", "allgather_bytes"),
    "reduce_scatter": ("reduce_scatter_s", "reduce_scatter_bytes"),
    "codec_send": ("compress_s", None),
    "codec_recv": ("decompress_s", None),
}
DERIVED_COLUMNS = (
    "compute_s",
    "allgather_s",
    "allgather_bytes",
    "reduce_scatter_s",
    "reduce_scatter_bytes",
    "compress_s",
    "decompress_s",
)
BYTE_COLUMNS = ("allgather_bytes", "reduce_scatter_bytes")


def _typed(schema, frame: pd.DataFrame) -> pd.DataFrame:
    dtypes = schema.empty_table().to_pandas().dtypes.to_dict()
    return frame[schema.names].astype(dtypes).reset_index(drop=True)


def _layer_shares(runs: pd.DataFrame, run_ids: list[str], layer_numel: pd.DataFrame) -> pd.DataFrame:
    """(run_id, layer, numel, share): every layer 0..L+1 of each run, share = numel / the run's total."""
    traced = runs.set_index("run_id")["layers"]
    grid = pd.DataFrame(
        [(run_id, layer) for run_id in run_ids for layer in range(int(traced[run_id]) + 2)],
        columns=["run_id", "layer"],
    )
    numel = layer_numel[["run_id", "layer", "numel"]].drop_duplicates(["run_id", "layer"])
    grid = grid.merge(numel, on=["run_id", "layer"], how="left")
    missing = grid["numel"].isna()
    if missing.any():
        row = grid[missing].iloc[0]
        raise TraceError(f"layer_numel: run {row.run_id!r} has no numel for layer {row.layer}")
    grid["numel"] = grid["numel"].astype(np.int64)
    total = grid.groupby("run_id")["numel"].transform("sum").astype(float)
    count = grid.groupby("run_id")["layer"].transform("size")
    # A run whose layers all have numel 0 splits the step evenly, so no time is lost.
    grid["share"] = np.where(total > 0, grid["numel"] / total.where(total > 0, 1.0), 1.0 / count)
    return grid


def _contributions(events: pd.DataFrame, shares: pd.DataFrame) -> pd.DataFrame:
    """Long frame (run_id, iteration, layer, phase, column, value): what each event adds to which cell."""
    duration = events["end_s"] - events["start_s"]
    tied = events["layer"] >= 0
    parts = []
    compute = events[tied & events["stream"].isin(("compute", "gather_host"))]
    parts.append(compute[KEY].assign(column="compute_s", value=duration[compute.index]))
    optim = events[tied & (events["stream"] == "optim")]
    parts.append(optim[KEY].assign(phase="optim", column="compute_s", value=duration[optim.index]))
    for stream, (time_column, bytes_column) in STREAM_COLUMNS.items():
        chosen = events[tied & (events["stream"] == stream)]
        parts.append(chosen[KEY].assign(column=time_column, value=duration[chosen.index]))
        if bytes_column:
            parts.append(chosen[KEY].assign(column=bytes_column, value=chosen["raw_bytes"].astype(float)))
    whole_step = events[~tied & (events["stream"] == "optim")]
    if len(whole_step):
        per_iteration = (
            whole_step.assign(value=duration[whole_step.index])
            .groupby(["run_id", "iteration"], as_index=False)["value"]
            .sum()
        )
        spread = per_iteration.merge(shares[["run_id", "layer", "share"]], on="run_id")
        parts.append(
            spread.assign(phase="optim", column="compute_s", value=spread["value"] * spread["share"])[
                [*KEY, "column", "value"]
            ]
        )
    return pd.concat([part[[*KEY, "column", "value"]] for part in parts], ignore_index=True)


def derive_layer_tables(
    runs: pd.DataFrame,
    events: pd.DataFrame,
    layer_numel: pd.DataFrame,
    iteration_s: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(layers, iterations) rows of every run that has events, as docs/trace-format.md derives them.

    `layer_numel` (run_id, layer, numel) gives each layer's unsharded parameter count; every layer
    0..L+1 of a run with events needs one. `iteration_s` (run_id, iteration, iteration_s), when given,
    supplies each iteration's measured time; without it an iteration lasts until its last event ends
    (max over ranks of the latest end_s). Raises TraceError when a number it needs is missing.
    """
    frame = pd.DataFrame(events).astype({"run_id": object, "phase": object, "stream": object})
    present = set(frame["run_id"])
    run_ids = [run_id for run_id in pd.unique(runs["run_id"]) if run_id in present]
    unknown = sorted(present - set(run_ids))
    if unknown:
        raise TraceError(f"events: run {unknown[0]!r} is not in runs")
    if not run_ids:
        return _typed(LAYERS, pd.DataFrame(columns=LAYERS.names)), _typed(
            ITERATIONS, pd.DataFrame(columns=ITERATIONS.names)
        )
    shares = _layer_shares(runs, run_ids, layer_numel)
    settings = runs.set_index("run_id")

    iterations = frame.groupby(["run_id", "iteration"], as_index=False).agg(
        ranks=("rank", "nunique"), iteration_s=("end_s", "max")
    )
    if iteration_s is not None:
        given = pd.DataFrame(iteration_s)[["run_id", "iteration", "iteration_s"]].astype({"run_id": object})
        iterations = iterations.drop(columns="iteration_s").merge(
            given, on=["run_id", "iteration"], how="left"
        )
        missing = iterations["iteration_s"].isna()
        if missing.any():
            row = iterations[missing].iloc[0]
            raise TraceError(
                f"iteration_s: run {row.run_id!r} iteration {row.iteration} has events but no iteration_s"
            )

    grid = iterations[["run_id", "iteration", "ranks"]].merge(
        shares[["run_id", "layer", "numel"]], on="run_id"
    )
    phase_rows = [
        (run_id, phase)
        for run_id in run_ids
        for phase in PHASES
        if phase != "recompute" or bool(settings.at[run_id, "activation_checkpointing"])
    ]
    grid = grid.merge(pd.DataFrame(phase_rows, columns=["run_id", "phase"]), on="run_id")

    sums = _contributions(frame, shares).groupby([*KEY, "column"])["value"].sum().unstack("column")
    sums = sums.reindex(columns=list(DERIVED_COLUMNS)).reset_index()
    layers = grid.merge(sums, on=KEY, how="left")
    for column in DERIVED_COLUMNS:
        mean = layers[column].fillna(0.0) / layers["ranks"]
        layers[column] = np.rint(mean).astype(np.int64) if column in BYTE_COLUMNS else mean
    traced = layers["run_id"].map(settings["layers"])
    layers["layer_kind"] = np.where(
        layers["layer"] == 0, "embedding", np.where(layers["layer"] == traced + 1, "head", "block")
    )
    layers["hash_s"] = 0.0
    run_order = {run_id: index for index, run_id in enumerate(run_ids)}
    layers = layers.sort_values(
        ["run_id", "iteration", "layer", "phase"],
        key=lambda column: (
            column.map(run_order)
            if column.name == "run_id"
            else column.map(PHASES.index)
            if column.name == "phase"
            else column
        ),
        kind="stable",
    )
    iterations = iterations.sort_values(
        ["run_id", "iteration"], key=lambda c: c.map(run_order) if c.name == "run_id" else c
    )
    return _typed(LAYERS, layers), _typed(ITERATIONS, iterations)


# A run during which other processes took more than this share of the host's CPU (`versions`'
# other_cpu_share, recorded by `ciera measure`) was measured on a busy host: its times include that work.
# On the 2-core machine of docs/measurement.md a test suite beside a capture took ~40 % and slowed it ~40 %.
BUSY_HOST_SHARE = 0.05


def other_cpu_share(versions: str | None) -> float | None:
    """The run's recorded share of the host's CPU that other processes used; None when not recorded."""
    try:
        value = json.loads(versions or "{}").get("other_cpu_share")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def launch_medians_s(versions: str | None) -> list[float]:
    """The median iteration of each launch a run pooled (`ciera measure --launches`); [] when the run
    records none (one launch, or captured before launches existed)."""
    try:
        values = json.loads(versions or "{}").get("launch_median_s")
    except (ValueError, AttributeError):
        return []
    if not isinstance(values, list) or not all(isinstance(v, int | float) and v > 0 for v in values):
        return []
    return [float(v) for v in values]


def launch_spread_summary(summaries: pd.DataFrame) -> dict:
    """Of runs (rows of :func:`run_summaries`): those pooled from several launches, how many launches, and
    how far a run's launch medians differ ((max − min) / median; mean, largest and its run) — what
    `ciera measure` and `ciera validate sim` both report. ``runs`` 0: no run pooled launches."""
    pooled = summaries[summaries["launches"] > 1] if len(summaries) else summaries
    if pooled.empty:
        return {"runs": 0, "launches": [], "mean": None, "max": None, "widest_run": None}
    spreads = pooled["launch_spread"].astype(float)
    widest = spreads.idxmax()
    return {
        "runs": int(len(pooled)),
        "launches": sorted({int(n) for n in pooled["launches"]}),
        "mean": float(spreads.mean()),
        "max": float(spreads[widest]),
        "widest_run": str(pooled.loc[widest, "run_id"]),
    }


def busy_host_summary(summaries: pd.DataFrame) -> dict:
    """Of runs (rows of :func:`run_summaries`): how many recorded the host's CPU, how many of those ran on a
    busy host (above BUSY_HOST_SHARE), the largest share and its run — what `ciera measure` and `ciera
    validate sim` both report."""
    recorded = summaries.dropna(subset=["other_cpu_share"]) if len(summaries) else summaries
    if recorded.empty:
        return {"recorded": 0, "busy": 0, "largest_share": None, "busiest_run": None}
    shares = recorded["other_cpu_share"].astype(float)
    busiest = shares.idxmax()
    return {
        "recorded": int(len(shares)),
        "busy": int((shares > BUSY_HOST_SHARE).sum()),
        "largest_share": float(shares[busiest]),
        "busiest_run": str(recorded.loc[busiest, "run_id"]),
    }


# The main thread inside the engine's gather calls: the engine's (or CIERA's) host path and CIERA's codec.
GATHER_PATH_STREAMS = ("gather_host", "codec_send", "codec_recv")


def run_summaries(bundle) -> pd.DataFrame:
    """One row per run with timed iterations: iterations, median / min / max iteration time, and the
    all-gather bytes one rank's iteration moved (raw and on the wire: event sums over ranks and iterations,
    divided by both), the share of the host's CPU other processes used meanwhile (None: not recorded),
    the launches it pooled with how far their medians differ (1 and NaN: one launch), and
    ``gather_path_s_per_gather``: the main thread's time inside the engine's gather calls (its issue and
    its wait, `gather_host`, with CIERA's codec, `codec_send` and `codec_recv`; blocking waits excluded)
    per all-gather that moved parameters — the engine's or CIERA's control plane per call, comparable
    between a plain run and its CIERA twin (NaN: the run records no gather path, captures before
    2026-12-05). What `ciera measure` prints and the report's Measured runs section show."""
    times = bundle.iterations.groupby("run_id")["iteration_s"].agg(["size", "median", "min", "max"])
    events = bundle.events
    gathers = events[events["stream"] == "allgather"]
    sums = gathers.groupby("run_id")[["raw_bytes", "wire_bytes"]].sum()
    ranks = events.groupby("run_id")["rank"].nunique()
    path = events[events["stream"].isin(GATHER_PATH_STREAMS)]
    path_s = (path["end_s"] - path["start_s"]).groupby(path["run_id"]).sum()
    recorded = set(events.loc[events["stream"] == "gather_host", "run_id"])
    parameter_gathers = gathers[gathers["raw_bytes"] > 0].groupby("run_id").size()
    versions = bundle.runs.set_index("run_id")["versions"]
    rows = []
    for run_id in times.index:
        per_iteration = float(ranks.get(run_id, 1)) * float(times.loc[run_id, "size"])
        rows.append(
            {
                "run_id": run_id,
                "iterations": int(times.loc[run_id, "size"]),
                "iteration_median_s": float(times.loc[run_id, "median"]),
                "iteration_min_s": float(times.loc[run_id, "min"]),
                "iteration_max_s": float(times.loc[run_id, "max"]),
                "allgather_raw_bytes": float(sums["raw_bytes"].get(run_id, 0.0)) / per_iteration,
                "allgather_wire_bytes": float(sums["wire_bytes"].get(run_id, 0.0)) / per_iteration,
                "other_cpu_share": other_cpu_share(versions.get(run_id)),
                **_launches(versions.get(run_id)),
                "gather_path_s_per_gather": float(path_s.get(run_id, 0.0)) / float(parameter_gathers[run_id])
                if run_id in recorded and parameter_gathers.get(run_id, 0) > 0
                else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def _launches(versions: str | None) -> dict:
    medians = launch_medians_s(versions)
    if len(medians) < 2:
        return {"launches": 1, "launch_spread": float("nan")}
    return {
        "launches": len(medians),
        "launch_spread": (max(medians) - min(medians)) / float(np.median(medians)),
    }


def stream_summaries(bundle) -> pd.DataFrame:
    """One row per (run, stream) of a bundle's events: where a rank's iteration goes. Per rank and timed
    iteration (sums over ranks and iterations divided by both): ``seconds`` (the stream's summed event
    durations: work on the main thread for compute, optim and the codec streams; time in flight for the
    collectives, overlapping whatever ran meanwhile), ``events``, ``raw_bytes`` and ``wire_bytes``; and
    ``mean_event_s``, one event's mean duration."""
    events = bundle.events
    if events.empty:
        return pd.DataFrame(
            columns=["run_id", "stream", "seconds", "events", "mean_event_s", "raw_bytes", "wire_bytes"]
        )
    events = events.assign(duration_s=events["end_s"] - events["start_s"])
    per_run = events.groupby("run_id").agg(ranks=("rank", "nunique"), iterations=("iteration", "nunique"))
    sums = events.groupby(["run_id", "stream"]).agg(
        seconds=("duration_s", "sum"),
        events=("duration_s", "size"),
        mean_event_s=("duration_s", "mean"),
        raw_bytes=("raw_bytes", "sum"),
        wire_bytes=("wire_bytes", "sum"),
    )
    sums = sums.reset_index().merge(per_run, left_on="run_id", right_index=True)
    per_iteration = sums["ranks"] * sums["iterations"]
    for column in ("seconds", "events", "raw_bytes", "wire_bytes"):
        sums[column] = sums[column] / per_iteration
    return sums.drop(columns=["ranks", "iterations"])
