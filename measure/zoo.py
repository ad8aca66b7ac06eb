"""The model zoo: shape-faithful decoder-only MoE language models for the measurement backend.

Data: the shapes are traces/data/models/*.toml (the same files the simulator reads), the default width scale
per model is measure/data/zoo.toml. One builder: `build_model(key, layers, width_scale, seed)` returns a
pure-torch model (measure/model.py); torch is imported only there, so listing and counting work without it.

Width scale s (an integer ≥ 1) divides: hidden_size, head_dim, moe_intermediate_size,
shared_expert_intermediate_size, dense_intermediate_size (each must divide exactly, and head_dim / s must
stay even for RoPE), and vocab_size (rounded up, never below 256 so byte-level tokens fit). It keeps: the
head and kv-head counts (so the GQA grouping), the expert count and top-k, the router kind, the shared
expert and its gate, dense_blocks, QK-norm, biases, tied embeddings, RoPE theta and norm eps. Every weight
matrix therefore shrinks by about s², so each category's share of the parameters stays close to the
full model's. Depth L (1..num_layers) is chosen separately; dense blocks stay the first min(dense_blocks, L).

Every parameter has one category, the trace format's (`traces.CATEGORIES`): expert_ffn (routed experts,
shared experts, a dense FFN), attention (q/k/v/o projections and their biases), router (router and the
shared-expert gate), norm (every RMSNorm, QK-norm included), embedding (token embedding and LM head).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import traces
from traces import ModelShape

if TYPE_CHECKING:
    import torch

CATEGORIES = traces.CATEGORIES
BYTE_VOCAB = 256  # byte-level tokens: every scaled vocabulary keeps at least this many rows


class ZooError(ValueError):
    """A zoo model that cannot be built as asked (unknown key, width scale, depth). One line naming the
    model, field and value; the CLI prints it and exits 2."""


def _zoo_file() -> Path:
    return Path(__file__).parent / "data" / "zoo.toml"


def _default_scales() -> dict[str, int]:
    with _zoo_file().open("rb") as handle:
        return dict(tomllib.load(handle)["default_width_scale"])


def zoo_keys() -> list[str]:
    """Every model in the zoo (every shipped shape), sorted by key."""
    return traces.model_keys()


def full_shape(key: str) -> ModelShape:
    """The published shape of a zoo model, by key, alias or display name (any case)."""
    try:
        return traces.load_model_shape(key)
    except traces.ModelShapeError as error:
        raise ZooError(str(error)) from None


def is_shipped(shape: ModelShape) -> bool:
    """Whether `shape` is a zoo model's own file (a copy elsewhere with the same name may differ)."""
    try:
        return traces.load_model_shape(shape.key).path.resolve() == Path(shape.path).resolve()
    except traces.ModelShapeError:
        return False


def model_reference(key_or_path: str) -> str:
    """How a spawned rank names the model: a zoo model's key, or the absolute path of a shape file outside
    the zoo (its key alone resolves to nothing, and a relative path not from a rank's directory)."""
    shape = full_shape(key_or_path)
    return shape.key if is_shipped(shape) else str(Path(shape.path).resolve())


def default_width_scale(key_or_path: str) -> int:
    return _default_scale(full_shape(key_or_path))


def _default_scale(shape: ModelShape) -> int:
    shipped = is_shipped(shape)
    scale = _default_scales().get(shape.key) if shipped else None
    if scale is None:
        where = "" if shipped else f" ({shape.path}, not a zoo model)"
        raise ZooError(
            f"model '{shape.key}'{where}: no default width scale; pass --width-scale (1: full width)"
        )
    return int(scale)


def scaled_shape(key: str, width_scale: int | None = None, layers: int | None = None) -> ModelShape:
    """The shape `build_model` builds: `width_scale` (default: the zoo's) applied, cut to `layers` blocks."""
    shape = full_shape(key)
    scale = _default_scale(shape) if width_scale is None else width_scale
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
        raise ZooError(f"model '{shape.key}': width_scale is {scale!r}, expected a positive integer")
    depth = shape.num_layers if layers is None else layers
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= shape.num_layers:
        raise ZooError(f"model '{shape.key}': layers is {depth!r}, expected 1..{shape.num_layers}")
    divided = {}
    for name in (
        "hidden_size",
        "head_dim",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "dense_intermediate_size",
    ):
        value = getattr(shape, name)
        if value % scale:
            raise ZooError(
                f"model '{shape.key}': width_scale {scale} does not divide {name} ({value}), "
                "expected a divisor of every width"
            )
        divided[name] = value // scale
    if divided["head_dim"] % 2:
        raise ZooError(
            f"model '{shape.key}': width_scale {scale} leaves head_dim {divided['head_dim']} "
            f"(from {shape.head_dim}), expected an even head_dim for RoPE"
        )
    vocab = shape.vocab_size if scale == 1 else max(math.ceil(shape.vocab_size / scale), BYTE_VOCAB)
    return dataclasses.replace(
        shape,
        num_layers=depth,
        vocab_size=vocab,
        dense_blocks=min(shape.dense_blocks, depth),
        **divided,
    )


def parameter_count(shape: ModelShape, active: bool = False) -> int:
    """Parameters of a model of this shape as `build_model` builds it (tied embeddings counted once).
    `active`: the routed experts count top-k / num_experts of their parameters (what one token uses)."""
    h, q, kv, d = shape.hidden_size, shape.q_width, shape.kv_width, shape.head_dim
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if shape.attention_bias else 0)
    norms = 2 * h + ((2 * d if shape.qk_norm_scope == "head" else q + kv) if shape.qk_norm else 0)
    dense = 3 * h * shape.dense_intermediate_size
    experts = shape.num_experts * 3 * h * shape.moe_intermediate_size
    if active:
        experts = experts * shape.experts_per_token // shape.num_experts
    moe = h * shape.num_experts + experts
    if shape.shared_expert_intermediate_size:
        moe += 3 * h * shape.shared_expert_intermediate_size + (h if shape.shared_expert_gate else 0)
    blocks = shape.num_layers * (attention + norms) + shape.dense_blocks * dense
    blocks += (shape.num_layers - shape.dense_blocks) * moe
    embedding = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return blocks + embedding + h


def category_of(name: str) -> str:
    """The trace category of a zoo model's parameter, from its name (`model.named_parameters()`)."""
    parts = name.split(".")
    if parts[0] in ("embed_tokens", "lm_head"):
        return "embedding"
    if any(part.endswith("norm") for part in parts):
        return "norm"
    if "router" in parts or "shared_expert_gate" in parts:
        return "router"
    if "attn" in parts:
        return "attention"
    if {"experts", "shared_expert", "mlp"} & set(parts):
        return "expert_ffn"
    raise ZooError(f"parameter '{name}': no category, expected a zoo model's parameter name")


def parameter_categories(model: Any) -> dict[str, str]:
    """name → category for every parameter of a zoo model (a tied LM head is the embedding's parameter)."""
    return {name: category_of(name) for name, _ in model.named_parameters()}


def build_model(
    key: str,
    layers: int | None = None,
    width_scale: int | None = None,
    seed: int = 0,
    *,
    activation_checkpointing: bool = True,
    aux_loss_coef: float = 0.0,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A zoo model (`measure.model.ZooModel`) of `layers` blocks (default: all) at `width_scale` (default:
    the zoo's small scale, measure/data/zoo.toml; 1 = full width), its weights drawn from `seed` (each
    parameter from its own stream keyed by seed and name, so the first blocks are the same at every depth).

    `model(input_ids)` → logits; `model(input_ids, targets)` → next-token cross-entropy (plus
    `aux_loss_coef` × the Switch load-balancing loss, off by default). Each block runs under
    `torch.utils.checkpoint` (use_reentrant=False) while `model.activation_checkpointing` is true (default).
    `vocab_size` overrides the shape's (e.g. 256 for a pure byte-level vocabulary). `device="meta"` builds
    without memory (for counting)."""
    shape = scaled_shape(key, width_scale, layers)
    if vocab_size is not None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ZooError(f"model '{shape.key}': vocab_size is {vocab_size!r}, expected a positive integer")
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if not isinstance(aux_loss_coef, int | float) or isinstance(aux_loss_coef, bool) or aux_loss_coef < 0:
        raise ZooError(f"model '{shape.key}': aux_loss_coef is {aux_loss_coef!r}, expected a number ≥ 0")
    from .model import ZooModel

    return ZooModel(
        shape,
        seed=seed,
        activation_checkpointing=activation_checkpointing,
        aux_loss_coef=float(aux_loss_coef),
        dtype=dtype,
        device=device,
    )
