"""The device entropy stage (ciera_runtime/device_rans.py): its streams are byte-identical to the host rANS
of the same chunk size, both decoders read each other's streams, and a corrupted stream is never accepted
with symbols the host decoder would not give. The CPU target runs here; the CUDA kernels — the same bodies
compiled by numba.cuda — run in numba's CUDA simulator in a subprocess (the simulator is chosen when
numba is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ciera_runtime import rans  # noqa: E402
from ciera_runtime.device_rans import DeviceRans  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _exponent_like(rng: np.random.Generator, size: int, spread: float) -> np.ndarray:
    """Bytes shaped like changed exponents: a narrow bell around a centre, or uniform for spread 0."""
    if spread == 0:
        return rng.integers(0, 256, size, dtype=np.uint8)
    return np.clip(np.rint(rng.normal(120, spread, size)), 0, 255).astype(np.uint8)


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(0, 20_000),
    fill=st.floats(0, 1),
    spread=st.sampled_from([0.0, 0.01, 1.0, 3.0, 30.0]),
    chunk_symbols=st.sampled_from([8, 64, 4096]),
    seed=st.integers(0, 2**32 - 1),
)
def test_streams_are_the_host_rans_byte_for_byte(capacity, fill, spread, chunk_symbols, seed) -> None:
    rng = np.random.default_rng(seed)
    data = _exponent_like(rng, capacity, spread)
    count = int(capacity * fill)
    stage = DeviceRans("cpu", chunk_symbols)
    stream, length = stage.encode(torch.from_numpy(data.copy()), torch.tensor(count))
    assert stream.numel() == stage.max_stream_bytes(capacity)
    assert stream[int(length) :].eq(0).all()  # zero past its end: the payload's padding
    host = rans.encode(data[:count], chunk_symbols=chunk_symbols)
    assert stream[: int(length)].numpy().tobytes() == host
    np.testing.assert_array_equal(rans.decode(host), data[:count])
    symbols, n, ok = stage.decode_rows(stream.unsqueeze(0), capacity, length.reshape(1))
    assert bool(ok[0]) and int(n[0]) == count
    np.testing.assert_array_equal(symbols[0, :count].numpy(), data[:count])


def test_rows_of_different_sources_decode_in_one_batch() -> None:
    rng = np.random.default_rng(3)
    stage = DeviceRans("cpu", 64)
    capacity, counts = 700, [0, 1, 63, 64, 65, 700]
    rows, lengths, datas = [], [], []
    room = stage.max_stream_bytes(capacity) + 24  # a slot wider than any stream, as in a gather
    for count in counts:
        data = _exponent_like(rng, capacity, 2.0)
        stream, length = stage.encode(torch.from_numpy(data), torch.tensor(count))
        rows.append(torch.nn.functional.pad(stream, (0, room - stream.numel())))
        lengths.append(int(length))
        datas.append(data[:count])
    symbols, n, ok = stage.decode_rows(torch.stack(rows), capacity, torch.tensor(lengths))
    assert ok.all() and n.tolist() == counts
    for row, data in enumerate(datas):
        np.testing.assert_array_equal(symbols[row, : len(data)].numpy(), data)
        assert symbols[row, len(data) :].eq(0).all()


def _corrupt(rng: np.random.Generator, stream: bytes) -> tuple[bytes, int]:
    """One fault a flaky link or a hostile peer could produce, and the length the receiver is told."""
    data = bytearray(stream)
    kind = rng.integers(0, 5)
    if kind == 0:  # flipped bits anywhere
        for at in rng.integers(0, len(data), rng.integers(1, 4)):
            data[at] ^= 1 << int(rng.integers(0, 8))
        return bytes(data), len(data)
    if (
        kind == 1
    ):  # a header field rewritten (count, chunk size, present symbols, a table entry, a word count)
        field = int(rng.integers(0, min(len(data) // 4, 8)))
        value = int(rng.choice([0, 1, 255, 256, 4095, 4096, 2**31, 2**32 - 1, rng.integers(0, 2**32)]))
        data[4 * field : 4 * field + 4] = value.to_bytes(4, "little")
        return bytes(data), len(data)
    if kind == 2:  # truncated, the length told truthfully
        cut = 4 * int(rng.integers(0, len(data) // 4))
        return bytes(data[:cut]), cut
    if kind == 3:  # the length told wrong
        return bytes(data), int(rng.choice([0, 4, len(data) - 4, len(data) + 4, 2**40]))
    data[-4:] = bytes(4) if len(data) >= 16 else data[-4:]  # the last words zeroed
    return bytes(data), len(data)


def test_a_corrupted_stream_is_refused_or_decodes_as_the_host_decoder_does() -> None:
    """Device-accepted implies host-accepted with the same symbols; outcomes counted."""
    rng = np.random.default_rng(11)
    stage = DeviceRans("cpu", 64)
    outcomes = {"refused": 0, "accepted, equal to the host's": 0}
    for trial in range(300):
        capacity = int(rng.integers(1, 900))
        count = int(rng.integers(0, capacity + 1))
        data = _exponent_like(rng, capacity, float(rng.choice([0.5, 3.0, 0.0])))
        stream = rans.encode(data[:count], chunk_symbols=64)
        bad, told = _corrupt(rng, stream)
        room = max(len(bad), 4)
        row = torch.zeros((1, room), dtype=torch.uint8)
        row[0, : len(bad)] = torch.frombuffer(bytearray(bad), dtype=torch.uint8) if bad else row[0, :0]
        symbols, n, ok = stage.decode_rows(row, capacity, torch.tensor([told]))
        if not bool(ok[0]):
            outcomes["refused"] += 1
            continue
        host = rans.decode(np.frombuffer(bad[:told], dtype=np.uint8))  # raises if the host refuses
        assert int(n[0]) == host.size <= capacity, trial
        np.testing.assert_array_equal(symbols[0, : host.size].numpy(), host)
        outcomes["accepted, equal to the host's"] += 1
    print(outcomes)
    assert outcomes["refused"] > 150  # most faults are caught by the stage itself, the rest by checksums


def test_bad_chunk_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk_symbols=12: expected a positive multiple of 8"):
        DeviceRans("cpu", 12)


_SIMULATED = r"""
import numpy as np, torch
from ciera_runtime import rans
from ciera_runtime.device_rans import DeviceRans

stage = DeviceRans("cpu", 64)
assert stage.cuda_kernels, "the simulator did not take the CUDA kernels"
rng = np.random.default_rng(5)
cases = 0
for capacity, count, spread in [(0, 0, 2.0), (9, 9, 0.0), (200, 129, 3.0), (640, 640, 0.01), (700, 333, 0.0)]:
    data = np.clip(np.rint(rng.normal(120, spread, capacity)), 0, 255).astype(np.uint8) if spread else \
        rng.integers(0, 256, capacity, dtype=np.uint8)
    stream, length = stage.encode(torch.from_numpy(data.copy()), torch.tensor(count))
    assert stream[: int(length)].numpy().tobytes() == rans.encode(data[:count], chunk_symbols=64), capacity
    rows = torch.stack([stream, stream.clone()])
    rows[1, 2 * int(length) // 3] ^= 0x10  # a flipped bit in the second copy
    symbols, n, ok = stage.decode_rows(rows, capacity, torch.tensor([int(length)] * 2))
    assert bool(ok[0]) and int(n[0]) == count
    assert (symbols[0, :count].numpy() == data[:count]).all()
    if bool(ok[1]):  # accepted: then exactly what the host decoder makes of it
        host = rans.decode(rows[1, : int(length)].numpy())
        assert (symbols[1, : host.size].numpy() == host).all()
    cases += 1
print("simulated cases", cases)
"""


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_the_cuda_kernels_in_numbas_simulator_make_the_same_streams() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _SIMULATED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated cases 5" in done.stdout
