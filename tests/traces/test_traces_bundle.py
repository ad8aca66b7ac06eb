"""The trace reader, validator and atomic writer: round trip, and one test per kind of bad input."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import traces
from traces.schema import SCHEMA_VERSION_KEY


def _replace(bundle: traces.TraceBundle, **tables: pd.DataFrame) -> traces.TraceBundle:
    return dataclasses.replace(bundle, **tables)


def test_round_trip_preserves_every_table(tiny_bundle, tmp_path):
    path = traces.write_bundle(tiny_bundle, tmp_path / "b")
    loaded = traces.read_bundle(path)
    for name in traces.TABLE_NAMES:
        pd.testing.assert_frame_equal(loaded.table(name), tiny_bundle.table(name), check_dtype=False)
    assert sorted(p.name for p in path.iterdir()) == sorted(f"{n}.parquet" for n in traces.TABLE_NAMES)


def test_each_file_carries_schema_version(tiny_bundle, tmp_path):
    path = traces.write_bundle(tiny_bundle, tmp_path / "b")
    for name in traces.TABLE_NAMES:
        metadata = pq.read_schema(path / f"{name}.parquet").metadata
        assert metadata[SCHEMA_VERSION_KEY] == str(traces.SCHEMA_VERSION).encode()


def test_writer_refuses_to_overwrite_unless_asked(tiny_bundle, tmp_path):
    traces.write_bundle(tiny_bundle, tmp_path / "b")
    with pytest.raises(traces.TraceError, match="already exists"):
        traces.write_bundle(tiny_bundle, tmp_path / "b")
    traces.write_bundle(tiny_bundle, tmp_path / "b", overwrite=True)
    assert traces.read_bundle(tmp_path / "b")


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_overwrite_never_replaces_something_that_is_not_a_bundle(kind, tiny_bundle, tmp_path):
    target = tmp_path / "precious"
    if kind == "directory":
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    else:
        target.write_text("keep me")
    with pytest.raises(traces.TraceError, match="not a trace bundle"):
        traces.write_bundle(tiny_bundle, target, overwrite=True)
    kept = target / "notes.txt" if kind == "directory" else target
    assert kept.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


def test_writer_leaves_nothing_behind_when_it_fails(tiny_bundle, tmp_path, monkeypatch):
    original = pq.write_table
    calls = {"n": 0}

    def crash_on_third(table, where, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return original(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", crash_on_third)
    with pytest.raises(OSError):
        traces.write_bundle(tiny_bundle, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_writer_validates_before_writing(tiny_bundle, tmp_path):
    layers = tiny_bundle.layers.copy()
    layers.loc[0, "compute_s"] = -1.0
    with pytest.raises(traces.TraceError):
        traces.write_bundle(_replace(tiny_bundle, layers=layers), tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def _write_raw(
    bundle: traces.TraceBundle,
    root: Path,
    table: str,
    arrow_table: pa.Table,
    version: str = str(traces.SCHEMA_VERSION),
):
    """Write a bundle, then replace one table's file with `arrow_table` as given (no validation)."""
    traces.write_bundle(bundle, root)
    metadata = {SCHEMA_VERSION_KEY: version.encode(), b"ciera.table": table.encode()}
    pq.write_table(arrow_table.replace_schema_metadata(metadata), root / f"{table}.parquet")


def _arrow(frame: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(frame, preserve_index=False)


BAD_INPUTS = {
    "missing column": (
        "layers",
        lambda f: f.drop(columns=["compute_s"]),
        "column 'compute_s': missing column",
    ),
    "extra column": ("runs", lambda f: f.assign(colour="red"), "column 'colour': unexpected column"),
    "wrong type": (
        "layers",
        lambda f: f.assign(compute_s=f["compute_s"].astype(str)),
        "column 'compute_s': type ",
    ),
    "NaN time": ("layers", lambda f: f.assign(allgather_s=math.nan), "column 'allgather_s': value nan"),
    "negative size": (
        "layers",
        lambda f: f.assign(allgather_bytes=f["allgather_bytes"] * -1 - 1),
        "column 'allgather_bytes': value -2001, expected >= 0",
    ),
    "negative time": ("iterations", lambda f: f.assign(iteration_s=-0.5), "column 'iteration_s': value -0.5"),
    "infinite time": ("layers", lambda f: f.assign(compute_s=math.inf), "column 'compute_s': value inf"),
    "unknown phase": ("layers", lambda f: f.assign(phase="sideways"), "column 'phase': value 'sideways'"),
    "busbw not nccl-tests": (
        "collectives",
        lambda f: f.assign(busbw_Bps=f["algbw_Bps"]),
        "column 'busbw_Bps': value 1.04858e+09 for all_gather over 4 ranks",
    ),
    "rate above one": (
        "exponents",
        lambda f: f.assign(block_change_rate=1.5),
        "column 'block_change_rate': value 1.5",
    ),
    "zero world size": (
        "runs",
        lambda f: f.assign(world_size=f["world_size"] * 0),
        "column 'world_size': value 0, expected >= 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_table_is_one_line_naming_file_table_column_value(case, tiny_bundle, tmp_path):
    table, mutate, expected = BAD_INPUTS[case]
    root = tmp_path / "b"
    frame = mutate(tiny_bundle.table(table).copy())
    _write_raw(tiny_bundle, root, table, _arrow(frame))
    with pytest.raises(traces.TraceError) as error:
        traces.read_bundle(root)
    message = str(error.value)
    assert "\n" not in message
    assert f"table '{table}'" in message
    assert expected in message
    assert str(root) in message


def test_unknown_schema_version(tiny_bundle, tmp_path):
    root = tmp_path / "b"
    _write_raw(tiny_bundle, root, "runs", _arrow(tiny_bundle.runs), version="99")
    with pytest.raises(traces.TraceError, match="schema version '99', this reader reads version 1 or 2"):
        traces.read_bundle(root)


def test_missing_table_file(tiny_bundle, tmp_path):
    root = traces.write_bundle(tiny_bundle, tmp_path / "b")
    os.remove(root / "exponents.parquet")
    with pytest.raises(traces.TraceError, match="table 'exponents' missing"):
        traces.read_bundle(root)


def test_not_parquet(tiny_bundle, tmp_path):
    root = traces.write_bundle(tiny_bundle, tmp_path / "b")
    (root / "layers.parquet").write_text("not parquet")
    with pytest.raises(traces.TraceError, match="layers.parquet: table 'layers' is not readable Parquet"):
        traces.read_bundle(root)


def test_layer_count_that_does_not_match_runs(tiny_bundle):
    runs = tiny_bundle.runs.assign(layers=3)
    with pytest.raises(traces.TraceError, match="distinct layers, runs.layers=3 implies 5"):
        traces.validate_bundle(_replace(tiny_bundle, runs=runs))


def test_layer_beyond_head(tiny_bundle):
    layers = tiny_bundle.layers.copy()
    layers.loc[layers["layer"] == 3, "layer"] = 7
    with pytest.raises(traces.TraceError, match="column 'layer': value 7 in run 'r0', expected 0..3"):
        traces.validate_bundle(_replace(tiny_bundle, layers=layers))


def test_layer_kind_must_match_numbering(tiny_bundle):
    layers = tiny_bundle.layers.copy()
    layers.loc[layers["layer"] == 0, "layer_kind"] = "block"
    with pytest.raises(traces.TraceError, match="column 'layer_kind': value 'block' for layer 0"):
        traces.validate_bundle(_replace(tiny_bundle, layers=layers))


def test_unknown_run_id(tiny_bundle):
    iterations = tiny_bundle.iterations.assign(run_id="ghost")
    with pytest.raises(traces.TraceError, match="value 'ghost' is not in table 'runs'"):
        traces.validate_bundle(_replace(tiny_bundle, iterations=iterations))


def test_duplicate_run_id(tiny_bundle):
    runs = pd.concat([tiny_bundle.runs, tiny_bundle.runs], ignore_index=True)
    with pytest.raises(traces.TraceError, match="appears twice"):
        traces.validate_bundle(_replace(tiny_bundle, runs=runs))


def test_iteration_missing_from_iterations_table(tiny_bundle):
    iterations = tiny_bundle.iterations.iloc[:1]
    with pytest.raises(traces.TraceError, match="iteration 1 is in only one of"):
        traces.validate_bundle(_replace(tiny_bundle, iterations=iterations))


def test_world_size_and_nodes_that_do_not_line_up(tiny_bundle):
    collectives = tiny_bundle.collectives.assign(nodes=1)  # 4 ranks at 2 per node span 2 nodes
    with pytest.raises(traces.TraceError, match="column 'nodes': value 1 for world_size 4.*expected 2"):
        traces.validate_bundle(_replace(tiny_bundle, collectives=collectives))


def test_algbw_must_match_bytes_over_time(tiny_bundle):
    collectives = tiny_bundle.collectives.assign(algbw_Bps=1.0)
    with pytest.raises(traces.TraceError, match="column 'algbw_Bps'"):
        traces.validate_bundle(_replace(tiny_bundle, collectives=collectives))


def test_full_layers_below_traced_layers(tiny_bundle):
    runs = tiny_bundle.runs.assign(full_layers=1)
    with pytest.raises(traces.TraceError, match="column 'full_layers': value 1 < layers 2"):
        traces.validate_bundle(_replace(tiny_bundle, runs=runs))


def test_cli_validate_exit_codes(tiny_bundle, tmp_path):
    good = traces.write_bundle(tiny_bundle, tmp_path / "good")
    ok = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "traces", "validate", str(good), "--json"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert '"valid": true' in ok.stdout
    bad = tmp_path / "bad"
    _write_raw(tiny_bundle, bad, "iterations", _arrow(tiny_bundle.iterations.assign(iteration_s=math.nan)))
    failed = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "traces", "validate", str(bad)],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 2
    assert failed.stderr.count("\n") == 1 and "Traceback" not in failed.stderr
    assert "iteration_s" in failed.stderr
