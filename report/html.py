"""Assemble the self-contained HTML report: plotly.js inlined once, figures as JSON, no network access."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import traces
from sim import path_change_text, path_shares_text
from traces import NAMED_BUNDLES, TraceBundle

from .figures import (
    DEFAULT_BLOCK_SIZE,
    Figure,
    breakdown_figure,
    divergence_arm_colour,
    divergence_arm_label,
    divergence_log_figure,
    divergence_share_figure,
    exponent_figure,
    iteration_spread,
    sensitivity_figure,
    short_label,
    speedup_figure,
    system_colour,
    system_label,
    timeline_figure,
)
from .inputs import (
    SYSTEMS,
    is_measured_point,
    provenance_label,
    timeline_contexts,
    validate_record,
    validate_timeline,
)
from .sensitivity import (
    BANDWIDTH_KEYS,
    BandwidthSweep,
    break_even_rows,
    sweep_command,
    sweep_views,
    validate_sweep_records,
)
from .summary import (
    PAYS_ABOVE,
    SummaryRow,
    lossy_faster,
    lossy_speedups,
    pays_bases,
    pays_text,
    speedup_span,
    summary_rows,
)
from .validation import (
    PRODUCERS,
    REPLAY_TARGET,
    SEED_ARM,
    ValidationFile,
    ValidationResults,
    auc_undefined_reason,
    exactly_zero,
    producing_command,
    sim_category_rows,
    validate_results,
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
table.records th, table.records td { padding:4px 5px; border-bottom:1px solid var(--line); text-align:right;
                                     white-space:nowrap; }
table.records th { white-space:normal; vertical-align:bottom; }
#records-table { font-size:12.5px; }
#records-table .split { color:var(--muted); font-size:11.5px; }
table.summary td { white-space:normal; vertical-align:top; }
table.summary td:first-child { min-width:150px; }
table.summary td .lossy { color:var(--muted); font-size:12px; }
table.summary td.pays { font-weight:600; }
table.summary td.unfit { color:var(--muted); font-size:12px; }
table.records td.unfit { color:#f87171; }
.verdict { margin:8px 0 4px; font-size:15px; max-width:980px; }
table.records th { position:sticky; top:0; background:#f3f4f6; cursor:pointer; user-select:none; }
table.records td.text, table.records th.text { text-align:left; }
table.records tr.projected td.source { color:#b45309; }
table.records tr.measured td.source { color:#047857; font-weight:600; }
.table-tools { margin:6px 0 10px; font-size:14px; }
.table-tools input { padding:5px 8px; width:340px; border:1px solid #cbd5e1; border-radius:4px; font:inherit; }
.table-scroll { max-height:640px; overflow:auto; border:1px solid var(--line); border-radius:4px; }
section h3 { margin:18px 0 4px; font-size:16px; }
.verdict-passed { color:#047857; font-weight:700; }
.verdict-failed { color:#b91c1c; font-weight:700; }
code.command { display:block; margin:4px 0 8px; padding:6px 10px; background:#f3f4f6; border-radius:4px;
               font-size:12.5px; white-space:pre-wrap; overflow-wrap:anywhere; }
.figure-grid { display:grid; grid-template-columns:repeat(auto-fit, minmax(420px, 1fr)); gap:12px 18px; }
.figure-grid > div { min-width:0; }
.figure-title { font-size:14px; font-weight:600; margin:6px 0 0 8px; }
table.validation th { white-space:normal; vertical-align:bottom; }
.line-swatch { display:inline-block; width:22px; height:0; border-top:3px solid; margin-right:6px;
               vertical-align:4px; }
.table-wide { overflow-x:auto; margin:6px 0; }
table.validation td:first-child { white-space:normal; text-align:left; }
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


def _memory_cell(memory: dict[str, Any]) -> str:
    """One GPU's memory and whether it fits; the parts in the hover title (sim/memory.py)."""
    if not memory:
        return '<td data-sort="0">—</td>'
    total = memory["total_bytes"]
    parts = ", ".join(
        f"{label} {memory[key] / 2**30:.1f}"
        for key, label in (
            ("model_states_bytes", "model states"),
            ("gathered_parameters_bytes", "gathered layers"),
            ("activations_bytes", "activations"),
            ("ciera_bytes", "CIERA state"),
            ("zeropp_bytes", "hpZ partition"),
        )
        if memory.get(key)
    )
    device = memory.get("device_bytes") or 0
    fit = (
        "fit not checked (no device memory in the preset)"
        if memory.get("fits") is None
        else ("fits" if memory["fits"] else "does not fit")
        + f" ({total / 2**30:.0f} GiB of {device / 2**30:.0f})"
    )
    css = ' class="wrap unfit"' if memory.get("fits") is False else ' class="wrap"'
    mark = " ✗" if memory.get("fits") is False else ""
    return f'<td{css} data-sort="{total}" title="{html.escape(fit)}: {html.escape(parts)} GiB">{total / 2**30:.0f}{mark}</td>'


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
    has_split = any(r.get("allgather_bytes_inter_node_per_iter") is not None for r in records)
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
        ("own bound × / overlap-only ×", ""),
        (
            "Allgather GB/iter gathered" + (" (one rank receives: intra / inter-node)" if has_split else ""),
            "",
        ),
        ("shards selected", ""),
        ("GiB / GPU", ""),
    ]
    head = "".join(f'<th class="{css}">{html.escape(name)}</th>' for name, css in headers)
    rows = []
    for r in ordered:
        iteration = r["iteration_s"]
        allgather_bytes = r.get("allgather_bytes_per_iter")
        intra = r.get("allgather_bytes_intra_node_per_iter")
        inter = r.get("allgather_bytes_inter_node_per_iter")
        split = (
            f'<br><span class="split">{_format_number(intra / 1e9, 3)} / {_format_number(inter / 1e9, 3)}</span>'
            if intra is not None and inter is not None
            else ("<br>—" if has_split else "")
        )
        selected = r.get("shards_selected")
        total = r.get("shards_total")
        shards = _format_number(selected, 6) + (f" / {total}" if selected is not None and total else "")
        cells = [
            f'<td class="text wrap">{html.escape(r["model"])}</td>',
            f'<td class="text">{html.escape(r["dtype"])}</td>',
            f"<td>{r['gpus']}</td>",
            f'<td class="text wrap" style="color:{system_colour(r["system"])};font-weight:600">'
            f"{html.escape(system_label(r['system']))}</td>",
            f'<td class="text wrap source">{provenance_label(r)}</td>',
            f"<td>{_format_number(iteration['p50'])}</td>",
            f'<td class="wrap" data-sort="{iteration["p5"]}">{_format_number(iteration["p5"])}–'
            f"{_format_number(iteration['p95'])}</td>",
            f"<td>{_format_number(r['speedup_vs_zero3'], 3)}</td>",
            f"<td>{_format_number(r.get('speedup_vs_zeropp'), 3)}</td>",
            f'<td data-sort="{r.get("bound_speedup") or 0}">{_format_number(r.get("bound_speedup"), 3)} / '
            f"{_format_number(r.get('overlap_only_speedup'), 3)}</td>",
            f'<td data-sort="{allgather_bytes or 0}">'
            f"{_format_number(None if allgather_bytes is None else allgather_bytes / 1e9)}{split}</td>",
            f'<td class="wrap">{shards}</td>',
            _memory_cell(r.get("memory") or {}),
        ]
        row_class = "measured" if is_measured_point(r) else "projected"
        rows.append(f'<tr class="{row_class}">{"".join(cells)}</tr>')
    missing = []
    if any(r.get("memory") for r in records):
        missing.append(
            "“GiB / GPU”: one GPU's memory at the peak of the iteration — model states, the gathered layers, "
            "activations, CIERA's exponent state, ZeRO++'s hpZ partition (hover for the parts); ✗: it does "
            "not fit the preset's device memory, and the summary leaves it out."
        )
    if has_split:  # the split is per receiving rank, the total per assembled tensor: say why they differ
        missing.append(
            "“Allgather GB/iter gathered” is the sum of the gathered tensors' sizes (wire format) as every "
            "rank assembles them; the two figures under it are what one rank receives over the intra-node "
            "and the inter-node network. They do not add up to the total: a rank's own shard (1/W of it) is "
            "never received, and while W fits in one node nothing crosses nodes (inter-node 0)."
        )
    else:
        missing.append(
            "The intra/inter-node split of the Allgather bytes is not in these records (older simulator "
            "output); the total is shown."
        )
    if any(r.get("bound_speedup") is None for r in records):
        missing.append("“—” as a bound: the record states no bound for that system.")
    notes = f'<p class="caption">{" ".join(missing)}</p>' if missing else ""
    return (
        notes + '<div class="table-tools"><input id="records-filter" type="search" '
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


def _gather_path_cell(seconds: float | None) -> str:
    """The main thread inside the engine's gather calls per all-gather (`traces.run_summaries`); — where
    the run did not record it."""
    if seconds is None or seconds != seconds:
        return '<td title="not recorded by this capture">—</td>'
    return f"<td>{seconds * 1e6:.0f}</td>"


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
        ("gather path µs/Allgather", ""),
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
            _gather_path_cell(r.get("gather_path_s_per_gather")),
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
        "swept bandwidths around it (linear in speedup over log bandwidth). Each system keeps the dash, "
        "marker and width of the speedup plot, the CIERA variants widest first, so lines that coincide "
        "stay visible; a legend entry “· on CIERA-ER” says that line lies on CIERA-ER's (at the bandwidths "
        "named, or at every one).</p>"
    )
    return _system_key(systems) + _plot_div("fig-sensitivity") + table + caption


# ------------------------------------------------------------------------------------------ validation


def _verdict(passed: bool) -> str:
    return (
        f'<span class="verdict-{"passed" if passed else "failed"}">{"PASSED" if passed else "FAILED"}</span>'
    )


def _command_line(result: ValidationFile) -> str:
    if result.shipped:
        return (
            '<p class="caption"><b>Shipped with CIERA</b> (no <code>--validation</code> file was given): the '
            "simulator's own check of the shipped measured bundle — the same op-graph rewrites that make every "
            "projection in this report, against measured runs they were not given. Rerun it on this checkout "
            "with the command below; pass your own files with <code>ciera report --validation</code>.</p>"
            f'<code class="command">{html.escape(producing_command(result))}</code>'
        )
    return (
        f'<p class="caption">Read from <code>{html.escape(result.origin)}</code>; the run\'s own fields '
        "give the equivalent command:</p>"
        f'<code class="command">{html.escape(producing_command(result))}</code>'
    )


def _validation_table(table_id: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain table (cells already escaped); the first column is text, the rest right-aligned."""
    head = "".join(
        f'<th class="{"text" if i == 0 else ""}">{html.escape(name)}</th>' for i, name in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{"text" if i == 0 else ""}">{cell}</td>' for i, cell in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return (
        f'<div class="table-wide"><table class="records validation" id="{table_id}">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def _lossless_verdict_text(d: dict[str, Any]) -> str:
    reasons = []
    if not d["bit_identical"]:
        first = ", ".join(d["first_difference_tensors"][:3])
        reasons.append(
            f"CIERA differs first at step {d['first_difference_step']}" + (f" ({first})" if first else "")
        )
    if not d["control"]["flagged"]:
        reasons.append("the lossy control was not flagged")
    return "; ".join(reasons) if reasons else "bit-identical at every step, and the lossy control flagged"


def _lossless_block(results: list[ValidationFile]) -> str:
    """One column per file: every number the command prints, in its words."""
    docs = [r.document for r in results]

    def row(name: str, value: Any) -> list[str]:
        return [html.escape(name), *(str(value(d)) for d in docs)]

    def mb(value: int) -> str:
        return f"{value / 1e6:,.1f} MB"

    rows = [
        row(
            "engine, model, ranks",
            lambda d: html.escape(
                f"{d['engine']} + CIERA vs {d['engine']}, {d['model']}, {d['world_size']} ranks"
            ),
        ),
        row("steps compared (every step: loss bits, SHA-256 of every tensor)", lambda d: d["steps_compared"]),
        row("tensors compared per step (parameters + Adam states)", lambda d: d["tensors_compared"]),
        row("checkpointed and resumed with CIERA after step", lambda d: d["resume_at"]),
        row("steps whose loss differs", lambda d: d["steps_with_different_loss"]),
        row("steps whose state differs", lambda d: d["steps_with_different_state"]),
        row(
            "max |difference| (state at the snapshot steps, loss at every step)",
            lambda d: (
                f"{d['max_abs_difference']:.3g} (steps {', '.join(d['max_abs_difference_at_snapshots']) or '—'})"
            ),
        ),
        row(
            "all-gather bytes raw → on the wire (rank 0, all steps)",
            lambda d: f"{mb(d['bytes_raw'])} → {mb(d['bytes_sent'])}",
        ),
        row("bytes saved", lambda d: f"<b>{d['bytes_saved_fraction'] * 100:.1f} %</b>"),
        row(
            "control (plain engine, one int8-quantised gather): flagged",
            lambda d: f"{'yes' if d['control']['flagged'] else '<b>NO</b>'} ({d['control']['steps']} steps)",
        ),
        row(
            "control: first differing step, tensors differing",
            lambda d: (
                f"{'—' if d['control']['first_difference_step'] is None else d['control']['first_difference_step']}, "
                f"{d['control']['first_difference_tensor_count']}"
            ),
        ),
        row(
            "control: max |difference| of the state, of the loss",
            lambda d: (
                f"{d['control']['max_abs_difference']:.3g}, {d['control']['max_abs_loss_difference']:.3g}"
            ),
        ),
        row("verdict", lambda d: f"{_verdict(d['passed'])}: {html.escape(_lossless_verdict_text(d))}"),
    ]
    headers = ["", *(f"{d['engine']} · {Path(r.origin).name}" for d, r in zip(docs, results, strict=True))]
    intro = (
        '<p class="caption">Measured, not simulated: the plain engine and the engine + CIERA were trained on '
        "local CPU ranks (gloo) of the machine that ran the command, from the same seed and data order; the "
        "CIERA run was checkpointed half-way and resumed in new processes. Every step compares the loss bits "
        "and a SHA-256 of every parameter and Adam state; at the snapshot steps the values themselves. CIERA "
        "passes when nothing differs and a control with one lossy gather is flagged.</p>"
    )
    commands = "".join(_command_line(r) for r in results)
    passed = all(d["passed"] for d in docs)
    return (
        f"<h3>Lossless: bit for bit against the plain engine — {_verdict(passed)}</h3>"
        + intro
        + _validation_table("validation-lossless-table", headers, rows)
        + commands
    )


def _fraction(value: float | None) -> str:
    return "— (seed level is 0)" if value is None else ("0" if value == 0 else f"{value:.3g}")


def _divergence_block(index: int, result: ValidationFile) -> tuple[str, dict[str, Figure]]:
    d = result.document
    arms = list(d["arms"])
    prefix = f"fig-divergence-{index}"
    titles = {
        f"{prefix}-kl": "KL(reference ‖ arm) of the next-token distributions",
        f"{prefix}-routing": "Routing decisions that differ from the reference's",
        f"{prefix}-top1": "Top-1 agreement with the reference",
        f"{prefix}-near-tie": f"Near-ties: the reference's routing decisions with a margin under "
        f"{d['near_tie_margin'] * 100:g} % of the score spread",
        f"{prefix}-auc": "Flip-margin AUC: did the flipped decisions have small margins?",
    }
    figures = {
        f"{prefix}-kl": divergence_log_figure(arms, "kl", "KL (nats per token)", ".3g"),
        f"{prefix}-routing": divergence_log_figure(arms, "routing_differ", "share of decisions", ".3~%"),
        f"{prefix}-top1": divergence_share_figure(
            arms, "top1_agreement", "tokens with the same top-1", [0, 1.04]
        ),
        f"{prefix}-near-tie": divergence_share_figure(
            [{"name": "reference", "points": arms[0]["points"]}], "near_tie_share", "share of decisions"
        ),
        f"{prefix}-auc": divergence_share_figure(
            [arm for arm in arms if auc_undefined_reason(arm) is None],
            "flip_margin_auc",
            "AUC",
            [0, 1.04],
            (0.5, "0.5: flips unrelated to the margin"),
        ),
    }
    key = "".join(
        f'<span><span class="line-swatch" style="border-color:{divergence_arm_colour(arm["name"])};'
        f'border-top-style:{"dashed" if arm["name"] == SEED_ARM else "solid"}"></span>'
        f"{html.escape(divergence_arm_label(arm['name']))}</span>"
        for arm in arms
    )
    # Exact zeros, said in words too: the log axes draw them only on their "= 0" strip.
    notes = []
    for arm in arms:
        zero_metrics = [m for m in ("kl", "routing_differ") if exactly_zero(arm, m)]
        label = divergence_arm_label(arm["name"])
        if len(zero_metrics) == 2:
            top1 = (
                " and top-1 agreement 100 %" if all(p["top1_agreement"] == 1 for p in arm["points"]) else ""
            )
            notes.append(
                f"<b>{html.escape(label)}: exactly 0 at every checkpoint</b> (KL and routing decisions that "
                f"differ{top1}) — drawn as diamonds on the “= 0” strip."
            )
        else:
            for metric, name in (("kl", "KL"), ("routing_differ", "routing decisions that differ")):
                zero_steps = [str(p["step"]) for p in arm["points"] if p[metric] == 0]
                below = [f"{p[metric]:.2g} at step {p['step']}" for p in arm["points"] if p[metric] < 0]
                if below:  # KL rounded a hair below 0: drawn on the "= 0" strip, so say what it was
                    notes.append(
                        f"{html.escape(label)}: {name} below 0 by rounding ({', '.join(below)}), drawn on the "
                        "“= 0” strip."
                    )
                if zero_steps and metric in zero_metrics:
                    notes.append(f"{html.escape(label)}: {name} exactly 0 at every checkpoint.")
                elif zero_steps:
                    notes.append(
                        f"{html.escape(label)}: {name} exactly 0 at step{'s' if len(zero_steps) > 1 else ''} "
                        f"{', '.join(zero_steps)}."
                    )
    undefined = [
        f"{html.escape(divergence_arm_label(arm['name']))} ({reason})"
        for arm in arms
        if (reason := auc_undefined_reason(arm)) is not None
    ]
    if undefined:
        notes.append(
            "Flip-margin AUC not defined (it needs both flipped and kept decisions) for "
            + "; ".join(undefined)
            + "."
        )
    nudged = d.get("nudged")
    if isinstance(nudged, dict) and {"parameter", "from", "to"} <= set(nudged):
        notes.append(
            f"The 1-ULP arm moved <code>{html.escape(str(nudged['parameter']))}</code>"
            f"[{html.escape(str(nudged.get('index', '')))}] from {nudged['from']:.8g} to {nudged['to']:.8g} "
            "before step 0."
        )
    last_rows = []
    for arm in arms:
        point = arm["points"][-1]
        auc = point["flip_margin_auc"]
        last_rows.append(
            [
                f'<span style="color:{divergence_arm_colour(arm["name"])};font-weight:600">'
                f"{html.escape(divergence_arm_label(arm['name']))}</span>",
                f"{point['kl']:.3g}",
                _fraction(point["kl_vs_seed"]),
                f"{point['routing_differ'] * 100:.3g} %",
                _fraction(point["routing_differ_vs_seed"]),
                f"{point['top1_agreement'] * 100:.4g} %",
                _fraction(point["top1_disagreement_vs_seed"]),
                "—" if auc is None else f"{auc:.3f}",
            ]
        )
    table = _validation_table(
        f"validation-divergence-table-{index}",
        [
            f"arm, at step {arms[0]['points'][-1]['step']}",
            "KL",
            "KL ÷ seed's",
            "routing differ",
            "÷ seed's",
            "top-1 agreement",
            "top-1 disagreement ÷ seed's",
            "flip AUC",
        ],
        last_rows,
    )
    checkpoints = ", ".join(map(str, d["checkpoints"]))
    blocks = "" if d["layers"] is None else f" with {d['layers']} blocks"
    intro = (
        f'<p class="caption">Measured, not simulated: a reference run ({html.escape(str(d.get("reference") or "the plain engine"))}, '
        f"seed {d['seed']}) and one run per arm were trained for {d['steps']} steps on local CPU ranks (gloo) "
        f"of the machine that ran the command, {html.escape(d['engine'])}, {html.escape(d['model'])}"
        f"{blocks}, {d['world_size']} ranks, learning rate "
        f"{d['lr']:g}. At each checkpoint (steps {checkpoints}) each arm and the reference ran on the same "
        f"{d['held_out_tokens']:,} held-out tokens and were compared. The seed arm (weights from seed "
        f"{d['other_seed']}) is the yardstick, drawn dashed: “as different as a new seed”. A lossless gather "
        "stays at exactly 0; a 1-ULP nudge shows how far chaos alone carries a run.</p>"
    )
    plots = "".join(
        f'<div><div class="figure-title">{html.escape(titles[figure_id])}</div>{_plot_div(figure_id)}</div>'
        for figure_id in figures
    )
    body = (
        f"<h3>Divergence from the reference run — {html.escape(d['model'])}, {html.escape(d['engine'])}, "
        f"{d['steps']} steps</h3>"
        + intro
        + f'<div class="legend-key">{key}</div>'
        + f'<div class="figure-grid">{plots}</div>'
        + "".join(f'<p class="caption">{note}</p>' for note in notes)
        + '<p class="caption">The near-tie share belongs to the reference run (a decision whose margin to '
        "the next expert is small), so it is drawn once; the flip-margin AUC is the chance that a flipped "
        "decision had a smaller reference margin than a kept one (1.0: only the closest calls flipped). "
        "Under the log axes, points at exactly 0 sit on the “= 0” strip, since a log axis has no 0.</p>"
        + '<p class="caption">At the last checkpoint, each metric as a fraction of the seed arm\'s: 1 is '
        "“as different as a new seed”, 0 is identical.</p>" + table + _command_line(result)
    )
    return body, figures


def _sim_block(index: int, result: ValidationFile) -> str:
    d = result.document
    rows = []
    for row in sim_category_rows(d):
        verdict = "—" if row.passed is None else _verdict(row.passed)
        target = f"≤ {row.mean_target * 100:g} %" + (
            "" if row.max_target is None else f" mean, ≤ {row.max_target * 100:g} % max"
        )
        span = (
            "—"
            if row.low_error is None or row.high_error is None
            else f"{row.low_error * 100:+.1f} … {row.high_error * 100:+.1f} %"
        )
        rows.append(
            [
                html.escape(row.name),
                str(row.runs),
                "—" if row.mean_abs_error is None else f"{row.mean_abs_error * 100:.1f} %",
                "—" if row.max_abs_error is None else f"{row.max_abs_error * 100:.1f} %",
                span,
                target,
                verdict,
            ]
        )
    noise = d["measurement_noise"]
    depth_line = (
        ""
        if noise["depth_line_residual_mean"] is None
        else f" A line a + b·L fitted to all measured depths of a (cluster, system) — in sample, the best a "
        f"depth-linear model can do — misses its own points by {noise['depth_line_residual_mean'] * 100:.1f} % "
        f"on average, {noise['depth_line_residual_max'] * 100:.1f} % at most."
    )
    return (
        f"<h3>Simulator against measured runs it was not given — {_verdict(d['passed'])}</h3>"
        '<p class="caption">Each held-out measured run is predicted from the seen runs '
        f"(held-out file <code>{html.escape(d['held_out_file'])}</code>), and the seen runs are replayed. "
        f"It passes when the replay is within {REPLAY_TARGET * 100:g} %, the held-out mean |error| within "
        f"the tolerance ({d['tolerance'] * 100:g} %) and the maximum within twice it; each category is shown "
        "against the same targets.</p>"
        + _validation_table(
            f"validation-sim-table-{index}",
            ["what was held out", "runs", "mean |error|", "max |error|", "range", "target", "result"],
            rows,
        )
        + '<p class="caption">Measurement noise, from the measurements alone (no model): the '
        f"{noise['timed_iterations_per_run']} timed iterations of a run differ by "
        f"{noise['iteration_spread_mean'] * 100:.1f} % on average and up to "
        f"{noise['iteration_spread_max'] * 100:.1f} % (max − min over median).{depth_line}</p>"
        + _verdicts_caption(d.get("ciera_verdicts"))
        + _over_max_caption(d)
        + _path_miss_caption(d.get("held_out_path_miss_by_category"))
        + _command_line(result)
        + (
            ""
            if isinstance(d.get("bundle"), str)
            else '<p class="caption">The file does not record which bundle was checked; without '
            "<code>--bundle</code> it is the shipped measured bundle.</p>"
        )
    )


def _over_max_caption(d: dict) -> str:
    """The held-out runs over the max target, each with how far its own measured depths' line misses it
    (files before 2026-12-06 do not record that: nothing is said)."""
    limit = 2 * d["tolerance"]
    over = [
        row
        for row in d["held_out"]
        if "own_depth_line_miss" in row and row["error"] is not None and abs(row["error"]) > limit
    ]
    if not over:
        return ""
    runs = "; ".join(
        f"{html.escape(row['system'])} on {html.escape(row['cluster'])}, L = {row['layers']}, "
        f"{row['error'] * 100:+.1f} % — "
        + (
            "fewer than three depths measured, no line"
            if row["own_depth_line_miss"] is None
            else f"its own line misses it by {row['own_depth_line_miss'] * 100:.1f} %"
        )
        + _path_parts_text(row.get("critical_path_s"))
        for row in over
    )
    return (
        f'<p class="caption">Over the max target ({limit * 100:g} %), each against the line a + b·L through its '
        f"own (cluster, system)'s measured depths, no model involved — a run far off its own line is a "
        f"miss of the measurement's before it is one of the model's: {runs}.</p>"
    )


def _path_parts_text(paths: dict | None) -> str:
    """A run's middle iteration's critical path, measured → predicted per part (files before 2026-12-06:
    nothing)."""
    if not paths:
        return ""
    return f"; critical path, measured → predicted (ms): {path_change_text(paths['measured'], paths['predicted'])}"


def _path_miss_caption(by_category: dict | None) -> str:
    """Which part of the iteration each category's predictions get wrong (files before 2026-12-06:
    nothing)."""
    if not by_category:
        return ""
    texts = "; ".join(
        f"{html.escape(name)}: {path_shares_text(parts)}" for name, parts in by_category.items()
    )
    return (
        '<p class="caption">Where the predictions miss: the critical path of the middle iteration, predicted − '
        "measured per part over the measured iteration, the mean over each category's runs (parts of work "
        f"that overlap trade places on the path; the parts sum to the iteration): {texts}.</p>"
    )


def _verdicts_caption(verdicts: list[dict] | None) -> str:
    """Whether the predictions put CIERA on the measured side of its plain engine (files before 2026-12-05
    do not record it: nothing is said)."""
    if not verdicts:
        return ""
    wrong = [row for row in verdicts if not row["same_side"]]
    others = "; ".join(
        f"{html.escape(row['system'])} on {html.escape(row['cluster'])}, L = {row['layers']}: measured "
        f"{row['measured_speedup']:.3f}×, predicted {row['predicted_speedup']:.3f}×"
        for row in wrong
    )
    return (
        '<p class="caption">Turning CIERA on — its speedup over the plain engine\'s run of the same cluster and '
        f"depth: the prediction says faster or slower as measured in {len(verdicts) - len(wrong)} of "
        f"{len(verdicts)} pairs{'; on the other side: ' + others if wrong else ''}.</p>"
    )


def _validation_body(results: ValidationResults | None) -> tuple[str, dict[str, Figure]]:
    """The section's HTML and its figures: lossless, divergence and validate-sim blocks for the files
    given, and for each kind not given, the command that makes it."""
    results = results or ValidationResults()
    figures: dict[str, Figure] = {}
    blocks = []
    lossless = results.of_kind("lossless")
    if lossless:
        blocks.append(_lossless_block(lossless))
    for index, result in enumerate(results.of_kind("divergence")):
        body, block_figures = _divergence_block(index, result)
        blocks.append(body)
        figures.update(block_figures)
    for index, result in enumerate(results.of_kind("sim")):
        blocks.append(_sim_block(index, result))
    missing = results.missing_kinds
    if missing:
        commands = "; ".join(f"{kind}: <code>{html.escape(PRODUCERS[kind])}</code>" for kind in missing)
        lead = (
            "No validation results were given."
            if not results.files
            else "Not shown (no file given):"
            if all(f.shipped for f in results.files)
            else "Not given:"
        )
        blocks.append(
            f'<p class="empty">{lead} They come from training runs and measured traces, not from the '
            f"simulator. Make them with {commands}; then pass the files with "
            "<code>ciera report --validation FILE[,FILE…]</code>.</p>"
        )
    return "".join(blocks), figures


def _summary_body(records: list[dict[str, Any]]) -> str:
    """Per model and dtype: the best system and its speedup over ZeRO-3 at each W (the best lossless one,
    and a lossy ZeRO++ beneath it when that is faster), and from which W the full CIERA pays."""
    rows = summary_rows(records, provenance_label)
    gpus = sorted({r["gpus"] for r in records})
    head = "".join(
        [
            '<th class="text">model · dtype</th>',
            *(f"<th>W = {g}</th>" for g in gpus),
            f'<th class="text">{html.escape(system_label("ciera"))} pays over ZeRO-3</th>',
        ]
    )

    def cell(row: SummaryRow, g: int) -> str:
        if g not in row.best:
            why = row.does_not_fit(g) or "not simulated"
            return f'<td class="unfit">{html.escape(why)}</td>'
        system, speedup = row.best_lossless.get(g, row.best[g])
        text = (
            f'<span style="color:{system_colour(system)};font-weight:600">{html.escape(short_label(system))}'
            f"</span> {speedup:.2f}×"
        )
        if system != "ciera" and g in row.ciera:
            text += f'<br><span class="lossy">CIERA {row.ciera[g]:.2f}×</span>'
        best_system, best_speedup = row.best[g]
        if best_system != system:
            text += (
                f'<br><span class="lossy">{html.escape(system_label(best_system))} {best_speedup:.2f}× '
                "(int8, lossy)</span>"
            )
        return f"<td>{text}</td>"

    def pays_cell(row: SummaryRow) -> str:
        text = html.escape(pays_text(row))
        lossy = lossy_speedups(row)
        if lossy:
            text += f"; ZeRO++ (lossy) is faster, {speedup_span(lossy)}"
        return f'<td class="text pays">{text}</td>'

    body = "".join(
        f'<tr><td class="text">{html.escape(row.model)} · {row.dtype}</td>'
        + "".join(cell(row, g) for g in gpus)
        + pays_cell(row)
        + "</tr>"
        for row in rows
    )
    target = 64 if 64 in gpus else gpus[-1]
    verdicts = []
    for dtype in ("bf16", "fp16"):
        at_target = [row for row in rows if row.dtype == dtype and target in row.ciera]
        if not at_target:
            continue
        values = [row.ciera[target] for row in at_target]
        paying = sum(v >= PAYS_ABOVE for v in values)
        better = [
            row.model
            for row in at_target
            if row.best_lossless.get(target, ("ciera", 0))[0] != "ciera"
            and row.best_lossless[target][1] > row.ciera[target] + 1e-3
        ]
        lossy = [found[1] for row in at_target if (found := lossy_faster(row, target)) is not None]
        over = " over ZeRO-3" if lossy else ""
        line = f"{dtype.upper()}: {system_label('ciera')} is {speedup_span(values)} ZeRO-3's speed " + (
            f"for {at_target[0].model} and {'pays' if paying else 'does not pay'}{over}"
            if len(values) == 1
            else f"across the {len(values)} models and pays{over} for {paying} of them"
        )
        if lossy:
            line += (
                f"; ZeRO++ (lossy, int8 weights) is faster for {len(lossy)} of them "
                f"({speedup_span(lossy)} ZeRO-3's speed)"
            )
        if better:
            line += f"; a simpler CIERA variant or another lossless system is faster for {', '.join(better)}"
        verdicts.append(html.escape(line) + ".")
    unfit = [(row.model, g, system, why) for row in rows for system, g, why in row.left_out]
    left_out = [
        f"{system_label(system)} ({model}, W = {g}: {why})"
        for model, g, system, why in sorted(set(unfit), key=lambda item: (item[0], item[1], item[2]))
    ]
    budget_note = (
        '<p class="caption">Left out of “fastest” and “pays from”: '
        + html.escape(
            ", ".join(left_out[:6]) + (f" and {len(left_out) - 6} more" if len(left_out) > 6 else "")
        )
        + " — a plan that does not fit one GPU's memory (the records' memory per GPU, against the preset's "
        "device memory) or, compressing every shard, the receiver cache budget "
        "(<code>ciera.cache_budget_bytes</code>) cannot run; its records carry the figures.</p>"
        if left_out
        else ""
    )
    boundaries, inter_nodes = pays_bases(rows)
    bases = [
        f"In {count} of {len(rows)} rows CIERA pays from {boundary}."
        for boundary, count in boundaries.items()
    ]
    bases += [f"Every verdict here rests on the {inter_node}." for inter_node in inter_nodes]
    basis_note = (
        f'<p class="caption">{html.escape(" ".join(bases))} How the verdicts move with that bandwidth: '
        '<a href="#sensitivity">Speedup vs link bandwidth</a>.</p>'
        if bases
        else ""
    )
    provenance = sorted({row.provenance for row in rows})
    caution = (
        "Every number here is an <b>analytic projection</b> of the simulator (traces from the analytic "
        "generator, extrapolated to these world sizes), not a measurement: check it against a measured run "
        "of your cluster (<code>ciera report --bundle measured</code>, the Validation section) before deploying."
        if provenance == ["analytic projection"]
        else f"Sources: {html.escape(', '.join(provenance))}; hollow markers and pale bars below are projections."
    )
    return (
        f'<p class="verdict"><b>At W = {target}:</b> {" ".join(verdicts)}</p>'
        f'<p class="caption">{caution}</p>'
        f'<div class="table-wide"><table class="records summary" id="summary-table"><thead><tr>{head}</tr>'
        f"</thead><tbody>{body}</tbody></table></div>"
        '<p class="caption">Each cell: the fastest <em>lossless</em> system at that W and its speedup over '
        f"ZeRO-3 (p50 iteration times); below it, {html.escape(system_label('ciera'))}'s own speedup when "
        "another system is faster, and ZeRO++ when its int8 (lossy) gathers are faster still; “does not fit” "
        "where not even ZeRO-3's step fits one GPU. CIERA is ER+BSC+CCP, ER+BSC is CIERA-ER+BSC. Pays: a "
        f"speedup of at least {PAYS_ABOVE:.2f}× over ZeRO-3 (less is within the simulation's own noise; the "
        "same threshold as <code>ciera simulate</code>'s summary). “Pays from W = n”: at n and every larger "
        "swept W where it fits.</p>" + basis_note + budget_note
    )


def _bundle_name(bundle_path: str | None) -> str:
    """The bundle as the user names it to the CLI: 'analytic (traces/data/default)' for a shipped one,
    else the path as given."""
    if not bundle_path:
        return "<code>none</code>"
    path = Path(bundle_path)
    for name, shipped in NAMED_BUNDLES.items():  # 'analytic' before its alias 'default'
        if path.exists() and shipped().exists() and path.resolve() == shipped().resolve():
            shown = shipped().resolve().relative_to(Path(traces.__file__).resolve().parent.parent)
            return f"<code>{html.escape(name)}</code> ({html.escape(str(shown))})"
    return f"<code>{html.escape(bundle_path)}</code>"


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
    validation: ValidationResults | None = None,
) -> str:
    """One self-contained HTML document (plotly.js inlined once, no network access) for these records.

    `records` follow the ciera.simulate/1 contract (validated here too, so API callers get the same
    checks as files); `timeline_events` are Chrome-trace events, complete ('X') ones are drawn.
    `sensitivity` is a link bandwidth sweep (report.sensitivity); without one the section says why
    (`sensitivity_missing`, or that none was given) and how to make one. `validation` holds what
    `ciera validate lossless/divergence/sim --json` wrote (report.validation.load_validation); the
    Validation section names the commands for whatever it lacks.
    """
    records = [validate_record(record, "<records>", index) for index, record in enumerate(records)]
    timeline_events = validate_timeline(list(timeline_events), "<timeline>")
    systems_present = [s for s in SYSTEMS if any(r["system"] == s for r in records)]
    if timeline_caption is None:
        contexts = timeline_contexts(timeline_events)
        timeline_caption = (
            (
                f"Simulated: {'; '.join(contexts)}."
                if contexts
                else "The timeline does not say which model, dtype and W it shows."
            )
            if timeline_events
            else None
        )

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
    exponent_note = ""
    if has_exponents:
        figures["fig-exponents"] = exponent_figure(bundle.exponents, bundle.runs)
        block_sizes = set(bundle.exponents["block_size"].astype(int))
        block_size = DEFAULT_BLOCK_SIZE if DEFAULT_BLOCK_SIZE in block_sizes else max(block_sizes)
        iterations, spread = iteration_spread(bundle.exponents, block_size)
        exponent_note = (
            f"q over iterations is not drawn: the bundle holds {iterations} iteration"
            f"{'s' if iterations != 1 else ''} per run and no category's q moves by more than {spread:.3f} "
            "across them, so it would be flat lines."
        )

    measured_rows = measured_run_rows(bundle) if bundle is not None else []
    if validation is not None:
        validation = validate_results(validation)
    validation_html, validation_figures = _validation_body(validation)
    figures.update(validation_figures)

    def section(anchor: str, heading: str, lede: str, body: str) -> str:
        return f'<section id="{anchor}"><h2>{heading}</h2><p class="lede">{lede}</p>{body}</section>'

    no_records = '<p class="empty">No simulation records.</p>'
    sections = [
        section(
            "summary",
            "Summary: where CIERA pays",
            "Per model and dtype, the fastest system at each world size W and its speedup over ZeRO-3, and "
            "from which W the full CIERA (ER+BSC+CCP) pays. The sections below show how each number comes "
            "about.",
            _summary_body(records) if records else no_records,
        ),
        section(
            "speedup",
            "Speedup vs GPUs",
            "Iteration-time speedup (ratio of p50 iteration times) of each system over ZeRO-3 as the world "
            "size grows, on log axes so ZeRO++ at several × and CIERA near 1× both read. Right: in FP16 "
            "views the speedup over ZeRO++ (int8 weight gathers: lossy, FP16 only); in BF16 views, where "
            "ZeRO++ does not exist, the Allgather bytes per iteration that CIERA's compression cuts (thin "
            "lines without markers: what one rank receives over the inter-node network, from the first W "
            "that spans nodes). Filled "
            "markers on solid lines are measured; hollow markers on dashed lines are projections. Each system "
            "has its own marker and dash, and the CIERA variants are drawn widest first (ER wide and pale, "
            "ER+BSC dotted, CIERA thin on top), so lines that coincide stay visible; which ones coincide, and "
            "why, is written under the plot. For CIERA (ER+BSC+CCP) the shaded band runs from what perfect "
            "overlap alone gives (dash-dot) up to the bound its own fewer bytes plus perfect overlap allow "
            "(dotted); every point's own bound (none for systems without one), bytes and the split of its "
            "speedup into bytes × overlap × other are in its hover text. The dotted line at 1 is parity. "
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
            "The simulator's attribution of one iteration's critical path (the iteration nearest the median) "
            "to compute (optimizer step included), Allgather and ReduceScatter time not hidden behind compute, "
            "codec work on the critical path, and the rest (waits between an op and what it waited for), per "
            "system. One panel per world size W, each with its own "
            "time axis, because W = 4 takes a fraction of what W = 128 takes (compare bars within a panel; "
            "the axis values across panels). The vertical tick with whiskers is the p50 iteration time and its "
            "p5–p95 band over the anchor run's iterations. ER+BSC is CIERA-ER+BSC, CIERA is ER+BSC+CCP. Paler bars are "
            "projections, full-colour bars measured. ZeRO++ is simulated in FP16 only, so BF16 views have "
            "no ZeRO++ row.",
            _plot_div("fig-breakdown") if records else no_records,
        ),
        section(
            "timeline",
            "One iteration, per stream",
            (f"<b>{html.escape(timeline_caption)}</b> " if timeline_caption else "")
            + "Gantt view of one simulated iteration per system: each row is a stream of a rank (compute, "
            "Allgather, ReduceScatter, codec sender, codec receiver); gaps are idle time. Panels share the time "
            "axis: zoom one to zoom all. The same trace opens in Perfetto (ciera simulate --timeline). It is "
            "one (model, dtype, W), not the one picked in the dropdowns above; for another, run "
            "<code>ciera simulate --models M --gpus W --dtype D --json s.json --timeline t.json</code> and "
            "<code>ciera report --records s.json --timeline t.json</code>.",
            _plot_div("fig-timeline")
            if timeline_events
            else '<p class="empty">No timeline events were given.</p>',
        ),
        section(
            "exponents",
            "Exponent churn",
            "How often exponents change between iterations, per parameter category: the fraction of values "
            "whose exponent changed, and the fraction of B-value blocks holding any change (the block change "
            "rate q that sets CIERA's payload ratio r(q) ≈ 0.5 + 1/(16B) + q·H/16 for BF16), on a log axis "
            "(a rate of exactly 0 is drawn at 10⁻⁵), in greys; and how q grows with the block size B, one "
            "colour, dash and marker per category. Categories whose q lie on each other (often attention "
            "and router) stay visible: the lower line is wider or shows through the dashes, and the upper "
            "one's legend entry says which line it lies on. The title names the model and dtype; with "
            "several, the dropdown picks one." + (f" {html.escape(exponent_note)}" if exponent_note else ""),
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
                    "(raw: what the gathers would move uncompressed; on the wire: what they moved). Gather path: "
                    "the main thread's time inside the engine's gather calls per Allgather, per rank (the "
                    "engine's host path, or CIERA's with its codec; network waits excluded; — where the capture "
                    "did not record it). These are measurements, not simulation output.",
                    _measured_runs_table(measured_rows),
                )
            ]
            if measured_rows
            else []
        ),
        section(
            "validation",
            "Validation",
            "Checks of the method itself rather than projections of its speed: that CIERA's gathers change "
            "nothing (lossless), how far other kinds of gather push a top-k MoE off its path compared with "
            "a new seed (divergence), and how well the simulator predicts measured runs it was not given. "
            "The lossless and divergence numbers are measured: real training on local CPU ranks (gloo) of "
            "the machine that ran the command shown under each; the simulator check compares its predictions "
            "with the measured bundle's runs.",
            validation_html,
        ),
        section(
            "records",
            "All records",
            "Every simulated (model, dtype, GPUs, system) point. Speedups are ratios of p50 iteration times; "
            "“own bound ×” is the most that this system's own Allgather bytes plus perfect overlap could give "
            "(“—” where the record states none), “overlap-only ×” what perfect overlap gives without "
            "compression; “source” says whether the point is measured or a projection (and from which traces).",
            _records_table(records) if records else no_records,
        ),
    ]

    meta_items = []
    if cluster:
        meta_items.append(f"cluster <code>{html.escape(cluster)}</code>")
    meta_items.append(f"trace bundle {_bundle_name(bundle_path)}")
    models = list(dict.fromkeys(r["model"] for r in records))
    gpus = sorted({r["gpus"] for r in records})
    if records:
        plural = "s" if len(models) != 1 else ""
        meta_items.append(f"{len(models)} model{plural}, W ∈ {{{', '.join(map(str, gpus))}}}")
    nav = "".join(
        f'<a href="#{anchor}">{name}</a>'
        for anchor, name in (
            ("summary", "Summary"),
            ("speedup", "Speedup"),
            ("sensitivity", "Bandwidth"),
            ("breakdown", "Breakdown"),
            ("timeline", "Timeline"),
            ("exponents", "Exponent churn"),
            *([("measured", "Measured runs")] if measured_rows else []),
            ("validation", "Validation"),
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
