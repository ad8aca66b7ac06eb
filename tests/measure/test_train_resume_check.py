"""`ciera train --resume` is checked before any rank starts: a directory without a checkpoint of `ciera
train`, one saved by another engine, model, depth, width or world size, or one at the last step is one
line naming what differs (a resume from an empty directory failed on every rank with "AssertionError:")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from measure.train import (
    CHECKPOINT_MANIFEST,
    TrainConfig,
    TrainError,
    check_resume,
    write_checkpoint_manifest,
)

SAVED = TrainConfig(model="small-moe", layers=1, width_scale=4, steps=8, save_at=4)


def _saved(directory: Path) -> TrainConfig:
    directory.mkdir(exist_ok=True)  # the engine's save made it
    config = dataclasses.replace(SAVED, checkpoint_dir=str(directory))
    write_checkpoint_manifest(config, 4)
    return dataclasses.replace(config, save_at=None, resume=True)


def test_a_matching_checkpoint_resumes(tmp_path: Path) -> None:
    resumed = _saved(tmp_path)
    check_resume(resumed)
    # The default width spelled out is the same checkpoint; the manifest was written whole.
    check_resume(dataclasses.replace(resumed, width_scale=4))
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_MANIFEST]


def test_what_cannot_be_resumed_is_one_line(tmp_path: Path) -> None:
    resumed = _saved(tmp_path / "ckpt")
    empty = tmp_path / "empty"
    empty.mkdir()
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / CHECKPOINT_MANIFEST).write_text("{not json")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / CHECKPOINT_MANIFEST).write_text(json.dumps({"schema": "other/1"}))
    cases = {
        "no checkpoint": (dataclasses.replace(resumed, checkpoint_dir=str(empty)), "holds no checkpoint"),
        "garbled": (dataclasses.replace(resumed, checkpoint_dir=str(garbled)), "not readable"),
        "foreign": (dataclasses.replace(resumed, checkpoint_dir=str(foreign)), "expected schema"),
        "engine": (
            dataclasses.replace(resumed, engine="fsdp"),
            "saved with engine 'zero3'; this run has 'fsdp'",
        ),
        "depth": (dataclasses.replace(resumed, layers=2), "saved with layers 1; this run has 2"),
        "width": (dataclasses.replace(resumed, width_scale=2), "saved with width_scale 4; this run has 2"),
        "world": (dataclasses.replace(resumed, world_size=4, global_batch=4), "saved with world_size 2"),
        "model": (
            dataclasses.replace(resumed, model="olmoe", width_scale=64),
            "saved with model 'small-moe'",
        ),
        "last step": (dataclasses.replace(resumed, steps=4), "at step 4; --steps 4 leaves no step"),
        "warm steps": (dataclasses.replace(resumed, warm_steps=4), "and 4 warm steps"),
    }
    refused = 0
    for name, (config, expected) in cases.items():
        with pytest.raises(TrainError, match=expected) as raised:
            check_resume(config)
        assert "\n" not in str(raised.value), name
        refused += 1
    assert refused == len(cases)
