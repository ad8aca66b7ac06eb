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

``select=True`` (benefit-driven selection, BSC, as the ZeRO-3 plug-in does it): at enable time, per shard
process group, each module's all-gather input (its parameters' padded shard sizes, in the
``MixedPrecisionPolicy`` dtype) is weighed with :func:`~ciera_runtime.selection.select_for_group` — the
link profiled (or ``comm_profile``), codec times measured, ``select_shards(overlap=False)`` (the encode
runs on the training thread), rank 0's table applied by every rank. A module not selected goes through
the plain all-gather with no CIERA work; its reason is in its stats and logged once (rank 0). The first
gather of every module is checked against what was decided: a different size, dtype or group raises
:class:`~ciera_runtime.errors.SelectionMismatchError` on every rank rather than run a wrong selection.

See docs/fsdp2.md for the gather counts per iteration (activation checkpointing, reshard_after_forward).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ciera_runtime.allgather import CompressedAllGather
from ciera_runtime.bucket import DEFAULT_PART_BYTES, PartBudget, check_part_bytes
from ciera_runtime.codec import CodecConfig
from ciera_runtime.errors import SelectionMismatchError
from ciera_runtime.selection import CommProfile, Decision, ShardInfo, select_with_gate
from ciera_runtime.zero3 import CATEGORIES, DEFAULT_PRIORS, PRIOR_SOURCE, _agree, category_from_name

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
    pipelined_gathers: int = 0  # gathers that travelled as several buckets (part_bytes)
    failed_gathers: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    time_s: float = 0.0
    phases: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        row = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "phases"}
        row["phases"] = dict(self.phases)
        return row


@dataclass
class _Plan:
    """What enable_ciera knows of a parameter group's all-gather input before its first gather."""

    group: dist.ProcessGroup  # the shard process group (the post-forward group is another one)
    numel: int | None  # per rank; None: known only at the gather (an fsdp_pre_all_gather extension)
    dtype: torch.dtype | None
    post_forward_group: bool  # reshard_after_forward=<int>: backward gathers over a smaller group
    category: str  # the category with the most values in the group
    q: float  # block change rate prior: the values-weighted mean of its parameters' category priors
    reason: str  # why its gathers cannot be compressed; "" for a candidate
    checked: bool = False  # the first gather matched


def _all_gather_dtype(fsdp_param, mp_policy) -> torch.dtype:
    """The dtype FSDP2 casts a parameter's shard to for the all-gather (FSDPParam.init_dtype_attrs, which
    runs only at FSDP2's lazy init, i.e. at the first forward)."""
    orig = fsdp_param.sharded_param.dtype
    param_dtype = getattr(mp_policy, "param_dtype", None)
    if param_dtype is None or param_dtype == orig or not orig.is_floating_point:
        return orig
    return param_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plan(param_group, names: dict[int, str], categories, q_by_category) -> _Plan:
    """The all-gather input ``foreach_all_gather`` will build for ``param_group`` (torch 2.13,
    ``_get_param_all_gather_inputs``): each parameter's padded shard, cast to its all-gather dtype, flat;
    several dtypes make it a uint8 view of the bytes."""
    fsdp_params = list(param_group.fsdp_params)
    group = param_group.mesh_info.shard_process_group
    post_forward = param_group.post_forward_mesh_info
    post_forward_group = post_forward is not None and post_forward != param_group.mesh_info
    values: Counter = Counter()
    weighted_q = 0.0
    for fsdp_param in fsdp_params:
        numel = fsdp_param.padded_sharded_param_size.numel()
        name = names.get(id(fsdp_param.sharded_param), "")
        category = categories.get(name) or category_from_name(name)
        values[category] += numel
        weighted_q += numel * q_by_category[category]
    total = sum(values.values())
    category = values.most_common(1)[0][0] if values else ""
    q = weighted_q / total if total else 0.0
    dtypes = [_all_gather_dtype(fsdp_param, param_group.mp_policy) for fsdp_param in fsdp_params]
    extension = [
        fsdp_param
        for fsdp_param in fsdp_params
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
    ]
    if extension:
        reason = (
            "an fsdp_pre_all_gather tensor extension makes the all-gather input (known only at the gather)"
        )
        return _Plan(group, None, None, post_forward_group, category, q, reason)
    if not fsdp_params:
        return _Plan(group, 0, None, post_forward_group, category, q, "no parameters")
    if len(set(dtypes)) > 1:
        numel = sum(
            fsdp_param.padded_sharded_param_size.numel() * dtype.itemsize
            for fsdp_param, dtype in zip(fsdp_params, dtypes, strict=True)
        )
        mixed = ", ".join(sorted({_dtype_name(dtype) for dtype in dtypes}))
        reason = f"all-gather dtype uint8 is not BF16/FP16 (parameters of {mixed} gathered as bytes)"
        return _Plan(group, numel, torch.uint8, post_forward_group, category, q, reason)
    dtype = dtypes[0]
    numel = sum(fsdp_param.padded_sharded_param_size.numel() for fsdp_param in fsdp_params)
    reason = ""
    if dtype not in _COMPRESSIBLE:
        reason = f"all-gather dtype {_dtype_name(dtype)} is not BF16/FP16"
    elif param_group.device.type != "cpu":
        reason = f"all-gather on {param_group.device}: the codec backends in this build work on CPU"
    return _Plan(group, numel, dtype, post_forward_group, category, q, reason)


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
        self.plan: _Plan | None = None  # set by enable_ciera(select=True)
        self.selected: bool | None = None  # None: no selection (every BF16/FP16 gather is compressed)

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
        select: bool = False,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> None:
        self.config = config or CodecConfig()
        self.cache_budget_bytes = cache_budget_bytes
        self.timeout_s = timeout_s
        self.select = select
        # A group's flat shard of at least 2 x part_bytes travels as several buckets, each a contiguous
        # range of it, encoded and issued in turn and decoded in turn (see zero3.CieraZero3.part_bytes).
        self.part_bytes = part_bytes
        self.part_budget = PartBudget(part_bytes)  # how many parts, within a per-step budget of extra calls
        # The BSC table every rank applied (rank 0's), one row per candidate module, with its name.
        self.selection: list[dict] = []
        self.engines: dict[dist.ProcessGroup, CompressedAllGather] = {}
        self.modules: dict[str, ModuleGatherStats] = {}
        self.iteration = 0
        # history[i]: {module: gathers} of iteration i (iterations start at each root forward).
        self.history: list[dict[str, int]] = []
        self._current: Counter = Counter()
        # The device path (enable_ciera(device_gather=True)): one DeviceGather per process group over the
        # modules' all-gather inputs, prepared lazily at the first gather after each optimizer step.
        self.device_gather = False
        self.device_gathers: dict[dist.ProcessGroup, Any] = {}
        self._device_comms: list[CieraAllGather] = []
        self._stale_payloads = True
        self._warned_plain: set[tuple[str, int]] = set()
        # Built now so a bad configuration fails here, not at the first gather.
        CompressedAllGather(None, self.config, cache_budget_bytes, timeout_s)

    # ----------------------------------------------------------------- the hook

    def engine_for(self, group: dist.ProcessGroup) -> CompressedAllGather:
        engine = self.engines.get(group)
        if engine is None:
            engine = CompressedAllGather(group, self.config, self.cache_budget_bytes, self.timeout_s)
            self.engines[group] = engine
        return engine

    def _check_plan(self, comm: CieraAllGather, input_tensor, group) -> None:
        """The first gather of a module selected at enable time must be the one selection weighed."""
        plan = comm.plan
        got = (input_tensor.numel(), input_tensor.dtype)
        if group is plan.group and (plan.numel is None or got == (plan.numel, plan.dtype)):
            plan.checked = True
            return
        planned = "known at the gather" if plan.numel is None else f"{plan.numel} {_dtype_name(plan.dtype)}"
        raise SelectionMismatchError(
            f"module {comm.stats.module!r}: enable_ciera(select=True) decided for an all-gather input of "
            f"{planned} values per rank over a {plan.group.size()}-rank group, but FSDP2's first all-gather "
            f"sends {got[0]} {_dtype_name(got[1])} values over a {group.size()}-rank group: the parameter "
            "group changed after enable_ciera (call it after fully_shard and after any change to the "
            "model's parameters, before the first forward)"
        )

    def _gather(self, comm: CieraAllGather, output, input_tensor, group, async_op: bool):
        stats = comm.stats
        if comm.plan is not None and not comm.plan.checked:
            self._check_plan(comm, input_tensor, group)
        stats.gathers += 1
        stats.async_gathers += bool(async_op)
        stats.phases[_phase(comm._param_group)] += 1
        self._current[stats.module] += 1
        raw_bytes = input_tensor.numel() * input_tensor.element_size()
        stats.raw_bytes += raw_bytes
        if self.device_gather and input_tensor.dtype in _COMPRESSIBLE:
            return self._device_gather(comm, output, input_tensor, group, async_op)
        if comm.selected is False or input_tensor.dtype not in _COMPRESSIBLE or output.device.type != "cpu":
            return self._plain(comm, output, input_tensor, group, async_op, raw_bytes)
        engine = self.engine_for(group)
        if stats.compressed is None:
            stats.dtype, stats.numel = str(input_tensor.dtype).removeprefix("torch."), input_tensor.numel()
        start_s = time.perf_counter()
        sent_before = engine.stats.bytes_sent
        # One collective per part of the group's flat shard (one part below 2 x part_bytes), each in
        # flight on return (one round in steady state); part k of every rank lands in its rank's slice.
        count = self.part_budget.parts(stats.shard_id, raw_bytes)
        ranges = _part_ranges(input_tensor.numel(), count)
        if len(ranges) == 1:
            parts = [([input_tensor], [stats.shard_id], [output])]
        else:
            stats.pipelined_gathers += 1
            by_rank = output.view(-1).view(engine.world_size, input_tensor.numel())
            parts = [
                ([input_tensor[start:stop]], [_part_id(stats.shard_id, k)], [by_rank[:, start:stop]])
                for k, (start, stop) in enumerate(ranges)
            ]
        handles = [engine.all_gather_bucket(*part) for part in parts]
        stats.wire_bytes += engine.stats.bytes_sent - sent_before
        first_id = parts[0][1][0]
        if stats.compressed is None and first_id in engine.registrations:
            registration = engine.registrations[first_id]
            stats.compressed, stats.reason = registration.compressed, registration.reason
            if comm.selected and registration.compressed:
                stats.reason = "selected by BSC"
        stats.time_s += time.perf_counter() - start_s

        def finish() -> None:
            start_s = time.perf_counter()
            sent_before = engine.stats.bytes_sent
            try:
                for handle in handles:  # in start order: a failed one leaves the later ones to their calls
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

    # ----------------------------------------------------------------- the device path

    def prepare_device_gathers(self) -> None:
        """Encode every module's all-gather input as it is now (FSDP2's own copy-in of its sharded
        parameters, cast to the all-gather dtype): done at the first gather after each optimizer step, and
        registered with the first. Collective (every rank reaches its first gather at the same module)."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_param_all_gather_inputs

        from ciera_runtime.device_gather import DeviceGather

        inputs: dict[dist.ProcessGroup, dict[int, torch.Tensor]] = {}
        for comm in self._device_comms:
            param_group = comm._param_group
            pieces = [
                t.reshape(-1) for ts in _get_param_all_gather_inputs(param_group.fsdp_params) for t in ts
            ]
            flat = torch.cat(pieces) if len({t.dtype for t in pieces}) == 1 else None
            if flat is None or flat.dtype not in _COMPRESSIBLE:
                continue  # its gathers go the plain way (FP32 or mixed dtypes), as on the host path
            group = param_group.mesh_info.shard_process_group
            inputs.setdefault(group, {})[comm.stats.shard_id] = flat
        for group, shards in inputs.items():
            device = self.device_gathers.get(group)
            if device is None:
                device = DeviceGather(
                    next(iter(shards.values())).device, group, self.config.block_size, self.config.entropy
                )
                device.register(shards)
                self.device_gathers[group] = device
            device.prepare(shards)
        self._stale_payloads = False

    def check_device_gathers(self) -> None:
        """Before the optimizer applies a step: the same GatherError on every rank if a device gather since
        the last check did not rebuild exactly."""
        for device in self.device_gathers.values():
            device.check()

    def _device_gather(self, comm: CieraAllGather, output, input_tensor, group, async_op: bool):
        stats = comm.stats
        if self._stale_payloads or any(d.needs_prepare for d in self.device_gathers.values()):
            self.prepare_device_gathers()
        device = self.device_gathers.get(group)
        if device is None or stats.shard_id not in device._shards:
            reason = (
                "device gather: not registered for this group (inputs of mixed dtypes, or a post-forward "
                "reshard group, reshard_after_forward=<int>)"
            )
            if stats.compressed is None:
                stats.compressed, stats.reason = False, reason
            if (stats.module, id(group)) not in self._warned_plain:  # once per module and group
                self._warned_plain.add((stats.module, id(group)))
                logger.warning(
                    "ciera_runtime.fsdp2: module %r (%d values) uses the plain all-gather over a %d-rank "
                    "group: %s",
                    stats.module,
                    input_tensor.numel(),
                    group.size(),
                    reason,
                )
            return self._plain(comm, output, input_tensor, group, async_op, input_tensor.numel() * 2)
        if stats.compressed is None:
            stats.compressed, stats.reason = True, f"device gather (entropy {self.config.entropy})"
            stats.dtype, stats.numel = str(input_tensor.dtype).removeprefix("torch."), input_tensor.numel()
        start_s = time.perf_counter()
        sent_before = device.stats.bytes_sent
        handle = device.all_gather([stats.shard_id], [input_tensor], [output])
        stats.wire_bytes += device.stats.bytes_sent - sent_before
        stats.time_s += time.perf_counter() - start_s
        if not async_op:
            handle.wait()
            return None
        return _CieraWork(handle.wait)

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
        self.part_budget.start_step()
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
            "part_budget": self.part_budget.describe(),
            "select": self.select,
            "selection": [dict(row) for row in self.selection],
            "engines": [
                {
                    "world_size": engine.world_size,
                    "gathers": engine.stats.gathers,
                    "resyncs": engine.stats.resyncs,
                    "host_s": engine.stats.host_s,  # on the training thread, network waits left out
                    "calls": engine.bucket_stats.calls if engine.bucket_stats else 0,
                    "overflow_rounds": engine.bucket_stats.overflow_rounds if engine.bucket_stats else 0,
                    # Calls whose shards took the one-call bucket passes (ciera_runtime/bucket_codec.py).
                    "one_call_calls": engine.bucket_stats.one_call_encodes if engine.bucket_stats else 0,
                    # Where the bucket rows' bytes go: codec payloads, raw messages, headers, padding.
                    "wire_bytes_by_kind": engine.bucket_stats.wire_bytes_by_kind()
                    if engine.bucket_stats
                    else {},
                }
                for engine in self.engines.values()
            ],
            # The device path: per process group, its gathers and host reads (one per prepare and check).
            "device_gathers": [
                {
                    "world_size": d.world_size,
                    "gathers": d.stats.gathers,
                    "host_reads": d.stats.host_reads,
                    "bytes_sent": d.stats.bytes_sent,
                    "raw_bytes": d.stats.raw_bytes_equivalent,
                    "host_s": d.stats.host_s,
                    "memory_bytes": d.memory_bytes(),
                }
                for d in self.device_gathers.values()
            ],
        }


def _part_ranges(numel: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous [start, stop) ranges of a flat shard, the same on every rank (sizes only)."""
    if count <= 1:
        return [(0, numel)]
    step = -(-numel // count)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def _part_id(shard_id: int, part: int) -> int:
    """The engine's shard id of part ``part`` of module shard ``shard_id`` (distinct from every module's
    own id, which is small)."""
    return 1 << 31 | shard_id << 4 | part


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every module of ``model`` (itself included) that ``fully_shard`` was applied to, in
    ``named_modules()`` order."""
    return [
        (name or "<root>", module) for name, module in model.named_modules() if isinstance(module, FSDPModule)
    ]


def _check_select_arguments(select, comm_profile, categories, priors) -> dict[str, float]:
    """One-line errors for the selection arguments; the prior q per category."""
    if not isinstance(select, bool):
        raise TypeError(f"select is {select!r}: expected True or False")
    if comm_profile is not None:
        if not select:
            raise ValueError("comm_profile is used only by benefit-driven selection: pass select=True too")
        if not isinstance(comm_profile, CommProfile):
            raise TypeError(
                f"comm_profile is {type(comm_profile).__name__}, "
                "expected a ciera_runtime.selection.CommProfile"
            )
        sizes, times = comm_profile.bytes_per_rank, comm_profile.time_s
        if (
            len(sizes) < 1
            or len(sizes) != len(times)
            or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False))
            or any(not (size > 0) for size in sizes)
            or any(not (t > 0 and t < float("inf")) for t in times)
        ):
            raise ValueError(
                "comm_profile: expected increasing positive bytes_per_rank and as many finite positive "
                "time_s "
                f"(got {len(sizes)} sizes, {len(times)} times)"
            )
    if not isinstance(categories, Mapping):
        raise TypeError(f"categories is {type(categories).__name__}, expected {{parameter name: category}}")
    for name, category in categories.items():
        if category not in DEFAULT_PRIORS:
            raise ValueError(f"categories[{name!r}] = {category!r}: expected one of {list(CATEGORIES)}")
    if not isinstance(priors, Mapping):
        raise TypeError(f"priors is {type(priors).__name__}, expected {{category: block change rate}}")
    q_by_category = dict(DEFAULT_PRIORS)
    for category, rate in priors.items():
        if category not in DEFAULT_PRIORS:
            raise ValueError(f"priors: {category!r} is not a category, expected one of {list(CATEGORIES)}")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"priors[{category!r}] = {rate!r}: expected a block change rate in [0, 1]")
        q_by_category[category] = float(rate)
    return q_by_category


def _not_selected_reason(row: Decision, world_size: int) -> str:
    if world_size < 2:
        return "not selected by BSC: world size 1"
    if row.gain_s <= 0:
        return (
            f"not selected by BSC: its codec costs more than the bytes it saves on this link "
            f"(gain {row.gain_s * 1e3:.3g} ms per gather, q = {row.q:.2f})"
        )
    return f"not selected by BSC: over the cache budget ({row.memory_bytes} bytes of cache)"


def _apply_selection(
    ciera: CieraFSDP2,
    comms: list[CieraAllGather],
    select: bool,
    comm_profile: CommProfile | None,
    q_by_category: dict[str, float],
) -> None:
    """Per shard process group (in order of its first module): agree on the candidates, then (select)
    decide them all with rank 0's BSC table. Collective over each group with a candidate."""
    by_group: dict[dist.ProcessGroup, list[CieraAllGather]] = {}
    for comm in comms:
        by_group.setdefault(comm.plan.group, []).append(comm)
    for group, members in by_group.items():
        candidates = [comm for comm in members if not comm.plan.reason]
        if not candidates:
            continue  # nothing CIERA would do over this group: no collective
        world_size = dist.get_world_size(group)
        # Same modules, sizes, dtypes and selection arguments on every rank before any collective of the
        # selection (else the same ConfigMismatchError on all, not mismatched collectives).
        description = ";".join(
            f"{c.stats.shard_id}:{c.plan.numel}:{c.plan.dtype}:{c.plan.reason == ''}" for c in members
        )
        _agree(
            f"{description}|{select}|{sorted(q_by_category.items())}|{ciera.cache_budget_bytes}|"
            f"{ciera.config.fingerprint}|{comm_profile is not None}|{ciera.part_bytes}",
            group,
            world_size,
        )
        if not select:
            continue
        shards = [
            ShardInfo(
                comm.stats.shard_id,
                comm.plan.numel,
                "bf16" if comm.plan.dtype == torch.bfloat16 else "fp16",
                comm.plan.category,
                comm.plan.q,
            )
            for comm in candidates
        ]
        table, gate = select_with_gate(shards, group, ciera.config, ciera.cache_budget_bytes, comm_profile)
        # Each module is one call: the per-call gate (selection.CallGate) weighs its fixed cost once, here.
        for comm, row in zip(candidates, table, strict=True):
            if row.shard_id != comm.stats.shard_id:  # broadcast_decisions kept rank 0's order
                raise RuntimeError(f"BSC table row {row.shard_id} for shard {comm.stats.shard_id}")
            raw_bytes = 2.0 * comm.plan.numel
            pays = row.selected and gate.pays(raw_bytes, row.payload_bytes, row.codec_s)
            comm.selected = pays
            ciera.selection.append(
                {
                    "module": comm.stats.module,
                    "numel": comm.plan.numel,
                    **row.as_dict(),
                    "call_pays": pays,
                    "per_call_s": gate.per_call_s,
                }
            )
            if not row.selected:
                comm.stats.reason = _not_selected_reason(row, world_size)
            elif not pays:
                comm.stats.reason = (
                    "not selected by BSC: its gather's bytes saved do not pay CIERA's per-call cost "
                    f"({gate.describe()})"
                )


def enable_ciera(
    model: nn.Module,
    config: CodecConfig | None = None,
    cache_budget_bytes: int | None = None,
    timeout_s: float = 300.0,
    select: bool = False,
    comm_profile: CommProfile | None = None,
    categories: Mapping[str, str] | None = None,
    priors: Mapping[str, float] | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    device_gather: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> CieraFSDP2:
    """Install the CIERA all-gather on every FSDP2 module of ``model`` (the root and every
    ``fully_shard``-ed submodule). Call after ``fully_shard`` and before the first forward, on every rank,
    with the same arguments (collective: it all-gathers a small fingerprint per shard process group, and
    with ``select`` profiles the link and broadcasts rank 0's decisions). Returns the :class:`CieraFSDP2`
    that holds the engines and the stats.

    ``cache_budget_bytes`` bounds what each engine (one per process group) keeps between gathers; a
    parameter group that does not fit is gathered raw (logged). ``timeout_s`` bounds every wait of a
    compressed gather: a rank that never arrives makes the others raise ``GatherTimeoutError``.

    ``select`` (default False: every BF16/FP16 group is compressed): benefit-driven selection per module
    at enable time, from its all-gather input size and dtype and a block change rate prior — the
    values-weighted mean of its parameters' category priors (``categories`` {parameter name: category},
    else from the names; ``priors`` {category: q} over zero3.DEFAULT_PRIORS). ``comm_profile``: a
    :class:`~ciera_runtime.selection.CommProfile` to use instead of profiling the link. A module not
    selected gathers through the plain all-gather, with no CIERA work. Not with
    ``reshard_after_forward=<int>`` (its backward gathers run over another group, which is not profiled).

    ``part_bytes`` (default 2 MiB; 0: never): a group's flat shard of at least twice this many bytes per
    rank travels as up to 8 pipelined buckets, contiguous ranges of it (docs/fsdp2.md).

    ``device_gather`` (with ``optimizer``, the one that steps the model): every BF16/FP16 module gathers
    through :class:`~ciera_runtime.device_gather.DeviceGather` on its own device — the path for CUDA
    parameters, which the host path leaves to the plain all-gather: the inputs encoded at the first
    gather after each optimizer step, no host read per gather, changed exponents rANS-coded on the device
    (``config.entropy``), no selection;
    the optimizer's step pre-hook raises the same GatherError on every rank if a gather failed. Run on
    CPU (gloo), not yet on a GPU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model is {type(model).__name__}, expected a torch.nn.Module sharded with fully_shard"
        )
    if getattr(model, "_ciera_fsdp2", None) is not None:
        raise ValueError(
            f"CIERA is already enabled on this {type(model).__name__}: call enable_ciera once per model"
        )
    categories = {} if categories is None else categories
    q_by_category = _check_select_arguments(
        select, comm_profile, categories, {} if priors is None else priors
    )
    found = fsdp_modules(model)
    if not found:
        raise ValueError(
            f"model {type(model).__name__} has no FSDP2 module: apply torch.distributed.fsdp.fully_shard "
            "to its blocks and to the root before enable_ciera"
        )
    names = {id(param): name for name, param in model.named_parameters()}
    unknown = sorted(set(categories) - set(names.values()))
    if unknown:
        raise ValueError(f"categories: {unknown[0]!r} is not a parameter of the model")
    check_part_bytes(part_bytes)
    if device_gather and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "enable_ciera(device_gather=True) needs optimizer=<the torch.optim.Optimizer that steps the model>: "
            "its step checks the gathers before and marks the payloads stale after"
        )
    if device_gather and select:
        raise ValueError("enable_ciera: device_gather compresses every BF16/FP16 module; use select=False")
    ciera = CieraFSDP2(config, cache_budget_bytes, timeout_s, select, part_bytes)
    comms: list[tuple[FSDPModule, CieraAllGather]] = []
    for name, module in found:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError(
                f"module {name!r} has {len(param_groups)} FSDP parameter groups (shard_placement_fn with "
                "several meshes): FSDP2's custom all-gather supports one group per module"
            )
        for param_group in param_groups:
            stats = ModuleGatherStats(name, len(comms))
            comm = CieraAllGather(ciera, stats, param_group)
            comm.plan = _plan(param_group, names, categories, q_by_category)
            if select and comm.plan.post_forward_group:
                raise ValueError(
                    f"module {name!r} reshards after forward to a smaller group "
                    "(reshard_after_forward=<int>): select=True weighs one link per module; use select=False "
                    "or reshard_after_forward=True"
                )
            comms.append((module, comm))
    _apply_selection(ciera, [comm for _, comm in comms], select, comm_profile, q_by_category)
    for module, comm in comms:
        stats = comm.stats
        ciera.modules[stats.module] = stats
        if select:
            plan = comm.plan
            stats.numel = plan.numel or 0
            stats.dtype = _dtype_name(plan.dtype) if plan.dtype is not None else ""
            if plan.reason or not comm.selected:
                comm.selected = False
                stats.compressed, stats.reason = False, stats.reason or plan.reason
        else:
            comm.plan = None  # decided at each module's first gather, as before selection existed
        module.set_custom_all_gather(comm)
    if select:
        _log_selection(ciera, q_by_category, priors)
    if device_gather:
        ciera.device_gather = True
        ciera._device_comms = [comm for _, comm in comms]
        ciera._hooks = [
            optimizer.register_step_pre_hook(lambda *_: ciera.check_device_gathers()),
            optimizer.register_step_post_hook(lambda *_: setattr(ciera, "_stale_payloads", True)),
        ]
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(
                "ciera_runtime.fsdp2: device gather for %d modules: exact detector, entropy stage %s on the "
                "device, no selection",
                len(comms),
                ciera.config.entropy,
            )
    # An iteration starts at each forward of the model (before FSDP2's own root pre-forward hook).
    model.register_forward_pre_hook(ciera._start_iteration, prepend=True)
    model._ciera_fsdp2 = ciera
    return ciera


def _log_selection(ciera: CieraFSDP2, q_by_category: dict[str, float], priors) -> None:
    """Rank 0 says once what selection used and decided (every rank applied the same table)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if ciera.selection:
        logger.warning(
            "ciera_runtime.fsdp2: no block change history at start-up; BSC uses per-category priors "
            "(%s: %s), weighted by values per module",
            PRIOR_SOURCE if not priors else "given priors over " + PRIOR_SOURCE,
            ", ".join(f"{c} q={q_by_category[c]:g}" for c in CATEGORIES),
        )
    for stats in ciera.modules.values():
        if stats.compressed is False:
            # Not BF16/FP16 or not on CPU: a warning, as without selection; not selected: what BSC is for.
            log = logger.info if stats.reason.startswith("not selected by BSC") else logger.warning
            log(
                "ciera_runtime.fsdp2: module %r (%d values) uses the plain all-gather: %s",
                stats.module,
                stats.numel,
                stats.reason,
            )
    selected = [stats for stats in ciera.modules.values() if stats.compressed is not False]
    logger.info(
        "ciera_runtime.fsdp2: BSC selected %d of %d modules (%d of %d values per rank) for CIERA",
        len(selected),
        len(ciera.modules),
        sum(stats.numel for stats in selected),
        sum(stats.numel for stats in ciera.modules.values()),
    )
