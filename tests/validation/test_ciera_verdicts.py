"""`ciera validate sim`'s verdict check: turning CIERA on, predicted faster or slower than its plain engine as
measured — each CIERA run against its own engine's run of the same cluster and depth, seen or held out."""

from __future__ import annotations

import pytest

from validation.cli import verdict_line
from validation.sim_check import ciera_verdicts

C = "emulated-2x2-200mbit"


def _held(system: str, layers: int, measured_s: float, predicted_s: float | None, cluster: str = C) -> dict:
    return {"cluster": cluster, "layers": layers, "system": system, "measured_s": measured_s,
            "predicted_s": predicted_s}  # fmt: skip


def test_each_ciera_run_is_compared_with_its_own_engine_and_the_side_of_one_is_counted() -> None:
    held = [
        _held("zero3", 2, 1.00, 1.10),
        _held("ciera", 2, 1.05, 1.00),  # measured 0.952× (slower), predicted 1.10× (faster): wrong side
        _held("fsdp", 2, 2.00, 2.00),
        _held("ciera-fsdp", 2, 1.60, 1.80),  # measured 1.25×, predicted 1.11×: same side
        _held("ciera", 4, 1.90, 1.85),  # its ZeRO-3 run was seen: compared with the replay
        _held("ciera-fsdp", 4, 3.0, 2.9),  # no FSDP2 run at L = 4: no pair
        _held("ciera", 6, 2.0, None),  # not predicted: no pair
        _held("zero3", 6, 2.2, 2.1),
    ]
    replay = [{"cluster": C, "layers": 4, "system": "zero3", "measured_s": 2.0, "replayed_s": 2.0}]
    verdicts = ciera_verdicts(held, replay)
    assert [(v["system"], v["layers"], v["plain_system"]) for v in verdicts] == [
        ("ciera", 2, "zero3"),
        ("ciera-fsdp", 2, "fsdp"),
        ("ciera", 4, "zero3"),
    ]
    first, second, third = verdicts
    assert first["measured_speedup"] == pytest.approx(1 / 1.05)
    assert first["predicted_speedup"] == pytest.approx(1.10)
    assert first["speedup_error"] == pytest.approx(1.10 * 1.05 - 1.0)
    assert not first["same_side"]
    assert second["same_side"] and second["predicted_speedup"] == pytest.approx(2.0 / 1.8)
    assert third["measured_speedup"] == pytest.approx(2.0 / 1.9)
    assert third["predicted_speedup"] == pytest.approx(2.0 / 1.85) and third["same_side"]

    line = verdict_line(verdicts)
    assert "in 2 of 3 pairs" in line
    assert "ciera on emulated-2x2-200mbit, L = 2: measured 0.952×, predicted 1.100×" in line
    assert "\n" not in line


def test_no_pair_is_said_so() -> None:
    assert ciera_verdicts([_held("ciera", 2, 1.0, 1.0)], []) == []
    assert "no held-out CIERA run" in verdict_line([])
