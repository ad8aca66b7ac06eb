"""benchmarks/engine_speed.py: DeepSpeed's own per-module work timed inside ZeRO-3 runs with and without
CIERA, against a reference loop timed by the same threads; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import one_line_error, run_benchmark  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_one_round_times_the_engines_code_in_both_launches(tmp_path: Path) -> None:
    """~30 s. One round at L = 2: a launch without CIERA and one with it, each rank's probe figures
    present and positive, the normalised ones their µs over the reference loop's."""
    out = tmp_path / "engine_speed.json"
    done = run_benchmark(
        "engine_speed.py", "--layers", "2", "--steps", "3", "--rounds", "1", "--json", str(out), timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(run["layers"], run["ciera"]) for run in result["launches"]] == [(2, "off"), (2, "on")]
    for run in result["launches"]:
        assert run["median_step_ms"] > 0 and len(run["ranks"]) == 2
        for rank in run["ranks"]:
            for name in ("release_sub_module", "linear_forward", "linear_backward"):
                assert rank[f"{name}_us"] > 0
                ratio = rank[f"{name}_us"] / rank["reference_us"]
                assert rank[f"{name}_over_reference"] == pytest.approx(ratio)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--layers", "two"], "--layers two: expected depths like 8,2"),
        (["--rounds", "0"], "expected positive numbers"),
        (["--nope"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line(args: list[str], fragment: str) -> None:
    line = one_line_error(run_benchmark("engine_speed.py", *args, timeout=120))
    assert fragment in line, line
