"""The depth rewrite (sim/depth.py) repeats a block's subgraph with its edges: a repeated collective is
issued by the op that corresponds, in the target's program order, to the one that issued it in the traced
iteration, with the traced lag after it — not by whatever op a copied time lead happens to land on."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import traces
from sim.depth import repeat_blocks
from sim.evaluate import Costs, evaluate
from sim.opgraph import build_graph
from sim.predict import parameter_ratio

GATHER_S = 0.05


def _iteration(waits: list[float], compute_s: float = 1.0) -> pd.DataFrame:
    """Two identical ranks, forward only. Block b computes (`compute_s`), half-way through issues the
    gather of block b + 1, then issues its own reduce-scatter and waits `waits[b - 1]` for it (a
    collective whose time depends on the link), then a short op. The embedding issues block 1's gather,
    the head ends the iteration."""
    layers = len(waits)
    rows = [("compute", 0, 0.0, 0.0, 0.1, 0), ("allgather", 1, 0.05, 0.05, 0.05 + GATHER_S, 1000)]
    t = 0.1
    for block, wait in enumerate(waits, start=1):
        rows.append(("compute", block, t, t, t + compute_s, 0))
        if block < layers:
            issue = t + compute_s / 2
            rows.append(("allgather", block + 1, issue, issue, issue + GATHER_S, 1000))
        t += compute_s
        rows.append(("reduce_scatter", block, t, t, t + wait, 2000))
        t += wait
        rows.append(("compute", block, t, t, t + 0.01, 0))
        t += 0.01
    rows.append(("compute", layers + 1, t, t, t + 0.1, 0))
    frame = pd.DataFrame(rows, columns=["stream", "layer", "issued_s", "start_s", "end_s", "raw_bytes"])
    one = frame.assign(run_id="r", iteration=0, phase="fwd", wire_bytes=frame["raw_bytes"])
    return pd.concat([one.assign(rank=0), one.assign(rank=1)], ignore_index=True)


def test_a_repeated_prefetch_is_issued_by_the_corresponding_op_with_its_traced_lag() -> None:
    # Block 2 waits long for its reduce-scatter (a slow link), block 1 briefly. Block 3 of the target
    # copies block 2 and follows a copy of block 2: block 2's gather was issued 0.61 s before it,
    # half-way through block 1; 0.61 s before target block 3 lies inside the copied block 2's long wait.
    traced = build_graph(_iteration([0.1, 0.9, 0.1]))
    assert traced.lag_s.max() == pytest.approx(0.0, abs=1e-9)
    deeper = repeat_blocks(traced, 3, 4, 1.0)
    # No lag where the traced graph had none (a lag is a fixed time: it does not shrink with the wait).
    assert deeper.lag_s.max() == pytest.approx(0.0, abs=1e-9)
    for rank in (0, 1):
        gathers = np.flatnonzero((deeper.stream == "allgather") & (deeper.rank == rank))
        for gather in gathers[
            1:
        ]:  # the gathers of blocks 2..4, each issued half-way through the block before
            issuer = deeper.main_prev[gather]
            assert deeper.stream[issuer] == "compute"
            assert deeper.layer[issuer] == deeper.layer[gather] - 1
            # The first half of the previous block's compute (the segment is cut at the issue point).
            assert deeper.duration_s[issuer] == pytest.approx(0.5)
            assert (
                deeper.main_prev[issuer] < 0 or deeper.layer[deeper.main_prev[issuer]] != deeper.layer[issuer]
            )
    result = evaluate(deeper)
    # At the traced durations the copies keep their blocks' traced times: 0.1 + 1 + 0.1 + 0.01 for
    # block 1, (1 + 0.9 + 0.01) for the two copies of block 2, 1 + 0.1 + 0.01 for block 3, the head 0.1.
    assert result.iteration_s == pytest.approx(0.1 + 1.11 + 2 * 1.91 + 1.11 + 0.1, rel=1e-9)


def test_the_repeated_prefetch_moves_with_the_work_when_the_wait_shrinks() -> None:
    # The same iteration with every reduce-scatter 10× faster (what a faster link does), rewritten: the
    # gather of each copied block is still issued half-way through the block before it.
    traced = build_graph(_iteration([0.1, 0.9, 0.1]))
    deeper = repeat_blocks(traced, 3, 5, 1.0)
    durations = np.where(deeper.stream == "reduce_scatter", deeper.duration_s / 10, deeper.duration_s)
    base = Costs.measured(deeper)
    faster = Costs(
        **{
            **base.__dict__,
            "own_s": np.where(deeper.is_main, 0.0, durations),
            "residual_s": np.zeros(deeper.size),
        }
    )
    result = evaluate(deeper, faster)
    rank0 = deeper.rank == 0
    for gather in np.flatnonzero((deeper.stream == "allgather") & rank0)[1:]:
        block = deeper.layer[gather] - 1
        compute = np.flatnonzero(rank0 & (deeper.stream == "compute") & (deeper.layer == block))
        assert result.start_s[gather] == pytest.approx(result.start_s[compute[0]] + 0.5, abs=1e-9)


def test_every_block_of_an_analytic_run_keeps_its_issue_points(bundle: traces.TraceBundle) -> None:
    """The generator issues each gather a fixed number of steps ahead, with no lag: rewritten to the full
    model, no op of any run gets a lag (copying time leads gave the recompute gathers lags wherever a
    copied neighbour's duration differed from the traced one's)."""
    for _, run in bundle.runs.iterrows():
        events = bundle.events[(bundle.events["run_id"] == run["run_id"]) & (bundle.events["rank"] == 0)]
        traced_layers, full = int(run["layers"]), int(run["full_layers"])
        ratio = parameter_ratio(bundle, str(run["run_id"]), traced_layers, full)
        for _, rows in events.groupby("iteration"):
            traced = build_graph(rows)
            assert traced.lag_s.max() <= 1e-9
            deeper = repeat_blocks(traced, traced_layers, full, ratio)
            assert deeper.lag_s.max() <= 1e-9, run["run_id"]
            gathers = (deeper.stream == "allgather") & (deeper.layer >= 1) & (deeper.layer <= full)
            assert int(gathers.sum()) == 2 * full  # forward and recompute, one each per block


def test_fsdp2_backward_prefetch_is_issued_by_the_block_before_on_a_measured_run(
    shipped_measured_bundle: traces.TraceBundle,
) -> None:
    """FSDP2 at 200 Mbit issues block b − 1's backward gather early in block b's backward, and then waits
    for block b's reduce-scatter. Its time lead includes that wait; rewritten from L = 6 to 8 each copied
    gather is still issued by an op of the block before it, without the lead turned into a lag."""
    bundle = shipped_measured_bundle
    runs = bundle.runs
    run = runs[
        (runs["system"] == "fsdp") & (runs["layers"] == 6) & (runs["cluster"] == "emulated-2x1-200mbit")
    ]
    run_id = str(run.iloc[0]["run_id"])
    events = bundle.events[(bundle.events["run_id"] == run_id) & (bundle.events["iteration"] == 0)]
    traced = build_graph(events)
    deeper = repeat_blocks(traced, 6, 8, parameter_ratio(bundle, run_id, 6, 8))
    collective = ~deeper.is_main
    assert deeper.lag_s[collective].max() <= traced.lag_s[~traced.is_main].max() + 1e-9
    backward = np.flatnonzero((deeper.stream == "allgather") & (deeper.phase == "bwd") & (deeper.layer >= 1))
    assert len(backward) == 2 * 8
    for gather in backward:
        issuer = deeper.main_prev[gather]
        if deeper.layer[gather] < 8:
            assert (deeper.layer[issuer], deeper.phase[issuer]) == (deeper.layer[gather] + 1, "bwd")
    # Every main op waits for what its traced original waited for: one gather per block and phase, one
    # reduce-scatter per block.
    waits = deeper.blocker[deeper.blocker >= 0]
    assert int((deeper.stream[waits] == "reduce_scatter").sum()) == 2 * (8 + 1)
