"""`ciera simulate --cluster <a measured cluster>`: the simulator on a cluster the bundle was captured on,
and on larger clusters of its kind — all through the one op graph (sim/opgraph.py → sim/rewrite.py →
sim/evaluate.py).

- At a traced configuration (model, system, cluster, depth, world size) the measured events are
  **replayed**: each iteration's graph at its measured durations gives it back.
- Another depth or world size is **projected**: the cluster's run of that system is rewritten (blocks
  repeated, collectives re-costed, compute on the target's cores) and evaluated. A CIERA system is its
  plain engine's run with CIERA written in at the target W (sim/ciera_rewrite.py, codec figures fitted to
  the system's runs on the cluster): the rewrite `ciera validate sim` checks, and the only one that costs
  a call's codec at the target W. `--gpus W` means W ranks
  of the cluster's kind: its ranks per node, nodes = W / ranks per node, its link; each node its own host
  with the capture host's cores (the emulated cluster put every node on one host), collectives from α–β
  per level fitted to the kind's measured sweeps. `ciera validate sim` measures how far these rewrites
  miss on runs they were not given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

import traces

from .ciera_rewrite import PLAIN_ENGINE, fit_system_figures
from .cluster import ScheduleSpec
from .depth import check_target_depth
from .errors import SimInputError
from .memory import estimate, model_footprint
from .predict import CieraOn, predict_run
from .replay import replay_run
from .rewrite import ClusterSpec, measured_cluster, projected_cluster

SCHEMA = "ciera.simulate.measured/2"
MAX_PROJECTED_RANKS = 4096
MEMORY_NOTE = (
    "memory per rank: model states, gathered parameters and CIERA's cache only (no activations: the "
    "width-scaled model has no shape in traces/data/models); the host's memory is not stated, the fit not checked"
)


@dataclass(frozen=True)
class MeasuredClusterRecord:
    model: str
    dtype: str
    cluster: str  # the target: the measured cluster, or `<kind>-<M>x<G>` projected from it
    gpus: int
    layers: int
    system: str
    kind: str  # replayed (a traced configuration) | projected (a rewritten graph)
    iteration_s: float  # median over the anchor's iterations
    measured_s: float | None  # the median measured iteration time, at a traced configuration
    speedup_vs_zero3: float
    basis: str  # what the number was computed from
    measured_cluster: str  # the cluster the anchor run was captured on
    compute: str  # where compute comes from: the trace, and on which host assumption
    simulated_events: int
    notes: list[str] = field(default_factory=list)
    # One rank's memory (sim/memory.py): the ranks of a measured cluster share their host's memory, which
    # no run states, so the fit is not checked (memory["fits"] is None).
    memory: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rank_memory(
    bundle: traces.TraceBundle, anchor: pd.Series, depth: int, world_size: int
) -> dict[str, Any]:
    """One rank's memory of the anchor's system at `depth` blocks and W = `world_size`: CIERA's runtime
    compresses every shard, so its receivers cache every other rank's exponents. Activations need the
    model's shape, which a width-scaled measured model has not in traces/data/models: left at 0."""
    footprint = model_footprint(bundle, str(anchor["run_id"]), int(anchor["layers"]), depth)
    ciera = str(anchor["system"]).startswith("ciera")
    shard_values = footprint.parameters / world_size if ciera else 0.0
    return estimate(
        str(anchor["system"]),
        world_size,
        int(anchor["gpus_per_node"]),
        footprint,
        ScheduleSpec().zero3_prefetch_layers,  # the engines' default: one layer gathered ahead
        0.0,
        shard_values,
        shard_values * (world_size - 1),
        0.0,
    ).to_dict()


def measured_clusters(bundle: traces.TraceBundle) -> list[str]:
    """Clusters the bundle holds measured runs with events of (the clusters it can replay)."""
    runs = bundle.runs_with_events()
    with_events = runs[runs["source"] == "measured"]
    return sorted(set(with_events["cluster"]))


def _target_cluster(bundle: traces.TraceBundle, anchor: pd.Series, world_size: int) -> ClusterSpec:
    """The measured cluster at its own W; W ranks of its kind otherwise."""
    spec = measured_cluster(bundle.collectives, anchor)
    if world_size == spec.world_size:
        return spec
    per_node = spec.ranks_per_node
    if world_size % per_node:
        raise SimInputError(
            f"--gpus {world_size}: cluster {spec.name!r} has {per_node} ranks per node; "
            f"expected a multiple of {per_node}"
        )
    runs = bundle.runs
    same_kind = runs[(runs["link_rate_Bps"] == anchor["link_rate_Bps"]) & (runs["source"] == "measured")]
    kind = []
    for cluster in sorted(set(same_kind["cluster"])):
        row = same_kind[same_kind["cluster"] == cluster].iloc[0]
        try:
            kind.append(measured_cluster(bundle.collectives, row))
        except SimInputError:
            continue
    nodes = world_size // per_node
    name = f"{spec.name}-kind-{nodes}x{per_node}"
    return projected_cluster(kind, nodes, per_node, name)


def _ciera_on(
    bundle: traces.TraceBundle,
    system: str,
    runs: pd.DataFrame,
    known: dict[tuple[str, str, str], tuple[CieraOn, list[str]]],
) -> tuple[CieraOn, list[str]]:
    """How `system` is written into its plain engine's runs of `runs` (one model, dtype and cluster):
    codec figures fitted to all of the system's runs there (kept in `known`), and the note saying so."""
    first = runs.iloc[0]
    key = (str(first["model"]), str(first["dtype"]), system)
    if key not in known:
        codec_runs = sorted(runs.loc[runs["system"] == system, "run_id"].astype(str))
        figures = fit_system_figures(bundle, system, codec_runs, runs)
        plain = PLAIN_ENGINE[system]
        note = (
            f"{system} projected as {plain}'s graph with CIERA written in at the target W (the rewrite "
            f"`ciera validate sim` checks: its system category); codec figures: {figures.describe()}"
        )
        known[key] = (CieraOn(figures, plain, plain), [note])
    return known[key]


def simulate_measured_cluster(
    bundle: traces.TraceBundle,
    cluster: str,
    models: Sequence[str] | None = None,
    systems: Sequence[str] | None = None,
    layers: int | None = None,
    gpus: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[MeasuredClusterRecord]:
    """One record per (model, dtype, world size, depth, system) on `cluster` or clusters of its kind: every
    traced depth at the traced world size when `layers` and `gpus` are None."""
    runs = bundle.runs_with_events()
    on_cluster = runs[(runs["cluster"] == cluster) & (runs["source"] == "measured")]
    if on_cluster.empty:
        raise SimInputError(
            f"--cluster {cluster!r}: the bundle holds no measured run with events on it "
            f"(measured clusters: {', '.join(measured_clusters(bundle)) or 'none'})"
        )
    too_large = [g for g in gpus or [] if g > MAX_PROJECTED_RANKS]
    if too_large:
        raise SimInputError(f"--gpus {too_large[0]}: expected at most {MAX_PROJECTED_RANKS} ranks")
    known_models = sorted(set(on_cluster["model"]))
    lookup = {name.lower(): name for name in known_models}
    chosen_models = []
    for name in models or known_models:
        if name.lower() not in lookup:
            raise SimInputError(
                f"--models: model {name!r} was not measured on {cluster!r}, expected one of {known_models}"
            )
        chosen_models.append(lookup[name.lower()])
    known_systems = sorted(set(on_cluster["system"]))
    for system in systems or []:
        if system not in known_systems:
            raise SimInputError(
                f"--systems: {system!r} was not measured on {cluster!r} (measured: {', '.join(known_systems)}); "
                "a system is simulated from its own runs"
            )
    if layers is not None:
        for model in chosen_models:
            full_layers = int(on_cluster.loc[on_cluster["model"] == model, "full_layers"].min())
            check_target_depth(layers, model, full_layers)

    measured_s = bundle.iterations.groupby("run_id")["iteration_s"].median()
    figures: dict[tuple[str, str, str], tuple[CieraOn, list[str]]] = {}
    records: list[MeasuredClusterRecord] = []
    for model in chosen_models:
        of_model = on_cluster[on_cluster["model"] == model]
        for dtype in sorted(set(of_model["dtype"])):
            if dtypes and dtype not in dtypes:
                continue
            of_dtype = of_model[of_model["dtype"] == dtype]
            traced_w = int(of_dtype["world_size"].iloc[0])
            world_sizes = list(gpus) if gpus else [traced_w]
            depths = [layers] if layers is not None else sorted({int(n) for n in of_dtype["layers"]})
            wanted = list(systems or sorted(set(of_dtype["system"])))
            needed = list(dict.fromkeys(["zero3", *wanted])) if "zero3" in set(of_dtype["system"]) else wanted
            for world_size in world_sizes:
                for depth in depths:
                    times: dict[str, MeasuredClusterRecord] = {}
                    for system in needed:
                        template = of_dtype[of_dtype["system"] == system].sort_values("layers")
                        if template.empty:
                            continue
                        traced = template[template["layers"] == depth]
                        if len(traced) and world_size == traced_w:
                            run_id = str(traced.iloc[0]["run_id"])
                            replayed = replay_run(bundle, run_id)
                            times[system] = MeasuredClusterRecord(
                                model, dtype, cluster, world_size, int(depth), system, "replayed",
                                float(replayed["replayed_s"].median()), float(measured_s[run_id]), float("nan"),
                                f"replay of run {run_id}", cluster, "traced", int(replayed["events"].sum()),
                                [MEMORY_NOTE], _rank_memory(bundle, traced.iloc[0], int(depth), world_size),
                            )  # fmt: skip
                            continue
                        anchor = (traced if len(traced) else template).iloc[-1]
                        target = anchor.copy()  # predict_run picks the runs it rewrites for this target
                        target["layers"] = depth
                        ciera_on, ciera_notes = None, []
                        if system in PLAIN_ENGINE:
                            if of_dtype["system"].eq(PLAIN_ENGINE[system]).any():
                                # The rewrite `ciera validate sim` checks: CIERA written into the plain
                                # engine's graph at the target W, codec figures from this system's runs.
                                ciera_on, ciera_notes = _ciera_on(bundle, system, of_dtype, figures)
                            else:
                                ciera_notes = [
                                    f"{system}: no {PLAIN_ENGINE[system]} run on {cluster} to write CIERA "
                                    "into; projected from its own run, its codec ops kept at the traced W's cost"
                                ]
                        target_cluster = _target_cluster(bundle, anchor, world_size)
                        prediction = predict_run(bundle, target, target_cluster, bundle.collectives, ciera_on)
                        compute = (
                            "traced"
                            if target_cluster.measured
                            else f"traced; each node its own host with {target_cluster.host_cores} cores"
                        )
                        times[system] = MeasuredClusterRecord(
                            model, dtype, target_cluster.name, world_size, int(depth), system, "projected",
                            prediction.iteration_s, None, float("nan"), prediction.basis, cluster, compute,
                            prediction.events, [*ciera_notes, *prediction.notes, MEMORY_NOTE],
                            _rank_memory(bundle, anchor, int(depth), world_size),
                        )  # fmt: skip
                    baseline = times.get("zero3")
                    for system in wanted:
                        if system in times:
                            record = times[system]
                            speedup = baseline.iteration_s / record.iteration_s if baseline else float("nan")
                            records.append(
                                MeasuredClusterRecord(
                                    **{**record.to_dict(), "speedup_vs_zero3": float(speedup)}
                                )
                            )
    if not records:
        raise SimInputError(f"--cluster {cluster!r}: no measured run matches --models/--systems/--dtype")
    return records


def measured_records_to_json(records: Sequence[MeasuredClusterRecord]) -> dict[str, Any]:
    def clean(record: MeasuredClusterRecord) -> dict[str, Any]:
        row = record.to_dict()
        if not np.isfinite(row["speedup_vs_zero3"]):
            row["speedup_vs_zero3"] = None  # no zero3 run on the cluster to compare with
        return row

    return {
        "schema": SCHEMA,
        "cluster": records[0].cluster if records else None,
        "records": [clean(record) for record in records],
    }


def measured_records_frame(records: Sequence[MeasuredClusterRecord]) -> pd.DataFrame:
    return pd.DataFrame([record.to_dict() for record in records])
