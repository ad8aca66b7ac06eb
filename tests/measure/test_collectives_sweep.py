"""The collectives sweep on real local gloo groups: 2 and 4 spawned ranks, whole group and node sub-group
rows, nccl-tests' size and bandwidth conventions, identical rows on every rank, and a missing rank ending in
the process group's timeout error."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from measure import collectives  # noqa: E402
from measure.collectives import OPS, bus_factor, sweep_collectives, sweep_sizes  # noqa: E402
from tests.ranks import free_port, read_until_done, start_ranks  # noqa: E402

MAX_BYTES = 64 << 10
SIZES = [1024 << k for k in range(7)]  # 1 KiB … 64 KiB
REPETITIONS = 3
# each size timed ~100 ms, so even on a loaded host (4 ranks on 2 cores, collectives of several ms) the
# small ones get more repetitions than the fixed count; at most MAX_REPETITIONS (the usual case: 12).
MIN_TIME_S = 0.1
MAX_REPETITIONS = 12
TIMEOUT_S = 3.0  # the group's timeout for the missing-rank check


def _rank(
    rank: int, world_size: int, port: int, ranks_per_node: int, queue, checked, late_s: float = 0.0
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    if late_s and rank == world_size - 1:  # this rank leaves every barrier `late_s` after the others
        barrier = collectives._Timer.barrier

        def late_barrier(self, group) -> None:
            barrier(self, group)
            time.sleep(late_s)

        collectives._Timer.barrier = late_barrier
    try:
        progress = []
        rows = sweep_collectives(
            max_bytes=MAX_BYTES if not late_s else 4096,
            warmup=1,
            repetitions=REPETITIONS,
            ranks_per_node=ranks_per_node,
            on_progress=progress.append,
            min_time_s=MIN_TIME_S,
            max_repetitions=MAX_REPETITIONS,
        )
        queue.put(("rows", rank, rows, progress))
        if checked is not None:  # the missing-rank check: `checked` is set once rank 0 has its error
            # Every rank shortens the group's timeout; rank 1 then never joins rank 0's next sweep.
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S), None)
            if rank == 0:
                start = time.monotonic()
                try:
                    sweep_collectives(max_bytes=1024, ranks_per_node=ranks_per_node)
                    queue.put(("missing", rank, None, time.monotonic() - start))
                except Exception as error:  # noqa: BLE001 — the error itself is the result
                    queue.put(("missing", rank, f"{type(error).__name__}: {error}", time.monotonic() - start))
                checked.set()
            else:
                checked.wait(TIMEOUT_S + 30)  # alive but absent: a timeout, not a closed connection
    except Exception as error:  # noqa: BLE001 — reported to the parent, which fails the test
        queue.put(("error", rank, f"{type(error).__name__}: {error}", None))
    finally:
        os._exit(0)  # no teardown: after the missing-rank check the group is broken on purpose


def _spawn(
    world_size: int,
    ranks_per_node: int,
    missing_rank_check: bool = False,
    deadline_s: float = 120,
    late_s: float = 0.0,
) -> dict:
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    checked = context.Event() if missing_rank_check else None
    processes = start_ranks(
        _rank, world_size, (world_size, free_port(), ranks_per_node, queue, checked, late_s), join=False
    )
    messages = read_until_done(processes, queue, deadline_s)
    errors = [message for message in messages if message[0] == "error"]
    assert not errors, errors
    return {(kind, rank): (payload, extra) for kind, rank, payload, extra in messages}


def _check_group_rows(rows: list[dict], world_size: int, nodes: int) -> None:
    assert [(row["op"], row["bytes"]) for row in rows] == [(op, size) for op in OPS for size in SIZES]
    # Sub-millisecond collectives are timed beyond the fixed count (MIN_TIME_S is several of them).
    assert any(row["repetitions"] > REPETITIONS for row in rows)
    for row in rows:
        assert row["world_size"] == world_size and row["nodes"] == nodes
        # At least the fixed count, never more than the cap. How many more is decided from the ranks' own
        # wall times of the first repetitions (barrier-exit skew included), which the row does not keep: its
        # time counts from the last rank's start, so repetitions × time_s may fall well short of MIN_TIME_S.
        assert REPETITIONS <= row["repetitions"] <= MAX_REPETITIONS
        assert 0 < row["time_min_s"] <= row["time_s"] <= row["time_max_s"]
        assert row["algbw_Bps"] == row["bytes"] / row["time_s"]
        factor = (
            2 * (world_size - 1) / world_size if row["op"] == "all_reduce" else (world_size - 1) / world_size
        )
        assert row["busbw_Bps"] == pytest.approx(row["algbw_Bps"] * factor, rel=1e-12)
        # The process's CPU beside the calling thread (gloo's transport threads), per rank: measured on CPU.
        assert 0 <= row["transport_cpu_s"] < 10 * row["time_max_s"] + 0.1


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_two_ranks_sweep_one_node_and_a_missing_rank_times_out() -> None:
    results = _spawn(2, ranks_per_node=2, missing_rank_check=True)
    rows, progress = results[("rows", 0)]
    assert results[("rows", 1)] == (rows, progress)  # identical on every rank
    assert progress == rows
    _check_group_rows(rows, world_size=2, nodes=1)  # one node: no sub-group rows
    error, elapsed_s = results[("missing", 0)]
    assert error is not None and "\n" not in error.strip(), error
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
    assert TIMEOUT_S * 0.5 <= elapsed_s <= TIMEOUT_S + 10, elapsed_s


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_four_ranks_two_per_node_sweep_the_whole_group_and_node_zero() -> None:
    results = _spawn(4, ranks_per_node=2)
    rows, progress = results[("rows", 0)]
    for rank in (1, 2, 3):
        assert results[("rows", rank)][0] == rows, f"rank {rank} returned other rows"
        assert results[("rows", rank)][1] == rows
    whole = [row for row in rows if row["world_size"] == 4]
    node = [row for row in rows if row["world_size"] == 2]
    assert rows == whole + node
    _check_group_rows(whole, world_size=4, nodes=2)
    _check_group_rows(node, world_size=2, nodes=1)


def test_a_rank_that_leaves_the_barrier_late_does_not_make_the_collective_slower() -> None:
    # One host, one clock: a collective counts from its last rank's start. Without that, each of these
    # ~0.1 ms collectives would count the 30 ms the late rank slept.
    late_s = 0.03
    rows, _ = _spawn(2, ranks_per_node=2, late_s=late_s)[("rows", 0)]
    assert rows and all(row["time_s"] < late_s / 3 for row in rows), [row["time_s"] for row in rows]


def test_sizes_double_and_round_up_to_the_group() -> None:
    assert sweep_sizes(1024, 64 << 10, 4, 2) == SIZES
    assert sweep_sizes(1024, 1023, 4, 2) == []
    # 1001 bytes on 4 ranks of 2-byte elements: multiples of 8; on 3 ranks of 4 bytes: multiples of 12.
    assert sweep_sizes(1001, 4004, 4, 2) == [1008, 2008, 4008]
    assert sweep_sizes(1000, 4000, 3, 4) == [1008, 2004, 4008]
    assert sweep_sizes(1, 8, 4, 2) == [8]  # 1, 2, 4 and 8 all round to 8: measured once
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_reduce", 8) == 14 / 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ops": ("broadcast",)}, "op 'broadcast'"),
        ({"ops": ()}, "ops is empty"),
        ({"min_bytes": 0}, "min_bytes is 0"),
        ({"min_bytes": 4096, "max_bytes": 1024}, "max_bytes is 1024"),
        ({"repetitions": 0}, "repetitions is 0"),
        ({"ranks_per_node": 0}, "ranks_per_node is 0"),
        ({"min_time_s": -1.0}, "min_time_s is -1.0"),
        ({"min_time_s": float("nan")}, "min_time_s is nan"),
        ({"repetitions": 5, "max_repetitions": 4}, "max_repetitions is 4"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str) -> None:
    arguments = {"ranks_per_node": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        sweep_collectives(**arguments)


def test_an_uninitialised_process_group_is_an_error() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="not initialised"):
        sweep_collectives(ranks_per_node=1)
