"""Model shape files (traces/data/models): lookup by key, alias or display name, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import traces


def test_every_shipped_shape_loads_and_aliases_resolve():
    keys = traces.model_keys()
    assert {"olmoe-1b-7b", "mixtral-8x7b", "small-moe"} <= set(keys)
    assert len(keys) == 7
    for key in keys:
        shape = traces.load_model_shape(key)
        assert shape.key == key
        for name in (shape.name, *shape.aliases, key.upper()):
            assert traces.load_model_shape(name).key == key
        assert shape.num_attention_heads % shape.num_key_value_heads == 0
    assert traces.load_model_shape("olmoe").name == "OLMoE-1B-7B"


def test_unknown_model_is_one_line_naming_it_and_the_known_ones():
    with pytest.raises(traces.ModelShapeError) as info:
        traces.load_model_shape("gpt-5")
    message = str(info.value)
    assert "\n" not in message
    assert "'gpt-5'" in message and "olmoe-1b-7b" in message and "small-moe" in message


def test_bad_field_names_the_file_field_and_value(tmp_path: Path):
    source = (traces.models.models_dir() / "mixtral-8x7b.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(source.replace("num_key_value_heads = 8", "num_key_value_heads = 5"))
    with pytest.raises(traces.ModelShapeError, match=r"bad.toml: field 'num_key_value_heads' is 5"):
        traces.load_model_shape(str(bad))
    bad.write_text(source.replace('router_score = "softmax"', 'router_score = "argmax"'))
    with pytest.raises(traces.ModelShapeError, match=r"field 'router_score' is 'argmax'"):
        traces.load_model_shape(str(bad))


def test_a_missing_misspelt_or_quoted_field_is_named(tmp_path: Path):
    """A misspelt optional field kept its default without a word, and `qk_norm = "false"` read as true."""
    source = (traces.models.models_dir() / "mixtral-8x7b.toml").read_text()
    cases = {
        source.replace("num_layers = 32\n", ""): "field 'num_layers' missing",
        "rope_thetta = 1e6\n" + source: "unknown field 'rope_thetta', expected one of hidden_size",
        source.replace(
            "qk_norm = false", 'qk_norm = "false"'
        ): "field 'qk_norm' is 'false', expected true or false",
        "optimizer = 3\n" + source: "field 'optimizer' is 3, expected a string",
    }
    refused = 0
    for index, (text, expected) in enumerate(cases.items()):
        bad = tmp_path / f"bad-{index}.toml"
        bad.write_text(text)
        with pytest.raises(traces.ModelShapeError, match=expected):
            traces.load_model_shape(str(bad))
        refused += 1
    assert refused == len(cases)
