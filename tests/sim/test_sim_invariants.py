"""Invariants of the simulated sweep (DESIGN.md bounds) on a small analytic bundle."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from sim import SYSTEMS, SimRecord, load_cluster, simulate
from sim.simulate import Simulator

GPUS = (4, 8, 16, 64)


@pytest.fixture(scope="module")
def records(bundle: traces.TraceBundle) -> list[SimRecord]:
    return simulate(bundle, load_cluster("a100-hdr-testbed"), gpus=GPUS)


def test_every_combination_is_covered(records: list[SimRecord]) -> None:
    keys = {(r.dtype, r.gpus, r.system) for r in records}
    for dtype in ("bf16", "fp16"):
        for gpus in GPUS:
            for system in SYSTEMS:
                assert ((dtype, gpus, system) in keys) == (not (dtype == "bf16" and system == "zeropp"))
    for record in records:
        assert (record.speedup_vs_zeropp is None) == (record.dtype == "bf16")
        assert record.source == "analytic" and record.projected  # OLMoE has 16 blocks, traced at 2 and 4


def test_no_system_beats_its_compute_only_time(bundle: traces.TraceBundle) -> None:
    simulator = Simulator(bundle, load_cluster("a100-hdr-testbed"))
    for system in SYSTEMS:
        for gpus in (8, 64):
            outcome = simulator.run(system, "OLMoE-1B-7B", "fp16", gpus)
            graph, costs = outcome.system.graph, outcome.costs
            compute_only = float(costs.work_s[graph.stream == "compute"].sum())
            assert outcome.result.iteration_s >= compute_only * (1 - 1e-12)
            assert (outcome.times_s > 0).all()


def test_breakdown_sums_to_the_iteration(records: list[SimRecord]) -> None:
    for record in records:
        assert sum(record.breakdown_s.values()) == pytest.approx(record.iteration_nominal_s, rel=1e-9)
        assert record.iteration_s["p5"] <= record.iteration_s["p50"] <= record.iteration_s["p95"]
        assert record.breakdown_s["compute"] > 0


def test_speedups_respect_the_bound_or_are_attributed(records: list[SimRecord]) -> None:
    for record in records:
        parts = record.speedup_parts
        assert parts["bytes"] * parts["overlap"] * parts["other"] == pytest.approx(record.speedup_vs_zero3)
        assert parts["bytes"] <= record.bound_speedup / record.overlap_only_speedup + 1e-9
        assert record.overlap_only_speedup <= record.bound_speedup + 1e-9 or record.payload_ratio > 1
        if record.system == "ciera" and record.speedup_vs_zero3 > record.bound_speedup:
            assert parts["other"] > 1
        if record.system.startswith("ciera"):
            # The compression's own share is at most 1/r (≈ 2 for BF16).
            assert record.bound_speedup / record.overlap_only_speedup <= 1 / record.payload_ratio + 1e-9


def test_ciera_beats_zero3_where_communication_dominates(records: list[SimRecord]) -> None:
    by_key = {(r.dtype, r.gpus, r.system): r for r in records}
    assert by_key[("bf16", 64, "ciera")].speedup_vs_zero3 > 1.0
    assert by_key[("bf16", 64, "ciera")].shards_selected > 0


def test_every_block_changing_makes_exponent_reuse_no_faster(bundle: traces.TraceBundle) -> None:
    churning = dataclasses.replace(
        bundle, exponents=bundle.exponents.assign(block_change_rate=1.0, exp_change_rate=1.0)
    )
    # Every gather sees all blocks changed and the exponents do not compress (H = 8 bits).
    preset = load_cluster(
        "a100-hdr-testbed", {"ciera.exponent_entropy_bits": "8", "ciera.reuse_across_gathers": "false"}
    )
    for record_pair in _pairs(simulate(churning, preset, gpus=(8, 16, 64), systems=("zero3", "ciera-er"))):
        zero3, reuse = record_pair
        assert reuse.iteration_s["p50"] >= zero3.iteration_s["p50"]
        assert reuse.payload_ratio >= 1.0


def _pairs(records: list[SimRecord]) -> list[tuple[SimRecord, SimRecord]]:
    by_key = {(r.dtype, r.gpus, r.system): r for r in records}
    return [(by_key[(d, g, "zero3")], by_key[(d, g, "ciera-er")]) for d, g, s in by_key if s == "zero3"]


@settings(max_examples=8, deadline=None)
@given(
    st.floats(min_value=1.0, max_value=8.0),
    st.floats(min_value=1.0, max_value=8.0),
    st.sampled_from(SYSTEMS),
    st.sampled_from((8, 16, 64)),
)
def test_more_bandwidth_never_makes_an_iteration_slower(
    bundle: traces.TraceBundle, intra_factor: float, inter_factor: float, system: str, gpus: int
) -> None:
    base = {"inter_node.beta_Bps": "4e9", "intra_node.beta_Bps": "240e9"}
    faster = {
        "inter_node.beta_Bps": str(4e9 * inter_factor),
        "intra_node.beta_Bps": str(240e9 * intra_factor),
    }
    slow = Simulator(bundle, load_cluster("a100-hdr-testbed", base)).run(system, "OLMoE-1B-7B", "fp16", gpus)
    fast = Simulator(bundle, load_cluster("a100-hdr-testbed", faster)).run(
        system, "OLMoE-1B-7B", "fp16", gpus
    )
    assert fast.result.iteration_s <= slow.result.iteration_s * (1 + 1e-9)
