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

from .sim_check import ValidationInputError, default_held_out_path, load_held_out, validate_sim

USER_ERRORS: tuple[type[BaseException], ...] = (ValidationInputError,)

app = typer.Typer(help="Check the simulator against measurements it was not given.", no_args_is_help=True)


@app.command("sim")
def sim_command(
    bundle: Annotated[
        str, typer.Option("--bundle", help="Measured bundle: a directory, or `measured`.")
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
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every number as JSON.")] = None,
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
        if bundle != "measured":
            raise ValidationInputError(
                "--held-out FILE is required for a bundle other than the shipped `measured`"
            )
        held_out = default_held_out_path()
    held = load_held_out(held_out)
    loaded = traces.read_bundle(traces.resolve_bundle(bundle))
    with Console(stderr=True).status("replaying and predicting"):
        document = validate_sim(loaded, held, tolerance)
    console = Console()
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
        table.add_row(row["cluster"], str(row["layers"]), row["system"], row["category"],
                      f"{row['measured_s'] * 1e3:.0f} ms", f"{row['predicted_s'] * 1e3:.0f} ms",
                      f"{row['error'] * 100:+.1f} %", speedup)  # fmt: skip
    console.print(table)
    calibration = Table(
        title="α–β per op, fitted to each cluster's collectives sweep (whole group)", box=box.SIMPLE_HEAD
    )
    for column in ("cluster", "op", "α", "β", "relative RMS residual"):
        calibration.add_column(column, justify="left" if column in ("cluster", "op") else "right")
    for row in document["calibration"]:
        beta = "-" if row["beta_Bps"] is None else f"{row['beta_Bps'] / 1e6:.1f} MB/s"
        calibration.add_row(row["cluster"], row["op"], f"{row['alpha_s'] * 1e3:.2f} ms", beta,
                            f"{row['relative_rms_residual'] * 100:.0f} %")  # fmt: skip
    console.print(calibration)
    categories = ", ".join(
        f"{name} {value * 100:.1f} %"
        for name, value in document["held_out_mean_abs_error_by_category"].items()
    )
    console.print(
        f"replay: mean |error| {document['replay_mean_abs_error'] * 100:.3f} %, max "
        f"{document['replay_max_abs_error'] * 100:.3f} % (target <= 2 %); held out: mean |error| "
        f"{document['held_out_mean_abs_error'] * 100:.1f} % (target <= {tolerance * 100:.0f} %), max "
        f"{document['held_out_max_abs_error'] * 100:.1f} % (target <= {2 * tolerance * 100:.0f} %); by what was "
        f"held out: {categories}. {'PASSED' if document['passed'] else 'FAILED'}"
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
    if json_path is not None:
        write_json_atomic(document, json_path, "--json")
    if not document["passed"]:
        raise typer.Exit(1)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="validate")
