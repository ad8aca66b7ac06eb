"""Codec round trips: every 16-bit pattern, odd sizes, the FP16 packing, rANS against constriction."""

from __future__ import annotations

import numpy as np
import pytest

from ciera_runtime import (
    BackendUnavailableError,
    CodecConfig,
    PayloadError,
    ShardDecoder,
    ShardEncoder,
    get_backend,
    rans,
)
from ciera_runtime.codec import HEADER_BYTES, PayloadLayout, parse_header
from ciera_runtime.kernels import sign_mantissa_bytes

ALL_PATTERNS = np.arange(1 << 16, dtype=np.uint16)


def _pair(numel: int, dtype: str, **config) -> tuple[ShardEncoder, ShardDecoder]:
    codec_config = CodecConfig(**config)
    return ShardEncoder(5, numel, dtype, 1, codec_config), ShardDecoder(5, 1, numel, dtype, codec_config)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("detector", ["hash", "exact"])
def test_every_bit_pattern_round_trips_exactly(dtype: str, detector: str) -> None:
    encoder, decoder = _pair(ALL_PATTERNS.size, dtype, detector=detector)
    rng = np.random.default_rng(1)
    # All 65,536 patterns (NaN payloads, +-inf, subnormals, +-0) in order, then shuffled: full, then delta.
    for bits in (ALL_PATTERNS, rng.permutation(ALL_PATTERNS), ALL_PATTERNS[::-1].copy()):
        np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)


def test_round_trip_through_torch_tensors_keeps_nan_payloads() -> None:
    torch = pytest.importorskip("torch")
    for torch_dtype in (torch.bfloat16, torch.float16):
        tensor = torch.from_numpy(ALL_PATTERNS.view(np.int16).copy()).view(torch_dtype)
        encoder, decoder = _pair(tensor.numel(), str(torch_dtype))
        rebuilt = torch.from_numpy(decoder.decode(encoder.encode(tensor)).view(np.int16)).view(torch_dtype)
        assert torch.equal(rebuilt.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 511, 512, 513, 2049])
@pytest.mark.parametrize("block_size", [1, 3, 512])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sizes_not_multiple_of_block_and_empty_shards(numel: int, block_size: int, dtype: str) -> None:
    encoder, decoder = _pair(numel, dtype, block_size=block_size, detector="exact" if numel % 2 else "hash")
    rng = np.random.default_rng(numel)
    bits = rng.integers(0, 1 << 16, numel).astype(np.uint16)
    for _ in range(3):
        np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)
        if numel:
            bits[-1] ^= 0x0180  # last (partial) block's exponent changes
    layout = PayloadLayout.of(numel, encoder.dtype, block_size)
    assert layout.n_blocks == -(-numel // block_size)


def test_unchanged_regather_sends_no_exponents_and_payload_meets_the_bound() -> None:
    numel, block_size = 1 << 16, 512
    encoder, decoder = _pair(numel, "bf16", block_size=block_size)
    weights = (np.random.default_rng(0).standard_normal(numel) * 0.02).astype(np.float32)
    bits = (weights.view(np.uint32) >> 16).astype(np.uint16)
    first = encoder.encode(bits)
    assert parse_header(first, 5, 1).full
    decoder.decode(first)
    for _ in range(2):  # recompute and backward gathers of the same weights
        payload = encoder.encode(bits)
        header = parse_header(payload, 5, 1)
        assert header.changed_blocks == 0 and header.exp_bytes == 0
        np.testing.assert_array_equal(decoder.decode(payload), bits)
        # r(0) = 0.5 + 1/(16B) (+ the header)
        assert payload.size <= numel * 2 * (0.5 + 1 / (16 * block_size)) + HEADER_BYTES + 8


def test_fp16_sign_mantissa_is_packed_in_11_bits_per_value() -> None:
    assert sign_mantissa_bytes(8, True) == 8 + 3
    assert sign_mantissa_bytes(1000, True) == 1000 + 375
    assert sign_mantissa_bytes(9, True) == 9 + 4
    assert sign_mantissa_bytes(1000, False) == 1000


def test_hash_and_exact_detectors_flag_the_same_blocks() -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 16, 10_000).astype(np.uint16)
    hashed, _ = _pair(bits.size, "bf16", block_size=100, detector="hash")
    exact, _ = _pair(bits.size, "bf16", block_size=100, detector="exact")
    hashed.encode(bits), exact.encode(bits)
    for _ in range(5):
        bits[rng.integers(0, bits.size, 4)] ^= 0x0080  # lowest exponent bit
        bits[rng.integers(0, bits.size, 4)] ^= 0x0001  # mantissa only: not a change
        hashed.encode(bits), exact.encode(bits)
        assert hashed.last_changed_blocks == exact.last_changed_blocks


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(0, np.uint8),
        np.full(1, 9, np.uint8),
        np.full(5000, 200, np.uint8),
        np.arange(256, dtype=np.uint8),
        np.random.default_rng(0).integers(0, 256, 70_001).astype(np.uint8),
    ],
    ids=["empty", "one", "single-symbol", "all-symbols", "uniform"],
)
def test_rans_round_trips_edge_inputs(data: np.ndarray) -> None:
    np.testing.assert_array_equal(rans.decode(rans.encode(data, chunk_symbols=4096)), data)


def test_rans_matches_constriction_and_entropy() -> None:
    constriction = pytest.importorskip("constriction")
    weights = (np.random.default_rng(2).standard_normal(200_000) * 0.02).astype(np.float32)
    exponents = ((weights.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    ours = rans.encode(exponents)
    np.testing.assert_array_equal(rans.decode(ours), exponents)
    counts = np.bincount(exponents, minlength=256)
    probabilities = counts / counts.sum()
    entropy_bits = -(probabilities[counts > 0] * np.log2(probabilities[counts > 0])).sum()
    model = constriction.stream.model.Categorical(probabilities.astype(np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(exponents.astype(np.int32), model)
    reference = coder.get_compressed()
    decoded = constriction.stream.stack.AnsCoder(reference).decode(model, exponents.size)
    np.testing.assert_array_equal(decoded, exponents)
    ours_bits, reference_bits = 8 * len(ours), 32 * reference.size
    assert ours_bits <= exponents.size * entropy_bits * 1.01 + 8 * 1024  # within 1% + table/state bytes
    assert abs(ours_bits - reference_bits) <= 0.01 * reference_bits + 8 * 1024


def test_rans_rejects_corrupted_and_truncated_streams() -> None:
    data = np.random.default_rng(4).integers(0, 12, 20_000).astype(np.uint8)
    stream = bytearray(rans.encode(data))
    with pytest.raises(rans.RansFormatError):
        rans.decode(bytes(stream[:-4]))
    stream[len(stream) // 2] ^= 0xFF
    with pytest.raises(rans.RansFormatError):
        rans.decode(bytes(stream))


def test_backend_registry_gives_cpu_and_a_clear_error_for_missing_ones() -> None:
    assert get_backend("cpu").name == "cpu"
    with pytest.raises(BackendUnavailableError, match="'cuda' is not available"):
        get_backend("cuda")
    with pytest.raises(BackendUnavailableError, match="unknown codec backend 'tpu'"):
        get_backend("tpu")
    with pytest.raises(BackendUnavailableError):
        ShardEncoder(0, 10, "bf16", config=CodecConfig(backend="cuda"))


@pytest.mark.parametrize("size", [1, 7, 8, 9, 15, 16, 17, 63, 4095, 4096, 4097, 4103])
def test_rans_round_trips_every_lane_tail(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 7, size).astype(np.uint8)
    np.testing.assert_array_equal(rans.decode(rans.encode(data, chunk_symbols=4096)), data)


def test_rans_rejects_single_symbol_stream_with_moved_state() -> None:
    stream = bytearray(rans.encode(np.full(100, 3, np.uint8)))
    stream[-4] ^= 0x01  # last lane state of the only chunk
    with pytest.raises(rans.RansFormatError):
        rans.decode(bytes(stream))


@pytest.mark.parametrize("block_size", [512, 100, 13])
def test_parallel_and_serial_detectors_agree(block_size: int) -> None:
    from ciera_runtime import kernels

    rng = np.random.default_rng(block_size)
    bits = rng.integers(0, 1 << 16, 10_007).astype(np.uint16)
    n_blocks = (bits.size + block_size - 1) // block_size
    results = []
    for parallel in (True, False):
        kernels.use_parallel_detect(parallel)
        try:
            hashes, last = np.zeros((n_blocks, 2), np.uint64), np.zeros(bits.size, np.uint8)
            exp_h, exp_e = np.empty(bits.size, np.uint8), np.empty(bits.size, np.uint8)
            changed_h, changed_e = np.zeros(n_blocks, np.uint8), np.zeros(n_blocks, np.uint8)
            kernels.detect_changes_hash(bits, 7, 0xFF, block_size, hashes, exp_h, changed_h, False)
            kernels.detect_changes_exact(bits, 7, 0xFF, block_size, exp_e, last, changed_e, False)
            results.append((hashes.copy(), exp_h.copy(), changed_h.copy(), changed_e.copy(), last.copy()))
        finally:
            kernels.use_parallel_detect(None)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[0][1], (bits >> 7).astype(np.uint8))


def test_hash_flags_every_single_word_change() -> None:
    """Each stream sums SplitMix64 outputs (a bijection) of position-keyed words: changing one word of a
    block always changes both halves of its hash."""
    from ciera_runtime import kernels

    rng = np.random.default_rng(9)
    bits = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
    hashes, exp, changed = np.zeros((8, 2), np.uint64), np.empty(4096, np.uint8), np.zeros(8, np.uint8)
    kernels.detect_changes_hash(bits, 7, 0xFF, 512, hashes, exp, changed, False)
    for _trial in range(200):
        position = int(rng.integers(0, 4096))
        before = hashes.copy()
        bits[position] ^= np.uint16(1 << int(rng.integers(7, 15)))
        kernels.detect_changes_hash(bits, 7, 0xFF, 512, hashes, exp, changed, False)
        block = position // 512
        assert changed.nonzero()[0].tolist() == [block]
        assert (hashes[block] != before[block]).all()


@pytest.mark.parametrize("numel", range(1, 18))
def test_fp16_sign_mantissa_plane_never_writes_past_its_end(numel: int) -> None:
    """A partial last group of 8 owns only ceil(3 * count / 8) packed bytes (it used to write 3)."""
    from ciera_runtime import kernels

    bits = np.random.default_rng(numel).integers(0, 1 << 16, numel).astype(np.uint16)
    size = sign_mantissa_bytes(numel, True)
    buffer = np.full(size + 8, 0xAB, dtype=np.uint8)
    kernels.pack_sign_mantissa(bits, True, buffer[:size])
    assert (buffer[size:] == 0xAB).all()
    exp = ((bits >> 10) & 0x1F).astype(np.uint8)
    merged = np.empty_like(bits)
    kernels.merge_planes(exp, buffer[:size], 10, True, merged)
    np.testing.assert_array_equal(merged, bits)


def test_starting_the_codec_keeps_torchs_thread_count() -> None:
    """numba's OpenMP pool start used to set torch's thread count (1 → 2), so torch summed in another
    order and training with CIERA drifted from the plain engine. Fresh process: the pool starts there."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    script = (
        "import torch, numpy as np\n"
        "torch.set_num_threads(1)\n"
        "from ciera_runtime import CodecConfig, ShardEncoder, kernels\n"
        "kernels.use_parallel_detect(True)\n"
        "encoder = ShardEncoder(0, 1 << 17, 'bf16', 0, CodecConfig())\n"
        "encoder.encode(np.zeros(1 << 17, np.uint16))\n"
        "print(torch.get_num_threads())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_codec_threads_default_to_the_cores_of_one_local_rank_and_cap_every_parallel_caller(
    monkeypatch,
) -> None:
    import os
    import threading

    import numba

    from ciera_runtime import kernels
    from ciera_runtime.backend import CpuBackend, default_codec_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("CIERA_CODEC_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert default_codec_threads() == (1, f"{cores} cores / {cores} local ranks")
    monkeypatch.setenv("CIERA_CODEC_THREADS", "3")
    assert default_codec_threads() == (3, "CIERA_CODEC_THREADS=3")
    for bad in ("0", "two", ""):
        monkeypatch.setenv("CIERA_CODEC_THREADS", bad)
        with pytest.raises(BackendUnavailableError, match=f"CIERA_CODEC_THREADS={bad!r}: expected"):
            default_codec_threads()
    monkeypatch.delenv("CIERA_CODEC_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(BackendUnavailableError, match="LOCAL_WORLD_SIZE='x'"):
        default_codec_threads()

    pool = numba.config.NUMBA_NUM_THREADS
    assert CpuBackend(threads=pool + 5).threads == pool  # never more than numba's pool
    backend = CpuBackend(threads=1)
    rng = np.random.default_rng(5)
    # Large enough for a parallel region (two rANS chunks); a small stream always runs serially.
    data = rng.integers(0, 7, 2 * kernels.PARALLEL_MIN_VALUES).astype(np.uint8)
    small = rng.integers(0, 7, 5_000).astype(np.uint8)
    stream = np.empty(data.size * 2 + 4096, dtype=np.uint8)
    seen: dict[str, object] = {}

    def round_trip(values: np.ndarray) -> bool:
        length = backend.ans_encode_into(values, stream)
        out = np.empty_like(values)
        backend.ans_decode(stream[:length], out)
        return bool((out == values).all())

    def call_from_a_fresh_thread() -> None:  # numba's count is per thread: a new one starts at the pool
        seen["before"] = numba.get_num_threads()
        seen["small exact"] = round_trip(small)
        seen["after small"] = numba.get_num_threads()  # a serial call does not pay for the check
        seen["exact"] = round_trip(data)
        seen["after"] = numba.get_num_threads()

    worker = threading.Thread(target=call_from_a_fresh_thread)
    worker.start()
    worker.join()
    assert seen == {"before": pool, "small exact": True, "after small": pool, "exact": True, "after": 1}


def _adam_like_step(bits: np.ndarray, rng: np.random.Generator, lr: float) -> np.ndarray:
    """BF16 weights after one update of relative size ~lr/|w| (what Adam does early in training)."""
    weights = (bits.astype(np.uint32) << 16).view(np.float32)
    stepped = weights - lr * np.sign(rng.standard_normal(weights.size)).astype(np.float32)
    return (stepped.view(np.uint32) >> 16).astype(np.uint16)


def test_exact_detector_sends_changed_blocks_as_deltas_and_full_payloads_as_exponents() -> None:
    from ciera_runtime.codec import FLAG_EXPONENT_DELTAS, FLAG_RAW_EXPONENTS

    numel = 1 << 16
    rng = np.random.default_rng(7)
    bits = ((rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    exact, exact_rx = _pair(numel, "bf16", detector="exact")
    hashed, hashed_rx = _pair(numel, "bf16", detector="hash")
    first = exact.encode(bits)
    assert not parse_header(first, 5, 1).flags & FLAG_EXPONENT_DELTAS  # full: receivers may hold nothing
    exact_rx.decode(first), hashed_rx.decode(hashed.encode(bits))
    sizes = {"exact": 0, "hash": 0}
    for _ in range(5):
        bits = _adam_like_step(bits, rng, 1e-4)
        for name, encoder, decoder in (("exact", exact, exact_rx), ("hash", hashed, hashed_rx)):
            payload = encoder.encode(bits)
            header = parse_header(payload, 5, 1)
            assert header.changed_blocks > 0
            assert bool(header.flags & FLAG_EXPONENT_DELTAS) == (name == "exact")
            assert not header.flags & FLAG_RAW_EXPONENTS
            np.testing.assert_array_equal(decoder.decode(payload), bits)
            sizes[name] += header.exp_bytes
    # Same blocks flagged, a fraction of the exponent bytes: most deltas in a changed block are 0.
    assert sizes["exact"] < sizes["hash"] / 4
    exact.force_full()
    full = parse_header(exact.encode(bits), 5, 1)
    assert full.full and not full.flags & FLAG_EXPONENT_DELTAS


def test_a_delta_flag_that_does_not_match_the_payload_kind_is_rejected() -> None:
    """A payload re-signed by a hostile sender with the deltas flag flipped (header CRC recomputed) is
    refused before it touches the cache, in both directions."""
    import struct
    import zlib

    from ciera_runtime.codec import _HEADER_CRC_OFFSET, FLAG_EXPONENT_DELTAS, PayloadError

    def flipped(payload: np.ndarray) -> np.ndarray:
        forged = payload.copy()
        forged[7] ^= FLAG_EXPONENT_DELTAS  # the flags byte (after magic, version, dtype)
        header = bytearray(forged[:HEADER_BYTES].tobytes())
        struct.pack_into("<I", header, _HEADER_CRC_OFFSET, zlib.crc32(header[:_HEADER_CRC_OFFSET]))
        forged[:HEADER_BYTES] = np.frombuffer(bytes(header), dtype=np.uint8)
        return forged

    numel = 4096
    rng = np.random.default_rng(8)
    bits = rng.integers(0, 1 << 16, numel).astype(np.uint16)
    encoder, decoder = _pair(numel, "bf16", detector="exact", block_size=64)
    full = encoder.encode(bits)
    with pytest.raises(PayloadError, match="deltas flag is set on a full payload"):
        decoder.decode(flipped(full))
    decoder.decode(full)
    bits[::97] ^= 0x0080
    delta = encoder.encode(bits)
    cache_before = decoder.exp_cache.copy()
    with pytest.raises(PayloadError, match="deltas flag is clear on a delta payload"):
        decoder.decode(flipped(delta))
    np.testing.assert_array_equal(decoder.exp_cache, cache_before)
    np.testing.assert_array_equal(decoder.decode(delta), bits)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("detector", ["hash", "exact"])
def test_the_uncoded_configuration_sends_changed_exponents_raw_and_rebuilds_exactly(
    dtype: str, detector: str
) -> None:
    """entropy='none': no entropy stage on either side — every payload with changed blocks carries their
    exponents (or deltas) one byte per value, and the receiver rebuilds every bit."""
    numel, block_size = 4099, 64
    encoder, decoder = _pair(numel, dtype, block_size=block_size, detector=detector, entropy="none")
    coded, _ = _pair(numel, dtype, block_size=block_size, detector=detector)
    rng = np.random.default_rng(7)
    weights = (rng.standard_normal(numel) * 0.02).astype(np.float32)  # exponents of low entropy
    if dtype == "bf16":
        bits = (weights.view(np.uint32) >> 16).astype(np.uint16)
    else:
        bits = weights.astype(np.float16).view(np.uint16).copy()
    sizes = []
    for step in range(6):
        payload = encoder.encode(bits)
        header = parse_header(payload, 5, 1)
        layout = PayloadLayout.of(numel, encoder.dtype, block_size)
        changed_values = min(numel, header.changed_blocks * block_size)  # the last block may be partial
        assert header.exp_bytes in (changed_values, changed_values - (-numel % block_size))
        assert payload.size == layout.fixed_bytes + header.exp_bytes
        if header.changed_blocks:
            assert header.flags & 2  # FLAG_RAW_EXPONENTS
        np.testing.assert_array_equal(decoder.decode(payload), bits)
        sizes.append((payload.size, coded.encode(bits).size))
        blocks = rng.choice(layout.n_blocks, size=max(1, step * 5), replace=False)
        for block in blocks:  # one exponent step in each chosen block
            index = min(numel - 1, block * block_size + int(rng.integers(block_size)))
            bits[index] ^= 0x0080 if dtype == "bf16" else 0x0400
    # rANS is what makes the coded payloads smaller: never larger than the uncoded ones.
    assert all(coded_size <= raw_size for raw_size, coded_size in sizes)
    assert any(coded_size < raw_size for raw_size, coded_size in sizes)


def test_entropy_settings_are_checked_fingerprinted_and_never_mixed() -> None:
    with pytest.raises(ValueError, match=r"^entropy='zstd': expected 'rans' or 'none'$"):
        CodecConfig(entropy="zstd")
    assert CodecConfig(entropy="none").fingerprint != CodecConfig().fingerprint
    assert CodecConfig().fingerprint == CodecConfig(entropy="rans").fingerprint
    # An uncoded receiver refuses a coded payload (a sender of the other configuration) in one line: the
    # entropy stage is part of the configuration fingerprint every payload carries.
    numel = 2048
    coded, _ = _pair(numel, "bf16")
    _, uncoded = _pair(numel, "bf16", entropy="none")
    bits = np.random.default_rng(3).integers(0, 1 << 16, numel).astype(np.uint16)
    coded.encode(bits)  # full first payload: its exponents may travel raw either way
    bits[::64] ^= 0x0080
    payload = coded.encode(bits)
    assert not parse_header(payload, 5, 1).flags & 2  # rANS paid here
    with pytest.raises(PayloadError, match=r"codec configuration \(fingerprint .*entropy='none'\)\)$"):
        uncoded.decode(payload)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("detector", ["hash", "exact"])
def test_a_seed_from_raw_values_stands_for_the_payload_it_replaced(dtype: str, detector: str) -> None:
    """A sender whose payload is not smaller than raw sends its values instead (the bucket path's seed):
    the receiver fills its cache from them at the payload's (epoch, generation), and the sender's next
    payload — a delta, with exponent deltas for the exact detector — rebuilds exactly on it."""
    from ciera_runtime import OutOfStepError, StalePayloadError

    numel = 5000
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 1 << 16, numel).astype(np.uint16)
    encoder, decoder = _pair(numel, dtype, block_size=64, detector=detector, entropy="none")
    encoder.encode(bits)  # not sent: raw values go instead
    decoder.seed(bits, encoder.epoch, encoder.generation)
    assert (decoder.epoch, decoder.generation) == (encoder.epoch, 1)
    for step in range(3):
        bits = bits.copy()
        bits[rng.integers(0, numel, 20)] ^= 0x0100 << (step % 2)  # an exponent bit of a few values
        payload = encoder.encode(bits)
        assert not parse_header(payload, 5, 1).full
        np.testing.assert_array_equal(decoder.decode(payload), bits)
    # The same rule as a full payload: an old generation or a retired epoch is refused, cache untouched.
    cache = decoder.exp_cache.copy()
    with pytest.raises(StalePayloadError):
        decoder.seed(bits, encoder.epoch, 2)
    restarted = ShardEncoder(5, numel, dtype, 1, encoder.config)
    decoder.seed(bits, restarted.epoch, 1)
    with pytest.raises(StalePayloadError):
        decoder.seed(bits, encoder.epoch, 99)
    np.testing.assert_array_equal(decoder.exp_cache, cache)  # the same values: the same exponents
    with pytest.raises(PayloadError, match="epoch 0"):
        decoder.seed(bits, 0, 5)
    with pytest.raises(ValueError, match="expected 5000 16-bit values"):
        decoder.seed(bits[:-1], restarted.epoch, 7)
    # A delta the seed did not stand for is out of step.
    fresh = ShardDecoder(5, 1, numel, dtype, encoder.config)
    with pytest.raises(OutOfStepError):
        fresh.decode(encoder.encode(bits))
