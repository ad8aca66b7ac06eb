"""`ciera report` end to end on files, and its one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from report import cli as report_cli


def _main_with_report_registered() -> None:
    """What `ciera_cli.main.main` does, for an app holding only the report command: user errors print as
    one line on stderr with exit code 2."""
    app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    report_cli.register(app)

    @app.callback()
    def _root() -> None:  # keeps `report` a subcommand, as under the real `ciera` app
        return None

    try:
        app()
    except report_cli.USER_ERRORS as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        sys.exit(2)


def _run(monkeypatch, capsys, *arguments: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ciera", *arguments])
    with pytest.raises(SystemExit) as exit_info:
        _main_with_report_registered()
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


@pytest.fixture
def records_file(tmp_path, records):
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"schema": "ciera.simulate/1", "records": records}))
    return path


@pytest.fixture
def timeline_file(tmp_path, timeline_events):
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"traceEvents": timeline_events}))
    return path


def test_report_from_files(monkeypatch, capsys, tmp_path, records_file, timeline_file):
    html_path = tmp_path / "out" / "report.html"
    html_path.parent.mkdir()
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(html_path),
        "--records",
        str(records_file),
        "--timeline",
        str(timeline_file),
    )
    assert code == 0, err
    document = html_path.read_text()
    assert 'id="fig-timeline"' in document and 'id="fig-speedup"' in document
    # Atomic write: no temporary sibling left behind.
    assert [p.name for p in html_path.parent.iterdir()] == ["report.html"]


def test_filters_select_records(monkeypatch, capsys, tmp_path, records_file):
    html_path = tmp_path / "report.html"
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(html_path),
        "--records",
        str(records_file),
        "--models",
        "Model-B",
        "--gpus",
        "4,128",
        "--dtype",
        "fp16",
    )
    assert code == 0, err
    document = html_path.read_text()
    assert document.count("<tr class=") == 2 * 6


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"schema": "ciera.simulate/0", "records": []}), "field 'schema': 'ciera.simulate/0'"),
        (json.dumps({"records": []}), "field 'schema': None"),
        (json.dumps({"schema": "ciera.simulate/1", "records": {}}), "field 'records'"),
        (
            json.dumps({"schema": "ciera.simulate/1", "records": [{"model": "m"}]}),
            "record 0, field 'dtype': missing",
        ),
    ],
)
def test_bad_records_file_is_one_line_exit_2(monkeypatch, capsys, tmp_path, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    html_path = tmp_path / "report.html"
    code, _, err = _run(monkeypatch, capsys, "report", "--html", str(html_path), "--records", str(bad))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert str(bad) in err and expected in err
    assert not html_path.exists(), "nothing is written on bad input"


def test_bad_field_value_names_record_and_field(monkeypatch, capsys, tmp_path, records):
    records[5]["iteration_s"]["p50"] = -1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "ciera.simulate/1", "records": records}))
    code, _, err = _run(
        monkeypatch, capsys, "report", "--html", str(tmp_path / "r.html"), "--records", str(bad)
    )
    assert code == 2
    assert "record 5, field 'iteration_s.p50': -1" in err and err.count("\n") == 1


def test_missing_records_file(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "nope.json"
    code, _, err = _run(
        monkeypatch, capsys, "report", "--html", str(tmp_path / "r.html"), "--records", str(missing)
    )
    assert code == 2 and str(missing) in err and "cannot read" in err and err.count("\n") == 1


def test_bad_timeline_file(monkeypatch, capsys, tmp_path, records_file):
    bad = tmp_path / "timeline.json"
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": "zero3", "tid": "compute", "ts": 0}]}))
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(tmp_path / "r.html"),
        "--records",
        str(records_file),
        "--timeline",
        str(bad),
    )
    assert code == 2 and "traceEvents[0], field 'dur': missing" in err and str(bad) in err


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--dtype", "fp32"], "--dtype: 'fp32'"),
        (["--gpus", "4,x"], "--gpus: 'x'"),
        (["--models", "Nope"], "--models: 'Nope' not in the records"),
        # Given but empty: a mistake, not a request for every model or W (the report was built before).
        (["--models", ""], "--models: empty"),
        (["--gpus", " , "], "--gpus: empty"),
    ],
)
def test_bad_options(monkeypatch, capsys, tmp_path, records_file, options, expected):
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(tmp_path / "r.html"),
        "--records",
        str(records_file),
        *options,
    )
    assert code == 2 and expected in err and err.count("\n") == 1


def test_output_directory_must_exist(monkeypatch, capsys, tmp_path, records_file):
    target = tmp_path / "missing-dir" / "r.html"
    code, _, err = _run(monkeypatch, capsys, "report", "--html", str(target), "--records", str(records_file))
    assert code == 2 and "does not exist" in err


def test_output_that_is_a_directory_is_one_line_exit_2(monkeypatch, capsys, tmp_path, records_file):
    target = tmp_path / "out"
    target.mkdir()
    code, _, err = _run(monkeypatch, capsys, "report", "--html", str(target), "--records", str(records_file))
    assert code == 2 and "is a directory" in err and len(err.strip().splitlines()) == 1, err
    assert list(target.iterdir()) == []
    assert not list(tmp_path.glob(".out.*"))


def test_report_simulates_when_no_records_are_given(monkeypatch, capsys, tmp_path):
    # A small slice of the default sweep through the sim API, on the shipped bundle.
    pytest.importorskip("sim.simulate")
    html_path = tmp_path / "report.html"
    code, _, err = _run(
        monkeypatch, capsys, "report", "--html", str(html_path), "--models", "OLMoE-1B-7B", "--gpus", "4,16"
    )
    assert code == 0, err
    document = html_path.read_text()
    assert "OLMoE-1B-7B" in document and "a100-hdr-testbed" in document
    assert document.count("<tr class=") == 2 * (5 + 6)  # bf16 without ZeRO++, fp16 with it
    assert 'id="fig-timeline"' in document and 'id="fig-exponents"' in document


def test_records_and_cluster_options_conflict(monkeypatch, capsys, tmp_path, records_file):
    code, _, err = _run(
        monkeypatch,
        capsys,
        "report",
        "--html",
        str(tmp_path / "r.html"),
        "--records",
        str(records_file),
        "--set",
        "inter_node.beta_Bps=1e9",
    )
    assert code == 2 and "--cluster/--set apply to a simulation" in err


@pytest.mark.heavy
def test_report_of_a_cpu_measured_bundle_says_why_nothing_is_simulated(tmp_path: Path) -> None:
    """`ciera report --bundle measured`: the measured runs render; the simulation is not made on the GPU
    preset (CPU compute under an A100 network), and the console says why instead of mixing them."""
    out = tmp_path / "measured.html"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "report", "--bundle", "measured", "--html", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "note: no simulation" in said and "no compute model is built" in said
    page = out.read_text()
    assert page.count('<tr class="measured">') == 64 and "No simulation records." in page
