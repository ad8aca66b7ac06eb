"""`ciera validate sim`'s console, apart from the check itself (which tests/validation/test_validate_sim.py
runs in the heavy tier)."""

from __future__ import annotations

from validation.cli import grouped_notes


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
    assert grouped_notes(notes) == [
        "emulated-2x2-200mbit: transport CPU not measured by its collectives sweep",
        "runs a, b: transport CPU not recorded in the run",
        "2 CIERA calls per iteration have no op after them",
        "1–7 gathered buckets per iteration matched no run of parameters (by prediction)",
    ]
    assert grouped_notes([]) == []
