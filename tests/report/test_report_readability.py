"""The report as users read it: summary first, coinciding lines named, log axes, the BF16 right panel,
per-W breakdown panels, exponent churn without flat panels, new record fields, --models names, a
timeline that must match the filter."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import pytest

from report import ReportInputError, build_report
from report.cli import resolve_model_names
from report.figures import breakdown_figure, bytes_split_text, exponent_figure, speedup_figure
from report.summary import coincidence_lines, coincidences, pays_text, summary_rows

from .conftest import crafted_bundle, crafted_records
from .test_report_cli import _run


def _figures(document: str) -> dict:
    payload = re.search(r"const cieraFigures = (\{.*?\});\n", document, re.S)
    assert payload
    return json.loads(payload.group(1).replace("<\\/", "</"))


def _coinciding_records() -> list[dict]:
    """Model-A: ER+BSC equals ER from W = 16 (every shard selected), CIERA equals ER+BSC with the codec off
    the critical path; at W <= 8 both select no shard and equal ZeRO-3."""
    records = crafted_records()
    by_key = {(r["model"], r["dtype"], r["gpus"], r["system"]): r for r in records}
    for r in records:
        if r["model"] != "Model-A" or r["dtype"] != "bf16":
            continue
        if r["system"] in ("ciera-er-bsc", "ciera"):
            er = by_key[("Model-A", "bf16", r["gpus"], "ciera-er")]
            if r["gpus"] <= 8:
                r.update(speedup_vs_zero3=1.0, shards_selected=0, shards_total=40)
            else:
                r.update(speedup_vs_zero3=er["speedup_vs_zero3"], shards_selected=40, shards_total=40)
                r["breakdown_s"] = {**r["breakdown_s"], "codec_critical": 0.0}
    return records


def test_coinciding_lines_are_named_with_their_reason():
    records = [r for r in _coinciding_records() if r["model"] == "Model-A" and r["dtype"] == "bf16"]
    lines = coincidence_lines(coincidences(records), sorted({r["gpus"] for r in records}), str)
    assert "ciera-er-bsc and ciera lie on ZeRO-3 (1.0×) at W = 4–8: selection chose no shard" in lines[0]
    assert any(
        "ciera-er-bsc lies on ciera-er at W = 16–128: BSC selected every shard" in line for line in lines
    )
    assert any(
        "ciera lies on ciera-er-bsc at W = 16–128: CCP" in line and "off the critical path" in line
        for line in lines
    )


def test_coinciding_lines_are_drawn_distinguishably_and_said_in_the_figure():
    figure = speedup_figure(_coinciding_records())
    left = [
        t for t in figure["data"] if t.get("xaxis") == "x" and t.get("legendgroup", "").startswith("ciera")
    ]
    left = [t for t in left if "(measured)" not in t["name"]][:3]  # view 0: Model-A bf16
    styles = {(t["line"]["dash"], t["line"]["width"], t["marker"]["symbol"][0]) for t in left}
    assert len(styles) == 3, "each CIERA variant needs its own dash, width and marker"
    widths = [t["line"]["width"] for t in left]
    assert widths == sorted(widths, reverse=True), "widest drawn first so thinner lines stay on top"
    notes = " ".join(a["text"] for a in figure["layout"]["annotations"])
    assert "BSC selected every shard" in notes and "CCP (pipelining) bought nothing" in notes
    go.Figure(figure)


def test_speedup_axes_are_log_and_span_zeropp():
    records = crafted_records()
    for r in records:
        if r["system"] == "zeropp":
            r["speedup_vs_zero3"] = 4.7
    figure = speedup_figure(records)
    layout = figure["layout"]
    assert layout["yaxis"]["type"] == "log"
    fp16 = figure["layout"]["updatemenus"][0]["buttons"][1]["args"][1]
    low, high = fp16["yaxis.range"]
    assert 10**high > 4.7 and 10**low < 1.0
    assert fp16["yaxis.type"] == "log" and fp16["yaxis2.type"] == "log"


def test_bf16_right_panel_shows_allgather_bytes_fp16_shows_zeropp():
    figure = speedup_figure(crafted_records())
    bf16, fp16 = (b["args"] for b in figure["layout"]["updatemenus"][0]["buttons"][:2])
    right_bf16 = [
        t for t, v in zip(figure["data"], bf16[0]["visible"], strict=True) if v and t.get("xaxis") == "x2"
    ]
    assert any("Allgather GB" in t["name"] for t in right_bf16)
    assert "Allgather GB" in bf16[1]["yaxis2.title.text"] and "ZeRO++" in fp16[1]["yaxis2.title.text"]
    titles = json.dumps(bf16[1]["annotations"])
    assert "Allgather bytes (ZeRO++ is FP16 only)" in titles
    # The page opens on view 0 exactly as the dropdown would show it.
    assert figure["layout"]["yaxis2"]["title"]["text"] == bf16[1]["yaxis2.title.text"]


def test_breakdown_has_a_panel_and_its_own_axis_per_world_size():
    figure = breakdown_figure(crafted_records())
    layout = figure["layout"]
    x_axes = sorted(k for k in layout if re.fullmatch(r"xaxis\d*", k))
    assert len(x_axes) == 6, "one time axis per W, so W = 4 is not flattened by W = 128"
    assert all("matches" not in layout[k] for k in x_axes)
    titles = [a["text"] for a in layout["annotations"]]
    assert "<b>W = 4</b>" in titles and "<b>W = 128</b>" in titles
    go.Figure(figure)


def test_exponent_churn_drops_flat_iterations_and_says_why():
    bundle = crafted_bundle()
    figure = exponent_figure(bundle.exponents, bundle.runs)
    titles = " ".join(a["text"] for a in figure["layout"]["annotations"])
    assert "over iterations" not in titles and "q vs block size" in titles
    assert figure["layout"]["yaxis"]["type"] == "log"
    page = build_report(crafted_records(), [], bundle, "t")
    assert "q over iterations is not drawn: the bundle holds 5 iterations per run" in page


def test_summary_comes_first_with_best_system_and_where_ciera_pays():
    records = crafted_records()
    for r in records:  # CIERA gains nothing at W = 4
        if r["system"] == "ciera" and r["gpus"] == 4:
            r["speedup_vs_zero3"] = 1.0
    page = build_report(records, [], None, "t")
    assert page.index('id="summary"') < page.index('id="speedup"')
    rows = summary_rows(records, lambda r: "analytic projection")
    model_a = next(r for r in rows if r.model == "Model-A" and r.dtype == "bf16")
    assert model_a.best[64][0] == "ciera" and pays_text(model_a) == "from W = 8"
    never = summary_rows([{**r, "speedup_vs_zero3": 1.0} for r in records], lambda r: "x")
    assert pays_text(never[0]) == "never (no swept W)"
    assert "At W = 64:" in page and "pays for 2 of them" in page


def test_new_record_fields_shown_when_present_and_their_absence_said():
    old = crafted_records()
    for r in old:
        if r["system"] != "ciera":
            r["bound_speedup"] = None
    page = build_report(old, [], None, "t")
    assert "intra/inter-node split of the Allgather bytes is not in these records" in page
    assert "the record states no bound for that system" in page
    speedup = _figures(page)["fig-speedup"]
    fsdp = next(t for t in speedup["data"] if t.get("legendgroup") == "fsdp" and t["xaxis"] == "x")
    assert all(c[4] == "none stated for this system" for c in fsdp["customdata"])
    bands = [t for t in speedup["data"] if "bound:" in t.get("name", "")]
    assert bands and all(t["name"].startswith("CIERA bound") for t in bands)
    new = crafted_records()
    for r in new:
        r["allgather_bytes_intra_node_per_iter"] = 1e9
        r["allgather_bytes_inter_node_per_iter"] = r["allgather_bytes_per_iter"] - 1e9
    page = build_report(new, [], None, "t")
    assert "not in these records" not in page and "(one rank receives: intra / inter-node)" in page
    assert "intra-node 1 GB" in bytes_split_text(new[0])
    speedup = _figures(page)["fig-speedup"]
    assert any("inter-node GB" in t["name"] for t in speedup["data"])


def test_model_names_resolve_short_and_any_case():
    assert resolve_model_names(["olmoe", "MIXTRAL"]) == ["OLMoE-1B-7B", "Mixtral-8x7B"]
    assert resolve_model_names(["model-a"], ["Model-A", "Model-B"]) == ["Model-A"]
    with pytest.raises(ReportInputError, match=r"'OLMoE-1B-7B' and 'olmoe' are the same model"):
        resolve_model_names(["olmoe", "OLMoE-1B-7B"])
    with pytest.raises(ReportInputError, match=r"--models: 'olmoe' \(OLMoE-1B-7B\) not in the records"):
        resolve_model_names(["olmoe"], ["Model-A"])


@pytest.fixture
def sim_shaped_files(tmp_path):
    records = crafted_records(models=("OLMoE-1B-7B", "Mixtral-8x7B"))
    records_path = tmp_path / "records.json"
    records_path.write_text(json.dumps({"schema": "ciera.simulate/1", "records": records}))
    timeline_path = tmp_path / "timeline.json"
    timeline_path.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "M",
                        "name": "process_name",
                        "pid": 1,
                        "args": {"name": "ciera — Mixtral-8x7B bf16 W=128"},
                    },
                    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "allgather"}},
                    {"ph": "X", "name": "gather", "pid": 1, "tid": 2, "ts": 0.0, "dur": 5.0},
                ]
            }
        )
    )
    return records_path, timeline_path


def test_cli_short_model_name_and_duplicate(monkeypatch, capsys, tmp_path, sim_shaped_files):
    records_path, _ = sim_shaped_files
    html_path = tmp_path / "r.html"
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(html_path),
        "--records",
        str(records_path),
        "--models",
        "olmoe",
    )
    assert code == 0, err
    assert html_path.read_text().count("<tr class=") == 6 * 11
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(tmp_path / "d.html"),
        "--records",
        str(records_path),
        "--models",
        "olmoe,OLMOE-1B-7B",
    )
    assert code == 2 and err.count("\n") == 1 and "are the same model (OLMoE-1B-7B)" in err


def test_cli_refuses_a_timeline_that_does_not_match_the_filter(
    monkeypatch, capsys, tmp_path, sim_shaped_files
):
    records_path, timeline_path = sim_shaped_files
    html_path = tmp_path / "r.html"
    code, _, err = _run(
        monkeypatch, capsys, "report", "--html", str(html_path), "--records", str(records_path),
        "--timeline", str(timeline_path), "--models", "olmoe", "--gpus", "32",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "shows Mixtral-8x7B bf16 W=128, which is not among the report's records" in err
    assert not html_path.exists()
    code, _, err = _run(
        monkeypatch, capsys, "report", "--html", str(html_path), "--records", str(records_path),
        "--timeline", str(timeline_path), "--models", "mixtral",
    )  # fmt: skip
    assert code == 0, err
    assert "<b>Simulated: Mixtral-8x7B bf16 W=128.</b>" in html_path.read_text()
