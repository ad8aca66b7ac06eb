"""ExponentRecorder's `exponents` and `shard_changes` rows: hand-computed rates on tensors with known changed
positions, a property test against a slow pure-Python reference, and layer_index on the zoo's names."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pd = pytest.importorskip("pandas")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from measure.exponents import ExponentRecorder, ExponentTracker, layer_index  # noqa: E402
from measure.zoo import build_model, parameter_categories, zoo_keys  # noqa: E402

KEY_COLUMNS = {  # the columns both tables start with, and their pandas dtypes
    "run_id": "str",
    "iteration": "int32",
    "layer": "int32",
    "shard": "str",
    "category": "str",
    "numel": "int64",
}
EXPONENT_COLUMNS = {
    **KEY_COLUMNS,
    "block_size": "int32",
    "exp_change_rate": "float64",
    "block_change_rate": "float64",
}
SHARD_COLUMNS = {**KEY_COLUMNS, "world_size": "int32", "shard_change_rate": "float64"}


def _columns(frame: pd.DataFrame) -> dict[str, str]:
    return {name: str(dtype) for name, dtype in frame.dtypes.items()}


def _rates(frame: pd.DataFrame, shard: str, size_column: str, rate_column: str, iteration: int = 1) -> dict:
    rows = frame[(frame.shard == shard) & (frame.iteration == iteration)]
    return dict(zip(rows[size_column].tolist(), rows[rate_column].tolist(), strict=True))


def test_hand_computed_rates_per_block_size_and_world_size() -> None:
    weight = torch.ones(10, dtype=torch.bfloat16)  # exponent 127 everywhere
    norm = torch.full((5,), 0.75, dtype=torch.bfloat16)
    recorder = ExponentRecorder(
        {"w": 1, "n": 3},
        {"w": "expert_ffn", "n": "norm"},
        block_sizes=(3, 4, 8, 16),
        world_sizes=(3, 4, 8, 16),
    )
    recorder.update([("w", weight), ("n", norm)])
    weight = weight.clone()
    weight[0] = -1.0  # the sign is not the exponent: no change
    weight[2] = 2.5  # exponent 128
    weight[5] = 1.75  # same exponent: no change
    weight[9] = -0.5  # exponent 126
    recorder.update([("w", weight), ("n", norm)])
    exponents, shards = recorder.frames("run-a")

    assert _columns(exponents) == EXPONENT_COLUMNS and _columns(shards) == SHARD_COLUMNS
    assert len(exponents) == 2 * 4 and len(shards) == 2 * 4
    assert set(exponents.run_id) == {"run-a"} and set(exponents.iteration) == {1}
    w = exponents[exponents.shard == "w"]
    assert set(w.exp_change_rate) == {2 / 10} and set(w.layer) == {1} and set(w.category) == {"expert_ffn"}
    assert set(w.numel) == {10}
    # Changed values 2 and 9. B=3: [0-2] [3-5] [6-8] [9] (the partial last block counts); B=4: [0-3] [4-7]
    # [8-9]; B=8: [0-7] [8-9]; B=16: one block.
    assert _rates(exponents, "w", "block_size", "block_change_rate") == {3: 2 / 4, 4: 2 / 3, 8: 1.0, 16: 1.0}
    # W=3: partitions of 4: [0,4) [4,8) [8,10); W=4: of 3: [0,3) [3,6) [6,9) [9,10); W=8: of 2, five
    # non-empty ones (three are empty and do not count); W=16 > numel: ten partitions of one value.
    assert _rates(shards, "w", "world_size", "shard_change_rate") == {
        3: 2 / 3,
        4: 2 / 4,
        8: 2 / 5,
        16: 2 / 10,
    }
    # A parameter without changes: every rate 0.
    assert _rates(exponents, "n", "block_size", "block_change_rate") == dict.fromkeys((3, 4, 8, 16), 0.0)
    assert _rates(shards, "n", "world_size", "shard_change_rate") == dict.fromkeys((3, 4, 8, 16), 0.0)
    assert set(exponents[exponents.shard == "n"].exp_change_rate) == {0.0}
    assert set(shards[shards.shard == "n"].layer) == {3} and set(shards.numel) == {10, 5}


def test_non_finite_values_compare_by_their_all_ones_exponent() -> None:
    inf, nan, fp32_max = math.inf, math.nan, torch.finfo(torch.float32).max
    before = torch.tensor([inf, nan, 1.0, inf, 0.0, 1.0, -inf, inf])
    # inf → NaN, NaN → -inf, -inf → inf: exponent 0xFF stays (no change); 1.0 → inf, inf → 1.0 and
    # 1.0 → NaN change; 0 → -0 does not; FP32's largest value rounds to inf in BF16 (no change, though
    # its FP32 exponent is 254).
    after = torch.tensor([nan, -inf, inf, 1.0, -0.0, nan, inf, fp32_max])
    recorder = ExponentRecorder({"x": 2}, {"x": "attention"}, block_sizes=(2, 4), world_sizes=(4, 8))
    recorder.update([("x", before)])
    recorder.update([("x", after)])
    exponents, shards = recorder.frames("r")
    assert set(exponents.exp_change_rate) == {3 / 8}  # values 2, 3 and 5
    assert _rates(exponents, "x", "block_size", "block_change_rate") == {2: 2 / 4, 4: 2 / 2}
    assert _rates(shards, "x", "world_size", "shard_change_rate") == {4: 2 / 4, 8: 3 / 8}


def test_iterations_count_from_one_and_compare_with_the_call_before() -> None:
    values = [torch.ones(4), torch.tensor([1.0, 2.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 1.0, 1.0])]
    recorder = ExponentRecorder({"p": 0}, {"p": "embedding"}, block_sizes=(1,), world_sizes=(1,))
    for tensor in values:
        recorder.update([("p", tensor)])
    assert recorder.iterations == 2
    exponents, shards = recorder.frames("r")
    assert exponents.iteration.tolist() == [1, 2]
    assert exponents.exp_change_rate.tolist() == [0.25, 0.0]  # iteration 2 compares with iteration 1
    assert shards.shard_change_rate.tolist() == [1.0, 0.0]


def test_fp32_and_bf16_inputs_of_the_same_values_give_the_same_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    first = torch.randn(3000, generator=generator) * 0.02
    second = first * (1 + 0.05 * torch.randn(3000, generator=generator))
    frames = []
    for cast in (lambda t: t, lambda t: t.to(torch.bfloat16)):
        recorder = ExponentRecorder({"p": 1}, {"p": "router"})
        recorder.update([("p", cast(first))])
        recorder.update([("p", cast(second))])
        frames.append(recorder.frames("r"))
    pd.testing.assert_frame_equal(frames[0][0], frames[1][0])
    pd.testing.assert_frame_equal(frames[0][1], frames[1][1])
    assert 0 < frames[0][0].exp_change_rate.iloc[0] < 1


def test_no_compared_iteration_gives_empty_tables_with_the_columns() -> None:
    recorder = ExponentRecorder({"p": 1}, {"p": "norm"})
    assert len(recorder.frames("r")[0]) == 0
    recorder.update([("p", torch.ones(3))])
    exponents, shards = recorder.frames("r")
    assert len(exponents) == len(shards) == 0
    assert _columns(exponents) == EXPONENT_COLUMNS and _columns(shards) == SHARD_COLUMNS


def test_tracker_and_recorder_count_the_same_changes() -> None:
    generator = torch.Generator().manual_seed(5)
    steps = [
        {name: torch.randn(size, generator=generator) for name, size in (("a", 1500), ("b", 700), ("c", 64))}
    ]
    for _ in range(2):
        steps.append(
            {name: t * (1 + 0.3 * torch.randn(t.shape, generator=generator)) for name, t in steps[-1].items()}
        )
    categories = {"a": "expert_ffn", "b": "expert_ffn", "c": "norm"}
    tracker = ExponentTracker(categories, block_size=256)
    recorder = ExponentRecorder(dict.fromkeys(categories, 1), categories, block_sizes=(256,))
    per_step = []
    for tensors in steps:
        per_step.append(tracker.update(tensors.items()))
        recorder.update(tensors.items())
    exponents, _ = recorder.frames("r")
    exponents["values_changed"] = exponents.exp_change_rate * exponents.numel
    exponents["blocks"] = -(-exponents.numel // 256)
    exponents["blocks_changed"] = exponents.block_change_rate * exponents.blocks
    for iteration, rates in enumerate(per_step[1:], start=1):
        rows = exponents[(exponents.iteration == iteration) & (exponents.category == "expert_ffn")]
        assert rates["expert_ffn"]["exp_change_rate"] == pytest.approx(
            rows.values_changed.sum() / rows.numel.sum()
        )
        assert rates["expert_ffn"]["block_change_rate"] == pytest.approx(
            rows.blocks_changed.sum() / rows.blocks.sum()
        )


def test_updates_that_do_not_match_the_baseline_are_refused_and_change_nothing() -> None:
    recorder = ExponentRecorder(
        {"a": 1, "b": 2}, {"a": "norm", "b": "norm"}, block_sizes=(2,), world_sizes=(2,)
    )
    recorder.update([("a", torch.ones(4)), ("b", torch.ones(2))])
    with pytest.raises(ValueError, match="'b' is missing"):
        recorder.update([("a", torch.full((4,), 2.0))])
    with pytest.raises(ValueError, match="'a' has 5 values, 4 at the last update"):
        recorder.update([("a", torch.ones(5)), ("b", torch.ones(2))])
    with pytest.raises(ValueError, match="'a' is given twice"):
        recorder.update([("a", torch.ones(4)), ("a", torch.ones(4)), ("b", torch.ones(2))])
    with pytest.raises(ValueError, match="'c' has no layer"):
        recorder.update([("a", torch.ones(4)), ("b", torch.ones(2)), ("c", torch.ones(1))])
    assert recorder.iterations == 0
    # The refused updates stored nothing: this one still compares with the baseline.
    recorder.update([("b", torch.ones(2)), ("a", torch.tensor([1.0, 1.0, 1.0, 4.0]))])
    exponents, _ = recorder.frames("r")
    assert exponents.shard.tolist() == ["a", "b"]  # the baseline's order
    assert exponents.exp_change_rate.tolist() == [0.25, 0.0]


def test_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="block_sizes holds 0"):
        ExponentRecorder({}, {}, block_sizes=(0, 64))
    with pytest.raises(ValueError, match="listed twice"):
        ExponentRecorder({}, {}, world_sizes=(4, 4))
    with pytest.raises(ValueError, match="category 'mlp'"):
        ExponentRecorder({"a": 1}, {"a": "mlp"})
    with pytest.raises(ValueError, match="'a' has no category"):
        ExponentRecorder({"a": 1}, {}).update([("a", torch.ones(1))])


# ------------------------------------------------------------------------------------- property test


def _reference_rows(bits_per_update: list[dict[str, list[int]]], block_sizes, world_sizes):
    """{(iteration, name): (exp rate, {B: rate}, {W: rate})} by plain loops over Python ints."""
    rows = {}
    for iteration in range(1, len(bits_per_update)):
        for name, after in bits_per_update[iteration].items():
            before = bits_per_update[iteration - 1][name]
            changed = [((a >> 7) & 0xFF) != ((b >> 7) & 0xFF) for a, b in zip(after, before, strict=True)]
            n = len(changed)
            blocks = {}
            for size in block_sizes:
                flags = [any(changed[start : start + size]) for start in range(0, n, size)]
                blocks[size] = sum(flags) / len(flags) if flags else 0.0
            shards = {}
            for world in world_sizes:
                size = -(-n // world)
                parts = [changed[rank * size : (rank + 1) * size] for rank in range(world)]
                parts = [part for part in parts if part]
                shards[world] = sum(any(part) for part in parts) / len(parts) if parts else 0.0
            rows[(iteration, name)] = (sum(changed) / n if n else 0.0, blocks, shards)
    return rows


def _bf16(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


@st.composite
def _updates(draw):
    sizes = draw(st.lists(st.integers(0, 90), min_size=1, max_size=3))
    first = {
        f"p{i}": draw(st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n)) for i, n in enumerate(sizes)
    }
    updates = [first]
    for _ in range(draw(st.integers(1, 3))):
        following = {}
        for name, bits in updates[-1].items():
            bits = list(bits)
            if bits:
                for position, value in draw(
                    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 0xFFFF)))
                ):
                    bits[position % len(bits)] = value
            following[name] = bits
        updates.append(following)
    return updates


@settings(max_examples=60, deadline=None)
@given(
    updates=_updates(),
    block_sizes=st.lists(
        st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 33, 64, 128]), min_size=1, max_size=5, unique=True
    ),
    world_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True),
)
def test_rows_match_a_pure_python_reference(updates, block_sizes, world_sizes) -> None:
    names = list(updates[0])
    recorder = ExponentRecorder(
        {name: i for i, name in enumerate(names)},
        dict.fromkeys(names, "expert_ffn"),
        block_sizes,
        world_sizes,
    )
    for bits in updates:
        recorder.update([(name, _bf16(values)) for name, values in bits.items()])
    exponents, shards = recorder.frames("r")
    expected = _reference_rows(updates, block_sizes, world_sizes)
    assert len(exponents) == len(expected) * len(block_sizes)
    assert len(shards) == len(expected) * len(world_sizes)
    assert exponents.block_size.tolist()[: len(block_sizes)] == block_sizes
    for (iteration, name), (exp_rate, blocks, partitions) in expected.items():
        rows = exponents[(exponents.iteration == iteration) & (exponents.shard == name)]
        assert set(rows.exp_change_rate) == {exp_rate}
        assert dict(zip(rows.block_size, rows.block_change_rate, strict=True)) == blocks
        assert set(rows.layer) == {names.index(name)} and set(rows.numel) == {len(updates[0][name])}
        rows = shards[(shards.iteration == iteration) & (shards.shard == name)]
        assert dict(zip(rows.world_size, rows.shard_change_rate, strict=True)) == partitions


# ------------------------------------------------------------------------------------------ layers


def test_layer_index_places_every_parameter_of_a_small_zoo_model() -> None:
    model = build_model("small-moe", layers=2, width_scale=8)
    categories = parameter_categories(model)
    layers = {name: layer_index(name, 2) for name, _ in model.named_parameters()}
    assert layers["embed_tokens.weight"] == 0  # tied: the LM head is this parameter
    assert layers["final_norm.weight"] == 3
    assert {layers[name] for name in layers if name.startswith("blocks.0.")} == {1}
    assert {layers[name] for name in layers if name.startswith("blocks.1.")} == {2}
    assert set(layers.values()) == {0, 1, 2, 3}
    # The recorder takes the real model's parameters, layers and categories as they come.
    recorder = ExponentRecorder(layers, categories)
    recorder.update(model.named_parameters())
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    recorder.update(model.named_parameters())
    exponents, shards = recorder.frames("small")
    assert len(exponents) == 5 * len(layers) and len(shards) == 4 * len(layers)
    assert exponents.groupby("shard").layer.first().to_dict() == layers
    assert exponents.groupby("shard").category.first().to_dict() == categories
    assert exponents.block_change_rate.between(0, 1).all() and shards.shard_change_rate.between(0, 1).all()
    assert exponents.exp_change_rate.max() > 0


@pytest.mark.parametrize("key", zoo_keys())
def test_layer_index_places_every_zoo_models_parameters(key: str) -> None:
    model = build_model(key, layers=2, device="meta")
    layers = {name: layer_index(name, 2) for name, _ in model.named_parameters()}
    untied = "lm_head.weight" in layers
    assert layers.get("lm_head.weight", 3) == 3 and layers["embed_tokens.weight"] == 0
    assert untied == (not model.shape.tie_word_embeddings)
    assert set(layers.values()) == {0, 1, 2, 3}


def test_layer_index_skips_wrapper_segments_and_refuses_what_it_cannot_place() -> None:
    assert layer_index("module.blocks.0._fsdp_wrapped_module.attn.q_proj.weight", 4) == 1
    assert layer_index("_orig_mod.lm_head.weight", 4) == 5
    for name in ("blocks.4.attn.q_proj.weight", "encoder.weight", "blocks.x.weight", "blocks.0", ""):
        with pytest.raises(ValueError, match="no layer of a 4-block zoo model") as error:
            layer_index(name, 4)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="num_layers is 0"):
        layer_index("embed_tokens.weight", 0)
