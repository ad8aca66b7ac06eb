"""A capture's --out directory records its plan; a rerun may only add topologies, depths, systems or kinds to it
(the capture is extended, and the console says with what), anything else is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from measure.campaign import CapturePlan, Topology, prepare_out_dir
from measure.launch import CaptureError

SLOW = Topology(nodes=2, ranks_per_node=1, link_rate="200mbit")
SLOWER = Topology(nodes=3, ranks_per_node=1, link_rate="100mbit")


def _plan(**changes) -> CapturePlan:
    return dataclasses.replace(
        CapturePlan(layers=(2, 4), systems=("zero3", "ciera"), topologies=(SLOW,)), **changes
    )


def test_a_sweep_capture_is_extended_by_the_full_capture(tmp_path: Path) -> None:
    assert prepare_out_dir(_plan(kinds=("collectives",)), tmp_path) == []
    lines = prepare_out_dir(_plan(), tmp_path)
    assert lines == [f"--out {tmp_path}: extends the capture there with kinds layers, exponents"]


def test_adding_topologies_depths_and_systems_extends_the_capture(tmp_path: Path) -> None:
    assert prepare_out_dir(_plan(), tmp_path) == []
    assert prepare_out_dir(_plan(), tmp_path) == []  # the same plan: nothing to say
    bigger = _plan(layers=(2, 4, 8), systems=("zero3", "fsdp", "ciera"), topologies=(SLOW, SLOWER))
    lines = prepare_out_dir(bigger, tmp_path)
    assert lines == [
        f"--out {tmp_path}: extends the capture there with layers 8",
        f"--out {tmp_path}: extends the capture there with systems fsdp",
        f"--out {tmp_path}: extends the capture there with topologies emulated-3x1-100mbit",
    ]
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(bigger.to_json()))
    assert prepare_out_dir(bigger, tmp_path) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"systems": ("zero3",)}, "systems"),  # drops a system: another plan
        ({"topologies": (SLOWER,)}, "topologies"),  # replaces the topology
        ({"iterations": 9, "layers": (2, 4, 6)}, "iterations, layers"),  # grows, but times differently
        ({"block_size": 128}, "block_size"),
        ({"allocator": "system"}, "allocator"),  # runs kept with another allocator would mix two hosts
    ],
)
def test_anything_but_growth_is_another_plan(tmp_path: Path, changes: dict, named: str) -> None:
    prepare_out_dir(_plan(), tmp_path)
    before = (tmp_path / "plan.json").read_text()
    with pytest.raises(CaptureError) as error:
        prepare_out_dir(_plan(**changes), tmp_path)
    message = str(error.value)
    assert "\n" not in message and "another plan" in message and f"differs in {named})" in message
    assert (tmp_path / "plan.json").read_text() == before  # the recorded plan is untouched


@pytest.mark.parametrize(
    ("content", "expected"), [("{oops", "cannot read its plan.json"), ("[1]", "holds list")]
)
def test_a_damaged_plan_is_one_line(tmp_path: Path, content: str, expected: str) -> None:
    (tmp_path / "plan.json").write_text(content)
    with pytest.raises(CaptureError) as error:
        prepare_out_dir(_plan(), tmp_path)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_plan_recorded_before_the_allocator_ran_with_the_systems(tmp_path: Path) -> None:
    """A capture started before `--allocator` existed ran its ranks with glibc's defaults: resumed with the
    new default (retain) it is another plan; with `--allocator system` it goes on."""
    document = json.loads(json.dumps(_plan().to_json()))
    del document["allocator"]
    (tmp_path / "plan.json").write_text(json.dumps(document))
    with pytest.raises(CaptureError) as error:
        prepare_out_dir(_plan(), tmp_path)
    assert "differs in allocator)" in str(error.value)
    assert prepare_out_dir(_plan(allocator="system"), tmp_path) == []


def test_an_out_that_cannot_be_a_capture_directory_is_one_line(tmp_path: Path) -> None:
    """A file where the directory belongs, or on its way: refused in one line (it was a traceback)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("keep")
    cases = {
        a_file: "is a file, expected a capture directory",
        a_file / "capture": "cannot create the directory (Not a directory)",
    }
    for out, expected in cases.items():
        with pytest.raises(CaptureError, match=re.escape(expected)) as raised:
            prepare_out_dir(_plan(), out)
        assert "\n" not in str(raised.value)
    assert a_file.read_text() == "keep"
