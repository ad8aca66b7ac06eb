"""`ciera measure --launches N`: each layer run launched N times with fresh ranks, the launches of all runs
in rounds over the plan, a run's launches pooled into one run of the bundle; the plan refuses a count that
is not 1 to 16, and a capture recorded before launches existed is the same capture."""

from __future__ import annotations

import json
import math
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
    with pytest.raises(CaptureError, match="launches"):
        prepare_out_dir(CapturePlan(**PLAN, launches=3), tmp_path)


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
