"""Collective cost model: hierarchical ring α–β, calibrated to nccl-tests style bus-bandwidth points.

A ring AllGather of a full (gathered) size S over p ranks costs (p−1)·α + (p−1)/p · S/β. Across nodes
(G GPUs per node, M = ceil(W/G) nodes) the gather runs in two levels: G parallel inter-node rings, one
per local rank, each gathering S/G over M ranks on a 1/G share of the node's injection bandwidth β_inter
(so that level costs (M−1)·α_inter + (M−1)/M · S/β_inter), then an intra-node ring over S on NVLink.
ReduceScatter costs the same as AllGather (nccl-tests convention), AllReduce = ReduceScatter + AllGather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .cluster import CalibrationPoint, ClusterPreset
from .errors import SimInputError

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def algbw_Bps(bytes_total: float, time_s: float) -> float:
    """nccl-tests algorithm bandwidth: S / t with S the full gathered / reduced size."""
    return bytes_total / time_s


def busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests busbw/algbw factor: (n−1)/n for AllGather and ReduceScatter, 2(n−1)/n for AllReduce."""
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    raise SimInputError(f"collective op {op!r}, expected one of {list(COLLECTIVE_OPS)}")


def busbw_Bps(op: str, bytes_total: float, time_s: float, ranks: int) -> float:
    """nccl-tests bus bandwidth, comparable to the link speed whatever the rank count."""
    return algbw_Bps(bytes_total, time_s) * busbw_factor(op, ranks)


@dataclass(frozen=True)
class CollectiveModel:
    """Hierarchical ring α–β costs for one cluster; every size is the full gathered size S in bytes."""

    gpus_per_node: int
    intra_alpha_s: float
    intra_beta_Bps: float
    inter_alpha_s: float
    inter_beta_Bps: float
    # Where inter_beta_Bps came from: "preset", "calibration" (preset points) or "measured" (bundle rows).
    inter_beta_source: str = "preset"
    # Relative RMS error of the model against the points it was fitted to (0 when not fitted).
    fit_relative_rms: float = 0.0

    @classmethod
    def from_preset(cls, preset: ClusterPreset, measured: pd.DataFrame | None = None) -> CollectiveModel:
        """Build the model; when preset.inter_node.beta_Bps is 0, fit it by least squares (relative error)
        to the bundle's measured collectives rows of this cluster that span >1 node, or else to the preset's
        [[calibration]] points."""
        base = cls(
            gpus_per_node=preset.gpus_per_node,
            intra_alpha_s=preset.intra_node.alpha_s,
            intra_beta_Bps=preset.intra_node.beta_Bps,
            inter_alpha_s=preset.inter_node.alpha_s,
            inter_beta_Bps=preset.inter_node.beta_Bps,
        )
        if preset.inter_node.beta_Bps > 0:
            return base
        measured_multi = [p for p in _measured_points(preset, measured) if p.nodes >= 2]
        # Measured collectives that all stay inside one node say nothing about the inter-node link: the
        # preset's calibration points fit it then (inter_beta_source says which was used).
        multi_node, source = (
            (measured_multi, "measured")
            if measured_multi
            else (
                [p for p in preset.calibration if p.nodes >= 2],
                "calibration",
            )
        )
        if not multi_node:
            raise SimInputError(
                f"{preset.origin}: field 'inter_node.beta_Bps': value 0 asks for a fit, but no calibration point "
                "or measured collective spans more than one node; set inter_node.beta_Bps or add a [[calibration]] point"
            )
        return base._fitted(multi_node, source)

    def _fitted(self, points: list[CalibrationPoint], source: str) -> CollectiveModel:
        # Each point's time is t = fixed + k·x with x = 1/β_inter: solve min Σ((fixed + k·x − t)/t)² in
        # closed form (a 1-D weighted least squares), weighting by 1/t² so small and large sizes count alike.
        fixed, slope, measured = [], [], []
        for point in points:
            per_op = 2.0 if point.op == "all_reduce" else 1.0
            time_s = point.bytes / (point.busbw_Bps / busbw_factor(point.op, point.world_size))
            nodes, ranks_in_node = self._levels(point.world_size, point.nodes)
            intra = self._ring_s(ranks_in_node, point.bytes, self.intra_alpha_s, self.intra_beta_Bps)
            fixed.append(per_op * (intra + (nodes - 1) * self.inter_alpha_s))
            slope.append(per_op * (nodes - 1) / nodes * point.bytes)
            measured.append(time_s)
        fixed_a, slope_a, time_a = np.array(fixed), np.array(slope), np.array(measured)
        weight = 1.0 / time_a**2
        inverse_beta = float(np.sum(weight * slope_a * (time_a - fixed_a)) / np.sum(weight * slope_a**2))
        if not inverse_beta > 0:
            raise SimInputError(
                "inter_node.beta_Bps: the calibration points are faster than the intra-node and latency terms "
                "alone allow; check intra_node.* and inter_node.alpha_s against the calibration"
            )
        predicted = fixed_a + slope_a * inverse_beta
        residual = float(np.sqrt(np.mean(((predicted - time_a) / time_a) ** 2)))
        return CollectiveModel(
            gpus_per_node=self.gpus_per_node,
            intra_alpha_s=self.intra_alpha_s,
            intra_beta_Bps=self.intra_beta_Bps,
            inter_alpha_s=self.inter_alpha_s,
            inter_beta_Bps=1.0 / inverse_beta,
            inter_beta_source=source,
            fit_relative_rms=residual,
        )

    def _levels(self, world_size: int, nodes: int | None = None) -> tuple[int, int]:
        """(nodes M, ranks per node in the group) for a group of `world_size` ranks."""
        node_count = nodes if nodes is not None else math.ceil(world_size / self.gpus_per_node)
        return node_count, math.ceil(world_size / node_count)

    @staticmethod
    def _ring_s(ranks: int, bytes_total: float, alpha_s: float, beta_Bps: float) -> float:
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * alpha_s + (ranks - 1) / ranks * bytes_total / beta_Bps

    def allgather_s(self, bytes_total: float, world_size: int) -> float:
        """Time of one AllGather producing `bytes_total` bytes on each of `world_size` ranks."""
        nodes, ranks_in_node = self._levels(world_size)
        intra = self._ring_s(ranks_in_node, bytes_total, self.intra_alpha_s, self.intra_beta_Bps)
        if nodes <= 1:
            return intra
        # G rings of M ranks each move S/G at β_inter/G: the per-rail bandwidth cancels the 1/G.
        inter = (nodes - 1) * self.inter_alpha_s + (nodes - 1) / nodes * bytes_total / self.inter_beta_Bps
        return inter + intra

    def intra_node_allgather_s(self, bytes_total: float, world_size: int) -> float:
        """AllGather confined to one node (ZeRO++ hpZ secondary partition): NVLink ring over min(W, G)."""
        ranks = min(world_size, self.gpus_per_node)
        return self._ring_s(ranks, bytes_total, self.intra_alpha_s, self.intra_beta_Bps)

    def allgather_traffic_bytes(self, bytes_total: float, world_size: int) -> tuple[float, float]:
        """(inter-node, intra-node) bytes one rank receives in the two-level AllGather of `allgather_s`.

        Inter-node: its rail's ring gathers S/G over M nodes, so (M−1)/M · S/G arrive over the network.
        Intra-node: the NVLink ring over S brings (G−1)/G · S. Their sum is not S: the inter-node share is
        forwarded again inside the node."""
        nodes, ranks_in_node = self._levels(world_size)
        intra = (ranks_in_node - 1) / ranks_in_node * bytes_total
        inter = (nodes - 1) / nodes * bytes_total / ranks_in_node if nodes > 1 else 0.0
        return inter, intra

    def intra_node_allgather_traffic_bytes(self, bytes_total: float, world_size: int) -> tuple[float, float]:
        """(inter-node, intra-node) bytes one rank receives in `intra_node_allgather_s` (hpZ): none cross."""
        ranks = min(world_size, self.gpus_per_node)
        return 0.0, (ranks - 1) / ranks * bytes_total

    def reduce_scatter_s(self, bytes_total: float, world_size: int) -> float:
        """ReduceScatter of a full gradient of `bytes_total`; same cost as AllGather (nccl-tests)."""
        return self.allgather_s(bytes_total, world_size)

    def all_reduce_s(self, bytes_total: float, world_size: int) -> float:
        """Ring AllReduce = ReduceScatter + AllGather."""
        return 2.0 * self.allgather_s(bytes_total, world_size)

    def time_s(self, op: str, bytes_total: float, world_size: int) -> float:
        if op == "all_gather_intra":
            return self.intra_node_allgather_s(bytes_total, world_size)
        if op == "all_gather":
            return self.allgather_s(bytes_total, world_size)
        if op == "reduce_scatter":
            return self.reduce_scatter_s(bytes_total, world_size)
        if op == "all_reduce":
            return self.all_reduce_s(bytes_total, world_size)
        raise SimInputError(f"collective op {op!r}, expected one of {list(COLLECTIVE_OPS)}")

    def link_s(self, op: str, bytes_total: float, world_size: int) -> float:
        """The bandwidth term of `time_s` at the level that bounds it: the inter-node ring's
        (M−1)/M · S/β_inter across nodes, else the NVLink ring's (G−1)/G · S/β_intra — the part a
        collective spends moving bytes through a link that collectives in flight beside it share."""
        per_op = 2.0 if op == "all_reduce" else 1.0
        nodes, ranks_in_node = self._levels(world_size)
        if op == "all_gather_intra":  # hpZ: inside the node, never on the inter-node link
            if nodes > 1:
                return 0.0
            per_op = 1.0
        if nodes > 1:
            return per_op * (nodes - 1) / nodes * bytes_total / self.inter_beta_Bps
        if ranks_in_node > 1:
            return per_op * (ranks_in_node - 1) / ranks_in_node * bytes_total / self.intra_beta_Bps
        return 0.0

    def allgather_marginal_s_per_byte(self, world_size: int) -> float:
        """d AllGather time / d S: what one more gathered byte costs (α terms drop out of differences)."""
        nodes, ranks_in_node = self._levels(world_size)
        per_byte = (ranks_in_node - 1) / ranks_in_node / self.intra_beta_Bps if ranks_in_node > 1 else 0.0
        if nodes > 1:
            per_byte += (nodes - 1) / nodes / self.inter_beta_Bps
        return per_byte

    def collectives_rows(
        self, cluster: str, world_sizes: list[int], sizes_bytes: list[int], source: str = "analytic"
    ) -> pd.DataFrame:
        """A `collectives` table (trace schema v2) of this model's predictions, e.g. for analytic bundles:
        one repetition each, so the median, minimum and maximum times are the predicted time."""
        rows = []
        for op in COLLECTIVE_OPS:
            for world_size in world_sizes:
                if world_size < 2:
                    continue
                for size in sizes_bytes:
                    time_s = self.time_s(op, size, world_size)
                    rows.append(
                        {
                            "cluster": cluster,
                            "op": op,
                            "world_size": world_size,
                            "nodes": math.ceil(world_size / self.gpus_per_node),
                            "bytes": int(size),
                            "time_s": time_s,
                            "algbw_Bps": algbw_Bps(size, time_s),
                            "busbw_Bps": busbw_Bps(op, size, time_s, world_size),
                            "source": source,
                            "repetitions": 1,
                            "time_min_s": time_s,
                            "time_max_s": time_s,
                            "transport_cpu_s": math.nan,  # a model's row: nothing measured
                        }
                    )
        frame = pd.DataFrame(rows)
        return frame.astype(
            {"world_size": "int32", "nodes": "int32", "bytes": "int64", "repetitions": "int32"}
        )


def _measured_points(preset: ClusterPreset, measured: pd.DataFrame | None) -> list[CalibrationPoint]:
    """Measured collectives rows of this cluster as calibration points (analytic rows are ignored: they were
    produced from a preset and would only echo it back)."""
    if measured is None or len(measured) == 0:
        return []
    rows = measured[
        (measured["cluster"] == preset.name)
        & (measured["source"] == "measured")
        & (measured["op"].isin(COLLECTIVE_OPS))
        & (measured["world_size"] >= 2)
        & (measured["time_s"] > 0)
    ]
    return [
        CalibrationPoint(
            op=str(row.op),
            world_size=int(row.world_size),
            nodes=int(row.nodes),
            bytes=int(row.bytes),
            busbw_Bps=float(busbw_Bps(str(row.op), row.bytes, row.time_s, int(row.world_size))),
        )
        for row in rows.itertuples(index=False)
    ]
