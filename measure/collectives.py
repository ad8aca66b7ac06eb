"""An nccl-tests-style sweep of the collectives the simulator's cost model is fitted to (the trace bundle's
`collectives` table), on the process group this process belongs to: gloo on CPU, NCCL on GPU.

Sizes double from ``min_bytes`` to ``max_bytes``. A size S follows nccl-tests: for ``all_gather`` the
gathered output (each rank contributes S / n), for ``reduce_scatter`` the input per rank (each rank keeps
S / n), for ``all_reduce`` the buffer. A size that does not divide into the group is rounded up to a
multiple of n × the element size, and the row records the bytes actually moved.

One measurement: a barrier, then one collective timed on every rank (on CUDA, synchronised before the
clock stops). What counts is the collective's time **from the last rank's start** to the last rank's end,
when every rank reads one clock (all on one host: ``perf_counter`` is the host's monotonic clock, shared
by every process and network namespace) — ranks leave the barrier at different times, and on a host with
more ranks than cores that skew was several milliseconds per call (4 ranks on 2 cores: 5.9 ms mean against
1.3 ms min at 128 KiB), cost the sweep then charged to the collective although the simulator makes
cross-rank waiting itself (a collective ends no earlier than its last participant's issue). On ranks of
several hosts (no shared clock) the slowest rank's own time counts; dedicated hosts leave a barrier
microseconds apart. Either way an all-reduce MAX gives every rank the same number. ``warmup`` untimed collectives run first, then ``repetitions`` measurements, then more
until about ``min_time_s`` was spent on the size (at most ``max_repetitions``; the same count on every
rank, from the slowest rank's mean of the first ones): small collectives are fast and their times bimodal
on gloo (a few of them take milliseconds), and five repetitions gave medians that flipped between the two
modes from one sweep to the next. A row has the **mean** of the repetitions (what a run of many such
collectives pays per call, as nccl-tests reports), their min and max, algbw = S / mean and busbw = algbw ·
(n−1)/n (all_gather, reduce_scatter) or algbw · 2(n−1)/n (all_reduce). On CPU each rank also takes the CPU
its process spent beside its calling thread over the same interval — the process group's transport
threads moving the bytes — and the row has the mean over ranks and repetitions as ``transport_cpu_s``:
what a collective takes from the host's cores while it runs (the simulator lets it compete with compute
there). On CUDA it is not measured (NaN).

Groups: the whole group (``nodes`` = the nodes it spans), then node 0's sub-group (``nodes`` = 1) when the
whole group spans more than one node and a node has at least two ranks. Ranks are node-major (node k holds
ranks k·G … k·G+G−1, G = ``ranks_per_node``); every node's sub-group is created on every rank in the same
order (``new_group`` is collective over the whole group), only node 0's ranks take part in its sweep, the
others wait at a barrier and then receive its rows. Every rank returns the same rows.

A rank that never joins a collective makes the others fail with the process group's error when its
timeout runs out; nothing here waits longer than that (so the timeout must exceed one node's sweep, which
the other nodes' ranks spend at a barrier).
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def sweep_sizes(min_bytes: int, max_bytes: int, group_size: int, element_size: int) -> list[int]:
    """The bytes the sweep measures: min_bytes, 2·min_bytes, … ≤ max_bytes, each rounded up to a multiple
    of group_size × element_size (a size that rounds to one already listed is measured once)."""
    unit = group_size * element_size
    sizes: list[int] = []
    requested = min_bytes
    while requested <= max_bytes:
        size = -(-requested // unit) * unit
        if not sizes or size != sizes[-1]:
            sizes.append(size)
        requested *= 2
    return sizes


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw of ``op`` on ``group_size`` ranks (nccl-tests' convention)."""
    n = group_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _row(op: str, world_size: int, nodes: int, size: int, stats: Sequence[float]) -> dict:
    mean_s, min_s, max_s, transport_cpu_s, repetitions = stats
    algbw = size / mean_s if mean_s > 0 else float("inf")
    return {
        "op": op,
        "world_size": world_size,
        "nodes": nodes,
        "bytes": size,
        "time_s": mean_s,
        "time_min_s": min_s,
        "time_max_s": max_s,
        "repetitions": int(repetitions),
        "algbw_Bps": algbw,
        "busbw_Bps": algbw * bus_factor(op, world_size),
        "transport_cpu_s": transport_cpu_s,
    }


class _Timer:
    """Barrier, clock and synchronisation for one device: a CUDA device is synchronised around the clock."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        self._token = torch.zeros(1, device=device) if self.cuda else None

    def synchronize(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def barrier(self, group) -> None:
        import torch.distributed as dist

        if self.cuda:  # NCCL's barrier guesses a device; a one-element all-reduce on ours does not
            dist.all_reduce(self._token, group=group)
            self.synchronize()
        else:
            dist.barrier(group=group)

    def time(self, run: Callable[[], object], group) -> tuple[float, float, float, float]:
        """(wall seconds, CPU seconds of this process beside the calling thread, start and end on the
        host's clock) of one ``run``."""
        self.barrier(group)
        start, process_s, thread_s = time.perf_counter(), time.process_time(), time.thread_time()
        run()
        self.synchronize()
        end = time.perf_counter()
        transport_s = (time.process_time() - process_s) - (time.thread_time() - thread_s)
        return end - start, (math.nan if self.cuda else max(transport_s, 0.0)), start, end


def _collective(op: str, size: int, group_size: int, device, dtype, group) -> Callable[[], object]:
    """One call of ``op`` moving ``size`` bytes (nccl-tests' S), buffers allocated once."""
    import torch
    import torch.distributed as dist

    count = size // torch.empty((), dtype=dtype).element_size()
    if op == "all_reduce":
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buffer, group=group)
    full = torch.zeros(count, dtype=dtype, device=device)
    part = torch.zeros(count // group_size, dtype=dtype, device=device)
    if op == "all_gather":  # looked up per call: whatever wraps torch.distributed's gather sees it
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part, group=group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(part, full, group=group)


def _sweep_group(
    group,
    group_size: int,
    plan: list[tuple[str, int]],
    warmup: int,
    repetitions: int,
    timer: _Timer,
    dtype,
    min_time_s: float = 0.0,
    max_repetitions: int = 0,
    shared_clock: bool = False,
) -> list[tuple[float, float, float, float, int]]:
    """Per (op, bytes) of ``plan``, on this group's ranks: the time per repetition (from the last rank's
    start on a shared clock, else the slowest rank's own) — its mean, min and max — the mean of the ranks'
    transport CPU, and how many repetitions were timed."""
    import torch
    import torch.distributed as dist

    stats = []
    for op, size in plan:
        run = _collective(op, size, group_size, timer.device, dtype, group)
        for _ in range(warmup):
            run()
        timer.synchronize()
        measured = [timer.time(run, group) for _ in range(repetitions)]
        # Small collectives are fast and their times bimodal (a few take milliseconds): time more of
        # them, the same number on every rank (from the slowest rank's mean so far).
        mean_s = torch.tensor([statistics.fmean(m[0] for m in measured)], dtype=torch.float64)
        mean_s = mean_s.to(timer.device)
        dist.all_reduce(mean_s, op=dist.ReduceOp.MAX, group=group)
        wanted = math.ceil(min_time_s / max(float(mean_s.item()), 1e-9)) if min_time_s > 0 else 0
        more = max(0, min(wanted, max_repetitions) - repetitions)
        measured += [timer.time(run, group) for _ in range(more)]
        table = torch.tensor(measured, dtype=torch.float64)
        # Columns: own wall time, start, end — each the maximum over the group's ranks.
        latest = table[:, [0, 2, 3]].contiguous().to(timer.device)
        transport = table[:, 1].contiguous()
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
        latest = latest.cpu()
        if shared_clock:
            slowest = (latest[:, 2] - latest[:, 1]).clamp(min=0.0).tolist()
        else:
            slowest = latest[:, 0].tolist()
        if timer.cuda:
            transport_s = math.nan
        else:
            dist.all_reduce(transport, op=dist.ReduceOp.SUM, group=group)
            transport_s = statistics.fmean((transport / group_size).tolist())
        stats.append((statistics.fmean(slowest), min(slowest), max(slowest), transport_s, len(slowest)))
    return stats


def _check(
    ops, min_bytes, max_bytes, warmup, repetitions, ranks_per_node, min_time_s, max_repetitions
) -> None:
    if not ops:
        raise ValueError(f"ops is empty: expected some of {', '.join(OPS)}")
    for op in ops:
        if op not in OPS:
            raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")
    for name, value, least in (
        ("min_bytes", min_bytes, 1),
        ("max_bytes", max_bytes, 1),
        ("warmup", warmup, 0),
        ("repetitions", repetitions, 1),
        ("ranks_per_node", ranks_per_node, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} is {value!r}: expected an integer ≥ {least}")
    if max_bytes < min_bytes:
        raise ValueError(f"max_bytes is {max_bytes}: expected at least min_bytes ({min_bytes})")
    if (
        isinstance(min_time_s, bool)
        or not isinstance(min_time_s, (int, float))
        or not 0 <= min_time_s < math.inf
    ):
        raise ValueError(f"min_time_s is {min_time_s!r}: expected a number of seconds ≥ 0")
    if (
        isinstance(max_repetitions, bool)
        or not isinstance(max_repetitions, int)
        or max_repetitions < repetitions
    ):
        raise ValueError(
            f"max_repetitions is {max_repetitions!r}: expected an integer ≥ repetitions ({repetitions})"
        )


def sweep_collectives(
    ops: Sequence[str] = OPS,
    min_bytes: int = 1024,
    max_bytes: int = 64 << 20,
    warmup: int = 2,
    repetitions: int = 5,
    *,
    min_time_s: float = 0.0,
    max_repetitions: int = 200,
    ranks_per_node: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    on_progress: Callable[[dict], Any] | None = None,
) -> list[dict]:
    """Rows (dicts: op, world_size, nodes, bytes, time_s, time_min_s, time_max_s, repetitions, algbw_Bps,
    busbw_Bps, transport_cpu_s) for the whole default group, then node 0's sub-group (see the module docstring), each by
    op, then bytes. Every rank of the group must call it with the same arguments; every rank returns the
    same rows. ``dtype``: the element type moved (default bfloat16). ``on_progress(row)`` is called with
    each row as this rank learns it (node 0's sub-group rows reach the other nodes' ranks at its end)."""
    import torch
    import torch.distributed as dist

    ops = tuple(ops)
    _check(ops, min_bytes, max_bytes, warmup, repetitions, ranks_per_node, min_time_s, max_repetitions)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: init_process_group first")
    dtype = torch.bfloat16 if dtype is None else dtype
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    element_size = torch.empty((), dtype=dtype).element_size()
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = -(-world // ranks_per_node)
    timer = _Timer(device)
    progress = on_progress or (lambda row: None)

    def plan(group_size: int) -> list[tuple[str, int]]:
        return [
            (op, size) for op in ops for size in sweep_sizes(min_bytes, max_bytes, group_size, element_size)
        ]

    def rows(group_size: int, group_nodes: int, stats) -> list[dict]:
        out = []
        for (op, size), measured in zip(plan(group_size), stats, strict=True):
            out.append(_row(op, group_size, group_nodes, size, measured))
            progress(out[-1])
        return out

    # One host (the emulated cluster, one machine's GPUs): every rank reads the same monotonic clock.
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    timing = (warmup, repetitions, timer, dtype, min_time_s, max_repetitions, len(set(hosts)) == 1)
    result = rows(world, nodes, _sweep_group(None, world, plan(world), *timing))

    node_ranks = [list(range(k * ranks_per_node, min((k + 1) * ranks_per_node, world))) for k in range(nodes)]
    if nodes < 2 or len(node_ranks[0]) < 2:
        return result  # one node: the whole group is node 0; one rank a node: nothing to measure within
    # new_group is collective over the whole group: every rank creates every node's group, in node order.
    groups = [dist.new_group(ranks) for ranks in node_ranks if len(ranks) >= 2]
    size = len(node_ranks[0])
    stats = torch.zeros((len(plan(size)), 5), dtype=torch.float64, device=device)
    if rank in node_ranks[0]:
        stats = torch.tensor(
            _sweep_group(groups[0], size, plan(size), *timing),
            dtype=torch.float64,
            device=device,
        )
    timer.barrier(None)  # the other nodes' ranks wait here while node 0 measures
    dist.broadcast(stats, src=node_ranks[0][0])
    result += rows(size, 1, stats.cpu().tolist())
    timer.barrier(None)
    for ranks, group in zip((r for r in node_ranks if len(r) >= 2), groups, strict=True):
        if rank in ranks:
            dist.destroy_process_group(group)
    return result
