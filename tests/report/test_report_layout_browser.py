"""The whole report laid out in headless Chromium at 1024 and 1600 px: no plot or text overlaps, no line
hides under another, nothing runs past its section, no table scrolls sideways — in the BF16 and the FP16
view, with real model names."""

from __future__ import annotations

import pytest

from report import build_report, write_report
from report.render_check import check_render

from .conftest import crafted_records, crafted_timeline
from .test_report_browser import _require_chromium
from .test_report_defects import coinciding_bundle, coinciding_sweep

pytestmark = pytest.mark.browser

MODELS = ("Llama-4-Scout-17B-16E", "Qwen2-57B-A14B", "OLMoE-1B-7B")


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("width_px", [1024, 1600])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_whole_report_has_no_layout_problems(tmp_path, width_px, dtype):
    _require_chromium()
    records = [r for r in crafted_records(models=MODELS, measured_model="none") if r["dtype"] == dtype]
    for r in records:  # coinciding CIERA lines: the notes under the speedup plot must fit too
        if r["system"] == "ciera-er-bsc":
            r["shards_selected"], r["shards_total"] = 40, 40
    # Lines that coincide exactly (router on attention, the CIERA variants over bandwidth) must all show,
    # and the exponent figure's model dropdown must fit above its panel titles.
    sweep = coinciding_sweep(models=MODELS, gpus=128)
    page = build_report(
        records, crafted_timeline(), coinciding_bundle(MODELS), "Layout test", sensitivity=sweep
    )
    html_path = write_report(tmp_path / "report.html", page)
    result = check_render(
        html_path,
        timeout_s=90,
        window_width_px=width_px,
        layout_selector="main",
        screenshot_path=tmp_path / "main.png",
    )
    assert result.console_errors == []
    assert result.plots_rendered == result.plots_expected == 5
    assert result.layout_problems == []
    assert (tmp_path / "main.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layout_check_sees_a_table_that_scrolls(tmp_path):
    _require_chromium()
    wide = "".join(f"<td>{'x' * 40}{i}</td>" for i in range(30))
    page = tmp_path / "wide.html"
    page.write_text(
        '<!DOCTYPE html><html><body><main style="width:600px"><div class="table-scroll" style="overflow:auto">'
        f"<table><tr>{wide}</tr></table></div></main></body></html>"
    )
    result = check_render(page, timeout_s=10, window_width_px=1024, layout_selector="main")
    assert any("needs horizontal scrolling" in problem for problem in result.layout_problems)
