"""CIERA inside DeepSpeed ZeRO-3 (ciera_runtime.zero3): spawned 2-rank gloo runs on DeepSpeed's CPU
accelerator, BF16 training with Adam, activation checkpointing per block.

Every spawned rank imports deepspeed (and with it torch._dynamo/inductor, ~8 s) once; the first
deepspeed.init_distributed builds DeepSpeed's shm op into $TORCH_EXTENSIONS_DIR (~60 s once per machine).
"""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import pytest

# Before deepspeed is imported (here and in the spawned ranks, which inherit the environment).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".torch_extensions"))
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _zero3_workers as workers  # noqa: E402

from measure.rank import release_deepspeed_shm  # noqa: E402
from tests.ranks import free_port, start_ranks  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes of multi-process work: CI runs it with -m heavy

STEPS = 20


def _run(worker, *args, world_size: int = 2, limit_s: float = 600.0) -> list:
    """Spawn ``world_size`` ranks of ``worker(rank, world_size, port, *args, results)``; the results are
    read while the ranks run (a result larger than a pipe's buffer would otherwise block its rank)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = start_ranks(worker, world_size, (world_size, port, *args, results), join=False)
    try:
        return _collect(worker, processes, results, world_size, limit_s)
    finally:  # ranks that leave by os._exit themselves (a dying rank) leave DeepSpeed's buffers behind
        release_deepspeed_shm({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _collect(worker, processes, results, world_size: int, limit_s: float) -> list:
    collected = []
    deadline = time.monotonic() + limit_s
    while len(collected) < world_size:
        try:
            collected.append(results.get(timeout=1.0))
        except queue.Empty:
            if processes.join(timeout=0.01) or time.monotonic() > deadline:  # raises if a rank failed
                break
    while not processes.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            raise TimeoutError(f"{worker.__name__}: ranks still running after {limit_s:g} s")
    assert len(collected) == world_size, f"{worker.__name__}: {len(collected)} of {world_size} results"
    return sorted(collected, key=lambda result: result["rank"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return _run(workers.train_worker, str(tmp_path_factory.mktemp("ckpt")), STEPS)


@pytest.fixture(scope="module")
def counted() -> list[dict]:
    return _run(workers.count_worker, 3)


def test_losses_and_parameters_bit_identical_to_plain_zero3(trained) -> None:
    for result in trained:
        assert len(result["losses"]) == STEPS
        # Python floats from loss.item(): == is bit equality here (no NaN).
        assert result["losses"] == result["plain_losses"]
        assert result["params_vs_plain"] == []
        assert result["losses"][-1] < result["losses"][0]  # it trains
    # Both ranks hold the same full parameters after GatheredParameters.
    assert trained[0]["param_digest"] == trained[1]["param_digest"]


def test_pipelined_buckets_cut_large_calls(trained) -> None:
    for result in trained:
        # 1 KiB parts: the larger coalesced calls travel as several buckets (bit-identity: the test above);
        # the resumed engine's default part size cuts none of this small model's calls.
        assert result["stats"]["ciera_pipelined_calls"] > 0
        assert result["stats"]["ciera_calls"] > result["stats"]["ciera_pipelined_calls"]
        budget = result["stats"]["ciera_part_budget"]
        assert 0 < budget["extra_calls_per_step"] <= budget["budget_per_step"]
        assert result["resumed_stats"]["ciera_pipelined_calls"] == 0


def test_every_bf16_parameter_goes_through_ciera_and_sends_fewer_bytes(trained) -> None:
    for result in trained:
        assert {path for path, _, _ in result["routes"].values()} == {"ciera"}
        stats = result["stats"]
        assert stats["deepspeed_gathers"] == 0 and stats["ciera_failed_gathers"] == 0
        assert stats["ciera_gathers"] > STEPS * len(result["routes"]) // 2
        # Fewer bytes than the raw gathers of the same run, and than the plain run's DeepSpeed gathers.
        assert stats["bytes_sent"] < stats["raw_bytes_equivalent"]
        assert stats["bytes_sent"] < result["plain_bytes"]
        # Same gathers as the plain run, plus the CIERA run's checkpoint save: DeepSpeed gathers the
        # persistent parameters again when it ends (checkpoint_event_epilogue).
        persistent_bytes = sum(2 * -(-result["numel"][name] // 2) for name in result["persistent_gathers"])
        assert stats["raw_bytes_equivalent"] == result["plain_bytes"] + persistent_bytes
        print(
            f"rank {result['rank']}: {STEPS} steps, bytes sent {stats['bytes_sent']} with CIERA vs "
            f"{result['plain_bytes']} plain ({stats['bytes_sent'] / result['plain_bytes']:.3f}); "
            f"{stats['ciera_gathers']} gathers, {stats['ciera_resyncs']} resyncs; "
            f"worker {result['seconds']:.1f} s"
        )


def test_gathered_parameters_and_persistent_parameters_use_ciera(trained) -> None:
    for result in trained:
        persistent = result["persistent_gathers"]
        # Once after each step, and once more when the checkpoint save ends (checkpoint_event_epilogue).
        assert persistent and all(count == STEPS + 1 for count in persistent.values())
        # GatheredParameters gathered every parameter that was partitioned (the persistent ones are not).
        partitioned = set(result["routes"]) - set(persistent)
        assert set(result["gathered_counts"]) == partitioned
        assert all(count == 1 for count in result["gathered_counts"].values())
        grew = result["stats_after_gathered"]["ciera_gathers"] - result["stats"]["ciera_gathers"]
        assert grew == len(partitioned)


def test_checkpoint_save_load_continue_bit_identical(trained) -> None:
    for result in trained:
        assert result["resumed_losses"] == result["losses"][STEPS // 2 :]
        assert result["resumed_vs_uninterrupted"] == []
        assert result["resumed_stats"]["ciera_failed_gathers"] == 0


@pytest.mark.parametrize("label", list(workers.COUNT_KNOBS))
def test_gather_counts_match_deepspeed(counted, label: str) -> None:
    for result in counted:
        found = result["counts"][label]
        for plain, ciera in zip(found["plain"], found["ciera"], strict=True):
            assert ciera["coalesced"] == plain["coalesced"]
            assert ciera["blocking"] == plain["blocking"]
        assert found["losses"] == found["plain_losses"] and found["failed"] == 0
        steady = found["ciera"][-1]
        assert found["ciera"][-2]["coalesced"] == steady["coalesced"]  # steady state from iteration 2
        partitioned = set(steady["coalesced"])
        assert partitioned and not partitioned & set(found["persistent"])
        per_phase = {
            phase: {name: steady[phase].get(name, 0) for name in partitioned}
            for phase in ("forward", "recompute", "backward")
        }
        checkpointed = {name for name in partitioned if name.startswith("blocks.")}
        if label in ("default", "reuse0"):
            # The prefetcher's first scan covers the whole trace (it fits the 5e7-element bucket) and marks
            # every parameter as used again, so none is released before its last use: one gather each.
            assert set(steady["coalesced"].values()) == {1}
            assert set(per_phase["recompute"].values()) == {0}
        elif label == "reuse0_live40k":
            # Prefetch capped by the live-parameter limit: several buckets in flight, waited in set order
            # (the FIFO keeps every rank's rounds in step); recompute and backward gather again.
            assert max(steady["coalesced"].values()) == 3
        else:
            # No prefetch and no reuse window: every use gathers. Checkpointed blocks: forward, recompute,
            # backward; embedding and LM head (outside the checkpoints): forward and backward.
            for name in partitioned:
                expected = (1, 1, 1) if name in checkpointed else (1, 0, 1)
                assert (
                    tuple(per_phase[phase][name] for phase in ("forward", "recompute", "backward"))
                    == expected
                )


def test_the_call_gate_leaves_calls_that_do_not_pay_whole_to_deepspeed() -> None:
    for result in _run(workers.gate_worker):
        never, free = result["runs"]["never_pays"], result["runs"]["free"]
        for run in (never, free):
            assert run["losses"] == result["plain_losses"] and run["params_equal"]
            assert run["compressed_params"] > 0  # BSC selected them; the gate decides per call
        assert never["gated_calls"] > 0 and never["ciera_calls"] == 0
        assert free["gated_calls"] == 0 and free["ciera_calls"] > 0
        # Measured on the group: CIERA's thread time per call, tens to thousands of microseconds.
        assert 1e-5 < result["runs"]["measured_overhead_s"] < 0.1


def test_bsc_applies_rank_zeros_table(counted) -> None:
    rank0, rank1 = counted
    assert rank0["measured_table"] == rank1["measured_table"]
    assert rank0["given_table"] == rank1["given_table"]
    selected = {row["shard_id"] for row in rank0["measured_table"] if row["selected"]}
    assert {ds_id for ds_id, path in rank0["measured_routes"].items() if path == "ciera"} == selected
    # A slow link (2 MB/s) pays for the large, stable expert weights (a raw gather takes 16 ms, the codec
    # ~0.3 ms and the protocol's two extra rounds ~0.4 ms); the tiny parameters cost more in those rounds
    # than they save. (Attention, q = 0.96, gains ~2 ms less: on a loaded machine its measured codec time
    # can eat that, so it is not asserted.)
    routes = rank0["given_routes"]
    assert routes == rank1["given_routes"]
    compressed = {name for name, (path, _, _) in routes.items() if path == "ciera"}
    experts = {
        name for name, (_, numel, category) in routes.items() if category == "expert_ffn" and numel >= 16384
    }
    assert experts and experts <= compressed
    assert not {name for name, (_, numel, _) in routes.items() if numel <= 512} & compressed
    # Mixed buckets (CIERA and DeepSpeed-path parameters in one coalesced call) train bit-identically.
    for result in counted:
        assert result["losses"] == result["counts"]["default"]["plain_losses"]
    for result in counted:
        stats = result["given_stats"]
        assert (
            stats["ciera_gathers"] > 0
            and stats["deepspeed_gathers"] > 0
            and stats["ciera_failed_gathers"] == 0
        )
    # No history at start-up: the priors are named in a log line (rank 0).
    assert any("per-category priors" in line and "expert_ffn q=0.22" in line for line in rank0["log"])


def test_a_failed_gather_raises_on_the_failing_rank_and_at_the_others_next_call(counted) -> None:
    rank0, rank1 = counted
    # Rank 1 could not rebuild rank 0's payload: it raises in that gather, naming the shard and itself.
    fault = rank1["fault"]
    assert fault["is_gather_error"] and fault["shard_id"] == fault["victim"]
    assert "could not rebuild" in fault["message"] and "rank 1" in fault["message"]
    # Rank 0's weights were exact; rank 1 left the step and exited, as torchrun's workers do: rank 0's
    # next collective (CIERA's or DeepSpeed's) fails at once, never a hang.
    assert rank0["fault"]["raised"] is not None, rank0["fault"]
    assert rank0["fault"]["seconds"] < 60, rank0["fault"]
    print(f"rank 0 after rank 1's failure: {rank0['fault']['raised']}: {rank0['fault']['message'][:120]}")


def test_a_rank_that_dies_does_not_hang_the_other() -> None:
    timeout_s = 20.0
    rank0, rank1 = _run(workers.dying_rank_worker, timeout_s)
    assert rank1["outcome"] == "exited"
    assert rank0["outcome"] != "no error"
    print(f"rank 0 after rank 1 exited: {rank0['outcome']} after {rank0['seconds']:.1f} s")
    assert rank0["seconds"] < 2 * timeout_s + 10


# ----------------------------------------------------------------------------- without spawned ranks


def test_deepspeed_version_outside_the_supported_range(monkeypatch) -> None:
    import deepspeed

    from ciera_runtime import zero3

    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(zero3.DeepSpeedVersionError) as error:
        zero3.require_deepspeed()
    message = str(error.value)
    assert "\n" not in message and "0.19.x" in message and "0.20.1" in message
    for version in ("0.19.0", "0.19.8", "0.19.12+cpu"):
        zero3.check_deepspeed_version(version)
    for version in ("0.18.9", "1.19.0", "0.19", "0.190.1"):
        with pytest.raises(zero3.DeepSpeedVersionError):
            zero3.check_deepspeed_version(version)


def test_deepspeed_missing_names_the_extra(monkeypatch) -> None:
    from ciera_runtime import zero3

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError) as error:
        zero3.require_deepspeed()
    assert 'pip install -e ".[deepspeed]"' in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "name, category",
    [
        ("embed.weight", "embedding"),
        ("model.embed_tokens.weight", "embedding"),
        ("lm_head.weight", "embedding"),
        ("blocks.0.norm1.weight", "norm"),
        ("layers.3.input_layernorm.weight", "norm"),
        ("blocks.0.attn.weight", "attention"),
        ("layers.1.self_attn.q_proj.weight", "attention"),
        ("blocks.2.router.weight", "router"),
        ("layers.0.mlp.gate.weight", "router"),
        ("layers.0.mlp.experts.3.gate_proj.weight", "expert_ffn"),
        ("blocks.0.experts.1.0.weight", "expert_ffn"),
        ("fc.weight", "expert_ffn"),
    ],
)
def test_categories_from_names(name: str, category: str) -> None:
    from ciera_runtime.zero3 import category_from_name

    assert category_from_name(name) == category


def test_config_section_is_validated() -> None:
    from types import SimpleNamespace

    from ciera_runtime.zero3 import ciera_section

    def engine(section):
        return SimpleNamespace(_config=SimpleNamespace(_param_dict={"ciera": section}))

    assert ciera_section(engine({"enabled": True, "select": False})) == {"enabled": True, "select": False}
    assert ciera_section(SimpleNamespace()) == {}
    assert ciera_section(engine({"entropy": "none"})) == {"entropy": "none"}
    with pytest.raises(ValueError, match="ciera.blocksize"):
        ciera_section(engine({"blocksize": 256}))
    with pytest.raises(ValueError, match="expected a table"):
        ciera_section(engine(True))


def test_parts_cut_calls_alike_on_every_rank() -> None:
    from types import SimpleNamespace

    import torch

    from ciera_runtime.zero3 import _parts

    def params(*numels):
        return [
            SimpleNamespace(ds_id=i, ds_tensor=torch.empty(n, dtype=torch.bfloat16))
            for i, n in enumerate(numels)
        ]

    def sizes(parts):
        return [sum(p.ds_tensor.numel() * 2 for p in part) for part in parts]

    small = params(100, 200, 300)
    assert _parts(small, 1) == [small]  # one part: the call whole
    even = params(*[1024] * 16)  # 32 KiB in 2 KiB parameters
    cut = _parts(even, 4)
    assert sizes(cut) == [8 << 10] * 4 and [p for part in cut for p in part] == even  # order kept
    lopsided = params(8192, 10, 10)  # a small remainder joins the last part
    assert sizes(_parts(lopsided, 2)) == [16384 + 40]
    assert len(_parts(params(1, 1), 8)) == 2  # never more parts than parameters


def test_the_device_gather_trains_bit_identical_and_refuses_a_corrupted_step(tmp_path) -> None:
    """The device path (what CUDA partitions take) on CPU partitions: losses and parameters as plain
    ZeRO-3, two host reads per step, a checkpoint resumed alike, a corrupted slot refused by every rank."""
    steps = 8
    ranks = _run(workers.device_train_worker, str(tmp_path), steps)
    for result in ranks:
        assert result["losses"] == result["plain_losses"], result["rank"]
        assert result["params_vs_plain"] == [] and result["resumed_vs_uninterrupted"] == []
        assert result["resumed_losses"] == result["losses"][steps // 2 :]
        assert result["routes"] == [("ciera", "device gather (entropy rans)")]
        # Inside the gathers (issue and wait, prepare excluded): no aten op that reads the host on a GPU.
        assert result["gather_host_reads"] == {}, result["gather_host_reads"]
        assert result["accumulation_losses_equal"] and result["accumulation_params_equal"]
        stats = result["stats"]
        assert stats["deepspeed_gathers"] == 0 and stats["ciera_gathers"] > 0
        # One prepare at enable and after each step, one check before each step; nothing per gather.
        assert stats["ciera_device_host_reads"] == 1 + 2 * steps
        assert stats["ciera_bytes_sent"] < stats["ciera_raw_bytes_equivalent"]
        assert result["refused"] is not None and "not applied" in result["refused"]
        assert result["changed_by_refused_step"] == []
