"""Cluster presets and the collective cost model against hand-computed ring α–β values."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from sim import CollectiveModel, SimInputError, busbw_Bps, list_clusters, load_cluster, parse_overrides
from sim.collectives import algbw_Bps

TESTBED = "a100-hdr-testbed"


def test_packaged_preset_loads_and_is_listed() -> None:
    preset = load_cluster(TESTBED)
    assert TESTBED in list_clusters()
    assert preset.gpus_per_node == 8
    assert preset.ciera.block_size == 512
    assert preset.calibration[0].busbw_Bps == 8e9


def test_overrides_are_coerced_to_the_field_type() -> None:
    preset = load_cluster(
        TESTBED, {"inter_node.beta_Bps": "25e9", "ciera.block_size": "256", "gpus_per_node": "4"}
    )
    assert preset.inter_node.beta_Bps == 25e9
    assert preset.ciera.block_size == 256 and isinstance(preset.ciera.block_size, int)
    assert preset.gpus_per_node == 4
    assert load_cluster(TESTBED, {"ciera.reuse_across_gathers": "false"}).ciera.reuse_across_gathers is False


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"nosuch": "1"}, "unknown field 'nosuch'"),
        ({"ciera.nosuch": "1"}, "unknown field 'ciera.nosuch'"),
        ({"ciera.block_size": "many"}, "expected an integer"),
        ({"ciera.block_size": "2.5"}, "expected an integer"),
        ({"ciera.block_size": "0"}, "expected > 0"),
        ({"inter_node.beta_Bps": "-1"}, "expected >= 0"),
        ({"inter_node.beta_Bps": "nan"}, "expected a finite number"),
        ({"compute.efficiency": "1.5"}, "expected a value in [0, 1]"),
        ({"ciera": "1"}, "is a table"),
        ({"calibration": "1"}, "list of points"),
    ],
)
def test_bad_override_is_one_line_naming_field_and_value(overrides: dict[str, str], fragment: str) -> None:
    with pytest.raises(SimInputError) as caught:
        load_cluster(TESTBED, overrides)
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)


def test_parse_overrides() -> None:
    assert parse_overrides(["a.b=1", "c = x"]) == {"a.b": "1", "c": "x"}
    for bad in ("novalue", "=1", "a="):
        with pytest.raises(SimInputError, match="expected KEY=VALUE"):
            parse_overrides([bad])


def test_unknown_preset_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SimInputError, match="unknown preset 'nope'"):
        load_cluster("nope")
    with pytest.raises(SimInputError, match="no such preset file"):
        load_cluster(str(tmp_path / "missing.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [\n")
    with pytest.raises(SimInputError, match="not valid TOML"):
        load_cluster(str(broken))
    incomplete = tmp_path / "incomplete.toml"
    incomplete.write_text('name = "x"\ngpus_per_node = 4\n[intra_node]\nalpha_s = 1e-6\nbeta_Bps = 1e11\n')
    with pytest.raises(SimInputError, match="missing field 'inter_node'"):
        load_cluster(str(incomplete))
    typo = tmp_path / "typo.toml"
    typo.write_text(incomplete.read_text() + "[inter_node]\nalpha_s = 1e-5\nbeta_Bps = 1e10\nbetta = 1\n")
    with pytest.raises(SimInputError, match="unknown field 'inter_node.betta'"):
        load_cluster(str(typo))


def test_user_file_preset(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "mine"\ngpus_per_node = 4\n[intra_node]\nalpha_s = 1e-6\nbeta_Bps = 1e11\n'
        "[inter_node]\nalpha_s = 1e-5\nbeta_Bps = 1e10\n"
    )
    preset = load_cluster(str(path))
    assert preset.name == "mine" and preset.inter_node.beta_Bps == 1e10
    assert str(path) in preset.origin


def _explicit_model() -> CollectiveModel:
    preset = load_cluster(
        TESTBED,
        {
            "intra_node.alpha_s": "1e-5",
            "intra_node.beta_Bps": "200e9",
            "inter_node.alpha_s": "3e-5",
            "inter_node.beta_Bps": "10e9",
        },
    )
    return CollectiveModel.from_preset(preset)


def test_single_node_ring_matches_hand_computation() -> None:
    model = _explicit_model()
    size = 1 << 30
    # p = 4 ranks in one node: 3·α + 3/4 · S/β.
    assert model.allgather_s(size, 4) == pytest.approx(3 * 1e-5 + 0.75 * size / 200e9)
    assert model.allgather_s(size, 8) == pytest.approx(7 * 1e-5 + 7 / 8 * size / 200e9)
    assert model.allgather_s(size, 1) == 0.0


def test_two_level_ring_matches_hand_computation() -> None:
    model = _explicit_model()
    size = 256 * 2**20
    # W = 32 → M = 4 nodes of G = 8: inter ring 3·α_inter + 3/4·S/β_inter, then intra ring 7·α + 7/8·S/β.
    expected = 3 * 3e-5 + 0.75 * size / 10e9 + 7 * 1e-5 + 7 / 8 * size / 200e9
    assert model.allgather_s(size, 32) == pytest.approx(expected)
    assert model.reduce_scatter_s(size, 32) == pytest.approx(expected)
    assert model.all_reduce_s(size, 32) == pytest.approx(2 * expected)
    # hpZ: backward gathers stay inside the node.
    assert model.intra_node_allgather_s(size, 32) == pytest.approx(7 * 1e-5 + 7 / 8 * size / 200e9)


def test_busbw_follows_nccl_tests_definition() -> None:
    assert algbw_Bps(1e9, 0.5) == 2e9
    assert busbw_Bps("all_gather", 1e9, 0.5, 16) == pytest.approx(2e9 * 15 / 16)
    assert busbw_Bps("reduce_scatter", 1e9, 0.5, 4) == pytest.approx(2e9 * 3 / 4)
    assert busbw_Bps("all_reduce", 1e9, 0.5, 8) == pytest.approx(2e9 * 2 * 7 / 8)
    with pytest.raises(SimInputError):
        busbw_Bps("broadcast", 1, 1, 2)


def test_fit_reproduces_the_preset_calibration_point() -> None:
    preset = load_cluster(TESTBED)
    assert preset.inter_node.beta_Bps == 0
    model = CollectiveModel.from_preset(preset)
    point = preset.calibration[0]
    time_s = model.allgather_s(point.bytes, point.world_size)
    assert busbw_Bps("all_gather", point.bytes, time_s, point.world_size) == pytest.approx(8e9, rel=1e-9)
    assert model.inter_beta_source == "calibration"
    assert model.fit_relative_rms == pytest.approx(0.0, abs=1e-12)
    # Hand check: t = S·(15/16)/8e9; β = (S/2) / (t − α_inter − 7·α_intra − 7/8·S/β_intra).
    size = point.bytes
    t = size * 15 / 16 / 8e9
    beta = (size / 2) / (t - 2.5e-5 - 7 * 8e-6 - 7 / 8 * size / 240e9)
    assert model.inter_beta_Bps == pytest.approx(beta)


def test_measured_bundle_rows_take_precedence_over_preset_points() -> None:
    preset = load_cluster(TESTBED)
    truth = _explicit_model()
    rows = truth.collectives_rows(preset.name, [16, 32, 64], [2**24, 2**28], source="measured")
    model = CollectiveModel.from_preset(preset, rows)
    assert model.inter_beta_source == "measured"
    assert model.inter_beta_Bps != pytest.approx(10e9)  # α/β of the preset differ from `truth`'s intra level
    # Rows of another cluster or analytic rows are ignored.
    other = rows.assign(cluster="elsewhere")
    assert CollectiveModel.from_preset(preset, other).inter_beta_source == "calibration"
    analytic = rows.assign(source="analytic")
    assert CollectiveModel.from_preset(preset, analytic).inter_beta_source == "calibration"


def test_fit_recovers_beta_from_consistent_measurements() -> None:
    preset = load_cluster(
        TESTBED, {"intra_node.alpha_s": "1e-5", "intra_node.beta_Bps": "200e9", "inter_node.alpha_s": "3e-5"}
    )
    truth = _explicit_model()
    rows = truth.collectives_rows(preset.name, [16, 32, 128], [2**22, 2**26, 2**30], source="measured")
    model = CollectiveModel.from_preset(preset, rows)
    assert model.inter_beta_Bps == pytest.approx(10e9, rel=1e-9)
    assert model.fit_relative_rms == pytest.approx(0.0, abs=1e-9)


def test_fit_without_multi_node_points_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "nocal.toml"
    path.write_text(
        'name = "nocal"\ngpus_per_node = 8\n[intra_node]\nalpha_s = 1e-6\nbeta_Bps = 1e11\n'
        "[inter_node]\nalpha_s = 1e-5\nbeta_Bps = 0.0\n"
    )
    with pytest.raises(SimInputError, match="inter_node.beta_Bps"):
        CollectiveModel.from_preset(load_cluster(str(path)))


def test_collectives_rows_are_consistent() -> None:
    model = _explicit_model()
    frame = model.collectives_rows("c", [4, 16], [1 << 20])
    assert isinstance(frame, pd.DataFrame)
    assert set(frame["op"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    for row in frame.itertuples():
        assert row.algbw_Bps == pytest.approx(row.bytes / row.time_s)
        assert row.nodes == math.ceil(row.world_size / 8)


@pytest.mark.parametrize("world_size", [2, 4, 8, 16, 32, 64, 128])
def test_more_bandwidth_is_never_slower(world_size: int) -> None:
    slow = _explicit_model()
    fast = CollectiveModel.from_preset(
        load_cluster(
            TESTBED,
            {
                "intra_node.alpha_s": "1e-5",
                "intra_node.beta_Bps": "400e9",
                "inter_node.alpha_s": "3e-5",
                "inter_node.beta_Bps": "20e9",
            },
        )
    )
    for size in (1, 1 << 20, 1 << 30):
        assert fast.allgather_s(size, world_size) <= slow.allgather_s(size, world_size)
