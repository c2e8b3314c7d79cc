"""HPSv2.1 (``HPSv2``): open_clip ViT-H-14 with HPSv2's weights and HPSv2's own image path.

Written after tgxs002/HPSv2 ``hpsv2/img_score.py``,
``hpsv2/src/open_clip/transform.py``, ``hpsv2/src/open_clip/factory.py``.
Example: ``python run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k_hps``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from coolsd.models.checkpoints import MissingWeightsError
from coolsd.required_files import RequiredFile
from eval.metrics.base import HPS_FILES, HPS_REPO, MeanScore, _hub_cache, _missing_hub_file
from eval.metrics.clip import _register_config, _tokenizer


def hps_image_tensor(image, size: int, antialias: bool = True) -> torch.Tensor:
    """HPSv2's scoring transform (light augmentation, eval): RGB, to float, the longest side bicubic to
    ``size`` (lengths rounded), zero padding to a centred square, OpenAI mean/std -> (3, size, size).

    ``antialias``: HPSv2 leaves it to torchvision's default for tensors (True since torchvision 0.17)."""
    import torchvision.transforms.functional as TF
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from torchvision.transforms import InterpolationMode

    x = TF.to_tensor(image.convert("RGB"))  # (3, H, W) in [0, 1]
    h, w = x.shape[1:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        x = TF.resize(x, [round(h * scale), round(w * scale)], interpolation=InterpolationMode.BICUBIC,
                      antialias=antialias)
    pad_h, pad_w = size - x.shape[1], size - x.shape[2]
    x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(x, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)


def load_hps_state(model: nn.Module, state: dict[str, torch.Tensor], assign: bool = False) -> None:
    """Load an HPSv2 ``state_dict`` into an open_clip CLIP strictly (as HPSv2's scorer does)."""
    result = model.load_state_dict(state, strict=False, assign=assign)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"HPSv2 checkpoint does not fit the open_clip model: missing {result.missing_keys[:8]} "
                         f"({len(result.missing_keys)}), unexpected {result.unexpected_keys[:8]} "
                         f"({len(result.unexpected_keys)})")


class HPSv2(MeanScore):
    """Human Preference Score v2 (v2.1 by default): open_clip ViT-H-14 with HPSv2's weights, mean score."""

    key = "hps_v2"

    def __init__(self, pretrained: str = f"hub:{HPS_REPO}", version: str = "v2.1", model_name: str = "ViT-H-14",
                 model_config: str | None = None, batch_size: int = 16, antialias: bool = True,
                 amp: bool = False) -> None:
        """``pretrained``: ``hub:<repo>`` (the version's file from that Hugging Face repo, cached) or a local
        checkpoint (a dict with ``state_dict``); ``model_config``: an extra open_clip JSON (tests register a
        tiny one); ``amp``: score under CUDA autocast (fp16) as ``hpsv2.score`` does on a GPU (default fp32)."""
        if version not in HPS_FILES:
            raise ValueError(f"HPSv2 version must be one of {sorted(HPS_FILES)}, got {version!r}")
        self.pretrained, self.version = pretrained, version
        self.model_name, self.model_config = model_name, model_config
        self.batch_size, self.antialias, self.amp = batch_size, antialias, amp
        self._model = None

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The version's checkpoint: ``HPS_v2.1_compressed.pt`` of ``hub:<repo>``, or the local file (the
        ViT-H-14 tokenizer ships with open_clip)."""
        pretrained = str(cfg.get("pretrained", f"hub:{HPS_REPO}"))
        filename = HPS_FILES.get(cfg.get("version", "v2.1"), HPS_FILES["v2.1"])
        if pretrained.startswith("hub:"):
            return [RequiredFile("HPSv2 weights", repo_id=pretrained.removeprefix("hub:"), filename=filename)]
        return [RequiredFile("HPSv2 weights", local=pretrained, manual=f"hf download {HPS_REPO} {filename}")]

    def checkpoint(self) -> str:
        """The checkpoint's local path (downloaded into the Hugging Face cache when online)."""
        setting = "eval.metrics.<i>.pretrained=<file>"
        if self.pretrained.startswith("hub:"):
            from huggingface_hub import hf_hub_download

            repo, filename = self.pretrained.removeprefix("hub:"), HPS_FILES[self.version]
            try:
                return hf_hub_download(repo_id=repo, filename=filename)
            except OSError as err:  # LocalEntryNotFoundError offline, network errors
                raise _missing_hub_file(f"HPSv2 ({self.version}) weights", repo, filename, _hub_cache(None),
                                        setting) from err
        path = Path(self.pretrained).expanduser()
        if not path.is_file():
            raise MissingWeightsError(f"HPSv2 weights not found: {path} (looked in {path.parent.resolve()}). On a "
                                      f"machine with network access run: hf download {HPS_REPO} "
                                      f"{HPS_FILES[self.version]}")
        return str(path)

    def preflight(self) -> None:
        import open_clip

        _register_config(self.model_config)
        if open_clip.get_model_config(self.model_name) is None:
            raise ValueError(f"HPSv2: unknown open_clip model {self.model_name!r}")
        self.checkpoint()
        _tokenizer(self.model_name, None)

    def _load(self, device: torch.device):
        if self._model is None:
            import open_clip

            from coolsd.models.checkpoints import load_state_dict

            self.preflight()
            model = open_clip.create_model(self.model_name, pretrained=None)
            load_hps_state(model, load_state_dict(self.checkpoint(), nested_keys=("state_dict",)))
            self._model = (model.eval(), _tokenizer(self.model_name, None))
        model, tokenizer = self._model
        return model.to(device), tokenizer

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        """(N,) HPS of each image with its raw prompt."""
        from PIL import Image

        if len(image_paths) != len(prompts):
            raise ValueError(f"HPSv2: {len(image_paths)} images but {len(prompts)} prompts")
        model, tokenizer = self._load(device)
        size = model.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else size
        out = []
        for start in range(0, len(image_paths), self.batch_size):
            images = []
            for path in image_paths[start : start + self.batch_size]:
                with Image.open(path) as im:
                    images.append(hps_image_tensor(im, size, self.antialias))
            texts = tokenizer(list(prompts[start : start + self.batch_size])).to(device)
            with torch.autocast(device.type, dtype=torch.float16, enabled=self.amp and device.type == "cuda"):
                img = model.encode_image(torch.stack(images).to(device), normalize=True).float()
                txt = model.encode_text(texts, normalize=True).float()
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out).double().numpy()

    def details(self, n: int) -> dict[str, Any]:
        return {"hps_v2_num_images": n, "hps_version": self.version}
