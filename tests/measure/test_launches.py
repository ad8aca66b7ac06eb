"""`ciera measure --launches N`: each layer run launched N times with fresh ranks, the launches of all runs
in rounds over the plan, a run's launches pooled into one run of the bundle; the plan refuses a count that
is not 1 to 16, a capture recorded before launches existed is the same capture, and a rerun with more
launches keeps those a capture has and adds the others."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from measure.assemble import _launches_by_run
from measure.campaign import (
    MAX_LAUNCHES,
    CapturePlan,
    _same_job,
    interleaved_order,
    plan_steps,
    prepare_out_dir,
)
from measure.capture import LayersJob
from measure.launch import CaptureError
from measure.measure_cli import launch_spread_line

PLAN = {"layers": (2, 4), "systems": ("zero3", "ciera"), "kinds": ("layers",)}


def _layer_steps(plan: CapturePlan) -> list:
    return [step for group in interleaved_order(plan_steps(plan)) for step in group if step.kind == "layers"]


def test_every_run_is_launched_n_times_in_rounds_over_the_plan() -> None:
    steps = _layer_steps(CapturePlan(**PLAN, launches=3))
    assert len(steps) == 4 * 3
    rounds = [steps[i : i + 4] for i in range(0, 12, 4)]
    for number, launches in enumerate(rounds, start=1):
        # Each round has every run once, by depth; within a depth the systems take turns (a later launch
        # one place further), so a run's launches do not all sit at one place.
        assert [step.job["launch"] for step in launches] == [number] * 4
        assert sorted(step.job["run_id"] for step in launches) == sorted(
            step.job["run_id"] for step in rounds[0]
        )
        assert [int(step.job["train"]["layers"]) for step in launches] == [2, 2, 4, 4]
    assert [step.job["system"] for step in rounds[0][:2]] == ["zero3", "ciera"]
    assert [step.job["system"] for step in rounds[1][:2]] == ["ciera", "zero3"]
    # The first launch keeps the run's own name; the others are named apart, one directory each.
    names = [step.name for step in steps]
    assert len(set(names)) == len(names)
    again = next(step for step in rounds[1] if step.job["run_id"] == steps[0].job["run_id"])
    assert names[0] == steps[0].job["run_id"] and again.name == f"{steps[0].job['run_id']}.launch2"
    # The launches of a run are the same job but for the launch number: same seed, batches, settings.
    first, second = (dict(step.job) for step in (steps[0], again))
    assert first.pop("launch") == 1 and second.pop("launch") == 2 and first == second


def test_one_launch_is_the_capture_it_always_was(tmp_path: Path) -> None:
    steps = _layer_steps(CapturePlan(**PLAN))
    assert [step.name for step in steps] == [step.job["run_id"] for step in steps]
    # A run finished before launches existed (its job.json has no launch) is kept, not redone.
    recorded = dict(steps[0].job)
    recorded.pop("launch")
    (tmp_path / "job.json").write_text(json.dumps(recorded))
    assert _same_job(tmp_path, steps[0].job)
    assert not _same_job(tmp_path, steps[0].job | {"launch": 2})


def test_a_plan_recorded_before_launches_existed_is_the_same_plan(tmp_path: Path) -> None:
    recorded = CapturePlan(**PLAN).to_json()
    recorded.pop("launches")
    (tmp_path / "plan.json").write_text(json.dumps(recorded))
    assert prepare_out_dir(CapturePlan(**PLAN), tmp_path) == []
    # It ran one launch per run: a rerun with three adds the second and third.
    assert prepare_out_dir(CapturePlan(**PLAN, launches=3), tmp_path) == [
        f"--out {tmp_path}: extends the capture there with launches 2-3 of every run, pooled with the 1 it has"
    ]


def test_raising_launches_keeps_every_launch_and_adds_the_new_ones(tmp_path: Path) -> None:
    """A capture re-run with more launches per run keeps each launch it has (the same job) and captures only
    the new ones, which go in rounds of their own after them; fewer launches is another plan."""
    three = CapturePlan(**PLAN, launches=3)
    assert prepare_out_dir(three, tmp_path) == []
    before = (tmp_path / "plan.json").read_text()
    for fewer in (1, 2):
        with pytest.raises(CaptureError) as error:
            prepare_out_dir(CapturePlan(**PLAN, launches=fewer), tmp_path)
        assert "differs in launches)" in str(error.value) and "raise --launches" in str(error.value)
        assert "\n" not in str(error.value)
    assert (tmp_path / "plan.json").read_text() == before
    # Raised with another change that is not growth: refused whole, the plan untouched.
    with pytest.raises(CaptureError, match=r"differs in iterations, launches\)"):
        prepare_out_dir(CapturePlan(**PLAN, launches=5, iterations=4), tmp_path)
    assert (tmp_path / "plan.json").read_text() == before
    five = CapturePlan(**PLAN, launches=5)
    assert prepare_out_dir(five, tmp_path) == [
        f"--out {tmp_path}: extends the capture there with launches 4-5 of every run, pooled with the 3 it has"
    ]
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(five.to_json()))
    # The steps the first three launches finished are the same jobs under the same names: kept, not redone.
    old = {step.name: step.job for step in _layer_steps(three)}
    new = _layer_steps(five)
    assert all(old[step.name] == step.job for step in new if step.job["launch"] <= 3)
    added = [step for step in new if step.name not in old]
    assert sorted({step.job["launch"] for step in added}) == [4, 5] and len(added) == 2 * 4
    assert new[-len(added) :] == added  # the new launches' rounds come after the kept ones
    assert prepare_out_dir(CapturePlan(**PLAN, launches=6), tmp_path)[0].endswith(
        "launches 6 of every run, pooled with the 5 it has"
    )


def test_a_recorded_count_that_is_not_an_int_is_another_plan(tmp_path: Path) -> None:
    recorded = CapturePlan(**PLAN).to_json() | {"launches": "3"}
    (tmp_path / "plan.json").write_text(json.dumps(recorded))
    with pytest.raises(CaptureError, match=r"differs in launches\)"):
        prepare_out_dir(CapturePlan(**PLAN, launches=4), tmp_path)


@pytest.mark.parametrize("value", [0, -1, MAX_LAUNCHES + 1, True, "2", 1.5, None])
def test_the_plan_refuses_a_count_that_is_not_1_to_16(value) -> None:
    with pytest.raises(CaptureError, match=f"--launches is {value!r}: expected an integer from 1 to 16"):
        CapturePlan(**PLAN, launches=value).check()


def _write_launch(runs: Path, name: str, run_id: str, launch: int, iteration_s: list[float]) -> None:
    directory = runs / name
    directory.mkdir(parents=True)
    job = _layer_steps(CapturePlan(**PLAN))[0].job | {"run_id": run_id, "launch": launch}
    (directory / "job.json").write_text(json.dumps(job))
    (directory / "run.json").write_text(json.dumps({"iteration_s": iteration_s}))


def test_a_runs_launches_are_read_in_launch_order_and_a_launch_twice_is_one_line(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # Directory names sort launch10 before launch2: the order comes from the jobs, not the names.
    for launch in (10, 2, 1):
        _write_launch(runs, "a" if launch == 1 else f"a.launch{launch}", "a", launch, [float(launch)])
    _write_launch(runs, "b", "b", 1, [0.5])
    grouped = _launches_by_run(tmp_path)
    assert [[job.launch for _, job, _ in launches] for launches in grouped] == [[1, 2, 10], [1]]
    assert [run["iteration_s"] for _, _, run in grouped[0]] == [[1.0], [2.0], [10.0]]
    assert isinstance(grouped[0][0][1], LayersJob)
    _write_launch(runs, "a.copy", "a", 2, [2.0])
    with pytest.raises(CaptureError, match="run a has launch 2 twice; expected each launch once"):
        _launches_by_run(tmp_path)


def test_the_console_says_how_far_launches_differ() -> None:
    one = {"run_id": "r1", "launches": 1, "launch_spread": None}
    assert launch_spread_line([one]) == ""
    pooled = [
        {"run_id": "r2", "launches": 3, "launch_spread": 0.2 / 1.1},
        {"run_id": "r3", "launches": 3, "launch_spread": 0.0},
        one,
    ]
    line = launch_spread_line(pooled)
    assert line.startswith("each run pooled from 3 launches of fresh ranks")
    assert "differ by 9.1 % on average, up to 18.2 % (r2)" in line


def test_a_runs_launch_spread_is_read_from_what_it_recorded() -> None:
    import pandas as pd

    import traces

    def bundle_of(versions: dict[str, str]):
        runs = pd.DataFrame({"run_id": list(versions), "versions": list(versions.values())})
        iterations = pd.DataFrame({"run_id": list(versions), "iteration": 0, "iteration_s": 1.0})
        events = pd.DataFrame(
            columns=["run_id", "rank", "stream", "start_s", "end_s", "raw_bytes", "wire_bytes"]
        )
        return SimpleNamespace(runs=runs, iterations=iterations, events=events)

    summaries = traces.run_summaries(
        bundle_of({
            "pooled": json.dumps({"launches": 3, "launch_median_s": [1.0, 1.1, 1.2]}),
            "one": json.dumps({}),
            "garbled": json.dumps({"launch_median_s": [1.0, "x"]}),
            "broken": "{not json",
        })
    ).set_index("run_id")  # fmt: skip
    assert summaries.loc["pooled", "launches"] == 3
    assert summaries.loc["pooled", "launch_spread"] == pytest.approx(0.2 / 1.1)
    for run in ("one", "garbled", "broken"):  # nothing usable recorded: one launch, no spread
        assert summaries.loc[run, "launches"] == 1 and math.isnan(summaries.loc[run, "launch_spread"])
    pooled = traces.launch_spread_summary(summaries.reset_index())
    assert pooled == {"runs": 1, "launches": [3], "mean": pytest.approx(0.2 / 1.1),
                      "max": pytest.approx(0.2 / 1.1), "widest_run": "pooled"}  # fmt: skip


@pytest.mark.heavy  # two captures of one rank
def test_a_capture_rerun_with_more_launches_pools_the_new_ones_with_those_it_has(tmp_path: Path) -> None:
    """`ciera measure` over a finished one-launch capture with `--launches 2`: the console says what it
    adds, the first launch is kept (its directory untouched), the second captured, and the bundle's run
    pools both launches' timed iterations."""
    pytest.importorskip("deepspeed")
    import traces

    out = tmp_path / "cap"
    capture = [
        sys.executable, "-m", "ciera_cli.main", "measure", "layers", "--out", str(out), "--model",
        "mixtral-8x7b", "--width-scale", "64", "--layers", "1", "--iterations", "2", "--warmup", "1",
        "--ranks-per-node", "1", "--systems", "fsdp", "--timeout-s", "120",
    ]  # fmt: skip
    environment = os.environ | {"DS_ACCELERATOR": "cpu"}
    first = subprocess.run(capture, capture_output=True, text=True, timeout=120, env=environment)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = (out / "runs").glob("*/")
    kept = (run_dir / "run.json").read_text()
    again = subprocess.run(
        [*capture, "--launches", "2"], capture_output=True, text=True, timeout=120, env=environment
    )
    assert again.returncode == 0, again.stderr[-2000:]
    console = " ".join((again.stderr + again.stdout).split())
    assert "extends the capture there with launches 2 of every run, pooled with the 1 it has" in console
    assert "1 captured, 1 kept from before" in console
    assert (run_dir / "run.json").read_text() == kept
    assert sorted(path.name for path in (out / "runs").glob("*/")) == [
        run_dir.name,
        f"{run_dir.name}.launch2",
    ]
    bundle = traces.read_bundle(out / "bundle")
    (row,) = bundle.runs.itertuples()
    assert json.loads(row.versions)["launches"] == 2
    assert sorted(bundle.events["iteration"].unique()) == [0, 1, 2, 3]
