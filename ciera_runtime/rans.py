"""Interleaved rANS for bytes, in numba.

Format (little-endian, every field 4-byte aligned so the word arrays can be viewed in place)::

    u32 symbol_count          number of coded bytes (0: nothing else follows)
    u32 chunk_symbols         symbols per independently coded chunk (chunks decode in parallel)
    u32 present_count         symbols with non-zero frequency
    present_count x u32       (symbol << 16) | frequency, frequencies sum to 2**PROB_BITS
    n_chunks x u32            16-bit words written by each chunk
    per chunk: LANES x u32 final lane states, then its 16-bit words (padded to 4 bytes)

Each chunk interleaves ``LANES`` = 8 rANS states held in registers (symbol i of the chunk uses lane i % 8); states are 32 bits
in [2**16, 2**32) with 16-bit renormalisation, so one symbol emits at most one word.  Decoding checks that
every lane ends in the initial state and every word was consumed: a corrupted stream raises instead of
yielding wrong bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
LANES = 8
STATE_LOW = 1 << 16  # lower end of the normalised state interval
DEFAULT_CHUNK_SYMBOLS = 1 << 18
_MASK = PROB_SCALE - 1
_RENORM_BOUND = (STATE_LOW >> PROB_BITS) << 16  # times freq: states at or above it emit a word first


class RansFormatError(ValueError):
    """The byte stream is not a valid rANS stream (truncated or corrupted)."""


def normalize_frequencies(counts: np.ndarray) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to PROB_SCALE, every present symbol >= 1."""
    total = int(counts.sum())
    freqs = np.zeros(256, dtype=np.int64)
    present = np.flatnonzero(counts)
    if total == 0:
        return freqs
    scaled = counts[present].astype(np.float64) * PROB_SCALE / total
    freqs[present] = np.maximum(1, np.floor(scaled).astype(np.int64))
    # Hand the rounding remainder out by largest fractional loss (greedy, keeps every freq >= 1).
    deficit = PROB_SCALE - int(freqs.sum())
    if deficit > 0:
        order = present[np.argsort(-(scaled - np.floor(scaled)), kind="stable")]
        for k in range(deficit):
            freqs[order[k % order.size]] += 1
    while deficit < 0:
        # Too many symbols rounded up to 1: take from the symbol where it costs least (largest freq).
        donor = present[np.argmax(freqs[present])]
        take = min(-deficit, int(freqs[donor]) - 1)
        freqs[donor] -= take
        deficit += take
    return freqs


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_chunk(data, freqs, cums, start, stop, words, states_out):
    """Encode data[start:stop] backwards; its words end at words[stop]. Returns the word count."""
    pos = stop
    x = np.full(LANES, STATE_LOW, dtype=np.int64)
    for i in range(stop - 1, start - 1, -1):
        lane = (i - start) & (LANES - 1)
        state = x[lane]
        symbol = data[i]
        freq = freqs[symbol]
        if state >= _RENORM_BOUND * freq:
            pos -= 1
            words[pos] = state & 0xFFFF
            state >>= 16
        x[lane] = ((state // freq) << PROB_BITS) + (state % freq) + cums[symbol]
    for lane in range(LANES):
        states_out[lane] = x[lane]
    return stop - pos


@njit(parallel=True, cache=True, nogil=True)
def _encode_chunks(data, freqs, cums, chunk_symbols, words, word_counts, states):
    """Chunk c owns words[start:stop] (at most one word per symbol), filled from its end."""
    n = data.size
    for chunk in prange(word_counts.size):
        start = chunk * chunk_symbols
        stop = min(start + chunk_symbols, n)
        word_counts[chunk] = _encode_chunk(data, freqs, cums, start, stop, words, states[chunk])


@njit(inline="always")
def _decode_step(x, table):
    entry = table[
        x & _MASK
    ]  # freq << 20 | bias << 8 | symbol (freq < 4096: one-symbol streams never get here)
    return (entry >> 20) * (x >> PROB_BITS) + ((entry >> 8) & _MASK), entry & 0xFF


@njit(inline="always")
def _decode_renorm(x, table, words, pos):
    """One symbol and a branch-free renormalisation: words[pos] is read unconditionally (the caller
    guarantees it exists) and consumed only when the state fell below STATE_LOW. ``pos`` is unsigned so
    numba emits no negative-index wraparound for it."""
    x, symbol = _decode_step(x, table)
    word = np.int64(words[pos])
    low = x < STATE_LOW
    x = ((x << 16) | word) if low else x
    return x, pos + np.uint64(low), symbol


@njit(cache=True, nogil=True)
def _decode_chunk(words, pos, end, states, table, out, start, stop):
    """Decode out[start:stop]; returns True when the chunk's stream was consistent."""
    x0, x1, x2, x3 = np.int64(states[0]), np.int64(states[1]), np.int64(states[2]), np.int64(states[3])
    x4, x5, x6, x7 = np.int64(states[4]), np.int64(states[5]), np.int64(states[6]), np.int64(states[7])
    if min(min(min(x0, x1), min(x2, x3)), min(min(x4, x5), min(x6, x7))) < STATE_LOW:
        return False
    chunk_out = out[start:stop]
    chunk_words = words[pos:end]
    n_words = np.uint64(chunk_words.size)
    p = np.uint64(0)
    groups = chunk_out.size // LANES
    group = 0
    # Fast path: eight lanes in registers while at least eight words remain, so every read is in bounds.
    for group in range(groups):
        if p + np.uint64(LANES) > n_words:
            break
        i = group * LANES
        x0, p, chunk_out[i] = _decode_renorm(x0, table, chunk_words, p)
        x1, p, chunk_out[i + 1] = _decode_renorm(x1, table, chunk_words, p)
        x2, p, chunk_out[i + 2] = _decode_renorm(x2, table, chunk_words, p)
        x3, p, chunk_out[i + 3] = _decode_renorm(x3, table, chunk_words, p)
        x4, p, chunk_out[i + 4] = _decode_renorm(x4, table, chunk_words, p)
        x5, p, chunk_out[i + 5] = _decode_renorm(x5, table, chunk_words, p)
        x6, p, chunk_out[i + 6] = _decode_renorm(x6, table, chunk_words, p)
        x7, p, chunk_out[i + 7] = _decode_renorm(x7, table, chunk_words, p)
        group += 1
    i = start + group * LANES
    pos += np.int64(p)
    lane_state = np.array([x0, x1, x2, x3, x4, x5, x6, x7], dtype=np.int64)
    while i < stop:
        lane = (i - start) & (LANES - 1)
        x, out[i] = _decode_step(lane_state[lane], table)
        if x < STATE_LOW:
            if pos >= end:
                return False
            x = (x << 16) | words[pos]
            pos += 1
        lane_state[lane] = x
        i += 1
    return pos == end and lane_state.min() == STATE_LOW and lane_state.max() == STATE_LOW


@njit(parallel=True, cache=True, nogil=True)
def _decode_chunks(words, word_starts, word_counts, states, table, chunk_symbols, out):
    """Decode every chunk; returns the number of chunks whose stream was inconsistent (0 when valid)."""
    n = out.size
    n_chunks = word_counts.size
    bad = np.zeros(n_chunks, dtype=np.int64)
    for chunk in prange(n_chunks):
        start = chunk * chunk_symbols
        stop = min(start + chunk_symbols, n)
        pos = word_starts[chunk]
        ok = _decode_chunk(words, pos, pos + word_counts[chunk], states[chunk], table, out, start, stop)
        bad[chunk] = 0 if ok else 1
    return bad.sum()


@njit(cache=True, nogil=True)
def _histogram(data):
    counts = np.zeros(256, dtype=np.int64)
    for value in data:
        counts[value] += 1
    return counts


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def encode(data: np.ndarray, chunk_symbols: int = DEFAULT_CHUNK_SYMBOLS) -> bytes:
    """rANS-encode a uint8 array; the frequency table travels in the stream."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    n = data.size
    if n == 0:
        return np.zeros(3, dtype=np.uint32).tobytes()
    counts = _histogram(data)
    freqs = normalize_frequencies(counts)
    cums = np.zeros(256, dtype=np.int64)
    np.cumsum(freqs[:-1], out=cums[1:])
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    words = np.empty(n, dtype=np.uint16)
    word_counts = np.zeros(n_chunks, dtype=np.int64)
    states = np.zeros((n_chunks, LANES), dtype=np.int64)
    _encode_chunks(data, freqs, cums, chunk_symbols, words, word_counts, states)
    present = np.flatnonzero(freqs)
    parts = [
        np.array([n, chunk_symbols, present.size], dtype=np.uint32).tobytes(),
        ((present.astype(np.uint32) << 16) | freqs[present].astype(np.uint32)).tobytes(),
        word_counts.astype(np.uint32).tobytes(),
    ]
    for chunk in range(n_chunks):
        stop = min((chunk + 1) * chunk_symbols, n)
        chunk_words = words[stop - word_counts[chunk] : stop]
        parts.append(states[chunk].astype(np.uint32).tobytes())
        parts.append(chunk_words.tobytes())
        if chunk_words.size % 2:
            parts.append(b"\0\0")
    return b"".join(parts)


def decode(stream: bytes | memoryview | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a stream made by :func:`encode`; raises RansFormatError on truncated or corrupted input."""
    buf = np.frombuffer(stream, dtype=np.uint8) if not isinstance(stream, np.ndarray) else stream
    if buf.size < 12 or buf.size % 4:
        raise RansFormatError(f"rANS stream of {buf.size} bytes is too short or not 4-byte aligned")
    head = buf[:12].view(np.uint32)
    n, chunk_symbols, present_count = int(head[0]), int(head[1]), int(head[2])
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    elif out.size != n:
        raise RansFormatError(f"rANS stream holds {n} symbols, caller expects {out.size}")
    if n == 0:
        return out
    if chunk_symbols <= 0 or not 0 < present_count <= 256:
        raise RansFormatError(f"rANS header invalid: chunk_symbols={chunk_symbols}, present={present_count}")
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    offset = 12
    table_end = offset + 4 * present_count + 4 * n_chunks
    if buf.size < table_end:
        raise RansFormatError("rANS stream truncated inside its frequency table")
    table = buf[offset : offset + 4 * present_count].view(np.uint32)
    symbols = (table >> 16).astype(np.int64)
    freqs_present = (table & 0xFFFF).astype(np.int64)
    if symbols.max() > 255 or freqs_present.min() < 1 or freqs_present.sum() != PROB_SCALE:
        raise RansFormatError("rANS frequency table does not sum to the probability scale")
    if present_count > 1 and (np.diff(symbols) <= 0).any():
        raise RansFormatError("rANS frequency table lists a symbol twice or out of order: corrupted data")
    freqs = np.zeros(256, dtype=np.int64)
    freqs[symbols] = freqs_present
    cums = np.zeros(256, dtype=np.int64)
    np.cumsum(freqs[:-1], out=cums[1:])
    slot = np.arange(PROB_SCALE, dtype=np.int64)
    # slot -> freq << 20 | (slot - cumfreq) << 8 | symbol, 4 B per slot (16 KiB: stays in L1).
    table = (
        (np.repeat(freqs, freqs) << 20)
        | ((slot - np.repeat(cums, freqs)) << 8)
        | np.repeat(np.arange(256, dtype=np.int64), freqs)
    ).astype(np.uint32)
    word_counts = buf[offset + 4 * present_count : table_end].view(np.uint32).astype(np.int64)
    # Chunk c: LANES states then its words, padded to 4 bytes; locate all in the 16-bit word view.
    states = np.empty((n_chunks, LANES), dtype=np.int64)
    word_starts = np.empty(n_chunks, dtype=np.int64)
    cursor = table_end
    for chunk in range(n_chunks):
        if cursor + 4 * LANES > buf.size:
            raise RansFormatError("rANS stream truncated before a chunk's lane states")
        states[chunk] = buf[cursor : cursor + 4 * LANES].view(np.uint32)
        cursor += 4 * LANES
        word_starts[chunk] = cursor // 2
        cursor += _pad4(2 * int(word_counts[chunk]))
    if cursor != buf.size:
        raise RansFormatError(f"rANS stream is {buf.size} bytes, its tables describe {cursor}")
    if present_count == 1:
        # One symbol (frequency 4096): states never move and no words are written.
        if word_counts.any() or (states != STATE_LOW).any():
            raise RansFormatError("rANS single-symbol stream carries words or moved states: corrupted data")
        out[:] = symbols[0]
        return out
    words = buf.view(np.uint16)
    bad_chunks = _decode_chunks(words, word_starts, word_counts, states, table, chunk_symbols, out)
    if bad_chunks:
        raise RansFormatError(f"rANS stream inconsistent in {bad_chunks} chunk(s): corrupted data")
    return out
