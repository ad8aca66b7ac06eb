"""System rewrites for a cluster preset: a traced ZeRO-3 iteration's op graph (sim/opgraph.py) rewritten
into the graph another system would run, before it is re-costed on the target cluster (sim/rewrite.py)
and evaluated (sim/evaluate.py). A system the bundle holds runs of is simulated from those runs instead;
these rules are for the systems it lacks (the analytic bundle holds ZeRO-3 runs only).

- **fsdp** (FSDP2, `reshard_after_forward` as its default): every block is gathered for its forward and
  again before its recompute, like ZeRO-3; the root group (embedding and head) is not resharded after
  the forward, so its backward gathers are dropped.
- **zeropp** (ZeRO++, FP16): forward gathers move int8 weights plus one fp32 scale per quantization
  group (qwZ), with the quantize and dequantize kernels on the gather's own stream; recompute and
  backward gathers read the hpZ secondary partition inside the node (the `allgather_intra` stream,
  re-costed on the intra-node level only); gradients are reduce-scattered as int4 plus scales (qgZ),
  quantize and dequantize on the scatter's stream.
- **CIERA** (the method's GPU design: one compressed collective per engine gather, issued where the engine
  issues it): each gather of a layer the plan compresses moves the plan's payload — changed blocks'
  exponents only in the first gather after the optimizer step (the forward), none in the recompute and
  backward gathers (compared with the last gather). `ciera-er` and `ciera-er-bsc` run the sender kernels
  (hash+compress) on the main thread right after the op that issues the gather, and the receiver kernels
  (decompress+merge) on the main thread before the op that waits for it. `ciera` (CCP) runs them on two
  side streams (`ccp_send`, `ccp_recv`): the sender kernels from the gather's issue point, the transfer
  after them; the receiver kernels after the transfer, and the op that waited for the gather waits for
  them — so a sender kernel overlaps the previous transfer and a receiver kernel the next one. The plan
  (`ciera_plan`) is benefit-driven selection (sim/selection.py) over the parameters' block change rates.

A rewritten collective's duration is its traced duration scaled by the anchor curve's time at the new
size over its time at the traced size, so what the trace held beyond the curve scales with it; kernel
seconds added to a collective's own stream are recorded in `embedded_codec_s` for the critical path.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import pandas as pd

from .cluster import ClusterPreset
from .collectives import CollectiveModel
from .graph_edit import EditableOp, editable_ops, relink_main, to_graph
from .opgraph import TOLERANCE_S, OpGraph
from .payload import raw_bytes
from .selection import select_shards

CIERA_SYSTEMS = ("ciera-er", "ciera-er-bsc", "ciera")
BSC_SYSTEMS = ("ciera-er-bsc", "ciera")  # the ones whose shards benefit-driven selection picks
INTRA_NODE_GATHER_STREAM = "allgather_intra"

AnchorTime = Callable[[str, np.ndarray], np.ndarray]  # (curve op, sizes) → seconds on the anchor cluster


@dataclass(frozen=True)
class LayerPlan:
    changed_ratio: float  # payload / raw of the first gather after the optimizer step
    unchanged_ratio: float  # of the later gathers of the iteration
    sender_s: float  # hash + compress of the rank's shards of the layer, per gather
    receiver_s: float  # decompress + merge of what it receives, per gather


@dataclass(frozen=True)
class CieraPlan:
    decisions: pd.DataFrame  # sim/selection.py's decision table
    layers: dict[int, LayerPlan]

    @property
    def shards_selected(self) -> int:
        return int(self.decisions["selected"].sum())

    @property
    def receiver_cache_bytes(self) -> float:
        chosen = self.decisions["selected"].to_numpy(dtype=bool)
        return float(self.decisions.loc[chosen, "memory_bytes"].sum())

    def sender_values(self, world_size: int) -> float:
        """Values of this rank's shards of the selected parameters: the exponents its sender keeps. The
        cache holds (W − 1) such shards (sim/payload.py), so one shard is the cache over W − 1."""
        return self.receiver_cache_bytes / max(world_size - 1, 1)


@dataclass(frozen=True)
class SystemGraph:
    graph: OpGraph
    embedded_codec_s: np.ndarray  # per op: kernel seconds on a collective's own stream
    codec_busy_s: float  # every codec kernel of the iteration (main thread or stream)


def codec_seconds(shards: pd.DataFrame, world_size: int, preset: ClusterPreset) -> pd.DataFrame:
    """Per shard and gather: hash, compress (of the rank's shard) and decompress (of what it receives)
    at the preset's kernel throughputs plus a launch each."""
    codec = preset.codec
    full = np.asarray(raw_bytes(shards["numel"].to_numpy(dtype=float)), dtype=float)
    return pd.DataFrame(
        {
            "hash_s": full / world_size / codec.hash_Bps + codec.kernel_launch_s,
            "compress_s": full / world_size / codec.compress_Bps + codec.kernel_launch_s,
            "decompress_s": full * (world_size - 1) / world_size / codec.decompress_Bps
            + codec.kernel_launch_s,
        },
        index=shards.index,
    )


def ciera_plan(
    system: str,
    shards: pd.DataFrame,
    dtype: str,
    world_size: int,
    gathers_per_layer: int,
    preset: ClusterPreset,
    collectives: CollectiveModel,
    selection: str = "benefit",
    cache_budget_bytes: float | None = None,
) -> CieraPlan:
    """Which shards `system` compresses at `world_size` and what a gather of each layer then costs.
    `selection`: "benefit" (BSC's per-shard gain under the cache budget), "all" or "none".
    `cache_budget_bytes`: the receiver cache BSC may use (default: the preset's ciera.cache_budget_bytes)."""
    budget = preset.ciera.cache_budget_bytes if cache_budget_bytes is None else cache_budget_bytes
    table = shards.copy()
    table["q"] = np.clip(table["q"].to_numpy(dtype=float) * preset.ciera.change_rate_scale, 0.0, 1.0)
    table = pd.concat([table, codec_seconds(table, world_size, preset)], axis=1)
    changed = 1 if preset.ciera.reuse_across_gathers else gathers_per_layer
    decisions = select_shards(
        table,
        world_size=world_size,
        dtype=dtype,
        block_size=preset.ciera.block_size,
        entropy_bits=preset.ciera.exponent_entropy_bits,
        header_bytes=preset.ciera.header_bytes,
        comm_s_per_byte=collectives.allgather_marginal_s_per_byte(world_size),
        cache_budget_bytes=0 if selection == "none" else budget,
        changed_gathers=changed,
        unchanged_gathers=max(gathers_per_layer - changed, 0),
        overlap_codec=system == "ciera",
        select_all=system == "ciera-er" or selection == "all",
    )
    selected = decisions["selected"].to_numpy(dtype=bool)
    raw = np.asarray(raw_bytes(decisions["numel"].to_numpy(dtype=float)), dtype=float)
    layer_of = decisions["layer"].to_numpy(dtype=np.int64)
    slots = int(layer_of.max()) + 1 if len(layer_of) else 0

    def per_layer(values: np.ndarray) -> np.ndarray:
        return np.bincount(layer_of, weights=values, minlength=slots)

    raw_sum = per_layer(raw)
    changed_sum = per_layer(np.where(selected, decisions["changed_payload_bytes"].to_numpy(), raw))
    unchanged_sum = per_layer(np.where(selected, decisions["unchanged_payload_bytes"].to_numpy(), raw))
    sender = table["hash_s"].to_numpy() + table["compress_s"].to_numpy()
    sender_sum = per_layer(np.where(selected, sender, 0.0))
    receiver_sum = per_layer(np.where(selected, table["decompress_s"].to_numpy(), 0.0))
    layers = {
        layer: LayerPlan(
            changed_ratio=float(changed_sum[layer] / raw_sum[layer]),
            unchanged_ratio=float(unchanged_sum[layer] / raw_sum[layer]),
            sender_s=float(sender_sum[layer]),
            receiver_s=float(receiver_sum[layer]),
        )
        for layer in np.unique(layer_of).tolist()
        if raw_sum[layer] > 0
    }
    return CieraPlan(decisions, layers)


def rescaled_durations(
    duration_s: np.ndarray,
    wire: np.ndarray,
    curve_op: str,
    new_curve_op: str,
    new_wire: np.ndarray,
    anchor_time_s: AnchorTime,
) -> np.ndarray:
    """Collectives' durations at new sizes (and curve): each scaled by the anchor curve's time at its new
    size over that at its old one (unscaled where the old time is 0)."""
    before = np.asarray(anchor_time_s(curve_op, np.asarray(wire, dtype=float)), dtype=float)
    after = np.asarray(anchor_time_s(new_curve_op, np.asarray(new_wire, dtype=float)), dtype=float)
    return np.asarray(duration_s, dtype=float) * np.divide(
        after, before, out=np.ones_like(after), where=before > 0
    )


def rescaled_duration(
    duration_s: float,
    wire: float,
    curve_op: str,
    new_curve_op: str,
    new_wire: float,
    anchor_time_s: AnchorTime,
) -> float:
    """`rescaled_durations` of one collective."""
    return float(
        rescaled_durations(
            np.array([duration_s]),
            np.array([wire]),
            curve_op,
            new_curve_op,
            np.array([new_wire]),
            anchor_time_s,
        )[0]
    )


def _rescaled(
    op: EditableOp, curve_op: str, new_curve_op: str, wire: float, anchor_time_s: AnchorTime
) -> None:
    """Give `op` a new size (and curve): its duration scaled by the anchor curve's times."""
    op.duration_s = rescaled_duration(
        op.duration_s, op.wire_bytes, curve_op, new_curve_op, wire, anchor_time_s
    )
    op.wire_bytes = wire


class _MainOps:
    """A rank's main ops (or those of one layer and phase) in program order, searchable by position and
    by measured start (a running maximum, so the first op at or after a time is found by bisection)."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.starts: list[float] = []
        self.ops: list[EditableOp] = []

    def add(self, position: int, op: EditableOp) -> None:
        self.positions.append(position)
        self.starts.append(max(op.measured_start_s, self.starts[-1]) if self.starts else op.measured_start_s)
        self.ops.append(op)

    def first_after(self, position: int, start_s: float | None = None) -> EditableOp | None:
        """The first op after `position` (that started at or after `start_s`)."""
        k = bisect.bisect_right(self.positions, position)
        if start_s is not None:
            k = max(k, bisect.bisect_left(self.starts, start_s))
        return self.ops[k] if k < len(self.ops) else None


def _gather_users(ops: list[EditableOp]) -> dict[int, EditableOp]:
    """Per gather (by identity), the main op that uses what it gathered: the one blocked on it, else —
    where the gather was done before it was needed, so nothing waited — the first main op after its
    issuer, in program order, that started once the gather had ended (an op that ran while the gather was
    in flight and did not wait for it did not use it): of the gather's layer and phase, else of any; a
    gather that ended after every op goes to the first op of its layer and phase after its issuer."""
    waiters = {id(op.blocker): op for op in ops if op.is_main and op.blocker is not None}
    position = {id(op): k for k, op in enumerate(ops)}
    every, labelled = _MainOps(), {}
    for k, op in enumerate(ops):
        if op.is_main:
            every.add(k, op)
            labelled.setdefault((op.layer, op.phase), _MainOps()).add(k, op)
    for op in ops:
        if op.stream != "allgather" or id(op) in waiters:
            continue
        after = position[id(op.issuer)] if op.issuer is not None and id(op.issuer) in position else -1
        mine = labelled.get((op.layer, op.phase))
        ended = op.measured_end_s - TOLERANCE_S
        user = (
            (mine.first_after(after, ended) if mine else None)
            or every.first_after(after, ended)
            or (mine.first_after(after) if mine else None)
        )
        if user is not None:
            waiters[id(op)] = user
    return waiters


def system_graph(
    system: str,
    plain: OpGraph,
    dtype: str,
    preset: ClusterPreset,
    anchor_time_s: AnchorTime,
    plan: CieraPlan | None = None,
    without_codec: bool = False,
    templates: dict[tuple, CieraTemplate] | None = None,
) -> SystemGraph:
    """The graph `system` runs, from the ZeRO-3 graph `plain`. `without_codec`: every codec kernel at 0 s
    (what the iteration would be if the codec were free). `templates`: CIERA rewrites of `plain` already
    made (see `CieraTemplate`), filled in as they are made."""
    if system == "zero3":
        return SystemGraph(plain, np.zeros(plain.size), 0.0)
    if system in CIERA_SYSTEMS:
        if plan is None:
            raise ValueError(f"system {system!r} needs a CIERA plan")
        scale = 0.0 if without_codec else 1.0
        key = _ciera_structure(system, plan, scale, preset)
        template = templates.get(key) if templates is not None else None
        if template is None:
            template = _ciera_template(system, plain, plan, scale, preset)
            if templates is not None:
                templates[key] = template
        return template.fill(plain, plan, scale, anchor_time_s)
    ops_by_rank: dict[int, list[EditableOp]] = {}
    embedded: dict[int, float] = {}
    busy = [0.0]
    for rank in sorted(set(plain.rank.tolist())):
        ops = editable_ops(plain, rank)
        if system == "fsdp":
            ops = _fsdp(ops)
        elif system == "zeropp":
            _zeropp(ops, plain.world_size, preset, anchor_time_s, embedded, busy, without_codec)
        ops_by_rank[rank] = ops
    graph = to_graph(ops_by_rank, plain.world_size)
    order = [op for rank in sorted(ops_by_rank) for op in ops_by_rank[rank]]
    embedded_codec_s = np.array([embedded.get(id(op), 0.0) for op in order])
    return SystemGraph(graph, embedded_codec_s, busy[0] / max(len(ops_by_rank), 1))


def _fsdp(ops: list[EditableOp]) -> list[EditableOp]:
    layers = [op.layer for op in ops if op.is_main and op.layer >= 0]
    root = {0, max(layers)} if layers else set()
    dropped = {id(op) for op in ops if op.stream == "allgather" and op.phase == "bwd" and op.layer in root}
    for op in ops:
        if op.is_main and op.blocker is not None and id(op.blocker) in dropped:
            op.blocker = None
    return [op for op in ops if id(op) not in dropped]


def _quantized_bytes(raw: float, bits: int, group: int) -> float:
    numel = raw / 2
    return numel * bits / 8 + np.ceil(numel / group) * 4


def _zeropp(ops, world, preset, anchor_time_s, embedded, busy, without_codec) -> None:  # noqa: ANN001
    zpp, launch = preset.zeropp, preset.codec.kernel_launch_s
    scale = 0.0 if without_codec else 1.0
    for op in ops:
        raw = op.raw_bytes
        if op.stream == "allgather" and op.phase == "fwd":
            wire = _quantized_bytes(raw, zpp.weight_bits, zpp.quantization_group_size)
            _rescaled(op, "all_gather", "all_gather", wire, anchor_time_s)
            kernels = raw / world / zpp.quantize_Bps + raw / zpp.dequantize_Bps + 2 * launch
        elif op.stream == "allgather":
            _rescaled(op, "all_gather", "all_gather_intra", raw, anchor_time_s)
            op.stream = INTRA_NODE_GATHER_STREAM
            continue
        elif op.stream == "reduce_scatter":
            wire = _quantized_bytes(raw, zpp.gradient_bits, zpp.quantization_group_size)
            _rescaled(op, "reduce_scatter", "reduce_scatter", wire, anchor_time_s)
            kernels = raw / zpp.quantize_Bps + raw / world / zpp.dequantize_Bps + 2 * launch
        else:
            continue
        op.duration_s += kernels * scale
        embedded[id(op)] = kernels * scale
        busy[0] += kernels * scale


@dataclass(frozen=True)
class CieraTemplate:
    """A CIERA rewrite of one plain graph without the plan's values: the rewritten graph, and where each
    value a plan sets lies in it. The rewrite's shape depends on the plan only through which layers it
    compresses and which of them have sender or receiver kernels (`_ciera_structure`); across world
    sizes and BSC's alternatives a plan mostly keeps that shape and changes only payload ratios and
    kernel seconds, so one template serves them all and each plan only fills in its values."""

    graph: OpGraph  # payload and kernel values still to fill in
    gathers: tuple[tuple[int, int, int, bool], ...]  # (op in graph, op in plain, layer, first), rewrite order
    kernels: tuple[tuple[int, int, bool], ...]  # (op in graph, layer, sender?)
    ranks: int

    @cached_property
    def gather_ops(self) -> np.ndarray:
        return np.array([op for op, _, _, _ in self.gathers], dtype=np.int64)

    @cached_property
    def gather_sources(self) -> np.ndarray:
        return np.array([source for _, source, _, _ in self.gathers], dtype=np.int64)

    def fill(self, plain: OpGraph, plan: CieraPlan, scale: float, anchor_time_s: AnchorTime) -> SystemGraph:
        """The graph with `plan`'s values: each compressed gather at the plan's payload (its duration
        rescaled by the anchor curve), each codec kernel at its seconds (times `scale`)."""
        duration = self.graph.duration_s.copy()
        wire = self.graph.wire_bytes.copy()
        busy = 0.0
        if self.gathers:
            # Every compressed gather at once (one curve lookup for the plain sizes, one for the payloads).
            ops, sources = self.gather_ops, self.gather_sources
            ratios = np.empty(len(ops))
            for k, (_, _, layer, first) in enumerate(self.gathers):
                layer_plan = plan.layers[layer]
                ratios[k] = layer_plan.changed_ratio if first else layer_plan.unchanged_ratio
                busy += layer_plan.sender_s * scale + layer_plan.receiver_s * scale
            new_wire = plain.raw_bytes[sources].astype(float) * ratios
            duration[ops] = rescaled_durations(
                plain.duration_s[sources], plain.wire_bytes[sources], "all_gather", "all_gather", new_wire,
                anchor_time_s,
            )  # fmt: skip
            wire[ops] = new_wire
        for op, layer, sender in self.kernels:
            layer_plan = plan.layers[layer]
            duration[op] = (layer_plan.sender_s if sender else layer_plan.receiver_s) * scale
        graph = replace(self.graph, duration_s=duration, wire_bytes=wire)
        return SystemGraph(graph, np.zeros(graph.size), busy / max(self.ranks, 1))


def _ciera_structure(system: str, plan: CieraPlan, scale: float, preset: ClusterPreset) -> tuple:
    """What of `plan` shapes `system`'s rewrite: per compressed layer, whether it has sender and receiver
    kernels (a kernel of 0 s is not inserted)."""
    return (
        system == "ciera",
        preset.ciera.reuse_across_gathers,
        tuple(
            (layer, layer_plan.sender_s * scale > 0, layer_plan.receiver_s * scale > 0)
            for layer, layer_plan in sorted(plan.layers.items())
        ),
    )


def _ciera_template(
    system: str, plain: OpGraph, plan: CieraPlan, scale: float, preset: ClusterPreset
) -> CieraTemplate:
    ops_by_rank: dict[int, list[EditableOp]] = {}
    gathers: list[tuple[EditableOp, int, int, bool]] = []
    kernels: list[tuple[EditableOp, int, bool]] = []
    for rank in sorted(set(plain.rank.tolist())):
        ops = editable_ops(plain, rank)
        source = dict(zip(map(id, ops), np.flatnonzero(plain.rank == rank).tolist(), strict=True))
        ops_by_rank[rank] = _ciera(ops, system, plan, scale, preset, gathers, kernels, source)
    graph = to_graph(ops_by_rank, plain.world_size)
    position = {
        id(op): k for k, op in enumerate(op for rank in sorted(ops_by_rank) for op in ops_by_rank[rank])
    }
    return CieraTemplate(
        graph=graph,
        gathers=tuple((position[id(op)], source, layer, first) for op, source, layer, first in gathers),
        kernels=tuple((position[id(op)], layer, sender) for op, layer, sender in kernels),
        ranks=len(ops_by_rank),
    )


@dataclass(frozen=True)
class CodecInsertion:
    """What `insert_codec` did to one compressed gather: the gather and its codec ops (None: not inserted)."""

    gather: EditableOp
    send: EditableOp | None
    receive: EditableOp | None


KernelSeconds = Callable[[EditableOp], tuple[float, float] | None]  # gather → (sender s, receiver s)


def insert_codec(
    ops: list[EditableOp], overlap: bool, kernel_s: KernelSeconds
) -> tuple[list[EditableOp], list[CodecInsertion]]:
    """One rank's ops with CIERA's codec written around every gather `kernel_s` compresses (it gives the
    gather's sender and receiver seconds, None for a gather left plain). The one placement rule of both
    CIERA rewrites (the preset's systems here, the measured runtime's in sim/ciera_rewrite.py):

    - without overlap (the CPU runtime, `ciera-er`): the sender kernels on the main thread right after the
      op that issues the gather, which they then issue; the receiver kernels on the main thread before the
      op that uses what it gathered, blocked on the gather;
    - with overlap (CCP): the sender kernels on their side stream between the issue and the transfer (the
      gather is issued by them), the receiver kernels on theirs after it (the user waits for them).

    A kernel of 0 s is not inserted."""
    waiters = _gather_users(ops)
    before: dict[int, list[EditableOp]] = {}  # main op (by identity) → codec ops to run before it
    after: dict[int, list[EditableOp]] = {}  # main op → codec ops to run after it
    done: list[CodecInsertion] = []
    for op in ops:
        if op.stream != "allgather":
            continue
        seconds = kernel_s(op)
        if seconds is None:
            continue
        sender_s, receiver_s = seconds
        send = receive = None
        waiter = waiters.get(id(op))
        if overlap:
            if sender_s > 0:
                send = EditableOp(op.rank, "ccp_send", op.layer, op.phase, sender_s, issuer=op.issuer)
                before.setdefault(id(op), []).append(send)
                op.issuer = send
            if receiver_s > 0 and waiter is not None:
                receive = EditableOp(op.rank, "ccp_recv", op.layer, op.phase, receiver_s, issuer=op)
                after.setdefault(id(op), []).append(receive)
                if waiter.blocker is None or waiter.blocker is op:
                    waiter.blocker = receive
                else:  # it waits for another collective too: a zero-length wait for this one first
                    wait = EditableOp(op.rank, "compute", waiter.layer, waiter.phase, 0.0, blocker=receive)
                    before.setdefault(id(waiter), []).append(wait)
        else:
            if sender_s > 0:
                # Right after the op that issues the gather (at the iteration's start when none does).
                send = EditableOp(op.rank, "codec_send", op.layer, op.phase, sender_s)
                after.setdefault(id(op.issuer) if op.issuer is not None else 0, []).append(send)
                op.issuer = send
            if receiver_s > 0 and waiter is not None:
                receive = EditableOp(op.rank, "codec_recv", op.layer, op.phase, receiver_s, blocker=op)
                if waiter.blocker is op:
                    waiter.blocker = None  # it now follows the decode that waited for the gather
                before.setdefault(id(waiter), []).append(receive)
        done.append(CodecInsertion(op, send, receive))
    edited: list[EditableOp] = list(after.get(0, []))
    for op in ops:
        edited.extend(before.get(id(op), []))
        edited.append(op)
        edited.extend(after.get(id(op), []))
    relink_main(edited)
    return edited, done


def _ciera(ops, system, plan, scale, preset, gathers, kernels, source) -> list[EditableOp]:  # noqa: ANN001
    """One rank's CIERA rewrite, its shape only: each compressed gather is listed in `gathers` (with its
    op in the plain graph, `source`) and each codec kernel inserted in `kernels`, for
    `CieraTemplate.fill` to give them the plan's values."""

    def kernel_s(op: EditableOp) -> tuple[float, float] | None:
        layer_plan = plan.layers.get(op.layer)
        if layer_plan is None:
            return None
        return layer_plan.sender_s * scale, layer_plan.receiver_s * scale

    edited, done = insert_codec(ops, system == "ciera", kernel_s)
    for insertion in done:
        op = insertion.gather
        first = op.phase == "fwd" or not preset.ciera.reuse_across_gathers
        gathers.append((op, source[id(op)], op.layer, first))
        if insertion.send is not None:
            kernels.append((insertion.send, op.layer, True))
        if insertion.receive is not None:
            kernels.append((insertion.receive, op.layer, False))
    return edited
