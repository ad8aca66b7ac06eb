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
    StalePayloadError,
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
    if where != "sign_mantissa":
        assert decoder.generation == 0  # cache untouched
    else:
        # Found in the merge pass, after the verified exponents were applied: the cache is right at
        # generation 1, so the next delta rebuilds exactly.
        assert decoder.generation == 1
        bits[17] ^= 0x0100
        np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)


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


# ---- caller-supplied buffers (issue: a larger out read past the cache, a smaller FP16 out was wrong)


@pytest.mark.parametrize(
    "make_out",
    [
        lambda n: np.empty(n + 1, np.uint16),
        lambda n: np.empty(n - 1, np.uint16),
        lambda n: np.empty(n, np.float32),
        lambda n: np.empty(2 * n, np.uint16)[::2],
        lambda n: np.empty((1, n), np.uint16),
        lambda n: [0] * n,
    ],
    ids=["larger", "smaller", "float32", "noncontiguous", "2d", "list"],
)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decode_rejects_an_out_buffer_that_is_not_numel_contiguous_16_bit(make_out, dtype: str) -> None:
    config = CodecConfig(block_size=256)
    encoder = ShardEncoder(SHARD_ID, NUMEL, dtype, SOURCE_RANK, config)
    decoder = ShardDecoder(SHARD_ID, SOURCE_RANK, NUMEL, dtype, config)
    payload = encoder.encode(np.random.default_rng(0).integers(0, 1 << 16, NUMEL, dtype=np.uint16))
    with pytest.raises(ValueError, match=f"shard {SHARD_ID}: out"):
        decoder.decode(payload, out=make_out(NUMEL))
    assert decoder.generation == 0  # nothing applied


def test_encode_into_a_reused_buffer_checks_its_size_and_type() -> None:
    encoder, decoder, bits = _codec()
    with pytest.raises(ValueError, match="payload buffer holds"):
        encoder.encode(bits, out=np.empty(encoder.layout.max_payload_bytes - 1, np.uint8))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        encoder.encode(bits, out=np.empty(encoder.layout.max_payload_bytes, np.uint16))
    buffer = np.full(encoder.layout.max_payload_bytes, 0xAB, np.uint8)  # stale bytes from a last gather
    payload = encoder.encode(bits, out=buffer)
    assert payload.base is buffer or np.shares_memory(payload, buffer)
    np.testing.assert_array_equal(decoder.decode(payload), bits)


def test_encoder_rejects_a_tensor_of_another_dtype_or_device() -> None:
    torch = pytest.importorskip("torch")
    encoder, _, bits = _codec()
    as_fp16 = torch.from_numpy(bits.view(np.int16).copy()).view(torch.float16)
    with pytest.raises(ValueError, match="dtype torch.float16, expected bf16"):
        encoder.encode(as_fp16)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        encoder.encode(torch.zeros(NUMEL))
    with pytest.raises(ValueError, match="is on meta"):
        encoder.encode(torch.empty(NUMEL, dtype=torch.bfloat16, device="meta"))


# ---- header fields are checked before they are used


def test_a_flipped_size_field_is_caught_by_the_header_crc_before_it_sizes_anything() -> None:
    from ciera_runtime.codec import HEADER_FORMAT

    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits).copy()
    exp_bytes_offset = struct.calcsize(HEADER_FORMAT[: HEADER_FORMAT.index("IIQIIQII") + 2])
    payload[exp_bytes_offset + 3] ^= 0x10  # exp_bytes += 2**28
    with pytest.raises(PayloadError, match="header CRC mismatch"):
        decoder.decode(payload)


def test_a_header_with_a_valid_crc_but_impossible_sizes_is_rejected() -> None:
    """A sender bug (not corruption): the CRC matches, the sizes are out of bounds."""
    import zlib

    from ciera_runtime.codec import HEADER_FORMAT

    encoder, decoder, bits = _codec()
    payload = encoder.encode(bits).copy()
    fields = list(struct.unpack_from(HEADER_FORMAT, payload.tobytes()))
    fields[11] = NUMEL + 1  # exp_bytes beyond what raw exponents cost
    header = bytearray(struct.pack(HEADER_FORMAT, *fields))
    struct.pack_into("<I", header, HEADER_BYTES - 4, zlib.crc32(header[: HEADER_BYTES - 4]))
    payload[:HEADER_BYTES] = np.frombuffer(bytes(header), np.uint8)
    with pytest.raises(PayloadError, match="at most"):
        decoder.decode(payload)


# ---- replay protection: sender epoch + generation


def test_a_replayed_old_full_payload_is_rejected_and_the_cache_does_not_go_back() -> None:
    encoder, decoder, bits = _codec()
    first = encoder.encode(bits).copy()  # generation 1, full
    decoder.decode(first)
    bits[3] ^= 0x0100
    np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)
    with pytest.raises(StalePayloadError, match="not newer"):
        decoder.decode(first)
    resync = encoder.encode_resync(bits, generation=1)  # an old resync: full, generation 1
    with pytest.raises(StalePayloadError):
        decoder.decode(resync)
    assert decoder.generation == 2
    bits[4000] ^= 0x0100
    np.testing.assert_array_equal(decoder.decode(encoder.encode(bits)), bits)  # still in step


def test_a_restarted_sender_is_accepted_and_its_old_incarnation_retired() -> None:
    encoder, decoder, bits = _codec()
    old_payload = encoder.encode(bits).copy()
    decoder.decode(old_payload)
    restarted = ShardEncoder(SHARD_ID, NUMEL, "bf16", SOURCE_RANK, encoder.config)  # new epoch, generation 0
    assert restarted.epoch != encoder.epoch
    np.testing.assert_array_equal(decoder.decode(restarted.encode(bits)), bits)
    assert decoder.epoch == restarted.epoch and encoder.epoch in decoder.retired_epochs
    later_from_old = encoder.encode(bits)  # a delayed payload of the old incarnation
    with pytest.raises(StalePayloadError, match="retired"):
        decoder.decode(later_from_old)


def test_a_payload_from_a_differently_configured_sender_is_rejected() -> None:
    encoder, _, bits = _codec()
    other = ShardDecoder(SHARD_ID, SOURCE_RANK, NUMEL, "bf16", CodecConfig(block_size=256, verify_every=3))
    with pytest.raises(PayloadError, match="codec configuration"):
        other.decode(encoder.encode(bits))


def test_rans_rejects_a_frequency_table_that_lists_a_symbol_twice() -> None:
    from ciera_runtime import rans

    stream = bytearray(rans.encode(np.array([1, 2, 2, 3] * 50, np.uint8)))
    entries = np.frombuffer(bytes(stream[12:24]), np.uint32).copy()  # (symbol << 16) | freq, 3 entries
    entries[1] = (entries[0] & 0xFFFF0000) | (entries[1] & 0xFFFF)  # second entry names symbol 1 again
    stream[12:24] = entries.tobytes()
    with pytest.raises(rans.RansFormatError, match="twice"):
        rans.decode(bytes(stream), np.empty(200, np.uint8))
