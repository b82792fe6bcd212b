"""Benchmarks: ``python -m ddtree.bench attention ...`` (attention backends) and the main generation bench."""
