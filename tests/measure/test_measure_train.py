"""`ciera train`: DeepSpeed ZeRO-3 and FSDP2 with CIERA train bit-identically to the plain engines on a zoo
model (losses every step, every final parameter), send fewer bytes, and resume from a checkpoint exactly;
bad input and a dying rank end in one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _train_workers import runs_worker  # noqa: E402

from measure.train import CHECKPOINT_MANIFEST, TrainConfig, TrainError, check_resume, train  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes of multi-process work: CI runs it with -m heavy

# The engines' own tests (tests/engines) train 20+ steps; these check the `ciera train` harness on a zoo
# model, so a few steps keep the default suite short.
TINY = TrainConfig(
    model="small-moe", layers=1, width_scale=4, seq_len=32, global_batch=2, steps=8, lr=1e-3, timeout_s=120
)
from tests.ranks import free_port, start_ranks  # noqa: E402

HALF = TINY.steps // 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of the comparisons, in one spawned 2-rank group; rank 0's results (digests are checked
    equal on both ranks)."""
    checkpoint = str(tmp_path_factory.mktemp("ckpt"))
    runs = [
        ("zero3_off", dataclasses.replace(TINY, engine="zero3", ciera=False)),
        ("zero3_on", dataclasses.replace(TINY, engine="zero3", ciera=True)),
        ("fsdp_off", dataclasses.replace(TINY, engine="fsdp", ciera=False)),
        ("fsdp_on", dataclasses.replace(TINY, engine="fsdp", ciera=True)),
        ("fsdp_select", dataclasses.replace(TINY, engine="fsdp", ciera=True, select=True)),
        ("zero3_device", dataclasses.replace(TINY, engine="zero3", ciera=True, device_gather=True)),
        ("fsdp_device", dataclasses.replace(TINY, engine="fsdp", ciera=True, device_gather=True)),
        (
            "zero3_on_first_half",
            dataclasses.replace(TINY, steps=HALF, save_at=HALF, checkpoint_dir=checkpoint),
        ),
        ("zero3_on_resumed", dataclasses.replace(TINY, resume=True, checkpoint_dir=checkpoint)),
    ]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    start_ranks(runs_worker, 2, (2, free_port(), runs, queue), join=True)
    results = dict(queue.get() for _ in range(2))
    for name in results[0]:
        assert results[0][name]["parameter_digest"] == results[1][name]["parameter_digest"], name
    return {**results[0], "checkpoint_dir": checkpoint}


def _losses(run: dict) -> list[str]:
    return [step["loss_bits"] for step in run["steps"]]


@pytest.mark.parametrize("engine", ["zero3", "fsdp", "zero3_device", "fsdp_device"])
def test_ciera_trains_bit_identically_to_the_plain_engine(runs: dict, engine: str) -> None:
    """The host path and the device path (--device-gather, what CUDA parameters take) alike."""
    plain, ciera = (
        runs[f"{engine.removesuffix('_device')}_off"],
        runs[engine if "_" in engine else f"{engine}_on"],
    )
    assert len(_losses(ciera)) == TINY.steps
    assert _losses(ciera) == _losses(plain)  # every step, as float32 bits
    assert ciera["parameter_digest"] == plain["parameter_digest"]  # every final parameter
    assert len(set(_losses(ciera))) == TINY.steps  # the model really trained
    sent = sum(step["allgather_bytes_sent"] for step in ciera["steps"])
    raw = sum(step["raw_bytes"] for step in ciera["steps"])
    plain_sent = sum(step["allgather_bytes_sent"] for step in plain["steps"])
    # The same gathers, counted raw (FSDP2's device path registers at its first gather, inside step 0: its
    # 8-byte shard-set fingerprint is on the wire too).
    assert raw - plain_sent == (8 if engine == "fsdp_device" else 0)
    # Fewer bytes on the wire; in these first steps of a tiny model most blocks change.
    assert sent < (0.95 if engine.endswith("_device") else 0.8) * raw


def test_select_reaches_the_fsdp2_plug_in(runs: dict) -> None:
    """--select decides every FSDP2 module at start-up (what it picks depends on this machine's link and
    codec timings); whatever it picks trains bit-identically."""
    run = runs["fsdp_select"]
    assert run["ciera"]["select"] is True
    assert [row["module"] for row in run["ciera"]["selection"]] == ["<root>", "blocks.0"]
    assert _losses(run) == _losses(runs["fsdp_off"])
    assert run["parameter_digest"] == runs["fsdp_off"]["parameter_digest"]


def test_zero3_gathers_each_parameter_as_often_as_deepspeed(runs: dict) -> None:
    counts = runs["zero3_on"]["gathers_per_parameter"]
    assert counts and all(count >= 1 for count in counts.values())


def test_resume_from_a_checkpoint_with_ciera_is_bit_identical(runs: dict) -> None:
    straight, first, resumed = runs["zero3_on"], runs["zero3_on_first_half"], runs["zero3_on_resumed"]
    assert [step["step"] for step in resumed["steps"]] == list(range(HALF, TINY.steps))
    assert _losses(first) + _losses(resumed) == _losses(straight)
    assert resumed["parameter_digest"] == straight["parameter_digest"]
    # The save wrote its manifest: the resume was checked against it before any rank started.
    manifest = json.loads((Path(runs["checkpoint_dir"]) / CHECKPOINT_MANIFEST).read_text())
    assert manifest["step"] == HALF and manifest["engine"] == "zero3" and manifest["layers"] == 1
    check_resume(dataclasses.replace(TINY, resume=True, checkpoint_dir=runs["checkpoint_dir"]))


def test_a_rank_that_dies_stops_the_run_with_one_line() -> None:
    config = dataclasses.replace(TINY, engine="fsdp", steps=6, exit_rank_at=(1, 3), timeout_s=30)
    with pytest.raises(TrainError, match="rank 1 exited with code 17") as error:
        train(config)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "args, words",
    [
        (["train", "no-such-model"], "no-such-model"),
        (["train", "--engine", "megatron"], "engine 'megatron'"),
        (["train", "--world-size", "3", "--global-batch", "4"], "does not split over 3 ranks"),
        (["train", "--width-scale", "7"], "width"),
        (["train", "--ciera", "maybe"], "--ciera 'maybe'"),
        (["train", "--entropy", "zstd"], "--entropy 'zstd': expected rans or none"),
        (["train", "--device-gather", "--select"], "device_gather compresses every BF16 parameter"),
        (["train", "--device-gather", "--ciera", "off"], "device_gather is CIERA's device path"),
        (["train", "--save-at", "3"], "--checkpoint-dir"),
        (["train", "--json", "/nonexistent-dir/x.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], words: str, capsys, monkeypatch) -> None:
    import ciera_cli.main as entry

    monkeypatch.setattr(sys, "argv", ["ciera", *args])
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    captured = capsys.readouterr()
    assert exit_.value.code == 2, captured
    assert words in captured.err and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_nan_loss_stops_and_names_the_step() -> None:
    config = dataclasses.replace(TINY, engine="fsdp", steps=8, lr=1e30)
    with pytest.raises(TrainError, match=r"loss is nan at step \d+"):
        train(config)


def test_a_hung_run_prints_each_live_ranks_stack_before_it_is_stopped(capfd) -> None:
    from _train_workers import hung_rank

    from measure.train import _no_progress

    context = mp.get_context("spawn")
    ready = context.Event()
    hung = context.Process(target=hung_rank, args=(ready,))
    hung.start()
    try:
        assert ready.wait(60)
        message = _no_progress([hung], 360.0)
    finally:
        hung.kill()
        hung.join()
    assert message == "no progress for 360 s; the Python stacks of ranks [0] are printed above"
    assert "in hung_rank" in capfd.readouterr().err
    assert _no_progress([hung], 360.0) == "no progress for 360 s"  # nobody left to ask


@pytest.mark.parametrize("model", ["deepseek-moe-16b", "llama-4-scout-17b-16e"])
def test_plain_zero3_trains_models_with_an_ungated_shared_expert(model: str) -> None:
    """DeepSpeed ZeRO-3 re-partitioned an ungated shared expert's down-projection before autograd had
    accumulated its gradient when the expert ran after the routed ones (`RuntimeError: The size of tensor
    a (0) must match the size of tensor b (...)` in the first backward); it runs first now. Plain and with
    CIERA, bit-identical."""
    config = dataclasses.replace(
        TINY, model=model, layers=2, width_scale=32, steps=2, engine="zero3", ciera=False
    )
    plain = train(config)
    with_ciera = train(dataclasses.replace(config, ciera=True))
    assert len(_losses(plain)) == 2 and _losses(plain) == _losses(with_ciera)
    assert plain["parameter_digest"] == with_ciera["parameter_digest"]
