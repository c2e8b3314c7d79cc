"""The one GPU command: the static decode path measured on a GPU in one call, under a time budget.

Runs the default plan (``eval.bench.gpu.steps``: preflight, blocks, captured AR, captured iterations, one eager AR
image, throughput) or the named ``--steps``, printing the plan's estimate first and the goals last, writing
``gpu.json``, ``gpu.md`` and ``gpu_step_seconds.json`` into ``--out`` after every image. Imports only what the
offline GPU nodes' Python holds; ``--dry-run`` rehearses on a CPU with every package the node lacks blocked.

Examples::

    python scripts/gpu.py --out results/bench/h200 --budget 300        # on the GPU node
    python scripts/gpu.py --dry-run --out /tmp/gpu                      # the CPU rehearsal
    python scripts/gpu.py --fetch-wheels                                # the wheels the named bench steps need
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.bench.gpu import node  # noqa: E402  (standard library only: it may block imports before the rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_run", help="folder for gpu.{json,md} and gpu_step_seconds.json")
    parser.add_argument("--steps", default=None, help="comma-separated step names (default: the default plan)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; checked before every image")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, imports the node lacks blocked")
    parser.add_argument("--no-block", action="store_true", help="with --dry-run: do not block imports")
    parser.add_argument("--wheels", action="store_true", help="with --dry-run: count the carried wheels (Hydra, "
                        "OmegaConf, ftfy) as installed, as on a node after their install line")
    parser.add_argument("--keep-going", action="store_true", help="go on after a failed preflight")
    parser.add_argument("--list", action="store_true", help="list the steps and the plan's estimate, run nothing")
    parser.add_argument("--fetch-wheels", nargs="?", const=node.WHEEL_FOLDER, default=None, metavar="DIR",
                        help=f"download/build the wheels the Hydra steps need into DIR ({node.WHEEL_FOLDER}) and stop")
    args = parser.parse_args()
    if args.fetch_wheels:
        wheels = node.fetch_wheels(args.fetch_wheels)
        print("\n".join(f"{w.name} ({w.stat().st_size / 2**10:.0f} KiB)" for w in wheels))
        print(f"on the node: {node.INSTALL_LINE}")
        return
    if args.dry_run and not args.no_block:
        node.block_imports(node.missing_modules(present=node.wheel_names() if args.wheels else ()))
    from eval.bench.gpu.plan import load_table, plan_lines, run_plan
    from eval.bench.gpu.steps import STEPS, default_steps

    names = args.steps.split(",") if args.steps else [s.name for s in default_steps()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; choose from {','.join(STEPS)}")
    steps = [STEPS[n] for n in names]
    if args.list:
        print("\n".join(f"{s.name:<18} {'default' if s.default else 'named  '} {s.doc}" for s in STEPS.values()))
        print("\n".join(plan_lines(load_table(), steps, args.budget)))
        return
    if not args.dry_run:
        from coolsd.device import cuda_available, cuda_diagnosis

        if not cuda_available():
            raise SystemExit(f"scripts/gpu.py needs a GPU ({cuda_diagnosis()}); --dry-run rehearses on the CPU")
    report = run_plan(args.out, steps, budget=args.budget, dry_run=args.dry_run, keep_going=args.keep_going)
    failed = [name for name, state in report["steps"].items() if state["status"].startswith("failed")]
    if failed:
        raise SystemExit(f"failed steps: {', '.join(failed)} (see {Path(args.out) / 'gpu.md'})")


if __name__ == "__main__":
    main()
