"""benchmarks/compute_excess.py: a CIERA run's compute against its plain engine's, per engine call, and the
host work visible beside each call's codec; bad input is one line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import load_benchmark, one_line_error, run_benchmark  # noqa: E402

import traces  # noqa: E402


@pytest.fixture(scope="module")
def one_cluster() -> traces.TraceBundle:
    """The shipped bundle's ZeRO-3 and ZeRO-3 + CIERA runs at L = 2 and 4 on one cluster (quick)."""
    bundle = traces.read_bundle(traces.resolve_bundle("measured"))
    runs = bundle.runs
    chosen = runs[
        (runs["cluster"] == CLUSTER) & runs["system"].isin(("zero3", "ciera")) & runs["layers"].isin((2, 4))
    ]
    ids = set(chosen["run_id"])
    return dataclasses.replace(bundle, runs=chosen, events=bundle.events[bundle.events["run_id"].isin(ids)])


def test_each_depth_compares_the_pair_per_call(one_cluster: traces.TraceBundle) -> None:
    rows = load_benchmark("compute_excess").compute_excess(one_cluster, "zero3", "ciera")
    assert [(row["cluster"], row["layers"]) for row in rows] == [(CLUSTER, 2), (CLUSTER, 4)]
    for row in rows:
        assert row["calls"] in (87, 191)  # one CIERA call per engine all-gather, every rank alike
        assert row["excess_per_call_s"] == pytest.approx(
            (row["codec_compute_s"] - row["plain_compute_s"]) / row["calls"]
        )
        assert row["plain_work_s"] < row["plain_compute_s"] and row["codec_work_s"] < row["codec_compute_s"]
        # The host work beside each call's codec: tens of microseconds, not the compute's excess.
        assert 20e-6 < row["send_gap_s"] < 200e-6 and 20e-6 < row["before_decode_s"] < 200e-6
    in_sample, deeper = rows
    assert abs(in_sample["work_excess_per_call_s"]) < 100e-6  # where the glue is fitted: ~nothing
    assert deeper["work_excess_per_call_s"] > 100e-6  # held out at L = 4: heavier


CLUSTER = "emulated-2x1-200mbit"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--bundle", "/nonexistent-bundle"], "not a trace bundle directory"),
        (["--codec", "zeropp"], "no cluster and depth with runs of both zero3 and zeropp"),
        (["--nope"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line(args: list[str], fragment: str) -> None:
    line = one_line_error(run_benchmark("compute_excess.py", *args, timeout=120))
    assert fragment in line, line
