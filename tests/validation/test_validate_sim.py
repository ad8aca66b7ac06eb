"""`ciera validate sim`: held-out runs predicted by the same rewrites that make projections, categorised by
what was held out; the JSON contract; one-line errors for bad held-out files. The full check of the
shipped bundle is slow (`-m slow`); a small held-out set exercises every category quickly."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import traces
from validation.sim_check import (
    SCHEMA,
    HeldOut,
    ValidationInputError,
    category,
    default_held_out_path,
    load_held_out,
    measurement_noise,
    validate_sim,
)

pytestmark = pytest.mark.heavy  # predicts the whole shipped bundle (minutes): CI runs it with -m heavy

SEEN = "emulated-2x1-200mbit"


@pytest.fixture(scope="module")
def bundle(shipped_measured_bundle: traces.TraceBundle) -> traces.TraceBundle:
    return shipped_measured_bundle


def _small(bundle: traces.TraceBundle) -> traces.TraceBundle:
    """L = 2 runs of every cluster, and the exponent statistics: every category, small graphs."""
    runs = bundle.runs
    keep = set(runs[(runs["layers"] == 2) | ~runs["run_id"].isin(set(bundle.events["run_id"]))]["run_id"])
    tables = ("runs", "layers", "iterations", "exponents", "events", "shard_changes")
    return dataclasses.replace(
        bundle, **{t: bundle.table(t)[bundle.table(t)["run_id"].isin(keep)] for t in tables}
    )


@pytest.fixture(scope="module")
def small_document(bundle: traces.TraceBundle) -> dict:
    held = HeldOut(
        seen_clusters=(SEEN,),
        seen_layers=(2,),
        origin="test",
        seen_systems=("zero3", "fsdp"),
        codec_runs=(f"mixtral-8x7b-w32-ciera-L2-{SEEN}", f"mixtral-8x7b-w32-ciera-fsdp-L2-{SEEN}"),
    )
    return validate_sim(_small(bundle), held, 0.04)


def test_every_held_out_run_is_predicted_and_categorised(small_document: dict) -> None:
    document = small_document
    assert document["schema"] == SCHEMA
    assert document["replay_max_abs_error"] < 1e-6  # the seen runs replay exactly
    assert {row["system"] for row in document["replay"]} == {"zero3", "fsdp"}
    categories = {row["category"] for row in document["held_out"]}
    assert {"link", "topology", "system"} <= categories
    for row in document["held_out"]:
        assert row["predicted_s"] > 0 and row["basis"], row
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1.0)
        if row["category"] == "system":
            assert "CIERA written in" in row["basis"]
        if row["category"] in ("link", "topology"):
            assert "re-costed on " + row["cluster"] in row["basis"]
    errors = np.abs([row["error"] for row in document["held_out"]])
    assert document["held_out_mean_abs_error"] == pytest.approx(errors.mean())
    for name, mean in document["held_out_mean_abs_error_by_category"].items():
        in_category = [abs(r["error"]) for r in document["held_out"] if r["category"] == name]
        assert mean == pytest.approx(np.mean(in_category))
        assert document["held_out_max_abs_error_by_category"][name] == pytest.approx(max(in_category))
    figures = document["codec_figures"]["ciera"]
    assert figures["encode_s"][2] > 0 and figures["first_ratio"] > figures["repeat_ratio"] >= 0.5
    # Payload format 5 codes a changed block's exponents as deltas against the receivers' cache: most of
    # its values have delta 0, so rANS spends well under the ~2.6 bits of the exponents' own entropy.
    assert 0.2 < figures["changed_exponent_bits"] < 2.6
    assert figures["description"].startswith("encode ") and 0.0 <= figures["overflow_rate"] < 0.2
    assert document["passed"] == (
        document["replay_max_abs_error"] <= 0.01
        and document["held_out_mean_abs_error"] <= 0.04
        and document["held_out_max_abs_error"] <= 0.08
        and all(v <= 0.04 for v in document["held_out_mean_abs_error_by_category"].values())
    )


def test_every_held_out_ciera_run_beside_its_engine_gets_a_verdict(small_document: dict) -> None:
    """At L = 2 every cluster but the seen one has all four systems held out: one pair per CIERA run."""
    verdicts = small_document["ciera_verdicts"]
    ciera_runs = [r for r in small_document["held_out"] if r["system"] in ("ciera", "ciera-fsdp")]
    assert len(verdicts) == len(ciera_runs) > 0
    by_key = {(r["cluster"], r["layers"], r["system"]): r for r in small_document["held_out"]}
    for verdict in verdicts:
        ciera = by_key[(verdict["cluster"], verdict["layers"], verdict["system"])]
        plain = by_key[(verdict["cluster"], verdict["layers"], verdict["plain_system"])]
        assert verdict["measured_speedup"] == pytest.approx(plain["measured_s"] / ciera["measured_s"])
        assert verdict["predicted_speedup"] == pytest.approx(plain["predicted_s"] / ciera["predicted_s"])
    assert small_document["ciera_verdicts_on_the_measured_side"] == sum(v["same_side"] for v in verdicts)


def test_the_codec_runs_are_predicted_in_sample_and_kept_out_of_the_held_out_errors(
    small_document: dict,
) -> None:
    """The runs the codec figures are fitted to go through the same rewrite, from their plain engine's run:
    reported as the rewrite's in-sample error, never among the held-out rows or in their means."""
    document = small_document
    rows = document["codec_runs_in_sample"]
    assert {row["run_id"] for row in rows} == set(document["seen"]["codec_runs"])
    held_ids = {row["run_id"] for row in document["held_out"]}
    for row in rows:
        assert row["run_id"] not in held_ids
        assert row["predicted_s"] > 0 and "CIERA written in" in row["basis"]
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1.0)
        # Fitted to its own codec events: the rewrite reproduces it to within the runs' own noise.
        assert abs(row["error"]) < 0.15, row


def test_every_anchor_states_its_in_sample_calibration(
    small_document: dict, bundle: traces.TraceBundle
) -> None:
    """Each anchor a prediction used is listed once with the two factors fitted on its own run: what a
    reader needs to see that the predictions lean on the seen runs only."""
    anchors = small_document["anchor_calibration"]
    used = {row["basis"].split(" (")[0] for row in small_document["held_out"] if row["predicted_s"]}
    assert {row["anchor_run"] for row in anchors} == used
    assert len(anchors) == len(used)
    runs = bundle.runs.set_index("run_id")
    seen = small_document["seen"]
    for row in anchors:
        assert 0.25 <= row["compute_scale"] <= 4.0 and row["transport_scale"] > 0
        anchor = runs.loc[row["anchor_run"]]  # a seen run: a seen cluster and depth
        assert anchor["cluster"] in seen["clusters"] and int(anchor["layers"]) in seen["layers"]


def test_the_first_thing_no_seen_run_has_names_the_category() -> None:
    seen = pd.DataFrame([{"system": "zero3", "nodes": 2, "gpus_per_node": 1, "link_rate_Bps": 25e6}])

    def run(**changes) -> pd.Series:
        return pd.Series(
            {"system": "zero3", "nodes": 2, "gpus_per_node": 1, "link_rate_Bps": 25e6, **changes}
        )

    assert category(run(), seen) == "depth"
    assert category(run(link_rate_Bps=125e6), seen) == "link"
    assert category(run(nodes=3), seen) == "topology"
    assert category(run(gpus_per_node=2, link_rate_Bps=125e6), seen) == "topology"
    assert category(run(system="ciera", nodes=3), seen) == "system"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", r"table \[seen\] missing"),
        ("[seen]\nclusters = []\nlayers = [2]\n", "field 'seen.clusters'"),
        ("[seen]\nclusters = ['x']\nlayers = [0]\n", "field 'seen.layers'"),
        ("[seen]\nclusters = ['x']\nlayers = [2]\nsystems = 'zero3'\n", "field 'seen.systems'"),
        ("[seen]\nclusters = ['x']\nlayers = [2]\n[codec]\nruns = [1]\n", "field 'codec.runs'"),
        ("[seen\n", "cannot read"),
        ("[seen]\nlayers = [2]\n", "field 'seen.clusters' missing, expected"),
        ("[seen]\nclusters = ['x']\nlayers = [true]\n", "field 'seen.layers' is \\[True\\]"),
        ("codec = 3\n[seen]\nclusters = ['x']\nlayers = [2]\n", "'codec' is 3, expected a table"),
    ],
)
def test_bad_held_out_files_are_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "held.toml"
    path.write_text(text)
    with pytest.raises(ValidationInputError, match=expected):
        load_held_out(path)


def test_the_shipped_held_out_file_says_when_it_was_fixed() -> None:
    held = load_held_out(default_held_out_path())
    assert held.fixed and held.seen_systems == ("zero3", "fsdp") and len(held.codec_runs) == 2


def test_unknown_runs_and_nothing_held_out_are_refused(tmp_path: Path, bundle: traces.TraceBundle) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[seen]\nclusters = ['nope']\nlayers = [2]\n")
    with pytest.raises(ValidationInputError, match="seen cluster 'nope' is not in the bundle"):
        validate_sim(bundle, load_held_out(unknown), 0.04)
    # A typo in the seen systems or depths would hold out every run of them and fail far from the file.
    for lines, named in (
        ("layers = [2]\nsystems = ['zero9']", "seen system 'zero9'"),
        ("layers = [3]", "seen depth 3"),
    ):
        typo = tmp_path / "typo.toml"
        typo.write_text(f"[seen]\nclusters = ['{SEEN}']\n{lines}\n")
        with pytest.raises(ValidationInputError, match=f"{named} is not in the bundle"):
            validate_sim(bundle, load_held_out(typo), 0.04)
    codec = tmp_path / "codec.toml"
    codec.write_text(f"[seen]\nclusters = ['{SEEN}']\nlayers = [2]\n[codec]\nruns = ['nope']\n")
    with pytest.raises(ValidationInputError, match="codec run 'nope' is not in the bundle"):
        validate_sim(bundle, load_held_out(codec), 0.04)
    everything = tmp_path / "all.toml"
    clusters = sorted(set(bundle.runs["cluster"]))
    everything.write_text(f"[seen]\nclusters = {clusters!r}\nlayers = [2, 4, 6, 8]\n")
    with pytest.raises(ValidationInputError, match="nothing is held out"):
        validate_sim(bundle, load_held_out(everything), 0.04)


def test_measurement_noise_is_computed_from_the_measurements_alone(bundle: traces.TraceBundle) -> None:
    runs = bundle.runs[(bundle.runs["cluster"] == SEEN) & (bundle.runs["system"] == "fsdp")].copy()
    # Exactly linear in depth, with iterations 1.0 and 1.2 of the line's value: spread 0.2 / 1.1.
    iterations = pd.DataFrame(
        [
            {"run_id": r.run_id, "iteration": i, "iteration_s": (0.1 + 0.05 * r.layers) * factor}
            for r in runs.itertuples()
            for i, factor in enumerate((1.0, 1.2))
        ]
    )
    # Runs captured before the host-CPU record (the shipped ones have it: taken out here).
    unrecorded = bundle.runs.copy()
    unrecorded["versions"] = [
        json.dumps({k: v for k, v in json.loads(text).items() if k != "other_cpu_share"})
        for text in unrecorded["versions"]
    ]
    noise = measurement_noise(dataclasses.replace(bundle, runs=unrecorded, iterations=iterations), runs)
    assert noise["timed_iterations_per_run"] == 2
    assert noise["iteration_spread_mean"] == pytest.approx(0.2 / 1.1)
    assert noise["depth_line_residual_max"] == pytest.approx(0.0, abs=1e-9)
    assert set(noise["depth_line_residual_by_run"]) == set(runs["run_id"])
    # The same lines per system: here one system, so its lines are the whole's; no launches pooled.
    (system,) = noise["by_system"]
    fsdp = noise["by_system"][system]
    assert system == "fsdp" and fsdp["runs"] == len(runs)
    assert fsdp["iteration_spread_mean"] == pytest.approx(0.2 / 1.1)
    assert fsdp["launch_spread_mean"] is None and fsdp["launch_spread_max"] is None
    # One depth 20 % above the line the others make: it lies well off the fitted line, and the per-run
    # misses are what the summary's mean and max are taken over.
    off = runs["run_id"].iloc[1]
    bent = iterations.assign(
        iteration_s=np.where(
            iterations["run_id"] == off, iterations["iteration_s"] * 1.2, iterations["iteration_s"]
        )
    )
    bent_noise = measurement_noise(dataclasses.replace(bundle, runs=unrecorded, iterations=bent), runs)
    by_run = bent_noise["depth_line_residual_by_run"]
    assert by_run[off] > 0.05
    assert max(by_run.values()) == pytest.approx(bent_noise["depth_line_residual_max"])
    assert np.mean(list(by_run.values())) == pytest.approx(bent_noise["depth_line_residual_mean"])
    assert bent_noise["by_system"]["fsdp"]["depth_line_residual_max"] == pytest.approx(max(by_run.values()))
    # Two systems: each one's lines from its own runs only (ZeRO-3's iterations 1.0 and 1.5 of a line).
    zero3 = bundle.runs[(bundle.runs["cluster"] == SEEN) & (bundle.runs["system"] == "zero3")]
    both = pd.concat([runs, zero3])
    mixed = pd.concat([bent, pd.DataFrame(
        [{"run_id": r.run_id, "iteration": i, "iteration_s": (0.2 + 0.1 * r.layers) * factor}
         for r in zero3.itertuples() for i, factor in enumerate((1.0, 1.5))]
    )])  # fmt: skip
    split = measurement_noise(dataclasses.replace(bundle, runs=unrecorded, iterations=mixed), both)[
        "by_system"
    ]
    assert set(split) == {"fsdp", "zero3"} and split["zero3"]["runs"] == len(zero3)
    assert split["zero3"]["iteration_spread_max"] == pytest.approx(0.5 / 1.25)
    assert split["zero3"]["depth_line_residual_max"] == pytest.approx(0.0, abs=1e-9)
    assert split["fsdp"] == bent_noise["by_system"]["fsdp"]
    # Runs without the record: none counted, none guessed.
    assert noise["runs_with_host_cpu_recorded"] == 0 and noise["other_cpu_share_max"] is None
    # Two runs that recorded it, one on a busy host; a garbled record counts as not recorded.
    first, second, third = runs["run_id"].iloc[:3]
    recorded = unrecorded.copy()
    for run_id, versions in ((first, {"other_cpu_share": 0.41}), (second, {"other_cpu_share": 0.01})):
        recorded.loc[recorded["run_id"] == run_id, "versions"] = json.dumps(versions)
    recorded.loc[recorded["run_id"] == third, "versions"] = "{not json"
    busy = measurement_noise(dataclasses.replace(bundle, runs=recorded, iterations=iterations), runs)
    assert busy["runs_with_host_cpu_recorded"] == 2 and busy["runs_on_a_busy_host"] == 1
    assert busy["other_cpu_share_max"] == pytest.approx(0.41)


def test_cli_refuses_a_bad_tolerance_in_one_line() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "sim", "--tolerance", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --tolerance 2.0")


def test_the_shipped_check_writes_its_json_exits_by_the_verdict_and_matches_the_reports_copy(
    tmp_path: Path,
) -> None:
    """~25 s. The report shows report/data/validate-sim-measured.json when no --validation file is given:
    it must be what this checkout's `ciera validate sim` computes."""
    out = tmp_path / "validate.json"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "sim", "--held-out", "traces/data/measured.held-out.toml",
         "--json", str(out)],
        capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    written = json.loads(out.read_text())
    shipped = json.loads(
        (Path(__file__).resolve().parents[2] / "report" / "data" / "validate-sim-measured.json").read_text()
    )
    assert [row["run_id"] for row in written["held_out"]] == [row["run_id"] for row in shipped["held_out"]]
    for mine, theirs in zip(written["held_out"], shipped["held_out"], strict=True):
        assert mine["predicted_s"] == pytest.approx(theirs["predicted_s"], rel=1e-9), mine["run_id"]
    assert written["held_out_mean_abs_error"] == pytest.approx(shipped["held_out_mean_abs_error"], rel=1e-9)
    assert [
        (r["run_id"], pytest.approx(r["predicted_s"], rel=1e-9)) for r in shipped["codec_runs_in_sample"]
    ] == [(r["run_id"], r["predicted_s"]) for r in written["codec_runs_in_sample"]]
    assert done.returncode == (0 if written["passed"] else 1), done.stderr[-2000:]
    assert ("PASSED" if written["passed"] else "FAILED") in done.stdout
    # Each run over the max target is named, with its own depth line's miss (the noise beneath it).
    over = [
        r
        for r in written["held_out"]
        if r["error"] is not None and abs(r["error"]) > 2 * written["tolerance"]
    ]
    assert done.stdout.count("over the max target") == len(over) > 0
    assert all(r["own_depth_line_miss"] is not None for r in over)
    assert written["replay_max_abs_error"] <= 0.01
    assert {row["category"] for row in written["held_out"]} == {"depth", "link", "topology", "system"}
    held = load_held_out(default_held_out_path())
    seen = {(r["cluster"], r["layers"], r["system"]) for r in written["replay"]}
    assert all(
        c in held.seen_clusters and n in held.seen_layers and s in held.seen_systems for c, n, s in seen
    )


@pytest.mark.slow  # ~1 min on 2 cores (8 before ParameterLayout): run on purpose with -m slow
def test_the_second_bundle_is_checked_with_its_own_held_out_file_and_replays_exactly(tmp_path: Path) -> None:
    """`ciera validate sim --bundle measured-olmoe`: another zoo model on another link, its held-out file
    (fixed before its capture) found beside it; every seen run replays exactly and every held-out run is
    predicted and categorised. Its errors are what docs/validation.md states; they fail the targets."""
    document = _validate_shipped_bundle("measured-olmoe", tmp_path)
    assert set(document["held_out_mean_abs_error_by_category"]) == {"depth", "topology", "system"}


def _validate_shipped_bundle(name: str, tmp_path: Path) -> dict:
    """`ciera validate sim --bundle NAME` as a user runs it: its held-out file found beside the bundle,
    every seen run replayed exactly, every held-out run predicted; the exit code says whether it passed."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", "validate", "sim", "--bundle", name, "--json", str(out)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    document = json.loads(out.read_text())
    assert document["held_out_file"].endswith(f"{name}.held-out.toml")
    assert document["replay_max_abs_error"] <= 1e-6
    assert all(row["predicted_s"] is not None for row in document["held_out"])
    assert document["passed"] == (done.returncode == 0)
    return document


@pytest.mark.slow  # ~30 s on 2 cores: run on purpose with -m slow
def test_the_wider_bundle_is_checked_with_its_own_held_out_file_and_gets_every_ciera_verdict_right(
    tmp_path: Path,
) -> None:
    """`ciera validate sim --bundle measured-w16`: the measured bundle's model at 1/16 width, its held-out
    file (fixed before its capture) found beside it; every seen run replays exactly, every held-out run is
    predicted and categorised, and turning CIERA on is predicted on the measured side of its plain engine in
    every pair. Its errors are what README and docs/validation.md state; they fail the targets."""
    document = _validate_shipped_bundle("measured-w16", tmp_path)
    assert set(document["held_out_mean_abs_error_by_category"]) == {"depth", "link", "topology", "system"}
    verdicts = document["ciera_verdicts"]
    assert len(verdicts) == 22 and document["ciera_verdicts_on_the_measured_side"] == len(verdicts)


def test_in_the_wider_bundle_zero3_with_ciera_beats_zero3_on_every_200mbit_run() -> None:
    """What the README states of `measured-w16`: ZeRO-3 + CIERA's median iteration is shorter than plain
    ZeRO-3's on every 200 Mbit cluster and depth, sending at most 52 % of its all-gather bytes."""
    bundle = traces.read_bundle(traces.resolve_bundle("measured-w16"))
    median_s = bundle.iterations.groupby("run_id")["iteration_s"].median()
    timed = bundle.runs["run_id"].isin(median_s.index)  # not the exponent-statistics run
    runs = bundle.runs[timed].set_index("run_id")
    gathers = bundle.events[bundle.events["stream"] == "allgather"].groupby("run_id")
    wire_ratio = gathers["wire_bytes"].sum() / gathers["raw_bytes"].sum()
    pairs = 0
    for (cluster, layers), group in runs.groupby(["cluster", "layers"]):
        if not cluster.endswith("200mbit"):
            continue
        by_system = {system: run_id for run_id, system in group["system"].items()}
        assert median_s[by_system["ciera"]] < median_s[by_system["zero3"]], (cluster, layers)
        assert wire_ratio[by_system["ciera"]] <= 0.52
        pairs += 1
    assert pairs == 9  # 2 x 1, 2 x 2 and 3 x 1 at depths 2, 4, 6


def test_codec_runs_of_two_block_sizes_are_refused_in_one_line(bundle: traces.TraceBundle) -> None:
    # The rewrite's change rate is the exponent statistics' at the codec runs' block size: two sizes
    # for one system have no one rate to give it.
    small = _small(bundle)
    codec = [f"mixtral-8x7b-w32-ciera-L2-{SEEN}", "mixtral-8x7b-w32-ciera-L2-emulated-2x1-1gbit"]
    runs = small.runs.copy()
    runs.loc[runs["run_id"] == codec[1], "block_size"] = 512
    held = HeldOut((SEEN,), (2,), "two-sizes.toml", seen_systems=("zero3", "fsdp"), codec_runs=tuple(codec))
    with pytest.raises(
        ValidationInputError, match=r"two-sizes.toml: the codec runs of ciera use block sizes \[64, 512\]"
    ):
        validate_sim(dataclasses.replace(small, runs=runs), held, 0.04)


def test_a_run_over_the_max_target_is_named_with_its_own_miss_without_a_model() -> None:
    from validation.cli import over_max_lines

    row = {"system": "ciera", "cluster": "c", "layers": 4, "category": "system"}
    document = {"held_out": [
        {**row, "error": -0.106, "own_depth_line_miss": 0.077},
        {**row, "layers": 2, "error": 0.09, "own_depth_line_miss": None},
        {**row, "layers": 6, "error": 0.05, "own_depth_line_miss": 0.001},
        {**row, "layers": 8, "error": None, "own_depth_line_miss": 0.2},
    ]}  # fmt: skip
    lines = over_max_lines(document, 0.08)
    assert len(lines) == 2
    assert "L = 4, -10.6 % (system)" in lines[0] and "misses it by 7.7 % with no model involved" in lines[0]
    assert "L = 2, +9.0 %" in lines[1] and "fewer than three depths" in lines[1]


def test_each_held_out_run_holds_its_measured_and_predicted_critical_paths(
    small_document: dict, bundle: traces.TraceBundle
) -> None:
    """The one attribution (`sim.evaluate.critical_path`) on both sides: the measured parts are the
    replayed middle iteration's, so they sum to that iteration's measured time; the predicted parts sum to
    one of the prediction's iterations, within the spread of its median; the category summary is the mean of
    each run's signed miss per part."""
    from sim.evaluate import BREAKDOWN_KEYS
    from validation.sim_check import path_miss

    iterations = bundle.iterations
    for row in small_document["held_out"]:
        paths = row["critical_path_s"]
        assert set(paths["measured"]) == set(paths["predicted"]) == set(BREAKDOWN_KEYS), row["run_id"]
        assert all(v >= 0 for side in paths.values() for v in side.values())
        times = iterations[iterations["run_id"] == row["run_id"]]["iteration_s"].sort_values().to_numpy()
        middle = times[len(times) // 2]
        assert sum(paths["measured"].values()) == pytest.approx(middle, rel=1e-6), row["run_id"]
        assert sum(paths["predicted"].values()) == pytest.approx(row["predicted_s"], rel=0.1), row["run_id"]
        if row["system"] in ("ciera", "ciera-fsdp"):
            assert paths["predicted"]["codec_critical"] > 0  # the rewrite's codec ops lie on the path
    for name, parts in small_document["held_out_path_miss_by_category"].items():
        rows = [path_miss(r) for r in small_document["held_out"] if r["category"] == name]
        for part, value in parts.items():
            assert value == pytest.approx(np.mean([miss[part] for miss in rows]))
    # The signed misses of one run sum to its middle iterations' difference over the measured one.
    row = small_document["held_out"][0]
    miss = path_miss(row)
    measured = sum(row["critical_path_s"]["measured"].values())
    assert sum(miss.values()) == pytest.approx(
        sum(row["critical_path_s"]["predicted"].values()) / measured - 1
    )


def test_the_console_names_where_the_predictions_miss() -> None:
    from validation.cli import over_max_lines, path_miss_line

    parts = {"compute": 2.281, "exposed_allgather": 0.983, "exposed_reduce_scatter": 1.265,
             "codec_critical": 0.147, "other": 0.023}  # fmt: skip
    predicted = {**parts, "exposed_allgather": 0.616, "codec_critical": 0.214}
    row = {"system": "ciera", "cluster": "c", "layers": 8, "category": "system", "error": -0.092,
           "own_depth_line_miss": 0.006, "critical_path_s": {"measured": parts, "predicted": predicted}}  # fmt: skip
    document = {
        "held_out": [row, {**row, "layers": 2, "error": 0.09, "critical_path_s": None}],
        "held_out_path_miss_by_category": {
            "system": {
                "compute": 0.0,
                "exposed_allgather": -0.078,
                "exposed_reduce_scatter": 0.0,
                "codec_critical": 0.014,
                "other": 0.0,
            },  # fmt: skip
        },
    }
    lines = over_max_lines(document, 0.08)
    assert (
        "critical path, measured → predicted (ms): compute 2281 → 2281, exposed all-gather 983 → 616"
        in lines[0]
    )
    assert "codec 147 → 214" in lines[0]
    assert "critical path" not in lines[1]  # a run with no path says nothing of one
    line = path_miss_line(document)
    assert (
        "system: exposed all-gather -7.8 %, codec +1.4 %" in line
        and "compute" not in line.split("system:")[1]
    )
    assert path_miss_line({"held_out_path_miss_by_category": {}}) is None
