"""The report's speedup-vs-link-bandwidth section: break-even text, `--sensitivity` files and their
one-line errors, the section simulated in place, and the page in a real browser."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from report import build_report, write_report
from report import cli as report_cli
from report.sensitivity import break_even, load_sensitivity, sweep_grid_Bps

BETA_NOTE = "inter-node β 4.42 GB/s of testbed: fitted to the preset's calibration points"


def _record(model: str, system: str, speedup: float, gpus: int = 32, dtype: str = "bf16") -> dict[str, Any]:
    """A ciera.simulate/1 record with just what the report checks; zero3's iteration is 2 s."""
    iteration_s = 2.0 / speedup
    return {
        "model": model,
        "dtype": dtype,
        "gpus": gpus,
        "system": system,
        "source": "analytic",
        "projected": True,
        "iteration_s": {"p5": 0.97 * iteration_s, "p50": iteration_s, "p95": 1.03 * iteration_s},
        "breakdown_s": {
            "compute": 1.0,
            "exposed_allgather": iteration_s - 1.0,
            "exposed_reduce_scatter": 0.0,
            "codec_critical": 0.0,
            "other": 0.0,
        },
        "speedup_vs_zero3": speedup,
        "cluster": "testbed",
        "notes": [BETA_NOTE],
    }


# CIERA's speedup at 2, 8 and 32 GB/s: pays, pays less, no gain (crossing between 8 and 32 GB/s).
CIERA_SPEEDUPS = {"2e9": 1.5, "8e9": 1.2, "32e9": 0.9}
FSDP_SPEEDUPS = {"2e9": 1.1, "8e9": 1.05, "32e9": 1.02}


def _sweep_document() -> dict[str, Any]:
    """What `ciera simulate --sweep inter_node.beta_Bps=2e9,8e9,32e9 --json` writes, for one model."""
    return {
        "schema": "ciera.simulate.sweep/1",
        "key": "inter_node.beta_Bps",
        "values": list(CIERA_SPEEDUPS),
        "cluster": "testbed",
        "runs": [
            {
                "value": value,
                "schema": "ciera.simulate/1",
                "records": [
                    _record("Model-A", "zero3", 1.0),
                    _record("Model-A", "fsdp", FSDP_SPEEDUPS[value]),
                    _record("Model-A", "ciera", CIERA_SPEEDUPS[value]),
                ],
            }
            for value in CIERA_SPEEDUPS
        ],
    }


def _records_document() -> dict[str, Any]:
    records = [
        _record("Model-A", system, speedup, gpus=gpus)
        for gpus in (8, 32)
        for system, speedup in (("zero3", 1.0), ("fsdp", 1.08), ("ciera", 1.4))
    ]
    return {"schema": "ciera.simulate/1", "records": records, "cluster": "testbed"}


def _main_with_report_registered() -> None:
    """What `ciera_cli.main.main` does for the report command: user errors are one line, exit code 2."""
    app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    report_cli.register(app)

    @app.callback()
    def _root() -> None:
        return None

    try:
        app()
    except report_cli.USER_ERRORS as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        sys.exit(2)


def _run(monkeypatch, capsys, *arguments: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["ciera", "report", *arguments])
    with pytest.raises(SystemExit) as exit_info:
        _main_with_report_registered()
    return int(exit_info.value.code or 0), capsys.readouterr().err


def _words(console_text: str) -> str:
    """The console wraps long lines at its width; the words are what the tests read."""
    return " ".join(console_text.split())


def _figures(document: str) -> dict[str, Any]:
    payload = re.search(r"const cieraFigures = (\{.*?\});\n", document)
    assert payload is not None
    return json.loads(payload.group(1).replace("<\\/", "</"))


def _section(document: str) -> str:
    start = document.index('<section id="sensitivity">')
    return document[start : document.index("</section>", start)]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    records_path = tmp_path / "records.json"
    records_path.write_text(json.dumps(_records_document()))
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps(_sweep_document()))
    return {"records": records_path, "sweep": sweep_path, "html": tmp_path / "report.html"}


# ------------------------------------------------------------------------------------------ break-even


def test_break_even_interpolates_the_crossing_in_log_bandwidth():
    result = break_even([(8e9, 1.2), (2e9, 1.5), (32e9, 0.9)])  # unordered on purpose
    # 1.2 -> 0.9 over 8 -> 32 GB/s falls to the 1.01× "pays" threshold 0.19/0.3 of the way in log
    # bandwidth: 8·4^(0.19/0.3).
    assert result.kind == "crosses"
    assert result.bandwidth_Bps == pytest.approx(8e9 * 4 ** (0.19 / 0.3))
    assert result.text == (
        "stops paying between 8 GB/s and 32 GB/s (interpolated ≈ 19.2 GB/s): 1.200× at 8 GB/s, 0.900× at 32 GB/s"
    )
    assert result.short == "stops paying at 8–32 GB/s"


def test_break_even_at_exactly_one_names_the_interval_only():
    # 1.0 exactly is the plain schedule chosen over compression: the crossing is somewhere in (16, 32].
    result = break_even([(16e9, 1.04), (32e9, 1.0)])
    assert result.kind == "crosses" and result.bandwidth_Bps == pytest.approx(32e9)
    assert "interpolated" not in result.text
    assert result.text.startswith("stops paying between 16 GB/s and 32 GB/s: 1.040×")


@pytest.mark.parametrize(
    ("points", "kind", "text"),
    [
        ([(2e9, 1.5), (4e9, 1.2), (8e9, 1.01)], "always", "pays at every swept bandwidth (2 GB/s–8 GB/s)"),
        ([(2e9, 1.0), (4e9, 0.97)], "never", "never pays in the swept range (2 GB/s–4 GB/s): at most 1.000×"),
        ([(2e9, 0.95), (4e9, 1.1)], "rises", "no gain up to 2 GB/s (0.950×), pays from 4 GB/s"),
        ([(2e9, 1.2), (4e9, 0.9), (8e9, 1.1)], "crosses", "; pays again at 8 GB/s (1.100×)"),
        # Noise around 1.0 is no crossing: one threshold (1.01×) for "pays", as in the summary.
        ([(2e9, 1.0000083), (4e9, 0.999995)], "never", "never pays in the swept range"),
    ],
)
def test_break_even_without_a_single_crossing(points, kind, text):
    result = break_even(points)
    assert result.kind == kind and text in result.text


def test_grid_is_round_gigabytes_per_second_around_the_cluster():
    grid_Bps = sweep_grid_Bps(4.42e9)
    assert [b / 1e9 for b in grid_Bps] == [2, 4, 8, 16, 32, 64]
    assert sweep_grid_Bps(25e9)[0] == 8e9


# ---------------------------------------------------------------------------------------- --sensitivity


def test_sensitivity_file_draws_the_section(monkeypatch, capsys, files):
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--sensitivity",
        str(files["sweep"]),
    )
    assert code == 0, err
    document = files["html"].read_text()
    assert '<a href="#sensitivity">' in document
    section = _section(document)
    assert 'id="fig-sensitivity"' in section and 'id="sensitivity-table"' in section
    assert "stops paying between 8 GB/s and 32 GB/s (interpolated ≈ 19.2 GB/s)" in section
    assert "4.42 GB/s" in section and "simulated projection" in section
    figure = _figures(document)["fig-sensitivity"]
    lines = {trace["name"]: trace for trace in figure["data"]}
    assert lines["CIERA (ER+BSC+CCP)"]["x"] == [2, 8, 32]
    assert lines["CIERA (ER+BSC+CCP)"]["y"] == [1.5, 1.2, 0.9]
    assert lines["FSDP"]["y"] == [1.1, 1.05, 1.02]
    assert "ZeRO-3" not in lines, "the baseline is the 1.0 line, not a system line"
    assert lines["no gain (1.0×)"]["y"] == [1, 1]
    assert lines["this cluster's β: 4.42 GB/s"]["x"] == [4.42, 4.42]
    assert figure["layout"]["xaxis"]["type"] == "log" and "GB/s" in figure["layout"]["xaxis"]["title"]["text"]
    assert figure["layout"]["xaxis"]["tickvals"] == [2, 8, 32]


def test_without_sensitivity_data_the_section_says_how_to_make_it(monkeypatch, capsys, files):
    code, err = _run(monkeypatch, capsys, "--html", str(files["html"]), "--records", str(files["records"]))
    assert code == 0, err
    assert "no link bandwidth sensitivity" in _words(err)  # on the console too, not only in the page
    section = _section(files["html"].read_text())
    assert "fig-sensitivity" not in section
    assert "--records was given without --sensitivity" in section
    assert (
        "ciera simulate --sweep inter_node.beta_Bps=2e9,4e9,8e9,16e9,32e9,64e9 --models Model-A --gpus 32 "
        "--dtype bf16 --cluster testbed --json sweep.json"
    ) in section


def _bad(document: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    target: Any = document
    for step in path[:-1]:
        target = target[step]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            ["schema"],
            "ciera.simulate/1",
            "field 'schema': 'ciera.simulate/1', expected 'ciera.simulate.sweep/1'",
        ),
        (["key"], "ciera.block_size", "field 'key': 'ciera.block_size', expected a bandwidth field"),
        (["runs", 1, "records"], KeyError, "runs[1], field 'records': missing"),
        (["runs", 0, "records"], [], "runs[0]: field 'records': empty list"),
        (
            ["runs", 2, "records", 1, "speedup_vs_zero3"],
            -1,
            "runs[2]: record 1, field 'speedup_vs_zero3': -1",
        ),
        (["values", 1], "fast", "field 'values[1]': 'fast', expected a bandwidth in B/s"),
        (["values", 0], "0", "field 'values[0]': '0', expected a bandwidth in B/s > 0"),
        (["runs"], [], "field 'runs': 0 runs for 3 values"),
        (["values"], ["2e9"], "field 'values': ['2e9'], expected a list of two or more bandwidths"),
    ],
    ids=["schema", "key", "no-records", "empty-records", "bad-record", "value", "zero", "runs", "one-value"],
)
def test_bad_sensitivity_file_is_one_line_exit_2(monkeypatch, capsys, files, path, value, expected):
    bad = files["sweep"].with_name("bad-sweep.json")
    bad.write_text(json.dumps(_bad(_sweep_document(), path, value)))
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--sensitivity",
        str(bad),
    )
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: "), err
    assert expected in err, err
    assert not files["html"].exists(), "nothing is written on bad input"


@pytest.mark.parametrize(
    ("content", "expected"),
    [("{not json", "not valid JSON"), (None, "cannot read file"), ("[]", "top level is list")],
)
def test_unreadable_sensitivity_file_is_one_line_exit_2(monkeypatch, capsys, files, content, expected):
    bad = files["sweep"].with_name("other.json")
    if content is not None:
        bad.write_text(content)
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--sensitivity",
        str(bad),
    )
    assert code == 2 and err.count("\n") == 1 and str(bad) in err and expected in err, err


def test_sensitivity_of_other_models_is_refused(monkeypatch, capsys, files):
    document = _sweep_document()
    for run in document["runs"]:
        for record in run["records"]:
            record["model"] = "Model-Z"
    files["sweep"].write_text(json.dumps(document))
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--sensitivity",
        str(files["sweep"]),
    )
    assert code == 2 and err.count("\n") == 1
    assert "no records of the report's models (Model-A)" in err and "Model-Z bf16 W=32" in err


def test_load_sensitivity_reads_what_ciera_simulate_sweep_writes(tmp_path):
    """The file the simulator's own `--sweep` writes (not a crafted one) loads and draws."""
    pytest.importorskip("sim.simulate")
    from typer.testing import CliRunner

    from sim import cli as sim_cli

    app = typer.Typer(add_completion=False)
    sim_cli.register(app)
    sweep_path = tmp_path / "sweep.json"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--sweep",
            "inter_node.beta_Bps=2e9,64e9",
            "--models",
            "OLMoE-1B-7B",
            "--gpus",
            "16",
            "--dtype",
            "bf16",
            "--systems",
            "zero3,ciera",
            "--json",
            str(sweep_path),
        ],
    )
    assert result.exit_code == 0, result.output
    sweep = load_sensitivity(sweep_path)
    assert [p.bandwidth_Bps for p in sweep.points] == [2e9, 64e9]
    records = [dict(r) for r in sweep.points[0].records]
    page = build_report(records, [], None, "sweep", sensitivity=sweep)
    assert 'id="fig-sensitivity"' in _section(page)


# ------------------------------------------------------------------------------------ simulated in place


def test_report_simulates_the_bandwidth_sweep(monkeypatch, capsys, tmp_path):
    pytest.importorskip("sim.simulate")
    html_path = tmp_path / "report.html"
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(html_path),
        "--models",
        "OLMoE-1B-7B",
        "--gpus",
        "16",
        "--dtype",
        "bf16",
    )
    assert code == 0, err
    assert re.search(r"bandwidth sensitivity: 7 bandwidths × 1 model at W=16, bf16 in [0-9.]+ s", _words(err))
    document = html_path.read_text()
    section = _section(document)
    assert 'id="sensitivity-table"' in section and "OLMoE-1B-7B" in section
    assert "Simulated by ciera report at W=16" in section and "Not swept: ZeRO++ (FP16 only" in section
    figure = _figures(document)["fig-sensitivity"]
    ciera = next(trace for trace in figure["data"] if trace.get("legendgroup") == "ciera")
    assert ciera["name"].startswith("CIERA (ER+BSC+CCP)")  # and, when it lies on a variant, which
    assert len(ciera["x"]) == 7 and ciera["x"] == sorted(ciera["x"])
    # The point at the cluster's own β is the record the other sections show.
    speedup_records = [
        trace for trace in _figures(document)["fig-speedup"]["data"] if trace["name"] == "CIERA (ER+BSC+CCP)"
    ]
    reference_GBps = next(t for t in figure["data"] if t["name"].startswith("this cluster's β"))["x"][0]
    at_reference = ciera["y"][ciera["x"].index(reference_GBps)]
    assert any(math.isclose(at_reference, y) for trace in speedup_records for y in trace["y"])


def test_single_node_report_says_why_there_is_no_sweep(monkeypatch, capsys, tmp_path):
    pytest.importorskip("sim.simulate")
    html_path = tmp_path / "report.html"
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(html_path),
        "--models",
        "OLMoE-1B-7B",
        "--gpus",
        "4",
        "--dtype",
        "bf16",
    )
    assert code == 0, err
    assert "fits in one node" in _words(err)
    section = _section(html_path.read_text())
    assert "fits in one node" in section and "fig-sensitivity" not in section


# ------------------------------------------------------------------------------------------- browser


@pytest.mark.browser
@pytest.mark.parametrize("width_px", [1024, 1600])
def test_sensitivity_section_renders_in_a_browser(tmp_path, width_px):
    from report.render_check import check_render, find_chromium

    if find_chromium() is None:
        if os.environ.get("CIERA_REQUIRE_BROWSER") == "1":
            pytest.fail("CIERA_REQUIRE_BROWSER=1 but no Chromium found")
        pytest.skip("no Chromium installed (set CIERA_REQUIRE_BROWSER=1 to make this a failure)")
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps(_sweep_document()))
    page = build_report(
        _records_document()["records"], [], None, "Sensitivity", sensitivity=load_sensitivity(sweep_path)
    )
    html_path = write_report(tmp_path / "report.html", page)
    result = check_render(html_path, timeout_s=90, window_width_px=width_px)
    assert result.console_errors == []
    assert result.plots_expected == 3 and result.plots_rendered == 3  # speedup, sensitivity, breakdown
