"""Property tests: any sequence of changes round-trips bit for bit, for both detectors and dtypes."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder, payload_passes


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(0, 3000),
    block_size=st.sampled_from([1, 5, 64, 512]),
    dtype=st.sampled_from(["bf16", "fp16"]),
    detector=st.sampled_from(["hash", "exact"]),
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), min_size=1, max_size=6),
)
def test_random_change_sequences_round_trip(numel, block_size, dtype, detector, seed, steps) -> None:
    config = CodecConfig(block_size=block_size, detector=detector, verify_every=2)
    encoder = ShardEncoder(1, numel, dtype, 0, config)
    decoder = ShardDecoder(1, 0, numel, dtype, config)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, numel).astype(np.uint16)
    for change_share, exponent_only in steps:
        changed = rng.random(numel) < change_share
        noise = rng.integers(0, 1 << 16, numel).astype(np.uint16)
        if exponent_only:
            noise &= 0x7F80 if dtype == "bf16" else 0x7C00
        bits = np.where(changed, bits ^ noise, bits).astype(np.uint16)
        np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)
        assert decoder.generation == encoder.generation


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=600), start=st.integers(0, 2**32 - 1))
def test_compiled_crc32_is_zlibs(data, start) -> None:
    """The one-call encoder writes its header's CRC-32s in numba; receivers check them with zlib."""
    assert int(payload_passes.crc32(np.frombuffer(data, dtype=np.uint8), start)) == zlib.crc32(data, start)


def _reference_frequencies(counts: np.ndarray) -> np.ndarray:
    """The rANS stream's frequency rule, written plainly (the wire format depends on it): scale to 4096,
    floor, at least 1 per present symbol; hand the remainder out by largest fractional loss, ties in symbol
    order; if the floors of 1 overshoot, take from the largest frequency."""
    total = int(counts.sum())
    freqs = np.zeros(256, dtype=np.int64)
    present = np.flatnonzero(counts)
    if total == 0:
        return freqs
    scaled = counts[present].astype(np.float64) * 4096 / total
    freqs[present] = np.maximum(1, np.floor(scaled).astype(np.int64))
    deficit = 4096 - int(freqs.sum())
    if deficit > 0:
        order = present[np.argsort(-(scaled - np.floor(scaled)), kind="stable")]
        for k in range(deficit):
            freqs[order[k % order.size]] += 1
    while deficit < 0:
        donor = present[np.argmax(freqs[present])]
        take = min(-deficit, int(freqs[donor]) - 1)
        freqs[donor] -= take
        deficit += take
    return freqs


@settings(max_examples=300, deadline=None)
@given(
    counts=st.dictionaries(
        st.integers(0, 255),
        st.one_of(st.integers(1, 3), st.integers(1, 10**9)),
        min_size=0,
        max_size=256,
    )
)
def test_rans_frequencies_follow_the_stream_rule(counts) -> None:
    from ciera_runtime import rans

    histogram = np.zeros(256, dtype=np.int64)
    for symbol, count in counts.items():
        histogram[symbol] = count
    freqs = rans.normalize_frequencies(histogram)
    np.testing.assert_array_equal(freqs, _reference_frequencies(histogram))
    if counts:
        assert (
            freqs.sum() == 4096 and (freqs[histogram > 0] >= 1).all() and (freqs[histogram == 0] == 0).all()
        )


@settings(max_examples=150, deadline=None)
@given(
    symbols=st.lists(st.integers(0, 255), min_size=1, max_size=600),
    skew=st.integers(1, 6),
    chunk_symbols=st.sampled_from([8, 64, 4096]),
    damage=st.one_of(
        st.none(),
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(1, 64), st.just(0)),
    ),
)
def test_rans_serial_and_parallel_decoders_agree_on_every_stream(
    symbols, skew, chunk_symbols, damage
) -> None:
    """The one-call serial decoder (small shards) and the chunks-in-parallel one read every stream alike:
    the same bytes, or the same RansFormatError, never another exception — corrupted streams included."""
    from ciera_runtime import kernels, rans

    data = (np.array(symbols, dtype=np.int64) // skew).astype(np.uint8)  # fewer symbols: real frequencies
    stream = bytearray(rans.encode(data, chunk_symbols=chunk_symbols))
    if damage is not None:
        kind, where, value = damage
        if kind == "flip":
            stream[where % len(stream)] ^= value
        else:
            stream = stream[: max(0, len(stream) - 4 * where)]
    outcomes = []
    try:
        for forced in (False, True):
            kernels.use_parallel_detect(forced)
            try:
                outcomes.append(
                    ("bytes", rans.decode(bytes(stream), np.empty(data.size, np.uint8)).tobytes())
                )
            except rans.RansFormatError as error:
                outcomes.append(("error", str(error)))
    finally:
        kernels.use_parallel_detect(None)
    assert outcomes[0] == outcomes[1]
    if damage is None:
        assert outcomes[0] == ("bytes", data.tobytes())
