"""MoE model shapes, read from the shared data files in traces/data/models (one TOML per model, from its
published config, via `traces.load_model_shape`), and the per-layer parameter and FLOP accounting the
analytic trace generator needs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import traces

from .errors import SimInputError

CATEGORIES = traces.CATEGORIES


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


def load_model_config(name_or_path: str) -> traces.ModelShape:
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
    # The shape as the data file gives it; the priors checked and complete (the generator reads every one).
    return replace(shape, block_change_rate_prior={c: float(r) for c, r in rates.items()})


def layer_parameters(model: traces.ModelShape, layer: int, traced_layers: int) -> list[ParameterSpec]:
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


def forward_flops(model: traces.ModelShape, params: list[ParameterSpec], seq_len: int, tokens: int) -> float:
    """Forward FLOPs of one layer for `tokens` tokens: 2 per multiply-accumulate over the active
    weights, plus causal attention scores and values (2·2·seq/2·q_width per token)."""
    matmul = sum(2.0 * p.numel * p.active_fraction for p in params if p.category != "norm")
    flops = matmul * tokens
    if any(p.category == "attention" for p in params):
        q_width = model.num_attention_heads * model.head_dim
        flops += 2.0 * seq_len * q_width * tokens  # QK^T and AV, halved for the causal mask
    return flops
