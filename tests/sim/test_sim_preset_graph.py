"""Cluster presets on the op graph: an analytic run is a traced graph like a measured one, and the
world-size and depth rewrites onto the preset give back what the generator's own schedule gives at that
size (both cost collectives with the preset's α–β; noise off, so they must agree)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import traces
from sim.analytic import generate_bundle, load_settings
from sim.cluster import load_cluster
from sim.collectives import CollectiveModel
from sim.curves import PresetCurve
from sim.predict import predict_run
from sim.rewrite import preset_cluster, traced_cluster

PRESET = "a100-hdr-testbed"


@pytest.fixture(scope="module")
def noiseless_bundle() -> traces.TraceBundle:
    settings = dataclasses.replace(
        load_settings(),
        models=["olmoe-1b-7b"],
        traced_layers=[4, 8, 16],
        world_sizes=[8, 16, 64],
        dtypes=["bf16"],
        compute_time_cv=0.0,
        comm_time_cv=0.0,
        iterations=2,
    )
    return generate_bundle(settings)


def _seen(bundle: traces.TraceBundle, world_size: int, layers: int) -> traces.TraceBundle:
    runs = bundle.runs[(bundle.runs["world_size"] == world_size) & (bundle.runs["layers"] == layers)]
    return dataclasses.replace(
        bundle, runs=runs, events=bundle.events[bundle.events["run_id"].isin(runs["run_id"])]
    )


def test_preset_curves_are_the_preset_collective_model():
    preset = load_cluster(PRESET)
    model = CollectiveModel.from_preset(preset, None)
    for world_size in (4, 16, 128):
        spec = preset_cluster(preset, model, world_size)
        assert spec.world_size == world_size
        assert spec.nodes == -(-world_size // preset.gpus_per_node)
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            curve = spec.curves[op]
            assert isinstance(curve, PresetCurve)
            sizes = np.array([1e3, 1.1e5, 6.7e7])
            assert curve.time_s(sizes) == pytest.approx([model.time_s(op, s, world_size) for s in sizes])
            assert (curve.link_s(sizes) <= curve.time_s(sizes)).all()
    # Inside one node the link part is the NVLink ring's; across nodes the inter-node ring's.
    assert preset_cluster(preset, model, 8).link_Bps == 0.0
    assert preset_cluster(preset, model, 16).link_Bps == model.inter_beta_Bps


@pytest.mark.parametrize(
    ("world_size", "seen_layers", "layers"),
    [(16, 4, 4), (64, 4, 4), (8, 4, 8), (8, 8, 16), (64, 4, 8), (64, 8, 16)],
)
def test_world_size_and_depth_rewrites_reproduce_the_generator_on_its_preset(
    noiseless_bundle, world_size, seen_layers, layers
):
    """Seen: W = 8 (one node). Predicted: two and eight nodes, and twice the depth, inside one node and
    across eight (a prefetched gather repeated with the block it serves; the contention the anchor saw
    not kept as overhead beside the contention the evaluator simulates)."""
    bundle = noiseless_bundle
    preset = load_cluster(PRESET)
    model = CollectiveModel.from_preset(preset, None)
    target_id = f"analytic-olmoe-1b-7b-bf16-L{layers}-W{world_size}"
    target = bundle.runs.set_index("run_id").loc[target_id].copy()
    target["run_id"] = target_id
    generated_s = float(bundle.iterations.set_index("run_id").loc[target_id, "iteration_s"].median())
    prediction = predict_run(
        _seen(bundle, 8, seen_layers), target, preset_cluster(preset, model, world_size), bundle.collectives
    )
    assert prediction.anchor_run == f"analytic-olmoe-1b-7b-bf16-L{seen_layers}-W8"
    assert (f"W = {world_size}" in prediction.basis) == (world_size != 8)
    assert prediction.iteration_s == pytest.approx(generated_s, rel=0.01)


def test_an_analytic_run_is_traced_on_its_preset():
    bundle = traces.read_bundle(traces.default_bundle_path())
    run = bundle.runs.iloc[0]
    spec = traced_cluster(bundle.collectives, run)
    assert spec.name == run["cluster"] and spec.world_size == int(run["world_size"])
    assert not spec.measured and spec.host_cores == 0
