"""Anole-7b (Chern et al., 2024, arXiv 2407.06135), a Chameleon-7B fine-tuned to generate images, as an adapter.

Anole shares Lumina-mGPT's architecture (``transformers``' Chameleon layers, Meta's Chameleon vocabulary and VQGAN), so
this adapter is ``LuminaMGPT`` (``coolsd.models.lumina_mgpt``) with Anole's sequence layout; the network, the
vocabulary map, the weights loader, the VQGAN decoder and the EAGLE draft layer are Lumina-mGPT's. What differs:

* **Grid.** A plain 32 x 32 grid of 1,024 image codes at 512 px, with **no end-of-row tokens** (Anole's image-only
  mode samples 1,024 image tokens between ``<racm3:break>`` and ``<eoss>``); the KV cache holds one slot per image
  token, on both decode paths (``static_forward`` over a ``StaticKVCache`` or the static path's ``DeviceKVCache``).
* **Image-token constraint.** Only the 8,192 image tokens (Chameleon ids 4..8195, read from the vocabulary's
  ``IMGIMG..Z`` names) may be sampled inside an image: LANTERN sets every other logit (ids 0..3 and 8196..65535)
  to the minimum; the harness's head computes the image-code rows only, which is the same distribution.
* **Prompt** (``model.prompt_template``). ``[<s>] + text + <reserved08706> + <racm3:break>``: the end-of-turn token
  and the image start are written, never sampled (LANTERN ``models/ea_model_anole.py`` ``generate``: BOS, the raw
  prompt, ids 8710 and 8197; GAIR's ``text2image.py`` the same through ``<END-OF-TURN>`` and its ``ImageDecoder``
  appending ``begin_image``). ``{prompt}`` (default) is LANTERN's and GAIR's raw prompt; the SJD reference and
  PathSpec, which carries its Anole path (``model_wrappers/model_loader.py`` ``get_anole_forward_func``), use
  ``"Generate an image of {prompt}"`` and sample the image start (here always written).
* **CFG** (``model.uncond_context``). Two streams, ``u + s(c - u)`` on image-code logits. The unconditional stream
  is ``[<s>, <racm3:break>]`` at positions 0, 1, its image tokens from 2 (``bos``, default: LANTERN's
  ``uncond_tokens``/``uncond_position_ids``, and GAIR's ``_split_inputs_for_cfg``, whose image-conditioned stream
  equals the unconditional one for a text-only prompt); ``end_of_turn``: ``[<reserved08706>, <racm3:break>]``, as
  SJD's and PathSpec's CFG masks every prompt slot but the last (``prepare_cfg_input``:
  ``attention_mask[B//2:, :L-1] = 0``, positions from the mask's cumulative sum).
* **Sampling** (``configs/model/anole_7b.yaml``): LANTERN's ``generate_images.py`` (CFG 3.0, top-k 2000,
  temperature 1.0, top-p 1.0), which SJD's and PathSpec's ``eval_model.py`` also use (guidance 3.0, image top-k
  2000, temperature 1.0). GAIR's own recipe samples with temperature 0.7 and top-p 0.9, no top-k (``Options.Image``).

Weights: the language model from ``leloy/Anole-7b-v0.1-hf`` (the transformers conversion LANTERN, SJD and PathSpec
load; config, index and safetensors shards, ``model.vqmodel.*`` skipped), Meta's tokenizer files
(``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt``) from ``GAIR/Anole-7b-v0.1``'s ``tokenizer/`` folder, both
on the Hugging Face hub (or ``model.tokenizer_dir=<folder>`` for a local copy). ``pretrained=false`` builds random
weights of the sizes in ``random_init`` with a vocabulary and word-level tokenizer made in code (tests).

Written after jadohu/LANTERN ``models/ea_model_anole.py``, ``entrypoints/generate_images.py``,
tyshiwo1/Accelerating-T2I-AR-with-SJD and Haodong-Lei-Ray/PathSpec ``model_wrappers/model_loader.py``,
``scheduler/jacobi_iteration_anhole.py``, ``scheduler/jacobi_iteration_lumina_mgpt.py`` and GAIR-NLP/anole
``text2image.py``, ``chameleon/inference/chameleon.py``; studied, not copied.

Example: ``python run.py model=anole_7b decoder=coolsd``; ``python run.py model=anole_tiny`` (random weights).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from coolsd.kv_cache import StaticKVCache
from coolsd.models.base import ImageARModel, Runtime, stream_rows
from coolsd.models.checkpoints import MissingWeightsError, hub_file
from coolsd.models.lumina_mgpt import (
    LM_PATTERNS,
    TOKENIZER_FILES,
    TOKENIZER_HINT,
    LuminaMGPT,
    RandomInit,
    chameleon_tokenizer_files,
)
from coolsd.required_files import RequiredFile
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput

#: ``model.uncond_context``: the token before ``<racm3:break>`` in the unconditional CFG stream
UNCOND_CONTEXTS = ("bos", "end_of_turn")
TOKENIZER_FOLDER = "tokenizer"  # GAIR/Anole-7b-v0.1's folder of Meta's tokenizer files


class Anole(LuminaMGPT):
    """Anole text-to-image adapter (see the module docstring); prompts are free text."""

    stand_in_is_end_of_row = False  # no end-of-row tokens: a new row's first code follows the row above's last
    runtime_defaults = Runtime()  # PyTorch's SDPA dispatch and TF32 defaults; Meta's tokenizer truncates pixels
    model_name = "Anole"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the language model's config, index and shards (``hub_repo``) and Meta's tokenizer
        files, from ``tokenizer_repo``'s ``tokenizer/`` folder on the hub or the local ``tokenizer_dir``."""
        if not cfg.get("pretrained", True):
            return []
        repo = str(cfg.get("hub_repo", "leloy/Anole-7b-v0.1-hf"))
        language = RequiredFile("Anole language model", repo_id=repo, patterns=LM_PATTERNS,
                                revision=cfg.get("revision"),
                                must_have=("config.json", "model.safetensors.index.json"))
        if cfg.get("tokenizer_dir"):
            return [language, RequiredFile("Chameleon tokenizer + VQGAN", local=str(cfg["tokenizer_dir"]),
                                           must_have=("text_tokenizer.json", "vqgan.yaml",
                                                      "vqgan.ckpt|vqgan.safetensors"), manual=TOKENIZER_HINT)]
        names = tuple(f"{TOKENIZER_FOLDER}/{name}" for name in TOKENIZER_FILES)
        return [language, RequiredFile("Chameleon tokenizer + VQGAN (Anole's copy)",
                                       repo_id=str(cfg.get("tokenizer_repo", "GAIR/Anole-7b-v0.1")), patterns=names,
                                       revision=cfg.get("tokenizer_revision"), must_have=names)]

    def __init__(
        self,
        sampling: dict | SamplingConfig,
        width: int = 512,
        height: int = 512,
        pretrained: bool = True,
        hub_repo: str = "leloy/Anole-7b-v0.1-hf",
        revision: str | None = None,
        tokenizer_repo: str = "GAIR/Anole-7b-v0.1",
        tokenizer_revision: str | None = None,
        tokenizer_dir: str | None = None,
        random_init: dict | RandomInit | None = None,
        prompt_template: str = "{prompt}",
        uncond_context: str = "bos",
        prompt_capacity: int = 256,
        runtime: Runtime | None = None,
    ) -> None:
        """Reference options (module docstring): ``prompt_template`` (``{prompt}`` is replaced by the prompt),
        ``uncond_context`` (``bos`` | ``end_of_turn``). ``tokenizer_repo`` / ``tokenizer_revision``: where Meta's
        tokenizer files are fetched when ``tokenizer_dir`` is not set. ``prompt_capacity``: the prefix width of
        the static decode path's prefill (BOS, template, end of turn and image start included)."""
        if uncond_context not in UNCOND_CONTEXTS:
            raise ValueError(f"model.uncond_context must be one of {UNCOND_CONTEXTS}, got {uncond_context!r}")
        if not isinstance(prompt_template, str) or "{prompt}" not in prompt_template:
            raise ValueError(f"model.prompt_template must contain {{prompt}}, got {prompt_template!r}")
        # read by tokenizer_files during LuminaMGPT's constructor (plain attributes: allowed before Module.__init__)
        self.prompt_template, self.uncond_context = prompt_template, uncond_context
        self.tokenizer_repo, self.tokenizer_revision = tokenizer_repo, tokenizer_revision
        super().__init__(sampling, width=width, height=height, pretrained=pretrained, hub_repo=hub_repo,
                         revision=revision, tokenizer_dir=tokenizer_dir, random_init=random_init, header="forced",
                         prompt_capacity=prompt_capacity, runtime=runtime)

    def tokenizer_files(self, tokenizer_dir: str | None) -> dict[str, Path]:
        """Meta's tokenizer files: from ``tokenizer_dir`` when set, else ``tokenizer/`` of ``tokenizer_repo`` on the
        hub (downloaded when online); one error lists every file that is not available."""
        if tokenizer_dir:
            return chameleon_tokenizer_files(tokenizer_dir)
        files, errors = {}, []
        for name in TOKENIZER_FILES:
            try:
                files[name] = Path(hub_file(self.tokenizer_repo, f"{TOKENIZER_FOLDER}/{name}",
                                            revision=self.tokenizer_revision))
            except MissingWeightsError as err:
                errors.append(str(err))
        if errors:
            raise MissingWeightsError("; ".join(errors) + " (or set model.tokenizer_dir=<folder> holding "
                                      f"{', '.join(TOKENIZER_FILES)})")
        return files

    # -- prompts ---------------------------------------------------------------------------------------------
    def text_ids(self, prompt: str) -> list[int]:
        """BOS, the templated prompt and the end of turn (``<reserved08706>``)."""
        body = self.tokenizer.encode(self.prompt_template.format(prompt=prompt), add_special_tokens=False)
        return [self.vocabulary.bos, *body, self.vocabulary.end_of_turn]

    def image_header(self) -> list[int]:
        """``<racm3:break>`` alone: Anole's images have no size tokens."""
        return [self.vocabulary.image_start]

    def unconditional_ids(self) -> list[int]:
        """``[<s>, <racm3:break>]`` (``uncond_context=bos``) or ``[<reserved08706>, <racm3:break>]``."""
        first = self.vocabulary.bos if self.uncond_context == "bos" else self.vocabulary.end_of_turn
        return [first, self.vocabulary.image_start]

    # -- one slot per image token, on both paths ---------------------------------------------------------------
    def _eager_cache(self, kv: StaticKVCache, position_base: torch.Tensor) -> StaticKVCache:
        """The prefill's cache itself: image token ``i`` at slot ``prefix_len + i`` (positions: ``static_forward``)."""
        return kv

    static_cache = ImageARModel.static_cache  # no structural slots: ``DeviceKVCache.of`` the prefill's cache

    @torch.inference_mode()
    def forward_block(self, cache: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                      tree_mask: torch.Tensor | None = None) -> TargetOutput:
        with self.decode_context():
            return self.static_forward(cache, tokens.to(self.device), positions.to(self.device), tree_mask)

    def static_forward(self, cache: Any, tokens: torch.Tensor, positions: torch.Tensor,
                       tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """``forward_block`` without its context and copies, over the prefill's ``StaticKVCache`` or the static
        path's ``DeviceKVCache``: image token ``i`` of a stream sits at that stream's prompt length + ``i`` (the
        prompt lengths read on the device from the prefix's padding), both streams fed the same codes."""
        s = self.num_streams
        base = cache.key_valid[:, :cache.prefix_len].sum(-1)  # (B·S,) each stream's prompt length
        seq = base[:, None] + stream_rows(positions, s)  # (B·S, T)
        mask = cache.begin_block(tokens.shape[1], tree_mask)
        hidden = self._hidden(stream_rows(self.code_to_bpe[tokens], s), seq, cache, mask)
        return self._output(hidden)
