"""Benchmarks of issue 9: step scaling in K, mining, retrieval, tree sampler, sharding.

Run them all with `python -m benchmarks.run_all --size=small|full --out-dir=DIR`;
every module writes `DIR/<name>.json` and prints a table. Results of the full
run on the project's reference machine are in `benchmarks/RESULTS.md`.
"""
