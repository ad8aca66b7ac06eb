"""The pieces of `ciera validate lossless` and `divergence` that need no training: the arms' changes
(int8 round trip, the ULP nudge, state digests and snapshots), the step comparison, and the divergence
metrics on constructed outputs."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from measure.arms import (  # noqa: E402
    QUANTIZATION_GROUP,
    int8_block_roundtrip,
    load_state,
    nudge_one_weight,
    save_state,
    state_digest,
)
from validation.divergence import (  # noqa: E402
    DivergencePlan,
    compare_outputs,
    flip_margin_auc,
    margins,
    top_k_sets,
)
from validation.lossless import _compare_steps, max_abs_difference  # noqa: E402


def test_int8_round_trip_is_lossy_but_bounded_per_group() -> None:
    values = torch.randn(3 * QUANTIZATION_GROUP + 17, dtype=torch.float32).to(torch.bfloat16)
    restored = int8_block_roundtrip(values)
    assert restored.dtype == values.dtype and restored.shape == values.shape
    assert not torch.equal(restored, values)  # the point of the control: it changes the weights
    for start in range(0, values.numel(), QUANTIZATION_GROUP):
        group = values[start : start + QUANTIZATION_GROUP].float()
        step = group.abs().max() / 127
        error = (restored[start : start + QUANTIZATION_GROUP].float() - group).abs().max()
        assert error <= step / 2 + group.abs().max() * 2**-8  # half a quantum, plus BF16 rounding
    assert torch.equal(int8_block_roundtrip(torch.zeros(10)), torch.zeros(10))


def test_the_nudge_moves_one_router_weight_by_one_bf16_ulp() -> None:
    from measure.zoo import build_model

    model = build_model("small-moe", 1, None, 0, activation_checkpointing=False)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    nudged = nudge_one_weight(model)
    changed = [name for name, param in model.named_parameters() if not torch.equal(param, before[name])]
    assert changed == [nudged["parameter"]] and nudged["parameter"].endswith("router.weight")
    old_bits = torch.tensor([nudged["from"]]).to(torch.bfloat16).view(torch.int16)
    new_bits = torch.tensor([nudged["to"]]).to(torch.bfloat16).view(torch.int16)
    assert (
        int(new_bits - old_bits) == 1
        and torch.tensor([nudged["to"]]).to(torch.bfloat16).float() == nudged["to"]
    )


def test_digests_see_one_flipped_bit_and_snapshots_round_trip(tmp_path: Path) -> None:
    state = [("a", torch.arange(8, dtype=torch.float32)), ("b", torch.ones(3))]
    names, digest = state_digest(state)
    flipped = state[0][1].clone()
    flipped.view(torch.int32)[5] ^= 1  # one mantissa bit
    _, other = state_digest([("a", flipped), state[1]])
    assert names == ["a", "b"] and digest["all"] != other["all"]
    assert digest["tensors"][0] != other["tensors"][0] and digest["tensors"][1] == other["tensors"][1]
    save_state(state, tmp_path / "x.pt")
    save_state([("a", flipped), ("b", torch.tensor([1.0, math.nan, 1.0]))], tmp_path / "y.pt")
    assert list(load_state(tmp_path / "x.pt")) == ["a", "b"]
    assert not list(tmp_path.glob("*.partial"))
    assert max_abs_difference(tmp_path / "x.pt", tmp_path / "x.pt") == 0.0
    assert max_abs_difference(tmp_path / "x.pt", tmp_path / "y.pt") == math.inf  # a NaN is never "0"


def _document(losses: list[str], digests: list[list[str]]) -> dict:
    return {
        "state_names": ["w", "w:exp_avg"],
        "steps": [{"step": i, "loss": float(i), "loss_bits": bits} for i, bits in enumerate(losses)],
        "state_digests": [{"step": i + 1, "all": "".join(d), "tensors": d} for i, d in enumerate(digests)],
    }


def test_step_comparison_finds_the_first_difference_and_its_tensors() -> None:
    same = _document(["aa", "bb", "cc"], [["1", "2"], ["3", "4"], ["5", "6"]])
    result = _compare_steps(same, same)
    assert result["steps_compared"] == 3 and result["first_difference_step"] is None
    late = _document(["aa", "bb", "cc"], [["1", "2"], ["3", "X"], ["5", "Y"]])
    result = _compare_steps(same, late)
    assert result["first_difference_step"] == 1 and result["first_difference_tensors"] == ["w:exp_avg"]
    assert result["steps_with_different_state"] == 2 and result["steps_with_different_loss"] == 0
    loss_only = _document(["aa", "zz", "cc"], [["1", "2"], ["3", "4"], ["5", "6"]])
    assert _compare_steps(same, loss_only)["steps_with_different_loss"] == 1
    with pytest.raises(ValueError, match="different tensors"):
        _compare_steps(same, {**same, "state_names": ["v", "w:exp_avg"]})


def test_divergence_metrics_on_constructed_outputs() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(50, 8))
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    scores = rng.random((2, 50, 6))
    reference = {"log_probs": log_probs, "router_scores": scores, "top_k": np.array(2)}
    same = compare_outputs(reference, dict(reference))
    assert same["kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["routing_differ"] == 0.0
    assert same["flip_margin_auc"] is None and same["decisions"] == 100
    swapped = scores.copy()
    swapped[..., [0, 5]] = swapped[..., [5, 0]]
    moved = compare_outputs(reference, {**reference, "router_scores": swapped})
    expected = np.mean(np.any(top_k_sets(scores, 2) != top_k_sets(swapped, 2), axis=-1))
    assert moved["routing_differ"] == pytest.approx(expected) and 0 < expected < 1
    shifted = compare_outputs(reference, {**reference, "log_probs": np.roll(log_probs, 1, axis=-1)})
    assert shifted["kl"] > 0 and shifted["top1_agreement"] < 1


def test_margins_and_the_flip_auc() -> None:
    scores = np.array([[0.4, 0.3, 0.2, 0.1], [0.4, 0.25, 0.249, 0.1], [0.25, 0.25, 0.25, 0.25]])
    np.testing.assert_allclose(margins(scores, 1), [0.1 / 0.3, 0.15 / 0.3, 0.0])
    np.testing.assert_allclose(margins(scores, 2), [0.1 / 0.3, 0.001 / 0.3, 0.0])
    assert top_k_sets(scores, 2).tolist() == [[0, 1], [0, 1], [0, 1]]  # ties: the lower index
    reference_margins = np.array([0.001, 0.002, 0.5, 0.6, 0.7])
    assert flip_margin_auc(reference_margins, np.array([1, 1, 0, 0, 0])) == 1.0
    assert flip_margin_auc(reference_margins, np.array([0, 0, 0, 1, 1])) == 0.0
    assert flip_margin_auc(np.array([0.1, 0.1, 0.1]), np.array([1, 0, 0])) == 0.5  # ties count half
    assert flip_margin_auc(reference_margins, np.zeros(5)) is None


def test_checkpoints_include_step_zero_and_the_last_step() -> None:
    assert DivergencePlan(steps=200, checkpoints=4).checkpoint_steps() == [0, 50, 100, 150, 200]
    assert DivergencePlan(steps=3, checkpoints=10).checkpoint_steps() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["lossless", "--engine", "zero2"], "--engine 'zero2': expected one of zero3, fsdp"),
        (["lossless", "--steps", "1"], "--steps 1: expected at least 2"),
        (["lossless", "--world-size", "3"], "does not split over 3 ranks"),
        (["lossless", "--model", "nope"], "nope"),
        (["divergence", "--checkpoints", "0"], "--checkpoints 0: expected an integer >= 1"),
        (["divergence", "--layers", "-1"], "--layers -1: expected an integer >= 0"),
        (["divergence", "--json", "/nonexistent-dir/y.json"], "directory /nonexistent-dir does not exist"),
        (["lossless", "--json", "/"], "is a directory"),
        (["lossless", "--block-size", "100"], "--block-size is 100: expected a power of two"),
        (["lossless", "--width-scale", "3"], "width_scale 3 does not divide hidden_size"),
        (["divergence", "--width-scale", "-2"], "--width-scale -2: expected an integer >= 0"),
    ],
)
def test_bad_options_are_one_line_before_any_rank_starts(arguments: list[str], expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", *arguments],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr


def test_progress_without_a_terminal_is_a_line_per_arm_and_at_the_end(capsys) -> None:
    from validation.cli import _run_arms

    def two_arms(plan, on_progress):  # noqa: ANN001 — stands in for run_lossless
        for done, status in enumerate(
            ["reference: step 1", "reference: step 2", "ciera: step 1", "ciera: step 2"]
        ):
            on_progress(status, done + 1, 4)
        return {"plan": plan}

    assert _run_arms("lossless", two_arms, "the plan") == {"plan": "the plan"}
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lossless: ")]
    assert [line.split(" (")[0] for line in lines] == [
        "lossless: 1/4 steps of all arms; reference: step 1",
        "lossless: 3/4 steps of all arms; ciera: step 1",
        "lossless: 4/4 steps of all arms; ciera: step 2",
    ]
