"""Defects a new user hit in the HTML report: coinciding lines hidden, one colour meaning two things, an
unnamed model, empty ZeRO++ rows in BF16, gather bytes that do not add up unexplained, a one-tick speedup
axis, and wording slips. Figure checks are on the figure dicts (fast); one browser check sees a line
hidden under another."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import plotly.graph_objects as go
import pytest

from report import build_report, write_report
from report.figures import (
    CATEGORY_COLOURS,
    breakdown_figure,
    exponent_figure,
    log_axis_ticks,
    sensitivity_figure,
    speedup_figure,
)
from report.render_check import check_render
from report.sensitivity import BandwidthSweep, SweepPoint, sweep_views
from traces import TraceBundle, default_bundle_path

from .conftest import crafted_bundle, crafted_records
from .test_report_browser import _require_chromium
from .test_report_sensitivity import _record

CIERA_VARIANTS = ("ciera-er", "ciera-er-bsc", "ciera")


def _figures(document: str) -> dict:
    payload = re.search(r"const cieraFigures = (\{.*?\});\n", document, re.S)
    assert payload
    return json.loads(payload.group(1).replace("<\\/", "</"))


def coinciding_sweep(models: tuple[str, ...] = ("Model-A",), gpus: int = 32) -> BandwidthSweep:
    """Three bandwidths where CIERA-ER, ER+BSC and CIERA give the same speedup at every one."""
    speedups = {2e9: 1.5, 8e9: 1.2, 32e9: 0.9}
    points = tuple(
        SweepPoint(
            bandwidth_Bps,
            tuple(
                [_record(m, "zero3", 1.0, gpus=gpus) for m in models]
                + [_record(m, "fsdp", 1.05, gpus=gpus) for m in models]
                + [_record(m, system, speedup, gpus=gpus) for m in models for system in CIERA_VARIANTS]
            ),
            is_reference=bandwidth_Bps == 8e9,
        )
        for bandwidth_Bps, speedup in speedups.items()
    )
    return BandwidthSweep(
        "inter_node.beta_Bps", points, "test", "testbed", 8e9, "set in the preset", "Crafted sweep."
    )


def coinciding_bundle(models: tuple[str, ...] = ("Model-A",)) -> TraceBundle:
    """The crafted bundle with router's rates equal to attention's, once per model (a run each), at two
    block sizes so q vs B is a line."""
    base = crafted_bundle()
    exponents = base.exponents
    attention = exponents[exponents["category"] == "attention"]
    router = attention.assign(category="router", shard=attention["shard"].str.replace("attention", "router"))
    one_run = pd.concat([exponents[exponents["category"] != "router"], router], ignore_index=True)
    one_run = pd.concat(
        [one_run, one_run.assign(block_size=1024, block_change_rate=one_run["block_change_rate"] ** 0.5)],
        ignore_index=True,
    )
    runs = pd.concat(
        [base.runs.assign(run_id=f"r{i}", model=model) for i, model in enumerate(models)], ignore_index=True
    )
    exponents = pd.concat([one_run.assign(run_id=f"r{i}") for i in range(len(models))], ignore_index=True)
    return TraceBundle(
        runs=runs,
        layers=base.layers,
        iterations=base.iterations,
        collectives=base.collectives,
        exponents=exponents,
    )


def _visible_at_load(figure: dict) -> list[dict]:
    return [t for t in figure["data"] if t.get("visible", True)]


# ------------------------------------------------------------------------------ 1. coinciding lines


def test_sensitivity_lines_that_coincide_stay_distinct_and_say_so():
    sweep = coinciding_sweep()
    figure = sensitivity_figure(sweep_views(sweep), "β", [p.bandwidth_Bps for p in sweep.points], 8e9)
    lines = [t for t in figure["data"] if t.get("legendgroup") in ("fsdp", *CIERA_VARIANTS)]
    styles = {(t["line"]["dash"], t["line"]["width"], t["marker"]["symbol"]) for t in lines}
    assert len(styles) == len(lines) == 4, "each system its own dash, width and marker"
    widths = [t["line"]["width"] for t in lines]
    assert widths == sorted(widths, reverse=True), "widest drawn first: thinner ones stay on top"
    names = {t["legendgroup"]: t["name"] for t in lines}
    assert names["ciera-er"] == "CIERA-ER"
    assert names["ciera-er-bsc"] == "CIERA-ER+BSC · on CIERA-ER"
    assert names["ciera"] == "CIERA (ER+BSC+CCP) · on CIERA-ER"
    assert names["fsdp"] == "FSDP"
    go.Figure(figure)


def test_sensitivity_legend_names_the_bandwidths_of_a_partial_coincidence():
    sweep = coinciding_sweep()
    for point in sweep.points:  # CIERA pulls ahead at the slowest link only
        for record in point.records:
            if record["system"] == "ciera" and point.bandwidth_Bps == 2e9:
                record["speedup_vs_zero3"] = 1.8
    figure = sensitivity_figure(sweep_views(sweep), "β", [p.bandwidth_Bps for p in sweep.points])
    ciera = next(t for t in figure["data"] if t.get("legendgroup") == "ciera")
    assert ciera["name"] == "CIERA (ER+BSC+CCP) · on CIERA-ER at 8, 32 GB/s"


def test_exponent_lines_that_coincide_stay_distinct_and_say_so():
    bundle = coinciding_bundle()
    figure = exponent_figure(bundle.exponents, bundle.runs)
    lines = [t for t in figure["data"] if t["type"] == "scatter"]
    assert len({(t["line"]["dash"], t["marker"]["symbol"]) for t in lines}) == len(lines) == 5
    order = [t["legendgroup"] for t in lines]
    attention, router = (lines[order.index(c)] for c in ("attention", "router"))
    assert attention["y"] == pytest.approx(router["y"]), "the crafted case: router's q is attention's"
    assert order.index("attention") < order.index("router"), "the wider line is drawn first"
    assert attention["line"]["width"] > router["line"]["width"] and router["line"]["dash"] != "solid"
    assert router["name"] == "router (on attention's line)" and attention["name"] == "attention"
    assert all(t["name"] == t["legendgroup"] for t in lines if t["legendgroup"] not in ("router",))
    go.Figure(figure)


# ---------------------------------------------------------------------- 2. exponent colours and title


def test_exponent_colours_mean_one_thing_and_the_title_names_the_model():
    bundle = coinciding_bundle(models=("Mixtral-8x7B", "OLMoE-1B-7B"))
    figure = exponent_figure(bundle.exponents, bundle.runs)
    boxes = [t for t in figure["data"] if t["type"] == "box"]
    lines = [t for t in figure["data"] if t["type"] == "scatter"]
    box_colours = {t["marker"]["color"] for t in boxes}
    assert len(box_colours) == 2 and not box_colours & set(CATEGORY_COLOURS.values())
    for line in lines:  # a category has one colour, in every view
        assert line["marker"]["color"] == CATEGORY_COLOURS[line["legendgroup"]]
    assert "<b>Mixtral-8x7B</b> · BF16" in figure["layout"]["title"]["text"]
    buttons = figure["layout"]["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == ["Mixtral-8x7B · bf16", "OLMoE-1B-7B · bf16"]
    assert "<b>OLMoE-1B-7B</b>" in buttons[1]["args"][1]["title"]["text"]
    assert len(_visible_at_load(figure)) == 2 + 5, "view 0 only: two boxes, five category lines"
    go.Figure(figure)


def test_single_model_exponent_figure_has_no_dropdown():
    bundle = crafted_bundle()
    figure = exponent_figure(bundle.exponents, bundle.runs)
    assert figure["layout"]["updatemenus"] == []
    assert figure["layout"]["title"]["text"].startswith("<b>Model-A</b> · BF16 · block size B=512")


# ------------------------------------------------------------------------- 3. no empty ZeRO++ rows


def test_bf16_breakdown_panels_have_no_zeropp_row():
    figure = breakdown_figure(crafted_records())
    layout = figure["layout"]
    panels = [k for k in layout if re.fullmatch(r"yaxis\d*", k)]
    assert all("ZeRO++" not in layout[k]["categoryarray"] for k in panels), "view 0 is Model-A BF16"
    assert all("CIERA" in layout[k]["categoryarray"] for k in panels)
    buttons = layout["updatemenus"][0]["buttons"]
    bf16, fp16 = buttons[0]["args"][1], buttons[1]["args"][1]
    assert "ZeRO++" not in bf16["yaxis.categoryarray"] and "ZeRO++" in fp16["yaxis.categoryarray"]
    page = build_report(crafted_records(), [], None, "t")
    assert "BF16 views have no ZeRO++ row" in page


# -------------------------------------------------------------------- 4. gathered vs received bytes


def test_records_table_says_why_received_bytes_do_not_add_up_to_the_gathered():
    records = crafted_records()
    for r in records:  # W <= 8 in one node: one rank receives (W-1)/W of it, all intra-node
        share = (r["gpus"] - 1) / r["gpus"]
        inter = 0.0 if r["gpus"] <= 8 else 0.5 * share * r["allgather_bytes_per_iter"]
        r["allgather_bytes_intra_node_per_iter"] = share * r["allgather_bytes_per_iter"] - inter
        r["allgather_bytes_inter_node_per_iter"] = inter
    page = build_report(records, [], None, "t")
    records_section = page[page.index('<section id="records">') :]
    assert "Allgather GB/iter gathered (one rank receives: intra / inter-node)" in records_section
    for phrase in (
        "the sum of the gathered tensors' sizes (wire format) as every rank assembles them",
        "what one rank receives over the intra-node and the inter-node network",
        "They do not add up to the total: a rank's own shard (1/W of it) is never received",
        "while W fits in one node nothing crosses nodes",
    ):
        assert phrase in records_section


# ------------------------------------------------------------------------ 5. a flat speedup axis


def test_flat_speedup_plot_gets_at_least_three_y_ticks():
    records = crafted_records(models=("Model-A",), measured_model="none")
    for r in records:
        r["speedup_vs_zero3"] = 1.0
        r["speedup_vs_zeropp"] = 1.0 if r["dtype"] == "fp16" else None
        r["bound_speedup"] = r["overlap_only_speedup"] = None
    figure = speedup_figure(records)
    y_axis = figure["layout"]["yaxis"]
    assert len(y_axis["tickvals"]) >= 3
    low, high = y_axis["range"]
    assert all(low <= math.log10(t) <= high for t in y_axis["tickvals"])
    for button in figure["layout"]["updatemenus"][0]["buttons"]:  # every view, both panels
        assert len(button["args"][1]["yaxis.tickvals"]) >= 3
        assert len(button["args"][1]["yaxis2.tickvals"]) >= 3
    assert log_axis_ticks([1.0])["tickvals"] == [0.9, 1.0, 1.1]


# ------------------------------------------------------------------------------- 6. wording slips


def test_one_model_and_equal_ends_read_naturally():
    records = [r for r in crafted_records() if r["model"] == "Model-A"]
    for r in records:
        if r["system"] == "ciera":
            r["speedup_vs_zero3"] = 1.0
    page = build_report(records, [], None, "t")
    assert "1 models" not in page and "1 model, W ∈" in page
    assert "1.00–1.00×" not in page
    assert "CIERA (ER+BSC+CCP) is 1.00× ZeRO-3&#x27;s speed for Model-A and does not pay" in page
    # The summary says "never" for CIERA never paying (not "nowhere"), and no note says "none shards".
    assert "never (no swept W)" in page and "nowhere" not in page
    assert "none shard" not in page
    # No row carries a dagger, so no dagger footnote; no zero-second cost sentence.
    assert "†" not in page and "only 0 s" not in page


def test_several_models_keep_the_plural_and_a_range():
    page = build_report(crafted_records(), [], None, "t")
    assert "2 models, W ∈" in page and "across the 2 models and pays for 2 of them" in page
    assert re.search(r"is \d\.\d\d–\d\.\d\d× ZeRO-3", page)


def test_header_names_the_shipped_bundle_as_the_cli_does(tmp_path):
    page = build_report(crafted_records(), [], None, "t", bundle_path=str(default_bundle_path()))
    assert "trace bundle <code>analytic</code> (traces/data/default)" in page
    other = build_report(crafted_records(), [], None, "t", bundle_path=str(tmp_path))
    assert f"trace bundle <code>{tmp_path}</code>" in other


# ------------------------------------------------------------------------------------------ browser


@pytest.mark.browser
def test_layout_check_sees_a_hidden_line_and_a_dropdown_over_text(tmp_path):
    _require_chromium()
    hidden = {"type": "scatter", "mode": "lines", "x": [1, 2, 3], "y": [1, 2, 1]}
    figure = {
        "data": [
            {**hidden, "name": "under", "line": {"width": 2}},
            {**hidden, "name": "over", "line": {"width": 2}},
            {**hidden, "name": "wide", "y": [2, 3, 2], "line": {"width": 7}},
            {**hidden, "name": "dotted on top", "y": [2, 3, 2], "line": {"width": 2, "dash": "dot"}},
            {**hidden, "name": "flat under", "y": [3, 3, 3], "line": {"width": 2}},  # a box 0 px high
            {**hidden, "name": "flat over", "y": [3, 3, 3], "line": {"width": 3}},
        ],
        "layout": {"width": 500, "height": 300},
    }
    covered = {
        "data": [{"type": "scatter", "x": [1, 2], "y": [1, 2]}],
        "layout": {
            "width": 500,
            "height": 300,
            "annotations": [
                {
                    "text": "a panel title",
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.1,
                    "y": 0.9,
                    "showarrow": False,
                }
            ],
            "updatemenus": [
                {"buttons": [{"label": "a model · bf16", "method": "skip"}], "x": 0, "xanchor": "left"}
            ],
        },
    }
    page = build_report(crafted_records(), [], None, "t")
    figures = _figures(page)
    figures["fig-speedup"], figures["fig-breakdown"] = figure, covered
    payload = json.dumps(figures, ensure_ascii=False).replace("</", "<\\/")
    start = page.index("const cieraFigures = ") + len("const cieraFigures = ")
    page = page[:start] + payload + page[page.index(";\n", start) :]
    result = check_render(
        write_report(tmp_path / "hidden.html", page),
        timeout_s=60,
        window_width_px=1600,
        layout_selector="main",
    )
    hidden_lines = [p for p in result.layout_problems if "is hidden under" in p]
    assert hidden_lines == [
        '#fig-speedup: line "under" is hidden under "over"',
        '#fig-speedup: line "flat under" is hidden under "flat over"',
    ]
    assert '#fig-breakdown: the dropdown covers "a panel title"' in result.layout_problems


def test_cieras_timelines_show_their_codec_rows():
    """CIERA-ER and ER+BSC run their codec on the main thread's side rows (codec_send/recv), CIERA on its
    CCP streams: each has its own rows in the timeline, wherever it compresses a shard."""
    import traces
    from sim import load_cluster, timeline

    bundle = traces.read_bundle(traces.default_bundle_path())
    document = timeline(bundle, load_cluster("a100-hdr-testbed"), "olmoe", "bf16", 64)
    processes = {
        e["pid"]: e["args"]["name"].split(" ")[0]
        for e in document["traceEvents"]
        if e["name"] == "process_name"
    }
    threads: dict[str, set[str]] = {}
    for event in document["traceEvents"]:
        if event["name"] == "thread_name":
            threads.setdefault(processes[event["pid"]], set()).add(event["args"]["name"])
    assert {"codec_send", "codec_recv"} <= threads["ciera-er"]
    assert {"codec_send", "codec_recv"} <= threads["ciera-er-bsc"]
    assert {"ccp_send", "ccp_recv"} <= threads["ciera"]
