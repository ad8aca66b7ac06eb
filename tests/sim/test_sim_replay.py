"""Replay of measured events (sim/replay.py): the graph reproduces its input at the measured durations, its
dependencies are the ones that shaped the timeline (hand-built cases), and it is monotone."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim.replay import build_rank_graph, evaluate


def _events(rows: list[tuple]) -> pd.DataFrame:
    """(stream, issued, start, end) rows of one rank and iteration."""
    return pd.DataFrame(rows, columns=["stream", "issued_s", "start_s", "end_s"]).assign(
        run_id="r", rank=0, iteration=0, layer=1, phase="fwd", raw_bytes=0, wire_bytes=0
    )


def test_the_main_thread_waits_for_the_gather_it_blocked_on() -> None:
    # compute 0–1 issues a gather (1–3); the main thread is blocked until 3, then computes 3–4.
    events = _events([("compute", 0.0, 0.0, 1.0), ("allgather", 1.0, 1.0, 3.0), ("compute", 3.0, 3.0, 4.0)])
    graph = build_rank_graph(events)
    start, end = evaluate(graph)
    np.testing.assert_allclose(end, [1.0, 3.0, 4.0])
    # A gather twice as fast: the second compute starts when it ends.
    _, faster = evaluate(graph, np.array([1.0, 1.0, 1.0]))
    np.testing.assert_allclose(faster, [1.0, 2.0, 3.0])


def test_an_overlapped_gather_does_not_hold_the_main_thread() -> None:
    # The gather (0.5–1.5) runs under compute (0–2); the next compute follows at once.
    events = _events([("compute", 0.0, 0.0, 2.0), ("allgather", 0.5, 0.5, 1.5), ("compute", 2.0, 2.0, 3.0)])
    graph = build_rank_graph(events)
    assert graph.blocker[2] == -1
    _, slower = evaluate(graph, np.array([2.0, 1.0, 1.0]))  # compute 1 now ends at 2 anyway
    assert slower[-1] == pytest.approx(3.0)


def test_idle_time_not_explained_by_a_collective_stays_a_fixed_lag() -> None:
    events = _events([("compute", 0.0, 0.0, 1.0), ("compute", 1.2, 1.2, 2.0)])
    graph = build_rank_graph(events)
    assert graph.lag_s[1] == pytest.approx(0.2)
    _, end = evaluate(graph, np.array([0.5, 0.8]))
    assert end[-1] == pytest.approx(1.5)


def test_collectives_on_one_stream_run_in_order_and_the_second_waits_for_the_first() -> None:
    events = _events(
        [
            ("compute", 0.0, 0.0, 0.1),
            ("allgather", 0.1, 0.1, 1.0),
            ("allgather", 0.1, 1.0, 2.0),  # issued at 0.1, started when the first ended
            ("compute", 2.0, 2.0, 2.5),
        ]
    )
    graph = build_rank_graph(events)
    assert graph.stream_prev[2] == 1 and graph.blocker[3] == 2
    _, end = evaluate(graph, np.array([0.1, 2.0, 1.0, 0.5]))
    np.testing.assert_allclose(end, [0.1, 2.1, 3.1, 3.6])


def test_longer_durations_never_shorten_the_iteration() -> None:
    rng = np.random.default_rng(3)
    rows, now = [], 0.0
    for _ in range(30):
        compute = rng.uniform(0.01, 0.1)
        rows.append(("compute", now, now, now + compute))
        issue = now + compute
        gather = rng.uniform(0.01, 0.2)
        rows.append(("allgather", issue, issue, issue + gather))
        now = issue + (gather if rng.random() < 0.5 else 0.0)
    graph = build_rank_graph(_events(rows))
    base = evaluate(graph)[1].max()
    for _ in range(20):
        longer = graph.duration_s * (1.0 + rng.uniform(0.0, 1.0, len(graph.duration_s)))
        assert evaluate(graph, longer)[1].max() >= base - 1e-12
