"""MoE model shapes, read from the shared data files in traces/data/models (one TOML per model, from its
published config, via `traces.load_model_shape`), and the per-layer parameter and FLOP accounting the
analytic trace generator needs."""

from __future__ import annotations

from dataclasses import dataclass

import traces

from .errors import SimInputError

CATEGORIES = traces.CATEGORIES


@dataclass(frozen=True)
class ModelConfig:
    key: str  # file stem, e.g. "olmoe-1b-7b"
    name: str  # display name, e.g. "OLMoE-1B-7B"
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    dense_blocks: int
    dense_intermediate_size: int
    optimizer: str | None
    block_change_rate_prior: dict[str, float]
    prior_source: str
    qk_norm_scope: str = "full"  # "head": one norm of head_dim per q and k (Qwen3)


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter tensor as ZeRO-3 shards it (experts' three matrices fused per expert)."""

    name: str
    layer: int
    category: str
    numel: int
    active_fraction: float  # share of its values each token multiplies (top-k / num_experts for experts)


def list_models() -> list[str]:
    return traces.model_keys()


def load_model_config(name_or_path: str) -> ModelConfig:
    """Load a model by key ("mixtral-8x7b"), alias ("mixtral"), display name ("Mixtral-8x7B") or TOML path."""
    try:
        shape = traces.load_model_shape(name_or_path)
    except traces.ModelShapeError as error:
        raise SimInputError(str(error)) from None
    rates = {c: shape.block_change_rate_prior.get(c) for c in CATEGORIES}
    for category, rate in rates.items():
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate <= 1:
            raise SimInputError(
                f"{shape.path}: field 'block_change_rate_prior.{category}' is {rate!r}, expected a rate in [0, 1]"
            )
    return ModelConfig(
        key=shape.key,
        name=shape.name,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        qk_norm=shape.qk_norm,
        attention_bias=shape.attention_bias,
        num_experts=shape.num_experts,
        experts_per_token=shape.experts_per_token,
        moe_intermediate_size=shape.moe_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        dense_blocks=shape.dense_blocks,
        dense_intermediate_size=shape.dense_intermediate_size,
        optimizer=shape.optimizer,
        block_change_rate_prior={c: float(r) for c, r in rates.items()},
        prior_source=shape.prior_source,
        qk_norm_scope=shape.qk_norm_scope,
    )


def layer_parameters(model: ModelConfig, layer: int, traced_layers: int) -> list[ParameterSpec]:
    """Parameters of layer `layer` in a model cut to `traced_layers` blocks: 0 = embedding,
    1..L = blocks, L+1 = head (final norm + LM head; a tied head is gathered again, so it counts)."""
    h = model.hidden_size
    if layer == 0:
        return [ParameterSpec("embed_tokens.weight", 0, "embedding", model.vocab_size * h, 0.0)]
    if layer == traced_layers + 1:
        return [
            ParameterSpec("final_norm.weight", layer, "norm", h, 1.0),
            ParameterSpec("lm_head.weight", layer, "embedding", model.vocab_size * h, 1.0),
        ]
    prefix = f"blocks.{layer - 1}"
    q_width = model.num_attention_heads * model.head_dim
    kv_width = model.num_key_value_heads * model.head_dim
    attention = h * q_width * 2 + h * kv_width * 2
    if model.attention_bias:
        attention += q_width + 2 * kv_width
    params = [
        ParameterSpec(f"{prefix}.attn", layer, "attention", attention, 1.0),
        ParameterSpec(f"{prefix}.input_norm.weight", layer, "norm", h, 1.0),
        ParameterSpec(f"{prefix}.post_attn_norm.weight", layer, "norm", h, 1.0),
    ]
    if model.qk_norm:
        qk_numel = 2 * model.head_dim if model.qk_norm_scope == "head" else q_width + kv_width
        params.append(ParameterSpec(f"{prefix}.qk_norm", layer, "norm", qk_numel, 1.0))
    if layer <= model.dense_blocks:
        params.append(
            ParameterSpec(f"{prefix}.mlp", layer, "expert_ffn", 3 * h * model.dense_intermediate_size, 1.0)
        )
        return params
    params.append(ParameterSpec(f"{prefix}.router.weight", layer, "router", h * model.num_experts, 1.0))
    expert_fraction = model.experts_per_token / model.num_experts
    expert_numel = 3 * h * model.moe_intermediate_size
    params.extend(
        ParameterSpec(f"{prefix}.experts.{e}", layer, "expert_ffn", expert_numel, expert_fraction)
        for e in range(model.num_experts)
    )
    if model.shared_expert_intermediate_size:
        shared = 3 * h * model.shared_expert_intermediate_size
        params.append(ParameterSpec(f"{prefix}.shared_experts", layer, "expert_ffn", shared, 1.0))
    return params


def forward_flops(model: ModelConfig, params: list[ParameterSpec], seq_len: int, tokens: int) -> float:
    """Forward FLOPs of one layer for `tokens` tokens: 2 per multiply-accumulate over the active
    weights, plus causal attention scores and values (2·2·seq/2·q_width per token)."""
    matmul = sum(2.0 * p.numel * p.active_fraction for p in params if p.category != "norm")
    flops = matmul * tokens
    if any(p.category == "attention" for p in params):
        q_width = model.num_attention_heads * model.head_dim
        flops += 2.0 * seq_len * q_width * tokens  # QK^T and AV, halved for the causal mask
    return flops
