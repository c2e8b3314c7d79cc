"""Where a sweep stands: one line per row (done, running, requeued, stale, failed, not started), then a total.

Reads the sweep folder alone (no SLURM command), so it also works on a copy of it;
``eval/report/sweep_status.py`` says how each state is decided. When rows failed or went stale it then prints the
command that resubmits only those rows (the sweep's own launcher options and folder; the running rows are left
alone). Exit code 0 when every row is done, 1 otherwise, 2 when the folder holds no run.

Examples::

    python run.py -m hydra/launcher=slurm experiment=table_llamagen
    python scripts/status.py results/runs/table_llamagen
    python scripts/status.py results/runs/table_llamagen/row=sjd     # one row
    watch -n 60 python scripts/status.py results/runs/table_llamagen
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.report.sweep_status import StatusError, report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a sweep folder (hydra.sweep.dir, e.g. results/runs/<experiment>), a folder "
                        "of sweeps, or one run folder")
    args = parser.parse_args(argv)
    try:
        text, code = report(args.folder)
    except StatusError as err:
        print(f"status: {err}", file=sys.stderr)
        return 2
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
