"""The system rewrite "turn CIERA on": a plain engine's traced graph (ZeRO-3 or FSDP2) rewritten into the
graph the CIERA runtime of this build runs, from the plain run, the bundle's exponent statistics and the
codec figures of a few CIERA runs — never from the CIERA run being predicted.

What the runtime does per engine all-gather (ciera_runtime/zero3.py, fsdp2.py; docs/runtime.md):

- **ZeRO-3**: DeepSpeed's coalesced gather of a bucket becomes one CIERA gather per parameter. At the
  engine's issue point, per parameter: encode (main thread), then an asynchronous control round. At the
  engine's wait: per parameter, the bulk round (blocking), decode + merge (main thread), the status round
  (blocking).
- **FSDP2**: one CIERA gather per parameter group, the whole protocol synchronous at the issue point:
  encode, control (blocking), bulk (blocking), decode, status (blocking).

Sizes: a bulk round carries, from each of the W ranks, a per-shard overhead (header, bitmap, alignment,
coder state), the sign+mantissa plane (half the raw bytes for BF16) and, for the first gather of a
parameter after the optimizer step (its forward gather), the changed blocks' exponents at the coded bits
per value; later gathers of the iteration see no change. Control and status rounds carry a fixed row per
rank. Costs: encode and decode at the codec figures' per-call and per-byte times (encode over the rank's
shard S/W, decode over the (W − 1)/W·S it receives), plus the protocol's main-thread glue per gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .graph_edit import EditableOp, editable_ops, to_graph
from .opgraph import OpGraph

SIGN_MANTISSA_FRACTION = {"bf16": 0.5, "fp16": 11 / 16}


@dataclass(frozen=True)
class CodecFigures:
    """What CIERA costs, fitted to the events of the given CIERA runs."""

    encode_call_s: float
    encode_s_per_byte: float  # per byte of the rank's own shard (S / W)
    decode_call_s: float
    decode_s_per_byte: float  # per byte received ((W − 1)/W · S)
    glue_s_per_gather: float  # main-thread time the protocol adds per CIERA gather beyond the codec
    shard_overhead_bytes: float  # per source shard of a bulk round
    changed_exponent_bits: float  # coded bits per value of a changed block
    control_bytes_per_rank: float
    status_bytes_per_rank: float
    block_change_rate: float  # of the first gather after an optimizer step (the exponent statistics)
    runs: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        return (
            f"encode {self.encode_call_s * 1e3:.2f} ms + {self.encode_s_per_byte * 1e9:.1f} ns/B, decode "
            f"{self.decode_call_s * 1e3:.2f} ms + {self.decode_s_per_byte * 1e9:.1f} ns/B, glue "
            f"{self.glue_s_per_gather * 1e3:.2f} ms per gather, {self.shard_overhead_bytes:.0f} B per shard, "
            f"{self.changed_exponent_bits:.2f} bits per changed exponent (fitted to {', '.join(self.runs)})"
        )


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of y ≈ a + b·x, both ≥ 0."""
    if len(x) < 2 or np.ptp(x) == 0:
        return float(np.median(y)) if len(y) else 0.0, 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(np.median(y)), 0.0
    if intercept < 0:
        return 0.0, float(np.sum(x * y) / np.sum(x * x))
    return float(intercept), float(slope)


def mean_block_change_rate(bundle: traces.TraceBundle, block_size: int = 512) -> float:
    """The parameter-weighted block change rate of the bundle's exponent statistics."""
    stats = bundle.exponents[bundle.exponents["block_size"] == block_size]
    if stats.empty:
        raise SimInputError(
            f"bundle: no exponent statistics at block size {block_size} (capture them with `ciera measure exponents`)"
        )
    return float(np.average(stats["block_change_rate"], weights=stats["numel"]))


def fit_codec_figures(
    bundle: traces.TraceBundle, codec_runs: list[str], plain_runs: dict[str, str], change_rate: float
) -> CodecFigures:
    """Fit the figures to `codec_runs` (CIERA runs); `plain_runs` maps each to the plain engine's run of
    the same configuration, whose main-thread time the glue is measured against."""
    encode_x, encode_y, decode_x, decode_y = [], [], [], []
    repeat_over, first_extra, first_signs = [], [], []
    control, status, glue = [], [], []
    for run_id in codec_runs:
        run = bundle.runs[bundle.runs["run_id"] == run_id].iloc[0]
        world = int(run["world_size"])
        events = bundle.events[bundle.events["run_id"] == run_id]
        for _, per_rank in events.groupby(["iteration", "rank"]):
            ordered = per_rank.sort_values(["issued_s", "start_s"], kind="stable")
            gathers = ordered[ordered["stream"] == "allgather"]
            bulk = gathers[gathers["raw_bytes"] > 0]
            small = gathers[gathers["raw_bytes"] == 0]["wire_bytes"].to_numpy(dtype=float)
            encodes = ordered[ordered["stream"] == "codec_send"]
            decodes = ordered[ordered["stream"] == "codec_recv"]
            if len(encodes) != len(bulk) or len(decodes) != len(bulk):
                raise SimInputError(
                    f"codec run {run_id!r}: {len(encodes)} encodes, {len(decodes)} decodes and {len(bulk)} "
                    "bulk rounds per rank; expected one of each per gather"
                )
            raw = bulk["raw_bytes"].to_numpy(dtype=float)
            wire = bulk["wire_bytes"].to_numpy(dtype=float)
            encode_x += list(raw / world)
            encode_y += list((encodes["end_s"] - encodes["start_s"]).to_numpy())
            decode_x += list(raw * (world - 1) / world)
            decode_y += list((decodes["end_s"] - decodes["start_s"]).to_numpy())
            signs = raw * SIGN_MANTISSA_FRACTION[str(run["dtype"])]
            first = (bulk["phase"] == "fwd").to_numpy()
            repeat_over += list((wire[~first] - signs[~first]) / world)
            first_extra += list(wire[first] - signs[first])
            first_signs += list(signs[first])
            if len(small):
                control.append(float(np.max(small)) / world)
                status.append(float(np.min(small)) / world)
        plain_id = plain_runs.get(run_id)
        if plain_id is not None:
            plain = bundle.events[bundle.events["run_id"] == plain_id]

            def main_s(frame: pd.DataFrame) -> float:
                chosen = frame[frame["stream"] == "compute"]
                return float((chosen["end_s"] - chosen["start_s"]).sum()) / max(
                    frame.groupby(["iteration", "rank"]).ngroups, 1
                )

            gathers_per_rank = len(
                events[(events["stream"] == "allgather") & (events["raw_bytes"] > 0)]
            ) / max(events.groupby(["iteration", "rank"]).ngroups, 1)
            glue.append(max(0.0, (main_s(events) - main_s(plain)) / max(gathers_per_rank, 1.0)))
    if not encode_x:
        raise SimInputError("codec runs: no CIERA gathers to fit the codec figures to")
    encode_call, encode_slope = _line(np.array(encode_x), np.array(encode_y))
    decode_call, decode_slope = _line(np.array(decode_x), np.array(decode_y))
    overhead = float(np.median(repeat_over)) if repeat_over else 0.0
    world_of = {r: int(bundle.runs[bundle.runs["run_id"] == r].iloc[0]["world_size"]) for r in codec_runs}
    mean_world = float(np.mean(list(world_of.values())))
    exponent_bytes = max(0.0, float(np.sum(first_extra)) - overhead * mean_world * len(first_extra))
    # Changed blocks' exponents: q · (raw / 2 values) · bits / 8 bytes, raw / 2 values per BF16 byte pair.
    values = float(np.sum(first_signs)) / SIGN_MANTISSA_FRACTION["bf16"] / 2  # raw bytes / 2
    bits = 8.0 * exponent_bytes / max(change_rate * values, 1.0)
    return CodecFigures(
        encode_call_s=encode_call,
        encode_s_per_byte=encode_slope,
        decode_call_s=decode_call,
        decode_s_per_byte=decode_slope,
        glue_s_per_gather=float(np.median(glue)) if glue else 0.0,
        shard_overhead_bytes=overhead,
        changed_exponent_bits=bits,
        control_bytes_per_rank=float(np.median(control)) if control else 0.0,
        status_bytes_per_rank=float(np.median(status)) if status else 0.0,
        block_change_rate=change_rate,
        runs=tuple(codec_runs),
    )


def parameter_sizes(bundle: traces.TraceBundle, traced_layers: int) -> dict[int, list[float]]:
    """Per layer of a model traced at `traced_layers` blocks: its parameters' raw BF16 bytes in module order,
    from the exponent statistics (blocks map onto the statistics run's blocks in turn)."""
    stats = bundle.exponents
    first = stats[
        (stats["iteration"] == stats["iteration"].min()) & (stats["block_size"] == stats["block_size"].min())
    ]
    stats_layers = int(first["layer"].max()) - 1
    by_layer = {
        int(layer): list(2.0 * rows["numel"].to_numpy(dtype=float))
        for layer, rows in first.groupby("layer", sort=True)
    }
    sizes: dict[int, list[float]] = {
        0: by_layer.get(0, []),
        traced_layers + 1: by_layer.get(stats_layers + 1, []),
    }
    for layer in range(1, traced_layers + 1):
        sizes[layer] = by_layer.get((layer - 1) % stats_layers + 1, [])
    return sizes


def split_bucket(size_bytes: float, layer: int, parameters: dict[int, list[float]]) -> list[float]:
    """The parameters one gathered bucket holds: a run of consecutive parameters, in module order or in
    reverse (backward fetches), whose sizes add up to the bucket's — preferring a run of the layer the
    bucket is attributed to (the layer holding most of its elements). A bucket that no run matches stays
    one gather (the caller counts it)."""
    sequence = [(owner, size) for owner in sorted(parameters) for size in parameters[owner]]
    best: list[float] | None = None
    for ordered in (sequence, sequence[::-1]):
        sizes = np.array([size for _, size in ordered])
        layers = np.array([owner for owner, _ in ordered])
        prefix = np.concatenate([[0.0], np.cumsum(sizes)])
        where = {round(value): i for i, value in enumerate(prefix)}
        for end in range(1, len(prefix)):
            start = where.get(round(prefix[end] - size_bytes))
            if start is None or start >= end:
                continue
            run_layers = layers[start:end]
            values, counts = np.unique(run_layers, return_counts=True)
            if values[np.argmax(counts)] == layer:
                return list(sizes[start:end])
            best = best or list(sizes[start:end])
    return best or [size_bytes]


def ciera_graph(
    plain: OpGraph,
    engine: str,
    dtype: str,
    figures: CodecFigures,
    parameters: dict[int, list[float]],
    anchor_time_s,  # noqa: ANN001 — (op name, wire bytes array) → isolated seconds on the anchor cluster
    counts: dict[str, int] | None = None,
) -> OpGraph:
    """The CIERA graph of `plain` (a ZeRO-3 or FSDP2 iteration). New collectives get the anchor's isolated
    cost as their duration (no in-run overhead beyond the glue); `counts` collects what was done."""
    counts = counts if counts is not None else {}
    world = plain.world_size
    ops_by_rank: dict[int, list[EditableOp]] = {}
    for rank in sorted(set(plain.rank.tolist())):
        ops_by_rank[rank] = _rewrite_rank(
            plain, rank, engine, dtype, figures, parameters, anchor_time_s, world, counts
        )
    return to_graph(ops_by_rank, world)


def _payload_bytes(
    raw: float, first: bool, dtype: str, figures: CodecFigures, world: int, change_rate: float
) -> float:
    signs = raw * SIGN_MANTISSA_FRACTION[dtype]
    exponents = change_rate * (raw / 2) * figures.changed_exponent_bits / 8 if first else 0.0
    return world * figures.shard_overhead_bytes + signs + exponents


def _rewrite_rank(
    plain, rank, engine, dtype, figures, parameters, anchor_time_s, world, counts
) -> list[EditableOp]:  # noqa: ANN001, PLR0913
    indices = np.flatnonzero(plain.rank == rank)
    is_main = plain.is_main
    old = dict(zip((int(i) for i in indices), editable_ops(plain, rank), strict=True))
    change_rate = figures.block_change_rate
    replaced: dict[int, list[dict]] = {}  # plain gather index → its parameters' CIERA gathers
    for i in indices:
        if plain.stream[i] != "allgather":
            continue
        if engine == "zero3":
            sizes = split_bucket(float(plain.raw_bytes[i]), int(plain.layer[i]), parameters)
            if len(sizes) == 1 and not any(sizes[0] in v for v in parameters.values()):
                counts["buckets_not_split"] = counts.get("buckets_not_split", 0) + 1
        else:
            sizes = [float(plain.raw_bytes[i])]
        first = str(plain.phase[i]) == "fwd"
        replaced[int(i)] = [
            {"raw": s, "wire": _payload_bytes(s, first, dtype, figures, world, change_rate)} for s in sizes
        ]
        counts["ciera_gathers"] = counts.get("ciera_gathers", 0) + len(sizes)
    # Where the engine waits for each plain gather: the main op it blocked, else the first main op of its
    # layer and phase that started after it ended.
    waiters: dict[int, int] = {}
    main_indices = [int(i) for i in indices if is_main[i]]
    for i in main_indices:
        blocker = int(plain.blocker[i])
        if blocker in replaced and blocker not in waiters:
            waiters[blocker] = i
    for g in replaced:
        if g in waiters:
            continue
        later = [
            i for i in main_indices
            if plain.measured_start_s[i] >= plain.measured_end_s[g]
            and plain.layer[i] == plain.layer[g] and plain.phase[i] == plain.phase[g]
        ]  # fmt: skip
        after = [i for i in main_indices if plain.measured_start_s[i] >= plain.measured_end_s[g]]
        waiters[g] = (later or after or [main_indices[-1]])[0]
    waits_at: dict[int, list[int]] = {}
    for g, i in waiters.items():
        waits_at.setdefault(i, []).append(g)
    issued_by: dict[int, list[int]] = {}
    for g in replaced:
        issuer = int(plain.main_prev[g])
        issued_by.setdefault(issuer, []).append(g)

    def time_of(op_name: str, wire: float) -> float:
        return float(anchor_time_s(op_name, np.array([wire]))[0])

    out: list[EditableOp] = []
    previous_main: list[EditableOp | None] = [None]

    def emit_main(op: EditableOp) -> EditableOp:
        op.main_prev = previous_main[0]
        previous_main[0] = op
        out.append(op)
        return op

    def codec(stream: str, layer: int, phase: str, seconds: float, anchor: EditableOp) -> EditableOp:
        return EditableOp(rank, stream, layer, phase, seconds, measured_start_s=anchor.measured_end_s,
                   measured_end_s=anchor.measured_end_s, issued_s=anchor.measured_end_s)  # fmt: skip

    def collective(layer: int, phase: str, raw: float, wire: float, issuer: EditableOp) -> EditableOp:
        op = EditableOp(rank, "allgather", layer, phase, time_of("all_gather", wire), raw_bytes=raw, wire_bytes=wire,
                 issuer=issuer, measured_start_s=issuer.measured_end_s, measured_end_s=issuer.measured_end_s,
                 issued_s=issuer.measured_end_s)  # fmt: skip
        out.append(op)
        return op

    controls: dict[tuple[int, int], EditableOp] = {}
    last_status: dict[int, EditableOp] = {}
    replaced_by_op = {id(old[g]): g for g in replaced}

    def encode_and_control(layer: int, phase: str, raw: float, anchor: EditableOp) -> EditableOp:
        seconds = figures.encode_call_s + figures.encode_s_per_byte * raw / world
        encode = emit_main(codec("codec_send", layer, phase, seconds, anchor))
        return collective(layer, phase, 0.0, figures.control_bytes_per_rank * world, encode)

    def wait_protocol(g: int, synchronous: bool) -> None:
        layer, phase = int(plain.layer[g]), str(plain.phase[g])
        for j, part in enumerate(replaced[g]):
            anchor = previous_main[0] or old[g]
            if synchronous:
                control = encode_and_control(layer, phase, part["raw"], anchor)
            else:
                control = controls[(g, j)]
            glue = emit_main(codec("compute", -1, phase, figures.glue_s_per_gather / 2, anchor))
            glue.blocker = control
            bulk = collective(layer, phase, part["raw"], part["wire"], glue)
            decode = emit_main(
                codec(
                    "codec_recv",
                    layer,
                    phase,
                    figures.decode_call_s + figures.decode_s_per_byte * part["raw"] * (world - 1) / world,
                    anchor,
                )
            )
            decode.blocker = bulk
            status = collective(layer, phase, 0.0, figures.status_bytes_per_rank * world, decode)
            after = emit_main(codec("compute", -1, phase, figures.glue_s_per_gather / 2, anchor))
            after.blocker = status
            last_status[g] = status

    for i in indices:
        i = int(i)
        op = old[i]
        if not is_main[i]:
            if i in replaced:
                continue  # the plain gather: replaced by CIERA's rounds
            out.append(op)
            continue
        for g in waits_at.get(i, []) if engine == "zero3" else []:
            wait_protocol(g, synchronous=False)
        if op.blocker is not None and id(op.blocker) in replaced_by_op:
            op.blocker = last_status.get(replaced_by_op[id(op.blocker)])
        emit_main(op)
        for g in issued_by.get(i, []):
            if engine == "zero3":
                layer, phase = int(plain.layer[g]), str(plain.phase[g])
                for j, part in enumerate(replaced[g]):
                    controls[(g, j)] = encode_and_control(layer, phase, part["raw"], op)
            else:
                wait_protocol(g, synchronous=True)
    # A collective whose issuer is not in the rewritten graph has no issue edge (graph_edit.to_graph).
    return out
