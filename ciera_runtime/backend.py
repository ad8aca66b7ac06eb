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
    """Kernels one codec step needs. Arrays are 1-D; ``bits`` is the shard as uint16 patterns."""

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


class CpuBackend:
    """numba kernels (vectorised loops; blocks and rANS chunks in parallel) and the numba interleaved rANS."""

    name = "cpu"

    def __init__(self) -> None:
        from ciera_runtime import kernels, rans

        self._kernels = kernels
        self._rans = rans
        kernels.start_thread_pool()

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
        return self._kernels.encode_planes_exact(
            bits, exp_shift, exp_mask, is_fp16, block_size, exp_out, last_exp, changed_out, force_all, sm_out
        )

    def extract_exponents(self, bits, exp_shift, exp_mask, exp_out):
        self._kernels.extract_exponents(bits, exp_shift, exp_mask, exp_out)

    def pack_sign_mantissa(self, bits, is_fp16, out):
        self._kernels.pack_sign_mantissa(bits, is_fp16, out)

    def merge_planes_checked(self, exp, sign_mantissa, exp_shift, is_fp16, out) -> int:
        return self._kernels.merge_planes_checked(exp, sign_mantissa, exp_shift, is_fp16, out)

    def gather_blocks(self, exp, changed_blocks, block_offsets, block_size, out):
        self._kernels.gather_blocks(exp, changed_blocks, block_offsets, block_size, out)

    def scatter_blocks(self, packed, changed_blocks, block_offsets, block_size, exp):
        self._kernels.scatter_blocks(packed, changed_blocks, block_offsets, block_size, exp)

    def checksum64(self, plane: np.ndarray) -> int:
        return self._kernels.checksum64(plane)

    def ans_encode_into(self, data: np.ndarray, out: np.ndarray) -> int:
        return self._rans.encode_into(data, out)

    def ans_decode(self, stream, out: np.ndarray) -> None:
        self._rans.decode(stream, out)


def _cuda_unavailable() -> CodecBackend:
    raise BackendUnavailableError(
        "codec backend 'cuda' is not available in this build (no CUDA kernels / nvCOMP ANS yet); use 'cpu'"
    )


_FACTORIES: dict[str, Callable[[], CodecBackend]] = {"cpu": CpuBackend, "cuda": _cuda_unavailable}
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
