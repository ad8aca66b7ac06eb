"""The report's Validation section: what `ciera validate lossless/divergence/sim --json` wrote (real
outputs of short runs, in tests/report/data), the files' one-line errors, CIERA's exact zeros on the log
axes, and the section in a real browser at 1024 and 1600 px without overlaps."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from report import ReportInputError, build_report, write_report
from report import cli as report_cli
from report.validation import (
    DIVERGENCE_SCHEMA,
    LOSSLESS_SCHEMA,
    SIM_SCHEMA,
    ValidationFile,
    ValidationResults,
    load_validation,
    producing_command,
    validate_validation_document,
)

DATA = Path(__file__).parent / "data"
SAMPLES = {kind: DATA / f"validate-{kind}.json" for kind in ("lossless", "divergence", "sim")}
# A critical path's parts (sim.evaluate.critical_path), as `ciera validate sim` writes them per run.
PATH = {
    "compute": 1.0,
    "exposed_allgather": 0.5,
    "exposed_reduce_scatter": 0.2,
    "codec_critical": 0.1,
    "other": 0.0,
}


def _sample(kind: str) -> dict[str, Any]:
    return json.loads(SAMPLES[kind].read_text())


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


def _words(text: str) -> str:
    return " ".join(text.split())


def _figures(document: str) -> dict[str, Any]:
    payload = re.search(r"const cieraFigures = (\{.*?\});\n", document)
    assert payload is not None
    return json.loads(payload.group(1).replace("<\\/", "</"))


def _section(document: str) -> str:
    start = document.index('<section id="validation">')
    return document[start : document.index("</section>", start)]


def _text(fragment: str) -> str:
    """The section's words without tags, as a reader sees them."""
    return _words(re.sub(r"<[^>]+>", " ", fragment))


@pytest.fixture
def files(tmp_path: Path, records) -> dict[str, Path]:
    records_path = tmp_path / "records.json"
    records_path.write_text(json.dumps({"schema": "ciera.simulate/1", "records": records}))
    return {"records": records_path, "html": tmp_path / "report.html"}


def test_schemas_are_the_validation_commands_own():
    from validation import divergence, lossless, sim_check

    assert (LOSSLESS_SCHEMA, DIVERGENCE_SCHEMA, SIM_SCHEMA) == (
        lossless.SCHEMA,
        divergence.SCHEMA,
        sim_check.SCHEMA,
    )


# ------------------------------------------------------------------------------------------ the section


def test_section_from_the_sample_files(monkeypatch, capsys, files):
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--validation",
        f"{SAMPLES['lossless']},{SAMPLES['divergence']}",  # comma-separated ...
        "--validation",
        str(SAMPLES["sim"]),  # ... and repeated
    )
    assert code == 0, err
    assert "validation JSON" not in err, "nothing is missing, so no note"
    document = files["html"].read_text()
    nav = document[document.index("<nav>") : document.index("</nav>")]
    assert nav.index("#validation") < nav.index("#records")
    section = _section(document)
    text = _text(section)
    # Lossless: every figure the command prints, in its words.
    for expected in (
        "Lossless: bit for bit against the plain engine — PASSED",
        "steps compared (every step: loss bits, SHA-256 of every tensor) 4",
        "tensors compared per step (parameters + Adam states) 348",
        "checkpointed and resumed with CIERA after step 2",
        "steps whose loss differs 0",
        "steps whose state differs 0",
        "0 (steps 2, 4)",
        "88.2 MB → 51.1 MB",
        "bytes saved 42.0 %",
        "flagged yes (3 steps)",
        "tensors differing 0, 347",
        "0.000624, 0.00208",
        "PASSED : bit-identical at every step, and the lossy control flagged",
        "Measured, not simulated",
    ):
        assert expected in text, expected
    assert (
        f"ciera validate lossless --engine fsdp --steps 4 --world-size 2 --model small-moe --layers 2 "
        f"--seed 0 --json {SAMPLES['lossless']}"
    ) in text
    # Divergence: the command, CIERA's zeros in words, the seed yardstick, the last-checkpoint table.
    assert (
        "ciera validate divergence --engine fsdp --steps 4 --checkpoints 2 --world-size 2 --model small-moe "
        f"--layers 2 --held-out-sequences 8 --seed 0 --json {SAMPLES['divergence']}"
    ) in text
    assert "CIERA (lossless): exactly 0 at every checkpoint" in text
    assert "int8 weight gathers (lossy): KL exactly 0 at step 0" in text
    assert "as different as a new seed" in text
    assert "Flip-margin AUC not defined" in text and "CIERA (lossless) (no routing decision flipped)" in text
    assert "another seed: as different as a new seed (every routing decision flipped)" in text
    table = section[section.index('id="validation-divergence-table-0"') :]
    table = _text(table[: table.index("</table>")])
    assert "arm, at step 4" in table
    assert "int8 weight gathers (lossy) 3.23e-05 0.000321 7.42 % 0.0742 98.05 % 0.0379 0.919" in table
    assert "CIERA (lossless) 0 0 0 % 0 100 % 0 —" in table
    assert "another seed: as different as a new seed 0.101 1 100 % 1 48.44 % 1 —" in table
    # Validate sim: per category mean/max and pass/fail, and the measurement noise.
    for expected in (
        "Simulator against measured runs it was not given — FAILED",
        "depth 2 6.7 % 11.0 % -11.0 … +2.3 % ≤ 4 % mean, ≤ 8 % max FAILED",
        "system 30 7.4 % 29.6 % -10.5 … +29.6 % ≤ 4 % mean, ≤ 8 % max FAILED",
        "replay of the seen runs 6 0.0 % 0.0 %",
        "all held-out runs 56 7.6 % 29.6 %",
        "differ by 14.6 % on average and up to 42.1 %",
        "misses its own points by 1.9 % on average, 7.2 % at most",
        "ciera validate sim --bundle measured --held-out",
    ):
        assert expected in text, expected


def test_divergence_figures_draw_ciera_zeros_and_the_seed_reference(tmp_path):
    page = build_report([], [], None, "Validation", validation=load_validation([SAMPLES["divergence"]]))
    figures = _figures(page)
    sample = _sample("divergence")
    kl = {trace["name"]: trace for trace in figures["fig-divergence-0-kl"]["data"]}
    # A log axis has no 0: CIERA's zeros are markers on the "= 0" strip, not dropped.
    assert kl["CIERA (lossless)"]["y"] == [None, None, None]
    zeros = kl["CIERA (lossless): = 0"]
    assert zeros["yaxis"] == "y2" and zeros["x"] == [0, 2, 4] and zeros["y"] == [0, 0, 0]
    layout = figures["fig-divergence-0-kl"]["layout"]
    assert layout["yaxis"]["type"] == "log" and layout["yaxis2"]["ticktext"] == ["= 0"]
    seed = kl["another seed: as different as a new seed"]
    assert seed["line"]["dash"] == "dash" and seed["y"] == [p["kl"] for p in sample["arms"][3]["points"]]
    assert kl["int8 weight gathers (lossy): = 0"]["x"] == [0, None, None]  # only step 0 is exactly 0
    routing = {trace["name"]: trace for trace in figures["fig-divergence-0-routing"]["data"]}
    assert routing["CIERA (lossless): = 0"]["y"] == [0, 0, 0]
    top1 = {trace["name"]: trace for trace in figures["fig-divergence-0-top1"]["data"]}
    assert top1["CIERA (lossless)"]["y"] == [1.0, 1.0, 1.0]
    near_tie = figures["fig-divergence-0-near-tie"]["data"]
    assert len(near_tie) == 1, "the near-tie share is the reference run's: drawn once"
    assert near_tie[0]["y"] == [p["near_tie_share"] for p in sample["arms"][0]["points"]]
    auc = {trace["name"] for trace in figures["fig-divergence-0-auc"]["data"]}
    assert auc == {
        "1-ULP nudge of one router weight",
        "int8 weight gathers (lossy)",
        "0.5: flips unrelated to the margin",
    }


def test_kl_rounded_below_zero_is_drawn_on_the_zero_strip_and_said():
    document = _edit(_sample("divergence"), ["arms", 1, "points", 0, "kl"], -2e-12)
    page = build_report(
        [],
        [],
        None,
        "rounding",
        validation=ValidationResults((ValidationFile("divergence", "<api>", document),)),
    )
    kl = {trace["name"]: trace for trace in _figures(page)["fig-divergence-0-kl"]["data"]}
    assert kl["1-ULP nudge of one router weight: = 0"]["x"] == [0, None, None]
    assert kl["1-ULP nudge of one router weight"]["y"][0] is None
    assert "KL below 0 by rounding (-2e-12 at step 0)" in _text(_section(page))


def test_without_validation_files_the_section_shows_the_shipped_sim_check(monkeypatch, capsys, files):
    """No --validation: the section is not empty — it shows the simulator's shipped check of the measured
    bundle (labelled as shipped, with the command that remakes it) and names the commands for the rest."""
    code, err = _run(monkeypatch, capsys, "--html", str(files["html"]), "--records", str(files["records"]))
    assert code == 0, err
    assert (
        "no --validation file given: the Validation section shows the shipped `ciera validate sim`"
        in _words(err)
    )
    text = _text(_section(files["html"].read_text()))
    assert "Shipped with CIERA" in text and "Not shown (no file given):" in text
    shipped = json.loads(
        (Path(__file__).resolve().parents[2] / "report/data/validate-sim-measured.json").read_text()
    )
    verdicts = shipped["ciera_verdicts"]
    agreeing = sum(row["same_side"] for row in verdicts)
    assert f"faster or slower as measured in {agreeing} of {len(verdicts)} pairs" in text
    # The runs over the max target, each beside its own depth line's miss (no model involved).
    over = [
        r
        for r in shipped["held_out"]
        if r["error"] is not None and abs(r["error"]) > 2 * shipped["tolerance"]
    ]
    assert over and "Over the max target" in text
    for row in over:
        assert f"L = {row['layers']}, {row['error'] * 100:+.1f} % — its own line misses it by" in text
        # ... and its critical path, measured → predicted, part by part (what the console prints).
        measured, predicted = (row["critical_path_s"][side] for side in ("measured", "predicted"))
        assert (
            f"exposed all-gather {measured['exposed_allgather'] * 1e3:.0f} → "
            f"{predicted['exposed_allgather'] * 1e3:.0f}" in text
        )
    assert "Where the predictions miss: the critical path of the middle iteration" in text
    for name in shipped["held_out_path_miss_by_category"]:
        assert f"{name}: " in text.split("Where the predictions miss")[1]
    for command in (
        "ciera validate sim --bundle measured --held-out traces/data/measured.held-out.toml",
        "ciera validate lossless --engine zero3 --json lossless.json",
        "ciera validate divergence --engine zero3 --json divergence.json",
        "ciera report --validation FILE[,FILE…]",
    ):
        assert command in text, command
    assert "No validation results were given." not in text


def test_a_partial_set_says_what_is_missing(monkeypatch, capsys, files):
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--validation",
        str(SAMPLES["lossless"]),
    )
    assert code == 0, err
    assert "no divergence, sim validation JSON given" in _words(err)
    text = _text(_section(files["html"].read_text()))
    assert "Lossless: bit for bit" in text and "Not given:" in text
    assert "ciera validate divergence" in text and "fig-divergence" not in files["html"].read_text()


def test_report_simulating_by_itself_takes_validation_files(monkeypatch, capsys, tmp_path):
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
        "--validation",
        f"{SAMPLES['divergence']},{SAMPLES['sim']}",
    )
    assert code == 0, err
    document = html_path.read_text()
    assert "fig-divergence-0-kl" in _figures(document) and "fig-speedup" in _figures(document)
    assert "no lossless validation JSON given" in _words(err)


def test_lossless_failure_and_unflagged_control_read_as_failed():
    document = _sample("lossless")
    document.update(
        bit_identical=False,
        passed=False,
        first_difference_step=3,
        first_difference_tensors=["blocks.0.w"],
        steps_with_different_state=2,
    )
    document["control"]["flagged"] = False
    page = build_report(
        [], [], None, "failed", validation=ValidationResults((ValidationFile("lossless", "<api>", document),))
    )
    text = _text(_section(page))
    assert "Lossless: bit for bit against the plain engine — FAILED" in text
    assert "CIERA differs first at step 3 (blocks.0.w); the lossy control was not flagged" in text
    assert "flagged NO (3 steps)" in text


def test_producing_command_counts_checkpoints_and_windows():
    divergence = ValidationFile("divergence", "d.json", _sample("divergence") | {"layers": None})
    command = producing_command(divergence)
    assert "--checkpoints 2" in command and "--layers 0" in command and "--held-out-sequences 8" in command


# ------------------------------------------------------------------------------------------ bad files


def _edit(document: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    document = copy.deepcopy(document)
    target: Any = document
    for step in path[:-1]:
        target = target[step]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


@pytest.mark.parametrize(
    ("kind", "path", "value", "expected"),
    [
        (
            "lossless",
            ["schema"],
            "ciera.validate.other/1",
            "field 'schema': 'ciera.validate.other/1', expected one of 'ciera.validate.lossless/1', "
            "'ciera.validate.divergence/1', 'ciera.validate.sim/1'",
        ),
        ("lossless", ["schema"], "ciera.simulate/1", "(a file for --records)"),
        (
            "lossless",
            ["control", "flagged"],
            KeyError,
            "field 'control.flagged': missing, expected true or false",
        ),
        ("lossless", ["steps_compared"], "4", "field 'steps_compared': '4', expected an integer >= 0"),
        (
            "lossless",
            ["bytes_saved_fraction"],
            1.5,
            "field 'bytes_saved_fraction': 1.5, expected a finite number <= 1",
        ),
        (
            "divergence",
            ["arms", 2, "points", 1, "kl"],
            "x",
            "field 'arms[2].points[1].kl': 'x', expected a finite number",
        ),
        (
            "divergence",
            ["arms", 0, "points", 0, "top1_agreement"],
            1.2,
            "field 'arms[0].points[0].top1_agreement': 1.2, expected a finite number >= 0 and <= 1",
        ),
        (
            "divergence",
            ["arms", 3, "name"],
            "other",
            "field 'arms[*].name': ['ciera', 'ulp', 'int8', 'other'], expected an arm named 'seed'",
        ),
        (
            "divergence",
            ["arms", 1, "points", 2, "near_tie_share"],
            0.5,
            "field 'arms[1].points[2].near_tie_share': 0.5, expected 0.1396484375 as in arms[0]",
        ),
        (
            "divergence",
            ["checkpoints"],
            [0, 2, 6],
            "field 'arms[0].points[*].step': [0, 2, 4], expected the checkpoints [0, 2, 6]",
        ),
        ("divergence", ["arms"], [], "field 'arms': [], expected a non-empty list"),
        (
            "sim",
            ["held_out", 4, "error"],
            "x",
            "field 'held_out[4].error': 'x', expected a finite number or null",
        ),
        (
            "sim",
            ["measurement_noise"],
            KeyError,
            "field 'measurement_noise': missing, expected a JSON object",
        ),
        ("sim", ["passed"], "no", "field 'passed': 'no', expected true or false"),
        (
            "sim",
            ["held_out", 2, "own_depth_line_miss"],
            -0.1,
            "field 'held_out[2].own_depth_line_miss': -0.1, expected a finite number >= 0 or null",
        ),
        (
            "sim",
            ["held_out", 2, "critical_path_s"],
            {"measured": dict(PATH, compute=-0.5), "predicted": PATH},
            "field 'held_out[2].critical_path_s.measured.compute': -0.5, expected a finite number >= 0",
        ),
        (
            "sim",
            ["held_out_path_miss_by_category"],
            {"system": dict(PATH, exposed_allgather="x")},
            "field 'held_out_path_miss_by_category.system.exposed_allgather': 'x', expected a finite number",
        ),
        (
            "sim",
            ["ciera_verdicts"],
            [
                {
                    "cluster": "c",
                    "system": "ciera",
                    "layers": 2,
                    "measured_speedup": 1.1,
                    "predicted_speedup": 0.9,
                    "same_side": "yes",
                }
            ],  # fmt: skip
            "field 'ciera_verdicts[0].same_side': 'yes', expected true or false",
        ),
    ],
    ids=[
        "schema",
        "records-file",
        "missing",
        "type",
        "range",
        "kl",
        "share",
        "no-seed-arm",
        "near-tie",
        "checkpoints",
        "no-arms",
        "sim-error",
        "sim-noise",
        "sim-passed",
        "sim-own-line",
        "sim-path-part",
        "sim-path-miss",
        "sim-verdict",
    ],
)
def test_bad_validation_file_is_one_line_exit_2(monkeypatch, capsys, files, kind, path, value, expected):
    bad = files["html"].with_name(f"bad-{kind}.json")
    bad.write_text(json.dumps(_edit(_sample(kind), path, value)))
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--validation",
        f"{SAMPLES['lossless'] if kind != 'lossless' else SAMPLES['sim']},{bad}",
    )
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: "), err
    assert expected in _words(err), err
    assert not files["html"].exists(), "nothing is written on bad input"


@pytest.mark.parametrize(
    ("content", "expected"),
    [("{not json", "not valid JSON"), (None, "cannot read file"), ("[1]", "top level is list")],
)
def test_unreadable_validation_file_is_one_line_exit_2(monkeypatch, capsys, files, content, expected):
    bad = files["html"].with_name("other.json")
    if content is not None:
        bad.write_text(content)
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--validation",
        str(bad),
    )
    assert code == 2 and err.count("\n") == 1 and str(bad) in err and expected in err, err
    assert not files["html"].exists()


def test_the_same_file_twice_is_refused(monkeypatch, capsys, files):
    code, err = _run(
        monkeypatch,
        capsys,
        "--html",
        str(files["html"]),
        "--records",
        str(files["records"]),
        "--validation",
        f"{SAMPLES['lossless']},{SAMPLES['lossless']}",
    )
    assert code == 2 and err.count("\n") == 1 and "given twice" in err, err


def test_api_results_get_the_same_checks():
    document = _edit(_sample("divergence"), ["arms", 0, "points", 0, "decisions"], 0)
    with pytest.raises(ReportInputError, match=r"<api>: field 'arms\[0\].points\[0\].decisions': 0"):
        build_report(
            [],
            [],
            None,
            "api",
            validation=ValidationResults((ValidationFile("divergence", "<api>", document),)),
        )
    assert validate_validation_document(_sample("sim"), "s.json").kind == "sim"


# ------------------------------------------------------------------------------------------- browser


def _require_chromium() -> None:
    from report.render_check import find_chromium

    if find_chromium() is None:
        if os.environ.get("CIERA_REQUIRE_BROWSER") == "1":
            pytest.fail("CIERA_REQUIRE_BROWSER=1 but no Chromium found")
        pytest.skip("no Chromium installed (set CIERA_REQUIRE_BROWSER=1 to make this a failure)")


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.browser
@pytest.mark.parametrize("width_px", [1024, 1600])
def test_validation_section_renders_without_overlaps(tmp_path, records, width_px):
    from report.render_check import check_render

    _require_chromium()
    page = build_report(records, [], None, "Validation", validation=load_validation(list(SAMPLES.values())))
    html_path = write_report(tmp_path / "report.html", page)
    result = check_render(html_path, timeout_s=90, window_width_px=width_px, layout_selector="#validation")
    assert result.console_errors == []
    assert result.plots_expected == 7 and result.plots_rendered == 7  # speedup, breakdown, 5 divergence
    assert result.layout_problems == []
    assert result.ok


@pytest.mark.browser
def test_layout_check_sees_overlaps(tmp_path):
    """The checker itself must see what it guards against: plots on top of each other, text on text, and
    a line wider than its section."""
    from report.render_check import check_render

    _require_chromium()
    page = build_report([], [], None, "Overlaps")
    broken_style = (
        "<style>#overlap { position:relative; height:300px; } #overlap .ciera-plot { position:absolute; "
        "top:0; left:0; width:400px; height:300px; } #wide { width:5000px; }</style>"
    )
    broken_body = (
        '<section id="overlap"><div class="ciera-plot" id="fig-a"></div><div class="ciera-plot" id="fig-b"></div>'
        '<p id="wide">wide</p></section>'
        "<script>for (const id of ['fig-a', 'fig-b']) { Plotly.newPlot(id, [{x: [1, 2], y: [1, 2]}], "
        "{title: {text: 'a title long enough to run into the other title'}, width: 400, height: 300, "
        "annotations: [{text: 'same place', x: 1.5, y: 1.5, showarrow: false}, "
        "{text: 'same place', x: 1.5, y: 1.5, showarrow: false}]}); }</script>"
    )
    html_path = tmp_path / "broken.html"
    html_path.write_text(
        page.replace("</head>", broken_style + "</head>").replace("</main>", broken_body + "</main>")
    )
    result = check_render(html_path, timeout_s=60, window_width_px=1024, layout_selector="#overlap")
    problems = " | ".join(result.layout_problems)
    assert "#fig-a overlaps #fig-b" in problems
    assert 'text "same place" overlaps "same place"' in problems
    assert "runs past the right edge of #overlap" in problems
    assert not result.ok
