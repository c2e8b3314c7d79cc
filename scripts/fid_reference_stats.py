"""FID reference statistics of an image folder under this harness's protocol, as clean-fid's ``.npz`` (``mu``,
``sigma``): what ``eval=coco30k`` (and any ``eval.metrics.<i>.reference_stats``) scores against. Logic:
``eval/metrics/fid.py`` ``write_reference_stats``.

Examples::

    python scripts/fid_reference_stats.py $COCO_DIR/val2014 --out $COCO_DIR/fid_stats_coco2014_val_clean256.npz
    python scripts/fid_reference_stats.py $COCO_DIR/val2017 --out coco5k_stats.npz --device cuda
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.metrics.fid import write_reference_stats  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the reference images (e.g. MS-COCO val2014)")
    parser.add_argument("--out", required=True, help="the .npz to write")
    parser.add_argument("--protocol", default="clean", choices=("clean", "torch_fidelity"))
    parser.add_argument("--image-size", type=int, default=256, help="the square size before the Inception (256)")
    parser.add_argument("--max-reference", type=int, default=None, help="at most this many images (name order)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    n, path = write_reference_stats(args.folder, args.out, args.protocol, args.image_size, args.max_reference,
                                    device=args.device)
    print(f"wrote {path}: mu and sigma of {n} images ({args.protocol} protocol, {args.image_size} px); give "
          f"eval.metrics.0.reference_stats={path} eval.metrics.0.reference_count={n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
