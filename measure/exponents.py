"""Exponent statistics of real training, as the method defines them (reference/ciera-method.txt, §2):
between consecutive iterations, the **exponent change rate** is the fraction of weight values whose
exponent field changed, and the **block change rate** the fraction of blocks of B consecutive values
(B = 512 by default) with at least one such value — per parameter category.

Weights are taken as the engine all-gathers them: BF16 (a BF16 parameter as is; an FP32 master weight cast
to BF16 by round-to-nearest-even, which is what FSDP2's mixed-precision all-gather sends). Blocks run over
each parameter's flattened values from its first element (a ZeRO-3 shard boundary can split a block in
two; at B ≪ numel / W that changes little, and it is the same for every category).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

BF16_EXP_SHIFT, BF16_EXP_MASK = 7, 0xFF


@dataclass
class CategoryCounts:
    values: int = 0
    values_changed: int = 0
    blocks: int = 0
    blocks_changed: int = 0

    def rates(self) -> dict[str, float]:
        return {
            "exp_change_rate": self.values_changed / self.values if self.values else 0.0,
            "block_change_rate": self.blocks_changed / self.blocks if self.blocks else 0.0,
        }


def bf16_exponents(tensor) -> np.ndarray:
    """Exponent field (uint8) of every value of ``tensor`` as BF16 (cast first if it is not BF16)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.bfloat16:
        flat = flat.to(torch.bfloat16)
    bits = flat.contiguous().view(torch.int16).numpy().view(np.uint16)
    return ((bits >> BF16_EXP_SHIFT) & BF16_EXP_MASK).astype(np.uint8)


class ExponentTracker:
    """Per-step exponent and block change rates per category, against the previous step's weights."""

    def __init__(self, categories: Mapping[str, str], block_size: int = 512) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected a positive integer")
        self.categories = dict(categories)
        self.block_size = block_size
        self._previous: dict[str, np.ndarray] = {}

    def update(self, named_tensors: Iterable[tuple[str, object]]) -> dict[str, dict[str, float]] | None:
        """Compare with the last update; {category: rates} (None on the first call: nothing to compare)."""
        counts: dict[str, CategoryCounts] = {}
        first = not self._previous
        for name, tensor in named_tensors:
            if name not in self.categories:
                raise ValueError(f"parameter {name!r} has no category")
            exponents = bf16_exponents(tensor)
            previous = self._previous.get(name)
            self._previous[name] = exponents
            if previous is None:
                continue
            changed = exponents != previous
            n = changed.size
            n_blocks = -(-n // self.block_size)
            padded = np.zeros(n_blocks * self.block_size, dtype=bool)
            padded[:n] = changed
            counts.setdefault(self.categories[name], CategoryCounts())
            category = counts[self.categories[name]]
            category.values += n
            category.values_changed += int(changed.sum())
            category.blocks += n_blocks
            category.blocks_changed += int(padded.reshape(n_blocks, self.block_size).any(axis=1).sum())
        if first:
            return None
        total = CategoryCounts()
        for category in counts.values():
            total.values += category.values
            total.values_changed += category.values_changed
            total.blocks += category.blocks
            total.blocks_changed += category.blocks_changed
        return {**{name: c.rates() for name, c in sorted(counts.items())}, "all": total.rates()}


def summarize(per_step: list[dict | None], warmup_steps: int) -> dict[str, dict[str, float]]:
    """Median and mean of each category's rates over the steps after ``warmup_steps``."""
    kept = [rates for step, rates in enumerate(per_step) if rates is not None and step >= warmup_steps]
    summary: dict[str, dict[str, float]] = {}
    for category in sorted({name for rates in kept for name in rates}):
        for metric in ("exp_change_rate", "block_change_rate"):
            values = np.array([rates[category][metric] for rates in kept if category in rates])
            if values.size:
                summary.setdefault(category, {})[f"{metric}_median"] = float(np.median(values))
                summary[category][f"{metric}_mean"] = float(values.mean())
        summary.setdefault(category, {})["steps"] = len(kept)
    return summary
