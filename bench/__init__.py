"""`python -m bench.run`: the benchmark harness, its statistics, plots and worker processes."""
