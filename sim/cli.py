"""`ciera simulate`: project iteration time and speedups of ZeRO-3, FSDP, ZeRO++ and CIERA to 4–128 GPUs."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import traces

from . import verdict
from .cluster import list_clusters, load_cluster, parse_overrides
from .errors import SimInputError
from .measured_cluster import measured_clusters, measured_records_to_json, simulate_measured_cluster
from .simulate import (
    DEFAULT_GPUS,
    DTYPES,
    FP16_ONLY_SYSTEMS,
    SYSTEMS,
    SimRecord,
    check_output_path,
    check_simulate_overrides,
    records_to_json,
    simulate,
    timeline,
    write_json_atomic,
)

USER_ERRORS: tuple[type[BaseException], ...] = (SimInputError,)

DEFAULT_CLUSTER = "a100-hdr-testbed"


def _split(values: list[str] | None) -> list[str]:
    """Accept both repeated options and comma-separated lists."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def _given_twice(values: list[str]) -> list[str]:
    return sorted({value for value in values if values.count(value) > 1})


def _listed(values: list[str] | None, option: str, example: str) -> list[str] | None:
    """An option's comma-separated values; None where it was not given. Given but empty (`--systems ""`)
    is a mistake, not a request for the default."""
    if not values:
        return None
    parts = _split(values)
    if not parts:
        raise SimInputError(f"{option}: empty, expected a comma-separated list, e.g. {example}")
    twice = _given_twice(parts)
    if twice:  # `--systems zero3,zero3` printed every row twice
        raise SimInputError(f"{option}: {', '.join(twice)} given twice; list each once")
    return parts


def parse_gpus(values: list[str] | None) -> list[int]:
    parts = _listed(values, "--gpus", "4,8,16")
    if parts is None:
        return list(DEFAULT_GPUS)
    gpus = []
    for part in parts:
        try:
            number = int(part)
        except ValueError:
            raise SimInputError(
                f"--gpus: value {part!r}, expected positive integers >= 2, e.g. 4,8,16"
            ) from None
        if number < 2:
            raise SimInputError(f"--gpus: value {part!r}, expected positive integers >= 2, e.g. 4,8,16")
        if number in gpus:
            raise SimInputError(f"--gpus: {number} given twice; list each world size once")
        gpus.append(number)
    return gpus


def _format_speedup(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _print_summary(records: list[SimRecord], console: Console) -> None:
    """What a reader decides on, last on the console (sim/verdict.py: the rules the report uses too)."""
    dicts = [record.to_dict() for record in records]
    console.print(
        verdict.summary_table(dicts, lambda r: r["source"] + (", projected" if r["projected"] else ""))
    )


def _fit_mark(record: SimRecord) -> str:
    return " ✗" if record.memory.get("fits") is False else ""


def _memory_cell(record: SimRecord) -> str:
    memory = record.memory
    if not memory:
        return "—"
    total = f"{memory['total_bytes'] / 2**30:.0f} GiB"
    return total + (" ✗" if memory.get("fits") is False else "")


def _print_table(records: list[SimRecord], console: Console) -> None:
    table = Table(
        title=f"Simulated iteration time ({records[0].cluster})" if records else "Simulated iteration time"
    )
    for name, justify in (
        ("model", "left"),
        ("dtype", "left"),
        ("gpus", "right"),
        ("system", "left"),
        ("iteration p50 s", "right"),
        ("vs zero3", "right"),
        ("vs zeropp", "right"),
        ("bound", "right"),
        ("memory/GPU", "right"),
        ("source", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    analytic = False
    for record in records:
        marker = record.source + (", projected" if record.projected else "")
        analytic = analytic or record.source != "measured"
        table.add_row(
            record.model + (" †" if record.source != "measured" else ""),
            record.dtype,
            str(record.gpus),
            record.system,
            f"{record.iteration_s['p50']:.4g}",
            _format_speedup(record.speedup_vs_zero3),
            _format_speedup(record.speedup_vs_zeropp),
            _format_speedup(record.bound_speedup),
            _memory_cell(record),
            marker,
        )
    table.caption = (
        ("† from analytic traces (model output, not measurements). " if analytic else "")
        + "projected: world size or depth not traced. bound: the most this system can gain over zero3 with "
        "perfect overlap — for ciera* fewer bytes, for the others their own collectives' link time (ZeRO++: "
        "int8 weights, hpZ inside the node); — where none applies (docs/simulator.md). memory/GPU: "
        "the estimate of sim/memory.py; ✗ does not fit the device."
    )
    console.print(table)


def _print_notes(notes: list[str], console: Console) -> None:
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)


# A full per-record table longer than this is printed with --verbose only (the summary and --json hold it).
TABLE_ROWS_SHOWN = 40


def simulate_command(
    bundle: Annotated[
        str | None,
        typer.Option(
            "--bundle",
            help="Trace bundle directory, or a shipped one by name: analytic (the default) or measured.",
        ),
    ] = None,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--models",
            help="Models to simulate, by name or short name, any case (comma-separated or repeated; "
            "`ciera models` lists them).",
        ),
    ] = None,
    gpus: Annotated[
        list[str] | None, typer.Option("--gpus", help="World sizes, e.g. 4,8,16,32,64,128 (the default).")
    ] = None,
    systems: Annotated[
        list[str] | None,
        typer.Option(
            "--systems",
            help="Systems (default: all): zero3 (DeepSpeed ZeRO-3), fsdp (PyTorch FSDP), zeropp (ZeRO++: int8 "
            "weights + hpZ, fp16 only), ciera-er (exponent reuse on every shard), ciera-er-bsc (+ benefit-driven "
            "shard selection), ciera (+ codec off the critical path).",
        ),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="bf16 or fp16 (default: both; zeropp runs in fp16 only).")
    ] = None,
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster",
            help="Cluster preset name, a TOML file path, or a measured cluster of the bundle (`ciera clusters`).",
        ),
    ] = DEFAULT_CLUSTER,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a preset field, KEY=VALUE with dotted keys (repeatable)."),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(
            "--layers", help="Simulate this many blocks instead of the full model (e.g. a traced depth)."
        ),
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option(
            "--sweep",
            help="Repeat the simulation for each value of one preset field, KEY=V1,V2,... (e.g. "
            "inter_node.beta_Bps=5e9,10e9,25e9): speedups per value, to see where CIERA stops paying.",
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the records as JSON to this file.")
    ] = None,
    timeline_path: Annotated[
        Path | None,
        typer.Option(
            "--timeline",
            help="Write one simulated iteration per system (first model and dtype, largest --gpus) "
            "as Chrome-trace JSON for Perfetto.",
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            help=f"Also print the table of every record when it has more than {TABLE_ROWS_SHOWN} rows, and the "
            "notes on the plans chosen (BSC's selection, cache budgets).",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="Processes for a preset sweep (default: one per core from 16 (model, dtype, W) jobs on, "
            "else 1). The records are the same at any count.",
        ),
    ] = None,
) -> None:
    """Replay one training iteration per system and project it to the requested GPU counts."""
    if workers is not None and workers < 1:
        raise SimInputError(f"--workers: value {workers}, expected a whole number >= 1")
    if cluster not in list_clusters() and not cluster.endswith(".toml"):
        loaded = _read_bundle(bundle)
        if cluster in measured_clusters(loaded):
            if workers is not None:
                raise SimInputError(
                    f"--workers with --cluster {cluster}: a measured cluster's projection runs in this "
                    "process; --workers sets the processes of a preset sweep"
                )
            for option, given in (("--sweep", sweep), ("--set", overrides), ("--timeline", timeline_path)):
                if given:
                    raise SimInputError(
                        f"{option} with --cluster {cluster}: a measured cluster is replayed as captured, "
                        "it has no preset fields or simulated timeline (`ciera measure timeline` writes the "
                        "measured one); use a preset cluster for that"
                    )
            _measured_cluster_command(loaded, cluster, models, systems, dtype, layers, gpus, json_path)
            return
        raise SimInputError(
            f"--cluster: unknown preset {cluster!r}, expected one of {list_clusters()}, a .toml file path, "
            f"or a measured cluster of the bundle ({', '.join(measured_clusters(loaded)) or 'it has none'})"
        )
    if sweep is not None:
        if timeline_path is not None:
            raise SimInputError(
                "--timeline with --sweep: a timeline shows one configuration; drop one of them"
            )
        _sweep_command(
            sweep, bundle, models, gpus, systems, dtype, cluster, overrides or [], layers, json_path, workers
        )
        return
    parsed_overrides = parse_overrides(overrides or [])
    check_simulate_overrides(parsed_overrides)
    preset = load_cluster(cluster, parsed_overrides)
    system_names = _listed(systems, "--systems", "zero3,ciera") or list(SYSTEMS)
    for name in system_names:
        if name not in SYSTEMS:
            raise SimInputError(f"--systems: unknown system {name!r}, expected one of {list(SYSTEMS)}")
    if dtype is not None and dtype not in DTYPES:
        raise SimInputError(f"--dtype: value {dtype!r}, expected one of {list(DTYPES)}")
    dtypes = [dtype] if dtype else list(DTYPES)
    world_sizes = parse_gpus(gpus)
    for option, path in (("--json", json_path), ("--timeline", timeline_path)):
        if path is not None:
            check_output_path(path, option)
    notes = []
    if preset.defaulted:
        notes.append(f"{preset.origin}: not given, defaults used: {', '.join(preset.defaulted)}")
    skipped = [s for s in system_names if s in FP16_ONLY_SYSTEMS]
    if skipped and "bf16" in dtypes:
        if dtypes == ["bf16"] and set(system_names) <= set(FP16_ONLY_SYSTEMS):
            raise SimInputError(
                f"--systems {','.join(system_names)} with --dtype bf16: ZeRO++ is simulated in fp16 only "
                "(as DeepSpeed evaluates it); use --dtype fp16"
            )
        notes.append(f"{', '.join(skipped)}: fp16 only (as in DeepSpeed's ZeRO++), skipped for bf16")
    loaded = _read_bundle(bundle)

    error_console = Console(stderr=True)
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=error_console,
        transient=True,
        disable=not error_console.is_terminal,
    ) as progress:
        task = progress.add_task("sweep", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        started_s = time.perf_counter()
        counters: dict[str, int] = {}
        records = simulate(
            loaded,
            preset,
            models=_listed(models, "--models", "mixtral-8x7b"),
            gpus=world_sizes,
            systems=system_names,
            dtypes=dtypes,
            progress=report,
            layers=layers,
            counters=counters,
            workers=workers,
        )
        elapsed_s = time.perf_counter() - started_s
    if json_path is not None:
        document = records_to_json(
            records,
            preset,
            cluster_option=cluster,
            overrides=list(overrides or []),
            bundle=str(_bundle_path(bundle).resolve()),
        )
        write_json_atomic(document, json_path, "--json")
    if timeline_path is not None:
        first = records[0]
        write_json_atomic(
            timeline(
                loaded,
                preset,
                first.model,
                first.dtype,
                max(world_sizes),
                systems=system_names,
                layers=layers,
            ),
            timeline_path,
            "--timeline",
        )
    # What the simulation substituted or chose belongs on the console: each distinct note once, with the
    # models, dtypes and W's it holds for. Then the table (when short, or --verbose), the summary last.
    dicts = [record.to_dict() for record in records]
    # The inter-node β every verdict rests on is stated under the summary; elsewhere it is a note.
    notes += [
        note
        for note in verdict.grouped_notes(dicts)
        if not ("ciera" in system_names and note.startswith("inter-node β "))
    ]
    details = verdict.grouped_notes(dicts, "details")
    out = Console()
    out = out if out.is_terminal else Console(width=150)
    _print_notes(notes + (details if verbose else []), out)
    if details and not verbose:
        out.print(
            f"{len(details)} more notes on the plans chosen (BSC's selection, cache budgets) with --verbose",
            markup=False,
            highlight=False,
        )
    if verbose or len(records) <= TABLE_ROWS_SHOWN:
        _print_table(records, out)
    else:
        out.print(
            f"{len(records)} records: the table of every one with --verbose, every number with --json",
            markup=False,
            highlight=False,
        )
    events, processes = counters["simulated_events"], counters["workers"]
    out.print(
        f"{len(records)} records, {events:,} simpy events in {elapsed_s:.1f} s "
        f"({events / max(elapsed_s, 1e-9):,.0f} events/s"
        + (f", {processes} processes)" if processes > 1 else ")"),
        markup=False,
        highlight=False,
    )
    if json_path is not None:
        out.print(f"wrote {json_path}", markup=False, highlight=False)
    if timeline_path is not None:
        out.print(f"wrote {timeline_path}", markup=False, highlight=False)
    if "ciera" in system_names:
        _print_summary(records, out)


def _bundle_path(bundle: str | None) -> Path:
    return traces.resolve_bundle(bundle) if bundle is not None else traces.default_bundle_path()


def _read_bundle(bundle: str | None) -> traces.TraceBundle:
    bundle_path = _bundle_path(bundle)
    if bundle is None and not bundle_path.is_dir():
        raise SimInputError(
            f"--bundle: the packaged default bundle is missing at {bundle_path}; "
            "generate one with `ciera analytic-bundle --out DIR` and pass --bundle DIR"
        )
    return traces.read_bundle(bundle_path)


def _measured_cluster_command(
    loaded: traces.TraceBundle,
    cluster: str,
    models: list[str] | None,
    systems: list[str] | None,
    dtype: str | None,
    layers: int | None,
    gpus: list[str] | None,
    json_path: Path | None,
) -> None:
    """Replay (traced configuration) or project (another depth or world size of the cluster's kind) a
    cluster the bundle was measured on; both through the one op graph."""
    if json_path is not None:
        check_output_path(json_path, "--json")
    if dtype is not None and dtype not in DTYPES:
        raise SimInputError(f"--dtype: value {dtype!r}, expected one of {list(DTYPES)}")
    started_s = time.perf_counter()
    with Console(stderr=True).status("replaying and rewriting the measured graphs"):
        records = simulate_measured_cluster(
            loaded,
            cluster,
            models=_listed(models, "--models", "mixtral-8x7b"),
            systems=_listed(systems, "--systems", "zero3,ciera"),
            layers=layers,
            gpus=parse_gpus(gpus) if gpus else None,
            dtypes=[dtype] if dtype else None,
        )
    elapsed_s = time.perf_counter() - started_s
    table = Table(title=f"Iteration time on the measured cluster {cluster} and clusters of its kind")
    for name in (
        "model",
        "dtype",
        "gpus",
        "L",
        "system",
        "measured",
        "simulated",
        "error",
        "vs zero3",
        "memory/rank",
        "how",
    ):
        table.add_column(name, justify="left" if name in ("model", "dtype", "system", "how") else "right")
    for record in records:
        error = (
            ""
            if record.measured_s is None
            else f"{(record.iteration_s / record.measured_s - 1) * 100:+.2f} %"
        )
        table.add_row(
            record.model,
            record.dtype,
            str(record.gpus),
            str(record.layers),
            record.system,
            "—" if record.measured_s is None else f"{record.measured_s * 1e3:.0f} ms",
            f"{record.iteration_s * 1e3:.0f} ms",
            error,
            "—" if record.speedup_vs_zero3 != record.speedup_vs_zero3 else f"{record.speedup_vs_zero3:.2f}×",
            f"{record.memory['total_bytes'] / 2**20:.0f} MiB" if record.memory else "—",
            record.kind,
        )
    table.caption = (
        "replayed: a traced configuration, its measured events evaluated again. projected: the traced graph "
        "rewritten (blocks repeated, collectives re-costed on the target, compute on its cores) and "
        "evaluated — not measured; `ciera validate sim` shows how far these rewrites miss."
    )
    out = Console()
    # What was assumed first, the table (the answer) last.
    projected = [
        f"{r.cluster}: compute {r.compute}"
        for r in sorted(records, key=lambda record: record.gpus)
        if r.kind == "projected"
    ]
    for note in verdict.merged_notes([*projected, *(note for r in records for note in r.notes)]):
        out.print(note, markup=False, highlight=False)
    events = sum(r.simulated_events for r in records)
    out.print(
        f"{len(records)} records, {events:,} simpy events in {elapsed_s:.1f} s "
        f"({events / max(elapsed_s, 1e-9):,.0f} events/s)",
        markup=False,
        highlight=False,
    )
    (out if out.is_terminal else Console(width=160)).print(table)
    if json_path is not None:
        write_json_atomic(measured_records_to_json(records), json_path, "--json")
        print(f"wrote {json_path}", file=sys.stderr)


def _sweep_command(
    sweep, bundle, models, gpus, systems, dtype, cluster, overrides, layers, json_path, workers=None
) -> None:
    key, sep, text = sweep.partition("=")
    values = [value.strip() for value in text.split(",") if value.strip()]
    if not sep or not key.strip() or len(values) < 2:
        raise SimInputError(f"--sweep {sweep!r}: expected KEY=V1,V2,... with two or more values")
    twice = _given_twice(values)
    if twice:
        raise SimInputError(f"--sweep {sweep!r}: {', '.join(twice)} given twice; list each value once")
    if json_path is not None:
        check_output_path(json_path, "--json")
    system_names = _listed(systems, "--systems", "zero3,ciera") or list(SYSTEMS)
    dtypes = [dtype] if dtype else list(DTYPES)
    loaded = _read_bundle(bundle)
    runs = []
    for value in values:
        parsed_overrides = parse_overrides([*overrides, f"{key.strip()}={value}"])
        check_simulate_overrides(parsed_overrides)
        preset = load_cluster(cluster, parsed_overrides)
        records = simulate(
            loaded, preset, models=_listed(models, "--models", "mixtral-8x7b"), gpus=parse_gpus(gpus), systems=system_names,
            dtypes=dtypes, layers=layers, workers=workers,
        )  # fmt: skip
        runs.append((value, records))
    # A value the preset substitutes is said so in its column and below the table: inter_node.beta_Bps=0
    # asks for the fit to the calibration points, and the column would read 0 for the fitted β.
    substituted = {
        value: note
        for value, records in runs
        for note in {n for record in records for n in record.notes if n.startswith("inter-node β")}
        if key.strip() == "inter_node.beta_Bps" and "set in the preset" not in note
    }
    headers = [f"{value} (fitted)" if value in substituted else value for value in values]
    table = Table(title=f"speedup vs zero3 (p50) as {key.strip()} varies ({cluster})")
    for column in ("model", "dtype", "gpus", "system", *headers):
        table.add_column(column, justify="left" if column in ("model", "dtype", "system") else "right")
    first = runs[0][1]
    by_value = [{(r.model, r.dtype, r.gpus, r.system): r for r in records} for _, records in runs]
    for record in first:
        row_key = (record.model, record.dtype, record.gpus, record.system)
        cells = [
            f"{table_of[row_key].speedup_vs_zero3:.2f}×" + _fit_mark(table_of[row_key])
            if row_key in table_of
            else "-"
            for table_of in by_value
        ]
        table.add_row(record.model, record.dtype, str(record.gpus), record.system, *cells)
    if any(_fit_mark(record) for _, records in runs for record in records):
        table.caption = "✗: does not fit one GPU's memory (memory per GPU, docs/simulator.md)"
    console = Console()
    console.print(table)
    every_record = [record.to_dict() for _, records in runs for record in records]
    for note in verdict.grouped_notes(every_record):
        if not note.startswith("inter-node β"):  # that one differs per value and is in the JSON
            console.print(f"note: {note}", markup=False, highlight=False)
    for value, note in substituted.items():
        console.print(f"note: --sweep {key.strip()}={value}: {note}", markup=False, highlight=False)
    if json_path is not None:
        write_json_atomic(
            {
                "schema": "ciera.simulate.sweep/1",
                "key": key.strip(),
                "values": values,
                "cluster": cluster,
                "runs": [{"value": value, **records_to_json(records)} for value, records in runs],
            },
            json_path,
            "--json",
        )
        print(f"wrote {json_path}", file=sys.stderr)


def replay_command(
    bundle: Annotated[
        str, typer.Option("--bundle", help="Trace bundle with events: a directory, or `measured`.")
    ] = "measured",
    run: Annotated[
        str | None, typer.Option("--run", help="Replay one run (default: every run with events).")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every number as JSON.")] = None,
) -> None:
    """Replay measured iterations from their events (durations and the dependencies between streams) and
    compare with the measured iteration times (sim/replay.py)."""
    from .replay import replay_bundle, replay_run

    if json_path is not None:
        check_output_path(json_path, "--json")
    loaded = traces.read_bundle(traces.resolve_bundle(bundle))
    if loaded.events.empty:
        raise SimInputError(
            f"--bundle {bundle}: holds no events (an analytic or schema-v1 bundle); nothing to replay"
        )
    started_s = time.perf_counter()
    if run is not None:
        if run not in set(loaded.events["run_id"].unique()):
            raise SimInputError(
                f"--run {run!r}: no run with events of that id in --bundle {bundle} (`ciera replay --bundle "
                f"{bundle}` lists them)"
            )
        per_iteration = replay_run(loaded, run)
        rows = [
            {
                "run_id": run,
                "iterations": len(per_iteration),
                "measured_s": float(per_iteration["measured_s"].median()),
                "replayed_s": float(per_iteration["replayed_s"].median()),
                "max_abs_error": float(per_iteration["error"].abs().max()),
                "events": int(per_iteration["events"].sum()),
                **loaded.runs.set_index("run_id")
                .loc[run, ["cluster", "system", "layers", "world_size"]]
                .to_dict(),
            }
        ]
    else:
        rows = replay_bundle(loaded).to_dict("records")
    table = Table(title=f"replayed measured iterations ({bundle})")
    columns = ("cluster", "L", "system", "W", "iterations", "measured", "replayed", "max |error|", "run")
    for column in columns:  # the run id last: what `--run` (here and `ciera measure timeline`) takes
        table.add_column(column, justify="left" if column in ("cluster", "system", "run") else "right")
    for row in rows:
        table.add_row(
            str(row["cluster"]),
            str(int(row["layers"])),
            str(row["system"]),
            str(int(row["world_size"])),
            str(int(row["iterations"])),
            f"{row['measured_s'] * 1e3:.1f} ms",
            f"{row['replayed_s'] * 1e3:.1f} ms",
            f"{row['max_abs_error'] * 100:.3f} %",
            str(row["run_id"]),
        )
    console = Console()
    console = console if console.is_terminal else Console(width=180)  # a pipe or file: nothing cut
    console.print(table)
    worst = max(row["max_abs_error"] for row in rows)
    elapsed_s = time.perf_counter() - started_s
    events = sum(int(row["events"]) for row in rows)
    console.print(
        f"{len(rows)} runs replayed; largest |replayed − measured| / measured: {worst * 100:.3f} %; "
        f"{events:,} simpy events in {elapsed_s:.1f} s ({events / max(elapsed_s, 1e-9):,.0f} events/s)"
    )
    if json_path is not None:
        write_json_atomic(
            {
                "schema": "ciera.replay/1",
                "bundle": str(bundle),
                "runs": [
                    {
                        k: (int(v) if k in ("layers", "world_size", "iterations", "events") else v)
                        for k, v in r.items()
                    }
                    for r in rows
                ],
                "max_abs_error": worst,
            },
            json_path,
            "--json",
        )


def clusters_command(
    bundle: Annotated[
        str, typer.Option("--bundle", help="Also list the clusters this bundle was measured on.")
    ] = "measured",
) -> None:
    """List the cluster presets (`--cluster NAME`) and the measured clusters a bundle can replay."""
    # The bundle first: a bad --bundle is refused before anything is printed, not after the presets.
    loaded = traces.read_bundle(traces.resolve_bundle(bundle))
    table = Table(title="cluster presets (sim/data/clusters; copy one to describe your cluster)", box=None)
    for column in ("name", "GPUs/node", "description"):
        table.add_column(column)
    for name in list_clusters():
        preset = load_cluster(name)
        table.add_row(name, str(preset.gpus_per_node), preset.description)
    console = Console()
    console = console if console.is_terminal else Console(width=150)
    console.print(table)
    runs = loaded.runs[loaded.runs["cluster"].isin(measured_clusters(loaded))]
    measured = Table(
        title=f"measured clusters of --bundle {bundle} (replayed by `ciera simulate --cluster`)", box=None
    )
    for column in ("name", "nodes × ranks", "link", "gloo measured", "depths", "systems"):
        measured.add_column(column)
    for name, group in runs.groupby("cluster"):
        first = group.iloc[0]
        measured.add_row(
            str(name),
            f"{int(first['nodes'])} × {int(first['gpus_per_node'])}",
            *(
                (
                    f"{first['link_rate_Bps'] * 8 / 1e6:.0f} Mbit/s",
                    f"{first['measured_link_Bps'] / 1e6:.1f} MB/s",
                )
                if int(first["nodes"]) > 1 and first["link_rate_Bps"] > 0
                else ("none (one node)", "—")  # a local capture: no emulated link, nothing measured across it
            ),
            ",".join(str(n) for n in sorted(set(group["layers"]))),
            ",".join(sorted(set(group["system"]))),
        )
    if runs.empty:
        console.print(f"--bundle {bundle}: no measured runs with events", markup=False)
    else:
        console.print(measured)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_command)
    app.command("replay")(replay_command)
    app.command("clusters")(clusters_command)
