"""Codec throughput and payload size against copy baselines measured in the same run.

    python benchmarks/codec.py --json out/codec.json [--numel 8388608] [--repeats 5] [--full-path-q 0.01]

Weights: BF16 N(0, 0.02). Perturbation at rate q: a share q of the blocks get one exponent moved by one.
Throughputs are in shard bytes (2 per value) per second, best of ``repeats``, numba's threads (all cores);
``detect*_GBps`` use the adaptive serial/parallel choice of ``kernels.detect_changes_*``;
``detect_serial_GBps`` and ``detect_parallel_GBps`` force one variant of the hash detector.

Baselines: ``copy_GBps`` is a numba ``prange`` copy on as many threads as the codec kernels get (the
baseline of the full-path ratios); ``memcpy_GBps`` is numpy's one-thread copy (reference; ``vs_memcpy``).
``full_path`` times ShardEncoder.encode into a reused send buffer (one fused pass for exponent
plane, change detection, sign+mantissa plane and its checksum; gather_blocks; rANS into the buffer;
bitmap, header, CRCs) and ShardDecoder.decode (CRCs, rANS decode, scatter, merge with the checksum) at
q = ``--full-path-q`` (0.01; 1.0 is every block changed, as in early training), each sample next to a
copy sample so both see the same load; ``encode_us``/``decode_us`` per shard show the fixed cost per call
at small ``--numel`` (the engines' shards: 32768 values for small-moe's experts). ``entropy_stages``:
the same full path with rANS (``CodecConfig.entropy='rans'``, the default) and without an entropy stage
(``'none'``: changed blocks' exponent deltas sent one byte per value), at ``--full-path-q`` and at q = 1:
mean payload / raw shard bytes, best encode and decode time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _output import emit_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from ciera_runtime import (  # noqa: E402
    CodecConfig,
    ShardDecoder,
    ShardEncoder,
    kernels,
    rans,
)
from ciera_runtime.selection import perturb_blocks  # noqa: E402


@njit(parallel=True, cache=True, nogil=True)
def parallel_copy(source, target):
    """The baseline: a copy on all of numba's threads (as many as the codec kernels use)."""
    for i in prange(source.size):
        target[i] = source[i]


def best_s(function, repeats: int) -> float:
    function()  # warm-up (compile / page-in)
    samples = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start_s)
    return min(samples)


def entropy_bits(data: np.ndarray) -> float:
    counts = np.bincount(data, minlength=256)
    probabilities = counts[counts > 0] / data.size
    return float(-(probabilities * np.log2(probabilities)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--numel", type=int, default=1 << 23, help="values per shard (default 8 Mi)")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--full-path-q", type=float, default=0.01, help="share of blocks changed per version in full_path"
    )
    args = parser.parse_args()
    if not 0.0 <= args.full_path_q <= 1.0:
        parser.error(f"--full-path-q is {args.full_path_q}: expected a share in [0, 1]")
    numel, block_size, repeats = args.numel, args.block_size, args.repeats
    rng = np.random.default_rng(args.seed)
    weights = (rng.standard_normal(numel) * 0.02).astype(np.float32)
    bits = (weights.view(np.uint32) >> 16).astype(np.uint16)  # truncation: BF16 patterns
    shard_bytes = bits.nbytes
    gbps = lambda seconds: shard_bytes / seconds / 1e9  # noqa: E731

    copy_target = np.empty_like(bits)
    memcpy_s = best_s(lambda: np.copyto(copy_target, bits), repeats)
    threads = numba.get_num_threads()
    copy_s = best_s(lambda: parallel_copy(bits, copy_target), repeats)

    exp_plane = np.empty(numel, dtype=np.uint8)
    sm_plane = np.empty(numel, dtype=np.uint8)
    merged = np.empty_like(bits)
    n_blocks = (numel + block_size - 1) // block_size
    hash_cache = np.zeros((n_blocks, 2), dtype=np.uint64)
    changed = np.zeros(n_blocks, dtype=np.uint8)

    def split() -> None:
        kernels.extract_exponents(bits, 7, 0xFF, exp_plane)
        kernels.pack_sign_mantissa(bits, False, sm_plane)

    split_s = best_s(split, repeats)
    merge_s = best_s(lambda: kernels.merge_planes(exp_plane, sm_plane, 7, False, merged), repeats)
    assert np.array_equal(merged, bits)

    def detect_hash() -> None:
        kernels.detect_changes_hash(bits, 7, 0xFF, block_size, hash_cache, exp_plane, changed, False)

    for _ in range(2 * kernels.PROBE_EVERY):  # let the adaptive serial/parallel choice settle
        detect_hash()
    detect_s = best_s(detect_hash, repeats)
    detect_forced_s = {}
    for parallel in (False, True):  # each variant forced, for comparison with the adaptive choice
        kernels.use_parallel_detect(parallel)
        detect_forced_s[parallel] = best_s(
            lambda: kernels.detect_changes_hash(
                bits, 7, 0xFF, block_size, hash_cache, exp_plane, changed, False
            ),
            repeats,
        )
    kernels.use_parallel_detect(None)
    detect_parallel_s, detect_serial_s = detect_forced_s[True], detect_forced_s[False]
    last_exp = exp_plane.copy()

    def detect_exact() -> None:
        kernels.detect_changes_exact(bits, 7, 0xFF, block_size, exp_plane, last_exp, changed, False)

    for _ in range(2 * kernels.PROBE_EVERY):
        detect_exact()
    detect_exact_s = best_s(detect_exact, repeats)

    # Full codec path at q (--full-path-q), as the all-gather runs it: ShardEncoder.encode into a reused send
    # buffer (one fused pass, gather, rANS straight into the buffer, bitmap, header, CRCs) and
    # ShardDecoder.decode (CRCs, rANS decode, scatter, merge with the sign+mantissa checksum) into a
    # reused output. A chain of versions, each with a share q of its blocks changed from the one before;
    # every sample next to a same-threads copy sample, so both see the same load.
    config = CodecConfig(block_size=block_size)
    encoder = ShardEncoder(0, numel, "bf16", 1, config)
    decoder = ShardDecoder(0, 1, numel, "bf16", config)
    send_buffer = np.empty(encoder.layout.max_payload_bytes, dtype=np.uint8)
    out = np.empty_like(bits)
    decoder.decode(encoder.encode(bits, out=send_buffer), out=out)
    chain = [bits]
    for _ in range(2 * kernels.PROBE_EVERY + 2 * repeats + 2):
        chain.append(perturb_blocks(chain[-1], args.full_path_q, block_size, "bf16", rng))
    encode_samples, decode_samples, copy_samples, changed_blocks = [], [], [], 0
    for version in chain[1:]:
        start_s = time.perf_counter()
        parallel_copy(bits, copy_target)
        copy_samples.append(time.perf_counter() - start_s)
        start_s = time.perf_counter()
        payload = encoder.encode(version, out=send_buffer)
        encode_samples.append(time.perf_counter() - start_s)
        start_s = time.perf_counter()
        decoder.decode(payload, out=out)
        decode_samples.append(time.perf_counter() - start_s)
        assert np.array_equal(out, version)
        changed_blocks = encoder.last_changed_blocks
    settled = 2 * kernels.PROBE_EVERY  # the adaptive serial/parallel choices settle first
    copy_s = min(copy_s, *copy_samples[settled:])
    encode_s, decode_s = min(encode_samples[settled:]), min(decode_samples[settled:])
    full_path = {
        "q": args.full_path_q,
        "encode_us": round(encode_s * 1e6, 1),
        "decode_us": round(decode_s * 1e6, 1),
        "changed_blocks": changed_blocks,  # of the last sample
        "copy_threads": threads,
        "encode_GBps": round(gbps(encode_s), 3),
        "decode_GBps": round(gbps(decode_s), 3),
        "encode_vs_copy": round(copy_s / encode_s, 3),
        "decode_vs_copy": round(copy_s / decode_s, 3),
        "encode_vs_memcpy_one_thread": round(memcpy_s / encode_s, 3),
        "decode_vs_memcpy_one_thread": round(memcpy_s / decode_s, 3),
    }

    # The entropy stage against none (CodecConfig.entropy = 'none': changed blocks' exponent deltas sent
    # one byte per value, what a device without an entropy coder runs): payload size and full-path time.
    def entropy_stage(entropy: str, q: float) -> dict:
        stage_config = CodecConfig(block_size=block_size, entropy=entropy)
        sender = ShardEncoder(0, numel, "bf16", 1, stage_config)
        receiver = ShardDecoder(0, 1, numel, "bf16", stage_config)
        receiver.decode(sender.encode(bits, out=send_buffer), out=out)
        versions, sizes, encodes, decodes = [bits], [], [], []
        for _ in range(2 * repeats):
            versions.append(perturb_blocks(versions[-1], q, block_size, "bf16", rng))
        for version in versions[1:]:
            start_s = time.perf_counter()
            payload = sender.encode(version, out=send_buffer)
            encodes.append(time.perf_counter() - start_s)
            sizes.append(payload.size)
            start_s = time.perf_counter()
            receiver.decode(payload, out=out)
            decodes.append(time.perf_counter() - start_s)
            assert np.array_equal(out, version)
        return {
            "entropy": entropy,
            "q": q,
            "payload_ratio": round(float(np.mean(sizes)) / shard_bytes, 5),
            "encode_us": round(min(encodes) * 1e6, 1),
            "decode_us": round(min(decodes) * 1e6, 1),
        }

    entropy_stages = [
        entropy_stage(entropy, q) for q in sorted({args.full_path_q, 1.0}) for entropy in ("rans", "none")
    ]

    exponents = ((weights.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    stream = rans.encode(exponents)
    decoded = np.empty_like(exponents)
    ans_encode_s = best_s(lambda: rans.encode(exponents), repeats)
    ans_decode_s = best_s(lambda: rans.decode(stream, decoded), repeats)
    assert np.array_equal(decoded, exponents)
    numba.set_num_threads(1)  # per-core figure: one numba thread
    ans_decode_one_thread_s = best_s(lambda: rans.decode(stream, decoded), repeats)
    numba.set_num_threads(threads)
    entropy = entropy_bits(exponents)

    payload_rows = []
    for q in (0.0, 0.01, 0.1, 0.5, 1.0):
        encoder = ShardEncoder(0, numel, "bf16", 1, config)
        encoder.encode(bits)
        perturbed = perturb_blocks(bits, q, block_size, "bf16", rng)
        payload = encoder.encode(perturbed)
        ratio = payload.size / shard_bytes
        bound = 0.5 + 1 / (16 * block_size) + q * entropy / 16
        payload_rows.append(
            {
                "q": q,
                "ratio": round(ratio, 6),
                "bound": round(bound, 6),
                "excess_pp": round(100 * (ratio - bound), 4),
            }
        )

    result = {
        "numel": numel,
        "shard_bytes": shard_bytes,
        "block_size": block_size,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other processes share these cores
        "memcpy_GBps": round(gbps(memcpy_s), 3),
        "copy_GBps": round(gbps(copy_s), 3),
        "copy_threads": threads,
        "split_GBps": round(gbps(split_s), 3),
        "merge_GBps": round(gbps(merge_s), 3),
        "detect_GBps": round(gbps(detect_s), 3),
        "detect_exact_GBps": round(gbps(detect_exact_s), 3),
        "detect_serial_GBps": round(gbps(detect_serial_s), 3),
        "detect_parallel_GBps": round(gbps(detect_parallel_s), 3),
        "vs_memcpy": {
            name: round(memcpy_s / seconds, 3)
            for name, seconds in (
                ("split", split_s),
                ("merge", merge_s),
                ("detect", detect_s),
                ("detect_exact", detect_exact_s),
                ("detect_serial", detect_serial_s),
                ("detect_parallel", detect_parallel_s),
            )
        },
        "full_path": full_path,
        "entropy_stages": entropy_stages,
        "ans": {
            "symbols": int(exponents.size),
            "bits_per_symbol": round(8 * len(stream) / exponents.size, 5),
            "entropy_bits": round(entropy, 5),
            "excess_percent": round(100 * (8 * len(stream) / exponents.size / entropy - 1), 4),
            "encode_MBps": round(exponents.size / ans_encode_s / 1e6, 1),
            "decode_MBps": round(exponents.size / ans_decode_s / 1e6, 1),
            "decode_MBps_one_thread": round(exponents.size / ans_decode_one_thread_s / 1e6, 1),
        },
        "payload": payload_rows,
    }
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
