"""An op graph (sim/opgraph.py) as editable objects: the form the system rewrites (sim/ciera_rewrite.py,
sim/system_rewrite.py) insert and replace ops in, then turn back into an `OpGraph`.

Edges are object references (`main_prev` for a main-thread op's predecessor, `issuer` for the main op that
issues a collective, `blocker` for the collective a main op waits for), so inserting an op never
renumbers anything; `to_graph` derives the indices, each stream's order and the cross-rank coupling (the
k-th collective of a stream on every rank is one group) from the edited lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from .opgraph import KERNEL_STREAMS, MAIN_THREAD_STREAMS, OpGraph


@dataclass(eq=False)  # ops are compared by identity
class EditableOp:
    rank: int
    stream: str
    layer: int
    phase: str
    duration_s: float
    lag_s: float = 0.0
    raw_bytes: float = 0.0
    wire_bytes: float = 0.0
    issuer: EditableOp | None = None
    blocker: EditableOp | None = None
    offset_s: float = 0.0
    tail_s: float = 0.0
    measured_start_s: float = 0.0
    measured_end_s: float = 0.0
    issued_s: float = 0.0
    main_prev: EditableOp | None = None

    @property
    def is_main(self) -> bool:
        return self.stream in MAIN_THREAD_STREAMS


def editable_ops(graph: OpGraph, rank: int) -> list[EditableOp]:
    """One rank's ops in the graph's order, with their edges as references."""
    indices = np.flatnonzero(graph.rank == rank)
    # The rank's columns as Python lists (one conversion per column, not one numpy scalar per field).
    stream, layer, phase = (
        graph.stream[indices].tolist(),
        graph.layer[indices].tolist(),
        graph.phase[indices].tolist(),
    )
    duration, lag = graph.duration_s[indices].tolist(), graph.lag_s[indices].tolist()
    raw, wire = graph.raw_bytes[indices].tolist(), graph.wire_bytes[indices].tolist()
    offset, tail = graph.offset_s[indices].tolist(), graph.tail_s[indices].tolist()
    start, end = graph.measured_start_s[indices].tolist(), graph.measured_end_s[indices].tolist()
    issued = graph.issued_s[indices].tolist()
    ops = [
        EditableOp(
            rank=rank, stream=str(stream[k]), layer=int(layer[k]), phase=str(phase[k]),
            duration_s=float(duration[k]), lag_s=float(lag[k]),
            raw_bytes=float(raw[k]), wire_bytes=float(wire[k]),
            offset_s=float(offset[k]), tail_s=float(tail[k]),
            measured_start_s=float(start[k]), measured_end_s=float(end[k]),
            issued_s=float(issued[k]),
        )
        for k in range(len(indices))
    ]  # fmt: skip
    by_index = dict(zip(indices.tolist(), ops, strict=True))
    is_main = graph.is_main[indices].tolist()
    main_prev, blocker = graph.main_prev[indices].tolist(), graph.blocker[indices].tolist()
    for k, op in enumerate(ops):
        if is_main[k]:
            op.main_prev = by_index.get(main_prev[k])
            op.blocker = by_index.get(blocker[k])
        else:
            op.issuer = by_index.get(main_prev[k])
    return ops


def relink_main(ops: list[EditableOp]) -> None:
    """Program order is the order of a rank's main ops in `ops`: each one's `main_prev` is the one before
    it (a rank's first op keeps none)."""
    previous: EditableOp | None = None
    for op in ops:
        if op.is_main:
            op.main_prev = previous
            previous = op


_COLUMNS = (
    "rank", "stream", "layer", "phase", "duration_s", "tail_s", "lag_s", "offset_s", "raw_bytes", "wire_bytes",
    "measured_start_s", "measured_end_s", "issued_s",
)  # fmt: skip


def to_graph(ops_by_rank: dict[int, list[EditableOp]], world: int) -> OpGraph:
    """The `OpGraph` of edited ops (each rank's list in program order)."""
    ops = [op for rank in sorted(ops_by_rank) for op in ops_by_rank[rank]]
    index = {id(op): k for k, op in enumerate(ops)}

    def ref(op: EditableOp | None) -> int:
        # An edge to an op that is not in the graph (replaced by a rewrite) is no edge.
        return -1 if op is None else index.get(id(op), -1)

    count = len(ops)
    # Every field of every op in one pass, as columns (plain lists until they become the graph's arrays;
    # no ops: no columns, and each array below is empty).
    columns = dict(zip(_COLUMNS, zip(*map(attrgetter(*_COLUMNS), ops), strict=True), strict=False))
    streams = list(columns.get("stream", ()))
    main_streams = set(MAIN_THREAD_STREAMS)
    is_main = [name in main_streams for name in streams]
    main_prev = [ref(op.main_prev) if is_main[k] else ref(op.issuer) for k, op in enumerate(ops)]
    blocker = [ref(op.blocker) if is_main[k] else -1 for k, op in enumerate(ops)]
    stream_prev = [-1] * count
    position = [-1] * count
    per_stream: dict[str, int] = {}  # the most collectives a rank runs on each stream
    base = 0
    for rank in sorted(ops_by_rank):
        listed: dict[str, list[int]] = {}  # each stream's collectives, in list order
        for k in range(base, base + len(ops_by_rank[rank])):
            if not is_main[k]:
                listed.setdefault(streams[k], []).append(k)
        # A stream runs its collectives in issue order (gloo and NCCL run a group's in the order issued),
        # the listed order among those one op issues: a trace can hold a pair started against their issue
        # order (OLMoE's ZeRO-3 gathers with the gather path recorded), and a rewrite that moves issue
        # points would otherwise close a cycle (a wait for a collective stuck behind one issued later).
        # The ranks are coupled in that order too — the k-th issued is one collective on every rank, as
        # `opgraph._couple` couples a traced graph's — not in list order, which would pair a rank's
        # collective with another rank's issued at another point.
        for indices in listed.values():
            ordered = sorted(indices, key=lambda k: main_prev[k])
            for before, k in zip([-1, *ordered[:-1]], ordered, strict=True):
                stream_prev[k] = before
            for issued, k in enumerate(ordered):
                position[k] = issued
        for name, indices in listed.items():
            per_stream[name] = max(per_stream.get(name, 0), len(indices))
        base += len(ops_by_rank[rank])
    # Group ids: the k-th collective of a stream on every rank, numbered across streams; a side-stream
    # kernel is a group of its own (one rank's work).
    offsets, total = {}, 0
    for name in sorted(per_stream):
        offsets[name], total = total, total + per_stream[name]
    group = np.array(
        [offsets[streams[k]] + position[k] if position[k] >= 0 else -1 for k in range(count)], dtype=int
    )
    stream = np.array(streams, dtype=object)
    kernels = np.flatnonzero(np.isin(stream, KERNEL_STREAMS))
    group[kernels] = total + np.arange(len(kernels))

    def floats(name: str) -> np.ndarray:
        return np.array(columns.get(name, ()), dtype=float)

    return OpGraph(
        rank=np.array(columns.get("rank", ()), dtype=int),
        stream=stream,
        layer=np.array(columns.get("layer", ()), dtype=int),
        phase=np.array(columns.get("phase", ()), dtype=object),
        duration_s=floats("duration_s"),
        tail_s=floats("tail_s"),
        lag_s=floats("lag_s"),
        main_prev=np.array(main_prev, dtype=int),
        stream_prev=np.array(stream_prev, dtype=int),
        blocker=np.array(blocker, dtype=int),
        offset_s=floats("offset_s"),
        raw_bytes=floats("raw_bytes"),
        wire_bytes=floats("wire_bytes"),
        group=group,
        world_size=world,
        measured_start_s=floats("measured_start_s"),
        measured_end_s=floats("measured_end_s"),
        issued_s=floats("issued_s"),
    )
