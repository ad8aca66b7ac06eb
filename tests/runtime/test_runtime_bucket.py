"""The bucket path: one collective per engine all-gather, one round in steady state, over real gloo groups."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _bucket_workers as workers  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(worker, world_size: int, *args) -> list:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        worker, args=(world_size, _free_port(), *args, results), nprocs=world_size, start_method="spawn"
    )
    return sorted(results.get() for _ in range(world_size))


@pytest.mark.parametrize("world_size", [2, 3])
def test_buckets_are_exact_in_one_round_with_rare_overflow(world_size: int) -> None:
    iterations = 12
    for rank, mismatches, gathers, calls, overflows, registrations, rounds, sent, raw, raw_messages in _run(
        workers.bucket_steady_worker, world_size, iterations
    ):
        assert mismatches == 0 and gathers == iterations * 3 * 8, rank
        assert calls == iterations * 9 and registrations == 3
        # One round per call, plus the registrations and the overflow rounds (the first gathers and the
        # churn burst only).
        assert rounds == calls + registrations + overflows
        assert overflows <= 6, overflows
        assert sent < raw
        assert raw_messages >= calls // 3  # the 7-value shard never pays


def test_a_decode_failure_surfaces_here_on_that_rank_and_at_the_next_call_on_the_others() -> None:
    results = {rank: (log, recoveries) for rank, log, recoveries in _run(workers.bucket_failure_worker, 3)}
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
