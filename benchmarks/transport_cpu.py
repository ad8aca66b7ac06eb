"""What one gloo all-gather takes from the host's cores beside the calling thread, three ways of calling it.

    python benchmarks/transport_cpu.py --json out/transport_cpu.json [--topology 2x1] [--rate 200mbit]
        [--bytes-per-rank 57344] [--calls 200]
    python benchmarks/transport_cpu.py --runs CAPTURED_BUNDLE [--sweeps measured] [--json FILE]

The simulator lets each collective's transport CPU (the sweep's ``transport_cpu_s``: the process's CPU time
minus the calling thread's over the call, gloo's threads moving the bytes) compete with compute on the
host's cores (docs/simulator.md). The sweep times each call after a barrier; a training run calls them
between compute. This measures, on an emulated cluster (``measure.emulated.EmulatedCluster``: root and
iproute2; otherwise one line and exit 2), per rank and call, the transport CPU and the wall time of
``--calls`` all-gathers of ``--bytes-per-rank`` each called (a) after a barrier, as the sweep does,
(b) back to back, (c) after ~1 ms of single-threaded matmul each, as between a run's layers. Every rank
uses one torch thread. Prints the per-rank means and their mean over ranks.

``--runs BUNDLE`` (no root): for each run of a captured bundle that recorded its ranks' transport CPU
(`versions` `transport_cpu_median_s`, captures from 2026-12-03 19:30 UTC on), that in-run figure per rank
and iteration against what the simulator charges for the same iteration — the sweep's per-call transport
CPU (``--sweeps``: the bundle holding the cluster's sweep, default the shipped ``measured``) summed over
the iteration's collectives, per rank (median over iterations).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

MODES = ("after_barrier", "back_to_back", "between_compute")

WORKER = r"""
import json, os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
world = dist.get_world_size()
size, calls = int(os.environ["CIERA_BYTES_PER_RANK"]), int(os.environ["CIERA_CALLS"])
mine = torch.ones(size, dtype=torch.uint8)
out = torch.empty(world * size, dtype=torch.uint8)
for _ in range(20):
    dist.all_gather_into_tensor(out, mine)
result = {"rank": dist.get_rank()}
work = torch.randn(128, 128)
for mode in ("after_barrier", "back_to_back", "between_compute"):
    transport_s = wall_s = 0.0
    for _ in range(calls):
        if mode == "after_barrier":
            dist.barrier()
        elif mode == "between_compute":
            for _ in range(30):
                work = torch.tanh(work @ work) * 0.5
        process, thread, start = time.process_time(), time.thread_time(), time.perf_counter()
        dist.all_gather_into_tensor(out, mine)
        wall_s += time.perf_counter() - start
        transport_s += (time.process_time() - process) - (time.thread_time() - thread)
    result[mode] = {"transport_cpu_s": transport_s / calls, "wall_s": wall_s / calls}
dist.destroy_process_group()
print(json.dumps(result), flush=True)
from measure.rank import leave_rank  # run from the checkout's root
leave_rank(0)  # no interpreter finalization after gloo (leave_rank says why)
"""


def compare_runs(runs_bundle: str, sweeps_bundle: str) -> dict:
    """In-run transport CPU per rank and iteration against the sweep's per-call figures summed over it:
    the simulator's own calibration (sim/rewrite.py `transport_scale`)."""
    import traces
    from sim.opgraph import build_graph
    from sim.rewrite import measured_cluster, transport_scale

    captured = traces.read_bundle(traces.resolve_bundle(runs_bundle))
    sweeps = traces.read_bundle(traces.resolve_bundle(sweeps_bundle))
    rows = []
    for _, run in captured.runs.iterrows():
        in_run = json.loads(run["versions"]).get("transport_cpu_median_s")
        of_cluster = sweeps.runs[sweeps.runs["cluster"] == run["cluster"]]
        if in_run is None or of_cluster.empty:
            continue  # captured before the recording, or no sweep of its cluster
        spec = measured_cluster(sweeps.collectives, of_cluster.iloc[0])
        events = captured.events[captured.events["run_id"] == run["run_id"]]
        graphs = [build_graph(per_iteration) for _, per_iteration in events.groupby("iteration")]
        scale, note = transport_scale(run, graphs, spec)
        if note is None and scale > 0:
            rows.append({"run_id": run["run_id"], "in_run_s": in_run, "sweep_modelled_s": in_run / scale,
                         "ratio": scale})  # fmt: skip
    return {"benchmark": "transport_cpu_runs", "runs_bundle": runs_bundle, "sweeps_bundle": sweeps_bundle,
            "runs": rows}  # fmt: skip


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--topology", default="2x1", help="NODESxRANKS (e.g. 2x1, 2x2, 3x1)")
    parser.add_argument("--rate", default="200mbit", help="inter-node link rate, tc syntax")
    parser.add_argument("--bytes-per-rank", type=int, default=56 << 10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--runs", help="a captured bundle: its runs' transport CPU against the sweep's")
    parser.add_argument("--sweeps", default="measured", help="with --runs: the bundle with the sweeps")
    args = parser.parse_args()
    if args.runs:
        emit_json(compare_runs(args.runs, args.sweeps), args.json)
        return
    try:
        nodes, ranks_per_node = (int(part) for part in args.topology.lower().split("x"))
    except ValueError:
        parser.error(f"--topology {args.topology!r}: expected NODESxRANKS, e.g. 2x1")
    if args.bytes_per_rank < 1 or args.calls < 1:
        parser.error("--bytes-per-rank and --calls: expected positive integers")
    from measure.emulated import EmulatedCluster, EmulationError

    try:
        with EmulatedCluster(nodes, ranks_per_node, args.rate) as cluster:
            env = os.environ | {
                "MASTER_PORT": "29700",  # inside the cluster's own fresh namespaces: nothing else there
                "WORLD_SIZE": str(cluster.world_size),
                "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "CIERA_BYTES_PER_RANK": str(args.bytes_per_rank),
                "CIERA_CALLS": str(args.calls),
            }
            processes = [
                cluster.popen(rank, [sys.executable, "-c", WORKER], env=env | {"RANK": str(rank)},
                              stdout=subprocess.PIPE, text=True, cwd=_REPO_ROOT)
                for rank in range(cluster.world_size)
            ]  # fmt: skip
            outputs = [process.communicate(timeout=600)[0] for process in processes]
            if any(process.returncode for process in processes):
                sys.exit(f"transport_cpu: a rank failed (exit codes {[p.returncode for p in processes]})")
    except EmulationError as error:
        print(f"transport_cpu: {error}", file=sys.stderr)
        sys.exit(2)
    per_rank = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    means = {
        mode: {
            key: sum(rank[mode][key] for rank in per_rank) / len(per_rank)
            for key in ("transport_cpu_s", "wall_s")
        }
        for mode in MODES
    }
    emit_json(
        {
            "benchmark": "transport_cpu",
            "topology": args.topology,
            "rate": args.rate,
            "bytes_per_rank": args.bytes_per_rank,
            "calls": args.calls,
            "mean_over_ranks": means,
            "per_rank": per_rank,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
