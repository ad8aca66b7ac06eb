"""The gather plan: identical rows give an identical plan, and every disagreement or out-of-bounds value
is the same one-line error on every rank (pure numpy, no process group)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ciera_runtime import ConfigMismatchError, GatherError
from ciera_runtime.protocol import (
    MODE_COMPRESSED,
    MODE_RAW,
    ControlRow,
    control_row_bytes,
    make_plan,
    pack_status,
    status_failures,
)

W = 3
NUMEL = 1000


def _row(rank: int, **changes) -> ControlRow:
    row = ControlRow(
        shard_id=4,
        mode=MODE_COMPRESSED,
        dtype=1,
        numel=NUMEL,
        block_size=512,
        detector=1,
        entropy=1,
        cache_budget_bytes=-1,
        world_size=W,
        epoch=100 + rank,
        generation=5,
        exp_bytes=40 + rank,
        fixed_bytes=1200,
        cache_epochs=tuple(100 + s if s != rank else 0 for s in range(W)),
        cache_generations=tuple(4 if s != rank else 0 for s in range(W)),
    )
    return dataclasses.replace(row, **changes)


def _round_trip(rows: list[ControlRow]) -> list[ControlRow | None]:
    return [ControlRow.unpack(row.pack(W), W) for row in rows]


def test_rows_round_trip_and_have_a_size_set_by_the_world_size_only() -> None:
    rows = [_row(r, reason="é" * 200) for r in range(W)]
    packed = [row.pack(W) for row in rows]
    assert {p.size for p in packed} == {control_row_bytes(W)}
    unpacked = _round_trip(rows)
    assert unpacked[1].epoch == 101 and unpacked[1].cache_generations == (4, 0, 4)
    assert len(unpacked[0].reason.encode()) <= 160  # cut on a character boundary


def test_in_step_ranks_send_deltas_and_the_row_fits_the_largest() -> None:
    plan = make_plan(_round_trip([_row(r) for r in range(W)]), W)
    assert plan.resync == (False,) * W and plan.variable_bytes == (40, 41, 42)
    assert plan.row_bytes == 1200 + 42 and plan.expected[2] == (102, 5)


def test_a_receiver_out_of_step_makes_that_source_resync_with_full_raw_exponents() -> None:
    rows = [_row(r) for r in range(W)]
    rows[2] = dataclasses.replace(rows[2], cache_generations=(3, 4, 0))  # behind on source 0
    plan = make_plan(_round_trip(rows), W)
    assert plan.resync == (True, False, False)
    assert plan.row_bytes == 1200 + NUMEL


def test_a_corrupted_control_row_is_the_same_error_for_everyone() -> None:
    packed = [_row(r).pack(W).copy() for r in range(W)]
    packed[1][37] ^= 4
    rows = [ControlRow.unpack(p, W) for p in packed]
    with pytest.raises(GatherError, match="rank 1: control row unreadable"):
        make_plan(rows, W)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("block_size", 256, "codec block_size"),
        ("entropy", 2, "codec entropy stage"),
        ("cache_budget_bytes", 1 << 20, "cache budget"),
        ("mode", MODE_RAW, "mode"),
        ("numel", NUMEL + 1, "numel"),
        ("shard_id", 5, "shard id"),
    ],
)
def test_a_rank_that_disagrees_is_named(field: str, value: int, words: str) -> None:
    rows = [_row(r) for r in range(W)]
    rows[2] = dataclasses.replace(rows[2], **{field: value})
    with pytest.raises(ConfigMismatchError, match=words) as error:
        make_plan(_round_trip(rows), W)
    assert f"rank 2: {field}=" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("exp_bytes", [-1, NUMEL + 1, 1 << 40])
def test_exponent_sizes_beyond_the_raw_cost_never_size_a_round(exp_bytes: int) -> None:
    rows = [_row(r) for r in range(W)]
    rows[0] = dataclasses.replace(rows[0], exp_bytes=exp_bytes)
    with pytest.raises(GatherError, match="out of bounds"):
        make_plan(_round_trip(rows), W)


def test_a_local_failure_travels_to_every_rank_with_its_reason() -> None:
    rows = [_row(r) for r in range(W)]
    rows[1] = ControlRow(shard_id=4, world_size=W, failed=1, reason="output has dtype torch.float32")
    with pytest.raises(GatherError, match="rank 1: output has dtype torch.float32"):
        make_plan(_round_trip(rows), W)


def test_status_rows_name_the_failed_ranks() -> None:
    rows = np.stack([pack_status(False, ""), pack_status(True, "bad CRC"), pack_status(False, "")])
    assert status_failures(rows) == {1: "bad CRC"}
    rows[2, 3] ^= 1
    assert status_failures(rows) == {1: "bad CRC", 2: "status row unreadable (corrupted)"}
