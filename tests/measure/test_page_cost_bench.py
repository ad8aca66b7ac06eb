"""benchmarks/page_cost.py: the same allocate-fill-free step with glibc's defaults and with the ranks'
retained allocator, in one run; the retained one faults nothing in; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _bench_script import run_benchmark  # noqa: E402

from measure.launch import RETAIN_ALLOCATOR_ENV, allocator_in_use  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
def test_the_retained_allocator_faults_nothing_in_where_the_systems_faults_every_page(tmp_path: Path) -> None:
    out = tmp_path / "pages.json"
    done = run_benchmark("page_cost.py", "--mib", "64", "--repetitions", "4", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    system, retain = result["modes"]["system"], result["modes"]["retain"]
    # 64 MiB is above glibc's largest mmap threshold: handed back when freed, faulted in again each step.
    assert system["faults_per_step"] >= 0.9 * result["pages_per_step"]
    assert retain["faults_per_step"] == 0 and result["retain_env"] == RETAIN_ALLOCATOR_ENV
    assert (
        result["us_per_faulted_page"]
        == (system["median_ms"] - retain["median_ms"]) * 1e3 / system["faults_per_step"]
    )
    assert "one faulted 4 KB page" in done.stdout


def test_bad_input_is_one_line() -> None:
    done = run_benchmark("page_cost.py", "--mib", "0", timeout=60)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) <= 2 and "--mib 0" in lines[-1], lines


def test_what_the_allocator_record_says() -> None:
    """Read from the rank's own environment: retain only when every setting is in force, whoever set it."""
    assert allocator_in_use(dict(RETAIN_ALLOCATOR_ENV, PATH="/bin")) == {
        "allocator": "retain",
        "malloc_env": RETAIN_ALLOCATOR_ENV,
    }
    assert allocator_in_use({"MALLOC_MMAP_MAX_": "0"}) == {
        "allocator": "system",
        "malloc_env": {"MALLOC_MMAP_MAX_": "0"},
    }
    assert allocator_in_use({}) == {"allocator": "system", "malloc_env": {}}
