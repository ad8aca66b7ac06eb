"""The timeline is chosen with the view: `--timeline-of MODEL:W[:DTYPE]` picks the simulated iteration,
the console says which one is shown, and a choice the report cannot honour is one line before any
simulation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _report(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "report", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--timeline-of", "olmoe"], "expected MODEL:W[:DTYPE]"),
        (["--timeline-of", "olmoe:x"], "expected MODEL:W[:DTYPE]"),
        (["--timeline-of", "olmoe:16:int4"], "dtype 'int4'"),
        (["--timeline-of", "olmoe:64", "--gpus", "16"], "W=64 is not in --gpus (16)"),
        (["--timeline-of", "nosuch:16"], "--timeline-of: model 'nosuch'"),
        (
            ["--timeline-of", "mixtral:16", "--models", "olmoe"],
            "Mixtral-8x7B is not in --models (OLMoE-1B-7B)",
        ),
        (["--timeline-of", "olmoe:16", "--records", "x.json"], "with --records pass the matching --timeline"),
    ],
)
def test_a_timeline_choice_that_cannot_be_honoured_is_one_line(
    arguments: list[str], expected: str, tmp_path: Path
) -> None:
    done = _report(*arguments, "--html", str(tmp_path / "r.html"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
    assert not (tmp_path / "r.html").exists()


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_the_timeline_shows_the_chosen_model_and_world_size(tmp_path: Path) -> None:
    html_path = tmp_path / "r.html"
    done = _report(
        "--models", "olmoe,mixtral", "--gpus", "16,32", "--dtype", "bf16", "--timeline-of", "MIXTRAL:16",
        "--html", str(html_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timeline: Mixtral-8x7B bf16 at W=16 (--timeline-of)" in done.stderr
    page = html_path.read_text()
    timeline_at = page.index('id="timeline"')
    assert "Mixtral-8x7B" in page[timeline_at : timeline_at + 3000]
    default = _report("--models", "olmoe", "--gpus", "16", "--dtype", "bf16", "--html", str(html_path))
    assert "timeline: OLMoE-1B-7B bf16 at W=16 (choose another with --timeline-of" in default.stderr
