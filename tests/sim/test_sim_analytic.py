"""The analytic generator: the shipped default bundle is exactly what it produces, and it is honest
about being analytic."""

from __future__ import annotations

import pandas as pd
import pytest

import traces
from sim.analytic import generate_bundle, load_settings
from sim.model_config import layer_parameters, list_models, load_model_config


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
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


def _shipped_run(run_id: str) -> tuple[traces.TraceBundle, pd.DataFrame]:
    bundle = traces.read_bundle(traces.default_bundle_path())
    return bundle, bundle.events[bundle.events["run_id"] == run_id]


def test_analytic_runs_replay_exactly_through_the_op_graph():
    """The generator's schedule graph and the graph rebuilt from the events it wrote are one graph: the
    evaluator gives back every iteration (the same path a measured run replays on)."""
    from sim.replay import replay_run

    bundle = traces.read_bundle(traces.default_bundle_path())
    for run_id in ("analytic-mixtral-8x7b-bf16-L8-W8", "analytic-olmoe-1b-7b-fp16-L2-W4"):
        replayed = replay_run(bundle, run_id)
        assert len(replayed) == 4
        assert replayed["error"].abs().max() < 1e-9, run_id


def test_analytic_events_follow_the_zero3_schedule():
    """Gathers are issued one step ahead (prefetch 1) and a step never starts before its gather ends; a
    reduce-scatter follows its backward; the optimizer starts after the last reduce-scatter; every rank
    has the same events; the iteration is at least the main thread's work and at least the link's."""
    bundle, events = _shipped_run("analytic-mixtral-8x7b-bf16-L4-W8")
    assert events["rank"].nunique() == 8
    one = events[(events["rank"] == 0) & (events["iteration"] == 1)].sort_values("start_s")
    main = one[one["stream"].isin(["compute", "optim"])].reset_index(drop=True)
    gathers = one[one["stream"] == "allgather"]
    for _, gather in gathers.iterrows():
        step = main[(main["layer"] == gather["layer"]) & (main["phase"] == gather["phase"])].iloc[0]
        assert step["start_s"] >= gather["end_s"] - 1e-12
        position = int(step.name)
        if position >= 2:
            # Issued when the step before this one started, i.e. when the one before that ended.
            assert abs(gather["issued_s"] - main.loc[position - 2, "end_s"]) < 1e-12
    scatters = one[one["stream"] == "reduce_scatter"]
    assert (scatters["phase"] == "bwd").all() and len(scatters) == 6
    first_optim = main[main["phase"] == "optim"]["start_s"].min()
    assert first_optim >= scatters["end_s"].max() - 1e-12
    iteration_s = bundle.iterations.set_index(["run_id", "iteration"]).loc[
        ("analytic-mixtral-8x7b-bf16-L4-W8", 1), "iteration_s"
    ]
    assert iteration_s >= (main["end_s"] - main["start_s"]).sum() - 1e-12
    for rank, rows in events[events["iteration"] == 1].groupby("rank"):
        assert rows.sort_values("start_s")["end_s"].to_numpy() == pytest.approx(one["end_s"].to_numpy()), rank


def test_a_gather_beside_a_reduce_scatter_shares_the_link():
    """Two collectives in flight on the link take longer together than alone: the schedule's costs go
    through the evaluator's shared link, not a sum of maxima."""
    from sim.analytic import _schedule_events, _Step

    def step(layer: int, phase: str, gather: float, scatter: float) -> _Step:
        return _Step(
            layer,
            phase,
            0.001,
            1e6 if gather else 0.0,
            gather,
            gather,
            1e6 if scatter else 0.0,
            scatter,
            scatter,
        )

    alone = [step(0, "fwd", 0.0, 0.0), step(1, "bwd", 0.0, 0.1), step(2, "bwd", 0.1, 0.0)]
    events = _schedule_events(alone, prefetch=0)
    # The second gather starts when the first backward's reduce-scatter is in flight: both at half rate.
    scatter = events[events["stream"] == "reduce_scatter"].iloc[0]
    gather = events[events["stream"] == "allgather"].iloc[0]
    assert scatter["end_s"] - scatter["start_s"] > 0.1 + 1e-6
    assert gather["end_s"] - gather["start_s"] > 0.1 + 1e-6


def test_bad_generator_settings_name_the_field(tmp_path) -> None:
    """A settings file with a field missing, unknown or of the wrong type is one line naming it (it was
    "AnalyticSettings.__init__() got an unexpected keyword argument", or accepted and failed later)."""
    import re
    from importlib import resources

    from sim import SimInputError

    shipped = (resources.files("sim") / "data" / "analytic_bundle.toml").read_text()
    cases = {
        "generator_layers = 3\n" + shipped: "unknown field 'generator_layers', expected one of cluster",
        shipped.replace('cluster = "a100-hdr-testbed"\n', ""): "field 'cluster' missing",
        shipped.replace("seq_len = 1024", 'seq_len = "long"'): "field 'seq_len' is 'long', expected int",
        shipped.replace("seq_len = 1024", "seq_len = 0"): "field 'seq_len' is 0, expected int > 0",
        shipped.replace("world_sizes = [4, 8]", "world_sizes = [4, true]"): "'world_sizes' is [4, True]",
        shipped.replace("world_sizes = [4, 8]", "world_sizes = []"): "expected a non-empty list of int",
        shipped.replace(
            "comm_time_cv = 0.05", "comm_time_cv = -1"
        ): "'comm_time_cv' is -1, expected a number",
        shipped.replace("activation_checkpointing = true", "activation_checkpointing = 1"): "expected bool",
        shipped.replace("compute_time_cv = 0.03", "compute_time_cv = nan"): "'compute_time_cv' is nan",
    }
    refused = 0
    for index, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"settings-{index}.toml"
        path.write_text(text)
        with pytest.raises(SimInputError, match=re.escape(expected)) as raised:
            load_settings(path)
        assert "\n" not in str(raised.value)
        refused += 1
    assert refused == len(cases)
    assert load_settings().seq_len == 1024  # the shipped file passes its own check
