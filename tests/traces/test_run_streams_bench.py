"""benchmarks/run_streams.py: per run of a bundle, where a rank's iteration goes, by stream; a bad bundle is
one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from _bench_script import run_benchmark  # noqa: E402


def test_the_shipped_bundle_by_stream(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    done = run_benchmark("run_streams.py", "--bundle", "measured", "--runs", "L2-emulated-2x1-200mbit",
                         "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = {run["run_id"].split("-w32-")[1].split("-L2")[0]: run for run in result["runs"]}
    assert set(runs) == {"zero3", "fsdp", "ciera", "ciera-fsdp"}
    for name, run in runs.items():
        streams = run["streams"]
        assert run["iteration_median_s"] > 0 and streams["compute"]["seconds"] > 0
        assert streams["allgather"]["wire_bytes"] <= streams["allgather"]["raw_bytes"]
        assert ("codec_send" in streams) == name.startswith("ciera")
    # CIERA's gathers carry the same raw bytes as ZeRO-3's, about half of them on the wire.
    plain, ciera = runs["zero3"]["streams"]["allgather"], runs["ciera"]["streams"]["allgather"]
    assert ciera["raw_bytes"] == plain["raw_bytes"] and ciera["wire_bytes"] < 0.6 * plain["wire_bytes"]


def test_a_bad_bundle_is_one_line(tmp_path: Path) -> None:
    done = run_benchmark("run_streams.py", "--bundle", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len((done.stdout + done.stderr).strip().splitlines()) == 1
