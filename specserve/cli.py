"""The `specserve` console script: `serve`, `bench`, `train-draft`, `token-map`."""
from __future__ import annotations

import sys


def usage() -> str:
    from specserve.bench.cli import BENCHES

    return f"""usage: specserve <command> [args]

commands:
  serve [flags]        start the OpenAI-compatible server (the flags of python -m specserve.launch_server)
  bench <name> [...]   benchmarks: {", ".join(BENCHES)} (specserve bench --help)
  train-draft [...]    train an EAGLE-3 / EAGLE-2 draft head for a target (train-draft --help)
  token-map [...]      an FR-Spec token map for --speculative-token-map (token-map --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from specserve.launch_server import main as serve

        return serve(rest)
    if cmd == "bench":
        from specserve.bench.cli import main as bench

        return bench(rest)
    if cmd == "train-draft":
        from specserve.train.cli import main as train_draft

        return train_draft(rest)
    if cmd == "token-map":
        from specserve.train.token_map_cli import main as token_map

        return token_map(rest)
    print(f"error: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
