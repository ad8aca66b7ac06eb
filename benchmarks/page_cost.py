"""What a freshly faulted page costs on this host, against memory a process keeps: the reason `ciera
measure` runs its ranks with `--allocator retain` (measure.launch.RETAIN_ALLOCATOR_ENV).

    python benchmarks/page_cost.py --json out/page_cost.json [--mib 64] [--repetitions 40]

Two worker processes, one after the other, each timing ``--repetitions`` times the same step: allocate a
``--mib`` MiB torch tensor, fill it, free it — what a training iteration does with its activations,
gradients and optimizer temporaries. ``system``: glibc's defaults, under which a buffer this large is
mmap'd and handed back to the kernel when freed, so every step faults its pages in again; ``retain``: the
same with RETAIN_ALLOCATOR_ENV, under which the freed buffer stays in the process. Per mode: the median,
fastest and slowest step (ms) and the minor page faults per step, after WARMUP_STEPS untimed ones. ``us_per_faulted_page``: the
difference of the two medians over the system mode's faults per step — what one fault costs here (a
virtual machine whose host takes back the pages its guest frees pays it at the host too). Where the
kernel reports free pages to a hypervisor (`/sys/module/page_reporting`), its settings are included.

Nothing else should run meanwhile; the baseline (``retain``) is measured in the same run.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's packages

MODES = ("system", "retain")
PAGE_BYTES = 4096
# Untimed steps first: either way the process's heap is faulted in at the start (retained, glibc settles
# after a handful of steps: 7 here), as a rank's warm-up iterations do.
WARMUP_STEPS = 10
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def _worker(mib: int, repetitions: int) -> dict:
    import statistics

    import torch

    torch.set_num_threads(1)
    size = mib << 20
    times_s, faults = [], []
    for _ in range(repetitions + WARMUP_STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start_s = time.perf_counter()
        buffer = torch.empty(size, dtype=torch.uint8)
        buffer.fill_(1)
        del buffer
        times_s.append(time.perf_counter() - start_s)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    times_s, faults = times_s[WARMUP_STEPS:], faults[WARMUP_STEPS:]
    return {
        "median_ms": 1e3 * statistics.median(times_s),
        "fastest_ms": 1e3 * min(times_s),
        "slowest_ms": 1e3 * max(times_s),
        "faults_per_step": statistics.median(faults),
    }


def _page_reporting() -> dict | None:
    if not PAGE_REPORTING.is_dir():
        return None
    settings = {}
    for path in sorted(PAGE_REPORTING.iterdir()):
        try:
            settings[path.name] = path.read_text().strip()
        except OSError:
            continue
    return settings


def measure(mib: int, repetitions: int) -> dict:
    import json

    from measure.launch import RETAIN_ALLOCATOR_ENV

    base_env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    modes = {}
    for mode in MODES:
        env = base_env | (RETAIN_ALLOCATOR_ENV if mode == "retain" else {})
        done = subprocess.run(
            [sys.executable, __file__, "--worker", str(mib), str(repetitions)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{mode} worker failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        modes[mode] = json.loads(done.stdout)
    system, retain = modes["system"], modes["retain"]
    faults = system["faults_per_step"]
    return {
        "benchmark": "page_cost",
        "mib": mib,
        "repetitions": repetitions,
        "modes": modes,
        "retain_env": RETAIN_ALLOCATOR_ENV,
        "pages_per_step": (mib << 20) // PAGE_BYTES,
        "us_per_faulted_page": 1e3 * (system["median_ms"] - retain["median_ms"]) / faults if faults else None,
        "page_reporting": _page_reporting(),
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        import json

        print(json.dumps(_worker(int(sys.argv[2]), int(sys.argv[3]))))
        return
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mib", type=int, default=64, help="buffer size, MiB (default 64)")
    parser.add_argument("--repetitions", type=int, default=40, help="timed steps per mode (default 40)")
    args = parser.parse_args()
    if not 1 <= args.mib <= 4096 or args.repetitions < 1:
        parser.error(
            f"--mib {args.mib} / --repetitions {args.repetitions}: expected 1-4096 MiB and >= 1 steps"
        )
    try:
        result = measure(args.mib, args.repetitions)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        parser.exit(2, f"page_cost.py: {error}\n")
    for mode in MODES:
        figures = result["modes"][mode]
        print(
            f"{mode:6s}: {args.mib} MiB allocated, filled and freed in {figures['median_ms']:.1f} ms "
            f"(median; {figures['fastest_ms']:.1f}-{figures['slowest_ms']:.1f}), "
            f"{figures['faults_per_step']:.0f} page faults per step"
        )
    if result["us_per_faulted_page"] is not None:
        print(f"one faulted 4 KB page: {result['us_per_faulted_page']:.2f} µs")
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
