"""Reading older bundles: a version-1 table becomes its version-2 form in memory (docs/trace-format.md,
*Reading version 1*). What version 1 did not record is filled with zeros and said in a note."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .schema import TABLE_SCHEMAS

V1_UPGRADE_NOTE = "schema v1 bundle read as v2: engine config, link and events unknown (filled with zeros)"


def upgrade_v1_table(name: str, frame: pd.DataFrame) -> pd.DataFrame:
    """The version-2 form of the version-1 table `name` (already checked against the version-1 schema)."""
    if name == "runs":
        frame = frame.assign(
            engine="zero3",
            backend=np.where(frame["source"] == "analytic", "analytic", "gloo"),
            nodes=-(-frame["world_size"] // frame["gpus_per_node"]),
            prefetch_bucket_size=0,
            max_reuse_distance=0,
            max_live_parameters=0,
            reshard_after_forward=False,
            link_rate_Bps=0.0,
            link_latency_s=0.0,
            measured_link_Bps=0.0,
            warmup_iterations=0,
            clock_spread_s=0.0,
            reduce_bucket_size=np.nan,
        )
    elif name == "collectives":
        frame = frame.assign(
            repetitions=1, time_min_s=frame["time_s"], time_max_s=frame["time_s"], transport_cpu_s=np.nan
        )
    schema = TABLE_SCHEMAS[name]
    return frame[schema.names].astype(schema.empty_table().to_pandas().dtypes.to_dict())
