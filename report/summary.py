"""What the report says in words: the per-model summary at the top (the verdicts of `sim.verdict`, the
same the console prints), and which systems' lines coincide.

Pure functions of the records (ciera.simulate/1 dicts), so the tests can check the statements without a
browser, and the figures and the HTML say the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim import (
    LOSSY_SYSTEMS,
    PAYS_ABOVE,
    SummaryRow,
    lossy_faster,
    lossy_speedups,
    node_boundary_text,
    pays_bases,
    pays_text,
    speedup_span,
    summary_rows,
    w_ranges,
)

CIERA = "ciera"

__all__ = [
    "CIERA",
    "LOSSY_SYSTEMS",
    "PAYS_ABOVE",
    "SummaryRow",
    "coincidence_lines",
    "coincidences",
    "lossy_faster",
    "lossy_speedups",
    "node_boundary_text",
    "pays_bases",
    "pays_text",
    "speedup_span",
    "summary_rows",
    "w_ranges",
]

# Two systems whose speedups differ by less than this (relative) draw as one line.
COINCIDE_RELATIVE = 0.002


def _speedup(record: dict[str, Any]) -> float:
    return float(record["speedup_vs_zero3"])


@dataclass(frozen=True)
class Coincidence:
    """`system` draws on top of `other` at `gpus`, for `reason`."""

    system: str
    other: str
    gpus: tuple[int, ...]
    reason: str


def _bsc_reason(bsc: Sequence[dict[str, Any]]) -> str:
    if all(
        r.get("shards_selected") is not None and r.get("shards_selected") == r.get("shards_total")
        for r in bsc
    ):
        return "BSC selected every shard, so it is ER"
    if any("slower than compressing every shard" in " ".join(r.get("details") or []) for r in bsc):
        return "BSC's own choice replayed slower than all shards, so all are sent compressed"
    return "the shards BSC left uncompressed were hidden behind compute anyway"


def _ccp_reason(bsc: Sequence[dict[str, Any]]) -> str:
    codec_exposed = [r["breakdown_s"]["codec_critical"] / max(r["iteration_s"]["p50"], 1e-12) for r in bsc]
    if max(codec_exposed, default=0.0) < 0.01:
        return "CCP (pipelining) bought nothing: the codec was already off the critical path"
    return "CCP (pipelining) bought nothing here"


def coincidences(records: Sequence[dict[str, Any]]) -> list[Coincidence]:
    """For one (model, dtype) view: the CIERA variants whose lines lie on each other, and why that is
    expected; also a variant that selected no shard (it is ZeRO-3, on the parity line)."""
    by_system: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        by_system.setdefault(record["system"], {})[record["gpus"]] = record
    found: list[Coincidence] = []
    for system in ("ciera-er-bsc", CIERA):
        if system not in by_system:
            continue
        own = by_system[system]
        parity = sorted(
            g
            for g, r in own.items()
            if r.get("shards_selected") == 0 and abs(_speedup(r) - 1) < COINCIDE_RELATIVE
        )
        if parity:
            found.append(
                Coincidence(
                    system, "zero3", tuple(parity), "selection chose no shard, i.e. the plain ZeRO-3 schedule"
                )
            )
        # Compare with the next-simpler variant first; the full system against ER only when BSC is absent.
        for other in ("ciera-er-bsc", "ciera-er") if system == CIERA else ("ciera-er",):
            if other not in by_system or other == system:
                continue
            same = sorted(
                g
                for g, r in own.items()
                if g in by_system[other]
                and g not in parity
                and abs(_speedup(r) - _speedup(by_system[other][g])) <= COINCIDE_RELATIVE * _speedup(r)
            )
            if not same:
                continue
            at = [own[g] for g in same]
            if system == "ciera-er-bsc":
                reason = _bsc_reason(at)
            elif other == "ciera-er-bsc":
                reason = _ccp_reason([by_system[other][g] for g in same])
            else:
                reason = "neither BSC nor CCP changed the ER schedule"
            found.append(Coincidence(system, other, tuple(same), reason))
            break
    return found


def coincidence_lines(items: Sequence[Coincidence], all_gpus: Sequence[int], label: Any) -> list[str]:
    """One sentence per (what they lie on, where, why); systems sharing all three are named together."""
    grouped: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
    for item in items:
        grouped.setdefault((item.other, item.gpus, item.reason), []).append(item.system)
    lines = []
    for (other, gpus, reason), systems in grouped.items():
        target = "ZeRO-3 (1.0×)" if other == "zero3" else label(other)
        verb = "lies" if len(systems) == 1 else "lie"
        names = " and ".join(label(s) for s in systems)
        lines.append(f"{names} {verb} on {target} at {w_ranges(gpus, all_gpus)}: {reason}.")
    return lines
