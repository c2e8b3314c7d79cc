"""CLIP score (``CLIPScore``, open_clip ViT-B-32-quickgelu with the openai weights, LANTERN's recipe) and the
open_clip helpers HPSv2 shares.

The recipe is described in ``eval.metrics``; written after jadohu/LANTERN
``entrypoints/eval_fid_clip.py``. Example: ``python run.py model=janus_pro_1b eval=coco5k``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from coolsd.models.checkpoints import MissingWeightsError
from coolsd.required_files import RequiredFile
from eval.metrics.base import MeanScore, _hub_cache, _missing_hub_file
from eval.metrics.images import lantern_crop_resize, lantern_uint8_round_trip

HF_SAFE_WEIGHTS = "open_clip_model.safetensors"  # the file open_clip tries first in a hub repo, then the .bin
HF_WEIGHTS = f"{HF_SAFE_WEIGHTS}|open_clip_pytorch_model.bin"


def _register_config(model_config: str | None) -> None:
    if model_config:
        import open_clip

        path = Path(model_config).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"open_clip model config not found: {path} (looked in {path.parent.resolve()})")
        open_clip.add_model_config(str(path))


def _tokenizer(model_name: str, cache_dir: str | None):
    import open_clip

    try:
        return open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
    except OSError as err:  # an HF tokenizer whose files are not cached (offline)
        raise MissingWeightsError(f"the tokenizer of open_clip model {model_name} is not available ({err}); "
                                  f"fetch its files with hf download <its repo> on a machine with network "
                                  f"access") from err


class CLIPScore(MeanScore):
    """Mean cosine similarity between open_clip image and text embeddings, LANTERN's recipe."""

    key = "clip_score"

    def __init__(self, model_name: str = "ViT-B-32-quickgelu", pretrained: str | None = "openai",
                 prefix: str = "A photo depicts ", image_size: int | None = 256, model_config: str | None = None,
                 batch_size: int = 32, cache_dir: str | None = None) -> None:
        """``model_name``: any open_clip name (also ``hf-hub:`` / ``local-dir:``); ``pretrained``: an open_clip
        tag, a local weights file, or None (random weights: tests only); ``image_size``: LANTERN's crop +
        LANCZOS size before the model's preprocessing (None: the raw image); ``model_config``: an extra
        open_clip model JSON to register (its file stem is the name); ``cache_dir``: open_clip's hub cache
        (default: the Hugging Face cache)."""
        self.model_name, self.pretrained, self.prefix, self.image_size = model_name, pretrained, prefix, image_size
        self.model_config, self.batch_size, self.cache_dir = model_config, batch_size, cache_dir
        self._model = None

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The weights ``preflight`` resolves: an open_clip tag's hub file (``ViT-B-32-quickgelu`` / ``openai``:
        ``timm/vit_base_patch32_clip_224.openai``), an ``hf-hub:`` repo, a ``local-dir:`` folder or a local file.
        Tags served only by URL, and tokenizers (open_clip ships the CLIP BPE), are left to open_clip."""
        import open_clip

        name, pretrained, cache = str(cfg.get("model_name", "ViT-B-32-quickgelu")), cfg.get("pretrained"), \
            cfg.get("cache_dir")
        if name.startswith("local-dir:"):
            return [RequiredFile("CLIP score model", local=name.removeprefix("local-dir:"),
                                 must_have=("open_clip_config.json",))]
        if name.startswith("hf-hub:"):
            return [RequiredFile("CLIP score model", repo_id=name.removeprefix("hf-hub:"), cache_dir=cache,
                                 patterns=("open_clip_config.json", HF_SAFE_WEIGHTS),
                                 must_have=("open_clip_config.json", HF_SAFE_WEIGHTS))]
        if not pretrained:
            return []
        _register_config(cfg.get("model_config"))
        tag = open_clip.get_pretrained_cfg(name, str(pretrained)) if open_clip.get_model_config(name) else {}
        if tag:
            hub = tag.get("hf_hub", "")
            if not hub:
                return []
            repo, filename = os.path.split(hub)  # "org/name/" (open_clip's default file) or "org/name/file"
            return [RequiredFile(f"CLIP score weights ({name}, {pretrained})", repo_id=repo, cache_dir=cache,
                                 filename=filename or HF_WEIGHTS)]
        return [RequiredFile("CLIP score weights", local=str(pretrained),
                             manual="set eval.metrics.<i>.pretrained to an open_clip tag or a weights file")]

    def preflight(self) -> None:
        """Resolve the model config, the weights (download or cache) and the tokenizer; refuse a GELU/QuickGELU
        mismatch between the architecture and the pretrained tag."""
        import open_clip

        _register_config(self.model_config)
        setting = "eval.metrics.<i>.pretrained=<file> (eval=coco5k: eval.metrics.1.pretrained=<file>)"
        if self.model_name.startswith("local-dir:"):
            folder = Path(self.model_name.removeprefix("local-dir:")).expanduser()
            if not (folder / "open_clip_config.json").is_file():
                raise MissingWeightsError(f"open_clip local-dir model: {folder / 'open_clip_config.json'} not found")
        elif self.model_name.startswith("hf-hub:"):
            from open_clip.pretrained import download_pretrained_from_hf

            repo = self.model_name.removeprefix("hf-hub:")
            try:
                download_pretrained_from_hf(repo, filename="open_clip_config.json", cache_dir=self.cache_dir)
                download_pretrained_from_hf(repo, cache_dir=self.cache_dir)
            except (FileNotFoundError, OSError) as err:
                raise _missing_hub_file("CLIP score weights", repo, "open_clip_model.safetensors",
                                        _hub_cache(self.cache_dir), setting) from err
        else:
            model_cfg = open_clip.get_model_config(self.model_name)
            if model_cfg is None:
                raise ValueError(f"CLIP score: unknown open_clip model {self.model_name!r} (register a JSON with "
                                 f"model_config=<file>); known: {', '.join(open_clip.list_models()[:12])}, ...")
            if self.pretrained:
                tag = open_clip.get_pretrained_cfg(self.model_name, self.pretrained)
                if tag:
                    if tag.get("quick_gelu", False) != model_cfg.get("quick_gelu", False):
                        raise ValueError(
                            f"CLIP score: the {self.pretrained!r} weights were trained with "
                            f"{'QuickGELU' if tag.get('quick_gelu') else 'GELU'} but open_clip builds "
                            f"{self.model_name} with {'QuickGELU' if model_cfg.get('quick_gelu') else 'GELU'}: "
                            f"use model_name={self.model_name.removesuffix('-quickgelu')}"
                            f"{'' if model_cfg.get('quick_gelu') else '-quickgelu'}")
                    self._resolve_tag(tag, setting)
                else:
                    path = Path(self.pretrained).expanduser()
                    if not path.is_file():
                        raise MissingWeightsError(
                            f"CLIP score weights: {self.pretrained!r} is neither an open_clip tag of "
                            f"{self.model_name} ({open_clip.list_pretrained_tags_by_model(self.model_name)}) nor an "
                            f"existing file (looked at {path.resolve()}); set {setting}")
        _tokenizer(self.model_name, self.cache_dir)

    def _resolve_tag(self, tag: dict, setting: str) -> str:
        import open_clip

        try:
            return open_clip.download_pretrained(tag, cache_dir=self.cache_dir)
        except (FileNotFoundError, OSError, RuntimeError) as err:
            hub = tag.get("hf_hub", "")
            if hub:  # "org/name/" (open_clip's default file names) or "org/name/file"
                repo, filename = hub.rsplit("/", 1)
                filename = filename or "open_clip_model.safetensors"
                raise _missing_hub_file(f"CLIP score weights ({self.model_name}, {self.pretrained})", repo, filename,
                                        _hub_cache(self.cache_dir), setting) from err
            raise MissingWeightsError(f"CLIP score weights ({self.model_name}, {self.pretrained}) could not be fetched "
                                      f"from {tag.get('url')} ({err}); download it there and set {setting}") from err

    def _load(self, device: torch.device):
        """(model, preprocess, tokenizer), built once."""
        if self._model is None:
            import open_clip

            self.preflight()
            model, _, preprocess = open_clip.create_model_and_transforms(self.model_name, pretrained=self.pretrained,
                                                                         cache_dir=self.cache_dir)
            self._model = (model.eval(), preprocess, _tokenizer(self.model_name, self.cache_dir))
        model, preprocess, tokenizer = self._model
        return model.to(device), preprocess, tokenizer

    def image(self, path: str | Path):
        """The PIL image CLIP's preprocessing receives: LANTERN's crop, LANCZOS and uint8 round trip."""
        from PIL import Image

        with Image.open(path) as im:
            im = im.convert("RGB")
            if self.image_size is None:
                return im.copy()
            return lantern_uint8_round_trip(lantern_crop_resize(im, self.image_size))

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        """(N,) cosine similarity of each image with its prefixed prompt."""
        if len(image_paths) != len(prompts):
            raise ValueError(f"CLIP score: {len(image_paths)} images but {len(prompts)} prompts")
        model, preprocess, tokenizer = self._load(device)
        out = []
        for start in range(0, len(image_paths), self.batch_size):
            paths = image_paths[start : start + self.batch_size]
            images = torch.stack([preprocess(self.image(p)) for p in paths]).to(device)  # (B, 3, H, W)
            texts = tokenizer([self.prefix + t for t in prompts[start : start + self.batch_size]]).to(device)
            img = torch.nn.functional.normalize(model.encode_image(images).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts).float(), dim=-1)
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out).double().numpy()

    def details(self, n: int) -> dict[str, Any]:
        return {"clip_num_images": n, "clip_model": f"{self.model_name}/{self.pretrained}"}
