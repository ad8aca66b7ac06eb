"""Time the default simulator sweep and the HTML report against reading the bundle, in the same run.

    python benchmarks/simulate.py --json out/simulate.json [--bundle DIR] [--cluster a100-hdr-testbed]

The sweep is `ciera simulate`'s default: every model of the bundle × W ∈ {4, 8, 16, 32, 64, 128} × six
systems × BF16 and FP16 (ZeRO++ in FP16 only). Each (model, dtype, W, system) is replayed once in simpy
at nominal durations; the Monte Carlo band comes from the vectorised max-plus recurrence. Simulated
events per second = simpy events processed / seconds spent inside the simpy replays (and over the whole
sweep, for the end-to-end rate). The report (if the `report` package is present) is built from the same
records plus one timeline, without writing files.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--bundle", type=Path, default=traces.default_bundle_path())
    parser.add_argument("--cluster", default="a100-hdr-testbed")
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

    # Same sweep through `simulate` (what the CLI runs) to confirm it matches and to time it as users see it.
    started = time.perf_counter()
    public_records = simulate(bundle, preset)
    public_sweep_s = time.perf_counter() - started
    assert len(public_records) == len(records)

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

    result = {
        "benchmark": "simulate",
        "bundle": str(args.bundle),
        "cluster": preset.name,
        "cpu_count": os.cpu_count(),
        "baseline_read_bundle_s": read_s,
        "sweep": {
            "records": len(records),
            "simulations": simulator.simulated_runs,
            "seconds": sweep_s,
            "seconds_via_simulate": public_sweep_s,
            "target_s": 30.0,
            "meets_target": public_sweep_s < 30.0,
            "vs_read_bundle": public_sweep_s / read_s,
            "simpy_events": simulator.simulated_events,
            "simpy_seconds": simulator.simpy_seconds,
            "events_per_s_in_simpy": simulator.simulated_events / simulator.simpy_seconds,
            "events_per_s_end_to_end": simulator.simulated_events / sweep_s,
            "monte_carlo_samples": preset.simulation.samples,
        },
        "report": {
            "seconds": report_s,
            "target_s": 10.0,
            "meets_target": report_s is not None and report_s < 10.0,
            "note": report_note,
        },
    }
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
