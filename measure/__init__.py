"""Measurement on a real group. Built so far: the model zoo, the corpus, real training runs and their
exponent statistics.

- `measure.zoo`: `build_model(key, layers, width_scale, seed)` (torch, imported only when building),
  `parameter_categories(model)`, `scaled_shape`, `parameter_count`, `zoo_keys`, `ZooError`.
- `measure.corpus`: byte-level tokens of the CPython documentation topics, deterministic `batches`.
- `measure.train`: `ciera train` — a zoo model under DeepSpeed ZeRO-3 or FSDP2, CIERA on or off, on
  spawned gloo ranks or under torchrun (`TrainConfig`, `train`, `run_rank`).
- `measure.exponents`: exponent and block change rates per category between steps (`ExponentTracker`).
- `ciera models` lists the zoo (measure/cli.py).

Trace capture into a bundle (`ciera measure`: per-event timelines, collectives sweeps, exponent tables) is
not built yet: until it is, the shipped bundle is analytic (`ciera analytic-bundle`) and every report
says so.
"""

from .corpus import CorpusError, batch, batches, corpus_info
from .zoo import (
    CATEGORIES,
    ZooError,
    build_model,
    category_of,
    default_width_scale,
    parameter_categories,
    parameter_count,
    scaled_shape,
    zoo_keys,
)

__all__ = [
    "CATEGORIES",
    "CorpusError",
    "ZooError",
    "batch",
    "batches",
    "build_model",
    "category_of",
    "corpus_info",
    "default_width_scale",
    "parameter_categories",
    "parameter_count",
    "scaled_shape",
    "zoo_keys",
]
