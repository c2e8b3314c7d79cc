"""Fail when what travels with the checkout (tracked files and untracked ones git does not ignore) exceeds a limit.

    python scripts/tree_size.py                 # the limit: 56 MiB (eval/records/tree_size.py, LIMIT)
    python scripts/tree_size.py --limit 60000000 --top 20

Prints the total and the largest files; exit code 1 above the limit. ``.ci/run`` runs it before the tests.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.records.tree_size import LIMIT, check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=ROOT, help="the checkout (default: this one)")
    parser.add_argument("--limit", type=int, default=LIMIT, help=f"bytes (default {LIMIT:,}: 56 MiB)")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest files to list")
    args = parser.parse_args(argv)
    ok, lines = check(args.root, args.limit, args.top)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
