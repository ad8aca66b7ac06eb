"""Memory per GPU (sim/memory.py) in every record, the fit against the preset's device, and the verdicts
that leave out what does not fit (sim/verdict.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import traces
from sim import load_cluster, simulate, summary_rows
from sim.cluster import parse_overrides
from sim.memory import GIB, activation_bytes, estimate, model_footprint
from sim.model_config import layer_parameters, load_model_config
from sim.verdict import PAYS_ABOVE, grouped_notes, pays_text, w_ranges


@pytest.fixture(scope="module")
def bundle() -> traces.TraceBundle:
    return traces.read_bundle(traces.default_bundle_path())


@pytest.fixture(scope="module")
def scout(bundle: traces.TraceBundle) -> list:
    return simulate(
        bundle, load_cluster("a100-hdr-testbed"), models=["scout"], gpus=[4, 16, 64], systems=["zero3", "ciera"],
        dtypes=["bf16"],
    )  # fmt: skip


def _zoo_parameters(key: str) -> int:
    config = load_model_config(key)
    layers = config.num_layers
    return sum(p.numel for layer in range(layers + 2) for p in layer_parameters(config, layer, layers))


def test_parameters_at_full_depth_are_the_models_own(bundle: traces.TraceBundle) -> None:
    """The footprint repeats the anchor's traced blocks to the full depth: it must count the zoo model."""
    for key in ("olmoe-1b-7b", "llama-4-scout-17b-16e", "deepseek-moe-16b"):
        name = load_model_config(key).name
        run = bundle.runs[
            (bundle.runs["model"] == name) & (bundle.runs["layers"] == bundle.runs["layers"].max())
        ]
        anchor = run.iloc[0]
        footprint = model_footprint(
            bundle, anchor["run_id"], int(anchor["layers"]), int(anchor["full_layers"])
        )
        assert footprint.parameters == pytest.approx(_zoo_parameters(key), rel=1e-6), key


def test_scout_does_not_fit_at_small_w_and_the_model_states_follow_deepspeeds_estimator(scout: list) -> None:
    by = {(r.gpus, r.system): r for r in scout}
    parameters = _zoo_parameters("llama-4-scout-17b-16e")
    for gpus in (4, 16):
        memory = by[(gpus, "zero3")].memory
        assert memory["model_states_bytes"] == pytest.approx(18 * parameters / gpus)
        assert memory["fits"] is False and memory["total_bytes"] > memory["device_bytes"] == 80 * GIB
    assert by[(64, "zero3")].memory["fits"] is True
    # Every part is counted once and adds up.
    memory = by[(64, "ciera")].memory
    parts = (
        "model_states_bytes",
        "gathered_parameters_bytes",
        "activations_bytes",
        "ciera_bytes",
        "zeropp_bytes",
    )
    assert memory["total_bytes"] == pytest.approx(sum(memory[p] for p in parts))
    assert memory["ciera_bytes"] > 0 and memory["activations_bytes"] > 0


def test_what_does_not_fit_is_left_out_of_fastest_and_pays_from(scout: list) -> None:
    (row,) = summary_rows([r.to_dict() for r in scout], lambda r: "analytic projection")
    assert 4 not in row.best and 16 not in row.best and 64 in row.best
    assert 4 not in row.ciera and row.pays_from in (None, 64)
    assert row.does_not_fit(4).startswith("does not fit (") and "GiB of 80)" in row.does_not_fit(4)


def test_cieras_cache_is_cut_to_what_the_device_leaves(bundle: traces.TraceBundle) -> None:
    """BSC's budget is the preset's, or less where the rest of the step leaves less: a CIERA plan fits
    wherever the plain step does."""
    records = simulate(
        bundle, load_cluster("a100-hdr-testbed"), models=["scout", "qwen2"], gpus=[16, 32, 64],
        systems=["zero3", "ciera-er-bsc", "ciera"], dtypes=["bf16"],
    )  # fmt: skip
    plain = {(r.model, r.gpus): r.memory["fits"] for r in records if r.system == "zero3"}
    cut = 0
    for record in records:
        if record.system != "zero3" and plain[(record.model, record.gpus)]:
            assert record.memory["fits"] is True, (record.model, record.gpus, record.system)
            cut += any("receiver cache budget cut" in note for note in record.notes)
    assert cut > 0  # Llama-4-Scout at W = 32 leaves less than the 16 GiB budget


def test_a_preset_without_device_memory_says_the_fit_is_not_checked(
    bundle: traces.TraceBundle, tmp_path: Path
) -> None:
    source = Path(__file__).resolve().parents[2] / "sim" / "data" / "clusters" / "a100-hdr-testbed.toml"
    lines = [line for line in source.read_text().splitlines() if not line.startswith("device_memory_bytes")]
    preset_path = tmp_path / "no-memory.toml"
    preset_path.write_text("\n".join(lines) + "\n")
    preset = load_cluster(str(preset_path))
    assert "device_memory_bytes" in preset.defaulted  # said on the console with every simulation
    (record,) = simulate(bundle, preset, models=["olmoe"], gpus=[8], systems=["zero3"], dtypes=["bf16"])
    assert record.memory["fits"] is None and record.memory["device_bytes"] == 0


def test_an_override_of_device_memory_changes_the_verdict(bundle: traces.TraceBundle) -> None:
    preset = load_cluster("a100-hdr-testbed", parse_overrides(["device_memory_bytes=192e9"]))
    (record,) = simulate(bundle, preset, models=["mixtral"], gpus=[8], systems=["zero3"], dtypes=["bf16"])
    assert record.memory["fits"] is True  # an H200's 141 GB-class device holds what an A100 does not


def test_activations_grow_with_depth_and_sequence_and_drop_with_checkpointing() -> None:
    shape = traces.load_model_shape("mixtral")
    checkpointed = activation_bytes(shape, 32, 1024, 1, True)
    assert activation_bytes(shape, 64, 1024, 1, True) > checkpointed
    assert activation_bytes(shape, 32, 2048, 1, True) > checkpointed
    assert activation_bytes(shape, 32, 1024, 1, False) > 10 * checkpointed


def test_zeropp_holds_a_secondary_partition_per_node() -> None:
    footprint = dataclasses.make_dataclass("F", ["parameters", "largest_layer_parameters"])(8e9, 1e8)
    zero3 = estimate("zero3", 64, 8, footprint, 1, 0.0, 0.0, 0.0, 80 * GIB)
    zeropp = estimate("zeropp", 64, 8, footprint, 1, 0.0, 0.0, 0.0, 80 * GIB)
    assert zeropp.total_bytes - zero3.total_bytes == pytest.approx(2 * 8e9 / 8)


def test_one_threshold_for_pays() -> None:
    def records(speedup: float) -> list[dict]:
        return [
            {"model": "M", "dtype": "bf16", "gpus": g, "system": s, "speedup_vs_zero3": 1.0 if s == "zero3" else speedup}
            for g in (8, 16) for s in ("zero3", "ciera")
        ]  # fmt: skip

    (just_below,) = summary_rows(records(PAYS_ABOVE - 1e-4), lambda r: "x")
    (at,) = summary_rows(records(PAYS_ABOVE), lambda r: "x")
    assert pays_text(just_below).startswith("never") and at.pays_from == 8


def test_w_is_sorted_as_numbers_in_grouped_notes() -> None:
    records = [
        {"model": "M", "dtype": "bf16", "gpus": g, "notes": ["n"] if g != 8 else []}
        for g in (128, 16, 32, 4, 64, 8)
    ]
    assert grouped_notes(records) == ["n — M bf16 at W = 4, 16, 32, 64, 128"]
    assert w_ranges([128, 16, 32], [4, 8, 16, 32, 64, 128]) == "W = 16, 32, 128"
    assert w_ranges([64, 16, 32], [4, 8, 16, 32, 64, 128]) == "W = 16–64"


def test_ciera_simulate_marks_what_does_not_fit(tmp_path: Path) -> None:
    """The issue's check: `ciera simulate --models scout --gpus 4,8,16` marks the configurations that
    do not fit, on the console and in the JSON."""
    out = tmp_path / "scout.json"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "simulate", "--models", "scout", "--gpus", "4,8,16", "--dtype",
         "bf16", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("does not fit (") >= 3
    assert "✗" in done.stdout  # the per-record table (short enough to print) marks each record
    records = json.loads(out.read_text())["records"]
    assert all(r["memory"]["fits"] is False for r in records if r["gpus"] in (4, 8))
    assert records[0]["memory"]["verdict"].startswith("does not fit (465 GiB of 80)")
