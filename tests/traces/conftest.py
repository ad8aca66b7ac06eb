"""A tiny valid bundle, built by hand, that each bad-input test breaks in one way."""

from __future__ import annotations

import pandas as pd
import pytest

import traces


def make_tiny_bundle(layers: int = 2, world_size: int = 4, iterations: int = 2) -> traces.TraceBundle:
    runs = pd.DataFrame(
        [
            {
                "run_id": "r0",
                "source": "measured",
                "model": "toy",
                "dtype": "bf16",
                "layers": layers,
                "full_layers": 8,
                "seq_len": 128,
                "micro_batch_size": 1,
                "world_size": world_size,
                "gpus_per_node": 2,
                "hardware": "cpu",
                "cluster": "toy-cluster",
                "system": "zero3",
                "block_size": 512,
                "activation_checkpointing": True,
                "optimizer": "adam",
                "versions": "{}",
                "engine": "zero3",
                "backend": "gloo",
                "nodes": -(-world_size // 2),
                "prefetch_bucket_size": 50_000_000,
                "max_reuse_distance": 1_000_000_000,
                "max_live_parameters": 1_000_000_000,
                "reshard_after_forward": False,
                "link_rate_Bps": 125e6,
                "link_latency_s": 1e-4,
                "measured_link_Bps": 77e6,
                "warmup_iterations": 2,
                "clock_spread_s": 2e-6,
                "reduce_bucket_size": 500_000_000.0,
            }
        ]
    )
    layer_rows, iteration_rows, exponent_rows = [], [], []
    for iteration in range(iterations):
        for layer in range(layers + 2):
            kind = "embedding" if layer == 0 else "head" if layer == layers + 1 else "block"
            for phase in ("fwd", "bwd", "optim"):
                gathered = 0 if phase == "optim" else 2000
                layer_rows.append(
                    {
                        "run_id": "r0",
                        "iteration": iteration,
                        "layer": layer,
                        "layer_kind": kind,
                        "phase": phase,
                        "numel": 1000,
                        "compute_s": 0.001,
                        "allgather_bytes": gathered,
                        "allgather_s": 0.0005 if gathered else 0.0,
                        "reduce_scatter_bytes": 2000 if phase == "bwd" else 0,
                        "reduce_scatter_s": 0.0005 if phase == "bwd" else 0.0,
                        "hash_s": 0.0,
                        "compress_s": 0.0,
                        "decompress_s": 0.0,
                    }
                )
            if iteration:
                exponent_rows.append(
                    {
                        "run_id": "r0",
                        "iteration": iteration,
                        "layer": layer,
                        "shard": f"p{layer}",
                        "category": "embedding" if kind != "block" else "expert_ffn",
                        "numel": 1000,
                        "block_size": 512,
                        "exp_change_rate": 0.001,
                        "block_change_rate": 0.2,
                    }
                )
        iteration_rows.append({"run_id": "r0", "iteration": iteration, "iteration_s": 0.02})
    collectives = pd.DataFrame(
        [
            {
                "cluster": "toy-cluster",
                "op": "all_gather",
                "world_size": world_size,
                "nodes": -(-world_size // 2),
                "bytes": 1 << 20,
                "time_s": 0.001,
                "algbw_Bps": (1 << 20) / 0.001,
                "busbw_Bps": (1 << 20) / 0.001 * (world_size - 1) / world_size,
                "source": "measured",
                "repetitions": 5,
                "time_min_s": 0.0009,
                "time_max_s": 0.0012,
                "transport_cpu_s": 0.0002,
            }
        ]
    )

    def typed(name: str, frame: pd.DataFrame) -> pd.DataFrame:
        return frame.astype(traces.empty_table(name).dtypes.to_dict())

    return traces.TraceBundle(
        runs=typed("runs", runs),
        layers=typed("layers", pd.DataFrame(layer_rows)),
        iterations=typed("iterations", pd.DataFrame(iteration_rows)),
        collectives=typed("collectives", collectives),
        exponents=typed("exponents", pd.DataFrame(exponent_rows)),
    )


@pytest.fixture
def tiny_bundle() -> traces.TraceBundle:
    return make_tiny_bundle()
