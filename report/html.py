"""Assemble the self-contained HTML report: plotly.js inlined once, figures as JSON, no network access."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from traces import TraceBundle

from .figures import (
    breakdown_figure,
    exponent_figure,
    sensitivity_figure,
    speedup_figure,
    system_colour,
    system_label,
    timeline_figure,
)
from .inputs import SYSTEMS, is_measured_point, provenance_label, validate_record, validate_timeline
from .sensitivity import (
    BANDWIDTH_KEYS,
    BandwidthSweep,
    break_even_rows,
    sweep_command,
    sweep_views,
    validate_sweep_records,
)

PLOT_CLASS = "ciera-plot"
PLOTLY_CONFIG = {
    "responsive": True,
    "displaylogo": False,
    "showLink": False,
    "showSendToCloud": False,
    "toImageButtonOptions": {"format": "svg"},
    "modeBarButtonsToRemove": ["lasso2d", "select2d"],
}

STYLE = """
:root { --ink:#1f2933; --muted:#6b7280; --line:#e5e7eb; --accent:#d62728; --bg:#f8fafc; }
* { box-sizing: border-box; }
body { margin:0; font-family: Inter, system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color:var(--ink);
       background:var(--bg); line-height:1.5; }
header { background:#111827; color:#f9fafb; padding:28px 40px 22px; }
header h1 { margin:0 0 6px; font-size:26px; font-weight:650; letter-spacing:-0.01em; }
header .meta { color:#cbd5e1; font-size:14px; }
header .meta code { color:#f9fafb; }
.provenance { margin:16px 0 0; padding:10px 14px; border-left:4px solid #f59e0b; background:#1f2937;
              color:#fde68a; font-size:14px; border-radius:4px; }
nav { position:sticky; top:0; z-index:10; background:white; border-bottom:1px solid var(--line);
      padding:8px 40px; font-size:14px; }
nav a { color:var(--ink); text-decoration:none; margin-right:22px; }
nav a:hover { color:var(--accent); }
main { max-width:1320px; margin:0 auto; padding:10px 40px 60px; }
section { background:white; border:1px solid var(--line); border-radius:8px; margin:22px 0; padding:18px 22px; }
section h2 { margin:0 0 4px; font-size:20px; }
section p.lede { margin:0 0 10px; color:var(--muted); font-size:14px; max-width:980px; }
.legend-key { display:inline-flex; gap:18px; flex-wrap:wrap; font-size:13px; color:var(--muted); margin-bottom:4px; }
.swatch { display:inline-block; width:12px; height:12px; border-radius:50%; margin-right:5px; vertical-align:-1px; }
.empty { color:var(--muted); font-style:italic; padding:20px 0; }
p.caption { color:var(--muted); font-size:13px; margin:8px 0 0; max-width:980px; }
table.records td.wrap { white-space:normal; }
table.records { border-collapse:collapse; width:100%; font-size:13px; font-variant-numeric:tabular-nums; }
table.records th, table.records td { padding:4px 8px; border-bottom:1px solid var(--line); text-align:right;
                                     white-space:nowrap; }
table.records th { position:sticky; top:0; background:#f3f4f6; cursor:pointer; user-select:none; }
table.records td.text, table.records th.text { text-align:left; }
table.records tr.projected td.source { color:#b45309; }
table.records tr.measured td.source { color:#047857; font-weight:600; }
.table-tools { margin:6px 0 10px; font-size:14px; }
.table-tools input { padding:5px 8px; width:340px; border:1px solid #cbd5e1; border-radius:4px; font:inherit; }
.table-scroll { max-height:640px; overflow:auto; border:1px solid var(--line); border-radius:4px; }
footer { color:var(--muted); font-size:12px; text-align:center; padding:10px 0 30px; }
"""

# Table filtering and sorting, a few lines of plain JS so the page needs nothing beyond plotly.js.
TABLE_SCRIPT = """
(function () {
  const table = document.getElementById('records-table');
  if (!table) return;
  const body = table.tBodies[0];
  document.getElementById('records-filter').addEventListener('input', function (event) {
    const words = event.target.value.toLowerCase().split(/\\s+/).filter(Boolean);
    for (const row of body.rows) {
      const text = row.textContent.toLowerCase();
      row.style.display = words.every(function (w) { return text.includes(w); }) ? '' : 'none';
    }
  });
  Array.from(table.tHead.rows[0].cells).forEach(function (header, column) {
    header.addEventListener('click', function () {
      const ascending = header.dataset.order !== 'asc';
      header.dataset.order = ascending ? 'asc' : 'desc';
      const rows = Array.from(body.rows);
      rows.sort(function (a, b) {
        const x = a.cells[column].dataset.sort ?? a.cells[column].textContent;
        const y = b.cells[column].dataset.sort ?? b.cells[column].textContent;
        const nx = parseFloat(x), ny = parseFloat(y);
        const order = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return ascending ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
})();
"""


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _json_for_script(value: object) -> str:
    """JSON safe to embed in a <script> element (no premature '</script>', no NaN)."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _sanitize(value: Any) -> Any:
    """Plain JSON types only: numpy scalars to Python, non-finite floats to null (a gap in the plot)."""
    if isinstance(value, dict):
        return {key: _sanitize(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(item) for item in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plot_div(figure_id: str) -> str:
    return f'<div class="{PLOT_CLASS}" id="{figure_id}"></div>'


def _system_key(systems: Sequence[str]) -> str:
    items = "".join(
        f'<span><span class="swatch" style="background:{system_colour(s)}"></span>{html.escape(system_label(s))}</span>'
        for s in systems
    )
    return f'<div class="legend-key">{items}</div>'


def _format_number(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def _records_table(records: list[dict[str, Any]]) -> str:
    system_rank = {s: i for i, s in enumerate(SYSTEMS)}
    ordered = sorted(
        records,
        key=lambda r: (
            r["model"],
            r["dtype"],
            r["gpus"],
            system_rank.get(r["system"], len(SYSTEMS)),
            r["system"],
        ),
    )
    headers = [
        ("model", "text"),
        ("dtype", "text"),
        ("GPUs", ""),
        ("system", "text"),
        ("source", "text"),
        ("iteration p50 (s)", ""),
        ("p5–p95 (s)", ""),
        ("× ZeRO-3", ""),
        ("× ZeRO++", ""),
        ("bound ×", ""),
        ("overlap-only ×", ""),
        ("Allgather GB/iter", ""),
        ("shards selected", ""),
    ]
    head = "".join(f'<th class="{css}">{html.escape(name)}</th>' for name, css in headers)
    rows = []
    for r in ordered:
        iteration = r["iteration_s"]
        allgather_bytes = r.get("allgather_bytes_per_iter")
        cells = [
            f'<td class="text">{html.escape(r["model"])}</td>',
            f'<td class="text">{html.escape(r["dtype"])}</td>',
            f"<td>{r['gpus']}</td>",
            f'<td class="text" style="color:{system_colour(r["system"])};font-weight:600">'
            f"{html.escape(system_label(r['system']))}</td>",
            f'<td class="text source">{provenance_label(r)}</td>',
            f"<td>{_format_number(iteration['p50'])}</td>",
            f'<td data-sort="{iteration["p5"]}">{_format_number(iteration["p5"])}–{_format_number(iteration["p95"])}</td>',
            f"<td>{_format_number(r['speedup_vs_zero3'], 3)}</td>",
            f"<td>{_format_number(r.get('speedup_vs_zeropp'), 3)}</td>",
            f"<td>{_format_number(r.get('bound_speedup'), 3)}</td>",
            f"<td>{_format_number(r.get('overlap_only_speedup'), 3)}</td>",
            f"<td>{_format_number(None if allgather_bytes is None else allgather_bytes / 1e9)}</td>",
            f"<td>{_format_number(r.get('shards_selected'), 6)}</td>",
        ]
        row_class = "measured" if is_measured_point(r) else "projected"
        rows.append(f'<tr class="{row_class}">{"".join(cells)}</tr>')
    return (
        '<div class="table-tools"><input id="records-filter" type="search" '
        'placeholder="filter rows, e.g. &quot;mixtral fp16 ciera&quot;"> '
        "<span>click a column header to sort</span></div>"
        f'<div class="table-scroll"><table class="records" id="records-table"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


# What `ciera measure` ran under each system name (measure.capture.SYSTEMS): CIERA compresses every BF16
# parameter (exponent reuse), without selection or pipelining, inside the real engine.
MEASURED_SYSTEM_LABELS = {
    "zero3": "ZeRO-3",
    "fsdp": "FSDP2",
    "ciera": "ZeRO-3 + CIERA",
    "ciera-fsdp": "FSDP2 + CIERA",
}


def measured_run_rows(bundle: TraceBundle) -> list[dict[str, Any]]:
    """One row per measured run with timed iterations: its cluster, link, depth, system, iteration times,
    the all-gather bytes per iteration (raw and on the wire, means over ranks) and the speedup over the
    ZeRO-3 run of the same cluster and depth — every number straight from the bundle."""
    from traces import run_summaries

    summaries = run_summaries(bundle)
    if summaries.empty:
        return []
    summaries = summaries.set_index("run_id")
    runs = bundle.runs[(bundle.runs["source"] == "measured") & bundle.runs["run_id"].isin(summaries.index)]
    rows = [
        {
            "run_id": run.run_id,
            "cluster": run.cluster,
            "nodes": int(run.nodes),
            "ranks_per_node": int(run.gpus_per_node),
            "link_rate_Bps": float(run.link_rate_Bps),
            "measured_link_Bps": float(run.measured_link_Bps),
            "layers": int(run.layers),
            "system": run.system,
            **summaries.loc[run.run_id].to_dict(),
            "iterations": int(summaries.loc[run.run_id, "iterations"]),
            "hardware": run.hardware,
        }
        for run in runs.itertuples()
    ]
    baseline = {(r["cluster"], r["layers"]): r["iteration_median_s"] for r in rows if r["system"] == "zero3"}
    for row in rows:
        base = baseline.get((row["cluster"], row["layers"]))
        row["speedup_vs_zero3"] = base / row["iteration_median_s"] if base else None
    return sorted(rows, key=lambda r: (r["cluster"], r["layers"], r["system"]))


def _measured_runs_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        ("cluster", "text"),
        ("link nominal / gloo (MB/s)", ""),
        ("L", ""),
        ("system", "text"),
        ("iteration median (ms)", ""),
        ("min–max (ms)", ""),
        ("× ZeRO-3", ""),
        ("Allgather raw MB/iter", ""),
        ("on the wire MB/iter", ""),
    ]
    head = "".join(f'<th class="{css}">{html.escape(name)}</th>' for name, css in headers)
    body = []
    for r in rows:
        link = (
            f"{r['link_rate_Bps'] / 1e6:.1f} / {r['measured_link_Bps'] / 1e6:.1f}"
            if r["link_rate_Bps"]
            else "loopback"
        )
        cells = [
            f'<td class="text">{html.escape(r["cluster"])}</td>',
            f"<td>{link}</td>",
            f"<td>{r['layers']}</td>",
            f'<td class="text" style="color:{system_colour(r["system"])};font-weight:600">'
            f"{html.escape(MEASURED_SYSTEM_LABELS.get(r['system'], r['system']))}</td>",
            f"<td>{r['iteration_median_s'] * 1e3:.1f}</td>",
            f"<td>{r['iteration_min_s'] * 1e3:.1f}–{r['iteration_max_s'] * 1e3:.1f}</td>",
            f"<td>{_format_number(r['speedup_vs_zero3'], 3)}</td>",
            f"<td>{r['allgather_raw_bytes'] / 1e6:.2f}</td>",
            f"<td>{r['allgather_wire_bytes'] / 1e6:.2f}</td>",
        ]
        body.append(f'<tr class="measured">{"".join(cells)}</tr>')
    return (
        f'<div class="table-scroll"><table class="records" id="measured-table"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _sensitivity_body(sweep: BandwidthSweep, views: list) -> str:
    """System key, the figure, and per model the bandwidth where each CIERA variant stops paying."""
    systems = [s for s in SYSTEMS if any(s in view.lines for view in views)]
    # One row per model: the full CIERA's statement in words, its variants in a few words each. Plain
    # rows: the measured/projected row classes belong to the records tables.
    rows = []
    for view, results in break_even_rows(views):
        if not results:
            continue
        primary = next(
            (s for s in ("ciera", "ciera-er-bsc", "ciera-er") if s in results), next(iter(results))
        )
        others = "; ".join(
            f'<span style="color:{system_colour(s)};font-weight:600">{html.escape(system_label(s))}</span>: '
            f"{html.escape(result.short)}"
            for s, result in results.items()
            if s != primary
        )
        rows.append(
            f'<tr><td class="text">{html.escape(view.model)}</td>'
            f'<td class="text">{html.escape(view.dtype)}</td><td>{view.gpus}</td>'
            f'<td class="text wrap"><span style="color:{system_colour(primary)};font-weight:600">'
            f"{html.escape(system_label(primary))}</span> {html.escape(results[primary].text)}</td>"
            f'<td class="text wrap">{others or "—"}</td></tr>'
        )
    headers = (
        ("model", "text"),
        ("dtype", "text"),
        ("GPUs", ""),
        ("where the speedup over ZeRO-3 falls to 1.0 or below", "text"),
        ("the other CIERA variants", "text"),
    )
    head = "".join(f'<th class="{css}">{name}</th>' for name, css in headers)
    table = (
        '<table class="records" id="sensitivity-table">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        if rows
        else '<p class="empty">The sweep holds no CIERA records, so no break-even bandwidth is stated.</p>'
    )
    reference = (
        f"The dotted vertical line is this cluster's own β, {sweep.reference_Bps / 1e9:.3g} GB/s "
        f"({html.escape(sweep.reference_note)}); the other sections were simulated there. "
        if sweep.reference_Bps is not None
        else (f"{html.escape(sweep.reference_note)}. " if sweep.reference_note else "")
    )
    caption = (
        f'<p class="caption">{reference}{html.escape(sweep.scope_note)} Every point is a simulated '
        "projection at a set bandwidth, not a measurement. The crossing is interpolated between the two "
        "swept bandwidths around it (linear in speedup over log bandwidth).</p>"
    )
    return _system_key(systems) + _plot_div("fig-sensitivity") + table + caption


def _provenance_banner(records: list[dict[str, Any]], bundle: TraceBundle | None) -> str:
    measured = sum(is_measured_point(r) for r in records)
    analytic = sum(provenance_label(r) == "analytic projection" for r in records)
    other_projections = len(records) - measured - analytic
    analytic_runs = 0 if bundle is None else int((bundle.runs["source"] == "analytic").sum())
    counts = f"{len(records)} simulation records: {measured} measured, {analytic} <b>analytic projection</b>"
    if other_projections:
        counts += f", {other_projections} projected from measured traces to untraced sizes"
    parts = [counts + "."]
    if measured < len(records):
        parts.append(
            "Analytic projections are model output of the simulator (analytic traces and/or extrapolation in "
            "depth and world size), not measurements; every projected point is drawn with a hollow marker on a "
            "dashed line, and as a paler bar."
        )
    if bundle is not None and analytic_runs:
        parts.append(
            f"{analytic_runs} of the bundle's {len(bundle.runs)} trace runs were produced by the analytic "
            "generator, not captured on hardware."
        )
    return f'<div class="provenance">{" ".join(parts)}</div>'


def build_report(
    records: list[dict[str, Any]],
    timeline_events: list[dict[str, Any]],
    bundle: TraceBundle | None,
    title: str,
    *,
    cluster: str | None = None,
    bundle_path: str | None = None,
    timeline_caption: str | None = None,
    sensitivity: BandwidthSweep | None = None,
    sensitivity_missing: str | None = None,
) -> str:
    """One self-contained HTML document (plotly.js inlined once, no network access) for these records.

    `records` follow the ciera.simulate/1 contract (validated here too, so API callers get the same
    checks as files); `timeline_events` are Chrome-trace events, complete ('X') ones are drawn.
    `sensitivity` is a link bandwidth sweep (report.sensitivity); without one the section says why
    (`sensitivity_missing`, or that none was given) and how to make one.
    """
    records = [validate_record(record, "<records>", index) for index, record in enumerate(records)]
    timeline_events = validate_timeline(list(timeline_events), "<timeline>")
    systems_present = [s for s in SYSTEMS if any(r["system"] == s for r in records)]
    if timeline_caption is None:
        contexts = sorted({event["context"] for event in timeline_events if event.get("context")})
        timeline_caption = f"Simulated: {'; '.join(contexts)}." if contexts else None

    figures: dict[str, dict[str, Any]] = {}
    if records:
        figures["fig-speedup"] = speedup_figure(records)
        figures["fig-breakdown"] = breakdown_figure(records)
    if timeline_events:
        figures["fig-timeline"] = timeline_figure(timeline_events)
    sensitivity_views = []
    if sensitivity is not None:
        sensitivity = validate_sweep_records(sensitivity)
        sensitivity_views = sweep_views(sensitivity)
    if sensitivity_views:
        reference_label = (
            f"this cluster's β {sensitivity.reference_Bps / 1e9:.3g} GB/s: {sensitivity.reference_note}"
            if sensitivity.reference_Bps is not None
            else ""
        )
        figures["fig-sensitivity"] = sensitivity_figure(
            sensitivity_views,
            BANDWIDTH_KEYS[sensitivity.key],
            [p.bandwidth_Bps for p in sensitivity.points if not p.is_reference],
            sensitivity.reference_Bps,
            reference_label,
        )
    has_exponents = bundle is not None and len(bundle.exponents) > 0
    if has_exponents:
        figures["fig-exponents"] = exponent_figure(bundle.exponents, bundle.runs)

    measured_rows = measured_run_rows(bundle) if bundle is not None else []

    def section(anchor: str, heading: str, lede: str, body: str) -> str:
        return f'<section id="{anchor}"><h2>{heading}</h2><p class="lede">{lede}</p>{body}</section>'

    no_records = '<p class="empty">No simulation records.</p>'
    sections = [
        section(
            "speedup",
            "Speedup vs GPUs",
            "Iteration-time speedup of each system over ZeRO-3 (left) and over ZeRO++ (right, FP16 only) as the "
            "world size grows. Filled markers on solid lines are measured; hollow markers on dashed lines are "
            "analytic projections. For CIERA (ER+BSC+CCP) the shaded band runs from what perfect overlap alone gives "
            "(dash-dot) up to the bound that its fewer bytes plus perfect overlap allow (dotted); every point's own "
            "bound and the split of its speedup into bytes × overlap × other are in its hover text. The dotted "
            "line at 1 is parity. "
            "Use the dropdown to pick the model and dtype.",
            (_system_key([s for s in systems_present if s != "zero3"]) + _plot_div("fig-speedup"))
            if records
            else no_records,
        ),
        section(
            "sensitivity",
            "Speedup vs link bandwidth",
            "Every projection rests on the cluster's link numbers. Here the simulation is repeated at several "
            "inter-node bandwidths, the rest of the cluster unchanged, to show where CIERA stops paying: its "
            "gain comes from moving fewer bytes, so it shrinks as the link gets faster and the gathers hide "
            "behind compute. One line per system, speedup over ZeRO-3 at the same bandwidth; the grey line "
            "at 1.0 is no gain. With several models, the dropdown picks one.",
            _sensitivity_body(sensitivity, sensitivity_views)
            if sensitivity is not None and sensitivity_views
            else '<p class="empty">'
            + html.escape(sensitivity_missing or "No link bandwidth sensitivity data was given.")
            + " Make one with <code>"
            + html.escape(sweep_command(records))
            + "</code> and pass it with <code>ciera report --records … --sensitivity sweep.json</code>; "
            "<code>ciera report</code> without <code>--records</code> simulates one itself.</p>",
        ),
        section(
            "breakdown",
            "Where the iteration time goes",
            "Stacked per-rank time of one iteration for every system, grouped by world size W: compute, the "
            "Allgather and ReduceScatter time not hidden behind compute, codec work left on the critical path, "
            "and the rest (optimizer step, launch gaps). Markers with whiskers show the p50 iteration time and "
            "its p5–p95 Monte Carlo band. Paler bars are analytic projections, full-colour bars measured.",
            _plot_div("fig-breakdown") if records else no_records,
        ),
        section(
            "timeline",
            "One iteration, per stream",
            "Gantt view of one simulated iteration per system: each row is a stream of a rank (compute, "
            "Allgather, ReduceScatter, codec sender, codec receiver); gaps are idle time. Panels share the time "
            "axis: zoom one to zoom all. The same trace opens in Perfetto (ciera simulate --timeline)."
            + (f" {html.escape(timeline_caption)}" if timeline_caption else ""),
            _plot_div("fig-timeline")
            if timeline_events
            else '<p class="empty">No timeline events were given.</p>',
        ),
        section(
            "exponents",
            "Exponent churn",
            "How often exponents change between iterations, per parameter category: the fraction of values "
            "whose exponent changed, and the fraction of B-value blocks holding any change (the block change "
            "rate q that sets CIERA's payload ratio r(q) ≈ 0.5 + 1/(16B) + q·H/16 for BF16).",
            _plot_div("fig-exponents")
            if has_exponents
            else '<p class="empty">The trace bundle holds no exponent statistics.</p>',
        ),
        *(
            [
                section(
                    "measured",
                    "Measured runs",
                    "Real training iterations captured with <code>ciera measure</code> on "
                    + html.escape(", ".join(sorted({r["hardware"] for r in measured_rows})))
                    + ": each row is one run of the trace bundle (median and range over its timed "
                    "iterations; the iteration ends when the last rank ends). × ZeRO-3 compares with the ZeRO-3 "
                    "run of the same cluster and depth; Allgather bytes are per rank's view of one iteration "
                    "(raw: what the gathers would move uncompressed; on the wire: what they moved). These are "
                    "measurements, not simulation output.",
                    _measured_runs_table(measured_rows),
                )
            ]
            if measured_rows
            else []
        ),
        section(
            "records",
            "All records",
            "Every simulated (model, dtype, GPUs, system) point. Speedups are ratios of p50 iteration times; "
            "“bound ×” is the most that fewer Allgather bytes plus perfect overlap could give, “overlap-only ×” "
            "what perfect overlap gives without compression.",
            _records_table(records) if records else no_records,
        ),
    ]

    meta_items = []
    if cluster:
        meta_items.append(f"cluster <code>{html.escape(cluster)}</code>")
    meta_items.append(f"trace bundle <code>{html.escape(bundle_path) if bundle_path else 'none'}</code>")
    models = list(dict.fromkeys(r["model"] for r in records))
    gpus = sorted({r["gpus"] for r in records})
    if records:
        meta_items.append(f"{len(models)} models, W ∈ {{{', '.join(map(str, gpus))}}}")
    nav = "".join(
        f'<a href="#{anchor}">{name}</a>'
        for anchor, name in (
            ("speedup", "Speedup"),
            ("sensitivity", "Bandwidth"),
            ("breakdown", "Breakdown"),
            ("timeline", "Timeline"),
            ("exponents", "Exponent churn"),
            *([("measured", "Measured runs")] if measured_rows else []),
            ("records", "Records"),
        )
    )
    figure_payload = _json_for_script({key: _sanitize(value) for key, value in figures.items()})
    render_script = (
        f"const cieraFigures = {figure_payload};\n"
        f"const cieraConfig = {_json_for_script(PLOTLY_CONFIG)};\n"
        "for (const [id, figure] of Object.entries(cieraFigures)) {\n"
        "  Plotly.newPlot(id, figure.data, figure.layout, cieraConfig);\n"
        "}\n"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style>"
        f"<script>{_plotly_js()}</script></head><body>"
        f"<header><h1>{html.escape(title)}</h1>"
        f'<div class="meta">{" · ".join(meta_items)}</div>'
        f"{_provenance_banner(records, bundle)}</header>"
        f"<nav>{nav}</nav><main>{''.join(sections)}</main>"
        "<footer>Generated by <code>ciera report</code>. Self-contained: works offline.</footer>"
        f"<script>{render_script}{TABLE_SCRIPT}</script></body></html>\n"
    )
