"""`ciera train`: train a zoo model with DeepSpeed ZeRO-3 or FSDP2, with or without CIERA, on local spawned
ranks or under torchrun / the deepspeed launcher (the same code; the launcher's RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK are used). Placement (`measure.placement`): with CUDA, rank r of a
node trains on cuda:<LOCAL_RANK> with NCCL, else on the CPU with gloo (CIERA_TRAIN_BACKEND=gloo keeps CUDA
machines on the CPU); the choice is said on the console. CUDA parameters take CIERA's device path only (the
host codec reads CPU tensors): on CUDA, CIERA without --device-gather is switched to it, and said so.
Step times on CUDA come from CUDA events (`measure.clock.boundary_clock`).

Every rank builds the same model from the same seed; step s always trains on the same global batch of the
corpus (`measure.corpus.batch`), rank r on its contiguous slice. Per step it records the global mean loss
(exact, as float32 bits), the step time (slowest rank), and the bytes this rank's all-gathers sent,
counted where every all-gather passes (`torch.distributed.all_gather_single`, which
`all_gather_into_tensor` calls too): the engine's own parameter gathers without CIERA, CIERA's rounds
(control, payloads, status) with it — and, with CIERA, what the same gathers would have sent raw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import math
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .extensions import BuildLockError, extensions_dir, wait_for_locks

ENGINES = ("zero3", "fsdp")
LOSSY_GATHERS = ("none", "once", "every")
# The largest power of two the codec takes as its block size (CodecConfig: below 2**31, a u32 header field).
BLOCK_SIZE_MAX = 1 << 30


def block_size_problem(value, name: str = "block_size") -> str | None:
    """What is wrong with ``value`` as CIERA's block size B (a power of two the codec accepts), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= BLOCK_SIZE_MAX:
        return f"{name} is {value!r}: expected a power of two from 1 to {BLOCK_SIZE_MAX}"
    if value & (value - 1):
        return f"{name} is {value}: expected a power of two (e.g. 64, 128, 256, 512)"
    return None


class TrainError(ValueError):
    """A training run that cannot start or cannot go on (bad input, NaN loss, a failed rank): one line."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = "small-moe"
    engine: str = "zero3"
    ciera: bool = True
    world_size: int = 2
    steps: int = 20
    layers: int | None = 2
    width_scale: int | None = None
    seed: int = 0
    lr: float = 1e-4
    global_batch: int = 4  # sequences per step, split evenly over the ranks
    seq_len: int = 64
    activation_checkpointing: bool = True
    select: bool = False  # BSC (benefit-driven selection, both engines); False: every BF16 shard compressed
    block_size: int = 64  # CIERA's B (CodecConfig.block_size) and the exponent statistics' blocks
    part_bytes: int | None = None  # CIERA's pipelined bucket size, both engines (None: the plug-ins' default)
    # Warm start: the first warm_steps steps of the run (from its first step: 0, or the checkpoint's step)
    # train like any other on the same batches, but nothing is recorded for them — no step record, no
    # report, no state digest, no exponent statistics — and they are not timed. `steps` counts them: the
    # run still ends after step `steps`. Checkpoints (save_at), snapshots and exit_rank_at count every step.
    warm_steps: int = 0
    detector: str = "exact"  # CodecConfig's default: exponent deltas
    entropy: str = "rans"  # CodecConfig.entropy: "none" sends changed exponents uncoded
    # The device path (ciera_runtime.device_gather): what CUDA parameters take; on CPU it runs the same
    # code. Changed exponents rANS-coded on the device (entropy "rans") or uncoded ("none"), no selection.
    device_gather: bool = False
    cache_budget_bytes: int | None = None
    timeout_s: float = 300.0
    checkpoint_dir: str | None = None
    save_at: int | None = None  # save a checkpoint after this many steps
    resume: bool = False  # start from the checkpoint in checkpoint_dir
    threads_per_rank: int = 0  # torch threads per rank; 0: cores // world_size (at least 1)
    # ZeRO-3 keeps parameters below this many elements unpartitioned (DeepSpeed's default is 1e5, which at
    # this machine's model sizes would keep nearly every parameter whole and never gather it).
    persistence_threshold: int = 0
    # The engine configuration that shapes the schedule (None: the engine's own default, recorded as used).
    prefetch_bucket_size: int | None = None  # DeepSpeed stage3_prefetch_bucket_size
    max_reuse_distance: int | None = None  # DeepSpeed stage3_max_reuse_distance
    max_live_parameters: int | None = None  # DeepSpeed stage3_max_live_parameters
    reduce_bucket_size: int | None = None  # DeepSpeed reduce_bucket_size (gradients reduced per bucket)
    reshard_after_forward: bool = True  # FSDP2 fully_shard(reshard_after_forward=...)
    # Exponent statistics: after every step, the exponent and block change rates per category against the
    # step before (measure.exponents), from the full weights (a collective per parameter: slows the run).
    exponent_stats: bool = False
    exponent_warmup_steps: int = 30  # steps left out of the summary (the method's warm-up)
    # Fault injection, for testing what a dying rank does to the others: (rank, step) — that rank's
    # process exits without a word when it reaches that step.
    exit_rank_at: tuple[int, int] | None = None
    # Arms of `ciera validate lossless / divergence` (measure.arms): what differs from the plain run.
    init_seed: int | None = None  # weights drawn from this seed (None: `seed`); the data order stays `seed`'s
    nudge_ulp: bool = False  # before step 0, one router weight moved by one BF16 ULP (the gathered precision)
    lossy_gather: str = "none"  # none | once (one shard of step 0's first gather) | every: int8-quantised
    record_state: bool = False  # after every step, SHA-256 of every parameter and optimizer state (rank 0)
    snapshot_dir: str | None = None  # where rank 0 saves the full state after the steps in snapshot_steps
    snapshot_steps: tuple[int, ...] = ()  # counted in completed steps (1 = after the first step)
    # Where rank 0 saves the weights as the engine computes with them (BF16), after these completed steps
    # (0: before the first step), as params-{step}.pt in snapshot_dir.
    parameter_snapshot_steps: tuple[int, ...] = ()

    def check(self) -> None:
        """One-line TrainError for what cannot be run."""
        if self.engine not in ENGINES:
            raise TrainError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        for name in ("world_size", "steps", "global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainError(f"{name} is {value!r}: expected a positive integer")
        problem = block_size_problem(self.block_size)
        if problem:
            raise TrainError(problem)
        if self.entropy not in ("rans", "none"):
            raise TrainError(f"entropy is {self.entropy!r}: expected 'rans' or 'none'")
        if self.device_gather and self.select:
            raise TrainError("device_gather compresses every BF16 parameter: it does not take select")
        if self.device_gather and not self.ciera:
            raise TrainError("device_gather is CIERA's device path: it needs ciera on")
        if isinstance(self.warm_steps, bool) or not isinstance(self.warm_steps, int) or self.warm_steps < 0:
            raise TrainError(f"warm_steps is {self.warm_steps!r}: expected an integer >= 0")
        if self.warm_steps > self.steps:
            raise TrainError(
                f"warm_steps is {self.warm_steps}: expected at most steps ({self.steps}), which counts them"
            )
        if self.world_size > 64:
            raise TrainError(f"world_size is {self.world_size}: local ranks are processes on this machine")
        if self.global_batch % self.world_size:
            raise TrainError(
                f"global batch of {self.global_batch} sequences does not split over {self.world_size} ranks"
            )
        for name in ("lr", "timeout_s"):  # a timeout of 0 failed every rank's connect with a torch message
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, float | int) and math.isfinite(value) and value > 0
            ):
                raise TrainError(f"{name} is {value!r}: expected a positive number")
        if (self.save_at is not None or self.resume) and not self.checkpoint_dir:
            raise TrainError("--save-at and --resume need --checkpoint-dir")
        if self.save_at is not None and not 1 <= self.save_at <= self.steps:
            raise TrainError(f"save_at is {self.save_at}: expected a step in 1..{self.steps}")
        if self.lossy_gather not in LOSSY_GATHERS:
            raise TrainError(
                f"lossy_gather is {self.lossy_gather!r}: expected one of {', '.join(LOSSY_GATHERS)}"
            )
        if self.lossy_gather != "none" and self.ciera:
            raise TrainError("a lossy gather arm runs the plain engine: CIERA must be off (--ciera off)")
        if (self.snapshot_steps or self.parameter_snapshot_steps) and not self.snapshot_dir:
            raise TrainError("snapshot steps need snapshot_dir")
        if self.exponent_stats and self.exponent_warmup_steps >= self.steps - self.warm_steps:
            raise TrainError(
                f"--exponent-stats leaves out the first {self.exponent_warmup_steps} recorded steps as "
                f"warm-up: record more than that ({self.steps - self.warm_steps} steps after "
                f"{self.warm_steps} warm steps)"
            )


@dataclass
class StepRecord:
    step: int
    loss: float
    loss_bits: str  # float32 bits, hex: exact comparison across runs
    step_s: float
    allgather_bytes_sent: int
    raw_bytes: int  # what the parameter gathers would have sent uncompressed (= sent, without CIERA)
    # CIERA's time on the training thread in this step, network waits left out (0 without CIERA)
    ciera_host_s: float = 0.0


@dataclass
class RankResult:
    rank: int
    steps: list[StepRecord] = field(default_factory=list)
    parameter_digest: str = ""
    gathers_per_parameter: dict[str, int] | None = None
    ciera: dict | None = None
    threads: int = 0
    codec_threads: str | None = None  # with CIERA: "N (why)", the numba threads its codec runs per rank
    exponent_rates: list[dict | None] | None = None  # per step: {category: rates}
    state_names: list[str] | None = None  # the tensors state_digests cover, in order
    state_digests: list[dict] | None = None  # per step: {"step", "all": sha256, "tensors": [8-hex each]}
    nudged: dict | None = None  # which weight the ULP nudge moved, and from/to
    warm_steps: int = 0  # steps trained before the first recorded one (cfg.warm_steps)
    warm_final_loss: float | None = None  # global mean loss of the last warm step
    environment: dict | None = None  # measure.placement.environment_record: device, driver, NCCL, ...


# ---------------------------------------------------------------------------------------- byte counting


class AllGatherCounter:
    """Counts the bytes this rank sends in all-gathers, at torch.distributed's single-tensor all-gather
    (every all-gather of DeepSpeed, FSDP2 and CIERA reaches it). Installed once per process, before the
    engines are created, so the references they keep are the counting ones."""

    _installed: AllGatherCounter | None = None

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0

    @classmethod
    def installed(cls) -> AllGatherCounter:
        if cls._installed is None:
            import torch.distributed as dist
            import torch.distributed.distributed_c10d as c10d

            counter = cls()
            original = c10d.all_gather_single

            def counted(output_tensor, input_tensor, group=None, async_op=False):
                counter.bytes_sent += input_tensor.numel() * input_tensor.element_size()
                counter.calls += 1
                return original(output_tensor, input_tensor, group, async_op)

            c10d.all_gather_single = counted  # all_gather_into_tensor and _all_gather_base call this global
            dist.all_gather_single = counted
            cls._installed = counter
        return cls._installed


# ---------------------------------------------------------------------------------------- one rank


def _float_bits(value: float) -> str:
    return struct.pack("<f", value).hex()


def _parameter_digest(named_full_tensors) -> str:
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in named_full_tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _ds_config(cfg: TrainConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.global_batch // cfg.world_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": cfg.lr, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": cfg.persistence_threshold,
            **{
                key: value
                for key, value in (
                    ("stage3_prefetch_bucket_size", cfg.prefetch_bucket_size),
                    ("stage3_max_reuse_distance", cfg.max_reuse_distance),
                    ("stage3_max_live_parameters", cfg.max_live_parameters),
                    ("reduce_bucket_size", cfg.reduce_bucket_size),
                )
                if value is not None
            },
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq")


class _EngineRun:
    """One training step as the capture times it: forward, backward, optimizer step (each engine says how)."""

    nudged: dict | None = None  # what the ULP nudge arm changed before wrapping (measure.arms)

    def step(self, inputs, targets):
        loss = self.forward(inputs, targets)
        self.backward(loss)
        self.optimizer_step()
        return loss


class _Zero3Run(_EngineRun):
    def __init__(self, cfg: TrainConfig, model, categories: dict[str, str]) -> None:
        import deepspeed

        self.cfg = cfg
        try:  # torch's loader would wait for a killed process's build lock forever
            wait_for_locks(extensions_dir(), cfg.timeout_s)
        except BuildLockError as error:
            raise TrainError(str(error)) from None
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_ds_config(cfg)
        )
        self.ciera = None
        if cfg.ciera:
            from ciera_runtime import CodecConfig
            from ciera_runtime.zero3 import enable_ciera

            self.ciera = enable_ciera(
                self.engine,
                config=CodecConfig(block_size=cfg.block_size, detector=cfg.detector, entropy=cfg.entropy),
                cache_budget_bytes=cfg.cache_budget_bytes,
                select=cfg.select,
                categories=categories,
                timeout_s=cfg.timeout_s,
                part_bytes=cfg.part_bytes,
                device_gather=cfg.device_gather,
            )

    def forward(self, inputs, targets):
        return self.engine(inputs, targets)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()

    def schedule_config(self) -> dict:
        """The engine configuration that shapes the gather schedule, as the engine resolved it."""
        zero = self.engine._config.zero_config
        return {
            "prefetch_bucket_size": int(zero.prefetch_bucket_size),
            "max_reuse_distance": int(zero.max_reuse_distance),
            "max_live_parameters": int(zero.max_live_parameters),
            "reduce_bucket_size": int(zero.reduce_bucket_size),
            "reshard_after_forward": False,
        }

    def save(self, directory: str, step: int) -> None:
        self.engine.save_checkpoint(directory, tag="ciera-train", client_state={"step": step})

    def load(self, directory: str) -> int:
        _, client_state = self.engine.load_checkpoint(directory, tag="ciera-train")
        return int(client_state["step"])

    def full_parameters(self):
        import deepspeed

        module = self.engine.module
        out = []
        for name, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                out.append((name, param.detach().clone()))
        return out

    def full_state(self) -> list:
        """(name, full fp32 tensor) of every parameter's master copy and Adam state (collective: every rank
        calls it; DeepSpeed assembles the partitions)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = []
        for name, param in self.engine.module.named_parameters():
            out.append((name, safe_get_full_fp32_param(param)))
            for key in OPTIMIZER_STATE_KEYS:
                state = safe_get_full_optimizer_state(param, key)
                if state is not None:
                    out.append((f"{name}:{key}", state))
        return out

    def engines(self) -> list:
        """CIERA's gathers of this run (each has ``stats.bytes_sent``, ``raw_bytes_equivalent``, ``host_s``)."""
        if self.ciera is None:
            return []
        return [*self.ciera.gathers.values(), *self.ciera.device_gathers.values()]

    def gathers_per_parameter(self) -> dict[str, int] | None:
        return None if self.ciera is None else self.ciera.gathers_per_param()

    def ciera_stats(self) -> dict | None:
        return None if self.ciera is None else _with_codec(self.ciera)


class _FsdpRun(_EngineRun):
    def __init__(self, cfg: TrainConfig, model, categories: dict[str, str]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from .placement import current

        self.cfg = cfg
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The mesh on the rank's own device: fully_shard's default mesh takes CUDA whenever it exists, even
        # for ranks placed on the CPU (CIERA_TRAIN_BACKEND=gloo). Without CUDA the default is the CPU mesh.
        mesh = (
            init_device_mesh(current().device_type, (dist.get_world_size(),))
            if torch.cuda.is_available()
            else None
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.ciera = None
        if cfg.ciera:
            from ciera_runtime import CodecConfig
            from ciera_runtime.fsdp2 import enable_ciera

            self.ciera = enable_ciera(
                model,
                config=CodecConfig(block_size=cfg.block_size, detector=cfg.detector, entropy=cfg.entropy),
                cache_budget_bytes=cfg.cache_budget_bytes,
                timeout_s=cfg.timeout_s,
                select=cfg.select,
                categories=categories,
                device_gather=cfg.device_gather,
                optimizer=self.optimizer,
                **({} if cfg.part_bytes is None else {"part_bytes": cfg.part_bytes}),
            )

    def forward(self, inputs, targets):
        return self.model(inputs, targets)

    def backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def schedule_config(self) -> dict:
        return {
            "prefetch_bucket_size": 0,
            "max_reuse_distance": 0,
            "max_live_parameters": 0,
            "reduce_bucket_size": 0,
            "reshard_after_forward": self.cfg.reshard_after_forward,
        }

    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, directory: str, step: int) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=directory)
        if dist.get_rank() == 0:
            Path(directory, "ciera-train-step.txt").write_text(f"{step}\n")
        dist.barrier()

    def load(self, directory: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        return int(Path(directory, "ciera-train-step.txt").read_text())

    def full_parameters(self):
        return [(name, param.full_tensor()) for name, param in self.model.named_parameters()]

    def full_state(self) -> list:
        """(name, full tensor) of every parameter (fp32) and its Adam state (collective)."""
        out = []
        for name, param in self.model.named_parameters():
            out.append((name, param.full_tensor()))
            state = self.optimizer.state.get(param, {})
            for key in OPTIMIZER_STATE_KEYS:
                if key in state:
                    out.append((f"{name}:{key}", state[key].full_tensor()))
        return out

    def engines(self) -> list:
        """CIERA's gathers of this run (each has ``stats.bytes_sent``, ``raw_bytes_equivalent``, ``host_s``)."""
        if self.ciera is None:
            return []
        return [*self.ciera.engines.values(), *self.ciera.device_gathers.values()]

    def gathers_per_parameter(self) -> dict[str, int] | None:
        return None if self.ciera is None else self.ciera.gathers_per_iteration()

    def ciera_stats(self) -> dict | None:
        return None if self.ciera is None else _with_codec(self.ciera)


def _with_codec(ciera) -> dict:
    """CIERA's stats, with the codec settings its engines ran with (CodecConfig)."""
    config = ciera.config
    return {
        **ciera.stats(),
        "block_size": config.block_size,
        "detector": config.detector,
        "entropy": config.entropy,
    }


def _ciera_bytes(engines) -> tuple[int, int]:
    """(bytes CIERA's engines sent, what their gathers would have sent raw)."""
    return (
        sum(engine.stats.bytes_sent for engine in engines),
        sum(engine.stats.raw_bytes_equivalent for engine in engines),
    )


def start_run(cfg: TrainConfig, world_size: int):
    """(model, categories, run, threads): this rank's model built from the seed and wrapped by its engine
    (`run.forward`, `run.backward`, `run.optimizer_step`, `run.engines()`, `run.schedule_config()`)."""
    import torch

    from .arms import nudge_one_weight
    from .placement import current
    from .zoo import build_model, parameter_categories

    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    model = build_model(
        cfg.model,
        cfg.layers,
        cfg.width_scale,
        cfg.seed if cfg.init_seed is None else cfg.init_seed,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    nudged = nudge_one_weight(model) if cfg.nudge_ulp else None
    categories = parameter_categories(model)
    model.to(current().device)  # built on the CPU from the seed: the same weights on every device
    run = (_Zero3Run if cfg.engine == "zero3" else _FsdpRun)(cfg, model, categories)
    run.nudged = nudged
    return model, categories, run, threads


def run_rank(
    rank: int,
    world_size: int,
    cfg: TrainConfig,
    report: Callable[[dict], None],
    on_warm_step: Callable[[int, float], None] | None = None,
) -> RankResult:
    """Train on this rank (process group already initialised); ``report`` gets a dict per recorded step,
    ``on_warm_step`` (step, global mean loss) each warm step (cfg.warm_steps) — nothing else is kept of
    those."""
    import torch
    import torch.distributed as dist

    from .arms import LossyGather, save_state, state_digest
    from .clock import boundary_clock
    from .corpus import batch
    from .placement import current, environment_record

    lossy = LossyGather.installed(cfg.lossy_gather, rank)  # before the engines keep references to the gather
    counter = AllGatherCounter.installed()
    model, categories, run, threads = start_run(cfg, world_size)
    start_step = run.load(cfg.checkpoint_dir) if cfg.resume else 0
    first_recorded = start_step + cfg.warm_steps
    if first_recorded > cfg.steps:
        raise TrainError(
            f"warm_steps is {cfg.warm_steps}: from step {start_step} (the checkpoint's) that runs past "
            f"steps ({cfg.steps})"
        )
    result = RankResult(rank, threads=threads, nudged=run.nudged, warm_steps=cfg.warm_steps)
    device = current().device
    result.environment = environment_record(current())
    clock = boundary_clock(current())  # CUDA: the step timed by events, one synchronize at each end
    if cfg.ciera:
        from ciera_runtime import get_backend

        backend = get_backend("cpu")
        result.codec_threads = f"{backend.threads} ({backend.threads_basis})"
    if cfg.record_state:
        result.state_digests = []
    tracker = None
    if cfg.exponent_stats:
        from .exponents import ExponentTracker

        tracker = ExponentTracker(categories, cfg.block_size)
        result.exponent_rates = []
    per_rank = cfg.global_batch // world_size

    def snapshot_parameters(completed: int) -> None:
        if completed in cfg.parameter_snapshot_steps:
            weights = [(name, tensor.to(torch.bfloat16)) for name, tensor in run.full_parameters()]
            if rank == 0:  # full_parameters is collective: every rank gathers, rank 0 writes
                save_state(weights, Path(cfg.snapshot_dir) / f"params-{completed}.pt")

    def global_mean_loss(loss) -> float:
        """The mean of the ranks' losses, as float32 (collective)."""
        losses = torch.tensor([loss.detach().float().item()], dtype=torch.float32, device=device)
        dist.all_reduce(losses)  # a sum of W float32 values in a fixed order: the same on every rank
        return struct.unpack("<f", struct.pack("<f", float(losses.item()) / world_size))[0]

    def stop_unless_finite(mean_loss: float, step: int) -> None:
        if not math.isfinite(mean_loss):
            raise TrainError(f"loss is {mean_loss} at step {step}: training stopped")

    snapshot_parameters(start_step)
    for step in range(start_step, cfg.steps):
        if cfg.exit_rank_at == (rank, step):
            os._exit(17)  # a crash: no exception, no cleanup, no message
        inputs, targets = batch(step, cfg.seq_len, cfg.global_batch, cfg.seed, "train")
        inputs = inputs[rank * per_rank : (rank + 1) * per_rank].to(device)
        targets = targets[rank * per_rank : (rank + 1) * per_rank].to(device)
        if step < first_recorded:  # a warm step: trained, not timed, nothing kept but the last loss
            with lossy.during_step(step):
                loss = run.step(inputs, targets)
            mean_loss_f32 = global_mean_loss(loss)
            if on_warm_step is not None:
                on_warm_step(step, mean_loss_f32)
            stop_unless_finite(mean_loss_f32, step)
            if step + 1 == first_recorded:
                result.warm_final_loss = mean_loss_f32
        else:
            if tracker is not None and step == first_recorded:
                tracker.update(run.full_parameters())  # the weights before the first recorded step
            sent_before, ciera_before = counter.bytes_sent, _ciera_bytes(run.engines())
            host_before_s = sum(engine.stats.host_s for engine in run.engines())
            start_s = clock.begin()
            with lossy.during_step(step):
                loss = run.step(inputs, targets)
            end = clock()
            step_s = clock.finish()(end) - start_s
            sent = counter.bytes_sent - sent_before
            ciera_sent, ciera_raw = (
                after - before
                for after, before in zip(_ciera_bytes(run.engines()), ciera_before, strict=True)
            )
            raw = sent - ciera_sent + ciera_raw  # CIERA's gathers counted at what they would have sent raw
            mean_loss_f32 = global_mean_loss(loss)
            slowest_s = torch.tensor([step_s], dtype=torch.float64, device=device)
            dist.all_reduce(slowest_s, op=dist.ReduceOp.MAX)
            record = StepRecord(
                step,
                mean_loss_f32,
                _float_bits(mean_loss_f32),
                float(slowest_s.item()),
                sent,
                raw,
                sum(engine.stats.host_s for engine in run.engines()) - host_before_s,
            )
            result.steps.append(record)
            report(dataclasses.asdict(record))
            stop_unless_finite(mean_loss_f32, step)
            if tracker is not None:
                result.exponent_rates.append(tracker.update(run.full_parameters()))
        if (cfg.record_state and step >= first_recorded) or step + 1 in cfg.snapshot_steps:
            state = run.full_state()  # collective: every rank assembles, rank 0 keeps
            if rank == 0 and cfg.record_state and step >= first_recorded:
                names, digest = state_digest(state)
                result.state_names = names
                result.state_digests.append({"step": step + 1, **digest})
            if rank == 0 and step + 1 in cfg.snapshot_steps:
                save_state(state, Path(cfg.snapshot_dir) / f"state-{step + 1}.pt")
            del state
        snapshot_parameters(step + 1)
        if cfg.save_at is not None and step + 1 == cfg.save_at:
            if rank == 0:  # an earlier save's manifest must not vouch for a save that stops half-way
                Path(cfg.checkpoint_dir, CHECKPOINT_MANIFEST).unlink(missing_ok=True)
            run.save(cfg.checkpoint_dir, step + 1)  # collective; both engines end it with a barrier
            if rank == 0:
                write_checkpoint_manifest(cfg, step + 1)
    result.gathers_per_parameter = run.gathers_per_parameter()
    result.ciera = run.ciera_stats()
    result.parameter_digest = _parameter_digest(run.full_parameters())
    return result


# ---------------------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def placed_config(cfg: TrainConfig, placement) -> tuple[TrainConfig, str | None]:
    """``cfg`` as it runs on ``placement`` (measure.placement.Placement), and the console line saying what
    changed (None: nothing). CUDA parameters take CIERA's device path only (the host codec reads CPU
    tensors): CIERA without device_gather is switched to it there; BSC (select) has no device path."""
    if not (placement.cuda and cfg.ciera and not cfg.device_gather):
        return cfg, None
    if cfg.select:
        raise TrainError(
            "select is on, but on CUDA ranks CIERA runs its device path, which compresses every BF16 "
            "parameter: expected --no-select, or CIERA_TRAIN_BACKEND=gloo to train on the CPU"
        )
    return dataclasses.replace(cfg, device_gather=True), (
        "CIERA on CUDA: using the device gather (--device-gather; changed exponents rANS-coded on the GPU, every "
        "BF16 parameter compressed): the host codec takes CPU tensors only"
    )


def _say(line: str) -> None:
    import sys

    print(f"ciera train: {line}", file=sys.stderr, flush=True)


def _init_group(rank: int, world_size: int, cfg: TrainConfig):
    """Place this rank (measure.placement: its GPU, or the CPU) and form the process group; the placement."""
    from .placement import init_group, place_rank

    placement = place_rank()
    init_group(placement, rank, world_size, cfg.timeout_s)
    return placement


def _spawned_rank(rank: int, world_size: int, port: int, cfg: TrainConfig, queue) -> None:
    # A hung run is stopped by the parent after cfg.timeout_s + 60 s without progress; it first asks each
    # rank for its Python stacks (SIGUSR1) so the hang can be located from the console.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # What torchrun / the deepspeed launcher would set (DeepSpeed asserts LOCAL_RANK).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    import torch.distributed as dist

    try:
        _init_group(rank, world_size, cfg)

        def on_warm_step(step: int, loss: float) -> None:
            if rank == 0:
                queue.put(("warm", rank, {"step": step, "loss": loss}))

        result = run_rank(
            rank, world_size, cfg, lambda record: queue.put(("step", rank, record)), on_warm_step
        )
        queue.put(("done", rank, dataclasses.asdict(result)))
    except Exception as error:  # noqa: BLE001 — one line to the parent, which stops every rank
        from .rank import failure_text

        queue.put(("error", rank, failure_text(error)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # every message in the pipe before the process ends
    from .rank import leave_rank

    leave_rank(0)


def check_environment(cfg: TrainConfig) -> None:
    """One line naming what to install when an engine's package is missing or unsupported."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TrainError('torch is not installed: pip install -e ".[runtime]"') from None
    if cfg.engine == "zero3":
        # Found and versioned without importing it: the import takes ~2 s and, before a placement sets
        # DS_ACCELERATOR, logs DeepSpeed's accelerator guess above our own lines. The ranks import it.
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise TrainError('deepspeed is not installed: DS_BUILD_OPS=0 pip install -e ".[deepspeed]"')
        try:
            version = importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:  # a source tree on the path, never installed
            import deepspeed

            version = deepspeed.__version__
        from ciera_runtime.zero3 import check_deepspeed_version

        try:
            check_deepspeed_version(version)
        except Exception as error:  # noqa: BLE001 — the version error is already one line
            raise TrainError(str(error)) from None


def validate(cfg: TrainConfig) -> None:
    """Every one-line error that needs no rank: options, the model at this depth and width, the checkpoint
    to resume from, the engine's package and version."""
    cfg.check()
    from .zoo import scaled_shape

    scaled_shape(cfg.model, cfg.width_scale, cfg.layers)
    if cfg.resume:
        check_resume(cfg)
    check_environment(cfg)


# Written beside each checkpoint `ciera train --save-at` saves: what a resume must match. Without it a
# resume from an empty or foreign directory failed on every rank inside the engine ("AssertionError:").
CHECKPOINT_MANIFEST = "ciera-train-checkpoint.json"
CHECKPOINT_SCHEMA = "ciera.train.checkpoint/1"


def checkpoint_manifest(cfg: TrainConfig, step: int) -> dict:
    """What a checkpoint of `cfg` saved after `step` steps holds: the fields a resume must match."""
    from .zoo import default_width_scale, scaled_shape

    shape = scaled_shape(cfg.model, cfg.width_scale, cfg.layers)
    width_scale = default_width_scale(cfg.model) if cfg.width_scale is None else cfg.width_scale
    return {
        "schema": CHECKPOINT_SCHEMA,
        "engine": cfg.engine,
        "model": shape.key,
        "layers": shape.num_layers,
        "width_scale": width_scale,
        "world_size": cfg.world_size,
        "step": step,
    }


def write_checkpoint_manifest(cfg: TrainConfig, step: int) -> None:
    """Rank 0, after the engine saved: the manifest, whole or not at all (a temporary file renamed)."""
    import json

    path = Path(cfg.checkpoint_dir, CHECKPOINT_MANIFEST)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(checkpoint_manifest(cfg, step), indent=1) + "\n")
    os.replace(partial, path)


def check_resume(cfg: TrainConfig) -> None:
    """One line when `cfg.checkpoint_dir` holds no checkpoint this run can resume from: none saved by
    `ciera train`, or one of another engine, model, depth, width or world size, or one at or past the
    last step."""
    import json

    path = Path(cfg.checkpoint_dir, CHECKPOINT_MANIFEST)
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainError(
            f"--resume: {cfg.checkpoint_dir} holds no checkpoint of `ciera train` (no {CHECKPOINT_MANIFEST}; "
            "--save-at writes one)"
        ) from None
    except (OSError, ValueError) as error:
        raise TrainError(f"--resume: {path}: not readable ({' '.join(str(error).split())})") from None
    if not isinstance(saved, dict) or saved.get("schema") != CHECKPOINT_SCHEMA:
        raise TrainError(f"--resume: {path}: expected schema {CHECKPOINT_SCHEMA}")
    wanted = checkpoint_manifest(cfg, 0)
    for key in ("engine", "model", "layers", "width_scale", "world_size"):
        if saved.get(key) != wanted[key]:
            raise TrainError(
                f"--resume: the checkpoint in {cfg.checkpoint_dir} was saved with {key} {saved.get(key)!r}; "
                f"this run has {wanted[key]!r}"
            )
    step = saved.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise TrainError(f"--resume: {path}: field 'step' is {step!r}, expected a step >= 1")
    if step + cfg.warm_steps >= cfg.steps:
        raise TrainError(
            f"--resume: the checkpoint is at step {step}; --steps {cfg.steps} leaves no step to record after "
            f"it{f' and {cfg.warm_steps} warm steps' if cfg.warm_steps else ''}"
        )


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun or the deepspeed launcher (they set
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), else None."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise TrainError(
            f"RANK={os.environ['RANK']!r} WORLD_SIZE={os.environ['WORLD_SIZE']!r}: expected integers"
        ) from None


def train_launched(
    cfg: TrainConfig,
    on_step: Callable[[dict], None] | None = None,
    on_warm_step: Callable[[dict], None] | None = None,
) -> dict | None:
    """This process is one rank started by a launcher: train it; rank 0 returns the result document (the
    others None). ``cfg.world_size`` must match the launcher's WORLD_SIZE."""
    import torch.distributed as dist

    from .placement import init_group, place_rank

    rank, world_size = launched_rank()
    if world_size != cfg.world_size:
        raise TrainError(f"--world-size {cfg.world_size}, but the launcher started {world_size} ranks")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    placement = place_rank()
    cfg, changed = placed_config(cfg, placement)
    validate(cfg)
    if rank == 0:
        _say(placement.note())
        if changed:
            _say(changed)
    init_group(placement, rank, world_size, cfg.timeout_s)
    try:
        warm = None
        if rank == 0 and on_warm_step is not None:

            def warm(step: int, loss: float) -> None:
                on_warm_step({"step": step, "loss": loss})

        result = run_rank(
            rank, world_size, cfg, on_step if rank == 0 and on_step else lambda record: None, warm
        )
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, dataclasses.asdict(result))
    finally:
        dist.destroy_process_group()
    return summarize(cfg, gathered) if rank == 0 else None


def train(
    cfg: TrainConfig,
    on_step: Callable[[dict], None] | None = None,
    on_warm_step: Callable[[dict], None] | None = None,
) -> dict:
    """Run ``cfg`` on local spawned ranks; returns the result document (every number the CLI prints).
    ``on_step`` gets rank 0's record of each recorded step, ``on_warm_step`` {"step", "loss"} of each warm
    step."""
    import torch

    from .placement import check_ds_accelerator, choose_placement

    # The placement every spawned rank will make (rank r is local rank r): the last rank needs a GPU too.
    available = torch.cuda.is_available()
    devices = torch.cuda.device_count() if available else 0
    last = choose_placement(available, cfg.world_size - 1, os.environ, devices)
    _say(last.note())
    cfg, changed = placed_config(cfg, last)
    if changed:
        _say(changed)
    validate(cfg)
    os.environ["DS_ACCELERATOR"] = check_ds_accelerator(last, os.environ)  # the spawned ranks inherit it
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    import queue as queue_module

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = mp.start_processes(
        _spawned_rank,
        args=(cfg.world_size, free_port(), cfg, queue),
        nprocs=cfg.world_size,
        join=False,
        start_method="spawn",
    )
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    last_progress = time.monotonic()
    try:
        while len(results) + len(errors) < cfg.world_size:
            try:
                kind, rank, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [
                    rank
                    for rank, process in enumerate(processes.processes)
                    if not process.is_alive() and rank not in results and rank not in errors
                ]
                if dead and time.monotonic() - last_progress > 5:
                    for rank in dead:
                        errors[rank] = f"rank {rank} exited with code {processes.processes[rank].exitcode}"
                if time.monotonic() - last_progress > cfg.timeout_s + 60:
                    errors.setdefault(-1, _no_progress(processes.processes, cfg.timeout_s + 60))
                continue
            last_progress = time.monotonic()
            if kind == "step":
                if rank == 0 and on_step is not None:
                    on_step(payload)
            elif kind == "warm":
                if on_warm_step is not None:
                    on_warm_step(payload)
            elif kind == "done":
                results[rank] = payload
            else:
                errors[rank] = payload
    finally:
        if errors:
            for process in processes.processes:
                if process.is_alive():
                    process.kill()
        for process in processes.processes:
            process.join(timeout=30)
    if errors:
        # A rank that died first, then what the others saw.
        ordered = sorted(errors.items(), key=lambda item: (" exited with code " not in item[1], item[0]))
        raise TrainError(
            "training failed: "
            + "; ".join(
                message if message.startswith("rank ") else f"rank {rank}: {message}"
                for rank, message in ordered
            )
        )
    return summarize(cfg, [results[rank] for rank in sorted(results)])


def _no_progress(processes, waited_s: float) -> str:
    """Ask every live rank to print its Python stacks (stderr), then the one-line reason."""
    asked = []
    for rank, process in enumerate(processes):
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGUSR1)
                asked.append(rank)
    if asked:
        time.sleep(2.0)  # faulthandler writes from a signal handler; give it a moment before the kill
    stacks = f"; the Python stacks of ranks {asked} are printed above" if asked else ""
    return f"no progress for {waited_s:.0f} s{stacks}"


def summarize(cfg: TrainConfig, ranks: list[dict]) -> dict:
    """The result document: config, per-step records (rank 0's bytes; losses and times are global), the
    final parameter digest (the same on every rank, checked), gather counts and CIERA's stats."""
    digests = {rank["parameter_digest"] for rank in ranks}
    if len(digests) != 1:
        raise TrainError(f"ranks disagree on the final parameters: {len(digests)} different digests")
    rank0 = ranks[0]
    steps = rank0["steps"]
    sent = [record["allgather_bytes_sent"] for record in steps]
    raw = [record["raw_bytes"] for record in steps]
    return {
        "schema": "ciera.train/1",
        "config": dataclasses.asdict(cfg),
        "steps": steps,
        "final_loss": steps[-1]["loss"] if steps else None,
        "block_size": cfg.block_size,
        "warm_steps": rank0.get("warm_steps", 0),  # trained before the first step in "steps", unrecorded
        "warm_final_loss": rank0.get("warm_final_loss"),
        "parameter_digest": digests.pop(),
        "allgather_bytes_sent_per_step": (sum(sent) / len(sent)) if sent else 0,
        "raw_bytes_per_step": (sum(raw) / len(raw)) if raw else 0,
        "median_step_s": sorted(r["step_s"] for r in steps)[len(steps) // 2] if steps else None,
        "gathers_per_parameter": rank0["gathers_per_parameter"],
        "threads_per_rank": rank0["threads"],
        "environment": rank0.get("environment"),  # rank 0's: device, driver, NCCL, GPUs per node, CPU
        "codec_threads_per_rank": rank0.get("codec_threads"),
        "ciera": rank0["ciera"],
        "exponent_stats": _exponent_summary(cfg, rank0),
        "nudged": rank0.get("nudged"),
        "state_names": rank0.get("state_names"),
        "state_digests": rank0.get("state_digests"),
    }


def _exponent_summary(cfg: TrainConfig, rank0: dict) -> dict | None:
    if not cfg.exponent_stats:
        return None
    from .exponents import summarize

    per_step = rank0["exponent_rates"]
    return {
        "block_size": cfg.block_size,
        "warmup_steps": cfg.exponent_warmup_steps,
        "per_step": per_step,
        "after_warmup": summarize(per_step, cfg.exponent_warmup_steps),
    }
