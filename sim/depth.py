"""The depth rewrite: an iteration traced at L blocks rewritten to N blocks by repeating (or dropping) the
per-block parts of its events; the one graph builder (sim/opgraph.py) then derives every edge of the
rewritten iteration from them, as it does for a traced one.

Each rank's iteration is cut into **windows** at its main thread's compute: a forward block window runs
from the first compute op of block l's forward to the first of the next block's; a backward block window from
the first op of block l's recompute or backward to the first of block l − 1's (glue ops outside any layer
stay in the window they fall in). The embedding, the head, the loss and the optimizer step are windows
of their own and are kept once. A block's collective belongs to the window of the main-thread op it
serves (the first of its layer and phase: a prefetched gather is repeated with the block whose parameters
it moves, issued as far ahead of it as traced); any other collective to the window whose op issued it, or
to the last block window of that phase when that is a block window (so it is copied once) — program order
and labels, not timing, so every rank cuts the same collectives into the same window.

The target iteration is the sequence: what comes before block 1, forward windows of target blocks 1..N,
what lies between the forward and the backward blocks (head, loss), backward windows N..1, the rest
(embedding backward, optimizer). Target block 1 and N are the traced first and last blocks (their
neighbours differ: the embedding, the head); the blocks between are the traced interior blocks in turn.
Each window keeps its events' offsets from its own start, and the windows are laid end to end. Layers are
relabelled to the target's: a copy of traced block l placed as block i is layer i, the head is N + 1.

Two things depend on the parameter count and are scaled by it: the optimizer step's work, and the
gradient collectives of no layer (ZeRO-3 reduces every gradient in one bucket at the end); the
embedding's and head's own collectives are kept as traced.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .errors import SimInputError
from .opgraph import MAIN_THREAD_STREAMS

_GRADIENT_STREAMS = ("reduce_scatter", "all_reduce")
# The columns the rewrite moves or relabels; the others are copied as they are.
_TIMES = ("issued_s", "start_s", "end_s")

Window = tuple[tuple[str, int], float, float, np.ndarray]  # key, start, end, its rows (positions)


class _Rank:
    """One rank's events in start order as plain arrays: the rewrite works on these, not on the frame
    (a pandas operation per window made it the sweep's largest cost)."""

    def __init__(self, ordered: pd.DataFrame) -> None:
        self.frame = ordered
        self.stream = ordered["stream"].to_numpy(dtype=object)
        self.phase = ordered["phase"].to_numpy(dtype=object)
        self.layer = ordered["layer"].to_numpy()
        self.issued_s = ordered["issued_s"].to_numpy(dtype=float)
        self.start_s = ordered["start_s"].to_numpy(dtype=float)
        self.end_s = ordered["end_s"].to_numpy(dtype=float)
        self.raw_bytes = ordered["raw_bytes"].to_numpy()
        self.wire_bytes = ordered["wire_bytes"].to_numpy()


def _window_keys(
    streams: np.ndarray, phases: np.ndarray, layer_of: np.ndarray, layers: int
) -> list[tuple[str, int] | None]:
    """Per main-thread op: the block window it opens (or None: it stays in the current window)."""
    keys: list[tuple[str, int] | None] = []
    for stream, phase, layer in zip(streams, phases, layer_of.tolist(), strict=True):
        if stream not in ("compute", "optim"):
            keys.append(None)  # codec work names the shard it codes, not where the program is
        elif 1 <= layer <= layers and phase == "fwd":
            keys.append(("fwd", int(layer)))
        elif 1 <= layer <= layers and phase in ("recompute", "bwd"):
            keys.append(("bwd", int(layer)))
        elif layer in (0, layers + 1) or phase == "optim":
            keys.append(("other", int(layer)))
        else:
            keys.append(None)
    return keys


def _windows(events: _Rank, layers: int) -> list[Window]:
    """(key, start, end, rows) of one rank's windows in order; collectives go with their issuer."""
    is_main = np.isin(events.stream, MAIN_THREAD_STREAMS)
    main_rows = np.flatnonzero(is_main)
    main_stream, main_phase, main_layer = (
        events.stream[main_rows], events.phase[main_rows], events.layer[main_rows],
    )  # fmt: skip
    main_start = events.start_s[main_rows]
    keys = _window_keys(main_stream, main_phase, main_layer, layers)
    boundaries: list[tuple[tuple[str, int], float]] = []
    current: tuple[str, int] = ("other", -1)
    boundaries.append((current, float(main_start[0]) if len(main_rows) else 0.0))
    for key, start in zip(keys, main_start.tolist(), strict=True):
        if key is not None and key != current:
            current = key
            boundaries.append((key, start))
    starts = np.array([b[1] for b in boundaries])
    main_window = np.searchsorted(starts, main_start, side="right") - 1
    # A collective goes with the block it serves: a block's collectives (layer 1..L) with the window of the
    # first op of their layer and phase — a prefetched gather issued a step ahead still moves its own
    # block's parameters, so it is repeated with that block, not with the block that issued it. Any other
    # collective (embedding, head, layer −1) is kept once: with the window of the op that had ended last
    # before its issue, or, when that is a block window (a head gather prefetched during an interior
    # block, which is repeated), with the last block window of that phase, which is copied once.
    main_ends = events.end_s[main_rows]
    collective_rows = np.flatnonzero(~is_main)
    issuer = np.searchsorted(main_ends, events.issued_s[collective_rows] + 1e-6, side="right") - 1
    by_issuer = np.where(issuer >= 0, main_window[np.maximum(issuer, 0)], 0)
    first_of: dict[tuple[int, str], int] = {}
    for position, (stream, layer, phase) in enumerate(
        zip(main_stream, main_layer.tolist(), main_phase, strict=True)
    ):
        if stream in ("compute", "optim"):
            first_of.setdefault((int(layer), str(phase)), position)
    window_keys = [key for key, _ in boundaries]
    last_block = {
        "fwd": window_keys.index(("fwd", layers)) if ("fwd", layers) in window_keys else -1,
        "bwd": window_keys.index(("bwd", 1)) if ("bwd", 1) in window_keys else -1,
    }
    collective_window = []
    for layer, phase, window in zip(
        events.layer[collective_rows].tolist(), events.phase[collective_rows], by_issuer.tolist(), strict=True
    ):
        served = first_of.get((int(layer), str(phase)), -1) if 1 <= layer <= layers else -1
        if served >= 0:
            collective_window.append(int(main_window[served]))
            continue
        kind = window_keys[window][0]
        collective_window.append(
            last_block[kind] if kind in last_block and last_block[kind] >= 0 else int(window)
        )
    window_of = np.zeros(len(events.stream), dtype=int)
    window_of[main_rows] = main_window
    window_of[collective_rows] = np.array(collective_window, dtype=int)
    windows = []
    last_end = float(events.end_s.max()) if len(events.end_s) else 0.0
    for position, (key, start) in enumerate(boundaries):
        end = float(starts[position + 1]) if position + 1 < len(starts) else last_end
        windows.append((key, start, end, np.flatnonzero(window_of == position)))
    return windows


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


def repeat_blocks(
    events: pd.DataFrame, traced_layers: int, target_layers: int, parameter_ratio: float
) -> pd.DataFrame:
    """The events of one iteration (every rank) rewritten from `traced_layers` to `target_layers` blocks.
    `parameter_ratio` (the target's parameter count over the traced one's) scales the optimizer step and
    the gradient collectives of no layer."""
    if target_layers == traced_layers:
        return events
    mapping = block_map(traced_layers, target_layers)
    pieces = []
    for rank, rank_events in events.groupby("rank", sort=True):
        ordered = _Rank(rank_events.sort_values(["start_s", "end_s"], kind="stable"))
        windows = _target_windows(_windows(ordered, traced_layers), mapping, rank)
        clock: float | None = None
        rows, window_ids, parts = [], [], []
        for position, (start, end, chosen, (source, target), scaled) in enumerate(windows):
            clock = start if clock is None else clock
            part = {column: getattr(ordered, column)[chosen] + (clock - start) for column in _TIMES}
            layer = ordered.layer[chosen]
            # The window's ops of layer `source` as layer `target` of the rewritten model.
            part["layer"] = np.where(layer != source, layer, target) if source != target else layer
            part["raw_bytes"] = ordered.raw_bytes[chosen].copy()
            part["wire_bytes"] = ordered.wire_bytes[chosen].copy()
            grown = _scale_parameter_work(part, ordered.stream[chosen], parameter_ratio) if scaled else 0.0
            rows.append(chosen)
            window_ids.append(np.full(len(chosen), position))
            parts.append(part)
            clock += (end - start) + grown
        take = np.concatenate(rows)
        columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        _issue_in_program_order(columns, ordered.stream[take], np.concatenate(window_ids))
        frame = ordered.frame.iloc[take].reset_index(drop=True)
        for name, values in columns.items():
            frame[name] = values.astype(frame[name].dtype, copy=False)
        pieces.append(frame)
    return pd.concat(pieces, ignore_index=True)


def _issue_in_program_order(columns: dict[str, np.ndarray], stream: np.ndarray, window: np.ndarray) -> None:
    """A rank issues the collectives of a stream in program order: those serving an earlier window
    first. A gather prefetched ahead of its window keeps its lead, but not past a collective of an earlier
    window (a copied block may be shorter than the one traced before it): its issue, start and end move
    by as much. Without this, ranks could issue one stream's collectives in different orders. (In place,
    on one rank's rewritten columns.)"""
    collective = ~np.isin(stream, MAIN_THREAD_STREAMS)
    for name in dict.fromkeys(stream[collective].tolist()):
        rows = np.flatnonzero(stream == name)
        order = rows[np.lexsort((columns["issued_s"][rows], window[rows]))]  # stable, like sort_values
        issued = columns["issued_s"][order]
        # Strictly later than the one before (by a nanosecond at a tie): coupling orders by issue time.
        steps = np.arange(len(issued)) * 1e-9
        delay = np.maximum.accumulate(issued - steps) + steps - issued
        if (delay > 0).any():
            for column in _TIMES:
                columns[column][order] = columns[column][order] + delay


def _target_windows(
    windows: list[Window], mapping: list[int], rank: int
) -> list[tuple[float, float, np.ndarray, tuple[int, int], bool]]:
    """(start, end, rows, (layer, as layer), parameter-scaled) of the target's windows in order."""
    traced_layers = max(key[1] for key, *_ in windows if key[0] == "fwd") if windows else 0
    by_key = {key: (start, end, rows) for key, start, end, rows in windows}
    missing = [layer for layer in range(1, traced_layers + 1) if ("fwd", layer) not in by_key]
    if missing or not traced_layers:
        raise SimInputError(
            f"depth rewrite: rank {rank} has no forward window of block {missing[0] if missing else 1} "
            "(the events do not name their layers)"
        )
    keys = [key for key, *_ in windows]
    first_fwd, last_fwd = keys.index(("fwd", 1)), keys.index(("fwd", traced_layers))
    backward = [i for i, key in enumerate(keys) if key[0] == "bwd"]
    first_bwd = min(backward) if backward else len(windows)
    last_bwd = max(backward) if backward else len(windows) - 1

    target_layers = len(mapping)
    head = (traced_layers + 1, target_layers + 1)

    def kept(positions: range) -> list[tuple[float, float, np.ndarray, tuple[int, int], bool]]:
        return [
            (start, end, rows, head, key[0] == "other")
            for key, start, end, rows in (windows[i] for i in positions)
        ]

    def blocks(
        phase: str, order: list[tuple[int, int]]
    ) -> list[tuple[float, float, np.ndarray, tuple[int, int], bool]]:
        out = []
        for target, source in order:
            if (phase, source) in by_key:
                start, end, rows = by_key[(phase, source)]
                out.append((start, end, rows, (source, target), False))
        return out

    numbered = list(enumerate(mapping, start=1))
    return [
        *kept(range(first_fwd)),
        *blocks("fwd", numbered),
        *kept(range(last_fwd + 1, first_bwd)),
        *blocks("bwd", list(reversed(numbered))),
        *kept(range(last_bwd + 1, len(windows))),
    ]


def _scale_parameter_work(window: dict[str, np.ndarray], stream: np.ndarray, ratio: float) -> float:
    """Scale, in place, the optimizer ops and gradient collectives of a kept window (its columns, `stream`
    per row) by `ratio` (their work and bytes go with the parameter count); what starts after a grown op
    starts later by as much. Returns how much longer the window got."""
    delay = 0.0
    issued, start, end, layer = window["issued_s"], window["start_s"], window["end_s"], window["layer"]
    for index in np.lexsort((end, start)).tolist():  # start order (stable, like sort_values)
        issued[index] += delay if stream[index] != "" else 0.0
        start[index] += delay
        end[index] += delay
        # A gradient collective of no layer (ZeRO-3's bucket at the end) carries every layer's gradients;
        # the embedding's or head's own reduce-scatter (FSDP2, analytic runs) does not grow with depth.
        whole_model = stream[index] in _GRADIENT_STREAMS and layer[index] < 0
        if stream[index] == "optim" or whole_model:
            duration = end[index] - start[index]
            end[index] = start[index] + duration * ratio
            if stream[index] == "optim":
                delay += duration * (ratio - 1.0)
            else:
                for column in ("raw_bytes", "wire_bytes"):
                    window[column][index] = int(round(window[column][index] * ratio))
    return delay
