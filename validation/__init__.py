"""Projections checked against measurements the simulator was not given.

- `validation.sim_check`: `ciera validate sim` — a held-out file names what the simulator may see; the
  seen runs are replayed from their events and every other measured run is predicted (`sim.predict`)
  and compared with its measurement (`validate_sim`, `load_held_out`, `ValidationInputError`; the split
  itself, seen against held out, is `split_runs`, which benchmarks/main_thread_split.py shares).

- `validation.lossless`: `ciera validate lossless` — the engine + CIERA (checkpointed and resumed) against
  the plain engine, every parameter and optimizer state compared at every step, and a lossy control that
  must be flagged (`run_lossless`, `LosslessPlan`).
- `validation.divergence`: `ciera validate divergence` — how far CIERA, a 1-ULP nudge, int8 weight gathers
  and another seed move a top-k MoE's predictions and routing from a reference run (`run_divergence`,
  `DivergencePlan`, `compare_outputs`).
"""
