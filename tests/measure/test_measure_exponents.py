"""Exponent and block change rates as the method defines them, on tensors with known changes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from measure.exponents import ExponentTracker, bf16_exponents, summarize  # noqa: E402


def test_rates_count_values_and_blocks_whose_exponent_changed() -> None:
    weight = torch.full((2048,), 1.5, dtype=torch.bfloat16)  # exponent 127 everywhere, 4 blocks of 512
    norm = torch.full((100,), 0.75, dtype=torch.bfloat16)
    tracker = ExponentTracker({"w": "expert_ffn", "n": "norm"}, block_size=512)
    assert tracker.update([("w", weight), ("n", norm)]) is None  # first call: nothing to compare
    weight = weight.clone()
    weight[3] = 3.0  # exponent 128: block 0
    weight[1500] = 1.75  # same exponent: no change
    weight[2047] = 0.5  # exponent 126: block 3
    rates = tracker.update([("w", weight), ("n", norm)])
    assert rates["expert_ffn"] == {"exp_change_rate": 2 / 2048, "block_change_rate": 2 / 4}
    assert rates["norm"] == {"exp_change_rate": 0.0, "block_change_rate": 0.0}
    assert rates["all"]["exp_change_rate"] == 2 / 2148
    assert rates["all"]["block_change_rate"] == 2 / 5  # the norm is one partial block


def test_fp32_weights_are_taken_as_their_bf16_cast() -> None:
    # 1.99999 rounds to 2.0 in BF16: exponent 128, not FP32's 127.
    assert bf16_exponents(torch.tensor([1.99999, 1.0]))[0] == 128
    assert bf16_exponents(torch.tensor([1.99999, 1.0]))[1] == 127


def test_summary_leaves_out_the_warm_up() -> None:
    per_step = [{"all": {"exp_change_rate": 1.0, "block_change_rate": 1.0}}] * 3 + [
        {"all": {"exp_change_rate": 0.01, "block_change_rate": 0.5}}
    ] * 5
    summary = summarize(per_step, warmup_steps=3)
    assert summary["all"]["exp_change_rate_median"] == 0.01 and summary["all"]["steps"] == 5


def test_an_unknown_parameter_is_an_error() -> None:
    with pytest.raises(ValueError, match="'x' has no category"):
        ExponentTracker({}).update([("x", torch.zeros(3))])
