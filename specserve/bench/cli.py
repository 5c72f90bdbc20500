"""`specserve bench <name>`: dispatch to one benchmark."""
from __future__ import annotations

import sys

BENCHES = {"compare": "specserve.bench.compare", "spec": "specserve.bench.spec_compare",
           "ngram-cost": "specserve.bench.ngram_cost", "limit": "specserve.bench.limit",
           "speculative": "specserve.bench.speculative", "serving": "specserve.bench.serving",
           "mtbench": "specserve.bench.mtbench", "compile": "specserve.bench.compile",
           "governor-sim": "specserve.bench.governor_sim"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        names = ", ".join(BENCHES)
        print(f"usage: specserve bench {{{names}}} [args]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
