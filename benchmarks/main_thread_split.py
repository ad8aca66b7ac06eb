"""Where held-out runs' predicted time goes, stream by stream, against the measured runs — and what the
optimizer step comes to under each world-size rule (`sim.rewrite.OPTIMIZER_WORK`).

    python benchmarks/main_thread_split.py [--bundle measured] [--held-out FILE] [--systems zero3,fsdp]
        [--category topology|link|depth|system] [--without-transport-cpu] [--json F]

For every held-out run of the given systems in one category of `ciera validate sim` (default topology:
another nodes × ranks-per-node shape, a world size the anchor's is not; link: another link rate; depth:
another depth; system: a CIERA system written into its plain engine's graph, `--systems ciera,ciera-fsdp`
— the same seen set, the same call, `validation.sim_check.predict_held_out`):

- measured: the median iteration, and per rank and iteration each main-thread stream's time (compute,
  optim; `traces.stream_summaries`, the mean over ranks and iterations) and the all-gathers' time on their
  stream (start to end, summed) with the median gather's;
- ``as_built``: the prediction, with the same parts (`Prediction.main_thread_s`, `collective_s`,
  `collective_median_s`);
- ``per_element``: the same prediction with every engine's optimizer step scaled by W_a / W_t (the rule
  for all engines before 2026-12-05), for comparison.

``--without-transport-cpu``: both predictions with the collectives' transport CPU left out of the model
(anchor and target; `sim.rewrite.run_transport_s` answering "not measured"), to see how much of the
predicted compute is that load on the shared cores. A what-if, not the simulator as built.

Reads the bundle only; no rank is started.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _output import OneLineParser, add_bundle_argument, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RULES = ("as_built", "per_element")
MAIN_STREAMS = ("compute", "optim")


CATEGORIES = ("topology", "link", "depth", "system")


def split(
    bundle_name: str,
    held_out_path: Path | None,
    systems: list[str],
    without_transport_cpu: bool = False,
    category: str = "topology",
) -> dict:
    import sim.rewrite
    import traces
    from validation.sim_check import category as held_out_category
    from validation.sim_check import (
        codec_figures,
        default_held_out_path,
        load_held_out,
        predict_held_out,
        split_runs,
    )

    bundle = traces.read_bundle(traces.resolve_bundle(bundle_name))
    path = held_out_path or default_held_out_path(bundle_name)
    if path is None:
        raise ValueError(f"--bundle {bundle_name}: no held-out file beside it; give --held-out FILE")
    held_out = load_held_out(path)
    runs = split_runs(bundle, held_out)
    figures = codec_figures(bundle, runs.seen, held_out, runs.seen_runs) if category == "system" else {}
    gathers = bundle.events[bundle.events["stream"] == "allgather"]
    gather_median_s = (gathers["end_s"] - gathers["start_s"]).groupby(gathers["run_id"]).median()
    streams = traces.stream_summaries(bundle).set_index(["run_id", "stream"])["seconds"]
    iteration_s = bundle.iterations.groupby("run_id")["iteration_s"].median()
    if category not in CATEGORIES:
        raise ValueError(f"--category {category}: expected one of {', '.join(CATEGORIES)}")
    of_systems = runs.target_runs[runs.target_runs["system"].isin(systems)]
    in_category = of_systems.apply(lambda run: held_out_category(run, runs.seen_runs) == category, axis=1)
    targets = of_systems[in_category.astype(bool)].sort_values(["system", "cluster", "layers"])
    if targets.empty:
        raise ValueError(
            f"--systems {','.join(systems)}: no held-out run of them in category {category} "
            f"(held out there: {', '.join(sorted(set(runs.target_runs['system']))) or 'none'})"
        )
    built = dict(sim.rewrite.OPTIMIZER_WORK)
    transport_s = sim.rewrite.run_transport_s
    rows = []
    for _, target in targets.iterrows():
        record = {
            "run_id": target["run_id"],
            "system": target["system"],
            "cluster": target["cluster"],
            "layers": int(target["layers"]),
            "measured": {
                "iteration_s": float(iteration_s[target["run_id"]]),
                **{f"{s}_s": float(streams.get((target["run_id"], s), 0.0)) for s in MAIN_STREAMS},
                "allgather_s": float(streams.get((target["run_id"], "allgather"), 0.0)),
                "allgather_median_s": float(gather_median_s.get(target["run_id"], 0.0)),
            },
        }
        for rule in RULES:
            sim.rewrite.OPTIMIZER_WORK.update(
                built if rule == "as_built" else dict.fromkeys(built, "per_element")
            )
            if without_transport_cpu:
                sim.rewrite.run_transport_s = _not_measured
            try:
                prediction = predict_held_out(bundle, runs, figures, target)
            finally:
                sim.rewrite.OPTIMIZER_WORK.update(built)
                sim.rewrite.run_transport_s = transport_s
            if isinstance(prediction, str):  # not predicted (no codec run of that system)
                raise ValueError(f"{target['run_id']}: {prediction}")
            record[rule] = {
                "iteration_s": prediction.iteration_s,
                **{f"{s}_s": prediction.main_thread_s.get(s, 0.0) for s in MAIN_STREAMS},
                "allgather_s": prediction.collective_s.get("allgather", 0.0),
                "allgather_median_s": prediction.collective_median_s.get("allgather", 0.0),
            }
        rows.append(record)
    return {"benchmark": "main_thread_split", "bundle": bundle_name, "held_out": str(path), "category": category,
            "per": "rank and iteration", "rules": list(RULES), "without_transport_cpu": without_transport_cpu,
            "runs": rows}  # fmt: skip


def _not_measured(*_args, **_kwargs) -> None:
    return None


def main() -> None:
    import traces

    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_bundle_argument(parser, default="measured")
    parser.add_argument("--held-out", type=Path, help="default: the file shipped beside a shipped bundle")
    parser.add_argument(
        "--systems",
        default="zero3,fsdp",
        help="systems to show (comma-separated; --category system: ciera,ciera-fsdp)",
    )
    parser.add_argument(
        "--category", default="topology", choices=CATEGORIES, help="held-out runs of this category"
    )
    parser.add_argument(
        "--without-transport-cpu",
        action="store_true",
        help="what-if: the collectives' transport CPU left out",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from sim import SimInputError
    from validation.sim_check import ValidationInputError

    try:
        result = split(
            args.bundle,
            args.held_out,
            [s for s in args.systems.split(",") if s],
            args.without_transport_cpu,
            args.category,
        )
    except (traces.TraceError, SimInputError, ValidationInputError, OSError, ValueError) as error:
        parser.exit(2, f"main_thread_split.py: {error}\n")
    print(
        "ms per rank and iteration: iteration / compute / optim — measured, as built, optimizer by 1/W; "
        "then the all-gathers' time on their stream / the median gather's (ms) — measured, as built"
        + (
            "; both predicted without the collectives' transport CPU (a what-if)"
            if args.without_transport_cpu
            else ""
        )
    )
    for run in result["runs"]:
        parts = [
            " / ".join(f"{1e3 * run[key][f'{name}_s']:6.0f}" for name in ("iteration", *MAIN_STREAMS))
            for key in ("measured", *RULES)
        ]
        gathers = [
            f"{1e3 * run[key]['allgather_s']:5.0f} / {1e3 * run[key]['allgather_median_s']:5.2f}"
            for key in ("measured", "as_built")
        ]
        print(
            f"{run['system']:10s} {run['cluster']:22s} L={run['layers']}:  "
            + "  |  ".join(parts)
            + "  ||  "
            + "  |  ".join(gathers)
        )
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
