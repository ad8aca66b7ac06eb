"""`ciera measure`: capture a trace bundle on the group this machine can form — plain local ranks, or the
emulated two-level cluster (`--link-rate`, root on Linux) — with real DeepSpeed ZeRO-3 / FSDP2 training.

    ciera measure all --model mixtral --out DIR [--nodes 2 --ranks-per-node 1,2 --link-rate 200mbit,1gbit]
    ciera measure layers | collectives | exponents   (the same options; one kind of capture)
    ciera measure timeline --bundle DIR --run RUN_ID [--iteration 0] --out FILE.json
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .campaign import (
    MAX_LAUNCHES,
    CapturePlan,
    Topology,
    capture_all,
    capture_launched,
    launched_topology,
    plan_steps,
    prepare_out_dir,
)
from .capture import MAX_TIMED_ITERATIONS, SYSTEMS
from .cli import write_json
from .launch import CaptureError

app = typer.Typer(
    help="Capture real traces (events, collectives sweeps, exponent statistics) into a trace bundle.",
    no_args_is_help=True,
)


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CaptureError(
            f"{option} {text!r}: expected comma-separated whole numbers, e.g. 2,4,6,8"
        ) from None
    if not values:
        raise CaptureError(f"{option} {text!r}: expected at least one number")
    _refuse_twice(option, text, values)
    return values


def _refuse_twice(option: str, text: str, values: tuple) -> None:
    """A value listed twice is a typo, not a request (the plan would record it twice)."""
    twice = sorted({value for value in values if values.count(value) > 1}, key=str)
    if twice:
        raise CaptureError(f"{option} {text!r}: names {', '.join(map(str, twice))} twice")


def _split_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _names(option: str, text: str) -> tuple[str, ...]:
    names = _split_names(text)
    if not names:  # `--systems ""` is a mistake, not a request for a capture without them
        raise CaptureError(f"{option} {text!r}: expected at least one comma-separated name")
    _refuse_twice(option, text, names)
    return names


def _topologies(
    nodes: int, ranks_per_node: str, link_rates: str | None, latency_s: float
) -> tuple[Topology, ...]:
    per_node = _ints("--ranks-per-node", ranks_per_node)
    if link_rates is None:
        if nodes != 1:
            raise CaptureError(
                f"--nodes {nodes} needs --link-rate: nodes are network namespaces joined by a shaped link "
                "(without --link-rate the ranks run as plain local processes, one node)"
            )
        return tuple(Topology(1, g) for g in per_node)
    from .emulated import EmulationError, check_environment, parse_rate_Bps

    rates = _names("--link-rate", link_rates)
    for rate in rates:
        try:
            parse_rate_Bps(rate)
        except (EmulationError, ValueError) as error:
            raise CaptureError(f"--link-rate: {error}") from None
    try:
        check_environment()
    except EmulationError as error:
        raise CaptureError(f"--link-rate needs the emulated cluster: {error}") from None
    return tuple(Topology(nodes, g, rate, latency_s) for g, rate in itertools.product(per_node, rates))


def _listed_topologies(text: str, latency_s: float) -> tuple[Topology, ...]:
    """`--topologies 2x1-200mbit,2x2-200mbit,3x1-200mbit,1x2`: each item M x G ranks, with an emulated
    inter-node link rate after the dash (none: plain local ranks on one node)."""
    topologies = []
    for item in _split_names(text):  # none: refused below, naming the shape expected
        shape, _, rate = item.partition("-")
        nodes_text, _, per_node_text = shape.partition("x")
        try:
            nodes, per_node = int(nodes_text), int(per_node_text)
        except ValueError:
            raise CaptureError(
                f"--topologies {item!r}: expected NODESxRANKS[-RATE], e.g. 2x1-200mbit or 1x2"
            ) from None
        if nodes < 1 or per_node < 1:
            raise CaptureError(f"--topologies {item!r}: nodes and ranks per node must be >= 1")
        topologies.extend(_topologies(nodes, str(per_node), rate or None, latency_s))
    if not topologies:
        raise CaptureError(f"--topologies {text!r}: expected at least one NODESxRANKS[-RATE]")
    if len(set(topologies)) != len(topologies):
        raise CaptureError(f"--topologies {text!r}: names a topology twice")
    return tuple(topologies)


def _check_packages(plan: CapturePlan) -> None:
    """torch, and DeepSpeed where a system runs on it: one line naming what to install, before any rank."""
    from .train import TrainConfig, check_environment

    engines = {SYSTEMS[system][0] for system in plan.systems}
    if "exponents" in plan.kinds and plan.exponent_steps:
        engines.add("zero3")
    for engine in sorted(engines, reverse=True):  # zero3 first: it needs torch and deepspeed
        check_environment(TrainConfig(engine=engine))


def _check_capacity(plan: CapturePlan) -> None:
    """Say before starting when this machine cannot hold a topology."""
    from .emulated import EmulationError, check_capacity
    from .zoo import parameter_count, scaled_shape

    params = parameter_count(scaled_shape(plan.model, plan.width_scale, max(plan.layers)))
    for topology in plan.topologies:
        # Python + torch + DeepSpeed per rank, and bf16 weights, fp32 master weights and Adam states.
        per_rank_bytes = 700e6 + 18.0 * params
        try:
            check_capacity(topology.nodes, topology.ranks_per_node, per_rank_bytes)
        except EmulationError as error:
            raise CaptureError(f"topology {topology.name}: {error}") from None


def _placement_notes(plan: CapturePlan) -> list[str]:
    """Where the ranks will run (measure.placement decides in each rank; the same rule, said once here),
    and, on CUDA, that the CIERA systems run the device gather (measure.train.placed_config)."""
    import torch

    from .placement import choose_placement

    available = torch.cuda.is_available()
    ranks_per_node = max(topology.ranks_per_node for topology in plan.topologies)
    placement = choose_placement(
        available, ranks_per_node - 1, os.environ, torch.cuda.device_count() if available else 0
    )
    notes = [placement.note()]
    ciera_systems = [system for system in plan.systems if system.startswith("ciera")]
    if placement.cuda and ciera_systems:
        notes.append(
            f"{', '.join(ciera_systems)}: CIERA runs its device gather on CUDA ranks (changed exponents "
            "rANS-coded on the GPU, every BF16 parameter compressed): the host codec takes CPU tensors only"
        )
    return notes


def _run(plan: CapturePlan, out: Path, json_path: Path | None) -> None:
    from .assemble import assemble_bundle
    from .train import launched_rank

    launched = launched_rank()
    if launched is not None:
        if any(topology.emulated or topology.nodes > 1 for topology in plan.topologies):
            raise CaptureError(
                "under torchrun / the deepspeed launcher the cluster is the launcher's: drop --nodes and --link-rate"
            )
        plan = dataclasses.replace(plan, topologies=(launched_topology(),))
    plan.check()
    _check_packages(plan)
    if launched is None:
        _check_capacity(plan)
        for line in prepare_out_dir(plan, out):
            Console(stderr=True).print(f"ciera measure: {line}", markup=False, highlight=False)
    elif launched[0] != 0:
        capture_launched(plan, out)  # the other ranks print nothing; rank 0 reports
        return
    console = Console(stderr=True)
    for note in _placement_notes(plan):
        console.print(f"ciera measure: {note}")
    if any(topology.emulated for topology in plan.topologies):
        from .emulated import clean_leftovers, leftover_namespaces
        from .extensions import extensions_dir, remove_locks_since

        say = functools.partial(console.print, soft_wrap=True, markup=False, highlight=False)  # uncut
        leftovers = leftover_namespaces()
        removed = clean_leftovers(leftovers)
        if removed:
            say(f"removed leftovers of a killed capture: {', '.join(removed)}")
        created = [created_s for created_s in leftovers.values() if created_s is not None]
        if created:
            # Its ranks were killed with them: a DeepSpeed build lock they held would stall every rank.
            for lock in remove_locks_since(extensions_dir(), min(created)):
                say(f"removed a DeepSpeed build lock the killed capture held: {lock}")
    steps = plan_steps(plan)
    total = sum(step.iterations for step in steps)
    started_s = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} iterations"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("capture", total=total, status="")
        base = {"done": 0}

        def on_step(event: str, step, info: dict) -> None:
            if event == "kept":
                base["done"] += step.iterations
                progress.update(task, completed=base["done"])
                progress.console.print(f"kept {step.name} (finished before)")
            elif event == "link":
                progress.console.print(
                    f"{step.topology.name}: nominal {info['link_rate_Bps'] / 1e6:.1f} MB/s, gloo gets "
                    f"{info['measured_link_Bps'] / 1e6:.1f} MB/s across nodes"
                )
            elif event == "start":
                progress.update(task, description=step.name, status="starting ranks")
            elif event == "progress" and "iteration" in info:
                progress.update(
                    task,
                    # A run timed longer than planned (--min-timed-s) stays within its share of the bar.
                    completed=base["done"] + min(info["iteration"] + 1, step.iterations),
                    status=f"{info['iteration'] + 1}/{info['of']}"
                    + (" warm" if info.get("warm") else "")
                    + (f" loss {info['loss']:.3f}" if "loss" in info else ""),
                )
            elif event == "progress":  # a collectives sweep: one row per op, group and size
                progress.update(
                    task, status=f"{info['op']} {info['bytes']:,} B over {info['world_size']} ranks"
                )
            elif event == "done":
                base["done"] += step.iterations
                progress.update(task, completed=base["done"], status="done")

        try:
            done = (
                capture_all(plan, out, on_step) if launched is None else capture_launched(plan, out, on_step)
            )
        except KeyboardInterrupt:
            raise CaptureError(
                f"interrupted: finished runs are kept in {out}; the same command goes on from there"
            ) from None
    if set(plan.kinds) == {"collectives"}:  # sweeps only: nothing a bundle could hold without a run
        _sweeps_summary(out, done, time.perf_counter() - started_s, json_path, plan)
        return
    bundle = assemble_bundle(out)
    import traces

    path = traces.write_bundle(bundle, out / "bundle", overwrite=True)
    wall_s = time.perf_counter() - started_s
    _summary(bundle, path, done, wall_s)
    if json_path is not None:
        write_json(
            json_path,
            {
                "schema": "ciera.measure/1",
                "bundle": str(path),
                "plan": plan.to_json(),
                "captured": done["captured"],
                "kept": done["kept"],
                "links": done["links"],
                "wall_s": wall_s,
                "runs": _run_summaries(bundle),
            },
        )


def _sweeps_summary(out: Path, done: dict, wall_s: float, json_path: Path | None, plan: CapturePlan) -> None:
    """`ciera measure collectives`: the sweeps are the result; a bundle needs a layer or exponent run."""
    from .assemble import finished_sweeps

    console = Console(stderr=True)
    sweeps = []
    for sweep_dir, cluster, rows in finished_sweeps(out):
        ops = sorted({row["op"] for row in rows})
        sizes = len({row["bytes"] for row in rows})
        sweeps.append({"cluster": cluster, "path": str(sweep_dir), "ops": ops, "sizes": sizes})
        console.print(
            f"collectives sweep of {cluster}: {', '.join(ops)} at {sizes} sizes, in {sweep_dir}",
            markup=False,
            highlight=False,
        )
    console.print(
        f"{len(done['captured'])} captured, {len(done['kept'])} kept from before; wall {wall_s:.0f} s; no bundle "
        "written: a bundle needs a layer or exponent run (`ciera measure all` with the same options and --out "
        "adds them and keeps these sweeps)",
        markup=False,
        highlight=False,
    )
    if json_path is not None:
        write_json(
            json_path,
            {
                "schema": "ciera.measure/1",
                "bundle": None,
                "plan": plan.to_json(),
                "captured": done["captured"],
                "kept": done["kept"],
                "links": done["links"],
                "wall_s": wall_s,
                "runs": [],
                "sweeps": sweeps,
            },
        )


def _none_if_missing(value) -> float | None:
    return None if value is None or value != value else float(value)  # NaN: not recorded


def _run_summaries(bundle) -> list[dict]:
    import traces

    summaries = traces.run_summaries(bundle)
    if summaries.empty:  # no run with timed iterations (an exponent-statistics capture)
        return []
    summaries = summaries.set_index("run_id")
    runs = bundle.runs[bundle.runs["run_id"].isin(summaries.index)]
    rows = []
    for run in runs.itertuples():
        versions = json.loads(run.versions)
        summary = summaries.loc[run.run_id]
        rows.append(
            {
                "run_id": run.run_id,
                "system": run.system,
                "layers": int(run.layers),
                "cluster": run.cluster,
                "block_size": int(run.block_size),
                "warm_steps": int(versions.get("warm_steps", 0)),
                "min_timed_s": float(versions.get("min_timed_s", 0.0)),
                # Runs captured before the allocator was recorded ran with the system's.
                "allocator": str(versions.get("allocator", "system")),
                "timed_iterations": int(summary["iterations"]),
                "warmup_iterations": int(run.warmup_iterations),  # the warm steps included
                "median_iteration_s": float(summary["iteration_median_s"]),
                "allgather_raw_bytes_per_iteration": float(summary["allgather_raw_bytes"]),
                "allgather_wire_bytes_per_iteration": float(summary["allgather_wire_bytes"]),
                "gc_collect_median_s": versions.get("gc_collect_median_s"),
                "other_cpu_share": _none_if_missing(summary["other_cpu_share"]),
                "launches": int(summary["launches"]),
                "launch_spread": _none_if_missing(summary["launch_spread"]),
                "gather_path_s_per_gather": _none_if_missing(summary["gather_path_s_per_gather"]),
            }
        )
    return rows


def allocator_line(summaries: list[dict]) -> str:
    """One console line on how the runs' ranks handled the memory they freed (`--allocator`)."""
    from .launch import RETAIN_ALLOCATOR_ENV

    counts = {kind: sum(s["allocator"] == kind for s in summaries) for kind in ("retain", "system")}
    settings = ", ".join(f"{key}={value}" for key, value in RETAIN_ALLOCATOR_ENV.items())
    parts = []
    if counts["retain"]:
        parts.append(
            f"{counts['retain']} runs kept the memory their ranks freed ({settings}), as a GPU rank's caching "
            "allocator does"
        )
    if counts["system"]:
        parts.append(
            f"{counts['system']} runs with glibc's defaults: their large buffers were faulted "
            "in again every iteration, a cost a GPU rank does not have (docs/measurement.md)"
        )
    return "allocator: " + "; ".join(parts)


def launch_spread_line(summaries: list[dict]) -> str:
    """One console line on how far the launches of each run differ ("" when every run had one launch): the
    spread (slowest − fastest) / median of a run's launch medians — what pooling them averages out."""
    import pandas as pd

    from traces import launch_spread_summary

    pooled = launch_spread_summary(pd.DataFrame(summaries, columns=["run_id", "launches", "launch_spread"]))
    if not pooled["runs"]:
        return ""
    counts = pooled["launches"]
    count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        f"each run pooled from {count} launches of fresh ranks, in rounds over the plan: a run's launch medians "
        f"differ by {100 * pooled['mean']:.1f} % on average, up to {100 * pooled['max']:.1f} % "
        f"({pooled['widest_run']})"
    )


def other_cpu_line(summaries: list[dict]) -> str:
    """One console line on what other processes took from the host during the runs ("" when unrecorded)."""
    import pandas as pd

    from traces import BUSY_HOST_SHARE, busy_host_summary

    host = busy_host_summary(pd.DataFrame(summaries, columns=["run_id", "other_cpu_share"]))
    if not host["recorded"]:
        return ""
    if not host["busy"]:
        return f"other processes used at most {100 * host['largest_share']:.1f} % of the host's CPU during any run"
    return (
        f"[bold yellow]the host was busy[/]: other processes used more than {100 * BUSY_HOST_SHARE:.0f} % of "
        f"its CPU during {host['busy']} of {host['recorded']} runs (up to {100 * host['largest_share']:.0f} %, "
        f"{host['busiest_run']}); those runs' times include that contention — recapture them on a quiet "
        "machine (docs/measurement.md)"
    )


def _summary(bundle, path: Path, done: dict, wall_s: float) -> None:
    console = Console()
    summaries = _run_summaries(bundle)
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"measured runs in {path} (median iteration; all-gather bytes per iteration, raw and on the wire; "
        "gather path per all-gather)",
    )
    for column in ("cluster", "L", "system", "iteration", "raw", "wire", "path", "vs zero3"):
        table.add_column(column, justify="left" if column in ("cluster", "system") else "right")
    baseline = {
        (s["cluster"], s["layers"]): s["median_iteration_s"] for s in summaries if s["system"] == "zero3"
    }
    for s in sorted(summaries, key=lambda s: (s["cluster"], s["layers"], s["system"])):
        base = baseline.get((s["cluster"], s["layers"]))
        table.add_row(
            s["cluster"],
            str(s["layers"]),
            s["system"],
            f"{s['median_iteration_s'] * 1e3:.0f} ms",
            f"{s['allgather_raw_bytes_per_iteration'] / 1e6:.2f} MB",
            f"{s['allgather_wire_bytes_per_iteration'] / 1e6:.2f} MB",
            f"{s['gather_path_s_per_gather'] * 1e6:.0f} µs"
            if s["gather_path_s_per_gather"] is not None
            else "-",
            f"{base / s['median_iteration_s']:.2f}x" if base else "-",
        )
    console.print(table)
    if any(s["gather_path_s_per_gather"] is not None for s in summaries):
        console.print(
            "path: the main thread's time inside the engine's gather calls per all-gather, per rank (issue "
            "and wait: the engine's host path, or CIERA's with its codec; network waits excluded)"
        )
    if summaries:
        warm = sorted({s["warm_steps"] for s in summaries})
        blocks = sorted({s["block_size"] for s in summaries})
        console.print(
            f"B = {', '.join(map(str, blocks))}; "
            + (
                f"{', '.join(map(str, warm))} warm steps (trained, not recorded) before each run's warm-up"
                if warm != [0]
                else "no warm steps: each run's warm-up starts at step 0"
            )
        )
        timed = sorted({s["timed_iterations"] for s in summaries})
        floors = sorted({s["min_timed_s"] for s in summaries if s["min_timed_s"] > 0})
        console.print(
            f"timed iterations per run: {timed[0]}"
            + (f"-{timed[-1]}" if len(timed) > 1 else "")
            + (
                f" (each run timed at least {', '.join(f'{f:g}' for f in floors)} s at its warm-up pace, "
                f"at most {MAX_TIMED_ITERATIONS} iterations)"
                if floors
                else ""
            )
        )
        console.print(allocator_line(summaries))
        launches_line = launch_spread_line(summaries)
        if launches_line:
            console.print(launches_line)
        collects = [s["gc_collect_median_s"] for s in summaries if s["gc_collect_median_s"] is not None]
        if collects:
            console.print(
                "Python's GC ran between the timed iterations, not inside them (median "
                f"{1e3 * min(collects):.0f}-{1e3 * max(collects):.0f} ms per iteration, untimed; "
                "docs/measurement.md)"
            )
        busy_line = other_cpu_line(summaries)
        if busy_line:
            console.print(busy_line)
    console.print(
        f"{len(done['captured'])} captured, {len(done['kept'])} kept from before; wall {wall_s:.0f} s; "
        f"bundle: {path} ({len(bundle.runs)} runs, {len(bundle.events)} events)"
    )


# ---------------------------------------------------------------------------------------- commands


ModelOption = Annotated[str, typer.Option("--model", help="Zoo model (key, alias or name; `ciera models`).")]
OutOption = Annotated[
    Path, typer.Option("--out", help="Capture directory (resumable); the bundle is DIR/bundle.")
]
NodesOption = Annotated[
    int, typer.Option("--nodes", help="Nodes (network namespaces; > 1 needs --link-rate).")
]
RanksOption = Annotated[
    str, typer.Option("--ranks-per-node", help="Ranks per node; a list captures each (e.g. 1,2).")
]
RateOption = Annotated[
    str | None,
    typer.Option(
        "--link-rate", help="Inter-node link rate in tc syntax (e.g. 200mbit,1gbit); root on Linux."
    ),
]
LatencyOption = Annotated[float, typer.Option("--link-latency", help="One-way inter-node delay, seconds.")]
WidthOption = Annotated[int, typer.Option("--width-scale", help="Width divisor (0: the zoo's default).")]
LayersOption = Annotated[str, typer.Option("--layers", help="Depths to capture, comma-separated.")]
SystemsOption = Annotated[str, typer.Option("--systems", help=f"Systems: {', '.join(SYSTEMS)}.")]
IterationsOption = Annotated[int, typer.Option("--iterations", help="Timed iterations per run.")]
WarmupOption = Annotated[int, typer.Option("--warmup", help="Untimed iterations first (>= 1).")]
WarmStepsOption = Annotated[
    int,
    typer.Option(
        "--warm-steps",
        help="Training steps before the warm-up, nothing recorded (mid-training churn; batches go on).",
    ),
]
MinTimedOption = Annotated[
    float,
    typer.Option(
        "--min-timed-s",
        help="Time each run at least this long: more than --iterations where iterations are short "
        f"(as many as the last warm-up iteration's pace fits, at most {MAX_TIMED_ITERATIONS}; 0: --iterations).",
    ),
]
LaunchesOption = Annotated[
    int,
    typer.Option(
        "--launches",
        help="Launch each run this many times, fresh ranks each, in rounds over the plan; the bundle pools "
        f"their timed iterations (1 to {MAX_LAUNCHES}).",
    ),
]
AllocatorOption = Annotated[
    str,
    typer.Option(
        "--allocator",
        help="retain: every rank keeps the memory it frees (glibc, no mmap'd chunks, no trimming), as a GPU "
        "rank's caching allocator does; system: glibc's defaults (large buffers faulted in again every "
        "iteration).",
    ),
]
BlockSizeOption = Annotated[
    int, typer.Option("--block-size", help="CIERA's block size B in every run (a power of two).")
]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write the capture's summary as JSON.")]
TimeoutOption = Annotated[
    float, typer.Option("--timeout-s", help="A rank that shows no progress for this long stops the capture.")
]


def _plan(kinds, model, width_scale, nodes, ranks_per_node, link_rate, link_latency, layers, systems,
          iterations, warmup, exponent_steps, timeout_s, collectives_max_mib,
          topologies=None) -> CapturePlan:  # fmt: skip
    if topologies is not None:
        if nodes != 1 or ranks_per_node != "2" or link_rate is not None:
            raise CaptureError("--topologies names nodes, ranks per node and link rates: drop --nodes, "
                               "--ranks-per-node and --link-rate")  # fmt: skip
        chosen = _listed_topologies(topologies, link_latency)
    else:
        chosen = _topologies(nodes, ranks_per_node, link_rate, link_latency)
    return CapturePlan(
        model=model,
        width_scale=width_scale or None,
        layers=_ints("--layers", layers),
        systems=_names("--systems", systems),
        topologies=chosen,
        iterations=iterations,
        warmup_iterations=warmup,
        exponent_steps=exponent_steps,
        timeout_s=timeout_s,
        collectives_max_bytes=int(collectives_max_mib) << 20,
        kinds=kinds,
    )


def _command(kinds: tuple[str, ...], default_exponent_steps: int):
    def command(
        out: OutOption,
        model: ModelOption = "mixtral-8x7b",
        width_scale: WidthOption = 32,
        nodes: NodesOption = 1,
        ranks_per_node: RanksOption = "2",
        link_rate: RateOption = None,
        link_latency: LatencyOption = 0.0,
        topologies: Annotated[
            str | None,
            typer.Option(
                "--topologies",
                help="Topologies to capture, NODESxRANKS[-RATE] each (e.g. 2x1-200mbit,2x2-200mbit,3x1-200mbit); "
                "instead of --nodes/--ranks-per-node/--link-rate.",
            ),
        ] = None,
        layers: LayersOption = "2,4,6,8",
        systems: SystemsOption = "zero3,fsdp,ciera",
        iterations: IterationsOption = 3,
        warmup: WarmupOption = 2,
        exponent_steps: Annotated[
            int,
            typer.Option("--exponent-steps", help="Training steps of the exponent-statistics run (0: none)."),
        ] = default_exponent_steps,
        collectives_max_mib: Annotated[
            int,
            typer.Option(
                "--collectives-max-mib", help="Largest collective of the sweep, MiB (>= 64 by nccl-tests)."
            ),
        ] = 64,
        timeout_s: TimeoutOption = 600.0,
        select: Annotated[
            bool,
            typer.Option(
                "--select/--no-select",
                help="CIERA with BSC: compress only the shards whose measured benefit pays (ZeRO-3).",
            ),
        ] = False,
        warm_steps: WarmStepsOption = 0,
        block_size: BlockSizeOption = 64,
        min_timed_s: MinTimedOption = 0.0,
        launches: LaunchesOption = 1,
        allocator: AllocatorOption = "retain",
        json_path: JsonOption = None,
    ) -> None:
        plan = _plan(kinds, model, width_scale, nodes, ranks_per_node, link_rate, link_latency, layers,
                     systems, iterations, warmup, exponent_steps, timeout_s, collectives_max_mib,
                     topologies)  # fmt: skip
        plan = dataclasses.replace(
            plan,
            select=select,
            warm_steps=warm_steps,
            block_size=block_size,
            min_timed_s=min_timed_s,
            launches=launches,
            allocator=allocator,
        )
        _run(plan, out, json_path)

    return command


app.command("all", help="Collectives sweeps, layer runs and exponent statistics: a whole bundle.")(
    _command(("collectives", "layers", "exponents"), 40)
)
app.command("layers", help="Timed iterations of the real engines, every event recorded (depth x system).")(
    _command(("layers",), 0)
)
app.command(
    "collectives", help="nccl-tests-style sweep: all_gather, reduce_scatter, all_reduce, 1 KiB..64 MiB."
)(_command(("collectives",), 0))
app.command("exponents", help="Exponent, block and shard change rates per parameter over real training.")(
    _command(("exponents",), 40)
)


@app.command("timeline")
def timeline_command(
    bundle: Annotated[str, typer.Option("--bundle", help="Bundle directory, or `measured`.")],
    run: Annotated[str, typer.Option("--run", help="run_id of a measured run with events.")],
    out: Annotated[Path, typer.Option("--out", help="Chrome-trace JSON file (opens in Perfetto).")],
    iteration: Annotated[int, typer.Option("--iteration", help="Iteration of the run.")] = 0,
) -> None:
    """Write one measured iteration as Chrome-trace JSON: one process per rank, one thread per stream — the
    format `ciera simulate --timeline` writes, so both open side by side in Perfetto."""
    import traces

    from .timeline import measured_timeline

    loaded = traces.read_bundle(traces.resolve_bundle(bundle))
    document = measured_timeline(loaded, run, iteration)
    write_json(out, document, "--out")
    Console().print(
        f"wrote {out}: run {run} iteration {iteration}, {len(document['traceEvents'])} trace events"
    )
