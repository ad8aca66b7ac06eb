"""The light core stays light: the simulator half imports without torch, numba or deepspeed."""

from __future__ import annotations

import subprocess
import sys


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
