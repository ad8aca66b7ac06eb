"""Read, validate and atomically write trace bundles (a directory of seven Parquet tables)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .derive import DERIVED_COLUMNS, derive_layer_tables
from .errors import TraceError
from .schema import (
    ALLOWED_VALUES,
    MINIMUM_VALUES,
    OPTIONAL_COLUMNS,
    POSITIVE_INT_COLUMNS,
    RATE_COLUMNS,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SCHEMAS_BY_VERSION,
    TABLE_SCHEMAS,
    with_metadata,
)
from .upgrade import V1_UPGRADE_NOTE, upgrade_v1_table

TABLE_NAMES = tuple(TABLE_SCHEMAS)
READABLE = " or ".join(str(v) for v in READABLE_VERSIONS)
# Tolerances of the events rules (docs/trace-format.md).
ORDER_TOLERANCE_S = 1e-9
OVERLAP_TOLERANCE_S = 1e-6
ITERATION_TOLERANCE_S = 1e-3
ITERATION_TOLERANCE_REL = 1e-3


def empty_table(name: str) -> pd.DataFrame:
    return TABLE_SCHEMAS[name].empty_table().to_pandas()


def _empty(name: str) -> Callable[[], pd.DataFrame]:
    return lambda: empty_table(name)


@dataclass(frozen=True)
class TraceBundle:
    """The seven trace tables as pandas DataFrames, columns exactly as in `traces.schema`.

    `events` and `shard_changes` default to empty tables. `notes` says what the reader substituted
    (a version-1 bundle upgraded in memory); it is not written.
    """

    runs: pd.DataFrame
    layers: pd.DataFrame
    iterations: pd.DataFrame
    collectives: pd.DataFrame
    exponents: pd.DataFrame
    events: pd.DataFrame = dataclasses.field(default_factory=_empty("events"))
    shard_changes: pd.DataFrame = dataclasses.field(default_factory=_empty("shard_changes"))
    notes: tuple[str, ...] = ()

    def table(self, name: str) -> pd.DataFrame:
        return getattr(self, name)

    def runs_with_events(self) -> pd.DataFrame:
        """The runs that have events (the ones a trace-driven simulation can replay or rewrite)."""
        # isin against the unique ids: against 1.5 M arrow strings it is seconds slower.
        return self.runs[self.runs["run_id"].isin(set(self.events["run_id"].unique()))]

    def with_runs(self, run_ids: set[str]) -> TraceBundle:
        """These runs, and every run without events (exponent statistics: inputs to every rewrite); the
        collectives sweeps whole."""
        statistics = set(self.runs["run_id"]) - set(self.events["run_id"].unique())
        keep = run_ids | statistics
        tables = ("runs", "layers", "iterations", "exponents", "events", "shard_changes")
        return dataclasses.replace(
            self, **{name: self.table(name)[self.table(name)["run_id"].isin(keep)] for name in tables}
        )


def _describe(value: object) -> str:
    text = repr(value.item() if isinstance(value, np.generic) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(origin: str, table: str, column: str, message: str) -> TraceError:
    return TraceError(f"{origin}: table '{table}', column '{column}': {message}")


def _normalised(arrow_type: pa.DataType) -> pa.DataType:
    """Writers differ in string flavour (pandas 3 writes large_string); both mean text."""
    return (
        pa.string()
        if pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type)
        else arrow_type
    )


def _check_columns(origin: str, name: str, actual: pa.Schema, version: int = SCHEMA_VERSION) -> None:
    expected = SCHEMAS_BY_VERSION[version][name]
    missing = [f for f in expected.names if f not in actual.names and (name, f) not in OPTIONAL_COLUMNS]
    if missing:
        raise _fail(origin, name, missing[0], "missing column")
    extra = [f for f in actual.names if f not in expected.names]
    if extra:
        raise _fail(origin, name, extra[0], f"unexpected column (schema v{version} has none such)")
    for field in expected:
        if field.name not in actual.names:
            continue  # an optional column (checked above)
        found = actual.field(field.name).type
        if _normalised(found) != _normalised(field.type):
            raise _fail(origin, name, field.name, f"type {_normalised(found)}, expected {field.type}")


def _check_values(origin: str, name: str, frame: pd.DataFrame, schema: pa.Schema | None = None) -> None:
    """Per-column value checks: no NaN/inf/negative numbers, closed sets, rates in [0, 1]."""
    for field in schema or TABLE_SCHEMAS[name]:
        column = frame[field.name]
        if pa.types.is_string(field.type):
            if column.isna().any():
                raise _fail(origin, name, field.name, "null value, expected a string")
            allowed = ALLOWED_VALUES.get((name, field.name))
            if allowed is not None:
                bad = column[~column.isin(allowed)]
                if len(bad):
                    raise _fail(
                        origin, name, field.name, f"value {_describe(bad.iloc[0])}, expected one of {allowed}"
                    )
            continue
        if pa.types.is_boolean(field.type):
            if column.isna().any():
                raise _fail(origin, name, field.name, "null value, expected true/false")
            continue
        values = column.to_numpy(dtype=np.float64, na_value=np.nan)
        if (name, field.name) in OPTIONAL_COLUMNS:
            values = values[~np.isnan(values)]  # NaN: not measured
            column = column[column.notna()]
        finite = np.isfinite(values)
        if not finite.all():
            raise _fail(
                origin, name, field.name, f"value {_describe(values[~finite][0])}, expected a finite number"
            )
        floor = MINIMUM_VALUES.get((name, field.name), 0)
        below = values < floor
        if below.any():
            raise _fail(
                origin, name, field.name, f"value {_describe(column[below].iloc[0])}, expected >= {floor}"
            )
        if (name, field.name) in POSITIVE_INT_COLUMNS and (values < 1).any():
            raise _fail(
                origin, name, field.name, f"value {_describe(column[values < 1].iloc[0])}, expected >= 1"
            )
        if (name, field.name) in RATE_COLUMNS and (values > 1).any():
            raise _fail(
                origin,
                name,
                field.name,
                f"value {_describe(column[values > 1].iloc[0])}, expected a rate in [0, 1]",
            )


def _raise_first(
    origin: str,
    table: str,
    column: str,
    frame: pd.DataFrame,
    violates: pd.Series | np.ndarray,
    message: Callable[[Any], str],
) -> None:
    """Fail on the first row of `frame` for which `violates` holds; `message` describes that row."""
    violates = np.asarray(violates, dtype=bool)
    if violates.any():
        raise _fail(origin, table, column, message(frame[violates].iloc[0]))


def _check_runs(origin: str, bundle: TraceBundle) -> None:
    runs = bundle.runs
    _raise_first(
        origin,
        "runs",
        "run_id",
        runs,
        runs["run_id"].duplicated(),
        lambda row: f"value {row.run_id!r} appears twice, expected unique",
    )
    _raise_first(
        origin,
        "runs",
        "full_layers",
        runs,
        runs["full_layers"] < runs["layers"],
        lambda row: f"value {row.full_layers} < layers {row.layers} in run {row.run_id!r}",
    )
    implied_nodes = -(-runs["world_size"] // runs["gpus_per_node"])
    _raise_first(
        origin,
        "runs",
        "nodes",
        runs,
        runs["nodes"] != implied_nodes,
        lambda row: (
            f"value {row.nodes} in run {row.run_id!r}, expected ceil(world_size {row.world_size} / "
            f"gpus_per_node {row.gpus_per_node}) = {-(-row.world_size // row.gpus_per_node)}"
        ),
    )
    for name in ("layers", "iterations", "exponents", "events", "shard_changes"):
        frame = bundle.table(name)
        _raise_first(
            origin,
            name,
            "run_id",
            frame,
            ~frame["run_id"].isin(runs["run_id"]),
            lambda row: f"value {row.run_id!r} is not in table 'runs'",
        )


def _check_layers(origin: str, bundle: TraceBundle) -> None:
    layers = bundle.layers
    if not len(layers):
        return
    traced_l = layers["run_id"].map(bundle.runs.set_index("run_id")["layers"])
    _raise_first(
        origin,
        "layers",
        "layer",
        layers,
        layers["layer"] > traced_l + 1,
        lambda row: (
            f"value {row.layer} in run {row.run_id!r}, expected 0..{int(traced_l[row.name]) + 1} (runs.layers + 1)"
        ),
    )
    counts = (
        layers.assign(traced_l=traced_l)
        .groupby(["run_id", "iteration"])
        .agg(distinct=("layer", "nunique"), traced_l=("traced_l", "first"))
    )
    _raise_first(
        origin,
        "layers",
        "layer",
        counts.reset_index(),
        counts["distinct"] != counts["traced_l"] + 2,
        lambda row: (
            f"run {row.run_id!r} iteration {row.iteration} has {row.distinct} distinct layers, "
            f"runs.layers={row.traced_l} implies {row.traced_l + 2}"
        ),
    )
    expected_kind = np.where(
        layers["layer"] == 0, "embedding", np.where(layers["layer"] == traced_l + 1, "head", "block")
    )
    _raise_first(
        origin,
        "layers",
        "layer_kind",
        layers,
        layers["layer_kind"].to_numpy() != expected_kind,
        lambda row: f"value {row.layer_kind!r} for layer {row.layer} of run {row.run_id!r}",
    )


def _check_iterations(origin: str, bundle: TraceBundle) -> None:
    iterations = bundle.iterations
    _raise_first(
        origin,
        "iterations",
        "iteration",
        iterations,
        iterations.duplicated(["run_id", "iteration"]),
        lambda row: f"run {row.run_id!r} iteration {row.iteration} appears twice, expected one row",
    )
    layer_iters = set(
        map(tuple, bundle.layers[["run_id", "iteration"]].drop_duplicates().to_numpy().tolist())
    )
    iter_rows = set(map(tuple, bundle.iterations[["run_id", "iteration"]].to_numpy().tolist()))
    if layer_iters != iter_rows:
        run_id, iteration = sorted(layer_iters ^ iter_rows)[0]
        raise _fail(
            origin,
            "iterations",
            "iteration",
            f"run {run_id!r} iteration {iteration} is in only one of 'layers' and 'iterations'",
        )


def _check_parameter_tables(origin: str, bundle: TraceBundle) -> None:
    """`exponents` and `shard_changes`: every parameter's layer lies within 0..L+1 of its run."""
    traced = bundle.runs.set_index("run_id")["layers"]
    for name in ("exponents", "shard_changes"):
        frame = bundle.table(name)
        if not len(frame):
            continue
        _raise_first(
            origin,
            name,
            "layer",
            frame,
            frame["layer"] > frame["run_id"].map(traced) + 1,
            lambda row: f"value {row.layer} beyond runs.layers + 1 of run {row.run_id!r}",
        )


def _check_collectives(origin: str, bundle: TraceBundle) -> None:
    coll = bundle.collectives
    if not len(coll):
        return
    _raise_first(
        origin,
        "collectives",
        "nodes",
        coll,
        coll["nodes"] > coll["world_size"],
        lambda row: f"value {row.nodes} > world_size {row.world_size}",
    )
    # Collectives of a cluster that runs were captured on must span the nodes those runs imply.
    gpus_per_node = coll["cluster"].map(bundle.runs.groupby("cluster")["gpus_per_node"].first())
    implied_nodes = -(-coll["world_size"] // gpus_per_node)
    _raise_first(
        origin,
        "collectives",
        "nodes",
        coll,
        gpus_per_node.notna() & (coll["nodes"] != implied_nodes),
        lambda row: (
            f"value {row.nodes} for world_size {row.world_size} on cluster {row.cluster!r}, runs there "
            f"have gpus_per_node {int(gpus_per_node[row.name])} so expected {int(implied_nodes[row.name])}"
        ),
    )
    _raise_first(
        origin,
        "collectives",
        "time_min_s",
        coll,
        coll["time_min_s"] > coll["time_s"] * (1 + 1e-9),
        lambda row: (
            f"value {row.time_min_s:.9g} > time_s {row.time_s:.9g} (the median) for {row.op} of {row.bytes} bytes"
        ),
    )
    _raise_first(
        origin,
        "collectives",
        "time_max_s",
        coll,
        coll["time_max_s"] * (1 + 1e-9) < coll["time_s"],
        lambda row: (
            f"value {row.time_max_s:.9g} < time_s {row.time_s:.9g} (the median) for {row.op} of {row.bytes} bytes"
        ),
    )
    expected_algbw = coll["bytes"] / coll["time_s"].where(coll["time_s"] > 0)
    _raise_first(
        origin,
        "collectives",
        "algbw_Bps",
        coll,
        ~np.isclose(coll["algbw_Bps"], expected_algbw, rtol=1e-3),
        lambda row: (
            f"value {row.algbw_Bps:.6g}, expected bytes/time_s = "
            f"{row.bytes / row.time_s if row.time_s else math.inf:.6g}"
        ),
    )
    # nccl-tests: busbw = algbw·(n−1)/n for all_gather and reduce_scatter, algbw·2(n−1)/n for all_reduce.
    ranks = coll["world_size"].astype(float)
    factor = np.where(coll["op"] == "all_reduce", 2.0, 1.0) * (ranks - 1) / ranks
    expected_busbw = coll["algbw_Bps"] * factor
    _raise_first(
        origin,
        "collectives",
        "busbw_Bps",
        coll,
        ~np.isclose(coll["busbw_Bps"], expected_busbw, rtol=1e-3),
        lambda row: (
            f"value {row.busbw_Bps:.6g} for {row.op} over {row.world_size} ranks, expected "
            f"algbw_Bps·{'2' if row.op == 'all_reduce' else ''}(n−1)/n = {expected_busbw[row.name]:.6g}"
        ),
    )


def _where(row: Any) -> str:
    return (
        f"run {row.run_id!r} rank {row['rank']} iteration {row.iteration} layer {row.layer} "
        f"phase {row.phase!r} stream {row.stream!r}"
    )


def _check_events(origin: str, bundle: TraceBundle) -> None:
    events = bundle.events
    if not len(events):
        return
    runs = bundle.runs.set_index("run_id")
    world_size = events["run_id"].map(runs["world_size"])
    _raise_first(
        origin,
        "events",
        "rank",
        events,
        events["rank"] >= world_size,
        lambda row: (
            f"value {row['rank']} in run {row.run_id!r}, expected 0..{int(world_size[row.name]) - 1} (runs.world_size - 1)"
        ),
    )
    traced = events["run_id"].map(runs["layers"])
    _raise_first(
        origin,
        "events",
        "layer",
        events,
        events["layer"] > traced + 1,
        lambda row: (
            f"value {row.layer} in run {row.run_id!r}, expected -1..{int(traced[row.name]) + 1} (runs.layers + 1)"
        ),
    )
    checkpointing = events["run_id"].map(runs["activation_checkpointing"]).astype(bool)
    _raise_first(
        origin,
        "events",
        "phase",
        events,
        (events["phase"] == "recompute") & ~checkpointing,
        lambda row: f"value 'recompute' ({_where(row)}) but the run has activation_checkpointing false",
    )
    _raise_first(
        origin,
        "events",
        "issued_s",
        events,
        events["issued_s"] > events["start_s"] + ORDER_TOLERANCE_S,
        lambda row: f"value {row.issued_s:.9g} > start_s {row.start_s:.9g} ({_where(row)})",
    )
    _raise_first(
        origin,
        "events",
        "end_s",
        events,
        events["end_s"] < events["start_s"] - ORDER_TOLERANCE_S,
        lambda row: f"value {row.end_s:.9g} < start_s {row.start_s:.9g} ({_where(row)})",
    )
    streams = ["run_id", "rank", "iteration", "stream"]
    ordered = events.sort_values([*streams, "start_s"], kind="stable")
    same_stream = (ordered[streams] == ordered[streams].shift()).all(axis=1)
    previous_end = ordered["end_s"].shift()
    _raise_first(
        origin,
        "events",
        "start_s",
        ordered.assign(previous_end=previous_end),
        same_stream & (ordered["start_s"] < previous_end - OVERLAP_TOLERANCE_S),
        lambda row: (
            f"value {row.start_s:.9g} overlaps the previous event on its stream, which ends at "
            f"{row.previous_end:.9g} ({_where(row)})"
        ),
    )
    iteration_s = (
        bundle.iterations.set_index(["run_id", "iteration"])["iteration_s"]
        .reindex(pd.MultiIndex.from_frame(events[["run_id", "iteration"]]))
        .to_numpy()
    )
    _raise_first(
        origin,
        "events",
        "iteration",
        events,
        np.isnan(iteration_s),
        lambda row: (
            f"run {row.run_id!r} iteration {row.iteration} has events but no row in table 'iterations'"
        ),
    )
    limit = iteration_s * (1 + ITERATION_TOLERANCE_REL) + ITERATION_TOLERANCE_S
    _raise_first(
        origin,
        "events",
        "end_s",
        events.assign(iteration_s=iteration_s),
        events["end_s"].to_numpy() > limit,
        lambda row: (
            f"value {row.end_s:.9g} is past iteration_s {row.iteration_s:.9g} of its iteration "
            f"(+{ITERATION_TOLERANCE_S:g} s +{ITERATION_TOLERANCE_REL:.1%}) ({_where(row)})"
        ),
    )


def _check_layers_match_events(origin: str, bundle: TraceBundle) -> None:
    """For runs with events, `layers` must be what `derive_layer_tables` makes of them."""
    if not len(bundle.events):
        return
    key = ["run_id", "iteration", "layer", "phase"]
    layers = bundle.layers[bundle.layers["run_id"].isin(bundle.events["run_id"].unique())]
    layer_numel = layers.drop_duplicates(["run_id", "layer"])[["run_id", "layer", "numel"]]
    try:
        derived, _ = derive_layer_tables(bundle.runs, bundle.events, layer_numel)
    except TraceError as error:
        raise _fail(origin, "layers", "numel", str(error)) from None
    joined = derived.astype({"run_id": object, "phase": object}).merge(
        layers.astype({"run_id": object, "phase": object}),
        on=key,
        how="outer",
        suffixes=("_events", ""),
        indicator=True,
    )

    def where(row: Any) -> str:
        return f"run {row.run_id!r} iteration {row.iteration} layer {row.layer} phase {row.phase!r}"

    _raise_first(
        origin,
        "layers",
        "phase",
        joined,
        joined["_merge"] == "left_only",
        lambda row: f"{where(row)}: the run's events imply this row, the table lacks it",
    )
    _raise_first(
        origin,
        "layers",
        "phase",
        joined,
        joined["_merge"] == "right_only",
        lambda row: f"{where(row)}: row not implied by the run's events",
    )
    for column in DERIVED_COLUMNS:
        expected = joined[f"{column}_events"].astype(float)
        _raise_first(
            origin,
            "layers",
            column,
            joined,
            ~np.isclose(joined[column].astype(float), expected, rtol=1e-6, atol=1e-9),
            lambda row, column=column: (
                f"{where(row)}: value {row[column]:.9g}, its events give {row[column + '_events']:.9g}"
            ),
        )


def _check_consistency(origin: str, bundle: TraceBundle) -> None:
    """Cross-table rules of docs/trace-format.md."""
    for check in (
        _check_runs,
        _check_layers,
        _check_iterations,
        _check_parameter_tables,
        _check_collectives,
        _check_events,
        _check_layers_match_events,
    ):
        check(origin, bundle)


def validate_bundle(bundle: TraceBundle, origin: str = "<bundle>") -> None:
    """Raise TraceError on the first rule of docs/trace-format.md that `bundle` breaks."""
    for name in TABLE_NAMES:
        frame = bundle.table(name)
        expected = TABLE_SCHEMAS[name].names
        missing = [c for c in expected if c not in frame.columns]
        if missing:
            raise _fail(origin, name, missing[0], "missing column")
        extra = [c for c in frame.columns if c not in expected]
        if extra:
            raise _fail(
                origin, name, str(extra[0]), f"unexpected column (schema v{SCHEMA_VERSION} has none such)"
            )
        _arrow_of(name, frame, origin)
        _check_values(origin, name, frame)
    _check_consistency(origin, bundle)


def _arrow_of(name: str, frame: pd.DataFrame, origin: str) -> pa.Table:
    try:
        return pa.Table.from_pandas(frame, schema=TABLE_SCHEMAS[name], preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as error:
        column = next((c for c in TABLE_SCHEMAS[name].names if c in str(error)), "?")
        raise _fail(
            origin, name, column, f"cannot convert to the schema type: {str(error).splitlines()[0]}"
        ) from None


def _read_table(file: Path, name: str) -> tuple[pa.Table, int]:
    """The Arrow table in `file` and the schema version its metadata names (one this reader reads)."""
    if not file.is_file():
        raise TraceError(f"{file}: table '{name}' missing from bundle")
    try:
        table = pq.read_table(file)
    except (pa.ArrowInvalid, OSError) as error:
        raise TraceError(
            f"{file}: table '{name}' is not readable Parquet: {str(error).splitlines()[0]}"
        ) from None
    version = (table.schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise TraceError(
            f"{file}: table '{name}' carries no {SCHEMA_VERSION_KEY.decode()} metadata, expected version {READABLE} "
            "(a table rewritten by pandas or pyarrow loses it: read the bundle with traces.read_bundle, edit the "
            "DataFrames, write it with traces.write_bundle)"
        )
    if version.decode() not in {str(v) for v in READABLE_VERSIONS}:
        raise TraceError(
            f"{file}: table '{name}' has schema version {version.decode()!r}, this reader reads version {READABLE}"
        )
    return table, int(version.decode())


def read_bundle(path: str | os.PathLike[str]) -> TraceBundle:
    """Read and validate the bundle directory at `path`.

    A version-1 bundle (five tables) is upgraded in memory to version 2 and the bundle's `notes` say so.
    """
    root = Path(path)
    if not root.is_dir():
        raise TraceError(
            f"{root}: not a trace bundle directory (expected {', '.join(n + '.parquet' for n in TABLE_NAMES)})"
        )
    frames: dict[str, pd.DataFrame] = {}
    bundle_version: int | None = None  # that of runs.parquet, read first; every table must agree
    for name in TABLE_NAMES:
        file = root / f"{name}.parquet"
        if bundle_version is not None and name not in SCHEMAS_BY_VERSION[bundle_version]:
            if file.exists():
                raise TraceError(
                    f"{file}: table '{name}' in a schema version {bundle_version} bundle, which has no such table"
                )
            frames[name] = empty_table(name)
            continue
        table, version = _read_table(file, name)
        if bundle_version is None:
            bundle_version = version
        elif version != bundle_version:
            raise TraceError(
                f"{file}: table '{name}' has schema version '{version}', the bundle's runs.parquet has '{bundle_version}'"
            )
        schema = SCHEMAS_BY_VERSION[version][name]
        _check_columns(str(file), name, table.schema, version)
        for field in schema:
            if field.name not in table.schema.names:  # an optional column: not measured
                table = table.append_column(field, pa.nulls(table.num_rows, field.type).fill_null(np.nan))
        frame = table.select(schema.names).cast(schema).to_pandas()
        _check_values(str(file), name, frame, schema)
        frames[name] = frame if version == SCHEMA_VERSION else upgrade_v1_table(name, frame)
    bundle = TraceBundle(**frames, notes=(V1_UPGRADE_NOTE,) if bundle_version == 1 else ())
    _check_consistency(str(root), bundle)
    return bundle


def _is_replaceable_bundle(root: Path) -> bool:
    """A directory that holds nothing but bundle table files (possibly some of them)."""
    if root.is_symlink() or not root.is_dir():
        return False
    expected = {f"{name}.parquet" for name in TABLE_NAMES}
    return all(entry.name in expected and entry.is_file() for entry in root.iterdir())


def write_bundle(bundle: TraceBundle, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Validate `bundle`, then write it to `path` atomically: a temporary sibling directory is filled
    and renamed into place, so readers never see a partial bundle."""
    root = Path(path)
    validate_bundle(bundle, str(root))
    tables = {name: _arrow_of(name, bundle.table(name), str(root)) for name in TABLE_NAMES}
    if root.exists() and not overwrite:
        raise TraceError(
            f"{root}: already exists (use --overwrite, or write_bundle(..., overwrite=True), to replace it)"
        )
    if root.exists() and not _is_replaceable_bundle(root):
        # overwrite replaces a bundle, never a file or a directory holding anything else (it is deleted).
        raise TraceError(
            f"{root}: not a trace bundle directory (expected only {', '.join(n + '.parquet' for n in TABLE_NAMES)}), "
            "refusing to replace it"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".partial", dir=root.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the bundle should not be
    try:
        for name, table in tables.items():
            # zstd, and float columns split by byte stream instead of dictionary-encoded: a measured events
            # table is 1.5x smaller than with zstd alone, 2x than with the default snappy.
            floats = [field.name for field in table.schema if pa.types.is_floating(field.type)]
            pq.write_table(
                table.replace_schema_metadata(with_metadata(name).metadata),
                staging / f"{name}.parquet",
                compression="zstd",
                use_dictionary=[c for c in table.column_names if c not in floats],
                use_byte_stream_split=floats or False,
            )
        if root.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".old", dir=root.parent))
            os.replace(root, retired / root.name)
            os.replace(staging, root)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root
