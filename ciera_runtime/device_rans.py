"""The entropy stage of the device path: the project's rANS format (:mod:`ciera_runtime.rans`) encoded and
decoded on the device, with no host read and static shapes.

A stream made here is byte-identical to ``rans.encode(data, chunk_symbols=DEVICE_CHUNK_SYMBOLS)`` (so the host
decoder reads it, and this decoder reads the host's streams of that chunk size). What differs is only
where the work runs:

* the sizes a stream depends on (symbols, present symbols, chunks, words per chunk) stay on the device
  as 0-d / 1-d tensors; the layout is written with prefix sums and scatters (a spare slot past the end
  takes what is masked out), so no shape depends on the data and nothing is read on the host;
* the per-chunk loops — normalising the frequencies (one thread), encoding and decoding a chunk (one
  thread per chunk, its eight lanes interleaved as in the host format) — are plain Python functions
  compiled twice from the same source: by ``numba.cuda`` into CUDA kernels for tensors on a GPU (launched
  on torch's current stream), and by ``numba.njit`` (chunks in ``prange``) for tensors on the CPU. Under
  ``NUMBA_ENABLE_CUDASIM=1`` the CUDA kernels run in numba's simulator on CPU tensors: that is how CI
  runs the kernel code a GPU compiles (tests/runtime/test_runtime_device_rans.py).

Chunks are short (DEVICE_CHUNK_SYMBOLS symbols) so a shard has enough of them to spread over a GPU's
threads; each costs ~34 bytes of lane states and word count.

The decoder never trusts a length it reads: every offset is checked against the row it came from, a
chunk that would read past its words or end off its lanes' initial state is marked bad, and the caller
(the device payload) checks the rebuilt exponents' checksum as well.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from numba import njit, prange

from ciera_runtime.rans import LANES, PROB_BITS, PROB_SCALE, STATE_LOW, max_encoded_bytes

DEVICE_CHUNK_SYMBOLS = 4096  # a multiple of LANES: every chunk but the last has full lane groups
_MASK = PROB_SCALE - 1
_RENORM_BOUND = (STATE_LOW >> PROB_BITS) << 16  # times freq: states at or above it emit a word first
_U32 = (1 << 32) - 1


# ---- the per-item bodies: one source, compiled for the CPU (njit) and for CUDA (numba.cuda) ----------


def _normalize_body(counts, freqs, order, fracs, bounds, inv_freqs, cums, cmpl_freqs):
    """``rans.normalize_frequencies`` and the encoder's symbol tables, on one thread (256 symbols)."""
    total = 0
    for symbol in range(256):
        total += counts[symbol]
        freqs[symbol] = 0
    present = 0
    if total > 0:
        for symbol in range(256):
            if counts[symbol] > 0:
                scaled = np.float64(counts[symbol]) * np.float64(PROB_SCALE) / np.float64(total)
                floor = math.floor(scaled)
                freqs[symbol] = max(1, np.int64(floor))
                fracs[present] = scaled - floor
                order[present] = symbol
                present += 1
        deficit = PROB_SCALE
        for symbol in range(256):
            deficit -= freqs[symbol]
        if deficit > 0:
            # Largest fractional loss first, ties in symbol order: a stable insertion sort (as the host's
            # mergesort argsort of the negated fractions).
            for k in range(1, present):
                frac, symbol = fracs[k], order[k]
                j = k - 1
                while j >= 0 and fracs[j] < frac:
                    fracs[j + 1] = fracs[j]
                    order[j + 1] = order[j]
                    j -= 1
                fracs[j + 1] = frac
                order[j + 1] = symbol
            for k in range(deficit):
                freqs[order[k % present]] += 1
        while deficit < 0:
            donor = -1
            for symbol in range(256):  # the first present symbol with the largest frequency
                if counts[symbol] > 0 and (donor < 0 or freqs[symbol] > freqs[donor]):
                    donor = symbol
            take = min(-deficit, freqs[donor] - 1)
            freqs[donor] -= take
            deficit += take
    running = 0
    for symbol in range(256):
        freq = freqs[symbol]
        cums[symbol] = running
        running += freq
        bounds[symbol] = _RENORM_BOUND * freq
        cmpl_freqs[symbol] = PROB_SCALE - freq
        inv_freqs[symbol] = 1.0 / np.float64(freq) if freq > 0 else 0.0


def _encode_chunk_body(chunk, data, count, chunk_symbols, tables, inv_freqs, words, word_counts, states):
    """Encode data[start:stop] backwards into words[start:stop], filled from its end (the host's
    ``_encode_chunk``: symbol i of the chunk uses lane i % 8, a state at or above its symbol's bound emits
    its low 16 bits, x // freq from the float reciprocal). ``tables`` rows: bounds, cums, PROB_SCALE - freq."""
    start = chunk * chunk_symbols
    for lane in range(LANES):
        states[chunk, lane] = STATE_LOW
    word_counts[chunk] = 0
    if start >= count:
        return
    stop = min(start + chunk_symbols, count)
    p = stop
    for i in range(stop - 1, start - 1, -1):
        lane = (i - start) % LANES
        x = states[chunk, lane]
        symbol = data[i]
        if x >= tables[0, symbol]:
            words[p - 1] = x & 0xFFFF
            p -= 1
            x >>= 16
        q = np.int64((np.float64(x) + 0.5) * inv_freqs[symbol])
        states[chunk, lane] = x + tables[1, symbol] + q * tables[2, symbol]
    word_counts[chunk] = stop - p


def _decode_chunk_body(row, chunk, words, states32, chunks, table, symbols, chunk_symbols, lanes, bad):
    """Decode chunk ``chunk`` of row ``row`` into symbols[row, start:stop]; bad[row, chunk] = 1 when its
    stream is inconsistent. ``chunks[row]`` holds [n, row ok, then per chunk: u32 index of its lane
    states, u16 index of its first word, its word count]; every index is checked against the row."""
    bad[row, chunk] = 0
    n = chunks[row, 0]
    start = chunk * chunk_symbols
    if chunks[row, 1] == 0 or start >= n:
        return
    stop = min(start + chunk_symbols, n)
    at = 2 + 3 * chunk
    state_at, pos, count = chunks[row, at], chunks[row, at + 1], chunks[row, at + 2]
    end = pos + count
    if state_at < 0 or state_at + LANES > states32.shape[1] or pos < 0 or end > words.shape[1]:
        bad[row, chunk] = 1
        return
    for lane in range(LANES):
        x = np.int64(states32[row, state_at + lane]) & _U32
        if x < STATE_LOW:
            bad[row, chunk] = 1
            return
        lanes[row, chunk, lane] = x
    for i in range(start, stop):
        lane = (i - start) % LANES
        x = lanes[row, chunk, lane]
        entry = table[row, x & _MASK]  # freq << 20 | bias << 8 | symbol
        x = (entry >> 20) * (x >> PROB_BITS) + ((entry >> 8) & _MASK)
        symbols[row, i] = entry & 0xFF
        if x < STATE_LOW:
            if pos >= end:
                bad[row, chunk] = 1
                return
            x = (x << 16) | (np.int64(words[row, pos]) & 0xFFFF)
            pos += 1
        lanes[row, chunk, lane] = x
    if pos != end:
        bad[row, chunk] = 1
        return
    for lane in range(LANES):
        if lanes[row, chunk, lane] != STATE_LOW:
            bad[row, chunk] = 1


# ---- the CPU target ----------------------------------------------------------------------------------

_normalize_cpu = njit(cache=True, nogil=True)(_normalize_body)
_encode_chunk_cpu = njit(cache=True, nogil=True)(_encode_chunk_body)
_decode_chunk_cpu = njit(cache=True, nogil=True)(_decode_chunk_body)


@njit(parallel=True, cache=True, nogil=True)
def _encode_chunks_cpu(data, count, chunk_symbols, tables, inv_freqs, words, word_counts, states):
    for chunk in prange(word_counts.size):
        _encode_chunk_cpu(chunk, data, count, chunk_symbols, tables, inv_freqs, words, word_counts, states)


@njit(parallel=True, cache=True, nogil=True)
def _decode_chunks_cpu(words, states32, chunks, table, symbols, chunk_symbols, lanes, bad):
    rows, n_chunks = bad.shape
    for item in prange(rows * n_chunks):
        _decode_chunk_cpu(
            item // n_chunks,
            item % n_chunks,
            words,
            states32,
            chunks,
            table,
            symbols,
            chunk_symbols,
            lanes,
            bad,
        )


# ---- the CUDA target (compiled on first use: numba.cuda is imported only then) ------------------------
# The kernels are module-level functions that name ``cuda`` and the device functions as globals: numba's
# CUDA simulator swaps those globals for its own when it runs a kernel on the CPU.

cuda = None
_normalize_device = _encode_chunk_device = _decode_chunk_device = None
_cuda_kernels = None


def _normalize_kernel(counts, freqs, order, fracs, bounds, inv_freqs, cums, cmpl_freqs):
    if cuda.grid(1) == 0:
        _normalize_device(counts, freqs, order, fracs, bounds, inv_freqs, cums, cmpl_freqs)


def _encode_kernel(data, count, chunk_symbols, tables, inv_freqs, words, word_counts, states):
    chunk = cuda.grid(1)
    if chunk < word_counts.size:
        _encode_chunk_device(
            chunk, data, count[0], chunk_symbols, tables, inv_freqs, words, word_counts, states
        )


def _decode_kernel(words, states32, chunks, table, symbols, chunk_symbols, lanes, bad):
    item = cuda.grid(1)
    rows, n_chunks = bad.shape
    if item < rows * n_chunks:
        _decode_chunk_device(
            item // n_chunks,
            item % n_chunks,
            words,
            states32,
            chunks,
            table,
            symbols,
            chunk_symbols,
            lanes,
            bad,
        )


def _cuda():
    """numba.cuda and the three kernels, compiled from the bodies above on first use."""
    global cuda, _normalize_device, _encode_chunk_device, _decode_chunk_device, _cuda_kernels
    if _cuda_kernels is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda
        _normalize_device = cuda.jit(device=True)(_normalize_body)
        _encode_chunk_device = cuda.jit(device=True)(_encode_chunk_body)
        _decode_chunk_device = cuda.jit(device=True)(_decode_chunk_body)
        _cuda_kernels = (
            cuda,
            cuda.jit(_normalize_kernel),
            cuda.jit(_encode_kernel),
            cuda.jit(_decode_kernel),
        )
    return _cuda_kernels


def _use_cuda_kernels(device: torch.device) -> bool:
    """CUDA kernels for a GPU's tensors, and under numba's CUDA simulator (CI) for CPU tensors too."""
    return device.type == "cuda" or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _launch(kernel, threads: int, device: torch.device, *arrays):
    """Launch ``kernel`` over ``threads`` on torch's current stream (a GPU) or the simulator (CPU)."""
    cuda = _cuda()[0]
    block = 128
    grid = max(1, -(-threads // block))
    if device.type == "cuda":
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        kernel[grid, block, stream](
            # sync=False: the kernel runs on the stream that wrote the tensors, so numba need not wait for
            # it (its default would block the host on that stream at every launch).
            *[cuda.as_cuda_array(a, sync=False) if isinstance(a, torch.Tensor) else a for a in arrays]
        )
    else:
        kernel[grid, block](*[a.numpy() if isinstance(a, torch.Tensor) else a for a in arrays])


# ---- the stage -----------------------------------------------------------------------------------------


class DeviceRans:
    """rANS of uint8 tensors on their device: ``encode`` the first ``count`` bytes of a tensor (``count``
    a 0-d device tensor), ``decode_rows`` a batch of streams. No host read, shapes from static sizes."""

    def __init__(self, device: str | torch.device, chunk_symbols: int = DEVICE_CHUNK_SYMBOLS) -> None:
        if chunk_symbols < LANES or chunk_symbols % LANES:
            raise ValueError(f"chunk_symbols={chunk_symbols!r}: expected a positive multiple of {LANES}")
        self.device = torch.device(device)
        self.chunk_symbols = chunk_symbols
        self.cuda_kernels = _use_cuda_kernels(self.device)

    def max_stream_bytes(self, capacity: int) -> int:
        """The longest stream of up to ``capacity`` symbols, rounded to 8 bytes."""
        return (max_encoded_bytes(capacity, self.chunk_symbols) + 7) & ~7

    def _chunks(self, capacity: int) -> int:
        return max(1, -(-capacity // self.chunk_symbols))

    def encode(self, data: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream of ``data[:count]`` (uint8, ``max_stream_bytes(data.numel())`` bytes, zero past its
        end) and its length in bytes (0-d int64)."""
        device, capacity, chunk_symbols = self.device, data.numel(), self.chunk_symbols
        n_chunks = self._chunks(capacity)
        count = count.to(torch.int64).reshape(1)
        live = torch.arange(capacity, device=device) < count
        counts = torch.zeros(256, dtype=torch.int64, device=device)
        counts.scatter_add_(0, data.to(torch.int64), live.to(torch.int64))
        freqs = torch.empty(256, dtype=torch.int64, device=device)
        order = torch.empty(256, dtype=torch.int64, device=device)
        fracs = torch.empty(256, dtype=torch.float64, device=device)
        tables = torch.empty((3, 256), dtype=torch.int64, device=device)  # bounds, cums, PROB_SCALE - freq
        inv_freqs = torch.empty(256, dtype=torch.float64, device=device)
        words = torch.zeros(max(capacity, 1), dtype=torch.int32, device=device)
        word_counts = torch.empty(n_chunks, dtype=torch.int64, device=device)
        states = torch.empty((n_chunks, LANES), dtype=torch.int64, device=device)
        if self.cuda_kernels:
            _, normalize_kernel, encode_kernel, _ = _cuda()
            _launch(
                normalize_kernel,
                1,
                device,
                counts,
                freqs,
                order,
                fracs,
                tables[0],
                inv_freqs,
                tables[1],
                tables[2],
            )
            _launch(
                encode_kernel,
                n_chunks,
                device,
                data,
                count,
                chunk_symbols,
                tables,
                inv_freqs,
                words,
                word_counts,
                states,
            )
        else:
            _normalize_cpu(
                *(
                    t.numpy()
                    for t in (counts, freqs, order, fracs, tables[0], inv_freqs, tables[1], tables[2])
                )
            )
            _encode_chunks_cpu(
                data.numpy(),
                int(count.numpy()[0]),
                chunk_symbols,
                tables.numpy(),
                inv_freqs.numpy(),
                words.numpy(),
                word_counts.numpy(),
                states.numpy(),
            )
        return self._layout(count, freqs, words, word_counts, states, capacity)

    def _layout(self, count, freqs, words, word_counts, states, capacity):
        """Write the stream (rans module docstring) with scatters: every u32 / u16 a masked-out item would
        write lands on a spare slot past the end."""
        device, chunk_symbols = self.device, self.chunk_symbols
        n_chunks_max = word_counts.numel()
        stream_bytes = self.max_stream_bytes(capacity)
        buffer = torch.zeros(stream_bytes + 4, dtype=torch.uint8, device=device)
        out32, out16 = buffer.view(torch.int32), buffer.view(torch.int16)
        spare32, spare16 = out32.numel() - 1, out16.numel() - 1
        present_mask = freqs > 0
        present = present_mask.sum().reshape(1)
        n_chunks = (count + chunk_symbols - 1) // chunk_symbols
        chunk_ids = torch.arange(n_chunks_max, device=device)
        live = chunk_ids < n_chunks
        chunk_bytes = torch.where(live, 4 * LANES + ((2 * word_counts + 3) & ~3), 0)
        header_bytes = 12 + 4 * present + 4 * n_chunks
        starts = header_bytes + torch.cumsum(chunk_bytes, 0) - chunk_bytes  # each chunk's lane states
        length = header_bytes + chunk_bytes.sum()
        nonempty = (count > 0).to(torch.int64)
        head = torch.cat([count, chunk_symbols * nonempty, present])
        out32[:3] = _as_int32(head)
        symbols = torch.arange(256, device=device)
        slots = torch.where(present_mask, 2 + torch.cumsum(present_mask.to(torch.int64), 0), spare32)
        out32.scatter_(0, slots, _as_int32((symbols << 16) | freqs))
        out32.scatter_(0, torch.where(live, 3 + present + chunk_ids, spare32), _as_int32(word_counts))
        state_slots = torch.where(
            live.unsqueeze(1), starts.unsqueeze(1) // 4 + torch.arange(LANES, device=device), spare32
        )
        out32.scatter_(0, state_slots.reshape(-1), _as_int32(states.reshape(-1)))
        # Word i of the encode buffer belongs to chunk i // chunk_symbols; its kept words are the last
        # word_counts of the chunk's range, written after its lane states.
        index = torch.arange(words.numel(), device=device)
        chunk_of = torch.clamp(index // chunk_symbols, max=n_chunks_max - 1)
        stop = torch.minimum((chunk_of + 1) * chunk_symbols, count)
        first = stop - word_counts[chunk_of]
        kept = (index >= first) & (index < stop) & live[chunk_of]
        targets = torch.where(kept, (starts[chunk_of] + 4 * LANES) // 2 + index - first, spare16)
        out16.scatter_(0, targets, _as_signed(words.to(torch.int64), 16).to(torch.int16))
        buffer[-4:] = 0
        return buffer[:stream_bytes], length.reshape(())

    def decode_rows(
        self, streams: torch.Tensor, capacity: int, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode each row of ``streams`` (k, room) uint8 — a stream of ``lengths[r]`` bytes at its start —
        into (k, capacity) uint8 symbols (zero past each row's count), with the count of each row (k,) and
        whether each row is a consistent stream of this chunk size (k,)."""
        device, chunk_symbols = self.device, self.chunk_symbols
        rows, room = streams.shape
        n_chunks_max = self._chunks(capacity)
        width = ((room + 3) & ~3) + 4 * (3 + 256 + n_chunks_max)  # room for every header read, clamped
        padded = torch.zeros((rows, width), dtype=torch.uint8, device=device)
        padded[:, :room] = streams
        words32 = padded.view(torch.int32).to(torch.int64) & _U32  # (k, width / 4)
        last32 = words32.shape[1] - 1
        n, chunk_field, present = words32[:, 0], words32[:, 1], words32[:, 2]
        ok = (n <= capacity) & (lengths <= room) & (lengths >= 12) & (lengths % 4 == 0)
        ok &= (n == 0) | ((chunk_field == chunk_symbols) & (present >= 1) & (present <= 256))
        entries = words32[:, 3 : 3 + 256]
        listed = torch.arange(256, device=device) < present.unsqueeze(1)
        symbols_listed = entries >> 16
        freqs_listed = torch.where(listed, entries & 0xFFFF, 0)
        rising = (symbols_listed[:, 1:] > symbols_listed[:, :-1]) | ~listed[:, 1:]
        ok &= (n == 0) | (
            (torch.where(listed, symbols_listed <= 255, True).all(1))
            & (torch.where(listed, freqs_listed >= 1, True).all(1))
            & (freqs_listed.sum(1) == PROB_SCALE)
            & rising.all(1)
        )
        # The decode table: slot s -> the listed entry whose cumulative range holds s.
        ends = torch.cumsum(freqs_listed, 1)
        slots = torch.arange(PROB_SCALE, device=device).expand(rows, PROB_SCALE).contiguous()
        which = torch.searchsorted(ends, slots, right=True).clamp(max=255)
        freq = freqs_listed.gather(1, which)
        bias = slots - (ends.gather(1, which) - freq)
        table = (freq << 20) | ((bias & _MASK) << 8) | (symbols_listed.gather(1, which) & 0xFF)
        # Chunks: word counts after the entries, then each chunk's lane states and words.
        n_chunks = (n + chunk_symbols - 1) // chunk_symbols
        chunk_ids = torch.arange(n_chunks_max, device=device)
        live = chunk_ids < n_chunks.unsqueeze(1)
        counts_at = torch.clamp(3 + present.unsqueeze(1) + chunk_ids, max=last32)
        word_counts = torch.where(live, words32.gather(1, counts_at), 0)
        chunk_bytes = torch.where(live, 4 * LANES + ((2 * word_counts + 3) & ~3), 0)
        header_bytes = 12 + 4 * present + 4 * n_chunks
        starts = header_bytes.unsqueeze(1) + torch.cumsum(chunk_bytes, 1) - chunk_bytes
        ok &= (header_bytes + chunk_bytes.sum(1)) == lengths
        chunks = torch.empty((rows, 2 + 3 * n_chunks_max), dtype=torch.int64, device=device)
        chunks[:, 0] = torch.where(ok, n, 0)
        chunks[:, 1] = ok.to(torch.int64)
        chunks[:, 2::3] = starts // 4
        chunks[:, 3::3] = (starts + 4 * LANES) // 2
        chunks[:, 4::3] = word_counts
        # The kernels read only the stream's own bytes.
        aligned = padded[:, : (room + 3) & ~3].contiguous()
        words16, states32 = aligned.view(torch.int16), aligned.view(torch.int32)
        symbols = torch.zeros((rows, max(capacity, 1)), dtype=torch.uint8, device=device)
        lanes = torch.empty((rows, n_chunks_max, LANES), dtype=torch.int64, device=device)
        bad = torch.zeros((rows, n_chunks_max), dtype=torch.int64, device=device)
        if rows:
            if self.cuda_kernels:
                decode_kernel = _cuda()[3]
                _launch(
                    decode_kernel,
                    rows * n_chunks_max,
                    device,
                    words16,
                    states32,
                    chunks,
                    table,
                    symbols,
                    chunk_symbols,
                    lanes,
                    bad,
                )
            else:
                _decode_chunks_cpu(
                    words16.numpy(),
                    states32.numpy(),
                    chunks.numpy(),
                    table.numpy(),
                    symbols.numpy(),
                    chunk_symbols,
                    lanes.numpy(),
                    bad.numpy(),
                )
        ok &= bad.sum(1) == 0
        return symbols[:, :capacity], n, ok


def _as_signed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values (int64) as the signed values with the same bits (still int64): an
    explicit wrap, since an out-of-range narrowing cast is not defined alike on every device."""
    return values - (values >= (1 << (bits - 1))).to(torch.int64) * (1 << bits)


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """u32 values (int64, 0 .. 2**32 - 1) as the int32 with the same bits."""
    return _as_signed(values, 32).to(torch.int32)
