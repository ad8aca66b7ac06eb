"""Cluster presets: TOML files describing a GPU cluster, loaded into frozen dataclasses.

A preset is data, not code. `load_cluster("a100-hdr-testbed", {})` reads the packaged file
sim/data/clusters/a100-hdr-testbed.toml; `load_cluster("my.toml", {...})` reads a user's file. Overrides are
dotted keys (`inter_node.beta_Bps=25e9`, `ciera.block_size=256`) whose text is coerced to the type of the
field they replace, so what-if questions need no file edits.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SimInputError

_CLUSTERS_PACKAGE = "sim.data.clusters"


@dataclass(frozen=True)
class ComputeSpec:
    peak_flops: float = 312e12
    efficiency: float = 0.40
    memory_Bps: float = 1.6e12


@dataclass(frozen=True)
class LinkSpec:
    """One level of the collective hierarchy: per-ring-step latency and bandwidth.

    intra_node.beta_Bps is the ring busbw a GPU reaches inside a node; inter_node.beta_Bps is the per-node
    injection bandwidth shared by the node's G rails (0 = fit it to the calibration points)."""

    alpha_s: float
    beta_Bps: float


@dataclass(frozen=True)
class CalibrationPoint:
    op: str
    world_size: int
    nodes: int
    bytes: int
    busbw_Bps: float


@dataclass(frozen=True)
class CodecSpec:
    hash_Bps: float = 400e9
    compress_Bps: float = 60e9
    decompress_Bps: float = 80e9
    kernel_launch_s: float = 5e-6


@dataclass(frozen=True)
class ZeroppSpec:
    weight_bits: int = 8
    quantization_group_size: int = 2048
    quantize_Bps: float = 200e9
    dequantize_Bps: float = 250e9
    gradient_bits: int = 4


@dataclass(frozen=True)
class CieraSpec:
    cache_budget_bytes: int = 4 * 2**30
    block_size: int = 512
    change_rate_scale: float = 1.0
    # Entropy of trained weights' exponents; ANS codes a changed block to about this many bits per value.
    exponent_entropy_bits: float = 2.6
    # Payload header per shard and rank (magic, version, shard id, generation, dtype, numel).
    header_bytes: int = 32
    # Compare against the last gather (DESIGN.md): recompute and backward gathers then see no change.
    reuse_across_gathers: bool = True
    # Block change rate assumed for parameters the bundle carries no exponent statistics for.
    fallback_block_change_rate: float = 1.0


@dataclass(frozen=True)
class ScheduleSpec:
    # Layers gathered ahead of the one computing (DeepSpeed's prefetch bucket, FSDP's forward/backward prefetch).
    zero3_prefetch_layers: int = 1
    fsdp_prefetch_layers: int = 1


@dataclass(frozen=True)
class ClusterPreset:
    name: str
    gpus_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    description: str = ""
    hardware: str = ""
    # Memory of one GPU: configurations whose estimate (sim/memory.py) exceeds it are marked "does not fit".
    # 0 = not stated: every record says its fit was not checked.
    device_memory_bytes: float = 0.0
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    calibration: tuple[CalibrationPoint, ...] = ()
    codec: CodecSpec = field(default_factory=CodecSpec)
    zeropp: ZeroppSpec = field(default_factory=ZeroppSpec)
    ciera: CieraSpec = field(default_factory=CieraSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    # Where the preset came from (file path), for error messages; not a TOML key.
    origin: str = field(default="", compare=False)
    # Fields the TOML left out and their defaults filled (printed with every simulation: never silent).
    defaulted: tuple[str, ...] = field(default=(), compare=False)

    def nodes(self, world_size: int) -> int:
        return math.ceil(world_size / self.gpus_per_node)


# Fields that must be strictly positive / within [0, 1]; everything numeric must be finite and >= 0.
_POSITIVE_FIELDS = {
    "gpus_per_node",
    "intra_node.beta_Bps",
    "compute.peak_flops",
    "compute.efficiency",
    "compute.memory_Bps",
    "codec.hash_Bps",
    "codec.compress_Bps",
    "codec.decompress_Bps",
    "zeropp.weight_bits",
    "zeropp.quantization_group_size",
    "zeropp.quantize_Bps",
    "zeropp.dequantize_Bps",
    "zeropp.gradient_bits",
    "ciera.block_size",
    "ciera.exponent_entropy_bits",
}
_UNIT_INTERVAL_FIELDS = {"compute.efficiency", "ciera.fallback_block_change_rate"}
_BIT_WIDTH_FIELDS = {"zeropp.weight_bits": 16, "zeropp.gradient_bits": 16, "ciera.exponent_entropy_bits": 8}
_CALIBRATION_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def list_clusters() -> list[str]:
    """Names of the presets shipped with the package."""
    root = importlib.resources.files(_CLUSTERS_PACKAGE)
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def _read_preset_text(name_or_path: str) -> tuple[str, str]:
    """(origin, TOML text) for a preset name or a file path."""
    looks_like_path = name_or_path.endswith(".toml") or "/" in name_or_path or "\\" in name_or_path
    if not looks_like_path:
        resource = importlib.resources.files(_CLUSTERS_PACKAGE) / f"{name_or_path}.toml"
        if resource.is_file():
            return f"preset '{name_or_path}'", resource.read_text(encoding="utf-8")
        raise SimInputError(
            f"--cluster: unknown preset {name_or_path!r}, expected one of {list_clusters()} or a .toml file path"
        )
    path = Path(name_or_path)
    if not path.is_file():
        raise SimInputError(f"--cluster: {path}: no such preset file")
    try:
        return str(path), path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SimInputError(f"{path}: cannot read preset file: {error}") from None


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _coerce(origin: str, key: str, value: Any, kind: Any) -> Any:
    """Convert a TOML value or an override's text to `kind` (int, float, bool, str); fail with one line."""

    def bad(expected: str) -> SimInputError:
        return SimInputError(f"{origin}: field '{key}': value {value!r}, expected {expected}")

    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.strip().lower() in ("true", "1", "yes")
        raise bad("true or false")
    if kind is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise bad("an integer") from None
        if isinstance(number, float) and math.isfinite(number) and number == int(number):
            return int(number)
        raise bad("an integer")
    if kind is float:
        if isinstance(value, bool):
            raise bad("a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad("a number") from None
        if not math.isfinite(number):
            raise bad("a finite number")
        return number
    if kind is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    raise bad(f"a value of type {kind}")  # pragma: no cover - every preset field is one of the above


# Fields a preset may leave out without a word: text, and the calibration points (none is a valid choice).
_SILENTLY_OPTIONAL = {"description", "hardware", "calibration"}


def _build(origin: str, cls: type, table: Any, prefix: str, defaulted: list[str] | None = None) -> Any:
    if not isinstance(table, dict):
        raise SimInputError(f"{origin}: field '{prefix.rstrip('.')}': expected a table")
    kinds = _field_types(cls)
    internal = {"origin", "defaulted"}
    allowed = [f.name for f in dataclasses.fields(cls) if f.name not in internal]
    for key in table:
        if key not in allowed:
            raise SimInputError(f"{origin}: unknown field '{prefix}{key}', expected one of {allowed}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in internal:
            continue
        if f.name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SimInputError(f"{origin}: missing field '{prefix}{f.name}'")
            if defaulted is not None and f.name not in _SILENTLY_OPTIONAL:
                defaulted.append(f"{prefix}{f.name}")
            continue
        kind = kinds[f.name]
        raw = table[f.name]
        if _is_dataclass_type(kind):
            values[f.name] = _build(origin, kind, raw, f"{prefix}{f.name}.", defaulted)
        elif typing.get_origin(kind) is tuple:
            if not isinstance(raw, list):
                raise SimInputError(f"{origin}: field '{prefix}{f.name}': expected an array of tables")
            (item_kind, _) = typing.get_args(kind)
            values[f.name] = tuple(
                _build(origin, item_kind, item, f"{prefix}{f.name}[{i}].", defaulted)
                for i, item in enumerate(raw)
            )
        else:
            values[f.name] = _coerce(origin, f"{prefix}{f.name}", raw, kind)
    return cls(**values)


def _check_ranges(preset: ClusterPreset) -> None:
    def walk(obj: Any, prefix: str) -> typing.Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(obj):
            if f.name in ("origin", "defaulted", "calibration"):
                continue
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    for key, value in walk(preset, ""):
        if isinstance(value, bool) or isinstance(value, str):
            continue
        if value < 0:
            raise SimInputError(f"{preset.origin}: field '{key}': value {value!r}, expected >= 0")
        if key in _POSITIVE_FIELDS and value <= 0:
            raise SimInputError(f"{preset.origin}: field '{key}': value {value!r}, expected > 0")
        if key in _UNIT_INTERVAL_FIELDS and value > 1:
            raise SimInputError(
                f"{preset.origin}: field '{key}': value {value!r}, expected a value in [0, 1]"
            )
        if key in _BIT_WIDTH_FIELDS and value > _BIT_WIDTH_FIELDS[key]:
            raise SimInputError(
                f"{preset.origin}: field '{key}': value {value!r}, expected at most {_BIT_WIDTH_FIELDS[key]}"
            )
    for index, point in enumerate(preset.calibration):
        where = f"{preset.origin}: field 'calibration[{index}]"
        if point.op not in _CALIBRATION_OPS:
            raise SimInputError(f"{where}.op': value {point.op!r}, expected one of {list(_CALIBRATION_OPS)}")
        if point.world_size < 2 or point.nodes < 1 or point.nodes > point.world_size:
            raise SimInputError(
                f"{where}': world_size {point.world_size}, nodes {point.nodes}, expected world_size >= 2 and 1 <= nodes <= world_size"
            )
        if point.bytes <= 0 or point.busbw_Bps <= 0:
            raise SimInputError(f"{where}': bytes and busbw_Bps must be > 0")


def _apply_override(origin: str, data: dict[str, Any], assignment: tuple[str, str]) -> None:
    key, text = assignment
    parts = key.split(".")
    cls: Any = ClusterPreset
    table = data
    for depth, part in enumerate(parts):
        kinds = {f.name: f for f in dataclasses.fields(cls) if f.name != "origin"}
        if part not in kinds:
            dotted = ".".join(parts[: depth + 1])
            raise SimInputError(
                f"--set {key}={text}: unknown field '{dotted}' in {origin}, expected one of {sorted(kinds)}"
            )
        kind = _field_types(cls)[part]
        last = depth == len(parts) - 1
        if _is_dataclass_type(kind):
            if last:
                raise SimInputError(f"--set {key}={text}: '{key}' is a table, expected one of its fields")
            table = table.setdefault(part, {})
            cls = kind
            continue
        if typing.get_origin(kind) is tuple:
            raise SimInputError(
                f"--set {key}={text}: '{part}' is a list of points; copy the preset file and edit it instead"
            )
        if not last:
            raise SimInputError(f"--set {key}={text}: '{part}' is a value, not a table")
        table[part] = _coerce(f"--set {key}", key, text, kind)


def parse_overrides(assignments: list[str] | tuple[str, ...]) -> dict[str, str]:
    """['a.b=1', ...] → {'a.b': '1'}; a missing '=' or empty key is a SimInputError."""
    overrides: dict[str, str] = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise SimInputError(f"--set {assignment!r}: expected KEY=VALUE, e.g. inter_node.beta_Bps=25e9")
        overrides[key.strip()] = value.strip()
    return overrides


def load_cluster(name_or_path: str, overrides: dict[str, str] | None = None) -> ClusterPreset:
    """Load a packaged preset by name or a TOML file by path, apply dotted-key overrides, validate."""
    origin, text = _read_preset_text(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SimInputError(f"{origin}: not valid TOML: {error}") from None
    for assignment in (overrides or {}).items():
        _apply_override(origin, data, assignment)
    defaulted: list[str] = []
    preset = _build(origin, ClusterPreset, data, "", defaulted)
    preset = dataclasses.replace(preset, origin=origin, defaulted=tuple(defaulted))
    _check_ranges(preset)
    return preset
