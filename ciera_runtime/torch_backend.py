"""``TorchBackend``: the codec's array kernels written in torch tensor ops, byte-identical to ``CpuBackend``.

The same code runs on any torch device (``TorchBackend("cpu")`` today, ``TorchBackend("cuda")`` later): it
reproduces ``kernels.py`` bit for bit -- exponent plane, sign+mantissa plane (BF16, and FP16 with its
3-bit fields packed 8 per 3 bytes), block change detection (128-bit SplitMix64 block hash, or exact compare),
block gather/scatter and the plane's ``checksum64`` -- so payloads made by either backend are the same bytes.

Integer emulation, and why:

* torch has no arithmetic on ``uint16`` (nor ``uint64``) on every version and device, so a 16-bit pattern
  is read through an ``int16`` view, widened to ``int32`` and masked with ``0xFFFF``: its shifts and masks
  then see the unsigned pattern. Rebuilt patterns are brought back into ``[-2**15, 2**15)`` before the
  cast to ``int16``, so no cast ever depends on out-of-range conversion rules.
* SplitMix64 (block hash and checksum) is uint64 arithmetic. It runs on ``int64``: multiply and add wrap
  two's-complement, which is the same 64 bits as mod 2**64; a logical right shift is the arithmetic shift
  masked to its low ``64 - k`` bits. Constants >= 2**63 are passed as their signed equivalents.
* numba sums the per-word terms mod 2**64 (serially or from per-block partials); addition mod 2**64 does
  not depend on order, so a parallel ``sum`` over wrapped ``int64`` gives the same total.
* 8-byte words are read by reinterpreting bytes as ``int64`` (little-endian, like numba's ``uint64``
  views of the same buffers), or, where a view is impossible (a plane at an odd offset on a device),
  assembled from the bytes with shifts.

Where host reads happen (each one a device synchronisation on a GPU):

* ``checksum64``, ``encode_planes_*`` and ``merge_planes_checked`` return Python ints (the protocol);
  ``checksum64_tensor`` returns a 0-d ``int64`` tensor (the uint64 bits) without a sync.
* ``gather_blocks`` / ``scatter_blocks`` read the number of values they move (it sizes an index tensor).
* The entropy stage (``ans_encode_into`` / ``ans_decode``) is the project's numba rANS on host arrays
  (``ciera_runtime.rans``): same stream format and bytes; device tensors are copied to and from host.

Arguments may be numpy arrays or tensors. numpy arrays are viewed with ``torch.from_numpy`` (zero copy), so
results written into ``*_out`` arguments and state arrays (``hash_cache``, ``last_exp``) land in the caller's
buffers; values are computed on ``self.device`` and copied into outputs that live elsewhere.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ciera_runtime import kernels
from ciera_runtime.backend import default_codec_threads

_U64 = 1 << 64


def _signed64(value: int) -> int:
    """The int64 with the same 64 bits as the uint64 ``value``."""
    value = int(value) % _U64
    return value - _U64 if value >= 1 << 63 else value


_GOLDEN_GAMMA = _signed64(kernels._GOLDEN_GAMMA)
_MIX_MUL_1 = _signed64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _signed64(0x94D049BB133111EB)
_HASH_SEED_A = _signed64(kernels.HASH_SEED_A)
_HASH_SEED_B = _signed64(kernels.HASH_SEED_B)
_CHECKSUM_SEED = _signed64(kernels.CHECKSUM_SEED)

# torch dtypes without (portable) arithmetic, read through a signed view of the same width.
_SIGNED_VIEW: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
for _name, _signed in (("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64)):
    if hasattr(torch, _name):
        _SIGNED_VIEW[getattr(torch, _name)] = _signed
_NUMPY_SIGNED_VIEW = {
    np.dtype(np.uint16): np.int16,
    np.dtype(np.float16): np.int16,
    np.dtype(np.uint32): np.int32,
    np.dtype(np.uint64): np.int64,
}


def _lsr64(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed ints)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bit patterns (``kernels._mix64``)."""
    z = (z ^ _lsr64(z, 30)) * _MIX_MUL_1
    z = (z ^ _lsr64(z, 27)) * _MIX_MUL_2
    return z ^ _lsr64(z, 31)


def _as_tensor(array) -> torch.Tensor:
    """``array`` as a tensor sharing its memory, unsigned/float 16-64-bit types as signed views."""
    if isinstance(array, torch.Tensor):
        tensor = array.detach()
        signed = _SIGNED_VIEW.get(tensor.dtype)
        return tensor.view(signed) if signed is not None else tensor
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    signed_np = _NUMPY_SIGNED_VIEW.get(array.dtype)
    if signed_np is not None:
        array = array.view(signed_np)
    if array.flags.writeable:
        return torch.from_numpy(array)
    # Read-only inputs (a payload received as bytes) are only read: silence torch's warning about them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _le_words(plane: torch.Tensor) -> torch.Tensor:
    """int64 little-endian words of a 1-D uint8 tensor whose length is a multiple of 8."""
    try:
        if plane.data_ptr() % 8 == 0:
            return plane.view(torch.int64)
    except RuntimeError:  # storage offset not a multiple of 8: no int64 view
        pass
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=plane.device)
    # The bytes occupy disjoint bits, so their sum is their OR (the top byte wraps into the sign bit).
    return (plane.reshape(-1, 8).to(torch.int64) << shifts).sum(dim=1)


def _checksum_terms(words: torch.Tensor, first_word: int) -> torch.Tensor:
    """Σ mix64((seed + (j + 1)·γ) ^ w_j) over words j = first_word, first_word + 1, ... (int64, wrapping)."""
    index = torch.arange(
        first_word + 1, first_word + 1 + words.numel(), dtype=torch.int64, device=words.device
    )
    return _mix64((index * _GOLDEN_GAMMA + _CHECKSUM_SEED) ^ words).sum()


def _to_int16_patterns(values: torch.Tensor) -> torch.Tensor:
    """int32 holding 16-bit patterns (any higher bits dropped) -> int16 with the same low 16 bits."""
    values = values & 0xFFFF
    return (values - ((values & 0x8000) << 1)).to(torch.int16)


class TorchBackend:
    """Codec backend in torch tensor ops on ``device``; the rANS entropy stage runs on host (see module)."""

    name = "torch"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        import numba

        from ciera_runtime import rans

        self.device = torch.device(device)
        self._rans = rans
        self._numba = numba
        # The host rANS runs numba parallel regions: start numba's pool now, keeping torch's thread count
        # (see kernels.start_thread_pool), and cap its threads per rank like CpuBackend does.
        kernels.start_thread_pool()
        threads, self.threads_basis = default_codec_threads()
        self.threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))

    # ---- argument handling -------------------------------------------------------------------------

    def _input(self, array) -> torch.Tensor:
        """A read-only argument as a tensor on this backend's device (zero copy when already there)."""
        tensor = _as_tensor(array)
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def _exponents(self, patterns: torch.Tensor, exp_shift: int, exp_mask: int) -> torch.Tensor:
        return ((patterns >> exp_shift) & (exp_mask & 0xFF)).to(torch.uint8)

    def _patterns(self, bits) -> torch.Tensor:
        """The 16-bit patterns as int32 in [0, 2**16), 1-D."""
        return self._input(bits).reshape(-1).to(torch.int32) & 0xFFFF

    # ---- planes ------------------------------------------------------------------------------------

    def _sign_mantissa(self, patterns: torch.Tensor, is_fp16: bool) -> torch.Tensor:
        """The sign+mantissa plane (``kernels.pack_sign_mantissa``) as a new uint8 tensor."""
        numel = patterns.numel()
        if not is_fp16:
            return (((patterns >> 8) & 0x80) | (patterns & 0x7F)).to(torch.uint8)
        plane = torch.empty(kernels.sign_mantissa_bytes(numel, True), dtype=torch.uint8, device=self.device)
        plane[:numel] = (patterns & 0xFF).to(torch.uint8)
        groups = (numel + 7) // 8
        # 3-bit field sign << 2 | mantissa >> 8 per value; value j of a group of 8 at bit 3j of 24 bits.
        fields = torch.zeros(groups * 8, dtype=torch.int32, device=self.device)
        fields[:numel] = ((patterns >> 13) & 0x4) | ((patterns >> 8) & 0x3)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=self.device)
        packed = (fields.view(groups, 8) << shifts).sum(dim=1)  # disjoint bits: sum == OR
        group_bytes = torch.stack([packed & 0xFF, (packed >> 8) & 0xFF, (packed >> 16) & 0xFF], dim=1)
        # A partial last group owns only ceil(3 * count / 8) bytes: the plane ends there.
        plane[numel:] = group_bytes.reshape(-1)[: plane.numel() - numel].to(torch.uint8)
        return plane

    def _checked_sm_out(self, numel: int, is_fp16: bool, sm_out) -> torch.Tensor:
        """``sm_out`` as a tensor, checked like ``kernels._check_sm_out``."""
        expected = kernels.sign_mantissa_bytes(numel, is_fp16)
        out = _as_tensor(sm_out)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != expected:
            raise ValueError(
                f"sm_out must be a uint8 array of {expected} bytes, got {out.dtype} {tuple(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError("sm_out must be contiguous")
        return out

    def extract_exponents(self, bits, exp_shift: int, exp_mask: int, exp_out) -> None:
        patterns = self._patterns(bits)
        _as_tensor(exp_out)[: patterns.numel()].copy_(self._exponents(patterns, exp_shift, exp_mask))

    def pack_sign_mantissa(self, bits, is_fp16: bool, out) -> None:
        plane = self._sign_mantissa(self._patterns(bits), bool(is_fp16))
        out_tensor = _as_tensor(out)
        if out_tensor.numel() < plane.numel():
            raise ValueError(f"out holds {out_tensor.numel()} bytes, the plane takes {plane.numel()}")
        out_tensor[: plane.numel()].copy_(plane)

    def merge_planes_checked(self, exp, sign_mantissa, exp_shift: int, is_fp16: bool, out) -> int:
        """``kernels.merge_planes`` into ``out``; returns ``checksum64(sign_mantissa)`` (host read)."""
        return self._unsigned(self.merge_planes_checked_tensor(exp, sign_mantissa, exp_shift, is_fp16, out))

    def merge_planes_checked_tensor(
        self, exp, sign_mantissa, exp_shift: int, is_fp16: bool, out
    ) -> torch.Tensor:
        """``merge_planes_checked`` with the checksum as a 0-d int64 tensor (no host sync)."""
        out_tensor = _as_tensor(out)
        exp_t, sm = self._input(exp), self._input(sign_mantissa)
        numel = out_tensor.numel()
        if exp_t.numel() != numel or sm.numel() != kernels.sign_mantissa_bytes(numel, is_fp16):
            raise ValueError(
                f"planes of {exp_t.numel()} and {sm.numel()} bytes do not fit {numel} values (fp16={is_fp16})"
            )
        exp32 = exp_t.reshape(-1).to(torch.int32)
        low = sm[:numel].to(torch.int32)
        if is_fp16:
            values = (exp32 << exp_shift) | low
            groups = (numel + 7) // 8
            tail = torch.zeros(groups * 3, dtype=torch.int32, device=self.device)
            tail[: sm.numel() - numel] = sm[numel:].to(torch.int32)  # missing bytes of a partial group: 0
            tail = tail.view(groups, 3)
            packed = tail[:, 0] | (tail[:, 1] << 8) | (tail[:, 2] << 16)
            shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=self.device)
            high = ((packed.unsqueeze(1) >> shifts) & 0x7).reshape(-1)[:numel]
            values = values | ((high & 0x4) << 13) | ((high & 0x3) << 8)
        else:
            values = ((low & 0x80) << 8) | (exp32 << exp_shift) | (low & 0x7F)
        # numba stores into uint16: bits above 16 (only from out-of-range exponent bytes) are dropped.
        out_tensor.view(-1).copy_(_to_int16_patterns(values))  # view: never a copy
        return self.checksum64_tensor(sm)

    # ---- change detection --------------------------------------------------------------------------

    def _block_hashes(self, exp: torch.Tensor, block_size: int) -> torch.Tensor:
        """(n_blocks, 2) int64: ``kernels._block_words_hash`` of every block, streams A and B.

        Word j of a block holds its exponent bytes 8j .. 8j+7 (little-endian; past the block's end: 0);
        term j of a stream is mix64((seed + (j + 1)·γ) ^ word_j); each stream is mix64(Σ terms ^ length)."""
        numel = exp.numel()
        n_blocks = (numel + block_size - 1) // block_size
        words_per_block = (block_size + 7) // 8
        full_blocks, last_len = divmod(numel, block_size)
        row_bytes = 8 * words_per_block
        if row_bytes == block_size and last_len == 0:
            rows = exp.reshape(n_blocks, row_bytes)
        else:  # rows padded with zero bytes to whole words, the partial last block too
            rows = torch.zeros(n_blocks, row_bytes, dtype=torch.uint8, device=self.device)
            rows[:full_blocks, :block_size] = exp[: full_blocks * block_size].view(full_blocks, block_size)
            if last_len:
                rows[full_blocks, :last_len] = exp[full_blocks * block_size :]
        words = _le_words(rows.reshape(-1)).view(n_blocks, 1, words_per_block)
        seeds = torch.tensor([[_HASH_SEED_A], [_HASH_SEED_B]], dtype=torch.int64, device=self.device)
        index = torch.arange(1, words_per_block + 1, dtype=torch.int64, device=self.device)
        terms = _mix64((seeds + index * _GOLDEN_GAMMA) ^ words)  # (n_blocks, 2, words_per_block)
        if last_len:  # the partial last block has only ceil(last_len / 8) words
            terms[full_blocks, :, (last_len + 7) // 8 :] = 0
        lengths = torch.full((n_blocks, 1), block_size, dtype=torch.int64, device=self.device)
        if last_len:
            lengths[full_blocks] = last_len
        return _mix64(terms.sum(dim=2) ^ lengths)

    def _blocks_any(self, flags: torch.Tensor, block_size: int) -> torch.Tensor:
        """Per block: whether any of its values' ``flags`` is set."""
        numel = flags.numel()
        n_blocks = (numel + block_size - 1) // block_size
        padded = torch.zeros(n_blocks * block_size, dtype=torch.bool, device=self.device)
        padded[:numel] = flags
        return padded.view(n_blocks, block_size).any(dim=1)

    def _check_blocks(self, numel: int, block_size: int, changed_out: torch.Tensor) -> None:
        n_blocks = (numel + block_size - 1) // block_size
        if changed_out.numel() != n_blocks:
            raise ValueError(
                f"changed_out holds {changed_out.numel()} flags, {numel} values make {n_blocks} blocks"
            )

    def encode_planes_hash(self, *args) -> int:
        """``kernels.encode_planes_hash``: returns ``checksum64(sm_out)`` (host read); the arguments of ``encode_planes_hash_tensor``."""
        return self._unsigned(self.encode_planes_hash_tensor(*args))

    def encode_planes_hash_tensor(
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
    ) -> torch.Tensor:
        """``encode_planes_hash`` with the checksum as a 0-d int64 tensor (no host sync)."""
        patterns = self._patterns(bits)
        sm_tensor = self._checked_sm_out(patterns.numel(), bool(is_fp16), sm_out)
        changed_tensor = _as_tensor(changed_out)
        self._check_blocks(patterns.numel(), block_size, changed_tensor)
        cache_tensor = _as_tensor(hash_cache)
        exp = self._exponents(patterns, exp_shift, exp_mask)
        hashes = self._block_hashes(exp, block_size)
        changed = (hashes != cache_tensor.to(self.device)).any(dim=1) | bool(force_all)
        # numba stores the new hash only for changed blocks; an unchanged block's hash equals the cached
        # one, so storing every hash leaves the same cache.
        cache_tensor.copy_(hashes)
        return self._store_planes(patterns, exp, changed, changed_tensor, exp_out, sm_tensor, is_fp16)

    def encode_planes_exact(self, *args) -> int:
        """``kernels.encode_planes_exact``: returns ``checksum64(sm_out)`` (host read); the arguments of ``encode_planes_exact_tensor``."""
        return self._unsigned(self.encode_planes_exact_tensor(*args))

    def encode_planes_exact_tensor(
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
    ) -> torch.Tensor:
        """``encode_planes_exact`` with the checksum as a 0-d int64 tensor (no host sync)."""
        patterns = self._patterns(bits)
        numel = patterns.numel()
        sm_tensor = self._checked_sm_out(numel, bool(is_fp16), sm_out)
        changed_tensor = _as_tensor(changed_out)
        self._check_blocks(numel, block_size, changed_tensor)
        last_tensor = _as_tensor(last_exp)
        exp = self._exponents(patterns, exp_shift, exp_mask)
        differs = exp != last_tensor[:numel].to(self.device)
        changed = self._blocks_any(differs, block_size) | bool(force_all)
        # numba copies a block into last_exp when it changed (or force_all); an unchanged block already
        # equals it, so copying the whole plane leaves the same state.
        last_tensor[:numel].copy_(exp)
        return self._store_planes(patterns, exp, changed, changed_tensor, exp_out, sm_tensor, is_fp16)

    def _store_planes(self, patterns, exp, changed, changed_out, exp_out, sm_out, is_fp16) -> torch.Tensor:
        """What both encode passes write: change flags, exponent plane, sign+mantissa plane; returns the
        plane's checksum as a 0-d tensor."""
        changed_out.copy_(changed)
        _as_tensor(exp_out)[: exp.numel()].copy_(exp)
        plane = self._sign_mantissa(patterns, bool(is_fp16))
        sm_out.copy_(plane)
        return self.checksum64_tensor(plane)

    # ---- block gather / scatter --------------------------------------------------------------------

    def _block_runs(
        self, numel: int, changed_blocks, block_offsets, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Element indices of the changed blocks in the plane and at their offsets in the packed array."""
        blocks = self._input(changed_blocks).reshape(-1).to(torch.int64)
        offsets = self._input(block_offsets).reshape(-1).to(torch.int64)
        starts = blocks * block_size
        # As numba's slices: a block runs to min(start + block_size, numel), none past the end.
        lengths = (numel - starts).clamp(min=0, max=block_size)
        # Host read: the number of values moved sizes the index tensors.
        total = int(lengths.sum())
        which = torch.repeat_interleave(lengths, output_size=total)
        within = (
            torch.arange(total, dtype=torch.int64, device=self.device) - (lengths.cumsum(0) - lengths)[which]
        )
        return starts[which] + within, offsets[which] + within

    def gather_blocks(self, exp, changed_blocks, block_offsets, block_size: int, out) -> None:
        exp_t = self._input(exp).reshape(-1)
        plane_index, packed_index = self._block_runs(exp_t.numel(), changed_blocks, block_offsets, block_size)
        out_tensor = _as_tensor(out)
        out_tensor[packed_index.to(out_tensor.device)] = exp_t[plane_index].to(out_tensor.device)

    def scatter_blocks(self, packed, changed_blocks, block_offsets, block_size: int, exp) -> None:
        exp_tensor = _as_tensor(exp)
        plane_index, packed_index = self._block_runs(
            exp_tensor.numel(), changed_blocks, block_offsets, block_size
        )
        values = self._input(packed).reshape(-1)[packed_index]
        exp_tensor[plane_index.to(exp_tensor.device)] = values.to(exp_tensor.device)

    # ---- checksum ----------------------------------------------------------------------------------

    def checksum64_tensor(self, plane) -> torch.Tensor:
        """``kernels.checksum64`` as a 0-d int64 tensor holding the uint64's bits; no host sync.

        mix64(Σ_j mix64((seed + (j + 1)·γ) ^ w_j) ^ n_bytes), w_j the little-endian words of the plane,
        the partial last word zero-filled."""
        data = self._input(plane).reshape(-1)
        n_bytes = data.numel()
        whole = n_bytes - n_bytes % 8
        total = _checksum_terms(_le_words(data[:whole]), 0)
        if whole < n_bytes:
            last = torch.zeros(8, dtype=torch.uint8, device=self.device)
            last[: n_bytes - whole] = data[whole:]
            total = total + _checksum_terms(last.view(torch.int64), whole // 8)
        return _mix64(total ^ n_bytes)

    def checksum64(self, plane) -> int:
        """``kernels.checksum64`` (a host read on a GPU; see ``checksum64_tensor``)."""
        return self._unsigned(self.checksum64_tensor(plane))

    @staticmethod
    def _unsigned(value: torch.Tensor) -> int:
        """The uint64 whose bits a 0-d int64 tensor holds (``.item()``: a device sync on a GPU)."""
        return int(value.item()) % _U64

    # ---- entropy stage: the project's rANS on host arrays ------------------------------------------

    def _cap_threads(self) -> None:
        if self._numba.get_num_threads() > self.threads:
            self._numba.set_num_threads(self.threads)

    @staticmethod
    def _host_array(array) -> np.ndarray:
        if isinstance(array, torch.Tensor):
            return _as_tensor(array).cpu().numpy()
        if isinstance(array, np.ndarray):
            return array
        return np.frombuffer(array, dtype=np.uint8)

    def ans_encode_into(self, data, out) -> int:
        """``rans.encode_into`` on host: same stream bytes as CpuBackend; -1 when it does not fit."""
        self._cap_threads()
        data_host = self._host_array(data)
        if isinstance(out, np.ndarray) or out.device.type == "cpu":
            return int(self._rans.encode_into(data_host, self._host_array(out)))
        staging = np.empty(out.numel(), dtype=np.uint8)
        length = int(self._rans.encode_into(data_host, staging))
        if length > 0:
            out[:length].copy_(torch.from_numpy(staging[:length]))
        return length

    def ans_decode(self, stream, out) -> None:
        """``rans.decode`` on host (raises ``rans.RansFormatError`` on a corrupted stream)."""
        self._cap_threads()
        stream_host = self._host_array(stream)
        if isinstance(out, np.ndarray) or out.device.type == "cpu":
            self._rans.decode(stream_host, self._host_array(out))
            return
        staging = np.empty(out.numel(), dtype=np.uint8)
        self._rans.decode(stream_host, staging)
        out.copy_(torch.from_numpy(staging).view(out.shape))
