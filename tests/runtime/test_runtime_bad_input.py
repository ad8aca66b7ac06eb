"""Every bad payload raises an error naming shard and source rank; never silently wrong weights."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ciera_runtime import (
    ChecksumMismatchError,
    CodecConfig,
    OutOfStepError,
    PayloadError,
    ShardDecoder,
    ShardEncoder,
)
from ciera_runtime.codec import HEADER_BYTES

SHARD_ID, SOURCE_RANK, NUMEL = 11, 3, 5000


def _codec(**config) -> tuple[ShardEncoder, ShardDecoder, np.ndarray]:
    codec_config = CodecConfig(block_size=256, **config)
    encoder = ShardEncoder(SHARD_ID, NUMEL, "bf16", SOURCE_RANK, codec_config)
    decoder = ShardDecoder(SHARD_ID, SOURCE_RANK, NUMEL, "bf16", codec_config)
    weights = (np.random.default_rng(0).standard_normal(NUMEL) * 0.02).astype(np.float32)
    return encoder, decoder, (weights.view(np.uint32) >> 16).astype(np.uint16)


def _names_shard_and_rank(error: pytest.ExceptionInfo) -> None:
    assert f"shard {SHARD_ID} from rank {SOURCE_RANK}" in str(error.value)
    assert error.value.shard_id == SHARD_ID and error.value.source_rank == SOURCE_RANK


@pytest.mark.parametrize("where", ["header", "bitmap", "sign_mantissa", "exponents"])
def test_corrupted_payload_is_rejected(where: str) -> None:
    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits).copy()
    layout = encoder.layout
    offset = {
        "header": 40,
        "bitmap": layout.bitmap_offset,
        "sign_mantissa": layout.sign_mantissa_offset + 123,
        "exponents": layout.fixed_bytes + 20,
    }[where]
    payload[offset] ^= 0x5A
    with pytest.raises(PayloadError) as error:
        decoder.decode(payload)
    _names_shard_and_rank(error)
    assert decoder.generation == 0  # cache untouched


@pytest.mark.parametrize("keep_bytes", [0, HEADER_BYTES - 1, HEADER_BYTES + 10, -1])
def test_truncated_payload_is_rejected(keep_bytes: int) -> None:
    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits)
    with pytest.raises(PayloadError, match="truncated|bytes") as error:
        decoder.decode(payload[:keep_bytes])
    _names_shard_and_rank(error)


def test_wrong_magic_is_rejected() -> None:
    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits).copy()
    payload[:4] = np.frombuffer(b"XXXX", np.uint8)
    with pytest.raises(PayloadError, match="bad magic") as error:
        decoder.decode(payload)
    _names_shard_and_rank(error)


def test_wrong_format_version_is_rejected() -> None:
    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits).copy()
    payload[4:6] = np.frombuffer(struct.pack("<H", 99), np.uint8)
    with pytest.raises(PayloadError, match="format version 99") as error:
        decoder.decode(payload)
    _names_shard_and_rank(error)


def test_payload_of_another_shard_or_rank_is_rejected() -> None:
    _, decoder, bits = _codec()
    foreign = ShardEncoder(SHARD_ID + 1, NUMEL, "bf16", SOURCE_RANK, decoder.config)
    with pytest.raises(PayloadError, match="expected") as error:
        decoder.decode(foreign.encode(bits))
    _names_shard_and_rank(error)


def test_skipped_gather_is_out_of_step_then_a_full_payload_resyncs() -> None:
    encoder, decoder, bits = _codec()
    decoder.decode(encoder.encode(bits))
    bits[7] ^= 0x0100
    encoder.encode(bits)  # this gather never reaches the receiver
    bits[900] ^= 0x0100
    with pytest.raises(OutOfStepError, match="out of step") as error:
        decoder.decode(encoder.encode(bits))
    _names_shard_and_rank(error)
    np.testing.assert_array_equal(decoder.decode(encoder.encode_resync(bits)), bits)
    bits[4000] ^= 0x0080
    np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)  # back in step


def test_restarted_receiver_with_empty_cache_is_out_of_step() -> None:
    encoder, decoder, bits = _codec()
    decoder.decode(encoder.encode(bits))
    restarted = ShardDecoder(SHARD_ID, SOURCE_RANK, NUMEL, "bf16", decoder.config)
    with pytest.raises(OutOfStepError):
        restarted.decode(encoder.encode(bits))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_bit_flip_anywhere_in_a_payload_never_gives_wrong_weights(dtype: str) -> None:
    """Header, bitmap and exponents are covered by the CRC-32, the sign+mantissa plane by its 64-bit
    checksum; only alignment padding carries nothing, and flipping it changes no weight."""
    config = CodecConfig(block_size=256)
    encoder = ShardEncoder(SHARD_ID, 3001, dtype, SOURCE_RANK, config)
    bits = np.random.default_rng(1).integers(0, 1 << 16, 3001, dtype=np.uint16)
    payload = encoder.encode(bits)
    expected = ShardDecoder(SHARD_ID, SOURCE_RANK, 3001, dtype, config).decode(payload)
    rng = np.random.default_rng(2)
    rejected = 0
    for position in rng.choice(payload.size, size=300, replace=False):
        corrupted = payload.copy()
        corrupted[position] ^= np.uint8(1 << int(rng.integers(0, 8)))
        try:
            rebuilt = ShardDecoder(SHARD_ID, SOURCE_RANK, 3001, dtype, config).decode(corrupted)
        except PayloadError:
            rejected += 1
            continue
        assert np.array_equal(rebuilt, expected), f"flip at byte {position} rebuilt different weights"
    assert rejected >= 290  # all but the few padding bytes the draw may hit


def test_verify_mode_detects_a_wrong_rebuild_from_a_stale_cache() -> None:
    """What verify mode is for: a rebuild that every payload check passes but is still wrong, as a
    hash collision in the sender's change detection would cause (the receiver's cache is stale)."""
    encoder, decoder, bits = _codec(verify_every=2)
    decoder.decode(encoder.encode(bits))  # generation 1: no checksum
    decoder.exp_cache[123] ^= 0x01  # stale exponent that the next delta does not resend
    payload = encoder.encode(bits)  # generation 2: checksum, no changed blocks
    with pytest.raises(ChecksumMismatchError) as error:
        decoder.decode(payload)
    _names_shard_and_rank(error)
    with pytest.raises(OutOfStepError):  # the cache is no longer trusted
        decoder.decode(encoder.encode(bits))


def test_encoder_rejects_a_shard_of_the_wrong_size() -> None:
    encoder, _, bits = _codec()
    with pytest.raises(ValueError, match="shard 11"):
        encoder.encode(bits[:-1])
