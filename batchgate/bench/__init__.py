"""`batchgate bench`: the benchmark harness, its statistics, plots and worker processes."""
