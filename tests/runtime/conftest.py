"""Session set-up for the runtime tests (pyproject's `pythonpath` makes the checkout importable)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compile_numba_kernels_once():
    """Compile (and cache) every codec kernel in this process before any test spawns gloo ranks, so the
    ranks load numba's cache instead of compiling the same kernels at once and racing on its files."""
    import numpy as np

    from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder, kernels

    bits = np.random.default_rng(0).integers(0, 1 << 16, 5000).astype(np.uint16)
    try:
        for parallel in (False, True):
            kernels.use_parallel_detect(parallel)
            for dtype in ("bf16", "fp16"):
                for detector in ("hash", "exact"):
                    config = CodecConfig(block_size=512, detector=detector)
                    encoder = ShardEncoder(0, bits.size, dtype, 1, config)
                    decoder = ShardDecoder(0, 1, bits.size, dtype, config)
                    changed = bits.copy()
                    changed[:10] ^= 0x0400
                    for version in (bits, changed):
                        np.testing.assert_array_equal(decoder.decode(encoder.encode(version)), version)
    finally:
        kernels.use_parallel_detect(None)
    yield
