"""The GPU smoke test for a user's first minutes on a GPU node: tiny models on CUDA, one process against
torchrun's ranks (NCCL), the bf16 self-check, compiled against eager tokens, one bench preset; a pass/fail table.

The checks live in ``eval.bench.gpu_smoke`` (its docstring says what each one proves); this entry point parses the
options, runs them and prints the table. It refuses at once on a machine without CUDA.

Examples::

    python scripts/gpu_smoke.py                         # every check; writes gpu_smoke/gpu_smoke.{md,json}
    python scripts/gpu_smoke.py --checks ranks compiled --out /tmp/smoke
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.bench.gpu_smoke import CHECKS, run_smoke  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_smoke", help="folder for the table, JSON record and logs")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=None, help="a subset (default: all)")
    parser.add_argument("--acceptance-images", type=int, default=256,
                        help="images per decoder and precision of the bf16_acceptance check")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU when there is no CUDA: only to test this script itself")
    args = parser.parse_args()
    record = run_smoke(Path(args.out), args.checks, allow_cpu=args.allow_cpu,
                       acceptance_images=args.acceptance_images)
    print((Path(args.out) / "gpu_smoke.md").read_text())
    sys.exit(0 if record["passed"] else 1)


if __name__ == "__main__":
    main()
