"""The developer benchmarks and fault harnesses of batchgate: a package of the checkout,
not installed with batchgate. Run each from the repository root as `python -m bench.NAME`
(docs/benchmarks.md lists them); what several share is in bench/common.py."""
