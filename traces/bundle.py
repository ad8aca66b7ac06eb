"""Read, validate and atomically write trace bundles (a directory of five Parquet tables)."""

from __future__ import annotations

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

from .errors import TraceError
from .schema import (
    ALLOWED_VALUES,
    POSITIVE_INT_COLUMNS,
    RATE_COLUMNS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TABLE_SCHEMAS,
    with_metadata,
)

TABLE_NAMES = tuple(TABLE_SCHEMAS)


@dataclass(frozen=True)
class TraceBundle:
    """The five trace tables as pandas DataFrames, columns exactly as in `traces.schema`."""

    runs: pd.DataFrame
    layers: pd.DataFrame
    iterations: pd.DataFrame
    collectives: pd.DataFrame
    exponents: pd.DataFrame

    def table(self, name: str) -> pd.DataFrame:
        return getattr(self, name)


def empty_table(name: str) -> pd.DataFrame:
    return TABLE_SCHEMAS[name].empty_table().to_pandas()


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


def _check_columns(origin: str, name: str, actual: pa.Schema) -> None:
    expected = TABLE_SCHEMAS[name]
    missing = [f for f in expected.names if f not in actual.names]
    if missing:
        raise _fail(origin, name, missing[0], "missing column")
    extra = [f for f in actual.names if f not in expected.names]
    if extra:
        raise _fail(origin, name, extra[0], f"unexpected column (schema v{SCHEMA_VERSION} has none such)")
    for field in expected:
        found = actual.field(field.name).type
        if _normalised(found) != _normalised(field.type):
            raise _fail(origin, name, field.name, f"type {_normalised(found)}, expected {field.type}")


def _check_values(origin: str, name: str, frame: pd.DataFrame) -> None:
    """Per-column value checks: no NaN/inf/negative numbers, closed sets, rates in [0, 1]."""
    schema = TABLE_SCHEMAS[name]
    for field in schema:
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
        finite = np.isfinite(values)
        if not finite.all():
            raise _fail(
                origin, name, field.name, f"value {_describe(values[~finite][0])}, expected a finite number"
            )
        negative = values < 0
        if negative.any():
            raise _fail(
                origin, name, field.name, f"value {_describe(column[negative].iloc[0])}, expected >= 0"
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
    for name in ("layers", "iterations", "exponents"):
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


def _check_exponents(origin: str, bundle: TraceBundle) -> None:
    exps = bundle.exponents
    if not len(exps):
        return
    traced_l = exps["run_id"].map(bundle.runs.set_index("run_id")["layers"])
    _raise_first(
        origin,
        "exponents",
        "layer",
        exps,
        exps["layer"] > traced_l + 1,
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


def _check_consistency(origin: str, bundle: TraceBundle) -> None:
    """Cross-table rules of docs/trace-format.md."""
    for check in (_check_runs, _check_layers, _check_iterations, _check_exponents, _check_collectives):
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


def read_bundle(path: str | os.PathLike[str]) -> TraceBundle:
    """Read and validate the bundle directory at `path`."""
    root = Path(path)
    if not root.is_dir():
        raise TraceError(
            f"{root}: not a trace bundle directory (expected {', '.join(n + '.parquet' for n in TABLE_NAMES)})"
        )
    frames: dict[str, pd.DataFrame] = {}
    for name in TABLE_NAMES:
        file = root / f"{name}.parquet"
        if not file.is_file():
            raise TraceError(f"{file}: table '{name}' missing from bundle")
        try:
            table = pq.read_table(file)
        except (pa.ArrowInvalid, OSError) as error:
            raise TraceError(
                f"{file}: table '{name}' is not readable Parquet: {str(error).splitlines()[0]}"
            ) from None
        metadata = table.schema.metadata or {}
        version = metadata.get(SCHEMA_VERSION_KEY)
        if version is None:
            raise TraceError(
                f"{file}: table '{name}' carries no {SCHEMA_VERSION_KEY.decode()} metadata, expected version {SCHEMA_VERSION}"
            )
        if version.decode() != str(SCHEMA_VERSION):
            raise TraceError(
                f"{file}: table '{name}' has schema version {version.decode()!r}, this reader reads version {SCHEMA_VERSION}"
            )
        _check_columns(str(file), name, table.schema)
        frame = table.select(TABLE_SCHEMAS[name].names).cast(TABLE_SCHEMAS[name]).to_pandas()
        _check_values(str(file), name, frame)
        frames[name] = frame
    bundle = TraceBundle(**frames)
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
        raise TraceError(f"{root}: already exists (pass overwrite to replace it)")
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
            pq.write_table(
                table.replace_schema_metadata(with_metadata(name).metadata), staging / f"{name}.parquet"
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
