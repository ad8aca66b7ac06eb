"""`ciera report`: write the self-contained HTML scaling report.

With `--records` (and optionally `--timeline`) it renders what `ciera simulate --json/--timeline` wrote;
without, it runs the simulator's default sweep through the `sim` API and renders that.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import sim
from traces import TraceBundle, TraceError

from .errors import ReportInputError
from .html import build_report
from .inputs import (
    DTYPES,
    load_records,
    load_timeline,
    parse_context,
    provenance_label,
    timeline_contexts,
    write_text_atomically,
)
from .sensitivity import (
    DEFAULT_KEY,
    BandwidthSweep,
    filter_sweep,
    load_sensitivity,
    reference_from_records,
    simulate_bandwidth_sweep,
)
from .summary import PAYS_ABOVE, pays_bases, summary_rows
from .validation import load_validation, shipped_validation, split_paths

# TraceError: a bad --bundle is reported the same way when the report is driven on its own.
USER_ERRORS: tuple[type[BaseException], ...] = (ReportInputError, TraceError)

DEFAULT_TITLE = "CIERA scale-out report"
DEFAULT_CLUSTER = "a100-hdr-testbed"  # the method's testbed, as `ciera simulate` defaults to


def _split_list(values: list[str] | None, option: str) -> list[str]:
    """Accept both `--models a,b` and `--models a --models b`; given but empty (`--models ""`) is a
    mistake, not a request for the default."""
    items = [item.strip() for value in values or [] for item in value.split(",") if item.strip()]
    if values and not items:
        raise ReportInputError(f"{option}: empty, expected a comma-separated list")
    return items


def _parse_gpus(values: list[str] | None) -> list[int]:
    gpus: list[int] = []
    for item in _split_list(values, "--gpus"):
        if not item.isdigit() or int(item) < 1:
            raise ReportInputError(f"--gpus: {item!r}, expected positive integers such as 4,8,16")
        gpus.append(int(item))
    return gpus


def resolve_model_names(
    models: list[str], known: list[str] | None = None, option: str = "--models"
) -> list[str]:
    """--models entries as the display names records use: a name in `known` (the records' models) in
    any case, else a shipped model's key, alias or display name in any case (traces.load_model_shape).
    The same model named twice (e.g. 'olmoe,OLMoE-1B-7B') is refused. Errors name `option`."""
    from traces import ModelShapeError, load_model_shape

    by_lower = {name.lower(): name for name in known or []}
    resolved: dict[str, str] = {}
    for given in models:
        name = by_lower.get(given.lower())
        if name is None:
            try:
                name = load_model_shape(given).name
            except ModelShapeError as error:
                if known is None:
                    raise ReportInputError(f"{option}: {error}") from None
                raise ReportInputError(
                    f"{option}: {given!r} not in the records (have: {', '.join(sorted(known))})"
                ) from None
            if known is not None and name not in known:
                raise ReportInputError(
                    f"{option}: {given!r} ({name}) not in the records (have: {', '.join(sorted(known))})"
                )
        if name in resolved:
            raise ReportInputError(f"{option}: {given!r} and {resolved[name]!r} are the same model ({name})")
        resolved[name] = given
    return list(resolved)


def _filter_records(
    records: list[dict[str, Any]], models: list[str], gpus: list[int], dtype: str | None
) -> list[dict[str, Any]]:
    selected = [
        r
        for r in records
        if (not models or r["model"] in models)
        and (not gpus or r["gpus"] in gpus)
        and (not dtype or r["dtype"] == dtype)
    ]
    if not selected:
        raise ReportInputError("no records left after --models/--gpus/--dtype filtering")
    return selected


def _check_timeline_matches(
    path: Path, events: list[dict[str, Any]], records: list[dict[str, Any]], console: Console
) -> None:
    """A --timeline must show a (model, dtype, W) the report's records hold after --models/--gpus/--dtype:
    a timeline of another model or W would be read as this one's. Refused in one line; a timeline that
    does not say what it shows is drawn with a console note."""
    contexts = timeline_contexts(events)
    parsed = [parse_context(context) for context in contexts]
    if not contexts or None in parsed:
        console.print(
            f"note: {path}: the timeline does not say which model, dtype and W it shows; it is drawn as given",
            markup=False,
            highlight=False,
        )
        return
    held = {(r["model"], r["dtype"], r["gpus"]) for r in records}
    for context, shown in zip(contexts, parsed, strict=True):
        if shown not in held:
            kept = sorted({r["model"] for r in records})
            raise ReportInputError(
                f"--timeline: {path} shows {context}, which is not among the report's records "
                f"(models {', '.join(kept)}; W {', '.join(map(str, sorted({r['gpus'] for r in records})))}; "
                f"dtype {', '.join(sorted({r['dtype'] for r in records}))}); simulate a matching one with "
                f"ciera simulate --timeline"
            )


def _progress(console: Console, label: str) -> Progress:
    """A progress bar for a simulation the report runs: gone when done, silent when not on a terminal."""
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _simulate_sensitivity(
    bundle: TraceBundle,
    records: list[dict[str, Any]],
    cluster: str | None,
    overrides: list[str],
    console: Console,
) -> tuple[BandwidthSweep | None, str]:
    """The link bandwidth sweep at the report's largest world size (report.sensitivity), timed on the
    console so its cost stays visible."""
    started_s = time.perf_counter()
    with _progress(console, "bandwidth sweep") as progress:
        task = progress.add_task("sensitivity", total=None)
        try:
            sweep, summary = simulate_bandwidth_sweep(
                sim,
                bundle,
                cluster or DEFAULT_CLUSTER,
                overrides,
                records,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
        except sim.SimInputError as error:  # e.g. the records' preset file is gone: the section says why
            sweep, summary = None, f"No link bandwidth sensitivity: {error}"
    if sweep is None:
        console.print(f"note: {summary}", markup=False, highlight=False)
    else:
        console.print(
            f"bandwidth sensitivity: {summary} in {time.perf_counter() - started_s:.1f} s",
            markup=False,
            highlight=False,
        )
    return sweep, summary


def _not_simulated_on(bundle: TraceBundle, cluster: str | None, overrides: list[str]) -> str:
    """Why the bundle cannot be simulated on the report's preset ('' when it can)."""
    preset = sim.load_cluster(cluster or DEFAULT_CLUSTER, sim.parse_overrides(overrides))
    return sim.other_device(bundle, preset)


def _simulate_sweep(
    bundle: TraceBundle,
    models: list[str],
    gpus: list[int],
    dtype: str | None,
    cluster: str | None,
    overrides: list[str],
    console: Console,
    timeline_of: tuple[str, int, str | None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Run the simulator's sweep through its public API, plus one timeline: `timeline_of` (model, W,
    dtype) when given, else the first model, FP16 when swept (so all six systems, ZeRO++ included,
    appear), at the largest world size — and the console says which."""
    parsed_overrides = sim.parse_overrides(overrides)
    sim.check_simulate_overrides(parsed_overrides)
    preset = sim.load_cluster(cluster or DEFAULT_CLUSTER, parsed_overrides)
    sweep_gpus = gpus or list(sim.DEFAULT_GPUS)
    sweep_dtypes = [dtype] if dtype else list(sim.DTYPES)
    with _progress(console, "simulating") as progress:
        task = progress.add_task("sweep", total=None)
        sim_records = sim.simulate(
            bundle,
            preset,
            models=models or None,
            gpus=sweep_gpus,
            dtypes=sweep_dtypes,
            progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    records = [record.to_dict() for record in sim_records]
    if timeline_of is None:
        timeline_model = records[0]["model"]
        timeline_gpus = max(r["gpus"] for r in records)
        timeline_dtype = "fp16" if any(r["dtype"] == "fp16" for r in records) else records[0]["dtype"]
        chosen = "(choose another with --timeline-of MODEL:W[:DTYPE])"
    else:
        timeline_model, timeline_gpus, wanted_dtype = timeline_of
        (timeline_model,) = resolve_model_names(
            [timeline_model], list(dict.fromkeys(r["model"] for r in records)), "--timeline-of"
        )
        if timeline_gpus not in {r["gpus"] for r in records}:
            raise ReportInputError(
                f"--timeline-of: W={timeline_gpus} is not among the simulated world sizes "
                f"({', '.join(str(g) for g in sorted({r['gpus'] for r in records}))})"
            )
        dtypes = sorted({r["dtype"] for r in records if r["model"] == timeline_model})
        timeline_dtype = wanted_dtype or ("fp16" if "fp16" in dtypes else dtypes[0])
        if timeline_dtype not in dtypes:
            raise ReportInputError(
                f"--timeline-of: dtype {timeline_dtype!r} is not simulated (have {dtypes})"
            )
        chosen = "(--timeline-of)"
    console.print(
        f"timeline: {timeline_model} {timeline_dtype} at W={timeline_gpus} {chosen}",
        markup=False,
        highlight=False,
    )
    timeline_document = sim.timeline(bundle, preset, timeline_model, timeline_dtype, timeline_gpus)
    return records, timeline_document["traceEvents"], {"cluster": preset.name}


def _check_timeline_model(given: str, models: list[str], bundle_models: list[str]) -> None:
    """--timeline-of's model, before the sweep: one of the bundle's own models (any case) or a shipped
    model's name, and among --models when they are given."""
    by_lower = {name.lower(): name for name in bundle_models}
    name = by_lower.get(given.lower()) or resolve_model_names([given], None, "--timeline-of")[0]
    if models and name not in models:
        raise ReportInputError(f"--timeline-of: {name} is not in --models ({', '.join(models)})")


def _parse_timeline_of(text: str) -> tuple[str, int, str | None]:
    """MODEL:W[:DTYPE] → (model, W, dtype or None); one line for anything else."""
    parts = [part.strip() for part in text.split(":")]
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise ReportInputError(f"--timeline-of {text!r}: expected MODEL:W[:DTYPE], e.g. olmoe:32:bf16")
    dtype = parts[2] if len(parts) == 3 else None
    if dtype is not None and dtype not in DTYPES:
        raise ReportInputError(
            f"--timeline-of {text!r}: dtype {dtype!r}, expected one of {', '.join(DTYPES)}"
        )
    return parts[0], int(parts[1]), dtype


def _cluster_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("name")
    return getattr(value, "name", str(value))


def report_command(
    html_path: Annotated[Path, typer.Option("--html", help="Output HTML file (written atomically).")] = Path(
        "ciera-report.html"
    ),
    records_path: Annotated[
        Path | None,
        typer.Option(
            "--records", help="Records JSON from `ciera simulate --json`; without it, simulate the sweep."
        ),
    ] = None,
    timeline_path: Annotated[
        Path | None, typer.Option("--timeline", help="Chrome-trace JSON from `ciera simulate --timeline`.")
    ] = None,
    bundle_path: Annotated[
        str | None,
        typer.Option(
            "--bundle",
            help="Trace bundle for the simulation and the exponent plots: a directory, or a shipped one "
            "by name (analytic, the default, or measured).",
        ),
    ] = None,
    models: Annotated[
        list[str] | None, typer.Option("--models", help="Models to include (comma-separated).")
    ] = None,
    gpus: Annotated[
        list[str] | None, typer.Option("--gpus", help="World sizes to include, e.g. 4,8,16,32,64,128.")
    ] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Restrict to bf16 or fp16.")] = None,
    cluster: Annotated[
        str | None, typer.Option("--cluster", help="Cluster preset name or TOML file (simulation only).")
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="KEY=VALUE preset override (simulation only).")
    ] = None,
    sensitivity_path: Annotated[
        Path | None,
        typer.Option(
            "--sensitivity",
            help="Bandwidth sweep JSON from `ciera simulate --sweep inter_node.beta_Bps=V1,V2,... --json`, "
            "for the speedup-vs-bandwidth section (without it, and without --records, the report simulates one).",
        ),
    ] = None,
    validation_paths: Annotated[
        list[str] | None,
        typer.Option(
            "--validation",
            help="JSON from `ciera validate lossless|divergence|sim --json` (repeatable or comma-separated; "
            "each recognised by its schema) for the Validation section.",
        ),
    ] = None,
    timeline_of: Annotated[
        str | None,
        typer.Option(
            "--timeline-of",
            help="Which simulated iteration the timeline shows, MODEL:W[:DTYPE] (e.g. olmoe:32:bf16); default: "
            "the first model at the largest W (simulation only; with --records pass --timeline).",
        ),
    ] = None,
    title: Annotated[str, typer.Option("--title", help="Report title.")] = DEFAULT_TITLE,
) -> None:
    """Write one self-contained HTML report (plotly inlined, works offline)."""
    from traces import default_bundle_path, read_bundle, resolve_bundle

    console = Console(stderr=True)
    console = console if console.is_terminal else Console(stderr=True, width=150)
    started_s = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise ReportInputError(f"--dtype: {dtype!r}, expected one of {', '.join(DTYPES)}")
    if html_path.is_dir():  # fail before a sweep that could take seconds, not after it
        raise ReportInputError(f"{html_path}: is a directory, expected a file path for the HTML report")
    model_names = _split_list(models, "--models")
    gpu_counts = _parse_gpus(gpus)
    if len(set(gpu_counts)) < len(gpu_counts):
        repeated = next(g for g in gpu_counts if gpu_counts.count(g) > 1)
        raise ReportInputError(f"--gpus: {repeated} given twice")
    if timeline_path is not None and records_path is None:
        raise ReportInputError("--timeline needs --records (the records the timeline belongs to)")
    parsed_timeline_of = _parse_timeline_of(timeline_of) if timeline_of is not None else None
    if parsed_timeline_of is not None and records_path is not None:
        raise ReportInputError(
            "--timeline-of chooses a simulated iteration; with --records pass the matching --timeline file"
        )
    if parsed_timeline_of is not None and gpu_counts and parsed_timeline_of[1] not in gpu_counts:
        raise ReportInputError(
            f"--timeline-of: W={parsed_timeline_of[1]} is not in --gpus ({', '.join(map(str, gpu_counts))})"
        )
    if records_path is not None:
        if cluster is not None or overrides:
            raise ReportInputError(
                "--cluster/--set apply to a simulation; with --records the records are rendered as-is"
            )
        records, metadata = load_records(records_path)
        model_names = resolve_model_names(model_names, list(dict.fromkeys(r["model"] for r in records)))
        timeline_events = load_timeline(timeline_path) if timeline_path is not None else []
    else:
        model_names = resolve_model_names(model_names)
    # Read before any simulation: a bad file fails in a moment, not after the sweep.
    sensitivity = load_sensitivity(sensitivity_path) if sensitivity_path is not None else None
    given_validation = split_paths(validation_paths)
    validation = load_validation(given_validation) if given_validation else shipped_validation()
    resolved_bundle_path = (resolve_bundle(bundle_path) if bundle_path else None) or (
        Path(metadata["bundle"]) if records_path and metadata.get("bundle") else None
    )
    if resolved_bundle_path is None and default_bundle_path().exists():
        resolved_bundle_path = default_bundle_path()
    bundle = read_bundle(resolved_bundle_path) if resolved_bundle_path is not None else None
    not_simulated = ""
    if records_path is None:
        if bundle is None:
            raise ReportInputError("--bundle: no trace bundle to simulate (the packaged default is missing)")
        not_simulated = _not_simulated_on(bundle, cluster, overrides or [])
        if not_simulated:
            # A measured bundle of another device: its measured runs, exponents and validation still
            # render; the simulated sections say why they are empty.
            console.print(f"note: no simulation — {not_simulated}", markup=False, highlight=False)
            records, timeline_events, metadata = [], [], {}
        else:
            if parsed_timeline_of is not None:  # before the sweep: a model it will not simulate fails now
                _check_timeline_model(parsed_timeline_of[0], model_names, list(bundle.runs["model"].unique()))
            records, timeline_events, metadata = _simulate_sweep(
                bundle, model_names, gpu_counts, dtype, cluster, overrides or [], console, parsed_timeline_of
            )
    if not not_simulated:
        records = _filter_records(records, model_names, gpu_counts, dtype)
    if timeline_path is not None:
        _check_timeline_matches(timeline_path, timeline_events, records, console)
    sensitivity_missing = None
    if sensitivity is not None:
        report_models = list(dict.fromkeys(r["model"] for r in records))
        sensitivity = filter_sweep(sensitivity, report_models, gpu_counts, dtype)
        if sensitivity.key == DEFAULT_KEY:
            reference_Bps, reference_note = reference_from_records(records, sensitivity.cluster)
            sensitivity = replace(sensitivity, reference_Bps=reference_Bps, reference_note=reference_note)
    elif not_simulated:
        sensitivity_missing = f"no simulation: {not_simulated}"
    elif records_path is None and bundle is not None:
        sensitivity, sensitivity_missing = _simulate_sensitivity(
            bundle, records, cluster, overrides or [], console
        )
    elif bundle is not None and metadata.get("cluster_option"):
        # The records say how they were simulated: the sweep runs on the same preset and overrides.
        sensitivity, sensitivity_missing = _simulate_sensitivity(
            bundle, records, str(metadata["cluster_option"]), list(metadata.get("overrides") or []), console
        )
    else:
        sensitivity_missing = (
            "--records was given without --sensitivity, and the records do not say which preset they were "
            "simulated on (a file from before `ciera simulate` wrote it): no link bandwidth sensitivity data."
        )
        console.print(f"note: {sensitivity_missing}", markup=False, highlight=False)

    if not given_validation:
        shipped = validation.files[0].document
        console.print(
            "note: no --validation file given: the Validation section shows the shipped `ciera validate sim` "
            f"of the measured bundle (held-out mean {shipped['held_out_mean_abs_error'] * 100:.1f} %, max "
            f"{shipped['held_out_max_abs_error'] * 100:.1f} %: {'passed' if shipped['passed'] else 'FAILED'}) "
            "and names the commands for the lossless and divergence checks",
            markup=False,
            highlight=False,
        )
    elif validation.missing_kinds:
        missing = ", ".join(validation.missing_kinds)
        console.print(
            f"note: no {missing} validation JSON given (--validation); the Validation section says which "
            f"command makes {'it' if len(validation.missing_kinds) == 1 else 'each'}",
            markup=False,
            highlight=False,
        )
    document = build_report(
        records,
        timeline_events,
        bundle,
        title,
        cluster=_cluster_name(metadata.get("cluster")) or cluster,
        bundle_path=str(resolved_bundle_path) if resolved_bundle_path is not None else None,
        sensitivity=sensitivity,
        sensitivity_missing=sensitivity_missing,
        validation=validation,
    )
    write_text_atomically(html_path, document)
    elapsed_s = time.perf_counter() - started_s
    console.print(
        f"wrote [bold]{html_path}[/bold] ({len(document.encode()) / 1e6:.1f} MB, {len(records)} records) "
        f"in {elapsed_s:.1f} s"
    )
    out = Console()
    _print_verdicts(records, out if out.is_terminal else Console(width=150))


def _print_verdicts(records: list[dict[str, Any]], console: Console) -> None:
    """The report's summary in a line per model and dtype, last on the console (the same verdicts as the
    report's Summary section and `ciera simulate`'s table: sim.verdict)."""
    if not records:
        return
    rows = summary_rows(records, provenance_label)
    console.print(
        f"Summary (pays: ≥ {PAYS_ABOVE:.2f}× over ZeRO-3; the report's first section):",
        markup=False,
        highlight=False,
    )
    for row in rows:
        console.print(f"  {sim.verdict_line(row)}", markup=False, highlight=False)
    boundaries, inter_nodes = pays_bases(rows)
    for boundary in boundaries:
        console.print(f"  where CIERA pays from {boundary}", markup=False, highlight=False)
    for inter_node in inter_nodes:
        console.print(f"  every verdict rests on the {inter_node}", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
