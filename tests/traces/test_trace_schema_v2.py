"""Trace schema version 2: the events and shard_changes tables, the new runs and collectives columns,
layers derived from events, and reading version-1 bundles."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import traces
from tests.traces.conftest import make_tiny_bundle
from traces.schema import OPTIONAL_COLUMNS, SCHEMA_VERSION_KEY, V1_TABLE_SCHEMAS, with_metadata
from traces.upgrade import V1_UPGRADE_NOTE

LAYERS = 2  # traced blocks: layers 0..3
WORLD = 2
NUMEL = {0: 1000, 1: 3000, 2: 3000, 3: 3000}


def _typed(name: str, rows: list[dict] | pd.DataFrame) -> pd.DataFrame:
    empty = traces.empty_table(name)
    frame = pd.DataFrame(rows, columns=empty.columns)
    return frame.astype(empty.dtypes.to_dict()) if len(frame) else empty


def _event(
    run_id="r0", rank=0, iteration=0, layer=0, phase="fwd", stream="compute", start=0.0, end=0.0, **more
):
    row = {
        "run_id": run_id,
        "rank": rank,
        "iteration": iteration,
        "layer": layer,
        "phase": phase,
        "stream": stream,
        "issued_s": more.pop("issued", start),
        "start_s": start,
        "end_s": end,
        "raw_bytes": 0,
        "wire_bytes": 0,
    }
    row.update(more)
    return row


def schedule_events(iterations: int = 2, checkpointing: bool = True) -> pd.DataFrame:
    """One rank's ZeRO-3-like iteration per rank, each step after the last, so no stream overlaps itself."""
    order = [(layer, "fwd") for layer in range(LAYERS + 2)]
    if checkpointing:
        order += [(layer, "recompute") for layer in range(1, LAYERS + 1)]
    order += [(layer, "bwd") for layer in reversed(range(LAYERS + 2))]
    rows = []
    for iteration in range(iterations):
        for rank in range(WORLD):
            t = 0.0
            for layer, phase in order:
                size = 2 * NUMEL[layer]
                steps = [("codec_send", 1e-4, 0, 0), ("allgather", 5e-4 * (rank + 1), size, size // 2)]
                steps += [("codec_recv", 2e-4, 0, 0), ("compute", 1e-3 * (1 + (phase == "bwd")), 0, 0)]
                if phase == "bwd":
                    steps.append(("reduce_scatter", 6e-4, size, size))
                for stream, duration, raw, wire in steps:
                    rows.append(
                        _event(
                            rank=rank,
                            iteration=iteration,
                            layer=layer,
                            phase=phase,
                            stream=stream,
                            issued=max(t - 1e-5, 0.0),
                            start=t,
                            end=t + duration,
                            raw_bytes=raw,
                            wire_bytes=wire,
                        )
                    )
                    t += duration
            # The loss all-reduce and the engine's one optimizer step: tied to no layer.
            for stream, phase, duration in (("all_reduce", "bwd", 1e-4), ("optim", "optim", 3e-3)):
                rows.append(
                    _event(
                        rank=rank,
                        iteration=iteration,
                        layer=-1,
                        phase=phase,
                        stream=stream,
                        start=t,
                        end=t + duration,
                    )
                )
    return _typed("events", rows)


def shard_changes_rows() -> pd.DataFrame:
    return _typed(
        "shard_changes",
        [
            {
                "run_id": "r0",
                "iteration": 1,
                "layer": layer,
                "shard": f"p{layer}",
                "category": "embedding" if layer in (0, LAYERS + 1) else "expert_ffn",
                "numel": NUMEL[layer],
                "world_size": world,
                "shard_change_rate": 0.25 * world / 4,
            }
            for layer in range(LAYERS + 2)
            for world in (2, 4)
        ],
    )


def bundle_with_events(
    events: pd.DataFrame, checkpointing: bool = True, slack_s: float = 5e-4
) -> traces.TraceBundle:
    """The tiny bundle of conftest with `events`, layers and iterations derived from them, shard_changes."""
    base = make_tiny_bundle(layers=LAYERS, world_size=WORLD)
    runs = base.runs.assign(activation_checkpointing=checkpointing)
    numel = pd.DataFrame(
        [("r0", layer, n) for layer, n in NUMEL.items()], columns=["run_id", "layer", "numel"]
    )
    ends = events.groupby(["run_id", "iteration"], as_index=False)["end_s"].max()
    measured = ends.assign(iteration_s=ends["end_s"] + slack_s)
    layers, iterations = traces.derive_layer_tables(runs, events, numel, iteration_s=measured)
    return dataclasses.replace(
        base,
        runs=runs,
        layers=layers,
        iterations=iterations,
        events=events,
        shard_changes=shard_changes_rows(),
    )


@pytest.fixture(scope="module")
def events_bundle() -> traces.TraceBundle:
    return bundle_with_events(schedule_events())


# --- round trip and construction ---------------------------------------------------------------------


def test_round_trip_with_events_and_shard_changes(events_bundle, tmp_path):
    traces.validate_bundle(events_bundle)
    path = traces.write_bundle(events_bundle, tmp_path / "b")
    assert sorted(p.name for p in path.iterdir()) == sorted(f"{n}.parquet" for n in traces.TABLE_NAMES)
    loaded = traces.read_bundle(path)
    assert loaded.notes == ()
    for name in traces.TABLE_NAMES:
        pd.testing.assert_frame_equal(loaded.table(name), events_bundle.table(name), check_dtype=False)
    for name in traces.TABLE_NAMES:
        assert pq.read_schema(path / f"{name}.parquet").metadata[SCHEMA_VERSION_KEY] == b"2"


@pytest.mark.parametrize(
    "table_name, column, value",
    [("collectives", "transport_cpu_s", 0.25e-3), ("runs", "reduce_bucket_size", 1_441_792.0)],
)
def test_optional_columns_read_nan_when_absent_and_are_checked_when_present(
    events_bundle, tmp_path, table_name: str, column: str, value: float
):
    assert (table_name, column) in OPTIONAL_COLUMNS
    # A bundle written before the column existed: its file lacks it and reads as NaN (not measured).
    path = traces.write_bundle(events_bundle, tmp_path / "b")
    table = pq.read_table(path / f"{table_name}.parquet")
    older = table.drop_columns([column])
    pq.write_table(older.replace_schema_metadata(table.schema.metadata), path / f"{table_name}.parquet")
    loaded = traces.read_bundle(path)
    assert len(loaded.table(table_name)) and loaded.table(table_name)[column].isna().all()
    # Recorded values round-trip; a negative or infinite one is refused in one line.
    recorded = loaded.table(table_name).assign(**{column: value})
    again = traces.read_bundle(
        traces.write_bundle(dataclasses.replace(loaded, **{table_name: recorded}), tmp_path / "c")
    )
    assert (again.table(table_name)[column] == value).all()
    for bad, expected in (
        (-1.0, r"value -1.*expected >= 0"),
        (float("inf"), r"value inf, expected a finite number"),
    ):
        bad_table = recorded.assign(**{column: bad})
        with pytest.raises(traces.TraceError, match=rf"column '{column}': {expected}"):
            traces.validate_bundle(dataclasses.replace(loaded, **{table_name: bad_table}), "origin")


def test_seven_tables_and_five_table_construction_still_works():
    assert traces.TABLE_NAMES == (
        "runs",
        "layers",
        "iterations",
        "collectives",
        "exponents",
        "events",
        "shard_changes",
    )
    bundle = traces.TraceBundle(**{name: traces.empty_table(name) for name in traces.TABLE_NAMES[:5]})
    assert list(bundle.events.columns) == list(traces.empty_table("events").columns)
    assert list(bundle.shard_changes.columns) == list(traces.empty_table("shard_changes").columns)
    assert bundle.notes == ()
    traces.validate_bundle(bundle)


def test_exponent_statistics_run_needs_no_layers_or_iterations(events_bundle):
    stats_run = events_bundle.runs.assign(run_id="stats", activation_checkpointing=False)
    runs = pd.concat([events_bundle.runs, stats_run], ignore_index=True)
    shard_changes = pd.concat(
        [events_bundle.shard_changes, events_bundle.shard_changes.assign(run_id="stats")], ignore_index=True
    )
    exponents = pd.concat(
        [events_bundle.exponents, events_bundle.exponents.assign(run_id="stats")], ignore_index=True
    )
    traces.validate_bundle(
        dataclasses.replace(events_bundle, runs=runs, shard_changes=shard_changes, exponents=exponents)
    )


# --- one test per rule: each breaks it once and checks the one-line message --------------------------


def _first(frame: pd.DataFrame, mask: pd.Series, **values) -> pd.DataFrame:
    """`frame` with `values` set on the first row where `mask` holds."""
    frame = frame.copy()
    index = frame.index[np.asarray(mask, dtype=bool)][0]
    for column, value in values.items():
        frame.loc[index, column] = value
    return frame


def _overlap(events: pd.DataFrame) -> pd.DataFrame:
    """Move the second compute event of rank 0, iteration 0 to start inside the first."""
    compute = events[(events["stream"] == "compute") & (events["rank"] == 0) & (events["iteration"] == 0)]
    first, second = compute.index[:2]
    start = events.loc[first, "start_s"] + 1e-4
    duration = events.loc[second, "end_s"] - events.loc[second, "start_s"]
    return _first(events, events.index == second, issued_s=start, start_s=start, end_s=start + duration)


def _layers_off(layers: pd.DataFrame) -> pd.DataFrame:
    mask = (layers["layer"] == 1) & (layers["phase"] == "fwd") & (layers["iteration"] == 1)
    return _first(layers, mask, compute_s=layers.loc[mask, "compute_s"].iloc[0] * 1.01)


Mutation = Callable[[pd.DataFrame], pd.DataFrame]
RULES: dict[str, tuple[str, str, Mutation, str]] = {
    # runs
    "engine closed set": (
        "runs",
        "engine",
        lambda f: f.assign(engine="megatron"),
        "value 'megatron', expected one of",
    ),
    "backend closed set": (
        "runs",
        "backend",
        lambda f: f.assign(backend="mpi"),
        "value 'mpi', expected one of",
    ),
    "nodes at least one": ("runs", "nodes", lambda f: f.assign(nodes=0), "value 0, expected >= 1"),
    "nodes = ceil(W/G)": (
        "runs",
        "nodes",
        lambda f: f.assign(nodes=3),
        "value 3 in run 'r0', expected ceil(world_size 2 / gpus_per_node 2) = 1",
    ),
    "prefetch not negative": (
        "runs",
        "prefetch_bucket_size",
        lambda f: f.assign(prefetch_bucket_size=-1),
        "value -1, expected >= 0",
    ),
    "reuse distance not negative": (
        "runs",
        "max_reuse_distance",
        lambda f: f.assign(max_reuse_distance=-5),
        "value -5, expected >= 0",
    ),
    "live parameters not negative": (
        "runs",
        "max_live_parameters",
        lambda f: f.assign(max_live_parameters=-2),
        "value -2, expected >= 0",
    ),
    "link rate finite": ("runs", "link_rate_Bps", lambda f: f.assign(link_rate_Bps=math.inf), "value inf"),
    "link latency not negative": (
        "runs",
        "link_latency_s",
        lambda f: f.assign(link_latency_s=-1e-3),
        "value -0.001",
    ),
    "measured link not NaN": (
        "runs",
        "measured_link_Bps",
        lambda f: f.assign(measured_link_Bps=math.nan),
        "value nan",
    ),
    "warmup not negative": (
        "runs",
        "warmup_iterations",
        lambda f: f.assign(warmup_iterations=-1),
        "value -1",
    ),
    "clock spread not negative": (
        "runs",
        "clock_spread_s",
        lambda f: f.assign(clock_spread_s=-1e-6),
        "value -1e-06",
    ),
    # collectives
    "repetitions at least one": (
        "collectives",
        "repetitions",
        lambda f: f.assign(repetitions=0),
        "value 0, expected >= 1",
    ),
    "min above median": (
        "collectives",
        "time_min_s",
        lambda f: f.assign(time_min_s=f["time_s"] * 1.01),
        "value 0.00101 > time_s 0.001 (the median)",
    ),
    "max below median": (
        "collectives",
        "time_max_s",
        lambda f: f.assign(time_max_s=f["time_s"] * 0.99),
        "value 0.00099 < time_s 0.001 (the median)",
    ),
    # events
    "event run unknown": (
        "events",
        "run_id",
        lambda f: f.assign(run_id="ghost"),
        "value 'ghost' is not in table 'runs'",
    ),
    "rank beyond world size": (
        "events",
        "rank",
        lambda f: _first(f, f["rank"] == 1, rank=2),
        "value 2 in run 'r0', expected 0..1 (runs.world_size - 1)",
    ),
    "negative rank": (
        "events",
        "rank",
        lambda f: _first(f, f["rank"] == 1, rank=-1),
        "value -1, expected >= 0",
    ),
    "layer beyond head": (
        "events",
        "layer",
        lambda f: _first(f, f["layer"] == 3, layer=4),
        "value 4 in run 'r0', expected -1..3 (runs.layers + 1)",
    ),
    "layer below -1": (
        "events",
        "layer",
        lambda f: _first(f, f["layer"] == -1, layer=-2),
        "value -2, expected >= -1",
    ),
    "unknown stream": (
        "events",
        "stream",
        lambda f: _first(f, f["stream"] == "optim", stream="nvlink"),
        "value 'nvlink'",
    ),
    "unknown phase": (
        "events",
        "phase",
        lambda f: _first(f, f["phase"] == "fwd", phase="sideways"),
        "value 'sideways'",
    ),
    "issued after start": (
        "events",
        "issued_s",
        lambda f: _first(f, f["start_s"] > 0, issued_s=f.loc[f["start_s"] > 0, "start_s"].iloc[0] + 1e-6),
        "run 'r0' rank 0 iteration 0 layer 0 phase 'fwd' stream 'allgather'",
    ),
    "end before start": (
        "events",
        "end_s",
        lambda f: _first(
            f, f["stream"] == "compute", end_s=f.loc[f["stream"] == "compute", "start_s"].iloc[0] - 1e-6
        ),
        "stream 'compute'",
    ),
    "negative time": (
        "events",
        "issued_s",
        lambda f: _first(f, f["layer"] >= 0, issued_s=-1.0),
        "value -1.0, expected >= 0",
    ),
    "infinite time": ("events", "end_s", lambda f: _first(f, f["layer"] >= 0, end_s=math.inf), "value inf"),
    "NaN time": ("events", "start_s", lambda f: _first(f, f["layer"] >= 0, start_s=math.nan), "value nan"),
    "overlap on a stream": (
        "events",
        "start_s",
        _overlap,
        "overlaps the previous event on its stream, which ends at 0.0018 (run 'r0' rank 0 iteration 0 layer 1",
    ),
    "event iteration not in iterations": (
        "events",
        "iteration",
        lambda f: f.assign(iteration=f["iteration"].where(f["iteration"] == 0, 7)),
        "run 'r0' iteration 7 has events but no row in table 'iterations'",
    ),
    "event past its iteration": (
        "events",
        "end_s",
        lambda f: _first(
            f, f["stream"] == "optim", end_s=f.loc[f["stream"] == "optim", "end_s"].iloc[0] + 0.01
        ),
        "is past iteration_s",
    ),
    # shard_changes
    "shard change run unknown": (
        "shard_changes",
        "run_id",
        lambda f: f.assign(run_id="ghost"),
        "value 'ghost' is not in table 'runs'",
    ),
    "shard change layer beyond head": (
        "shard_changes",
        "layer",
        lambda f: f.assign(layer=9),
        "value 9 beyond runs.layers + 1 of run 'r0'",
    ),
    "shard change negative layer": (
        "shard_changes",
        "layer",
        lambda f: f.assign(layer=-1),
        "value -1, expected >= 0",
    ),
    "shard change iteration zero": (
        "shard_changes",
        "iteration",
        lambda f: f.assign(iteration=0),
        "value 0, expected >= 1",
    ),
    "shard change world size zero": (
        "shard_changes",
        "world_size",
        lambda f: f.assign(world_size=0),
        "value 0, expected >= 1",
    ),
    "shard change rate above one": (
        "shard_changes",
        "shard_change_rate",
        lambda f: f.assign(shard_change_rate=1.25),
        "value 1.25, expected a rate in [0, 1]",
    ),
    "shard change category": (
        "shard_changes",
        "category",
        lambda f: f.assign(category="misc"),
        "value 'misc'",
    ),
    "iteration listed twice": (
        "iterations",
        "iteration",
        lambda f: pd.concat([f, f.iloc[:1]], ignore_index=True),
        "run 'r0' iteration 0 appears twice, expected one row",
    ),
    # layers derived from events
    "layers differ from events": (
        "layers",
        "compute_s",
        _layers_off,
        "run 'r0' iteration 1 layer 1 phase 'fwd': value 0.00101, its events give 0.001",
    ),
    "layers lack a row events imply": (
        "layers",
        "phase",
        lambda f: f[~((f["layer"] == 2) & (f["phase"] == "recompute") & (f["iteration"] == 0))],
        "run 'r0' iteration 0 layer 2 phase 'recompute': the run's events imply this row, the table lacks it",
    ),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule_is_one_line_naming_table_column_value(case, events_bundle):
    table, column, mutate, expected = RULES[case]
    broken = dataclasses.replace(events_bundle, **{table: mutate(events_bundle.table(table))})
    with pytest.raises(traces.TraceError) as error:
        traces.validate_bundle(broken, "origin")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"origin: table '{table}', column '{column}': "), message
    assert expected in message, message


def test_layers_row_not_implied_by_events(events_bundle):
    runs = events_bundle.runs.assign(activation_checkpointing=False)
    events = events_bundle.events[events_bundle.events["phase"] != "recompute"]
    with pytest.raises(traces.TraceError, match="phase 'recompute': row not implied by the run's events"):
        traces.validate_bundle(dataclasses.replace(events_bundle, runs=runs, events=events))


def test_recompute_events_need_activation_checkpointing(events_bundle):
    runs = events_bundle.runs.assign(activation_checkpointing=False)
    with pytest.raises(
        traces.TraceError, match="column 'phase': value 'recompute' .*activation_checkpointing false"
    ):
        traces.validate_bundle(dataclasses.replace(events_bundle, runs=runs))


def test_event_rule_through_the_reader_names_the_file(events_bundle, tmp_path):
    root = traces.write_bundle(events_bundle, tmp_path / "b")
    frame = events_bundle.events.assign(stream="nvlink")
    metadata = with_metadata("events").metadata
    pq.write_table(
        pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(metadata),
        root / "events.parquet",
    )
    with pytest.raises(traces.TraceError) as error:
        traces.read_bundle(root)
    assert str(error.value).startswith(
        f"{root / 'events.parquet'}: table 'events', column 'stream': value 'nvlink'"
    )


def test_collective_times_equal_within_tolerance(events_bundle):
    collectives = events_bundle.collectives.assign(time_min_s=lambda f: f["time_s"] * (1 + 1e-12))
    traces.validate_bundle(dataclasses.replace(events_bundle, collectives=collectives))


# --- derive_layer_tables ------------------------------------------------------------------------------


def _hand_events() -> pd.DataFrame:
    """A run with one block (layers 0..2), two ranks, one iteration."""
    table = [
        # rank, layer, phase, stream, start_s, end_s, raw_bytes (wire_bytes: 60 % of raw for gathers)
        (0, 1, "fwd", "compute", 0.0, 0.010, 0),
        (0, 1, "fwd", "compute", 0.020, 0.025, 0),
        (0, 1, "fwd", "allgather", 0.0, 0.004, 1000),
        (0, 1, "fwd", "codec_recv", 0.004, 0.005, 0),
        (0, 1, "bwd", "reduce_scatter", 0.05, 0.06, 2000),
        (0, -1, "optim", "optim", 0.1, 0.2, 0),
        (0, 1, "optim", "optim", 0.2, 0.21, 0),
        (0, -1, "bwd", "all_reduce", 0.3, 0.31, 0),
        (0, -1, "fwd", "compute", 0.4, 0.41, 0),
        (1, 1, "fwd", "compute", 0.0, 0.005, 0),
        (1, 1, "fwd", "allgather", 0.0, 0.006, 1000),
        (1, 1, "bwd", "reduce_scatter", 0.05, 0.07, 2003),
        (1, 1, "bwd", "codec_send", 0.0, 0.002, 0),
        (1, -1, "optim", "optim", 0.1, 0.14, 0),
    ]
    return _typed(
        "events",
        [
            _event(
                rank=rank,
                layer=layer,
                phase=phase,
                stream=stream,
                start=start,
                end=end,
                raw_bytes=raw,
                wire_bytes=raw * 6 // 10 if stream == "allgather" else raw,
            )
            for rank, layer, phase, stream, start, end, raw in table
        ],
    )


def _hand_runs(checkpointing: bool) -> pd.DataFrame:
    run = make_tiny_bundle(layers=1, world_size=2).runs
    return run.assign(activation_checkpointing=checkpointing)


HAND_NUMEL = pd.DataFrame({"run_id": "r0", "layer": [0, 1, 2], "numel": [100, 300, 600]})


def test_derive_layer_tables_by_hand():
    layers, iterations = traces.derive_layer_tables(_hand_runs(False), _hand_events(), HAND_NUMEL)
    assert list(layers.columns) == list(traces.empty_table("layers").columns)
    assert list(zip(layers["layer"], layers["phase"], strict=True)) == [
        (layer, phase) for layer in (0, 1, 2) for phase in ("fwd", "bwd", "optim")
    ]
    assert list(layers["layer_kind"]) == ["embedding"] * 3 + ["block"] * 3 + ["head"] * 3
    assert list(layers["numel"]) == [100] * 3 + [300] * 3 + [600] * 3
    cell = layers.set_index(["layer", "phase"])
    # fwd of layer 1: rank 0 computes 10 + 5 ms, rank 1 5 ms; gathers of 4 and 6 ms; rank 0 decodes 1 ms.
    assert cell.loc[(1, "fwd"), "compute_s"] == pytest.approx((0.015 + 0.005) / 2)
    assert cell.loc[(1, "fwd"), "allgather_s"] == pytest.approx((0.004 + 0.006) / 2)
    assert cell.loc[(1, "fwd"), "allgather_bytes"] == 1000
    assert cell.loc[(1, "fwd"), "decompress_s"] == pytest.approx(0.001 / 2)
    # bwd of layer 1: reduce-scatters of 10 and 20 ms, 2000 and 2003 bytes (mean 2001.5 rounds to 2002).
    assert cell.loc[(1, "bwd"), "reduce_scatter_s"] == pytest.approx(0.015)
    assert cell.loc[(1, "bwd"), "reduce_scatter_bytes"] == 2002
    assert cell.loc[(1, "bwd"), "compress_s"] == pytest.approx(0.001)
    # The whole-model step (100 ms on rank 0, 40 ms on rank 1: mean 70 ms) split 1:3:6 by numel,
    # plus layer 1's own optimizer event (10 ms on rank 0: mean 5 ms).
    assert cell.loc[(0, "optim"), "compute_s"] == pytest.approx(0.1 * 0.07)
    assert cell.loc[(1, "optim"), "compute_s"] == pytest.approx(0.3 * 0.07 + 0.005)
    assert cell.loc[(2, "optim"), "compute_s"] == pytest.approx(0.6 * 0.07)
    # Everything else is zero: the loss all-reduce and the compute event with layer -1 belong to no layer.
    assert layers["compute_s"].sum() == pytest.approx(0.010 + 0.07 + 0.005)
    assert (layers["hash_s"] == 0).all()
    assert layers["allgather_bytes"].sum() == 1000 and layers["reduce_scatter_bytes"].sum() == 2002
    # The iteration ends with the last event on any rank.
    assert iterations.to_dict("records") == [
        {"run_id": "r0", "iteration": 0, "iteration_s": pytest.approx(0.41)}
    ]


def test_stream_summaries_by_hand():
    """Per (run, stream): sums over the two ranks and the one iteration, divided by both."""
    bundle = dataclasses.replace(make_tiny_bundle(layers=1, world_size=2), events=_hand_events())
    table = traces.stream_summaries(bundle).set_index("stream")
    assert set(table["run_id"]) == {"r0"}
    assert table.loc["compute", "seconds"] == pytest.approx((0.010 + 0.005 + 0.010 + 0.005) / 2)
    assert table.loc["compute", "events"] == pytest.approx(4 / 2)
    assert table.loc["allgather", "seconds"] == pytest.approx((0.004 + 0.006) / 2)
    assert table.loc["allgather", "mean_event_s"] == pytest.approx(0.005)
    assert (
        table.loc["allgather", "raw_bytes"] == pytest.approx(1000)
        and table.loc["allgather", "wire_bytes"] == 600
    )
    assert table.loc["reduce_scatter", "raw_bytes"] == pytest.approx((2000 + 2003) / 2)
    assert table.loc["codec_send", "seconds"] == pytest.approx(0.002 / 2)
    assert traces.stream_summaries(dataclasses.replace(bundle, events=bundle.events.iloc[:0])).empty


def test_run_summaries_gather_path_per_gather_by_hand():
    """The main thread inside the engine's gather calls (gather_host and the codec) per all-gather that
    moved parameters, over ranks and iterations alike; an overflow round (raw 0) is not a gather of its own;
    NaN where the run records no gather path (a capture before the stream existed)."""
    table = [
        # rank, iteration, stream, start_s, end_s, raw_bytes
        (0, 0, "gather_host", 0.000, 0.003, 0),
        (0, 0, "codec_send", 0.003, 0.004, 0),
        (0, 0, "allgather", 0.004, 0.010, 1000),
        (0, 0, "allgather", 0.010, 0.012, 0),  # an overflow round
        (0, 0, "codec_recv", 0.012, 0.014, 0),
        (0, 0, "compute", 0.014, 0.050, 0),
        (1, 0, "gather_host", 0.000, 0.001, 0),
        (1, 0, "allgather", 0.001, 0.010, 1000),
        (1, 0, "allgather", 0.010, 0.020, 1000),
        (1, 0, "compute", 0.020, 0.060, 0),
    ]
    events = _typed(
        "events",
        [
            _event(
                rank=rank, iteration=it, stream=stream, start=start, end=end, raw_bytes=raw, wire_bytes=raw
            )
            for rank, it, stream, start, end, raw in table
        ],
    )
    bundle = dataclasses.replace(make_tiny_bundle(layers=1, world_size=2), events=events)
    summary = traces.run_summaries(bundle).set_index("run_id")
    # 3 + 1 + 2 ms on rank 0, 1 ms on rank 1, over 3 parameter gathers.
    assert summary.loc["r0", "gather_path_s_per_gather"] == pytest.approx(0.007 / 3)
    unrecorded = dataclasses.replace(bundle, events=events[events["stream"] != "gather_host"])
    assert np.isnan(traces.run_summaries(unrecorded).loc[0, "gather_path_s_per_gather"])


def test_derive_layer_tables_with_checkpointing_and_measured_iteration_time():
    measured = pd.DataFrame({"run_id": ["r0"], "iteration": [0], "iteration_s": [0.5]})
    layers, iterations = traces.derive_layer_tables(
        _hand_runs(True), _hand_events(), HAND_NUMEL, iteration_s=measured
    )
    assert list(layers["phase"][:4]) == ["fwd", "recompute", "bwd", "optim"]
    assert len(layers) == 12
    assert (layers.loc[layers["phase"] == "recompute", "compute_s"] == 0).all()
    assert iterations["iteration_s"].tolist() == [0.5]
    with pytest.raises(traces.TraceError, match="run 'r0' iteration 0 has events but no iteration_s"):
        traces.derive_layer_tables(
            _hand_runs(True), _hand_events(), HAND_NUMEL, iteration_s=measured.iloc[:0]
        )


def test_derive_layer_tables_needs_every_layers_numel():
    with pytest.raises(traces.TraceError, match="run 'r0' has no numel for layer 2"):
        traces.derive_layer_tables(_hand_runs(False), _hand_events(), HAND_NUMEL.iloc[:2])


def test_derive_layer_tables_of_no_events_is_empty():
    layers, iterations = traces.derive_layer_tables(
        _hand_runs(False), traces.empty_table("events"), HAND_NUMEL
    )
    assert layers.empty and iterations.empty
    assert list(layers.columns) == list(traces.empty_table("layers").columns)


# --- version 1 -----------------------------------------------------------------------------------------


def write_v1_bundle(bundle: traces.TraceBundle, root: Path) -> Path:
    """`bundle` as a version-1 writer wrote it: five tables, the version-1 columns, version "1"."""
    root.mkdir(parents=True)
    for name, schema in V1_TABLE_SCHEMAS.items():
        table = pa.Table.from_pandas(bundle.table(name)[schema.names], schema=schema, preserve_index=False)
        pq.write_table(
            table.replace_schema_metadata(with_metadata(name, version=1).metadata), root / f"{name}.parquet"
        )
    return root


def test_v1_bundle_reads_upgraded_with_a_note(tiny_bundle, tmp_path):
    analytic_run = tiny_bundle.runs.assign(run_id="a0", source="analytic", world_size=3)
    runs = pd.concat([tiny_bundle.runs, analytic_run], ignore_index=True)
    root = write_v1_bundle(dataclasses.replace(tiny_bundle, runs=runs), tmp_path / "v1")
    assert sorted(p.name for p in root.iterdir()) == sorted(f"{n}.parquet" for n in V1_TABLE_SCHEMAS)
    loaded = traces.read_bundle(root)
    assert loaded.notes == (V1_UPGRADE_NOTE,)
    assert "schema v1 bundle read as v2" in loaded.notes[0]
    runs = loaded.runs.set_index("run_id")
    assert list(loaded.runs.columns) == list(traces.empty_table("runs").columns)
    assert runs["engine"].tolist() == ["zero3", "zero3"]
    assert runs["backend"].tolist() == ["gloo", "analytic"]
    assert runs["nodes"].tolist() == [2, 2]  # ceil(4 / 2), ceil(3 / 2)
    for column in (
        "prefetch_bucket_size",
        "max_reuse_distance",
        "max_live_parameters",
        "link_rate_Bps",
        "link_latency_s",
        "measured_link_Bps",
        "warmup_iterations",
        "clock_spread_s",
    ):
        assert (runs[column] == 0).all(), column
    assert runs["reduce_bucket_size"].isna().all()  # not recorded
    assert not runs["reshard_after_forward"].any()
    collectives = loaded.collectives
    assert collectives["repetitions"].tolist() == [1]
    assert (
        collectives["time_min_s"].tolist()
        == collectives["time_s"].tolist()
        == collectives["time_max_s"].tolist()
    )
    assert loaded.events.empty and loaded.shard_changes.empty
    for name in ("layers", "iterations", "exponents"):
        pd.testing.assert_frame_equal(loaded.table(name), tiny_bundle.table(name), check_dtype=False)
    # Writing always writes version 2, and the note describes the reading, not the bundle.
    again = traces.read_bundle(traces.write_bundle(loaded, tmp_path / "v2"))
    assert again.notes == ()
    pd.testing.assert_frame_equal(again.runs, loaded.runs, check_dtype=False)


def test_v1_bundle_values_are_still_checked(tiny_bundle, tmp_path):
    root = write_v1_bundle(
        dataclasses.replace(tiny_bundle, runs=tiny_bundle.runs.assign(gpus_per_node=0)), tmp_path / "v1"
    )
    with pytest.raises(
        traces.TraceError, match="runs.parquet: table 'runs', column 'gpus_per_node': value 0"
    ):
        traces.read_bundle(root)


def test_v1_bundle_with_a_v2_only_table_is_refused(tiny_bundle, tmp_path):
    root = write_v1_bundle(tiny_bundle, tmp_path / "v1")
    (root / "events.parquet").write_bytes(b"")
    with pytest.raises(
        traces.TraceError, match="table 'events' in a schema version 1 bundle, which has no such table"
    ):
        traces.read_bundle(root)


def test_tables_of_mixed_versions_are_refused(tiny_bundle, tmp_path):
    root = traces.write_bundle(tiny_bundle, tmp_path / "b")
    v1 = V1_TABLE_SCHEMAS["layers"]
    table = pa.Table.from_pandas(tiny_bundle.layers, schema=v1, preserve_index=False)
    pq.write_table(
        table.replace_schema_metadata(with_metadata("layers", version=1).metadata), root / "layers.parquet"
    )
    with pytest.raises(
        traces.TraceError, match="table 'layers' has schema version '1', the bundle's runs.parquet has '2'"
    ):
        traces.read_bundle(root)


def test_other_versions_name_the_versions_read(tiny_bundle, tmp_path):
    root = traces.write_bundle(tiny_bundle, tmp_path / "b")
    metadata = {SCHEMA_VERSION_KEY: b"3", b"ciera.table": b"runs"}
    table = pq.read_table(root / "runs.parquet").replace_schema_metadata(metadata)
    pq.write_table(table, root / "runs.parquet")
    with pytest.raises(traces.TraceError) as error:
        traces.read_bundle(root)
    assert str(error.value) == (
        f"{root / 'runs.parquet'}: table 'runs' has schema version '3', this reader reads version 1 or 2"
    )


def test_cli_validate_prints_the_upgrade_note(tiny_bundle, tmp_path):
    root = write_v1_bundle(tiny_bundle, tmp_path / "v1")
    result = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "traces", "validate", str(root)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert f"note: {V1_UPGRADE_NOTE}" in result.stdout


# --- property: events laid out without overlap validate; one moved into its predecessor is caught ------

STREAM_NAMES = ("compute", "allgather", "reduce_scatter", "all_reduce", "codec_send", "codec_recv", "optim")
intervals = st.lists(
    st.tuples(
        st.floats(0.0, 2e-3),  # gap after the previous event on the stream
        st.floats(1e-5, 2e-3),  # duration
        st.integers(-1, LAYERS + 1),
        st.sampled_from(("fwd", "recompute", "bwd", "optim")),
        st.integers(0, 1 << 20),
    ),
    min_size=0,
    max_size=6,
)


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.dictionaries(
        st.tuples(st.integers(0, WORLD - 1), st.sampled_from(STREAM_NAMES)), intervals, min_size=1
    ),
    pick=st.integers(0, 1000),
)
def test_property_non_overlapping_events_validate_and_an_overlap_is_caught(layout, pick):
    rows = []
    for (rank, stream), steps in sorted(layout.items()):
        t = 0.0
        for gap, duration, layer, phase, size in steps:
            collective = stream in ("allgather", "reduce_scatter", "all_reduce")
            t += gap
            rows.append(
                _event(
                    rank=rank,
                    layer=layer,
                    phase=phase,
                    stream=stream,
                    issued=t * 0.5,
                    start=t,
                    end=t + duration,
                    raw_bytes=size if collective else 0,
                    wire_bytes=size // 2 if collective else 0,
                )
            )
            t += duration
    if not rows:
        rows.append(_event(layer=0, start=0.0, end=1e-3))
    events = _typed("events", rows)
    bundle = bundle_with_events(events)
    traces.validate_bundle(bundle)

    keys = ["rank", "stream"]
    ordered = events.sort_values([*keys, "start_s"], kind="stable")
    followers = ordered.index[(ordered[keys] == ordered[keys].shift()).all(axis=1).to_numpy()]
    if not len(followers):
        return
    moved = followers[pick % len(followers)]
    previous = ordered.index[ordered.index.get_loc(moved) - 1]
    start = float(
        events.loc[previous, "start_s"]
        + 0.5 * (events.loc[previous, "end_s"] - events.loc[previous, "start_s"])
    )
    duration = float(events.loc[moved, "end_s"] - events.loc[moved, "start_s"])
    shifted = _first(
        events, pd.Series(events.index == moved), issued_s=start, start_s=start, end_s=start + duration
    )
    with pytest.raises(
        traces.TraceError, match="column 'start_s': value .* overlaps the previous event on its stream"
    ):
        traces.validate_bundle(dataclasses.replace(bundle, events=shifted))


def test_layers_of_events_bundle_sum_every_rank_and_stream(events_bundle):
    """A cross-check of the derivation on the scheduled events: totals over layers equal totals of events."""
    events, layers = events_bundle.events, events_bundle.layers
    gathers = events[events["stream"] == "allgather"]
    assert layers["allgather_bytes"].sum() == gathers["raw_bytes"].sum() / WORLD
    durations = (gathers["end_s"] - gathers["start_s"]).sum() / WORLD
    assert layers["allgather_s"].sum() == pytest.approx(durations)
    step = events[events["stream"] == "optim"]
    compute = events[events["stream"] == "compute"]
    total_compute = (
        (step["end_s"] - step["start_s"]).sum() + (compute["end_s"] - compute["start_s"]).sum()
    ) / WORLD
    assert layers["compute_s"].sum() == pytest.approx(total_compute)
    assert np.isclose(
        layers.loc[layers["phase"] == "optim", "compute_s"].sum(),
        (step["end_s"] - step["start_s"]).sum() / WORLD,
    )
