"""`ciera models`: the table, --json, aliases, and the one-line exit-2 error for an unknown model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from measure import zoo


def run_ciera(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    import ciera_cli.main as entry

    monkeypatch.setattr(sys, "argv", ["ciera", *args])
    code = 0
    try:
        entry.main()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_models_table_lists_the_zoo(capsys, monkeypatch) -> None:
    code, out, _ = run_ciera(["models"], capsys, monkeypatch)
    assert code == 0
    for key in zoo.zoo_keys():
        assert key in out
    assert "24.7M" in out and "46.7B" in out


def test_models_json(capsys, monkeypatch) -> None:
    code, out, _ = run_ciera(["models", "--json"], capsys, monkeypatch)
    assert code == 0
    document = json.loads(out)
    assert document["schema"] == "ciera.models/1"
    records = {r["key"]: r for r in document["models"]}
    assert list(records) == zoo.zoo_keys() and len(records) == 7
    small = records["small-moe"]
    assert small["params"] == small["small"]["params"] == 24_670_208 and small["small"]["width_scale"] == 1
    mixtral = records["mixtral-8x7b"]
    assert (mixtral["experts"], mixtral["top_k"], mixtral["attention_heads"], mixtral["kv_heads"]) == (
        8,
        2,
        32,
        8,
    )
    assert records["qwen2-57b-a14b"]["shared_expert_intermediate_size"] == 20480
    for record in records.values():
        assert record["small"]["params_at_2_layers"] < 50e6


def test_models_accepts_an_alias(capsys, monkeypatch) -> None:
    code, out, _ = run_ciera(["models", "olmoe", "--json"], capsys, monkeypatch)
    assert code == 0
    assert [r["key"] for r in json.loads(out)["models"]] == ["olmoe-1b-7b"]


def test_a_shape_file_outside_the_zoo_is_listed_without_a_small_scale(tmp_path, capsys, monkeypatch) -> None:
    """It has no default width scale: shown as such (it was "no such model" by its key)."""
    import traces

    path = tmp_path / "mymoe.toml"
    path.write_text(
        (traces.models.models_dir() / "olmoe-1b-7b.toml")
        .read_text()
        .replace('aliases = ["olmoe"]', "aliases = []")
    )
    code, out, _ = run_ciera(["models", str(path), "--json"], capsys, monkeypatch)
    assert code == 0
    (record,) = json.loads(out)["models"]
    assert record["key"] == "mymoe" and record["small"] is None and record["layers"] == 16


def test_unknown_model_is_one_line_exit_2(capsys, monkeypatch) -> None:
    code, out, err = run_ciera(["models", "gpt-5"], capsys, monkeypatch)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: model 'gpt-5': no such model")
    for key in zoo.zoo_keys():
        assert key in err
    assert "olmoe" in err


def test_listing_needs_no_torch() -> None:
    probe = (
        "import sys, measure, measure.cli, measure.corpus; "
        "from measure import zoo; zoo.parameter_count(zoo.scaled_shape('olmoe', layers=2)); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
