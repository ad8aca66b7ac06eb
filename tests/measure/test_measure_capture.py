"""`ciera measure`: a tiny real capture on 2 local ranks (DeepSpeed ZeRO-3, ZeRO-3 + CIERA, FSDP2) gives a
bundle the reader accepts and the simulator loads, with consistent events; resume, faults and misuse give
one line; measured timelines are Chrome traces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import traces
from measure.extensions import extensions_dir
from measure.train import free_port

pytest.importorskip("deepspeed")

MODEL = ["--model", "mixtral-8x7b", "--width-scale", "64"]
TINY = [*MODEL, "--layers", "1", "--iterations", "2", "--warmup", "1", "--timeout-s", "120"]


def ciera(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ciera_cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | (env or {}),
    )


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("capture") / "cap"
    done = ciera("measure", "layers", "--out", str(out), *TINY, "--systems", "zero3,ciera,fsdp")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.heavy
def test_capture_gives_a_valid_bundle_of_measured_runs(captured: Path) -> None:
    bundle = traces.read_bundle(captured / "bundle")
    assert set(bundle.runs["source"]) == {"measured"}
    assert sorted(bundle.runs["system"]) == ["ciera", "fsdp", "zero3"]
    assert set(bundle.runs["layers"]) == {1}
    # Each run records the CPU its ranks spent beside their main threads per iteration (transport).
    transport = [json.loads(v)["transport_cpu_median_s"] for v in bundle.runs["versions"]]
    assert all(value is not None and 0 <= value < 60 for value in transport), transport
    # Every rank ran with the memory it frees kept (the default `--allocator retain`), as its own
    # environment recorded it.
    from measure.launch import RETAIN_ALLOCATOR_ENV

    for versions in map(json.loads, bundle.runs["versions"]):
        assert versions["allocator"] == "retain" and versions["malloc_env"] == RETAIN_ALLOCATOR_ENV
    runs = bundle.runs.set_index("run_id")
    assert (runs["engine"] == np.where(runs["system"] == "fsdp", "fsdp", "zero3")).all()
    assert (runs["backend"] == "gloo").all() and (runs["nodes"] == 1).all()
    zero3 = runs[runs["engine"] == "zero3"]
    assert (zero3["prefetch_bucket_size"] > 0).all() and (zero3["max_reuse_distance"] == 0).all()
    assert set(bundle.iterations.groupby("run_id")["iteration"].nunique()) == {2}
    done = ciera("traces", "validate", str(captured / "bundle"))
    assert done.returncode == 0, done.stderr


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_events_are_consistent(captured: Path) -> None:
    bundle = traces.read_bundle(captured / "bundle")
    events = bundle.events
    assert (events["end_s"] >= events["start_s"]).all()
    assert (events["start_s"] >= events["issued_s"]).all()
    # Per rank, iteration and stream: no overlap.
    for _, group in events.groupby(["run_id", "rank", "iteration", "stream"]):
        ordered = group.sort_values("start_s")
        assert (ordered["start_s"].to_numpy()[1:] >= ordered["end_s"].to_numpy()[:-1] - 1e-6).all()
    # The iteration time is at least every rank's main-thread busy time.
    busy = (
        events[events["stream"].isin(["compute", "gather_host", "optim"])]
        .assign(duration=lambda f: f["end_s"] - f["start_s"])
        .groupby(["run_id", "iteration", "rank"])["duration"]
        .sum()
        .groupby(["run_id", "iteration"])
        .max()
    )
    iteration_s = bundle.iterations.set_index(["run_id", "iteration"])["iteration_s"]
    assert (iteration_s.reindex(busy.index) >= busy - 1e-9).all()
    # Per-layer sums match the per-layer table (the reader checks it too; here it is shown directly).
    gathers = events[events["stream"] == "allgather"]
    per_layer = gathers.groupby(["run_id", "iteration", "layer", "phase"])["raw_bytes"].sum() / 2
    table = bundle.layers.set_index(["run_id", "iteration", "layer", "phase"])["allgather_bytes"]
    np.testing.assert_allclose(table.reindex(per_layer.index).to_numpy(), per_layer.to_numpy(), rtol=1e-6)
    # CIERA moves fewer bytes than it would raw; the plain engines move what they gather.
    by_system = (
        gathers.merge(bundle.runs[["run_id", "system"]]).groupby("system")[["raw_bytes", "wire_bytes"]].sum()
    )
    assert by_system.loc["ciera", "wire_bytes"] < by_system.loc["ciera", "raw_bytes"]
    assert by_system.loc["zero3", "wire_bytes"] == by_system.loc["zero3", "raw_bytes"]
    # Every engine gather is issued inside the engine's own gather call, whose main-thread time is the
    # gather_host stream (the path a system rewrite replaces), in every system.
    host = events[events["stream"] == "gather_host"]
    assert set(host["run_id"]) == set(bundle.runs["run_id"])
    for key, issued in gathers.groupby(["run_id", "rank", "iteration"]):
        segments = host.set_index(["run_id", "rank", "iteration"]).loc[[key]]
        inside = (
            issued["issued_s"].to_numpy()[:, None] >= segments["start_s"].to_numpy()[None, :] - 1e-6
        ) & (issued["issued_s"].to_numpy()[:, None] <= segments["end_s"].to_numpy()[None, :] + 1e-6)
        assert inside.any(axis=1).all(), key
    # Every phase shows up, and CIERA's codec runs in its own streams.
    assert {"fwd", "bwd", "recompute", "optim"} <= set(events["phase"])
    assert {"codec_send", "codec_recv"} <= set(events[events["run_id"].str.contains("-ciera-")]["stream"])


@pytest.mark.heavy
def test_a_time_floor_times_short_runs_longer_on_every_rank_alike(tmp_path: Path) -> None:
    from measure.capture import timed_iterations

    out = tmp_path / "cap"
    done = ciera("measure", "layers", "--out", str(out), *TINY, "--systems", "zero3", "--min-timed-s", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    bundle = traces.read_bundle(out / "bundle")
    versions = json.loads(bundle.runs.iloc[0]["versions"])
    assert versions["min_timed_s"] == 3.0 and versions["warmup_iteration_s"] > 0
    count = len(bundle.iterations)
    # Both ranks timed the same count (the events of each rank cover every timed iteration), from the rule.
    assert count == timed_iterations(2, 3.0, versions["warmup_iteration_s"]) > 2
    assert (bundle.events.groupby("rank")["iteration"].nunique() == count).all()
    assert f"timed iterations per run: {count} (each run timed at least 3 s" in done.stdout
    # The same command again keeps the run: the floor is part of the job.
    again = ciera("measure", "layers", "--out", str(out), *TINY, "--systems", "zero3", "--min-timed-s", "3")
    assert again.returncode == 0 and "kept" in again.stdout, again.stderr[-2000:]


@pytest.mark.heavy
def test_launches_of_a_run_are_pooled_into_one_run_that_replays_exactly(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    args = ["measure", "layers", "--out", str(out), *TINY, "--systems", "zero3,ciera", "--launches", "2"]
    done = ciera(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(path.name for path in (out / "runs").iterdir()) == [
        "mixtral-8x7b-w64-ciera-L1-local-2",
        "mixtral-8x7b-w64-ciera-L1-local-2.launch2",
        "mixtral-8x7b-w64-zero3-L1-local-2",
        "mixtral-8x7b-w64-zero3-L1-local-2.launch2",
    ]
    bundle = traces.read_bundle(out / "bundle")
    assert len(bundle.runs) == 2
    for run in bundle.runs.itertuples():
        versions = json.loads(run.versions)
        assert versions["launches"] == 2 and len(versions["launch_median_s"]) == 2
        launches = [json.loads((out / "runs" / name / "run.json").read_text())["iteration_s"]
                    for name in (run.run_id, f"{run.run_id}.launch2")]  # fmt: skip
        # The run's iterations are the first launch's, then the second's, numbered on.
        times = bundle.iterations[bundle.iterations["run_id"] == run.run_id].sort_values("iteration")
        assert times["iteration"].tolist() == [0, 1, 2, 3]
        assert times["iteration_s"].tolist() == launches[0] + launches[1]
        events = bundle.events[bundle.events["run_id"] == run.run_id]
        assert (
            events.groupby("rank")["iteration"].unique().map(sorted).map(list) == [[0, 1, 2, 3]] * 2
        ).all()
    assert "timed iterations per run: 4" in done.stdout
    assert "each run pooled from 2 launches of fresh ranks" in done.stdout
    replayed = ciera("replay", "--bundle", str(out / "bundle"))
    assert replayed.returncode == 0 and "largest |replayed − measured| / measured: 0.000 %" in replayed.stdout
    # The same command again keeps all four launches.
    again = ciera(*args)
    assert again.returncode == 0 and again.stderr.count("kept ") == 4, again.stderr[-2000:]


@pytest.mark.heavy
def test_rerun_keeps_finished_runs_and_refuses_another_plan(captured: Path) -> None:
    done = ciera("measure", "layers", "--out", str(captured), *TINY, "--systems", "zero3,ciera,fsdp")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("kept ") == 3
    # The summary gives every run's gather path per all-gather (this capture records it), as the bundle has it.
    gather_path = traces.run_summaries(traces.read_bundle(captured / "bundle"))["gather_path_s_per_gather"]
    assert len(gather_path) == 3 and (gather_path > 0).all()
    console = done.stdout + done.stderr
    flat = " ".join(console.split())
    assert (
        console.count(" µs ") >= 3 and "path: the main thread's time inside the engine's gather calls" in flat
    )
    assert "allocator: 3 runs kept the memory their ranks freed (MALLOC_MMAP_MAX_=0" in flat
    other = ciera("measure", "layers", "--out", str(captured), *TINY, "--systems", "zero3")
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1 and "another plan" in other.stderr and "systems" in other.stderr


@pytest.mark.heavy  # uses the module's capture (~20 s): the heavy tier
def test_measured_timeline_is_a_chrome_trace(captured: Path, tmp_path: Path) -> None:
    bundle = traces.read_bundle(captured / "bundle")
    run_id = bundle.runs[bundle.runs["system"] == "ciera"]["run_id"].iloc[0]
    out = tmp_path / "timeline.json"
    done = ciera(
        "measure", "timeline", "--bundle", str(captured / "bundle"), "--run", run_id, "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["otherData"]["schema"] == "ciera.timeline/1"
    complete = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {1, 2}  # one process per rank
    threads = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "allgather", "codec_send", "codec_recv"} <= threads
    bad = ciera(
        "measure", "timeline", "--bundle", str(captured / "bundle"), "--run", "nope", "--out", str(out)
    )
    assert bad.returncode == 2 and "--run 'nope'" in bad.stderr


@pytest.mark.heavy
def test_simulator_loads_the_measured_bundle(captured: Path) -> None:
    """A fresh capture replays on its own cluster; under a GPU preset its CPU compute is refused in one
    line that names that cluster (no compute model moves it to another device)."""
    bundle = traces.read_bundle(captured / "bundle")
    label, cluster = bundle.runs["model"].iloc[0], bundle.runs["cluster"].iloc[0]
    done = ciera("simulate", "--bundle", str(captured / "bundle"), "--models", label, "--cluster", cluster)
    assert done.returncode == 0, done.stderr[-2000:]
    assert label in done.stdout and "replay" in done.stdout
    refused = ciera(
        "simulate", "--bundle", str(captured / "bundle"), "--models", label, "--gpus", "4", "--dtype", "bf16"
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert "no compute model is built" in lines[-1] and f"--cluster {cluster}" in lines[-1]


@pytest.mark.slow  # a whole capture of its own: run with -m slow
def test_a_rank_killed_mid_capture_stops_the_others_and_keeps_finished_runs(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    args = [
        "measure",
        "layers",
        "--out",
        str(out),
        *MODEL,
        "--layers",
        "1",
        "--iterations",
        "2",
        "--warmup",
        "1",
    ]
    victim = "mixtral-8x7b-w64-zero3-L1-local-2"
    started = time.monotonic()
    done = ciera(*args, "--systems", "fsdp,zero3", env={"CIERA_MEASURE_EXIT_AT": f"{victim}:1:1"})
    assert done.returncode == 2
    assert time.monotonic() - started < 120
    last_line = done.stderr.strip().splitlines()[-1]  # after the progress bar's last frame
    assert last_line == "error: capture failed: rank 1 stopped (exit code 17)", done.stderr[-2000:]
    assert (out / "runs" / "mixtral-8x7b-w64-fsdp-L1-local-2" / "run.json").is_file()  # finished: kept
    assert not (out / "runs" / victim).exists()  # the partial run is not written
    assert not (out / "bundle").exists()


@pytest.mark.slow  # a whole capture of its own: run with -m slow
def test_ctrl_c_stops_the_ranks_and_the_next_run_redoes_it(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    args = ["measure", "layers", "--out", str(out), *MODEL, "--layers", "1", "--systems", "zero3"]
    process = subprocess.Popen(
        [sys.executable, "-m", "ciera_cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list((out / ".partial").glob("*/rank0.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr[-2000:]
    assert "interrupted" in stderr
    leftover = subprocess.run(["pgrep", "-f", f"measure.rank {out}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""  # no rank outlives the capture


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--systems", "zero3,zeropp"], "'zeropp' is not a system"),
        (["--layers", "2,x"], "--layers"),
        # Given but empty: a mistake, not a capture without layer runs (it captured the rest before).
        (["--systems", " , "], "--systems ' , ': expected at least one comma-separated name"),
        (["--nodes", "2", "--link-rate", ","], "--link-rate ',': expected at least one comma-separated name"),
        (["--nodes", "2"], "--nodes 2 needs --link-rate"),
        (["--ranks-per-node", "4000"], "more than this machine"),
        (["--warmup", "0"], "--warmup"),
        (["--min-timed-s", "-1"], "--min-timed-s is -1.0: expected a number of seconds >= 0"),
        (["--min-timed-s", "nan"], "--min-timed-s is nan"),
        (["--launches", "0"], "--launches is 0: expected an integer from 1 to 16"),
        (["--launches", "17"], "--launches is 17: expected an integer from 1 to 16"),
        (["--allocator", "jemalloc"], "--allocator 'jemalloc': expected one of retain, system"),
        (["--topologies", "2by1"], "--topologies '2by1': expected NODESxRANKS[-RATE]"),
        (["--topologies", "0x1"], "nodes and ranks per node must be >= 1"),
        (["--topologies", "1x2,1x2"], "names a topology twice"),
        # Twice in a list: the plan recorded it twice and captured it once.
        (["--systems", "zero3,fsdp,zero3"], "--systems 'zero3,fsdp,zero3': names zero3 twice"),
        (["--layers", "2,4,2"], "--layers '2,4,2': names 2 twice"),
        (["--topologies", "1x2", "--nodes", "2"], "--topologies names nodes, ranks per node and link rates"),
        (["--topologies", "2x1"], "--nodes 2 needs --link-rate"),
    ],
)
def test_misuse_is_one_line_before_any_rank_starts(tmp_path: Path, args: list[str], expected: str) -> None:
    done = ciera("measure", "layers", "--out", str(tmp_path / "cap"), *args, timeout=60)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "cap" / "runs").exists()


@pytest.mark.slow  # a whole capture of its own: run with -m slow
def test_under_torchrun_every_rank_runs_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(free_port()), "-m", "ciera_cli.main", "measure", "layers", "--out", str(out), *MODEL,
         "--layers", "1", "--systems", "zero3,fsdp", "--iterations", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    bundle = traces.read_bundle(out / "bundle")
    assert sorted(bundle.runs["run_id"]) == [
        "mixtral-8x7b-w64-fsdp-L1-local-2",
        "mixtral-8x7b-w64-zero3-L1-local-2",
    ]
    assert sorted(set(bundle.events["rank"])) == [0, 1]
    # One process ran both jobs: each run holds only its own timed iterations.
    assert set(bundle.iterations.groupby("run_id")["iteration"].nunique()) == {1}


@pytest.mark.slow  # a whole capture of its own: run with -m slow
def test_under_a_launcher_a_missing_rank_is_one_line_not_a_hang(tmp_path: Path) -> None:
    started = time.monotonic()
    launcher_env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port())}  # fmt: skip
    done = ciera(
        "measure", "layers", "--out", str(tmp_path / "cap"), *MODEL, "--layers", "1", "--systems", "zero3",
        "--timeout-s", "5", env=launcher_env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert time.monotonic() - started < 60
    assert "did not form within 5 s (a rank is missing?)" in done.stderr.strip().splitlines()[-1]


def _our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("ciera-m-")]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="the emulated cluster needs root on Linux (network namespaces, veth, tc)",
)
@pytest.mark.heavy
def test_emulated_capture_after_a_killed_one_cleans_up_and_records_its_link(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    args = ["measure", "layers", "--out", str(out), *MODEL, "--layers", "1", "--systems", "zero3",
            "--iterations", "1", "--warmup", "1", "--nodes", "2", "--ranks-per-node", "1", "--link-rate", "1gbit"]  # fmt: skip
    before = set(_our_namespaces())
    killed = subprocess.Popen(
        [sys.executable, "-m", "ciera_cli.main", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not list((out / ".partial").glob("*/rank0.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed.kill()  # SIGKILL: no cleanup runs
    killed.wait()
    assert set(_our_namespaces()) - before  # left behind
    # A rank killed while torch's loader held DeepSpeed's op build lock leaves it (every later DeepSpeed
    # process would wait for it forever): as one of its ranks would, after the capture started.
    lock = extensions_dir() / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    done = ciera(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "removed leftovers of a killed capture" in done.stderr
    assert f"removed a DeepSpeed build lock the killed capture held: {lock}" in done.stderr
    assert set(_our_namespaces()) <= before  # nothing of ours is left
    bundle = traces.read_bundle(out / "bundle")
    run = bundle.runs.iloc[0]
    assert (run.cluster, run.nodes, run.gpus_per_node, run.world_size) == ("emulated-2x1-1gbit", 2, 1, 2)
    assert run.link_rate_Bps == 125e6
    assert 0.2 * run.link_rate_Bps < run.measured_link_Bps < 1.1 * run.link_rate_Bps


@pytest.mark.heavy  # uses the module's capture (~20 s): the heavy tier
def test_report_shows_the_measured_runs(captured: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    done = ciera("report", "--bundle", str(captured / "bundle"), "--html", str(out), "--gpus", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    page = out.read_text()
    section = page[page.index('<section id="measured">') :]
    section = section[: section.index("</section>")]
    assert "These are measurements, not simulation output" in section
    assert section.count('<tr class="measured">') == 3
    for label in ("ZeRO-3 + CIERA", "FSDP2", "ZeRO-3"):
        assert f">{label}</td>" in section


@pytest.mark.heavy  # uses the module's capture (~20 s): the heavy tier
def test_replay_reproduces_every_captured_iteration(captured: Path, tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    done = ciera("replay", "--bundle", str(captured / "bundle"), "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(out.read_text())
    assert len(document["runs"]) == 3
    assert document["max_abs_error"] < 1e-9


def test_without_torch_the_capture_says_what_to_install(tmp_path: Path) -> None:
    probe = (
        "import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None; "
        "from ciera_cli.main import main; "
        f"sys.argv = ['ciera', 'measure', 'layers', '--out', {str(tmp_path / 'cap')!r}]; main()"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == 'error: torch is not installed: pip install -e ".[runtime]"'
    assert not (tmp_path / "cap").exists()


@pytest.mark.heavy  # uses the module's capture (~20 s): the heavy tier
def test_ciera_rounds_are_counted_at_the_layer_of_the_parameter_they_gather(captured: Path) -> None:
    # A CIERA bucket row (one per DeepSpeed coalesced call) counts at the layer of its first parameter, as
    # DeepSpeed's own coalesced gather does; its decode, however late it runs and whichever row was issued
    # last, gives that row its raw bytes. So each iteration's gathered raw bytes stay within three gathers
    # (forward, recompute, backward) of every layer, never piling up at the layer that happened to wait.
    bundle = traces.read_bundle(captured / "bundle")
    run_id = bundle.runs[bundle.runs["system"] == "ciera"]["run_id"].iloc[0]
    layers = bundle.layers[bundle.layers["run_id"] == run_id]
    per_iteration = layers.groupby("iteration").agg(raw=("allgather_bytes", "sum"), numel=("numel", "sum"))
    assert (per_iteration["raw"] <= 3 * 2 * per_iteration["numel"] * 1.05).all(), per_iteration
    # Every bucket row got its raw bytes from its own decode (registration rows carry none).
    events = bundle.events[(bundle.events["run_id"] == run_id) & (bundle.events["stream"] == "allgather")]
    assert (events["raw_bytes"] > 0).sum() >= 0.8 * len(events[events["wire_bytes"] > 1024]), events


@pytest.mark.heavy
def test_a_sweep_alone_ends_with_its_sweep_and_no_bundle(tmp_path: Path) -> None:
    """`ciera measure collectives`: the sweep is the result (exit 0, its file named); no bundle is written,
    and the JSON says so. ~15 s."""
    out, report = tmp_path / "sweep", tmp_path / "sweep.json"
    done = ciera("measure", "collectives", "--out", str(out), *TINY, "--collectives-max-mib", "1",
                 "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = " ".join(done.stderr.split())
    assert "collectives sweep of local-2: all_gather, all_reduce, reduce_scatter at" in said
    assert "no bundle written" in said and not (out / "bundle").exists()
    document = json.loads(report.read_text())
    assert document["bundle"] is None and document["runs"] == [] and len(document["sweeps"]) == 1
    assert document["captured"] == ["collectives-local-2"]
