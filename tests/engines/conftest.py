"""Session set-up for the engine tests."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compile_numba_kernels_once():
    """Compile (and cache) the BF16 codec kernels in this process before any test spawns ranks, so the
    ranks load numba's cache instead of compiling the same kernels at once and racing on its files."""
    try:
        import numpy as np

        from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder
    except ImportError:  # the runtime extra is missing: the tests skip themselves
        yield
        return
    bits = np.random.default_rng(0).integers(0, 1 << 16, 5000).astype(np.uint16)
    config = CodecConfig()
    encoder = ShardEncoder(0, bits.size, "bf16", 1, config)
    decoder = ShardDecoder(0, 1, bits.size, "bf16", config)
    changed = bits.copy()
    changed[:10] ^= 0x0400
    for version in (bits, changed):
        np.testing.assert_array_equal(decoder.decode(encoder.encode(version)), version)
    yield
