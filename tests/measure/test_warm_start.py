"""Block size per run and warm start: `--block-size` and `--warm-steps` of `ciera train` and `ciera measure`
(and `ciera train`'s other numbers: lr, timeout) are checked with one line before any rank starts; B reaches the codec's CodecConfig and the capture's jobs;
warm steps train on batches 0..N-1 and leave nothing in the step records, the events or the recorder (tiny
one-rank runs)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from measure.campaign import CapturePlan, _same_job, layer_jobs, plan_steps
from measure.launch import CaptureError
from measure.train import BLOCK_SIZE_MAX, TrainConfig, TrainError, block_size_problem
from tests.ranks import free_port, start_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def _ciera(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"DS_ACCELERATOR": "cpu"},
    )


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [1, 2, 64, 512, 4096, BLOCK_SIZE_MAX])
def test_powers_of_two_the_codec_takes_are_block_sizes(value: int) -> None:
    assert block_size_problem(value) is None
    TrainConfig(block_size=value).check()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "block_size is 0: expected a power of two from 1 to"),
        (-512, "block_size is -512"),
        (384, "block_size is 384: expected a power of two"),
        (2 * BLOCK_SIZE_MAX, f"block_size is {2 * BLOCK_SIZE_MAX}"),
        (True, "block_size is True"),
        (512.0, "block_size is 512.0"),
    ],
)
def test_other_block_sizes_are_one_line(value, words: str) -> None:
    with pytest.raises(TrainError, match=words) as error:
        TrainConfig(block_size=value).check()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"warm_steps": -1}, "warm_steps is -1: expected an integer >= 0"),
        ({"warm_steps": 21, "steps": 20}, "warm_steps is 21: expected at most steps (20)"),
        (
            {"warm_steps": 15, "steps": 40, "exponent_stats": True, "exponent_warmup_steps": 30},
            "record more than that (25 steps after 15 warm steps)",
        ),
    ],
)
def test_bad_warm_steps_are_one_line(changes: dict, words: str) -> None:
    with pytest.raises(TrainError) as error:
        dataclasses.replace(TrainConfig(), **changes).check()
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_run_of_only_warm_steps_is_allowed() -> None:
    TrainConfig(steps=5, warm_steps=5, checkpoint_dir="x", save_at=5).check()  # a warm checkpoint


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--block-size", "100"], "--block-size is 100: expected a power of two"),
        (["--block-size", "0"], "--block-size is 0"),
        (["--warm-steps", "-3"], "--warm-steps is -3: expected an integer >= 0"),
        (["--steps", "0", "--warm-steps", "5"], "--steps is 0"),
    ],
)
def test_train_options_are_one_line_and_exit_2(args: list[str], words: str, capsys, monkeypatch) -> None:
    import ciera_cli.main as entry

    monkeypatch.setattr(sys, "argv", ["ciera", "train", *args])
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    captured = capsys.readouterr()
    assert exit_.value.code == 2, captured
    assert words in captured.err and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--block-size", "3"], "--block-size is 3: expected a power of two"),
        (["--warm-steps", "-1"], "--warm-steps is -1"),
    ],
)
def test_measure_options_are_one_line_before_any_rank(tmp_path: Path, args: list[str], words: str) -> None:
    done = _ciera("measure", "layers", "--out", str(tmp_path / "cap"), *args, timeout=60)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "cap" / "runs").exists()


def test_capture_plan_checks_block_size_and_warm_steps() -> None:
    with pytest.raises(CaptureError, match="--block-size is 768"):
        CapturePlan(block_size=768).check()
    with pytest.raises(CaptureError, match="--warm-steps is -2"):
        CapturePlan(warm_steps=-2).check()


# ---------------------------------------------------------------------------------------- where B goes


def test_block_size_reaches_the_codec_config_of_both_engines(monkeypatch) -> None:
    """`_Zero3Run` and `_FsdpRun` hand TrainConfig.block_size to CIERA as CodecConfig.block_size (the
    engines themselves stubbed: no process group needed)."""
    pytest.importorskip("torch")
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed.fsdp as fsdp

    import ciera_runtime.fsdp2
    import ciera_runtime.zero3
    from measure.train import _FsdpRun, _Zero3Run
    from measure.zoo import build_model

    seen = {}
    monkeypatch.setattr(deepspeed, "initialize", lambda model, **kwargs: (model, None, None, None))
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: module)
    for module, name in ((ciera_runtime.zero3, "zero3"), (ciera_runtime.fsdp2, "fsdp")):

        def enable(target, config, name=name, **kwargs):
            seen[name] = config

        monkeypatch.setattr(module, "enable_ciera", enable)
    for engine, run in (("zero3", _Zero3Run), ("fsdp", _FsdpRun)):
        cfg = TrainConfig(engine=engine, block_size=128, layers=1, width_scale=4)
        run(cfg, build_model(cfg.model, 1, 4, 0), {})
        assert seen[engine].block_size == 128, engine


def test_capture_jobs_carry_block_size_and_warm_steps() -> None:
    plan = CapturePlan(
        model="mixtral-8x7b", width_scale=64, layers=(1,), systems=("zero3", "ciera"),
        warmup_iterations=2, iterations=3, exponent_steps=20, block_size=256, warm_steps=7,
    )  # fmt: skip
    jobs = [job for _, job in layer_jobs(plan)]
    assert {job.train.block_size for job in jobs} == {256}
    assert {job.warm_steps for job in jobs} == {7}
    assert {job.train.warm_steps for job in jobs} == {0}  # the job's warm steps, not run_rank's
    steps = {step.kind: step for step in plan_steps(plan)}
    assert steps["layers"].iterations == 7 + 2 + 3  # the progress bar counts the warm steps
    assert steps["exponents"].job["warm_steps"] == 7
    assert steps["exponents"].job["train"]["block_size"] == 256
    assert steps["exponents"].iterations == 7 + 20


def test_capture_jobs_scale_the_reduce_bucket_with_the_model() -> None:
    from measure.train import _ds_config

    plan = CapturePlan(model="mixtral-8x7b", width_scale=64, layers=(1, 2), systems=("zero3", "ciera"))
    jobs = [job for _, job in layer_jobs(plan)]
    one_block = {job.train.prefetch_bucket_size for job in jobs}  # one block's elements, like the prefetch
    assert len(one_block) == 1 and one_block.pop() > 0
    assert {job.train.reduce_bucket_size for job in jobs} == {jobs[0].train.prefetch_bucket_size}
    zero = _ds_config(jobs[0].train)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"]
    # None: DeepSpeed's own default (5e8 elements), which the config then leaves out.
    default = [job for _, job in layer_jobs(dataclasses.replace(plan, reduce_bucket_blocks=None))]
    assert {job.train.reduce_bucket_size for job in default} == {None}
    assert "reduce_bucket_size" not in _ds_config(default[0].train)["zero_optimization"]


def test_a_run_finished_before_the_new_fields_is_kept(tmp_path: Path) -> None:
    """A job.json written before `warm_steps` existed is the same job as today's with warm_steps 0."""
    plan = CapturePlan(model="mixtral-8x7b", width_scale=64, layers=(1,), systems=("zero3",))
    (step,) = [step for step in plan_steps(plan) if step.kind == "layers"]
    old = json.loads(json.dumps(step.job))
    del old["warm_steps"]
    del old["train"]["warm_steps"]
    (tmp_path / "job.json").write_text(json.dumps(old))
    assert _same_job(tmp_path, step.job)
    changed = dataclasses.replace(plan, warm_steps=3)
    (new,) = [step for step in plan_steps(changed) if step.kind == "layers"]
    assert not _same_job(tmp_path, new.job)


# ---------------------------------------------------------------------------------------- warm steps run


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_warm_steps_train_on_the_first_batches_and_are_not_recorded() -> None:
    """One rank, FSDP2 without CIERA, 5 steps: with 3 warm steps the records are steps 3 and 4, with the
    losses the same run records there without warm steps, and the warm run's last loss is step 2's."""
    pytest.importorskip("torch")
    import torch.multiprocessing as mp
    from _train_workers import runs_worker

    base = TrainConfig(
        engine="fsdp", ciera=False, world_size=1, global_batch=1, steps=5, layers=1, width_scale=8,
        seq_len=16, threads_per_rank=1, timeout_s=120,
    )  # fmt: skip
    runs = [("straight", base), ("warm", dataclasses.replace(base, warm_steps=3))]
    queue = mp.get_context("spawn").SimpleQueue()
    start_ranks(runs_worker, 1, (1, free_port(), runs, queue), join=True)
    _, results = queue.get()
    straight, warm = results["straight"], results["warm"]
    assert [step["step"] for step in warm["steps"]] == [3, 4]
    assert [s["loss_bits"] for s in warm["steps"]] == [s["loss_bits"] for s in straight["steps"][3:]]
    assert warm["warm_steps"] == 3 and straight["warm_steps"] == 0
    assert warm["warm_final_loss"] == straight["steps"][2]["loss"]
    assert straight["warm_final_loss"] is None
    assert warm["parameter_digest"] == straight["parameter_digest"]


_CAPTURE = [
    "--model", "mixtral-8x7b", "--width-scale", "64", "--layers", "1", "--iterations", "2",
    "--ranks-per-node", "1", "--systems", "fsdp", "--timeout-s", "120",
]  # fmt: skip


@pytest.fixture(scope="module")
def warm_capture(tmp_path_factory) -> Path:
    """A one-rank FSDP2 capture: 3 warm steps, 1 warm-up iteration, 2 timed, B = 128."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("warm-capture")
    done = _ciera("measure", "layers", "--out", str(out / "cap"), *_CAPTURE, "--warmup", "1",
                  "--warm-steps", "3", "--block-size", "128", "--json", str(out / "summary.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 warm steps (trained, not recorded)" in done.stdout
    return out


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_a_capture_with_warm_steps_records_only_its_iterations(warm_capture: Path) -> None:
    """Events of exactly the 2 timed iterations (a warm step in the recorder would add iterations); the runs
    row says B, the iterations before the first traced and how many of them were warm steps."""
    import traces

    bundle = traces.read_bundle(warm_capture / "cap" / "bundle")
    assert sorted(bundle.events["iteration"].unique()) == [0, 1]
    (run_dir,) = (warm_capture / "cap" / "runs").glob("*/")
    assert len(json.loads((run_dir / "run.json").read_text())["iteration_s"]) == 2
    row = bundle.runs.iloc[0]
    assert row["block_size"] == 128 and row["warmup_iterations"] == 3 + 1
    assert json.loads(row["versions"])["warm_steps"] == 3
    summary = json.loads((warm_capture / "summary.json").read_text())
    assert summary["plan"]["warm_steps"] == 3 and summary["plan"]["block_size"] == 128
    assert summary["runs"][0]["warm_steps"] == 3 and summary["runs"][0]["block_size"] == 128
    progress = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert [entry.get("warm", False) for entry in progress] == [True] * 3 + [False] * 3


@pytest.mark.heavy  # a second capture
def test_a_capture_goes_on_with_the_batches_after_the_warm_steps(warm_capture: Path) -> None:
    """4 warm-up iterations instead of 3 warm steps + 1: the same batches 0..3 before the 2 timed
    iterations, so the same losses there, and the same events per iteration."""
    import traces

    plain = warm_capture / "plain"
    done = _ciera("measure", "layers", "--out", str(plain), *_CAPTURE, "--warmup", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    (warm_dir,) = (warm_capture / "cap" / "runs").glob("*/")
    (plain_dir,) = (plain / "runs").glob("*/")
    warm_run = json.loads((warm_dir / "run.json").read_text())
    plain_run = json.loads((plain_dir / "run.json").read_text())
    assert warm_run["mean_loss"] == plain_run["mean_loss"]
    warm_events = traces.read_bundle(warm_capture / "cap" / "bundle").events
    assert len(warm_events) == len(traces.read_bundle(plain / "bundle").events)


@pytest.mark.heavy  # a capture of its own
def test_an_exponent_capture_after_warm_steps_numbers_its_rows_by_step(tmp_path: Path) -> None:
    """3 warm steps, then 12 steps whose statistics start after the 10-step warm-up: the rows are steps 14
    and 15 (step t against t - 1), at the default block sizes and the run's own B; the command ends with
    its summary (an exponent-only capture has no timed run to list)."""
    pytest.importorskip("deepspeed")
    import traces

    done = _ciera(
        "measure", "exponents", "--out", str(tmp_path / "cap"), "--model", "mixtral-8x7b", "--width-scale",
        "64", "--exponent-steps", "12", "--warm-steps", "3", "--block-size", "32", "--ranks-per-node", "1",
        "--timeout-s", "120", "--json", str(tmp_path / "summary.json"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    bundle = traces.read_bundle(tmp_path / "cap" / "bundle")
    assert sorted(bundle.exponents["iteration"].unique()) == [14, 15]
    assert sorted(bundle.exponents["block_size"].unique()) == [32, 64, 128, 256, 512, 1024]
    row = bundle.runs.iloc[0]
    assert row["block_size"] == 32 and row["warmup_iterations"] == 3 + 10
    assert json.loads(row["versions"])["warm_steps"] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["runs"] == []


def test_link_rates_of_one_shape_are_interleaved_per_depth() -> None:
    """Two rates of the 2x1 shape share one cluster and run depth by depth, every rate's systems back to
    back (each block starting one system further along); the 2x2 shape is its own group; sweeps first,
    the exponent run last."""
    from measure.campaign import Topology, interleaved_order

    slow, fast = Topology(2, 1, "200mbit"), Topology(2, 1, "1gbit")
    wide = Topology(2, 2, "200mbit")
    plan = CapturePlan(
        model="mixtral-8x7b", width_scale=64, layers=(2, 4), systems=("zero3", "ciera"),
        topologies=(slow, fast, wide), exponent_steps=5,
    )  # fmt: skip
    groups = interleaved_order(plan_steps(plan))
    assert [len(group) for group in groups] == [2 + 8 + 1, 1 + 4]
    names = [(step.kind, step.topology.link_rate, step.job.get("train", {}).get("layers"), step.job.get("system"))
             for step in groups[0]]  # fmt: skip
    assert names == [
        ("collectives", "200mbit", None, None), ("collectives", "1gbit", None, None),
        ("layers", "200mbit", 2, "zero3"), ("layers", "200mbit", 2, "ciera"),
        ("layers", "1gbit", 2, "ciera"), ("layers", "1gbit", 2, "zero3"),
        ("layers", "200mbit", 4, "zero3"), ("layers", "200mbit", 4, "ciera"),
        ("layers", "1gbit", 4, "ciera"), ("layers", "1gbit", 4, "zero3"),
        ("exponents", "200mbit", plan.exponent_layers, None),
    ]  # fmt: skip
    assert {step.topology for step in groups[1]} == {wide}
    assert sorted(step.name for group in groups for step in group) == sorted(s.name for s in plan_steps(plan))


@pytest.mark.parametrize("launches", [1, 2, 3])
def test_every_system_takes_every_place_in_its_block_alike(launches: int) -> None:
    """A slow spell at the end of a block must not always fall on the same system: over a plan whose
    blocks (launch, depth, rate) number a multiple of its systems, each system runs first, second, ... in
    as many blocks as every other, and no run sits at the same place in two of its launches."""
    from collections import Counter

    from measure.campaign import Topology, interleaved_order

    systems = ("zero3", "fsdp", "ciera", "ciera-fsdp")
    plan = CapturePlan(
        model="mixtral-8x7b", width_scale=64, layers=(2, 4), systems=systems,
        topologies=(Topology(2, 1, "200mbit"), Topology(2, 1, "1gbit")), exponent_steps=5,
        kinds=("layers",), launches=launches,
    )  # fmt: skip
    (group,) = interleaved_order(plan_steps(plan))
    blocks = [group[i : i + len(systems)] for i in range(0, len(group), len(systems))]
    assert len(blocks) == 4 * launches
    places: Counter = Counter()
    place_of_run: dict[str, list[int]] = {}
    for block in blocks:
        assert sorted(step.job["system"] for step in block) == sorted(systems)
        assert len({(step.job["launch"], step.job["train"]["layers"], step.topology) for step in block}) == 1
        for place, step in enumerate(block):
            places[(step.job["system"], place)] += 1
            place_of_run.setdefault(step.job["run_id"], []).append(place)
    assert set(places.values()) == {launches}
    assert all(len(set(seen)) == len(seen) == launches for seen in place_of_run.values())


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        # A timeout of 0 started the ranks and failed each connect with torch's own message.
        ({"timeout_s": 0}, "timeout_s is 0: expected a positive number"),
        ({"timeout_s": float("nan")}, "timeout_s is nan: expected a positive number"),
        ({"timeout_s": True}, "timeout_s is True: expected a positive number"),
        ({"lr": -1.0}, "lr is -1.0: expected a positive number"),
    ],
)
def test_bad_numbers_are_one_line_before_any_rank_starts(changes: dict, words: str) -> None:
    with pytest.raises(TrainError) as error:
        dataclasses.replace(TrainConfig(), **changes).check()
    assert words in str(error.value) and "\n" not in str(error.value)
