"""How every benchmark reports: one summary line on stdout, one JSON line appended to a file."""
from __future__ import annotations

import json


def report(summary: str, row: dict, path: str) -> None:
    print(summary, flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
