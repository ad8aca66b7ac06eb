"""Exponent statistics of real training, as the method defines them (reference/ciera-method.txt, §2):
between consecutive iterations, the **exponent change rate** is the fraction of weight values whose
exponent field changed, the **block change rate** the fraction of blocks of B consecutive values with at
least one such value, and the **shard change rate** the fraction of a parameter's ZeRO-3 partitions at
world size W with at least one such value.

Weights are taken as the engine all-gathers them: BF16 (a BF16 parameter as is; an FP32 master weight cast
to BF16 by round-to-nearest-even, torch's ``.to(torch.bfloat16)``, which is what FSDP2's mixed-precision
all-gather sends). The exponent is bits 14..7 of the BF16 pattern. Non-finite values are not special:
NaN and ±inf have the exponent field 0xFF and are compared like any other value (inf → NaN is no change,
a finite value → inf or NaN is one; the sign never counts).

Blocks run over each parameter's flattened values from its first element; the last, partial block counts
as a block (a ZeRO-3 shard boundary can split a block in two; at B ≪ numel / W that changes little, and it
is the same for every category). Partitions follow ZeRO-3: the flattened values split into W contiguous
pieces of ceil(numel / W) values, the last ones shorter or empty; empty partitions do not count. The
method measures W = 4 and projects larger W by re-partitioning the measured per-value changes; that is
what `ExponentRecorder` does for every W it is given.

Two users: `ExponentTracker` (per-category rates of one block size, `ciera train --exponent-stats`) and
`ExponentRecorder` (per-parameter rows of the trace bundle's `exponents` and `shard_changes` tables). Both
diff exponents through the same `ExponentHistory`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from traces import CATEGORIES

if TYPE_CHECKING:
    import pandas as pd

BF16_EXP_SHIFT, BF16_EXP_MASK = 7, 0xFF
# The block sizes the trace bundle's `exponents` table holds for every parameter (a capture adds its own B).
EXPONENT_BLOCK_SIZES = (64, 128, 256, 512, 1024)

# Module wrappers whose name segment engines and torch insert into parameter names; they place nothing.
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


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
    """Exponent field (uint8) of every value of ``tensor`` as BF16 (cast first if it is not BF16), on the
    CPU whatever device the tensor is on."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.bfloat16:
        flat = flat.to(torch.bfloat16)
    bits = flat.contiguous().view(torch.int16)
    if bits.device.type != "cpu":  # take the exponents there: a byte a value crosses to the host
        return ((bits >> BF16_EXP_SHIFT) & BF16_EXP_MASK).to(torch.uint8).cpu().numpy()
    # uint16 >> 7 keeps the sign at bit 8, which the cast to uint8 drops: bits 14..7 remain.
    return (bits.numpy().view(np.uint16) >> BF16_EXP_SHIFT).astype(np.uint8)


def block_count(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` values in ``numel`` values, the last partial block included."""
    return -(-numel // block_size)


def partition_count(numel: int, world_size: int) -> int:
    """Non-empty ZeRO-3 partitions of ``numel`` values over ``world_size`` ranks (ceil(numel / W) each)."""
    if numel == 0:
        return 0
    return block_count(numel, block_count(numel, world_size))


def changed_block_flags(changed: np.ndarray, block_size: int) -> np.ndarray:
    """One bool per block of ``block_size`` values of the flat mask ``changed``: any value changed."""
    n = changed.size
    full = n // block_size
    flags = np.empty(block_count(n, block_size), dtype=bool)
    flags[:full] = changed[: full * block_size].reshape(full, block_size).any(axis=1)
    if full < flags.size:
        flags[full] = changed[full * block_size :].any()
    return flags


def _coarser_flags(flags: np.ndarray, factor: int, blocks: int) -> np.ndarray:
    """Block flags at factor × the block size, from the flags of the finer blocks (the coarse blocks are
    unions of ``factor`` consecutive fine ones, both starting at value 0)."""
    padded = np.zeros(blocks * factor, dtype=bool)
    padded[: flags.size] = flags
    return padded.reshape(blocks, factor).any(axis=1)


def changed_block_counts(changed: np.ndarray, block_sizes: Sequence[int]) -> list[int]:
    """Blocks holding a changed value, per block size (in the order given). A block size that is a multiple
    of a smaller one is counted from the largest such one's block flags, not from the values again."""
    n = changed.size
    flags: dict[int, np.ndarray] = {}
    for size in sorted(set(block_sizes)):
        finer = max((smaller for smaller in flags if size % smaller == 0), default=None)
        if finer is None:
            flags[size] = changed_block_flags(changed, size)
        else:
            flags[size] = _coarser_flags(flags[finer], size // finer, block_count(n, size))
    return [int(np.count_nonzero(flags[size])) for size in block_sizes]


def changed_partition_count(changed: np.ndarray, world_size: int) -> int:
    """Non-empty ZeRO-3 partitions (W contiguous pieces of ceil(numel / W) values) holding a changed value."""
    n = changed.size
    if n == 0:
        return 0
    size = block_count(n, world_size)
    return int(np.count_nonzero(np.logical_or.reduceat(changed, np.arange(0, n, size))))


class ExponentHistory:
    """The BF16 exponents each parameter had at its last `changes` call: the per-value diff both the
    tracker and the recorder count from."""

    def __init__(self) -> None:
        self._previous: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._previous)

    def numel(self, name: str) -> int | None:
        previous = self._previous.get(name)
        return None if previous is None else previous.size

    def changes(self, name: str, tensor) -> np.ndarray | None:
        """Bool per value: the exponent differs from the last call's (None on this parameter's first call).
        The tensor's exponents replace the stored ones."""
        exponents = bf16_exponents(tensor)
        previous = self._previous.get(name)
        if previous is not None and previous.size != exponents.size:
            raise ValueError(
                f"parameter {name!r} has {exponents.size} values, {previous.size} at the last update"
            )
        self._previous[name] = exponents
        return None if previous is None else exponents != previous


class ExponentTracker:
    """Per-step exponent and block change rates per category, against the previous step's weights."""

    def __init__(self, categories: Mapping[str, str], block_size: int = 512) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected a positive integer")
        self.categories = dict(categories)
        self.block_size = block_size
        self._history = ExponentHistory()

    def update(self, named_tensors: Iterable[tuple[str, object]]) -> dict[str, dict[str, float]] | None:
        """Compare with the last update; {category: rates} (None on the first call: nothing to compare)."""
        counts: dict[str, CategoryCounts] = {}
        first = not len(self._history)
        for name, tensor in named_tensors:
            if name not in self.categories:
                raise ValueError(f"parameter {name!r} has no category")
            changed = self._history.changes(name, tensor)
            if changed is None:
                continue
            category = counts.setdefault(self.categories[name], CategoryCounts())
            category.values += changed.size
            category.values_changed += int(np.count_nonzero(changed))
            category.blocks += block_count(changed.size, self.block_size)
            category.blocks_changed += changed_block_counts(changed, (self.block_size,))[0]
        if first:
            return None
        total = CategoryCounts()
        for category in counts.values():
            total.values += category.values
            total.values_changed += category.values_changed
            total.blocks += category.blocks
            total.blocks_changed += category.blocks_changed
        return {**{name: c.rates() for name, c in sorted(counts.items())}, "all": total.rates()}


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} is empty: expected at least one positive integer")
    for value in values:
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} holds {value!r}: expected positive integers")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} is {values}: a value is listed twice")
    return tuple(int(value) for value in values)


class ExponentRecorder:
    """Rows of the trace bundle's `exponents` and `shard_changes` tables, one set per `update` after the
    first: every parameter's exponent change rate, block change rate per block size and shard change rate
    per world size, comparing that update's full weights with the previous update's.

    ``layer_of`` and ``categories`` map every parameter name to its layer (0..L+1, see `layer_index`) and
    category (`measure.zoo.parameter_categories`). Every update must carry the same parameters as the first
    (its baseline), with the same sizes; rows follow the baseline's parameter order."""

    def __init__(
        self,
        layer_of: Mapping[str, int],
        categories: Mapping[str, str],
        block_sizes: Sequence[int] = EXPONENT_BLOCK_SIZES,
        world_sizes: Sequence[int] = (4, 8, 16, 32),
    ) -> None:
        self.layer_of = dict(layer_of)
        self.categories = dict(categories)
        self.block_sizes = _positive_ints("block_sizes", block_sizes)
        self.world_sizes = _positive_ints("world_sizes", world_sizes)
        for name, layer in self.layer_of.items():
            if not isinstance(layer, int | np.integer) or isinstance(layer, bool) or layer < 0:
                raise ValueError(f"parameter {name!r}: layer {layer!r}, expected an integer ≥ 0")
        for name, category in self.categories.items():
            if category not in CATEGORIES:
                raise ValueError(f"parameter {name!r}: category {category!r}, expected one of {CATEGORIES}")
        self._history = ExponentHistory()
        self._names: list[str] = []  # the baseline's parameters, in its order
        self._numel = np.zeros(0, dtype=np.int64)
        # Per compared iteration: changed values (P,), changed blocks (P, block sizes), changed partitions
        # (P, world sizes).
        self._changed: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    @property
    def iterations(self) -> int:
        """Iterations compared so far (updates after the baseline)."""
        return len(self._changed)

    def update(self, named_full_tensors: Iterable[tuple[str, object]]) -> None:
        """The first call stores the baseline; every later call compares with the call before and adds one
        iteration's rows (iteration 1, 2, …)."""
        tensors = dict(self._checked(named_full_tensors))
        if not self._names:
            for name, tensor in tensors.items():
                self._history.changes(name, tensor)
            self._names = list(tensors)
            self._numel = np.array([self._history.numel(name) for name in self._names], dtype=np.int64)
            return
        values = np.zeros(len(self._names), dtype=np.int64)
        blocks = np.zeros((len(self._names), len(self.block_sizes)), dtype=np.int64)
        partitions = np.zeros((len(self._names), len(self.world_sizes)), dtype=np.int64)
        for index, name in enumerate(self._names):
            changed = self._history.changes(name, tensors[name])
            values[index] = count = int(np.count_nonzero(changed))
            if count == 0:
                continue
            if count == changed.size:  # every block and partition changed
                blocks[index] = [block_count(count, size) for size in self.block_sizes]
                partitions[index] = [partition_count(count, size) for size in self.world_sizes]
                continue
            blocks[index] = changed_block_counts(changed, self.block_sizes)
            partitions[index] = [changed_partition_count(changed, size) for size in self.world_sizes]
        self._changed.append((values, blocks, partitions))

    def _checked(self, named_full_tensors: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
        """The named tensors, after every check that can fail (so a failed update changes nothing)."""
        items = list(named_full_tensors)
        seen: set[str] = set()
        for name, tensor in items:
            if name in seen:
                raise ValueError(f"parameter {name!r} is given twice")
            seen.add(name)
            if name not in self.layer_of:
                raise ValueError(f"parameter {name!r} has no layer")
            if name not in self.categories:
                raise ValueError(f"parameter {name!r} has no category")
            previous = self._history.numel(name)
            if previous is not None and previous != tensor.numel():
                raise ValueError(
                    f"parameter {name!r} has {tensor.numel()} values, {previous} at the last update"
                )
        if self._names:
            missing = [name for name in self._names if name not in seen]
            if missing:
                raise ValueError(
                    f"parameter {missing[0]!r} is missing: every update needs the baseline's parameters"
                )
            extra = [name for name, _ in items if self._history.numel(name) is None]
            if extra:
                raise ValueError(f"parameter {extra[0]!r} is not in the baseline (the first update)")
        return items

    def frames(self, run_id: str) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(exponents, shard_changes): the rows of every compared iteration, columns and dtypes as the trace
        format's tables. Rows run by iteration, then parameter (baseline order), then B or W."""
        import pandas as pd

        iterations, parameters = len(self._changed), len(self._names)
        numel = self._numel
        names = np.array(self._names, dtype=object)
        layers = np.array([self.layer_of[name] for name in self._names], dtype=np.int32)
        categories = np.array([self.categories[name] for name in self._names], dtype=object)

        def stacked(part: int, width: int) -> np.ndarray:  # (T, P, width) or (T, P) for width 0
            shape = (iterations, parameters, width) if width else (iterations, parameters)
            if not iterations:
                return np.zeros(shape, dtype=np.int64)
            return np.stack([changed[part] for changed in self._changed]).reshape(shape)

        def table(sizes: tuple[int, ...], size_column: str) -> dict:
            per = len(sizes)  # rows per iteration and parameter
            return {
                "run_id": pd.Series(np.full(iterations * parameters * per, run_id, dtype=object), dtype=str),
                "iteration": np.repeat(np.arange(1, iterations + 1, dtype=np.int32), parameters * per),
                "layer": np.tile(np.repeat(layers, per), iterations),
                "shard": pd.Series(np.tile(np.repeat(names, per), iterations), dtype=str),
                "category": pd.Series(np.tile(np.repeat(categories, per), iterations), dtype=str),
                "numel": np.tile(np.repeat(numel, per), iterations),
                size_column: np.tile(np.array(sizes, dtype=np.int32), iterations * parameters),
            }

        def totals(count, sizes: tuple[int, ...]) -> np.ndarray:  # (P, sizes): blocks or partitions
            return np.array([count(n, size) for n in numel for size in sizes], dtype=np.int64).reshape(
                parameters, len(sizes)
            )

        exponents = table(self.block_sizes, "block_size")
        exponents["exp_change_rate"] = np.repeat(_rate(stacked(0, 0), numel), len(self.block_sizes))
        exponents["block_change_rate"] = _rate(
            stacked(1, len(self.block_sizes)), totals(block_count, self.block_sizes)
        )
        shard_changes = table(self.world_sizes, "world_size")
        shard_changes["shard_change_rate"] = _rate(
            stacked(2, len(self.world_sizes)), totals(partition_count, self.world_sizes)
        )
        return pd.DataFrame(exponents), pd.DataFrame(shard_changes)


def _rate(changed: np.ndarray, total: np.ndarray) -> np.ndarray:
    """changed / total (broadcast over leading axes) as float64, flattened; 0 where there is nothing to
    count (a parameter without values)."""
    changed, total = np.broadcast_arrays(changed.astype(np.float64), total.astype(np.float64))
    return np.divide(changed, total, out=np.zeros(changed.shape), where=total > 0).reshape(-1)


def layer_index(parameter_name: str, num_layers: int) -> int:
    """Layer of a zoo model's parameter (`measure.model.ZooModel` names): 0 the embedding (a tied LM head
    is the embedding's parameter), i + 1 for ``blocks.i.*``, L + 1 the final norm and an untied LM head.
    Wrapper segments engines insert (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.``) are skipped."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers is {num_layers!r}: expected a positive integer")
    parts = [part for part in parameter_name.split(".") if part not in _WRAPPER_SEGMENTS]
    head = parts[0] if parts else ""
    if head == "embed_tokens":
        return 0
    if head in ("final_norm", "lm_head"):
        return num_layers + 1
    if head == "blocks" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < num_layers:
        return int(parts[1]) + 1
    raise ValueError(
        f"parameter {parameter_name!r}: no layer of a {num_layers}-block zoo model "
        f"(expected embed_tokens.*, blocks.<0..{num_layers - 1}>.*, final_norm.* or lm_head.*)"
    )


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
