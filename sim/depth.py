"""The depth rewrite: an iteration's op graph traced at L blocks rewritten to N blocks by repeating (or
dropping) its per-block subgraphs — the ops of a block **and their edges** — not by repeating events and
re-deriving the edges from shifted times.

Each rank's ops are cut into **windows** at its main thread's compute: a forward block window runs from
the first compute op of block l's forward to the first of the next block's; a backward block window from
the first op of block l's recompute or backward to the first of block l − 1's (glue ops outside any layer
stay in the window they fall in). The embedding, the head, the loss and the optimizer step are windows
of their own and are kept once. A block's collective belongs to the window of the main-thread op it
serves (the first of its layer and phase: a prefetched gather is repeated with the block whose parameters
it moves); any other collective to the window whose op issued it, or to the last block window of that
phase when that is a block window (so it is copied once) — program order and labels, not timing, so every
rank cuts the same collectives into the same window.

The target iteration is the sequence: what comes before block 1, forward windows of target blocks 1..N,
what lies between the forward and the backward blocks (head, loss), backward windows N..1, the rest
(embedding backward, optimizer). Target block 1 and N are the traced first and last blocks (their
neighbours differ: the embedding, the head); the blocks between are the traced interior blocks in turn.
Layers are relabelled to the target's: a copy of traced block l placed as block i is layer i, the head is
N + 1.

**Edges are carried, not re-derived.** Every op of the target is a copy of a traced op and keeps its
lag, its measured tail and its durations. An edge inside a window goes to the same copy of its other end.
An edge that leaves the window keeps its place in program order relative to the window:

- a collective issued from another window (a prefetched gather, issued during the block before the one it
  serves) is issued by the main op that lies, in the target's program order, as many main ops before (or
  after) the first op of its window as its traced issuer lay before the traced window's first op — "the
  op k steps before the block it serves", with the traced lag after it;
- a main op that waited for a collective of another window waits for the collective that lies as many
  collectives of that stream before (or after) its window's first one as in the traced graph.

So a prefetch's issue point stays where the engine's rule puts it — a number of ops ahead, moving with
the work — whatever the copied neighbour window's duration or the conditions its lead was measured under
(a lead measured at 200 Mbit included a reduce-scatter's wait that a faster link does not have).
A rank's collectives of one stream run in window order (those serving an earlier window first), and the
k-th of a stream is the same collective on every rank.

**Per-block compute fitted across the traced depths.** Copies carry the traced blocks' compute, which
is one run's: a run whose blocks ran slow or fast (the host drifted) would pass that on to every block
added. Given `block_compute_s` — one block's main-thread compute per rank and iteration, the mean over
every block of every traced depth of the same system and cluster (`sim.predict.fit_block_compute`) — the
copied blocks' compute ops are scaled by one factor so that the target iteration's compute is the traced
one's plus that much per block added (less per block dropped): the anchor's own iteration stays as
measured, the pooled blocks set only the change. (On the three shipped bundles, the pooled mean
predicts a held-out depth's compute better than the anchor's own blocks or the slope of a line through
the traced runs' totals, which amplifies one run's drift: `benchmarks/depth_rule.py`.) Measured start
and end times stay as traced (the cluster rewrite reads overlaps from them); the evaluator runs each op
at its new duration.

Two things depend on the parameter count and are scaled by it: the optimizer step's work, and the
gradient collectives that carry the blocks' gradients — those of no layer, and, where no block reduces
its own, every one outside the blocks (ZeRO-3 reduces every gradient in one bucket once the embedding's
last gradient is in; the capture labels it layer 0); the embedding's and head's own collectives are
kept as traced. The measured times of the copies (which the
cluster rewrite reads overlaps from) are the traced ones shifted to where the window lies in the target.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import SimInputError
from .graph_edit import EditableOp, relink_main, to_graph
from .opgraph import OpGraph

_GRADIENT_STREAMS = ("reduce_scatter", "all_reduce")
# Main-thread streams labelled with the layer the program is in (the engine's gather path runs inside it).
PROGRAM_STREAMS = ("compute", "gather_host", "optim")


def _window_key(stream: str, phase: str, layer: int, layers: int) -> tuple[str, int] | None:
    """The block window a main-thread op opens (or None: it stays in the current window)."""
    if stream not in PROGRAM_STREAMS:
        return None  # codec work names the shard it codes, not where the program is
    if 1 <= layer <= layers and phase == "fwd":
        return ("fwd", layer)
    if 1 <= layer <= layers and phase in ("recompute", "bwd"):
        return ("bwd", layer)
    if layer in (0, layers + 1) or phase == "optim":
        return ("other", layer)
    return None


class _RankWindows:
    """One rank's ops (graph indices, in graph order) cut into windows."""

    def __init__(self, graph: OpGraph, rank: int, layers: int) -> None:
        self.ops = np.flatnonzero(graph.rank == rank)
        is_main = graph.is_main[self.ops]
        self.main = self.ops[is_main]
        if not len(self.main):
            raise SimInputError(f"depth rewrite: rank {rank} has no main-thread ops")
        self.window: dict[int, int] = {}
        self.keys: list[tuple[str, int]] = []
        current: tuple[str, int] | None = None
        for op in self.main:
            key = _window_key(str(graph.stream[op]), str(graph.phase[op]), int(graph.layer[op]), layers)
            if current is None and key is None:
                key = ("other", -1)
            if key is not None and key != current:
                current = key
                self.keys.append(key)
            self.window[int(op)] = len(self.keys) - 1
        # Where each window starts in the rank's program order (its first main op).
        self.main_position = {int(op): k for k, op in enumerate(self.main)}
        self.first_main = np.zeros(len(self.keys), dtype=int)
        for k in range(len(self.main) - 1, -1, -1):
            self.first_main[self.window[int(self.main[k])]] = k
        # A collective goes with the block it serves: a block's collectives (layer 1..L) with the window
        # of the first op of their layer and phase — a prefetched gather issued a step ahead still moves
        # its own block's parameters, so it is repeated with that block, not with the block that issued
        # it. Any other collective (embedding, head, layer −1) is kept once: with the window of its issuer,
        # or, when that is a block window (a head gather prefetched during an interior block, which is
        # repeated), with the last block window of that phase, which is copied once.
        first_of: dict[tuple[int, str], int] = {}
        for op in self.main:
            if graph.stream[op] in PROGRAM_STREAMS:
                first_of.setdefault((int(graph.layer[op]), str(graph.phase[op])), int(op))
        last_block = {
            "fwd": self.keys.index(("fwd", layers)) if ("fwd", layers) in self.keys else -1,
            "bwd": self.keys.index(("bwd", 1)) if ("bwd", 1) in self.keys else -1,
        }
        for op in self.ops[~is_main]:
            layer, phase = int(graph.layer[op]), str(graph.phase[op])
            served = first_of.get((layer, phase), -1) if 1 <= layer <= layers else -1
            if served >= 0:
                self.window[int(op)] = self.window[served]
                continue
            issuer = int(graph.main_prev[op])
            window = self.window[issuer] if issuer >= 0 else 0
            kind = self.keys[window][0]
            self.window[int(op)] = last_block[kind] if last_block.get(kind, -1) >= 0 else window
        self.members: list[list[int]] = [[] for _ in self.keys]
        for op in self.ops:  # graph order: program order for main ops, stream order for collectives
            self.members[self.window[int(op)]].append(int(op))
        # Each window's span on the traced clock: from its first main op's start to the next window's.
        starts = graph.measured_start_s[self.main[self.first_main]]
        last_end = float(graph.measured_end_s[self.ops].max())
        self.span = [
            (float(starts[w]), float(starts[w + 1]) if w + 1 < len(starts) else last_end)
            for w in range(len(self.keys))
        ]
        # Per stream, the collectives in window order (then stream order): where each lies, and where
        # each window's first one would be.
        self.stream_order: dict[str, list[int]] = {}
        for window_members in self.members:
            for op in window_members:
                if not graph.is_main[op]:
                    self.stream_order.setdefault(str(graph.stream[op]), []).append(op)
        self.stream_position = {op: k for ops in self.stream_order.values() for k, op in enumerate(ops)}
        self.stream_windows = {
            name: np.array([self.window[op] for op in ops]) for name, ops in self.stream_order.items()
        }


def check_target_depth(layers: int, model: str, full_layers: int) -> None:
    """A depth rewrite goes from 1 block to the model's published depth, no further: past it there is no
    such model (and a typo such as 1000 would build a graph of millions of ops)."""
    if not 1 <= layers <= full_layers:
        raise SimInputError(f"--layers {layers}: model {model!r} has 1..{full_layers} blocks")


def block_map(traced_layers: int, target_layers: int) -> list[int]:
    """Which traced block each target block 1..N copies: the first and last as traced, the interior
    blocks in turn."""
    if target_layers < 1 or traced_layers < 1:
        raise SimInputError(f"depth rewrite: {traced_layers} → {target_layers} blocks, expected >= 1")
    if target_layers == 1:
        return [1]
    interior = list(range(2, traced_layers)) or [1 if traced_layers == 1 else traced_layers]
    middle = [interior[i % len(interior)] for i in range(target_layers - 2)]
    return [1, *middle, traced_layers]


def _target_sequence(
    windows: _RankWindows, mapping: list[int], rank: int
) -> list[tuple[int, dict[int, int], bool]]:
    """(traced window, layer relabelling, parameter-scaled) of the target's windows in order."""
    keys = windows.keys
    traced_layers = max((key[1] for key in keys if key[0] == "fwd"), default=0)
    missing = [layer for layer in range(1, traced_layers + 1) if ("fwd", layer) not in keys]
    if missing or not traced_layers:
        raise SimInputError(
            f"depth rewrite: rank {rank} has no forward window of block {missing[0] if missing else 1} "
            "(the events do not name their layers)"
        )
    target_layers = len(mapping)
    head = {traced_layers + 1: target_layers + 1}
    first_fwd, last_fwd = keys.index(("fwd", 1)), keys.index(("fwd", traced_layers))
    backward = [i for i, key in enumerate(keys) if key[0] == "bwd"]
    first_bwd = min(backward) if backward else len(keys)
    last_bwd = max(backward) if backward else len(keys) - 1

    def kept(positions: range) -> list[tuple[int, dict[int, int], bool]]:
        return [(w, head, keys[w][0] == "other") for w in positions]

    def blocks(phase: str, order: list[tuple[int, int]]) -> list[tuple[int, dict[int, int], bool]]:
        return [
            (keys.index((phase, source)), {**head, source: target}, False)
            for target, source in order
            if (phase, source) in keys
        ]

    numbered = list(enumerate(mapping, start=1))
    return [
        *kept(range(first_fwd)),
        *blocks("fwd", numbered),
        *kept(range(last_fwd + 1, first_bwd)),
        *blocks("bwd", list(reversed(numbered))),
        *kept(range(last_bwd + 1, len(keys))),
    ]


def repeat_blocks(
    graph: OpGraph,
    traced_layers: int,
    target_layers: int,
    parameter_ratio: float,
    block_compute_s: float | None = None,
) -> OpGraph:
    """The graph of one iteration (every rank) rewritten from `traced_layers` to `target_layers` blocks.
    `parameter_ratio` (the target's parameter count over the traced one's) scales the optimizer step and
    the gradient collectives of no layer; `block_compute_s` (one block's compute per rank and iteration,
    `sim.predict.fit_block_compute`), when given, is what each block added or dropped changes the compute
    by. At the traced depth the graph is returned unchanged."""
    if target_layers == traced_layers:
        return graph
    mapping = block_map(traced_layers, target_layers)
    ops_by_rank: dict[int, list[EditableOp]] = {}
    origin: dict[int, tuple[int, int]] = {}  # id(copy) -> (target window, traced op)
    # Where no block reduces its own gradients (ZeRO-3's one bucket, reduced once the embedding's last
    # gradient is in: labelled layer 0), the reductions outside the blocks carry every block's.
    gradients = np.isin(graph.stream, _GRADIENT_STREAMS)
    blocks_reduce = bool((gradients & (graph.layer >= 1) & (graph.layer <= traced_layers)).any())
    for rank in sorted(set(graph.rank.tolist())):
        ops_by_rank[rank] = _repeat_rank(
            graph, rank, traced_layers, mapping, parameter_ratio, origin, blocks_reduce
        )
    rewritten = to_graph(ops_by_rank, graph.world_size)
    rewritten = _couple(
        graph, rewritten, [origin[id(op)] for rank in sorted(ops_by_rank) for op in ops_by_rank[rank]]
    )
    if block_compute_s is None:
        return rewritten
    return _add_pooled_blocks(graph, rewritten, target_layers - traced_layers, block_compute_s, target_layers)


def _add_pooled_blocks(
    traced: OpGraph, rewritten: OpGraph, added_blocks: int, block_compute_s: float, target_layers: int
) -> OpGraph:
    """`rewritten` with its blocks' compute ops scaled by one factor, so that its compute per rank is the
    traced iteration's plus `block_compute_s` per block added."""
    if not (np.isfinite(block_compute_s) and block_compute_s >= 0):
        raise SimInputError(
            f"depth rewrite: per-block compute {block_compute_s!r} s, expected a finite time >= 0"
        )
    ranks = max(len(np.unique(traced.rank)), 1)
    compute = rewritten.stream == "compute"
    in_blocks = compute & (rewritten.layer >= 1) & (rewritten.layer <= target_layers)
    traced_s = float(traced.duration_s[traced.stream == "compute"].sum()) / ranks
    outside_s = float(rewritten.duration_s[compute & ~in_blocks].sum()) / ranks
    blocks_s = float(rewritten.duration_s[in_blocks].sum()) / ranks
    wanted_blocks_s = traced_s + added_blocks * block_compute_s - outside_s
    if blocks_s <= 0 or wanted_blocks_s <= 0:
        raise SimInputError(
            f"depth rewrite: {target_layers} blocks at {block_compute_s * 1e3:.1f} ms of compute per block "
            f"from the traced {traced_s * 1e3:.1f} ms leave the blocks no compute; expected a deeper target"
        )
    duration = np.where(in_blocks, rewritten.duration_s * (wanted_blocks_s / blocks_s), rewritten.duration_s)
    return dataclasses.replace(rewritten, duration_s=duration)


def _repeat_rank(
    graph: OpGraph,
    rank: int,
    layers: int,
    mapping: list[int],
    ratio: float,
    origin: dict[int, tuple[int, int]],
    blocks_reduce: bool,
) -> list[EditableOp]:
    windows = _RankWindows(graph, rank, layers)
    sequence = _target_sequence(windows, mapping, rank)
    copies: dict[tuple[int, int], EditableOp] = {}
    ordered: list[EditableOp] = []
    placed: list[tuple[int, int]] = []  # (target window, traced op) of each copy, in target order
    clock: float | None = None
    for position, (window, relabel, scaled) in enumerate(sequence):
        start, end = windows.span[window]
        clock = start if clock is None else clock
        shift, grown = clock - start, 0.0
        for op in windows.members[window]:
            layer = int(graph.layer[op])
            copy = EditableOp(
                rank=rank, stream=str(graph.stream[op]), layer=relabel.get(layer, layer),
                phase=str(graph.phase[op]), duration_s=float(graph.duration_s[op]),
                lag_s=float(graph.lag_s[op]), raw_bytes=float(graph.raw_bytes[op]),
                wire_bytes=float(graph.wire_bytes[op]), offset_s=float(graph.offset_s[op]),
                tail_s=float(graph.tail_s[op]),
                measured_start_s=float(graph.measured_start_s[op]) + shift + grown,
                measured_end_s=float(graph.measured_end_s[op]) + shift + grown,
                issued_s=float(graph.issued_s[op]) + shift + grown,
            )  # fmt: skip
            if scaled:
                grown += _scale_parameter_work(copy, layer, ratio, blocks_reduce)
            copies[(position, op)] = copy
            origin[id(copy)] = (position, op)
            ordered.append(copy)
            placed.append((position, op))
        clock += (end - start) + grown
    relink_main(ordered)
    # Where each target window starts in the target's program order and in each stream's order.
    target_window = [p for p, _ in placed]
    main_positions = [k for k, op in enumerate(ordered) if op.is_main]
    main_window = np.array([target_window[k] for k in main_positions])
    target_first_main = np.searchsorted(main_window, np.arange(len(sequence)), side="left")
    target_streams: dict[str, list[int]] = {}
    for k, op in enumerate(ordered):
        if not op.is_main:
            target_streams.setdefault(op.stream, []).append(k)
    target_stream_windows = {
        name: np.array([target_window[k] for k in ks]) for name, ks in target_streams.items()
    }

    def main_counterpart(position: int, window: int, traced_op: int) -> EditableOp | None:
        """The target main op as far before (after) the first op of target window `position` as
        `traced_op` lies before (after) the first op of traced window `window`."""
        offset = windows.main_position[traced_op] - int(windows.first_main[window])
        k = int(target_first_main[position]) + offset
        k = min(max(k, 0), len(main_positions) - 1)
        return ordered[main_positions[k]]

    def stream_counterpart(position: int, window: int, traced_op: int) -> EditableOp | None:
        """The target collective as many of its stream before (after) the first one of target window
        `position` as `traced_op` lies before (after) the first one of traced window `window`."""
        name = str(graph.stream[traced_op])
        base = int(np.searchsorted(windows.stream_windows[name], window, side="left"))
        offset = windows.stream_position[traced_op] - base
        target = target_stream_windows.get(name)
        if target is None:
            return None
        k = int(np.searchsorted(target, position, side="left")) + offset
        return ordered[target_streams[name][k]] if 0 <= k < len(target) else None

    for (position, op), copy in zip(placed, ordered, strict=True):
        issuer = int(graph.main_prev[op])
        if not copy.is_main and issuer >= 0:
            window = windows.window[op]
            copy.issuer = (
                copies[(position, issuer)]
                if windows.window[issuer] == window
                else main_counterpart(position, window, issuer)
            )
    main_rank = {id(ordered[k]): rank_position for rank_position, k in enumerate(main_positions)}
    for (position, op), copy in zip(placed, ordered, strict=True):
        blocker = int(graph.blocker[op])
        if not copy.is_main or blocker < 0:
            continue
        window = windows.window[op]
        if windows.window[blocker] == window:
            copy.blocker = copies[(position, blocker)]
            continue
        counterpart = stream_counterpart(position, window, blocker)
        # A wait for a collective of a later window (the next block's prefetched gather) holds only if
        # its counterpart is issued before the waiting op: a copied neighbour may issue it later.
        if counterpart is not None and counterpart.issuer is not None:
            if main_rank[id(counterpart.issuer)] >= main_rank[id(copy)]:
                counterpart = None
        copy.blocker = counterpart
    return ordered


def _scale_parameter_work(op: EditableOp, traced_layer: int, ratio: float, blocks_reduce: bool) -> float:
    """Scale a kept window's optimizer op, or gradient collective that carries the blocks' gradients, by
    `ratio` (their work and bytes go with the parameter count). Returns how much later what follows it on
    the main thread starts on the measured clock."""
    # A gradient collective of no layer, or any outside the blocks where the blocks reduce none of their
    # own (ZeRO-3's bucket at the end), carries every layer's gradients; where the blocks reduce their
    # own, the embedding's or head's reduce-scatter (FSDP2, analytic runs) does not grow with depth.
    if op.stream == "optim":
        grown = op.duration_s * (ratio - 1.0)
        op.duration_s *= ratio
        op.measured_end_s += grown
        return grown
    if op.stream in _GRADIENT_STREAMS and (traced_layer < 0 or not blocks_reduce):
        grown = op.duration_s * (ratio - 1.0)
        op.duration_s *= ratio
        op.tail_s += grown
        op.measured_end_s += grown
        op.raw_bytes = float(round(op.raw_bytes * ratio))
        op.wire_bytes = float(round(op.wire_bytes * ratio))
    return 0.0


def _couple(traced: OpGraph, rewritten: OpGraph, origin: list[tuple[int, int]]) -> OpGraph:
    """The rewritten graph with its collectives coupled across ranks structurally: the copies of one
    traced collective (one group) placed in one target window are one collective. Every rank must have
    placed the traced group's members in the same window (windows are cut by program order and labels),
    else the ranks would not agree on what they run."""
    group = np.full(rewritten.size, -1)
    ids: dict[tuple[int, int], int] = {}
    for k in np.flatnonzero(rewritten.group >= 0):
        position, op = origin[k]
        group[k] = ids.setdefault((position, int(traced.group[op])), len(ids))
    sizes = np.bincount(group[group >= 0], minlength=len(ids))
    if len(ids) and (sizes != rewritten.world_size).any():
        raise SimInputError(
            f"depth rewrite: {int((sizes != rewritten.world_size).sum())} collectives were placed in different "
            "windows on different ranks; they cannot be coupled"
        )
    return dataclasses.replace(rewritten, group=group)
