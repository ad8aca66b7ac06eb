"""`ciera simulate` end to end: JSON schema, Chrome-trace timeline, and one-line exit-2 errors."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import typer

import traces
from sim import SYSTEMS, sweep_workers
from sim import cli as sim_cli

RECORD_KEYS = {
    "model",
    "dtype",
    "gpus",
    "system",
    "source",
    "iteration_s",
    "breakdown_s",
    "allgather_bytes_per_iter",
    "speedup_vs_zero3",
    "speedup_vs_zeropp",
    "shards_selected",
    "bound_speedup",
    "overlap_only_speedup",
    "speedup_parts",
    "anchor_run",
    "iterations",
}


def run_ciera(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """Run the `ciera` entry point in-process (or an equivalent app if sim.cli is not registered yet)."""
    import ciera_cli.main as entry

    if "sim.cli" in entry.STAGE_CLI_MODULES:
        monkeypatch.setattr(sys, "argv", ["ciera", *args])
        runner, errors = entry.main, ()
    else:
        app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
        sim_cli.register(app)
        app.command("version")(lambda: None)
        errors = (*sim_cli.USER_ERRORS, traces.TraceError)

        def runner() -> None:
            app(args, prog_name="ciera")

    code = 0
    try:
        runner()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    except errors as error:  # the same one-line rendering as ciera_cli.main
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        code = 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_and_timeline(bundle_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out.json"
    timeline_file = tmp_path / "timeline.json"
    code, stdout, _ = run_ciera(
        [
            "simulate",
            "--bundle",
            str(bundle_dir),
            "--gpus",
            "8,16",
            "--json",
            str(out),
            "--timeline",
            str(timeline_file),
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0
    assert "OLMoE-1B-7B" in stdout and "analytic" in stdout
    document = json.loads(out.read_text())
    assert document["schema"] == "ciera.simulate/1"
    records = document["records"]
    assert len(records) == 2 * (2 * len(SYSTEMS) - 1)
    for record in records:
        assert RECORD_KEYS <= set(record)
        assert set(record["iteration_s"]) == {"p5", "p50", "p95"}
        assert set(record["breakdown_s"]) == {
            "compute",
            "exposed_allgather",
            "exposed_reduce_scatter",
            "codec_critical",
            "other",
        }
        assert set(record["speedup_parts"]) == {"bytes", "overlap", "other"}
        assert record["source"] == "analytic"
    trace = json.loads(timeline_file.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete and all(e["dur"] > 0 and e["ts"] >= 0 for e in complete)
    assert len({e["pid"] for e in complete}) == len(SYSTEMS) - 1  # first dtype is bf16: no zeropp
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "allgather", "reduce_scatter", "codec_send", "codec_recv"} <= names
    assert not list(tmp_path.glob(".*partial"))


def test_filters(bundle_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out.json"
    code, stdout, _ = run_ciera(
        [
            "simulate",
            "--bundle",
            str(bundle_dir),
            "--models",
            "olmoe-1b-7b",
            "--gpus",
            "32",
            "--systems",
            "zero3,ciera",
            "--dtype",
            "fp16",
            "--set",
            "ciera.cache_budget_bytes=1e9",
            "--json",
            str(out),
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["system"], r["gpus"], r["dtype"]) for r in records] == [
        ("zero3", 32, "fp16"),
        ("ciera", 32, "fp16"),
    ]
    assert records[1]["speedup_vs_zeropp"] is not None
    # How much simulating the answer took, as on a measured cluster: records, events, events/s.
    line = next(line for line in stdout.splitlines() if "simpy events in" in line)
    assert line.startswith("2 records, ") and line.endswith(" events/s)")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--models", "GPT-5"], "model 'GPT-5' is not in the bundle"),
        (["--systems", "zero4"], "unknown system 'zero4'"),
        (["--cluster", "nowhere"], "unknown preset 'nowhere'"),
        (["--cluster", "missing/file.toml"], "no such preset file"),
        (["--set", "inter_node.beta_Bps"], "expected KEY=VALUE"),
        (["--set", "inter_node.beta=1"], "unknown field 'inter_node.beta'"),
        (["--set", "ciera.block_size=big"], "expected an integer"),
        (["--gpus", "8,x"], "--gpus: value 'x'"),
        (["--gpus", "0"], "--gpus: value '0'"),
        (["--gpus", "-4"], "--gpus: value '-4'"),
        (["--gpus", ""], "--gpus: empty"),
        (["--gpus", " , "], "--gpus: empty"),
        # An empty list is a mistake, not a request for the default (it ran every system before).
        (["--systems", ""], "--systems: empty"),
        (["--models", ","], "--models: empty"),
        (["--dtype", "fp8"], "--dtype: value 'fp8'"),
        (["--systems", "zeropp", "--dtype", "bf16"], "fp16 only"),
        (["--workers", "0"], "--workers: value 0"),
        (["--workers", "two"], "--workers"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    bundle_dir: Path, tmp_path: Path, args: list[str], fragment: str, capsys, monkeypatch
) -> None:
    out = tmp_path / "out.json"
    code, _, stderr = run_ciera(
        ["simulate", "--bundle", str(bundle_dir), *args, "--json", str(out)], capsys, monkeypatch
    )
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], stderr
    assert not out.exists()


@pytest.mark.parametrize("option", ["--json", "--timeline"])
@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_unwritable_output_exits_2_with_one_line(
    bundle_dir: Path, tmp_path: Path, option: str, where: str, capsys, monkeypatch
) -> None:
    (tmp_path / "plain").write_text("")
    target = tmp_path if where == "a directory" else tmp_path / "plain" / "out.json"
    args = ["simulate", "--bundle", str(bundle_dir), "--models", "OLMoE-1B-7B", "--gpus", "8"]
    code, _, stderr = run_ciera([*args, option, str(target)], capsys, monkeypatch)
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and option in lines[0] and str(target) in lines[0], stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_outputs_are_readable_like_any_file_the_user_creates(
    bundle_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    old_umask = os.umask(0o022)
    try:
        out, timeline_file = tmp_path / "out.json", tmp_path / "timeline.json"
        args = ["simulate", "--bundle", str(bundle_dir), "--models", "OLMoE-1B-7B", "--gpus", "8"]
        code, _, _ = run_ciera(
            [*args, "--json", str(out), "--timeline", str(timeline_file)], capsys, monkeypatch
        )
    finally:
        os.umask(old_umask)
    assert code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert stat.S_IMODE(timeline_file.stat().st_mode) == 0o644


def test_bad_bundle_exits_2(tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, stderr = run_ciera(["simulate", "--bundle", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_default_bundle_end_to_end(tmp_path: Path, capsys, monkeypatch) -> None:
    if not traces.default_bundle_path().is_dir():
        pytest.skip("the packaged default bundle has not been generated in this checkout")
    out = tmp_path / "out.json"
    code, stdout, _ = run_ciera(["simulate", "--gpus", "8,128", "--json", str(out)], capsys, monkeypatch)
    assert code == 0
    records = json.loads(out.read_text())["records"]
    assert len({r["model"] for r in records}) == 6
    # 24 (model, dtype, W) jobs: the sweep runs in one process per core, and says so.
    processes = sweep_workers(24)
    line = next(line for line in stdout.splitlines() if "simpy events in" in line)
    assert line.endswith(f", {processes} processes)" if processes > 1 else " events/s)"), line
    assert all(
        r["speedup_vs_zero3"] <= r["bound_speedup"] * (1 + 1e-9) or r["speedup_parts"]["other"] > 1
        for r in records
    )
