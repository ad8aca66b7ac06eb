"""Plotly figure specifications (plain dicts: data, layout) for each section of the report.

Figures are built as plain JSON-ready dicts rather than `plotly.graph_objects`: constructing hundreds of
validated trace objects costs seconds, and the figures are only ever serialised. The tests pass every
figure through `plotly.graph_objects.Figure` once to catch invalid properties.

Per-model views use one figure with a dropdown (`updatemenus`) that toggles trace visibility, rather than
a figure per model, to keep the page light.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from .inputs import BREAKDOWN_KEYS, SYSTEMS, is_measured_point, provenance_label

if TYPE_CHECKING:  # sensitivity imports this module for system labels
    from .sensitivity import SweepView

Figure = dict[str, Any]

# One colour per system, used by every plot so a system reads the same everywhere.
SYSTEM_COLOURS = {
    "zero3": "#7f7f7f",
    "fsdp": "#9467bd",
    "zeropp": "#8c564b",
    "ciera-er": "#17becf",
    "ciera-er-bsc": "#1f77b4",
    "ciera": "#d62728",
}
SYSTEM_LABELS = {
    "zero3": "ZeRO-3",
    "fsdp": "FSDP",
    "zeropp": "ZeRO++",
    "ciera-er": "CIERA-ER",
    "ciera-er-bsc": "CIERA-ER+BSC",
    "ciera": "CIERA (ER+BSC+CCP)",
}
BREAKDOWN_LABELS = {
    "compute": "compute",
    "exposed_allgather": "exposed Allgather",
    "exposed_reduce_scatter": "exposed ReduceScatter",
    "codec_critical": "codec on critical path",
    "other": "other",
}
BREAKDOWN_COLOURS = {
    "compute": "#4c78a8",
    "exposed_allgather": "#f58518",
    "exposed_reduce_scatter": "#b279a2",
    "codec_critical": "#54a24b",
    "other": "#bab0ac",
}
CATEGORY_COLOURS = {
    "expert_ffn": "#4c78a8",
    "attention": "#f58518",
    "router": "#e45756",
    "norm": "#72b7b2",
    "embedding": "#54a24b",
}
STREAM_ORDER = ("compute", "allgather", "reduce_scatter", "codec_send", "codec_recv")

ANALYTIC_BAR_OPACITY = 0.6
DEFAULT_BLOCK_SIZE = 512  # DESIGN.md's B, shown when the bundle has it
ALWAYS_VISIBLE = -1  # owner of traces shown in every dropdown view

FONT = {
    "family": "Inter, system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif",
    "size": 13,
    "color": "#1f2933",
}
GRID_COLOUR = "#e5e7eb"


def system_label(system: str) -> str:
    return SYSTEM_LABELS.get(system, system)


def system_colour(system: str) -> str:
    return SYSTEM_COLOURS.get(system, "#333333")


def _ordered_systems(systems: Iterable[str]) -> list[str]:
    present = set(systems)
    return [s for s in SYSTEMS if s in present] + sorted(present - set(SYSTEMS))


def _base_layout(height_px: int) -> dict[str, Any]:
    return {
        "height": height_px,
        "font": FONT,
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "margin": {"l": 70, "r": 30, "t": 110, "b": 60},
        "hoverlabel": {"font": {"family": FONT["family"], "size": 12}},
        "legend": {"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0, "font": {"size": 12}},
    }


def _axis(title: str, **extra: Any) -> dict[str, Any]:
    axis = {
        "title": {"text": title},
        "gridcolor": GRID_COLOUR,
        "zerolinecolor": GRID_COLOUR,
        "linecolor": "#9ca3af",
        "showline": True,
        "ticks": "outside",
    }
    axis.update(extra)
    return axis


def _dropdown(
    labels: Sequence[str], visibility: Sequence[list[bool]], layouts: Sequence[dict[str, Any]]
) -> dict:
    """A dropdown whose entry i shows the traces flagged in visibility[i] and applies layouts[i]."""
    buttons = [
        {"label": label, "method": "update", "args": [{"visible": visible}, layout]}
        for label, visible, layout in zip(labels, visibility, layouts, strict=True)
    ]
    return {
        "type": "dropdown",
        "buttons": buttons,
        "active": 0,
        "x": 0,
        "xanchor": "left",
        "y": 1.22,
        "yanchor": "top",
        "bgcolor": "white",
        "bordercolor": "#9ca3af",
        "font": {"size": 12},
        "showactive": True,
    }


def _view_menus(
    data: list[dict[str, Any]],
    owners: Sequence[int],
    views: Sequence[tuple[str, str]],
    view_layouts: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Show view 0 (and the always-visible traces) at load; return the dropdown that switches views,
    none when there is only one."""
    for trace, owner in zip(data, owners, strict=True):
        trace["visible"] = owner in (0, ALWAYS_VISIBLE)
    if len(views) < 2:
        return []
    visibility = [[owner in (view, ALWAYS_VISIBLE) for owner in owners] for view in range(len(views))]
    return [_dropdown([f"{m} · {d}" for m, d in views], visibility, view_layouts)]


def _views(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(model, dtype) pairs in a stable order: models as they first appear, bf16 before fp16."""
    models = list(dict.fromkeys(r["model"] for r in records))
    dtypes_by_model: dict[str, set[str]] = defaultdict(set)
    for record in records:
        dtypes_by_model[record["model"]].add(record["dtype"])
    return [(m, d) for m in models for d in ("bf16", "fp16") if d in dtypes_by_model[m]]


def _gpu_ticks(gpus: Iterable[int]) -> dict[str, Any]:
    """A log axis ticked at the given powers of two (world sizes, block sizes); an explicit range, so an
    empty panel stays sane."""
    values = sorted(set(gpus))
    padding = 0.12  # in decades
    return {
        "type": "log",
        "tickvals": values,
        "ticktext": [str(v) for v in values],
        "range": [math.log10(values[0]) - padding, math.log10(values[-1]) + padding],
        "autorange": False,
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


# --------------------------------------------------------------------------------------------- speedup


def _speedup_traces(
    records: list[dict[str, Any]],
    speedup_field: str,
    axis_suffix: str,
    baseline_label: str,
    show_legend: bool,
) -> list[dict[str, Any]]:
    """One dashed, hollow-marker line per system over all its points, and a solid, filled overlay of the
    measured points, so analytic projections never look like measurements."""
    traces: list[dict[str, Any]] = []
    by_system: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get(speedup_field) is not None:
            by_system[record["system"]].append(record)
    for system in _ordered_systems(by_system):
        points = sorted(by_system[system], key=lambda r: r["gpus"])
        colour = system_colour(system)
        custom = [
            [
                provenance_label(r),
                r["iteration_s"]["p50"],
                r["iteration_s"]["p5"],
                r["iteration_s"]["p95"],
                _fmt(r.get("bound_speedup")),
                _speedup_parts_text(r) if speedup_field == "speedup_vs_zero3" else "",
            ]
            for r in points
        ]
        hover = (
            f"<b>{system_label(system)}</b> · %{{x}} GPUs<br>speedup vs {baseline_label}: <b>%{{y:.3f}}×</b><br>"
            "iteration p50 %{customdata[1]:.4g} s (p5–p95 %{customdata[2]:.4g}–%{customdata[3]:.4g} s)<br>"
            "bound (bytes + perfect overlap): %{customdata[4]}×%{customdata[5]}<br>"
            "source: %{customdata[0]}<extra></extra>"
        )
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": system_label(system),
                "legendgroup": system,
                "showlegend": show_legend,
                "x": [r["gpus"] for r in points],
                "y": [r[speedup_field] for r in points],
                "line": {"color": colour, "width": 2, "dash": "dash"},
                "marker": {
                    "color": colour,
                    "size": 9,
                    "symbol": ["circle" if is_measured_point(r) else "circle-open" for r in points],
                    "line": {"width": 2, "color": colour},
                },
                "customdata": custom,
                "hovertemplate": hover,
                "xaxis": f"x{axis_suffix}",
                "yaxis": f"y{axis_suffix}",
            }
        )
        measured = [(r, c) for r, c in zip(points, custom, strict=True) if is_measured_point(r)]
        if measured:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": f"{system_label(system)} (measured)",
                    "legendgroup": system,
                    "showlegend": False,
                    "x": [r["gpus"] for r, _ in measured],
                    "y": [r[speedup_field] for r, _ in measured],
                    "line": {"color": colour, "width": 3, "dash": "solid"},
                    "marker": {"color": colour, "size": 11, "symbol": "circle"},
                    "customdata": [c for _, c in measured],
                    "hovertemplate": hover,
                    "xaxis": f"x{axis_suffix}",
                    "yaxis": f"y{axis_suffix}",
                }
            )
    return traces


def _speedup_parts_text(record: dict[str, Any]) -> str:
    """The simulator's multiplicative split of the speedup (bytes × overlap × other), when it gives one."""
    parts = record.get("speedup_parts")
    if not isinstance(parts, dict) or not all(
        isinstance(parts.get(k), int | float) for k in ("bytes", "overlap", "other")
    ):
        return ""
    return f"<br>split: bytes {parts['bytes']:.3f}× · overlap {parts['overlap']:.3f}× · other {parts['other']:.3f}×"


def _bound_traces(records: list[dict[str, Any]], show_legend: bool) -> list[dict[str, Any]]:
    """The band between what perfect overlap alone gives and what fewer bytes plus perfect overlap can
    give (DESIGN.md bounds), drawn for the full CIERA system; its top edge is the dotted bound line."""
    candidates = [r for r in records if r["system"] == "ciera" and r.get("bound_speedup") is not None]
    if not candidates:
        candidates = [
            r for r in records if r["system"].startswith("ciera") and r.get("bound_speedup") is not None
        ]
    best_by_gpus: dict[int, dict[str, Any]] = {}
    for record in candidates:
        held = best_by_gpus.get(record["gpus"])
        if held is None or record["bound_speedup"] > held["bound_speedup"]:
            best_by_gpus[record["gpus"]] = record
    if not best_by_gpus:
        return []
    points = [best_by_gpus[g] for g in sorted(best_by_gpus)]
    gpus = [r["gpus"] for r in points]
    bound = [r["bound_speedup"] for r in points]
    overlap_only = [
        r["overlap_only_speedup"] if r.get("overlap_only_speedup") is not None else r["bound_speedup"]
        for r in points
    ]
    colour = system_colour("ciera")
    return [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "perfect overlap, no compression",
            "legendgroup": "bound",
            "showlegend": show_legend,
            "x": gpus,
            "y": overlap_only,
            "line": {"color": "#9ca3af", "width": 1.5, "dash": "dashdot"},
            "hovertemplate": "%{x} GPUs · overlap-only speedup %{y:.3f}×<extra></extra>",
            "xaxis": "x",
            "yaxis": "y",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "bound: fewer bytes + perfect overlap",
            "legendgroup": "bound",
            "showlegend": show_legend,
            "x": gpus,
            "y": bound,
            "fill": "tonexty",
            "fillcolor": "rgba(214, 39, 40, 0.08)",
            "line": {"color": colour, "width": 1.5, "dash": "dot"},
            "hovertemplate": "%{x} GPUs · bound speedup %{y:.3f}×<extra></extra>",
            "xaxis": "x",
            "yaxis": "y",
        },
    ]


def speedup_figure(records: list[dict[str, Any]]) -> Figure:
    """Speedup vs GPUs: left panel against ZeRO-3, right panel against ZeRO++ (FP16 only); a dropdown
    picks the model and dtype."""
    views = _views(records)
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    for view_index, (model, dtype) in enumerate(views):
        selected = [r for r in records if r["model"] == model and r["dtype"] == dtype]
        view_traces = _bound_traces(selected, show_legend=True)
        view_traces += _speedup_traces(
            [r for r in selected if r["system"] != "zero3"],
            "speedup_vs_zero3",
            "",
            "ZeRO-3",
            show_legend=True,
        )
        has_zeropp = any(r.get("speedup_vs_zeropp") is not None for r in selected)
        view_traces += _speedup_traces(
            [r for r in selected if r["system"] != "zeropp"],
            "speedup_vs_zeropp",
            "2",
            "ZeRO++",
            show_legend=False,
        )
        data += view_traces
        owners += [view_index] * len(view_traces)
        annotations = [
            _panel_title("vs ZeRO-3", "x domain", "y domain"),
            _panel_title("vs ZeRO++ (int8 weights, FP16 only)", "x2 domain", "y2 domain"),
        ]
        if not has_zeropp:
            annotations.append(
                {
                    "text": "ZeRO++ is modelled for FP16 only;<br>pick an fp16 view to compare against it.",
                    "xref": "x2 domain",
                    "yref": "y2 domain",
                    "x": 0.5,
                    "y": 0.5,
                    "showarrow": False,
                    "font": {"size": 13, "color": "#6b7280"},
                }
            )
        labels = {provenance_label(r) for r in selected}
        provenance = labels.pop() if len(labels) == 1 else "measured and projected points"
        view_layouts.append(
            {
                "annotations": annotations,
                "title": {"text": f"<b>{model}</b> · {dtype.upper()} · {provenance}", "x": 0.5, "y": 0.98},
            }
        )
    all_gpus = [r["gpus"] for r in records]
    parity_traces = [_parity_trace(all_gpus, ""), _parity_trace(all_gpus, "2")]
    data += parity_traces
    owners += [ALWAYS_VISIBLE] * len(parity_traces)
    menus = _view_menus(data, owners, views, view_layouts)
    layout = _base_layout(600)
    layout["margin"] = {"l": 70, "r": 30, "t": 110, "b": 120}
    layout.update(view_layouts[0] if view_layouts else {})
    layout.update(
        {
            "xaxis": _axis("GPUs (world size W, log₂ scale)", domain=[0, 0.47], **_gpu_ticks(all_gpus)),
            "yaxis": _axis("speedup (× ZeRO-3 iteration time)", rangemode="tozero"),
            "xaxis2": _axis(
                "GPUs (world size W, log₂ scale)", domain=[0.55, 1], anchor="y2", **_gpu_ticks(all_gpus)
            ),
            "yaxis2": _axis("speedup (× ZeRO++ iteration time)", anchor="x2"),
            "updatemenus": menus,
            "hovermode": "closest",
        }
    )
    return {"data": data, "layout": layout}


def _panel_title(text: str, xref: str, yref: str) -> dict[str, Any]:
    return {
        "text": f"<b>{text}</b>",
        "xref": xref,
        "yref": yref,
        "x": 0.5,
        "y": 1.02,
        "xanchor": "center",
        "yanchor": "bottom",
        "showarrow": False,
        "font": {"size": 14},
    }


def _parity_trace(gpus: Sequence[int], axis_suffix: str) -> dict[str, Any]:
    """Speedup 1: no better than the baseline. A trace rather than a shape, and always visible: plotly.js
    draws broken (NaN) axis lines for a subplot without any visible trace, e.g. ZeRO++ in a BF16 view."""
    return {
        "type": "scatter",
        "mode": "lines",
        "name": "parity (speedup 1)",
        "showlegend": False,
        "x": [min(gpus), max(gpus)],
        "y": [1, 1],
        "line": {"color": "#6b7280", "width": 1, "dash": "dot"},
        "hoverinfo": "skip",
        "xaxis": f"x{axis_suffix}",
        "yaxis": f"y{axis_suffix}",
    }


# ------------------------------------------------------------------------------------------- breakdown


def breakdown_figure(records: list[dict[str, Any]]) -> Figure:
    """Stacked iteration-time breakdown per system, grouped by W, with the p50 and p5–p95 band on top;
    a dropdown picks the model and dtype."""
    views = _views(records)
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    for view_index, (model, dtype) in enumerate(views):
        selected = [r for r in records if r["model"] == model and r["dtype"] == dtype]
        system_rank = {s: i for i, s in enumerate(_ordered_systems(r["system"] for r in selected))}
        selected.sort(key=lambda r: (r["gpus"], system_rank[r["system"]]))
        categories = [[f"W={r['gpus']}" for r in selected], [system_label(r["system"]) for r in selected]]
        sources = [provenance_label(r) for r in selected]
        for key in BREAKDOWN_KEYS:
            data.append(
                {
                    "type": "bar",
                    "name": BREAKDOWN_LABELS[key],
                    "legendgroup": key,
                    "x": categories,
                    "y": [r["breakdown_s"][key] for r in selected],
                    # Projected bars are paler: model output, not a measurement. (Not hatched: plotly's
                    # pattern fills did not draw in headless Chromium.)
                    "marker": {
                        "color": BREAKDOWN_COLOURS[key],
                        "opacity": [1.0 if is_measured_point(r) else ANALYTIC_BAR_OPACITY for r in selected],
                        "line": {"width": 0},
                    },
                    "customdata": sources,
                    "hovertemplate": (
                        f"%{{x}}<br>{BREAKDOWN_LABELS[key]}: <b>%{{y:.4g}} s</b><br>source: %{{customdata}}"
                        "<extra></extra>"
                    ),
                }
            )
            owners.append(view_index)
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "iteration p50 (bar: p5–p95)",
                "legendgroup": "iteration",
                "x": categories,
                "y": [r["iteration_s"]["p50"] for r in selected],
                "error_y": {
                    "type": "data",
                    "symmetric": False,
                    "array": [r["iteration_s"]["p95"] - r["iteration_s"]["p50"] for r in selected],
                    "arrayminus": [r["iteration_s"]["p50"] - r["iteration_s"]["p5"] for r in selected],
                    "color": "#111827",
                    "thickness": 1.2,
                    "width": 3,
                },
                "marker": {
                    "symbol": "line-ew-open",
                    "size": 10,
                    "color": [system_colour(r["system"]) for r in selected],
                    "line": {"width": 3},
                },
                "customdata": [
                    [r["iteration_s"]["p5"], r["iteration_s"]["p95"], provenance_label(r)] for r in selected
                ],
                "hovertemplate": (
                    "%{x}<br>iteration p50 <b>%{y:.4g} s</b><br>p5–p95 %{customdata[0]:.4g}–%{customdata[1]:.4g} s"
                    "<br>source: %{customdata[2]}<extra></extra>"
                ),
            }
        )
        owners.append(view_index)
        view_layouts.append({"title": {"text": f"<b>{model}</b> · {dtype.upper()}", "x": 0.5, "y": 0.98}})
    menus = _view_menus(data, owners, views, view_layouts)
    layout = _base_layout(560)
    layout.update(view_layouts[0] if view_layouts else {})
    layout.update(
        {
            "barmode": "stack",
            "bargap": 0.25,
            "xaxis": _axis("world size W · system", tickangle=-50, tickfont={"size": 10}),
            "yaxis": _axis("time per iteration (s)", rangemode="tozero"),
            "margin": {"l": 70, "r": 30, "t": 130, "b": 170},
            "legend": {
                "orientation": "h",
                "y": 1.02,
                "yanchor": "bottom",
                "x": 1,
                "xanchor": "right",
                "font": {"size": 12},
            },
            "updatemenus": menus,
            "hovermode": "closest",
        }
    )
    return {"data": data, "layout": layout}


# -------------------------------------------------------------------------------------------- timeline


def timeline_figure(timeline_events: list[dict[str, Any]]) -> Figure:
    """Gantt view of one simulated iteration per system: a panel per system, a row per stream."""
    events_by_system: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in timeline_events:
        events_by_system[event["pid"]].append(event)
    systems = _ordered_systems(events_by_system)
    panel_count = max(len(systems), 1)
    gap = 0.05
    panel_height = (1 - gap * (panel_count - 1)) / panel_count
    # Seconds for long iterations (tens of seconds at scale), milliseconds otherwise.
    longest_us = max(
        (
            max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
            for events in events_by_system.values()
        ),
        default=0.0,
    )
    us_per_unit, unit = (1e6, "s") if longest_us >= 2e6 else (1e3, "ms")
    data: list[dict[str, Any]] = []
    layout = _base_layout(170 * panel_count + 120)
    layout["margin"] = {"l": 120, "r": 30, "t": 60, "b": 60}
    annotations = []
    for index, system in enumerate(systems):
        events = events_by_system[system]
        origin_us = min(e["ts"] for e in events)
        iteration_units = (max(e["ts"] + e["dur"] for e in events) - origin_us) / us_per_unit
        streams = [s for s in STREAM_ORDER if any(e["tid"] == s for e in events)]
        streams += sorted({e["tid"] for e in events} - set(STREAM_ORDER))
        suffix = "" if index == 0 else str(index + 1)
        top = 1 - index * (panel_height + gap)
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": system_label(system),
                "showlegend": False,
                "y": [e["tid"] for e in events],
                "base": [(e["ts"] - origin_us) / us_per_unit for e in events],
                "x": [e["dur"] / us_per_unit for e in events],
                "marker": {"color": system_colour(system), "line": {"width": 0}},
                "width": 0.7,
                "customdata": [[e.get("name", ""), (e["ts"] - origin_us) / us_per_unit] for e in events],
                "hovertemplate": (
                    f"<b>{system_label(system)}</b> · %{{y}}<br>%{{customdata[0]}}<br>"
                    f"start %{{customdata[1]:.4g}} {unit} · duration %{{x:.4g}} {unit}<extra></extra>"
                ),
                "xaxis": f"x{suffix}",
                "yaxis": f"y{suffix}",
            }
        )
        # Panels share one time axis (zoom one, zoom all); each keeps its own tick labels.
        shared_time_axis = {"matches": "x"} if index else {}
        layout[f"xaxis{suffix}"] = _axis(
            f"time within the iteration ({unit})" if index == panel_count - 1 else "",
            anchor=f"y{suffix}",
            rangemode="tozero",
            **shared_time_axis,
        )
        layout[f"yaxis{suffix}"] = _axis(
            "",
            domain=[max(top - panel_height, 0), top],
            anchor=f"x{suffix}",
            type="category",
            categoryorder="array",
            categoryarray=list(reversed(streams)),
            showgrid=False,
        )
        annotations.append(
            {
                "text": f"<b>{system_label(system)}</b> · one iteration: {iteration_units:.4g} {unit}",
                "xref": "paper",
                "yref": "paper",
                "x": 0,
                "y": top,
                "xanchor": "left",
                "yanchor": "bottom",
                "showarrow": False,
                "font": {"size": 13, "color": system_colour(system)},
            }
        )
    layout["annotations"] = annotations
    layout["barmode"] = "overlay"
    layout["hovermode"] = "closest"
    return {"data": data, "layout": layout}


# ------------------------------------------------------------------------------------------- exponents


def _weighted_rate_lines(
    rows: pd.DataFrame,
    categories: list[str],
    x_column: str,
    x_hover: str,
    axis: str,
    marker_size: int,
    showlegend: bool = True,
) -> list[dict[str, Any]]:
    """One line per category: block change rate weighted by parameter count, against `x_column`."""
    weighted = rows.assign(weighted_rate=rows["block_change_rate"] * rows["numel"])
    grouped = weighted.groupby(["category", x_column])[["weighted_rate", "numel"]].sum().reset_index()
    grouped["block_change_rate"] = grouped["weighted_rate"] / grouped["numel"].clip(lower=1)
    lines = []
    for category in categories:
        series = grouped[grouped["category"] == category].sort_values(x_column)
        lines.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": category,
                "legendgroup": category,
                "showlegend": showlegend,
                "x": series[x_column].tolist(),
                "y": series["block_change_rate"].tolist(),
                "line": {"color": CATEGORY_COLOURS.get(category, "#333333"), "width": 2},
                "marker": {"size": marker_size},
                "hovertemplate": f"{category} · {x_hover}<br>block change rate %{{y:.4f}}<extra></extra>",
                "xaxis": f"x{axis}",
                "yaxis": f"y{axis}",
            }
        )
    return lines


def exponent_figure(exponents: pd.DataFrame, runs: pd.DataFrame) -> Figure:
    """Per-category distribution of exponent and block change rates (box from precomputed quartiles, so
    the page stays small however many shards the bundle has) and the numel-weighted block change rate over
    iterations at the default block size B (or the bundle's most common one), and how q grows with B."""
    block_sizes = set(exponents["block_size"].astype(int))
    block_size = (
        DEFAULT_BLOCK_SIZE
        if DEFAULT_BLOCK_SIZE in block_sizes
        else int(exponents["block_size"].mode().iloc[0])
    )
    all_rows = exponents.merge(runs[["run_id", "model", "dtype", "source"]], on="run_id", how="left")
    rows = all_rows[all_rows["block_size"] == block_size]
    categories = [c for c in CATEGORY_COLOURS if c in set(rows["category"])]
    categories += sorted(set(rows["category"]) - set(CATEGORY_COLOURS))
    data: list[dict[str, Any]] = []
    for rate_column, label, offset_group in (
        ("exp_change_rate", "values with a changed exponent", "exp"),
        ("block_change_rate", f"B={block_size} blocks with a change", "block"),
    ):
        quantiles = (
            rows.groupby("category")[rate_column].quantile([0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0]).unstack()
        )
        means = rows.groupby("category")[rate_column].mean()
        present = [c for c in categories if c in quantiles.index]
        data.append(
            {
                "type": "box",
                "name": label,
                "offsetgroup": offset_group,
                "x": present,
                "q1": [float(quantiles.loc[c, 0.25]) for c in present],
                "median": [float(quantiles.loc[c, 0.5]) for c in present],
                "q3": [float(quantiles.loc[c, 0.75]) for c in present],
                "lowerfence": [float(quantiles.loc[c, 0.05]) for c in present],
                "upperfence": [float(quantiles.loc[c, 0.95]) for c in present],
                "mean": [float(means.loc[c]) for c in present],
                "marker": {"color": "#4c78a8" if offset_group == "exp" else "#f58518"},
                "hoverinfo": "x+y",
                "xaxis": "x",
                "yaxis": "y",
            }
        )
    data += _weighted_rate_lines(rows, categories, "iteration", "iteration %{x}", "2", marker_size=5)
    data += _weighted_rate_lines(
        all_rows, categories, "block_size", "B=%{x}", "3", marker_size=6, showlegend=False
    )
    sources = sorted(set(rows["source"].dropna()))
    provenance = (
        " + ".join("analytic traces" if s == "analytic" else f"{s} traces" for s in sources)
        or "unknown source"
    )
    layout = _base_layout(520)
    layout.update(
        {
            "title": {
                "text": f"Exponent churn, block size B={block_size} · {provenance}",
                "x": 0.5,
                "y": 0.97,
            },
            "boxmode": "group",
            "xaxis": _axis("parameter category", domain=[0, 0.38]),
            "yaxis": _axis("change rate between iterations (fraction)", rangemode="tozero"),
            "xaxis2": _axis("iteration", domain=[0.46, 0.71], anchor="y2", dtick=1),
            "yaxis2": _axis(f"block change rate q at B={block_size}", anchor="x2", rangemode="tozero"),
            "xaxis3": _axis(
                "block size B (values, log₂ scale)", domain=[0.79, 1], anchor="y3", **_gpu_ticks(block_sizes)
            ),
            "yaxis3": _axis("block change rate q", anchor="x3", rangemode="tozero"),
            "annotations": [
                _panel_title("per category (box p25–p75, whiskers p5–p95)", "x domain", "y domain"),
                _panel_title("q over iterations (numel-weighted)", "x2 domain", "y2 domain"),
                _panel_title("q vs block size", "x3 domain", "y3 domain"),
            ],
            "margin": {"l": 70, "r": 30, "t": 90, "b": 110},
            "legend": {"orientation": "h", "y": -0.28, "x": 0, "font": {"size": 12}},
        }
    )
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------------- bandwidth sensitivity


def _bandwidth_ticks(bandwidths_Bps: Iterable[float]) -> dict[str, Any]:
    """A log axis in GB/s ticked at the swept bandwidths."""
    values_GBps = sorted({b / 1e9 for b in bandwidths_Bps})
    padding = 0.08  # in decades
    return {
        "type": "log",
        "tickvals": values_GBps,
        "ticktext": [f"{v:.3g}" for v in values_GBps],
        "range": [math.log10(values_GBps[0]) - padding, math.log10(values_GBps[-1]) + padding],
        "autorange": False,
    }


def sensitivity_figure(
    views: Sequence[SweepView],
    axis_title: str,
    tick_Bps: Sequence[float],
    reference_Bps: float | None = None,
    reference_label: str = "",
) -> Figure:
    """Speedup vs ZeRO-3 against link bandwidth, one line per system, for each (model, dtype) view of
    `report.sensitivity.SweepView`s (a dropdown picks the view); the 1.0 "no gain" line and, when known,
    the cluster's own bandwidth as a vertical marker (named in the legend, not ticked: its label would
    collide with a neighbouring swept value's). The x axis is ticked at `tick_Bps`. Every point is a simulated projection (the bandwidth
    is set, not measured), so every line is dashed with hollow markers."""
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    all_bandwidths_Bps = [b for view in views for points in view.lines.values() for b, _ in points]
    if reference_Bps is not None:
        all_bandwidths_Bps.append(reference_Bps)
    for view_index, view in enumerate(views):
        speedups = []
        for system, points in view.lines.items():
            colour = system_colour(system)
            speedups += [r["speedup_vs_zero3"] for _, r in points]
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": system_label(system),
                    "legendgroup": system,
                    "x": [b / 1e9 for b, _ in points],
                    "y": [r["speedup_vs_zero3"] for _, r in points],
                    "line": {"color": colour, "width": 2, "dash": "dash"},
                    "marker": {"color": colour, "size": 9, "symbol": "circle-open", "line": {"width": 2}},
                    "customdata": [
                        [r["iteration_s"]["p50"], r["iteration_s"]["p5"], r["iteration_s"]["p95"]]
                        for _, r in points
                    ],
                    "hovertemplate": (
                        f"<b>{system_label(system)}</b> · %{{x:.3g}} GB/s<br>"
                        "speedup vs ZeRO-3: <b>%{y:.3f}×</b><br>"
                        "iteration p50 %{customdata[0]:.4g} s (p5–p95 %{customdata[1]:.4g}–%{customdata[2]:.4g} s)"
                        f"<br>simulated projection ({view.provenance}, bandwidth set)<extra></extra>"
                    ),
                }
            )
            owners.append(view_index)
        low = min([1.0, *speedups])
        high = max([1.0, *speedups])
        if reference_Bps is not None:
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": f"this cluster's β: {reference_Bps / 1e9:.3g} GB/s",
                    "x": [reference_Bps / 1e9, reference_Bps / 1e9],
                    "y": [low - 0.02 * (high - low + 0.1), high + 0.02 * (high - low + 0.1)],
                    "line": {"color": "#111827", "width": 1.5, "dash": "dot"},
                    "hovertemplate": f"{reference_label}<extra></extra>",
                }
            )
            owners.append(view_index)
        view_layouts.append(
            {
                "title": {
                    "text": f"<b>{view.model}</b> · {view.dtype.upper()} · W={view.gpus} · simulated projection",
                    # Left, under nothing: centred, a long model name runs under the mode bar at 1024 px.
                    "xref": "paper",
                    "x": 0,
                    "xanchor": "left",
                    "y": 0.98,
                }
            }
        )
    if all_bandwidths_Bps:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": "no gain (1.0×)",
                "x": [min(all_bandwidths_Bps) / 1e9, max(all_bandwidths_Bps) / 1e9],
                "y": [1, 1],
                "line": {"color": "#6b7280", "width": 1.5},
                "hoverinfo": "skip",
            }
        )
        owners.append(ALWAYS_VISIBLE)
    menus = _view_menus(data, owners, [(v.model, f"{v.dtype} · W={v.gpus}") for v in views], view_layouts)
    layout = _base_layout(520)
    layout["margin"] = {"l": 70, "r": 30, "t": 110 if menus else 70, "b": 120}
    layout.update(view_layouts[0] if view_layouts else {})
    ticks = _bandwidth_ticks(tick_Bps or all_bandwidths_Bps) if all_bandwidths_Bps else {}
    if ticks:  # the axis spans every point, the reference included, whichever are ticked
        span_GBps = [b / 1e9 for b in all_bandwidths_Bps]
        ticks["range"] = [math.log10(min(span_GBps)) - 0.08, math.log10(max(span_GBps)) + 0.08]
    layout.update(
        {
            "xaxis": _axis(axis_title, **ticks),
            "yaxis": _axis("speedup (× ZeRO-3 iteration time)"),
            "updatemenus": menus,
            "hovermode": "closest",
        }
    )
    return {"data": data, "layout": layout}


# ------------------------------------------------------------------------------------------ divergence

# Arms of `ciera validate divergence`: label and colour. The seed arm is the yardstick, drawn as a thick
# dashed reference line; CIERA keeps the red every other plot gives it.
DIVERGENCE_ARMS = {
    "ciera": ("CIERA (lossless)", SYSTEM_COLOURS["ciera"]),
    "ulp": ("1-ULP nudge of one router weight", "#ff7f0e"),
    "int8": ("int8 weight gathers (lossy)", SYSTEM_COLOURS["zeropp"]),
    "seed": ("another seed: as different as a new seed", "#111827"),
    "reference": ("the reference run (plain engine)", "#4c78a8"),
}
ZERO_BAND_DOMAIN = (0.0, 0.1)  # the "= 0" strip under a log axis
LOG_DOMAIN = (0.2, 1.0)


def divergence_arm_label(name: str) -> str:
    return DIVERGENCE_ARMS.get(name, (name, ""))[0]


def divergence_arm_colour(name: str) -> str:
    return DIVERGENCE_ARMS.get(name, ("", "#6b7280"))[1] or "#6b7280"


def _arm_line(name: str) -> dict[str, Any]:
    if name == "seed":
        return {"color": divergence_arm_colour(name), "width": 3, "dash": "dash"}
    return {"color": divergence_arm_colour(name), "width": 2.5 if name == "ciera" else 2}


def _small_layout(height_px: int = 320) -> dict[str, Any]:
    """A figure of a grid cell: its title is the HTML above it (it wraps; an SVG title would run under the
    mode bar at narrow widths), so the top margin only holds the mode bar."""
    layout = _base_layout(height_px)
    layout.update(
        {
            "margin": {"l": 72, "r": 16, "t": 30, "b": 52},
            "showlegend": False,  # one colour key above the figures serves all of them
            "hovermode": "closest",
        }
    )
    return layout


def _log_ticks(values: Iterable[float]) -> dict[str, Any]:
    """A log axis labelled at powers of ten only, at most about six of them (minor labels such as '2'
    and '5' collide with the powers' superscripts in a short axis)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return {}
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    high = max(high, low + 1)
    step = max(1, math.ceil((high - low) / 5))
    return {
        "range": [low - 0.15, high + 0.15],
        "autorange": False,
        "tickmode": "array",
        "tickvals": [10.0**e for e in range(low, high + 1, step)],
        "ticktext": [f"10<sup>{e}</sup>" if e != 0 else "1" for e in range(low, high + 1, step)],
    }


def _step_axis(steps: Sequence[int], **extra: Any) -> dict[str, Any]:
    return _axis("training step", tickvals=list(steps), **extra)


def divergence_log_figure(
    arms: Sequence[dict[str, Any]], metric: str, axis_title: str, value_format: str
) -> Figure:
    """One line per arm over the checkpoints on a log y axis, and under it an "= 0" strip: a log axis has
    no 0, so every point that is exactly 0 (CIERA's, by design) is drawn there as a marker, never dropped.
    Negative values (KL rounding a hair below 0) are drawn in the strip too, their value in the hover."""
    data: list[dict[str, Any]] = []
    steps: list[int] = []
    for arm in arms:
        name = arm["name"]
        x = [point["step"] for point in arm["points"]]
        values = [point[metric] for point in arm["points"]]
        steps = sorted({*steps, *x})
        label = divergence_arm_label(name)
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": label,
                "legendgroup": name,
                "x": x,
                "y": [v if v > 0 else None for v in values],
                "line": _arm_line(name),
                "marker": {"color": divergence_arm_colour(name), "size": 7},
                "connectgaps": False,
                "hovertemplate": f"<b>{label}</b> · step %{{x}}<br>{axis_title}: %{{y:{value_format}}}<extra></extra>",
            }
        )
        zeros = [(s, v) for s, v in zip(x, values, strict=True) if v <= 0]
        if zeros:
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": f"{label}: = 0",
                    "legendgroup": name,
                    "x": [s if v <= 0 else None for s, v in zip(x, values, strict=True)],
                    "y": [0 if v <= 0 else None for v in values],
                    "customdata": [v for v in values],
                    "line": {**_arm_line(name), "width": 1.5},
                    "marker": {"color": divergence_arm_colour(name), "size": 9, "symbol": "diamond"},
                    "connectgaps": False,
                    "yaxis": "y2",
                    "hovertemplate": f"<b>{label}</b> · step %{{x}}<br>{axis_title}: exactly %{{customdata}}"
                    "<extra></extra>",
                }
            )
    layout = _small_layout()
    all_values = [point[metric] for arm in arms for point in arm["points"]]
    layout.update(
        {
            "xaxis": _step_axis(steps, anchor="y2"),
            "yaxis": _axis(
                axis_title, type="log", domain=list(LOG_DOMAIN), anchor="x", **_log_ticks(all_values)
            ),
            "yaxis2": _axis(
                "",
                domain=list(ZERO_BAND_DOMAIN),
                range=[-1, 1],
                tickvals=[0],
                ticktext=["= 0"],
                showgrid=False,
                zeroline=False,
                fixedrange=True,
                anchor="x",
            ),
        }
    )
    return {"data": data, "layout": layout}


def divergence_share_figure(
    arms: Sequence[dict[str, Any]],
    metric: str,
    axis_title: str,
    y_range: Sequence[float] | None = None,
    reference_line: tuple[float, str] | None = None,
) -> Figure:
    """One line per arm over the checkpoints on a linear axis in percent; null values are gaps."""
    data: list[dict[str, Any]] = []
    steps: list[int] = []
    for arm in arms:
        name = arm["name"]
        x = [point["step"] for point in arm["points"]]
        steps = sorted({*steps, *x})
        label = divergence_arm_label(name)
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": label,
                "x": x,
                "y": [point[metric] for point in arm["points"]],
                "line": _arm_line(name),
                "marker": {"color": divergence_arm_colour(name), "size": 7},
                "connectgaps": False,
                "hovertemplate": f"<b>{label}</b> · step %{{x}}<br>{axis_title}: %{{y:.4~%}}<extra></extra>",
            }
        )
    if reference_line is not None and steps:
        value, name = reference_line
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": name,
                "x": [steps[0], steps[-1]],
                "y": [value, value],
                "line": {"color": "#6b7280", "width": 1.5, "dash": "dot"},
                "hovertemplate": f"{name}<extra></extra>",
            }
        )
    layout = _small_layout()
    y_axis = _axis(axis_title, tickformat=".0%", rangemode="tozero")
    if y_range is not None:
        y_axis.update({"range": list(y_range), "autorange": False})
    layout.update({"xaxis": _step_axis(steps), "yaxis": y_axis})
    return {"data": data, "layout": layout}
