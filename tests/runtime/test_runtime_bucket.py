"""The bucket path: one collective per engine all-gather, one round in steady state, over real gloo groups."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _bucket_workers as workers  # noqa: E402

from tests.ranks import spawn_ranks  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("world_size, entropy", [(2, "rans"), (3, "rans"), (2, "none")])
def test_buckets_are_exact_in_one_round_with_rare_overflow(world_size: int, entropy: str) -> None:
    iterations = 12
    for (
        rank, mismatches, gathers, calls, overflows, registrations, rounds, sent, raw, raw_messages, seeds, payloads
    ) in spawn_ranks(workers.bucket_steady_worker, world_size, iterations, entropy):  # fmt: skip
        assert mismatches == 0 and gathers == iterations * 3 * 8, rank
        assert calls == iterations * 9 and registrations == 3
        # One round per call, plus the registrations and the overflow rounds (the first gathers and the
        # churn burst only).
        assert rounds == calls + registrations + overflows
        assert overflows <= 6, overflows
        assert sent < raw
        assert raw_messages >= calls // 3  # the 7-value shard never pays
        if entropy == "none":
            # Every full payload (the first gathers, the churn burst) is raw-sized: it goes as a seed, and
            # the shards' next payloads are deltas on it — they do not stay raw.
            assert seeds >= 2 and payloads > calls, (seeds, payloads, calls)
        else:
            assert seeds == 0


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_decode_failure_surfaces_here_on_that_rank_and_at_the_next_call_on_the_others() -> None:
    results = {
        rank: (log, recoveries) for rank, log, recoveries in spawn_ranks(workers.bucket_failure_worker, 3)
    }
    outcomes = {rank: [outcome for _, outcome, _ in log] for rank, (log, _) in results.items()}
    # Rank 1 raises at call 2 and once more at call 3, where the others raise: call 4 meets again.
    assert outcomes[1] == ["exact", "exact", "error", "error", "exact", "exact", "exact"]
    for rank in (0, 2):
        assert outcomes[rank] == ["exact", "exact", "exact", "error", "exact", "exact", "exact"]
    messages = {results[1][0][2][2], results[1][0][3][2], results[0][0][3][2], results[2][0][3][2]}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "could not rebuild" in message and "rank 1" in message and "\n" not in message
    assert all(recoveries == 1 for _, recoveries in results.values())


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_rank_that_gives_up_tells_the_others_so_both_meet_at_the_recovery() -> None:
    timeout_s = 3.0
    results = {rank: rest for rank, *rest in spawn_ranks(workers.bucket_stall_worker, 2, timeout_s)}
    for rank, (log, recoveries, unfinished) in results.items():
        outcomes = [outcome for _, outcome, _, _ in log]
        assert "wrong" not in outcomes, (rank, log)
        assert outcomes.count("error") == 1 and outcomes[-2:] == ["exact", "exact"], (rank, log)
        assert recoveries == 1 and unfinished == 0, (rank, recoveries, unfinished)
    ((_, _, gave_up, waited_s),) = [entry for entry in results[0][0] if entry[1] == "error"]
    assert "waited 3 s in the bucket round" in gave_up and waited_s >= timeout_s
    ((_, _, told, told_after_s),) = [entry for entry in results[1][0] if entry[1] == "error"]
    # Rank 1 learns it from rank 0's notice, well before its own timeout would have fired.
    assert "gave up on a CIERA round" in told and "rank 0" in told and told_after_s < timeout_s / 2, told


def _check_faults(world_size: int, injections: int, seed: int, detector: str) -> collections.Counter:
    """Per injection, every rank's (faulted, clean, clean) outcomes must be one of:
    all exact; the same error on every rank in the faulted gather, then exact; or a one-sided failure —
    the ranks that could not rebuild raise in the faulted gather and again in the next, where every other
    rank (exact in the faulted gather) raises that error too, then exact everywhere. Never wrong weights,
    never a hang (every run has a deadline)."""
    collected = spawn_ranks(
        workers.bucket_fault_worker, world_size, injections, seed, detector, timeout_s=200 + 2.0 * injections
    )
    # No CIERA round left unfinished: a rank that recovered drained its failure's unpaired rounds (one
    # still held by gloo could abort the process at exit; the ranks leave through leave_rank).
    assert all(result[6] == 0 for result in collected), [result[5:7] for result in collected]
    seeds = sum(result[7] for result in collected)
    one_call_rebuilds = [result[8] for result in collected]
    # The exact detector's buckets take the one-call passes (most of their calls), the hash detector's never.
    assert all(count > injections if detector == "exact" else count == 0 for count in one_call_rebuilds), (
        detector,
        one_call_rebuilds,
    )
    if seed % 2:  # no entropy stage: full payloads go as seeds (see the worker)
        assert seeds > 0
    by_injection = collections.defaultdict(dict)
    for rank, records, *_ in collected:
        for index, fault, target, outcomes, _ in records:
            by_injection[index][rank] = (fault, target, outcomes)
    counts: collections.Counter = collections.Counter()
    for index, per_rank in sorted(by_injection.items()):
        fault = next(iter(per_rank.values()))[0]
        where = f"injection {index} ({fault} on rank {next(iter(per_rank.values()))[1]})"
        rows = {rank: outcomes for rank, (_, _, outcomes) in per_rank.items()}
        flat = [o for outcomes in rows.values() for o, _ in outcomes]
        assert "wrong" not in flat, f"{where}: silently wrong weights: {rows}"
        assert all(outcomes[2][0] == "exact" for outcomes in rows.values()), (
            f"{where}: not exact after: {rows}"
        )
        first = {outcomes[0] for outcomes in rows.values()}
        if first == {("exact", "")}:
            assert all(outcomes[1][0] == "exact" for outcomes in rows.values()), f"{where}: {rows}"
            kind = "exact"
        elif len(first) == 1:  # the same error on every rank, in the same gather
            assert all(outcomes[1][0] == "exact" for outcomes in rows.values()), f"{where}: {rows}"
            kind = "error"
        else:  # one-sided: the failing ranks now, everybody in the next gather, with a failing rank's error
            failing = {rank for rank, outcomes in rows.items() if outcomes[0][0] == "error"}
            messages = {rows[rank][0][1] for rank in failing}
            assert failing and len(failing) < world_size, f"{where}: {rows}"
            for rank, outcomes in rows.items():
                assert outcomes[1][0] == "error" and outcomes[1][1] in messages, f"{where}: {rows}"
                if rank in failing:
                    assert outcomes[1][1] == outcomes[0][1], f"{where}: {rows}"
            assert all("could not rebuild" in m and "\n" not in m for m in messages), messages
            kind = "next_call"
        counts[(fault, kind)] += 1
    summary = {f"{fault}:{kind}": n for (fault, kind), n in sorted(counts.items())}
    overflows = [overflow for _, _, overflow, *_ in collected]
    drained = sum(result[5] for result in collected)
    print(
        f"\nW={world_size}, {detector} detector: {len(by_injection)} injections, overflow rounds {overflows[0]}, outcomes {summary}, "
        f"unpaired rounds paired at recovery {drained}, seeds sent {seeds}"
    )
    return counts


MUST_ERROR_NOW = {"control_flip", "output_float32", "output_short", "shard_float32", "shard_wrong_numel"}
MUST_ERROR_NOW |= {"shard_not_tensor", "numel_mismatch", "dtype_mismatch", "different_bucket"}
MUST_BE_EXACT = {"output_noncontiguous", "output_2d", "shard_noncontiguous", "churn_burst", "none"}


# The exact detector runs the one-call bucket passes, the hash detector the per-shard loop.
@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("detector", ["hash", "exact"])
@pytest.mark.parametrize("world_size, injections", [(2, 70), (3, 46)])
def test_every_fault_ends_exact_or_in_the_same_error_now_or_at_the_next_call(
    world_size, injections, detector
) -> None:
    counts = _check_faults(world_size, injections, seed=world_size, detector=detector)
    assert sum(counts.values()) == injections
    for (fault, kind), _ in counts.items():
        if fault in MUST_ERROR_NOW:
            assert kind == "error", (fault, kind)
        if fault in MUST_BE_EXACT:
            assert kind == "exact", (fault, kind)
    assert {fault for fault, _ in counts} == set(workers.BUCKET_FAULTS)
    assert counts[("recv_flip", "next_call")] + counts[("recv_garbage", "next_call")] > 0


@pytest.mark.slow
@pytest.mark.parametrize("detector", ["hash", "exact"])
@pytest.mark.parametrize("world_size, injections", [(2, 1500), (3, 800)])
def test_many_bucket_faults_slow(world_size: int, injections: int, detector: str) -> None:
    counts = _check_faults(world_size, injections, seed=100 + world_size, detector=detector)
    assert sum(counts.values()) == injections
