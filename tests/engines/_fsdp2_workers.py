"""Worker functions for the spawned FSDP2 + CIERA tests (importable by the spawned children)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

STEPS = 20
PIPELINED_STEPS = 6
CHECKPOINT_STEP = 10


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyModel(nn.Module):
    """Input projection, a few residual blocks (LayerNorm + two Linear), a head; each block checkpointed."""

    def __init__(self, width: int = 64, depth: int = 3, checkpointing: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing else block(h)
        return self.head(h)


def build(reshard_after_forward: bool = True, param_dtype=torch.bfloat16, width: int = 64):
    """Same seed on every rank and every build: identical initial weights (FP32 master parameters; the
    all-gather in ``param_dtype``, gradients reduced in FP32; ``param_dtype=None``: no policy, FP32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyModel(width)
    policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    )
    kwargs = {"mp_policy": policy} if policy else {}
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, torch.sin(x[:, :4].sum(-1, keepdim=True))


def train_step(model, optimizer, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = ((model(x).float() - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {name: torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)) for name in a}


class CountingAllGather:
    """The plain all-gather with a call count per module (to compare FSDP2's schedule with and without
    CIERA)."""

    @staticmethod
    def install(model) -> dict[str, int]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        counts: dict[str, int] = {}

        class _Counting(AllGather):
            def __init__(self, name: str) -> None:
                self.name = name

            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                counts[self.name] = counts.get(self.name, 0) + 1
                return dist.all_gather_into_tensor(
                    output_tensor, input_tensor, group=group, async_op=async_op
                )

        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_Counting(name or "<root>"))
        return counts


def _flip_one_received_bit(target_rank: int, rank: int):
    """A one-shot fault: on ``target_rank``, flip a bit in the sign+mantissa section of source 0's row."""
    armed = {"left": 1 if rank == target_rank else 0}

    def injector(point, shard_id, array) -> None:
        if point == "receive" and armed["left"]:
            armed["left"] -= 1
            array[0, 200] ^= 0x10

    return injector


def training_worker(rank: int, world_size: int, port: int, checkpoint_dir: str, result_queue) -> None:
    """Plain FSDP2 vs FSDP2 + CIERA (same seed, same data), gather counts, one injected fault with
    recovery, checkpoint save → load into a fresh model → continue, a rollback into the live model, the
    async unshard path, reshard_after_forward=False, and FP32 gathers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ciera_runtime import GatherError
    from ciera_runtime.fsdp2 import enable_ciera

    init_gloo(rank, world_size, port)
    out: dict = {"rank": rank}
    try:
        # ---- plain FSDP2 (reshard_after_forward=True, checkpointing per block), counting its gathers
        model, optimizer = build()
        plain_counts = CountingAllGather.install(model)
        plain_losses = [train_step(model, optimizer, step, rank) for step in range(STEPS)]
        plain_params = full_params(model)
        out["plain_gathers_per_iteration"] = {name: count / STEPS for name, count in plain_counts.items()}
        del model, optimizer

        # ---- FSDP2 + CIERA, a fault injected once (step 5) and recovered from
        model, optimizer = build()
        ciera = enable_ciera(model)
        losses, errors = [], []
        step = 0
        while step < STEPS:
            if step == 5 and not errors:
                for engine in ciera.engines.values():
                    engine.fault_injector = _flip_one_received_bit(1, rank)
            try:
                losses.append(train_step(model, optimizer, step, rank))
            except GatherError as error:
                errors.append((type(error).__name__, str(error)))
                model.reset_iter_state()
                optimizer.zero_grad()
                continue  # the same step again
            step += 1
        ciera_params = full_params(model)
        out["losses_equal"] = losses == plain_losses
        out["losses"] = (plain_losses, losses)
        out["params_equal"] = same_bits(plain_params, ciera_params)
        out["errors"] = errors
        out["ciera_gathers_per_iteration"] = ciera.gathers_per_iteration()
        out["stats"] = ciera.stats()
        out["resyncs"] = sum(engine.stats.resyncs for engine in ciera.engines.values())
        del model, optimizer, ciera

        # ---- pipelined buckets: 2 KiB parts cut every block's shard (8352 values) into 8 buckets
        model, optimizer = build()
        pipelined = enable_ciera(model, part_bytes=2048)
        out["pipelined_losses_equal"] = [
            train_step(model, optimizer, step, rank) for step in range(PIPELINED_STEPS)
        ] == plain_losses[:PIPELINED_STEPS]
        out["pipelined_stats"] = pipelined.stats()
        del model, optimizer, pipelined

        # ---- no entropy stage: full payloads are raw-sized and go as seeds, the next ones as deltas
        from ciera_runtime import CodecConfig

        model, optimizer = build()
        uncoded = enable_ciera(model, config=CodecConfig(entropy="none"))
        out["uncoded_losses_equal"] = [
            train_step(model, optimizer, step, rank) for step in range(PIPELINED_STEPS)
        ] == plain_losses[:PIPELINED_STEPS]
        buckets = [engine.bucket_stats for engine in uncoded.engines.values() if engine.bucket_stats]
        out["uncoded_messages"] = {
            "seed": sum(b.seed_messages for b in buckets),
            "raw": sum(b.raw_messages for b in buckets),
            "payload": sum(b.payload_messages for b in buckets),
        }
        del model, optimizer, uncoded

        # ---- checkpoint: train to step 10, save, load into a fresh model (fresh engines), continue;
        # at step 13 roll the live model back to the step-10 checkpoint and run 10..19 again.
        model, optimizer = build()
        enable_ciera(model)
        resumed_losses = [train_step(model, optimizer, step, rank) for step in range(CHECKPOINT_STEP)]
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
        del model, optimizer
        model, optimizer = build()
        ciera = enable_ciera(model)

        def load() -> None:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=checkpoint_dir)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

        load()
        resumed_losses += [train_step(model, optimizer, step, rank) for step in range(CHECKPOINT_STEP, 13)]
        load()  # rollback into the live model: its engines' caches hold the step-13 weights
        rollback_losses = [train_step(model, optimizer, step, rank) for step in range(CHECKPOINT_STEP, STEPS)]
        out["resume_losses_equal"] = resumed_losses == plain_losses[:13]
        out["rollback_losses_equal"] = rollback_losses == plain_losses[CHECKPOINT_STEP:]
        out["rollback_params_equal"] = same_bits(plain_params, full_params(model))
        out["checkpoint_resyncs"] = sum(engine.stats.resyncs for engine in ciera.engines.values())
        del model, optimizer, ciera

        # ---- reshard_after_forward=False: one gather per module per iteration
        model, optimizer = build(reshard_after_forward=False)
        ciera = enable_ciera(model)
        short = [train_step(model, optimizer, step, rank) for step in range(3)]
        out["no_reshard_losses_equal"] = short == plain_losses[:3]
        out["no_reshard_gathers_per_iteration"] = ciera.gathers_per_iteration()
        out["no_reshard_phases"] = {name: row["phases"] for name, row in ciera.stats()["modules"].items()}
        del model, optimizer, ciera

        # ---- the async unshard path (FSDP2 waits on the dist.Work the hook returns)
        model, optimizer = build()
        for module in model.modules():
            if hasattr(module, "_set_unshard_async_op"):
                module._set_unshard_async_op(True)
        ciera = enable_ciera(model)
        short = [train_step(model, optimizer, step, rank) for step in range(3)]
        out["async_losses_equal"] = short == plain_losses[:3]
        # An explicit unshard(async_op=True) of one block: its parameters equal the full tensors.
        block = model.blocks[1]
        expected = {name: p.full_tensor().to(torch.bfloat16) for name, p in block.named_parameters()}
        block.unshard(async_op=True).wait()
        out["explicit_unshard_equal"] = all(
            torch.equal(p.view(torch.int16), expected[name].view(torch.int16))
            for name, p in block.named_parameters()
        )
        block.reshard()
        stats = ciera.stats()
        out["async_gathers"] = (
            stats["gathers"],
            sum(row["async_gathers"] for row in stats["modules"].values()),
        )
        out["explicit_phases"] = stats["modules"]["blocks.1"]["phases"]
        del model, optimizer, ciera

        # ---- FP16 param_dtype: compressed too, bit-identical to plain FSDP2 in FP16
        fp16_losses = {}
        for kind in ("plain", "ciera"):
            model, optimizer = build(param_dtype=torch.float16)
            ciera = enable_ciera(model) if kind == "ciera" else None
            fp16_losses[kind] = [train_step(model, optimizer, step, rank) for step in range(3)]
        out["fp16_losses_equal"] = fp16_losses["plain"] == fp16_losses["ciera"]
        out["fp16_compressed"] = [row["compressed"] for row in ciera.stats()["modules"].values()]
        del model, optimizer, ciera

        # ---- FP32 all-gather input (no param_dtype): plain gathers, said once per module
        import logging

        records: list[str] = []

        class _Collect(logging.Handler):
            def emit(self, record) -> None:
                records.append(record.getMessage())

        handler = _Collect()
        logging.getLogger("ciera_runtime").addHandler(handler)
        model, optimizer = build(param_dtype=None)
        ciera = enable_ciera(model)
        for step in range(2):
            train_step(model, optimizer, step, rank)
        logging.getLogger("ciera_runtime").removeHandler(handler)
        stats = ciera.stats()
        out["fp32"] = {
            "compressed": [row["compressed"] for row in stats["modules"].values()],
            "plain_gathers": sum(row["plain_gathers"] for row in stats["modules"].values()),
            "gathers": stats["gathers"],
            "wire_ratio": stats["wire_ratio"],
            "log_lines": [line for line in records if "plain all-gather" in line],
        }
    finally:
        result_queue.put(out)
        dist.destroy_process_group()


def dying_rank_worker(
    rank: int, world_size: int, port: int, timeout_s: float, mode: str, result_queue
) -> None:
    """Rank 1 dies (``mode='exit'``) or stalls past the engine's timeout (``mode='stall'``) at step 3;
    rank 0 must raise, not hang."""
    from ciera_runtime.fsdp2 import enable_ciera

    init_gloo(rank, world_size, port, timeout_s=60)
    model, optimizer = build(width=32)
    enable_ciera(model, timeout_s=timeout_s)
    for step in range(3):
        train_step(model, optimizer, step, rank)
    if rank == 1:
        if mode == "exit":
            os._exit(0)
        time.sleep(timeout_s + 5)
        os._exit(0)
    start_s = time.perf_counter()
    try:
        train_step(model, optimizer, 3, rank)
        outcome = ("no error", "")
    except Exception as error:  # noqa: BLE001 — reported to the test
        outcome = (f"{type(error).__module__}.{type(error).__name__}", str(error))
    result_queue.put((rank, *outcome, time.perf_counter() - start_s))
    os._exit(0)  # the group is broken: no collective teardown


def subgroup_reshard_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """reshard_after_forward=2 on 4 ranks (backward gathers over a 2-rank group) and CPUOffloadPolicy:
    FSDP2 + CIERA against plain FSDP2, losses compared step by step."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from ciera_runtime.fsdp2 import enable_ciera

    init_gloo(rank, world_size, port)
    out: dict = {"rank": rank}
    try:
        for variant in ("subgroup", "offload"):
            options = (
                {"reshard_after_forward": 2}
                if variant == "subgroup"
                else {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
            )
            losses = {}
            for kind in ("plain", "ciera"):
                torch.manual_seed(0)
                model = TinyModel(32)
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.blocks:
                    fully_shard(block, mp_policy=policy, **options)
                fully_shard(model, mp_policy=policy, **options)
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
                ciera = enable_ciera(model) if kind == "ciera" else None
                losses[kind] = [train_step(model, optimizer, step, rank) for step in range(3)]
            stats = ciera.stats()
            out[variant] = {
                "losses_equal": losses["plain"] == losses["ciera"],
                "gathers_per_iteration": ciera.gathers_per_iteration(),
                "compressed": all(row["compressed"] for row in stats["modules"].values()),
                "engine_world_sizes": sorted(engine["world_size"] for engine in stats["engines"]),
            }
            if variant == "subgroup":  # selection weighs one link per module: refused, before any collective
                del model._ciera_fsdp2
                try:
                    enable_ciera(model, select=True, comm_profile=slow_profile())
                    out["subgroup"]["select_error"] = "no error"
                except ValueError as error:
                    out["subgroup"]["select_error"] = str(error)
    finally:
        result_queue.put(out)
        dist.destroy_process_group()


SELECT_STEPS = 3
# Link profiles given to enable_ciera(select=True), bytes per rank -> seconds: a slow link where every byte
# costs (1 KB/s: a block's 16.7 KB raw shard takes 16 s, far above any codec time) and a fast one where
# bytes cost nothing (the gain is minus the codec time: nothing pays).
PROFILE_SIZES = (256, 1 << 16, 1 << 24)


def slow_profile():
    from ciera_runtime.selection import CommProfile

    return CommProfile(PROFILE_SIZES, tuple(size / 1e3 for size in PROFILE_SIZES))


def fast_profile():
    from ciera_runtime.selection import CommProfile

    return CommProfile(PROFILE_SIZES, (1e-9,) * len(PROFILE_SIZES))


def select_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """enable_ciera(select=True) against plain FSDP2 (same seed, same data): a slow-link profile, a
    fast-link profile, codec timings that differ between the ranks, FP32 groups, a parameter group changed
    after enable_ciera, and the argument checks that need an FSDP2 model."""
    import logging

    import ciera_runtime.selection as selection
    from ciera_runtime import SelectionMismatchError
    from ciera_runtime.fsdp2 import enable_ciera
    from ciera_runtime.selection import CodecTimes

    init_gloo(rank, world_size, port)
    out: dict = {"rank": rank}
    records: list[tuple[str, str]] = []

    class _Collect(logging.Handler):
        def emit(self, record) -> None:
            records.append((record.levelname, record.getMessage()))

    handler = _Collect()
    ciera_logger = logging.getLogger("ciera_runtime")
    ciera_logger.addHandler(handler)
    ciera_logger.setLevel(logging.INFO)
    try:
        model, optimizer = build()
        plain_losses = [train_step(model, optimizer, step, rank) for step in range(SELECT_STEPS)]
        plain_params = full_params(model)
        del model, optimizer

        def run(label: str, **kwargs) -> None:
            records.clear()
            model, optimizer = build(param_dtype=kwargs.pop("param_dtype", torch.bfloat16))
            ciera = enable_ciera(model, select=True, **kwargs)
            losses = [train_step(model, optimizer, step, rank) for step in range(SELECT_STEPS)]
            stats = ciera.stats()
            out[label] = {
                "losses_equal": losses == plain_losses,
                "params_equal": all(same_bits(plain_params, full_params(model)).values()),
                "modules": {
                    name: {key: row[key] for key in ("compressed", "reason", "numel", "dtype", "gathers")}
                    | {"plain_gathers": row["plain_gathers"]}
                    for name, row in stats["modules"].items()
                },
                "selection": stats["selection"],
                "wire_ratio": stats["wire_ratio"],
                "engines": len(ciera.engines),
                "engine_gathers": sum(engine.stats.gathers for engine in ciera.engines.values()),
                "log": list(records),
            }

        run("slow", comm_profile=slow_profile())
        run("fast", comm_profile=fast_profile())

        # Codec timings that differ between the ranks: rank 0 measures a cheap codec, rank 1 one that costs
        # more than any byte saved on a 1 MB/s link. Each rank's own table is kept; both must apply rank 0's.
        local_tables: list = []
        original_select, original_measure = selection.select_shards, selection.measure_codec_times

        def recording_select(*args, **kwargs):
            table = original_select(*args, **kwargs)
            local_tables.append([row.as_dict() for row in table])
            return table

        def skewed_measure(numel, dtype, q, config=None, world_size=2, seed=0):
            cost_s = 1e-6 if rank == 0 else 100.0
            return CodecTimes(cost_s, cost_s, cost_s, 2.6)

        selection.select_shards, selection.measure_codec_times = recording_select, skewed_measure
        try:
            # The slow link: what is tested is whose table applies, not the per-call gate, which at 1 µs per
            # byte weighed the root module's ~0.5 ms of saved link against its measured per-call cost.
            run("skewed", comm_profile=slow_profile())
        finally:
            selection.select_shards, selection.measure_codec_times = original_select, original_measure
        out["skewed"]["local_selected"] = [row["selected"] for table in local_tables for row in table]

        # FP32 all-gather inputs: never candidates, no selection collective, plain gathers.
        records.clear()
        model, optimizer = build(param_dtype=None)
        ciera = enable_ciera(model, select=True, comm_profile=slow_profile())
        for step in range(2):
            train_step(model, optimizer, step, rank)
        stats = ciera.stats()
        out["fp32"] = {
            "compressed": [row["compressed"] for row in stats["modules"].values()],
            "reasons": [row["reason"] for row in stats["modules"].values()],
            "plain_gathers": sum(row["plain_gathers"] for row in stats["modules"].values()),
            "gathers": stats["gathers"],
            "selection": stats["selection"],
            "engines": len(ciera.engines),
            "log": list(records),
        }
        del model, optimizer, ciera

        # The parameter group changes after enable_ciera (blocks.1 gathered in FP16, decided for BF16):
        # the first gather of that module raises on both ranks, before any collective.
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model, optimizer = build()
        enable_ciera(model, select=True, comm_profile=slow_profile())
        model.blocks[1]._get_fsdp_state()._fsdp_param_groups[0].mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float32
        )
        try:
            train_step(model, optimizer, 0, rank)
            out["mismatch"] = ("no error", "")
        except SelectionMismatchError as error:
            out["mismatch"] = (type(error).__name__, str(error))
        del model, optimizer

        # Argument checks that need an FSDP2 model.
        model, _ = build()
        try:
            enable_ciera(model, select=True, categories={"blocks.9.fc1.weight": "attention"})
            out["unknown_name"] = "no error"
        except ValueError as error:
            out["unknown_name"] = str(error)
    finally:
        ciera_logger.removeHandler(handler)
        result_queue.put(out)
        dist.destroy_process_group()


def device_gather_worker(rank: int, world_size: int, port: int, result_queue) -> None:
    """Plain FSDP2 and FSDP2 with the device gather (the path CUDA parameters take) on CPU: the same losses
    and parameters, host reads counted; a received slot corrupted on one rank makes the next
    optimizer.step() raise the same GatherError on every rank before anything is applied."""
    from _device_counting import count_gather_host_reads

    from ciera_runtime import GatherError
    from ciera_runtime.fsdp2 import enable_ciera

    init_gloo(rank, world_size, port)
    out: dict = {"rank": rank}
    try:
        steps = 6
        model, optimizer = build()
        plain_losses = [train_step(model, optimizer, step, rank) for step in range(steps)]
        plain_params = full_params(model)
        plain_next = train_step(model, optimizer, steps, rank)
        plain_after_next = full_params(model)
        del model, optimizer

        model, optimizer = build()
        ciera = enable_ciera(model, device_gather=True, optimizer=optimizer)
        with count_gather_host_reads() as reads:
            losses = [train_step(model, optimizer, step, rank) for step in range(steps)]
        out["losses_equal"] = losses == plain_losses
        out["gather_host_reads"] = dict(reads)
        out["params_equal"] = same_bits(plain_params, full_params(model))
        out["stats"] = ciera.stats()
        out["reasons"] = sorted({m["reason"] for m in out["stats"]["modules"].values()})

        before = full_params(model)
        device = next(iter(ciera.device_gathers.values()))
        if rank == 0:
            device.fault_injector = lambda rows: rows[1].__setitem__(0, rows[1][0] ^ 1)
        try:
            train_step(model, optimizer, steps, rank)
            out["refused"] = None
        except GatherError as error:
            out["refused"] = str(error).splitlines()[0]
        device.fault_injector = None
        out["unchanged_by_refused_step"] = same_bits(before, full_params(model))
        # The same step again, as a caller that catches the error would: exact, as plain FSDP2's.
        optimizer.zero_grad()
        model.reset_iter_state()
        out["retried_step_equal"] = train_step(model, optimizer, steps, rank) == plain_next
        out["params_after_retry_equal"] = same_bits(plain_after_next, full_params(model))
        del model, optimizer, ciera

        # The async unshard path (FSDP2 waits on the dist.Work the hook returns) and no reshard after
        # forward (one gather per module and iteration): the device path gives plain FSDP2's losses.
        for name, reshard, async_op in (("async", True, True), ("no_reshard", False, False)):
            model, optimizer = build(reshard_after_forward=reshard)
            if async_op:
                for module in model.modules():
                    if hasattr(module, "_set_unshard_async_op"):
                        module._set_unshard_async_op(True)
            variant = enable_ciera(model, device_gather=True, optimizer=optimizer)
            losses = [train_step(model, optimizer, step, rank) for step in range(3)]
            out[f"{name}_losses_equal"] = losses == plain_losses[:3]
            out[f"{name}_async_gathers"] = sum(
                row["async_gathers"] for row in variant.stats()["modules"].values()
            )
            del model, optimizer, variant
    finally:
        result_queue.put(out)
        dist.destroy_process_group()
