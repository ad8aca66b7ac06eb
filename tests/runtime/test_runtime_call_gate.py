"""The per-call gate of BSC (selection.CallGate): a coalesced engine call goes through CIERA only where its
bytes saved pay its codec and CIERA's per-call thread time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ciera_runtime.selection import CallGate, CommProfile

SIZES = tuple(4**k for k in range(5, 12))
# A 200 Mbit-like link: 1 ms per collective, ~17 MB/s.
SLOW = CommProfile(SIZES, tuple(1e-3 + size / 17e6 for size in SIZES))
# Loopback-like: 80 us per collective, 2 GB/s.
FAST = CommProfile(SIZES, tuple(80e-6 + size / 2e9 for size in SIZES))


@given(st.floats(min_value=1.0, max_value=1e9, allow_nan=False))
def test_the_profiles_plain_python_interpolation_is_log_log(size_bytes: float) -> None:
    # CommProfile.comm_s runs at every engine call (CallGate), without numpy; numpy's log-log interpolation
    # (and the linear extrapolation beyond the sweep) is the reference.
    sizes, times = np.log(np.asarray(SIZES, dtype=float)), np.log(np.asarray(SLOW.time_s))
    if size_bytes >= SIZES[-1]:
        expected = SLOW.time_s[-1] * size_bytes / SIZES[-1]
    else:
        expected = float(np.exp(np.interp(np.log(size_bytes), sizes, times)))
    assert math.isclose(SLOW.comm_s(size_bytes), expected, rel_tol=1e-9)


def test_small_calls_go_to_the_engine_large_ones_through_ciera_on_a_slow_link() -> None:
    gate = CallGate(SLOW, 300e-6)
    # An expert of a fine-grained MoE: 3 KB per rank saves ~90 us of link, costs 300 us of thread.
    assert not gate.pays(3_000, 1_560, 20e-6)
    # A block of 400 KB per rank saves ~11 ms.
    assert gate.pays(400_000, 208_000, 1e-3)


def test_nothing_pays_on_loopback() -> None:
    gate = CallGate(FAST, 300e-6)
    for raw in (3_000, 400_000, 16 << 20):
        assert not gate.pays(raw, 0.52 * raw, 3e-9 * raw)


def test_a_split_call_weighs_its_saving_at_the_calls_whole_size() -> None:
    gate = CallGate(SLOW, 300e-6)
    raw, payload = 40_000, 20_800  # alone: saves ~1.1 ms of link for 0.3 ms of thread
    assert gate.pays(raw, payload, 50e-6)
    # Beside 1 MB on DeepSpeed's path (in flight together) the same bytes save the same link time.
    assert gate.pays(raw, payload, 50e-6, rest_bytes=1_000_000)
    saving_s = SLOW.comm_s(raw + 1_000_000) - SLOW.comm_s(payload + 1_000_000)
    assert 0.8 < saving_s / ((raw - payload) / 17e6) < 1.25  # the link's rate (log-log interpolated)
    # A 3 KB expert beside a 1 KB norm still does not pay its call.
    assert not gate.pays(3_000, 1_560, 20e-6, rest_bytes=1_000)


@pytest.mark.parametrize("per_call_s", [0.0, 300e-6, 5e-3])
def test_a_dearer_call_never_pays_where_a_cheaper_one_did_not(per_call_s: float) -> None:
    cheaper, dearer = CallGate(SLOW, per_call_s), CallGate(SLOW, per_call_s + 1e-4)
    for raw in (1_000, 10_000, 100_000, 1_000_000):
        assert not dearer.pays(raw, 0.52 * raw, 0.0) or cheaper.pays(raw, 0.52 * raw, 0.0)
