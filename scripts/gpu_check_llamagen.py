"""GPU check of the LlamaGen T2I-XL adapter at real size with random weights (no downloads).

The check lives in ``eval.bench.gpu_check_llamagen`` (``run_check``: forward timings at the CFG batch of 2, bf16
vs float32 logits and guided distributions on the same weights); this entry point parses the options, prints the
report and optionally writes it as JSON.

Example: ``python scripts/gpu_check_llamagen.py --block-size 1024 --out gpu_check.json``
(also run by ``pytest -m gpu tests/test_llamagen_t2i.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coolsd.io import atomic_write_bytes  # noqa: E402
from eval.bench.gpu_check_llamagen import run_check  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-size", type=int, default=1024, help="image tokens: 256 (stage I) or 1024")
    parser.add_argument("--tokens", type=int, default=64, help="teacher-forced tokens compared bf16 vs fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="also write the report as JSON here")
    parser.add_argument("--gpt-size", type=str, default="GPT-XL", help="GPT-XL (the T2I model); smaller "
                        "sizes only smoke-test the script")
    parser.add_argument("--device", type=str, default="cuda", help="cuda (cpu only to smoke-test)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU (the CPU tests cover the tiny configuration)")
    report = run_check(block_size=args.block_size, device=args.device, seed=args.seed, tokens=args.tokens,
                       repeats=args.repeats, gpt_size=args.gpt_size)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        atomic_write_bytes(args.out, (text + "\n").encode())


if __name__ == "__main__":
    main()
