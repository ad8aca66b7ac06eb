"""CIERA's trace-driven scale-out simulator (imports without torch).

Cluster presets (`load_cluster`), the hierarchical collective cost model (`CollectiveModel`).
"""

from .cluster import ClusterPreset, list_clusters, load_cluster, parse_overrides
from .collectives import CollectiveModel, algbw_Bps, busbw_Bps, busbw_factor
from .errors import SimInputError

__all__ = [
    "ClusterPreset",
    "CollectiveModel",
    "SimInputError",
    "algbw_Bps",
    "busbw_Bps",
    "busbw_factor",
    "list_clusters",
    "load_cluster",
    "parse_overrides",
]
