"""The bucket's capacity plan (replicated state, no collective needed): sizes from same-phase history, the
margin above the payloads' fixed floor, full-exponent gathers as outliers, candidate periods scored alike."""

from __future__ import annotations

from ciera_runtime.bucket import CALL_LAG, CAPACITY_MARGIN, CAPACITY_SLACK_BYTES, STEADY_HISTORY, Bucket

FLOOR, FIRST, REPEAT, FULL = 100_000, 104_000, 100_200, 140_000


def _bucket() -> Bucket:
    return Bucket(
        (1,), (100_000,), 7, initial_capacity_bytes=150_000, max_capacity_bytes=200_000, floor_bytes=FLOOR
    )


def _run(bucket: Bucket, phases: int, gathers: int) -> list[tuple[int, int]]:
    """Gathers of a cycle of `phases` (first one carries changes), the bucket's first full; one call each.
    Returns (capacity, message total) per gather."""
    out = []
    for index in range(gathers):
        call = index + 1
        capacity = bucket.capacity_for(call, index)
        total = FULL if index == 0 else FIRST if index % phases == 0 else REPEAT
        bucket.record(call, index, total, full=index == 0)
        out.append((capacity, total))
    return out


def test_steady_sizes_are_the_same_phase_totals_plus_a_margin_above_the_floor() -> None:
    for phases in (2, 3):
        sized = _run(_bucket(), phases, 40)
        # At most one overflow while two cycles of history cannot yet tell a 3-phase cycle from a 2-phase
        # one; none once they can.
        overflows = [index for index, (capacity, total) in enumerate(sized) if capacity < total]
        assert len(overflows) <= 1 and all(index < 12 for index in overflows), (phases, overflows)
        for capacity, total in sized[-12:]:
            padding = capacity - total
            assert padding <= (total - FLOOR) * CAPACITY_MARGIN + CAPACITY_SLACK_BYTES + 8, (phases, padding)


def test_the_full_first_gather_bounds_only_the_first_cycle() -> None:
    sized = _run(_bucket(), 2, 20)
    # Before a cycle of non-full gathers is known the full one's total bounds the size ...
    assert sized[2][0] >= FULL
    # ... and once it is, the full gather no longer inflates the rows.
    assert all(capacity < FIRST + (FIRST - FLOOR) for capacity, _ in sized[CALL_LAG + 4 :])


def test_a_longer_period_does_not_win_by_predicting_fewer_gathers() -> None:
    """A 2-phase cycle whose first-phase totals grow step by step (churn rising early in training): every
    period's predictions of first gathers fall short, so a period scored only where it has history (6
    predicts the fewest of the last 12 gathers) would win by counting fewer shortfalls. Scored on the same
    gathers, the true cycle wins."""
    bucket = _bucket()
    for index in range(17):
        total = FULL if index == 0 else FIRST + 2_000 * (index // 2) if index % 2 == 0 else REPEAT
        bucket.capacity_for(index + 1, index)
        bucket.record(index + 1, index, total, full=index == 0)
    bucket.capacity_for(18, 17)
    assert bucket._period == 2


def test_history_is_the_finished_gathers_in_any_record_order() -> None:
    """The history takes the finished gathers as a prefix while records come in call order, and filters
    every entry once one came out of order: both give what a plain filter gives."""
    import random

    rng = random.Random(5)
    for in_order in (True, False):
        bucket = _bucket()
        entries = [(call, call - 1, rng.randint(FLOOR, FULL), rng.random() < 0.1) for call in range(1, 60)]
        if not in_order:
            rng.shuffle(entries)
        for entry in entries:
            bucket.record(*entry)
            call = entry[0] + rng.randint(0, 2 * CALL_LAG)
            finished = [e for e in bucket.totals if e[0] <= call - CALL_LAG]
            steady = [e for e in finished if not e[3]]
            chosen = steady if len(steady) >= STEADY_HISTORY else finished
            known, gathers, position = bucket._finished_history(call)
            assert known == {gather: total for _, gather, total, _ in chosen}
            assert gathers == sorted(known) and all(gathers[at] == g for g, at in position.items())
        assert bucket._in_call_order is in_order


class _ReferencePlan:
    """The capacity rule as first written (every call builds the whole history and scores periods from
    it): the oracle the bucket's faster reading of the same history must agree with, size for size."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.period: int | None = None
        self.chosen_at = -1

    def capacity_for(self, call: int, index: int) -> int:
        from ciera_runtime.bucket import CAPACITY_WINDOW, OVERFLOW_PENALTY_BYTES, _align8

        bucket = self.bucket
        finished = [entry for entry in bucket.totals if entry[0] <= call - CALL_LAG]
        steady = [entry for entry in finished if not entry[3]]
        known = {g: t for _, g, t, _ in (steady if len(steady) >= STEADY_HISTORY else finished)}
        if not known:
            return bucket.initial_capacity_bytes
        gathers = sorted(known)
        position = {g: at for at, g in enumerate(gathers)}

        def planned(largest: int) -> int:
            above = max(0, largest - bucket.floor_bytes)
            return min(
                bucket.max_capacity_bytes,
                _align8(bucket.floor_bytes + int(above * (1 + CAPACITY_MARGIN)) + CAPACITY_SLACK_BYTES),
            )

        def predict(target: int, period: int) -> int | None:
            if period == 0:
                end = position.get(target, len(gathers))
                window = gathers[max(0, end - CAPACITY_WINDOW) : end]
                return planned(max(known[g] for g in window)) if window else None
            largest = max(known.get(target - period, -1), known.get(target - 2 * period, -1))
            return planned(largest) if largest >= 0 else None

        if self.period is None or gathers[-1] // 4 != self.chosen_at:
            best, best_score = 0, float("inf")
            scored = gathers[-12:]
            fallback = [predict(g, 0) for g in scored]
            for period in range(7):
                overflows, used = 0, 0
                for g, other in zip(scored, fallback, strict=True):
                    size = (predict(g, period) if period else other) or other
                    if size is not None:
                        overflows += known[g] > size
                        used += size
                score = used + overflows * OVERFLOW_PENALTY_BYTES if used else float("inf")
                if score < best_score:
                    best, best_score = period, score
            self.period, self.chosen_at = best, gathers[-1] // 4
        return predict(index, self.period) or predict(index, 0) or bucket.initial_capacity_bytes


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(
    phases=st.integers(1, 4),
    totals=st.lists(st.integers(FLOOR - 500, 210_000), min_size=1, max_size=150),
    fulls=st.lists(st.booleans(), min_size=150, max_size=150),
    lags=st.lists(st.integers(0, 2 * CALL_LAG), min_size=150, max_size=150),
    shuffled=st.booleans(),
)
def test_the_steady_state_reading_gives_the_sizes_of_the_whole_history(
    phases, totals, fulls, lags, shuffled
) -> None:
    """However the totals, full gathers and finishing lags fall (and with records out of order, where the
    bucket builds the whole history), every planned size equals the reference rule's."""
    import random

    bucket, reference = _bucket(), None
    reference = _ReferencePlan(bucket)
    pending: list[tuple[int, int, int, bool]] = []
    rng = random.Random(len(totals))
    for index, total in enumerate(totals):
        call = index + 1
        assert bucket.capacity_for(call, index) == reference.capacity_for(call, index), index
        pending.append((call, index, total + (index % phases) * 37, fulls[index] or index == 0))
        # Gathers finish some calls later (never more than CALL_LAG behind: starting a call finishes them).
        while pending and (len(pending) > CALL_LAG or lags[index] == 0):
            batch = [pending.pop(0)]
            if shuffled and pending and rng.random() < 0.2:
                batch.insert(0, pending.pop(0))  # recorded out of order
            for entry in batch:
                bucket.record(*entry)
            if lags[index] != 0:
                break
