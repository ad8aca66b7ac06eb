"""Projections checked against measurements the simulator was not given.

- `validation.sim_check`: `ciera validate sim` — a held-out file names what the simulator may see; the
  seen runs are replayed from their events and every other measured run is predicted (`sim.predict`)
  and compared with its measurement (`validate_sim`, `load_held_out`, `ValidationInputError`).

Not built yet: bit-exact training checks over long runs and router divergence (`ciera validate lossless`,
`ciera validate divergence`).
"""
