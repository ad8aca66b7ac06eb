"""Trace bundles: the versioned Parquet tables that measurement writes and the simulator reads.

Public surface: `TraceBundle`, `read_bundle`, `write_bundle`, `validate_bundle`, `derive_layer_tables`,
`run_summaries`, `stream_summaries` (with `BUSY_HOST_SHARE`, `busy_host_summary`, `launch_spread_summary`),
`TraceError`, `default_bundle_path`, `SCHEMA_VERSION`. The format (version 2; version-1 bundles are read and
upgraded in memory) is documented in docs/trace-format.md.

Model shapes (data both `measure` and `sim` read): `ModelShape`, `load_model_shape`, `model_keys`,
`ModelShapeError` (traces/data/models/*.toml).
"""

import os
from pathlib import Path

from .bundle import TABLE_NAMES, TraceBundle, empty_table, read_bundle, validate_bundle, write_bundle
from .derive import (
    BUSY_HOST_SHARE,
    busy_host_summary,
    derive_layer_tables,
    launch_spread_summary,
    run_summaries,
    stream_summaries,
)
from .errors import TraceError
from .models import ModelShape, ModelShapeError, load_model_shape, model_keys
from .schema import BACKENDS, CATEGORIES, DTYPES, ENGINES, PHASES, SCHEMA_VERSION, STREAMS


def default_bundle_path() -> Path:
    """The bundle shipped with the package: analytic traces of six MoE models on the method's testbed."""
    return Path(__file__).parent / "data" / "default"


def measured_bundle_path() -> Path:
    """The measured bundle shipped with the package: real DeepSpeed ZeRO-3 / FSDP2 / CIERA runs captured
    with `ciera measure all` on the emulated two-level cluster (docs/measurement.md says how)."""
    return Path(__file__).parent / "data" / "measured"


def measured_olmoe_bundle_path() -> Path:
    """A second measured bundle: OLMoE-1B-7B at 1/32 width on 2 x 1 and 3 x 1 nodes at 500 Mbit — another
    zoo model on another link, to check the simulator beyond the bundle it was built against."""
    return Path(__file__).parent / "data" / "measured-olmoe"


def measured_w16_bundle_path() -> Path:
    """The measured bundle's model at 1/16 width (four times the bytes per engine call): the same clusters,
    systems and capture command at depths 2, 4, 6 — where ZeRO-3 + CIERA's per-call cost is smaller
    against what its bytes save (README, "At 1/16 width")."""
    return Path(__file__).parent / "data" / "measured-w16"


# Bundles the CLI knows by name (`--bundle measured`); anything else is a directory path.
NAMED_BUNDLES = {
    "analytic": default_bundle_path,
    "default": default_bundle_path,
    "measured": measured_bundle_path,
    "measured-olmoe": measured_olmoe_bundle_path,
    "measured-w16": measured_w16_bundle_path,
}
# The shipped bundles of measured runs (what `ciera validate sim` and the benchmarks take by name).
MEASURED_BUNDLE_NAMES = tuple(name for name in NAMED_BUNDLES if name.startswith("measured"))


def resolve_bundle(name_or_path: str | os.PathLike[str]) -> Path:
    """A name of NAMED_BUNDLES: that shipped bundle; else the path as given."""
    text = os.fspath(name_or_path)
    if text in NAMED_BUNDLES:
        path = NAMED_BUNDLES[text]()
        if not path.is_dir():
            raise TraceError(f"--bundle {text}: the shipped bundle is missing at {path} (a partial install?)")
        return path
    return Path(text)


__all__ = [
    "BACKENDS",
    "CATEGORIES",
    "DTYPES",
    "ENGINES",
    "ModelShape",
    "ModelShapeError",
    "PHASES",
    "SCHEMA_VERSION",
    "STREAMS",
    "TABLE_NAMES",
    "TraceBundle",
    "TraceError",
    "default_bundle_path",
    "measured_bundle_path",
    "measured_olmoe_bundle_path",
    "measured_w16_bundle_path",
    "MEASURED_BUNDLE_NAMES",
    "NAMED_BUNDLES",
    "resolve_bundle",
    "derive_layer_tables",
    "run_summaries",
    "stream_summaries",
    "BUSY_HOST_SHARE",
    "busy_host_summary",
    "launch_spread_summary",
    "empty_table",
    "load_model_shape",
    "model_keys",
    "read_bundle",
    "validate_bundle",
    "write_bundle",
]
