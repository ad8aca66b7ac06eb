"""The depth rewrite's per-block compute, three rules against the measured compute of held-out depths.

    python benchmarks/depth_rule.py --bundle measured|measured-olmoe|measured-w16|DIR [--held-out FILE] [--json FILE]

For every cluster and system of a bundle, the runs at the held-out file's seen depths are the traced
ones and the deepest of them the anchor; every other measured depth is predicted by `sim.repeat_blocks`
(the code path of every projection) from the anchor's iterations, under three rules for what a block
added or dropped costs in main-thread compute: the pooled mean of every traced block (as built,
`sim.fit_block_compute`), the anchor's own blocks copied (the rule before), and the slope of a
least-squares line through the traced runs' compute per rank and iteration. Each prediction is the
rewritten iterations' compute per rank and iteration (mean over iterations), against the measured run's
(`traces.stream_summaries`). Only compute is compared: the rest of the iteration is the same under every
rule. Reads the bundle only; no rank is started.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from _output import OneLineParser, add_bundle_argument, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RULES = ("pooled_blocks", "anchor_blocks", "line_slope")


def _compute_per_rank_s(graph) -> float:  # noqa: ANN001  (a sim.OpGraph)
    return float(graph.duration_s[graph.stream == "compute"].sum()) / len(np.unique(graph.rank))


def compare(bundle_name: str, held_out_path: Path | None) -> dict:
    import sim
    import traces
    from validation.sim_check import default_held_out_path, load_held_out

    bundle = traces.read_bundle(traces.resolve_bundle(bundle_name))
    path = held_out_path or default_held_out_path(bundle_name)
    if path is None:
        raise ValueError(f"--bundle {bundle_name}: no shipped held-out file; give --held-out FILE")
    traced_depths = set(load_held_out(Path(path)).seen_layers)
    runs = bundle.runs_with_events()
    runs = runs[runs["source"] == "measured"]
    compute_s = traces.stream_summaries(bundle)
    compute_s = compute_s[compute_s["stream"] == "compute"].set_index("run_id")["seconds"]
    rows = []
    for (cluster, system), of_pair in runs.groupby(["cluster", "system"], sort=True):
        traced = of_pair[of_pair["layers"].isin(traced_depths)]
        if traced["layers"].nunique() < 2:
            continue
        anchor = traced.sort_values(["layers", "run_id"]).iloc[-1]
        anchor_layers = int(anchor["layers"])
        depths = traced["layers"].astype(float).to_numpy()
        totals = np.array([float(compute_s[run_id]) for run_id in traced["run_id"]])
        per_block = {
            "pooled_blocks": sim.fit_block_compute(bundle, traced).block_compute_s,
            "anchor_blocks": None,
            "line_slope": float(np.polyfit(depths, totals, 1)[0]),
        }
        events = bundle.events[bundle.events["run_id"] == anchor["run_id"]]
        graphs = list(sim.iteration_graphs(events).values())
        for _, target in of_pair[~of_pair["layers"].isin(traced_depths)].sort_values("layers").iterrows():
            measured_s = float(compute_s[target["run_id"]])
            predicted = {
                rule: float(
                    np.mean(
                        [
                            _compute_per_rank_s(
                                sim.repeat_blocks(graph, anchor_layers, int(target["layers"]), 1.0, block_s)
                            )
                            for graph in graphs
                        ]
                    )
                )
                for rule, block_s in per_block.items()
            }
            rows.append(
                {
                    "cluster": cluster,
                    "system": system,
                    "anchor_run": str(anchor["run_id"]),
                    "target_run": str(target["run_id"]),
                    "measured_compute_s": measured_s,
                    "per_block_s": per_block,
                    "predicted_compute_s": predicted,
                    "error": {rule: value / measured_s - 1 for rule, value in predicted.items()},
                }
            )
    if not rows:
        raise ValueError(
            f"--bundle {bundle_name}: no cluster and system with two traced depths and a held-out one"
        )
    summary = {
        rule: {
            "mean_abs_error": float(np.mean([abs(row["error"][rule]) for row in rows])),
            "max_abs_error": float(np.max([abs(row["error"][rule]) for row in rows])),
        }
        for rule in RULES
    }
    return {
        "benchmark": "depth_rule",
        "bundle": str(bundle_name),
        "held_out": str(path),
        "traced_depths": sorted(traced_depths),
        "per": "rank and timed iteration (main-thread compute)",
        "rows": rows,
        "summary": summary,
    }


def main() -> None:
    import sim
    import traces
    from validation.sim_check import ValidationInputError

    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_bundle_argument(parser)
    parser.add_argument(
        "--held-out", type=Path, help="its seen depths are the traced ones (default: the shipped file)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        result = compare(args.bundle, args.held_out)
    except (traces.TraceError, sim.SimInputError, ValidationInputError, OSError, ValueError) as error:
        parser.exit(2, f"depth_rule.py: {error}\n")
    for row in result["rows"]:
        errors = "  ".join(f"{rule} {100 * row['error'][rule]:+5.1f} %" for rule in RULES)
        print(f"{row['target_run']}: compute {1e3 * row['measured_compute_s']:.0f} ms measured; {errors}")
    for rule, figures in result["summary"].items():
        print(
            f"{rule}: mean |error| {100 * figures['mean_abs_error']:.2f} %, "
            f"max {100 * figures['max_abs_error']:.2f} %"
        )
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
