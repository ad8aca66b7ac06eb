"""Fault injection over real gloo groups: every gather under an injected fault ends with exact weights or
the same clear error on every rank — never wrong weights, never a hang, never one rank alone failing.

The CI-sized runs draw ~100 faults per world size; ``-m slow`` draws thousands. Each run prints its
counts (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _fault_workers as workers  # noqa: E402

from tests.ranks import spawn_ranks  # noqa: E402

MUST_ERROR = {
    "control_flip",
    "output_float32",
    "output_short",
    "shard_float32",
    "shard_wrong_numel",
    "shard_not_tensor",
    *workers.CONFIG_FAULTS,
}
MUST_BE_EXACT = {"output_noncontiguous", "output_2d", "shard_noncontiguous", "restart", "none"}


def _run_and_check(
    world_size: int, injections: int, seed: int, faults=workers.ALL_FAULTS
) -> collections.Counter:
    # The deadline is for a hang (a gather waits at most the engine's 30 s timeout); a loaded 2-core machine
    # runs a few injections per second.
    deadline_s = 300 + 1.0 * injections
    results = spawn_ranks(
        workers.fault_injection_worker, world_size, injections, seed, tuple(faults), timeout_s=deadline_s
    )
    counts: collections.Counter = collections.Counter()
    by_injection = collections.defaultdict(list)
    for rank, records, final, _, _ in results:
        assert final == ["exact"] * len(workers.SHAPES), f"rank {rank}: engine unusable after the faults"
        for index, fault, target, outcome, message, elapsed_s in records:
            by_injection[index].append((rank, fault, target, outcome, message, elapsed_s))
    for index, per_rank in sorted(by_injection.items()):
        fault = per_rank[0][1]
        outcomes = {outcome for _, _, _, outcome, _, _ in per_rank}
        messages = {message for *_, message, _ in per_rank}
        where = f"injection {index} ({fault} on rank {per_rank[0][2]})"
        assert "wrong" not in outcomes, f"{where}: silently wrong weights: {per_rank}"
        assert len(outcomes) == 1, f"{where}: ranks ended differently: {per_rank}"
        assert len(messages) == 1, f"{where}: ranks raised different errors: {messages}"
        outcome = outcomes.pop()
        if fault in MUST_ERROR:
            assert outcome == "error", f"{where}: expected an error on every rank, got {outcome}"
        if fault in MUST_BE_EXACT:
            assert outcome == "exact", f"{where}: expected exact weights, got {messages}"
        if outcome == "error":
            message = messages.pop()
            assert message.startswith("shard ") or message.startswith("all-gather"), message
            assert "\n" not in message
        counts[(fault, outcome)] += 1
    summary = {f"{fault}:{outcome}": n for (fault, outcome), n in sorted(counts.items())}
    slowest_s = max(elapsed_s for per_rank in by_injection.values() for *_, elapsed_s in per_rank)
    print(
        f"\nW={world_size}: {len(by_injection)} injections, slowest gather {slowest_s:.2f} s, outcomes {summary}"
    )
    return counts


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("world_size, injections", [(2, 160), (3, 90)])
def test_every_fault_ends_exact_or_in_the_same_error_on_every_rank(world_size: int, injections: int) -> None:
    counts = _run_and_check(world_size, injections, seed=world_size)
    assert sum(counts.values()) == injections
    assert sum(n for (_, outcome), n in counts.items() if outcome == "wrong") == 0
    # The draw covers every fault, and corrupted payloads really were caught (not only padding hit).
    assert {fault for fault, _ in counts} == set(workers.ALL_FAULTS)
    assert counts[("send_flip", "error")] > 0 and counts[("recv_garbage", "error")] > 0


@pytest.mark.slow
@pytest.mark.parametrize("world_size, injections", [(2, 3000), (3, 1500)])
def test_many_faults_slow(world_size: int, injections: int) -> None:
    counts = _run_and_check(world_size, injections, seed=100 + world_size)
    assert sum(counts.values()) == injections


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_rank_that_never_arrives_makes_the_others_raise_within_the_timeout() -> None:
    results = spawn_ranks(workers.missing_rank_worker, 3, 3.0, timeout_s=120)
    for rank, outcome, elapsed_s in results[:-1]:
        assert outcome.startswith("timeout: shard 0"), (rank, outcome)
        assert 2.5 < elapsed_s < 30
    assert results[-1][1] == "absent"
