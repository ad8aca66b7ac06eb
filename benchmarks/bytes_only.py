"""What CIERA's bytes alone buy on each captured run, against what its measured runs got — by the
simulator's own CIERA rewrite, the one `ciera validate sim` checks. Reads a bundle; starts no rank.

    python benchmarks/bytes_only.py [--bundle measured] [--held-out FILE] [--runs SUBSTRING] [--json F]

For every (cluster, depth) where the bundle has a plain engine's run and its CIERA twin (ZeRO-3 and
ZeRO-3 + CIERA, FSDP2 and FSDP2 + CIERA), three predictions from the plain run's own graphs (no depth or
cluster rewrite: the anchor is the run itself), by `sim.predict_run`:

- ``plain_s``: the plain run as traced (its compute calibrated as for every prediction);
- ``bytes_only_s``: the CIERA rewrite with the codec figures' costs set to zero — each gather carries
  CIERA's bytes (the payload ratios, per-shard headers and overflow rounds of the fitted figures) and
  nothing else changes: no encode, no decode, no host time beyond the engine's own;
- ``ciera_s``: the CIERA rewrite with the figures as fitted (what `ciera validate sim` predicts).

``bytes_only_speedup`` = plain_s / bytes_only_s: the most a runtime sending these bytes gains on that
run's schedule — a gather hidden behind compute saves nothing. It is neither `benchmarks/train_step.py`'s
bytes bound T_plain / (T_plain − (1 − r)·T_allgather), which takes every gather's saved time off the
step, nor a simulate record's `bound_speedup`, which assumes perfect overlap. Beside it the measured
speedup (the plain run's median over the CIERA twin's), the rewrite's predicted one, and
``codec_cost_s`` = ciera_s − bytes_only_s: what the codec and its host work cost the iteration in the
rewrite. Where the bytes-only speedup is near 1 no runtime can pay: the gathers are not what the
iteration waits for.

The codec figures are fitted as `ciera validate sim` fits them: to the held-out file's codec runs
(default: the bundle's own held-out file).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sim  # noqa: E402
import traces  # noqa: E402
from sim.ciera_rewrite import PLAIN_ENGINE, CodecFigures  # noqa: E402
from sim.predict import CieraOn  # noqa: E402
from sim.rewrite import measured_cluster  # noqa: E402
from validation.sim_check import (  # noqa: E402
    HeldOut,
    ValidationInputError,
    codec_figures,
    default_held_out_path,
    load_held_out,
)


def bytes_only(figures: CodecFigures) -> CodecFigures:
    """`figures` with every cost of CIERA's own set to zero: its bytes, and nothing else."""
    return dataclasses.replace(
        figures,
        encode_s=(0.0, 0.0, 0.0),
        decode_s=(0.0, 0.0, 0.0),
        glue_s_per_gather=0.0,
        gather_host_s_per_call=None,  # the engine's own gather path stays as traced
    )


def speedups(bundle: traces.TraceBundle, held_out: HeldOut, runs_containing: str = "") -> list[dict]:
    runs = bundle.runs_with_events()
    measured = runs[runs["source"] == "measured"]
    medians = bundle.iterations.groupby("run_id")["iteration_s"].median()
    rows = []
    # The figures `ciera validate sim` fits: each codec run paired with its plain twin (here among every
    # measured run, the seen ones included: the same twin).
    fitted = codec_figures(bundle, bundle, held_out, measured)
    for system, engine in PLAIN_ENGINE.items():
        figures = fitted.get(system)
        if figures is None:
            continue
        variants = {
            "ciera": CieraOn(figures, engine, engine),
            "bytes_only": CieraOn(bytes_only(figures), engine, engine),
        }
        for (cluster, layers), pair in measured.groupby(["cluster", "layers"], sort=True):
            plain, codec = pair[pair["system"] == engine], pair[pair["system"] == system]
            if plain.empty or codec.empty or runs_containing not in str(codec.iloc[0]["run_id"]):
                continue
            plain_row, codec_row = plain.iloc[0], codec.iloc[0]
            # The plain run alone as the anchor's candidates: every prediction starts from its graphs.
            own = bundle.with_runs({str(plain_row["run_id"])})
            cluster_spec = measured_cluster(bundle.collectives, plain_row)
            plain_s = sim.predict_run(own, plain_row, cluster_spec, bundle.collectives).iteration_s
            predicted = {
                name: sim.predict_run(own, codec_row, cluster_spec, bundle.collectives, on).iteration_s
                for name, on in variants.items()
            }
            measured_plain, measured_codec = (
                float(medians[plain_row["run_id"]]),
                float(medians[codec_row["run_id"]]),
            )
            rows.append({
                "cluster": cluster, "layers": int(layers), "system": system,
                "plain_run": str(plain_row["run_id"]), "codec_run": str(codec_row["run_id"]),
                "in_sample": str(codec_row["run_id"]) in held_out.codec_runs,
                "measured_plain_s": measured_plain, "measured_ciera_s": measured_codec,
                "measured_speedup": measured_plain / measured_codec,
                "plain_s": plain_s, "bytes_only_s": predicted["bytes_only"], "ciera_s": predicted["ciera"],
                "bytes_only_speedup": plain_s / predicted["bytes_only"],
                "predicted_speedup": plain_s / predicted["ciera"],
                "codec_cost_s": predicted["ciera"] - predicted["bytes_only"],
            })  # fmt: skip
    return rows


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="measured", help="bundle name or directory (default: measured)")
    parser.add_argument("--held-out", type=Path, default=None, help="held-out file naming the codec runs")
    parser.add_argument("--runs", default="", help="only CIERA runs whose id contains this")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        held_out_path = args.held_out or default_held_out_path(args.bundle)
        if held_out_path is None:
            parser.exit(2, f"bytes_only.py: bundle {args.bundle!r} has no held-out file; give --held-out\n")
        held_out = load_held_out(held_out_path)
        bundle = traces.read_bundle(traces.resolve_bundle(args.bundle))
        missing = sorted(set(held_out.codec_runs) - set(bundle.runs["run_id"]))
        if missing:
            parser.exit(2, f"bytes_only.py: {held_out_path}: codec run {missing[0]!r} is not in the bundle\n")
        rows = speedups(bundle, held_out, args.runs)
    except (traces.TraceError, ValidationInputError, sim.SimInputError, OSError, ValueError) as error:
        parser.exit(2, f"bytes_only.py: {error}\n")
    if not rows:
        parser.exit(
            2, f"bytes_only.py: {args.bundle}: no plain run with a CIERA twin (matching {args.runs!r})\n"
        )
    for row in rows:
        print(
            f"{row['codec_run']}: bytes only {row['bytes_only_speedup']:.3f}x, measured {row['measured_speedup']:.3f}x, "
            f"predicted {row['predicted_speedup']:.3f}x; codec and host work {1e3 * row['codec_cost_s']:+.0f} ms "
            f"of {1e3 * row['plain_s']:.0f} ms",
            file=sys.stderr,
        )
    by_system = {}
    for system in sorted({row["system"] for row in rows}):
        chosen = [row for row in rows if row["system"] == system]
        by_system[system] = {
            "bytes_only_speedup_median": float(np.median([row["bytes_only_speedup"] for row in chosen])),
            "measured_speedup_median": float(np.median([row["measured_speedup"] for row in chosen])),
            "runs_measured_faster": sum(row["measured_speedup"] > 1.0 for row in chosen),
            "runs": len(chosen),
        }
    emit_json(
        {"benchmark": "bytes_only", "bundle": args.bundle, "held_out": str(held_out_path),
         "by_system": by_system, "rows": rows},
        args.json,
    )  # fmt: skip


if __name__ == "__main__":
    main()
