"""The report's verdicts are the simulator's (sim.verdict): what does not fit is marked and left out, FP16
verdicts name a faster ZeRO++, every verdict says what it rests on; `ciera report --records` fills its
bandwidth section from the records' own preset and ends its console with the summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import traces
from report.html import build_report
from sim import load_cluster, simulate


@pytest.fixture(scope="module")
def records() -> list[dict]:
    bundle = traces.read_bundle(traces.default_bundle_path())
    simulated = simulate(
        bundle, load_cluster("a100-hdr-testbed"), models=["scout", "olmoe"], gpus=[8, 16, 32],
        systems=["zero3", "zeropp", "ciera"],
    )  # fmt: skip
    return [record.to_dict() for record in simulated]


def _summary(page: str) -> str:
    return page[page.index('id="summary"') : page.index('id="speedup"')]


def test_what_does_not_fit_is_marked_in_the_summary_and_the_records_table(records: list[dict]) -> None:
    page = build_report(records, [], None, "t")
    summary = _summary(page)
    assert summary.count("does not fit (") >= 4  # Llama-4-Scout at W = 8 and 16, both dtypes
    assert "Left out of “fastest” and “pays from”" in summary
    left_out = summary[summary.index("Left out of") :]
    # W sorted as numbers: W = 8 before W = 16 for the same model and system.
    assert left_out.index("Llama-4-Scout-17B-16E, W = 8") < left_out.index("Llama-4-Scout-17B-16E, W = 16")
    table = page[page.index('id="records-table"') :] if 'id="records-table"' in page else page
    assert "GiB / GPU" in page and "✗" in table


def test_fp16_verdicts_name_a_faster_zeropp_and_every_verdict_its_basis(records: list[dict]) -> None:
    summary = _summary(build_report(records, [], None, "t"))
    assert "pays over ZeRO-3 for" in summary and "ZeRO++ (lossy, int8 weights) is faster for" in summary
    assert "ZeRO++ (lossy) is faster," in summary  # in the FP16 rows' "pays" column
    assert "the first W that spans nodes (2 × 8 GPUs" in summary
    assert "inter-node β" in summary and 'href="#sensitivity"' in summary
    assert "at least 1.01× over ZeRO-3" in summary


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_report_from_records_fills_the_bandwidth_section_and_ends_with_the_summary(tmp_path: Path) -> None:
    sim_json, html = tmp_path / "sim.json", tmp_path / "r.html"
    common = [sys.executable, "-m", "ciera_cli.main"]
    done = subprocess.run(
        [*common, "simulate", "--models", "olmoe", "--gpus", "8,16", "--dtype", "bf16", "--systems", "zero3,ciera",
         "--json", str(sim_json)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(sim_json.read_text())
    assert document["cluster_option"] == "a100-hdr-testbed" and document["overrides"] == []
    done = subprocess.run(
        [*common, "report", "--records", str(sim_json), "--html", str(html)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bandwidth sensitivity:" in done.stderr and "without --sensitivity" not in done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("Summary (pays: ≥ 1.01×") and "OLMoE-1B-7B bf16: CIERA pays" in lines[1]
    assert lines[-1].strip().startswith("every verdict rests on the inter-node β")
    page = html.read_text()
    sensitivity = page[page.index('id="sensitivity"') : page.index('id="breakdown"')]
    assert "fig-sensitivity" in sensitivity and 'class="empty"' not in sensitivity
