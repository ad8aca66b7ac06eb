"""The HTML report built from crafted records: sections, self-containment, provenance labelling."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import pytest

from report import ReportInputError, build_report
from report.figures import breakdown_figure, exponent_figure, speedup_figure, timeline_figure
from report.html import PLOT_CLASS
from report.inputs import validate_timeline

from .conftest import crafted_records


def _figures(document: str) -> dict:
    payload = re.search(r"const cieraFigures = (\{.*?\});\n", document, re.S)
    assert payload, "figure payload missing"
    return json.loads(payload.group(1).replace("<\\/", "</"))


def test_report_has_every_section(records, timeline_events, bundle):
    document = build_report(
        records, timeline_events, bundle, "Test report", cluster="a100-hdr-testbed", bundle_path="b"
    )
    for anchor in ("speedup", "breakdown", "timeline", "exponents", "records"):
        assert f'<section id="{anchor}">' in document
    figures = _figures(document)
    assert set(figures) == {"fig-speedup", "fig-breakdown", "fig-timeline", "fig-exponents"}
    assert document.count(f'class="{PLOT_CLASS}"') == 4
    assert "a100-hdr-testbed" in document and "trace bundle <code>b</code>" in document
    # One table row per record.
    assert document.count("<tr class=") == len(records)


def test_report_is_self_contained(records, timeline_events, bundle):
    document = build_report(records, timeline_events, bundle, "Test report")
    assert document.count("plotly.js v") == 1, "plotly.js must be inlined exactly once"
    assert not re.search(r"<script[^>]*\bsrc\s*=", document, re.I), "no external scripts"
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']https?:", document, re.I), "no external stylesheets"
    assert len(document.encode()) < 10_000_000


def test_analytic_points_are_labelled_and_drawn_differently(records, timeline_events, bundle):
    document = build_report(records, timeline_events, bundle, "Test report")
    assert "analytic projection" in document
    assert "not measurements" in document
    speedup = _figures(document)["fig-speedup"]
    model_a_ciera = [
        t
        for t in speedup["data"]
        if t.get("legendgroup") == "ciera" and t["xaxis"] == "x" and t["name"].startswith("CIERA")
    ]
    projection = next(t for t in model_a_ciera if "(measured)" not in t["name"])
    measured = next(t for t in model_a_ciera if "(measured)" in t["name"])
    assert projection["line"]["dash"] == "dash" and measured["line"]["dash"] == "solid"
    # Model-A is measured at W <= 8 only: those markers are filled, the rest hollow.
    symbols = dict(zip(projection["x"], projection["marker"]["symbol"], strict=True))
    assert symbols[4] == symbols[8] == "circle"
    assert {symbols[w] for w in (16, 32, 64, 128)} == {"circle-open"}
    assert measured["x"] == [4, 8] and measured["marker"]["symbol"] == "circle"
    # Table rows say which is which.
    assert '<tr class="projected">' in document and '<tr class="measured">' in document


def test_all_analytic_records_never_say_measured(timeline_events, bundle):
    analytic_only = crafted_records(measured_model="none")
    document = build_report(analytic_only, timeline_events, bundle, "Test report")
    speedup = _figures(document)["fig-speedup"]
    assert not any("(measured)" in t["name"] for t in speedup["data"])
    assert '<tr class="measured">' not in document
    assert "0 measured" in document


def test_figures_are_valid_plotly(records, timeline_events, bundle):
    # plotly's validator rejects unknown or mistyped properties that plotly.js would silently ignore.
    for figure in (
        speedup_figure(records),
        breakdown_figure(records),
        timeline_figure(validate_timeline(timeline_events, "t")),
        exponent_figure(bundle.exponents, bundle.runs),
    ):
        go.Figure(figure)


def test_colours_are_consistent_per_system(records, timeline_events):
    speedup = speedup_figure(records)
    timeline = timeline_figure(validate_timeline(timeline_events, "t"))
    # Markers carry the system's colour; a wide underlay line is a paler version of it.
    speedup_colours = {
        t["legendgroup"]: t["marker"]["color"]
        for t in speedup["data"]
        if "legendgroup" in t and "marker" in t
    }
    for trace in timeline["data"]:
        system = next(
            s
            for s, label in ((s, s) for s in speedup_colours)
            if trace["marker"]["color"] == speedup_colours[s]
        )
        assert system


def test_dropdown_switches_model_and_dtype(records):
    figure = speedup_figure(records)
    buttons = figure["layout"]["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == [
        "Model-A · bf16",
        "Model-A · fp16",
        "Model-B · bf16",
        "Model-B · fp16",
    ]
    for button in buttons:
        assert len(button["args"][0]["visible"]) == len(figure["data"])
    # ZeRO++ is FP16 only: the BF16 view says so instead of drawing an empty comparison.
    assert "FP16 only" in json.dumps(buttons[0]["args"][1]["annotations"])


def test_sections_degrade_without_timeline_or_exponents(records):
    document = build_report(records, [], None, "Test report")
    assert "No timeline events were given." in document
    assert "no exponent statistics" in document
    assert set(_figures(document)) == {"fig-speedup", "fig-breakdown"}


def test_title_and_names_are_escaped(records):
    document = build_report(records, [], None, "<script>alert(1)</script>")
    assert "<script>alert(1)</script>" not in document


def test_bad_record_from_the_api_names_the_field(records):
    records[3] = {**records[3], "source": "guessed"}
    with pytest.raises(ReportInputError, match=r"record 3, field 'source': 'guessed'"):
        build_report(records, [], None, "t")


def test_default_sweep_size_stays_small():
    models = tuple(f"Model-{letter}" for letter in "ABCDEF")
    many_records = crafted_records(models=models)
    assert len(many_records) == 6 * 6 * 11
    document = build_report(many_records, [], None, "t")
    assert len(document.encode()) < 10_000_000


def test_sim_shaped_timeline_resolves_systems_and_streams():
    # `ciera simulate --timeline` names integer pids/tids through metadata events.
    document = {
        "traceEvents": [
            {
                "ph": "M",
                "name": "process_name",
                "pid": 1,
                "tid": 0,
                "args": {"name": "ciera — Mixtral-8x7B bf16 W=32"},
            },
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "allgather"}},
            {"ph": "X", "name": "fwd L1 gather", "pid": 1, "tid": 2, "ts": 10.0, "dur": 5.0},
        ]
    }
    (event,) = validate_timeline(document, "t.json")
    assert (event["pid"], event["tid"], event["context"]) == ("ciera", "allgather", "Mixtral-8x7B bf16 W=32")
    page = build_report(crafted_records(), [document["traceEvents"][i] for i in range(3)], None, "t")
    assert "Simulated: Mixtral-8x7B bf16 W=32." in page


def test_projected_records_from_measured_traces_are_not_measured(timeline_events):
    sim_shaped = crafted_records()
    for record in sim_shaped:
        record["projected"] = record["gpus"] > 4  # measured traces exist at W=4 only
        record["source"] = "measured" if record["model"] == "Model-A" else "mixed"
    figure = speedup_figure(sim_shaped)
    projection = next(t for t in figure["data"] if t.get("legendgroup") == "ciera" and t["xaxis"] == "x")
    symbols = dict(zip(projection["x"], projection["marker"]["symbol"], strict=True))
    assert symbols[4] == "circle" and symbols[8] == "circle-open"
    page = build_report(sim_shaped, timeline_events, None, "t")
    assert "projection from measured traces" in page and "projection from measured + analytic traces" in page


def test_measured_runs_show_the_gather_path_where_the_capture_recorded_it():
    """The Measured runs table's gather-path column is `traces.run_summaries`' figure in µs per Allgather,
    and a dash (with the reason in its title) for a run whose capture recorded no gather path — every run of
    the shipped `measured` bundle."""
    import dataclasses

    import traces
    from report.html import _measured_runs_table, measured_run_rows

    bundle = traces.read_bundle(traces.measured_bundle_path())
    rows = measured_run_rows(bundle)
    assert _measured_runs_table(rows).count("not recorded by this capture") == len(rows)
    # The same events with the ZeRO-3 runs' layer −1 segments read as the engine's gather path.
    events = bundle.events
    relabel = (
        events["run_id"].str.contains("-zero3-") & (events["stream"] == "compute") & (events["layer"] == -1)
    )
    recorded = dataclasses.replace(
        bundle, events=events.assign(stream=events["stream"].mask(relabel, "gather_host"))
    )
    rows = measured_run_rows(recorded)
    table = _measured_runs_table(rows)
    zero3 = [r for r in rows if r["system"] == "zero3"]
    assert zero3 and table.count("not recorded by this capture") == len(rows) - len(zero3)
    expected = traces.run_summaries(recorded).set_index("run_id")["gather_path_s_per_gather"]
    for row in zero3:
        assert f"<td>{expected[row['run_id']] * 1e6:.0f}</td>" in table
