"""The sweep in worker processes (`simulate(workers=N)`): the same records, in the same order, as in one
process; the events counted once per evaluation; bad worker counts refused in one line."""

from __future__ import annotations

import pytest

import traces
from sim import SimInputError, load_cluster, simulate, sweep_workers
from sim.simulate import MAX_WORKERS, PARALLEL_MIN_JOBS


def test_workers_give_the_records_of_one_process(bundle: traces.TraceBundle) -> None:
    preset = load_cluster("a100-hdr-testbed")
    serial_counts: dict[str, int] = {}
    parallel_counts: dict[str, int] = {}
    progress: list[tuple[int, int]] = []
    serial = simulate(bundle, preset, gpus=[4, 8, 16], counters=serial_counts, workers=1)
    parallel = simulate(
        bundle,
        preset,
        gpus=[4, 8, 16],
        counters=parallel_counts,
        workers=2,
        progress=lambda done, total: progress.append((done, total)),
    )
    assert [r.to_dict() for r in parallel] == [r.to_dict() for r in serial]
    # One (model, dtype) group per worker: each evaluation still runs (and is counted) once.
    assert parallel_counts == {"simulated_events": serial_counts["simulated_events"], "workers": 2}
    assert serial_counts["workers"] == 1
    # Progress counts (model, dtype, W) jobs, a whole group at a time, up to all of them.
    assert [total for _, total in progress] == [6, 6] and [done for done, _ in progress] == [3, 6]


def test_no_more_workers_than_groups(bundle: traces.TraceBundle) -> None:
    counters: dict[str, int] = {}
    simulate(
        bundle, load_cluster("a100-hdr-testbed"), gpus=[8], dtypes=["bf16"], counters=counters, workers=4
    )
    assert counters["workers"] == 1  # one (model, dtype) group: run here, no process started


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2", True])
def test_bad_worker_counts_are_refused(bundle: traces.TraceBundle, workers: object) -> None:
    with pytest.raises(SimInputError, match=r"^workers=.*expected a whole number >= 1$"):
        simulate(bundle, load_cluster("a100-hdr-testbed"), gpus=[8], workers=workers)  # type: ignore[arg-type]


def test_default_workers() -> None:
    assert sweep_workers(PARALLEL_MIN_JOBS - 1) == 1
    many = sweep_workers(10_000)
    assert 1 <= many <= MAX_WORKERS
    assert sweep_workers(PARALLEL_MIN_JOBS) == min(many, PARALLEL_MIN_JOBS)
