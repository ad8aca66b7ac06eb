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
        _compile_bucket_passes()
    finally:
        kernels.use_parallel_detect(None)
    yield


def _compile_bucket_passes() -> None:
    """The one-call bucket passes (ciera_runtime/bucket_codec.py), with the argument types the bucket path
    gives them: a bucket of two shards encoded, then its row rebuilt as a received one."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder, bucket_codec, kernels
    from ciera_runtime.codec import DType

    kernels.use_parallel_detect(None)
    config = CodecConfig()
    numel, world = 3000, 2
    states = [
        SimpleNamespace(
            numel=numel, dtype=DType.BF16, torch_dtype=torch.bfloat16, compressed=True,
            encoder=ShardEncoder(shard, numel, "bf16", 1, config),
            decoders={1: ShardDecoder(shard, 1, numel, "bf16", config)},
        )
        for shard in range(2)
    ]  # fmt: skip
    encoder = bucket_codec.BucketEncoder(states, config)
    decoder = bucket_codec.BucketDecoder(encoder, (0, 1), config, world)
    shards = [(torch.randn(numel) * 0.02).to(torch.bfloat16) for _ in states]
    bits = encoder.flat_bits(shards)
    head = 64
    received = np.zeros((world, head + encoder.stream_bytes), dtype=np.uint8)
    length = encoder.encode([state.encoder for state in states], bits, received[1, head:])
    entries = tuple(k | s << 2 for k, s in zip(encoder.kinds.tolist(), encoder.sizes.tolist(), strict=True))
    headers = [SimpleNamespace(entries=entries)] * world
    out, _ = decoder.flat_output(None)
    failure, _ = decoder.decode(states, headers, received, head, 0, bits, out, lambda *_: None)
    assert failure is None and length > 0
