"""Benchmarks run from a checkout: `python -m bench.<name>`."""
