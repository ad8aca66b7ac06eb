"""The simulator's one intermediate form: an iteration of every rank as an op graph, built from a bundle's
events (trace schema v2).

Ops are the events: compute and optimizer segments and codec work on each rank's main thread, and
collectives on their own streams. Edges:

- **program order**: the main thread runs one op at a time, in its measured order;
- **waits**: where the main thread sat idle between two ops it was blocked on a collective — the one that
  ended last inside the idle interval is its dependency (`blocker`); what remains of the idle time after
  that end (Python between hooks, a wakeup) is a fixed `lag_s`;
- **issue points**: a collective is issued by the main-thread op that had ended last before `issued_s`
  (plus the same kind of lag). An asynchronous collective is issued from inside a main-thread segment (the
  call does not end it): that op is cut at the issue point and the part before it issues the collective,
  so the issue moves with the work when the work is slowed or sped up;
- **stream order**: a collective starts after the previous op on its stream;
- **coupling across ranks**: the k-th collective issued on a stream is the same collective on every rank
  (gloo and NCCL run a group's collectives in issue order). It cannot finish before its last participant
  has issued it (no byte leaves a rank before that): each rank's `tail_s` is its measured end minus the
  group's last issue. The recorded start on a stream (issue, or the previous op's end) is not a safe
  coupling point — gloo's worker threads can start a rank's next transfer before its previous one is
  reported done — so a collective ends at the later of its own stream path (start + `duration_s`) and its
  group path (last issue + `tail_s`); at the measured values both give its measured end.

Evaluated at the measured durations (`sim.evaluate.evaluate(graph)`) the graph gives back the measured
iteration: the check that it holds every dependency that shaped it. Projections (`sim.rewrite`) are
stated rewrites of this graph; they never build a second model beside it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from .errors import SimInputError

MAIN_THREAD_STREAMS = ("compute", "gather_host", "optim", "codec_send", "codec_recv")
COLLECTIVE_STREAMS = ("allgather", "reduce_scatter", "all_reduce")
# Device kernels a rewrite puts on side streams (CIERA's codec under CCP): off the main thread, issued
# like a collective and run in order on their stream, but one rank's own work (no coupling, no link).
KERNEL_STREAMS = ("ccp_send", "ccp_recv")
TOLERANCE_S = 1e-6


@dataclass(frozen=True)
class OpGraph:
    """One iteration of every rank. Arrays are indexed by op; a reference to another op is its index, -1
    for none. Ops of one rank are contiguous and in measured start order."""

    rank: np.ndarray  # int
    stream: np.ndarray  # object: stream name
    layer: np.ndarray  # int: 0 embedding, 1..L blocks, L+1 head, -1 none
    phase: np.ndarray  # object: fwd | recompute | bwd | optim
    duration_s: np.ndarray  # measured end − start (its stream path, for a collective)
    tail_s: np.ndarray  # collective: measured end − its group's last issue (its group path); main op: 0
    lag_s: np.ndarray  # fixed delay after the op's dependencies are met
    main_prev: np.ndarray  # main op: previous main op of its rank; collective: its issuing main op
    stream_prev: np.ndarray  # collective: previous op on the same stream of its rank
    blocker: np.ndarray  # main op: the collective its rank waited for before it
    offset_s: np.ndarray  # start of a rank's first op on the aligned clock (its barrier exit)
    raw_bytes: np.ndarray  # float: full uncompressed size S of a collective
    wire_bytes: np.ndarray  # float: what the collective moved
    group: np.ndarray  # collective: id shared by the same collective on every rank; main op: -1
    world_size: int
    measured_start_s: np.ndarray  # what the capture recorded (rewrites read overlaps from it)
    measured_end_s: np.ndarray
    issued_s: np.ndarray

    @cached_property
    def is_main(self) -> np.ndarray:
        # Computed once per graph (np.isin over an object array sorts it): every rewrite, cost and
        # evaluation step asks for it. Read-only, as it is shared.
        flags = np.isin(self.stream, MAIN_THREAD_STREAMS)
        flags.flags.writeable = False
        return flags

    @property
    def size(self) -> int:
        return len(self.duration_s)


@dataclass
class _Columns:
    """One iteration's events as plain arrays (one per column the graph reads), in some row order."""

    rank: np.ndarray
    stream: np.ndarray  # object
    layer: np.ndarray
    phase: np.ndarray  # object
    start: np.ndarray
    end: np.ndarray
    issued: np.ndarray
    raw: np.ndarray
    wire: np.ndarray

    @classmethod
    def of(cls, events: pd.DataFrame) -> _Columns:
        return cls(
            rank=events["rank"].to_numpy(dtype=int),
            stream=events["stream"].to_numpy(dtype=object),
            layer=events["layer"].to_numpy(dtype=int),
            phase=events["phase"].to_numpy(dtype=object),
            start=events["start_s"].to_numpy(dtype=float),
            end=events["end_s"].to_numpy(dtype=float),
            issued=events["issued_s"].to_numpy(dtype=float),
            raw=events["raw_bytes"].to_numpy(dtype=float),
            wire=events["wire_bytes"].to_numpy(dtype=float),
        )

    def take(self, rows: np.ndarray) -> _Columns:
        return _Columns(**{name: values[rows] for name, values in vars(self).items()})

    def __len__(self) -> int:
        return len(self.start)


def _in_start_order(columns: _Columns) -> _Columns:
    """The rows sorted by start, then end; ties keep their order (a stable sort, as the capture wrote them)."""
    return columns.take(np.lexsort((columns.end, columns.start)))


def _rank_arrays(columns: _Columns) -> dict[str, np.ndarray]:
    """The edges of one rank's iteration (events of one run, rank and iteration, in start order)."""
    # Plain lists: the loop below reads them element by element (numpy scalars would cost more, and
    # are the same floats).
    streams = columns.stream.tolist()
    start = columns.start.tolist()
    end = columns.end.tolist()
    issued = columns.issued.tolist()
    count = len(columns)
    is_main = np.isin(columns.stream, MAIN_THREAD_STREAMS).tolist()
    main_prev = np.full(count, -1)
    stream_prev = np.full(count, -1)
    blocker = np.full(count, -1)
    lag = np.zeros(count)
    collective_ends = sorted((end[i], i) for i in range(count) if not is_main[i])
    ends_only = [e for e, _ in collective_ends]
    last_main = -1
    # The main thread runs one op at a time, so its ends only grow: a collective's issuer is found by
    # bisection over them.
    main_ends: list[float] = []
    main_indices: list[int] = []
    last_on_stream: dict[str, int] = {}
    for index in range(count):
        if is_main[index]:
            previous_end = end[last_main] if last_main >= 0 else 0.0
            ready = previous_end
            if start[index] - previous_end > TOLERANCE_S and len(ends_only):
                position = bisect.bisect_right(ends_only, start[index] + TOLERANCE_S) - 1
                if position >= 0 and ends_only[position] >= previous_end - TOLERANCE_S:
                    blocker[index] = collective_ends[position][1]
                    ready = max(ready, ends_only[position])
            main_prev[index] = last_main
            lag[index] = max(0.0, start[index] - ready)
            last_main = index
            main_ends.append(end[index])
            main_indices.append(index)
        else:
            position = bisect.bisect_right(main_ends, issued[index] + TOLERANCE_S) - 1
            issuer = main_indices[position] if position >= 0 else -1
            main_prev[index] = issuer
            issue_ready = end[issuer] if issuer >= 0 else 0.0
            lag[index] = max(0.0, issued[index] - issue_ready)
            stream_prev[index] = last_on_stream.get(streams[index], -1)
            last_on_stream[streams[index]] = index
    return {"main_prev": main_prev, "stream_prev": stream_prev, "blocker": blocker, "lag_s": lag}


def _split_at_issues(ordered: _Columns) -> _Columns:
    """One rank's events (in start order) with every main-thread op inside which the rank issued a
    collective cut at each such issue point (an asynchronous call does not end a segment): the collective
    is then issued by the part before it, so its issue moves with that work when the work is slowed or
    sped up (shared cores), instead of staying a fixed time after the op's start."""
    is_main = np.isin(ordered.stream, MAIN_THREAD_STREAMS)
    issued = np.sort(ordered.issued[~is_main])
    if not len(issued) or not is_main.any():
        return ordered
    start, end = ordered.start, ordered.end
    low = np.searchsorted(issued, start + TOLERANCE_S, side="right")
    high = np.searchsorted(issued, end - TOLERANCE_S, side="left")
    cut = is_main & (high > low)
    if not cut.any():
        return ordered
    rows, times = [], []
    for position in np.flatnonzero(cut):
        points = [start[position]]
        for t in issued[low[position] : high[position]]:
            if t - points[-1] > TOLERANCE_S:
                points.append(float(t))
        points.append(end[position])
        for a, b in zip(points[:-1], points[1:], strict=True):
            rows.append(position)
            times.append((a, b))
    # The uncut rows, then the parts, sorted again (stably) by start and end.
    kept = np.flatnonzero(~cut)
    split = ordered.take(np.concatenate([kept, np.asarray(rows, dtype=np.int64)]))
    bounds = np.array(times)
    split.issued[len(kept) :] = bounds[:, 0]
    split.start[len(kept) :] = bounds[:, 0]
    split.end[len(kept) :] = bounds[:, 1]
    return _in_start_order(split)


def build_graph(events: pd.DataFrame) -> OpGraph:
    """The op graph of one iteration from its events (one run, one iteration, every rank)."""
    if events.empty:
        raise SimInputError("events: an iteration without events has no graph")
    columns = _Columns.of(events)
    pieces: list[_Columns] = []
    arrays: dict[str, list[np.ndarray]] = {"main_prev": [], "stream_prev": [], "blocker": [], "lag_s": []}
    offset = 0
    ranks = sorted(int(r) for r in set(columns.rank.tolist()))
    for rank in ranks:
        ordered = _split_at_issues(_in_start_order(columns.take(np.flatnonzero(columns.rank == rank))))
        per_rank = _rank_arrays(ordered)
        for name in ("main_prev", "stream_prev", "blocker"):
            values = per_rank[name]
            arrays[name].append(np.where(values >= 0, values + offset, -1))
        arrays["lag_s"].append(per_rank["lag_s"])
        pieces.append(ordered)
        offset += len(ordered)
    frame = _Columns(**{name: np.concatenate([getattr(p, name) for p in pieces]) for name in vars(pieces[0])})
    start, end, rank = frame.start, frame.end, frame.rank
    group = _couple(frame, len(ranks))
    tail = np.zeros(len(frame))
    collective = group >= 0
    if collective.any():
        last_issue = np.full(int(group.max()) + 1, -np.inf)
        np.maximum.at(last_issue, group[collective], frame.issued[collective])
        tail[collective] = end[collective] - last_issue[group[collective]]
    offsets = np.zeros(len(frame))
    for r in ranks:
        first = np.flatnonzero(rank == r)[0]
        offsets[first] = start[first]
    return OpGraph(
        rank=rank,
        stream=frame.stream,
        layer=frame.layer,
        phase=frame.phase,
        duration_s=end - start,
        tail_s=tail,
        lag_s=np.concatenate(arrays["lag_s"]),
        main_prev=np.concatenate(arrays["main_prev"]),
        stream_prev=np.concatenate(arrays["stream_prev"]),
        blocker=np.concatenate(arrays["blocker"]),
        offset_s=offsets,
        raw_bytes=frame.raw,
        wire_bytes=frame.wire,
        group=group,
        world_size=len(ranks),
        measured_start_s=start,
        measured_end_s=end,
        issued_s=frame.issued,
    )


def _couple(frame: _Columns, ranks: int) -> np.ndarray:
    """Group id per collective: the k-th collective issued on a stream is one collective on every rank.
    Ranks that disagree on how many collectives a stream ran (or on their sizes) are not one group."""
    group = np.full(len(frame), -1)
    next_id = 0
    for name in COLLECTIVE_STREAMS:
        chosen = np.flatnonzero(frame.stream == name)
        if not len(chosen):
            continue
        per_rank = []
        for rank in np.unique(frame.rank[chosen]).tolist():
            mine = chosen[frame.rank[chosen] == rank]
            per_rank.append(mine[np.lexsort((frame.start[mine], frame.issued[mine]))])
        counts = {len(indices) for indices in per_rank}
        if len(per_rank) != ranks or len(counts) != 1:
            raise SimInputError(
                f"events: the ranks ran different numbers of {name} collectives ({sorted(counts)}); "
                "they cannot be coupled into one iteration"
            )
        indices = np.vstack(per_rank)
        sizes = frame.raw[indices]
        if (sizes != sizes[0]).any():
            raise SimInputError(f"events: the k-th {name} collective has different sizes on different ranks")
        group[indices] = next_id + np.arange(indices.shape[1])
        next_id += indices.shape[1]
    return group


def iteration_graphs(events: pd.DataFrame) -> dict[int, OpGraph]:
    """Every iteration of one run's events as its graph."""
    return {int(iteration): build_graph(rows) for iteration, rows in events.groupby("iteration", sort=True)}
