"""Prefetch depth 0: gathers issued on demand (no cycle), never faster than prefetching one step."""

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
