"""Training step time and all-gather bytes: ZeRO-3 vs ZeRO-3 + CIERA, FSDP2 vs FSDP2 + CIERA, 2 gloo ranks.

    python benchmarks/train_step.py --json out/train_step.json [--link loopback|netns] [--rate 1gbit]
        [--steps 5] [--warmup 2] [--warm-steps 0] [--block-size 64] [--entropy rans|none] [--rounds 3] [--layers 2]
        [--seq-len 64] [--global-batch 4] [--systems zero3,zero3+ciera,fsdp,fsdp+ciera] [--select]
        [--probe-mib 8] [--timeout-s 1800]

Each rank runs the real ``measure.train.run_rank`` (the code behind ``ciera train``) on ``--model``
(default ``small-moe``; any zoo key, at ``--width-scale``, 0 = the zoo's default scale):
every system trains from the same seed on the same batches, ``--warmup`` unmeasured steps then
``--steps`` timed ones. Step time is the slowest rank's (as run_rank records it); bytes are those a rank's
all-gathers sent per step, counted at ``all_gather_single``, and what they would have sent raw. CIERA
runs with block size ``--block-size`` B and entropy stage ``--entropy`` (``none``: changed exponents uncoded;
full payloads, raw-sized then, travel as seeds).

Warm start (``--warm-steps N``): the first steps of training change nearly every block's exponents; to time
the steps of a run already under way, each engine's plain system first trains N steps once, on loopback
whatever ``--link`` is (they are not timed), and saves a checkpoint (DeepSpeed's ``save_checkpoint`` for
ZeRO-3, DCP for FSDP2) in a temporary directory removed at exit. Every timed system of that engine —
plain, with CIERA, profiled — resumes from it (a plain engine's checkpoint loads into the engine with
CIERA) and trains ``--warmup`` + ``--steps`` steps after it, on batches N, N+1, …; losses of plain and
CIERA are compared bit for bit from there. The JSON records N, the loss each warm run ended with, and
every recorded loss of the first round.

Load: the machine is shared. The systems run in ``--rounds`` rounds, each round every system once, the
order rotated from round to round, so each sees the same load over time; the load average is recorded
before and after, and the spread of the per-round medians is reported.

Where the plain engine's time goes (DESIGN.md, "Bounds the numbers must respect"): in every round each
plain engine also runs once *profiled* (rotated in with the others; its steps are not in the timings):
every collective is made synchronous (an async one is waited for at once) and timed in a wrapper at
``torch.distributed`` — all-gathers at ``all_gather_single`` (T_allgather); reduce-scatters, all-reduces,
all-to-alls and broadcasts as T_other_comm — and T_compute = the profiled step time − T_allgather −
T_other_comm (mean of the two ranks, median over the timed steps). Each is capped at T_baseline: measured
in other runs, a busy time can come out above the baseline step that contains it. Time in a collective
includes waiting for the other rank to arrive. With r = CIERA's sent / raw bytes,
``bound_speedup = T_baseline / max(T_compute, r·T_allgather + T_other_comm)`` and
``overlap_only = T_baseline / max(T_compute, T_allgather + T_other_comm)``, T_baseline the plain engine's
timed median; 1/r bounds the all-gather's own speedup from bytes alone.

Control plane, per system (``collective_calls_per_step``, ``host_ms_per_step``, ``host_us_per_allgather``;
the comparison's ``control_plane``): every collective call of a timed step is counted at
``torch.distributed`` (all ops; the two all-reduces ``run_rank`` adds per step included, in both systems
alike); the training thread's time in the parameter gathers is, with CIERA, its whole bucket path with
network waits left out (``GatherStats.host_s``: packing, encoding, issuing, unpacking, decoding), and for
the plain engine the time spent inside ``all_gather_single`` calls (issuing them; the engine's own
bookkeeping around them is not counted; FSDP2's all-gathers are synchronous, their time is the
transfer's: n/a). Both are means of the ranks, medians of the timed steps. Per CIERA system:
``ciera_calls``, ``overflow_rounds`` and ``one_call_calls`` (calls that took the one-call bucket passes,
ciera_runtime/bucket_codec.py; rank 0, every run, warm-up included), ``gated_calls`` (with ``--select``,
ZeRO-3's coalesced calls that BSC's per-call gate left whole to DeepSpeed) and ``overflow_share``;
``bytes_on_wire_not_above_raw`` checks every timed step.

``--link netns`` (root, iproute2): the two ranks run in two network namespaces joined by a veth pair with
``tc tbf`` at ``--rate`` on both ends — the namespace code of ``allgather_netns.py`` — and everything is
removed on exit, error and SIGINT/SIGTERM/SIGHUP (and leftovers of killed runs at start). Not root:
one line, exit 2. Before and after training each rank measures the rate gloo gets: a raw all-gather of
``--probe-mib`` MiB per rank (median of 5). Every rank uses one torch and one numba thread (2 ranks,
2 cores), on loopback too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

PROBES = ("probe_before", "probe_after")
SYSTEMS = ("zero3", "zero3+ciera", "fsdp", "fsdp+ciera")
MODEL = "small-moe"  # the default model
# A bytes bound below this gain (r ≈ 1: selection compressed next to nothing) has no share to report.
MIN_BOUND_GAIN = 0.005
_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)
_OTHER_COMM = (
    "reduce_scatter_single",  # FSDP2's; reduce_scatter_tensor and _reduce_scatter_base call it
    "reduce_scatter_tensor",
    "reduce_scatter",
    "_reduce_scatter_base",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_gather",  # the list form (object gathers, small); every tensor all-gather is all_gather_single
)


class BadArgument(Exception):
    """One line, exit 2."""


# --------------------------------------------------------------------------------------------- rank side


def _engines(args) -> list[str]:
    """The engines of the systems, in the order they are first named."""
    return list(dict.fromkeys(system.partition("+")[0] for system in args.systems.split(",")))


def _system_config(args, system: str, phase: str = "timed"):
    """The TrainConfig of ``system``. Phase ``timed``: ``--warmup`` + ``--steps`` steps — with
    ``--warm-steps N``, resumed from the engine's warm checkpoint at step N. Phase ``warm``: the engine's
    plain system for N warm steps (nothing recorded), saving that checkpoint."""
    from measure.train import TrainConfig

    engine, _, ciera = system.partition("+")
    warm = args.warm_steps
    checkpoint = {"checkpoint_dir": str(Path(args.checkpoint_root) / engine)} if warm else {}
    if phase == "warm":
        checkpoint |= {"save_at": warm, "warm_steps": warm}
        ciera = ""
    elif warm:
        checkpoint["resume"] = True
    return TrainConfig(
        model=args.model,
        width_scale=args.width_scale or None,
        engine=engine,
        ciera=bool(ciera),
        select=bool(ciera) and args.select,
        world_size=2,
        steps=warm if phase == "warm" else warm + args.warmup + args.steps,
        layers=args.layers,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        block_size=args.block_size,
        entropy=args.entropy,
        threads_per_rank=1,
        timeout_s=300.0,
        part_bytes=args.part_bytes,
        **checkpoint,
    )


class _CommTimer:
    """Wraps torch.distributed's collectives (once per process, before any engine exists). Off: passes
    through. On (the profiled run): each call waits for its collective at once and adds its time."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        from measure.train import AllGatherCounter

        AllGatherCounter.installed()  # first: the timer wraps the counting all-gather
        self.on = False
        # A wrapped collective that calls another wrapped one is timed once, outermost (per thread).
        self._local = threading.local()
        self.seconds = {"allgather": 0.0, "other": 0.0}
        self.calls: dict[str, int] = {}
        # Off too: every collective call is counted, and the time the calling thread spends inside an
        # async all_gather_single (issuing it: it returns before its bytes move). A synchronous one (FSDP2's
        # default) returns after the transfer: counted apart, its time is not the thread's own.
        self.counts: dict[str, int] = {}
        self.issue_s = 0.0
        for name, kind in [("all_gather_single", "allgather")] + [(n, "other") for n in _OTHER_COMM]:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, kind, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def _wrap(self, name: str, kind: str, original):
        def timed(*args, **kwargs):
            if getattr(self._local, "depth", 0):
                return original(*args, **kwargs)
            self.counts[name] = self.counts.get(name, 0) + 1
            if not self.on:
                self._local.depth = 1
                try:
                    start_s = time.perf_counter()
                    work = original(*args, **kwargs)
                    if name == "all_gather_single" and work is not None:
                        self.issue_s += time.perf_counter() - start_s
                        self.counts["all_gather_single:async"] = (
                            self.counts.get("all_gather_single:async", 0) + 1
                        )
                finally:
                    self._local.depth = 0
                return work
            self._local.depth = 1
            try:
                start_s = time.perf_counter()
                work = original(*args, **kwargs)
                if work is not None and hasattr(work, "wait"):
                    work.wait()
                self.seconds[kind] += time.perf_counter() - start_s
            finally:
                self._local.depth = 0
            self.calls[name] = self.calls.get(name, 0) + 1
            return work

        return timed

    def snapshot(self) -> tuple[float, float, float, dict[str, int]]:
        return self.seconds["allgather"], self.seconds["other"], self.issue_s, dict(self.counts)


def _probe_link(probe_mib: float, repeats: int = 5) -> dict:
    """Raw all-gather of probe_mib MiB per rank: median time and the rate a rank's bytes get."""
    import torch
    import torch.distributed as dist

    numel = max(1, int(probe_mib * (1 << 20)) // 2)
    shard = torch.ones(numel, dtype=torch.bfloat16)
    output = torch.empty(2 * numel, dtype=torch.bfloat16)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    times = []
    for index in range(repeats + 2):
        dist.barrier()
        start_s = time.perf_counter()
        gather(output, shard)
        elapsed = torch.tensor([time.perf_counter() - start_s], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if index >= 2:
            times.append(float(elapsed))
    median_s = sorted(times)[len(times) // 2]
    return {
        "bytes_per_rank": numel * 2,
        "median_ms": round(median_s * 1e3, 3),
        "MBps_per_rank": round(numel * 2 / median_s / 1e6, 1),
    }


def _rank_environment(args) -> int:
    """This rank's process-group environment, one torch and one numba thread; returns the rank."""
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.port))
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import numba
    import torch

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    return args.rank


def _warm_rank_main(args) -> None:
    """The warm phase on this rank: each engine's plain system for ``--warm-steps`` steps, its checkpoint
    saved in ``--checkpoint-root``/ENGINE; what it ends with goes to the result file."""
    rank = _rank_environment(args)
    import torch.distributed as dist

    from measure.train import _float_bits, _init_group, run_rank

    engines = _engines(args)
    _init_group(rank, 2, _system_config(args, engines[0], "warm"))
    out: dict = {"rank": rank, "engines": {}}
    try:
        for engine in engines:
            start_s = time.perf_counter()
            result = run_rank(rank, 2, _system_config(args, engine, "warm"), lambda record: None)
            out["engines"][engine] = {
                "system": engine,
                "steps": args.warm_steps,
                "final_loss": result.warm_final_loss,
                "final_loss_bits": _float_bits(result.warm_final_loss),
                "parameter_digest": result.parameter_digest,
                "wall_s": round(time.perf_counter() - start_s, 1),
            }
        Path(args.result).write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(args) -> None:
    rank = _rank_environment(args)
    import torch.distributed as dist

    from measure.train import _init_group, run_rank

    systems = args.systems.split(",")
    _init_group(rank, 2, _system_config(args, systems[0]))
    timer = _CommTimer()
    out: dict = {"rank": rank, "runs": [], "profiles": {}}
    try:
        out["probe_before"] = _probe_link(args.probe_mib)
        plain = [s for s in systems if "+" not in s]
        entries = systems + [f"{s}:profile" for s in plain]
        for round_index in range(args.rounds):
            shift = round_index % len(entries)
            for entry in entries[shift:] + entries[:shift]:
                system, _, profiled = entry.partition(":")
                records: list[dict] = []
                last = [timer.snapshot()]

                def on_step(record, records=records, last=last, round_index=round_index):
                    allgather_s, other_s, issue_s, counts = snapshot = timer.snapshot()
                    calls = {name: n - last[0][3].get(name, 0) for name, n in counts.items()}
                    records.append(
                        record
                        | {
                            "round": round_index,
                            "allgather_s": allgather_s - last[0][0],
                            "other_comm_s": other_s - last[0][1],
                            "allgather_issue_s": issue_s - last[0][2],
                            "collective_calls": {name: n for name, n in calls.items() if n},
                        }
                    )
                    last[0] = snapshot

                timer.on, timer.calls = bool(profiled), {}
                try:
                    result = run_rank(rank, 2, _system_config(args, system), on_step)
                finally:
                    timer.on = False
                if profiled:
                    out["profiles"].setdefault(system, {"steps": []})["steps"] += records
                    out["profiles"][system]["calls_per_run"] = dict(timer.calls)
                    continue
                out["runs"].append(
                    {
                        "system": system,
                        "round": round_index,
                        "steps": records,
                        "parameter_digest": result.parameter_digest,
                        "ciera_call_counts": _ciera_call_counts(result.ciera),
                        "ciera_wire_bytes_by_kind": _wire_bytes_by_kind(result.ciera),
                    }
                )
        out["probe_after"] = _probe_link(args.probe_mib)
        import numba
        import torch

        out["threads"] = {"torch": torch.get_num_threads(), "numba": numba.get_num_threads()}
        Path(args.result).write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wire_bytes_by_kind(stats: dict | None) -> dict[str, int] | None:
    """Where CIERA's bucket rows' bytes went (payloads, raw messages, headers, padding), either engine."""
    if stats is None:
        return None
    if "ciera_wire_bytes_by_kind" in stats:  # ZeRO-3
        return dict(stats["ciera_wire_bytes_by_kind"])
    total: dict[str, int] = {}
    for engine in stats["engines"]:
        for kind, n in engine.get("wire_bytes_by_kind", {}).items():
            total[kind] = total.get(kind, 0) + n
    return total


def _ciera_call_counts(stats: dict | None) -> list[int | None] | None:
    """[CIERA bucket collectives, overflow rounds, one-call calls, calls the per-call gate left to the
    engine] of a run, from either engine's stats (FSDP2's gate acts once, at enable, on whole modules:
    no calls of its to count, None)."""
    if stats is None:
        return None
    if "ciera_calls" in stats:  # ZeRO-3
        return [
            stats["ciera_calls"], stats["ciera_overflow_rounds"], stats["ciera_one_call_calls"],
            stats["ciera_gated_calls"],
        ]  # fmt: skip
    counts = [sum(e[key] for e in stats["engines"]) for key in ("calls", "overflow_rounds", "one_call_calls")]
    return [*counts, None]


# --------------------------------------------------------------------------------------------- root side


def _stats(values: list[float]) -> dict:
    import numpy as np

    array = np.asarray(values, dtype=float)
    return {
        "median": float(np.median(array)),
        "p10": float(np.percentile(array, 10)),
        "p90": float(np.percentile(array, 90)),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _report(
    args, ranks: list[dict], link: dict, load_before, load_after, wall_s: float, warm: dict | None = None
) -> dict:
    import numpy as np

    systems = args.systems.split(",")
    first_timed = args.warm_steps + args.warmup  # step numbers go on from the warm checkpoint
    rank_runs = [r["runs"] for r in ranks]
    per_system: dict[str, dict] = {}
    losses: dict[str, list[list[str]]] = {}
    digests: dict[str, set[str]] = {}
    for index, run0 in enumerate(rank_runs[0]):
        system = run0["system"]
        entry = per_system.setdefault(
            system,
            {
                "step_s": [],
                "round_medians": [],
                "sent": [],
                "raw": [],
                "host_s": [],
                "calls": [],
                "gathers": [],
                "async_gathers": [],
            },
        )
        timed = [step for step in run0["steps"] if step["step"] >= first_timed]
        step_s = [step["step_s"] for step in timed]  # the slowest rank's, the same in every rank's record
        entry["step_s"] += step_s
        entry["round_medians"].append(float(np.median(step_s)))
        rank_steps = [[s for s in runs[index]["steps"] if s["step"] >= first_timed] for runs in rank_runs]
        for steps in zip(*rank_steps, strict=True):  # bytes: the mean of the ranks, per step
            entry["sent"].append(float(np.mean([s["allgather_bytes_sent"] for s in steps])))
            entry["raw"].append(float(np.mean([s["raw_bytes"] for s in steps])))
            # The training thread's own time in the parameter gathers, mean of the ranks: CIERA's bucket
            # path (network waits left out), or the plain engine's time issuing its all-gathers.
            host_key = "ciera_host_s" if "+ciera" in system else "allgather_issue_s"
            entry["host_s"].append(float(np.mean([s[host_key] for s in steps])))
            calls = steps[0]["collective_calls"]
            entry["calls"].append(sum(n for name, n in calls.items() if ":" not in name))
            entry["gathers"].append(calls.get("all_gather_single", 0))
            entry["async_gathers"].append(calls.get("all_gather_single:async", 0))
        losses.setdefault(system, []).append([step["loss_bits"] for step in run0["steps"]])
        entry.setdefault("first_round_losses", [step["loss"] for step in run0["steps"]])
        digests.setdefault(system, set()).update(runs[index]["parameter_digest"] for runs in rank_runs)
        counted = run0.get("ciera_call_counts")
        if counted is not None:  # the whole run (warm-up steps included), rank 0's
            entry["ciera_calls"] = entry.get("ciera_calls", 0) + counted[0]
            entry["overflow_rounds"] = entry.get("overflow_rounds", 0) + counted[1]
            entry["one_call_calls"] = entry.get("one_call_calls", 0) + counted[2]
            if counted[3] is not None:
                entry["gated_calls"] = entry.get("gated_calls", 0) + counted[3]
        for kind, n in (run0.get("ciera_wire_bytes_by_kind") or {}).items():
            entry.setdefault("wire_by_kind", {})
            entry["wire_by_kind"][kind] = entry["wire_by_kind"].get(kind, 0) + n

    table: dict[str, dict] = {}
    for system in systems:
        entry = per_system[system]
        sent, raw = float(np.mean(entry["sent"])), float(np.mean(entry["raw"]))
        table[system] = {
            "step_ms": {k: round(v * 1e3, 2) for k, v in _stats(entry["step_s"]).items()},
            "round_median_ms": [round(v * 1e3, 2) for v in entry["round_medians"]],
            "round_spread": round(max(entry["round_medians"]) / min(entry["round_medians"]) - 1, 4),
            "allgather_bytes_sent_per_step": round(sent),
            "raw_bytes_per_step": round(raw),
            "r": round(sent / raw, 4) if raw else None,
            "collective_calls_per_step": float(np.median(entry["calls"])),
            "allgather_calls_per_step": float(np.median(entry["gathers"])),
            "host_ms_per_step": _ms(float(np.median(entry["host_s"])))
            if "+ciera" in system or np.median(entry["async_gathers"])
            else None,
            # per async all-gather (CIERA's rows are); None when the plain engine's are all synchronous
            # (FSDP2's default: a blocking call's time is the transfer's, not the thread's own work)
            "host_us_per_allgather": round(
                1e6 * float(np.median(entry["host_s"])) / float(np.median(entry["async_gathers"])), 1
            )
            if np.median(entry["async_gathers"])
            else None,
            "synchronous_allgathers_per_step": float(
                np.median(entry["gathers"]) - np.median(entry["async_gathers"])
            ),
            # every recorded step of the first round, from step first_timed_step - warmup_steps on
            "losses": entry["first_round_losses"],
            # CIERA's bucket collectives and the overflow rounds among them, every run of the system
            "ciera_calls": entry.get("ciera_calls"),
            "overflow_rounds": entry.get("overflow_rounds"),
            "one_call_calls": entry.get("one_call_calls"),
            # coalesced calls BSC's per-call gate left whole to the engine (ZeRO-3 with --select)
            "gated_calls": entry.get("gated_calls"),
            "overflow_share": round(entry["overflow_rounds"] / entry["ciera_calls"], 4)
            if entry.get("ciera_calls")
            else None,
            # shares of CIERA's bucket-row bytes (rank 0, every run, warm-up included)
            "wire_share_by_kind": {
                kind: round(n / max(1, sum(entry["wire_by_kind"].values())), 4)
                for kind, n in entry["wire_by_kind"].items()
            }
            if entry.get("wire_by_kind")
            else None,
            # every timed step of every round: what the all-gathers sent (CIERA's protocol included) vs raw
            "bytes_on_wire_not_above_raw": all(
                a <= b for a, b in zip(entry["sent"], entry["raw"], strict=True)
            ),
            "losses_repeat_across_rounds": all(bits == losses[system][0] for bits in losses[system]),
            "final_parameters_equal_across_ranks_and_rounds": len(digests[system]) == 1,
        }

    comparisons: dict[str, dict] = {}
    for plain in (s for s in systems if "+" not in s):
        twin = f"{plain}+ciera"
        if twin not in table:
            continue
        r = table[twin]["r"]
        t_base = table[plain]["step_ms"]["median"] / 1e3
        t_ciera = table[twin]["step_ms"]["median"] / 1e3
        comparison = {
            "loss_bits_identical_every_step": losses[plain][0] == losses[twin][0]
            and all(bits == losses[plain][0] for bits in losses[plain] + losses[twin]),
            "final_parameters_identical": digests[plain] == digests[twin] and len(digests[plain]) == 1,
            "raw_bytes_equal": table[plain]["allgather_bytes_sent_per_step"]
            == table[twin]["raw_bytes_per_step"],
            "r": r,
            "allgather_bytes_bound_1_over_r": round(1 / r, 3),
            "measured_step_speedup": round(t_base / t_ciera, 3),
            "round_speedups": [
                round(a / b, 3)
                for a, b in zip(table[plain]["round_median_ms"], table[twin]["round_median_ms"], strict=True)
            ],
        }
        # Control plane: the training thread's time in the gathers and the collectives per step, CIERA next
        # to the plain engine (host: CIERA's whole bucket path without network waits; plain: issuing).
        comparison["control_plane"] = {
            "host_ms_per_step": {
                "plain": table[plain]["host_ms_per_step"],
                "ciera": table[twin]["host_ms_per_step"],
            },
            "host_us_per_allgather": {
                "plain": table[plain]["host_us_per_allgather"],
                "ciera": table[twin]["host_us_per_allgather"],
            },
            "collective_calls_per_step": {
                "plain": table[plain]["collective_calls_per_step"],
                "ciera": table[twin]["collective_calls_per_step"],
                "ratio": round(
                    table[twin]["collective_calls_per_step"]
                    / max(1.0, table[plain]["collective_calls_per_step"]),
                    3,
                ),
            },
        }
        # What the saved bytes are worth on this link: (raw - sent) per step at the rate the probe measured,
        # next to what CIERA's step costs beyond the plain one.
        probe_Bps = float(np.mean([ranks[0][key]["MBps_per_rank"] for key in PROBES])) * 1e6
        saved_bytes = table[twin]["raw_bytes_per_step"] - table[twin]["allgather_bytes_sent_per_step"]
        comparison["saved_bytes_per_step"] = saved_bytes
        comparison["saved_link_ms_per_step_at_probe_rate"] = _ms(saved_bytes / probe_Bps)
        comparison["ciera_extra_ms_per_step"] = _ms(t_ciera - t_base)
        profiles = [rank["profiles"].get(plain) for rank in ranks]
        if all(profiles):
            allgather, other, compute, profiled = [], [], [], []
            for rows in zip(*(p["steps"] for p in profiles), strict=True):
                if rows[0]["step"] < first_timed:
                    continue
                step_s = rows[0]["step_s"]  # the slowest rank's
                ag = float(np.mean([row["allgather_s"] for row in rows]))
                oc = float(np.mean([row["other_comm_s"] for row in rows]))
                allgather.append(ag)
                other.append(oc)
                compute.append(step_s - ag - oc)
                profiled.append(step_s)
            measured = {
                name: float(np.median(values))
                for name, values in (("allgather", allgather), ("other", other), ("compute", compute))
            }
            # Busy times of the baseline step cannot exceed it; measured in other (profiled) runs they can,
            # by load and by the waits the profiling adds: capped at T_baseline.
            t_ag, t_oc, t_c = (min(measured[name], t_base) for name in ("allgather", "other", "compute"))
            bound = t_base / max(t_c, r * t_ag + t_oc)
            overlap_only = t_base / max(t_c, t_ag + t_oc)
            comparison["profile"] = {
                "method": "profiled runs (one per round, interleaved): every collective synchronous and "
                "timed at torch.distributed; compute = profiled step - all-gathers - other comm (mean of "
                "ranks, median of timed steps), each capped at T_baseline",
                "profiled_step_ms": _ms(float(np.median(profiled))),
                "T_baseline_ms": _ms(t_base),
                "T_allgather_ms": _ms(t_ag),
                "T_other_comm_ms": _ms(t_oc),
                "T_compute_ms": _ms(t_c),
                "T_compute_uncapped_ms": _ms(measured["compute"]),
                "allgather_share_of_baseline": round(t_ag / t_base, 4),
                "collective_calls_per_profiled_run": profiles[0]["calls_per_run"],
                "profiled_losses_identical": all(
                    [row["loss_bits"] for row in profiles[0]["steps"] if row["round"] == index]
                    == losses[plain][0]
                    for index in range(args.rounds)
                ),
                "bound_speedup": round(bound, 3),
                "overlap_only_speedup": round(overlap_only, 3),
                "bytes_share_of_bound": round(bound / overlap_only, 3),
            }
            # The step with the same overlap as the plain engine and (1 - r) of its all-gather time
            # saved: what CIERA's bytes alone allow, and how much of that gain the measured step kept.
            bytes_bound = t_base / (t_base - (1 - r) * t_ag)
            comparison["bytes_bound_speedup"] = round(bytes_bound, 3)
            # r ≈ 1 (BSC compressed nothing, or next to nothing): the bytes allow no gain worth a share —
            # a share of a 0.001 % bound would read as thousands of per cent.
            comparison["share_of_bytes_gain"] = (
                round((t_base / t_ciera - 1) / (bytes_bound - 1), 3)
                if bytes_bound - 1 >= MIN_BOUND_GAIN
                else None
            )
        comparisons[f"{plain} vs {twin}"] = comparison

    return {
        "schema": "ciera.bench.train_step/1",
        "model": args.model,
        "width_scale": args.width_scale or None,
        "config": {
            "layers": args.layers,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "world_size": 2,
            "block_size": args.block_size,
            "entropy": args.entropy,
            "warm_steps": args.warm_steps,  # trained before the warm-up (each engine's plain system, resumed)
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "first_timed_step": first_timed,
            "rounds": args.rounds,
            "select": args.select,
            "part_bytes": args.part_bytes,
            "threads_per_rank": ranks[0]["threads"],
            "systems": systems,
            "train_config": dataclasses.asdict(_system_config(args, systems[0])),
        },
        "warm": warm,
        "link": link
        | {
            "gloo_probe_before": [r["probe_before"] for r in ranks][0],
            "gloo_probe_after": [r["probe_after"] for r in ranks][0],
        },
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "systems": table,
        "comparisons": comparisons,
        "wall_s": round(wall_s, 1),
    }


def _rank_command(
    args, rank: int, result: Path, master_addr: str, port: int, phase: str = "timed"
) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--result", str(result),
        "--master-addr", master_addr, "--port", str(port), "--systems", args.systems,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
        "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--model", args.model,
        "--width-scale", str(args.width_scale),
        "--global-batch", str(args.global_batch), "--probe-mib", str(args.probe_mib),
        "--timeout-s", str(args.timeout_s), *(["--select"] if args.select else []),
        *(["--part-bytes", str(args.part_bytes)] if args.part_bytes is not None else []),
        "--block-size", str(args.block_size), "--entropy", args.entropy, "--warm-steps", str(args.warm_steps),
        "--phase", phase, *(["--checkpoint-root", str(args.checkpoint_root)] if args.warm_steps else []),
    ]  # fmt: skip


class _Loopback:
    """Both ranks on this machine's loopback; ``close()`` ends the ranks still running."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _check_args(args) -> None:
    for name, low in (
        ("steps", 1), ("warmup", 0), ("warm_steps", 0), ("rounds", 1), ("layers", 1), ("seq_len", 1)
    ):  # fmt: skip
        if getattr(args, name) < low:
            raise BadArgument(f"--{name.replace('_', '-')} is {getattr(args, name)}: expected at least {low}")
    from measure.train import block_size_problem

    problem = block_size_problem(args.block_size, "--block-size")
    if problem:
        raise BadArgument(problem)
    if args.global_batch < 2 or args.global_batch % 2:
        raise BadArgument(f"--global-batch is {args.global_batch}: expected an even number (2 ranks)")
    if not _RATE.match(args.rate):
        raise BadArgument(f"--rate {args.rate!r}: expected a tc rate such as 1gbit, 500mbit, 100mbps")
    if not args.probe_mib > 0:
        raise BadArgument(f"--probe-mib is {args.probe_mib}: expected a positive number")
    if args.timeout_s < 10:
        raise BadArgument(f"--timeout-s is {args.timeout_s}: expected at least 10")
    if args.part_bytes is not None and args.part_bytes < 0:
        raise BadArgument(f"--part-bytes is {args.part_bytes}: expected at least 0 (0: one bucket per call)")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems or len(set(systems)) != len(systems):
        raise BadArgument(f"--systems {args.systems!r}: expected distinct names from {', '.join(SYSTEMS)}")
    from measure.zoo import scaled_shape

    try:
        scaled_shape(args.model, args.width_scale or None, args.layers)
    except Exception as error:  # noqa: BLE001 — the zoo's errors are one line
        raise BadArgument(str(error).splitlines()[0]) from None


def _warm_start(args, env: dict, scratch: Path) -> dict | None:
    """Each engine's plain system trains ``--warm-steps`` steps on loopback (whatever ``--link``: warm
    steps are not timed) and saves a checkpoint under ``args.checkpoint_root``; every timed system of the
    engine resumes from it. Returns what the warm runs ended with (None: a rank failed, said on stderr)."""
    from allgather_netns import wait_for_ranks

    from measure.train import free_port

    link = _Loopback()
    results = [scratch / f"warm-rank{rank}.json" for rank in (0, 1)]
    port = free_port()
    start_s = time.perf_counter()
    try:
        for rank in (0, 1):
            command = _rank_command(args, rank, results[rank], "127.0.0.1", port, phase="warm")
            link.processes.append(subprocess.Popen(command, env=env, cwd=_REPO_ROOT))
        failed = wait_for_ranks(link.processes, args.timeout_s, poll_s=0.2)
    finally:
        link.close()
    if failed or any(not path.exists() for path in results):
        print(
            f"train_step: FAILED (warm start): {'; '.join(failed) or 'a rank wrote no result'}",
            file=sys.stderr,
        )
        return None
    ranks = [json.loads(path.read_text()) for path in results]
    engines = ranks[0]["engines"]
    for engine, entry in engines.items():
        entry["final_parameters_equal_across_ranks"] = (
            len({rank["engines"][engine]["parameter_digest"] for rank in ranks}) == 1
        )
    return {
        "link": "loopback",
        "steps": args.warm_steps,
        "checkpoint": {
            engine: {"zero3": "DeepSpeed save_checkpoint", "fsdp": "torch.distributed.checkpoint (DCP)"}[
                engine
            ]
            for engine in engines
        },
        "engines": engines,
        "wall_s": round(time.perf_counter() - start_s, 1),
    }


def _main(args) -> int:
    try:
        _check_args(args)
    except BadArgument as reason:
        print(f"train_step: error: {reason}")
        return 2
    link_info: dict = {"kind": args.link}
    if args.link == "netns":
        import allgather_netns as netns

        try:
            netns._check_environment()
        except netns.Unavailable as reason:
            print(f"train_step: skipped: {reason}")
            return 2
        removed = netns._clean_leftovers()
        if removed:
            print(f"train_step: removed leftover namespaces {removed}", file=sys.stderr)
        link = netns.Link(args.rate, 0.0)
        master_addr, port = netns.ADDRESSES[0], netns.PORT
        link_info |= {"rate": args.rate, "addresses": list(netns.ADDRESSES)}
    else:
        from measure.train import free_port

        link = _Loopback()
        master_addr, port = "127.0.0.1", free_port()
    from allgather_netns import close_on_exit, wait_for_ranks

    close_on_exit(link)
    start_s = time.perf_counter()
    try:
        # The warm checkpoints live here too: removed at exit, on error and on a signal.
        with tempfile.TemporaryDirectory(prefix="ciera-train-step-") as scratch:
            env = os.environ | {
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "NUMBA_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu",
                "TORCH_EXTENSIONS_DIR": os.environ.get(
                    "TORCH_EXTENSIONS_DIR", str(_REPO_ROOT / ".torch_extensions")
                ),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
            }
            warm = None
            if args.warm_steps:  # on loopback, before any namespace exists
                args.checkpoint_root = Path(scratch) / "warm"
                warm = _warm_start(args, env, Path(scratch))
                if warm is None:
                    return 1
            if args.link == "netns":
                try:
                    link.open()
                except netns.Unavailable as reason:
                    print(f"train_step: skipped: {reason}")
                    return 2
                link_info["qdiscs"] = link.qdiscs()
            results = [Path(scratch) / f"rank{rank}.json" for rank in (0, 1)]
            load_before = os.getloadavg()
            for rank in (0, 1):
                command = _rank_command(args, rank, results[rank], master_addr, port)
                rank_env = dict(env)
                if args.link == "netns":
                    command = ["ip", "netns", "exec", link.namespaces[rank], *command]
                    rank_env["GLOO_SOCKET_IFNAME"] = link.devices[rank]
                link.processes.append(subprocess.Popen(command, env=rank_env, cwd=_REPO_ROOT))
            failed = wait_for_ranks(link.processes, args.timeout_s, poll_s=0.2)
            if failed or any(not path.exists() for path in results):
                print(f"train_step: FAILED: {'; '.join(failed) or 'a rank wrote no result'}", file=sys.stderr)
                return 1
            load_after = os.getloadavg()
            ranks = [json.loads(path.read_text()) for path in results]
            result = _report(
                args, ranks, link_info, load_before, load_after, time.perf_counter() - start_s, warm
            )
    finally:
        link.close()
    emit_json(result, args.json)
    if result["warm"] is not None:
        first = result["config"]["first_timed_step"]
        losses = ", ".join(f"{name} {e['final_loss']:.4f}" for name, e in result["warm"]["engines"].items())
        print(
            f"warm start: {args.warm_steps} steps of each plain engine on loopback (loss after them: "
            f"{losses}); every system resumed from its engine's checkpoint, timed steps "
            f"{first}..{first + args.steps - 1}"
        )
    for name, comparison in result["comparisons"].items():  # the answer, last, where the eye lands
        plain = name.split(" vs ")[0]
        line = (
            f"{plain}: {result['systems'][plain]['step_ms']['median']:.0f} ms plain, "
            f"{result['systems'][plain + '+ciera']['step_ms']['median']:.0f} ms with CIERA: "
            f"{comparison['measured_step_speedup']:.3f}x, r = {comparison['r']:.3f}"
        )
        if comparison.get("share_of_bytes_gain") is not None:
            line += (
                f", bytes bound {comparison['bytes_bound_speedup']:.3f}x "
                f"({100 * comparison['share_of_bytes_gain']:.0f} % of that gain kept)"
            )
        elif "bytes_bound_speedup" in comparison:
            line += (
                f", bytes bound {comparison['bytes_bound_speedup']:.3f}x (under {100 * MIN_BOUND_GAIN:.1f} %: "
                "no gain to keep; selection compressed next to nothing)"
            )
        control = comparison["control_plane"]

        def host(side: str, control=control) -> str:
            us = control["host_us_per_allgather"][side]
            if us is None:
                return "n/a (synchronous all-gathers only)"
            return f"{control['host_ms_per_step'][side]:.1f} ms/step ({us:.0f} us per all-gather)"

        line += (
            f"; training-thread time in gathers {host('ciera')} vs plain {host('plain')}; "
            f"collectives per step {control['collective_calls_per_step']['ciera']:.0f} vs "
            f"{control['collective_calls_per_step']['plain']:.0f}"
        )
        twin_row = result["systems"][plain + "+ciera"]
        if twin_row["overflow_share"] is not None:
            line += f"; overflow rounds {100 * twin_row['overflow_share']:.1f} % of CIERA's collectives"
        if twin_row.get("one_call_calls") is not None and twin_row.get("ciera_calls"):
            line += (
                f"; {twin_row['one_call_calls']} of {twin_row['ciera_calls']} calls in the one-call passes"
            )
        if twin_row.get("gated_calls"):
            line += f"; {twin_row['gated_calls']} calls left to the engine by the per-call gate"
        if not twin_row["bytes_on_wire_not_above_raw"]:
            line += "; MORE BYTES THAN RAW in some step"
        print(line)
    broken = [
        name
        for name, comparison in result["comparisons"].items()
        if not (comparison["loss_bits_identical_every_step"] and comparison["final_parameters_identical"])
    ]
    if broken:
        print(f"train_step: FAILED: losses or parameters differ: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--link", choices=("loopback", "netns"), default="loopback")
    parser.add_argument("--rate", default="1gbit", help="netns: tbf rate on each veth end (tc syntax)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all systems, order rotated")
    parser.add_argument("--model", default=MODEL, help="zoo key (ciera models lists them)")
    parser.add_argument("--width-scale", type=int, default=0, help="width divisor (0: the zoo's default)")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step, both ranks")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--select",
        action="store_true",
        help="CIERA with BSC (both engines): compress only the shards whose benefit pays on this link",
    )
    parser.add_argument(
        "--part-bytes",
        type=int,
        help="CIERA's pipelined bucket size, raw bytes per rank, both engines (0: one bucket per call)",
    )
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="steps each engine's plain system trains first (loopback, untimed); every timed system of "
        "the engine resumes from its checkpoint",
    )
    parser.add_argument("--block-size", type=int, default=64, help="CIERA's block size B (a power of two)")
    parser.add_argument(
        "--entropy", choices=("rans", "none"), default="rans", help="CIERA's entropy stage (none: uncoded)"
    )
    parser.add_argument("--probe-mib", type=float, default=8.0, help="raw all-gather probe, MiB per rank")
    parser.add_argument("--timeout-s", type=int, default=1800, help="whole run")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--master-addr", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("warm", "timed"), default="timed", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        from measure.rank import leave_rank

        (_warm_rank_main if args.phase == "warm" else _rank_main)(args)
        leave_rank(0)  # result written, group destroyed (measure/rank.py says why)
    sys.exit(_main(args))


if __name__ == "__main__":
    main()
