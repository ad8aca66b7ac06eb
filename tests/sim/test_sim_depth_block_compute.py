"""The depth rewrite's per-block compute (sim/depth.py, `sim.predict.fit_block_compute`): each block added
or dropped changes the iteration's compute by one block's compute pooled over every traced block of the
system and cluster, not by whatever the anchor run's own blocks happened to cost."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from sim.depth import repeat_blocks
from sim.errors import SimInputError
from sim.opgraph import OpGraph, build_graph
from sim.predict import fit_block_compute


def _iteration(layers: int, block_s: float, run_id: str = "r") -> pd.DataFrame:
    """Two identical ranks, forward only: an embedding op (0.1 s), `layers` blocks of `block_s` compute
    each with a reduce-scatter after it, a head op (0.1 s)."""
    rows = [("compute", 0, 0.0, 0.1, 0)]
    t = 0.1
    for block in range(1, layers + 1):
        rows.append(("compute", block, t, t + block_s, 0))
        t += block_s
        rows.append(("reduce_scatter", block, t, t + 0.05, 2000))
        t += 0.05
    rows.append(("compute", layers + 1, t, t + 0.1, 0))
    frame = pd.DataFrame(rows, columns=["stream", "layer", "start_s", "end_s", "raw_bytes"])
    one = frame.assign(
        run_id=run_id, iteration=0, phase="fwd", issued_s=frame["start_s"], wire_bytes=frame["raw_bytes"]
    )
    return pd.concat([one.assign(rank=0), one.assign(rank=1)], ignore_index=True)


def _compute_per_rank_s(graph: OpGraph, layers: slice | None = None) -> float:
    chosen = graph.stream == "compute"
    if layers is not None:
        chosen &= (graph.layer >= layers.start) & (graph.layer <= layers.stop)
    return float(graph.duration_s[chosen].sum()) / len(np.unique(graph.rank))


@pytest.mark.parametrize("target_layers", [2, 5, 9])
def test_each_block_added_or_dropped_changes_compute_by_the_pooled_block(target_layers: int) -> None:
    traced = build_graph(_iteration(3, 1.0))
    rewritten = repeat_blocks(traced, 3, target_layers, 1.0, block_compute_s=0.8)
    traced_s = 0.1 + 3 * 1.0 + 0.1
    assert _compute_per_rank_s(rewritten) == pytest.approx(traced_s + (target_layers - 3) * 0.8, rel=1e-12)
    # The embedding and the head are kept once, at their traced compute.
    assert _compute_per_rank_s(rewritten, slice(0, 0)) == pytest.approx(0.1)
    assert _compute_per_rank_s(rewritten, slice(target_layers + 1, target_layers + 1)) == pytest.approx(0.1)
    # Only compute is rescaled: the collectives keep their traced durations, one per target block.
    gathers = rewritten.stream == "reduce_scatter"
    assert np.allclose(rewritten.duration_s[gathers], 0.05)
    assert gathers.sum() == 2 * target_layers


def test_without_a_pooled_block_the_copies_keep_their_traced_compute() -> None:
    traced = build_graph(_iteration(3, 1.0))
    rewritten = repeat_blocks(traced, 3, 5, 1.0)
    assert _compute_per_rank_s(rewritten) == pytest.approx(0.2 + 5 * 1.0)


def test_at_the_traced_depth_the_graph_is_unchanged_whatever_the_pool_says() -> None:
    traced = build_graph(_iteration(3, 1.0))
    assert repeat_blocks(traced, 3, 3, 1.0, block_compute_s=0.2) is traced


def test_a_pooled_block_that_leaves_the_blocks_no_compute_is_refused_in_one_line() -> None:
    traced = build_graph(_iteration(3, 1.0))
    with pytest.raises(SimInputError) as refused:
        repeat_blocks(traced, 3, 1, 1.0, block_compute_s=2.0)
    message = str(refused.value)
    assert "\n" not in message and "2000.0 ms of compute per block" in message


@pytest.mark.parametrize("block_compute_s", [float("nan"), float("inf"), -0.1])
def test_a_per_block_compute_that_is_not_a_time_is_refused(block_compute_s: float) -> None:
    traced = build_graph(_iteration(3, 1.0))
    with pytest.raises(SimInputError, match="expected a finite time >= 0"):
        repeat_blocks(traced, 3, 5, 1.0, block_compute_s=block_compute_s)


def test_the_pool_is_the_mean_over_every_block_of_every_traced_run() -> None:
    events = pd.concat([_iteration(3, 1.0, "deep"), _iteration(2, 2.0, "shallow")], ignore_index=True)
    runs = pd.DataFrame({"run_id": ["deep", "shallow"], "layers": [3, 2]})
    fit = fit_block_compute(SimpleNamespace(events=events), runs)
    # Five blocks (3 of 1 s, 2 of 2 s); the embedding and head (0.1 s) are not blocks.
    assert fit.block_compute_s == pytest.approx((3 * 1.0 + 2 * 2.0) / 5)
    assert fit.depths == (2, 3) and fit.blocks == 5
    assert "1400 ms of compute per block added (the mean of 5 traced blocks, L = 2, 3)" == fit.describe()


def test_runs_whose_events_name_no_block_pool_nothing_and_say_so() -> None:
    events = _iteration(2, 1.0, "flat").assign(layer=0)
    fit = fit_block_compute(SimpleNamespace(events=events), pd.DataFrame({"run_id": ["flat"], "layers": [2]}))
    assert fit.block_compute_s is None and fit.blocks == 0
    assert "no traced block compute to pool" in fit.describe()
