"""The light core stays light: the simulator half imports without torch, numba or deepspeed."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_simulator_half_imports_without_heavy_packages():
    probe = (
        "import sys, traces, sim, report, ciera_cli.main; "
        "heavy = sorted(m for m in ('torch', 'numba', 'deepspeed', 'constriction') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_console_script_lists_every_stage_command():
    result = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for command in (
        "simulate",
        "replay",
        "report",
        "traces",
        "analytic-bundle",
        "models",
        "train",
        "measure",
        "validate",
    ):
        assert command in result.stdout


def test_help_and_version_show_no_bool_type():
    from typer.testing import CliRunner

    from ciera_cli.main import app

    runner = CliRunner()
    help_result = runner.invoke(app, ["--help"])
    assert help_result.exit_code == 0, help_result.output
    assert "--version" in help_result.output and "--help" in help_result.output
    assert "<bool>" not in help_result.output, "a flag takes no value: no type after it"
    version_result = runner.invoke(app, ["--version"])
    assert version_result.exit_code == 0 and version_result.output.startswith("ciera ")
    assert "<bool>" not in version_result.output
    # Every command's flags, its own --help included.
    for command in ("simulate", "report", "train", "measure", "validate", "replay", "models"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "<bool>" not in result.output, command


def test_an_option_where_a_value_belongs_is_named():
    """click reads `--sweep --gpus 7` as a sweep of '--gpus' and then refuses '7', naming neither; the
    console names both. A negative number, a dash-led value or an option after `--` stays a value."""
    from ciera_cli.main import option_taken_as_value

    refused = {
        ("simulate", "--sweep", "--gpus", "7"): "--sweep expects a value, got the option --gpus "
        "(see `ciera simulate --help`)",
        ("validate", "sim", "--bundle", "--held-out", "x.toml"): "--bundle expects a value, got the option "
        "--held-out (see `ciera validate sim --help`)",
        ("measure", "all", "--systems", "--out", "d"): "--systems expects a value, got the option --out",
        # Help where a value belongs: `--json --help` would run the projection and write a file `--help`.
        ("simulate", "--json", "--help"): "--json expects a value, got the option --help",
        ("simulate", "--sweep", "--help"): "--sweep expects a value, got the option --help",
    }
    kept = [
        ("simulate", "--layers", "-3"),
        ("simulate", "--gpus", "4", "--sweep", "inter_node.beta_Bps=1e9,2e9"),
        ("simulate", "--json", "--", "--gpus"),
        ("simulate", "--verbose", "--gpus", "8"),  # --verbose is a flag
        ("nosuchcommand", "--gpus", "--sweep"),
        (),
    ]
    outcomes = {"named": 0, "kept": 0}
    for argv, expected in refused.items():
        message = option_taken_as_value(list(argv))
        assert message is not None and message.startswith("error: ") and expected in message, (argv, message)
        outcomes["named"] += 1
    for argv in kept:
        assert option_taken_as_value(list(argv)) is None, argv
        outcomes["kept"] += 1
    assert outcomes == {"named": len(refused), "kept": len(kept)}


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_malformed_options_are_one_line_errors():
    """A value of the wrong type, an unknown option or command, a missing value: one line on stderr, exit 2
    (click's usage box was ~6 lines); help and version still exit 0, no arguments prints help (exit 2)."""
    cases = {
        ("simulate", "--workers", "two"): "Invalid value for '--workers'",
        ("simulate", "--layers"): "requires an argument",
        ("simulate", "--bogus"): "No such option: --bogus",
        ("report", "--gpus"): "requires an argument. (see `ciera report --help`)",
        ("simulate", "--sweep", "--gpus", "7"): "--sweep expects a value, got the option --gpus",
        ("nosuchcommand",): "No such command 'nosuchcommand'",
    }
    outcomes = {"one-line error": 0}
    for args, fragment in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "ciera_cli.main", *args], capture_output=True, text=True
        )
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, (args, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (args, lines)
        assert result.stdout == "", args
        outcomes["one-line error"] += 1
    assert outcomes == {"one-line error": len(cases)}
    for args, code in ((("simulate", "--help"), 0), (("--version",), 0), ((), 2)):
        result = subprocess.run(
            [sys.executable, "-m", "ciera_cli.main", *args], capture_output=True, text=True
        )
        assert result.returncode == code, (args, result.stderr)
