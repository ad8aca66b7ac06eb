"""Measurement on a real group: the model zoo, the corpus, real training runs, and trace capture.

- `measure.zoo`: `build_model(key, layers, width_scale, seed)` (torch, imported only when building),
  `parameter_categories(model)`, `scaled_shape`, `parameter_count`, `zoo_keys`, `ZooError`.
- `measure.corpus`: byte-level tokens of the CPython documentation topics, deterministic `batches`.
- `measure.train`: `ciera train` — a zoo model under DeepSpeed ZeRO-3 or FSDP2, CIERA on or off, on
  spawned ranks or under torchrun (`TrainConfig`, `train`, `run_rank`, `start_run`).
- `measure.placement`: where a rank runs (cuda:<LOCAL_RANK> + NCCL with CUDA, else CPU + gloo) and the
  environment record; `measure.clock`: the clock of steps and segment boundaries (CUDA events on CUDA, the host clock on CPU).
- `measure.exponents`: exponent, block and shard change rates (`ExponentTracker` per category for
  `ciera train --exponent-stats`; `ExponentRecorder` per parameter for the bundle's tables; `layer_index`).
- `ciera measure` (docs/measurement.md): `measure.emulated` (the emulated two-level cluster: network
  namespaces, a bridge, tc-shaped links, `probe_link`), `measure.events` (`EventRecorder`: per-event
  timelines of a rank), `measure.collectives` (`sweep_collectives`, nccl-tests style), `measure.capture`
  (what one rank runs), `measure.launch` (starting and watching the ranks), `measure.campaign`
  (`CapturePlan`, `capture_all`, `capture_launched`: resumable captures), `measure.assemble` (a capture
  directory to a trace bundle), `measure.timeline` (measured iterations as Chrome traces).
- `ciera models` lists the zoo (measure/cli.py).
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
