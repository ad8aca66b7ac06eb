"""The trace's schedule is kept (generator-only fields refused); --layers simulates a given depth."""

from __future__ import annotations

import pytest


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_generator_only_fields_are_refused_not_ignored() -> None:
    """--set of a field a simulation of a traced bundle cannot change (the trace's compute and prefetch)
    is one line naming the field and what to do, from `ciera simulate`, `--sweep` and `ciera report`."""
    import subprocess
    import sys

    for args in (
        ["simulate", "--set", "schedule.zero3_prefetch_layers=0"],
        ["simulate", "--sweep", "compute.efficiency=0.3,0.5", "--models", "olmoe"],
        ["report", "--set", "compute.peak_flops=1e15", "--html", "/nonexistent/dir/r.html"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "ciera_cli.main", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "analytic-bundle" in lines[0], (args, done.stderr)


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
