"""CIERA inside FSDP2 (``torch.distributed.fsdp.fully_shard``) through its custom all-gather hook.

FSDP2 gathers one parameter group (the parameters one ``fully_shard`` call owns) at a time:
``foreach_all_gather`` copies the group's sharded parameters, cast to the all-gather dtype
(``MixedPrecisionPolicy.param_dtype``), into rank r's slice of one flat output buffer and calls the group's
``AllGather`` comm with ``(output, input = output[r·n:(r+1)·n], group, async_op)``.
``FSDPModule.set_custom_all_gather(comm)`` replaces that comm. :func:`enable_ciera` installs a
:class:`CieraAllGather` on every FSDP module of a model; each one sends its group's flat input through one
:class:`~ciera_runtime.CompressedAllGather` engine per process group, as a bucket of one shard — one
collective per FSDP2 all-gather, one round in steady state (one shard id per
parameter group, numbered in ``model.named_modules()`` order and registered on its first gather, which is
the same on every rank). The result is bit for bit what ``all_gather_into_tensor`` gives, or every rank
raises the same :class:`~ciera_runtime.GatherError`, unchanged.

How FSDP2 consumes the comm's return value (torch 2.13, ``_fsdp_collectives.foreach_all_gather_copy_out``):
the result is waited on only if it is a ``dist.Work`` (``isinstance(work, dist.distributed_c10d.Work)``),
and any non-``None`` value marks the gather as asynchronous. So with ``async_op=False`` (FSDP2's default
for its pre-forward / pre-backward unshard and its implicit prefetch) the gather is finished before the
call returns and ``None`` is returned; with ``async_op=True`` (``FSDPModule.unshard(async_op=True)``,
``_set_unshard_async_op(True)``) the engine's bucket row is in flight on return and a ``dist.Work``
subclass finishes the protocol in ``wait()`` — any other object would never be waited on, and FSDP2
would read an unfinished buffer.

Inputs that are not BF16/FP16 (no ``param_dtype`` policy: FP32; or the uint8 view FSDP2 uses for mixed
dtypes / ``fsdp_pre_all_gather`` extensions) cannot be compressed: they go through the plain
``all_gather_single``, and that is logged once per module.

See docs/fsdp2.md for the gather counts per iteration (activation checkpointing, reshard_after_forward).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ciera_runtime.allgather import CompressedAllGather
from ciera_runtime.codec import CodecConfig

logger = logging.getLogger("ciera_runtime")


def _all_gather_single(output, input_tensor, group=None, async_op=False):
    # Looked up at each call, so a counter or timer that wraps torch.distributed later sees it too.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_tensor, group=group, async_op=async_op)


_COMPRESSIBLE = (torch.bfloat16, torch.float16)
# Iterations of per-module gather counts kept (a list of dicts).
_HISTORY = 64


@dataclass
class ModuleGatherStats:
    """All-gathers of one FSDP parameter group on this rank. Bytes are what this rank sends: ``raw_bytes``
    its shard as the plain all-gather sends it, ``wire_bytes`` what actually went out (the compressed
    protocol's rows: registration, bucket and overflow rows; the shard itself for a plain gather)."""

    module: str
    shard_id: int
    dtype: str = ""
    numel: int = 0
    compressed: bool | None = None  # None until the first gather decides
    reason: str = ""
    gathers: int = 0
    async_gathers: int = 0  # called with async_op=True (a dist.Work returned, finished in wait())
    plain_gathers: int = 0
    failed_gathers: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    time_s: float = 0.0
    phases: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        row = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "phases"}
        row["phases"] = dict(self.phases)
        return row


def _phase(param_group) -> str:
    """Why FSDP2 gathers now: 'forward', 'backward' (pre-backward unshard or its prefetch), 'recompute'
    (a forward run by autograd during backward: activation checkpointing), or 'explicit' (unshard())."""
    state = getattr(getattr(param_group, "_training_state", None), "name", "")
    in_backward = torch._C._current_graph_task_id() != -1
    if state == "FORWARD":
        return "recompute" if in_backward else "forward"
    if state == "PRE_BACKWARD":
        return "backward"
    return "explicit"


class _CieraWork(dist.Work):
    """What an asynchronous gather returns: FSDP2 waits on ``dist.Work`` instances only."""

    def __init__(self, finish) -> None:
        super().__init__()
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            finish, self._finish = self._finish, None
            self._done = True
            finish()  # a GatherError propagates unchanged, on every rank alike
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


class CieraAllGather(AllGather):
    """FSDP2 ``AllGather`` comm of one parameter group, backed by a shared :class:`CieraFSDP2`."""

    def __init__(self, owner: CieraFSDP2, stats: ModuleGatherStats, param_group=None) -> None:
        self._owner = owner
        self.stats = stats
        self._param_group = param_group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self._owner._gather(self, output_tensor, input_tensor, group, async_op)


class CieraFSDP2:
    """CIERA installed on an FSDP2 model: the engines (one per process group), per-module stats, the
    per-iteration gather counts. Made by :func:`enable_ciera`."""

    def __init__(
        self,
        config: CodecConfig | None = None,
        cache_budget_bytes: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.config = config or CodecConfig()
        self.cache_budget_bytes = cache_budget_bytes
        self.timeout_s = timeout_s
        self.engines: dict[dist.ProcessGroup, CompressedAllGather] = {}
        self.modules: dict[str, ModuleGatherStats] = {}
        self.iteration = 0
        # history[i]: {module: gathers} of iteration i (iterations start at each root forward).
        self.history: list[dict[str, int]] = []
        self._current: Counter = Counter()
        # Built now so a bad configuration fails here, not at the first gather.
        CompressedAllGather(None, self.config, cache_budget_bytes, timeout_s)

    # ----------------------------------------------------------------- the hook

    def engine_for(self, group: dist.ProcessGroup) -> CompressedAllGather:
        engine = self.engines.get(group)
        if engine is None:
            engine = CompressedAllGather(group, self.config, self.cache_budget_bytes, self.timeout_s)
            self.engines[group] = engine
        return engine

    def _gather(self, comm: CieraAllGather, output, input_tensor, group, async_op: bool):
        stats = comm.stats
        stats.gathers += 1
        stats.async_gathers += bool(async_op)
        stats.phases[_phase(comm._param_group)] += 1
        self._current[stats.module] += 1
        raw_bytes = input_tensor.numel() * input_tensor.element_size()
        stats.raw_bytes += raw_bytes
        if input_tensor.dtype not in _COMPRESSIBLE or output.device.type != "cpu":
            return self._plain(comm, output, input_tensor, group, async_op, raw_bytes)
        engine = self.engine_for(group)
        if stats.compressed is None:
            stats.dtype, stats.numel = str(input_tensor.dtype).removeprefix("torch."), input_tensor.numel()
        start_s = time.perf_counter()
        sent_before = engine.stats.bytes_sent
        # One collective for the group's flat shard, in flight on return (one round in steady state).
        handle = engine.all_gather_bucket([input_tensor], [stats.shard_id], [output])
        stats.wire_bytes += engine.stats.bytes_sent - sent_before
        if stats.compressed is None and stats.shard_id in engine.registrations:
            registration = engine.registrations[stats.shard_id]
            stats.compressed, stats.reason = registration.compressed, registration.reason
        stats.time_s += time.perf_counter() - start_s

        def finish() -> None:
            start_s = time.perf_counter()
            sent_before = engine.stats.bytes_sent
            try:
                handle.wait()
            except BaseException:
                stats.failed_gathers += 1
                raise
            finally:
                stats.wire_bytes += engine.stats.bytes_sent - sent_before
                stats.time_s += time.perf_counter() - start_s

        if not async_op:
            finish()
            return None
        return _CieraWork(finish)

    def _plain(self, comm: CieraAllGather, output, input_tensor, group, async_op, raw_bytes):
        stats = comm.stats
        if stats.compressed is None:
            stats.compressed = False
            stats.dtype, stats.numel = str(input_tensor.dtype).removeprefix("torch."), input_tensor.numel()
            if output.device.type != "cpu":
                stats.reason = f"all-gather on {output.device}: the codec backends in this build work on CPU"
            else:
                stats.reason = f"all-gather dtype {stats.dtype} is not BF16/FP16"
            logger.warning(
                "ciera_runtime.fsdp2: module %r (%d values) uses the plain all-gather: %s",
                stats.module,
                stats.numel,
                stats.reason,
            )
        stats.plain_gathers += 1
        stats.wire_bytes += raw_bytes
        start_s = time.perf_counter()
        work = _all_gather_single(output, input_tensor, group=group, async_op=async_op)
        stats.time_s += time.perf_counter() - start_s
        return work

    # ----------------------------------------------------------------- iterations and stats

    def _start_iteration(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a root forward re-run by autograd (checkpointed root): same iteration
        if self.iteration > 0 or self._current:
            self.history.append(dict(self._current))
            del self.history[:-_HISTORY]
        self._current = Counter()
        self.iteration += 1

    def gathers_per_iteration(self, iteration: int = -1) -> dict[str, int]:
        """{module: gathers} of a finished iteration (default: the last one). An iteration starts at each
        forward of the model given to enable_ciera; the one in progress is ``current_iteration_gathers()``."""
        return dict(self.history[iteration]) if self.history else {}

    def current_iteration_gathers(self) -> dict[str, int]:
        return dict(self._current)

    def stats(self) -> dict:
        """Per-module stats and totals (bytes this rank sent, raw vs on the wire)."""
        modules = {name: stats.as_dict() for name, stats in self.modules.items()}
        raw = sum(stats.raw_bytes for stats in self.modules.values())
        wire = sum(stats.wire_bytes for stats in self.modules.values())
        return {
            "modules": modules,
            "gathers": sum(stats.gathers for stats in self.modules.values()),
            "raw_bytes": raw,
            "wire_bytes": wire,
            "wire_ratio": wire / raw if raw else None,
            "iterations": self.iteration,
            "engines": [
                {
                    "world_size": engine.world_size,
                    "gathers": engine.stats.gathers,
                    "resyncs": engine.stats.resyncs,
                }
                for engine in self.engines.values()
            ],
        }


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every module of ``model`` (itself included) that ``fully_shard`` was applied to, in
    ``named_modules()`` order."""
    return [
        (name or "<root>", module) for name, module in model.named_modules() if isinstance(module, FSDPModule)
    ]


def enable_ciera(
    model: nn.Module,
    config: CodecConfig | None = None,
    cache_budget_bytes: int | None = None,
    timeout_s: float = 300.0,
) -> CieraFSDP2:
    """Install the CIERA all-gather on every FSDP2 module of ``model`` (the root and every
    ``fully_shard``-ed submodule). Call after ``fully_shard`` and before the first forward, on every rank,
    with the same arguments. Returns the :class:`CieraFSDP2` that holds the engines and the stats.

    ``cache_budget_bytes`` bounds what each engine (one per process group) keeps between gathers; a
    parameter group that does not fit is gathered raw (logged). ``timeout_s`` bounds every wait of a
    compressed gather: a rank that never arrives makes the others raise ``GatherTimeoutError``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model is {type(model).__name__}, expected a torch.nn.Module sharded with fully_shard"
        )
    if getattr(model, "_ciera_fsdp2", None) is not None:
        raise ValueError(
            f"CIERA is already enabled on this {type(model).__name__}: call enable_ciera once per model"
        )
    found = fsdp_modules(model)
    if not found:
        raise ValueError(
            f"model {type(model).__name__} has no FSDP2 module: apply torch.distributed.fsdp.fully_shard "
            "to its blocks and to the root before enable_ciera"
        )
    ciera = CieraFSDP2(config, cache_budget_bytes, timeout_s)
    shard_id = 0
    for name, module in found:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError(
                f"module {name!r} has {len(param_groups)} FSDP parameter groups (shard_placement_fn with "
                "several meshes): FSDP2's custom all-gather supports one group per module"
            )
        for param_group in param_groups:
            stats = ModuleGatherStats(name, shard_id)
            ciera.modules[name] = stats
            module.set_custom_all_gather(CieraAllGather(ciera, stats, param_group))
            shard_id += 1
    # An iteration starts at each forward of the model (before FSDP2's own root pre-forward hook).
    model.register_forward_pre_hook(ciera._start_iteration, prepend=True)
    model._ciera_fsdp2 = ciera
    return ciera
