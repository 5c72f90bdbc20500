"""Layer 8: `specserve bench <name>` (cli.py lists them). Every benchmark reports ratios
measured in one run; figures live in docs/benchmarks.md with their commands."""
