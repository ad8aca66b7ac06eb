"""CIERA's trace-driven scale-out simulator (imports without torch).

The op graph (the one intermediate form) and its evaluator:
- `build_graph(events)` / `iteration_graphs(events)`: each iteration of every rank as an `OpGraph`.
- `evaluate(graph, costs=None)`: simpy with the link and the hosts' cores shared; measured costs replay.
- `replay_run(bundle, run_id)`: a traced run's iterations replayed.
- `sweep_curves(...)` / `SweepCurve`: a measured cluster's size-resolved cost of each collective.
- `predict_run(...)`, `simulate_measured_cluster(...)`: projections as rewrites of traced graphs, measured
  or analytic; `repeat_blocks(...)`: the depth rewrite, with `fit_block_compute(bundle, runs)` its
  per-block compute pooled over the traced depths; `preset_cluster(...)`: W GPUs of a cluster preset as a cluster the rewrites target;
  `main_thread_work_s(bundle, run)`: a run's main-thread events read as work at a full core (what the
  CIERA rewrite's codec figures are fitted to).

Records of `ciera simulate` on a cluster preset, on the same path:
- `load_cluster` / `list_clusters`: cluster presets (TOML data) with dotted-key overrides.
- `CollectiveModel`: a preset's hierarchical ring α–β, calibrated to nccl-tests bus bandwidth.
- `simulate(bundle, cluster, models, gpus, systems, dtypes)`: one `SimRecord` per (model, dtype, gpus,
  system), each from an anchor run's graphs rewritten (depth, system, cluster) and evaluated.
- `timeline(...)`: one simulated iteration per system as Chrome-trace JSON.
- `records_to_json` / `write_json_atomic`: the `ciera.simulate/1` document.
- `select_shards`: benefit-driven shard selection (BSC) as a pure function.
- `MemoryEstimate`, `fit_text`: one GPU's memory of a configuration (sim/memory.py), in every record.
- Verdicts from record dicts, shared by the console and the report (sim/verdict.py): `summary_rows`,
  `pays_text`, `pays_bases`, `lossy_faster`, `lossy_speedups`, `speedup_span`, `grouped_notes`, `merged_notes`, `w_ranges`, `verdict_line`, the console's
  `summary_table`, the threshold `PAYS_ABOVE`.
"""

from .ciera_rewrite import main_thread_work_s
from .cluster import ClusterPreset, list_clusters, load_cluster, parse_overrides
from .collectives import CollectiveModel, algbw_Bps, busbw_Bps, busbw_factor
from .curves import SweepCurve, sweep_curves
from .depth import repeat_blocks
from .errors import SimInputError
from .evaluate import BREAKDOWN_KEYS, BREAKDOWN_LABELS, Costs, evaluate
from .measured_cluster import simulate_measured_cluster
from .memory import MemoryEstimate, fit_text
from .opgraph import OpGraph, build_graph, iteration_graphs
from .predict import fit_block_compute, predict_run
from .replay import replay_run
from .rewrite import preset_cluster
from .selection import select_shards
from .simulate import (
    DEFAULT_GPUS,
    DTYPES,
    SCHEMA,
    SYSTEMS,
    SimRecord,
    Simulator,
    check_simulate_overrides,
    other_device,
    records_to_json,
    simulate,
    sweep_workers,
    timeline,
    write_json_atomic,
)
from .verdict import (
    LOSSY_SYSTEMS,
    PAYS_ABOVE,
    SummaryRow,
    grouped_notes,
    lossy_faster,
    lossy_speedups,
    merged_notes,
    node_boundary_text,
    path_change_text,
    path_shares_text,
    pays,
    pays_bases,
    pays_text,
    speedup_span,
    summary_rows,
    summary_table,
    verdict_line,
    w_ranges,
)

__all__ = [
    "BREAKDOWN_KEYS",
    "BREAKDOWN_LABELS",
    "LOSSY_SYSTEMS",
    "MemoryEstimate",
    "PAYS_ABOVE",
    "SummaryRow",
    "fit_text",
    "grouped_notes",
    "lossy_faster",
    "lossy_speedups",
    "merged_notes",
    "node_boundary_text",
    "path_change_text",
    "path_shares_text",
    "pays",
    "pays_bases",
    "pays_text",
    "summary_rows",
    "speedup_span",
    "summary_table",
    "verdict_line",
    "w_ranges",
    "Costs",
    "OpGraph",
    "build_graph",
    "evaluate",
    "fit_block_compute",
    "iteration_graphs",
    "predict_run",
    "preset_cluster",
    "repeat_blocks",
    "replay_run",
    "simulate_measured_cluster",
    "SweepCurve",
    "sweep_curves",
    "DEFAULT_GPUS",
    "DTYPES",
    "SCHEMA",
    "SYSTEMS",
    "ClusterPreset",
    "CollectiveModel",
    "SimInputError",
    "SimRecord",
    "check_simulate_overrides",
    "other_device",
    "Simulator",
    "algbw_Bps",
    "busbw_Bps",
    "busbw_factor",
    "list_clusters",
    "load_cluster",
    "main_thread_work_s",
    "parse_overrides",
    "records_to_json",
    "select_shards",
    "simulate",
    "sweep_workers",
    "timeline",
    "write_json_atomic",
]
