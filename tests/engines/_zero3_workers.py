"""Spawned-rank workers for the DeepSpeed ZeRO-3 integration tests (importable by the spawned children)."""

from __future__ import annotations

import collections
import logging
import os
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

HIDDEN = 128
VOCAB = 32
TOKENS = 8  # per micro-batch and rank


class Block(nn.Module):
    """norm -> attention-ish projection -> norm -> a two-expert MoE FFN, dense dispatch (every expert runs,
    weighted by the router's softmax, so the module order never changes between iterations)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, 2)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        gate = torch.softmax(self.router(h).float(), dim=-1).to(h.dtype)
        return x + sum(gate[:, i : i + 1] * expert(h) for i, expert in enumerate(self.experts))


class TinyMoE(nn.Module):
    def __init__(self, blocks: int = 3, checkpointing: str = "torch") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing == "torch":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
            elif self.checkpointing == "deepspeed":
                import deepspeed

                x = deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.float(), targets)


def ds_config(**zero) -> dict:
    zero_config = {"stage": 3, "stage3_param_persistence_threshold": 300}
    zero_config.update(zero)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": zero_config,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def init_deepspeed(rank: int, world_size: int, port: int, timeout_s: float | None = None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import deepspeed

    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, **kwargs)


def make_engine(seed: int = 0, config: dict | None = None, checkpointing: str = "torch"):
    """deepspeed.initialize, or ciera_runtime.zero3.initialize when the config has a "ciera" section."""
    import deepspeed

    from ciera_runtime import zero3

    torch.manual_seed(seed)
    model = TinyMoE(checkpointing=checkpointing)
    config = config or ds_config()
    initialize = zero3.initialize if "ciera" in config else deepspeed.initialize
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return tokens, (tokens * 7 + 3) % VOCAB


def train_step(engine, step: int, rank: int) -> float:
    loss = engine(*batch(step, rank))
    engine.backward(loss)
    engine.step()
    return loss.item()


def full_params(engine) -> dict[str, bytes]:
    """Every parameter gathered (GatheredParameters), as raw bytes."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {name: p.detach().contiguous().view(torch.int16).numpy().tobytes() for name, p in params}


class GatherCounter:
    """Counts the gathers DeepSpeed's own functions do per parameter: ``coalesced`` (the coordinator's
    fetches and prefetches) and ``blocking`` (param.all_gather: GatheredParameters, persistent parameters);
    the reference a plain ZeRO-3 run gives."""

    def __init__(self, engine) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.not_available = ZeroParamStatus.NOT_AVAILABLE
        self.coalesced: collections.Counter = collections.Counter()
        self.blocking: collections.Counter = collections.Counter()
        self.bytes_sent = 0
        self.names = {}
        for name, param in engine.module.named_parameters():
            self.names[param.ds_id] = name
            param.all_gather_coalesced = self._wrap_coalesced(param.all_gather_coalesced)
            param.all_gather = self._wrap_blocking(param, param.all_gather)

    def clear(self) -> None:
        self.coalesced.clear()
        self.blocking.clear()

    def _add(self, counter, params) -> None:
        for param in params:
            counter[self.names[param.ds_id]] += 1
            self.bytes_sent += param.ds_tensor.ds_numel * param.ds_tensor.element_size()

    def _wrap_coalesced(self, original):
        def all_gather_coalesced(params, safe_mode=False, quantize=False):
            params = list(params)
            self._add(self.coalesced, params)
            return original(params, safe_mode=safe_mode, quantize=quantize)

        return all_gather_coalesced

    def _wrap_blocking(self, owner, original):
        def all_gather(param_list=None, async_op=False, hierarchy=0):
            params = [owner] if param_list is None else list(param_list)
            self._add(self.blocking, [p for p in params if p.ds_status == self.not_available])
            return original(param_list=params, async_op=async_op, hierarchy=hierarchy)

        return all_gather


def finish(results, payload) -> None:
    import torch.distributed as dist

    dist.barrier()
    results.put(payload)
    dist.destroy_process_group()


def init_worker(rank: int, world_size: int, port: int, timeout_s: float | None = None) -> None:
    import numba

    numba.set_num_threads(1)  # two ranks share two cores: one numba thread each
    init_deepspeed(rank, world_size, port, timeout_s)


def train_worker(rank: int, world_size: int, port: int, checkpoint_dir: str, steps: int, results) -> None:
    """Plain ZeRO-3 and ZeRO-3 + CIERA (every BF16 parameter compressed) from the same seed and data; a
    checkpoint saved mid-run by the CIERA engine is loaded into a fresh CIERA engine that continues."""
    import hashlib

    from ciera_runtime.zero3 import enable_ciera

    init_worker(rank, world_size, port)
    started = time.perf_counter()
    save_at = steps // 2

    engine = make_engine(0)
    counter = GatherCounter(engine)
    plain_losses = [train_step(engine, step, rank) for step in range(steps)]
    plain_bytes = counter.bytes_sent
    plain_params = full_params(engine)
    del engine, counter

    # The config key; buckets of 1 KiB per rank, so every coalesced call of this small model is pipelined
    # as several buckets (the resumed engine below keeps the default: one bucket per call here).
    engine = make_engine(0, {**ds_config(), "ciera": {"enabled": True, "select": False, "part_bytes": 1024}})
    ciera = engine.ciera
    routes = {route.name: (route.path, route.reason, route.category) for route in ciera.routes.values()}
    losses = []
    for step in range(steps):
        losses.append(train_step(engine, step, rank))
        if step + 1 == save_at:
            engine.save_checkpoint(checkpoint_dir, tag="mid")
    stats = ciera.stats()
    before_gathered = ciera.gathers_per_param(phase="outside_fetch")
    ciera.reset_counts()
    ciera_params = full_params(engine)  # GatheredParameters, through CIERA
    gathered_counts = ciera.gathers_per_param(phase="outside_fetch", kind="sync")
    stats_after_gathered = ciera.stats()
    del engine

    engine = make_engine(1)  # different initial weights: everything must come from the checkpoint
    resumed_ciera = enable_ciera(engine, select=False)
    engine.load_checkpoint(checkpoint_dir, tag="mid")
    resumed_losses = [train_step(engine, step, rank) for step in range(save_at, steps)]
    resumed_params = full_params(engine)
    resumed_stats = resumed_ciera.stats()

    def differing(a: dict, b: dict) -> list[str]:
        return sorted(name for name in a if a[name] != b.get(name))

    finish(
        results,
        {
            "rank": rank,
            "plain_losses": plain_losses,
            "losses": losses,
            "resumed_losses": resumed_losses,
            "params_vs_plain": differing(ciera_params, plain_params),
            "resumed_vs_uninterrupted": differing(resumed_params, ciera_params),
            "param_digest": hashlib.sha256(
                b"".join(ciera_params[n] for n in sorted(ciera_params))
            ).hexdigest(),
            "numel": {name: len(raw) // 2 for name, raw in ciera_params.items()},
            "routes": routes,
            "stats": stats,
            "plain_bytes": plain_bytes,
            "persistent_gathers": before_gathered,
            "gathered_counts": gathered_counts,
            "stats_after_gathered": stats_after_gathered,
            "resumed_stats": resumed_stats,
            "seconds": time.perf_counter() - started,
        },
    )


COUNT_KNOBS = {
    "default": ({}, "torch"),
    "reuse0": ({"stage3_max_reuse_distance": 0}, "torch"),
    "reuse0_prefetch0": ({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}, "torch"),
    "reuse0_live40k": ({"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 40_000}, "torch"),
    "reuse0_prefetch0_dsckpt": (
        {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
        "deepspeed",
    ),
}


def count_worker(rank: int, world_size: int, port: int, iterations: int, results) -> None:
    """Gathers per parameter per iteration, plain ZeRO-3 (DeepSpeed's functions counted) against CIERA
    (the integration's own counts), under several engine knobs; then BSC on the measured link and on a
    given slow-link profile."""
    import torch.distributed as dist

    from ciera_runtime.selection import CommProfile
    from ciera_runtime.zero3 import enable_ciera

    init_worker(rank, world_size, port)
    started = time.perf_counter()
    found = {}
    for label, (zero, checkpointing) in COUNT_KNOBS.items():
        plain, ciera_counts, plain_losses, losses = [], [], [], []
        engine = make_engine(0, ds_config(**zero), checkpointing)
        counter = GatherCounter(engine)
        for step in range(iterations):
            counter.clear()
            plain_losses.append(train_step(engine, step, rank))
            plain.append({"coalesced": dict(counter.coalesced), "blocking": dict(counter.blocking)})
        engine = make_engine(0, ds_config(**zero), checkpointing)
        ciera = enable_ciera(engine, select=False)
        for step in range(iterations):
            ciera.reset_counts()
            losses.append(train_step(engine, step, rank))
            coalesced = collections.Counter(ciera.gathers_per_param(kind="fetch"))
            coalesced.update(ciera.gathers_per_param(kind="prefetch"))
            ciera_counts.append(
                {
                    "coalesced": dict(coalesced),
                    "blocking": ciera.gathers_per_param(kind="sync"),
                    **{
                        phase: ciera.gathers_per_param(phase=phase)
                        for phase in ("forward", "recompute", "backward")
                    },
                }
            )
        persistent = sorted(name for name, param in engine.module.named_parameters() if param.ds_persist)
        found[label] = {
            "plain": plain,
            "ciera": ciera_counts,
            "persistent": persistent,
            "plain_losses": plain_losses,
            "losses": losses,
            "failed": ciera.stats()["ciera_failed_gathers"],
        }

    # BSC: measured loopback profile, then a given slow-link profile (alpha 50 us, 2 MB/s).
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ciera_runtime").addHandler(handler)
    engine = make_engine(0)
    measured = enable_ciera(engine)
    measured_table = [row.as_dict() for row in measured.decisions]
    measured_routes = {route.ds_id: route.path for route in measured.routes.values()}
    measured.disable()
    sizes = tuple(4**k for k in range(4, 12))
    slow = CommProfile(sizes, tuple(50e-6 + size / 2e6 for size in sizes))
    # A short timeout: after the fault below, the rank that failed leaves the step (see docs/runtime.md).
    given = enable_ciera(engine, comm_profile=slow, timeout_s=10.0)
    given_table = [row.as_dict() for row in given.decisions]
    given_routes = {
        route.name: (route.path, route.partition_numel, route.category) for route in given.routes.values()
    }
    losses = [train_step(engine, step, rank) for step in range(3)]
    logging.getLogger("ciera_runtime").removeHandler(handler)
    given_stats = given.stats()

    # A corrupted payload on one receiver: that rank raises the GatherError now; the other raises at its
    # next CIERA call — the same error if the failed rank calls again, a timeout when it has left the step.
    (gather_engine,) = given.gathers.values()
    victim = min(ds_id for ds_id, route in given.routes.items() if route.path == "ciera")

    def corrupt(point: str, shard_id: int, array) -> None:
        if rank == 1 and point == "receive" and shard_id == victim:
            array[0, 100] ^= 0x10  # a byte of rank 0's payload, as rank 1 received it

    gather_engine.fault_injector = corrupt
    payload = {
        "rank": rank,
        "counts": found,
        "measured_table": measured_table,
        "measured_routes": measured_routes,
        "given_table": given_table,
        "given_routes": given_routes,
        "given_stats": given_stats,
        "losses": losses,
        "log": records,
    }
    dist.barrier()  # everything above is in; the fault run below ends the group
    started_fault = time.perf_counter()
    try:
        train_step(engine, 3, rank)
        fault = {"raised": None}
    except Exception as error:  # noqa: BLE001 — reported to the test
        from ciera_runtime.errors import GatherError

        fault = {"raised": type(error).__name__, "is_gather_error": isinstance(error, GatherError)}
        fault.update(message=str(error), shard_id=getattr(error, "shard_id", None), victim=victim)
    fault["failed_gathers"] = given.stats()["ciera_failed_gathers"]
    fault["seconds"] = time.perf_counter() - started_fault
    payload.update(fault=fault, seconds=time.perf_counter() - started)
    results.put(payload)
    results.close()
    results.join_thread()
    # As torchrun would: a rank whose step raised exits; the other ranks' next collective then fails.
    os._exit(0)


def gate_worker(rank: int, world_size: int, port: int, results) -> None:
    """BSC's per-call gate (selection.CallGate) on a slow link (2 MB/s): with a per-call cost no call's
    bytes can pay, every coalesced call takes DeepSpeed's gather whole (no CIERA collective); with none,
    the selected parameters go through CIERA. Both train bit-identically to plain ZeRO-3."""
    from ciera_runtime import selection
    from ciera_runtime.selection import CommProfile
    from ciera_runtime.zero3 import enable_ciera

    init_worker(rank, world_size, port)
    sizes = tuple(4**k for k in range(4, 12))
    slow = CommProfile(sizes, tuple(50e-6 + size / 2e6 for size in sizes))
    engine = make_engine(0)
    plain = {"losses": [train_step(engine, step, rank) for step in range(3)], "params": full_params(engine)}
    runs = {}
    measured = selection.measure_call_overhead_s
    for label, per_call_s in (("never_pays", 1.0), ("free", 0.0)):
        selection.measure_call_overhead_s = lambda group=None, config=None, calls=12, s=per_call_s: s
        try:
            engine = make_engine(0)
            ciera = enable_ciera(engine, comm_profile=slow, timeout_s=30.0)
        finally:
            selection.measure_call_overhead_s = measured
        losses = [train_step(engine, step, rank) for step in range(3)]
        stats = ciera.stats()
        runs[label] = {
            "losses": losses,
            "params_equal": full_params(engine) == plain["params"],
            "gated_calls": stats["ciera_gated_calls"],
            "ciera_calls": stats["ciera_calls"],
            "compressed_params": stats["compressed_params"],
        }
    runs["measured_overhead_s"] = measured(None)
    finish(results, {"rank": rank, "plain_losses": plain["losses"], "runs": runs})


def dying_rank_worker(rank: int, world_size: int, port: int, timeout_s: float, results) -> None:
    """Rank 1 exits between two steps; rank 0 must fail within a bounded time, not hang."""
    import torch.distributed as dist

    from ciera_runtime.zero3 import enable_ciera

    init_worker(rank, world_size, port, timeout_s=2 * timeout_s)
    engine = make_engine(0)
    enable_ciera(engine, select=False, timeout_s=timeout_s)
    for step in range(2):
        train_step(engine, step, rank)
    dist.barrier()
    if rank == 1:
        results.put({"rank": 1, "outcome": "exited"})
        results.close()
        results.join_thread()  # the result is in the pipe before the process vanishes
        os._exit(0)
    started = time.perf_counter()
    try:
        for step in range(2, 6):
            train_step(engine, step, rank)
        outcome = "no error"
    except Exception as error:  # noqa: BLE001 — reported to the test
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    results.put({"rank": 0, "outcome": outcome, "seconds": time.perf_counter() - started})
    results.close()
    results.join_thread()
    os._exit(0)  # the process group is broken: no orderly shutdown


def device_train_worker(
    rank: int, world_size: int, port: int, checkpoint_dir: str, steps: int, results
) -> None:
    """Plain ZeRO-3 and ZeRO-3 with the device gather ('ciera': {'device_gather': true}) on CPU partitions,
    the path CUDA partitions take: the same losses and parameters; a checkpoint of the device-gather run
    loaded into a fresh one that continues alike; a slot corrupted on one rank makes the next optimizer
    step raise the same GatherError on every rank before anything is applied."""
    from _device_counting import count_gather_host_reads

    from ciera_runtime.errors import GatherError
    from ciera_runtime.zero3 import enable_ciera

    init_worker(rank, world_size, port)
    save_at = steps // 2
    engine = make_engine(0)
    plain_losses = [train_step(engine, step, rank) for step in range(steps)]
    plain_params = full_params(engine)
    del engine

    engine = make_engine(0, {**ds_config(), "ciera": {"enabled": True, "device_gather": True}})
    ciera = engine.ciera
    losses = []
    with count_gather_host_reads() as reads:
        for step in range(steps):
            losses.append(train_step(engine, step, rank))
            if step + 1 == save_at:
                engine.save_checkpoint(checkpoint_dir, tag="mid")
    stats = ciera.stats()
    params = full_params(engine)
    routes = sorted({(route.path, route.reason) for route in ciera.routes.values()})

    resumed_engine = make_engine(1)
    resumed = enable_ciera(resumed_engine, device_gather=True)
    resumed_engine.load_checkpoint(checkpoint_dir, tag="mid")
    resumed_losses = [train_step(resumed_engine, step, rank) for step in range(save_at, steps)]
    resumed_params = full_params(resumed_engine)
    resumed.check_device_gathers()  # the checkpoint's own gathers left no flag behind

    # Gradient accumulation (the optimizer steps every 2nd micro-step; gathers in between reuse the
    # prepared payloads): as plain ZeRO-3 with the same accumulation.
    accumulated = {}
    for kind in ("plain", "device"):
        config = {**ds_config(), "gradient_accumulation_steps": 2, "train_batch_size": 2 * world_size}
        if kind == "device":
            config["ciera"] = {"enabled": True, "device_gather": True}
        accumulating = make_engine(0, config)
        accumulated[kind] = [train_step(accumulating, step, rank) for step in range(6)]
        accumulated[f"{kind}_params"] = full_params(accumulating)
        del accumulating

    # A corrupted slot on rank 0 only: the step is refused on both ranks, the weights stay those before it.
    device = next(iter(ciera.device_gathers.values()))
    device.fault_injector = (
        (lambda rows: rows[1 - rank].__setitem__(0, rows[1 - rank][0] ^ 1)) if rank == 0 else None
    )
    refused = None
    try:
        train_step(engine, steps, rank)
    except GatherError as error:
        refused = str(error).splitlines()[0]
    device.fault_injector = None
    after_refusal = full_params(engine)

    finish(
        results,
        {
            "rank": rank,
            "plain_losses": plain_losses,
            "losses": losses,
            "resumed_losses": resumed_losses,
            "params_vs_plain": sorted(n for n in params if params[n] != plain_params[n]),
            "resumed_vs_uninterrupted": sorted(n for n in params if params[n] != resumed_params[n]),
            "routes": routes,
            "stats": stats,
            "refused": refused,
            "gather_host_reads": dict(reads),
            "accumulation_losses_equal": accumulated["plain"] == accumulated["device"],
            "accumulation_params_equal": accumulated["plain_params"] == accumulated["device_params"],
            "changed_by_refused_step": sorted(n for n in params if params[n] != after_refusal[n]),
        },
    )
