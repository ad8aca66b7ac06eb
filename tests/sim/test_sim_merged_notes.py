"""sim.merged_notes: the consoles of `ciera simulate` (a measured cluster's projection) and `ciera validate
sim` say each note once."""

from __future__ import annotations

from sim import merged_notes


def test_the_console_says_each_note_once_with_its_runs_or_its_range() -> None:
    notes = [
        "run b: transport CPU not recorded in the run",
        "run a: transport CPU not recorded in the run",
        "run a: transport CPU not recorded in the run",  # the same run seen by two predictions
        "3 gathered buckets per iteration matched no run of parameters",
        "1 gathered buckets per iteration matched no run of parameters",
        "7 gathered buckets per iteration matched no run of parameters",
        "2 CIERA calls per iteration have no op after them",
        "2 CIERA calls per iteration have no op after them",
        "emulated-2x2-200mbit: transport CPU not measured by its collectives sweep",
    ]
    assert merged_notes(notes) == [
        "runs b, a: transport CPU not recorded in the run",
        "1–7 gathered buckets per iteration matched no run of parameters (by prediction)",
        "2 CIERA calls per iteration have no op after them",
        "emulated-2x2-200mbit: transport CPU not measured by its collectives sweep",
    ]
    # Subjects other than runs: a projection's target clusters.
    assert merged_notes(
        ["x-4x1: compute traced", "x-8x1: compute traced", "memory per rank: no activations"]
    ) == [
        "x-4x1, x-8x1: compute traced",
        "memory per rank: no activations",
    ]
    assert merged_notes([]) == []
