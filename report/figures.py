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

from sim import BREAKDOWN_LABELS

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
STREAM_ORDER = (
    "compute", "gather_host", "optim", "allgather", "allgather_intra", "reduce_scatter", "all_reduce",
    "codec_send", "codec_recv", "ccp_send", "ccp_recv",
)  # fmt: skip

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

# Lines that can lie on each other get their own dash pattern, marker and width, drawn widest first, so
# a line under another still shows around it or through its gaps (no two systems share a dash and width:
# ZeRO-3 and FSDP gather the same bytes). Projections keep dashed patterns, measurements are solid.
SYSTEM_STYLES: dict[str, dict[str, Any]] = {
    "zero3": {"dash": "dash", "symbol": "circle", "width": 3, "size": 9},
    "fsdp": {"dash": "longdashdot", "symbol": "triangle-up", "width": 2, "size": 10},
    "zeropp": {"dash": "dashdot", "symbol": "x", "width": 2, "size": 9},
    "ciera-er": {"dash": "longdash", "symbol": "square", "width": 7, "size": 15},
    "ciera-er-bsc": {"dash": "dot", "symbol": "diamond", "width": 4.5, "size": 12},
    "ciera": {"dash": "dash", "symbol": "circle", "width": 2, "size": 8},
}
LEGEND_TOP_PX = 62  # below the plot area: tick labels and the x axis title
LEGEND_ROW_PX = 22
NOTE_ROW_PX = 18


def system_style(system: str) -> dict[str, Any]:
    return SYSTEM_STYLES.get(system, {"dash": "dash", "symbol": "circle", "width": 2, "size": 9})


def _marker_symbol(system: str, measured: bool) -> str:
    symbol = system_style(system)["symbol"]
    return symbol if measured or symbol == "x" else f"{symbol}-open"


def _translucent(colour: str, alpha: float) -> str:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red}, {green}, {blue}, {alpha})"


def bound_text(record: dict[str, Any]) -> str:
    """A record's own bound, or why there is none: never another system's."""
    bound = record.get("bound_speedup")
    return "none stated for this system" if bound is None else f"{bound:.3f}×"


def bytes_split_text(record: dict[str, Any]) -> str:
    """Allgather bytes per iteration, and what one rank receives over each network when the record has
    the split. The two received parts do not add up to the total: the total counts every gathered tensor
    as a rank assembles it, own shard included, which is never received."""
    total = record.get("allgather_bytes_per_iter")
    intra = record.get("allgather_bytes_intra_node_per_iter")
    inter = record.get("allgather_bytes_inter_node_per_iter")
    text = "n/a" if total is None else f"{total / 1e9:.3g} GB gathered"
    if intra is not None and inter is not None:
        return f"{text} (one rank receives intra-node {intra / 1e9:.3g} GB · inter-node {inter / 1e9:.3g} GB)"
    return f"{text} (intra/inter split not in these records)"


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
    # Widest first: a thinner line drawn later stays visible on top of a wider one it coincides with.
    for system in sorted(_ordered_systems(by_system), key=lambda s: -system_style(s)["width"]):
        points = sorted(by_system[system], key=lambda r: r["gpus"])
        colour = system_colour(system)
        style = system_style(system)
        custom = [
            [
                provenance_label(r),
                r["iteration_s"]["p50"],
                r["iteration_s"]["p5"],
                r["iteration_s"]["p95"],
                bound_text(r),
                _speedup_parts_text(r) if speedup_field == "speedup_vs_zero3" else "",
                bytes_split_text(r),
            ]
            for r in points
        ]
        hover = (
            f"<b>{system_label(system)}</b> · %{{x}} GPUs<br>speedup vs {baseline_label}: <b>%{{y:.3f}}×</b><br>"
            "iteration p50 %{customdata[1]:.4g} s (p5–p95 %{customdata[2]:.4g}–%{customdata[3]:.4g} s)<br>"
            "this system's bound (bytes + perfect overlap): %{customdata[4]}%{customdata[5]}<br>"
            "Allgather per iteration: %{customdata[6]}<br>"
            "source: %{customdata[0]}<extra></extra>"
        )
        wide = style["width"] > 3  # an underlay: paler, so the line on top of it reads
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": system_label(system),
                "legendgroup": system,
                "showlegend": show_legend,
                "x": [r["gpus"] for r in points],
                "y": [r[speedup_field] for r in points],
                "line": {
                    "color": _translucent(colour, 0.55) if wide else colour,
                    "width": style["width"],
                    "dash": style["dash"],
                },
                "marker": {
                    "color": colour,
                    "size": style["size"],
                    "symbol": [_marker_symbol(system, is_measured_point(r)) for r in points],
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
                    "marker": {"color": colour, "size": 11, "symbol": system_style(system)["symbol"]},
                    "customdata": [c for _, c in measured],
                    "hovertemplate": hover,
                    "xaxis": f"x{axis_suffix}",
                    "yaxis": f"y{axis_suffix}",
                }
            )
    return traces


def _bytes_traces(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Allgather GB per iteration per system on the right panel (BF16 views: there is no ZeRO++ to
    compare with); where the records split intra/inter-node, what one rank receives over the inter-node
    network as a thin line without markers."""
    traces: list[dict[str, Any]] = []
    by_system: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("allgather_bytes_per_iter") is not None:
            by_system[record["system"]].append(record)
    for system in sorted(_ordered_systems(by_system), key=lambda s: -system_style(s)["width"]):
        points = sorted(by_system[system], key=lambda r: r["gpus"])
        colour = system_colour(system)
        style = system_style(system)
        wide = style["width"] > 3
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": f"{system_label(system)}: Allgather GB",
                "legendgroup": system,
                "showlegend": False,
                "x": [r["gpus"] for r in points],
                "y": [r["allgather_bytes_per_iter"] / 1e9 for r in points],
                "line": {
                    "color": _translucent(colour, 0.55) if wide else colour,
                    "width": style["width"],
                    "dash": style["dash"],
                },
                "marker": {
                    "color": colour,
                    "size": style["size"],
                    "symbol": [_marker_symbol(system, is_measured_point(r)) for r in points],
                    "line": {"width": 2, "color": colour},
                },
                "customdata": [[bytes_split_text(r), provenance_label(r)] for r in points],
                "hovertemplate": f"<b>{system_label(system)}</b> · %{{x}} GPUs<br>Allgather per iteration: "
                "%{customdata[0]}<br>source: %{customdata[1]}<extra></extra>",
                "xaxis": "x2",
                "yaxis": "y2",
            }
        )
        inter = [r for r in points if r.get("allgather_bytes_inter_node_per_iter") is not None]
        if inter:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": f"{system_label(system)}: inter-node GB",
                    "legendgroup": system,
                    "showlegend": False,
                    "x": [r["gpus"] for r in inter],
                    # Nothing crosses nodes while W fits in one: a gap, not a dive to a log axis's floor.
                    "y": [r["allgather_bytes_inter_node_per_iter"] / 1e9 or None for r in inter],
                    # Thin and without markers, in the system's own dash: systems that send the same
                    # inter-node bytes (ZeRO-3 and FSDP) still show through each other's gaps.
                    "line": {"color": colour, "width": 1.2, "dash": style["dash"]},
                    "customdata": [bytes_split_text(r) for r in inter],
                    "hovertemplate": f"<b>{system_label(system)}</b> · %{{x}} GPUs<br>one rank receives "
                    "over the inter-node network; all: %{customdata}<extra></extra>",
                    "xaxis": "x2",
                    "yaxis": "y2",
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
    give (DESIGN.md bounds), from the full CIERA system's own records (the most compressing variant
    present when the full system is absent); none when those records state no bound."""
    owner = next(
        (
            s
            for s in ("ciera", "ciera-er-bsc", "ciera-er")
            if any(r["system"] == s and r.get("bound_speedup") is not None for r in records)
        ),
        None,
    )
    if owner is None:
        return []
    points = sorted(
        (r for r in records if r["system"] == owner and r.get("bound_speedup") is not None),
        key=lambda r: r["gpus"],
    )
    gpus = [r["gpus"] for r in points]
    bound = [r["bound_speedup"] for r in points]
    overlap_only = [
        r["overlap_only_speedup"] if r.get("overlap_only_speedup") is not None else r["bound_speedup"]
        for r in points
    ]
    colour = system_colour(owner)
    label = system_label(owner)
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
            "name": f"{SHORT_LABELS.get(owner, label)} bound: its bytes + perfect overlap",
            "legendgroup": "bound",
            "showlegend": show_legend,
            "x": gpus,
            "y": bound,
            "fill": "tonexty",
            "fillcolor": "rgba(214, 39, 40, 0.08)",
            "line": {"color": colour, "width": 1.5, "dash": "dot"},
            "hovertemplate": f"%{{x}} GPUs · {label} bound %{{y:.3f}}×<extra></extra>",
            "xaxis": "x",
            "yaxis": "y",
        },
    ]


# Log-axis tick mantissas: fine steps when the values span less than a factor of 3, coarse otherwise.
FINE_MANTISSAS = (1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)
COARSE_MANTISSAS = (1, 1.5, 2, 3, 5, 7)
MIN_LOG_TICKS = 3


def log_axis_ticks(values: Iterable[float], suffix: str = "×") -> dict[str, Any]:
    """A log axis spanning `values` (and 1 when `suffix` is '×') with readable round ticks."""
    positive = [v for v in values if v is not None and v > 0]
    if suffix == "×":
        positive.append(1.0)
    if not positive:
        return {"type": "log"}
    low, high = min(positive), max(positive)
    padding = 0.04 + 0.04 * (math.log10(high) - math.log10(low))
    mantissas = FINE_MANTISSAS if high / low < 3 else COARSE_MANTISSAS
    while True:
        span = [math.log10(low) - padding, math.log10(high) + padding]
        decades = range(math.floor(span[0]), math.ceil(span[1]) + 1)
        inside = [
            t
            for t in sorted({float(f"{m * 10.0**e:.6g}") for e in decades for m in mantissas})
            if span[0] <= math.log10(t) <= span[1]
        ]
        if high / low > 1000:  # many decades: powers of ten only
            inside = [t for t in inside if math.log10(t).is_integer()]
        # A flat view (every speedup 1.00×) would get one tick and no sense of scale: widen until 3 show.
        if len(inside) >= MIN_LOG_TICKS:
            break
        padding += 0.02
    return {
        "type": "log",
        "range": span,
        "autorange": False,
        "tickvals": inside,
        "ticktext": [f"{t:g}{suffix}" for t in inside],
    }


def _layout_updates(prefix: str, axis: dict[str, Any]) -> dict[str, Any]:
    """Axis properties as relayout keys ('yaxis.range'), for a dropdown entry that changes them."""
    return {f"{prefix}.{key}": value for key, value in axis.items()}


def speedup_figure(records: list[dict[str, Any]]) -> Figure:
    """Speedup vs GPUs on log axes: left against ZeRO-3; right against ZeRO++ in FP16 views and, in
    BF16 views (ZeRO++ is FP16 only), the Allgather bytes per iteration. Coinciding lines are named under
    the plot with the reason; a dropdown picks the model and dtype."""
    from .summary import coincidence_lines, coincidences  # summary imports inputs only

    views = _views(records)
    all_gpus = [r["gpus"] for r in records]
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    # Plotly wraps a horizontal legend into aligned columns whose count depends on the width: budget for
    # three entries a row (what 1024 px holds), so the legend never runs off the bottom.
    legend_entries = 2 + len({r["system"] for r in records} - {"zero3"})
    legend_rows = math.ceil(legend_entries / 3)
    notes_by_view: list[list[str]] = []
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
        if has_zeropp:
            view_traces += _speedup_traces(
                [r for r in selected if r["system"] != "zeropp"],
                "speedup_vs_zeropp",
                "2",
                "ZeRO++",
                show_legend=False,
            )
            right_values = [r["speedup_vs_zeropp"] for r in selected if r.get("speedup_vs_zeropp")]
            right_axis = {
                **log_axis_ticks(right_values),
                "title.text": "speedup (× ZeRO++ iteration time, log)",
            }
            right_title = "vs ZeRO++ (int8 weights, lossy; FP16 only)"
        else:
            view_traces += _bytes_traces(selected)
            # The inter-node lines too (where anything crosses nodes), or the axis cuts them off.
            right_values = [
                r[key] / 1e9
                for r in selected
                for key in ("allgather_bytes_per_iter", "allgather_bytes_inter_node_per_iter")
                if r.get(key)
            ]
            right_axis = {
                **log_axis_ticks(right_values, suffix=""),
                "title.text": "Allgather GB per iteration (log)",
            }
            right_title = "Allgather bytes (ZeRO++ is FP16 only)"
        data += view_traces
        owners += [view_index] * len(view_traces)
        left_values = [
            v
            for r in selected
            for v in (r["speedup_vs_zero3"], r.get("bound_speedup"), r.get("overlap_only_speedup"))
            if v is not None
        ]
        notes = coincidence_lines(coincidences(selected), all_gpus, system_label)
        if not any(r.get("allgather_bytes_inter_node_per_iter") is not None for r in selected):
            notes.append("Intra/inter-node split of the Allgather bytes: not in these records.")
        notes_by_view.append(notes)
        labels = {provenance_label(r) for r in selected}
        provenance = labels.pop() if len(labels) == 1 else "measured and projected points"
        view_layouts.append(
            {
                "annotations": [
                    _panel_title("vs ZeRO-3", "x domain", "y domain"),
                    _panel_title(right_title, "x2 domain", "y2 domain"),
                ],
                "title": {"text": f"<b>{model}</b> · {dtype.upper()} · {provenance}", "x": 0.5, "y": 0.98},
                **_layout_updates("yaxis", log_axis_ticks(left_values)),
                **_layout_updates("yaxis2", right_axis),
            }
        )
    note_rows = max((len(n) for n in notes_by_view), default=0)
    notes_px = NOTE_ROW_PX * note_rows + (10 if note_rows else 0)
    height_px = 600 + notes_px
    margin = {"l": 70, "r": 30, "t": 110, "b": LEGEND_TOP_PX + notes_px + LEGEND_ROW_PX * legend_rows + 10}
    plot_px = height_px - margin["t"] - margin["b"]
    for notes, view_layout in zip(notes_by_view, view_layouts, strict=True):
        if notes:  # under the x axis title, above the legend; in pixels (yshift), since plotly places
            # paper fractions relative to the plot area
            view_layout["annotations"].append(
                {
                    "text": "<br>".join(notes),
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0,
                    "y": 0,
                    "xanchor": "left",
                    "yanchor": "top",
                    "align": "left",
                    "yshift": -LEGEND_TOP_PX,
                    "showarrow": False,
                    "font": {"size": 12, "color": "#374151"},
                }
            )
    parity_traces = [_parity_trace(all_gpus, ""), _parity_trace(all_gpus, "2")]
    data += parity_traces
    owners += [ALWAYS_VISIBLE] * len(parity_traces)
    menus = _view_menus(data, owners, views, view_layouts)
    layout = _base_layout(height_px)
    layout["margin"] = margin
    layout["legend"] = {**layout["legend"], "y": -(LEGEND_TOP_PX + notes_px) / plot_px}
    layout.update(
        {
            "xaxis": _axis("GPUs (world size W, log₂ scale)", domain=[0, 0.46], **_gpu_ticks(all_gpus)),
            "yaxis": _axis("speedup (× ZeRO-3 iteration time, log)"),
            "xaxis2": _axis(
                "GPUs (world size W, log₂ scale)", domain=[0.56, 1], anchor="y2", **_gpu_ticks(all_gpus)
            ),
            "yaxis2": _axis("", anchor="x2"),
            "updatemenus": menus,
            "hovermode": "closest",
        }
    )
    if view_layouts:
        _apply_relayout(layout, view_layouts[0])
    return {"data": data, "layout": layout}


def _apply_relayout(layout: dict[str, Any], update: dict[str, Any]) -> None:
    """Apply a dropdown entry's layout update ('yaxis.range' keys included) to the initial layout, so
    the page opens showing exactly what picking view 0 would show."""
    for key, value in update.items():
        target = layout
        *path, last = key.split(".")
        for part in path:
            target = target.setdefault(part, {})
        target[last] = value


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

# Short system names for the breakdown's y axes (the panels are narrow); the caption spells them out.
SHORT_LABELS = {
    "zero3": "ZeRO-3",
    "fsdp": "FSDP",
    "zeropp": "ZeRO++",
    "ciera-er": "CIERA-ER",
    "ciera-er-bsc": "ER+BSC",
    "ciera": "CIERA",
}
BREAKDOWN_COLUMNS = 2
BREAKDOWN_PANEL_PX = 190


def short_label(system: str) -> str:
    return SHORT_LABELS.get(system, system)


def breakdown_figure(records: list[dict[str, Any]]) -> Figure:
    """Iteration time split into compute, exposed Allgather, exposed ReduceScatter, codec and the rest:
    one panel per world size W, each with its own time axis (W = 4 takes a fraction of a second, W = 128
    tens of seconds: on one shared axis the small ones vanish), horizontal stacked bars per system with
    the p50 and its p5–p95 band. A dropdown picks the model and dtype."""
    views = _views(records)
    all_gpus = sorted({r["gpus"] for r in records})
    columns = min(BREAKDOWN_COLUMNS, len(all_gpus))
    rows = math.ceil(len(all_gpus) / columns)
    systems = _ordered_systems(r["system"] for r in records)
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    for view_index, (model, dtype) in enumerate(views):
        # Rows of the systems this view holds only: ZeRO++ is simulated in FP16 alone, and an empty
        # ZeRO++ row in a BF16 panel reads as a missing number.
        in_view = {r["system"] for r in records if r["model"] == model and r["dtype"] == dtype}
        view_systems = [s for s in systems if s in in_view]
        view_layout: dict[str, Any] = {
            "title": {"text": f"<b>{model}</b> · {dtype.upper()}", "x": 0.5, "y": 0.985}
        }
        for panel, gpus in enumerate(all_gpus):
            suffix = "" if panel == 0 else str(panel + 1)
            view_layout[f"yaxis{suffix}.categoryarray"] = [short_label(s) for s in reversed(view_systems)]
            selected = [
                r for r in records if r["model"] == model and r["dtype"] == dtype and r["gpus"] == gpus
            ]
            selected.sort(key=lambda r: systems.index(r["system"]))
            labels = [SHORT_LABELS.get(r["system"], r["system"]) for r in selected]
            sources = [provenance_label(r) for r in selected]
            for key in BREAKDOWN_KEYS:
                data.append(
                    {
                        "type": "bar",
                        "orientation": "h",
                        "name": BREAKDOWN_LABELS[key],
                        "legendgroup": key,
                        "showlegend": panel == 0,
                        "y": labels,
                        "x": [r["breakdown_s"][key] for r in selected],
                        # Projected bars are paler: model output, not a measurement. (Not hatched:
                        # plotly's pattern fills did not draw in headless Chromium.)
                        "marker": {
                            "color": BREAKDOWN_COLOURS[key],
                            "opacity": [
                                1.0 if is_measured_point(r) else ANALYTIC_BAR_OPACITY for r in selected
                            ],
                            "line": {"width": 0},
                        },
                        "customdata": [
                            [
                                system_label(r["system"]),
                                s,
                                r["breakdown_s"][key] / max(r["iteration_s"]["p50"], 1e-12),
                            ]
                            for r, s in zip(selected, sources, strict=True)
                        ],
                        "hovertemplate": (
                            f"<b>%{{customdata[0]}}</b> · W={gpus}<br>{BREAKDOWN_LABELS[key]}: <b>%{{x:.4g}} s</b>"
                            " (%{customdata[2]:.0%} of p50)<br>source: %{customdata[1]}<extra></extra>"
                        ),
                        "xaxis": f"x{suffix}",
                        "yaxis": f"y{suffix}",
                    }
                )
                owners.append(view_index)
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": "iteration p50 (whiskers: p5–p95)",
                    "legendgroup": "iteration",
                    "showlegend": panel == 0,
                    "y": labels,
                    "x": [r["iteration_s"]["p50"] for r in selected],
                    "error_x": {
                        "type": "data",
                        "symmetric": False,
                        "array": [r["iteration_s"]["p95"] - r["iteration_s"]["p50"] for r in selected],
                        "arrayminus": [r["iteration_s"]["p50"] - r["iteration_s"]["p5"] for r in selected],
                        "color": "#111827",
                        "thickness": 1.2,
                        "width": 3,
                    },
                    "marker": {
                        "symbol": "line-ns-open",
                        "size": 12,
                        "color": [system_colour(r["system"]) for r in selected],
                        "line": {"width": 3},
                    },
                    "customdata": [
                        [system_label(r["system"]), r["iteration_s"]["p5"], r["iteration_s"]["p95"], s]
                        for r, s in zip(selected, sources, strict=True)
                    ],
                    "hovertemplate": (
                        f"<b>%{{customdata[0]}}</b> · W={gpus}<br>iteration p50 <b>%{{x:.4g}} s</b><br>"
                        "p5–p95 %{customdata[1]:.4g}–%{customdata[2]:.4g} s<br>source: %{customdata[3]}"
                        "<extra></extra>"
                    ),
                    "xaxis": f"x{suffix}",
                    "yaxis": f"y{suffix}",
                }
            )
            owners.append(view_index)
        view_layouts.append(view_layout)
    menus = _view_menus(data, owners, views, view_layouts)
    top_px, bottom_px = 120, 110
    height_px = top_px + bottom_px + rows * BREAKDOWN_PANEL_PX
    layout = _base_layout(height_px)
    plot_px = rows * BREAKDOWN_PANEL_PX
    for menu in menus:  # under the title (a long model name reaches the left edge), above the panels
        menu["y"] = 1 + (top_px - 45) / plot_px
    row_gap = 0.36 / rows  # room for each panel's tick labels, axis title and the next panel's title
    column_gap = 0.14  # room for the right column's system names
    width = (1 - column_gap * (columns - 1)) / columns
    height = (1 - row_gap * (rows - 1)) / rows
    annotations = []
    for panel, gpus in enumerate(all_gpus):
        suffix = "" if panel == 0 else str(panel + 1)
        row, column = divmod(panel, columns)
        left = column * (width + column_gap)
        top = 1 - row * (height + row_gap)
        layout[f"xaxis{suffix}"] = _axis(
            "time per iteration (s)",
            domain=[max(left, 0.0), min(left + width, 1.0)],
            anchor=f"y{suffix}",
            rangemode="tozero",
        )
        layout[f"xaxis{suffix}"]["title"]["standoff"] = 4
        layout[f"yaxis{suffix}"] = _axis(
            "",
            domain=[max(top - height, 0.0), min(top, 1.0)],
            anchor=f"x{suffix}",
            type="category",
            categoryorder="array",
            categoryarray=[SHORT_LABELS.get(s, s) for s in reversed(systems)],
            showgrid=False,
            ticks="",
        )
        annotations.append(
            {**_panel_title(f"W = {gpus}", f"x{suffix} domain", f"y{suffix} domain"), "y": 1.0}
        )
    layout.update(
        {
            "barmode": "stack",
            "bargap": 0.3,
            "margin": {"l": 80, "r": 30, "t": top_px, "b": bottom_px},
            "annotations": annotations,
            "legend": {
                "orientation": "h",
                "y": -70 / plot_px,
                "yanchor": "top",
                "x": 0,
                "font": {"size": 12},
            },
            "updatemenus": menus,
            "hovermode": "closest",
        }
    )
    if view_layouts:  # the page opens showing exactly what picking view 0 shows
        _apply_relayout(layout, view_layouts[0])
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


# Each category's own dash, marker and width, drawn widest first and solid before dashed, so a category
# whose q lies on another's still shows around it or through its gaps (attention and router often do).
CATEGORY_STYLES: dict[str, dict[str, Any]] = {
    "expert_ffn": {"dash": "solid", "symbol": "circle", "width": 2.5},
    "attention": {"dash": "solid", "symbol": "square", "width": 6},
    "router": {"dash": "dot", "symbol": "diamond", "width": 2.5},
    "norm": {"dash": "dashdot", "symbol": "triangle-up", "width": 2.5},
    "embedding": {"dash": "longdash", "symbol": "x", "width": 2.5},
}
# The left panel's two rates: greys, since every colour of the right panel means a category.
CHURN_RATE_COLOURS = {"exp": "#9ca3af", "block": "#374151"}
# Two categories' q closer than this at every B draw as one line (the plot is a few hundred px tall).
CATEGORY_COINCIDE_Q = 0.01


def category_style(category: str) -> dict[str, Any]:
    return CATEGORY_STYLES.get(category, {"dash": "dash", "symbol": "circle", "width": 2})


def _weighted_rate_lines(
    rows: pd.DataFrame,
    categories: list[str],
    x_column: str,
    x_hover: str,
    axis: str,
    marker_size: int,
    showlegend: bool = True,
) -> list[dict[str, Any]]:
    """One line per category: block change rate weighted by parameter count, against `x_column`. A line
    that lies on one drawn before it says so in its legend entry."""
    weighted = rows.assign(weighted_rate=rows["block_change_rate"] * rows["numel"])
    grouped = weighted.groupby(["category", x_column])[["weighted_rate", "numel"]].sum().reset_index()
    grouped["block_change_rate"] = grouped["weighted_rate"] / grouped["numel"].clip(lower=1)
    drawn = sorted(
        categories, key=lambda c: (-category_style(c)["width"], category_style(c)["dash"] != "solid")
    )
    series_by_category: dict[str, tuple[list[Any], list[float]]] = {}
    lines = []
    for category in drawn:
        series = grouped[grouped["category"] == category].sort_values(x_column)
        x, y = series[x_column].tolist(), series["block_change_rate"].tolist()
        under = next(
            (
                other
                for other, (other_x, other_y) in series_by_category.items()
                if other_x == x
                and x
                and max(abs(a - b) for a, b in zip(y, other_y, strict=True)) <= CATEGORY_COINCIDE_Q
            ),
            None,
        )
        series_by_category[category] = (x, y)
        style = category_style(category)
        colour = CATEGORY_COLOURS.get(category, "#333333")
        lines.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": category if under is None else f"{category} (on {under}'s line)",
                "legendgroup": category,
                "legendrank": 10 + categories.index(category),  # category order, whatever the draw order
                "showlegend": showlegend,
                "x": x,
                "y": y,
                "line": {
                    "color": _translucent(colour, 0.55) if style["width"] > 3 else colour,
                    "width": style["width"],
                    "dash": style["dash"],
                },
                "marker": {"color": colour, "size": marker_size, "symbol": style["symbol"]},
                "hovertemplate": f"{category} · {x_hover}<br>block change rate %{{y:.4f}}<extra></extra>",
                "xaxis": f"x{axis}",
                "yaxis": f"y{axis}",
            }
        )
    return lines


RATE_FLOOR = 1e-5  # a log axis has no 0: rates of exactly 0 are drawn at this floor (said in the lede)


def _floor(value: float) -> float:
    return max(float(value), RATE_FLOOR)


def iteration_spread(exponents: pd.DataFrame, block_size: int) -> tuple[int, float]:
    """How many iterations the bundle's runs hold and how far the numel-weighted q of any category moves
    across them: why the report draws no 'q over iterations' panel (a few flat points say nothing)."""
    rows = exponents[exponents["block_size"] == block_size]
    if rows.empty:
        return 0, 0.0
    weighted = rows.assign(w=rows["block_change_rate"] * rows["numel"])
    grouped = weighted.groupby(["category", "iteration"])[["w", "numel"]].sum()
    q = (grouped["w"] / grouped["numel"].clip(lower=1)).unstack()
    return int(rows["iteration"].nunique()), float((q.max(axis=1) - q.min(axis=1)).max())


def exponent_figure(exponents: pd.DataFrame, runs: pd.DataFrame) -> Figure:
    """Per (model, dtype), a dropdown picking one: the per-category distribution of exponent and block
    change rates (box from precomputed quartiles, so the page stays small however many shards the bundle
    has) at the default block size B (or the bundle's most common one), and how the numel-weighted block
    change rate q grows with B. The title names the model: categories of different models differ."""
    block_sizes = set(exponents["block_size"].astype(int))
    block_size = (
        DEFAULT_BLOCK_SIZE
        if DEFAULT_BLOCK_SIZE in block_sizes
        else int(exponents["block_size"].mode().iloc[0])
    )
    all_rows = exponents.merge(runs[["run_id", "model", "dtype", "source"]], on="run_id", how="left")
    present_categories = set(all_rows["category"])
    categories = [c for c in CATEGORY_COLOURS if c in present_categories]
    categories += sorted(present_categories - set(CATEGORY_COLOURS))
    views = _views(all_rows[["model", "dtype"]].drop_duplicates().to_dict("records"))
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    for view_index, (model, dtype) in enumerate(views):
        view_rows = all_rows[(all_rows["model"] == model) & (all_rows["dtype"] == dtype)]
        rows = view_rows[view_rows["block_size"] == block_size]
        view_traces: list[dict[str, Any]] = []
        for rank, (rate_column, label, offset_group) in enumerate(
            (
                ("exp_change_rate", "values with a changed exponent", "exp"),
                ("block_change_rate", f"B={block_size} blocks with a change", "block"),
            )
        ):
            quantiles = (
                rows.groupby("category")[rate_column]
                .quantile([0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0])
                .unstack()
            )
            means = rows.groupby("category")[rate_column].mean()
            present = [c for c in categories if c in quantiles.index]
            view_traces.append(
                {
                    "type": "box",
                    "name": label,
                    "legendgroup": offset_group,
                    "legendrank": 1 + rank,
                    "offsetgroup": offset_group,
                    "x": present,
                    "q1": [_floor(quantiles.loc[c, 0.25]) for c in present],
                    "median": [_floor(quantiles.loc[c, 0.5]) for c in present],
                    "q3": [_floor(quantiles.loc[c, 0.75]) for c in present],
                    "lowerfence": [_floor(quantiles.loc[c, 0.05]) for c in present],
                    "upperfence": [_floor(quantiles.loc[c, 0.95]) for c in present],
                    "mean": [_floor(means.loc[c]) for c in present],
                    "marker": {"color": CHURN_RATE_COLOURS[offset_group]},
                    "hoverinfo": "x+y",
                    "xaxis": "x",
                    "yaxis": "y",
                }
            )
        view_traces += _weighted_rate_lines(view_rows, categories, "block_size", "B=%{x}", "2", marker_size=6)
        data += view_traces
        owners += [view_index] * len(view_traces)
        sources = sorted(set(rows["source"].dropna()))
        provenance = (
            " + ".join("analytic traces" if s == "analytic" else f"{s} traces" for s in sources)
            or "unknown source"
        )
        view_layouts.append(
            {
                "title": {
                    "text": f"<b>{model}</b> · {dtype.upper()} · block size B={block_size} · {provenance}",
                    # Left, as in the bandwidth plot: centred, a long model name runs under the mode bar.
                    "xref": "paper",
                    "x": 0,
                    "xanchor": "left",
                    "y": 0.97,
                }
            }
        )
    menus = _view_menus(data, owners, views, view_layouts)
    # With a dropdown, room for it between the title and the panel titles: it sits 100 px above the plot.
    margin = {"l": 70, "r": 30, "t": 150 if menus else 90, "b": 120}
    height_px = 500 + (60 if menus else 0)
    for menu in menus:
        menu["y"] = 1 + 100 / (height_px - margin["t"] - margin["b"])
    layout = _base_layout(height_px)
    layout.update(view_layouts[0] if view_layouts else {})
    layout.update(
        {
            "boxmode": "group",
            # Log: value churn (~10⁻³) and block churn q (~0.5) differ by orders of magnitude.
            "xaxis": _axis(
                "parameter category", domain=[0, 0.5], categoryorder="array", categoryarray=categories
            ),
            "yaxis": _axis(
                "change rate between iterations (log)", type="log", **_log_ticks([RATE_FLOOR, 1.0])
            ),
            "xaxis2": _axis(
                "block size B (values, log₂ scale)", domain=[0.62, 1], anchor="y2", **_gpu_ticks(block_sizes)
            ),
            "yaxis2": _axis("block change rate q", anchor="x2", rangemode="tozero"),
            "annotations": [
                _panel_title("per category (box p25–p75, whiskers p5–p95)", "x domain", "y domain"),
                _panel_title("q vs block size (numel-weighted)", "x2 domain", "y2 domain"),
            ],
            "margin": margin,
            "legend": {"orientation": "h", "y": -0.3, "x": 0, "font": {"size": 12}},
            "updatemenus": menus,
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


# Two systems whose speedups differ by less than this (relative) at a bandwidth draw as one line there.
SWEEP_COINCIDE_RELATIVE = 0.002


def _coinciding_below(
    system: str, drawn: Sequence[str], lines: dict[str, list[tuple[float, dict[str, Any]]]]
) -> str:
    """Where `system`'s sweep line lies on that of a system drawn before it, in words for its legend
    entry: 'CIERA-ER' when at every bandwidth, 'CIERA-ER at 2, 4 GB/s' when at some; '' when nowhere."""

    def speedups(name: str) -> dict[float, float]:
        return {b: r["speedup_vs_zero3"] for b, r in lines[name]}

    own = speedups(system)
    for other in drawn[: drawn.index(system)]:
        theirs = speedups(other)
        same = [
            b
            for b, value in sorted(own.items())
            if b in theirs and abs(value - theirs[b]) <= SWEEP_COINCIDE_RELATIVE * abs(value)
        ]
        if len(same) == len(own):
            return short_label(other)
        if same:
            return f"{short_label(other)} at {', '.join(f'{b / 1e9:.3g}' for b in same)} GB/s"
    return ""


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
    is set, not measured), so every line is dashed with hollow markers. A line lying on one drawn before
    it says so in its legend entry ("· on CIERA-ER")."""
    data: list[dict[str, Any]] = []
    owners: list[int] = []
    view_layouts: list[dict[str, Any]] = []
    all_bandwidths_Bps = [b for view in views for points in view.lines.values() for b, _ in points]
    if reference_Bps is not None:
        all_bandwidths_Bps.append(reference_Bps)
    for view_index, view in enumerate(views):
        speedups = []
        # Widest first, in each system's own dash and marker (as in the speedup plot): CIERA-ER, ER+BSC
        # and CIERA often give one speedup at every bandwidth, and each must still show.
        drawn = sorted(view.lines, key=lambda s: -system_style(s)["width"])
        for system in drawn:
            points = view.lines[system]
            colour = system_colour(system)
            style = system_style(system)
            speedups += [r["speedup_vs_zero3"] for _, r in points]
            under = _coinciding_below(system, drawn, view.lines)
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": system_label(system) + (f" · on {under}" if under else ""),
                    "legendgroup": system,
                    "legendrank": 10 + SYSTEMS.index(system) if system in SYSTEMS else 100,
                    "x": [b / 1e9 for b, _ in points],
                    "y": [r["speedup_vs_zero3"] for _, r in points],
                    "line": {
                        "color": _translucent(colour, 0.55) if style["width"] > 3 else colour,
                        "width": style["width"],
                        "dash": style["dash"],
                    },
                    "marker": {
                        "color": colour,
                        "size": style["size"],
                        "symbol": _marker_symbol(system, measured=False),
                        "line": {"width": 2, "color": colour},
                    },
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
