"""`ciera models`: the measurement backend's model zoo (shapes from traces/data/models; no torch needed)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .corpus import CorpusError
from .emulated import EmulationError
from .train import ENGINES, TrainConfig, TrainError
from .zoo import (
    ZooError,
    default_width_scale,
    full_shape,
    is_shipped,
    parameter_count,
    scaled_shape,
    zoo_keys,
)

USER_ERRORS: tuple[type[BaseException], ...] = (ZooError, CorpusError, TrainError, EmulationError)

SCHEMA = "ciera.models/1"


def model_record(key: str) -> dict[str, object]:
    """One zoo model: its published shape and parameter counts, and the same at the default small scale
    (None for a shape file outside the zoo, which has no default scale)."""
    shape = full_shape(key)
    scale = default_width_scale(shape.key) if is_shipped(shape) else None  # a zoo model: its key names it
    small = scaled_shape(shape.key, scale) if scale is not None else None
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
        "small": None
        if small is None
        else {
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
    table.add_column("short names", no_wrap=True)
    for column in ("L", "E/k", "shared", "H/kv", "params", "active", "scale", "small"):
        table.add_column(column, justify="right", no_wrap=True)
    for record in records:
        small = record["small"]
        table.add_row(
            str(record["key"]),
            ", ".join(record["aliases"]) or "-",
            str(record["layers"]),
            f"{record['experts']}/{record['top_k']}",
            str(record["shared_expert_intermediate_size"] or "-"),
            f"{record['attention_heads']}/{record['kv_heads']}",
            _count(record["params"]),
            _count(record["active_params"]),
            f"1/{small['width_scale']}" if small else "-",
            _count(small["params"]) if small else "not in the zoo: --width-scale",
        )
    (Console() if Console().is_terminal else Console(width=150)).print(table)


def write_json(path: Path, document: dict, option: str = "--json") -> None:
    """Atomic: a temporary file in the same directory, renamed over the target."""
    import os
    import tempfile

    if path.is_dir():
        raise TrainError(f"{option} {path}: is a directory, expected a file path")
    if not path.parent.is_dir():
        raise TrainError(f"{option} {path}: directory {path.parent} does not exist")
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(handle, "w") as stream:
        json.dump(document, stream, indent=2)
    os.chmod(temporary, 0o666 & ~_umask())
    os.replace(temporary, path)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def train_command(
    model: Annotated[
        str, typer.Argument(help="Zoo model (key, alias or name; see `ciera models`).")
    ] = "small-moe",
    engine: Annotated[str, typer.Option(help=f"Training engine: {' | '.join(ENGINES)}.")] = "zero3",
    ciera: Annotated[
        str, typer.Option(help="on: parameter all-gathers through CIERA; off: the plain engine.")
    ] = "on",
    world_size: Annotated[
        int, typer.Option(help="Local ranks (spawned); under torchrun the launcher's count is used.")
    ] = 2,
    steps: Annotated[int, typer.Option(help="Training steps, recorded (after the warm steps).")] = 20,
    warm_steps: Annotated[
        int,
        typer.Option(
            help="Steps trained first, neither timed nor recorded (the data order goes on after them)."
        ),
    ] = 0,
    block_size: Annotated[
        int, typer.Option(help="CIERA's block size B (a power of two); also the exponent statistics'.")
    ] = 64,
    entropy: Annotated[
        str,
        typer.Option(help="CIERA's entropy stage for changed exponents: rans, or none (sent uncoded)."),
    ] = "rans",
    device_gather: Annotated[
        bool,
        typer.Option(
            "--device-gather",
            help="CIERA's device path (what CUDA ranks use; on CPU ranks the same code): rANS on the device.",
        ),
    ] = False,
    layers: Annotated[int, typer.Option(help="Decoder blocks (0: the model's full depth).")] = 2,
    width_scale: Annotated[int, typer.Option(help="Width divisor (0: the zoo's default small scale).")] = 0,
    seed: Annotated[int, typer.Option(help="Initial weights and data order.")] = 0,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 1e-4,
    global_batch: Annotated[int, typer.Option(help="Sequences per step, split over the ranks.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    checkpointing: Annotated[
        bool, typer.Option("--checkpointing/--no-checkpointing", help="Activation checkpointing per block.")
    ] = True,
    select: Annotated[
        bool,
        typer.Option(
            "--select/--no-select",
            help="BSC: compress only the shards whose measured benefit pays (ZeRO-3 and FSDP2).",
        ),
    ] = False,
    checkpoint_dir: Annotated[
        Path | None, typer.Option(help="Where --save-at saves and --resume loads.")
    ] = None,
    save_at: Annotated[int | None, typer.Option(help="Save a checkpoint after this many steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the checkpoint.")] = False,
    timeout_s: Annotated[
        float, typer.Option(help="A rank that does not arrive for this long stops the run.")
    ] = 300.0,
    exponent_stats: Annotated[
        bool,
        typer.Option(
            "--exponent-stats", help="Exponent and block change rates per category, every step (slower)."
        ),
    ] = False,
    warmup_steps: Annotated[int, typer.Option(help="Steps the exponent statistics leave out.")] = 30,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write every number printed, and more.")
    ] = None,
) -> None:
    """Train a zoo model with DeepSpeed ZeRO-3 or FSDP2, with or without CIERA, on local ranks (one per GPU
    with NCCL when CUDA is available, else CPU ranks with gloo; CIERA_TRAIN_BACKEND=gloo keeps them on CPU):
    loss and step time per step, bytes the all-gathers sent per step (raw and on the wire)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .train import block_size_problem, launched_rank, train, train_launched, validate

    if ciera not in ("on", "off"):
        raise TrainError(f"--ciera {ciera!r}: expected on or off")
    if steps < 1:
        raise TrainError(f"--steps is {steps}: expected a positive integer")
    if warm_steps < 0:
        raise TrainError(f"--warm-steps is {warm_steps}: expected an integer >= 0")
    problem = block_size_problem(block_size, "--block-size")
    if problem:
        raise TrainError(problem)
    if entropy not in ("rans", "none"):
        raise TrainError(f"--entropy {entropy!r}: expected rans or none")
    if json_path is not None and (json_path.is_dir() or not json_path.parent.is_dir()):
        write_json(json_path, {})  # raises the one-line error before any training
    config = TrainConfig(
        model=model,
        engine=engine,
        ciera=ciera == "on",
        world_size=world_size,
        steps=warm_steps + steps,  # TrainConfig.steps counts the warm steps
        warm_steps=warm_steps,
        block_size=block_size,
        entropy=entropy,
        device_gather=device_gather,
        layers=layers or None,
        width_scale=width_scale or None,
        seed=seed,
        lr=lr,
        global_batch=global_batch,
        seq_len=seq_len,
        activation_checkpointing=checkpointing,
        select=select,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        save_at=save_at,
        resume=resume,
        timeout_s=timeout_s,
        exponent_stats=exponent_stats,
        exponent_warmup_steps=warmup_steps,
    )
    launched = launched_rank()
    if launched is not None:  # torchrun / the deepspeed launcher started this process as one rank
        config = dataclasses.replace(config, world_size=launched[1])
    validate(config)  # every one-line error before the progress bar starts
    from .placement import backend_request

    backend_request(os.environ)  # a bad CIERA_TRAIN_BACKEND too
    if launched is not None and launched[0] != 0:
        train_launched(config)  # the other ranks print nothing; rank 0 reports
        return
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(
            f"{engine}{' + ciera' if config.ciera else ''}", total=config.steps, status="starting"
        )

        def on_step(record: dict) -> None:
            progress.update(
                task,
                completed=record["step"] + 1,
                status=f"loss {record['loss']:.4f}  {record['step_s'] * 1e3:.0f} ms/step",
            )

        def on_warm_step(record: dict) -> None:
            progress.update(
                task, completed=record["step"] + 1, status=f"warm step, loss {record['loss']:.4f}"
            )

        document = (
            train_launched(config, on_step, on_warm_step)
            if launched is not None
            else train(config, on_step, on_warm_step)
        )
    steps_done = document["steps"]
    sent, raw = document["allgather_bytes_sent_per_step"], document["raw_bytes_per_step"]
    table = Table(
        box=box.SIMPLE_HEAD, title=f"ciera train {model}: {engine}, CIERA {ciera}, {world_size} ranks"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("steps", f"{steps_done[0]['step'] if steps_done else 0}..{config.steps - 1}")
    if document["warm_steps"]:
        table.add_row(
            "warm steps before them (trained, not recorded)",
            f"{document['warm_steps']}, loss after them {document['warm_final_loss']:.6f}",
        )
    table.add_row("block size B", str(document["block_size"]))
    if ciera == "on":
        table.add_row(
            "entropy stage for changed exponents",
            f"{config.entropy} (on the device)" if document["config"]["device_gather"] else config.entropy,
        )
    table.add_row("final loss", f"{document['final_loss']:.6f}" if steps_done else "-")
    table.add_row("median step", f"{document['median_step_s'] * 1e3:.1f} ms" if steps_done else "-")
    table.add_row("all-gather bytes sent per step (rank 0)", f"{sent:,.0f}")
    table.add_row("the same gathers raw", f"{raw:,.0f}")
    table.add_row("on the wire / raw", f"{sent / raw:.4f}" if raw else "-")
    table.add_row("final parameters (sha256, every rank alike)", document["parameter_digest"][:16])
    environment = document.get("environment") or {}
    if environment:
        table.add_row("ranks on", f"{environment['device_name']} ({environment['backend']})")
        if environment["device"].startswith("cuda"):
            table.add_row(
                "driver / NCCL / GPUs per node",
                f"{environment['driver']} / {environment['nccl']} / {environment['gpus_per_node']}",
            )
    table.add_row("torch threads per rank", str(document["threads_per_rank"]))
    if document["codec_threads_per_rank"] is not None:
        table.add_row("codec (numba) threads per rank", document["codec_threads_per_rank"])
    Console().print(table)
    if document["exponent_stats"] is not None:
        stats = document["exponent_stats"]
        rates = Table(
            box=box.SIMPLE_HEAD,
            title=f"exponent statistics after {stats['warmup_steps']} warm-up steps (B = {stats['block_size']})",
        )
        for column in ("category", "exp change rate, median", "mean", "block change rate, median", "mean"):
            rates.add_column(column, justify="right" if column != "category" else "left")
        for category, values in stats["after_warmup"].items():
            rates.add_row(
                category,
                f"{values['exp_change_rate_median']:.5f}",
                f"{values['exp_change_rate_mean']:.5f}",
                f"{values['block_change_rate_median']:.4f}",
                f"{values['block_change_rate_mean']:.4f}",
            )
        Console().print(rates)
    if json_path is not None:
        write_json(json_path, document)


def register(app: typer.Typer) -> None:
    from .measure_cli import app as measure_app

    app.command("models")(models_command)
    app.command("train")(train_command)
    app.add_typer(measure_app, name="measure")
