"""The CIERA rewrite with the engine's gather path measured against the same rewrite reading it by difference,
on one bundle, in one run: `ciera validate sim` twice — on the bundle as captured (its `gather_host` events:
the plain run's path replaced by CIERA's, measured per call) and on the same bundle with every
`gather_host` event relabelled `compute` (what a capture before that stream recorded: the glue is the codec
run's compute minus its plain twin's, per call). Reads a bundle; starts no rank.

    python benchmarks/gather_path_ab.py --bundle DIR --held-out FILE [--json F]

The bundle must record the engine's gather path (captures since 2026-12-05). Per variant: the held-out
mean and max |error| overall and by category, each system's CIERA runs' errors, the in-sample codec runs'
errors and the codec figures' description.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import traces  # noqa: E402
from validation.sim_check import ValidationInputError, load_held_out, validate_sim  # noqa: E402


def without_gather_path(bundle: traces.TraceBundle) -> traces.TraceBundle:
    """`bundle` as a capture without the `gather_host` stream would have recorded it: that time in `compute`."""
    events = bundle.events
    stream = events["stream"].astype(object).where(events["stream"] != "gather_host", "compute")
    return dataclasses.replace(bundle, events=events.assign(stream=stream.astype(events["stream"].dtype)))


def summary(result: dict) -> dict:
    ciera = {}
    for row in result["held_out"]:
        if row["system"] in ("ciera", "ciera-fsdp") and row.get("error") is not None:
            ciera.setdefault(row["system"], []).append(round(row["error"], 4))
    return {
        "mean_abs_error": result["held_out_mean_abs_error"],
        "max_abs_error": result["held_out_max_abs_error"],
        "mean_abs_error_by_category": result["held_out_mean_abs_error_by_category"],
        "max_abs_error_by_category": result["held_out_max_abs_error_by_category"],
        "ciera_errors": ciera,
        "in_sample": {row["system"]: row["error"] for row in result["codec_runs_in_sample"]},
        "codec_figures": {k: v["description"] for k, v in result["codec_figures"].items() if v},
    }


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="bundle name or directory (with gather_host events)")
    parser.add_argument("--held-out", type=Path, required=True)
    parser.add_argument("--tolerance", type=float, default=0.04)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        bundle = traces.read_bundle(traces.resolve_bundle(args.bundle))
        if not (bundle.events["stream"] == "gather_host").any():
            parser.exit(2, f"gather_path_ab.py: {args.bundle}: no gather_host events (captured before the "
                        "engine's gather path was recorded): nothing to compare\n")  # fmt: skip
        held_out = load_held_out(args.held_out)
        measured = validate_sim(bundle, held_out, args.tolerance)
        by_difference = validate_sim(without_gather_path(bundle), held_out, args.tolerance)
    except (traces.TraceError, ValidationInputError, OSError, ValueError) as error:
        parser.exit(2, f"gather_path_ab.py: {error}\n")
    result = {
        "benchmark": "gather_path_ab",
        "bundle": args.bundle,
        "held_out": str(args.held_out),
        "path_measured": summary(measured),
        "glue_by_difference": summary(by_difference),
    }
    for name in ("path_measured", "glue_by_difference"):
        part = result[name]
        categories = ", ".join(
            f"{key} {100 * part['mean_abs_error_by_category'][key]:.1f} / "
            f"{100 * part['max_abs_error_by_category'][key]:.1f} %"
            for key in part["mean_abs_error_by_category"]
        )
        print(f"{name}: mean {100 * part['mean_abs_error']:.1f} %, max {100 * part['max_abs_error']:.1f} %; "
              f"{categories}", file=sys.stderr)  # fmt: skip
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
