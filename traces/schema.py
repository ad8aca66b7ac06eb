"""Arrow schemas of the trace bundle, version 2 (and version 1, which the reader upgrades).

docs/trace-format.md explains every column."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 2
# Versions `traces.read_bundle` reads; older ones are upgraded in memory (traces/upgrade.py).
READABLE_VERSIONS = (1, 2)
SCHEMA_VERSION_KEY = b"ciera.trace_schema"
TABLE_KEY = b"ciera.table"

SOURCES = ("measured", "analytic")
DTYPES = ("bf16", "fp16")
PHASES = ("fwd", "recompute", "bwd", "optim")
LAYER_KINDS = ("embedding", "block", "head")
CATEGORIES = ("expert_ffn", "attention", "router", "norm", "embedding")
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")
ENGINES = ("zero3", "fsdp")
BACKENDS = ("gloo", "nccl", "analytic")
# gather_host: the main thread inside the engine's own gather call (its host path); bundles before it have
# none (their engines' gather paths are inside `compute`).
STREAMS = (
    "compute", "gather_host", "allgather", "reduce_scatter", "all_reduce", "codec_send", "codec_recv", "optim",
)  # fmt: skip

RUNS_V1 = pa.schema(
    [
        ("run_id", pa.string()),
        ("source", pa.string()),
        ("model", pa.string()),
        ("dtype", pa.string()),
        ("layers", pa.int32()),
        ("full_layers", pa.int32()),
        ("seq_len", pa.int32()),
        ("micro_batch_size", pa.int32()),
        ("world_size", pa.int32()),
        ("gpus_per_node", pa.int32()),
        ("hardware", pa.string()),
        ("cluster", pa.string()),
        ("system", pa.string()),
        ("block_size", pa.int32()),
        ("activation_checkpointing", pa.bool_()),
        ("optimizer", pa.string()),
        ("versions", pa.string()),
    ]
)

LAYERS = pa.schema(
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("layer", pa.int32()),
        ("layer_kind", pa.string()),
        ("phase", pa.string()),
        ("numel", pa.int64()),
        ("compute_s", pa.float64()),
        ("allgather_bytes", pa.int64()),
        ("allgather_s", pa.float64()),
        ("reduce_scatter_bytes", pa.int64()),
        ("reduce_scatter_s", pa.float64()),
        ("hash_s", pa.float64()),
        ("compress_s", pa.float64()),
        ("decompress_s", pa.float64()),
    ]
)

ITERATIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("iteration_s", pa.float64()),
    ]
)

COLLECTIVES_V1 = pa.schema(
    [
        ("cluster", pa.string()),
        ("op", pa.string()),
        ("world_size", pa.int32()),
        ("nodes", pa.int32()),
        ("bytes", pa.int64()),
        ("time_s", pa.float64()),
        ("algbw_Bps", pa.float64()),
        ("busbw_Bps", pa.float64()),
        ("source", pa.string()),
    ]
)

# The leading columns of the per-parameter tables (exponents, shard_changes): run × iteration × parameter.
PARAMETER_COLUMNS = [
    ("run_id", pa.string()),
    ("iteration", pa.int32()),
    ("layer", pa.int32()),
    ("shard", pa.string()),
    ("category", pa.string()),
    ("numel", pa.int64()),
]

EXPONENTS = pa.schema(
    PARAMETER_COLUMNS
    + [
        ("block_size", pa.int32()),
        ("exp_change_rate", pa.float64()),
        ("block_change_rate", pa.float64()),
    ]
)

RUNS = pa.schema(
    list(RUNS_V1)
    + [
        ("engine", pa.string()),
        ("backend", pa.string()),
        ("nodes", pa.int32()),
        ("prefetch_bucket_size", pa.int64()),
        ("max_reuse_distance", pa.int64()),
        ("max_live_parameters", pa.int64()),
        ("reshard_after_forward", pa.bool_()),
        ("link_rate_Bps", pa.float64()),
        ("link_latency_s", pa.float64()),
        ("measured_link_Bps", pa.float64()),
        ("warmup_iterations", pa.int32()),
        ("clock_spread_s", pa.float64()),
        # DeepSpeed's reduce_bucket_size (elements) of a ZeRO-3 run, 0 for other engines; NaN: not recorded
        # (captures before 2026-12-05, analytic runs).
        ("reduce_bucket_size", pa.float64()),
    ]
)

COLLECTIVES = pa.schema(
    list(COLLECTIVES_V1)
    + [
        ("repetitions", pa.int32()),
        ("time_min_s", pa.float64()),
        ("time_max_s", pa.float64()),
        # Core-seconds per rank the transport took beside the calling thread (CPU sweeps; NaN: not
        # measured — a CUDA sweep, an analytic row, or a bundle written before the column existed).
        ("transport_cpu_s", pa.float64()),
    ]
)

EVENTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("rank", pa.int32()),
        ("iteration", pa.int32()),
        ("layer", pa.int32()),
        ("phase", pa.string()),
        ("stream", pa.string()),
        ("issued_s", pa.float64()),
        ("start_s", pa.float64()),
        ("end_s", pa.float64()),
        ("raw_bytes", pa.int64()),
        ("wire_bytes", pa.int64()),
    ]
)

SHARD_CHANGES = pa.schema(
    PARAMETER_COLUMNS
    + [
        ("world_size", pa.int32()),
        ("shard_change_rate", pa.float64()),
    ]
)

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "runs": RUNS,
    "layers": LAYERS,
    "iterations": ITERATIONS,
    "collectives": COLLECTIVES,
    "exponents": EXPONENTS,
    "events": EVENTS,
    "shard_changes": SHARD_CHANGES,
}

# Version 1: five tables; `runs` and `collectives` without the columns version 2 added.
V1_TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "runs": RUNS_V1,
    "layers": LAYERS,
    "iterations": ITERATIONS,
    "collectives": COLLECTIVES_V1,
    "exponents": EXPONENTS,
}

SCHEMAS_BY_VERSION: dict[int, dict[str, pa.Schema]] = {1: V1_TABLE_SCHEMAS, 2: TABLE_SCHEMAS}

# Columns whose values must lie in a closed set.
ALLOWED_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("runs", "source"): SOURCES,
    ("runs", "dtype"): DTYPES,
    ("layers", "phase"): PHASES,
    ("layers", "layer_kind"): LAYER_KINDS,
    ("collectives", "op"): COLLECTIVE_OPS,
    ("collectives", "source"): SOURCES,
    ("exponents", "category"): CATEGORIES,
    ("runs", "engine"): ENGINES,
    ("runs", "backend"): BACKENDS,
    ("events", "phase"): PHASES,
    ("events", "stream"): STREAMS,
    ("shard_changes", "category"): CATEGORIES,
}

# Rate columns: fractions in [0, 1].
RATE_COLUMNS = {
    ("exponents", "exp_change_rate"),
    ("exponents", "block_change_rate"),
    ("shard_changes", "shard_change_rate"),
}

# Integer columns that must be >= 1 (counts and sizes that cannot be zero).
POSITIVE_INT_COLUMNS = {
    ("runs", "layers"),
    ("runs", "full_layers"),
    ("runs", "seq_len"),
    ("runs", "micro_batch_size"),
    ("runs", "world_size"),
    ("runs", "gpus_per_node"),
    ("runs", "block_size"),
    ("collectives", "world_size"),
    ("collectives", "nodes"),
    ("exponents", "block_size"),
    ("runs", "nodes"),
    ("collectives", "repetitions"),
    ("shard_changes", "iteration"),
    ("shard_changes", "world_size"),
}

# Columns a file of this schema version may lack (read as NaN) and whose NaN means "not measured".
OPTIONAL_COLUMNS = {("collectives", "transport_cpu_s"), ("runs", "reduce_bucket_size")}

# Numeric columns with a floor other than 0: `events.layer` = -1 marks an event tied to no one layer.
MINIMUM_VALUES: dict[tuple[str, str], int] = {("events", "layer"): -1}


def with_metadata(table_name: str, version: int = SCHEMA_VERSION) -> pa.Schema:
    """The schema of `table_name` in `version` with the version and table tags written into each file."""
    return SCHEMAS_BY_VERSION[version][table_name].with_metadata(
        {SCHEMA_VERSION_KEY: str(version).encode(), TABLE_KEY: table_name.encode()}
    )
