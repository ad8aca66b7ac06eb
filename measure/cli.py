"""`ciera models`: the measurement backend's model zoo (shapes from traces/data/models; no torch needed)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .corpus import CorpusError
from .zoo import ZooError, default_width_scale, full_shape, parameter_count, scaled_shape, zoo_keys

USER_ERRORS: tuple[type[BaseException], ...] = (ZooError, CorpusError)

SCHEMA = "ciera.models/1"


def model_record(key: str) -> dict[str, object]:
    """One zoo model: its published shape and parameter counts, and the same at the default small scale."""
    shape = full_shape(key)
    scale = default_width_scale(shape.key)
    small = scaled_shape(shape.key, scale)
    return {
        "key": shape.key,
        "name": shape.name,
        "aliases": list(shape.aliases),
        "layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "attention_heads": shape.num_attention_heads,
        "kv_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "experts": shape.num_experts,
        "top_k": shape.experts_per_token,
        "router": shape.router_score,
        "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
        "dense_blocks": shape.dense_blocks,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "qk_norm": shape.qk_norm_scope if shape.qk_norm else None,
        "params": parameter_count(shape),
        "active_params": parameter_count(shape, active=True),
        "small": {
            "width_scale": scale,
            "hidden_size": small.hidden_size,
            "head_dim": small.head_dim,
            "moe_intermediate_size": small.moe_intermediate_size,
            "vocab_size": small.vocab_size,
            "params": parameter_count(small),
            "params_at_2_layers": parameter_count(
                scaled_shape(shape.key, scale, layers=min(2, shape.num_layers))
            ),
        },
    }


def _count(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def models_command(
    model: Annotated[
        str | None, typer.Argument(help="Show one model (key, alias or name); default: every model.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the zoo as JSON (ciera.models/1).")] = False,
) -> None:
    """List the model zoo: published shape and size, and the default small scale the measurements build."""
    records = [model_record(model)] if model is not None else [model_record(key) for key in zoo_keys()]
    if json_out:
        print(json.dumps({"schema": SCHEMA, "models": records}, indent=2))
        return
    table = Table(
        title="model zoo: published size, and the default small scale",
        caption="E/k: experts/top-k, H/kv: heads/kv-heads, active: per token; shapes in "
        "traces/data/models, small scale in measure/data/zoo.toml",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("key", no_wrap=True)
    for column in ("L", "E/k", "shared", "H/kv", "params", "active", "scale", "small"):
        table.add_column(column, justify="right", no_wrap=True)
    for record in records:
        small = record["small"]
        table.add_row(
            str(record["key"]),
            str(record["layers"]),
            f"{record['experts']}/{record['top_k']}",
            str(record["shared_expert_intermediate_size"] or "-"),
            f"{record['attention_heads']}/{record['kv_heads']}",
            _count(record["params"]),
            _count(record["active_params"]),
            f"1/{small['width_scale']}",
            _count(small["params"]),
        )
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("models")(models_command)
