"""numba CPU kernels of the codec: plane split/merge, block change detection, block gather/scatter.

All kernels work on the raw 16-bit patterns (``uint16``) so NaN payloads, infinities, subnormals and
signed zeros pass through untouched.  Element-wise kernels are plain whole-array loops that LLVM
vectorises; per-block kernels (gather, scatter) run blocks in parallel with ``prange``; change detection
(extraction fused with hash or compare) has a serial and a ``prange`` variant, chosen per call by measured
speed (see ``_AdaptiveChoice``). Loops index slices from 0 so numba's negative-index wraparound checks
disappear and LLVM can vectorise them.
``cache=True`` keeps the start-up cost to one compile per machine, and ``nogil=True`` lets the
CCP worker thread encode while the main thread decodes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from numba import njit, prange

# Bit layout of the two supported formats: exponent shift and mask inside the 16-bit pattern.
BF16_EXP_SHIFT, BF16_EXP_MASK = 7, 0xFF
FP16_EXP_SHIFT, FP16_EXP_MASK = 10, 0x1F

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# Two unrelated seeds: the two SplitMix64 streams that make up the 128-bit block hash.
HASH_SEED_A = np.uint64(0x243F6A8885A308D3)
HASH_SEED_B = np.uint64(0x13198A2E03707344)


@njit(inline="always")
def _mix64(z):
    """SplitMix64's output function (a bijection of uint64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def extract_exponents(bits, exp_shift, exp_mask, exp_out):
    """Exponent plane. A plain loop over the whole array: LLVM vectorises it (index provably >= 0),
    which beats a prange split by far on small core counts."""
    for i in range(bits.size):
        exp_out[i] = (bits[i] >> exp_shift) & exp_mask


@njit(inline="always")
def _block_words_hash(exp, exp_words, start, stop, seed_a, seed_b):
    """128-bit block hash: two SplitMix64 streams over the block's exponent bytes, 8 at a time.

    Word j (little-endian bytes start+8j .. start+8j+7, the partial last word zero-filled) is xored into
    the j-th state of each stream, ``s_j = seed + (j + 1) * golden_gamma``, and mixed by SplitMix64's
    output function; each stream sums its terms (mod 2**64) and mixes the sum with the block length.
    The terms are independent of each other, so the multiplies of many words overlap (no serial chain).
    """
    acc_a = np.uint64(0)
    acc_b = np.uint64(0)
    state_a = seed_a
    state_b = seed_b
    i = start
    if start % 8 == 0:
        block_words = exp_words[start // 8 : stop // 8]
        for word_index in range(block_words.size):
            word = block_words[word_index]
            state_a += _GOLDEN_GAMMA
            state_b += _GOLDEN_GAMMA
            acc_a += _mix64(state_a ^ word)
            acc_b += _mix64(state_b ^ word)
        i = (stop // 8) * 8
    word = np.uint64(0)
    filled = 0
    while i < stop:
        word |= np.uint64(exp[i]) << np.uint64(8 * filled)
        filled += 1
        i += 1
        if filled == 8 or i == stop:
            state_a += _GOLDEN_GAMMA
            state_b += _GOLDEN_GAMMA
            acc_a += _mix64(state_a ^ word)
            acc_b += _mix64(state_b ^ word)
            word = np.uint64(0)
            filled = 0
    length = np.uint64(stop - start)
    return _mix64(acc_a ^ length), _mix64(acc_b ^ length)


@njit(inline="always")
def _extract_hash_block(bits, exp_shift, exp_mask, exp, exp_words, start, stop, seed_a, seed_b):
    """Write the block's exponents into ``exp`` and return their 128-bit hash. The copy loop runs over
    slices so its index is provably non-negative (no wraparound check) and LLVM vectorises it."""
    block_exp = exp[start:stop]
    block_bits = bits[start:stop]
    for i in range(block_bits.size):
        block_exp[i] = (block_bits[i] >> exp_shift) & exp_mask
    return _block_words_hash(exp, exp_words, start, stop, seed_a, seed_b)


@njit(inline="always")
def _hash_one_block(
    bits, exp_shift, exp_mask, exp, exp_words, block_size, hash_cache, changed_out, force_all, block
):
    start = block * block_size
    stop = min(start + block_size, bits.size)
    hash_a, hash_b = _extract_hash_block(
        bits, exp_shift, exp_mask, exp, exp_words, start, stop, HASH_SEED_A, HASH_SEED_B
    )
    changed = force_all or hash_cache[block, 0] != hash_a or hash_cache[block, 1] != hash_b
    if changed:
        hash_cache[block, 0] = hash_a
        hash_cache[block, 1] = hash_b
    changed_out[block] = changed


@njit(parallel=True, cache=True, nogil=True)
def extract_and_hash_blocks(
    bits, exp_shift, exp_mask, exp, exp_words, block_size, hash_cache, changed_out, force_all
):
    """``extract_exponents`` and the block hash fused per block: one pass over the shard, blocks on all
    of numba's threads."""
    for block in prange(changed_out.size):
        _hash_one_block(
            bits, exp_shift, exp_mask, exp, exp_words, block_size, hash_cache, changed_out, force_all, block
        )


@njit(cache=True, nogil=True)
def extract_and_hash_blocks_serial(
    bits, exp_shift, exp_mask, exp, exp_words, block_size, hash_cache, changed_out, force_all
):
    """Single-threaded ``extract_and_hash_blocks`` (see ``use_parallel_detect``)."""
    for block in range(changed_out.size):
        _hash_one_block(
            bits, exp_shift, exp_mask, exp, exp_words, block_size, hash_cache, changed_out, force_all, block
        )


@njit(inline="always")
def _compare_and_update(exp, exp_words, last_exp, last_words, start, stop, force_all):
    """Whether the block's exponents differ from ``last_exp`` (word by word where aligned); if so, or if
    ``force_all``, copy them into ``last_exp``."""
    changed = force_all
    i = start
    if start % 8 == 0 and not changed:
        block_words = exp_words[start // 8 : stop // 8]
        block_last = last_words[start // 8 : stop // 8]
        for k in range(block_words.size):
            if block_words[k] != block_last[k]:
                changed = True
                break
        i = (stop // 8) * 8
    if not changed:
        for k in range(i, stop):
            if exp[k] != last_exp[k]:
                changed = True
                break
    if changed:
        block_exp = exp[start:stop]
        block_last_exp = last_exp[start:stop]
        for k in range(block_exp.size):
            block_last_exp[k] = block_exp[k]
    return changed


@njit(inline="always")
def _compare_one_block(
    bits, exp_shift, exp_mask, exp, exp_words, last_exp, last_words, block_size, changed_out, force_all, block
):
    start = block * block_size
    stop = min(start + block_size, bits.size)
    block_exp = exp[start:stop]
    block_bits = bits[start:stop]
    for i in range(block_bits.size):
        block_exp[i] = (block_bits[i] >> exp_shift) & exp_mask
    changed_out[block] = _compare_and_update(exp, exp_words, last_exp, last_words, start, stop, force_all)


@njit(parallel=True, cache=True, nogil=True)
def extract_and_compare_blocks(
    bits, exp_shift, exp_mask, exp, exp_words, last_exp, last_words, block_size, changed_out, force_all
):
    """Exponent plane into ``exp`` and flag blocks that differ from ``last_exp`` (updated in place),
    fused per block, blocks on all of numba's threads."""
    for block in prange(changed_out.size):
        _compare_one_block(
            bits,
            exp_shift,
            exp_mask,
            exp,
            exp_words,
            last_exp,
            last_words,
            block_size,
            changed_out,
            force_all,
            block,
        )


@njit(cache=True, nogil=True)
def extract_and_compare_blocks_serial(
    bits, exp_shift, exp_mask, exp, exp_words, last_exp, last_words, block_size, changed_out, force_all
):
    """Single-threaded ``extract_and_compare_blocks``."""
    for block in range(changed_out.size):
        _compare_one_block(
            bits,
            exp_shift,
            exp_mask,
            exp,
            exp_words,
            last_exp,
            last_words,
            block_size,
            changed_out,
            force_all,
            block,
        )


# Serial or parallel detection. A parallel region ends only when every numba thread has checked in, so
# on a shared or oversubscribed machine (other jobs, 2 ranks on 2 cores, the CCP worker next to the main
# thread) it waits for a thread the OS has not scheduled yet. Measured here, 8 Mi values, 2 cores:
# idle-ish, 2 threads 8.7 GB/s vs serial 5.0; loaded (load average 3.4), 2 threads 2.1 vs serial 4.5.
# Neither is right everywhere, so by default each detector picks, per call, the variant with the lower
# recently measured time per value (exponential average), and re-tries the other one every
# PROBE_EVERY calls. Shards under PARALLEL_MIN_VALUES always run serially (one region costs more).
PROBE_EVERY = 16
PARALLEL_MIN_VALUES = 1 << 16
_parallel_detect: bool | None = None  # None: adaptive; True/False: forced


@njit(parallel=True, cache=True, nogil=True)
def _touch_threads(out):
    for i in prange(out.size):
        out[i] = i


_pool_started = False


def start_thread_pool() -> None:
    """Start numba's thread pool now, keeping torch's thread count.

    With the OpenMP threading layer, the first parallel region of a process sets OpenMP's thread count
    for the process, which torch shares: ``torch.set_num_threads(1)`` read 2 after the first gather, torch's
    matmuls then summed in a different order, and training with CIERA stopped matching the plain engine
    bit for bit. Later regions leave it alone, so starting the pool once, here, and putting torch's count
    back is enough (the codec backend does this when it is created)."""
    global _pool_started
    if _pool_started:
        return
    import sys

    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    _touch_threads(np.empty(2, dtype=np.int64))
    _pool_started = True
    if torch is not None and torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def use_parallel_detect(enabled: bool | None) -> None:
    """Force the parallel (True) or serial (False) detection kernels; None restores the adaptive choice."""
    global _parallel_detect
    _parallel_detect = enabled


class _AdaptiveChoice:
    """Chooses serial vs parallel detection from measured seconds per value (one per calling thread)."""

    def __init__(self) -> None:
        self.cost: dict[tuple[str, bool], float] = {}
        self.warm: set[tuple[str, bool]] = set()
        self.calls = 0

    def choose(self, kind: str, numel: int) -> bool:
        if _parallel_detect is not None:
            return _parallel_detect
        import numba

        if numel < PARALLEL_MIN_VALUES or numba.get_num_threads() < 2:
            return False
        self.calls += 1
        serial, parallel = self.cost.get((kind, False)), self.cost.get((kind, True))
        if serial is None or parallel is None:
            return serial is not None  # measure serial first, then parallel
        prefer_parallel = parallel < serial
        return not prefer_parallel if self.calls % PROBE_EVERY == 0 else prefer_parallel

    def record(self, kind: str, parallel: bool, numel: int, seconds: float) -> None:
        if _parallel_detect is not None or numel < PARALLEL_MIN_VALUES:
            return
        key = (kind, parallel)
        if key not in self.warm:  # the first call loads the kernel (and starts the thread pool)
            self.warm.add(key)
            return
        per_value = seconds / numel
        old = self.cost.get(key)
        self.cost[key] = per_value if old is None else 0.75 * old + 0.25 * per_value


class _PerThreadChoice(threading.local):
    """One estimate per calling thread: the CCP worker (1 numba thread, next to a busy main thread) and
    the main thread see different costs and must not steer each other's choice."""

    def __init__(self) -> None:
        self.choice = _AdaptiveChoice()


_per_thread = _PerThreadChoice()


class _ChoiceProxy:
    def choose(self, kind: str, numel: int) -> bool:
        return _per_thread.choice.choose(kind, numel)

    def record(self, kind: str, parallel: bool, numel: int, seconds: float) -> None:
        _per_thread.choice.record(kind, parallel, numel, seconds)


_choice = _ChoiceProxy()


# Seed of the payload checksum over the sign+mantissa plane (unrelated to the block-hash seeds).
CHECKSUM_SEED = np.uint64(0x452821E638D01377)


@njit(cache=True, nogil=True)
def _checksum_words(words, tail_word, has_tail, n_bytes, seed):
    """Position-keyed SplitMix64 sum: Σ_j mix64((seed + (j+1)·γ) ^ w_j), finished with the length.
    mix64 is a bijection and the sum is mod 2^64, so any change confined to one word changes the result;
    terms are independent, so the loop has no carried multiply chain (it runs near the hash's speed)."""
    total = np.uint64(0)
    key = seed
    for j in range(words.size):
        key += _GOLDEN_GAMMA
        total += _mix64(key ^ words[j])
    if has_tail:
        key += _GOLDEN_GAMMA
        total += _mix64(key ^ tail_word)
    return _mix64(total ^ np.uint64(n_bytes))


def checksum64(plane: np.ndarray) -> int:
    """64-bit checksum of a contiguous uint8 array (the payload's sign+mantissa plane)."""
    words = words_view(plane)
    tail = plane[words.size * 8 :]
    tail_word = int.from_bytes(tail.tobytes(), "little") if tail.size else 0
    return int(_checksum_words(words, np.uint64(tail_word), tail.size > 0, plane.size, CHECKSUM_SEED))


def words_view(plane: np.ndarray) -> np.ndarray:
    """uint64 view of the first floor(n/8)*8 bytes of a contiguous uint8 plane."""
    return plane[: plane.size - plane.size % 8].view(np.uint64)


def detect_changes_hash(bits, exp_shift, exp_mask, block_size, hash_cache, exp_out, changed_out, force_all):
    """Exponent plane into ``exp_out``, then flag blocks whose 128-bit hash changed (updating the cache)."""
    parallel = _choice.choose("hash", bits.size)
    kernel = extract_and_hash_blocks if parallel else extract_and_hash_blocks_serial
    start_s = time.perf_counter()
    kernel(
        bits,
        exp_shift,
        exp_mask,
        exp_out,
        words_view(exp_out),
        block_size,
        hash_cache,
        changed_out,
        force_all,
    )
    _choice.record("hash", parallel, bits.size, time.perf_counter() - start_s)


def detect_changes_exact(bits, exp_shift, exp_mask, block_size, exp_out, last_exp, changed_out, force_all):
    """Exponent plane into ``exp_out``, then flag blocks that differ from ``last_exp`` (updated in place)."""
    parallel = _choice.choose("exact", bits.size)
    kernel = extract_and_compare_blocks if parallel else extract_and_compare_blocks_serial
    start_s = time.perf_counter()
    kernel(
        bits,
        exp_shift,
        exp_mask,
        exp_out,
        words_view(exp_out),
        last_exp,
        words_view(last_exp),
        block_size,
        changed_out,
        force_all,
    )
    _choice.record("exact", parallel, bits.size, time.perf_counter() - start_s)


def sign_mantissa_bytes(numel: int, is_fp16: bool) -> int:
    """Size of the sign+mantissa plane: BF16 1 byte/value; FP16 1 byte + 3 bit-packed bits per value."""
    if not is_fp16:
        return numel
    return numel + (3 * numel + 7) // 8


@njit(cache=True, nogil=True)
def pack_sign_mantissa(bits, is_fp16, out):
    """Write the sign+mantissa plane (vectorised whole-array loops).

    BF16: ``out[i] = sign << 7 | mantissa7``.
    FP16: ``out[:n]`` holds the low 8 mantissa bits; then for every group of 8 values the 3-bit fields
    ``sign << 2 | mantissa >> 8`` are packed little-endian into 3 bytes (value j of the group at bit 3j).
    """
    numel = bits.size
    if not is_fp16:
        for i in range(numel):
            value = bits[i]
            out[i] = ((value >> 8) & 0x80) | (value & 0x7F)
        return
    for i in range(numel):
        out[i] = bits[i] & 0xFF
    plane_end = numel + (3 * numel + 7) // 8
    for group in range((numel + 7) // 8):
        packed = 0
        base = group * 8
        for j in range(min(8, numel - base)):
            value = bits[base + j]
            packed |= np.int64(((value >> 13) & 0x4) | ((value >> 8) & 0x3)) << (3 * j)
        # A partial last group owns only ceil(3 * count / 8) bytes: never write past the plane.
        for k in range(min(3, plane_end - numel - 3 * group)):
            out[numel + 3 * group + k] = (packed >> (8 * k)) & 0xFF


@njit(cache=True, nogil=True)
def merge_planes(exp, sign_mantissa, exp_shift, is_fp16, out):
    """Inverse of the split: rebuild the 16-bit patterns from the exponent and sign+mantissa planes."""
    numel = out.size
    if not is_fp16:
        for i in range(numel):
            sm = np.int64(sign_mantissa[i])
            out[i] = ((sm & 0x80) << 8) | (np.int64(exp[i]) << exp_shift) | (sm & 0x7F)
        return
    for i in range(numel):
        out[i] = (np.int64(exp[i]) << exp_shift) | np.int64(sign_mantissa[i])
    plane_end = numel + (3 * numel + 7) // 8
    for group in range((numel + 7) // 8):
        base = group * 8
        packed = np.int64(0)
        for k in range(min(3, plane_end - numel - 3 * group)):  # partial last group: fewer bytes
            packed |= np.int64(sign_mantissa[numel + 3 * group + k]) << (8 * k)
        for j in range(min(8, numel - base)):
            high = (packed >> (3 * j)) & 0x7
            out[base + j] = np.int64(out[base + j]) | ((high & 0x4) << 13) | ((high & 0x3) << 8)


@njit(cache=True, nogil=True)
def gather_blocks(exp, changed_blocks, block_offsets, block_size, out):
    """Concatenate the exponents of ``changed_blocks``; ``block_offsets[k]`` is where block k goes in out.
    Serial: a copy is bound by memory, and entering a parallel region (~20 us) costs more than copying a
    32K-value shard."""
    numel = exp.size
    for k in range(changed_blocks.size):
        start = changed_blocks[k] * block_size
        stop = min(start + block_size, numel)
        dst = block_offsets[k]
        out[dst : dst + stop - start] = exp[start:stop]


@njit(cache=True, nogil=True)
def scatter_blocks(packed, changed_blocks, block_offsets, block_size, exp):
    """Inverse of ``gather_blocks``: write the received exponents of changed blocks into the cache."""
    numel = exp.size
    for k in range(changed_blocks.size):
        start = changed_blocks[k] * block_size
        stop = min(start + block_size, numel)
        src = block_offsets[k]
        exp[start:stop] = packed[src : src + stop - start]


@njit(cache=True, nogil=True)
def _changed_block_offsets(changed_blocks, block_size, numel):
    offsets = np.empty(changed_blocks.size, dtype=np.int64)
    total = 0
    for k in range(changed_blocks.size):
        offsets[k] = total
        total += min(block_size, numel - changed_blocks[k] * block_size)
    return offsets, total


def changed_block_offsets(changed_blocks: np.ndarray, block_size: int, numel: int) -> tuple[np.ndarray, int]:
    """Start offset of each changed block inside the packed exponent array, and the total length (only
    the shard's last block can be short). One compiled loop: every payload asks it twice."""
    offsets, total = _changed_block_offsets(changed_blocks, np.int64(block_size), np.int64(numel))
    return offsets, int(total)


# ---------------------------------------------------------------------------------------------------
# Fused passes: one pass per block does everything the payload's fixed part needs from the shard.
#
# Encode: exponent plane, change detection (hash or exact), sign+mantissa plane written straight into the
# caller's buffer (a view into the payload), and the plane's checksum64 from per-block partial sums (the
# sum is mod 2^64, so adding partials in any order gives the same total). Word j of the plane (bytes
# 8j .. 8j+7) belongs to the block in which it starts. Words inside the block are read back from the
# block's freshly written bytes (in L1); a word that starts in the block and runs into the next one is
# rebuilt from the input patterns, because another thread may not have written the next block yet. Words
# at or after byte n -- BF16's partial last word, FP16's packed tail -- are summed once every block is
# written (FP16's tail is 3n/8 bytes; its words do not line up with the blocks).
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _checksum_term(j, word):
    """Term of word j of the checksum: mix64((seed + (j + 1)·γ) ^ w_j)."""
    return _mix64((CHECKSUM_SEED + np.uint64(j + 1) * _GOLDEN_GAMMA) ^ word)


@njit(inline="always")
def _checksum_word_run(words, j0, j1):
    """Σ of the terms of words[j0:j1] (a vectorised loop: the key is an induction variable)."""
    run = words[j0:j1]
    total = np.uint64(0)
    key = CHECKSUM_SEED + np.uint64(j0) * _GOLDEN_GAMMA
    for k in range(run.size):
        key += _GOLDEN_GAMMA
        total += _mix64(key ^ run[k])
    return total


@njit(inline="always")
def _sm_low_byte(value, is_fp16):
    """Byte i < n of the sign+mantissa plane, from pattern i."""
    if is_fp16:
        return np.uint64(value & 0xFF)
    return np.uint64(((value >> 8) & 0x80) | (value & 0x7F))


@njit(inline="always")
def _fp16_group_bits(bits, base):
    """The packed 3-bit fields ``sign << 2 | mantissa >> 8`` of the values base .. base+7 (or fewer)."""
    packed = np.int64(0)
    for j in range(min(8, bits.size - base)):
        value = bits[base + j]
        packed |= np.int64(((value >> 13) & 0x4) | ((value >> 8) & 0x3)) << (3 * j)
    return packed


@njit(inline="always")
def _split_block(bits, exp_shift, exp_mask, is_fp16, exp, sm, start, stop):
    """Exponents and sign+mantissa bytes of values start .. stop-1 (one vectorised loop), plus, for FP16,
    the packed groups that start in the block (groups never share a byte, so blocks never race)."""
    block_bits = bits[start:stop]
    block_exp = exp[start:stop]
    block_sm = sm[start:stop]
    if is_fp16:
        for i in range(block_bits.size):
            value = block_bits[i]
            block_exp[i] = (value >> exp_shift) & exp_mask
            block_sm[i] = value & 0xFF
        numel = bits.size
        tail = sm[numel:]
        for group in range((start + 7) // 8, (stop + 7) // 8):
            packed = _fp16_group_bits(bits, 8 * group)
            for k in range(min(3, tail.size - 3 * group)):  # a partial last group owns fewer bytes
                tail[3 * group + k] = (packed >> (8 * k)) & 0xFF
    else:
        for i in range(block_bits.size):
            value = block_bits[i]
            block_exp[i] = (value >> exp_shift) & exp_mask
            block_sm[i] = ((value >> 8) & 0x80) | (value & 0x7F)


@njit(inline="always")
def _block_checksum(bits, is_fp16, sm_words, start, stop):
    """Partial checksum of the plane words that start in [start, stop) and end by byte n."""
    numel = bits.size
    first = (start + 7) // 8
    inside_end = stop // 8  # words first .. inside_end-1 lie inside the block: read them back
    total = np.uint64(0)
    if inside_end > first:
        total = _checksum_word_run(sm_words, first, inside_end)
    straddler = stop // 8
    if stop % 8 != 0 and straddler >= first and 8 * straddler + 8 <= numel:
        word = np.uint64(0)  # runs into the next block: rebuild it from the patterns
        for t in range(8):
            word |= _sm_low_byte(bits[8 * straddler + t], is_fp16) << np.uint64(8 * t)
        total += _checksum_term(straddler, word)
    return total


@njit(inline="always")
def _checksum_tail(sm, sm_words, numel, first_word, stop_word):
    """Terms of the plane words first_word .. stop_word-1 (the last may be partial, zero-filled)."""
    full_end = min(stop_word, sm.size // 8)
    total = np.uint64(0)
    if full_end > first_word:
        total = _checksum_word_run(sm_words, first_word, full_end)
    for j in range(max(first_word, full_end), stop_word):
        word = np.uint64(0)
        for t in range(min(8, sm.size - 8 * j)):
            word |= np.uint64(sm[8 * j + t]) << np.uint64(8 * t)
        total += _checksum_term(j, word)
    return total


_TAIL_WORDS_PER_TASK = 1 << 13


@njit(inline="always")
def _finish_checksum(sm, sm_words, numel, block_partials, tail_partials, parallel):
    """Plane checksum from the block partials and the words from byte n on (FP16 tail: in parallel)."""
    first = numel // 8
    stop_word = (sm.size + 7) // 8
    n_tasks = tail_partials.size
    if parallel and n_tasks > 1:  # BF16 has no tail task; a region for one task would only cost
        for task in prange(n_tasks):
            lo = first + task * _TAIL_WORDS_PER_TASK
            hi = min(lo + _TAIL_WORDS_PER_TASK, stop_word)
            tail_partials[task] = _checksum_tail(sm, sm_words, numel, lo, hi)
    else:
        for task in range(n_tasks):
            lo = first + task * _TAIL_WORDS_PER_TASK
            hi = min(lo + _TAIL_WORDS_PER_TASK, stop_word)
            tail_partials[task] = _checksum_tail(sm, sm_words, numel, lo, hi)
    total = np.uint64(0)
    for k in range(block_partials.size):
        total += block_partials[k]
    for k in range(n_tasks):
        total += tail_partials[k]
    return _mix64(total ^ np.uint64(sm.size))


@njit(cache=True, nogil=True)
def _tail_tasks(numel: int, plane_bytes: int) -> int:
    words = (plane_bytes + 7) // 8 - numel // 8
    return (words + _TAIL_WORDS_PER_TASK - 1) // _TAIL_WORDS_PER_TASK


@njit(inline="always")
def _block_words_hash_checksum(exp_words, sm_words, start, stop):
    """``_block_words_hash`` and ``_block_checksum`` of a block whose ends are multiples of 8."""
    block_exp = exp_words[start // 8 : stop // 8]
    block_sm = sm_words[start // 8 : stop // 8]
    acc_a = np.uint64(0)
    acc_b = np.uint64(0)
    total = np.uint64(0)
    state_a = HASH_SEED_A
    state_b = HASH_SEED_B
    key = CHECKSUM_SEED + np.uint64(start // 8) * _GOLDEN_GAMMA
    for k in range(block_exp.size):
        word = block_exp[k]
        state_a += _GOLDEN_GAMMA
        state_b += _GOLDEN_GAMMA
        key += _GOLDEN_GAMMA
        acc_a += _mix64(state_a ^ word)
        acc_b += _mix64(state_b ^ word)
        total += _mix64(key ^ block_sm[k])
    length = np.uint64(stop - start)
    return _mix64(acc_a ^ length), _mix64(acc_b ^ length), total


@njit(inline="always")
def _encode_hash_block(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    hash_cache,
    exp,
    exp_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    partials,
    block,
):
    start = block * block_size
    stop = min(start + block_size, bits.size)
    _split_block(bits, exp_shift, exp_mask, is_fp16, exp, sm, start, stop)
    if start % 8 == 0 and stop % 8 == 0:
        # Word j of the block's exponents and word j of the plane cover the same 8 values: one loop
        # mixes the three terms (two hash streams, checksum) of every word.
        hash_a, hash_b, partials[block] = _block_words_hash_checksum(exp_words, sm_words, start, stop)
    else:
        hash_a, hash_b = _block_words_hash(exp, exp_words, start, stop, HASH_SEED_A, HASH_SEED_B)
        partials[block] = _block_checksum(bits, is_fp16, sm_words, start, stop)
    changed = force_all or hash_cache[block, 0] != hash_a or hash_cache[block, 1] != hash_b
    if changed:
        hash_cache[block, 0] = hash_a
        hash_cache[block, 1] = hash_b
    changed_out[block] = changed


@njit(parallel=True, cache=True, nogil=True)
def encode_planes_hash_blocks(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    hash_cache,
    exp,
    exp_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    partials,
    tail_partials,
):
    """Fused encode pass (hash detector), blocks on all of numba's threads; returns the sm checksum64."""
    for block in prange(changed_out.size):
        _encode_hash_block(
            bits,
            exp_shift,
            exp_mask,
            is_fp16,
            block_size,
            hash_cache,
            exp,
            exp_words,
            changed_out,
            force_all,
            sm,
            sm_words,
            partials,
            block,
        )
    return _finish_checksum(sm, sm_words, bits.size, partials, tail_partials, True)


@njit(cache=True, nogil=True)
def encode_planes_hash_blocks_serial(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    hash_cache,
    exp,
    exp_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    partials,
    tail_partials,
):
    """Single-threaded ``encode_planes_hash_blocks``."""
    for block in range(changed_out.size):
        _encode_hash_block(
            bits,
            exp_shift,
            exp_mask,
            is_fp16,
            block_size,
            hash_cache,
            exp,
            exp_words,
            changed_out,
            force_all,
            sm,
            sm_words,
            partials,
            block,
        )
    return _finish_checksum(sm, sm_words, bits.size, partials, tail_partials, False)


# The exact detector's fused pass runs in chunks of whole blocks of about this many values: the split and
# the checksum are long vectorised loops over a chunk, only the comparison goes block by block. Done per
# block, a 64-value block left every loop a few iterations long: 1.0 GB/s against 2.4 GB/s per chunk
# (BF16, 32 Ki values, B = 64, one thread, this repository's 2-core machine).
_ENCODE_CHUNK_VALUES = 1 << 13


@njit(inline="always")
def _encode_exact_chunk(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    exp,
    exp_words,
    last_exp,
    last_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    blocks_per_chunk,
    chunk,
):
    """Split, compare and checksum the blocks of one chunk; returns the chunk's checksum partial (the
    plane words that start in it and end by byte n, as ``_block_checksum`` of the chunk's range)."""
    first_block = chunk * blocks_per_chunk
    end_block = min(first_block + blocks_per_chunk, changed_out.size)
    start = first_block * block_size
    stop = min(end_block * block_size, bits.size)
    _split_block(bits, exp_shift, exp_mask, is_fp16, exp, sm, start, stop)
    for block in range(first_block, end_block):
        block_start = block * block_size
        block_stop = min(block_start + block_size, bits.size)
        changed_out[block] = _compare_and_update(
            exp, exp_words, last_exp, last_words, block_start, block_stop, force_all
        )
    return _block_checksum(bits, is_fp16, sm_words, start, stop)


@njit(inline="always")
def _exact_chunks(n_blocks, block_size):
    blocks_per_chunk = max(1, _ENCODE_CHUNK_VALUES // block_size)
    return blocks_per_chunk, (n_blocks + blocks_per_chunk - 1) // blocks_per_chunk


@njit(parallel=True, cache=True, nogil=True)
def encode_planes_exact_blocks(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    exp,
    exp_words,
    last_exp,
    last_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    partials,
    tail_partials,
):
    """Fused encode pass (exact detector), chunks of blocks on all of numba's threads; returns the sm
    checksum64. ``partials`` holds at least one entry per chunk (one per block always does)."""
    blocks_per_chunk, n_chunks = _exact_chunks(changed_out.size, block_size)
    for chunk in prange(n_chunks):
        partials[chunk] = _encode_exact_chunk(
            bits, exp_shift, exp_mask, is_fp16, block_size, exp, exp_words, last_exp, last_words,
            changed_out, force_all, sm, sm_words, blocks_per_chunk, chunk,
        )  # fmt: skip
    return _finish_checksum(sm, sm_words, bits.size, partials[:n_chunks], tail_partials, True)


@njit(cache=True, nogil=True)
def encode_planes_exact_blocks_serial(
    bits,
    exp_shift,
    exp_mask,
    is_fp16,
    block_size,
    exp,
    exp_words,
    last_exp,
    last_words,
    changed_out,
    force_all,
    sm,
    sm_words,
    partials,
    tail_partials,
):
    """Single-threaded ``encode_planes_exact_blocks``."""
    blocks_per_chunk, n_chunks = _exact_chunks(changed_out.size, block_size)
    for chunk in range(n_chunks):
        partials[chunk] = _encode_exact_chunk(
            bits, exp_shift, exp_mask, is_fp16, block_size, exp, exp_words, last_exp, last_words,
            changed_out, force_all, sm, sm_words, blocks_per_chunk, chunk,
        )  # fmt: skip
    return _finish_checksum(sm, sm_words, bits.size, partials[:n_chunks], tail_partials, False)


def _check_sm_out(bits, is_fp16, sm_out) -> None:
    expected = sign_mantissa_bytes(bits.size, is_fp16)
    if sm_out.dtype != np.uint8 or sm_out.ndim != 1 or sm_out.size != expected:
        raise ValueError(
            f"sm_out must be a uint8 array of {expected} bytes, got {sm_out.dtype} {sm_out.shape}"
        )
    if not sm_out.flags.c_contiguous:
        raise ValueError("sm_out must be contiguous")


def encode_planes_hash(
    bits, exp_shift, exp_mask, is_fp16, block_size, hash_cache, exp_out, changed_out, force_all, sm_out
) -> int:
    """One pass: exponent plane into ``exp_out``, changed blocks by 128-bit hash (``hash_cache`` updated,
    exactly as ``detect_changes_hash``), sign+mantissa plane into ``sm_out`` (as ``pack_sign_mantissa``);
    returns ``checksum64(sm_out)``. Serial or parallel, chosen like the detectors."""
    _check_sm_out(bits, is_fp16, sm_out)
    partials = np.empty(changed_out.size, dtype=np.uint64)
    tail_partials = np.empty(_tail_tasks(bits.size, sm_out.size), dtype=np.uint64)
    parallel = _choice.choose("encode_hash", bits.size)
    kernel = encode_planes_hash_blocks if parallel else encode_planes_hash_blocks_serial
    start_s = time.perf_counter()
    checksum = kernel(
        bits,
        exp_shift,
        exp_mask,
        bool(is_fp16),
        block_size,
        hash_cache,
        exp_out,
        words_view(exp_out),
        changed_out,
        force_all,
        sm_out,
        words_view(sm_out),
        partials,
        tail_partials,
    )
    _choice.record("encode_hash", parallel, bits.size, time.perf_counter() - start_s)
    return int(checksum)


def encode_planes_exact(
    bits, exp_shift, exp_mask, is_fp16, block_size, exp_out, last_exp, changed_out, force_all, sm_out
) -> int:
    """One pass: exponent plane into ``exp_out``, blocks that differ from ``last_exp`` (updated, exactly
    as ``detect_changes_exact``), sign+mantissa plane into ``sm_out``; returns ``checksum64(sm_out)``."""
    _check_sm_out(bits, is_fp16, sm_out)
    partials = np.empty(changed_out.size, dtype=np.uint64)
    tail_partials = np.empty(_tail_tasks(bits.size, sm_out.size), dtype=np.uint64)
    parallel = _choice.choose("encode_exact", bits.size)
    kernel = encode_planes_exact_blocks if parallel else encode_planes_exact_blocks_serial
    start_s = time.perf_counter()
    checksum = kernel(
        bits,
        exp_shift,
        exp_mask,
        bool(is_fp16),
        block_size,
        exp_out,
        words_view(exp_out),
        last_exp,
        words_view(last_exp),
        changed_out,
        force_all,
        sm_out,
        words_view(sm_out),
        partials,
        tail_partials,
    )
    _choice.record("encode_exact", parallel, bits.size, time.perf_counter() - start_s)
    return int(checksum)


# Decode: values in chunks of _MERGE_CHUNK (a multiple of 8, so FP16 groups and checksum words line up
# with the chunks), each merged and its plane words summed in the same pass.
_MERGE_CHUNK = 1 << 13


@njit(inline="always")
def _merge_chunk(exp, sm, sm_words, exp_shift, is_fp16, out, start, stop):
    """Rebuild out[start:stop] (as ``merge_planes``) and return the checksum terms of its plane words."""
    numel = out.size
    chunk_out = out[start:stop]
    chunk_exp = exp[start:stop]
    chunk_sm = sm[start:stop]
    if is_fp16:
        for i in range(chunk_out.size):
            chunk_out[i] = (np.int64(chunk_exp[i]) << exp_shift) | np.int64(chunk_sm[i])
        tail = sm[numel:]
        for group in range(start // 8, (stop + 7) // 8):
            base = group * 8
            packed = np.int64(0)
            for k in range(min(3, tail.size - 3 * group)):  # partial last group: fewer bytes
                packed |= np.int64(tail[3 * group + k]) << (8 * k)
            for j in range(min(8, numel - base)):
                high = (packed >> (3 * j)) & 0x7
                out[base + j] = np.int64(out[base + j]) | ((high & 0x4) << 13) | ((high & 0x3) << 8)
    else:
        for i in range(chunk_out.size):
            value = np.int64(chunk_sm[i])
            chunk_out[i] = ((value & 0x80) << 8) | (np.int64(chunk_exp[i]) << exp_shift) | (value & 0x7F)
    if stop // 8 > start // 8:
        return _checksum_word_run(sm_words, start // 8, stop // 8)
    return np.uint64(0)


@njit(parallel=True, cache=True, nogil=True)
def merge_planes_checked_chunks(exp, sm, sm_words, exp_shift, is_fp16, out, partials, tail_partials):
    """``merge_planes`` and ``checksum64`` of the sign+mantissa plane in one pass, chunks in parallel."""
    numel = out.size
    for chunk in prange(partials.size):
        start = chunk * _MERGE_CHUNK
        stop = min(start + _MERGE_CHUNK, numel)
        partials[chunk] = _merge_chunk(exp, sm, sm_words, exp_shift, is_fp16, out, start, stop)
    return _finish_checksum(sm, sm_words, numel, partials, tail_partials, True)


@njit(cache=True, nogil=True)
def merge_planes_checked_chunks_serial(exp, sm, sm_words, exp_shift, is_fp16, out, partials, tail_partials):
    """Single-threaded ``merge_planes_checked_chunks``."""
    numel = out.size
    for chunk in range(partials.size):
        start = chunk * _MERGE_CHUNK
        stop = min(start + _MERGE_CHUNK, numel)
        partials[chunk] = _merge_chunk(exp, sm, sm_words, exp_shift, is_fp16, out, start, stop)
    return _finish_checksum(sm, sm_words, numel, partials, tail_partials, False)


def merge_planes_checked(exp, sign_mantissa, exp_shift, is_fp16, out) -> int:
    """``merge_planes`` into ``out`` and, in the same pass, ``checksum64(sign_mantissa)``, which it returns
    (the caller compares it with the header and discards ``out`` on a mismatch). Serial or parallel,
    chosen like the detectors."""
    numel = out.size
    if exp.size != numel or sign_mantissa.size != sign_mantissa_bytes(numel, is_fp16):
        raise ValueError(
            f"planes of {exp.size} and {sign_mantissa.size} bytes do not fit {numel} values (fp16={is_fp16})"
        )
    partials = np.empty((numel + _MERGE_CHUNK - 1) // _MERGE_CHUNK, dtype=np.uint64)
    tail_partials = np.empty(_tail_tasks(numel, sign_mantissa.size), dtype=np.uint64)
    parallel = _choice.choose("merge", numel)
    kernel = merge_planes_checked_chunks if parallel else merge_planes_checked_chunks_serial
    start_s = time.perf_counter()
    checksum = kernel(
        exp, sign_mantissa, words_view(sign_mantissa), exp_shift, bool(is_fp16), out, partials, tail_partials
    )
    _choice.record("merge", parallel, numel, time.perf_counter() - start_s)
    return int(checksum)
