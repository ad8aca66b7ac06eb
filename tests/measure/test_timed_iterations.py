"""How many iterations a capture times (`--min-timed-s`): never fewer than asked, enough to fill the floor
at the warm-up's pace, never more than the cap; the plan refuses a floor that is not a number >= 0."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from measure.campaign import CapturePlan
from measure.capture import MAX_TIMED_ITERATIONS, timed_iterations
from measure.launch import CaptureError


@given(
    iterations=st.integers(1, 100),
    min_timed_s=st.floats(0.0, 1e4),
    pace_s=st.floats(1e-4, 1e3),
)
def test_the_count_fills_the_floor_within_the_bounds(
    iterations: int, min_timed_s: float, pace_s: float
) -> None:
    count = timed_iterations(iterations, min_timed_s, pace_s)
    assert count >= iterations
    assert count <= max(iterations, MAX_TIMED_ITERATIONS)
    # The floor is filled at the warm-up's pace, unless the cap (or the asked count) decides.
    assert count * pace_s >= min_timed_s * (1 - 1e-12) or count == max(iterations, MAX_TIMED_ITERATIONS)
    # One iteration fewer would not have filled it, unless the asked count decides.
    assert count == iterations or (count - 1) * pace_s < min_timed_s
    # A slower pace never times more iterations.
    assert timed_iterations(iterations, min_timed_s, pace_s * 2) <= count


def test_examples_and_what_leaves_the_count_alone() -> None:
    assert timed_iterations(6, 8.0, 0.28) == 29  # a 0.28 s iteration (1 Gbit, L = 2, on this host)
    assert timed_iterations(6, 8.0, 2.3) == 6  # a 200 Mbit L = 8 run: six already fill it
    assert timed_iterations(6, 8.0, 0.01) == MAX_TIMED_ITERATIONS
    for pace_s in (0.0, -1.0, math.nan, math.inf):
        assert timed_iterations(6, 8.0, pace_s) == 6  # no usable pace: what was asked
    assert timed_iterations(6, 0.0, 0.28) == 6  # no floor


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, True, "8"])
def test_the_plan_refuses_a_floor_that_is_not_seconds(value) -> None:
    with pytest.raises(CaptureError, match="--min-timed-s"):
        CapturePlan(min_timed_s=value).check()


def test_a_plan_recorded_before_the_floor_existed_is_the_same_plan(tmp_path) -> None:
    import json

    from measure.campaign import prepare_out_dir

    plan = CapturePlan(layers=(2,), systems=("zero3",))
    recorded = plan.to_json()
    recorded.pop("min_timed_s")
    (tmp_path / "plan.json").write_text(json.dumps(recorded))
    assert prepare_out_dir(plan, tmp_path) == []
    with pytest.raises(CaptureError, match="min_timed_s"):
        prepare_out_dir(CapturePlan(layers=(2,), systems=("zero3",), min_timed_s=8.0), tmp_path)
