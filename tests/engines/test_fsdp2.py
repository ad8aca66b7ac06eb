"""CIERA inside FSDP2 (fully_shard) on spawned 2-rank gloo groups: bit-identical to plain FSDP2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp2_workers import (  # noqa: E402
    STEPS,
    device_gather_worker,
    dying_rank_worker,
    subgroup_reshard_worker,
    training_worker,
)

from tests.ranks import free_port, start_ranks  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes of multi-process work: CI runs it with -m heavy


@pytest.fixture(scope="module", autouse=True)
def _compile_numba_kernels_once():
    """Compile (and cache) the codec kernels here before the ranks start, so they load numba's cache
    instead of compiling the same kernels at once."""
    import numpy as np

    from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder

    bits = np.random.default_rng(0).integers(0, 1 << 16, 5000).astype(np.uint16)
    for dtype in ("bf16", "fp16"):
        encoder = ShardEncoder(0, bits.size, dtype, 1, CodecConfig())
        decoder = ShardDecoder(0, 1, bits.size, dtype, CodecConfig())
        np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)


def _run(worker, nprocs: int, *args, results_expected: int | None = None) -> list:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    start_ranks(worker, nprocs, (nprocs, free_port(), *args, results), join=True)
    return [results.get() for _ in range(results_expected or nprocs)]


@pytest.fixture(scope="module")
def training_results(tmp_path_factory) -> dict[int, dict]:
    checkpoint_dir = tmp_path_factory.mktemp("fsdp2_checkpoint")
    return {row["rank"]: row for row in _run(training_worker, 2, str(checkpoint_dir))}


def test_losses_and_final_parameters_bit_identical_to_plain_fsdp2(training_results) -> None:
    for result in training_results.values():
        plain, ciera = result["losses"]
        assert len(plain) == len(ciera) == STEPS
        assert result["losses_equal"], list(zip(plain, ciera, strict=True))
        assert all(result["params_equal"].values()), result["params_equal"]


def test_fewer_bytes_on_the_wire(training_results) -> None:
    for result in training_results.values():
        stats = result["stats"]
        assert stats["wire_bytes"] < stats["raw_bytes"]
        assert stats["wire_ratio"] < 0.7
        blocks = [row for name, row in stats["modules"].items() if name.startswith("blocks.")]
        assert all(row["compressed"] and row["dtype"] == "bfloat16" for row in blocks)
        # A block's shard (8352 bf16 values) costs well under what the plain all-gather sends. A bucket row
        # is sized from replicated state, not agreed per gather: the last block's backward gather follows
        # its forward one directly, before that is known to every rank, and is padded to an older size.
        assert all(row["wire_bytes"] < 0.67 * row["raw_bytes"] for row in blocks), [
            (row["wire_bytes"] / row["raw_bytes"], row["gathers"]) for row in blocks
        ]


def test_pipelined_buckets_stay_bit_identical(training_results) -> None:
    for result in training_results.values():
        assert result["pipelined_losses_equal"]
        blocks = [
            row for name, row in result["pipelined_stats"]["modules"].items() if name.startswith("blocks.")
        ]
        # From the second step on, the largest calls travel as parts, within the per-step budget of
        # extra calls; the first step cuts nothing.
        budget = result["pipelined_stats"]["part_budget"]
        assert 0 < budget["extra_calls_per_step"] <= budget["budget_per_step"]
        assert blocks and any(row["pipelined_gathers"] > 0 for row in blocks)
        assert all(row["pipelined_gathers"] < row["gathers"] for row in blocks)


def test_no_entropy_stage_is_bit_identical_and_leaves_raw_after_the_seeds(training_results) -> None:
    """CodecConfig(entropy='none'): a full payload is raw-sized, so a shard's first gather goes as a seed
    (raw values that fill the receivers' caches); its later gathers are payloads, not raw again."""
    for rank, row in training_results.items():
        assert row["uncoded_losses_equal"], rank
        messages = row["uncoded_messages"]
        assert messages["seed"] > 0 and messages["payload"] > messages["raw"], (rank, messages)


def test_gather_counts_per_module_per_iteration(training_results) -> None:
    """Activation checkpointing per block (use_reentrant=False): reshard_after_forward=True gathers every
    module twice per iteration (forward, backward; the recompute finds the parameters unsharded),
    False once. The same counts as plain FSDP2: CIERA does not change the schedule."""
    modules = {"<root>", "blocks.0", "blocks.1", "blocks.2"}
    for result in training_results.values():
        assert result["plain_gathers_per_iteration"] == dict.fromkeys(modules, 2.0)
        assert result["ciera_gathers_per_iteration"] == dict.fromkeys(modules, 2)
        phases = result["stats"]["modules"]["blocks.1"]["phases"]
        assert phases == {"forward": STEPS, "backward": STEPS}
        assert result["no_reshard_gathers_per_iteration"] == dict.fromkeys(modules, 1)
        assert result["no_reshard_losses_equal"]
        assert all(phases == {"forward": 3} for phases in result["no_reshard_phases"].values())


def test_gather_error_propagates_unchanged_on_every_rank_and_training_recovers(training_results) -> None:
    # Rank 1 could not rebuild a gather: it raises there and once more at its next call (the retried
    # step's first gather), where rank 0 raises the same error; the call after re-creates the groups.
    errors = {rank: result["errors"] for rank, result in training_results.items()}
    assert len(errors[0]) == 1 and errors[1] == errors[0] * 2, errors
    name, message = errors[0][0]
    assert name == "GatherError"
    assert "rank 1: rebuilding rank 0's shard" in message and "\n" not in message
    # ... and after reset_iter_state the step ran again: still bit-identical (first test).


def test_checkpoint_save_load_continue_bit_identical(training_results) -> None:
    for result in training_results.values():
        assert result["resume_losses_equal"]  # fresh model and engines loaded from the checkpoint
        assert result["rollback_losses_equal"]  # the step-10 checkpoint loaded into the live model
        assert all(result["rollback_params_equal"].values())


def test_async_unshard_fp16_and_fp32_paths(training_results) -> None:
    for result in training_results.values():
        assert result["async_losses_equal"]
        assert result["async_gathers"] == (3 * 8 + 1, 3 * 8 + 1)  # every gather returned a dist.Work
        assert result["explicit_unshard_equal"]
        assert result["explicit_phases"] == {"forward": 3, "backward": 3, "explicit": 1}
        assert result["fp16_losses_equal"] and all(result["fp16_compressed"])
        fp32 = result["fp32"]
        assert fp32["compressed"] == [False] * 4 and fp32["plain_gathers"] == fp32["gathers"] == 16
        assert fp32["wire_ratio"] == 1.0
        assert len(fp32["log_lines"]) == 4 and "float32 is not BF16/FP16" in fp32["log_lines"][0]


def test_a_rank_that_dies_makes_the_other_raise_not_hang() -> None:
    """Rank 1 exits at step 3; rank 0's next gather fails at once (gloo sees the closed connection) with
    a GatherError naming the shard — well inside the engine's timeout_s."""
    [(rank, error_type, message, elapsed_s)] = _run(dying_rank_worker, 2, 30.0, "exit", results_expected=1)
    assert rank == 0
    assert error_type.startswith("ciera_runtime.errors.") and "GatherError" in error_type
    assert message.startswith("shard 0:")
    assert elapsed_s < 30.0


@pytest.mark.slow
def test_a_rank_that_stalls_makes_the_other_time_out() -> None:
    """Rank 1 stops arriving (alive, busy elsewhere): rank 0 raises GatherTimeoutError after timeout_s."""
    [(rank, error_type, message, elapsed_s)] = _run(dying_rank_worker, 2, 3.0, "stall", results_expected=1)
    assert rank == 0 and error_type.endswith("GatherTimeoutError")
    assert "waited 3 s in the bucket round" in message
    assert 3.0 <= elapsed_s < 15.0


@pytest.mark.slow
def test_reshard_to_a_subgroup_and_cpu_offload_on_four_ranks() -> None:
    """reshard_after_forward=2 of 4 ranks: the backward gathers run over 2-rank groups (FSDP2 makes one
    per module), each with its own engine; CPUOffloadPolicy: the all-gather input comes from host memory."""
    for result in _run(subgroup_reshard_worker, 4):
        modules = {"<root>", "blocks.0", "blocks.1", "blocks.2"}
        subgroup, offload = result["subgroup"], result["offload"]
        assert subgroup["losses_equal"] and subgroup["compressed"]
        assert subgroup["gathers_per_iteration"] == dict.fromkeys(modules, 2)
        assert subgroup["engine_world_sizes"] == [2, 2, 2, 2, 4]
        assert subgroup["select_error"].startswith(
            "module '<root>' reshards after forward to a smaller group"
        )
        assert offload["losses_equal"] and offload["compressed"]
        assert offload["gathers_per_iteration"] == {"<root>": 1, **dict.fromkeys(modules - {"<root>"}, 2)}
        assert offload["engine_world_sizes"] == [4]


def test_a_model_without_fully_shard_is_a_one_line_error() -> None:
    from ciera_runtime.fsdp2 import enable_ciera

    with pytest.raises(ValueError) as caught:
        enable_ciera(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    message = str(caught.value)
    assert "\n" not in message and "no FSDP2 module" in message and "fully_shard" in message
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        enable_ciera("model")


def test_the_device_gather_trains_bit_identical_and_refuses_a_corrupted_step() -> None:
    """The device path (what CUDA parameters take) on CPU: losses and parameters as plain FSDP2, two host
    reads per step and none per gather, a corrupted slot refused by every rank at optimizer.step()."""
    results = _run(device_gather_worker, 2)
    for result in results:
        assert result["losses_equal"] is True, result["rank"]
        assert all(result["params_equal"].values()), result["params_equal"]
        assert result["reasons"] == ["device gather (entropy rans)"]
        # Inside the gathers (issue and wait, prepare excluded): no aten op that reads the host on a GPU.
        assert result["gather_host_reads"] == {}, result["gather_host_reads"]
        (device,) = result["stats"]["device_gathers"]
        # A prepare at the first gather after each step (6, the first one registering) and a check per step.
        assert device["host_reads"] == 2 * 6 and device["gathers"] == result["stats"]["gathers"]
        assert device["bytes_sent"] < device["raw_bytes"]
        assert result["refused"] is not None and "not applied" in result["refused"]
        assert all(result["unchanged_by_refused_step"].values())
        assert result["retried_step_equal"] is True and all(result["params_after_retry_equal"].values())
        assert result["async_losses_equal"] is True and result["async_async_gathers"] > 0
        assert result["no_reshard_losses_equal"] is True
