"""The device check: CIERA's codec kernels (TorchBackend) on a GPU, against a device copy and the CPU backend.

    python benchmarks/gpu_check.py --json out/gpu_check.json [--device cuda] [--numel 16777216] [--world 4]

One command, a few minutes on one GPU, JSON out. Without CUDA it runs the same code on the CPU (small
sizes are enough for CI) and says so (``device_is_gpu: false``): its throughputs are then not GPU figures.

Sections (every throughput in shard bytes, 2 per value, per second; best of ``--repeats``; each kernel
timed next to a device-to-device copy of the same shard in the same run, ``*_vs_copy`` = copy time / time):

- ``kernels``: split (exponent plane + sign+mantissa plane), split + detect (the fused encode pass with
  the hash detector and the plane checksum), merge (with its checksum), checksum alone.
- ``device_path``: what the device gather (``ciera_runtime.device_gather.DevicePayloadCodec``) does per
  shard — sender: the payload (planes, block bitmap, changed exponents compacted, checksums); receiver:
  the rebuild from its cache and the checks — at a share q of blocks changed, once per entropy
  configuration: ``rans`` (changed exponents rANS-coded on the device, the default) and ``none`` (uncoded).
- ``bit_exact``: the device's planes, change flags, hash cache, checksums and merged values against
  CpuBackend (numba) on the same inputs, BF16 and FP16, several block sizes, partial changes.
- ``emulated_gather``: W ranks in one process, each with the device gather's state of one shard: every
  rank rebuilds every other rank's part from its payload, bit for bit, over a few steps.
- ``entropy``: the rANS stage on the changed exponents — on the device (``ciera_runtime.device_rans``: CUDA
  kernels on a GPU, the same source compiled for the CPU otherwise) and on the host (numba) — stream size
  against the order-0 entropy and the uncoded size, throughput, and whether the device stream is
  byte-identical to the host's of the same chunk size.
- ``host_syncs``: the device gather's steady path (a shard's payload, its repeat, its decode) and its
  once-per-step encode: aten ops that read the host counted (any device), and with CUDA also run under
  ``torch.cuda.set_sync_debug_mode("error")`` (0 expected in both).

- ``multi_rank``: DeviceGather over a 2-rank process group — NCCL with 2 GPUs, gloo with ``--device cpu``
  (one GPU: not run) — each gather bit for bit against the raw all-gather, host syncs inside the gathers
  (``set_sync_debug_mode("warn")`` on CUDA), bytes over raw, and the raw all-gather's time over the
  compressed one's.

Not here: nvCOMP's ANS (the device stage is the project's own rANS format; docs/runtime.md).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _output import OneLineParser, emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from ciera_runtime import kernels, rans  # noqa: E402
from ciera_runtime.backend import CpuBackend  # noqa: E402
from ciera_runtime.codec import ENTROPY_STAGES  # noqa: E402
from ciera_runtime.device_gather import DevicePayloadCodec, HostReadCounter  # noqa: E402
from ciera_runtime.device_rans import DeviceRans  # noqa: E402
from ciera_runtime.selection import perturb_blocks  # noqa: E402
from ciera_runtime.torch_backend import TorchBackend  # noqa: E402
from measure.placement import Placement, environment_record  # noqa: E402

# (exp_shift, exp_mask, is_fp16) per dtype, as the codec uses them.
LAYOUT = {"bf16": (kernels.BF16_EXP_SHIFT, kernels.BF16_EXP_MASK, False),
          "fp16": (kernels.FP16_EXP_SHIFT, kernels.FP16_EXP_MASK, True)}  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(function, device: torch.device, repeats: int) -> float:
    function()  # warm-up: allocations, kernel selection
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        function()
        synchronize(device)
        samples.append(time.perf_counter() - start_s)
    return min(samples)


def weights_bits(numel: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """N(0, 0.02) weights as 16-bit patterns of ``dtype``."""
    values = torch.from_numpy((rng.standard_normal(numel) * 0.02).astype(np.float32))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    return values.to(torch_dtype).view(torch.int16).numpy().view(np.uint16).copy()


def entropy_bits(data: np.ndarray) -> float:
    if data.size == 0:
        return 0.0
    counts = np.bincount(data, minlength=256)
    probabilities = counts[counts > 0] / data.size
    return float(-(probabilities * np.log2(probabilities)).sum())


class DeviceShard:
    """One sender's (or receiver's) device buffers for a shard: the codec's state, on the device."""

    def __init__(self, numel: int, dtype: str, block_size: int, device: torch.device) -> None:
        self.numel, self.dtype, self.block_size = numel, dtype, block_size
        self.n_blocks = (numel + block_size - 1) // block_size
        _, _, is_fp16 = LAYOUT[dtype]
        self.exp = torch.empty(numel, dtype=torch.uint8, device=device)
        self.sm = torch.empty(kernels.sign_mantissa_bytes(numel, is_fp16), dtype=torch.uint8, device=device)
        self.changed = torch.zeros(self.n_blocks, dtype=torch.bool, device=device)
        self.hash_cache = torch.zeros((self.n_blocks, 2), dtype=torch.int64, device=device)
        self.packed = torch.empty(numel, dtype=torch.uint8, device=device)
        self.merged = torch.empty(numel, dtype=torch.int16, device=device)


def fused_pass(
    backend: TorchBackend, shard: DeviceShard, bits: torch.Tensor, force_all: bool
) -> torch.Tensor:
    """The fused encode pass (exponent plane, hash detection, sign+mantissa plane) into ``shard``'s
    buffers; its plane checksum as a 0-d tensor (no host read)."""
    exp_shift, exp_mask, is_fp16 = LAYOUT[shard.dtype]
    return backend.encode_planes_hash_tensor(
        bits, exp_shift, exp_mask, is_fp16, shard.block_size, shard.hash_cache, shard.exp, shard.changed,
        force_all, shard.sm,
    )  # fmt: skip


def kernels_section(backend, device, numel, block_size, repeats, rng) -> dict:
    bits_host = weights_bits(numel, "bf16", rng)
    bits = torch.from_numpy(bits_host.view(np.int16)).to(device)
    copy_target = torch.empty_like(bits)
    shard_bytes = 2 * numel
    shard = DeviceShard(numel, "bf16", block_size, device)
    exp_shift, exp_mask, _ = LAYOUT["bf16"]
    copy_s = best_s(lambda: copy_target.copy_(bits), device, repeats)

    def split() -> None:
        backend.extract_exponents(bits, exp_shift, exp_mask, shard.exp)
        backend.pack_sign_mantissa(bits, False, shard.sm)

    timings_s = {
        "split": best_s(split, device, repeats),
        "split_detect": best_s(
            lambda: fused_pass(backend, shard, bits, False),
            device,
            repeats,
        ),  # fmt: skip
        "merge": best_s(
            lambda: backend.merge_planes_checked_tensor(shard.exp, shard.sm, exp_shift, False, shard.merged),
            device,
            repeats,
        ),
        "checksum": best_s(lambda: backend.checksum64_tensor(shard.sm), device, repeats),
    }
    result = {"numel": numel, "block_size": block_size, "copy_GBps": round(shard_bytes / copy_s / 1e9, 4)}
    for name, seconds in timings_s.items():
        result[f"{name}_GBps"] = round(shard_bytes / seconds / 1e9, 4)
        result[f"{name}_vs_copy"] = round(copy_s / seconds, 3)
    return result


def device_path_section(device, numel, block_size, q, repeats, rng, entropy: str) -> dict:
    """Per shard, the device gather's sender and receiver work (ciera_runtime.device_gather's
    DevicePayloadCodec with this entropy stage) at a share q of blocks changed, against a copy."""
    base = weights_bits(numel, "bf16", rng)
    versions = [base]
    for _ in range(repeats + 2):
        versions.append(perturb_blocks(versions[-1], q, block_size, "bf16", rng))
    tensors = [torch.from_numpy(v.view(np.int16)).to(device).view(torch.bfloat16) for v in versions]
    codec = DevicePayloadCodec(device, block_size, entropy)
    sender = codec.new_shard(0, 0, numel, torch.bfloat16, rank=0, world_size=2)
    receiver = codec.new_shard(0, 0, numel, torch.bfloat16, rank=1, world_size=2)
    out = torch.empty_like(tensors[0])
    payload, _ = codec.encode(sender, tensors[0], True, 1, 0)
    codec.commit(sender)
    codec.decode(receiver, 0, payload, out, 1)
    copy_target = torch.empty_like(tensors[0])
    encode_samples, decode_samples, copy_samples, exact, sent = [], [], [], True, []
    for generation, version in enumerate(tensors[1:], start=2):
        synchronize(device)
        start_s = time.perf_counter()
        copy_target.copy_(version)
        synchronize(device)
        copy_samples.append(time.perf_counter() - start_s)
        start_s = time.perf_counter()
        payload, size = codec.encode(sender, version, False, generation, 0)
        codec.commit(sender)
        synchronize(device)
        encode_samples.append(time.perf_counter() - start_s)
        start_s = time.perf_counter()
        ok = codec.decode(receiver, 0, payload, out, generation)
        synchronize(device)
        decode_samples.append(time.perf_counter() - start_s)
        exact &= bool(ok) and bool(torch.equal(out.view(torch.int16), version.view(torch.int16)))
        sent.append(int(size))
    copy_s, encode_s, decode_s = min(copy_samples), min(encode_samples), min(decode_samples)
    shard_bytes = 2 * numel
    return {
        "entropy": entropy,
        "numel": numel,
        "block_size": block_size,
        "q": q,
        "exact": exact,
        "encode_GBps": round(shard_bytes / encode_s / 1e9, 2),
        "decode_GBps": round(shard_bytes / decode_s / 1e9, 2),
        "encode_vs_copy": round(copy_s / encode_s, 3),
        "decode_vs_copy": round(copy_s / decode_s, 3),
        "encode_us": round(encode_s * 1e6, 1),
        "decode_us": round(decode_s * 1e6, 1),
        "payload_bytes_over_raw": round(float(np.median(sent)) / shard_bytes, 4),
    }


def bit_exact_section(backend, device, numel, rng) -> dict:
    """The device kernels against CpuBackend on the same inputs: every output and state array."""
    cpu = CpuBackend(threads=1)
    cases, mismatches = 0, []
    for dtype in ("bf16", "fp16"):
        exp_shift, exp_mask, is_fp16 = LAYOUT[dtype]
        for block_size in (16, 64, 512):
            n_blocks = (numel + block_size - 1) // block_size
            sm_bytes = kernels.sign_mantissa_bytes(numel, is_fp16)
            host = {
                "exp": np.empty(numel, np.uint8), "sm": np.empty(sm_bytes, np.uint8),
                "changed": np.zeros(n_blocks, np.uint8), "cache": np.zeros((n_blocks, 2), np.uint64),
                "merged": np.empty(numel, np.uint16),
            }  # fmt: skip
            shard = DeviceShard(numel, dtype, block_size, device)
            bits = weights_bits(numel, dtype, rng)
            for step in range(3):
                if step:
                    bits = perturb_blocks(bits, 0.3, block_size, dtype, rng)
                force_all = step == 0
                cpu_sum = cpu.encode_planes_hash(
                    bits, exp_shift, exp_mask, is_fp16, block_size, host["cache"], host["exp"],
                    host["changed"], force_all, host["sm"],
                )  # fmt: skip
                device_bits = torch.from_numpy(bits.view(np.int16)).to(device)
                device_sum = fused_pass(backend, shard, device_bits, force_all)
                cpu_merged_sum = cpu.merge_planes_checked(
                    host["exp"], host["sm"], exp_shift, is_fp16, host["merged"]
                )
                device_merged_sum = backend.merge_planes_checked_tensor(
                    shard.exp, shard.sm, exp_shift, is_fp16, shard.merged
                )
                checks = {
                    "exponents": np.array_equal(shard.exp.cpu().numpy(), host["exp"]),
                    "sign_mantissa": np.array_equal(shard.sm.cpu().numpy(), host["sm"]),
                    "changed": np.array_equal(shard.changed.cpu().numpy().astype(np.uint8), host["changed"]),
                    "hash_cache": np.array_equal(
                        shard.hash_cache.cpu().numpy().view(np.uint64), host["cache"]
                    ),
                    "checksum": int(device_sum.item()) % (1 << 64) == cpu_sum,
                    "merge_checksum": int(device_merged_sum.item()) % (1 << 64) == cpu_merged_sum,
                    "merged": np.array_equal(shard.merged.cpu().numpy().view(np.uint16), host["merged"]),
                    "merged_is_input": np.array_equal(host["merged"], bits),
                }
                cases += 1
                mismatches += [
                    f"{dtype} B={block_size} step {step}: {name}" for name, ok in checks.items() if not ok
                ]
    return {"cases": cases, "numel": numel, "exact": not mismatches, "mismatches": mismatches}


def emulated_gather_section(device, numel, world, block_size, steps, rng) -> dict:
    """W ranks in one process, each with the device gather's state of one shard: every rank encodes its
    part, every rank rebuilds every other rank's from the payload, bit for bit, over a few steps."""
    codec = DevicePayloadCodec(device, block_size)
    shards = [weights_bits(numel, "bf16", rng) for _ in range(world)]
    states = [codec.new_shard(0, 0, numel, torch.bfloat16, rank, world) for rank in range(world)]
    rebuilt, wrong, sent_bytes, raw_bytes = 0, 0, 0, 0
    for step in range(steps):
        if step:
            shards = [perturb_blocks(bits, 0.3, block_size, "bf16", rng) for bits in shards]
        payloads = []
        for source in range(world):
            values = torch.from_numpy(shards[source].view(np.int16)).to(device).view(torch.bfloat16)
            payload, size = codec.encode(states[source], values, step == 0, step + 1, source)
            codec.commit(states[source])
            payloads.append(payload)
            sent_bytes += int(size)
            raw_bytes += 2 * numel
        for rank in range(world):
            # As DeviceGather does: every other rank's part of the shard in one batch of tensor ops.
            others = [source for source in range(world) if source != rank]
            sources = torch.tensor(others, dtype=torch.int64, device=device)
            parts = torch.stack([payloads[source] for source in others])
            with OpCounter() as counter:
                values, ok = codec.decode_rows(states[rank], sources, parts, step + 1)
            ops_batched = counter.ops
            for row, source in enumerate(others):
                expected = torch.from_numpy(shards[source].view(np.int16))
                rebuilt += 1
                wrong += not (bool(ok[row]) and torch.equal(values[row].cpu(), expected))
    return {
        "world": world,
        "numel_per_rank": numel,
        "steps": steps,
        "shards_rebuilt": rebuilt,
        "wrong": wrong,
        "exact": wrong == 0,
        "payload_bytes_over_raw": round(sent_bytes / raw_bytes, 4),  # changed exponents rANS-coded
        # Device kernels a receiver launches to rebuild all W − 1 sources of one shard (aten ops, counted
        # under a dispatch mode): the batch does not grow with W.
        "aten_ops_per_shard_rebuild": ops_batched,
    }


def entropy_section(device, numel, block_size, q, repeats, rng) -> dict:
    """The rANS stage on the exponents of a share q of changed blocks (what the uncoded path sends): on the
    device (its stream against the host's, byte for byte) and on the host."""
    bits = weights_bits(numel, "bf16", rng)
    exponents = ((bits >> kernels.BF16_EXP_SHIFT) & kernels.BF16_EXP_MASK).astype(np.uint8)
    n_blocks = (numel + block_size - 1) // block_size
    chosen = np.sort(rng.choice(n_blocks, size=max(1, int(q * n_blocks)), replace=False))
    changed = np.concatenate([exponents[b * block_size : (b + 1) * block_size] for b in chosen])
    stream = rans.encode(changed)
    decoded = np.empty_like(changed)
    encode_s = min(_timed(lambda: rans.encode(changed)) for _ in range(repeats))
    decode_s = min(_timed(lambda: rans.decode(stream, decoded)) for _ in range(repeats))
    rans.decode(stream, decoded)
    entropy = entropy_bits(changed)
    stage = DeviceRans(device)
    on_device = torch.from_numpy(changed).to(device)
    count = torch.tensor(changed.size, device=device)
    device_stream, device_length = stage.encode(on_device, count)
    host_stream = rans.encode(changed, chunk_symbols=stage.chunk_symbols)
    identical = device_stream[: int(device_length)].cpu().numpy().tobytes() == host_stream
    rows = device_stream.unsqueeze(0)
    lengths = device_length.reshape(1)
    symbols, _, ok = stage.decode_rows(rows, changed.size, lengths)
    device_exact = bool(ok[0]) and np.array_equal(symbols[0].cpu().numpy(), changed)
    device_encode_s = best_s(lambda: stage.encode(on_device, count), device, repeats)
    device_decode_s = best_s(lambda: stage.decode_rows(rows, changed.size, lengths), device, repeats)
    return {
        "device": {
            "kernels": "CUDA (numba.cuda)" if stage.cuda_kernels else "CPU (numba.njit, the same source)",
            "chunk_symbols": stage.chunk_symbols,
            "stream_bytes": int(device_length),
            "identical_to_host": identical,
            "exact": device_exact,
            "encode_MBps": round(changed.size / device_encode_s / 1e6, 1),
            "decode_MBps": round(changed.size / device_decode_s / 1e6, 1),
        },
        "where": "host (numba rANS, its own chunk choice)",
        "changed_values": int(changed.size),
        "uncoded_bytes": int(changed.size),
        "rans_bytes": int(len(stream)),
        "entropy_bytes": round(entropy * changed.size / 8, 1),
        "rans_over_entropy": round(len(stream) / max(1e-9, entropy * changed.size / 8), 4),
        "exact": bool(np.array_equal(decoded, changed)) and device_exact and identical,
        "encode_MBps": round(changed.size / encode_s / 1e6, 1),
        "decode_MBps": round(changed.size / decode_s / 1e6, 1),
    }


def _timed(function) -> float:
    start_s = time.perf_counter()
    function()
    return time.perf_counter() - start_s


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_syncs_section(device, numel, block_size, rng) -> dict:
    """The device gather's steady path — a shard's slot payload and its decode — checked for host reads:
    counted per aten op on any device (HostReadCounter), and with CUDA also run under
    ``torch.cuda.set_sync_debug_mode("error")``. The encode (once per step, before its one size read) is
    counted too."""
    codec = DevicePayloadCodec(device, block_size)
    sender = codec.new_shard(0, 0, numel, torch.bfloat16, rank=0, world_size=2)
    receiver = codec.new_shard(0, 0, numel, torch.bfloat16, rank=1, world_size=2)
    values = torch.from_numpy(weights_bits(numel, "bf16", rng).view(np.int16)).to(device).view(torch.bfloat16)
    out = torch.empty_like(values)
    payload, _ = codec.encode(sender, values, True, 1, 0)  # warm-up outside the checks
    codec.commit(sender)
    codec.decode(receiver, 0, payload, out, 1)
    steady = {
        "encode": lambda: codec.encode(sender, values, False, 2, 0),
        "repeat_payload": lambda: codec.repeat_payload(sender),
        "decode": lambda: codec.decode(receiver, 0, payload, out, 1),
    }
    counted = {}
    for name, call in steady.items():
        with HostReadCounter() as counter:
            call()
        counted[name] = sum(counter.counts.values())
    result = {"checked": True, "host_reads_per_aten_op": counted, "total": sum(counted.values())}
    if device.type != "cuda":
        result["sync_debug_mode"] = "not run: no CUDA device"
        return result
    syncs = {}
    for name, call in steady.items():
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            syncs[name] = 0
        except RuntimeError as error:
            syncs[name] = 1
            syncs[f"{name}_error"] = str(error).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result["sync_debug_mode"] = syncs
    result["total"] += sum(v for k, v in syncs.items() if not k.endswith("_error"))
    return result


def _multi_rank_worker(
    rank: int, world: int, port: int, device_type: str, numel: int, steps: int, queue
) -> None:
    """One rank of the multi-rank check: DeviceGather over a real process group (NCCL on GPUs, gloo on CPU),
    every gather checked bit for bit against the raw all-gather and timed next to it."""
    import os

    import torch.distributed as dist

    from ciera_runtime.device_gather import DeviceGather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(100 + rank)
        bits = weights_bits(numel, "bf16", rng)
        gather = DeviceGather(device, block_size=64)
        shard = torch.from_numpy(bits.view(np.int16)).to(device).view(torch.bfloat16)
        gather.register({0: shard})
        exact, compressed_s, raw_s, syncs = True, [], [], 0
        for step in range(steps):
            if step:
                bits = perturb_blocks(bits, 0.3, 64, "bf16", rng)
                shard = torch.from_numpy(bits.view(np.int16)).to(device).view(torch.bfloat16)
            gather.prepare({0: shard})
            expected = torch.empty(world * numel, dtype=torch.bfloat16, device=device)
            synchronize(device)
            start_s = time.perf_counter()
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(expected, shard)
            synchronize(device)
            raw_s.append(time.perf_counter() - start_s)
            start_s = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")  # a host sync in the gather warns (counted below)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = gather.all_gather([0], [shard]).wait()[0]
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            syncs += sum("synchroniz" in str(w.message) for w in caught)
            synchronize(device)
            compressed_s.append(time.perf_counter() - start_s)
            exact &= bool(torch.equal(got.view(torch.int16), expected.view(torch.int16)))
            gather.check()
        queue.put(
            {
                "rank": rank,
                "exact": exact,
                "host_syncs_in_gathers": syncs,
                "raw_all_gather_s": min(raw_s),
                "compressed_all_gather_s": min(compressed_s[1:] or compressed_s),
                "bytes_over_raw": gather.stats.bytes_sent / max(gather.stats.raw_bytes_equivalent, 1),
            }
        )
    finally:
        dist.barrier()  # leave together: tearing down gloo pairs the other rank still uses can abort it
        dist.destroy_process_group()


def multi_rank_section(device: torch.device, numel: int, steps: int = 4) -> dict:
    """DeviceGather over a 2-rank process group: NCCL with 2 GPUs, gloo with --device cpu (the same code,
    the collectives on the host); with one GPU not run (NCCL puts one rank on each GPU)."""
    import socket

    import torch.multiprocessing as mp

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"run": False, "why": f"{torch.cuda.device_count()} GPU: a 2-rank NCCL group needs 2"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(
        _multi_rank_worker,
        args=(2, port, device.type, numel, steps, queue),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = sorted((queue.get() for _ in range(2)), key=lambda r: r["rank"])
    return {
        "run": True,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "world": 2,
        "numel_per_rank": numel,
        "steps": steps,
        "exact": all(r["exact"] for r in ranks),
        "host_syncs_in_gathers": sum(r["host_syncs_in_gathers"] for r in ranks),
        "bytes_over_raw": round(ranks[0]["bytes_over_raw"], 4),
        "compressed_vs_raw_time": round(
            max(r["raw_all_gather_s"] for r in ranks) / max(r["compressed_all_gather_s"] for r in ranks), 3
        ),
    }


def environment(device: torch.device) -> dict:
    info = {"device": str(device), "device_is_gpu": device.type == "cuda", "torch": torch.__version__}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # The record every `ciera train` / `ciera measure` run carries (device name, driver, NCCL, ...).
        record = environment_record(Placement(f"cuda:{index}", "nccl", index, "gpu_check --device"))
        info |= {
            "device_name": record["device_name"],
            "device_memory_bytes": int(torch.cuda.get_device_properties(index).total_memory),
            "cuda": record["torch_cuda"],
            "driver": record["driver"],
            "nccl": record["nccl"],
            "gpus": record["gpus_per_node"],
        }
    info["nccl_gather"] = "ciera_runtime.device_gather.DeviceGather (section multi_rank: NCCL with 2 GPUs)"
    return info


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=1 << 24, help="values per shard for the throughputs")
    parser.add_argument(
        "--check-numel", type=int, default=100_003, help="values per shard for the exactness checks"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--q", type=float, default=0.4, help="share of blocks changed per step")
    parser.add_argument("--world", type=int, default=4, help="ranks of the emulated gather")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("numel", "check_numel", "block_size", "world", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(args, name)}: expected a whole number >= 1")
    if not 0.0 <= args.q <= 1.0:
        parser.error(f"--q is {args.q}: expected a share in [0, 1]")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    device = torch.device(args.device)
    backend = TorchBackend(device)
    rng = np.random.default_rng(args.seed)
    start_s = time.perf_counter()
    result = {
        "schema": "ciera.bench.gpu_check/1",
        "environment": environment(device),
        "kernels": kernels_section(backend, device, args.numel, args.block_size, args.repeats, rng),
        "device_path": {
            entropy: device_path_section(
                device, args.numel, args.block_size, args.q, args.repeats, rng, entropy
            )
            for entropy in ENTROPY_STAGES
        },
        "bit_exact": bit_exact_section(backend, device, args.check_numel, rng),
        "emulated_gather": emulated_gather_section(
            device, args.check_numel, args.world, args.block_size, 3, rng
        ),
        "entropy": entropy_section(device, args.numel, args.block_size, args.q, args.repeats, rng),
        "host_syncs": host_syncs_section(device, args.numel, args.block_size, rng),
        "multi_rank": multi_rank_section(device, args.check_numel),
    }
    result["wall_s"] = round(time.perf_counter() - start_s, 1)
    emit_json(result, args.json)
    failed = [name for name in ("bit_exact", "emulated_gather", "entropy") if not result[name]["exact"]]
    failed += [f"device_path {name}" for name, part in result["device_path"].items() if not part["exact"]]
    if result["multi_rank"]["run"] and not result["multi_rank"]["exact"]:
        failed.append("multi_rank")
    if failed:
        print(f"NOT EXACT: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
