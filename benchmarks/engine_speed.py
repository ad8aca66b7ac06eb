"""Does CIERA slow DeepSpeed's own code? Its per-module work timed inside ZeRO-3 runs with and without
CIERA, against the host's speed measured by the same threads.

    python benchmarks/engine_speed.py [--model mixtral-8x7b] [--width-scale 32] [--layers 8,2]
        [--steps 40] [--rounds 2] [--json F]

ZeRO-3 + CIERA's captured compute segments run longer than plain ZeRO-3's at depths ≥ 4 (docs/validation.md,
"Why ZeRO-3 + CIERA is predicted fast"). This launches `ciera train MODEL --engine zero3` (2 CPU ranks,
gloo) with CIERA off and on, alternately, ``--rounds`` times per depth, each launch with a probe
(benchmarks/_engine_probe/sitecustomize.py) that times in thread CPU time DeepSpeed's
`release_sub_module` (pure Python), ZeRO-3's Linear forward and backward, and every 97 calls a fixed
pure-Python reference loop. Per launch and rank: µs per call of each, and each over the reference loop's
time in the same run — the host's speed drifts from launch to launch by more than CIERA could change
(docs/measurement.md, "How steady the host is"), so only the normalised figures compare launches.
Also each launch's median step as `ciera train` prints it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "_engine_probe"
TIMED = ("release_sub_module", "linear_forward", "linear_backward")
STEP = re.compile(r"median step\s+([0-9.]+) ms")


def launch(model: str, width_scale: int, layers: int, steps: int, ciera: str, folder: Path) -> dict:
    """One `ciera train` launch with the probe: its median step and per rank the probe's figures."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / f"L{layers}-{ciera}"
    env = dict(os.environ, ENGINE_PROBE_OUT=str(prefix), CIERA_TRAIN_BACKEND="gloo")
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("DS_ACCELERATOR", "cpu")
    command = [sys.executable, "-m", "ciera_cli.main", "train", model, "--engine", "zero3", "--ciera", ciera]
    command += ["--layers", str(layers), "--width-scale", str(width_scale), "--steps", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()
        raise RuntimeError(
            f"ciera train ({' '.join(command[3:])}) failed: {tail[-1] if tail else done.returncode}"
        )
    step = STEP.search(done.stdout)
    ranks = []
    for path in sorted(folder.glob(f"{prefix.name}.*.json")):
        totals = json.loads(path.read_text())
        if "reference" not in totals:
            continue  # a process that imported the engine but timed nothing (the launcher)
        calls, seconds = totals["reference"]
        reference_s = seconds / calls
        rank = {"reference_us": reference_s * 1e6}
        for name in TIMED:
            if name in totals:
                calls, seconds = totals[name]
                rank[f"{name}_us"] = seconds / calls * 1e6
                rank[f"{name}_over_reference"] = seconds / calls / reference_s
        ranks.append(rank)
    if not ranks:
        raise RuntimeError(
            "the probe recorded nothing (DeepSpeed's ZeRO-3 modules not imported by the ranks?)"
        )
    return {
        "layers": layers,
        "ciera": ciera,
        "median_step_ms": float(step.group(1)) if step else None,
        "ranks": ranks,
    }


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--width-scale", type=int, default=32)
    parser.add_argument("--layers", default="8,2", help="depths, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per launch")
    parser.add_argument(
        "--rounds", type=int, default=2, help="launches per depth and setting (off, on alternately)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        depths = [int(text) for text in args.layers.split(",") if text]
    except ValueError:
        parser.error(f"--layers {args.layers}: expected depths like 8,2")
    if not depths or min(depths) < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--layers, --steps and --rounds: expected positive numbers")
    launches = []
    with tempfile.TemporaryDirectory(prefix="engine_speed.") as folder:
        try:
            for round_index in range(args.rounds):
                for layers in depths:
                    for ciera in ("off", "on"):
                        run = launch(
                            args.model,
                            args.width_scale,
                            layers,
                            args.steps,
                            ciera,
                            Path(folder) / str(round_index),
                        )
                        run["round"] = round_index
                        launches.append(run)
                        worst = max(rank["release_sub_module_over_reference"] for rank in run["ranks"])
                        print(
                            f"round {round_index} L={layers} CIERA {ciera:3s}: median step {run['median_step_ms']} ms, "
                            f"reference loop {min(r['reference_us'] for r in run['ranks']):.0f}–"
                            f"{max(r['reference_us'] for r in run['ranks']):.0f} µs, release_sub_module "
                            f"{max(r['release_sub_module_us'] for r in run['ranks']):.0f} µs "
                            f"(× {worst:.3f} of the reference)",
                            flush=True,
                        )
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
            parser.exit(2, f"engine_speed.py: {str(error).splitlines()[0]}\n")
    emit_json(
        {"benchmark": "engine_speed", "model": args.model, "width_scale": args.width_scale, "steps": args.steps,
         "per": "call, thread CPU time", "launches": launches},
        args.json,
    )  # fmt: skip


if __name__ == "__main__":
    main()
