"""What the report says in words: the per-model summary at the top, and which systems' lines coincide.

Pure functions of the records (ciera.simulate/1 dicts), so the tests can check the statements without a
browser, and the figures and the HTML say the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .inputs import SYSTEMS

# A speedup this close to 1 is no gain: CIERA's selection choosing no shard replays ZeRO-3 exactly
# (1.000), and a p50 over a few iterations wobbles in the fourth digit.
PAYS_ABOVE = 1.005
# Two systems whose speedups differ by less than this (relative) draw as one line.
COINCIDE_RELATIVE = 0.002
LOSSY_SYSTEMS = frozenset({"zeropp"})  # int8 weight gathers: faster, but not the same training run
CIERA = "ciera"


def _speedup(record: dict[str, Any]) -> float:
    return float(record["speedup_vs_zero3"])


def w_ranges(gpus: Sequence[int], all_gpus: Sequence[int]) -> str:
    """'W = 16–128' when the W's are a contiguous run of the swept ones, else 'W = 16, 64'."""
    chosen = sorted(set(gpus))
    swept = sorted(set(all_gpus))
    if len(chosen) > 1:
        first, last = swept.index(chosen[0]), swept.index(chosen[-1])
        if swept[first : last + 1] == chosen:
            return f"W = {chosen[0]}–{chosen[-1]}"
    return "W = " + ", ".join(map(str, chosen))


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
    if any("slower than selecting all shards" in " ".join(r.get("notes") or []) for r in bsc):
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


@dataclass(frozen=True)
class SummaryRow:
    model: str
    dtype: str
    best: dict[int, tuple[str, float]]  # W -> (system, speedup vs ZeRO-3), lossy systems included
    best_lossless: dict[int, tuple[str, float]]
    ciera: dict[int, float]  # W -> CIERA (ER+BSC+CCP) speedup vs ZeRO-3
    pays_from: int | None  # the smallest W from which CIERA pays at every larger swept W
    pays_at: tuple[int, ...]  # every W where it pays
    provenance: str
    # (system, W) left out of `best`: its receiver cache exceeds the cache budget, so the plan does not fit
    over_budget: tuple[tuple[str, int], ...] = ()


def summary_rows(records: Sequence[dict[str, Any]], provenance: Any) -> list[SummaryRow]:
    """One row per (model, dtype): the best system at each W, CIERA's speedup, and where it pays."""
    models = list(dict.fromkeys(r["model"] for r in records))
    rows: list[SummaryRow] = []
    rank = {s: i for i, s in enumerate(SYSTEMS)}
    for model in models:
        for dtype in ("bf16", "fp16"):
            view = [r for r in records if r["model"] == model and r["dtype"] == dtype]
            if not view:
                continue
            gpus = sorted({r["gpus"] for r in view})
            over_budget = tuple(
                (r["system"], r["gpus"]) for r in view if r.get("within_cache_budget", True) is False
            )
            view_fits = [r for r in view if r.get("within_cache_budget", True) is not False]
            best: dict[int, tuple[str, float]] = {}
            best_lossless: dict[int, tuple[str, float]] = {}
            for g in gpus:
                # Ties go to the simpler system (earlier in SYSTEMS): it needs less to deploy.
                at = sorted(
                    (r for r in view_fits if r["gpus"] == g),
                    key=lambda r: (-round(_speedup(r), 3), rank.get(r["system"], 99)),
                )
                best[g] = (at[0]["system"], _speedup(at[0]))
                lossless = [r for r in at if r["system"] not in LOSSY_SYSTEMS]
                if lossless:
                    best_lossless[g] = (lossless[0]["system"], _speedup(lossless[0]))
            ciera = {r["gpus"]: _speedup(r) for r in view if r["system"] == CIERA}
            pays_at = tuple(g for g in sorted(ciera) if ciera[g] > PAYS_ABOVE)
            pays_from = None
            for g in sorted(ciera, reverse=True):
                if ciera[g] > PAYS_ABOVE:
                    pays_from = g
                else:
                    break
            labels = {provenance(r) for r in view}
            rows.append(
                SummaryRow(
                    model,
                    dtype,
                    best,
                    best_lossless,
                    ciera,
                    pays_from,
                    pays_at,
                    labels.pop() if len(labels) == 1 else "measured and projected points",
                    over_budget,
                )
            )
    return rows


def pays_text(row: SummaryRow) -> str:
    """Where CIERA starts (equivalently, below which it stops) paying, in words."""
    if not row.ciera:
        return "not simulated"
    if not row.pays_at:
        return "never (no swept W)"
    swept = sorted(row.ciera)
    if row.pays_from == swept[0]:
        return f"at every swept W (from W = {swept[0]})"
    if row.pays_from is not None:
        return f"from W = {row.pays_from}"
    return f"only at W = {', '.join(map(str, row.pays_at))} (not at the largest W)"
