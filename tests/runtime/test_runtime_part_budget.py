"""The per-step budget of pipelined parts (ciera_runtime.bucket.PartBudget): the first step cuts nothing,
then the largest calls get their parts within max(EXTRA_CALLS_PER_STEP, EXTRA_CALLS_SHARE × calls) extra
collectives per step — decided from the calls alone, so every rank that sees the same calls cuts alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_runtime.bucket import (
    EXTRA_CALLS_PER_STEP,
    EXTRA_CALLS_SHARE,
    MAX_PARTS,
    PartBudget,
    parts_wanted,
)

MIB = 1 << 20


def _run(budget: PartBudget, step: list[tuple[object, int]], steps: int) -> list[list[int]]:
    """Parts per call of `steps` identical steps."""
    out = []
    for _ in range(steps):
        budget.start_step()
        out.append([budget.parts(key, raw) for key, raw in step])
    return out


def test_parts_wanted_follows_the_part_size_and_the_cap() -> None:
    assert parts_wanted(4 * MIB - 1, 2 * MIB) == 1  # under twice the part size: whole
    assert parts_wanted(4 * MIB, 2 * MIB) == 2
    assert parts_wanted(100 * MIB, 2 * MIB) == MAX_PARTS
    assert parts_wanted(100 * MIB, 0) == 1  # 0: never cut


def test_the_first_step_is_whole_then_the_largest_calls_get_parts_within_the_budget() -> None:
    # 12 calls a step: two of 16 MiB (want 8 parts each), one of 6 MiB (wants 3), the rest small.
    step = [("a", 16 * MIB), ("b", 6 * MIB), ("a2", 16 * MIB)] + [(f"s{i}", MIB) for i in range(9)]
    budget = PartBudget(2 * MIB)
    first, second, third = _run(budget, step, 3)
    assert first == [1] * 12
    # Budget max(4, int(0.1 × 12)) = 4 extra calls: all to the first 16 MiB call (first seen of the
    # two largest), 5 parts; none left for the others.
    assert second == third == [5, 1, 1] + [1] * 9
    assert budget.describe() == {
        "planned_step_calls": 12, "extra_calls_per_step": 4, "budget_per_step": 4, "plans": 1,
    }  # fmt: skip


def test_a_step_with_other_calls_is_planned_again_from_that_step() -> None:
    # DeepSpeed's first step gathers module by module (it records its trace); from the second it
    # coalesces prefetch buckets: other keys. The plan follows the calls the engine now makes.
    first = [(f"m{i}", 3 * MIB) for i in range(4)]
    later = [("bucket0", 12 * MIB), ("bucket1", 12 * MIB)]
    budget = PartBudget(2 * MIB)
    parts = []
    for step in (first, later, later, later):
        budget.start_step()
        parts.append([budget.parts(key, raw) for key, raw in step])
    assert parts[0] == [1] * 4
    assert parts[1] == [1, 1]  # planned from the first step's calls: these are not among them
    assert parts[2] == parts[3] == [5, 1]  # planned from the second: 4 extra to the first large call
    assert budget.describe()["plans"] == 2


def test_a_call_made_several_times_a_step_pays_its_extra_parts_each_time() -> None:
    # Forward and backward gather the same 16 MiB call: 3 extra parts each would cost 6 > 4.
    step = [("a", 16 * MIB), ("x", MIB), ("a", 16 * MIB)]
    budget = PartBudget(2 * MIB)
    assert _run(budget, step, 2)[1] == [3, 1, 3]  # 2 extra × 2 calls = 4
    assert budget.describe()["extra_calls_per_step"] == 4


def test_many_calls_earn_a_share_and_unknown_calls_stay_whole() -> None:
    step = [(i, 8 * MIB) for i in range(100)]  # 100 calls: budget int(0.1 × 100) = 10
    budget = PartBudget(2 * MIB)
    parts = _run(budget, step, 2)[1]
    assert sum(p - 1 for p in parts) == 10 and parts[:4] == [4, 4, 4, 2]
    assert budget.parts("never seen", 64 * MIB) == 1


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=64 * MIB), min_size=1, max_size=60),
    part_bytes=st.sampled_from([0, 1 << 10, MIB, 2 * MIB]),
    repeats=st.lists(st.integers(min_value=1, max_value=3), min_size=60, max_size=60),
)
def test_property_within_budget_and_alike_for_every_rank(sizes, part_bytes, repeats) -> None:
    step = [(index, size) for index, size in enumerate(sizes) for _ in range(repeats[index])]
    ranks = [PartBudget(part_bytes) for _ in range(3)]
    plans = [_run(rank, step, 3) for rank in ranks]
    assert plans[0] == plans[1] == plans[2]  # the same calls: the same cuts on every rank
    first, second, third = plans[0]
    assert first == [1] * len(step) and second == third
    assert all(rank.describe()["plans"] == 1 for rank in ranks)  # the same calls every step: one plan
    extra = sum(p - 1 for p in second)
    assert extra <= max(EXTRA_CALLS_PER_STEP, int(EXTRA_CALLS_SHARE * len(step)))
    for (_, size), parts in zip(step, second, strict=True):
        assert 1 <= parts <= parts_wanted(size, part_bytes)
