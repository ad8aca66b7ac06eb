"""`ciera validate sim`: replay and held-out prediction errors of the simulator against measured runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

import traces
from sim import merged_notes, path_change_text, path_shares_text

from .sim_check import ValidationInputError, default_held_out_path, load_held_out, validate_sim

USER_ERRORS: tuple[type[BaseException], ...] = (ValidationInputError,)

app = typer.Typer(help="Check the simulator against measurements it was not given.", no_args_is_help=True)

# The options the training checks share (`lossless`, `divergence`) and every command's --json.
EngineOption = Annotated[str, typer.Option("--engine", help="zero3 (DeepSpeed ZeRO-3) or fsdp (FSDP2).")]
WorldSizeOption = Annotated[int, typer.Option("--world-size", help="Local gloo ranks.")]
WidthScaleOption = Annotated[
    int, typer.Option("--width-scale", help="Width divisor (0: the zoo's default small scale).")
]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write every number as JSON.")]


def _out() -> Console:
    """The console for tables: its own width on a terminal, 140 columns into a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


@app.command("sim")
def sim_command(
    bundle: Annotated[
        str,
        typer.Option(
            "--bundle",
            help=f"Measured bundle: a directory or one of {', '.join(traces.MEASURED_BUNDLE_NAMES)}.",
        ),
    ] = "measured",
    held_out: Annotated[
        Path | None,
        typer.Option(
            "--held-out", help="Held-out file ([seen] clusters and layers); default: the shipped one."
        ),
    ] = None,
    tolerance: Annotated[
        float, typer.Option("--tolerance", help="Mean |error| allowed on held-out runs.")
    ] = 0.04,
    json_path: JsonOption = None,
) -> None:
    """Replay the seen runs and predict every held-out measured run from them; report per configuration the
    measured and predicted iteration times, the error, and the error of the speedup over zero3."""
    from sim import write_json_atomic
    from sim.simulate import check_output_path

    if not (math.isfinite(tolerance) and 0 < tolerance < 1):
        raise ValidationInputError(f"--tolerance {tolerance}: expected a fraction in (0, 1), e.g. 0.04")
    if json_path is not None:
        check_output_path(json_path, "--json")
    if held_out is None:
        held_out = default_held_out_path(bundle)
        if held_out is None:
            raise ValidationInputError(
                f"--bundle {bundle}: --held-out FILE is required for a bundle other than the shipped "
                f"{', '.join(traces.MEASURED_BUNDLE_NAMES)}"
            )
    held = load_held_out(held_out)
    loaded = traces.read_bundle(traces.resolve_bundle(bundle))
    with Console(stderr=True).status("replaying and predicting"):
        document = validate_sim(loaded, held, tolerance)
    document["bundle"] = bundle
    console = _out()
    replay = Table(title="replay of the seen runs", box=box.SIMPLE_HEAD)
    for column in ("cluster", "L", "system", "measured", "replayed", "error"):
        replay.add_column(column, justify="left" if column in ("cluster", "system") else "right")
    for row in document["replay"]:
        replay.add_row(row["cluster"], str(row["layers"]), row["system"], f"{row['measured_s'] * 1e3:.0f} ms",
                       f"{row['replayed_s'] * 1e3:.0f} ms", f"{row['error'] * 100:+.2f} %")  # fmt: skip
    console.print(replay)
    table = Table(title="held-out runs, predicted from the seen ones", box=box.SIMPLE_HEAD)
    for column in (
        "cluster",
        "L",
        "system",
        "held out by",
        "measured",
        "predicted",
        "error",
        "speedup error",
    ):
        table.add_column(
            column, justify="left" if column in ("cluster", "system", "held out by") else "right"
        )
    for row in document["held_out"]:
        speedup = "-" if row["speedup_error"] is None else f"{row['speedup_error'] * 100:+.1f} %"
        predicted = "-" if row["predicted_s"] is None else f"{row['predicted_s'] * 1e3:.0f} ms"
        error = "not predicted" if row["error"] is None else f"{row['error'] * 100:+.1f} %"
        table.add_row(row["cluster"], str(row["layers"]), row["system"], row["category"],
                      f"{row['measured_s'] * 1e3:.0f} ms", predicted, error, speedup)  # fmt: skip
    console.print(table)
    for system, figures in document["codec_figures"].items():
        if figures is not None:
            console.print(f"CIERA rewrite, {system}: {figures['description']}")
    for row in document["codec_runs_in_sample"]:
        console.print(
            f"in sample (not counted above): {row['system']} on {row['cluster']}, L = {row['layers']}, whose codec "
            f"events the figures were fitted to, predicted by the same rewrite from its plain engine's run: "
            f"{row['predicted_s'] * 1e3:.0f} ms against {row['measured_s'] * 1e3:.0f} ms measured "
            f"({row['error'] * 100:+.1f} %)"
        )
    for note in merged_notes(note for row in document["held_out"] for note in row["notes"]):
        console.print(f"note: {note}")
    calibration = Table(
        title="collective cost curves: each cluster's measured sweep (whole group, mean per size), interpolated",
        box=box.SIMPLE_HEAD,
    )
    columns = ("cluster", "op", "sizes", "link factor", "at 112 KiB", "at 1 MiB", "at 16 MiB",
               "transport CPU per rank at 112 KiB / 1 MiB")  # fmt: skip
    for column in columns:
        calibration.add_column(column, justify="left" if column in ("cluster", "op") else "right")
    for row in document["calibration"]:
        transport = (
            "not measured"
            if row.get("transport_cpu_at_112KiB_s") is None
            else f"{row['transport_cpu_at_112KiB_s'] * 1e3:.2f} / {row['transport_cpu_at_1MiB_s'] * 1e3:.2f} ms"
        )
        calibration.add_row(row["cluster"], row["op"], str(row["sizes"]), f"{row['link_factor']:.2f}",
                            f"{row['time_at_112KiB_s'] * 1e3:.2f} ms", f"{row['time_at_1MiB_s'] * 1e3:.1f} ms",
                            f"{row['time_at_16MiB_s'] * 1e3:.0f} ms", transport)  # fmt: skip
    console.print(calibration)
    anchors = document.get("anchor_calibration", [])
    if anchors:
        compute = [row["compute_scale"] for row in anchors]
        transport = [row["transport_scale"] for row in anchors]
        console.print(
            f"anchors, calibrated in sample on their own runs ({len(anchors)}; each in the JSON; docs/simulator.md): "
            f"compute work ×{min(compute):.2f}–{max(compute):.2f} (each anchor re-costed onto its own cluster "
            f"spends its measured main-thread time), transport CPU ×{min(transport):.2f}–{max(transport):.2f} "
            "(what the run measured over what its sweep says)"
        )
    noise = document["measurement_noise"]
    line = (
        ""
        if noise["depth_line_residual_mean"] is None
        else f"; a line a + b·L fitted to all measured depths of a (cluster, system), in sample, misses its "
        f"own points by mean {noise['depth_line_residual_mean'] * 100:.1f} %, max "
        f"{noise['depth_line_residual_max'] * 100:.1f} %"
    )
    console.print(
        f"measurement noise (no model involved): the {noise['timed_iterations_per_run']}+ timed iterations "
        f"of a run differ by mean {noise['iteration_spread_mean'] * 100:.1f} %, max "
        f"{noise['iteration_spread_max'] * 100:.1f} % (max − min over median){line}"
    )
    if noise.get("runs_pooled_from_launches"):
        counts = noise["launches_per_run"]
        count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        console.print(
            f"launches: {noise['runs_pooled_from_launches']} runs pooled from {count} launches of fresh ranks each; a "
            f"run's launch medians differ by mean {noise['launch_spread_mean'] * 100:.1f} %, max "
            f"{noise['launch_spread_max'] * 100:.1f} % (no model involved)"
        )
    by_system = noise.get("by_system", {})
    if len(by_system) > 1:
        console.print("by system, means (no model involved): " + "; ".join(
            f"{system} {_percent(row['iteration_spread_mean'])} between iterations, depth line "
            f"{_percent(row['depth_line_residual_mean'])}"
            + ("" if row["launch_spread_mean"] is None else f", launches {_percent(row['launch_spread_mean'])} apart")
            for system, row in by_system.items()
        ))  # fmt: skip
    recorded = noise.get("runs_with_host_cpu_recorded", 0)
    if not recorded:
        console.print("host CPU beside the runs: not recorded (captured before `ciera measure` recorded it)")
    elif noise["runs_on_a_busy_host"]:
        console.print(
            f"[bold yellow]{noise['runs_on_a_busy_host']} of {recorded} runs were measured on a busy host[/] "
            f"(other processes took up to {noise['other_cpu_share_max'] * 100:.0f} % of its CPU): their times "
            "include that work, and so do these errors"
        )
    else:
        console.print(
            f"host CPU beside the runs: other processes took at most {noise['other_cpu_share_max'] * 100:.1f} % "
            f"during any of the {recorded} runs"
        )
    console.print(verdict_line(document["ciera_verdicts"]))
    miss_line = path_miss_line(document)
    if miss_line is not None:
        console.print(miss_line)
    for line in over_max_lines(document, 2 * tolerance):
        console.print(line)
    per_category = []
    for name, count in document["held_out_not_predicted_by_category"].items():
        if name in document["held_out_mean_abs_error_by_category"]:
            text = (
                f"{name} mean {document['held_out_mean_abs_error_by_category'][name] * 100:.1f} % "
                f"max {document['held_out_max_abs_error_by_category'][name] * 100:.1f} %"
            )
        else:
            text = f"{name} —"
        per_category.append(text + (f" ({count} runs not predicted)" if count else ""))
    mean, worst = document["held_out_mean_abs_error"], document["held_out_max_abs_error"]
    overall = (
        "nothing predicted"
        if mean is None
        else f"mean |error| {mean * 100:.1f} % (target <= {tolerance * 100:.0f} %), max {worst * 100:.1f} % "
        f"(target <= {2 * tolerance * 100:.0f} %)"
    )
    console.print(
        f"replay: max |error| {document['replay_max_abs_error'] * 100:.3f} % (target <= 1 %); held out: "
        f"{overall}; by what was held out (each mean target <= {tolerance * 100:.0f} %): "
        f"{', '.join(per_category)}. {'PASSED' if document['passed'] else 'FAILED'}"
    )
    if json_path is not None:
        write_json_atomic(document, json_path, "--json")
    if not document["passed"]:
        raise typer.Exit(1)


def over_max_lines(document: dict, max_error: float) -> list[str]:
    """One line per held-out run predicted beyond `max_error`, with how far that run lies off the line
    through its own (cluster, system)'s measured depths — no model involved — so a miss the measurements
    themselves make is told from one the model makes."""
    lines = []
    for row in document["held_out"]:
        if row["error"] is None or abs(row["error"]) <= max_error:
            continue
        miss = row.get("own_depth_line_miss")
        floor = (
            f"the line through its own measured depths misses it by {miss * 100:.1f} % with no model involved"
            if miss is not None
            else "fewer than three depths of it were measured: no line to hold it against"
        )
        lines.append(
            f"over the max target ({max_error * 100:.0f} %): {row['system']} on {row['cluster']}, L = {row['layers']}, "
            f"{row['error'] * 100:+.1f} % ({row['category']}); {floor}{path_text(row)}"
        )
    return lines


def path_text(row: dict) -> str:
    """A held-out run's critical path, measured → predicted per part (ms), where it has one."""
    paths = row.get("critical_path_s")
    if not paths:
        return ""
    return "; its middle iteration's critical path, measured → predicted (ms): " + path_change_text(
        paths["measured"], paths["predicted"]
    )


def path_miss_line(document: dict) -> str | None:
    """Which part of the iteration each category's predictions get wrong: the mean over its runs of
    predicted − measured critical-path time per part, as a share of the measured iteration."""
    by_category = document.get("held_out_path_miss_by_category") or {}
    if not by_category:
        return None
    texts = [
        f"{name}: {path_shares_text(parts) or 'every part within 0.05 %'}"
        for name, parts in by_category.items()
    ]
    return (
        "where the predictions miss (critical path of the middle iteration, predicted − measured per part over "
        "the measured iteration, mean over each category's runs; parts of work that overlap trade places on "
        "the path, the parts sum to the iteration; per run in the JSON): " + "; ".join(texts)
    )


def verdict_line(verdicts: list[dict]) -> str:
    """Whether the predictions put CIERA on the measured side of its plain engine, and where they do not."""
    if not verdicts:
        return "turning CIERA on: no held-out CIERA run has its plain engine's run beside it"
    errors = [abs(row["speedup_error"]) for row in verdicts]
    wrong = [row for row in verdicts if not row["same_side"]]
    text = (
        f"turning CIERA on (its speedup over the plain engine's run of the same cluster and depth): predicted "
        f"faster or slower as measured in {len(verdicts) - len(wrong)} of {len(verdicts)} pairs; speedup error "
        f"mean {sum(errors) / len(errors) * 100:.1f} %, max {max(errors) * 100:.1f} %"
    )
    if wrong:
        text += "; on the other side: " + "; ".join(
            f"{row['system']} on {row['cluster']}, L = {row['layers']}: measured {row['measured_speedup']:.3f}×, "
            f"predicted {row['predicted_speedup']:.3f}×"
            for row in wrong
        )
    return text


@app.command("lossless")
def lossless_command(
    engine: EngineOption = "zero3",
    steps: Annotated[
        int, typer.Option("--steps", help="Training steps per arm (the CIERA arm resumes at half).")
    ] = 20,
    world_size: WorldSizeOption = 2,
    model: Annotated[str, typer.Option("--model", help="Zoo model.")] = "small-moe",
    layers: Annotated[int, typer.Option("--layers", help="Blocks of the model (0: all).")] = 2,
    width_scale: WidthScaleOption = 0,
    block_size: Annotated[
        int, typer.Option("--block-size", help="CIERA's block size B (a power of two), as `ciera train`'s.")
    ] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Weights and data order.")] = 0,
    json_path: JsonOption = None,
) -> None:
    """Train with the engine + CIERA (checkpointed and resumed half-way) and with the plain engine from the
    same seed and data; compare the loss and every parameter and optimizer state at every step. A control
    arm with one int8-quantised gather must be flagged. Exit 1 unless bit-identical and flagged."""

    from measure.train import ENGINES, block_size_problem

    from .lossless import LosslessPlan, run_lossless

    if engine not in ENGINES:
        raise ValidationInputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if steps < 2:
        raise ValidationInputError(f"--steps {steps}: expected at least 2 (the CIERA arm resumes half-way)")
    if layers < 0:
        raise ValidationInputError(f"--layers {layers}: expected a block count >= 0 (0: all)")
    if width_scale < 0:
        raise ValidationInputError(
            f"--width-scale {width_scale}: expected a divisor >= 1 (0: the zoo's default)"
        )
    problem = block_size_problem(block_size, "--block-size")
    if problem:
        raise ValidationInputError(problem)
    _check_json_path(json_path)
    plan = LosslessPlan(
        engine=engine, steps=steps, world_size=world_size, model=model, layers=layers or None,
        width_scale=width_scale or None, block_size=block_size, seed=seed,
    )  # fmt: skip
    _check_train_options(plan)
    document = _run_arms("lossless", run_lossless, plan)
    table = Table(
        title=f"lossless: {engine} + CIERA (block size {document['block_size']}) against {engine}, "
        f"{world_size} ranks",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    control = document["control"]
    rows = [
        ("steps compared (every step: loss bits, SHA-256 of every tensor)", str(document["steps_compared"])),
        ("tensors compared per step (parameters + Adam states)", str(document["tensors_compared"])),
        ("checkpoint and restart with CIERA after step", str(document["resume_at"])),
        ("steps whose loss differs", str(document["steps_with_different_loss"])),
        ("steps whose state differs", str(document["steps_with_different_state"])),
        ("max |difference| (state at steps " + ", ".join(document["max_abs_difference_at_snapshots"]) + "; loss every step)",
         f"{document['max_abs_difference']:.3g}"),
        ("all-gather bytes raw → on the wire (rank 0, all steps)",
         f"{document['bytes_raw']:,} → {document['bytes_sent']:,}"),
        ("bytes saved", f"{document['bytes_saved_fraction'] * 100:.1f} %"),
        (f"control ({control['steps']} steps, one int8 gather): flagged", "yes" if control["flagged"] else "NO"),
        ("control: first differing step, tensors differing", f"{control['first_difference_step']}, "
         f"{control['first_difference_tensor_count']}"),
        ("control: max |difference| of the state, of the loss",
         f"{control['max_abs_difference']:.3g}, {control['max_abs_loss_difference']:.3g}"),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    _out().print(table)
    verdict = "PASSED" if document["passed"] else "FAILED"
    reasons = []
    if not document["bit_identical"]:
        reasons.append(
            f"CIERA differs first at step {document['first_difference_step']} "
            f"({', '.join(document['first_difference_tensors'][:3])})"
        )
    if not control["flagged"]:
        reasons.append("the lossy control was not flagged")
    Console().print(
        f"{verdict}" + (": " + "; ".join(reasons) if reasons else ": bit-identical, control flagged")
    )
    if json_path is not None:
        from sim import write_json_atomic

        write_json_atomic(document, json_path, "--json")
    if not document["passed"]:
        raise typer.Exit(1)


@app.command("divergence")
def divergence_command(
    engine: EngineOption = "zero3",
    steps: Annotated[int, typer.Option("--steps", help="Training steps per arm.")] = 200,
    checkpoints: Annotated[
        int, typer.Option("--checkpoints", help="Evaluations after step 0, evenly spaced.")
    ] = 4,
    world_size: WorldSizeOption = 2,
    model: Annotated[str, typer.Option("--model", help="Zoo model (a top-k MoE).")] = "small-moe",
    layers: Annotated[
        int, typer.Option("--layers", help="Blocks of the model (0: all; small-moe has 6).")
    ] = 0,
    width_scale: WidthScaleOption = 0,
    held_out_sequences: Annotated[
        int, typer.Option("--held-out-sequences", help="Held-out windows of 64 tokens evaluated.")
    ] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Reference weights and every arm's data order.")] = 0,
    json_path: JsonOption = None,
) -> None:
    """Train a reference and four arms (CIERA, a 1-ULP nudge, int8 weight gathers, another seed) on the same
    data; at each checkpoint compare each arm's next-token distributions and routing decisions with the
    reference's on held-out tokens."""

    from measure.train import ENGINES

    from .divergence import DivergencePlan, run_divergence

    if engine not in ENGINES:
        raise ValidationInputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    for name, value, least in (("--steps", steps, 1), ("--checkpoints", checkpoints, 1),
                               ("--held-out-sequences", held_out_sequences, 1), ("--layers", layers, 0),
                               ("--width-scale", width_scale, 0)):  # fmt: skip
        if value < least:
            raise ValidationInputError(f"{name} {value}: expected an integer >= {least}")
    _check_json_path(json_path)
    plan = DivergencePlan(
        engine=engine, steps=steps, checkpoints=checkpoints, world_size=world_size, model=model,
        layers=layers or None, width_scale=width_scale or None, seed=seed, other_seed=seed + 1,
        held_out_sequences=held_out_sequences,
    )  # fmt: skip
    _check_train_options(plan)
    document = _run_arms("divergence", run_divergence, plan)
    table = Table(
        title=f"divergence from the reference ({engine}, {model}, {document['held_out_tokens']:,} held-out "
        "tokens); × seed: as a fraction of the other-seed arm",
        box=box.SIMPLE_HEAD,
    )
    for column in ("arm", "step", "KL", "× seed", "top-1 agree", "routing differs", "× seed", "near-ties",
                   "flip AUC"):  # fmt: skip
        table.add_column(column, justify="left" if column == "arm" else "right")

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    for arm in document["arms"]:
        for point in arm["points"]:
            table.add_row(
                arm["name"], str(point["step"]), f"{point['kl']:.3g}", ratio(point["kl_vs_seed"]),
                f"{point['top1_agreement'] * 100:.2f} %", f"{point['routing_differ'] * 100:.2f} %",
                ratio(point["routing_differ_vs_seed"]), f"{point['near_tie_share'] * 100:.1f} %",
                ratio(point["flip_margin_auc"]),
            )  # fmt: skip
    _out().print(table)
    if document["nudged"]:
        nudged = document["nudged"]
        Console().print(
            f"ulp arm: {nudged['parameter']}[{nudged['index']}] {nudged['from']!r} → {nudged['to']!r}",
            markup=False,
        )
    ciera = next(arm for arm in document["arms"] if arm["name"] == "ciera")
    exact = all(
        p["kl"] == 0 and p["routing_differ"] == 0 and p["top1_agreement"] == 1 for p in ciera["points"]
    )
    Console().print(
        "ciera: identical to the reference at every checkpoint (KL 0, no routing difference)"
        if exact
        else "ciera: DIFFERS from the reference — a losslessness bug; run `ciera validate lossless`"
    )
    if json_path is not None:
        from sim import write_json_atomic

        write_json_atomic(document, json_path, "--json")
    if not exact:
        raise typer.Exit(1)


def _run_arms(label: str, runner, plan):  # noqa: ANN001 — run_lossless/run_divergence and their plan
    """Run the arms under one progress bar on stderr; a training failure is one line.

    Where stderr is not a terminal (a batch job, a log file) a bar never shows, so a plain line is printed
    when an arm starts and at most once a minute in between."""
    import time
    from datetime import timedelta

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from measure.train import TrainError

    console = Console(stderr=True)
    started_s, last_line = time.monotonic(), {"s": -math.inf, "arm": None}
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        task = progress.add_task("arms", total=None, status="starting the reference arm")

        def on_progress(status: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, status=status)
            if console.is_terminal:
                return
            now_s, arm = time.monotonic(), status.partition(":")[0]
            if arm != last_line["arm"] or now_s - last_line["s"] >= 60 or done == total:
                elapsed = timedelta(seconds=int(now_s - started_s))
                console.print(
                    f"{label}: {done}/{total} steps of all arms; {status} ({elapsed})", highlight=False
                )
                last_line.update(s=now_s, arm=arm)

        try:
            return runner(plan, on_progress)
        except TrainError as error:
            raise ValidationInputError(str(error)) from None


def _check_json_path(path: Path | None) -> None:
    """Before hours of training: the JSON must be writable where asked, into a directory that exists."""
    if path is None:
        return
    from sim.simulate import check_output_path

    check_output_path(path, "--json")
    if not path.parent.is_dir():
        raise ValidationInputError(f"--json {path}: directory {path.parent} does not exist")


def _check_train_options(plan) -> None:  # noqa: ANN001 — a LosslessPlan or DivergencePlan
    """Every one-line error the training harness would give, before any rank starts."""
    from measure.train import TrainConfig, TrainError, validate

    try:
        validate(
            TrainConfig(
                model=plan.model, engine=plan.engine, world_size=plan.world_size, steps=plan.steps,
                layers=plan.layers, width_scale=plan.width_scale, seed=plan.seed,
                block_size=getattr(plan, "block_size", TrainConfig.block_size),
            )
        )  # fmt: skip
    except (TrainError, ValueError) as error:
        raise ValidationInputError(str(error).splitlines()[0]) from None


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="validate")


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share * 100:.1f} %"
