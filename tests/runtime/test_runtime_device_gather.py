"""The device gather (ciera_runtime/device_gather.py) on CPU gloo ranks — the same tensor code a GPU runs
under NCCL: bit-identical to the raw all-gather, no host read of device data on the steady path (counted
per aten op), one per step for the sizes and one for the check, and a corrupted slot refused by every
rank at the check, then exact again."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _device_gather_workers as workers  # noqa: E402

from tests.ranks import free_port, spawn_ranks  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("world_size,entropy", [(2, "rans"), (3, "rans"), (2, "none")])
def test_steady_gathers_are_exact_and_read_nothing_on_the_host(world_size: int, entropy: str) -> None:
    results = spawn_ranks(workers.steady_worker, world_size, entropy)
    sent = {}
    for (
        rank,
        mismatches,
        gathers,
        steady_reads,
        host_reads,
        bytes_sent,
        raw_bytes,
        over_raw,
        coded,
    ) in results:
        assert gathers == workers.STEPS * 8 - 2 and mismatches == 0, rank
        assert steady_reads == {}, f"rank {rank}: host reads on the steady path: {steady_reads}"
        assert host_reads == 2 * workers.STEPS  # the sizes after each prepare, the flag at each check
        # A part that would not be smaller than the raw values travels raw: no gather sends more than raw
        # (the first step's full payloads, the 7-value shard's every gather).
        assert over_raw == 0
        # Later gathers carry no exponents and small steps change few blocks: well under raw.
        assert bytes_sent < 0.8 * raw_bytes, (bytes_sent, raw_bytes)
        # rANS streams where they are shorter than the uncoded exponents (most payloads here); never with
        # entropy 'none'.
        if entropy == "rans":
            assert coded > workers.STEPS, coded  # of STEPS x 4 shard payloads per rank
        else:
            assert coded == 0, coded
        sent[rank] = bytes_sent
    print(entropy, world_size, "bytes sent per rank", sent)


def test_a_corrupted_slot_is_refused_by_every_rank_at_the_check_then_exact_again() -> None:
    results = spawn_ranks(workers.fault_worker, 2)
    outcomes = [outcome for _, outcome in results]
    assert outcomes[0] == outcomes[1]  # the same error, word for word, on every rank
    for _, steps in results:
        assert [kind for kind, _ in steps] == [
            "applied",
            "applied",
            "refused",
            "applied",
            "refused",
            "applied",
        ]
        assert all(value is True for kind, value in steps if kind == "applied")


def test_ranks_with_different_shard_sets_fail_alike() -> None:
    assert [outcome for _, outcome in spawn_ranks(workers.mismatch_worker, 2)] == ["ConfigMismatchError"] * 2


def test_the_host_read_counter_sees_what_would_sync_a_gpu() -> None:
    """The steady-path check above is only as good as the counter: it must see each kind of host read."""
    values = torch.arange(10)
    counter = workers.HostReadCounter()
    with counter:
        values.sum().item()
        bool(values[3] > 2)
        values[values > 4]
        values.nonzero()
        torch.repeat_interleave(values[:3], torch.tensor([1, 2, 3]))
        values.repeat_interleave(2)  # a static count: no host read
        torch.cumsum(values, 0)
    assert counter.counts["aten._local_scalar_dense"] == 2
    assert counter.counts["aten.index(bool mask)"] == 1
    assert counter.counts["aten.repeat_interleave(tensor repeats)"] == 1
    assert sum(counter.counts.values()) == 5  # the static repeat_interleave and the cumsum are not reads
    assert counter.counts["aten.nonzero"] == 1


def test_misuse_is_refused_in_one_line_before_anything_is_sent() -> None:
    """One process, W = 1 (gloo): what a caller can get wrong is checked before any collective."""
    import torch.distributed as dist

    from ciera_runtime.device_gather import DeviceGather

    workers.init_gloo(0, 1, free_port())
    try:
        gather = DeviceGather("cpu")
        with pytest.raises(ValueError, match="power of two"):
            DeviceGather("cpu", block_size=48)
        with pytest.raises(ValueError, match="dtype torch.float32"):
            gather.register({0: torch.zeros(8)})
        weights = {0: torch.zeros(8, dtype=torch.bfloat16)}
        gather.register(weights)
        with pytest.raises(ValueError, match="before prepare"):
            gather.all_gather([0], [weights[0]])
        with pytest.raises(ValueError, match="every registered shard"):
            gather.prepare({})
        gather.prepare(weights)
        with pytest.raises(ValueError, match=r"unknown: \[5\]"):
            gather.all_gather([5], [weights[0]])
        with pytest.raises(ValueError, match="distinct"):
            gather.all_gather([0, 0], [weights[0], weights[0]])
        with pytest.raises(ValueError, match="registered as 8"):
            gather.all_gather([0], [torch.zeros(9, dtype=torch.bfloat16)])
        assert torch.equal(gather.all_gather([0], [weights[0]]).wait()[0], weights[0])
        gather.check()
    finally:
        dist.destroy_process_group()


def _random_faults(world_size: int, steps: int, seed: int) -> collections.Counter:
    results = spawn_ranks(workers.random_fault_worker, world_size, steps, seed, timeout_s=120 + steps)
    per_rank = [outcomes for _, outcomes in results]
    counts: collections.Counter = collections.Counter()
    for step, outcomes in enumerate(zip(*per_rank, strict=True)):
        assert len(set(outcomes)) == 1, f"step {step}: ranks disagree: {outcomes}"  # message included
        fault, kind, exact = outcomes[0]
        if kind == "refused":  # the error names what happened
            assert ("changed after prepare" if fault == "edit_shard" else "failed its checks") in exact, exact
        # Applied means exact on every rank: no step computed from a wrong weight is ever applied.
        assert kind == "refused" or exact is True, f"step {step}: {fault} applied with wrong weights"
        counts[(fault, kind)] += 1
    # The faults that always change what a receiver rebuilds are always refused.
    for fault in ("zero_row", "replay_row", "edit_shard"):
        assert counts[(fault, "applied")] == 0 or fault == "replay_row", counts
    print(f"W = {world_size}, {steps} steps: {dict(sorted(counts.items()))}")
    return counts


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("world_size", [2, 3])
def test_random_faults_end_exact_or_refused_by_every_rank(world_size: int) -> None:
    counts = _random_faults(world_size, 60, seed=world_size)
    assert sum(counts.values()) == 60
    assert (
        counts[("none", "applied")] > 0 and sum(n for (_, kind), n in counts.items() if kind == "refused") > 0
    )


@pytest.mark.slow  # ~2 min: run on purpose with -m slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_many_random_faults_end_exact_or_refused_by_every_rank(world_size: int) -> None:
    assert sum(_random_faults(world_size, 600, seed=100 + world_size).values()) == 600
