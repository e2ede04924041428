"""Benchmarks behind ``jobs/bench_*.py``: each prints its measurements (and ratios) and can write JSON."""
