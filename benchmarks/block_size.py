"""Block size B against exponent churn, early and mid-training: the real codec over real weights.

    python benchmarks/block_size.py --json out/block_size.json [--engine fsdp|zero3] [--warm-steps 500]
        [--detector exact|hash] [--window 10] [--block-sizes 64,128,256,512] [--layers 2] [--seq-len 64]
        [--global-batch 4] [--timeout-s 300]

Training: ``small-moe`` as ``benchmarks/train_step.py`` trains it (2 blocks, 64 tokens, 4 sequences per
step, 2 gloo ranks on loopback, one torch thread per rank, TrainConfig's default learning rate), the plain
engine (``--engine``; CIERA does not change the weights: it trains bit-identically), through the real
``measure.train.train`` (every step a warm step there: nothing recorded but the loss). Rank 0 saves the
weights the engine computes with (BF16 full parameters, TrainConfig.parameter_snapshot_steps) after the
completed steps of two windows: **early**, steps 0..W (``--window`` W), and **late**, steps N..N+W
(``--warm-steps`` N ≥ W), in a temporary directory removed at exit.

Codec: for every B of ``--block-sizes`` and each window, every parameter is split into W = 2 contiguous
rank shards by ZeRO-3's rule (the flattened values, ceil(numel / 2) to rank 0, the rest to rank 1; FSDP2
cuts dim 0, which moves the boundary by less than a row), and each shard goes through its own
``ciera_runtime.codec.ShardEncoder`` and ``ShardDecoder`` (CodecConfig(block_size=B, detector=--detector):
``exact``, the default, sends changed blocks as exponent deltas; ``hash`` as exponents), one
gather per snapshot in order, exactly as a rank's shard is encoded from gather to gather. The window's
first snapshot primes them (a full payload, not counted); each of the W later snapshots is one counted
gather, its decode checked bit for bit against the snapshot. Per window and B: the share of blocks whose
exponents changed, r = payload bytes / raw bytes (raw: 2 bytes per value), and encode and decode time
per MB of raw shard (numba's threads, all cores), next to a copy of the same shards timed in the same loop
(the baseline). ``r_floor`` = 0.5 + 1/(16B) is r with no block changed (DESIGN.md's bound at q = 0);
per category (experts, attention, router, norms, embedding) the same figures. Payloads are counted as the
codec makes them: a tiny shard (a norm's 32..128 values) comes out larger than raw by its header, which the
runtime would send raw instead — under 0.02 % of the bytes here. The stdout summary ends with the B of the
smallest r in each window.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

MODEL = "small-moe"
ENGINES = ("fsdp", "zero3")
RANKS = 2


class BadArgument(Exception):
    """One line, exit 2."""


def _block_sizes(text: str) -> tuple[int, ...]:
    from measure.train import block_size_problem

    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BadArgument(
            f"--block-sizes {text!r}: expected comma-separated powers of two, e.g. 64,128,256"
        ) from None
    if not sizes or len(set(sizes)) != len(sizes):
        raise BadArgument(f"--block-sizes {text!r}: expected distinct block sizes, at least one")
    for size in sizes:
        problem = block_size_problem(size, "--block-sizes: a block size")
        if problem:
            raise BadArgument(problem)
    return sizes


def _check_args(args) -> None:
    for name, low in (("window", 1), ("layers", 1), ("seq_len", 1), ("timeout_s", 10)):
        if getattr(args, name) < low:
            raise BadArgument(f"--{name.replace('_', '-')} is {getattr(args, name)}: expected at least {low}")
    if args.warm_steps < args.window:
        raise BadArgument(
            f"--warm-steps is {args.warm_steps}: expected at least --window ({args.window}), "
            "so that the late window starts after the early one ends"
        )
    if args.global_batch < RANKS or args.global_batch % RANKS:
        raise BadArgument(f"--global-batch is {args.global_batch}: expected an even number (2 ranks)")
    args.block_sizes = _block_sizes(args.block_sizes)
    from measure.zoo import scaled_shape

    try:
        scaled_shape(MODEL, None, args.layers)
    except Exception as error:  # noqa: BLE001 — the zoo's errors are one line
        raise BadArgument(str(error).splitlines()[0]) from None


def _windows(args) -> dict[str, list[int]]:
    """Completed steps whose weights are snapshotted, per window."""
    return {
        "early": list(range(0, args.window + 1)),
        "late": list(range(args.warm_steps, args.warm_steps + args.window + 1)),
    }


# --------------------------------------------------------------------------------------------- training


def _train(args, snapshot_dir: Path) -> dict:
    """Train on 2 spawned loopback ranks, snapshots in ``snapshot_dir``; the losses at the windows' ends."""
    from measure.train import TrainConfig, train

    windows = _windows(args)
    steps = windows["late"][-1]
    config = TrainConfig(
        model=MODEL,
        engine=args.engine,
        ciera=False,
        world_size=RANKS,
        steps=steps,
        warm_steps=steps,  # nothing recorded: the snapshots and the losses are what is kept
        layers=args.layers,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        threads_per_rank=1,
        timeout_s=float(args.timeout_s),
        snapshot_dir=str(snapshot_dir),
        parameter_snapshot_steps=tuple(sorted({s for window in windows.values() for s in window})),
    )
    losses: dict[int, float] = {}
    start_s = time.perf_counter()

    def on_warm_step(record: dict) -> None:
        losses[record["step"]] = record["loss"]
        if record["step"] % 50 == 49:
            print(f"block_size: trained {record['step'] + 1}/{steps} steps", file=sys.stderr, flush=True)

    document = train(config, on_warm_step=on_warm_step)
    return {
        "config": {key: value for key, value in document["config"].items() if key != "snapshot_dir"},
        "steps": steps,
        "train_s": round(time.perf_counter() - start_s, 1),
        # per window, the loss of each step between its snapshots (step k goes from snapshot k to k + 1)
        "losses": {name: [losses.get(k) for k in window[:-1]] for name, window in windows.items()},
        "parameter_digest": document["parameter_digest"],
    }


# --------------------------------------------------------------------------------------------- codec


def _shards(numel: int) -> list[tuple[int, int]]:
    """(start, stop) of each rank's contiguous shard: ZeRO-3's ceil(numel / W) values per rank."""
    size = -(-numel // RANKS)
    return [(min(rank * size, numel), min((rank + 1) * size, numel)) for rank in range(RANKS)]


def _window_figures(snapshots: list[Path], block_sizes, categories: dict[str, str], detector: str) -> dict:
    """Encode and decode every rank shard of every parameter over the window's snapshots, per B."""
    import numpy as np
    import torch

    from ciera_runtime import CodecConfig, ShardDecoder, ShardEncoder

    zero = {"blocks": 0, "changed_blocks": 0, "raw_bytes": 0, "payload_bytes": 0}
    totals = {b: dict(zero, encode_s=0.0, decode_s=0.0, copy_s=0.0) for b in block_sizes}
    by_category = {b: {} for b in block_sizes}
    coders: dict = {}  # (B, parameter, rank) -> (encoder, decoder, send buffer, output)
    lossless = True
    for index, path in enumerate(snapshots):
        weights = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in weights.items():
            bits = tensor.reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)
            category = categories.get(name, "other")
            for rank, (start, stop) in enumerate(_shards(bits.size)):
                if stop == start:
                    continue
                shard = bits[start:stop]
                for block_size in block_sizes:
                    key = (block_size, name, rank)
                    if index == 0:  # the window's first gather: a full payload, not counted
                        config = CodecConfig(block_size=block_size, detector=detector)
                        shard_id = len(coders)
                        encoder = ShardEncoder(shard_id, shard.size, "bf16", rank, config)
                        decoder = ShardDecoder(shard_id, rank, shard.size, "bf16", config)
                        buffer = np.empty(encoder.layout.max_payload_bytes, dtype=np.uint8)
                        out = np.empty(shard.size, dtype=np.uint16)
                        coders[key] = (encoder, decoder, buffer, out)
                        decoder.decode(encoder.encode(shard, out=buffer), out=out)
                        continue
                    encoder, decoder, buffer, out = coders[key]
                    start_s = time.perf_counter()
                    np.copyto(out, shard)  # the baseline: the same bytes copied
                    copy_s = time.perf_counter() - start_s
                    start_s = time.perf_counter()
                    payload = encoder.encode(shard, out=buffer)
                    encode_s = time.perf_counter() - start_s
                    out.fill(0)
                    start_s = time.perf_counter()
                    decoder.decode(payload, out=out)
                    decode_s = time.perf_counter() - start_s
                    lossless = lossless and bool(np.array_equal(out, shard))
                    figures = {
                        "blocks": encoder.layout.n_blocks,
                        "changed_blocks": encoder.last_changed_blocks,
                        "raw_bytes": 2 * shard.size,
                        "payload_bytes": int(payload.size),
                    }
                    total = totals[block_size]
                    entry = by_category[block_size].setdefault(category, dict(zero))
                    for field, value in figures.items():
                        total[field] += value
                        entry[field] += value
                    total["encode_s"] += encode_s
                    total["decode_s"] += decode_s
                    total["copy_s"] += copy_s
        del weights
    result = {"gathers_counted": len(snapshots) - 1, "lossless": lossless, "by_block_size": {}}
    for block_size in block_sizes:
        total = totals[block_size]
        mb = total["raw_bytes"] / 1e6
        result["by_block_size"][str(block_size)] = {
            "changed_block_share": round(total["changed_blocks"] / total["blocks"], 5),
            "r": round(total["payload_bytes"] / total["raw_bytes"], 5),
            "r_floor": round(0.5 + 1 / (16 * block_size), 5),
            "encode_ms_per_MB": round(1e3 * total["encode_s"] / mb, 4),
            "decode_ms_per_MB": round(1e3 * total["decode_s"] / mb, 4),
            "copy_ms_per_MB": round(1e3 * total["copy_s"] / mb, 4),
            "raw_bytes": total["raw_bytes"],
            "payload_bytes": total["payload_bytes"],
            "by_category": {
                category: {
                    "changed_block_share": round(entry["changed_blocks"] / entry["blocks"], 5),
                    "r": round(entry["payload_bytes"] / entry["raw_bytes"], 5),
                    "raw_bytes": entry["raw_bytes"],
                }
                for category, entry in sorted(by_category[block_size].items())
            },
        }
    return result


def _categories(args) -> dict[str, str]:
    from measure.zoo import build_model, parameter_categories

    return parameter_categories(build_model(MODEL, args.layers, None, 0, activation_checkpointing=True))


# --------------------------------------------------------------------------------------------- main


def _main(args) -> int:
    try:
        _check_args(args)
    except BadArgument as reason:
        print(f"block_size: error: {reason}")
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO_ROOT / ".torch_extensions"))
    import numba

    from measure.train import TrainError

    start_s = time.perf_counter()
    load_before = os.getloadavg()
    windows = _windows(args)
    with tempfile.TemporaryDirectory(prefix="ciera-block-size-") as scratch:
        try:
            training = _train(args, Path(scratch))
        except TrainError as error:
            print(f"block_size: FAILED: {' '.join(str(error).split())}", file=sys.stderr)
            return 1
        categories = _categories(args)
        figures = {}
        for name, steps in windows.items():
            snapshots = [Path(scratch) / f"params-{step}.pt" for step in steps]
            codec_start_s = time.perf_counter()
            figures[name] = {
                "snapshot_steps": [steps[0], steps[-1]],
                **_window_figures(snapshots, args.block_sizes, categories, args.detector),
                "codec_s": round(time.perf_counter() - codec_start_s, 1),
            }
    best = {
        name: min(args.block_sizes, key=lambda b, w=window: (w["by_block_size"][str(b)]["r"], b))
        for name, window in figures.items()
    }
    result = {
        "schema": "ciera.bench.block_size/1",
        "model": MODEL,
        "config": {
            "engine": args.engine,
            "layers": args.layers,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "world_size": RANKS,
            "warm_steps": args.warm_steps,
            "window": args.window,
            "block_sizes": list(args.block_sizes),
            "shards": "ZeRO-3's rule: each parameter flattened, ceil(numel / 2) values to rank 0, the rest to rank 1",
            "detector": args.detector,
            "numba_threads": numba.get_num_threads(),
        },
        "training": training,
        "windows": figures,
        "smallest_r_block_size": best,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - start_s, 1),
    }
    emit_json(result, args.json)
    for name, window in figures.items():
        first, last = window["snapshot_steps"]
        print(f"{name} window, steps {first}..{last} ({window['gathers_counted']} gathers per shard):")
        for block_size in args.block_sizes:
            f = window["by_block_size"][str(block_size)]
            print(
                f"  B = {block_size:>4}: changed blocks {100 * f['changed_block_share']:5.1f} %, "
                f"r = {f['r']:.4f} (floor {f['r_floor']:.4f}), encode {f['encode_ms_per_MB']:.3f} ms/MB, "
                f"decode {f['decode_ms_per_MB']:.3f} ms/MB (copy {f['copy_ms_per_MB']:.3f})"
            )
    print("smallest r: " + ", ".join(f"{name} B = {b}" for name, b in best.items()))
    if not all(window["lossless"] for window in figures.values()):
        print("block_size: FAILED: a decoded shard differs from its snapshot", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--engine", choices=ENGINES, default="fsdp", help="the plain engine that trains")
    parser.add_argument(
        "--warm-steps", type=int, default=500, help="the late window starts after this many steps"
    )
    parser.add_argument(
        "--detector", choices=("exact", "hash"), default="exact", help="CodecConfig.detector (exact: deltas)"
    )
    parser.add_argument("--window", type=int, default=10, help="gathers counted per window (snapshots - 1)")
    parser.add_argument("--block-sizes", default="64,128,256,512")
    parser.add_argument("--layers", type=int, default=2, help="small-moe blocks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step, both ranks")
    parser.add_argument("--timeout-s", type=int, default=300, help="a rank that shows no progress this long")
    sys.exit(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
