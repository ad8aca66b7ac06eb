"""Benefit-driven selection in the FSDP2 plug-in (enable_ciera(select=True)) on spawned 2-rank gloo groups:
decided per module at enable time from given link profiles, rank 0's table on every rank, bit-identical
to plain FSDP2 whatever is selected."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp2_workers import SELECT_STEPS, fast_profile, select_worker  # noqa: E402

from tests.ranks import free_port, start_ranks  # noqa: E402

MODULES = {"<root>", "blocks.0", "blocks.1", "blocks.2"}


def _run(worker, nprocs: int) -> list:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    start_ranks(worker, nprocs, (nprocs, free_port(), results), join=True)
    return [results.get() for _ in range(nprocs)]


@pytest.fixture(scope="module")
def selected() -> dict[int, dict]:
    return {row["rank"]: row for row in _run(select_worker, 2)}


@pytest.mark.heavy
def test_slow_link_compresses_every_module_bit_identically(selected) -> None:
    for result in selected.values():
        slow = result["slow"]
        assert slow["losses_equal"] and slow["params_equal"]
        assert set(slow["modules"]) == MODULES
        for name, row in slow["modules"].items():
            assert row["compressed"] is True and row["reason"] == "selected by BSC", (name, row)
            assert row["plain_gathers"] == 0 and row["gathers"] == 2 * SELECT_STEPS
        # The sizes were found before the first gather: FSDP2's padded shards (blocks 8352, root 609).
        assert {name: row["numel"] for name, row in slow["modules"].items()} == {
            "<root>": 609,
            **dict.fromkeys(MODULES - {"<root>"}, 8352),
        }
        assert [row["module"] for row in slow["selection"]] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        assert all(row["selected"] and row["gain_s"] > 0 for row in slow["selection"])
        # Each module is one call: the per-call gate weighed its measured fixed cost, and it pays on 2 MB/s.
        assert all(row["call_pays"] and 1e-5 < row["per_call_s"] < 0.1 for row in slow["selection"])
        assert slow["engines"] == 1 and slow["engine_gathers"] == 8 * SELECT_STEPS
        assert slow["wire_ratio"] < 0.8
    assert selected[0]["slow"]["selection"] == selected[1]["slow"]["selection"]


@pytest.mark.heavy
def test_fast_link_compresses_nothing_and_does_no_ciera_work(selected) -> None:
    for result in selected.values():
        fast = result["fast"]
        assert fast["losses_equal"] and fast["params_equal"]
        assert fast["engines"] == 0 and fast["engine_gathers"] == 0  # not even an engine was made
        assert fast["wire_ratio"] == 1.0
        for row in fast["modules"].values():
            assert row["compressed"] is False and row["plain_gathers"] == row["gathers"] == 2 * SELECT_STEPS
            assert row["reason"].startswith("not selected by BSC: its codec costs more than the bytes")
        assert not any(row["selected"] for row in fast["selection"]) and len(fast["selection"]) == 4
    # Logged once, by rank 0: the priors used and each module's reason.
    log = selected[0]["fast"]["log"]
    assert sum("per-category priors" in line for _, line in log) == 1
    plain_lines = [line for _, line in log if "uses the plain all-gather: not selected by BSC" in line]
    assert len(plain_lines) == 4
    assert any("BSC selected 0 of 4 modules" in line for _, line in log)
    assert selected[1]["fast"]["log"] == []


@pytest.mark.heavy
def test_every_rank_applies_rank_zeros_table(selected) -> None:
    skewed = {rank: result["skewed"] for rank, result in selected.items()}
    # Each rank's own table (its own codec timings) differs: rank 0 would compress all, rank 1 nothing ...
    assert skewed[0]["local_selected"] == [True] * 4
    assert skewed[1]["local_selected"] == [False] * 4
    # ... and both applied rank 0's, so the gathers matched and training stayed bit-identical.
    assert skewed[0]["selection"] == skewed[1]["selection"]
    for result in skewed.values():
        assert all(row["selected"] for row in result["selection"])
        assert all(row["compressed"] for row in result["modules"].values())
        assert result["losses_equal"] and result["params_equal"]


@pytest.mark.heavy
def test_fp32_groups_are_never_candidates(selected) -> None:
    for rank, result in selected.items():
        fp32 = result["fp32"]
        assert fp32["compressed"] == [False] * 4 and fp32["selection"] == [] and fp32["engines"] == 0
        assert fp32["plain_gathers"] == fp32["gathers"] == 16
        assert all(reason == "all-gather dtype float32 is not BF16/FP16" for reason in fp32["reasons"])
        warnings = [line for level, line in fp32["log"] if level == "WARNING"]
        assert len(warnings) == (4 if rank == 0 else 0)


@pytest.mark.heavy
def test_a_group_changed_after_enable_fails_loudly_on_every_rank(selected) -> None:
    for result in selected.values():
        name, message = result["mismatch"]
        assert name == "SelectionMismatchError" and "\n" not in message
        assert message.startswith("module 'blocks.1': enable_ciera(select=True) decided for")
        assert "8352 bfloat16 values" in message and "sends 8352 float16 values" in message
        assert result["unknown_name"] == "categories: 'blocks.9.fc1.weight' is not a parameter of the model"


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"select": "yes"}, TypeError, "select is 'yes': expected True or False"),
        ({"comm_profile": "fast"}, ValueError, "comm_profile is used only by benefit-driven selection"),
        ({"select": True, "comm_profile": {"1024": 1e-3}}, TypeError, "expected a ciera_runtime.selection"),
        ({"select": True, "priors": {"mlp": 0.5}}, ValueError, "priors: 'mlp' is not a category"),
        ({"select": True, "priors": {"norm": 1.5}}, ValueError, "priors['norm'] = 1.5: expected a block"),
        (
            {"select": True, "categories": {"fc1.weight": "mlp"}},
            ValueError,
            "categories['fc1.weight'] = 'mlp'",
        ),
    ],
)
def test_bad_selection_arguments_are_one_line_errors(kwargs, error, text) -> None:
    from ciera_runtime.fsdp2 import enable_ciera

    with pytest.raises(error) as caught:
        enable_ciera(nn.Sequential(nn.Linear(4, 4)), **kwargs)
    assert text in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_comm_profile_is_a_one_line_error() -> None:
    from ciera_runtime.fsdp2 import enable_ciera
    from ciera_runtime.selection import CommProfile

    for profile in (
        CommProfile((1024, 256), (1e-3, 1e-4)),
        CommProfile((1024,), (0.0,)),
        CommProfile((), ()),
    ):
        with pytest.raises(ValueError, match="comm_profile: expected increasing positive bytes_per_rank"):
            enable_ciera(nn.Sequential(nn.Linear(4, 4)), select=True, comm_profile=profile)
    assert fast_profile().comm_s(1e6) == pytest.approx(1e-9)
