"""Worker processes the benchmark starts with `python -m bench.workers.NAME`."""
