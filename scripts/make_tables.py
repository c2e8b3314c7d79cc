"""Paper-style tables and trade-off plots from run records (``run.json``), beside the published numbers.

Reads every ``run.json`` under the given result folders (or the runs of a W&B project) and writes
``<out>/tables/<name>.{md,tex,csv}`` (``eval.report.paper_tables``: rows, intervals, bold only where
significant, the published table with ``--published``) and ``<out>/figures/<name>_*.{png,pdf}``
(``eval.report.paper_plots``: quality vs speedup with 95 % error bars and Pareto fronts, accepted length vs the
swept option, TV vs accepted length). ``<out>`` is the input folder (several: their common folder) unless
``--out`` is given. Every table's notes carry the evaluation card of its rows
(``eval/report/evaluation_card.py``); rows of one model with different cards are refused unless
``--mixed-protocols`` is given (then the caption says so and the notes list each row's differences). Each folder
given gets its ``report.html`` (``eval/report/html_page.py``: every row, missing ones flagged, the card, the
gallery).

Examples::

    python run.py -m experiment=table_llamagen
    python scripts/make_tables.py results/runs/table_llamagen --published
    python scripts/make_tables.py results/runs/sweep_coolsd_delta results/runs/sweep_lantern --name tradeoff
    python scripts/make_tables.py --wandb my-entity/coolsd --name wandb_table
    python scripts/make_tables.py --published --out /tmp/published   # the published table alone
    python scripts/make_tables.py runs/a runs/b --mixed-protocols     # rows of different evaluation cards
    python scripts/make_tables.py results/runs/table_llamagen --columns speedup batch_speedup throughput_img_s peak_mem_mb
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.report import paper_plots as plots
from eval.report import paper_tables as tables  # noqa: E402
from eval.report.html_page import ReportError, write_report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*",
                        help="result folders (searched recursively for run.json) or run.json files")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also read the runs of this W&B project")
    parser.add_argument("--name", help="table name (default: the runs' experiment_name, else 'table')")
    parser.add_argument("--out", help="writes <out>/tables/<name>.{md,tex,csv} and <out>/figures/<name>_*.{png,pdf} "
                        "(default: the result folder given, several: their common folder; the repository's "
                        "results/ only when named here)")
    parser.add_argument("--published", action="store_true",
                        help="add the published numbers as a second table (the measured decoders' rows) and the "
                             "methods not reproduced here as a third, marked 'reported', with the reason")
    parser.add_argument("--published-file", default=str(tables.PUBLISHED_CSV), help="the published numbers (CSV)")
    parser.add_argument("--columns", nargs="+", default=list(tables.DEFAULT_COLUMN_KEYS), metavar="KEY",
                        help=f"metric columns, in order, of {', '.join(tables.COLUMN_KEYS)} (default: all but "
                             f"{', '.join(tables.OPTIONAL_COLUMNS)}; those no run reports are left out)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    parser.add_argument("--mixed-protocols", action="store_true",
                        help="allow rows of one model whose evaluation cards differ (eval/report/evaluation_card.py "
                             "card_key); the caption says so and the notes list each row's differing fields")
    parser.add_argument("--mixed-hardware", action="store_true",
                        help="allow rows of one model measured on different GPU models (their latencies do not "
                             "compare); the caption says so")
    args = parser.parse_args(argv)
    try:
        written = tables.write_tables(args.paths, wandb=args.wandb, name=args.name, out=args.out,
                                      published=args.published, published_file=args.published_file,
                                      columns=args.columns, mixed_protocols=args.mixed_protocols,
                                      mixed_hardware=args.mixed_hardware)
    except tables.UsageError as err:
        parser.error(str(err))
    out, name = written.out, written.name
    print(written.tables.markdown)
    print(f"{written.records} run records, {written.rows} rows -> {out / 'tables' / name}.{{md,tex,csv}}")
    if not args.no_plots:
        figures = plots.make_plots(written.measured, out / "figures", name)
        stems = sorted({p.stem for p in figures})
        print(f"figures: {', '.join(stems) if stems else 'none (no run reports the plotted metrics)'} -> "
              f"{out / 'figures'}")
    for folder in report_folders(args.paths, out):
        try:
            print(f"report (every row, its card and the gallery) -> {write_report(folder)}")
        except ReportError as err:
            print(f"no report of {folder}: {err}", file=sys.stderr)
    return 0


def report_folders(paths: Sequence[str], out: Path) -> list[Path]:
    """The folders whose report pages to write: each run or sweep folder given, else the output folder."""
    folders = [Path(p) for p in paths if Path(p).is_dir()]
    return list(dict.fromkeys(folders)) or ([out] if any(out.rglob("run.json")) else [])


if __name__ == "__main__":
    sys.exit(main())
