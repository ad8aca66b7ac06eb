"""How repeatable captures of one plan are: the same runs captured two or more times, side by side.

    python benchmarks/capture_repeat.py --bundles DIR_A1,DIR_A2 [--bundles DIR_B1,DIR_B2 ...]
        [--json out/capture_repeat.json]

Each ``--bundles`` is one arm: comma-separated bundles (a capture's ``DIR/bundle``, or its ``DIR``) that
captured the same runs (the same run ids) — e.g. the same `ciera measure layers` command run twice, and
a second arm with ``--min-timed-s``. Per arm and bundle, the model-free noise lines `ciera validate sim`
prints (validation.sim_check.measurement_noise: the spread of a run's timed iterations, (max − min) /
median, and how far a line a + b·L through each (cluster, system)'s measured depths misses its own
points; with ``--launches``, how far a run's launch medians differ) and the timed iterations per run;
across the arm's bundles, how far each run's median iteration differs from the same run's in the arm's
other bundles ((max − min) / mean of its medians) — what a capture taken at another time would have
measured instead. No model is involved.

How the arms of the README's figures were taken (as root, one after the other, A B A B):

    ciera measure layers --model mixtral-8x7b --width-scale 32 --topologies 2x1-1gbit --layers 2,4,6,8 \\
        --systems zero3,ciera --iterations 6 --warmup 3 [--min-timed-s 8] --out captures/mt-A1   # -B1, -A2, -B2

and those of docs/validation.md, "Launches pooled" (plain local ranks, A B A B A B):

    ciera measure layers --model mixtral-8x7b --width-scale 32 --layers 2,4,6 --systems zero3,ciera \\
        --warmup 3 --iterations 12 --out captures/ab/A1          # B: --iterations 4 --launches 3, ab/B1
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's packages

import traces  # noqa: E402
from validation.sim_check import measurement_noise  # noqa: E402


def _bundle_path(text: str) -> Path:
    path = Path(text)
    return path / "bundle" if (path / "bundle").is_dir() else path


def arm_summary(paths: list[Path]) -> dict:
    """The noise lines of each bundle of one arm and how its runs' medians differ between bundles."""
    bundles = [traces.read_bundle(path) for path in paths]
    # Runs with timed iterations (an exponent-statistics run has none).
    run_sets = [set(bundle.iterations["run_id"]) for bundle in bundles]
    common = sorted(set.intersection(*run_sets))
    if not common:
        raise ValueError(f"{', '.join(map(str, paths))}: no run id in common; expected captures of one plan")
    per_bundle = []
    medians = []
    for path, bundle in zip(paths, bundles, strict=True):
        noise = measurement_noise(bundle, bundle.runs[bundle.runs["run_id"].isin(common)])
        summaries = traces.run_summaries(bundle).set_index("run_id").loc[common]
        per_bundle.append(
            {
                "bundle": str(path),
                "timed_iterations_min": int(summaries["iterations"].min()),
                "timed_iterations_max": int(summaries["iterations"].max()),
                "iteration_spread_mean": noise["iteration_spread_mean"],
                "iteration_spread_max": noise["iteration_spread_max"],
                "depth_line_residual_mean": noise["depth_line_residual_mean"],
                "depth_line_residual_max": noise["depth_line_residual_max"],
                # With `ciera measure --launches`: how far a run's launch medians differ (None: one launch).
                "launch_spread_mean": noise["launch_spread_mean"],
                "launch_spread_max": noise["launch_spread_max"],
            }
        )
        medians.append(summaries["iteration_median_s"].to_numpy())
    table = np.vstack(medians)  # bundle × run
    summary: dict = {"runs": len(common), "bundles": per_bundle}
    if len(bundles) > 1:
        between = (table.max(axis=0) - table.min(axis=0)) / table.mean(axis=0)
        summary["between_bundles_mean"] = float(between.mean())
        summary["between_bundles_max"] = float(between.max())
        summary["between_bundles_by_run"] = dict(zip(common, between.round(4).tolist(), strict=True))
    summary["median_iteration_s_by_run"] = {
        run: [float(value) for value in table[:, index]] for index, run in enumerate(common)
    }
    return summary


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundles", action="append", required=True, help="one arm: comma-separated bundles")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arms = []
    for text in args.bundles:
        paths = [_bundle_path(part) for part in text.split(",") if part]
        if not paths:
            parser.error(f"--bundles {text!r}: expected comma-separated bundle directories")
        try:
            arms.append({"bundles_asked": text, **arm_summary(paths)})
        except (traces.TraceError, ValueError) as error:
            parser.error(str(error).splitlines()[0])
    emit_json({"benchmark": "capture_repeat", "arms": arms}, args.json)


if __name__ == "__main__":
    main()
