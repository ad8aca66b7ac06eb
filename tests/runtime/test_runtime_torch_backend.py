"""TorchBackend (torch tensor ops) gives byte for byte what CpuBackend (numba) gives: every protocol method,
the state it leaves behind (hash cache, last exponents), and whole payloads through ShardEncoder/Decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder, kernels, rans
from ciera_runtime.backend import available_backends, get_backend
from ciera_runtime.torch_backend import TorchBackend

BLOCK_SIZES = (1, 3, 8, 13, 16, 32, 64, 128, 256, 512)
# NaN (quiet, signalling, with payload, negative), infinities, signed zeros, subnormals, extremes.
SPECIAL_BF16 = (0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFFFF)
SPECIAL_FP16 = (0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFFFF)


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


@pytest.fixture(scope="module")
def tb() -> TorchBackend:
    return TorchBackend("cpu")


def _layout(is_fp16: bool) -> tuple[int, int]:
    if is_fp16:
        return kernels.FP16_EXP_SHIFT, kernels.FP16_EXP_MASK
    return kernels.BF16_EXP_SHIFT, kernels.BF16_EXP_MASK


def _bits(rng: np.random.Generator, numel: int, is_fp16: bool) -> np.ndarray:
    """Arbitrary 16-bit patterns with NaN/inf/zero/subnormal patterns planted at random places."""
    bits = rng.integers(0, 1 << 16, numel).astype(np.uint16)
    if numel:
        specials = np.array(SPECIAL_FP16 if is_fp16 else SPECIAL_BF16, dtype=np.uint16)
        where = rng.integers(0, numel, max(1, numel // 8))
        bits[where] = rng.choice(specials, where.size)
    return bits


def _perturbed(rng: np.random.Generator, bits: np.ndarray, is_fp16: bool, share: float) -> np.ndarray:
    """Exponent changes in a few places, plus sign/mantissa noise everywhere that detection must ignore."""
    exp_bits = 0x7C00 if is_fp16 else 0x7F80
    other = bits ^ (rng.integers(0, 1 << 16, bits.size).astype(np.uint16) & np.uint16(~exp_bits & 0xFFFF))
    hit = rng.random(bits.size) < share
    other[hit] ^= rng.integers(0, 1 << 16, int(hit.sum())).astype(np.uint16) & np.uint16(exp_bits)
    return other


def _sm_buffer(numel: int, is_fp16: bool, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """A sign+mantissa plane at byte ``offset`` of a buffer whose guard bytes must stay 0xA5."""
    size = kernels.sign_mantissa_bytes(numel, is_fp16)
    buffer = np.full(size + offset + 16, 0xA5, dtype=np.uint8)
    return buffer, buffer[offset : offset + size]


sizes = st.one_of(st.integers(0, 70), st.integers(71, 5000))


@settings(max_examples=60, deadline=None)
@given(
    numel=sizes,
    is_fp16=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 9),
)
def test_plane_kernels_and_checksum_match(cpu, tb, numel, is_fp16, seed, offset) -> None:
    rng = np.random.default_rng(seed)
    shift, mask = _layout(is_fp16)
    bits = _bits(rng, numel, is_fp16)
    exp_ref, exp = np.empty(numel, np.uint8), np.full(numel, 0xEE, np.uint8)
    cpu.extract_exponents(bits, shift, mask, exp_ref)
    tb.extract_exponents(bits, shift, mask, exp)
    assert exp.tobytes() == exp_ref.tobytes()

    buffer_ref, sm_ref = _sm_buffer(numel, is_fp16, offset)
    buffer, sm = _sm_buffer(numel, is_fp16, offset)  # odd offsets: no int64 view of the plane
    cpu.pack_sign_mantissa(bits, is_fp16, sm_ref)
    tb.pack_sign_mantissa(bits, is_fp16, sm)
    assert buffer.tobytes() == buffer_ref.tobytes()
    assert tb.checksum64(sm) == cpu.checksum64(sm_ref)
    assert (int(tb.checksum64_tensor(sm)) % (1 << 64)) == cpu.checksum64(sm_ref)

    out_ref, out = np.empty(numel, np.uint16), np.full(numel, 0x5A5A, np.uint16)
    checksum_ref = cpu.merge_planes_checked(exp_ref, sm_ref, shift, is_fp16, out_ref)
    checksum = tb.merge_planes_checked(exp, sm, shift, is_fp16, out)
    assert out.tobytes() == out_ref.tobytes() == bits.tobytes()
    assert checksum == checksum_ref

    # Out-of-range exponent bytes (a corrupt cache): both drop the bits above 16 the same way.
    garbage = rng.integers(0, 256, numel).astype(np.uint8)
    checksum_ref = cpu.merge_planes_checked(garbage, sm_ref, shift, is_fp16, out_ref)
    checksum = tb.merge_planes_checked(garbage, sm, shift, is_fp16, out)
    assert out.tobytes() == out_ref.tobytes() and checksum == checksum_ref

    if sm.size:  # a flipped plane bit changes both checksums alike
        sm[rng.integers(0, sm.size)] ^= np.uint8(1 << int(rng.integers(0, 8)))
        assert tb.checksum64(sm) == cpu.checksum64(sm) != checksum_ref


@settings(max_examples=60, deadline=None)
@given(
    numel=sizes,
    block_size=st.sampled_from(BLOCK_SIZES),
    is_fp16=st.booleans(),
    detector=st.sampled_from(["hash", "exact"]),
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.tuples(st.floats(0.0, 0.3), st.booleans()), min_size=3, max_size=5),
)
def test_fused_encode_matches_over_partial_changes(
    cpu, tb, numel, block_size, is_fp16, detector, seed, steps
) -> None:
    """Consecutive encodes (first one forced), so both change-detection states evolve; every output and
    the state left behind are compared after each step."""
    rng = np.random.default_rng(seed)
    shift, mask = _layout(is_fp16)
    n_blocks = (numel + block_size - 1) // block_size
    bits = _bits(rng, numel, is_fp16)
    state_ref = np.zeros((n_blocks, 2), np.uint64) if detector == "hash" else np.zeros(numel, np.uint8)
    state = state_ref.copy()
    for step, (share, force_all) in enumerate(steps):
        force_all = force_all or step == 0
        if step:
            bits = _perturbed(rng, bits, is_fp16, share)
        results = []
        for backend, detection in ((cpu, state_ref), (tb, state)):
            exp = np.full(numel, 0xEE, np.uint8)
            changed = np.full(n_blocks, 7, np.uint8)
            offset = 1 + 3 * step
            buffer, sm = _sm_buffer(numel, is_fp16, offset)
            if detector == "hash":
                checksum = backend.encode_planes_hash(
                    bits, shift, mask, is_fp16, block_size, detection, exp, changed, force_all, sm
                )
            else:
                checksum = backend.encode_planes_exact(
                    bits, shift, mask, is_fp16, block_size, exp, detection, changed, force_all, sm
                )
            results.append(
                (checksum, exp.tobytes(), changed.tobytes(), buffer.tobytes(), detection.tobytes())
            )
        assert results[1] == results[0], (step, [a == b for a, b in zip(*results, strict=True)])
        if force_all:
            assert changed.all()


@settings(max_examples=50, deadline=None)
@given(
    numel=st.integers(1, 3000),
    block_size=st.sampled_from(BLOCK_SIZES),
    seed=st.integers(0, 2**32 - 1),
    share=st.floats(0.0, 1.0),
)
def test_gather_and_scatter_blocks_match(cpu, tb, numel, block_size, seed, share) -> None:
    rng = np.random.default_rng(seed)
    n_blocks = (numel + block_size - 1) // block_size
    exp = rng.integers(0, 256, numel).astype(np.uint8)
    changed = rng.random(n_blocks) < share
    changed[-1] |= rng.random() < 0.5  # the partial last block often
    changed_blocks = np.flatnonzero(changed)
    offsets, values = kernels.changed_block_offsets(changed_blocks, block_size, numel)
    packed_ref, packed = np.full(values, 0xEE, np.uint8), np.full(values, 0x11, np.uint8)
    cpu.gather_blocks(exp, changed_blocks, offsets, block_size, packed_ref)
    tb.gather_blocks(exp, changed_blocks, offsets, block_size, packed)
    assert packed.tobytes() == packed_ref.tobytes()

    received = rng.integers(0, 256, values).astype(np.uint8)
    cache_ref, cache = exp.copy(), exp.copy()
    cpu.scatter_blocks(received, changed_blocks, offsets, block_size, cache_ref)
    tb.scatter_blocks(received, changed_blocks, offsets, block_size, cache)
    assert cache.tobytes() == cache_ref.tobytes()


@pytest.mark.parametrize("numel", [0, 1, 9, 4_000, 70_000])
def test_entropy_stage_matches(cpu, tb, numel: int) -> None:
    rng = np.random.default_rng(numel)
    weights = (rng.standard_normal(numel) * 0.02).astype(np.float32)
    data = ((weights.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    room = rans.max_encoded_bytes(numel)
    stream_ref, stream = np.zeros(room, np.uint8), np.zeros(room, np.uint8)
    length = cpu.ans_encode_into(data, stream_ref)
    assert tb.ans_encode_into(data, stream) == length
    assert stream[:length].tobytes() == stream_ref[:length].tobytes()
    as_tensor = torch.zeros(room, dtype=torch.uint8)
    assert tb.ans_encode_into(torch.from_numpy(data), as_tensor) == length
    assert as_tensor[:length].numpy().tobytes() == stream_ref[:length].tobytes()
    decoded = np.empty(numel, np.uint8)
    tb.ans_decode(stream_ref[:length].tobytes(), decoded)
    assert decoded.tobytes() == data.tobytes()
    if numel > 100:  # too small an output: both say so
        assert tb.ans_encode_into(data, np.zeros(16, np.uint8)) == cpu.ans_encode_into(
            data, np.zeros(16, np.uint8)
        )
        corrupt = stream_ref[:length].copy()
        corrupt[length // 2] ^= 0xFF
        with pytest.raises(rans.RansFormatError):
            tb.ans_decode(corrupt, np.empty(numel, np.uint8))


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("is_fp16", [False, True], ids=["bf16", "fp16"])
def test_large_shard_matches_both_numba_variants(cpu, tb, is_fp16: bool, parallel: bool) -> None:
    """Past numba's merge chunk (8192 values) and FP16 tail task (8192 words): its partial sums, serial
    or in parallel, give the checksum the torch backend computes in one reduction."""
    rng = np.random.default_rng(21)
    shift, mask = _layout(is_fp16)
    numel, block_size = 300_001, 256
    n_blocks = (numel + block_size - 1) // block_size
    first = _bits(rng, numel, is_fp16)
    kernels.use_parallel_detect(parallel)
    try:
        caches = [np.zeros((n_blocks, 2), np.uint64) for _ in range(2)]
        for bits, force_all in ((first, True), (_perturbed(rng, first, is_fp16, 0.001), False)):
            results = []
            for backend, cache in zip((cpu, tb), caches, strict=True):
                exp, changed = np.empty(numel, np.uint8), np.zeros(n_blocks, np.uint8)
                sm = np.empty(kernels.sign_mantissa_bytes(numel, is_fp16), np.uint8)
                checksum = backend.encode_planes_hash(
                    bits, shift, mask, is_fp16, block_size, cache, exp, changed, force_all, sm
                )
                out = np.empty(numel, np.uint16)
                merged = backend.merge_planes_checked(exp, sm, shift, is_fp16, out)
                results.append(
                    (checksum, merged, exp.tobytes(), changed.tobytes(), sm.tobytes(), out.tobytes())
                )
            assert results[1] == results[0]
            assert caches[1].tobytes() == caches[0].tobytes()
            assert 0 < int(np.frombuffer(results[0][3], np.uint8).sum()) <= n_blocks
    finally:
        kernels.use_parallel_detect(None)


def test_tensor_arguments_give_the_same_bytes(cpu, tb) -> None:
    """bf16 tensors in, tensors as outputs and state: same results as the numpy path."""
    weights = (torch.randn(5003, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    bits = weights.view(torch.int16).numpy().view(np.uint16)
    numel, block_size, n_blocks = 5003, 64, (5003 + 63) // 64
    cache_ref, exp_ref = np.zeros((n_blocks, 2), np.uint64), np.empty(numel, np.uint8)
    changed_ref = np.zeros(n_blocks, np.uint8)
    sm_ref = np.empty(numel, np.uint8)
    checksum_ref = cpu.encode_planes_hash(
        bits, 7, 0xFF, False, block_size, cache_ref, exp_ref, changed_ref, True, sm_ref
    )
    cache = torch.zeros((n_blocks, 2), dtype=torch.int64)
    exp = torch.empty(numel, dtype=torch.uint8)
    changed = torch.zeros(n_blocks, dtype=torch.bool)
    sm = torch.empty(numel, dtype=torch.uint8)
    checksum = tb.encode_planes_hash_tensor(
        weights, 7, 0xFF, False, block_size, cache, exp, changed, True, sm
    )
    assert checksum.dim() == 0 and checksum.dtype == torch.int64
    assert int(checksum) % (1 << 64) == checksum_ref
    assert cache.numpy().tobytes() == cache_ref.tobytes()
    assert exp.numpy().tobytes() == exp_ref.tobytes() and sm.numpy().tobytes() == sm_ref.tobytes()
    assert changed.all()
    out = torch.empty(numel, dtype=torch.bfloat16)
    assert tb.merge_planes_checked(exp, sm, 7, False, out) == checksum_ref
    assert torch.equal(out.view(torch.int16), weights.view(torch.int16))


def test_wrong_sized_plane_is_rejected(tb) -> None:
    with pytest.raises(ValueError, match="sm_out must be a uint8 array of 100 bytes"):
        tb.encode_planes_hash(
            np.zeros(100, np.uint16), 7, 0xFF, False, 8, np.zeros((13, 2), np.uint64), np.empty(100, np.uint8),
            np.zeros(13, np.uint8), False, np.empty(99, np.uint8),
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not fit"):
        tb.merge_planes_checked(
            np.zeros(10, np.uint8), np.zeros(10, np.uint8), 10, True, np.empty(10, np.uint16)
        )


def test_registered_by_name() -> None:
    assert get_backend("torch").name == "torch"
    assert isinstance(get_backend("torch"), TorchBackend)
    assert "torch" in available_backends()


def _weights_steps(dtype: torch.dtype, numel: int, steps: int, seed: int) -> list[np.ndarray]:
    """Real-ish weights (N(0, 0.02)) and optimizer-like steps that move a few percent of them."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(numel, generator=generator) * 0.02
    versions = []
    for step in range(steps):
        if step:
            moved = torch.rand(numel, generator=generator) < 0.05
            weights = weights - moved * torch.randn(numel, generator=generator) * 0.002
        versions.append(weights.to(dtype).view(torch.int16).numpy().view(np.uint16).copy())
    return versions


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize("detector", ["hash", "exact"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_end_to_end_payloads_are_identical_and_cross_decode(dtype: torch.dtype, detector: str) -> None:
    numel, block_size = 40_003, 64
    configs = {
        name: CodecConfig(block_size=block_size, detector=detector, verify_every=2, backend=name)
        for name in ("cpu", "torch")
    }
    encoders = {name: ShardEncoder(3, numel, dtype, 1, config) for name, config in configs.items()}
    encoders["torch"].epoch = encoders["cpu"].epoch  # the only random header field
    # Each decoder reads the other backend's payloads.
    decoders = {name: ShardDecoder(3, 1, numel, dtype, config) for name, config in configs.items()}
    versions = _weights_steps(dtype, numel, 4, seed=7)
    versions[2] = versions[1].copy()  # a step with no change at all
    versions[3][:100] = _bits(np.random.default_rng(1), 100, dtype == torch.float16)  # NaN/inf too
    for generation, bits in enumerate(versions, start=1):
        shard = torch.from_numpy(bits.view(np.int16)).view(dtype)
        payloads = {name: encoder.encode(shard).copy() for name, encoder in encoders.items()}
        assert payloads["torch"].tobytes() == payloads["cpu"].tobytes(), generation
        assert encoders["torch"].last_changed_blocks == encoders["cpu"].last_changed_blocks
        for reader, writer in (("cpu", "torch"), ("torch", "cpu")):
            decoded = decoders[reader].decode(payloads[writer].tobytes())
            assert decoded.tobytes() == bits.tobytes(), (generation, reader)
        if generation > 1:
            assert 0 <= encoders["cpu"].last_changed_blocks < encoders["cpu"].layout.n_blocks
    resync = {name: encoder.encode_resync(shard, generation=2).copy() for name, encoder in encoders.items()}
    assert resync["torch"].tobytes() == resync["cpu"].tobytes()
    # A resync carries the current shard stamped with an earlier generation: a fresh receiver rebuilds it.
    fresh = ShardDecoder(3, 1, numel, dtype, configs["cpu"])
    assert fresh.decode(resync["torch"]).tobytes() == versions[-1].tobytes()


@settings(max_examples=60, deadline=None)
@given(
    numel=sizes,
    block_size=st.sampled_from(BLOCK_SIZES),
    is_fp16=st.booleans(),
    entropy=st.sampled_from(["rans", "none"]),
    seed=st.integers(0, 2**32 - 1),
    shares=st.lists(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]), min_size=1, max_size=5),
)
def test_small_shard_one_call_passes_give_the_composed_bytes(
    numel, block_size, is_fp16, entropy, seed, shares
) -> None:
    """Below PARALLEL_MIN_VALUES the CPU backend encodes and rebuilds a payload in one compiled call each
    way (payload_passes.py); the torch backend composes the same steps from its methods. Every payload is
    byte-identical, decodes on the other side, and leaves both receivers with the same cache."""
    configs = {
        name: CodecConfig(block_size=block_size, detector="exact", entropy=entropy, backend=name)
        for name in ("cpu", "torch")
    }
    dtype = "fp16" if is_fp16 else "bf16"
    encoders = {name: ShardEncoder(5, numel, dtype, 2, config) for name, config in configs.items()}
    encoders["torch"].epoch = encoders["cpu"].epoch
    decoders = {name: ShardDecoder(5, 2, numel, dtype, config) for name, config in configs.items()}
    rng = np.random.default_rng(seed)
    bits = _bits(rng, numel, is_fp16)
    for step, share in enumerate(shares):
        if step:
            bits = _perturbed(rng, bits, is_fp16, share)
        if step == 2:
            for encoder in encoders.values():
                encoder.force_full()
        payloads = {name: encoder.encode(bits).copy() for name, encoder in encoders.items()}
        assert payloads["cpu"].tobytes() == payloads["torch"].tobytes(), step
        assert encoders["cpu"].last_changed_blocks == encoders["torch"].last_changed_blocks
        for reader, writer in (("cpu", "torch"), ("torch", "cpu")):
            assert decoders[reader].decode(payloads[writer]).tobytes() == bits.tobytes()
        assert decoders["cpu"].exp_cache.tobytes() == decoders["torch"].exp_cache.tobytes()


@settings(max_examples=120, deadline=None)
@given(
    numel=st.integers(1, 3000),
    block_size=st.sampled_from([1, 8, 64, 512]),
    seed=st.integers(0, 2**32 - 1),
    damage=st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
    fix_crc=st.booleans(),
)
def test_small_shard_one_call_rebuild_rejects_what_the_composed_one_rejects(
    numel, block_size, seed, damage, fix_crc
) -> None:
    """A damaged payload — with its bitmap/exponent CRC recomputed, so the damage reaches the bitmap and
    exponent checks — gives the same error (or the same values) through the one-call rebuild (cpu) and
    the composed one (torch), and the receivers' caches stay identical."""
    from ciera_runtime.codec import HEADER_BYTES, _meta_crc, parse_header
    from ciera_runtime.errors import PayloadError

    configs = {name: CodecConfig(block_size=block_size, backend=name) for name in ("cpu", "torch")}
    encoder = ShardEncoder(5, numel, "bf16", 2, configs["cpu"])
    decoders = {name: ShardDecoder(5, 2, numel, "bf16", config) for name, config in configs.items()}
    rng = np.random.default_rng(seed)
    bits = _bits(rng, numel, False)
    first = encoder.encode(bits).copy()
    for decoder in decoders.values():
        decoder.decode(first)
    payload = encoder.encode(_perturbed(rng, bits, False, 0.3)).copy()
    where, value = damage
    payload[HEADER_BYTES + where % (payload.size - HEADER_BYTES)] ^= value
    if fix_crc:  # let the damage through the CRC to the checks behind it (header CRC recomputed too)
        header = parse_header(payload, 5, 2)
        crc = _meta_crc(payload, encoder.layout, payload[encoder.layout.fixed_bytes :])
        fields = bytearray(payload[:HEADER_BYTES].tobytes())
        import struct
        import zlib

        offset = struct.calcsize("<4sHBBIIQQQIIQI")  # meta_crc32: after shard_crc32 (HEADER_FORMAT)
        assert struct.unpack_from("<I", fields, offset)[0] == header.meta_crc32
        struct.pack_into("<I", fields, offset, crc)
        struct.pack_into("<I", fields, HEADER_BYTES - 4, zlib.crc32(bytes(fields[: HEADER_BYTES - 4])))
        payload[:HEADER_BYTES] = np.frombuffer(bytes(fields), dtype=np.uint8)
    outcomes = {}
    for name, decoder in decoders.items():
        try:
            outcomes[name] = ("values", decoder.decode(payload.copy()).tobytes())
        except PayloadError as error:
            outcomes[name] = ("error", str(error))
    assert outcomes["cpu"] == outcomes["torch"]
    assert decoders["cpu"].exp_cache.tobytes() == decoders["torch"].exp_cache.tobytes()
    assert decoders["cpu"].generation == decoders["torch"].generation


@pytest.mark.parametrize("section", ["bitmap", "exponents"])
def test_a_damaged_bitmap_or_exponent_section_fails_its_crc_on_both_paths(section: str) -> None:
    """The one-call rebuild checks the bitmap/exponent CRC itself, first, as the composed path does: the
    same error, and the cache untouched (still at the first payload's generation)."""
    from ciera_runtime.errors import PayloadError

    configs = {name: CodecConfig(backend=name) for name in ("cpu", "torch")}
    encoder = ShardEncoder(5, 4096, "bf16", 2, configs["cpu"])
    decoders = {name: ShardDecoder(5, 2, 4096, "bf16", config) for name, config in configs.items()}
    rng = np.random.default_rng(3)
    bits = _bits(rng, 4096, False)
    first = encoder.encode(bits).copy()
    payload = encoder.encode(_perturbed(rng, bits, False, 0.3)).copy()
    layout = encoder.layout
    assert payload.size > layout.fixed_bytes  # a delta payload with coded exponents
    at = layout.bitmap_offset if section == "bitmap" else layout.fixed_bytes
    payload[at] ^= 0x10
    for decoder in decoders.values():
        decoder.decode(first)
        cache = decoder.exp_cache.copy()
        with pytest.raises(PayloadError, match="bitmap/exponent CRC mismatch: payload corrupted in transit"):
            decoder.decode(payload)
        assert decoder.exp_cache.tobytes() == cache.tobytes() and decoder.generation == 1
