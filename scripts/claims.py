"""Decide the COOL-SD paper's claims on the runs of ``experiment=embedded_claims`` (logic: the
``eval/studies/claims/`` package).

    python run.py -m experiment=embedded_claims            # about two hours on 2 CPU cores
    python scripts/claims.py results/runs/embedded_claims --out results --export results/claims_data
    python scripts/claims.py results/claims_data --out results --readme docs/claims.md   # page, figures and the summary in docs/claims.md
                                                                                    # again, from the committed data alone
    python run.py -m experiment=embedded_claims_more ...   # more images of the deciding points (its config's header)
    python scripts/claims.py results/claims_data --extend results/runs/embedded_claims_more --out results \
        --readme docs/claims.md                            # joins them to the committed data, then the page
    python run.py -m experiment=embedded_claims_quick      # under 10 minutes
    python scripts/claims.py results/runs/embedded_claims_quick
    python scripts/claims.py results/claims_data --convert  # float16 features of earlier exports -> 8-bit, in place

Writes ``<out>/embedded_claims.md`` (verdicts, figures, the μ fit, every point and comparison with its 95 %
interval), ``<out>/embedded_claims.json``, ``<out>/embedded_claims_summary.md`` (the verdicts in short; with
``--readme`` also written into that file between its claims-summary markers) and
``<out>/figures/embedded_claims_*.{png,pdf}``. ``--out`` defaults
to the input folder. ``--export`` writes each regime's compact per-image data (``<regime>.claims.npz``: accepted
lengths, TV sums, timed latencies, classifier features quantised to 8 bits per column) and decides from it; a
folder of such files is itself a valid input, with no run folders or images. ``--extend`` adds the runs of
``experiment=embedded_claims_more`` (more images of a claim's deciding points) to that data as
``<regime>.more_<group>.claims.npz``; the page joins each to its regime's images and the claims it decides replace
the regime's. ``--convert`` rewrites FOLDER's compact data of the earlier format (float16 features) in the
quantised one, in place, and stops (``convert_compact``); the page reads both formats.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.studies.claims import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the multirun folder (one sub-folder per regime), one run, or a "
                                                  "folder of compact data (*.claims.npz)")
    parser.add_argument("--out", type=Path, default=None, help="where the page goes (default: the input folder)")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples (seed 0); Holm-corrected p needs ≥ 10,000")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also rewrite this file's claims summary (between its claims-summary markers)")
    parser.add_argument("--export", type=Path, default=None,
                        help="write the compact per-image data here (and decide from it)")
    parser.add_argument("--extend", type=Path, default=None,
                        help="the runs of experiment=embedded_claims_more: write them into FOLDER (compact data) as "
                             "<regime>.more_<group>.claims.npz, then decide from FOLDER (each joins its regime)")
    parser.add_argument("--convert", action="store_true",
                        help="rewrite FOLDER's *.claims.npz with float16 features as 8-bit ones, in place, and stop")
    args = parser.parse_args()
    if args.convert:
        from eval.studies.claims import COMPACT_SUFFIX, convert_compact

        for path in sorted(args.folder.glob(f"*{COMPACT_SUFFIX}")):
            before, after = convert_compact(path)
            print(f"{path}: {before:,} -> {after:,} bytes")
        return
    out = args.out or args.folder
    if args.extend is not None:
        from eval.studies.claims import export_more

        for path in export_more(args.extend, args.folder, device=args.device):
            print(f"more images of deciding points -> {path}")
    command = "python scripts/claims.py " + " ".join(sys.argv[1:])
    record = run(args.folder, out, resamples=args.resamples, command=command, device=args.device,
                 export=args.export, readme=args.readme)
    for regime, claims in record["claims"].items():
        print(regime + ": " + "; ".join(f"{c['key']} {c['verdict']}" for c in claims))
    print(f"-> {out / 'embedded_claims.md'}")


if __name__ == "__main__":
    main()
