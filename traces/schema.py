"""Arrow schemas of the trace bundle, version 1. docs/trace-format.md explains every column."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"ciera.trace_schema"
TABLE_KEY = b"ciera.table"

SOURCES = ("measured", "analytic")
DTYPES = ("bf16", "fp16")
PHASES = ("fwd", "recompute", "bwd", "optim")
LAYER_KINDS = ("embedding", "block", "head")
CATEGORIES = ("expert_ffn", "attention", "router", "norm", "embedding")
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")

RUNS = pa.schema(
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

COLLECTIVES = pa.schema(
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

EXPONENTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("layer", pa.int32()),
        ("shard", pa.string()),
        ("category", pa.string()),
        ("numel", pa.int64()),
        ("block_size", pa.int32()),
        ("exp_change_rate", pa.float64()),
        ("block_change_rate", pa.float64()),
    ]
)

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "runs": RUNS,
    "layers": LAYERS,
    "iterations": ITERATIONS,
    "collectives": COLLECTIVES,
    "exponents": EXPONENTS,
}

# Columns whose values must lie in a closed set.
ALLOWED_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("runs", "source"): SOURCES,
    ("runs", "dtype"): DTYPES,
    ("layers", "phase"): PHASES,
    ("layers", "layer_kind"): LAYER_KINDS,
    ("collectives", "op"): COLLECTIVE_OPS,
    ("collectives", "source"): SOURCES,
    ("exponents", "category"): CATEGORIES,
}

# Rate columns: fractions in [0, 1].
RATE_COLUMNS = {("exponents", "exp_change_rate"), ("exponents", "block_change_rate")}

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
}


def with_metadata(table_name: str) -> pa.Schema:
    """The schema of `table_name` with the version and table tags written into each file."""
    return TABLE_SCHEMAS[table_name].with_metadata(
        {SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: table_name.encode()}
    )
