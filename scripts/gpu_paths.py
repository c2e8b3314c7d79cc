"""Both decode paths on a GPU (eager, static, captured): LlamaGen T2I-XL 512 px, random bf16 weights, one process.

The measurement lives in ``eval.bench.gpu_paths`` (its steps, the goals and the report); this entry point parses the
options and prints where the report went. Each step runs under the run's budget (``--budget``, default 360 s, the
GPU issue's six minutes): a step that starts after it is skipped and said so.

Example: ``python scripts/gpu_paths.py --out results/bench/h100``; ``--allow-cpu`` runs the same steps on the tiny
model on a CPU (only to test the script).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.bench.gpu_paths import STEPS, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_paths.{json,md}")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {','.join(STEPS)}")
    parser.add_argument("--images", type=int, default=2, help="timed images per decoder and path (after a warm-up)")
    parser.add_argument("--repeats", type=int, default=20, help="replays per captured block")
    parser.add_argument("--budget", type=float, default=360.0, help="seconds after which no step starts")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU with the tiny model (a dry run)")
    args = parser.parse_args()
    steps = tuple(s for s in args.steps.split(",") if s)
    unknown = set(steps) - set(STEPS)
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; choose from {','.join(STEPS)}")
    report = run(args.out, steps, allow_cpu=args.allow_cpu, images=args.images, repeats=args.repeats,
                 budget=args.budget)
    states = ", ".join(f"{step}: {state['status']}" for step, state in report["steps"].items())
    print(f"{states}; report in {Path(args.out) / 'gpu_paths.md'}")


if __name__ == "__main__":
    main()
