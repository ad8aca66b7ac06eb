"""Time the default simulator sweep and the HTML report against reading the bundle, in the same run.

    python benchmarks/simulate.py --json out/simulate.json [--bundle DIR] [--cluster a100-hdr-testbed]

The sweep is `ciera simulate`'s default: every model of the bundle × W ∈ {4, 8, 16, 32, 64, 128} × six
systems × BF16 and FP16 (ZeRO++ in FP16 only). Each (model, dtype, W, system) is its anchor run's
iterations rewritten (depth, system, cluster) and evaluated in simpy; p5/p50/p95 are over those
iterations. The sweep runs twice: in this process (one `Simulator`: the baseline, and its simpy time) and
through `simulate` as `ciera simulate` runs it, in one worker process per core (`sim.sweep_workers`); the
records must match one for one. Simulated events per second = simpy events processed / seconds spent
rewriting and evaluating the iterations in process, and / the `simulate` time end to end; the sweep's
target is 10 s through `simulate` (docs/simulator.md, Performance), against reading the bundle in the
same run. The report (if the
`report` package is present) is built from the same records plus one timeline, without writing files.

On the op-graph path it also times one 128-rank projection of a measured run (`--measured-bundle`,
default the shipped one; `--measured-run`, default its deepest zero3 run on its first cluster): the run's
iterations rewritten onto 128 ranks of its cluster's kind and evaluated, against replaying the same run
(its graphs at the measured durations) in the same process — and, where the bundle holds ZeRO-3 + CIERA
runs on that cluster, the same projection with CIERA turned on (`ciera simulate --cluster C --systems
ciera --gpus 128`): the codec figures fitted to those runs, then the plain run's graph with CIERA written
in at W = 128 and, for its "vs zero3", the plain projection beside it (`measured_projection_ciera`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

import traces  # noqa: E402
from sim import DEFAULT_GPUS, SYSTEMS, Simulator, load_cluster, simulate, timeline  # noqa: E402
from sim.simulate import DTYPES, resolve_models  # noqa: E402

SWEEP_TARGET_S = 10.0  # the default `ciera simulate` sweep, in process (bundle read, CLI and table aside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--bundle", type=Path, default=traces.default_bundle_path())
    parser.add_argument("--cluster", default="a100-hdr-testbed")
    parser.add_argument("--measured-bundle", type=Path, default=traces.measured_bundle_path())
    parser.add_argument("--measured-run", default=None)
    args = parser.parse_args()

    started = time.perf_counter()
    bundle = traces.read_bundle(args.bundle)
    read_s = time.perf_counter() - started
    preset = load_cluster(args.cluster)

    # The sweep through the public API, with a Simulator we can ask for event counts afterwards.
    started = time.perf_counter()
    simulator = Simulator(bundle, preset)
    records = []
    for model in resolve_models(bundle, None):
        for dtype in DTYPES:
            for world_size in DEFAULT_GPUS:
                records.extend(simulator.records_for(model, dtype, world_size, SYSTEMS))
    sweep_s = time.perf_counter() - started

    # Same sweep through `simulate` (what the CLI runs, in its default worker processes) to confirm it
    # matches record for record and to time it as users see it; the in-process sweep above is the baseline.
    started = time.perf_counter()
    counters: dict[str, int] = {}
    public_records = simulate(bundle, preset, counters=counters)
    public_sweep_s = time.perf_counter() - started
    if [r.to_dict() for r in public_records] != [r.to_dict() for r in records]:
        raise SystemExit("simulate() in worker processes gave other records than the in-process sweep")

    report_s = None
    report_note = "report package not importable"
    try:
        from report.html import build_report

        started = time.perf_counter()
        document = timeline(bundle, preset, records[0].model, "fp16", max(DEFAULT_GPUS))
        html = build_report(
            [r.to_dict() for r in public_records],
            document["traceEvents"],
            bundle,
            "benchmark",
            cluster=preset.name,
        )
        report_s = time.perf_counter() - started
        report_note = f"build_report + one timeline, {len(html.encode()) / 1e6:.1f} MB HTML (not written)"
    except ImportError as error:
        report_note = f"report package not importable: {error}"

    measured, measured_ciera = _measured_projections(args.measured_bundle, args.measured_run)

    result = {
        "benchmark": "simulate",
        "measured_projection": measured,
        "measured_projection_ciera": measured_ciera,
        "bundle": str(args.bundle),
        "cluster": preset.name,
        "cpu_count": os.cpu_count(),
        "baseline_read_bundle_s": read_s,
        "sweep": {
            "records": len(records),
            "simulations": simulator.simulated_runs,
            "seconds_in_process": sweep_s,
            "seconds_via_simulate": public_sweep_s,
            "workers": counters["workers"],
            "speedup_vs_in_process": sweep_s / public_sweep_s,
            "target_s": SWEEP_TARGET_S,
            "meets_target": public_sweep_s <= SWEEP_TARGET_S,
            "vs_read_bundle": public_sweep_s / read_s,
            "simpy_events": simulator.simulated_events,
            "simpy_seconds": simulator.simpy_seconds,
            "events_per_s_in_simpy": simulator.simulated_events / simulator.simpy_seconds,
            "events_per_s_end_to_end": simulator.simulated_events / public_sweep_s,
            "iterations_per_record": sorted({record.iterations for record in records}),
        },
        "report": {
            "seconds": report_s,
            "target_s": 10.0,
            "meets_target": report_s is not None and report_s < 10.0,
            "note": report_note,
        },
    }
    emit_json(result, args.json)


def _measured_projections(path: Path, run_id: str | None) -> tuple[dict, dict | None]:
    from sim.measured_cluster import simulate_measured_cluster
    from sim.replay import replay_run

    bundle = traces.read_bundle(path)
    runs = bundle.runs_with_events()
    if run_id is None:
        zero3 = runs[runs["system"] == "zero3"]
        first = sorted(set(zero3["cluster"]))[0]
        run_id = str(zero3[zero3["cluster"] == first].sort_values("layers").iloc[-1]["run_id"])
    run = runs[runs["run_id"] == run_id].iloc[0]
    started = time.perf_counter()
    replayed = replay_run(bundle, run_id)
    replay_s = time.perf_counter() - started
    baseline = {
        "baseline_replay_s": replay_s,
        "baseline_replay_events": int(replayed["events"].sum()),
    }

    def projected(system: str) -> dict:
        started = time.perf_counter()
        records = simulate_measured_cluster(
            bundle, str(run["cluster"]), systems=[system], layers=int(run["layers"]), gpus=[128]
        )
        projection_s = time.perf_counter() - started
        record = next(r for r in records if r.system == system)
        events = sum(r.simulated_events for r in records)
        return {
            "run": run_id,
            "system": system,
            "records": len(records),
            "iterations": len(replayed),
            **baseline,
            "projection_128_ranks_s": projection_s,
            "projection_events": events,
            "events_per_s": events / projection_s,
            "target_s": 2.0,
            "meets_target": projection_s <= 2.0,
            "projected_iteration_s": record.iteration_s,
            "cluster": record.cluster,
        }

    on_cluster = runs[runs["cluster"] == run["cluster"]]
    with_ciera = "ciera" in set(on_cluster["system"]) and run["system"] == "zero3"
    return projected(str(run["system"])), projected("ciera") if with_ciera else None


if __name__ == "__main__":
    main()
