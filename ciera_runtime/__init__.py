"""CIERA runtime: lossless exponent-reuse all-gather for BF16/FP16 shards.

Public surface (see docs/runtime.md):

- ``CodecConfig``: block size, detector ('hash' | 'exact'), verify mode, backend name.
- ``ShardEncoder`` / ``ShardDecoder``: the per-shard codec (sender HashCache, receiver ExpCache).
- ``CompressedAllGather`` (engine per process group) and ``compressed_all_gather`` -> ``AllGatherHandle``
  (one shard, three rounds); ``CompressedAllGather.all_gather_bucket``: a bucket of shards in one
  collective, one round in steady state (what the engine plug-ins use; ``ciera_runtime.bucket``).
- ``gather_pipelined``: CCP, encode of gather i+1 overlapped with gather i.
- ``profile_comm``, ``measure_codec_times``, ``select_shards``, ``broadcast_decisions``: benefit-driven
  selection (BSC); broadcast rank 0's table so every rank compresses the same shards.
- ``CallGate``, ``measure_call_overhead_s``: BSC's per-call gate (an engine call whose bytes saved do not pay
  CIERA's measured fixed cost per call stays on the engine's own gather).
- ``get_backend``, ``available_backends``, ``register_backend``, ``CodecBackend``: codec backends.
- Errors: ``CieraError``, ``PayloadError``, ``OutOfStepError``, ``StalePayloadError``,
  ``ChecksumMismatchError``, ``BackendUnavailableError``; from a gather, on every rank alike:
  ``GatherError``, ``ConfigMismatchError``, ``GatherTimeoutError``; from an engine plug-in's first gather
  after a selection decided for other sizes: ``SelectionMismatchError``.

The device path, imported on purpose: ``ciera_runtime.device_gather`` (``DeviceGather``: payloads
prepared once per step, no host read per gather; docs/runtime.md, "The device gather").

torch is imported only by the all-gather, CCP and comm-profiling parts.
"""

from __future__ import annotations

from ciera_runtime.backend import CodecBackend, available_backends, get_backend, register_backend
from ciera_runtime.codec import CodecConfig, DType, ShardDecoder, ShardEncoder
from ciera_runtime.errors import (
    BackendUnavailableError,
    ChecksumMismatchError,
    CieraError,
    ConfigMismatchError,
    GatherError,
    GatherTimeoutError,
    OutOfStepError,
    PayloadError,
    SelectionMismatchError,
    StalePayloadError,
)
from ciera_runtime.selection import (
    CallGate,
    CodecTimes,
    CommProfile,
    Decision,
    ShardInfo,
    broadcast_decisions,
    measure_call_overhead_s,
    measure_codec_times,
    profile_comm,
    select_shards,
)

__all__ = [
    "AllGatherHandle",
    "BackendUnavailableError",
    "CallGate",
    "ChecksumMismatchError",
    "CieraError",
    "CodecBackend",
    "CodecConfig",
    "CodecTimes",
    "ConfigMismatchError",
    "GatherError",
    "GatherTimeoutError",
    "StalePayloadError",
    "CommProfile",
    "CompressedAllGather",
    "DType",
    "Decision",
    "OutOfStepError",
    "PayloadError",
    "ShardDecoder",
    "ShardEncoder",
    "SelectionMismatchError",
    "ShardInfo",
    "available_backends",
    "compressed_all_gather",
    "gather_pipelined",
    "get_backend",
    "measure_call_overhead_s",
    "measure_codec_times",
    "profile_comm",
    "register_backend",
    "broadcast_decisions",
    "select_shards",
]

_TORCH_NAMES = {
    "AllGatherHandle": "ciera_runtime.allgather",
    "CompressedAllGather": "ciera_runtime.allgather",
    "compressed_all_gather": "ciera_runtime.allgather",
    "gather_pipelined": "ciera_runtime.ccp",
}


def __getattr__(name: str):
    # torch-dependent names load on first use, so the codec imports without torch.
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'ciera_runtime' has no attribute {name!r}")
