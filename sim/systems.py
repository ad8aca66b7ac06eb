"""Operation graphs of one training iteration for each simulated system (docs/simulator.md).

Common skeleton (DeepSpeed ZeRO-3 order): forward over layers 0..N+1, then backward from the head down,
each transformer block first recomputing its forward (activation checkpointing) and then running its
backward; every layer step waits for its parameters to be gathered; the gather for step k is issued when
step k − d starts computing (prefetch depth d) and the gather stream serves gathers in order; after a
layer's backward its gradient is reduce-scattered on its own stream; the optimizer step runs at the end,
after the last ReduceScatter.

- zero3: the gathers the trace records per layer and phase — a checkpointed block is gathered for its
  forward and its recompute, whose parameters its backward reuses (DeepSpeed measured 2.1 gathers of a
  block per iteration); embedding and head twice (forward, backward).
- fsdp: FSDP's backward pre-hook unshards a block once and the checkpointed recompute reuses those
  parameters, so a block is gathered twice (forward, backward), with forward and backward prefetch.
- zeropp: forward gathers int8-quantized weights over all W ranks (qwZ, quantize/dequantize on the gather
  stream); recompute and backward gathers read the hpZ secondary partition inside the node; gradients are
  reduce-scattered as int4 (qgZ) with quantize/dequantize around it.
- ciera-er: exponent reuse on every parameter; hash, compress and decompress kernels are serialized with
  compute on the compute stream.
- ciera-er-bsc: the same, only for shards the benefit-driven selection picks; the rest travel raw.
- ciera: selection plus CCP: hash+compress on the sender stream one layer ahead of the gather, decompress
  on the receiver stream between gather and compute (the only codec work on the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .cluster import ClusterPreset
from .collectives import CollectiveModel
from .engine import Op, OpGraph
from .payload import raw_bytes
from .profile import PHASE_ORDER, ModelProfile
from .selection import select_shards

SYSTEMS = ("zero3", "fsdp", "zeropp", "ciera-er", "ciera-er-bsc", "ciera")
FP16_ONLY_SYSTEMS = ("zeropp",)
CIERA_SYSTEMS = ("ciera-er", "ciera-er-bsc", "ciera")
BSC_SYSTEMS = ("ciera-er-bsc", "ciera")  # the ones whose shards benefit-driven selection picks
NOISE_KINDS = ("compute", "allgather", "reduce_scatter", "codec")
# Name prefix of the sender kernels (hash+compress): the codec work CCP moves off the compute stream.
SENDER_CODEC_NAME = "hash+compress"


def noise_index(layer: int, phase: str, kind: str) -> int:
    return (layer * len(PHASE_ORDER) + PHASE_ORDER.index(phase)) * len(NOISE_KINDS) + NOISE_KINDS.index(kind)


def noise_slots(profile: ModelProfile) -> int:
    return (profile.full_layers + 2) * len(PHASE_ORDER) * len(NOISE_KINDS)


@dataclass(frozen=True)
class Step:
    """One layer's work on the compute stream in one phase."""

    layer: int
    phase: str
    compute_s: float
    allgather_bytes: float
    reduce_scatter_bytes: float
    compute_cv: float
    allgather_cv: float
    reduce_scatter_cv: float


@dataclass(frozen=True)
class BuiltSystem:
    graph: OpGraph
    allgather_bytes_per_iter: float  # Σ over gathers of the gathered (wire) tensor size S
    # What one rank receives per iteration in those gathers, over the network vs over NVLink
    # (CollectiveModel.allgather_traffic_bytes); hpZ gathers receive only inside the node.
    allgather_bytes_inter_node_per_iter: float
    allgather_bytes_intra_node_per_iter: float
    decisions: pd.DataFrame | None  # the BSC decision table (ciera systems), else None
    shards_selected: int


_STEPS_CACHE: dict[int, tuple[ModelProfile, tuple[list[Step], float, float]]] = {}


def compute_steps(profile: ModelProfile) -> tuple[list[Step], float, float]:
    """(layer steps in compute order, optimizer step seconds, optimizer coefficient of variation)."""
    cached = _STEPS_CACHE.get(id(profile))
    if cached is not None and cached[0] is profile:
        return cached[1]
    result = _compute_steps(profile)
    if len(_STEPS_CACHE) > 64:
        _STEPS_CACHE.clear()
    _STEPS_CACHE[id(profile)] = (profile, result)
    return result


def _compute_steps(profile: ModelProfile) -> tuple[list[Step], float, float]:
    rows = {(int(r.layer), str(r.phase)): r for r in profile.layers.itertuples(index=False)}
    last = profile.full_layers + 1

    def step(layer: int, phase: str) -> Step | None:
        row = rows.get((layer, phase))
        if row is None:
            return None
        return Step(
            layer,
            phase,
            float(row.compute_s),
            float(row.allgather_bytes),
            float(row.reduce_scatter_bytes),
            float(row.compute_cv),
            float(row.allgather_cv),
            float(row.reduce_scatter_cv),
        )

    order = [(layer, "fwd") for layer in range(last + 1)]
    order += [(last, "bwd")]
    for layer in range(last - 1, 0, -1):
        order += [(layer, "recompute"), (layer, "bwd")]
    order += [(0, "bwd")]
    steps = [s for s in (step(layer, phase) for layer, phase in order) if s is not None]
    optim_rows = profile.layers[profile.layers["phase"] == "optim"]
    optim_cv = float(optim_rows["compute_cv"].mean()) if len(optim_rows) else 0.0
    return steps, float(optim_rows["compute_s"].sum()), optim_cv


def _shard_codec_times(
    profile: ModelProfile, shards: pd.DataFrame, world_size: int, preset: ClusterPreset
) -> pd.DataFrame:
    """Per-gather hash/compress/decompress seconds per shard: the trace's per-layer times (split by numel,
    rescaled from the traced world size) when it has them, else the preset's kernel throughputs."""
    codec = preset.codec
    numel = shards["numel"].to_numpy(dtype=float)
    shard_bytes = raw_bytes(numel) / world_size
    received_bytes = raw_bytes(numel) * (world_size - 1) / world_size
    times = pd.DataFrame(
        {
            "hash_s": shard_bytes / codec.hash_Bps + codec.kernel_launch_s,
            "compress_s": shard_bytes / codec.compress_Bps + codec.kernel_launch_s,
            "decompress_s": received_bytes / codec.decompress_Bps + codec.kernel_launch_s,
        },
        index=shards.index,
    )
    fwd = profile.layers[profile.layers["phase"] == "fwd"].set_index("layer")
    traced_w = profile.compute_world_size
    scale = {
        "hash_s": traced_w / world_size,
        "compress_s": traced_w / world_size,
        "decompress_s": ((world_size - 1) / world_size) / max((traced_w - 1) / traced_w, 1e-12),
    }
    layer_numel = shards.groupby("layer")["numel"].transform("sum").to_numpy(dtype=float)
    for column in ("hash_s", "compress_s", "decompress_s"):
        traced = shards["layer"].map(fwd[column]).fillna(0.0).to_numpy(dtype=float)
        has_trace = traced > 0
        if has_trace.any():
            share = np.divide(numel, layer_numel, out=np.zeros_like(numel), where=layer_numel > 0)
            values = times[column].to_numpy(dtype=float, copy=True)
            values[has_trace] = traced[has_trace] * share[has_trace] * scale[column]
            times[column] = values
    return times


def _ciera_layer_plan(
    system: str,
    profile: ModelProfile,
    steps: list[Step],
    world_size: int,
    preset: ClusterPreset,
    collectives: CollectiveModel,
    selection: str = "benefit",
) -> tuple[pd.DataFrame, dict[int, dict[str, float]]]:
    """Decision table and, per layer, payload ratios and codec seconds of a gather."""
    shards = profile.shards.copy()
    shards["q"] = np.clip(shards["q"].to_numpy(dtype=float) * preset.ciera.change_rate_scale, 0.0, 1.0)
    shards = pd.concat([shards, _shard_codec_times(profile, shards, world_size, preset)], axis=1)
    gathers_per_layer: dict[int, int] = {}
    for step in steps:
        if step.allgather_bytes > 0:
            gathers_per_layer[step.layer] = gathers_per_layer.get(step.layer, 0) + 1
    total = shards["layer"].map(gathers_per_layer).fillna(0).astype(int)
    # Selection is per shard, but every block of a model sees the same gather count; use the typical one.
    typical_gathers = int(total.max()) if len(total) else 1
    changed = 1 if preset.ciera.reuse_across_gathers else typical_gathers
    decisions = select_shards(
        shards,
        world_size=world_size,
        dtype=profile.dtype,
        block_size=preset.ciera.block_size,
        entropy_bits=preset.ciera.exponent_entropy_bits,
        header_bytes=preset.ciera.header_bytes,
        comm_s_per_byte=collectives.allgather_marginal_s_per_byte(world_size),
        cache_budget_bytes=0 if selection == "none" else preset.ciera.cache_budget_bytes,
        changed_gathers=changed,
        unchanged_gathers=max(typical_gathers - changed, 0),
        overlap_codec=system == "ciera",
        select_all=system == "ciera-er" or selection == "all",
    )
    selected = decisions["selected"].to_numpy()
    raw = raw_bytes(decisions["numel"].to_numpy(dtype=float))
    layer_of = decisions["layer"].to_numpy(dtype=np.int64)
    slots = int(layer_of.max()) + 1 if len(layer_of) else 0

    def per_layer(values: np.ndarray) -> np.ndarray:
        return np.bincount(layer_of, weights=values, minlength=slots)

    raw_sum = per_layer(raw)
    changed_sum = per_layer(np.where(selected, decisions["changed_payload_bytes"].to_numpy(), raw))
    unchanged_sum = per_layer(np.where(selected, decisions["unchanged_payload_bytes"].to_numpy(), raw))
    sender_sum = per_layer(
        np.where(selected, shards["hash_s"].to_numpy() + shards["compress_s"].to_numpy(), 0.0)
    )
    receiver_sum = per_layer(np.where(selected, shards["decompress_s"].to_numpy(), 0.0))
    plan = {
        layer: {
            "changed_ratio": changed_sum[layer] / raw_sum[layer],
            "unchanged_ratio": unchanged_sum[layer] / raw_sum[layer],
            "sender_s": float(sender_sum[layer]),
            "receiver_s": float(receiver_sum[layer]),
        }
        for layer in np.unique(layer_of).tolist()
        if raw_sum[layer] > 0
    }
    return decisions, plan


def build_system(
    system: str,
    profile: ModelProfile,
    world_size: int,
    preset: ClusterPreset,
    collectives: CollectiveModel,
    selection: str = "benefit",
) -> BuiltSystem:
    """`selection` (CIERA systems with BSC): "benefit" — the per-shard gain model; "all" — every shard;
    "none" — no shard (the plain gathers)."""
    steps, optim_s, optim_cv = compute_steps(profile)
    graph = OpGraph()
    fsdp = system == "fsdp"
    zeropp = system == "zeropp"
    ciera = system in CIERA_SYSTEMS
    overlap_codec = system == "ciera"
    prefetch = preset.schedule.fsdp_prefetch_layers if fsdp else preset.schedule.zero3_prefetch_layers
    decisions, plan = (None, {})
    if ciera:
        decisions, plan = _ciera_layer_plan(
            system, profile, steps, world_size, preset, collectives, selection
        )

    # Which steps gather, and how many bytes. FSDP's recompute gathers what the backward needs; its
    # backward then reuses the unsharded parameters.
    gather_bytes = [s.allgather_bytes for s in steps]
    if fsdp:
        bwd_bytes = {s.layer: s.allgather_bytes for s in steps if s.phase == "bwd"}
        gather_bytes = [
            max(bwd_bytes.get(s.layer, 0.0), s.allgather_bytes)
            if s.phase == "recompute"
            else (
                0.0
                if s.phase == "bwd" and any(t.layer == s.layer and t.phase == "recompute" for t in steps)
                else b
            )
            for s, b in zip(steps, gather_bytes, strict=True)
        ]
    seen_gather: set[int] = set()
    first_gather = []
    for step, size in zip(steps, gather_bytes, strict=True):
        first_gather.append(size > 0 and step.layer not in seen_gather)
        if size > 0:
            seen_gather.add(step.layer)

    compute_index: list[int] = [-1] * len(steps)
    trigger_waiters: dict[int, list[tuple[int, str]]] = {}  # compute step → ops to patch with its start
    gather_done: dict[int, int] = {}  # step → op whose end makes the parameters usable
    total_gathered = 0.0
    total_inter_node = 0.0
    total_intra_node = 0.0
    zpp = preset.zeropp
    launch = preset.codec.kernel_launch_s

    def wait_for_start_of(step_index: int, op_index: int) -> None:
        if step_index >= 0:
            trigger_waiters.setdefault(step_index, []).append((op_index, "start"))

    def wait_for_issue(issue_step: int, op_index: int) -> None:
        """A gather (or its quantize) is issued when step `issue_step` starts. At prefetch depth 0 that is
        on demand: when the engine reaches the step, i.e. once the step before it has run — waiting for
        the step's own start would wait for itself."""
        if prefetch > 0:
            wait_for_start_of(issue_step, op_index)
        elif issue_step - 1 >= 0:
            op = graph.ops[op_index]
            op.deps_done = (*op.deps_done, compute_index[issue_step - 1])

    def add_gather_chain(j: int) -> None:
        """Sender work (if any), the collective, and receiver work for the gather of step j."""
        nonlocal total_gathered, total_inter_node, total_intra_node
        step = steps[j]
        size = gather_bytes[j]
        issue_step = j - prefetch
        sender_ops: list[int] = []
        layer_plan = plan.get(step.layer)
        if ciera and layer_plan is not None and layer_plan["sender_s"] > 0 and not overlap_codec:
            # ER without CCP: the sender kernels run on the compute stream just before the issuing step.
            sender_ops.append(
                graph.add(
                    Op(
                        f"{SENDER_CODEC_NAME} L{step.layer} {step.phase}",
                        "compute",
                        layer_plan["sender_s"],
                        "codec",
                        cv=step.compute_cv,
                        noise_index=noise_index(step.layer, step.phase, "codec"),
                    )
                )
            )
        if j in ccp_sender:
            sender_ops.append(ccp_sender[j])
        if zeropp and step.phase == "fwd":
            quantize = graph.add(
                Op(
                    f"quantize L{step.layer}",
                    "allgather",
                    size / world_size / zpp.quantize_Bps + launch,
                    "codec",
                    cv=step.compute_cv,
                    noise_index=noise_index(step.layer, step.phase, "codec"),
                )
            )
            wait_for_issue(issue_step, quantize)
            numel = size / 2
            wire = numel * zpp.weight_bits / 8 + np.ceil(numel / zpp.quantization_group_size) * 4
            comm_s = collectives.allgather_s(wire, world_size)
            traffic = collectives.allgather_traffic_bytes(wire, world_size)
        elif zeropp:
            wire, comm_s = size, collectives.intra_node_allgather_s(size, world_size)  # hpZ
            traffic = collectives.intra_node_allgather_traffic_bytes(size, world_size)
        elif ciera and layer_plan is not None:
            changed = first_gather[j] or not preset.ciera.reuse_across_gathers
            wire = size * layer_plan["changed_ratio" if changed else "unchanged_ratio"]
            comm_s = collectives.allgather_s(wire, world_size)
            traffic = collectives.allgather_traffic_bytes(wire, world_size)
        else:
            wire, comm_s = size, collectives.allgather_s(size, world_size)
            traffic = collectives.allgather_traffic_bytes(size, world_size)
        total_gathered += wire
        total_inter_node += traffic[0]
        total_intra_node += traffic[1]
        gather = graph.add(
            Op(
                f"allgather L{step.layer} {step.phase}",
                "allgather",
                comm_s,
                "allgather",
                deps_done=tuple(sender_ops),
                uses_link=True,
                issue_key=(issue_step, 0, j),
                bytes=wire,
                cv=step.allgather_cv,
                noise_index=noise_index(step.layer, step.phase, "allgather"),
            )
        )
        wait_for_issue(issue_step, gather)
        ready = gather
        if zeropp and step.phase == "fwd":
            ready = graph.add(
                Op(
                    f"dequantize L{step.layer}",
                    "allgather",
                    size / zpp.dequantize_Bps + launch,
                    "codec",
                    deps_done=(gather,),
                    cv=step.compute_cv,
                    noise_index=noise_index(step.layer, step.phase, "codec"),
                )
            )
        gather_done[j] = ready

    ccp_sender: dict[int, int] = {}

    def add_ccp_sender(j: int) -> None:
        """CCP: sender kernels on their own stream, issued one step before the gather of step j is."""
        step = steps[j]
        layer_plan = plan.get(step.layer)
        if not (
            overlap_codec and layer_plan is not None and layer_plan["sender_s"] > 0 and gather_bytes[j] > 0
        ):
            return
        ccp_sender[j] = graph.add(
            Op(
                f"{SENDER_CODEC_NAME} L{step.layer} {step.phase}",
                "codec_send",
                layer_plan["sender_s"],
                "codec",
                cv=step.compute_cv,
                noise_index=noise_index(step.layer, step.phase, "codec"),
            )
        )
        wait_for_start_of(j - prefetch - 1, ccp_sender[j])

    def add_receiver(k: int) -> None:
        step = steps[k]
        layer_plan = plan.get(step.layer)
        if not (ciera and layer_plan is not None and layer_plan["receiver_s"] > 0 and k in gather_done):
            return
        gather_done[k] = graph.add(
            Op(
                f"decompress L{step.layer} {step.phase}",
                "codec_recv" if overlap_codec else "compute",
                layer_plan["receiver_s"],
                "codec",
                deps_done=(gather_done[k],),
                cv=step.compute_cv,
                noise_index=noise_index(step.layer, step.phase, "codec"),
            )
        )

    for j in range(len(steps)):
        if j - prefetch - 1 < 0:
            add_ccp_sender(j)
    for j in range(len(steps)):
        if j - prefetch < 0 and gather_bytes[j] > 0:
            add_gather_chain(j)
    scatter_done: list[int] = []
    for k, step in enumerate(steps):
        if k + prefetch + 1 < len(steps):
            add_ccp_sender(k + prefetch + 1)
        j = k + prefetch
        if j < len(steps) and gather_bytes[j] > 0 and j - prefetch >= 0:
            add_gather_chain(j)
        add_receiver(k)
        compute = graph.add(
            Op(
                f"{step.phase} L{step.layer}",
                "compute",
                step.compute_s,
                "compute",
                deps_done=(gather_done[k],) if k in gather_done else (),
                cv=step.compute_cv,
                noise_index=noise_index(step.layer, step.phase, "compute"),
            )
        )
        compute_index[k] = compute
        for waiter, _ in trigger_waiters.pop(k, []):
            graph.ops[waiter].deps_start = (*graph.ops[waiter].deps_start, compute)
        if step.reduce_scatter_bytes > 0:
            scatter_done.append(
                _add_reduce_scatter(graph, step, k, compute, world_size, collectives, preset, zeropp)
            )
    # Triggers that point before the first step (issued at iteration start) need nothing.
    graph.add(
        Op(
            "optimizer step",
            "compute",
            optim_s,
            "compute",
            deps_done=tuple(scatter_done),
            cv=optim_cv,
            noise_index=noise_index(0, "optim", "compute"),
        )
    )
    shards_selected = int(decisions["selected"].sum()) if decisions is not None else 0
    return BuiltSystem(graph, total_gathered, total_inter_node, total_intra_node, decisions, shards_selected)


def _add_reduce_scatter(
    graph: OpGraph,
    step: Step,
    k: int,
    compute: int,
    world_size: int,
    collectives: CollectiveModel,
    preset: ClusterPreset,
    zeropp: bool,
) -> int:
    size = step.reduce_scatter_bytes
    deps: tuple[int, ...] = (compute,)
    if zeropp:  # qgZ: int4 gradients plus one scale per quantization group
        zpp = preset.zeropp
        quantize = graph.add(
            Op(
                f"quantize grad L{step.layer}",
                "reduce_scatter",
                size / zpp.quantize_Bps + preset.codec.kernel_launch_s,
                "codec",
                deps_done=deps,
                cv=step.compute_cv,
                noise_index=noise_index(step.layer, step.phase, "codec"),
            )
        )
        numel = size / 2
        size = numel * zpp.gradient_bits / 8 + np.ceil(numel / zpp.quantization_group_size) * 4
        deps = (quantize,)
    scatter = graph.add(
        Op(
            f"reduce_scatter L{step.layer}",
            "reduce_scatter",
            collectives.reduce_scatter_s(size, world_size),
            "reduce_scatter",
            deps_done=deps,
            uses_link=True,
            issue_key=(k, 1, k),
            bytes=size,
            cv=step.reduce_scatter_cv,
            noise_index=noise_index(step.layer, step.phase, "reduce_scatter"),
        )
    )
    if not zeropp:
        return scatter
    return graph.add(
        Op(
            f"dequantize grad L{step.layer}",
            "reduce_scatter",
            step.reduce_scatter_bytes / world_size / preset.zeropp.dequantize_Bps
            + preset.codec.kernel_launch_s,
            "codec",
            deps_done=(scatter,),
            cv=step.compute_cv,
            noise_index=noise_index(step.layer, step.phase, "codec"),
        )
    )
