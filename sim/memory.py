"""Memory per GPU of one simulated configuration, against the preset's device memory.

The accounting (sim/data/memory.toml, docs/simulator.md *Memory per GPU*): model states sharded over W as
DeepSpeed's estimator counts them, the gathered parameters the prefetch keeps live, checkpointed
activations plus one recomputed block, CIERA's sender state and receiver cache (ExpCache), ZeRO++'s hpZ
secondary partition. Parameter counts come from the anchor run's `layers` table (its blocks repeated to
the simulated depth as the depth rewrite repeats them); activations need the model's shape
(traces/data/models) and are left at 0 with a note when the bundle's model has none.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

import traces

from .depth import block_map
from .errors import SimInputError

GIB = 2**30


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter counts of a model at the simulated depth."""

    parameters: int
    largest_layer_parameters: int  # the embedding, a block or the head, whichever is largest


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds at the peak of an iteration, by what holds them."""

    model_states_bytes: float
    gathered_parameters_bytes: float
    activations_bytes: float
    ciera_bytes: float  # sender state + receiver cache of the shards CIERA compresses
    zeropp_bytes: float  # hpZ secondary partition
    device_bytes: float  # the preset's device memory; 0 = not stated, the fit is not checked

    @property
    def total_bytes(self) -> float:
        return (
            self.model_states_bytes
            + self.gathered_parameters_bytes
            + self.activations_bytes
            + self.ciera_bytes
            + self.zeropp_bytes
        )

    @property
    def fits(self) -> bool | None:
        """None where the preset states no device memory."""
        return None if self.device_bytes <= 0 else self.total_bytes <= self.device_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "total_bytes": self.total_bytes,
            "fits": self.fits,
            "verdict": fit_text(self.total_bytes, self.device_bytes),
        }


def fit_text(total_bytes: float, device_bytes: float) -> str:
    """'does not fit (431 GiB of 80)' / 'fits (62 GiB of 80)' / 'not checked (...)'."""
    if device_bytes <= 0:
        return f"{total_bytes / GIB:.0f} GiB, not checked (the preset states no device_memory_bytes)"
    verdict = "fits" if total_bytes <= device_bytes else "does not fit"
    return f"{verdict} ({total_bytes / GIB:.0f} GiB of {device_bytes / GIB:.0f})"


@cache
def _accounting() -> dict[str, dict[str, float]]:
    text = (resources.files("sim") / "data" / "memory.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def model_footprint(
    bundle: traces.TraceBundle, run_id: str, traced_layers: int, layers: int
) -> ModelFootprint:
    """Parameters of the anchor run's model at `layers` blocks: embedding and head as traced, the blocks
    repeated as `sim.depth.block_map` repeats them."""
    rows = bundle.layers[(bundle.layers["run_id"] == run_id) & (bundle.layers["phase"] == "fwd")]
    if rows.empty:
        raise SimInputError(f"bundle: run {run_id!r} has no layer rows to count its parameters")
    numel = rows[rows["iteration"] == rows["iteration"].min()].set_index("layer")["numel"]
    blocks = [int(numel.get(layer, 0)) for layer in range(1, traced_layers + 1)]
    others = [int(value) for layer, value in numel.items() if not 1 <= int(layer) <= traced_layers]
    repeated = [blocks[source - 1] for source in block_map(traced_layers, layers)]
    return ModelFootprint(sum(others) + sum(repeated), max([*others, *repeated]))


def activation_bytes(
    shape: traces.ModelShape, layers: int, seq_len: int, micro_batch: int, checkpointing: bool
) -> float:
    """Activations one GPU holds at the peak of backward (memory.toml [activations])."""
    costs = _accounting()["activations"]
    h = shape.hidden_size
    tokens = seq_len * micro_batch

    def per_token(experts: list[tuple[int, int]]) -> float:
        return (
            costs["attention_bytes_per_hidden"] * h
            + costs["attention_bytes_per_head_and_position"] * shape.num_attention_heads * seq_len
            + costs["norm_bytes_per_hidden"] * h
            + sum(
                k
                * (costs["expert_input_bytes_per_hidden"] * h + costs["expert_bytes_per_intermediate"] * size)
                for k, size in experts
            )
        )

    kinds = []
    if shape.num_experts and layers > shape.dense_blocks:
        routed = [(shape.experts_per_token, shape.moe_intermediate_size)]
        if shape.shared_expert_intermediate_size:
            routed.append((1, shape.shared_expert_intermediate_size))
        kinds.append(per_token(routed))
    if shape.dense_blocks or not shape.num_experts:
        kinds.append(per_token([(1, shape.dense_intermediate_size or shape.moe_intermediate_size)]))
    block_bytes = max(kinds) * tokens  # the largest block is the peak when it is recomputed
    if not checkpointing:
        return block_bytes * layers
    return layers * tokens * h * 2 + block_bytes


def estimate(
    system: str,
    world_size: int,
    gpus_per_node: int,
    footprint: ModelFootprint,
    prefetch_layers: int,
    activations_bytes: float,
    ciera_shard_values: float,
    receiver_cache_bytes: float,
    device_bytes: float,
) -> MemoryEstimate:
    """One GPU's memory for `system` at W = `world_size`. `ciera_shard_values`: the values of this rank's
    shards of the parameters CIERA compresses (0 for the plain systems)."""
    accounting = _accounting()
    parameters = footprint.parameters
    gathered_value = accounting["gathered"]["bytes_per_value"]
    gathered = footprint.largest_layer_parameters * gathered_value * (2 + max(prefetch_layers, 0))
    ciera = ciera_shard_values * accounting["ciera"]["sender_bytes_per_value"] + receiver_cache_bytes
    zeropp = 0.0
    if system == "zeropp":
        zeropp = (
            parameters
            * accounting["zeropp"]["secondary_bytes_per_parameter"]
            / min(gpus_per_node, world_size)
        )
    return MemoryEstimate(
        model_states_bytes=parameters * accounting["model_states"]["bytes_per_parameter"] / world_size,
        gathered_parameters_bytes=float(gathered),
        activations_bytes=float(activations_bytes),
        ciera_bytes=float(ciera),
        zeropp_bytes=float(zeropp),
        device_bytes=float(device_bytes),
    )
