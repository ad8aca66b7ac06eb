"""benchmarks/sweep_skew.py: the in-run gathers against a cluster's sweep, and the held-out errors with the
sweep's fastest repetitions in place of its means; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
import numpy as np  # noqa: E402
from _bench_script import load_benchmark, run_benchmark  # noqa: E402

import sim  # noqa: E402
import traces  # noqa: E402

CLUSTER = "emulated-2x2-200mbit"


def _script():
    return load_benchmark("sweep_skew")


@pytest.fixture(scope="module")
def measured() -> traces.TraceBundle:
    return traces.read_bundle(traces.resolve_bundle("measured"))


def test_in_run_gathers_against_the_sweep(measured: traces.TraceBundle) -> None:
    row = _script().in_run_gathers(measured, CLUSTER)
    assert row["runs"] == 4 and row["usual_gather_bytes"] == 114688
    # Four ranks, the same gathers on each: every rank's copy of a collective is counted.
    assert row["gathers_counted"] % 4 == 0 and row["gathers_counted"] > 1000
    assert 0 < row["sweep_fastest_s"] < row["sweep_mean_s"]
    assert 0 < row["in_run_own_median_s"] <= row["in_run_own_p90_s"]
    # The sweep figures are the simulator's own curve of the cluster (sim.sweep_curves) at the usual size.
    curve = sim.sweep_curves(measured.collectives, CLUSTER, world_size=4, nodes=2, link_Bps=0.0)["all_gather"]
    at = np.array([row["usual_gather_bytes"]])
    assert row["sweep_mean_s"] == curve.time_s(at)[0]
    assert row["sweep_fastest_s"] == curve.fastest_time_s(at)[0]
    # What docs/validation.md says of the shipped bundle: its sweep's mean lies above the runs' own median.
    assert row["sweep_mean_over_in_run_median"] > 1
    assert _script().in_run_gathers(measured, "no-such-cluster") is None


def test_the_fastest_copy_changes_only_that_cluster(measured: traces.TraceBundle) -> None:
    before = measured.collectives.copy()
    changed = _script().with_fastest_sweep(measured, CLUSTER).collectives
    assert measured.collectives.equals(before), "the bundle given must not change"
    mine = changed["cluster"] == CLUSTER
    assert (changed.loc[mine, "time_s"] == changed.loc[mine, "time_min_s"]).all()
    assert changed.loc[~mine].equals(before.loc[~mine])
    with pytest.raises(ValueError, match="no collectives sweep"):
        _script().with_fastest_sweep(measured, "no-such-cluster")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--bundle", "/nowhere/at/all"), "nowhere"),
        (("--cluster", "emulated-9x9-1mbit"), "is not in the bundle"),
        (("--held-out", "/nowhere/held-out.toml"), "held-out"),
    ],
)
def test_bad_input_is_one_line(args: tuple[str, ...], expected: str) -> None:
    done = run_benchmark("sweep_skew.py", *args)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 2, output[-2000:]
    assert "Traceback" not in output and len(output.splitlines()) == 1 and expected in output


@pytest.mark.heavy
def test_the_bracket_on_the_shipped_bundle(tmp_path: Path) -> None:
    out = tmp_path / "skew.json"
    done = run_benchmark("sweep_skew.py", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["held_out"]
    assert len(rows) == 16 and {row["system"] for row in rows} == {"zero3", "fsdp", "ciera", "ciera-fsdp"}
    # Shorter collectives never make an iteration longer: each prediction is at most the one as shipped.
    for row in rows:
        assert row["predicted_with_fastest_sweep_s"] <= row["predicted_s"] * 1.001, row["run_id"]
    for key in ("cluster_mean_abs_error", "cluster_max_abs_error", "held_out_mean_abs_error"):
        assert set(result[key]) == {"sweep_as_recorded", "fastest_sweep"}
