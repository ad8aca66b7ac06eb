"""Load and validate what the report renders: simulation records and Chrome-trace timelines.

Both loaders accept already-parsed objects (from the sim API) as well as files, and every problem is a
`ReportInputError` naming the origin (file), the record and the field.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sim import (  # the simulator's vocabulary (data flows sim -> report)
    BREAKDOWN_KEYS,
    DTYPES,
    SYSTEMS,
)

from .errors import ReportInputError

RECORDS_SCHEMA = "ciera.simulate/1"
# Where the record's traces came from; `mixed` when a model's traces mix measured and analytic runs.
SOURCES = ("measured", "analytic", "mixed")
PERCENTILE_KEYS = ("p5", "p50", "p95")
# Numbers a record may leave null: ZeRO++ exists for FP16 only, bounds only where the sim states them.
OPTIONAL_NUMBER_FIELDS = (
    "speedup_vs_zeropp",
    "bound_speedup",
    "overlap_only_speedup",
    "allgather_bytes_per_iter",
    "shards_selected",
)


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ReportInputError(f"{path}: cannot read file ({error.strerror or error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ReportInputError(
            f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(origin: str, where: str, field: str, value: object, allow_null: bool = False) -> None:
    if value is None and allow_null:
        return
    if not _is_number(value) or value < 0:
        raise ReportInputError(
            f"{origin}: {where}, field '{field}': {value!r}, expected a finite number >= 0"
        )


def validate_record(record: object, origin: str, index: int) -> dict[str, Any]:
    """Check one simulation record against the ciera.simulate/1 contract; return it as a plain dict."""
    where = f"record {index}"
    if not isinstance(record, Mapping):
        raise ReportInputError(f"{origin}: {where}: {type(record).__name__}, expected a JSON object")
    for field in (
        "model",
        "dtype",
        "gpus",
        "system",
        "source",
        "iteration_s",
        "breakdown_s",
        "speedup_vs_zero3",
    ):
        if field not in record:
            raise ReportInputError(f"{origin}: {where}, field '{field}': missing")
    if not isinstance(record["model"], str) or not record["model"]:
        raise ReportInputError(
            f"{origin}: {where}, field 'model': {record['model']!r}, expected a model name"
        )
    for field, allowed in (("dtype", DTYPES), ("system", SYSTEMS), ("source", SOURCES)):
        if record[field] not in allowed:
            raise ReportInputError(
                f"{origin}: {where}, field '{field}': {record[field]!r}, expected one of {', '.join(allowed)}"
            )
    gpus = record["gpus"]
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ReportInputError(f"{origin}: {where}, field 'gpus': {gpus!r}, expected an integer >= 1")
    for field, keys in (("iteration_s", PERCENTILE_KEYS), ("breakdown_s", BREAKDOWN_KEYS)):
        nested = record[field]
        if not isinstance(nested, Mapping):
            raise ReportInputError(f"{origin}: {where}, field '{field}': {nested!r}, expected an object")
        for key in keys:
            if key not in nested:
                raise ReportInputError(f"{origin}: {where}, field '{field}.{key}': missing")
            _check_number(origin, where, f"{field}.{key}", nested[key])
    if not isinstance(record.get("projected", False), bool):
        raise ReportInputError(
            f"{origin}: {where}, field 'projected': {record['projected']!r}, expected true/false"
        )
    _check_number(origin, where, "speedup_vs_zero3", record["speedup_vs_zero3"])
    for field in OPTIONAL_NUMBER_FIELDS:
        _check_number(origin, where, field, record.get(field), allow_null=True)
    return dict(record)


def is_measured_point(record: dict[str, Any]) -> bool:
    """Only a record simulated from measured traces at a traced world size and depth counts as measured;
    anything extrapolated, or built on analytic traces, is a projection."""
    return record["source"] == "measured" and not record.get("projected", False)


def provenance_label(record: dict[str, Any]) -> str:
    if is_measured_point(record):
        return "measured"
    return {
        "measured": "projection from measured traces",
        "mixed": "projection from measured + analytic traces",
    }.get(record["source"], "analytic projection")


def validate_records(document: object, origin: str) -> list[dict[str, Any]]:
    """Validate a whole `{"schema": "ciera.simulate/1", "records": [...]}` document."""
    if not isinstance(document, Mapping):
        raise ReportInputError(f"{origin}: top level is {type(document).__name__}, expected a JSON object")
    schema = document.get("schema")
    if schema != RECORDS_SCHEMA:
        raise ReportInputError(f"{origin}: field 'schema': {schema!r}, expected {RECORDS_SCHEMA!r}")
    records = document.get("records")
    if not isinstance(records, list):
        raise ReportInputError(f"{origin}: field 'records': {type(records).__name__}, expected a list")
    if not records:
        raise ReportInputError(f"{origin}: field 'records': empty list, nothing to report")
    return [validate_record(record, origin, index) for index, record in enumerate(records)]


def load_records(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records of a `ciera simulate --json` file, and the document's other top-level fields (metadata)."""
    path = Path(path)
    document = read_json(path)
    records = validate_records(document, str(path))
    metadata = {key: value for key, value in document.items() if key not in ("schema", "records")}
    return records, metadata


def _system_of_process(process_label: str) -> tuple[str, str]:
    """'ciera — Mixtral-8x7B bf16 W=32' → ('ciera', 'Mixtral-8x7B bf16 W=32'); unknown labels stay whole."""
    for system in sorted(SYSTEMS, key=len, reverse=True):
        if process_label == system:
            return system, ""
        for separator in (" — ", " - ", " "):
            if process_label.startswith(system + separator):
                return system, process_label[len(system) + len(separator) :].strip()
    return process_label, ""


def validate_timeline(document: object, origin: str) -> list[dict[str, Any]]:
    """Complete ('X') events of a Chrome trace with `pid` resolved to the system and `tid` to the stream.

    Accepts the object form `{"traceEvents": [...]}` and the bare array form. `process_name` and
    `thread_name` metadata events name integer pids and tids, as Perfetto would show them; a process name
    like 'ciera — <model> <dtype> W=<n>' yields the system and, in `context`, what was simulated.
    """
    if isinstance(document, Mapping):
        if "traceEvents" not in document:
            raise ReportInputError(f"{origin}: field 'traceEvents': missing")
        events = document["traceEvents"]
    else:
        events = document
    if not isinstance(events, list):
        raise ReportInputError(f"{origin}: field 'traceEvents': {type(events).__name__}, expected a list")
    process_names: dict[object, str] = {}
    thread_names: dict[tuple[object, object], str] = {}
    for event in events:
        if not isinstance(event, Mapping) or event.get("ph") != "M":
            continue
        name = (event.get("args") or {}).get("name")
        if not isinstance(name, str):
            continue
        if event.get("name") == "process_name":
            process_names[event.get("pid")] = name
        elif event.get("name") == "thread_name":
            thread_names[(event.get("pid"), event.get("tid"))] = name
    complete_events: list[dict[str, Any]] = []
    for index, event in enumerate(events):
        if not isinstance(event, Mapping):
            raise ReportInputError(
                f"{origin}: traceEvents[{index}]: {type(event).__name__}, expected an object"
            )
        if event.get("ph") != "X":
            continue
        for field in ("pid", "tid", "ts", "dur"):
            if field not in event:
                raise ReportInputError(f"{origin}: traceEvents[{index}], field '{field}': missing")
        for field in ("ts", "dur"):
            if not _is_number(event[field]) or event[field] < 0:
                raise ReportInputError(
                    f"{origin}: traceEvents[{index}], field '{field}': {event[field]!r}, expected microseconds >= 0"
                )
        resolved = dict(event)
        system, context = _system_of_process(process_names.get(event["pid"], str(event["pid"])))
        resolved["pid"] = system
        resolved["context"] = event.get("context") or context  # kept when events are validated twice
        resolved["tid"] = thread_names.get((event["pid"], event["tid"]), str(event["tid"]))
        complete_events.append(resolved)
    return complete_events


def timeline_contexts(events: list[dict[str, Any]]) -> list[str]:
    """What the timeline's process names say was simulated, e.g. 'Mixtral-8x7B bf16 W=32' (deduplicated)."""
    return sorted({event["context"] for event in events if event.get("context")})


def parse_context(context: str) -> tuple[str, str, int] | None:
    """'Mixtral-8x7B bf16 W=32' → ('Mixtral-8x7B', 'bf16', 32); None for any other shape."""
    parts = context.rsplit(" ", 2)
    if len(parts) != 3 or parts[1] not in DTYPES or not parts[2].startswith("W="):
        return None
    gpus = parts[2][2:]
    return (parts[0], parts[1], int(gpus)) if gpus.isdigit() else None


def load_timeline(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(path)
    return validate_timeline(read_json(path), str(path))


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write via a temporary sibling and `os.replace`, so readers never see a half-written file."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ReportInputError(f"{path}: directory {directory} does not exist")
    if path.is_dir():
        raise ReportInputError(f"{path}: is a directory, expected a file path for the HTML report")
    file_descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(file_descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return path
