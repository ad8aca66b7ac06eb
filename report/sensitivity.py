"""Link bandwidth sensitivity: CIERA's speedup over ZeRO-3 as the inter-node bandwidth varies.

Two sources, one shape (`BandwidthSweep`): `ciera report` simulating the sweep itself through the `sim`
API (`simulate_bandwidth_sweep`), or a `ciera simulate --sweep inter_node.beta_Bps=... --json FILE`
document (`load_sensitivity`). `break_even` finds where a system's speedup falls below the one "pays"
threshold (`PAYS_ABOVE`, 1.01×: below it a difference is the simulation's own noise).
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from sim import PAYS_ABOVE, pays

from .errors import ReportInputError
from .figures import system_label
from .inputs import SYSTEMS, provenance_label, read_json, validate_record, validate_records

SWEEP_SCHEMA = "ciera.simulate.sweep/1"
# Preset fields a sweep may vary to be drawn here, with the x-axis title each one gets.
BANDWIDTH_KEYS = {
    "inter_node.beta_Bps": "inter-node bandwidth β (GB/s per node, log scale)",
    "intra_node.beta_Bps": "intra-node bandwidth β (GB/s ring busbw per GPU, log scale)",
}
DEFAULT_KEY = "inter_node.beta_Bps"
# The sweep `ciera report` simulates: powers of two in GB/s from below the preset's β to 32× that.
GRID_POINTS = 6
# The sweep to suggest for `--sensitivity` (shown whenever the section has no data).
SUGGESTED_VALUES = "2e9,4e9,8e9,16e9,32e9,64e9"
# The simulator's note on how β was set, e.g. "inter-node β 4.42 GB/s of a100-hdr-testbed: fitted to ...".
_BETA_NOTE = re.compile(r"^inter-node β ([0-9.eE+-]+) GB/s of (.+?): (.+)$")


@dataclass(frozen=True)
class SweepPoint:
    bandwidth_Bps: float
    records: tuple[dict[str, Any], ...]
    is_reference: bool = False  # the bandwidth the report's other sections were simulated at


@dataclass(frozen=True)
class BandwidthSweep:
    key: str  # the preset field swept, one of BANDWIDTH_KEYS
    points: tuple[SweepPoint, ...]  # ascending bandwidth
    origin: str  # "simulated by ciera report" or the file it was read from
    cluster: str | None = None
    reference_Bps: float | None = None  # the cluster's own β, marked on the x axis
    reference_note: str = ""  # how that β was set (preset, fitted to calibration points, ...)
    scope_note: str = ""  # what was simulated and what was left out, for the caption


@dataclass(frozen=True)
class SweepView:
    """One (model, dtype) panel at one world size: speedup vs bandwidth per system (zero3 excluded)."""

    model: str
    dtype: str
    gpus: int
    provenance: str
    lines: dict[str, list[tuple[float, dict[str, Any]]]]  # system -> [(bandwidth_Bps, record)]


@dataclass(frozen=True)
class BreakEven:
    kind: Literal["crosses", "always", "never", "rises"]
    bandwidth_Bps: (
        float | None
    )  # where the speedup falls to PAYS_ABOVE (log-linear interpolation), if it does
    text: str  # the full statement, with the speedups around the crossing
    short: str  # a few words, for a table cell holding several systems


def _gbps(bandwidth_Bps: float) -> str:
    return f"{bandwidth_Bps / 1e9:.3g} GB/s"


def sweep_command(records: Sequence[dict[str, Any]]) -> str:
    """The `ciera simulate --sweep` line that makes a sensitivity file matching these records: their
    models, largest world size, BF16 when present, and cluster."""
    command = f"ciera simulate --sweep {DEFAULT_KEY}={SUGGESTED_VALUES}"
    if records:
        models = ",".join(dict.fromkeys(r["model"] for r in records))
        dtype = "bf16" if any(r["dtype"] == "bf16" for r in records) else records[0]["dtype"]
        command += f" --models {models} --gpus {max(r['gpus'] for r in records)} --dtype {dtype}"
        clusters = {r.get("cluster") for r in records} - {None}
        if len(clusters) == 1:
            command += f" --cluster {clusters.pop()}"
    return command + " --json sweep.json"


def break_even(points: Sequence[tuple[float, float]]) -> BreakEven:
    """Where the speedup (second of each pair) falls below `PAYS_ABOVE` as the bandwidth (first, B/s) grows.

    The crossing is interpolated linearly in speedup over log bandwidth between the last swept point
    that pays and the first that does not; a sweep that never crosses says so instead."""
    if not points:
        return BreakEven("never", None, "no swept points", "no swept points")
    ordered = sorted(points)
    bandwidths = [b for b, _ in ordered]
    speedups = [s for _, s in ordered]
    span = f"{_gbps(bandwidths[0])}–{_gbps(bandwidths[-1])}"
    if all(pays(s) for s in speedups):
        return BreakEven(
            "always",
            None,
            f"pays at every swept bandwidth ({span}): still {speedups[-1]:.3f}× at {_gbps(bandwidths[-1])}",
            "pays at every swept bandwidth",
        )
    if not any(pays(s) for s in speedups):
        return BreakEven(
            "never",
            None,
            f"never pays in the swept range ({span}): at most {max(speedups):.3f}×",
            "never pays",
        )
    first_paying = next(i for i, s in enumerate(speedups) if pays(s))
    crossing = next((i for i in range(first_paying + 1, len(speedups)) if not pays(speedups[i])), None)
    if crossing is None:  # no gain at the slowest links, a gain from some bandwidth on
        return BreakEven(
            "rises",
            bandwidths[first_paying],
            f"no gain up to {_gbps(bandwidths[first_paying - 1])} ({speedups[first_paying - 1]:.3f}×), "
            f"pays from {_gbps(bandwidths[first_paying])} ({speedups[first_paying]:.3f}×) on",
            f"pays from {_gbps(bandwidths[first_paying])} on",
        )
    (b0, s0), (b1, s1) = ordered[crossing - 1], ordered[crossing]
    fraction = (s0 - PAYS_ABOVE) / (s0 - s1)
    at_Bps = math.exp(math.log(b0) + fraction * (math.log(b1) - math.log(b0)))
    # A speedup of 1.0 is CIERA falling back to the plain schedule: the crossing lies somewhere in the
    # interval, so the interval leads and the interpolation is only stated when it says more.
    fell_back = math.isclose(s1, 1.0, abs_tol=1e-3)
    at_Bps = b1 if fell_back else at_Bps
    interpolated = "" if fell_back else f" (interpolated ≈ {_gbps(at_Bps)})"
    text = (
        f"stops paying between {_gbps(b0)} and {_gbps(b1)}{interpolated}: "
        f"{s0:.3f}× at {_gbps(b0)}, {s1:.3f}× at {_gbps(b1)}"
    )
    again = next((i for i in range(crossing + 1, len(speedups)) if pays(speedups[i])), None)
    if again is not None:
        text += f"; pays again at {_gbps(bandwidths[again])} ({speedups[again]:.3f}×)"
    return BreakEven("crosses", at_Bps, text, f"stops paying at {b0 / 1e9:.3g}–{_gbps(b1)}")


# ------------------------------------------------------------------------------------------ from a file


def _parse_bandwidth(origin: str, where: str, value: object) -> float:
    try:
        bandwidth_Bps = float(value)  # the sweep stores the values as typed, e.g. "5e9"
    except (TypeError, ValueError):
        raise ReportInputError(
            f"{origin}: {where}: {value!r}, expected a bandwidth in B/s such as 8e9"
        ) from None
    if not math.isfinite(bandwidth_Bps) or bandwidth_Bps <= 0:
        raise ReportInputError(
            f"{origin}: {where}: {value!r}, expected a bandwidth in B/s > 0 "
            "(0 means 'fit β' in a preset, which a sweep cannot plot; sweep explicit values)"
        )
    return bandwidth_Bps


def validate_sweep(document: object, origin: str) -> BandwidthSweep:
    """Check a `ciera.simulate.sweep/1` document over a bandwidth field; every run's records are checked
    against the ciera.simulate/1 contract."""
    if not isinstance(document, Mapping):
        raise ReportInputError(f"{origin}: top level is {type(document).__name__}, expected a JSON object")
    schema = document.get("schema")
    if schema != SWEEP_SCHEMA:
        hint = (
            " (a plain `ciera simulate --json` file: pass it with --records)"
            if schema == "ciera.simulate/1"
            else ""
        )
        raise ReportInputError(f"{origin}: field 'schema': {schema!r}, expected {SWEEP_SCHEMA!r}{hint}")
    key = document.get("key")
    if key not in BANDWIDTH_KEYS:
        raise ReportInputError(
            f"{origin}: field 'key': {key!r}, expected a bandwidth field ({', '.join(BANDWIDTH_KEYS)}); "
            f"make one with `ciera simulate --sweep {DEFAULT_KEY}={SUGGESTED_VALUES} --json FILE`"
        )
    values = document.get("values")
    if not isinstance(values, list) or len(values) < 2:
        raise ReportInputError(
            f"{origin}: field 'values': {values!r}, expected a list of two or more bandwidths"
        )
    runs = document.get("runs")
    if not isinstance(runs, list):
        raise ReportInputError(f"{origin}: field 'runs': {type(runs).__name__}, expected a list")
    if len(runs) != len(values):
        raise ReportInputError(
            f"{origin}: field 'runs': {len(runs)} runs for {len(values)} values, expected one run per value"
        )
    cluster = document.get("cluster")
    if cluster is not None and not isinstance(cluster, str):
        raise ReportInputError(f"{origin}: field 'cluster': {cluster!r}, expected a preset name")
    points = []
    for index, (value, run) in enumerate(zip(values, runs, strict=True)):
        bandwidth_Bps = _parse_bandwidth(origin, f"field 'values[{index}]'", value)
        where = f"runs[{index}]"
        if not isinstance(run, Mapping):
            raise ReportInputError(f"{origin}: {where}: {type(run).__name__}, expected a JSON object")
        if "records" not in run:
            raise ReportInputError(f"{origin}: {where}, field 'records': missing")
        if str(run.get("value")) != str(value):
            raise ReportInputError(
                f"{origin}: {where}, field 'value': {run.get('value')!r}, expected {value!r} (values[{index}])"
            )
        records = validate_records(run, f"{origin}: {where}")
        points.append(SweepPoint(bandwidth_Bps, tuple(records)))
    bandwidths = [p.bandwidth_Bps for p in points]
    if len(set(bandwidths)) != len(bandwidths):
        raise ReportInputError(f"{origin}: field 'values': {values!r}, expected distinct bandwidths")
    return BandwidthSweep(
        key=key,
        points=tuple(sorted(points, key=lambda p: p.bandwidth_Bps)),
        origin=origin,
        cluster=cluster,
        scope_note=f"Read from {origin} (ciera simulate --sweep {key}=…).",
    )


def validate_sweep_records(sweep: BandwidthSweep) -> BandwidthSweep:
    """The sweep with every record checked against the ciera.simulate/1 contract (API callers get the
    checks a file gets)."""
    points = tuple(
        replace(
            point,
            records=tuple(
                validate_record(record, f"{sweep.origin}: {_gbps(point.bandwidth_Bps)}", index)
                for index, record in enumerate(point.records)
            ),
        )
        for point in sweep.points
    )
    return replace(sweep, points=points)


def load_sensitivity(path: str | os.PathLike[str]) -> BandwidthSweep:
    path = Path(path)
    return validate_sweep(read_json(path), str(path))


def filter_sweep(
    sweep: BandwidthSweep, models: Sequence[str], gpus: Sequence[int], dtype: str | None
) -> BandwidthSweep:
    """Keep the sweep's records of these models (the report's), world sizes and dtype; fail when none is
    left, naming what the sweep holds."""
    wanted = set(models)

    def keep(record: dict[str, Any]) -> bool:
        return (
            record["model"] in wanted
            and (not gpus or record["gpus"] in gpus)
            and (dtype is None or record["dtype"] == dtype)
        )

    points = tuple(
        SweepPoint(p.bandwidth_Bps, tuple(r for r in p.records if keep(r)), p.is_reference)
        for p in sweep.points
    )
    if not any(p.records for p in points):
        held = sorted({(r["model"], r["dtype"], r["gpus"]) for p in sweep.points for r in p.records})
        described = ", ".join(f"{m} {d} W={g}" for m, d, g in held[:6]) + (" …" if len(held) > 6 else "")
        raise ReportInputError(
            f"{sweep.origin}: no records of the report's models ({', '.join(sorted(wanted))}) "
            f"after --models/--gpus/--dtype filtering; the sweep holds {described}"
        )
    return BandwidthSweep(
        sweep.key,
        points,
        sweep.origin,
        sweep.cluster,
        sweep.reference_Bps,
        sweep.reference_note,
        sweep.scope_note,
    )


def reference_from_records(
    records: Sequence[dict[str, Any]], cluster: str | None
) -> tuple[float | None, str]:
    """The inter-node β the report's records were simulated at, from the simulator's note on it (records
    of the sweep's cluster only), and how it was set; (None, why not) when the records do not say."""
    for record in records:
        for note in record.get("notes") or ():
            match = _BETA_NOTE.match(str(note))
            if match and (cluster is None or match.group(2) == cluster):
                how = f"{match.group(3)}, as the records of {match.group(2)} state"
                return float(match.group(1)) * 1e9, how
    return None, "the records do not state the inter-node β they were simulated at, so it is not marked"


# ---------------------------------------------------------------------------------- simulated in place


def sweep_grid_Bps(reference_Bps: float, points: int = GRID_POINTS) -> list[float]:
    """Powers of two in GB/s, the lowest at or below half the reference, doubling `points` times: round
    numbers a user reads at a glance, spanning slower and much faster links than the cluster's own."""
    lowest_GBps = 2.0 ** math.floor(math.log2(reference_Bps / 2e9))
    return [lowest_GBps * 2**k * 1e9 for k in range(points)]


def simulate_bandwidth_sweep(
    sim: Any,
    bundle: Any,
    cluster: str,
    overrides: Sequence[str],
    records: Sequence[dict[str, Any]],
    progress: Callable[[int, int], None] | None = None,
) -> tuple[BandwidthSweep | None, str]:
    """Simulate the report's models at its largest world size and one dtype (BF16 when the report has
    it) over `sweep_grid_Bps` of the preset's effective inter-node β, through the `sim` package's public
    API (`sim` is passed in, so the report's start never imports the simulator). The records the report
    already holds at that size are the point at the cluster's own β. Returns (None, why) when the sweep
    would say nothing: every rank in one node never uses the inter-node link."""
    preset = sim.load_cluster(cluster, sim.parse_overrides(list(overrides)))
    world_size = max(r["gpus"] for r in records)
    if world_size <= preset.gpus_per_node:
        return None, (
            f"No link bandwidth sensitivity: the report's largest world size, W={world_size}, fits in one "
            f"node of {preset.name} ({preset.gpus_per_node} GPUs), so the inter-node link carries nothing."
        )
    collectives = sim.CollectiveModel.from_preset(preset, bundle.collectives)
    reference_Bps = float(collectives.inter_beta_Bps)
    dtype = "bf16" if any(r["dtype"] == "bf16" for r in records) else records[0]["dtype"]
    in_view = [r for r in records if r["dtype"] == dtype and r["gpus"] == world_size]
    models = list(dict.fromkeys(r["model"] for r in in_view))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in in_view)]
    grid_Bps = [b for b in sweep_grid_Bps(reference_Bps) if not math.isclose(b, reference_Bps, rel_tol=1e-9)]
    points = [SweepPoint(reference_Bps, tuple(in_view), is_reference=True)]
    for done, bandwidth_Bps in enumerate(grid_Bps):
        swept = sim.load_cluster(
            cluster, sim.parse_overrides([*overrides, f"{DEFAULT_KEY}={bandwidth_Bps:.6g}"])
        )
        sim_records = sim.simulate(
            bundle,
            swept,
            models=models,
            gpus=[world_size],
            systems=systems,
            dtypes=[dtype],
            progress=(lambda d, t, done=done: progress(done * t + d, len(grid_Bps) * t))
            if progress
            else None,
        )
        points.append(SweepPoint(bandwidth_Bps, tuple(r.to_dict() for r in sim_records)))
    how = {
        "preset": "set in the preset",
        "measured": "fitted to the bundle's measured multi-node collectives",
        "calibration": "fitted to the preset's calibration points",
    }.get(str(collectives.inter_beta_source), str(collectives.inter_beta_source))
    left_out = [s for s in SYSTEMS if s not in systems]
    scope = (
        f"Simulated by ciera report at W={world_size} (the report's largest world size), {dtype.upper()} only, "
        f"{len(models)} model{'s' if len(models) != 1 else ''}, "
        f"{len(points)} bandwidths: {', '.join(_gbps(p.bandwidth_Bps) for p in sorted(points, key=lambda p: p.bandwidth_Bps))}."
    )
    if left_out:
        scope += (
            f" Not swept: {', '.join(system_label(s) for s in left_out)}"
            + (
                " (FP16 only; sweep it with --dtype fp16 and pass --sensitivity)"
                if "zeropp" in left_out
                else ""
            )
            + "."
        )
    sweep = BandwidthSweep(
        key=DEFAULT_KEY,
        points=tuple(sorted(points, key=lambda p: p.bandwidth_Bps)),
        origin="simulated by ciera report",
        cluster=preset.name,
        reference_Bps=reference_Bps,
        reference_note=how,
        scope_note=scope,
    )
    plural = "s" if len(models) != 1 else ""
    return sweep, f"{len(points)} bandwidths × {len(models)} model{plural} at W={world_size}, {dtype}"


# -------------------------------------------------------------------------------------------- views


def sweep_views(sweep: BandwidthSweep) -> list[SweepView]:
    """Per (model, dtype), the largest world size the sweep holds, one line per system but ZeRO-3 (the
    baseline, 1.0 by definition); models in first-seen order, BF16 before FP16."""
    largest: dict[tuple[str, str], int] = {}
    for point in sweep.points:
        for record in point.records:
            view_key = (record["model"], record["dtype"])
            largest[view_key] = max(largest.get(view_key, 0), record["gpus"])
    models = list(dict.fromkeys(model for model, _ in largest))
    views = []
    for model in models:
        for dtype in ("bf16", "fp16"):
            if (model, dtype) not in largest:
                continue
            gpus = largest[(model, dtype)]
            lines: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
            labels = set()
            for point in sweep.points:
                for record in point.records:
                    if (record["model"], record["dtype"], record["gpus"]) == (model, dtype, gpus):
                        labels.add(provenance_label(record))
                        if record["system"] != "zero3":
                            lines[record["system"]].append((point.bandwidth_Bps, record))
            ordered = {s: sorted(lines[s], key=lambda item: item[0]) for s in SYSTEMS if s in lines}
            ordered.update(
                {s: sorted(v, key=lambda item: item[0]) for s, v in lines.items() if s not in ordered}
            )
            provenance = labels.pop() if len(labels) == 1 else "measured and projected traces"
            views.append(SweepView(model, dtype, gpus, provenance, ordered))
    return views


def break_even_rows(views: Sequence[SweepView]) -> list[tuple[SweepView, dict[str, BreakEven]]]:
    """Per view, the break-even of every CIERA variant it holds."""
    return [
        (
            view,
            {
                system: break_even([(b, r["speedup_vs_zero3"]) for b, r in points])
                for system, points in view.lines.items()
                if system.startswith("ciera")
            },
        )
        for view in views
    ]
