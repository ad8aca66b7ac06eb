"""The report in a real browser: headless Chromium over the DevTools pipe (report.render_check).

Skipped when no Chromium is installed, unless CIERA_REQUIRE_BROWSER=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from report import build_report, write_report
from report.render_check import check_render, find_chromium

pytestmark = pytest.mark.browser


def _require_chromium() -> None:
    if find_chromium() is None:
        if os.environ.get("CIERA_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "CIERA_REQUIRE_BROWSER=1 but no Chromium found (install chromium or set CIERA_CHROMIUM)"
            )
        pytest.skip("no Chromium installed (set CIERA_REQUIRE_BROWSER=1 to make this a failure)")


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_report_renders_without_console_errors(tmp_path, records, timeline_events, bundle):
    _require_chromium()
    html_path = write_report(
        tmp_path / "report.html", build_report(records, timeline_events, bundle, "Browser test")
    )
    result = check_render(html_path, timeout_s=90, screenshot_path=tmp_path / "report.png")
    assert result.console_errors == []
    assert result.plotly_loaded
    assert result.plots_expected == 4 and result.plots_rendered == 4
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_render_check_catches_a_broken_page(tmp_path):
    _require_chromium()
    # The checker itself must see failures: a script error, and a plot div plotly never drew.
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!DOCTYPE html><html><body><div class="ciera-plot" id="a"></div>'
        "<script>console.error('deliberate'); undefinedFunction();</script></body></html>"
    )
    result = check_render(broken, timeout_s=3)
    assert any("deliberate" in error for error in result.console_errors)
    assert any("undefinedFunction" in error for error in result.console_errors)
    assert result.plots_expected == 1 and result.plots_rendered == 0 and not result.ok


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_render_check_script_prints_json(tmp_path, records):
    _require_chromium()
    html_path = write_report(tmp_path / "report.html", build_report(records, [], None, "Script test"))
    completed = subprocess.run(
        [sys.executable, "-m", "report.render_check", str(html_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert completed.returncode == 0, completed.stderr
    verdict = json.loads(completed.stdout)
    assert verdict["console_errors"] == [] and verdict["plots_rendered"] == 2 and verdict["ok"]


@pytest.mark.heavy
def test_report_of_the_measured_bundle_renders_its_measured_runs(tmp_path):
    _require_chromium()
    import traces

    # CPU-measured compute is not simulated under a GPU preset: the report renders the measured runs
    # without simulation records (what `ciera report --bundle measured` does).
    bundle = traces.read_bundle(traces.measured_bundle_path())
    page = build_report([], [], bundle, "Measured bundle")
    assert page.count('<tr class="measured">') == len(set(bundle.events["run_id"]))
    html_path = write_report(tmp_path / "measured.html", page)
    result = check_render(html_path, timeout_s=90)
    assert result.console_errors == []
    assert result.plots_rendered == result.plots_expected
