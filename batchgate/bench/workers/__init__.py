"""Worker processes the benchmark starts with `python -m batchgate.bench.workers.NAME`."""
