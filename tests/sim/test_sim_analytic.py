"""The analytic generator: the shipped default bundle is exactly what it produces, and it is honest
about being analytic."""

from __future__ import annotations

import pandas as pd

import traces
from sim.analytic import generate_bundle, load_settings
from sim.model_config import layer_parameters, list_models, load_model_config


def test_shipped_default_bundle_is_reproduced_by_the_generator():
    shipped = traces.read_bundle(traces.default_bundle_path())
    regenerated = generate_bundle(load_settings())
    for name in traces.TABLE_NAMES:
        pd.testing.assert_frame_equal(
            shipped.table(name).reset_index(drop=True),
            regenerated.table(name).reset_index(drop=True),
            check_dtype=False,
        )


def test_every_shipped_run_is_marked_analytic_and_covers_the_grid():
    runs = traces.read_bundle(traces.default_bundle_path()).runs
    assert set(runs["source"]) == {"analytic"}
    assert runs["model"].nunique() == 6
    assert set(runs["layers"]) == {2, 4, 6, 8}
    assert set(runs["world_size"]) == {4, 8}
    assert set(runs["dtype"]) == {"bf16", "fp16"}
    assert (runs["seq_len"] == 1024).all()


def test_parameter_counts_match_published_totals():
    published_total_b = {
        "OLMoE-1B-7B": 6.9,
        "DeepSeek-MoE-16B": 16.4,
        "Mixtral-8x7B": 46.7,
        "Qwen2-57B-A14B": 57.4,
        "Llama-4-Scout-17B-16E": 108.0,
    }
    for key in list_models():
        model = load_model_config(key)
        total = sum(
            p.numel
            for layer in range(model.num_layers + 2)
            for p in layer_parameters(model, layer, model.num_layers)
        )
        if model.name in published_total_b:
            assert abs(total / 1e9 - published_total_b[model.name]) / published_total_b[model.name] < 0.02, (
                model.name
            )
