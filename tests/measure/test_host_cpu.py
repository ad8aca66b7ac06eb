"""What other processes take from the host during a capture job: a busy process that is not the job's is
counted, the job's own children are not, and the console says so when it passes the threshold."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from measure.launch import host_cpu_record, host_cpu_sample
from measure.measure_cli import other_cpu_line

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")

BUSY_S = 1.0


def test_a_busy_process_outside_the_job_is_counted_as_other() -> None:
    start = host_cpu_sample()
    # An orphan (its shell parent exits at once): its CPU never reaches this process's children's usage.
    subprocess.run(
        ["sh", "-c", f"timeout {BUSY_S} sh -c 'while :; do :; done' >/dev/null 2>&1 &"], check=True
    )
    time.sleep(BUSY_S + 0.3)
    record = host_cpu_record(start, host_cpu_sample())
    assert record["other_cpu_s"] >= 0.6 * BUSY_S, record
    assert 0 < record["other_cpu_share"] <= 1, record


def test_the_jobs_own_children_are_not_other() -> None:
    # What the rest of the host takes anyway (another test run, CI's neighbours), over as long a window.
    start = host_cpu_sample()
    time.sleep(BUSY_S)
    baseline = host_cpu_record(start, host_cpu_sample())
    start = host_cpu_sample()
    busy = f"import time\nend = time.perf_counter() + {BUSY_S}\nwhile time.perf_counter() < end: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)  # reaped: its CPU is the job's
    record = host_cpu_record(start, host_cpu_sample())
    assert record["job_cpu_s"] >= 0.8 * BUSY_S, record
    assert record["other_cpu_s"] < baseline["other_cpu_s"] + 0.4 * BUSY_S, (record, baseline)


def test_without_proc_stat_the_share_is_unknown_not_zero() -> None:
    assert host_cpu_record(None, None) == {"other_cpu_share": None}


def test_the_console_line_names_the_busy_runs() -> None:
    quiet = [{"run_id": "a", "other_cpu_share": 0.01}, {"run_id": "b", "other_cpu_share": 0.02}]
    assert other_cpu_line(quiet) == "other processes used at most 2.0 % of the host's CPU during any run"
    busy = quiet + [{"run_id": "c", "other_cpu_share": 0.41}]
    line = other_cpu_line(busy)
    assert "the host was busy" in line and "1 of 3 runs" in line and "41 %" in line and ", c)" in line
    assert other_cpu_line([{"run_id": "old", "other_cpu_share": None}]) == ""
