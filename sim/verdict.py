"""The verdicts a reader acts on — the fastest system at each W, where CIERA pays, what that rests on —
computed once from `ciera.simulate/1` record dicts, so the console (`ciera simulate`) and the HTML report
say the same thing.

Rules (docs/simulator.md, *Verdicts*):
- **Pays** means a speedup over ZeRO-3 of at least `PAYS_ABOVE` (1 %), one threshold everywhere. Below
  it a difference is the simulation's own noise: over the default sweep, a system's speedup taken from the
  p50 of its rewritten iterations and from its median iteration differ by up to 0.49 % (p95 0.10 %), and a
  bandwidth sweep crosses 1.0 by 1e-5 from float rounding where CIERA replays ZeRO-3's schedule.
- A record that **does not fit** the device (`memory.fits` False) or whose receiver cache exceeds the
  budget (`within_cache_budget` False) is left out of "fastest" and "pays from": it is not a plan a
  cluster can run.
- **Lossy** systems (ZeRO++'s int8 weights) are named when faster, never as the best lossless choice.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from .evaluate import BREAKDOWN_LABELS
from .memory import fit_text

PAYS_ABOVE = 1.01
LOSSY_SYSTEMS = frozenset({"zeropp"})
CIERA = "ciera"
# Ties go to the simpler system (earlier here): it needs less to deploy.
SYSTEM_ORDER = ("zero3", "fsdp", "zeropp", "ciera-er", "ciera-er-bsc", "ciera")


def pays(speedup: float) -> bool:
    return speedup >= PAYS_ABOVE


def fits(record: dict[str, Any]) -> bool:
    """Whether the record's plan can run: it fits the device (or the fit was not checked) and its receiver
    cache is within the budget."""
    return (record.get("memory") or {}).get("fits") is not False and record.get("within_cache_budget", True)


def why_left_out(record: dict[str, Any]) -> str:
    """'' for a record that can run, else the reason in a few words."""
    memory = record.get("memory") or {}
    if memory.get("fits") is False:
        return fit_text(memory["total_bytes"], memory["device_bytes"])
    if not record.get("within_cache_budget", True):
        return "receiver cache over budget"
    return ""


@dataclass(frozen=True)
class SummaryRow:
    model: str
    dtype: str
    # W -> (system, speedup vs ZeRO-3) among the plans that fit, lossy included
    best: dict[int, tuple[str, float]]
    best_lossless: dict[int, tuple[str, float]]
    ciera: dict[int, float]  # W -> CIERA (ER+BSC+CCP) speedup vs ZeRO-3, where it fits
    pays_from: int | None  # the smallest W from which CIERA pays at every larger swept W
    pays_at: tuple[int, ...]  # every W where it pays
    provenance: str
    # (system, W, why) left out of `best`: the plan does not fit the device or the cache budget
    left_out: tuple[tuple[str, int, str], ...] = ()
    gpus: tuple[int, ...] = ()  # every W simulated for this (model, dtype)
    gpus_per_node: int | None = None
    inter_node: str = ""  # the inter-node bandwidth the records used and where it came from

    @property
    def over_budget(self) -> tuple[tuple[str, int], ...]:
        return tuple((system, g) for system, g, why in self.left_out if why == "receiver cache over budget")

    def does_not_fit(self, gpus: int, system: str = "zero3") -> str:
        """'' or why `system` at W = `gpus` was left out."""
        return next((why for s, g, why in self.left_out if s == system and g == gpus), "")


def _speedup(record: dict[str, Any]) -> float:
    return float(record["speedup_vs_zero3"])


def _inter_node(view: Sequence[dict[str, Any]]) -> str:
    for record in view:
        for note in record.get("notes") or []:
            if note.startswith("inter-node β "):
                return note
    return ""


def summary_rows(
    records: Sequence[dict[str, Any]], provenance: Callable[[dict[str, Any]], str]
) -> list[SummaryRow]:
    """One row per (model, dtype), in the records' model order, BF16 before FP16."""
    models = list(dict.fromkeys(r["model"] for r in records))
    rank = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    rows: list[SummaryRow] = []
    for model in models:
        for dtype in ("bf16", "fp16"):
            view = [r for r in records if r["model"] == model and r["dtype"] == dtype]
            if not view:
                continue
            gpus = sorted({int(r["gpus"]) for r in view})
            left_out = tuple(
                (r["system"], int(r["gpus"]), why_left_out(r))
                for r in sorted(view, key=lambda r: (int(r["gpus"]), rank.get(r["system"], 99)))
                if why_left_out(r)
            )
            runnable = [r for r in view if fits(r)]
            best: dict[int, tuple[str, float]] = {}
            best_lossless: dict[int, tuple[str, float]] = {}
            for g in gpus:
                at = sorted(
                    (r for r in runnable if r["gpus"] == g),
                    key=lambda r: (-round(_speedup(r), 3), rank.get(r["system"], 99)),
                )
                if not at:
                    continue
                best[g] = (at[0]["system"], _speedup(at[0]))
                lossless = [r for r in at if r["system"] not in LOSSY_SYSTEMS]
                if lossless:
                    best_lossless[g] = (lossless[0]["system"], _speedup(lossless[0]))
            ciera = {int(r["gpus"]): _speedup(r) for r in runnable if r["system"] == CIERA}
            pays_at = tuple(g for g in sorted(ciera) if pays(ciera[g]))
            pays_from = None
            for g in sorted(ciera, reverse=True):
                if not pays(ciera[g]):
                    break
                pays_from = g
            labels = {provenance(r) for r in view}
            per_node = {r.get("gpus_per_node") for r in view} - {None}
            rows.append(
                SummaryRow(
                    model=model,
                    dtype=dtype,
                    best=best,
                    best_lossless=best_lossless,
                    ciera=ciera,
                    pays_from=pays_from,
                    pays_at=pays_at,
                    provenance=labels.pop() if len(labels) == 1 else "measured and projected points",
                    left_out=left_out,
                    gpus=tuple(gpus),
                    gpus_per_node=int(per_node.pop()) if len(per_node) == 1 else None,
                    inter_node=_inter_node(view),
                )
            )
    return rows


def pays_text(row: SummaryRow) -> str:
    """Where CIERA starts (equivalently, below which it stops) paying, in words."""
    if not row.ciera:
        return "never (no W where it fits)" if row.gpus else "not simulated"
    if not row.pays_at:
        return "never (no swept W)"
    swept = sorted(row.ciera)
    if row.pays_from == swept[0]:
        return f"at every W where it fits (from W = {swept[0]})"
    if row.pays_from is not None:
        return f"from W = {row.pays_from}"
    return f"only at W = {', '.join(map(str, row.pays_at))} (not at the largest W)"


def first_multi_node_w(row: SummaryRow) -> int | None:
    """The smallest simulated W that spans more than one node (None when every W fits in one)."""
    if not row.gpus_per_node:
        return None
    return next((g for g in row.gpus if g > row.gpus_per_node), None)


def node_boundary_text(row: SummaryRow) -> str:
    """'' unless CIERA pays from the first W that spans nodes: then that is what the verdict rests on."""
    boundary = first_multi_node_w(row)
    if boundary is None or row.pays_from != boundary or not row.gpus_per_node:
        return ""
    nodes = -(-boundary // row.gpus_per_node)
    return (
        f"W = {boundary}, the first W that spans nodes ({nodes} × {row.gpus_per_node} GPUs; below it every "
        "gather stays inside one node)"
    )


def pays_bases(rows: Sequence[SummaryRow]) -> tuple[dict[str, int], list[str]]:
    """What the rows' "pays from W = n" rests on, for every renderer to phrase: {node-boundary text: the
    rows that pay from it} and the inter-node bandwidth notes, each once, in first-seen order."""
    boundaries: dict[str, int] = {}
    for row in rows:
        boundary = node_boundary_text(row)
        if boundary:
            boundaries[boundary] = boundaries.get(boundary, 0) + 1
    return boundaries, [note for note in dict.fromkeys(row.inter_node for row in rows) if note]


def lossy_speedups(row: SummaryRow) -> list[float]:
    """The speedups of a lossy system at every W where it is faster than every lossless one."""
    return [found[1] for g in row.gpus if (found := lossy_faster(row, g)) is not None]


def speedup_span(values: Sequence[float]) -> str:
    """'1.42×' or '1.13–1.14×' (one value when both ends agree to two decimals)."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"


def verdict_line(row: SummaryRow) -> str:
    """One line per (model, dtype): where CIERA pays and by how much, what does not fit, and ZeRO++ where
    its lossy gathers are faster."""
    text = f"{row.model} {row.dtype}: CIERA pays {pays_text(row)}"
    if row.pays_at:
        text += f" ({speedup_span([row.ciera[g] for g in row.pays_at])})"
    lossy = lossy_speedups(row)
    if lossy:
        text += f" over ZeRO-3; ZeRO++ (lossy) is faster, {speedup_span(lossy)}"
    unfit = sorted(
        {g for system, g, why in row.left_out if system == "zero3" and why.startswith("does not fit")}
    )
    if unfit:
        text += f"; does not fit one GPU at {w_ranges(unfit, row.gpus)}"
    return text


def summary_table(records: Sequence[dict[str, Any]], provenance: Callable[[dict[str, Any]], str]) -> Table:
    """The console's summary (`ciera simulate`): per model and dtype, CIERA's speedup at each W or why it
    was left out, a faster lossless system in brackets, where CIERA pays and what that rests on."""
    rows = summary_rows(records, provenance)
    world_sizes = sorted({int(r["gpus"]) for r in records})
    table = Table(title="Summary: CIERA's speedup over ZeRO-3 (p50 iteration time)")
    for name in ("model", "dtype", *(f"W={w}" for w in world_sizes), "CIERA pays"):
        table.add_column(name, justify="left" if name in ("model", "dtype", "CIERA pays") else "right")
    for row in rows:
        cells = []
        for w in world_sizes:
            if w not in row.gpus:
                cells.append("-")
                continue
            cell = f"{row.ciera[w]:.2f}×" if w in row.ciera else (
                row.does_not_fit(w, "zero3") or row.does_not_fit(w, CIERA) or "-"
            )  # fmt: skip
            lossless = row.best_lossless.get(w)
            if (
                lossless
                and lossless[0] != CIERA
                and w in row.ciera
                and lossless[1] >= row.ciera[w] * PAYS_ABOVE
            ):
                cell += f" ({lossless[0]} {lossless[1]:.2f}×)"
            cells.append(cell)
        pays_cell = pays_text(row)
        lossy = lossy_speedups(row)
        if lossy:
            pays_cell += f"; ZeRO++ (lossy) faster: {speedup_span(lossy)}"
        table.add_row(row.model, row.dtype, *cells, pays_cell)
    captions = [
        f"pays: ≥ {PAYS_ABOVE:.2f}× over ZeRO-3 (less is within the simulation's noise). In brackets: a faster "
        "lossless system. What does not fit one GPU (memory per GPU, docs/simulator.md) or CIERA's cache "
        "budget is left out of both."
    ]
    if any(lossy_speedups(row) for row in rows):
        captions.append(
            "ZeRO++ sends int8 weights: faster where named, but not the same training run (lossy)."
        )
    boundaries, inter_nodes = pays_bases(rows)
    for boundary, paying in boundaries.items():
        captions.append(f"In {paying} of {len(rows)} rows CIERA pays from {boundary}.")
    for inter_node in inter_nodes:
        captions.append(
            f"Every verdict rests on the {inter_node}; `ciera simulate --sweep inter_node.beta_Bps=2e9,4e9,...` "
            '(or the report\'s "Speedup vs link bandwidth") shows where CIERA stops paying.'
        )
    if any(r.get("source") != "measured" for r in records):
        captions.append("From analytic traces: model output, not measurements.")
    table.caption = "\n".join(captions)
    return table


def lossy_faster(row: SummaryRow, gpus: int) -> tuple[str, float] | None:
    """(lossy system, speedup) when a lossy system is faster than every lossless one at `gpus`."""
    best = row.best.get(gpus)
    lossless = row.best_lossless.get(gpus)
    if best is None or best[0] not in LOSSY_SYSTEMS:
        return None
    if lossless is not None and lossless[1] >= best[1]:
        return None
    return best


def w_ranges(gpus: Sequence[int], all_gpus: Sequence[int]) -> str:
    """'W = 16–128' when the W's are a contiguous run of the swept ones (two or more), else 'W = 16, 64';
    sorted as numbers."""
    chosen = sorted(set(gpus))
    swept = sorted(set(all_gpus) | set(chosen))
    if len(chosen) > 1:
        first, last = swept.index(chosen[0]), swept.index(chosen[-1])
        if swept[first : last + 1] == chosen:
            return f"W = {chosen[0]}–{chosen[-1]}"
    return "W = " + ", ".join(map(str, chosen))


def grouped_notes(records: Sequence[dict[str, Any]], field: str = "notes") -> list[str]:
    """Every distinct record note (of `field`: notes or details) once, followed by the models, dtypes and W's it applies to
    ("... — Mixtral-8x7B bf16 at W = 16–128; OLMoE-1B-7B fp16 at W = 4"); a note that holds for every
    record says so instead. In first-seen order."""
    all_gpus = sorted({int(r["gpus"]) for r in records})
    where: dict[str, dict[tuple[str, str], set[int]]] = {}
    everywhere: dict[str, int] = {}
    for record in records:
        for note in dict.fromkeys(record.get(field) or []):
            where.setdefault(note, {}).setdefault((record["model"], record["dtype"]), set()).add(
                int(record["gpus"])
            )
            everywhere[note] = everywhere.get(note, 0) + 1
    lines = []
    for note, places in where.items():
        if everywhere[note] == len(records):
            lines.append(f"{note} (every record)")
            continue
        scope = "; ".join(
            f"{model} {dtype} at {w_ranges(sorted(gpus), all_gpus)}"
            for (model, dtype), gpus in places.items()
        )
        lines.append(f"{note} — {scope}")
    return lines


_SUBJECT_NOTE = re.compile(r"(run )?(\S+): (.+)", re.S)
_COUNT_NOTE = re.compile(r"(\d+) (.+)", re.S)


def merged_notes(notes: Iterable[str]) -> list[str]:
    """Notes said once each, in first-seen order: notes that differ only in their subject (a leading
    "run ID: " or "NAME: ") as one line naming every subject ("runs a, b: ..."), and notes that differ
    only in a leading count as one line with its range ("1–7 gathered buckets ... (by prediction)")."""
    groups: dict[tuple[str, ...], list] = {}  # (kind, ...) -> its subjects or counts; dicts keep order
    for note in notes:
        if subject := _SUBJECT_NOTE.fullmatch(note):
            groups.setdefault(("subject", subject.group(1) or "", subject.group(3)), []).append(
                subject.group(2)
            )
        elif count := _COUNT_NOTE.fullmatch(note):
            groups.setdefault(("count", count.group(2)), []).append(int(count.group(1)))
        else:
            groups.setdefault(("plain", note), [])
    lines = []
    for key, values in groups.items():
        if key[0] == "subject":
            names = list(dict.fromkeys(values))
            prefix = "runs " if key[1] and len(names) > 1 else key[1]
            lines.append(f"{prefix}{', '.join(names)}: {key[2]}")
        elif key[0] == "count":
            low, high = min(values), max(values)
            lines.append(f"{low} {key[1]}" if low == high else f"{low}–{high} {key[1]} (by prediction)")
        else:
            lines.append(key[1])
    return lines


# A critical-path part shorter than this (seconds, or share of an iteration) is left out of the texts.
PATH_PART_SHOWN = 0.0005


def path_change_text(measured: dict[str, float], predicted: dict[str, float]) -> str:
    """A run's critical path part by part, measured → predicted in ms (`sim.evaluate.critical_path`'s
    parts): what `ciera validate sim` prints and the report shows for a run over the max target."""
    return ", ".join(
        f"{label} {measured[key] * 1e3:.0f} → {predicted[key] * 1e3:.0f}"
        for key, label in BREAKDOWN_LABELS.items()
        if measured[key] >= PATH_PART_SHOWN or predicted[key] >= PATH_PART_SHOWN
    )


def path_shares_text(shares: dict[str, float]) -> str:
    """Signed shares of an iteration per critical-path part (e.g. "exposed all-gather -2.4 %"); parts
    within PATH_PART_SHOWN are left out ("" when all are)."""
    return ", ".join(
        f"{BREAKDOWN_LABELS[key]} {value * 100:+.1f} %"
        for key, value in shares.items()
        if abs(value) >= PATH_PART_SHOWN
    )
