"""Model shapes: one TOML per model in traces/data/models, copied from its published config.

Both halves of the data flow read them: `measure` builds shape-faithful models from them and `sim` does its
parameter and FLOP accounting with them, so they live here, next to the bundle format they describe.

Public surface: `ModelShape`, `load_model_shape(key, alias, display name or .toml path)`, `model_keys()`,
`models_dir()`, `ModelShapeError`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .schema import CATEGORIES


class ModelShapeError(ValueError):
    """A model key that names no shape file, or a shape file with a bad field. The message is one line
    naming the file, field and value, so a CLI can print it as-is and exit 2."""


REQUIRED_INT = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "dense_blocks",
    "dense_intermediate_size",
)
_CHOICES = {"qk_norm_scope": ("full", "head"), "router_score": ("softmax", "sigmoid")}


@dataclass(frozen=True)
class ModelShape:
    key: str  # file stem, e.g. "olmoe-1b-7b"
    name: str  # display name, e.g. "OLMoE-1B-7B"
    aliases: tuple[str, ...]  # short names, e.g. ("olmoe",)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool
    qk_norm_scope: str  # "full": one norm over all heads' features; "head": one per head (Qwen3)
    attention_bias: bool  # bias on q, k and v (not on the output projection)
    num_experts: int
    experts_per_token: int
    router_score: str  # "softmax" over all experts, then top-k; "sigmoid" of the top-k logits
    norm_topk_prob: bool  # renormalise the kept top-k weights to sum to 1
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert; several shared experts count as one wide one
    shared_expert_gate: bool  # sigmoid(hidden -> 1) scaling the shared expert's output (Qwen2-MoE)
    dense_blocks: int  # leading blocks with a dense FFN instead of experts
    dense_intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    optimizer: str | None
    # Per-category median block change rates at B = 512 (read by sim's analytic generator); may be empty.
    block_change_rate_prior: dict[str, float] = field(default_factory=dict, hash=False)
    prior_source: str = ""
    path: Path | None = field(default=None, compare=False)

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim


def models_dir() -> Path:
    return Path(__file__).parent / "data" / "models"


def model_keys() -> list[str]:
    """Every shipped model's key (file stem), sorted."""
    return sorted(p.stem for p in models_dir().glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ModelShapeError(f"{path}: not valid TOML: {error}") from None


def _lookup() -> dict[str, Path]:
    """Lower-cased key, alias and display name → shipped file."""
    index: dict[str, Path] = {}
    for key in model_keys():
        path = models_dir() / f"{key}.toml"
        raw = _read_toml(path)
        names = [key, str(raw.get("name", key)), *[str(a) for a in raw.get("aliases", [])]]
        for name in names:
            other = index.setdefault(name.lower(), path)
            if other != path:
                raise ModelShapeError(f"{path}: name or alias '{name}' is also used by {other.name}")
    return index


def known_models_text() -> str:
    """'key (alias, ...), ...' for error messages."""
    parts = []
    for key in model_keys():
        aliases = _read_toml(models_dir() / f"{key}.toml").get("aliases", [])
        parts.append(f"{key} ({', '.join(aliases)})" if aliases else key)
    return ", ".join(parts)


def load_model_shape(key_or_path: str) -> ModelShape:
    """A shipped model by key ("mixtral-8x7b"), alias ("mixtral") or display name ("Mixtral-8x7B"), any
    case; or any TOML file with the same fields."""
    path = Path(key_or_path)
    if path.suffix != ".toml":
        found = _lookup().get(key_or_path.lower())
        if found is None:
            raise ModelShapeError(
                f"model '{key_or_path}': no such model, expected one of {known_models_text()} or a .toml path"
            )
        path = found
    if not path.is_file():
        raise ModelShapeError(f"model '{key_or_path}': no such model file")
    return _parse(path, _read_toml(path))


_BOOLS = (
    "tie_word_embeddings",
    "qk_norm",
    "attention_bias",
    "norm_topk_prob",
    "shared_expert_gate",
)
_OPTIONAL = ("name", "aliases", "optimizer", "rope_theta", "rms_norm_eps", "block_change_rate_prior")
_FIELDS = (*REQUIRED_INT, *_BOOLS, *_CHOICES, *_OPTIONAL)


def _parse(path: Path, raw: dict) -> ModelShape:
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:  # a misspelt optional field would silently keep its default
        raise ModelShapeError(f"{path}: unknown field '{unknown[0]}', expected one of {', '.join(_FIELDS)}")
    for name in REQUIRED_INT:
        if name not in raw:
            raise ModelShapeError(f"{path}: field '{name}' missing, expected a non-negative integer")
        value = raw.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ModelShapeError(f"{path}: field '{name}' is {value!r}, expected a non-negative integer")
    for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if raw[name] == 0:
            raise ModelShapeError(f"{path}: field '{name}' is 0, expected a positive integer")
    if raw["num_attention_heads"] % raw["num_key_value_heads"]:
        raise ModelShapeError(
            f"{path}: field 'num_key_value_heads' is {raw['num_key_value_heads']}, expected a divisor of "
            f"num_attention_heads ({raw['num_attention_heads']})"
        )
    if raw["dense_blocks"] < raw["num_layers"] and not 1 <= raw["experts_per_token"] <= raw["num_experts"]:
        raise ModelShapeError(
            f"{path}: field 'experts_per_token' is {raw['experts_per_token']}, expected 1..num_experts "
            f"({raw['num_experts']})"
        )
    for name in _BOOLS:  # bool("false") is True: a quoted boolean would flip the field
        if not isinstance(raw.get(name, False), bool):
            raise ModelShapeError(f"{path}: field '{name}' is {raw[name]!r}, expected true or false")
    for name in ("name", "optimizer"):
        if not isinstance(raw.get(name, ""), str):
            raise ModelShapeError(f"{path}: field '{name}' is {raw[name]!r}, expected a string")
    for name, choices in _CHOICES.items():
        value = raw.get(name, choices[0])
        if value not in choices:
            raise ModelShapeError(
                f"{path}: field '{name}' is {value!r}, expected one of {', '.join(choices)}"
            )
    for name, default in (("rope_theta", 10000.0), ("rms_norm_eps", 1e-6)):
        value = raw.get(name, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ModelShapeError(f"{path}: field '{name}' is {value!r}, expected a positive number")
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ModelShapeError(f"{path}: field 'aliases' is {aliases!r}, expected a list of names")
    prior = raw.get("block_change_rate_prior", {})
    if not isinstance(prior, dict):
        raise ModelShapeError(f"{path}: field 'block_change_rate_prior' is {prior!r}, expected a table")
    rates = {}
    for category, rate in prior.items():
        if category == "source":
            continue
        if category not in CATEGORIES:
            raise ModelShapeError(
                f"{path}: field 'block_change_rate_prior.{category}' is not a category, expected one of "
                f"{', '.join(CATEGORIES)}"
            )
        rates[category] = rate  # ranges are checked by the reader that needs them (sim)
    return ModelShape(
        key=path.stem,
        name=str(raw.get("name", path.stem)),
        aliases=tuple(aliases),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=bool(raw.get("qk_norm", False)),
        qk_norm_scope=str(raw.get("qk_norm_scope", "full")),
        attention_bias=bool(raw.get("attention_bias", False)),
        router_score=str(raw.get("router_score", "softmax")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_gate=bool(raw.get("shared_expert_gate", False)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        optimizer=raw.get("optimizer"),
        block_change_rate_prior=rates,
        prior_source=str(prior.get("source", "")),
        path=path,
        **{name: int(raw[name]) for name in REQUIRED_INT},
    )
