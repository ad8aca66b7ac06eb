"""Codec backends: the array kernels behind the codec, chosen by name at run time.

Callers (encoder, decoder, all-gather) only talk to a :class:`CodecBackend`; a GPU backend (CUDA kernels
plus nvCOMP's ANS) implements the same methods on device buffers and registers itself under ``"cuda"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ciera_runtime.errors import BackendUnavailableError


class CodecBackend(Protocol):
    """Kernels one codec step needs. Arrays are 1-D; ``bits`` is the shard as uint16 patterns.

    Optional: ``serial_payload_passes = True`` with ``encode_exact_payload`` and ``rebuild_payload`` (a
    small shard's whole payload in one call each way, as CpuBackend does; ciera_runtime/payload_passes.py
    says what they do). Without them the encoder and decoder compose the methods below."""

    name: str

    def encode_planes_hash(
        self,
        bits,
        exp_shift: int,
        exp_mask: int,
        is_fp16: bool,
        block_size: int,
        hash_cache,
        exp_out,
        changed_out,
        force_all,
        sm_out,
    ) -> int:
        """``detect_changes_hash`` + ``pack_sign_mantissa`` into ``sm_out`` in one pass; returns
        ``checksum64(sm_out)``."""
        ...

    def encode_planes_exact(
        self,
        bits,
        exp_shift: int,
        exp_mask: int,
        is_fp16: bool,
        block_size: int,
        exp_out,
        last_exp,
        changed_out,
        force_all,
        sm_out,
    ) -> int:
        """``detect_changes_exact`` + ``pack_sign_mantissa`` into ``sm_out`` in one pass; returns
        ``checksum64(sm_out)``."""
        ...

    def extract_exponents(self, bits, exp_shift: int, exp_mask: int, exp_out) -> None: ...

    def pack_sign_mantissa(self, bits, is_fp16: bool, out) -> None: ...

    def merge_planes_checked(self, exp, sign_mantissa, exp_shift: int, is_fp16: bool, out) -> int:
        """``merge_planes`` that also returns ``checksum64(sign_mantissa)`` (the caller compares)."""
        ...

    def gather_blocks(self, exp, changed_blocks, block_offsets, block_size: int, out) -> None: ...

    def scatter_blocks(self, packed, changed_blocks, block_offsets, block_size: int, exp) -> None: ...

    def checksum64(self, plane) -> int: ...

    def ans_encode_into(self, data, out) -> int:
        """ANS stream of ``data`` written into ``out``; its length, or -1 when it does not fit."""
        ...

    def ans_decode(self, stream, out) -> None: ...


CODEC_THREADS_ENV = "CIERA_CODEC_THREADS"


def default_codec_threads() -> tuple[int, str]:
    """numba threads one rank's codec may use, and why: ``CIERA_CODEC_THREADS`` when set, else the cores
    this process may run on divided by the ranks on this host (``LOCAL_WORLD_SIZE``, set by torchrun and
    the deepspeed launcher; 1 when absent).

    Why not numba's default (every core): each rank would start a team of all cores, so W local ranks run
    W × cores threads, and a parallel region ends only when its last thread has been scheduled (measured
    cost: docs/runtime.md, "Codec threads per rank"; `benchmarks/codec_threads.py`)."""
    import os

    raw = os.environ.get(CODEC_THREADS_ENV)
    if raw is not None:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise BackendUnavailableError(f"{CODEC_THREADS_ENV}={raw!r}: expected a whole number >= 1")
        return threads, f"{CODEC_THREADS_ENV}={threads}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    raw_local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local_ranks = max(1, int(raw_local))
    except ValueError:
        raise BackendUnavailableError(f"LOCAL_WORLD_SIZE={raw_local!r}: expected a whole number") from None
    return max(1, cores // local_ranks), f"{cores} cores / {local_ranks} local ranks"


class CpuBackend:
    """numba kernels (vectorised loops; blocks and rANS chunks in parallel) and the numba interleaved rANS.

    ``threads`` caps the numba threads of every kernel call (see :func:`default_codec_threads`). numba's
    thread count is per calling thread, so each call checks its caller's; a caller that asked for fewer
    (the CCP worker) keeps its lower count."""

    name = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        import numba

        from ciera_runtime import kernels, payload_passes, rans

        self._kernels = kernels
        self._rans = rans
        self._passes = payload_passes
        self._numba = numba
        kernels.start_thread_pool()
        if threads is None:
            threads, self.threads_basis = default_codec_threads()
        else:
            self.threads_basis = "given"
        # numba cannot run more threads than the pool it started with (NUMBA_NUM_THREADS).
        self.threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
        if self.threads < threads:
            self.threads_basis += f", capped at numba's pool of {self.threads}"

    def _cap_threads(self, numel: int) -> None:
        """Cap the caller's numba threads before a kernel that may run in parallel; a shard too small for
        a parallel region runs serially (unless forced), and the check (~2 us) is skipped."""
        if numel < self._kernels.PARALLEL_MIN_VALUES and self._kernels._parallel_detect is not True:
            return
        if self._numba.get_num_threads() > self.threads:
            self._numba.set_num_threads(self.threads)

    def encode_planes_hash(
        self,
        bits,
        exp_shift,
        exp_mask,
        is_fp16,
        block_size,
        hash_cache,
        exp_out,
        changed_out,
        force_all,
        sm_out,
    ):
        self._cap_threads(bits.size)
        return self._kernels.encode_planes_hash(
            bits,
            exp_shift,
            exp_mask,
            is_fp16,
            block_size,
            hash_cache,
            exp_out,
            changed_out,
            force_all,
            sm_out,
        )

    def encode_planes_exact(
        self,
        bits,
        exp_shift,
        exp_mask,
        is_fp16,
        block_size,
        exp_out,
        last_exp,
        changed_out,
        force_all,
        sm_out,
    ):
        self._cap_threads(bits.size)
        return self._kernels.encode_planes_exact(
            bits, exp_shift, exp_mask, is_fp16, block_size, exp_out, last_exp, changed_out, force_all, sm_out
        )

    def extract_exponents(self, bits, exp_shift, exp_mask, exp_out):
        self._cap_threads(bits.size)
        self._kernels.extract_exponents(bits, exp_shift, exp_mask, exp_out)

    def pack_sign_mantissa(self, bits, is_fp16, out):
        self._cap_threads(bits.size)
        self._kernels.pack_sign_mantissa(bits, is_fp16, out)

    def merge_planes_checked(self, exp, sign_mantissa, exp_shift, is_fp16, out) -> int:
        self._cap_threads(out.size)
        return self._kernels.merge_planes_checked(exp, sign_mantissa, exp_shift, is_fp16, out)

    # A small shard's whole payload in one compiled call each way (ciera_runtime/payload_passes.py); the
    # encoder and decoder use them for shards that run serially anyway (codec._one_call_capable).
    serial_payload_passes = True
    # A bucket of such shards in one compiled call (ciera_runtime/bucket_codec.py).
    bucket_payload_passes = True

    def encode_exact_payload(
        self, bits, exp_shift, exp_mask, is_fp16, block_size, exp_out, last_exp, base, changed_out, full,
        payload, template, bitmap_bytes, sm_offset, sm_bytes, fixed_bytes, use_rans, generation, shard_crc,
        checksum_flag,
    ):  # fmt: skip
        return self._passes.encode_exact(
            bits, exp_shift, exp_mask, is_fp16, block_size, exp_out, last_exp, base, changed_out, full,
            payload, template, bitmap_bytes, sm_offset, sm_bytes, fixed_bytes, use_rans, generation,
            shard_crc, checksum_flag,
        )  # fmt: skip

    def rebuild_payload(
        self, payload, exp_section, meta_crc, bitmap_bytes, sm_offset, sm_bytes, n_blocks, header_changed,
        full, deltas, exact_detector, raw_exponents, block_size, exp_cache, exp_shift, is_fp16, out,
    ):  # fmt: skip
        return self._passes.rebuild(
            payload, exp_section, meta_crc, bitmap_bytes, sm_offset, sm_bytes, n_blocks, header_changed,
            full, deltas, exact_detector, raw_exponents, block_size, exp_cache, exp_shift, is_fp16, out,
        )  # fmt: skip

    # Serial kernels: no thread count to cap (checking it costs ~2 us a call, several calls a payload).
    def gather_blocks(self, exp, changed_blocks, block_offsets, block_size, out):
        self._kernels.gather_blocks(exp, changed_blocks, block_offsets, block_size, out)

    def scatter_blocks(self, packed, changed_blocks, block_offsets, block_size, exp):
        self._kernels.scatter_blocks(packed, changed_blocks, block_offsets, block_size, exp)

    def checksum64(self, plane: np.ndarray) -> int:  # serial
        return self._kernels.checksum64(plane)

    def ans_encode_into(self, data: np.ndarray, out: np.ndarray) -> int:
        self._cap_threads(data.size)
        return self._rans.encode_into(data, out)

    def ans_decode(self, stream, out: np.ndarray) -> None:
        self._cap_threads(out.size)
        self._rans.decode(stream, out)


def _cuda_unavailable() -> CodecBackend:
    raise BackendUnavailableError(
        "codec backend 'cuda' is not available in this build (no CUDA kernels / nvCOMP ANS yet); use 'cpu'"
    )


def _torch_backend() -> CodecBackend:
    """TorchBackend on the CPU; imported here, on first use, so importing this module stays light."""
    try:
        from ciera_runtime.torch_backend import TorchBackend
    except ImportError as error:
        raise BackendUnavailableError(f"codec backend 'torch' needs PyTorch: {error}") from None
    return TorchBackend()


_FACTORIES: dict[str, Callable[[], CodecBackend]] = {
    "cpu": CpuBackend,
    "cuda": _cuda_unavailable,
    "torch": _torch_backend,
}
_INSTANCES: dict[str, CodecBackend] = {}


def register_backend(name: str, factory: Callable[[], CodecBackend]) -> None:
    """Make ``factory`` the provider of backend ``name`` (a GPU package calls this on import)."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def available_backends() -> list[str]:
    """Names that :func:`get_backend` can construct on this machine."""
    names = []
    for name in _FACTORIES:
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def get_backend(name: str = "cpu") -> CodecBackend:
    """The backend called ``name``; raises BackendUnavailableError (one line) when it cannot be used."""
    if name not in _FACTORIES:
        raise BackendUnavailableError(
            f"unknown codec backend {name!r}; known: {', '.join(sorted(_FACTORIES))}"
        )
    if name not in _INSTANCES:
        _INSTANCES[name] = _FACTORIES[name]()
    return _INSTANCES[name]
