"""Capture on a real group: per-layer timings, a collectives sweep and exponent statistics, written as a
trace bundle (docs/trace-format.md). Not built yet: until it is, the shipped bundle is analytic
(`ciera analytic-bundle`) and every report says so."""
