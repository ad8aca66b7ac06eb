"""Small analytic bundles for the simulator tests: one model, L ∈ {2, 4}, W ∈ {4, 8}, both dtypes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import traces
from sim.analytic import generate_bundle, load_settings


def small_bundle(**changes: object) -> traces.TraceBundle:
    settings = dataclasses.replace(
        load_settings(),
        models=["olmoe-1b-7b"],
        traced_layers=[2, 4],
        world_sizes=[4, 8],
        iterations=3,
        block_sizes=[256, 512],
        **changes,
    )
    return generate_bundle(settings)


@pytest.fixture(scope="session")
def bundle() -> traces.TraceBundle:
    return small_bundle()


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory, bundle: traces.TraceBundle) -> Path:
    return traces.write_bundle(bundle, tmp_path_factory.mktemp("sim") / "bundle")
