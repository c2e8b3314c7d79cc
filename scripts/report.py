"""A run's or sweep's report as one static page (``<folder>/report.html``: tables, trade-off plots, evaluation card,
verdicts, missing rows, a paged gallery of every image), or the qualitative figure of a paper (``--figure``).

``eval/report/html_page.py`` says what the page holds; it opens offline, from the folder (it links the run's
images).

Examples::

    python scripts/report.py outputs/2026-12-04/21-20-00
    python scripts/report.py results/runs/sweep_coolsd_delta
    python scripts/report.py results/bench/embedded_batch_sweep.md      # a benchmark page as HTML, its figures shown
    python scripts/report.py --figure outputs/2026-12-04/21-20-00 --prompts 0 5 12 --decoders ar sd coolsd --out fig
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.report.html_page import PAGE_SIZE, ReportError, write_figure, write_report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a run folder (hydra.run.dir) or a sweep folder (hydra.sweep.dir); or a "
                        "benchmark page (results/bench/<name>.md), written again as <name>.html")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, help="prompts per gallery page (default 20)")
    figure = parser.add_argument_group("the paper figure (--figure)")
    figure.add_argument("--figure", action="store_true", help="write a PDF and PNG grid of prompts × decoders instead")
    figure.add_argument("--prompts", type=int, nargs="+", metavar="I", help="image indices, one row each (prompt i, "
                        "seed eval.seed + i)")
    figure.add_argument("--decoders", nargs="+", metavar="ID", help="gallery column ids, one column each (default: "
                        "all; a sweep's decoder of several rows is <decoder>@<job number>)")
    figure.add_argument("--out", default=None, help="writes OUT.pdf and OUT.png (default <folder>/figure)")
    figure.add_argument("--width", type=float, default=7.0, help="inches (default 7: a two-column paper's text width)")
    figure.add_argument("--dpi", type=int, default=300, help="the PNG's resolution (default 300)")
    figure.add_argument("--stats", action="store_true", help="each image's accepted length (and TV) under it")
    args = parser.parse_args(argv)
    try:
        if args.folder.endswith(".md") and Path(args.folder).is_file():
            from eval.report.bench_page import write_bench_page

            print(f"report -> {write_bench_page(args.folder)}")
        elif args.figure:
            if not args.prompts:
                parser.error("--figure needs --prompts (image indices, e.g. --prompts 0 5 12)")
            out = args.out or str(Path(args.folder) / "figure")
            paths = write_figure(args.folder, args.prompts, args.decoders, out, width_in=args.width, dpi=args.dpi,
                                 stats=args.stats)
            print(f"figure: {len(args.prompts)} prompts x {len(args.decoders or []) or 'all'} decoders -> "
                  + ", ".join(str(p) for p in paths))
        else:
            print(f"report -> {write_report(args.folder, page_size=args.page_size)}")
    except ReportError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
