"""Projections checked against held-out measurements, bit-exact training, router divergence.
Not built yet: it needs measured bundles from `measure`."""
