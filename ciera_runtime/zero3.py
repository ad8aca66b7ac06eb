"""CIERA inside DeepSpeed ZeRO-3: one call (or one config section) routes the parameter all-gathers of the
selected BF16/FP16 parameters through :class:`~ciera_runtime.allgather.CompressedAllGather`.

Usage (every rank, same order, after ``deepspeed.initialize`` and before or between iterations)::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    ciera = enable_ciera(engine)                    # or: enable_ciera(engine, select=False, ...)

or let the DeepSpeed config carry it (``"ciera": {"enabled": true, ...}``) and call
``ciera_runtime.zero3.initialize(...)`` instead of ``deepspeed.initialize(...)``.

The hook (the route DeepSpeed's MiCS took): every ZeRO-3 parameter carries its own ``all_gather_coalesced``
(the coordinator's fetch and prefetch path: forward, activation-checkpoint recompute, backward) and
``all_gather`` (the blocking path: ``GatheredParameters``, persistent parameters after each step and around
checkpoints, external parameters, ``param.item()``). Both attributes are replaced on every parameter; the
replacement sends the selected parameters (keyed by ``ds_id``) through CIERA and hands the rest, unchanged,
to DeepSpeed's original function. The shard is the parameter's ``ds_tensor`` (its padded local partition);
the gathered tensor is laid out as DeepSpeed's (rank-major, the first ``ds_numel`` values viewed as
``ds_shape``) and the parameter's ``ds_status`` goes NOT_AVAILABLE -> INFLIGHT at the call and -> AVAILABLE
at ``wait()``, exactly as DeepSpeed's handles do, so the coordinator cannot tell the difference.

Collective order. Each coalesced call's CIERA parameters are gathered as one bucket
(:mod:`ciera_runtime.bucket`): one all-gather, issued inside the call so DeepSpeed's prefetch overlaps it
with compute, decoded at ``wait()`` (plus, rarely, an overflow round issued there). DeepSpeed waits on
in-flight handles in the iteration order of a Python set, which differs between ranks, so calls are
finished strictly in the order they were started (a FIFO): waiting on any handle first finishes every
earlier CIERA call. Start points are the same on every rank (DeepSpeed's own collectives rely on that). If
a call fails, every pending call is finished before the error is raised; which ranks raise in that call
and which at their next one is in docs/runtime.md, "When a failure surfaces".

Supported: DeepSpeed 0.19.x, CPU tensors (DeepSpeed's CPU accelerator with gloo; the codec backends in this
build are CPU-only). See docs/engines.md for the gather counts per parameter and iteration.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ciera_runtime.bucket import DEFAULT_PART_BYTES, PartBudget, check_part_bytes
from ciera_runtime.codec import CodecConfig
from ciera_runtime.errors import CieraError, ConfigMismatchError, GatherError

logger = logging.getLogger("ciera_runtime")

SUPPORTED_DEEPSPEED = "0.19"  # major.minor this module was written against (read its source before moving on)
INSTALL_HINT = 'pip install -e ".[deepspeed]"'

# Block change rate priors at B = 512 per category (no history exists at start-up): the median block change
# rates of OLMoE-1B-7B after warm-up (reference method, Fig. 4); traces/data/models/*.toml carry the other
# models' medians. Pass ``priors=`` for your model's own.
DEFAULT_PRIORS: dict[str, float] = {
    "expert_ffn": 0.22,
    "attention": 0.96,
    "router": 0.94,
    "norm": 0.64,
    "embedding": 0.65,
}
PRIOR_SOURCE = "reference method, OLMoE medians at B=512"
CATEGORIES = tuple(DEFAULT_PRIORS)

PHASES = ("forward", "recompute", "backward", "outside_fetch", "unused")

_CONFIG_KEYS = {
    "enabled",
    "device_gather",
    "part_bytes",
    "block_size",
    "detector",
    "verify_every",
    "entropy",
    "cache_budget_bytes",
    "select",
    "timeout_s",
    "categories",
    "priors",
}


class DeepSpeedVersionError(CieraError, RuntimeError):
    """The installed DeepSpeed is outside the range this integration supports."""


# ----------------------------------------------------------------------------- DeepSpeed import and version


def require_deepspeed():
    """Import DeepSpeed and check its version; one-line errors for a missing or unsupported install."""
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            f"ciera_runtime.zero3 needs DeepSpeed {SUPPORTED_DEEPSPEED}.x, which is not installed: {INSTALL_HINT}"
        ) from error
    check_deepspeed_version(getattr(deepspeed, "__version__", "unknown"))
    return deepspeed


def check_deepspeed_version(version: str) -> None:
    """Raise DeepSpeedVersionError unless ``version`` is SUPPORTED_DEEPSPEED.x."""
    parts = str(version).split(".")
    if ".".join(parts[:2]) != SUPPORTED_DEEPSPEED or len(parts) < 3:
        raise DeepSpeedVersionError(
            f"ciera_runtime.zero3 supports DeepSpeed {SUPPORTED_DEEPSPEED}.x; found deepspeed {version} "
            f"(its ZeRO-3 parameter hooks may differ): install a {SUPPORTED_DEEPSPEED}.x release"
        )


# ----------------------------------------------------------------------------- categories


def category_from_name(name: str) -> str:
    """A parameter's category from its name (the first rule that matches): embedding (embed, wte, wpe,
    lm_head), norm (a name part ending in norm or normN, or ln, ln_*, lnN), router (a part named router,
    gate, shared_expert_gate or wg; gate_proj is not one), attention (attn, attention, self_attn, q/k/v/o
    projections, qkv, c_attn), else expert_ffn (experts, mlp, ffn and every other weight)."""
    parts = name.lower().split(".")
    joined = "." + ".".join(parts) + "."
    if any(key in joined for key in ("embed", ".wte.", ".wpe.", "lm_head")):
        return "embedding"
    if any(re.search(r"norm\d*$", part) or re.match(r"ln(_|\d|$)", part) for part in parts):
        return "norm"
    if any(part in ("router", "gate", "shared_expert_gate", "wg") for part in parts):
        return "router"
    if any(
        part in ("attn", "attention", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "qkv", "c_attn")
        for part in parts
    ):
        return "attention"
    return "expert_ffn"


# ----------------------------------------------------------------------------- per-gather bookkeeping


@dataclass
class _Job:
    """One CIERA bucket gather in flight (started, not yet finished): the parameters of one coalesced call
    that share a process group, gathered in one collective."""

    params: list
    handle: Any  # ciera_runtime.bucket.BucketHandle
    outputs: list  # torch.Tensor of world_size * partition numel, per parameter
    done: bool = False
    error: BaseException | None = None


class CieraGatherHandle:
    """What the patched ``all_gather_coalesced`` returns when a call includes CIERA parameters: DeepSpeed's
    handle interface (``wait(handle_dependency=True)``), the CIERA gathers of the call and DeepSpeed's own
    handle for the rest of the call."""

    def __init__(self, owner: CieraZero3, jobs: list[_Job], ds_handle) -> None:
        self._owner = owner
        self._jobs = jobs
        self._ds_handle = ds_handle
        self.complete = False

    def wait(self, handle_dependency: bool = True, **kwargs) -> None:
        if self.complete:
            return
        if self._jobs:
            self._owner._finish_through(self._jobs[-1])
        for job in self._jobs:
            self._owner._publish(job)
        self._jobs = []
        if self._ds_handle is not None:
            self._ds_handle.wait(handle_dependency=handle_dependency)
            self._ds_handle = None
        self.complete = True


@dataclass
class ParamRoute:
    """Which path a parameter's gathers take, and why."""

    ds_id: int
    name: str
    category: str
    numel: int  # ds_numel (the full parameter)
    partition_numel: int  # ds_tensor.ds_numel (this rank's padded shard)
    dtype: str
    path: str  # "ciera" or "deepspeed"
    reason: str


@dataclass
class _Local(threading.local):
    phase: str = "outside_fetch"
    module_params: frozenset = field(default_factory=frozenset)  # id() of the fetched module's params


# ----------------------------------------------------------------------------- the integration


class CieraZero3:
    """CIERA installed on one DeepSpeed ZeRO-3 engine (or ZeRO-3 module). Create with :func:`enable_ciera`.

    ``routes``: ds_id -> :class:`ParamRoute`; ``decisions``: the BSC table every rank applied (rank 0's);
    ``gathers``: the CompressedAllGather engine per process group; ``gathers_per_param()``,
    ``gather_table()``, ``stats()``, ``reset_counts()``; ``disable()`` restores DeepSpeed's functions."""

    def __init__(
        self, module, coordinator, config: CodecConfig, timeout_s: float, part_bytes: int = DEFAULT_PART_BYTES
    ) -> None:
        self.module = module
        self.config = config
        self.timeout_s = timeout_s
        # A coalesced call larger than this (raw bytes per rank) travels as several buckets, issued one
        # after the other as each is encoded: the link carries one while the next is encoded, and at
        # wait() one is decoded while the next arrives (0: one bucket per call).
        self.part_bytes = part_bytes
        self.routes: dict[int, ParamRoute] = {}
        self.decisions: list = []
        self.gathers: dict[int, Any] = {}  # id(process group) -> CompressedAllGather
        # id(process group) -> DeviceGather, with 'device_gather': payloads prepared at each optimizer step
        self.device_gathers: dict[int, Any] = {}
        self._engine = None  # the DeepSpeed engine whose optimizer step the device gathers hook
        self._restore: list[Callable[[], None]] = []  # undoes the step hooks (disable)
        # Set by the optimizer step: the partitions change, so the next device gather prepares first
        # (DeepSpeed re-gathers its persistent parameters inside the step, after the update).
        self._stale_payloads = False
        self._coordinator = coordinator
        self._engine_of: dict[int, Any] = {}  # ds_id -> CompressedAllGather (CIERA params only)
        self._params: dict[int, Any] = {}  # ds_id -> parameter
        self._original_coalesced: dict[int, Callable] = {}
        self._original_all_gather: dict[int, Callable] = {}
        self._pending: collections.deque[_Job] = collections.deque()
        self._lock = threading.RLock()
        self._local = _Local()
        self._issued: collections.Counter = collections.Counter()  # (ds_id, issuing phase, kind) -> gathers
        self._used: collections.Counter = (
            collections.Counter()
        )  # (ds_id, phase of first use, kind) -> gathers
        self._awaiting_use: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._ds_bytes_sent = 0
        self._ds_gathers = 0
        self._pipelined_calls = 0  # coalesced calls cut into several buckets (part_bytes)
        # With BSC: per engine, the gate that weighs each coalesced call (selection.CallGate), and per
        # selected parameter (raw bytes, estimated payload bytes, codec seconds) per rank, from the table.
        self.call_gates: dict[int, Any] = {}  # id(CompressedAllGather) -> CallGate
        self._gate_figures: dict[int, tuple[float, float, float]] = {}
        self._gated_calls = 0  # coalesced calls the gate left whole to DeepSpeed
        self.part_budget = PartBudget(part_bytes)  # how many, within a per-step budget of extra calls
        self._module_params_cache: dict[int, tuple[frozenset, tuple[int, ...]]] = {}
        self._active = False

    # ------------------------------------------------------------------- counting and stats

    def reset_counts(self) -> None:
        """Start a new count of gathers (e.g. at the start of an iteration)."""
        self._issued.clear()
        self._used.clear()

    def gathers_per_param(
        self, phase: str | None = None, kind: str | None = None, by: str = "name", attributed: str = "use"
    ) -> dict:
        """Gathers per parameter since the last ``reset_counts()``, on either path (every call that
        materialises a parameter from its partitions), as {name or ds_id: count}.

        ``phase`` None: all gathers. Otherwise forward, recompute (activation-checkpoint recompute: a
        forward fetch inside autograd's backward), backward, outside_fetch (blocking gathers:
        GatheredParameters, persistent parameters after the step and around checkpoints) or unused (a
        prefetch the coordinator dropped at the next reset_step). With ``attributed="use"`` a gather counts
        in the phase of the fetch that first used it (a prefetch issued during backward for a recompute
        counts as recompute); with ``"issue"``, in the phase that issued it. ``kind``: fetch (issued for
        the module being fetched), prefetch (issued ahead, for later modules) or sync (blocking)."""
        if by not in ("name", "ds_id") or attributed not in ("use", "issue"):
            raise ValueError(f"by={by!r}, attributed={attributed!r}: expected 'name'|'ds_id', 'use'|'issue'")
        source = self._issued if phase is None or attributed == "issue" else self._used
        result: collections.Counter = collections.Counter()
        for (ds_id, gather_phase, gather_kind), count in source.items():
            if phase is not None and gather_phase != phase:
                continue
            if kind is not None and gather_kind != kind:
                continue
            result[self.routes[ds_id].name if by == "name" else ds_id] += count
        return dict(result)

    def gather_table(self) -> list[dict]:
        """One row per (parameter, phase of first use, kind) since the last reset, in ds_id order."""
        rows = []
        for (ds_id, phase, kind), count in sorted(self._used.items()):
            route = self.routes[ds_id]
            rows.append(
                {
                    "ds_id": ds_id,
                    "name": route.name,
                    "category": route.category,
                    "path": route.path,
                    "phase": phase,
                    "kind": kind,
                    "gathers": count,
                }
            )
        return rows

    def stats(self) -> dict:
        """Bytes this rank sent for parameter gathers since enable: CIERA's engine stats (control, bulk and
        status rounds) plus the raw bytes of the gathers left on DeepSpeed's path."""
        ciera = collections.Counter()
        wire_by_kind = collections.Counter()
        host_s = 0.0
        for engine in self.gathers.values():
            buckets = engine.bucket_stats
            if buckets is not None:
                ciera.update(
                    calls=buckets.calls,
                    registrations=buckets.registrations,
                    overflow_rounds=buckets.overflow_rounds,
                    raw_messages=buckets.raw_messages,
                    one_call_calls=buckets.one_call_encodes,
                )
                wire_by_kind.update(buckets.wire_bytes_by_kind())
            s = engine.stats
            ciera.update(
                gathers=s.gathers,
                raw_gathers=s.raw_gathers,
                resyncs=s.resyncs,
                failed_gathers=s.failed_gathers,
                rounds=s.rounds,
                bytes_sent=s.bytes_sent,
                raw_bytes_equivalent=s.raw_bytes_equivalent,
            )
            host_s += s.host_s
        for device in self.device_gathers.values():
            ciera.update(
                gathers=device.stats.gathers, calls=device.stats.gathers, rounds=device.stats.gathers,
                bytes_sent=device.stats.bytes_sent, raw_bytes_equivalent=device.stats.raw_bytes_equivalent,
            )  # fmt: skip
            ciera.update(device_host_reads=device.stats.host_reads)
            host_s += device.stats.host_s
        return {
            "ciera_gathers": ciera["gathers"],
            "ciera_raw_gathers": ciera["raw_gathers"],
            "ciera_resyncs": ciera["resyncs"],
            "ciera_failed_gathers": ciera["failed_gathers"],
            "ciera_rounds": ciera["rounds"],
            "ciera_calls": ciera["calls"],  # bucket collectives: one per coalesced DeepSpeed call
            "ciera_registrations": ciera["registrations"],
            "ciera_overflow_rounds": ciera["overflow_rounds"],
            "ciera_raw_messages": ciera["raw_messages"],
            # Calls whose shards took the one-call bucket passes (ciera_runtime/bucket_codec.py).
            "ciera_one_call_calls": ciera["one_call_calls"],
            # Where the bucket rows' bytes go: codec payloads, raw messages, headers, padding.
            "ciera_wire_bytes_by_kind": dict(wire_by_kind),
            "ciera_bytes_sent": ciera["bytes_sent"],
            "ciera_raw_bytes_equivalent": ciera["raw_bytes_equivalent"],
            "ciera_host_s": host_s,  # on the training thread, network waits left out
            "ciera_pipelined_calls": self._pipelined_calls,
            # Coalesced calls with CIERA parameters that the call gate left whole to DeepSpeed (BSC).
            "ciera_gated_calls": self._gated_calls,
            "ciera_part_budget": self.part_budget.describe(),
            "deepspeed_gathers": self._ds_gathers,
            "deepspeed_bytes_sent": self._ds_bytes_sent,
            "bytes_sent": ciera["bytes_sent"] + self._ds_bytes_sent,
            "raw_bytes_equivalent": ciera["raw_bytes_equivalent"] + self._ds_bytes_sent,
            "compressed_params": sum(route.path == "ciera" for route in self.routes.values()),
            "deepspeed_params": sum(route.path == "deepspeed" for route in self.routes.values()),
            "memory_bytes": sum(engine.memory_bytes() for engine in self.gathers.values())
            + sum(device.memory_bytes() for device in self.device_gathers.values()),
            # The device gather's host reads of device data: one per prepare (sizes), one per check.
            "ciera_device_host_reads": ciera["device_host_reads"],
        }

    def _count(self, params: Iterable, sync: bool) -> None:
        local = self._local
        for param in params:
            if sync:
                self._issued[(param.ds_id, "outside_fetch", "sync")] += 1
                self._used[(param.ds_id, "outside_fetch", "sync")] += 1
                continue
            kind = "fetch" if id(param) in local.module_params else "prefetch"
            self._issued[(param.ds_id, local.phase, kind)] += 1
            if self._coordinator is None:  # no fetch to attribute it to
                self._used[(param.ds_id, local.phase, kind)] += 1
            else:
                self._awaiting_use[param.ds_id].append(kind)

    def _attribute_use(self, ds_ids: Iterable[int], phase: str) -> None:
        for ds_id in ds_ids:
            waiting = self._awaiting_use.get(ds_id)
            while waiting:
                self._used[(ds_id, phase, waiting.popleft())] += 1

    def _count_ds_path(self, params: Iterable) -> None:
        for param in params:
            self._ds_gathers += 1
            tensor = param.ds_tensor
            self._ds_bytes_sent += int(getattr(tensor, "ds_numel", tensor.numel())) * tensor.element_size()

    # ------------------------------------------------------------------- the gathers

    def _uses_ciera(self, param, quantize: bool = False) -> bool:
        if quantize or param.ds_id not in self._engine_of:
            return False
        # hpZ secondary partitions and quantised partitions travel on DeepSpeed's path.
        return param.ds_secondary_tensor is None and not hasattr(param.ds_tensor, "ds_quant_scale")

    def _start(self, params: list) -> list[_Job]:
        """Start one bucket gather per process group for ``params`` (one, in practice): the row is in
        flight on return, so DeepSpeed's prefetch overlaps its transfer with compute."""
        import torch

        by_engine: dict[int, list] = {}
        for param in params:
            by_engine.setdefault(id(self._engine_of[param.ds_id]), []).append(param)
        jobs = []
        for group_params in by_engine.values():
            engine = self._engine_of[group_params[0].ds_id]
            if id(engine) in {id(d) for d in self.device_gathers.values()}:
                # The device path: one exact-size slot per call, no parts (nothing to pipeline on the host).
                if self._stale_payloads or any(d.needs_prepare for d in self.device_gathers.values()):
                    self.prepare_device_gathers()
                shards = [param.ds_tensor.data for param in group_params]
                outputs = [
                    torch.empty(engine.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
                    for shard in shards
                ]
                handle = engine.all_gather([param.ds_id for param in group_params], shards, outputs)
                job = _Job(group_params, handle, outputs)
                self._pending.append(job)
                jobs.append(job)
                continue
            raw = sum(param.ds_tensor.numel() * param.ds_tensor.element_size() for param in group_params)
            count = self.part_budget.parts(tuple(param.ds_id for param in group_params), raw)
            parts = _parts(group_params, count)
            self._pipelined_calls += len(parts) > 1
            for part in parts:
                shards = [param.ds_tensor.data for param in part]
                # One buffer for the part, as DeepSpeed's coalesced call allocates: the bucket rebuilds
                # into it in one pass (ciera_runtime/bucket_codec.py).
                # (16-bit patterns, viewed per parameter: CIERA gathers BF16 and FP16 only, mixed or not.)
                sizes = [engine.world_size * shard.numel() for shard in shards]
                flat = torch.empty(sum(sizes), dtype=torch.int16, device=shards[0].device)
                outputs = [
                    part.view(shard.dtype) for part, shard in zip(flat.split(sizes), shards, strict=True)
                ]
                handle = engine.all_gather_bucket(shards, [param.ds_id for param in part], outputs)
                job = _Job(part, handle, outputs)
                self._pending.append(job)
                jobs.append(job)
        return jobs

    def _finish_through(self, target: _Job) -> None:
        """Finish every started CIERA gather up to ``target``, in start order. On a failure, finish every
        pending gather first (every rank then ran the same rounds), then raise the first error."""
        with self._lock:
            if target.done:
                if target.error is not None:
                    raise target.error
                return
            first_error: BaseException | None = None
            while self._pending:
                job = self._pending.popleft()
                try:
                    job.handle.wait()
                except GatherError as error:
                    job.error = error
                    first_error = first_error or error
                finally:
                    job.done = True
                if job is target and first_error is None:
                    return
            if first_error is not None:
                raise first_error
            if target.error is not None:
                raise target.error

    def _publish(self, job: _Job) -> None:
        """Point the parameter at its gathered values and mark it AVAILABLE, as DeepSpeed's handles do."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for param, output in zip(job.params, job.outputs, strict=True):
            if param.ds_status != ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"expected param {param.ds_summary()} to be inflight")
            param.data = output.narrow(0, 0, param.ds_numel).view(param.ds_shape)
            param.ds_status = ZeroParamStatus.AVAILABLE
        job.outputs = []

    def _all_gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False):
        """Replacement of every parameter's ``all_gather_coalesced`` (DeepSpeed's coordinator calls it on
        the first parameter of each bucket, for forward, recompute and backward fetches and prefetches)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = list(params)
        with self._lock:
            mine = sorted((p for p in params if self._uses_ciera(p, quantize)), key=lambda p: p.ds_id)
            if mine and self.call_gates and not self._call_pays(mine, params):
                self._gated_calls += 1
                mine = []
            chosen = {id(p) for p in mine}
            rest = [p for p in params if id(p) not in chosen]
            for param in mine:  # what DeepSpeed's function checks, before anything starts
                if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                    raise RuntimeError(param.ds_summary())
            self._count(params, sync=False)
            for param in mine:
                param.ds_status = ZeroParamStatus.INFLIGHT
            jobs = self._start(mine) if mine else []
            ds_handle = None
            if rest or not mine:
                self._count_ds_path(rest)
                original = self._original_coalesced[rest[0].ds_id] if rest else self._any_original_coalesced()
                ds_handle = original(rest, safe_mode=safe_mode, quantize=quantize)
            if not mine:
                return ds_handle
            return CieraGatherHandle(self, jobs, ds_handle)

    def _call_pays(self, mine: list, params: list) -> bool:
        """The call gate's verdict on one coalesced call (selection.CallGate); True where no gate applies.
        (Every CIERA parameter of a gated engine was selected by BSC, so it has its table figures.)"""
        gate = self.call_gates.get(id(self._engine_of[mine[0].ds_id]))
        if gate is None:
            return True
        raw = payload = codec_s = 0.0
        for param in mine:
            param_raw, param_payload, param_codec_s = self._gate_figures[param.ds_id]
            raw += param_raw
            payload += param_payload
            codec_s += param_codec_s
        total = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
        return gate.pays(raw, payload, codec_s, total - raw)

    def _any_original_coalesced(self) -> Callable:
        return next(iter(self._original_coalesced.values()))

    def _all_gather_for(self, owner) -> Callable:
        original = self._original_all_gather[owner.ds_id]

        def all_gather(param_list=None, async_op=False, hierarchy=0):
            return self._all_gather(owner, original, param_list, async_op, hierarchy)

        return all_gather

    def _all_gather(self, owner, original, param_list, async_op, hierarchy):
        """Replacement of every parameter's blocking ``all_gather`` (GatheredParameters, persistent
        parameters, external parameters, ``param.item()``): CIERA parameters are gathered and finished
        here (DeepSpeed's own path gathers only NOT_AVAILABLE parameters, so does this), the rest go to
        DeepSpeed's function."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if param_list is None:
            param_list = [owner]
        param_list = list(param_list)
        with self._lock:
            to_gather = [p for p in param_list if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if async_op:  # handles of DeepSpeed's per-parameter async path: stays on its path
                self._count(to_gather, sync=True)
                self._count_ds_path(to_gather)
                return original(param_list=param_list, async_op=async_op, hierarchy=hierarchy)
            mine = sorted((p for p in to_gather if self._uses_ciera(p)), key=lambda p: p.ds_id)
            chosen = {id(p) for p in mine}
            rest = [p for p in param_list if id(p) not in chosen]
            self._count(to_gather, sync=True)
            for param in mine:
                param.ds_status = ZeroParamStatus.INFLIGHT
            jobs = self._start(mine) if mine else []
            if jobs:
                self._finish_through(jobs[-1])
                for job in jobs:
                    self._publish(job)
            if rest:
                self._count_ds_path(p for p in rest if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
                return original(param_list=rest, async_op=async_op, hierarchy=hierarchy)
            return None

    # ------------------------------------------------------------------- phase tracking

    def _wrap_coordinator(self, coordinator) -> None:
        """Wrap the coordinator's fetch_sub_module (to know the phase and the module a gather serves) and
        reset_step (prefetches never used by then are counted as unused); instance attributes, so
        ``disable()`` can drop them."""
        import torch
        from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
        from deepspeed.utils import z3_leaf_module

        original_fetch = coordinator.fetch_sub_module
        original_reset = coordinator.reset_step
        local = self._local
        cache = self._module_params_cache

        def fetch_sub_module(current_submodule, forward: bool) -> None:
            in_backward = torch._C._current_graph_task_id() != -1
            phase = ("recompute" if in_backward else "forward") if forward else "backward"
            key = id(current_submodule)
            if key not in cache:
                recurse = z3_leaf_module(current_submodule)
                params = list(iter_params(current_submodule, recurse=recurse))
                cache[key] = (frozenset(id(p) for p in params), tuple(p.ds_id for p in params))
            module_params, ds_ids = cache[key]
            saved = (local.phase, local.module_params)
            local.phase, local.module_params = phase, module_params
            try:
                result = original_fetch(current_submodule, forward)
            finally:
                local.phase, local.module_params = saved
            with self._lock:
                self._attribute_use(ds_ids, phase)
            return result

        def reset_step() -> None:  # DeepSpeed: at the start of each forward of the model
            self.part_budget.start_step()
            result = original_reset()
            with self._lock:
                self._attribute_use(list(self._awaiting_use), "unused")
            return result

        coordinator.fetch_sub_module = fetch_sub_module
        coordinator.reset_step = reset_step

    # ------------------------------------------------------------------- the device gathers' step

    def prepare_device_gathers(self) -> None:
        """Encode every device-path partition as it is now: after each optimizer step, and after a checkpoint
        was loaded (both hooked when an engine was given). Collective; one host read per group."""
        self._stale_payloads = False
        for device in self.device_gathers.values():
            device.prepare(
                {
                    ds_id: self._params[ds_id].ds_tensor.data
                    for ds_id, d in self._engine_of.items()
                    if d is device
                }
            )

    def check_device_gathers(self) -> None:
        """Before the optimizer applies a step: the same GatherError on every rank if a device gather
        since the last check did not rebuild exactly (docs/runtime.md, "The device gather")."""
        for device in self.device_gathers.values():
            device.check()

    def _hook_engine(self, engine) -> None:
        """Check before and prepare after the optimizer's step; prepare after load_checkpoint."""
        optimizer = engine.optimizer
        step, load = optimizer.step, engine.load_checkpoint

        def checked_step(*args, **kwargs):
            self.check_device_gathers()
            self._stale_payloads = True
            result = step(*args, **kwargs)
            if self._stale_payloads:  # no gather inside the step prepared them
                self.prepare_device_gathers()
            return result

        def load_checkpoint(*args, **kwargs):
            self._stale_payloads = True  # a gather inside the load prepares first, as in the step
            result = load(*args, **kwargs)
            self.prepare_device_gathers()
            return result

        optimizer.step, engine.load_checkpoint = checked_step, load_checkpoint
        self._restore.append(
            lambda: (vars(optimizer).pop("step", None), vars(engine).pop("load_checkpoint", None))
        )

    # ------------------------------------------------------------------- install / remove

    def _install(self, params: dict[int, Any]) -> None:
        self._params = params
        for ds_id, param in params.items():
            self._original_coalesced[ds_id] = param.all_gather_coalesced
            self._original_all_gather[ds_id] = param.all_gather
        for param in params.values():
            param.all_gather_coalesced = self._all_gather_coalesced
            param.all_gather = self._all_gather_for(param)
        if self._coordinator is not None:
            self._wrap_coordinator(self._coordinator)
        self.module._ciera_zero3 = self
        self._active = True

    def disable(self) -> None:
        """Put DeepSpeed's own gather functions back on every parameter (between steps: no gather in
        flight). Every rank must call it at the same point."""
        if not self._active:
            return
        if self._pending:
            raise RuntimeError("CieraZero3.disable: gathers are in flight; disable between steps")
        for ds_id, param in self._params.items():
            param.all_gather_coalesced = self._original_coalesced[ds_id]
            param.all_gather = self._original_all_gather[ds_id]
        if self._coordinator is not None:
            for name in ("fetch_sub_module", "reset_step"):
                if name in vars(self._coordinator):
                    delattr(self._coordinator, name)
        if getattr(self.module, "_ciera_zero3", None) is self:
            del self.module._ciera_zero3
        for restore in self._restore:
            restore()
        self._restore.clear()
        self._active = False


# ----------------------------------------------------------------------------- enable


def _engine_parts(target):
    """(module, coordinator or None, ZeRO config or None) of a DeepSpeed engine or a ZeRO-3 module."""
    import torch

    if isinstance(target, torch.nn.Module) and not hasattr(target, "zero_optimization_stage"):
        return target, None, None
    stage = target.zero_optimization_stage() if hasattr(target, "zero_optimization_stage") else None
    if stage != 3:
        raise ValueError(
            f"enable_ciera: the engine runs ZeRO stage {stage}, expected 3 (parameter partitioning)"
        )
    offload = getattr(getattr(target, "optimizer", None), "parameter_offload", None)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    zero_config = getattr(getattr(target, "_config", None), "zero_config", None)
    return target.module, coordinator, zero_config


def ciera_section(engine) -> dict:
    """The ``"ciera"`` section of a DeepSpeed engine's config ({} if absent)."""
    config = getattr(getattr(engine, "_config", None), "_param_dict", None) or {}
    section = config.get("ciera", {})
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed config field 'ciera' is {section!r}, expected a table")
    unknown = sorted(set(section) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"DeepSpeed config field 'ciera.{unknown[0]}' is not a setting, expected one of {sorted(_CONFIG_KEYS)}"
        )
    return dict(section)


def _route_reason(param, zero_config, device_gather: bool = False) -> str | None:
    """Why a parameter stays on DeepSpeed's path (None: it can go through CIERA)."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype

    tensor = param.ds_tensor
    if tensor is None:
        return "no partition"
    if tensor.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(tensor.dtype).removeprefix('torch.')} (CIERA codes bf16/fp16)"
    if get_allgather_dtype(param, tensor) != tensor.dtype:
        return "communication dtype differs from the partition's"
    if tensor.device.type != "cpu" and not device_gather:
        return (
            f"partition on {tensor.device}: the host codec works on CPU tensors (the device gather, "
            "'ciera': {'device_gather': true}, has not run on a GPU yet)"
        )
    if getattr(param, "ds_zero_partition_world_size", 2) < 2:
        return "partition world size 1"
    if (
        getattr(getattr(tensor, "final_location", None), "name", "") == "nvme"
        or param.nvme_swapper is not None
    ):
        return "NVMe-offloaded partition"
    if hasattr(tensor, "ds_quant_scale"):
        return "quantized partition"
    if zero_config is not None:
        if getattr(zero_config, "zero_quantized_weights", False):
            return "zero_quantized_weights"
        if getattr(zero_config, "zero_hpz_partition_size", 1) > 1:
            return "hpZ secondary partition"
    return None


def _agree(description: str, group, world_size: int) -> None:
    """Every rank of ``group`` checks that every rank has the same routing; the same error on all if not."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([zlib.crc32(description.encode())], dtype=torch.int64)
    everyone = torch.empty(world_size, dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(everyone, mine, group=group)
    values = everyone.tolist()
    if len(set(values)) > 1:
        failures = {rank: f"routing fingerprint {value:08x}" for rank, value in enumerate(values)}
        raise ConfigMismatchError(
            None,
            failures,
            "ranks disagree on which parameters go through CIERA (different models, dtypes, select, "
            "categories, priors, budget or part_bytes); call enable_ciera with the same arguments on every rank",
        )


def _describe(routes: dict, members: list[int]) -> str:
    return ";".join(
        f"{ds_id}:{routes[ds_id].partition_numel}:{routes[ds_id].dtype}:{routes[ds_id].path}"
        for ds_id in members
    )


def _parts(params: list, count: int) -> list[list]:
    """``params`` (ds_id order) cut into ``count`` contiguous runs of about equal raw bytes per rank (a
    remainder under half a run joins the last; a run holds at least one parameter): the same cut on
    every rank."""
    if count <= 1:
        return [params]
    total = sum(param.ds_tensor.numel() * param.ds_tensor.element_size() for param in params)
    target = -(-total // count)
    parts, current, size = [], [], 0
    for param in params:
        current.append(param)
        size += param.ds_tensor.numel() * param.ds_tensor.element_size()
        if size >= target:
            parts.append(current)
            current, size = [], 0
    if current:
        if parts and size < target // 2:
            parts[-1].extend(current)
        else:
            parts.append(current)
    return parts


def _select(routes, candidates, group, config, budget, categories_q, comm_profile):
    """BSC for one group's candidates: rank 0's decision table, applied by every rank, and the gate that
    weighs each coalesced call (selection.CallGate) from the same comm profile."""
    from ciera_runtime.selection import ShardInfo, select_with_gate

    shards = [
        ShardInfo(
            ds_id,
            routes[ds_id].partition_numel,
            routes[ds_id].dtype,
            routes[ds_id].category,
            categories_q[routes[ds_id].category],
        )
        for ds_id in candidates
    ]
    # Encode runs when DeepSpeed starts the gather, on its thread: no CCP overlap, so it is charged.
    return select_with_gate(shards, group, config, budget, comm_profile)


def enable_ciera(
    engine_or_model,
    config: CodecConfig | None = None,
    cache_budget_bytes: int | None = None,
    select: bool | None = None,
    categories: Mapping[str, str] | None = None,
    priors: Mapping[str, float] | None = None,
    timeout_s: float | None = None,
    comm_profile=None,
    part_bytes: int | None = None,
    device_gather: bool | None = None,
) -> CieraZero3:
    """Route the ZeRO-3 parameter all-gathers of ``engine_or_model`` (a DeepSpeedEngine after
    ``deepspeed.initialize``, or a module built under ``deepspeed.zero.Init``) through CIERA.

    Collective: every rank of the data-parallel group calls it at the same point with the same arguments
    (it all-gathers a routing fingerprint, and with ``select`` profiles the link and broadcasts rank 0's
    decision table). Arguments left ``None`` come from the engine config's ``"ciera"`` section, else the
    defaults: ``config`` CodecConfig() (the section may give block_size, detector, verify_every, entropy),
    ``cache_budget_bytes`` unlimited, ``select`` True (BSC: benefit-driven selection from a measured comm
    profile, measured codec times and per-category block change rate priors; False compresses every
    eligible BF16/FP16 parameter), ``categories`` {parameter name: category} (default: from names, see
    :func:`category_from_name`), ``priors`` {category: q} over DEFAULT_PRIORS, ``timeout_s`` 300 (bounds
    every wait of a CIERA gather: a rank that never arrives makes the others raise GatherTimeoutError).
    ``comm_profile``: a :class:`~ciera_runtime.selection.CommProfile` to use instead of measuring one.
    ``part_bytes`` (default DEFAULT_PART_BYTES, 2 MiB; 0: never): a coalesced call of at least twice this
    many raw bytes per rank travels as several pipelined buckets of about this size, from the second
    step on and within a per-step budget of extra calls (bucket.PartBudget: the largest calls first).
    ``device_gather`` (default False): the partitions go through :class:`~ciera_runtime.device_gather.
    DeviceGather` on their own device — payloads prepared at each optimizer step, no host read per gather,
    changed exponents rANS-coded on the device (``entropy``), every partition compressed (no selection) — for CUDA partitions, which the
    host path leaves to DeepSpeed. Needs the engine (its optimizer step checks and prepares). It has run on
    CPU (gloo), not yet on a GPU.
    """
    require_deepspeed()
    import torch.distributed as dist

    from ciera_runtime.allgather import CompressedAllGather

    module, coordinator, zero_config = _engine_parts(engine_or_model)
    if getattr(module, "_ciera_zero3", None) is not None:
        raise RuntimeError("enable_ciera: CIERA is already enabled on this model (call .disable() first)")
    section = ciera_section(engine_or_model) if module is not engine_or_model else {}
    if config is None:
        config = CodecConfig(
            block_size=section.get("block_size", CodecConfig().block_size),
            detector=section.get("detector", CodecConfig().detector),
            verify_every=section.get("verify_every", 0),
            entropy=section.get("entropy", CodecConfig().entropy),
        )
    if cache_budget_bytes is None:
        cache_budget_bytes = section.get("cache_budget_bytes")
    if select is None:
        # The device path has no selection yet: it compresses every eligible partition.
        select = bool(section.get("select", not (device_gather or section.get("device_gather", False))))
    if categories is None:
        categories = section.get("categories", {})
    if priors is None:
        priors = section.get("priors", {})
    if timeout_s is None:
        timeout_s = float(section.get("timeout_s", 300.0))
    if part_bytes is None:
        part_bytes = section.get("part_bytes", DEFAULT_PART_BYTES)
    check_part_bytes(part_bytes)
    if device_gather is None:
        device_gather = section.get("device_gather", False)
    if not isinstance(device_gather, bool):
        raise ValueError(f"device_gather={device_gather!r}: expected true or false")
    if device_gather and module is engine_or_model:
        raise ValueError(
            "enable_ciera: device_gather needs the DeepSpeed engine (its optimizer step is where the device "
            "gather checks and prepares), not a bare module"
        )
    if device_gather and select:
        raise ValueError("enable_ciera: device_gather compresses every eligible partition; set select false")
    q_by_category = dict(DEFAULT_PRIORS)
    for category, rate in dict(priors).items():
        if category not in DEFAULT_PRIORS:
            raise ValueError(f"priors: '{category}' is not a category, expected one of {list(CATEGORIES)}")
        if not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"priors.{category}={rate!r}: expected a block change rate in [0, 1]")
        q_by_category[category] = float(rate)

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params: dict[int, Any] = {}
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id") and param.ds_id not in params:
            params[param.ds_id] = param
            names[param.ds_id] = name
    if not params:
        raise ValueError("enable_ciera: the model has no ZeRO-3 parameters (run deepspeed.initialize first)")
    inflight = [names[i] for i, p in params.items() if p.ds_status == ZeroParamStatus.INFLIGHT]
    if inflight:
        raise RuntimeError(f"enable_ciera: parameter '{inflight[0]}' is being gathered; enable between steps")
    routes: dict[int, ParamRoute] = {}
    for ds_id in sorted(params):
        name, param = names[ds_id], params[ds_id]
        category = categories.get(name) or category_from_name(name)
        if category not in DEFAULT_PRIORS:
            raise ValueError(f"categories['{name}'] = {category!r}: expected one of {list(CATEGORIES)}")
        reason = _route_reason(param, zero_config, device_gather)
        tensor = param.ds_tensor
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "none"
        routes[ds_id] = ParamRoute(
            ds_id,
            name,
            category,
            int(param.ds_numel),
            int(getattr(tensor, "ds_numel", tensor.numel())) if tensor is not None else 0,
            {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype),
            "deepspeed" if reason else "candidate",
            reason or "",
        )

    integration = CieraZero3(module, coordinator, config, timeout_s, part_bytes)
    integration.routes = routes
    # One CompressedAllGather per process group, groups in order of their first parameter.
    by_group: dict[int, list[int]] = {}
    group_of: dict[int, Any] = {}
    for ds_id in routes:
        group = params[ds_id].ds_process_group
        group_of[id(group)] = group
        by_group.setdefault(id(group), []).append(ds_id)
    rank0_log = dist.get_rank() == 0
    if select and rank0_log:
        used = sorted({route.category for route in routes.values() if route.path == "candidate"})
        logger.warning(
            "ciera_runtime.zero3: no block change history at start-up; BSC uses per-category priors "
            "(%s: %s) for %s",
            PRIOR_SOURCE if not priors else "given priors over " + PRIOR_SOURCE,
            ", ".join(f"{c} q={q_by_category[c]:g}" for c in CATEGORIES),
            ", ".join(used) or "no candidate",
        )
    for key, members in by_group.items():
        group = group_of[key]
        world_size = dist.get_world_size(group)
        if device_gather:
            _enable_device_gather(integration, key, group, members, params, routes, config)
            continue
        engine = CompressedAllGather(group, config, cache_budget_bytes, timeout_s)
        candidates = [ds_id for ds_id in members if routes[ds_id].path == "candidate"]
        # Same candidates everywhere before any collective of the selection (else: the same error on all).
        _agree(_describe(routes, members) + f"|{select}|{sorted(q_by_category.items())}", group, world_size)
        selected = set(candidates)
        if select and candidates:
            table, gate = _select(
                routes,
                candidates,
                group,
                config,
                cache_budget_bytes,
                q_by_category,
                comm_profile,
            )
            integration.decisions.extend(table)
            selected = {row.shard_id for row in table if row.selected}
            integration.call_gates[id(engine)] = gate
            for row in table:
                if row.selected:
                    raw_bytes = 2.0 * routes[row.shard_id].partition_numel
                    integration._gate_figures[row.shard_id] = (raw_bytes, row.payload_bytes, row.codec_s)
            if rank0_log and selected:
                logger.warning(
                    "ciera_runtime.zero3: call gate: a coalesced call goes through CIERA only where its bytes "
                    "saved pay its codec and %s; the others take DeepSpeed's gather whole",
                    gate.describe(),
                )
        for ds_id in candidates:
            route = routes[ds_id]
            if ds_id not in selected:
                route.path, route.reason = "deepspeed", "not selected by BSC (gain <= 0 or over the budget)"
                continue
            if engine.register(ds_id, route.partition_numel, route.dtype, category=route.category):
                route.path, route.reason = "ciera", "selected" if select else "select=False: every eligible"
                integration._engine_of[ds_id] = engine
            else:
                route.path, route.reason = "deepspeed", engine.registrations[ds_id].reason
        _agree(
            _describe(routes, members) + f"|{config.fingerprint}|{cache_budget_bytes}|{part_bytes}",
            group,
            world_size,
        )
        integration.gathers[key] = engine
    integration._install(params)
    if device_gather:
        integration._engine = engine_or_model
        integration._hook_engine(engine_or_model)
        integration.prepare_device_gathers()  # the payloads of the first step
    if rank0_log:
        compressed = [r for r in routes.values() if r.path == "ciera"]
        logger.info(
            "ciera_runtime.zero3: %d of %d parameters (%d of %d values per rank) go through CIERA",
            len(compressed),
            len(routes),
            sum(r.partition_numel for r in compressed),
            sum(r.partition_numel for r in routes.values()),
        )
    return integration


def _enable_device_gather(integration, key, group, members, params, routes, config) -> None:
    """Register one group's eligible partitions with a DeviceGather on their device."""
    import torch.distributed as dist

    from ciera_runtime.device_gather import DeviceGather

    candidates = [ds_id for ds_id in members if routes[ds_id].path == "candidate"]
    _agree(_describe(routes, members) + f"|device|{config.block_size}", group, dist.get_world_size(group))
    if not candidates:
        return
    device = DeviceGather(
        params[candidates[0]].ds_tensor.device, group, block_size=config.block_size, entropy=config.entropy
    )
    device.register({ds_id: params[ds_id].ds_tensor.data for ds_id in candidates})
    for ds_id in candidates:
        routes[ds_id].path, routes[ds_id].reason = "ciera", f"device gather (entropy {config.entropy})"
        integration._engine_of[ds_id] = device
    integration.device_gathers[key] = device
    if dist.get_rank() == 0:
        logger.warning(
            "ciera_runtime.zero3: device gather on %s for %d partitions: exact detector, changed exponents "
            "uncoded (no device entropy stage), every eligible partition compressed (no selection); "
            "codec settings other than block_size do not apply",
            device.device,
            len(candidates),
        )


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` then, if the config has ``"ciera": {"enabled": true, ...}``,
    :func:`enable_ciera` with that section. Returns DeepSpeed's tuple; the engine's ``ciera`` attribute
    holds the :class:`CieraZero3` (None when the section is absent or disabled)."""
    deepspeed = require_deepspeed()
    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    section = ciera_section(engine)
    engine.ciera = enable_ciera(engine) if section.get("enabled", False) else None
    return result
