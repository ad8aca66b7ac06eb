"""Schedules: prefetch depth 0 gathers on demand (no cycle, never faster than depth 1); --layers simulates a given depth."""

from __future__ import annotations


def test_prefetch_depth_zero_gathers_on_demand_and_is_never_faster() -> None:
    import traces
    from sim import simulate
    from sim.cluster import load_cluster, parse_overrides

    bundle = traces.read_bundle(traces.default_bundle_path())
    p50 = {}
    for depth in (0, 1):
        preset = load_cluster(
            "a100-hdr-testbed",
            parse_overrides(
                [f"schedule.zero3_prefetch_layers={depth}", f"schedule.fsdp_prefetch_layers={depth}"]
            ),
        )
        records = simulate(bundle, preset, models=["olmoe-1b-7b"], gpus=[16], dtypes=["fp16"])
        p50[depth] = {r.system: r.iteration_s["p50"] for r in records}
    for system, seconds in p50[0].items():
        assert seconds >= p50[1][system] - 1e-9, system


def test_layers_simulates_a_traced_depth_as_traced_and_refuses_more_than_the_model() -> None:
    import pytest

    import traces
    from sim import simulate
    from sim.cluster import load_cluster
    from sim.errors import SimInputError

    bundle = traces.read_bundle(traces.default_bundle_path())
    preset = load_cluster("a100-hdr-testbed", {})
    traced = simulate(bundle, preset, models=["olmoe-1b-7b"], gpus=[8], dtypes=["bf16"], layers=4)
    assert {r.full_layers for r in traced} == {4} and not any(r.projected for r in traced)
    deeper = simulate(bundle, preset, models=["olmoe-1b-7b"], gpus=[8], dtypes=["bf16"], layers=12)
    assert all(r.projected for r in deeper)
    zero3 = {r.full_layers: r.iteration_nominal_s for r in traced + deeper if r.system == "zero3"}
    assert zero3[12] > zero3[4]
    with pytest.raises(SimInputError, match="--layers 17: model 'OLMoE-1B-7B' has 1..16 blocks"):
        simulate(bundle, preset, models=["olmoe-1b-7b"], gpus=[8], dtypes=["bf16"], layers=17)
