"""Read, validate and atomically write trace bundles (a directory of five Parquet tables)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

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

    def measured_run_ids(self) -> set[str]:
        return set(self.runs.loc[self.runs["source"] == "measured", "run_id"])


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


def _check_consistency(origin: str, bundle: TraceBundle) -> None:
    """Cross-table rules of docs/trace-format.md."""
    runs = bundle.runs
    duplicated = runs["run_id"][runs["run_id"].duplicated()]
    if len(duplicated):
        raise _fail(
            origin, "runs", "run_id", f"value {_describe(duplicated.iloc[0])} appears twice, expected unique"
        )
    if (runs["full_layers"] < runs["layers"]).any():
        row = runs[runs["full_layers"] < runs["layers"]].iloc[0]
        raise _fail(
            origin,
            "runs",
            "full_layers",
            f"value {row.full_layers} < layers {row.layers} in run {row.run_id!r}",
        )
    known_runs = set(runs["run_id"])
    for name in ("layers", "iterations", "exponents"):
        unknown = bundle.table(name).loc[~bundle.table(name)["run_id"].isin(known_runs), "run_id"]
        if len(unknown):
            raise _fail(origin, name, "run_id", f"value {_describe(unknown.iloc[0])} is not in table 'runs'")

    layers_by_run = runs.set_index("run_id")["layers"]
    layers = bundle.layers
    if len(layers):
        traced_l = layers["run_id"].map(layers_by_run)
        out_of_range = (layers["layer"] > traced_l + 1).to_numpy()
        if out_of_range.any():
            row = layers[out_of_range].iloc[0]
            raise _fail(
                origin,
                "layers",
                "layer",
                f"value {row.layer} in run {row.run_id!r}, expected 0..{int(layers_by_run[row.run_id]) + 1} (runs.layers + 1)",
            )
        counts = layers.groupby(["run_id", "iteration"])["layer"].nunique()
        for (run_id, iteration), count in counts.items():
            expected = int(layers_by_run[run_id]) + 2
            if count != expected:
                raise _fail(
                    origin,
                    "layers",
                    "layer",
                    f"run {run_id!r} iteration {iteration} has {count} distinct layers, runs.layers={expected - 2} implies {expected}",
                )
        expected_kind = np.where(
            layers["layer"] == 0, "embedding", np.where(layers["layer"] == traced_l + 1, "head", "block")
        )
        wrong_kind = layers["layer_kind"].to_numpy() != expected_kind
        if wrong_kind.any():
            row = layers[wrong_kind].iloc[0]
            raise _fail(
                origin,
                "layers",
                "layer_kind",
                f"value {row.layer_kind!r} for layer {row.layer} of run {row.run_id!r}",
            )
    layer_iters = set(map(tuple, layers[["run_id", "iteration"]].drop_duplicates().to_numpy().tolist()))
    iter_rows = set(map(tuple, bundle.iterations[["run_id", "iteration"]].to_numpy().tolist()))
    if layer_iters != iter_rows:
        odd = sorted(layer_iters ^ iter_rows)[0]
        raise _fail(
            origin,
            "iterations",
            "iteration",
            f"run {odd[0]!r} iteration {odd[1]} is in only one of 'layers' and 'iterations'",
        )

    exps = bundle.exponents
    if len(exps):
        over = (exps["layer"] > exps["run_id"].map(layers_by_run) + 1).to_numpy()
        if over.any():
            row = exps[over].iloc[0]
            raise _fail(
                origin,
                "exponents",
                "layer",
                f"value {row.layer} beyond runs.layers + 1 of run {row.run_id!r}",
            )

    coll = bundle.collectives
    if len(coll) and len(runs):
        # Collectives of a cluster that runs were captured on must span the nodes those runs imply.
        gpus_per_node = runs.groupby("cluster")["gpus_per_node"].first()
        on_known = coll[coll["cluster"].isin(gpus_per_node.index)]
        implied_nodes = -(-on_known["world_size"] // on_known["cluster"].map(gpus_per_node))
        mismatch = on_known["nodes"] != implied_nodes
        if mismatch.any():
            row = on_known[mismatch].iloc[0]
            raise _fail(
                origin,
                "collectives",
                "nodes",
                f"value {row.nodes} for world_size {row.world_size} on cluster {row.cluster!r}, runs there have "
                f"gpus_per_node {int(gpus_per_node[row.cluster])} so expected {int(implied_nodes[mismatch].iloc[0])}",
            )
    if len(coll):
        too_many = coll["nodes"] > coll["world_size"]
        if too_many.any():
            row = coll[too_many].iloc[0]
            raise _fail(origin, "collectives", "nodes", f"value {row.nodes} > world_size {row.world_size}")
        expected_algbw = coll["bytes"] / coll["time_s"].where(coll["time_s"] > 0)
        off = ~np.isclose(coll["algbw_Bps"], expected_algbw, rtol=1e-3)
        if off.any():
            row = coll[off].iloc[0]
            raise _fail(
                origin,
                "collectives",
                "algbw_Bps",
                f"value {row.algbw_Bps:.6g}, expected bytes/time_s = {row.bytes / row.time_s if row.time_s else math.inf:.6g}",
            )


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


def write_bundle(bundle: TraceBundle, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Validate `bundle`, then write it to `path` atomically: a temporary sibling directory is filled
    and renamed into place, so readers never see a partial bundle."""
    root = Path(path)
    validate_bundle(bundle, str(root))
    tables = {name: _arrow_of(name, bundle.table(name), str(root)) for name in TABLE_NAMES}
    if root.exists() and not overwrite:
        raise TraceError(f"{root}: already exists (pass overwrite to replace it)")
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
