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


def _window_keys(main: pd.DataFrame, layers: int) -> list[tuple[str, int] | None]:
    """Per main-thread op: the block window it opens (or None: it stays in the current window)."""
    keys: list[tuple[str, int] | None] = []
    for stream, phase, layer in zip(main["stream"], main["phase"], main["layer"], strict=True):
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


def _windows(
    rank_events: pd.DataFrame, layers: int
) -> list[tuple[tuple[str, int], float, float, pd.DataFrame]]:
    """(key, start, end, events) of one rank's windows in order; collectives go with their issuer."""
    ordered = rank_events.sort_values(["start_s", "end_s"], kind="stable")
    is_main = ordered["stream"].isin(MAIN_THREAD_STREAMS).to_numpy()
    main = ordered[is_main]
    keys = _window_keys(main, layers)
    boundaries: list[tuple[tuple[str, int], float]] = []
    current: tuple[str, int] = ("other", -1)
    boundaries.append((current, float(main["start_s"].iloc[0]) if len(main) else 0.0))
    for key, start in zip(keys, main["start_s"].to_numpy(dtype=float), strict=True):
        if key is not None and key != current:
            current = key
            boundaries.append((key, start))
    starts = np.array([b[1] for b in boundaries])
    main_window = np.searchsorted(starts, main["start_s"].to_numpy(dtype=float), side="right") - 1
    # A collective goes with the block it serves: a block's collectives (layer 1..L) with the window of the
    # first op of their layer and phase — a prefetched gather issued a step ahead still moves its own
    # block's parameters, so it is repeated with that block, not with the block that issued it. Any other
    # collective (embedding, head, layer −1) is kept once: with the window of the op that had ended last
    # before its issue, or, when that is a block window (a head gather prefetched during an interior
    # block, which is repeated), with the last block window of that phase, which is copied once.
    main_ends = main["end_s"].to_numpy(dtype=float)
    collectives = ordered[~is_main]
    issuer = (
        np.searchsorted(main_ends, collectives["issued_s"].to_numpy(dtype=float) + 1e-6, side="right") - 1
    )
    by_issuer = np.where(issuer >= 0, main_window[np.maximum(issuer, 0)], 0)
    first_of: dict[tuple[int, str], int] = {}
    for position, (stream, layer, phase) in enumerate(
        zip(main["stream"], main["layer"], main["phase"], strict=True)
    ):
        if stream in ("compute", "optim"):
            first_of.setdefault((int(layer), str(phase)), position)
    window_keys = [key for key, _ in boundaries]
    last_block = {
        "fwd": window_keys.index(("fwd", layers)) if ("fwd", layers) in window_keys else -1,
        "bwd": window_keys.index(("bwd", 1)) if ("bwd", 1) in window_keys else -1,
    }
    collective_window = []
    for layer, phase, window in zip(collectives["layer"], collectives["phase"], by_issuer, strict=True):
        served = first_of.get((int(layer), str(phase)), -1) if 1 <= layer <= layers else -1
        if served >= 0:
            collective_window.append(int(main_window[served]))
            continue
        kind = window_keys[window][0]
        collective_window.append(
            last_block[kind] if kind in last_block and last_block[kind] >= 0 else int(window)
        )
    collective_window = np.array(collective_window, dtype=int)
    window_of = pd.Series(0, index=ordered.index)
    window_of[main.index] = main_window
    window_of[collectives.index] = collective_window
    windows = []
    for position, (key, start) in enumerate(boundaries):
        end = float(starts[position + 1]) if position + 1 < len(starts) else float(ordered["end_s"].max())
        windows.append((key, start, end, ordered[window_of.to_numpy() == position]))
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
        clock: float | None = None
        rank_pieces = []
        windows = _target_windows(_windows(rank_events, traced_layers), mapping, rank)
        for position, (start, end, frame, scaled) in enumerate(windows):
            clock = start if clock is None else clock
            shifted = frame.copy()
            shift = clock - start
            for column in ("issued_s", "start_s", "end_s"):
                shifted[column] = shifted[column] + shift
            grown = _scale_parameter_work(shifted, parameter_ratio) if scaled else 0.0
            rank_pieces.append(shifted.assign(_window=position))
            clock += (end - start) + grown
        pieces.append(_issue_in_program_order(pd.concat(rank_pieces)))
    return pd.concat(pieces, ignore_index=True)


def _issue_in_program_order(rank_events: pd.DataFrame) -> pd.DataFrame:
    """A rank issues the collectives of a stream in program order: those serving an earlier window
    first. A gather prefetched ahead of its window keeps its lead, but not past a collective of an earlier
    window (a copied block may be shorter than the one traced before it): its issue, start and end move
    by as much. Without this, ranks could issue one stream's collectives in different orders."""
    frame = rank_events.reset_index(drop=True)
    collective = ~frame["stream"].isin(MAIN_THREAD_STREAMS)
    for _, rows in frame[collective].groupby("stream", sort=False):
        order = rows.sort_values(["_window", "issued_s"], kind="stable").index
        issued = frame.loc[order, "issued_s"].to_numpy(dtype=float)
        # Strictly later than the one before (by a nanosecond at a tie): coupling orders by issue time.
        steps = np.arange(len(issued)) * 1e-9
        delay = np.maximum.accumulate(issued - steps) + steps - issued
        if (delay > 0).any():
            for column in ("issued_s", "start_s", "end_s"):
                frame.loc[order, column] = frame.loc[order, column].to_numpy(dtype=float) + delay
    return frame.drop(columns="_window")


def _target_windows(
    windows: list[tuple[tuple[str, int], float, float, pd.DataFrame]], mapping: list[int], rank: int
) -> list[tuple[float, float, pd.DataFrame, bool]]:
    """(start, end, events, parameter-scaled) of the target's windows in order."""
    traced_layers = max(key[1] for key, *_ in windows if key[0] == "fwd") if windows else 0
    by_key = {key: (start, end, frame) for key, start, end, frame in windows}
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

    def relabel(frame: pd.DataFrame, source: int, target: int) -> pd.DataFrame:
        """The window's ops of layer `source` as layer `target` of the rewritten model."""
        if source == target:
            return frame
        return frame.assign(layer=frame["layer"].where(frame["layer"] != source, target))

    def kept(positions: range) -> list[tuple[float, float, pd.DataFrame, bool]]:
        return [
            (start, end, relabel(frame, traced_layers + 1, target_layers + 1), key[0] == "other")
            for key, start, end, frame in (windows[i] for i in positions)
        ]

    def blocks(phase: str, order: list[tuple[int, int]]) -> list[tuple[float, float, pd.DataFrame, bool]]:
        out = []
        for target, source in order:
            if (phase, source) in by_key:
                start, end, frame = by_key[(phase, source)]
                out.append((start, end, relabel(frame, source, target), False))
        return out

    numbered = list(enumerate(mapping, start=1))
    return [
        *kept(range(first_fwd)),
        *blocks("fwd", numbered),
        *kept(range(last_fwd + 1, first_bwd)),
        *blocks("bwd", list(reversed(numbered))),
        *kept(range(last_bwd + 1, len(windows))),
    ]


def _scale_parameter_work(window: pd.DataFrame, ratio: float) -> float:
    """Scale, in place, the optimizer ops and gradient collectives of a kept window by `ratio` (their work
    and bytes go with the parameter count); what starts after a grown op starts later by as much. Returns
    how much longer the window got."""
    delay = 0.0
    order = window.sort_values(["start_s", "end_s"], kind="stable").index
    for index in order:
        for column in ("issued_s", "start_s", "end_s"):
            window.at[index, column] += (
                delay if column != "issued_s" or window.at[index, "stream"] != "" else 0.0
            )
        stream = window.at[index, "stream"]
        # A gradient collective of no layer (ZeRO-3's bucket at the end) carries every layer's gradients;
        # the embedding's or head's own reduce-scatter (FSDP2, analytic runs) does not grow with depth.
        whole_model = stream in _GRADIENT_STREAMS and window.at[index, "layer"] < 0
        if stream == "optim" or whole_model:
            duration = window.at[index, "end_s"] - window.at[index, "start_s"]
            window.at[index, "end_s"] = window.at[index, "start_s"] + duration * ratio
            if stream == "optim":
                delay += duration * (ratio - 1.0)
            else:
                for column in ("raw_bytes", "wire_bytes"):
                    window.at[index, column] = int(round(window.at[index, column] * ratio))
    return delay
