"""Benchmarks and comparisons against transformers, run as ``python -m torchspec.bench.<name>``."""
