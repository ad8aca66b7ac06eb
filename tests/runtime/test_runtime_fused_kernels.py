"""The fused kernels give exactly what the separate kernels give: exponent plane, changed flags, detector
state, sign+mantissa plane and its checksum64; the rANS encoder's chunking and encode_into."""

from __future__ import annotations

import numpy as np
import pytest

from ciera_runtime import kernels, rans
from ciera_runtime.backend import get_backend

SIZES = (0, 1, 7, 8, 9, 17, 511, 513, 1000, 4103, 20001)
BLOCKS = (1, 3, 8, 13, 64, 512)


def _layout(is_fp16: bool) -> tuple[int, int]:
    if is_fp16:
        return kernels.FP16_EXP_SHIFT, kernels.FP16_EXP_MASK
    return kernels.BF16_EXP_SHIFT, kernels.BF16_EXP_MASK


def _shard(rng: np.random.Generator, numel: int) -> np.ndarray:
    return rng.integers(0, 1 << 16, numel).astype(np.uint16)


def _changed_version(rng: np.random.Generator, bits: np.ndarray) -> np.ndarray:
    """A few values with a different exponent, and sign/mantissa noise that detection must ignore."""
    other = bits ^ rng.integers(0, 2, bits.size).astype(np.uint16)
    if bits.size:
        where = rng.integers(0, bits.size, max(1, bits.size // 97))
        other[where] ^= np.uint16(1 << 11)
    return other


def _sm_plane_in_buffer(numel: int, is_fp16: bool, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """A sign+mantissa plane at byte ``offset`` of a larger buffer whose guard bytes must stay 0xA5."""
    size = kernels.sign_mantissa_bytes(numel, is_fp16)
    buffer = np.full(size + offset + 16, 0xA5, dtype=np.uint8)
    return buffer, buffer[offset : offset + size]


def _assert_guards(buffer: np.ndarray, offset: int, size: int) -> None:
    assert (buffer[:offset] == 0xA5).all() and (buffer[offset + size :] == 0xA5).all()


@pytest.fixture(params=[False, True], ids=["serial", "parallel"])
def forced_variant(request):
    kernels.use_parallel_detect(request.param)
    yield request.param
    kernels.use_parallel_detect(None)


@pytest.mark.parametrize("is_fp16", [False, True], ids=["bf16", "fp16"])
def test_encode_planes_hash_equals_separate_kernels(forced_variant, is_fp16: bool) -> None:
    rng = np.random.default_rng(11)
    shift, mask = _layout(is_fp16)
    for numel in SIZES:
        first = _shard(rng, numel)
        for block_size in BLOCKS:
            n_blocks = (numel + block_size - 1) // block_size
            cache_ref = np.zeros((n_blocks, 2), dtype=np.uint64)
            cache = np.zeros((n_blocks, 2), dtype=np.uint64)
            for step, (bits, force_all) in enumerate(
                [(first, True), (_changed_version(rng, first), False), (first, False)]
            ):
                exp_ref = np.empty(numel, dtype=np.uint8)
                changed_ref = np.zeros(n_blocks, dtype=np.uint8)
                kernels.detect_changes_hash(
                    bits, shift, mask, block_size, cache_ref, exp_ref, changed_ref, force_all
                )
                sm_ref = np.empty(kernels.sign_mantissa_bytes(numel, is_fp16), dtype=np.uint8)
                kernels.pack_sign_mantissa(bits, is_fp16, sm_ref)
                offset = 1 + step * 3  # unaligned too: the plane sits anywhere in a payload buffer
                buffer, sm = _sm_plane_in_buffer(numel, is_fp16, offset)
                exp = np.empty(numel, dtype=np.uint8)
                changed = np.zeros(n_blocks, dtype=np.uint8)
                checksum = kernels.encode_planes_hash(
                    bits, shift, mask, is_fp16, block_size, cache, exp, changed, force_all, sm
                )
                np.testing.assert_array_equal(exp, exp_ref)
                np.testing.assert_array_equal(changed, changed_ref)
                np.testing.assert_array_equal(cache, cache_ref)
                np.testing.assert_array_equal(sm, sm_ref)
                assert checksum == kernels.checksum64(sm_ref), (numel, block_size, step)
                _assert_guards(buffer, offset, sm.size)


@pytest.mark.parametrize("is_fp16", [False, True], ids=["bf16", "fp16"])
def test_encode_planes_exact_equals_separate_kernels(forced_variant, is_fp16: bool) -> None:
    rng = np.random.default_rng(12)
    shift, mask = _layout(is_fp16)
    for numel in SIZES:
        first = _shard(rng, numel)
        for block_size in BLOCKS:
            n_blocks = (numel + block_size - 1) // block_size
            last_ref = np.zeros(numel, dtype=np.uint8)
            last = np.zeros(numel, dtype=np.uint8)
            for step, (bits, force_all) in enumerate(
                [(first, True), (_changed_version(rng, first), False), (first, False)]
            ):
                exp_ref = np.empty(numel, dtype=np.uint8)
                changed_ref = np.zeros(n_blocks, dtype=np.uint8)
                kernels.detect_changes_exact(
                    bits, shift, mask, block_size, exp_ref, last_ref, changed_ref, force_all
                )
                sm_ref = np.empty(kernels.sign_mantissa_bytes(numel, is_fp16), dtype=np.uint8)
                kernels.pack_sign_mantissa(bits, is_fp16, sm_ref)
                offset = 8 * step + (step == 1)
                buffer, sm = _sm_plane_in_buffer(numel, is_fp16, offset)
                exp = np.empty(numel, dtype=np.uint8)
                changed = np.zeros(n_blocks, dtype=np.uint8)
                checksum = kernels.encode_planes_exact(
                    bits, shift, mask, is_fp16, block_size, exp, last, changed, force_all, sm
                )
                np.testing.assert_array_equal(exp, exp_ref)
                np.testing.assert_array_equal(changed, changed_ref)
                np.testing.assert_array_equal(last, last_ref)
                np.testing.assert_array_equal(sm, sm_ref)
                assert checksum == kernels.checksum64(sm_ref), (numel, block_size, step)
                _assert_guards(buffer, offset, sm.size)


def test_fused_encode_rejects_a_wrong_sized_plane() -> None:
    bits = np.zeros(100, dtype=np.uint16)
    with pytest.raises(ValueError):
        kernels.encode_planes_hash(
            bits, 7, 0xFF, False, 8, np.zeros((13, 2), np.uint64), np.empty(100, np.uint8),
            np.zeros(13, np.uint8), False, np.empty(99, np.uint8),
        )  # fmt: skip


@pytest.mark.parametrize("is_fp16", [False, True], ids=["bf16", "fp16"])
def test_merge_planes_checked_equals_merge_and_checksum(forced_variant, is_fp16: bool) -> None:
    rng = np.random.default_rng(13)
    shift, mask = _layout(is_fp16)
    for numel in (*SIZES, 8191, 8192, 8193, 3 * 8192 + 5):
        bits = _shard(rng, numel)
        exp = np.empty(numel, dtype=np.uint8)
        kernels.extract_exponents(bits, shift, mask, exp)
        buffer, sm = _sm_plane_in_buffer(numel, is_fp16, 3)
        kernels.pack_sign_mantissa(bits, is_fp16, sm)
        out_ref = np.empty(numel, dtype=np.uint16)
        kernels.merge_planes(exp, sm, shift, is_fp16, out_ref)
        out = np.empty(numel, dtype=np.uint16)
        checksum = get_backend("cpu").merge_planes_checked(exp, sm, shift, is_fp16, out)
        np.testing.assert_array_equal(out, out_ref)
        np.testing.assert_array_equal(out, bits)
        assert checksum == kernels.checksum64(sm)
        if sm.size:  # a flipped plane bit changes the checksum
            sm[rng.integers(0, sm.size)] ^= np.uint8(1 << int(rng.integers(0, 8)))
            assert kernels.merge_planes_checked(exp, sm, shift, is_fp16, out) != checksum


def test_backend_fused_encode_matches_kernels() -> None:
    rng = np.random.default_rng(14)
    bits = _shard(rng, 5000)
    backend = get_backend("cpu")
    sm = np.empty(5000, dtype=np.uint8)
    exp = np.empty(5000, dtype=np.uint8)
    changed = np.zeros(10, dtype=np.uint8)
    checksum = backend.encode_planes_hash(
        bits, 7, 0xFF, False, 512, np.zeros((10, 2), np.uint64), exp, changed, True, sm
    )
    assert checksum == kernels.checksum64(sm) and changed.all()
    checksum = backend.encode_planes_exact(
        bits, 7, 0xFF, False, 512, exp, np.zeros(5000, np.uint8), changed, False, sm
    )
    assert checksum == kernels.checksum64(sm)


def _exponent_like(rng: np.random.Generator, n: int) -> np.ndarray:
    weights = (rng.standard_normal(n) * 0.02).astype(np.float32)
    return ((weights.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_chunking_spreads_over_threads_and_round_trips(threads: int) -> None:
    rng = np.random.default_rng(15)
    data = _exponent_like(rng, 600_000)
    low, high = rans.MIN_CHUNK_SYMBOLS, rans.DEFAULT_CHUNK_SYMBOLS
    for n in (
        1,
        8,
        low - 1,
        low,
        2 * low - 1,
        2 * low,
        2 * low + 1,
        84_000,
        high - 1,
        high,
        high + 1,
        600_000,
    ):
        chunk = rans.choose_chunk_symbols(n, threads)
        assert chunk % rans.LANES == 0 and chunk <= high
        n_chunks = -(-n // chunk)
        assert n_chunks == 1 or chunk >= low
        if n >= threads * low:  # enough symbols: every thread gets a chunk
            assert n_chunks >= threads
        stream = rans.encode(data[:n], chunk_symbols=chunk)
        np.testing.assert_array_equal(rans.decode(stream), data[:n])


@pytest.mark.parametrize(
    "n", [1, 7, 8, 9, 4095, 4096, 4097, 32767, 32768, 32769, 65535, 65536, 65537, 84_000, 131_080]
)
def test_encode_into_round_trips_around_chunk_boundaries(n: int) -> None:
    rng = np.random.default_rng(n)
    data = _exponent_like(rng, n)
    stream = rans.encode(data)
    out = np.full(rans.max_encoded_bytes(n) + 8, 0xA5, dtype=np.uint8)
    length = rans.encode_into(data, out[3:])  # an unaligned destination inside a bigger buffer
    assert length == len(stream) and out[3 : 3 + length].tobytes() == stream
    assert out[0] == 0xA5 and (out[3 + length :] == 0xA5).all()
    np.testing.assert_array_equal(rans.decode(stream), data)
    assert rans.encode_into(data, np.empty(length - 1, dtype=np.uint8)) == -1  # does not fit: -1
    for chunk in (4096, rans.DEFAULT_CHUNK_SYMBOLS):  # streams cut as before still decode
        np.testing.assert_array_equal(rans.decode(rans.encode(data, chunk_symbols=chunk)), data)


def test_chunked_stream_stays_within_one_percent_of_entropy() -> None:
    rng = np.random.default_rng(16)
    data = _exponent_like(rng, 84_000)
    counts = np.bincount(data, minlength=256)
    p = counts[counts > 0] / data.size
    entropy = float(-(p * np.log2(p)).sum())
    for threads in (1, 2, 4):
        stream = rans.encode(data, chunk_symbols=rans.choose_chunk_symbols(data.size, threads))
        assert 8 * len(stream) / data.size < 1.01 * entropy


def test_encode_empty_and_single_symbol_inputs() -> None:
    assert rans.decode(rans.encode(np.empty(0, np.uint8))).size == 0
    out = np.empty(12, dtype=np.uint8)
    assert rans.encode_into(np.empty(0, np.uint8), out) == 12
    data = np.full(70_000, 9, dtype=np.uint8)
    np.testing.assert_array_equal(rans.decode(rans.encode(data)), data)
