"""The model zoo: every model builds small and trains, categories, GQA and shared experts as configured,
deterministic weights and losses, checkpointing that changes nothing, one-line errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from measure import corpus, zoo  # noqa: E402

INPUTS, TARGETS = corpus.batch(0, 32, 2, seed=0)


def losses_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(INPUTS, TARGETS)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("key", zoo.zoo_keys())
def test_every_zoo_model_builds_small_and_trains_at_two_layers(key: str) -> None:
    full = zoo.full_shape(key)
    model = zoo.build_model(key, layers=2)
    shape = model.shape
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == zoo.parameter_count(shape)
    assert sum(p.numel() * p.element_size() for p in params.values()) < 2**28  # well under a GB
    assert len(model.blocks) == 2

    loss, grads = losses_and_grads(model)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())

    categories = zoo.parameter_categories(model)
    assert set(categories) == set(params)
    assert set(categories.values()) == set(zoo.CATEGORIES)
    assert ("lm_head.weight" in params) != full.tie_word_embeddings

    for index, block in enumerate(model.blocks):
        attn = block.attn
        assert (attn.heads, attn.kv_heads) == (full.num_attention_heads, full.num_key_value_heads)
        assert attn.q_proj.out_features == full.num_attention_heads * shape.head_dim
        assert (
            attn.k_proj.out_features == attn.v_proj.out_features == full.num_key_value_heads * shape.head_dim
        )
        assert (attn.q_proj.bias is not None) == full.attention_bias
        assert hasattr(attn, "q_norm") == full.qk_norm
        dense = index < full.dense_blocks
        assert (block.mlp is not None) == dense and (block.moe is None) == dense
        if dense:
            continue
        moe = block.moe
        assert len(moe.experts) == full.num_experts and moe.top_k == full.experts_per_token
        assert (moe.shared_expert is not None) == (full.shared_expert_intermediate_size > 0)
        assert (moe.shared_expert_gate is not None) == full.shared_expert_gate
        if moe.shared_expert is not None:
            width = full.shared_expert_intermediate_size // zoo.default_width_scale(key)
            assert moe.shared_expert.up_proj.out_features == width


def test_categories_by_name() -> None:
    model = zoo.build_model("qwen2", layers=1)
    categories = zoo.parameter_categories(model)
    assert categories["embed_tokens.weight"] == categories["lm_head.weight"] == "embedding"
    assert categories["blocks.0.attn.q_proj.bias"] == "attention"
    assert categories["blocks.0.input_norm.weight"] == categories["final_norm.weight"] == "norm"
    assert categories["blocks.0.moe.router.weight"] == "router"
    assert categories["blocks.0.moe.shared_expert_gate.weight"] == "router"
    assert categories["blocks.0.moe.experts.3.down_proj.weight"] == "expert_ffn"
    assert categories["blocks.0.moe.shared_expert.up_proj.weight"] == "expert_ffn"
    small = zoo.parameter_categories(zoo.build_model("small-moe", layers=1, device="meta"))
    assert small["blocks.0.attn.q_norm.weight"] == small["blocks.0.attn.k_norm.weight"] == "norm"
    assert (
        zoo.parameter_categories(zoo.build_model("deepseek", layers=1, device="meta"))[
            "blocks.0.mlp.gate_proj.weight"
        ]
        == "expert_ffn"
    )
    with pytest.raises(zoo.ZooError, match="parameter 'blocks.0.extra.weight': no category"):
        zoo.category_of("blocks.0.extra.weight")


def test_small_moe_full_size_is_the_studys_25m_model() -> None:
    model = zoo.build_model("small-moe", device="meta")
    shape = model.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (6, 256, 4)
    assert (shape.num_experts, shape.experts_per_token, shape.moe_intermediate_size) == (16, 4, 256)
    assert shape.shared_expert_intermediate_size == 0 and shape.tie_word_embeddings and shape.qk_norm
    assert sum(p.numel() for p in model.parameters()) == 24_670_208
    assert zoo.parameter_count(shape, active=True) == 10_514_432
    assert zoo.default_width_scale("small-moe") == 1
    byte_vocab = zoo.build_model("small-moe", vocab_size=256, device="meta")
    assert sum(p.numel() for p in byte_vocab.parameters()) == 20_541_440


def test_full_size_models_match_their_published_totals() -> None:
    published_b = {"olmoe-1b-7b": 6.9, "deepseek-moe-16b": 16.4, "mixtral-8x7b": 46.7, "qwen2-57b-a14b": 57.4}
    for key, total_b in published_b.items():
        full = zoo.full_shape(key)
        two_blocks = zoo.build_model(key, layers=2, width_scale=1, device="meta")  # no memory
        assert sum(p.numel() for p in two_blocks.parameters()) == zoo.parameter_count(two_blocks.shape)
        assert abs(zoo.parameter_count(full) / 1e9 - total_b) / total_b < 0.01, key


def test_same_seed_gives_bit_identical_weights_and_loss() -> None:
    first, second = (zoo.build_model("olmoe", layers=2, seed=7) for _ in range(2))
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(first(INPUTS, TARGETS), second(INPUTS, TARGETS))
    other = zoo.build_model("olmoe", layers=2, seed=8)
    assert not torch.equal(first.blocks[0].attn.q_proj.weight, other.blocks[0].attn.q_proj.weight)
    shallow = zoo.build_model("olmoe", layers=1, seed=7)  # each parameter has its own stream: depth-free
    assert torch.equal(
        shallow.blocks[0].moe.experts[5].up_proj.weight, first.blocks[0].moe.experts[5].up_proj.weight
    )


@pytest.mark.parametrize("key", ["small-moe", "deepseek-moe-16b", "qwen2-57b-a14b"])
def test_checkpointing_on_or_off_gives_bit_identical_loss_and_grads(key: str) -> None:
    model = zoo.build_model(key, layers=2, seed=3)
    assert model.activation_checkpointing
    with_checkpoints = losses_and_grads(model)
    model.activation_checkpointing = False
    without = losses_and_grads(model)
    assert torch.equal(with_checkpoints[0], without[0])
    for name, grad in with_checkpoints[1].items():
        assert torch.equal(grad, without[1][name]), name


def test_auxiliary_balance_loss_is_off_by_default_and_optional() -> None:
    plain = zoo.build_model("olmoe", layers=2)
    loss = plain(INPUTS, TARGETS)
    assert torch.equal(loss.detach(), plain.last_lm_loss) and plain.last_balance_loss > 0
    balanced = zoo.build_model("olmoe", layers=2, aux_loss_coef=0.01)
    total = balanced(INPUTS, TARGETS)
    assert torch.allclose(total.detach(), balanced.last_lm_loss + 0.01 * balanced.last_balance_loss)
    logits = plain(INPUTS)
    assert logits.shape == (*INPUTS.shape, plain.shape.vocab_size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"key": "olmoe", "width_scale": 3},
            r"model 'olmoe-1b-7b': width_scale 3 does not divide hidden_size \(2048\)",
        ),
        (
            {"key": "minicpm", "width_scale": 64},
            r"width_scale 64 leaves head_dim 1 \(from 64\), expected an even",
        ),
        ({"key": "olmoe", "width_scale": 0}, r"width_scale is 0, expected a positive integer"),
        ({"key": "olmoe", "layers": 0}, r"model 'olmoe-1b-7b': layers is 0, expected 1..16"),
        ({"key": "small-moe", "layers": 7}, r"layers is 7, expected 1..6"),
        ({"key": "small-moe", "vocab_size": 0}, r"vocab_size is 0, expected a positive integer"),
        ({"key": "gpt-5"}, r"model 'gpt-5': no such model, expected one of .*olmoe-1b-7b"),
    ],
)
def test_unbuildable_requests_are_one_line_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        zoo.build_model(**kwargs, device="meta")
    assert isinstance(info.value, zoo.ZooError) and "\n" not in str(info.value)
