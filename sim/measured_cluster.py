"""`ciera simulate --cluster <a measured cluster>`: the simulator on a cluster the bundle was captured on.

At a traced configuration (model, system, cluster, depth) the measured events are replayed
(`sim.replay`): the iteration comes back as it was measured, per rank, from its durations and the
dependencies between its streams. At another depth of that cluster the replays of its traced depths are
fitted as a + b·L (`sim.predict`; the blocks are identical) and the record says it is a projection.
Other world sizes and topologies are not measured clusters: they are simulated on a preset
(`--cluster a100-hdr-testbed` or a TOML file), which models the collectives instead of replaying them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .predict import predict_iteration_s
from .replay import replay_run

SCHEMA = "ciera.simulate.measured/1"


@dataclass(frozen=True)
class MeasuredClusterRecord:
    model: str
    dtype: str
    cluster: str
    gpus: int
    layers: int
    system: str
    kind: str  # replayed (a traced configuration) | projected (another depth of the cluster)
    iteration_s: float  # median over the measured iterations of the replayed (or fitted) time
    measured_s: float | None  # the median measured iteration time, at a traced configuration
    speedup_vs_zero3: float
    basis: str  # what the number was computed from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measured_clusters(bundle: traces.TraceBundle) -> list[str]:
    """Clusters the bundle holds measured runs with events of (the clusters it can replay)."""
    runs = bundle.runs
    with_events = runs[(runs["source"] == "measured") & runs["run_id"].isin(set(bundle.events["run_id"]))]
    return sorted(set(with_events["cluster"]))


def simulate_measured_cluster(
    bundle: traces.TraceBundle,
    cluster: str,
    models: Sequence[str] | None = None,
    systems: Sequence[str] | None = None,
    layers: int | None = None,
    gpus: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[MeasuredClusterRecord]:
    """One record per (model, dtype, depth, system) on `cluster`: every traced depth when `layers` is None."""
    runs = bundle.runs
    on_cluster = runs[
        (runs["cluster"] == cluster)
        & (runs["source"] == "measured")
        & runs["run_id"].isin(set(bundle.events["run_id"]))
    ]
    if on_cluster.empty:
        raise SimInputError(
            f"--cluster {cluster!r}: the bundle holds no measured run with events on it "
            f"(measured clusters: {', '.join(measured_clusters(bundle)) or 'none'})"
        )
    world_sizes = sorted({int(w) for w in on_cluster["world_size"]})
    if gpus:
        foreign = [g for g in gpus if g not in world_sizes]
        if foreign:
            raise SimInputError(
                f"--gpus {foreign[0]}: cluster {cluster!r} was measured at W={','.join(map(str, world_sizes))}; "
                "other world sizes are simulated on a preset (--cluster a100-hdr-testbed or a TOML file)"
            )
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
                "a measured cluster replays what ran on it"
            )
    if layers is not None and layers < 1:
        raise SimInputError(f"--layers: value {layers}, expected a depth >= 1")

    measured_s = bundle.iterations.groupby("run_id")["iteration_s"].median()
    # Predict from this cluster's runs only: another cluster of the same shape is not this one.
    own = dataclasses.replace(bundle, runs=on_cluster)
    records: list[MeasuredClusterRecord] = []
    for model in chosen_models:
        of_model = on_cluster[on_cluster["model"] == model]
        for dtype in sorted(set(of_model["dtype"])):
            if dtypes and dtype not in dtypes:
                continue
            of_dtype = of_model[of_model["dtype"] == dtype]
            depths = [layers] if layers is not None else sorted({int(n) for n in of_dtype["layers"]})
            wanted = list(systems or sorted(set(of_dtype["system"])))
            needed = list(dict.fromkeys(["zero3", *wanted])) if "zero3" in set(of_dtype["system"]) else wanted
            for depth in depths:
                times: dict[str, tuple[float, float | None, str, str]] = {}
                for system in needed:
                    template = of_dtype[of_dtype["system"] == system]
                    if template.empty:
                        continue
                    traced = template[template["layers"] == depth]
                    if len(traced):
                        run_id = str(traced.iloc[0]["run_id"])
                        replayed = float(replay_run(own, run_id)["replayed_s"].median())
                        measured = float(measured_s[run_id])
                        times[system] = (replayed, measured, "replayed", f"replay of run {run_id}")
                        continue
                    target = template.iloc[0].copy()
                    target["layers"] = depth
                    prediction = predict_iteration_s(own, target)
                    times[system] = (prediction.iteration_s, None, "projected", prediction.basis)
                baseline = times.get("zero3")
                for system in wanted:
                    if system not in times:
                        continue
                    value, measured, kind, basis = times[system]
                    world_size = int(of_dtype[of_dtype["system"] == system].iloc[0]["world_size"])
                    records.append(
                        MeasuredClusterRecord(
                            model=model,
                            dtype=dtype,
                            cluster=cluster,
                            gpus=world_size,
                            layers=int(depth),
                            system=system,
                            kind=kind,
                            iteration_s=float(value),
                            measured_s=measured,
                            speedup_vs_zero3=float(baseline[0] / value) if baseline else float("nan"),
                            basis=basis,
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
