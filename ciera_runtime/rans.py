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

``encode`` cuts a stream into chunks by :func:`choose_chunk_symbols` (an equal share for up to CHUNK_SHARES threads,
chunks of 2**15 .. 2**18 symbols); ``encode_into`` writes the stream straight into a caller's buffer.
The encoder keeps the 8 lane states in registers, renormalises without a branch and divides by a
float reciprocal (see ``_encode_step``); its output is byte-identical to the earlier integer-division
encoder for the same chunk size.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from ciera_runtime import kernels

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
LANES = 8
STATE_LOW = 1 << 16  # lower end of the normalised state interval
DEFAULT_CHUNK_SYMBOLS = 1 << 18  # the longest chunk encode chooses
MIN_CHUNK_SYMBOLS = 1 << 15  # the shortest chunk it cuts a stream into to spread it over threads
_MASK = PROB_SCALE - 1
_RENORM_BOUND = (STATE_LOW >> PROB_BITS) << 16  # times freq: states at or above it emit a word first


class RansFormatError(ValueError):
    """The byte stream is not a valid rANS stream (truncated or corrupted)."""


def normalize_frequencies(counts: np.ndarray) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to PROB_SCALE, every present symbol >= 1."""
    return _normalize_frequencies(np.ascontiguousarray(counts, dtype=np.int64))


@njit(cache=True, nogil=True)
def _normalize_frequencies(counts):
    freqs = np.zeros(256, dtype=np.int64)
    total = counts.sum()
    if total == 0:
        return freqs
    present = np.flatnonzero(counts)
    scaled = counts[present].astype(np.float64) * PROB_SCALE / total
    floors = np.floor(scaled)
    for k in range(present.size):
        freqs[present[k]] = max(1, np.int64(floors[k]))
    # Hand the rounding remainder out by largest fractional loss (greedy, keeps every freq >= 1); ties in
    # symbol order (a stable sort).
    deficit = PROB_SCALE - freqs.sum()
    if deficit > 0:
        order = present[np.argsort(-(scaled - floors), kind="mergesort")]
        for k in range(deficit):
            freqs[order[k % order.size]] += 1
    while deficit < 0:
        # Too many symbols rounded up to 1: take from the symbol where it costs least (largest freq).
        donor = present[np.argmax(freqs[present])]
        take = min(-deficit, freqs[donor] - 1)
        freqs[donor] -= take
        deficit += take
    return freqs


@njit(inline="always")
def _encode_step(x, symbol, bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p):
    """Encode one symbol into state x; chunk_words[p - 1] is the next free word (p is unsigned).

    Branch-free renormalisation: the low 16 bits are always stored at p - 1 and kept only when the state
    was at or above the symbol's bound (the caller guarantees p >= 1: at most one word per symbol).
    x // freq comes from a float multiply: floor((x + 0.5) / freq) is exact for x < 2**32, freq <= 4096
    (the fraction lies at least 0.5 / 4096 from an integer, the rounding error is below 2**-20), and the
    new state x + cum + q * (PROB_SCALE - freq) equals (q << PROB_BITS) + x % freq + cum.
    """
    emit = x >= bounds[symbol]
    chunk_words[p - np.uint64(1)] = x & 0xFFFF
    p -= np.uint64(emit)
    x >>= 16 * np.int64(emit)
    q = np.int64((np.float64(x) + 0.5) * inv_freqs[symbol])
    return x + cums[symbol] + q * cmpl_freqs[symbol], p


@njit(cache=True, nogil=True)
def _encode_chunk(data, bounds, inv_freqs, cums, cmpl_freqs, start, stop, words, states_out):
    """Encode data[start:stop] backwards into words[start:stop], filled from its end; returns the word
    count (the words are the last ones of that range). Lanes 0..7 live in registers."""
    chunk_data = data[start:stop]
    chunk_words = words[start:stop]
    size = chunk_data.size
    p = np.uint64(size)
    x = np.full(LANES, STATE_LOW, dtype=np.int64)
    full = size - size % LANES
    for i in range(size - 1, full - 1, -1):  # the partial last group: lanes 0 .. size % 8 - 1
        x[i - full], p = _encode_step(
            x[i - full], chunk_data[i], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p
        )
    x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
    x4, x5, x6, x7 = x[4], x[5], x[6], x[7]
    for group in range(full // LANES - 1, -1, -1):
        i = group * LANES
        x7, p = _encode_step(x7, chunk_data[i + 7], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x6, p = _encode_step(x6, chunk_data[i + 6], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x5, p = _encode_step(x5, chunk_data[i + 5], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x4, p = _encode_step(x4, chunk_data[i + 4], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x3, p = _encode_step(x3, chunk_data[i + 3], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x2, p = _encode_step(x2, chunk_data[i + 2], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x1, p = _encode_step(x1, chunk_data[i + 1], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
        x0, p = _encode_step(x0, chunk_data[i], bounds, inv_freqs, cums, cmpl_freqs, chunk_words, p)
    states_out[0], states_out[1], states_out[2], states_out[3] = x0, x1, x2, x3
    states_out[4], states_out[5], states_out[6], states_out[7] = x4, x5, x6, x7
    return size - np.int64(p)


@njit(parallel=True, cache=True, nogil=True)
def _encode_chunks(data, bounds, inv_freqs, cums, cmpl_freqs, chunk_symbols, words, word_counts, states):
    """Chunk c owns words[start:stop] (at most one word per symbol), filled from its end."""
    n = data.size
    for chunk in prange(word_counts.size):
        start = chunk * chunk_symbols
        stop = min(start + chunk_symbols, n)
        word_counts[chunk] = _encode_chunk(
            data, bounds, inv_freqs, cums, cmpl_freqs, start, stop, words, states[chunk]
        )


@njit(cache=True, nogil=True)
def _encode_chunks_serial(
    data, bounds, inv_freqs, cums, cmpl_freqs, chunk_symbols, words, word_counts, states
):
    """``_encode_chunks`` on the calling thread only (same chunks, same bytes)."""
    n = data.size
    for chunk in range(word_counts.size):
        start = chunk * chunk_symbols
        stop = min(start + chunk_symbols, n)
        word_counts[chunk] = _encode_chunk(
            data, bounds, inv_freqs, cums, cmpl_freqs, start, stop, words, states[chunk]
        )


@njit(inline="always")
def _put_u32(out, offset, value):
    out[offset] = value & 0xFF
    out[offset + 1] = (value >> 8) & 0xFF
    out[offset + 2] = (value >> 16) & 0xFF
    out[offset + 3] = (value >> 24) & 0xFF


@njit(cache=True, nogil=True)
def _write_stream(out, n, chunk_symbols, freqs, words, word_counts, states):
    """Lay the stream out in ``out`` (see the module docstring); returns its length, or -1 (nothing
    useful written) when it does not fit."""
    n_chunks = word_counts.size
    present_count = 0
    for symbol in range(256):
        present_count += freqs[symbol] > 0
    total = 12 + 4 * present_count + 4 * n_chunks
    for chunk in range(n_chunks):
        total += 4 * LANES + ((2 * word_counts[chunk] + 3) & ~3)
    if total > out.size:
        return -1
    _put_u32(out, 0, n)
    _put_u32(out, 4, chunk_symbols)
    _put_u32(out, 8, present_count)
    offset = 12
    for symbol in range(256):
        if freqs[symbol] > 0:
            _put_u32(out, offset, (symbol << 16) | freqs[symbol])
            offset += 4
    for chunk in range(n_chunks):
        _put_u32(out, offset, word_counts[chunk])
        offset += 4
    for chunk in range(n_chunks):
        for lane in range(LANES):
            _put_u32(out, offset, states[chunk, lane])
            offset += 4
        stop = min((chunk + 1) * chunk_symbols, n)
        count = word_counts[chunk]
        chunk_words = words[stop - count : stop]
        dst = out[offset : offset + 2 * count]
        for k in range(count):
            word = chunk_words[k]
            dst[2 * k] = word & 0xFF
            dst[2 * k + 1] = word >> 8
        offset += 2 * count
        if count % 2:
            out[offset] = 0
            out[offset + 1] = 0
            offset += 2
    return offset


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
def _decode_chunks_serial(words, word_starts, word_counts, states, table, chunk_symbols, out):
    """``_decode_chunks`` on the calling thread only (no parallel region to enter for one chunk)."""
    n = out.size
    bad = 0
    for chunk in range(word_counts.size):
        start = chunk * chunk_symbols
        stop = min(start + chunk_symbols, n)
        pos = word_starts[chunk]
        ok = _decode_chunk(words, pos, pos + word_counts[chunk], states[chunk], table, out, start, stop)
        bad += 0 if ok else 1
    return bad


@njit(cache=True, nogil=True)
def _histogram(data):
    """Byte counts; four interleaved counters so consecutive equal bytes do not wait on each other's
    increment. Serial: a parallel region costs more than the few hundred KB it counts (and, on a busy
    machine, waits for an unscheduled thread)."""
    counts = np.zeros((4, 256), dtype=np.int64)
    quads = data.size // 4
    for k in range(quads):
        counts[0, data[4 * k]] += 1
        counts[1, data[4 * k + 1]] += 1
        counts[2, data[4 * k + 2]] += 1
        counts[3, data[4 * k + 3]] += 1
    for k in range(4 * quads, data.size):
        counts[0, data[k]] += 1
    total = np.zeros(256, dtype=np.int64)
    for symbol in range(256):
        total[symbol] = counts[0, symbol] + counts[1, symbol] + counts[2, symbol] + counts[3, symbol]
    return total


def _pad4(n: int) -> int:
    return (n + 3) & ~3


# Chunk counts are rounded to a multiple of this, whatever the machine: the bytes on the wire then depend
# on the data alone (not on the calling thread's numba thread count, which differs between the CCP worker
# and the main thread), and 1, 2 or 4 threads all get equal shares.
CHUNK_SHARES = 4


def choose_chunk_symbols(n: int, threads: int = CHUNK_SHARES) -> int:
    """Symbols per chunk for ``n`` symbols: chunks of at most DEFAULT_CHUNK_SYMBOLS, as many as a multiple
    of ``threads`` so every thread gets an equal share, but none shorter than MIN_CHUNK_SYMBOLS (each chunk
    costs ~30 bytes: 8 lane states, its word count, padding). A multiple of LANES, so every chunk but the
    last has full lane groups."""
    return int(_chunk_symbols(n, threads))


@njit(cache=True, nogil=True)
def _chunk_symbols(n, threads):
    """``choose_chunk_symbols``, compiled (the one-call encoders choose inside numba)."""
    if n <= 0:
        return DEFAULT_CHUNK_SYMBOLS
    n_chunks = -(-n // DEFAULT_CHUNK_SYMBOLS)
    n_chunks = -(-n_chunks // threads) * threads
    n_chunks = max(1, min(n_chunks, n // MIN_CHUNK_SYMBOLS))
    per_chunk = -(-n // n_chunks)
    return min(DEFAULT_CHUNK_SYMBOLS, -(-per_chunk // LANES) * LANES)


def max_encoded_bytes(n: int, chunk_symbols: int | None = None) -> int:
    """Upper bound on the length of ``encode`` of n symbols (at most one 16-bit word per symbol)."""
    if n == 0:
        return 12
    chunk_symbols = chunk_symbols or choose_chunk_symbols(n)
    n_chunks = -(-n // chunk_symbols)
    return 12 + 4 * 256 + n_chunks * (4 + 4 * LANES + 2) + 2 * n


@njit(cache=True, nogil=True)
def _symbol_tables(freqs):
    """Per-symbol encoder tables: renormalisation bound, 1/freq, cumulative freq, PROB_SCALE - freq."""
    cums = np.zeros(256, dtype=np.int64)
    inv_freqs = np.zeros(256, dtype=np.float64)
    running = 0
    for symbol in range(256):
        cums[symbol] = running
        running += freqs[symbol]
        if freqs[symbol] > 0:
            inv_freqs[symbol] = 1.0 / freqs[symbol]
    return _RENORM_BOUND * freqs, inv_freqs, cums, PROB_SCALE - freqs


@njit(cache=True, nogil=True)
def _encode_serial_into(data, out, chunk_symbols):
    """The whole of ``encode_into`` on the calling thread, in one compiled call: histogram, frequencies,
    tables, chunks and layout (a small shard's stream costs ~10 us less than through the separate steps;
    the same bytes)."""
    n = data.size
    freqs = _normalize_frequencies(_histogram(data))
    bounds, inv_freqs, cums, cmpl_freqs = _symbol_tables(freqs)
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    words = np.empty(n, dtype=np.uint16)
    word_counts = np.zeros(n_chunks, dtype=np.int64)
    states = np.zeros((n_chunks, LANES), dtype=np.int64)
    _encode_chunks_serial(
        data, bounds, inv_freqs, cums, cmpl_freqs, chunk_symbols, words, word_counts, states
    )
    return _write_stream(out, n, chunk_symbols, freqs, words, word_counts, states)


def encode_into(data: np.ndarray, out: np.ndarray, chunk_symbols: int | None = None) -> int:
    """rANS-encode a uint8 array straight into ``out`` (uint8, e.g. a view into a payload buffer).

    Returns the stream length, or -1 when the stream would not fit in ``out`` (its content is then
    undefined: a caller that passed the raw size sends the bytes raw). ``chunk_symbols`` None picks
    :func:`choose_chunk_symbols` (the stream records it, so any choice decodes)."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    n = data.size
    if n == 0:
        if out.size < 12:
            return -1
        out[:12] = 0
        return 12
    if chunk_symbols is None:
        chunk_symbols = choose_chunk_symbols(n)
    if chunk_symbols <= 0:
        raise ValueError(f"chunk_symbols={chunk_symbols}: expected a positive integer")
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    # Chunks on all threads or on this one, chosen by measured speed like the detectors (a parallel region
    # waits for every thread, which on a busy machine can cost more than the encode); same bytes either way.
    parallel = n_chunks > 1 and kernels._choice.choose("ans_encode", n)
    if not parallel:
        start_s = time.perf_counter()
        length = int(_encode_serial_into(data, out, chunk_symbols))
        if n_chunks > 1:
            kernels._choice.record("ans_encode", False, n, time.perf_counter() - start_s)
        return length
    freqs = normalize_frequencies(_histogram(data))
    bounds, inv_freqs, cums, cmpl_freqs = _symbol_tables(freqs)
    words = np.empty(n, dtype=np.uint16)
    word_counts = np.zeros(n_chunks, dtype=np.int64)
    states = np.zeros((n_chunks, LANES), dtype=np.int64)
    start_s = time.perf_counter()
    _encode_chunks(data, bounds, inv_freqs, cums, cmpl_freqs, chunk_symbols, words, word_counts, states)
    kernels._choice.record("ans_encode", True, n, time.perf_counter() - start_s)
    return int(_write_stream(out, n, chunk_symbols, freqs, words, word_counts, states))


def encode(data: np.ndarray, chunk_symbols: int | None = None) -> bytes:
    """rANS-encode a uint8 array; the frequency table travels in the stream."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if chunk_symbols is None and data.size:
        chunk_symbols = choose_chunk_symbols(data.size)
    out = np.empty(max_encoded_bytes(data.size, chunk_symbols), dtype=np.uint8)
    length = encode_into(data, out, chunk_symbols)
    return out[:length].tobytes()


# Why a stream is invalid (the decoders' status; 0: valid), the message `decode` raises with.
_STREAM_ERRORS = {
    1: "rANS stream truncated inside its frequency table",
    2: "rANS frequency table does not sum to the probability scale",
    3: "rANS frequency table lists a symbol twice or out of order: corrupted data",
    4: "rANS stream truncated before a chunk's lane states",
    5: "rANS stream is {size} bytes, its tables describe {detail}",
    6: "rANS single-symbol stream carries words or moved states: corrupted data",
    7: "rANS stream inconsistent in {detail} chunk(s): corrupted data",
    8: "rANS stream of {size} bytes is too short or not 4-byte aligned",
    9: "rANS stream holds {detail} symbols, caller expects {expected}",
    10: "rANS header invalid: chunk_symbols={chunk_symbols}, present={present}",
}


def stream_error(status: int, detail: int, buf: np.ndarray, expected: int) -> RansFormatError:
    """The error for a decoder's non-zero ``status`` on stream ``buf`` (``expected``: the symbols the
    caller asked for)."""
    head = buf[:12].view(np.uint32) if buf.size >= 12 and buf.size % 4 == 0 else np.zeros(3, np.uint32)
    return RansFormatError(
        _STREAM_ERRORS[int(status)].format(
            size=buf.size,
            detail=int(detail),
            expected=expected,
            chunk_symbols=int(head[1]),
            present=int(head[2]),
        )  # fmt: skip
    )


@njit(inline="always")
def _get_u32(buf, offset):
    return (
        np.int64(buf[offset])
        | (np.int64(buf[offset + 1]) << 8)
        | (np.int64(buf[offset + 2]) << 16)
        | (np.int64(buf[offset + 3]) << 24)
    )


@njit(cache=True, nogil=True)
def _parse_stream(buf, n, chunk_symbols, present_count):
    """Check a stream's tables (header fields already checked: n > 0, chunk_symbols > 0, 0 < present <=
    256) and locate its chunks: (status, detail, decode table, lane states, word starts (in 16-bit words),
    word counts, the symbol of a one-symbol stream or -1)."""
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    table = np.empty(PROB_SCALE, dtype=np.uint32)
    states = np.empty((n_chunks, LANES), dtype=np.int64)
    word_starts = np.empty(n_chunks, dtype=np.int64)
    word_counts = np.empty(n_chunks, dtype=np.int64)
    offset = 12
    table_end = offset + 4 * present_count + 4 * n_chunks
    if buf.size < table_end:
        return 1, 0, table, states, word_starts, word_counts, -1
    total = 0
    for k in range(present_count):  # every symbol a byte, every frequency >= 1, summing to the scale
        listed = _get_u32(buf, offset + 4 * k)
        if listed >> 16 > 255 or listed & 0xFFFF < 1:
            return 2, 0, table, states, word_starts, word_counts, -1
        total += listed & 0xFFFF
    if total != PROB_SCALE:
        return 2, 0, table, states, word_starts, word_counts, -1
    previous, slot = -1, 0
    for k in range(present_count):  # symbols strictly increasing; slot -> freq << 20 | bias << 8 | symbol
        listed = _get_u32(buf, offset + 4 * k)
        symbol, freq = listed >> 16, listed & 0xFFFF
        if symbol <= previous:
            return 3, 0, table, states, word_starts, word_counts, -1
        previous = symbol
        for bias in range(freq):
            table[slot] = np.uint32((freq << 20) | (bias << 8) | symbol)
            slot += 1
    cursor = table_end
    for chunk in range(n_chunks):
        word_counts[chunk] = _get_u32(buf, offset + 4 * present_count + 4 * chunk)
        if cursor + 4 * LANES > buf.size:
            return 4, 0, table, states, word_starts, word_counts, -1
        for lane in range(LANES):
            states[chunk, lane] = _get_u32(buf, cursor + 4 * lane)
        cursor += 4 * LANES
        word_starts[chunk] = cursor // 2
        cursor += (2 * word_counts[chunk] + 3) & ~3
    if cursor != buf.size:
        return 5, cursor, table, states, word_starts, word_counts, -1
    if present_count == 1:
        # One symbol (frequency 4096): states never move and no words are written.
        for chunk in range(n_chunks):
            if word_counts[chunk] != 0:
                return 6, 0, table, states, word_starts, word_counts, -1
            for lane in range(LANES):
                if states[chunk, lane] != STATE_LOW:
                    return 6, 0, table, states, word_starts, word_counts, -1
        return 0, 0, table, states, word_starts, word_counts, _get_u32(buf, offset) >> 16
    return 0, 0, table, states, word_starts, word_counts, -1


@njit(cache=True, nogil=True)
def _decode_serial(buf, n, chunk_symbols, present_count, out):
    """``_parse_stream`` then every chunk on the calling thread, in one compiled call: (status, detail)."""
    status, detail, table, states, word_starts, word_counts, single = _parse_stream(
        buf, n, chunk_symbols, present_count
    )
    if status != 0:
        return status, detail
    if single >= 0:
        out[:] = single
        return 0, 0
    bad = _decode_chunks_serial(
        buf.view(np.uint16), word_starts, word_counts, states, table, chunk_symbols, out
    )
    return (7, bad) if bad else (0, 0)


@njit(cache=True, nogil=True)
def decode_checked(buf, out):
    """``decode`` on the calling thread, every check included, in one compiled call (for callers inside
    numba): (status, detail), status 0 when ``out`` holds the stream's symbols (``stream_error`` turns
    any other into the error ``decode`` raises)."""
    if buf.size < 12 or buf.size % 4:
        return 8, 0
    n, chunk_symbols, present_count = _get_u32(buf, 0), _get_u32(buf, 4), _get_u32(buf, 8)
    if out.size != n:
        return 9, n
    if n == 0:
        return 0, 0
    if chunk_symbols <= 0 or not 0 < present_count <= 256:
        return 10, 0
    return _decode_serial(buf, n, chunk_symbols, present_count, out)


def decode(stream: bytes | memoryview | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a stream made by :func:`encode`; raises RansFormatError on truncated or corrupted input."""
    buf = np.frombuffer(stream, dtype=np.uint8) if not isinstance(stream, np.ndarray) else stream
    if buf.size < 12 or buf.size % 4:
        raise stream_error(8, 0, buf, -1 if out is None else out.size)
    buf = np.ascontiguousarray(buf)
    n, chunk_symbols, present_count = (int(v) for v in buf[:12].view(np.uint32))
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    elif out.size != n:
        raise stream_error(9, n, buf, out.size)
    if n == 0:
        return out
    if chunk_symbols <= 0 or not 0 < present_count <= 256:
        raise stream_error(10, 0, buf, n)
    n_chunks = (n + chunk_symbols - 1) // chunk_symbols
    parallel = n_chunks > 1 and kernels._choice.choose("ans_decode", n)
    start_s = time.perf_counter()
    if parallel:
        status, detail, table, states, word_starts, word_counts, single = _parse_stream(
            buf, n, chunk_symbols, present_count
        )
        if status == 0 and single >= 0:
            out[:] = single
        elif status == 0:
            bad = _decode_chunks(
                buf.view(np.uint16), word_starts, word_counts, states, table, chunk_symbols, out
            )
            status, detail = (7, bad) if bad else (0, 0)
    else:
        status, detail = _decode_serial(buf, n, chunk_symbols, present_count, out)
    if n_chunks > 1:
        kernels._choice.record("ans_decode", parallel, n, time.perf_counter() - start_s)
    if status:
        raise stream_error(status, detail, buf, n)
    return out
