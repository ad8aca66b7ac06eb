"""What one collective costs on a cluster, alone on the network, by size: the one collective model the
simulator re-costs graphs with.

- **Measured cluster** (`SweepCurve`): the cluster's collectives sweep (nccl-tests style, whole group),
  interpolated in log–log between the measured sizes — no line through points it does not fit: the
  engines' gathers sit between the small sizes that set an α and the large ones that set a β, where a
  straight α–β line misses by 70–146 %. Beyond the largest size it goes on linearly in S.
- **Its link part**: the bytes a collective of full size S moves across each node's link, `k_op ·
  (W − 1)/W · S` for a ring (`k_op` fitted from the sweep's slope and the link rate gloo measured on that
  cluster: 1 for gloo's ring all_gather, more for ops gloo runs another way), over that rate. The rest of
  the time (latency, CPU, the intra-node hops) is fixed.
- **Cluster preset** (`PresetCurve`): the preset's own hierarchical ring α–β (sim/collectives.py,
  calibrated to its nccl-tests points), its link part the bandwidth term of the level that bounds it.
- **Projected cluster** (`LevelCurve`): a topology that was not measured, of a measured kind (the same
  link): `(W − 1)·α_op + k_op·(W − 1)/W · S / B_link` with α_op (per ring step) and k_op from the kind's
  measured sweeps.
- **Transport CPU** (`transport_cpu_s`): the core-seconds per rank a collective's transport (gloo's
  threads, beside the calling thread) took in the CPU sweep, interpolated like its time; projected:
  `(W − 1)·c_step + (W − 1)/W · S · c_byte` fitted to the kind's sweeps; a preset's GPUs: none (their
  hosts' cores are not simulated). None where the sweep did not measure it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .collectives import CollectiveModel
from .errors import SimInputError

STREAM_OPS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}
# Streams only a system rewrite makes, with the curve that costs them: ZeRO++'s hpZ gathers inside a node
# (a preset's intra-node level; a measured cluster's sweep has no such curve).
REWRITE_STREAM_OPS = {"allgather_intra": "all_gather_intra"}
GRAPH_STREAM_OPS = {**STREAM_OPS, **REWRITE_STREAM_OPS}
LARGE_BYTES = 1 << 20  # sizes from here on set the slope (bandwidth-bound)
SMALL_BYTES = 16 << 10  # sizes up to here set the per-step latency


def _ring_share(world_size: int, nodes: int) -> float:
    """Bytes per byte of S that cross one node's link in a ring over `world_size` ranks on `nodes` nodes."""
    return (world_size - 1) / world_size if nodes > 1 else 0.0


@dataclass(frozen=True)
class SweepCurve:
    """A measured cluster's cost of one op by full size S (seconds), and the part of it on the link."""

    op: str
    sizes_bytes: np.ndarray
    times_s: np.ndarray  # median per size, its least-squares non-decreasing fit in S
    world_size: int
    nodes: int
    link_Bps: float  # what gloo measured across one node's link (0: one node)
    link_factor: float  # k_op
    transport_cpu_per_size_s: np.ndarray | None = None  # per size, per rank; None: not measured
    fastest_s: np.ndarray | None = None  # per size, the fastest repetition's (monotone); None: times_s

    def time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        return _log_log(self.sizes_bytes, self.times_s, size_bytes)

    def fastest_time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        """The least a collective of this size took in the sweep: what no run can beat."""
        return _log_log(
            self.sizes_bytes, self.times_s if self.fastest_s is None else self.fastest_s, size_bytes
        )

    def transport_cpu_s(self, size_bytes: np.ndarray) -> np.ndarray | None:
        if self.transport_cpu_per_size_s is None:
            return None
        return _log_log(self.sizes_bytes, self.transport_cpu_per_size_s, size_bytes)

    def link_s(self, size_bytes: np.ndarray) -> np.ndarray:
        if self.link_Bps <= 0:
            return np.zeros_like(np.asarray(size_bytes, dtype=float))
        link = (
            self.link_factor
            * _ring_share(self.world_size, self.nodes)
            * np.asarray(size_bytes)
            / self.link_Bps
        )
        return np.minimum(link, self.time_s(size_bytes))

    def describe(self) -> str:
        return f"{self.op}: measured sweep, {len(self.sizes_bytes)} sizes, interpolated"


def _log_log(sizes_bytes: np.ndarray, values: np.ndarray, at_bytes: np.ndarray) -> np.ndarray:
    """`values` (by size) interpolated in log–log at `at_bytes`; beyond the largest size, linear in S."""
    size = np.maximum(np.asarray(at_bytes, dtype=float), 1.0)
    floored = np.maximum(values, 1e-12)  # a zero would have no logarithm
    inside = np.exp(np.interp(np.log(size), np.log(sizes_bytes), np.log(floored)))
    slope = (values[-1] - values[-2]) / (sizes_bytes[-1] - sizes_bytes[-2])
    beyond = values[-1] + max(slope, 0.0) * (size - sizes_bytes[-1])
    return np.where(size > sizes_bytes[-1], beyond, inside)


@dataclass(frozen=True)
class LevelCurve:
    """A projected topology's cost of one op: a per-call cost, a per-ring-step α, and the link part of a
    measured kind."""

    op: str
    call_s: float
    alpha_s: float
    world_size: int
    nodes: int
    link_Bps: float
    link_factor: float
    transport_cpu_fit: tuple[float, float] | None = None  # (c_step, c_byte); None: not measured

    def transport_cpu_s(self, size_bytes: np.ndarray) -> np.ndarray | None:
        if self.transport_cpu_fit is None:
            return None
        step_s, byte_s = self.transport_cpu_fit
        share = (self.world_size - 1) / self.world_size
        return (self.world_size - 1) * step_s + share * np.asarray(size_bytes, dtype=float) * byte_s

    def link_s(self, size_bytes: np.ndarray) -> np.ndarray:
        if self.link_Bps <= 0:
            return np.zeros_like(np.asarray(size_bytes, dtype=float))
        return (
            self.link_factor
            * _ring_share(self.world_size, self.nodes)
            * np.asarray(size_bytes)
            / self.link_Bps
        )

    def time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        return self.call_s + (self.world_size - 1) * self.alpha_s + self.link_s(size_bytes)

    def fastest_time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        return self.link_s(size_bytes)  # a projection knows no fastest repetition: its link part alone

    def describe(self) -> str:
        return (
            f"{self.op}: {self.call_s * 1e3:.2f} ms per call + {self.alpha_s * 1e3:.3f} ms per ring step, "
            f"link factor {self.link_factor:.2f}"
        )


@dataclass(frozen=True)
class PresetCurve:
    """A cluster preset's cost of one op at one world size: its collective model, as it stands."""

    op: str
    model: CollectiveModel
    world_size: int

    def time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        # The α–β terms are elementwise arithmetic: the model takes an array of sizes as it is.
        sizes = np.asarray(size_bytes, dtype=float)
        return np.broadcast_to(self.model.time_s(self.op, sizes, self.world_size), sizes.shape).astype(float)

    def link_s(self, size_bytes: np.ndarray) -> np.ndarray:
        sizes = np.asarray(size_bytes, dtype=float)
        return np.broadcast_to(self.model.link_s(self.op, sizes, self.world_size), sizes.shape).astype(float)

    def transport_cpu_s(self, size_bytes: np.ndarray) -> np.ndarray | None:
        return None  # one GPU per rank: the hosts' cores are not simulated

    def fastest_time_s(self, size_bytes: np.ndarray) -> np.ndarray:
        return self.time_s(size_bytes)  # a model: no spread

    def describe(self) -> str:
        return f"{self.op}: the preset's hierarchical ring α–β at W = {self.world_size}"


Curve = SweepCurve | LevelCurve | PresetCurve


def monotone_fit(values: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators). A larger collective is
    never cheaper, but a sweep's few repetitions per size are noisy, mostly upward (interference only adds
    time): the running maximum carried one slow point at 1–4 KiB (3.0–3.4 ms on the 200 Mbit link, where
    8 KiB took 0.54 ms) to every size up to 128 KiB. Pooling averages such a point with the sizes it
    contradicts."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in np.asarray(values, dtype=float):
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(count), total / count) for total, count in blocks])


def sweep_curves(
    collectives: pd.DataFrame, cluster: str, world_size: int, nodes: int, link_Bps: float
) -> dict[str, SweepCurve]:
    """Per op, the measured curve of `cluster` over its whole group; {} when it has no complete sweep."""
    rows = collectives[
        (collectives["cluster"] == cluster)
        & (collectives["world_size"] == world_size)
        & (collectives["nodes"] == nodes)
        & (collectives["source"] == "measured")
    ]
    curves: dict[str, SweepCurve] = {}
    for op in STREAM_OPS.values():
        by_size = rows[rows["op"] == op].groupby("bytes")
        of_op = by_size["time_s"].median().sort_index()
        if len(of_op) < 3:
            return {}
        sizes = of_op.index.to_numpy(dtype=float)
        times = monotone_fit(of_op.to_numpy(dtype=float))
        transport = None  # measured at every size, or not at all (an older or a CUDA sweep)
        if "transport_cpu_s" in rows:
            cpu = by_size["transport_cpu_s"].median().sort_index().to_numpy(dtype=float)
            transport = monotone_fit(cpu) if np.isfinite(cpu).all() else None
        large = sizes >= LARGE_BYTES
        share = _ring_share(world_size, nodes)
        factor = 0.0
        if large.sum() >= 2 and share > 0 and link_Bps > 0:
            slope = float(np.polyfit(sizes[large], times[large], 1)[0])
            factor = max(slope * link_Bps / share, 0.0)
        fastest = None
        if "time_min_s" in rows:
            fastest = monotone_fit(by_size["time_min_s"].min().sort_index().to_numpy(dtype=float))
            fastest = np.minimum(fastest, times)
        curves[op] = SweepCurve(op, sizes, times, world_size, nodes, link_Bps, factor, transport, fastest)
    return curves


def level_curves(
    measured: list[dict[str, SweepCurve]], world_size: int, nodes: int, link_Bps: float
) -> dict[str, LevelCurve]:
    """Curves of a topology that was not measured, from measured curves of the same link kind. The
    small-size time (median up to 16 KiB, less its link part) of each measured cluster is fitted as call + (W − 1)·α over
    their world sizes (least squares, both ≥ 0); with a single world size all of it is per ring step,
    which is the pessimistic reading. k_op is the median link factor."""
    if not measured:
        raise SimInputError("no measured collectives sweep of this link kind to project a topology from")
    curves: dict[str, LevelCurve] = {}
    for op in STREAM_OPS.values():
        steps, small_times, factors = [], [], []
        for by_op in measured:
            curve = by_op[op]
            small = curve.sizes_bytes <= SMALL_BYTES
            if small.any():
                steps.append(max(curve.world_size - 1, 1))
                # What the small sizes cost beyond their bytes on the link.
                beyond = curve.times_s[small] - curve.link_s(curve.sizes_bytes[small])
                small_times.append(float(np.median(np.maximum(beyond, 0.0))))
            if curve.link_factor > 0:
                factors.append(curve.link_factor)
        call, alpha = _call_and_step(np.array(steps, dtype=float), np.array(small_times))
        curves[op] = LevelCurve(
            op,
            call,
            alpha,
            world_size,
            nodes,
            link_Bps,
            float(np.median(factors)) if factors else 1.0,
            _transport_fit([by_op[op] for by_op in measured]),
        )
    return curves


def _transport_fit(measured: list[SweepCurve]) -> tuple[float, float] | None:
    """(c_step, c_byte) ≥ 0 of transport CPU per rank ≈ (W − 1)·c_step + (W − 1)/W · S · c_byte, least
    squares over every measured size of the kind's sweeps (relative error: small sizes weigh as much);
    None when any of them lacks transport CPU."""
    if not measured or any(curve.transport_cpu_per_size_s is None for curve in measured):
        return None
    steps = np.concatenate([np.full(len(c.sizes_bytes), c.world_size - 1.0) for c in measured])
    moved = np.concatenate([c.sizes_bytes * (c.world_size - 1) / c.world_size for c in measured])
    cpu = np.concatenate([c.transport_cpu_per_size_s for c in measured])
    weight = 1.0 / np.maximum(cpu, 1e-9)
    design = np.column_stack([steps * weight, moved * weight])
    (step_s, byte_s), *_ = np.linalg.lstsq(design, cpu * weight, rcond=None)
    if step_s < 0 or byte_s < 0:  # one term alone, whichever fits better
        step_only = float(np.sum(steps * cpu * weight**2) / np.sum((steps * weight) ** 2))
        byte_only = float(np.sum(moved * cpu * weight**2) / np.sum((moved * weight) ** 2))
        errors = [
            np.sum((cpu - step_only * steps) ** 2 * weight**2),
            np.sum((cpu - byte_only * moved) ** 2 * weight**2),
        ]
        return (step_only, 0.0) if errors[0] <= errors[1] else (0.0, byte_only)
    return float(step_s), float(byte_s)


def _call_and_step(steps: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    if not len(steps):
        return 0.0, 0.0
    if len(set(steps.tolist())) < 2:
        return 0.0, float(np.median(times / steps))
    slope, intercept = np.polyfit(steps, times, 1)
    if slope < 0:
        return float(np.median(times)), 0.0
    if intercept < 0:
        return 0.0, float(np.sum(steps * times) / np.sum(steps**2))
    return float(intercept), float(slope)
