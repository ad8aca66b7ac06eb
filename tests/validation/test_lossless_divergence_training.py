"""`ciera validate lossless` and `divergence` end to end on spawned gloo ranks: short versions in the
default suite, the 1,000-step run and the repeat-twice determinism check under `-m slow`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from validation.divergence import DivergencePlan, run_divergence  # noqa: E402
from validation.lossless import LosslessPlan, run_lossless  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes of multi-process work: CI runs it with -m heavy


def _check_lossless(document: dict, steps: int) -> None:
    assert document["steps_compared"] == steps and document["tensors_compared"] > 0
    assert document["bit_identical"] and document["passed"]
    assert document["max_abs_difference"] == 0.0 and document["first_difference_step"] is None
    assert set(document["max_abs_difference_at_snapshots"]) == {str(document["resume_at"]), str(steps)}
    assert document["final_parameter_digest"]["reference"] == document["final_parameter_digest"]["ciera"]
    assert 0 < document["bytes_sent"] < document["bytes_raw"]
    control = document["control"]
    assert control["flagged"] and control["first_difference_step"] == 0 and control["max_abs_difference"] > 0


def test_zero3_with_ciera_is_bit_identical_across_a_resume_and_the_lossy_control_is_flagged() -> None:
    # At another block size than the default: `--block-size` reaches CIERA in every arm that runs it.
    document = run_lossless(LosslessPlan(engine="zero3", steps=4, layers=1, block_size=128))
    _check_lossless(document, 4)
    assert document["block_size"] == 128


@pytest.mark.slow
def test_fsdp2_with_ciera_is_bit_identical_across_a_resume(tmp_path: Path) -> None:
    out = tmp_path / "lossless.json"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "lossless", "--engine", "fsdp", "--steps", "6",
         "--layers", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PASSED" in done.stdout
    _check_lossless(json.loads(out.read_text()), 6)


@pytest.mark.slow
def test_a_thousand_steps_of_the_small_moe_stay_bit_identical() -> None:
    _check_lossless(run_lossless(LosslessPlan(engine="zero3", steps=1000, layers=2)), 1000)


@pytest.mark.slow
def test_lossless_is_the_same_twice_bit_for_bit() -> None:
    plan = LosslessPlan(engine="fsdp", steps=2, layers=1)
    first, second = run_lossless(plan), run_lossless(plan)
    assert first["passed"] and json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def _tiny_divergence() -> dict:
    return run_divergence(
        DivergencePlan(engine="fsdp", steps=2, checkpoints=1, layers=1, held_out_sequences=4)
    )


def test_divergence_arms_ciera_exact_the_others_measured() -> None:
    document = _tiny_divergence()
    assert document["checkpoints"] == [0, 2] and document["held_out_tokens"] == 4 * 64
    arms = {arm["name"]: arm for arm in document["arms"]}
    assert list(arms) == ["ciera", "ulp", "int8", "seed"]
    for point in arms["ciera"]["points"]:
        assert point["kl"] == 0.0 and point["routing_differ"] == 0.0 and point["top1_agreement"] == 1.0
    assert arms["ciera"]["losses"] == document["reference_losses"]
    last = {name: arm["points"][-1] for name, arm in arms.items()}
    assert last["seed"]["kl"] > last["int8"]["kl"] > 0 and last["seed"]["kl_vs_seed"] == 1.0
    assert arms["ulp"]["points"][0]["kl"] > 0  # the nudge is there before any training
    assert arms["int8"]["points"][0]["kl"] == 0.0  # int8 gathers change nothing before the first step
    assert document["nudged"]["parameter"].endswith("router.weight")
    near_ties = {arm["points"][-1]["near_tie_share"] for arm in document["arms"]}
    assert len(near_ties) == 1  # a property of the reference's routing, the same for every arm


@pytest.mark.slow
def test_divergence_is_the_same_twice_bit_for_bit() -> None:
    assert json.dumps(_tiny_divergence(), sort_keys=True) == json.dumps(_tiny_divergence(), sort_keys=True)
