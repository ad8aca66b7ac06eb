"""A model shape file outside the zoo (`--model path/to/my.toml`) reaches the ranks by its absolute path:
its key alone resolved to nothing there ("no such model" before any run), and a copy of a zoo model's file
elsewhere is that file, not the zoo's. Without a zoo default its width scale must be given, said in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import traces
from measure import zoo
from measure.campaign import CapturePlan, Topology, layer_jobs, plan_steps

LOCAL = Topology(nodes=1, ranks_per_node=2)


def _copy(tmp_path: Path, name: str, change: tuple[str, str] | None = None) -> Path:
    text = (traces.models.models_dir() / "olmoe-1b-7b.toml").read_text()
    text = text.replace('aliases = ["olmoe"]', "aliases = []")
    if change:
        text = text.replace(*change)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_outside_the_zoo_is_passed_by_its_absolute_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _copy(tmp_path, "mymoe.toml")
    plan = CapturePlan(model="mymoe.toml", width_scale=64, layers=(1,), systems=("zero3",), topologies=(LOCAL,),
                       kinds=("layers", "exponents"), exponent_steps=3)  # fmt: skip
    jobs = [job for _, job in layer_jobs(plan)]
    assert jobs and all(job.train.model == str(tmp_path / "mymoe.toml") for job in jobs)
    assert all(job.run_id.startswith("mymoe-w64-") for job in jobs)
    exponents = [step for step in plan_steps(plan) if step.kind == "exponents"]
    assert exponents and all(step.job["train"]["model"] == str(tmp_path / "mymoe.toml") for step in exponents)
    # A zoo model keeps its key.
    shipped = [job for _, job in layer_jobs(dataclasses.replace(plan, model="olmoe"))]
    assert all(job.train.model == "olmoe-1b-7b" for job in shipped)


def test_a_copy_named_like_a_zoo_model_is_the_copy(tmp_path: Path) -> None:
    copy = _copy(tmp_path, "olmoe-1b-7b.toml", ("num_layers = 16", "num_layers = 3"))
    assert not zoo.is_shipped(traces.load_model_shape(str(copy)))
    assert zoo.model_reference(str(copy)) == str(copy.resolve())
    assert zoo.scaled_shape(zoo.model_reference(str(copy)), 64).num_layers == 3


def test_without_a_zoo_default_the_width_scale_is_asked_for(tmp_path: Path) -> None:
    path = _copy(tmp_path, "mymoe.toml")
    with pytest.raises(
        zoo.ZooError, match=r"model 'mymoe' \(.*mymoe.toml, not a zoo model\): no default width"
    ):
        zoo.default_width_scale(str(path))
    assert zoo.default_width_scale("olmoe") == 16
