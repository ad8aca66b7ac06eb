"""Step time of `ciera train` (ZeRO-3 + CIERA, 2 spawned gloo ranks) by the codec's numba threads per rank,
against the plain engine measured in the same run.

    python benchmarks/codec_threads.py --json out/codec_threads.json [--engine zero3] [--steps 12]
        [--rounds 2] [--layers 2] [--threads 1,2]

Each variant is one `ciera train --json` subprocess: the plain engine, then CIERA with
``CIERA_CODEC_THREADS`` = each value of ``--threads`` (the runtime's default is cores / local ranks, which is
1 here: 2 cores, 2 ranks). The variants run in ``--rounds`` rounds, the order rotated from round to round so
each sees the same load over time. Reported per variant: the median over rounds of `ciera train`'s median
step (the slowest rank's step time), each round's figure, and the ratio to the plain engine. Every variant
must end with the plain engine's final parameters (CIERA is lossless whatever its thread count); a variant
that does not fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]


def _variants(threads: list[int]) -> list[tuple[str, dict[str, str], list[str]]]:
    plain = ("plain", {}, ["--ciera", "off"])
    return [plain] + [(f"ciera, {n} codec threads", {"CIERA_CODEC_THREADS": str(n)}, []) for n in threads]


def _run(args, extra_env: dict[str, str], extra_args: list[str], json_path: Path) -> dict:
    env = os.environ | extra_env
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO_ROOT / ".torch_extensions"))
    command = [
        sys.executable, "-m", "ciera_cli.main", "train", "--engine", args.engine, "--steps", str(args.steps),
        "--layers", str(args.layers), "--json", str(json_path), *extra_args,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=_REPO_ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"codec_threads: FAILED: {' '.join(command[3:])}: {tail[0]}")
    return json.loads(json_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--engine", choices=("zero3", "fsdp"), default="zero3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", default="1,2", help="CIERA_CODEC_THREADS values, comma-separated")
    args = parser.parse_args()
    try:
        threads = [int(value) for value in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r}: expected whole numbers separated by commas")
    if args.steps < 3 or args.rounds < 1 or min(threads) < 1:
        parser.error("expected --steps >= 3, --rounds >= 1 and every --threads value >= 1")

    variants = _variants(threads)
    medians: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    digests: dict[str, set[str]] = {name: set() for name, _, _ in variants}
    codec_threads: dict[str, str | None] = {}
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ciera-codec-threads-") as scratch:
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            for index, (name, env, extra) in enumerate(variants[shift:] + variants[:shift]):
                document = _run(args, env, extra, Path(scratch) / f"{round_index}-{index}.json")
                medians[name].append(document["median_step_s"] * 1e3)
                digests[name].add(document["parameter_digest"])
                codec_threads[name] = document.get("codec_threads_per_rank")
    plain_ms = statistics.median(medians["plain"])
    plain_digest = digests["plain"]
    result = {
        "schema": "ciera.bench.codec_threads/1",
        "engine": args.engine,
        "model": "small-moe",
        "layers": args.layers,
        "steps": args.steps,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "variants": {
            name: {
                "median_step_ms": round(statistics.median(values), 1),
                "round_median_step_ms": [round(value, 1) for value in values],
                "vs_plain": round(statistics.median(values) / plain_ms, 3),
                "codec_threads_per_rank": codec_threads[name],
                "final_parameters_equal_to_plain": digests[name] == plain_digest and len(plain_digest) == 1,
            }
            for name, values in medians.items()
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    emit_json(result, args.json)
    if not all(variant["final_parameters_equal_to_plain"] for variant in result["variants"].values()):
        print(
            "codec_threads: FAILED: a variant ended with other parameters than the plain engine",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
