"""The rank side of a capture: what one launched rank does for a `layers` job (timed iterations of a real
engine, every event recorded), a `collectives` job (the sweep) and an `exponents` job (training with
per-parameter exponent statistics). `measure.rank` starts these in each rank process; `measure.launch`
starts the processes and collects what rank 0 and every rank wrote into the job's directory.

Clock alignment: every rank leaves a barrier, then starts the iteration. When all ranks run on one host they
share CLOCK_MONOTONIC (`time.perf_counter`), so the iteration's origin is the earliest rank's start and the
spread of starts is recorded (`clock_spread_s`); across hosts each rank's own barrier exit is its origin and
the spread is unknown (recorded as 0, and the run's versions say `clock: barrier`).

Placement (`measure.placement`, decided in `measure.rank`): a rank runs on cuda:<LOCAL_RANK> with NCCL when
CUDA is available, else on the CPU with gloo. On CUDA the event recorder's boundaries are CUDA
events resolved at each iteration's end (`measure.clock.boundary_clock`; see `measure.events`), and CIERA runs
its device path (`measure.train.placed_config`, said on the rank's log and recorded in run.json's job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .exponents import layer_index
from .launch import allocator_in_use
from .train import TrainConfig, TrainError

SYSTEMS = {
    "zero3": ("zero3", False),
    "fsdp": ("fsdp", False),
    "ciera": ("zero3", True),
    "ciera-fsdp": ("fsdp", True),
}


@dataclass(frozen=True)
class LayersJob:
    """One run of `ciera measure layers`: `warm_steps` training steps with no recorder (no event is kept
    of them), then `warmup_iterations` untimed, then `iterations` recorded; the batches go on from step to
    step (iteration i trains on batch warm_steps + i)."""

    run_id: str
    system: str
    train: TrainConfig
    warmup_iterations: int = 2
    iterations: int = 3
    warm_steps: int = 0
    min_timed_s: float = 0.0  # time at least this long: more than `iterations` where they are short
    # Which launch of the run this job is (1..the plan's `launches`): each launch starts fresh ranks for the
    # same run; the bundle pools their timed iterations (measure/assemble.py). The ranks never read it.
    launch: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"kind": "layers", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> LayersJob:
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {key: value for key, value in document.items() if key in names}
        train = dict(fields.pop("train"))
        if train.get("exit_rank_at") is not None:
            train["exit_rank_at"] = tuple(train["exit_rank_at"])
        return cls(train=TrainConfig(**train), **fields)


# A run whose iterations are very short is still timed this many iterations at most (its events stay small).
MAX_TIMED_ITERATIONS = 64


def timed_iterations(iterations: int, min_timed_s: float, warmup_iteration_s: float) -> int:
    """How many iterations a run times: `iterations`, or more where they are short — enough that
    `min_timed_s` of them pass at the pace of the last warm-up iteration (the slowest rank's), at most
    MAX_TIMED_ITERATIONS (never fewer than `iterations`). The host's own speed wanders in phases of seconds
    (benchmarks/host_drift.py): six iterations of a quarter second sit in one phase, and their median is
    that phase's, not the run's."""
    if min_timed_s <= 0.0 or not math.isfinite(warmup_iteration_s) or warmup_iteration_s <= 0.0:
        return iterations
    wanted = math.ceil(min_timed_s / warmup_iteration_s)
    return max(iterations, min(wanted, MAX_TIMED_ITERATIONS))


def train_config_for(system: str, **options: Any) -> TrainConfig:
    """The TrainConfig of a system name: zero3 / fsdp (plain engines), ciera (ZeRO-3 + CIERA),
    ciera-fsdp (FSDP2 + CIERA)."""
    if system not in SYSTEMS:
        raise TrainError(f"system {system!r}: expected one of {', '.join(SYSTEMS)}")
    engine, ciera = SYSTEMS[system]
    return TrainConfig(engine=engine, ciera=ciera, **options)


def host_description() -> dict[str, str]:
    """What the run ran on: the device (the rank's placement), the host, the process group's backend and
    the software versions, with the environment record (measure.placement.environment_record: device name,
    driver, CUDA runtime and NCCL versions, GPUs per node, CPU model and cores) in ``versions``."""
    import torch
    import torch.distributed as dist

    from .placement import current, environment_record

    environment = environment_record(current())
    hardware = environment["device_name"]
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    # The host's usable cores: ranks sharing them run slower than one rank per core (a model needs it).
    versions["host_cpus"] = environment["cpu_cores"]
    versions.update(allocator_in_use())  # how the rank's freed memory was handled (CapturePlan.allocator)
    for key in ("device", "driver", "nccl", "torch_cuda", "gpus_per_node", "local_world_size", "cpu_model"):
        versions[key] = environment[key]
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        versions["ciera"] = version("ciera")
    except Exception:  # noqa: BLE001 — not installed as a distribution (a source checkout)
        versions["ciera"] = "source"
    return {
        "hardware": hardware,
        "host": socket.gethostname(),
        "backend": dist.get_backend() if dist.is_initialized() else environment["backend"],
        "versions": json.dumps(versions, sort_keys=True),
    }


# ---------------------------------------------------------------------------------------- layers job


def _attribute_gathers(run, model, layer_of: dict[int, int], recorder) -> None:
    """Tell the recorder which layer each engine gather moves (prefetches run inside other layers)."""
    # CIERA's shard ids are ZeRO-3's parameter ids (FSDP2's are its own; their rounds stay attributed to the
    # parameter group being gathered).
    recorder.shard_layers = {
        int(param.ds_id): layer_of[id(param)] for param in model.parameters() if hasattr(param, "ds_id")
    }
    if run.cfg.engine == "zero3":
        for param in model.parameters():
            inner = getattr(param, "all_gather_coalesced", None)
            if inner is None:
                continue

            def all_gather_coalesced(params, *args, inner=inner, **kwargs):
                layer = _main_layer(params, layer_of)
                with recorder.gather_layer(layer), recorder.engine_gather():
                    handle = inner(params, *args, **kwargs)
                return _AttributedHandle(handle, recorder, layer)

            param.all_gather_coalesced = all_gather_coalesced
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    module_layer = {id(module): layer for module, layer in _fsdp_module_layers(model)}
    if getattr(FSDPParamGroup, "_ciera_measure_wrapped", False):
        FSDPParamGroup._ciera_measure_layers = module_layer
        return
    FSDPParamGroup._ciera_measure_layers = module_layer
    for method in ("unshard", "wait_for_unshard", "post_backward"):
        original = getattr(FSDPParamGroup, method)
        # The group's gather and its wait are the engine's gather path (`gather_host`); post_backward (the
        # reduce-scatter) is attributed only.
        gathers = method != "post_backward"

        def wrapped(self, *args, original=original, gathers=gathers, **kwargs):
            layers = FSDPParamGroup._ciera_measure_layers
            layer = next((layers[id(m)] for m in self.modules if id(m) in layers), -1)
            with (
                recorder.gather_layer(layer),
                recorder.engine_gather() if gathers else contextlib.nullcontext(),
            ):
                return original(self, *args, **kwargs)

        setattr(FSDPParamGroup, method, wrapped)
    FSDPParamGroup._ciera_measure_wrapped = True


def _injected_exit(run_id: str, rank: int, iteration: int) -> bool:
    """Fault injection for testing what a dying rank does to a capture: CIERA_MEASURE_EXIT_AT names
    `run_id:rank:iteration` (the rank's process exits without a word there)."""
    return os.environ.get("CIERA_MEASURE_EXIT_AT") == f"{run_id}:{rank}:{iteration}"


def _main_layer(params, layer_of: dict[int, int]) -> int:
    """The layer holding most of the elements of a coalesced gather (a bucket may reach into the next)."""
    counts: dict[int, int] = {}
    for param in params:
        layer = layer_of.get(id(param), -1)
        counts[layer] = counts.get(layer, 0) + int(getattr(param, "ds_numel", param.numel()))
    return max(counts, key=lambda layer: (counts[layer], -layer)) if counts else -1


def _fsdp_module_layers(model) -> list[tuple[Any, int]]:
    # The root group holds the embedding and the head: its gathers are counted at layer 0.
    return [(model, 0)] + [(block, index + 1) for index, block in enumerate(model.blocks)]


class _AttributedHandle:
    """DeepSpeed's gather handle, waited on inside its layer's attribution."""

    def __init__(self, handle, recorder, layer: int) -> None:
        self._handle, self._recorder, self._layer = handle, recorder, layer

    def wait(self, *args, **kwargs):
        with self._recorder.gather_layer(self._layer), self._recorder.engine_gather():
            return self._handle.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def _trained_loss(run, cfg: TrainConfig, step: int, rank: int, per_rank: int, what: str) -> float:
    """One unrecorded training step on this rank's part of batch ``step``; its loss, or TrainError."""
    from .corpus import batch
    from .placement import current

    inputs, targets = batch(step, cfg.seq_len, cfg.global_batch, cfg.seed, "train")
    device = current().device
    loss = run.step(
        inputs[rank * per_rank : (rank + 1) * per_rank].to(device),
        targets[rank * per_rank : (rank + 1) * per_rank].to(device),
    )
    value = float(loss.detach().float().item())
    if not math.isfinite(value):
        raise TrainError(f"loss is {value} at {what} {step}: capture stopped")
    return value


def run_layers_rank(job: LayersJob, out_dir: Path, rank: int, world_size: int, progress) -> None:
    """Run `job` on this rank (process group initialised); every rank writes events-rank{r}.parquet, rank 0
    writes run.json."""
    import pandas as pd
    import torch
    import torch.distributed as dist

    from .clock import boundary_clock
    from .corpus import batch
    from .events import EventRecorder, finish_events
    from .placement import current
    from .train import placed_config, start_run

    placement = current()
    cfg, changed = placed_config(job.train, placement)
    if changed:  # recorded as run: run.json's job says device_gather
        job = dataclasses.replace(job, train=cfg)
        if rank == 0:
            print(f"ciera measure: {job.run_id}: {changed}", flush=True)
    # The embedding's inputs are token ids: its backward pre-hook (where its backward starts) is exactly
    # what is wanted, and torch's note that no input requires a gradient is not news.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    recorder = EventRecorder.install()  # before the engine exists: it keeps the wrapped collectives
    recorder.iterations.clear()  # under a launcher one process runs every job of the plan
    recorder.use_clock(boundary_clock(placement))
    model, categories, run, threads = start_run(cfg, world_size)
    num_layers = len(model.blocks)
    layer_of_name = {name: layer_index(name, num_layers) for name, _ in model.named_parameters()}
    layer_of = {id(param): layer_of_name[name] for name, param in model.named_parameters()}
    layer_numel = [0] * (num_layers + 2)
    for name, param in model.named_parameters():
        layer_numel[layer_of_name[name]] += int(getattr(param, "ds_numel", param.numel()))
    recorder.attach(
        [(0, model.embed_tokens)] + [(index + 1, block) for index, block in enumerate(model.blocks)],
        head_module=model.final_norm,
        top_module=model,
    )
    _attribute_gathers(run, model, layer_of, recorder)
    per_rank = cfg.global_batch // world_size
    warm = job.warm_steps
    total = job.warmup_iterations + job.iterations
    # Warm steps: outside any recorder iteration, so nothing of them is recorded (the recorder keeps
    # events only inside `iteration`); each is reported as progress, which keeps the watcher's timeout off.
    for step in range(warm):
        value = _trained_loss(run, cfg, step, rank, per_rank, "warm step")
        if rank == 0:
            progress({"iteration": step, "of": warm + total, "loss": value, "warm": True})
    losses: list[float] = []
    gc_collect_s: list[float] = []
    warmup_iteration_s = None  # the slowest rank's last warm-up iteration (with min_timed_s)
    iteration = 0
    while iteration < total:  # `total` grows after the warm-up where --min-timed-s asks for more
        if iteration == job.warmup_iterations:
            for engine in run.engines():  # CIERA's engines exist once the first gathers ran
                engine.codec_timer = recorder.codec_timer
        if cfg.exit_rank_at == (rank, iteration) or _injected_exit(job.run_id, rank, iteration):
            os._exit(17)  # a crash: no exception, no cleanup, no message
        inputs, targets = batch(warm + iteration, cfg.seq_len, cfg.global_batch, cfg.seed, "train")
        inputs = inputs[rank * per_rank : (rank + 1) * per_rank].to(placement.device)
        targets = targets[rank * per_rank : (rank + 1) * per_rank].to(placement.device)
        # Python's cyclic GC runs between iterations, not inside them. The recorder keeps every event of
        # the run, so the heap grew with the capture and gen-2 collections (tens to hundreds of ms)
        # landed inside timed iterations, more often in CIERA's runs, whose gathers allocate more: a
        # cost of the recording, not of the system. Frozen objects are never scanned again; each
        # iteration's own garbage is collected (and timed, `gc_collect_s`) before the next starts.
        gc_start_s = time.perf_counter()
        gc.collect()
        gc.freeze()
        gc_collect_s.append(time.perf_counter() - gc_start_s)
        dist.barrier()
        gc.disable()
        try:
            with recorder.iteration(iteration):
                with recorder.phase("fwd"):
                    loss = run.forward(inputs, targets)
                with recorder.phase("bwd"):
                    recorder.set_backward_layer(num_layers + 1)
                    run.backward(loss)
                with recorder.phase("optim"):
                    run.optimizer_step()
        finally:
            gc.enable()
        value = float(loss.detach().float().item())
        if not math.isfinite(value):
            raise TrainError(f"loss is {value} at iteration {iteration}: capture stopped")
        losses.append(value)
        if iteration == job.warmup_iterations - 1 and job.min_timed_s > 0.0:
            # Every rank times the same count: each computes it from the same, all-reduced duration.
            last = recorder.iterations[-1]
            slowest = torch.tensor([last.end_s - last.start_s], dtype=torch.float64, device=placement.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            warmup_iteration_s = float(slowest.item())
            total = job.warmup_iterations + timed_iterations(
                job.iterations, job.min_timed_s, warmup_iteration_s
            )
        if rank == 0:
            progress({"iteration": warm + iteration, "of": warm + total, "loss": value})
        iteration += 1
    measured = recorder.iterations[job.warmup_iterations :]
    host = socket.gethostname()
    timing = [(log.start_s, log.end_s) for log in measured]
    transport = [log.transport_cpu_s for log in measured]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (host, timing, transport))
    one_host = len({entry[0] for entry in gathered}) == 1
    rows = []
    iteration_s, spreads = [], []
    for index, log in enumerate(measured):
        starts = [entry[1][index][0] for entry in gathered]
        ends = [entry[1][index][1] for entry in gathered]
        origin_s = min(starts) if one_host else log.start_s
        if one_host:
            iteration_s.append(max(ends) - min(starts))
            spreads.append(max(starts) - min(starts))
        else:
            iteration_s.append(max(end - start for start, end in zip(starts, ends, strict=True)))
        for event in finish_events(log):
            rows.append(
                {
                    "run_id": job.run_id,
                    "rank": rank,
                    "iteration": index,
                    "layer": event.layer,
                    "phase": event.phase,
                    "stream": event.stream,
                    "issued_s": max(0.0, event.issued_s - origin_s),
                    "start_s": max(0.0, event.start_s - origin_s),
                    "end_s": max(0.0, event.end_s - origin_s),
                    "raw_bytes": event.raw_bytes,
                    "wire_bytes": event.wire_bytes,
                }
            )
    frame = pd.DataFrame(rows)
    staging = out_dir / f".events-rank{rank}.parquet.partial"
    frame.to_parquet(staging, index=False)
    os.replace(staging, out_dir / f"events-rank{rank}.parquet")
    schedule = run.schedule_config()
    final_losses = torch.tensor(
        losses[job.warmup_iterations :] or [0.0], dtype=torch.float64, device=placement.device
    )
    dist.all_reduce(final_losses)
    if rank == 0:
        document = {
            "run_id": job.run_id,
            "job": job.to_json(),
            "world_size": world_size,
            "threads_per_rank": threads,
            "layer_numel": layer_numel,
            "iteration_s": iteration_s,
            "clock": "shared" if one_host else "barrier",
            "clock_spread_s": max(spreads) if spreads else 0.0,
            # Per timed iteration, the mean over ranks of the CPU each process spent beside its main thread.
            "transport_cpu_s": [
                sum(entry[2][index] for entry in gathered) / world_size for index in range(len(measured))
            ],
            "gc_collect_s": gc_collect_s[job.warmup_iterations :],
            # With min_timed_s: the warm-up iteration the count was read from (None: `iterations` timed).
            "warmup_iteration_s": warmup_iteration_s,
            "schedule": schedule,
            "mean_loss": (final_losses / world_size).cpu().tolist(),
            "gathers_per_parameter": run.gathers_per_parameter(),
            "ciera": run.ciera_stats(),
            **host_description(),
        }
        _write_json_atomic(out_dir / "run.json", document)
    dist.barrier()


def write_text_atomic(path: Path, text: str) -> None:
    """Write next to `path` and rename into place: a reader never sees a partial file."""
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text)
    os.replace(staging, path)


def _write_json_atomic(path: Path, document: dict) -> None:
    write_text_atomic(path, json.dumps(document, indent=1))


# ---------------------------------------------------------------------------------------- collectives job


def run_collectives_rank(job: dict, out_dir: Path, rank: int, world_size: int, progress) -> None:
    """The nccl-tests-style sweep on this group (measure.collectives); rank 0 writes collectives.json."""
    from .collectives import sweep_collectives
    from .placement import current

    rows = sweep_collectives(
        device=current().device,  # CUDA: the rank's own GPU, synchronised around the clock
        min_bytes=int(job["min_bytes"]),
        max_bytes=int(job["max_bytes"]),
        warmup=int(job["warmup"]),
        repetitions=int(job["repetitions"]),
        min_time_s=float(job.get("min_time_s", 0.0)),  # a job written before it: the fixed repetitions
        ranks_per_node=int(job["ranks_per_node"]),
        on_progress=progress if rank == 0 else None,
    )
    if rank == 0:
        _write_json_atomic(out_dir / "collectives.json", {"rows": rows, **host_description()})


# ---------------------------------------------------------------------------------------- exponents job


def run_exponents_rank(job: dict, out_dir: Path, rank: int, world_size: int, progress) -> None:
    """Real training; after every step the full weights' exponent statistics against the step before
    (measure.exponents.ExponentRecorder). Rank 0 writes exponents.parquet and shard_changes.parquet with
    the steps after warm-up (iteration t compares step t's weights with step t−1's)."""
    import torch.distributed as dist

    from .exponents import EXPONENT_BLOCK_SIZES, ExponentRecorder
    from .placement import current
    from .train import placed_config, start_run

    train = dict(job["train"])
    train.pop("exit_rank_at", None)
    cfg, changed = placed_config(TrainConfig(**train), current())
    if changed and rank == 0:
        print(f"ciera measure: {job['run_id']}: {changed}", flush=True)

    model, categories, run, _threads = start_run(cfg, world_size)
    num_layers = len(model.blocks)
    layer_of = {name: layer_index(name, num_layers) for name, _ in model.named_parameters()}
    # The default block sizes, and the run's own B among them.
    block_sizes = tuple(sorted(set(EXPONENT_BLOCK_SIZES) | {cfg.block_size}))
    recorder = ExponentRecorder(layer_of, categories, block_sizes=block_sizes) if rank == 0 else None
    per_rank = cfg.global_batch // world_size
    # Warm steps (no statistics), then `steps` steps: the statistics start after `warmup_steps` of them.
    warm = int(job.get("warm_steps", 0))
    warmup = int(job["warmup_steps"])
    for step in range(warm + cfg.steps):
        value = _trained_loss(run, cfg, step, rank, per_rank, "step")
        if step + 1 >= warm + warmup:  # the baseline is the last warm-up step's weights
            weights = run.full_parameters()  # collective: every rank takes part
            if recorder is not None:
                recorder.update(weights)
        if rank == 0:
            progress({"iteration": step, "of": warm + cfg.steps, "loss": value, "warm": step < warm})
    if recorder is not None:
        exponents, shard_changes = recorder.frames(job["run_id"])
        for frame in (exponents, shard_changes):
            # step numbers, not positions after warm-up
            frame["iteration"] = frame["iteration"] + warm + warmup
        for name, frame in (("exponents", exponents), ("shard_changes", shard_changes)):
            staging = out_dir / f".{name}.parquet.partial"
            frame.to_parquet(staging, index=False)
            os.replace(staging, out_dir / f"{name}.parquet")
        layer_numel = [0] * (num_layers + 2)
        for name, param in model.named_parameters():
            layer_numel[layer_of[name]] += int(getattr(param, "ds_numel", param.numel()))
        _write_json_atomic(
            out_dir / "run.json",
            {
                "run_id": job["run_id"],
                "world_size": world_size,
                "layer_numel": layer_numel,
                **host_description(),
            },
        )
    dist.barrier()
