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
- ``kernel_floor_s``: the CIERA rewrite with the bytes plus the codec's compiled calls and nothing else —
  encode and decode timed here, on this machine, in one thread with the shard hot in cache (the
  `ShardEncoder`/`ShardDecoder` calls the runtime makes: the first gather after a step with a share q of
  blocks changed, q the figures' block change rate, and the repeat gathers with none), at the median
  per-rank shard of the system's codec runs, charged per byte (``kernel_ns_per_byte``). No per-call or
  per-shard cost, no host path, no glue: what a runtime with no overhead around its kernels would pay
  (a floor, not a prediction: the bundle's ranks ran its kernels with cold caches on shared cores);
- ``ciera_s``: the CIERA rewrite with the figures as fitted (what `ciera validate sim` predicts).

``bytes_only_speedup`` = plain_s / bytes_only_s: the most a runtime sending these bytes gains on that
run's schedule — a gather hidden behind compute saves nothing. It is neither `benchmarks/train_step.py`'s
bytes bound T_plain / (T_plain − (1 − r)·T_allgather), which takes every gather's saved time off the
step, nor a simulate record's `bound_speedup`, which assumes perfect overlap. Beside it the measured
speedup (the plain run's median over the CIERA twin's), the rewrite's predicted one, and
``codec_cost_s`` = ciera_s − bytes_only_s: what the codec and its host work cost the iteration in the
rewrite. Where the bytes-only speedup is near 1 no runtime can pay: the gathers are not what the
iteration waits for; where ``kernel_floor_speedup`` < 1, no CPU runtime with this codec can, however
little it spends around its kernels.

The codec figures are fitted as `ciera validate sim` fits them: to the held-out file's codec runs
(default: the bundle's own held-out file).
"""

from __future__ import annotations

import dataclasses
import sys
import time
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


# Gathers of one parameter per cycle of the engine: ZeRO-3 gathers it for forward, recompute and backward,
# FSDP2 for forward and backward; only the first after the optimizer step carries changed exponents.
GATHERS_PER_CYCLE = {"zero3": 3, "fsdp": 2}
KERNEL_SAMPLES = 60


def kernel_seconds(numel: int, block_size: int, q: float, samples: int = KERNEL_SAMPLES) -> dict[str, float]:
    """Median seconds of the codec's own calls on one BF16 shard of `numel` values, hot, in this thread:
    the first gather after a step (a share `q` of blocks changed) and a repeat gather (none), each side."""
    import numba

    from ciera_runtime import CodecConfig
    from ciera_runtime.codec import DType, ShardDecoder, ShardEncoder
    from ciera_runtime.selection import perturb_blocks, synthetic_bits

    config = CodecConfig(block_size=block_size)
    rng = np.random.default_rng(0)
    bits = synthetic_bits(numel, DType.BF16, rng)
    encoder = ShardEncoder(0, numel, "bfloat16", 0, config)
    decoder = ShardDecoder(0, 0, numel, "bfloat16", config)
    out = np.empty(numel, dtype=np.uint16)
    buffer = np.empty(encoder.layout.max_payload_bytes, dtype=np.uint8)
    times: dict[str, list[float]] = {"encode_first": [], "decode_first": [], "encode_repeat": [],
                                     "decode_repeat": []}  # fmt: skip
    threads = numba.get_num_threads()
    numba.set_num_threads(1)  # a rank's codec thread (`ciera measure` gives each rank one)
    try:
        decoder.decode(encoder.encode(bits, buffer), out)  # the full first payload; every kernel compiled
        for _ in range(samples):
            bits = perturb_blocks(bits, q, block_size, "bfloat16", rng)
            for phase in ("first", "repeat"):
                start_s = time.perf_counter()
                payload = encoder.encode(bits, buffer)
                middle_s = time.perf_counter()
                decoder.decode(payload, out)
                times[f"encode_{phase}"].append(middle_s - start_s)
                times[f"decode_{phase}"].append(time.perf_counter() - middle_s)
            if not np.array_equal(out, bits):
                raise RuntimeError("kernel timing: the decoded shard differs from the encoded one")
    finally:
        numba.set_num_threads(threads)
    return {name: float(np.median(values)) for name, values in times.items()}


def kernel_floor(figures: CodecFigures, engine: str, numel: int, seconds: dict[str, float]) -> CodecFigures:
    """`figures` whose only costs are the codec's calls `seconds` (kernel_seconds), averaged over the
    engine's cycle of gathers and charged per byte (of the rank's own shard to encode, of each source's
    shard to decode): the bytes and the kernels, nothing else."""
    cycle = GATHERS_PER_CYCLE[engine]
    shard_bytes = 2.0 * numel
    per_byte = {
        side: (seconds[f"{side}_first"] + (cycle - 1) * seconds[f"{side}_repeat"]) / cycle / shard_bytes
        for side in ("encode", "decode")
    }
    return dataclasses.replace(
        bytes_only(figures), encode_s=(0.0, 0.0, per_byte["encode"]), decode_s=(0.0, 0.0, per_byte["decode"])
    )


def median_shard_values(bundle: traces.TraceBundle, run_ids: tuple[str, ...]) -> int:
    """The median per-rank shard (values) of the CIERA calls of `run_ids`."""
    runs = bundle.runs.set_index("run_id")
    events = bundle.events[bundle.events["run_id"].isin(run_ids)]
    calls = events[(events["stream"] == "allgather") & (events["raw_bytes"] > 0)]
    world = calls["run_id"].map(runs["world_size"]).to_numpy(dtype=float)
    return max(1, int(np.median(calls["raw_bytes"].to_numpy(dtype=float) / world / 2)))


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
        numel = median_shard_values(bundle, figures.runs)  # the figures' own codec runs
        block_size = int(bundle.runs.set_index("run_id").loc[figures.runs[0], "block_size"])
        seconds = kernel_seconds(numel, block_size, figures.block_change_rate)
        floor = kernel_floor(figures, engine, numel, seconds)
        kernels = {
            "shard_values": numel, "block_size": block_size, "q": figures.block_change_rate,
            **{f"{name}_us": 1e6 * value for name, value in seconds.items()},
            "encode_ns_per_byte": 1e9 * floor.encode_s[2], "decode_ns_per_byte": 1e9 * floor.decode_s[2],
        }  # fmt: skip
        variants = {
            "ciera": CieraOn(figures, engine, engine),
            "bytes_only": CieraOn(bytes_only(figures), engine, engine),
            "kernel_floor": CieraOn(floor, engine, engine),
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
                "kernel_floor_s": predicted["kernel_floor"],
                "kernel_floor_speedup": plain_s / predicted["kernel_floor"], "kernels": kernels,
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
            f"{row['codec_run']}: bytes only {row['bytes_only_speedup']:.3f}x, kernels only "
            f"{row['kernel_floor_speedup']:.3f}x, measured {row['measured_speedup']:.3f}x, "
            f"predicted {row['predicted_speedup']:.3f}x; codec and host work {1e3 * row['codec_cost_s']:+.0f} ms "
            f"of {1e3 * row['plain_s']:.0f} ms",
            file=sys.stderr,
        )
    by_system = {}
    for system in sorted({row["system"] for row in rows}):
        chosen = [row for row in rows if row["system"] == system]
        by_system[system] = {
            "bytes_only_speedup_median": float(np.median([row["bytes_only_speedup"] for row in chosen])),
            "kernel_floor_speedup_median": float(np.median([row["kernel_floor_speedup"] for row in chosen])),
            "runs_kernel_floor_faster": sum(row["kernel_floor_speedup"] > 1.0 for row in chosen),
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
