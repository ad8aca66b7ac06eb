"""Property tests: any sequence of changes round-trips bit for bit, for both detectors and dtypes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder


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
