"""`graph_edit.to_graph` runs each rank's collectives of a stream in issue order (the listed order among
those one op issues), as gloo and NCCL run a group's: a trace can hold two gathers started against their
issue order, and once a rewrite moved issue points, the listed order closed a cycle the evaluator reported
as a graph bug (a fresh OLMoE capture's depth rewrite deadlocked at 27,523 ops)."""

from __future__ import annotations

import pytest

from sim.evaluate import evaluate
from sim.graph_edit import EditableOp, to_graph


def _rank(rank: int) -> list[EditableOp]:
    """Main ops a → b → c → d. Gather `late` (issued by c) is listed on the stream before gather `early`
    (issued by a), as a trace that started them against their issue order lists them; b waits for
    `early`."""
    a = EditableOp(rank, "compute", 1, "fwd", 0.1)
    early = EditableOp(rank, "allgather", 1, "fwd", 0.05, raw_bytes=1000, wire_bytes=1000, issuer=a)
    b = EditableOp(rank, "compute", 1, "fwd", 0.1, main_prev=a, blocker=early)
    c = EditableOp(rank, "compute", 1, "fwd", 0.1, main_prev=b)
    late = EditableOp(rank, "allgather", 2, "fwd", 0.05, raw_bytes=1000, wire_bytes=1000, issuer=c)
    d = EditableOp(rank, "compute", 2, "fwd", 0.1, main_prev=c, blocker=late)
    return [a, late, early, b, c, d]


def test_a_stream_runs_its_collectives_in_issue_order() -> None:
    graph = to_graph({0: _rank(0), 1: _rank(1)}, world=2)
    for rank in (0, 1):
        late, early = (
            k for k in range(graph.size) if graph.rank[k] == rank and graph.stream[k] == "allgather"
        )
        # Listed second, but issued first: it runs first, not behind `late`, which its own wait holds back.
        assert graph.stream_prev[early] == -1
        # Listed first, issued second: it runs after `early`.
        assert graph.stream_prev[late] == early
    # The same k-th collective on each rank is still one group.
    gathers = graph.stream == "allgather"
    assert sorted(graph.group[gathers & (graph.rank == 0)]) == sorted(
        graph.group[gathers & (graph.rank == 1)]
    )
    result = evaluate(graph)  # deadlocked before: b waited for `early`, stuck behind `late`, issued after b
    assert result.iteration_s == pytest.approx(0.45, abs=0.1)


def test_in_issue_order_the_stream_keeps_its_listed_order() -> None:
    ops = _rank(0)
    a, late, early = ops[0], ops[1], ops[2]
    late.issuer = a  # both issued by a: the listed order stands
    early.issuer = a
    graph = to_graph({0: ops}, world=1)
    first, second = (k for k in range(graph.size) if graph.stream[k] == "allgather")
    assert graph.stream_prev[second] == first


def test_the_ranks_are_coupled_in_issue_order_not_list_order() -> None:
    """Rank 0 lists `late` before `early` (a trace that started them against their issue order), rank 1 in
    issue order: the gather each rank issued first is one collective, as `opgraph._couple` couples a
    traced graph's (by issue) and as gloo matches them; coupled by list position, rank 0's `late` would be
    one collective with rank 1's `early`, and each would wait for a peer issued at another point."""
    swapped = _rank(0)
    a, late, early, b, c, d = swapped
    in_order = _rank(1)
    a1, late1, early1, b1, c1, d1 = in_order
    graph = to_graph({0: swapped, 1: [a1, early1, b1, c1, late1, d1]}, world=2)
    gathers = [k for k in range(graph.size) if graph.stream[k] == "allgather"]
    by_rank_layer = {(int(graph.rank[k]), int(graph.layer[k])): int(graph.group[k]) for k in gathers}
    assert by_rank_layer[(0, 1)] == by_rank_layer[(1, 1)]  # `early` (layer 1) with `early`
    assert by_rank_layer[(0, 2)] == by_rank_layer[(1, 2)]  # `late` (layer 2) with `late`
    assert by_rank_layer[(0, 1)] != by_rank_layer[(0, 2)]
    assert evaluate(graph).iteration_s == pytest.approx(0.45, abs=0.1)
