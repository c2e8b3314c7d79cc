"""LlamaGen text-to-image (T2I-XL, stage I 256 px / stage II 512 px): flan-t5-xl captions -> VQ-16 codes.

The adapter of the first model of the COOL-SD tables, written after FoundationVision/LlamaGen (MIT):
``autoregressive/sample/sample_t2i.py`` (caption pipeline and defaults), ``language/t5.py`` (T5 features
and the training-time caption cleaning) and ``autoregressive/models/generate.py`` (prefill masks and CFG).
It shares the GPT, cache, blocks, head and VQ with the class-conditional adapter
(``coolsd.models.llamagen.LlamaGenAdapter``); what it adds is the caption prefix:

1. the prompt is cleaned like the training captions (``caption_cleaning=reference``), tokenised to at most
   ``cls_token_num`` (120) T5 tokens with padding to that length, and encoded by ``T5EncoderModel``;
2. the valid token features are moved to the *end* of the 120 slots (left padding) and the padded slots are
   zeroed (``c = emb * mask``);
3. with CFG the batch is ``[caption; uncond_embedding]`` (halves, conditional first); both halves use the
   caption's mask, so no query attends to a padded prefix slot except itself (the reference forces the
   diagonal of its mask to 1);
4. ``cls_embedding.cap_proj`` (2048 -> 1280 -> 1280, GELU-tanh) projects both halves; the 120 prefix
   slots get an all-zero RoPE table; image token ``i`` sits at slot ``120 + i`` with grid cell ``i``.

Weights are the official files, loaded as published with strict key matching: ``t2i_XL_stage1_256.pt`` /
``t2i_XL_stage2_512.pt`` and ``vq_ds16_t2i.pt`` from ``peizesun/llamagen_t2i`` (``{"model": state_dict}``,
``torch.load(weights_only=True)``) and ``google/flan-t5-xl`` through ``transformers``. Everything is
downloaded on first use unless ``HF_HUB_OFFLINE=1``; a missing file raises ``MissingWeightsError`` with the
file, the cache folder and the ``hf download`` command.

``text_encoder=tiny_random`` builds a seeded one-layer random T5 and a hashing word tokenizer in code: for
tests and plumbing only (configs/model/llamagen_t2i_tiny.yaml); its images mean nothing.

Example: ``python run.py model=llamagen_t2i_512 decoder=coolsd data=file data.path=prompts.txt``.
"""
from __future__ import annotations

import functools
import html
import inspect
import os
import re
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from coolsd.models.base import Runtime
from coolsd.models.checkpoints import MissingWeightsError, hub_cached, hub_file, missing_together
from coolsd.models.llamagen import GPTConfig, LlamaGenAdapter, LlamaGenCache, load_gpt_checkpoint
from coolsd.models.vq import VQConfig
from coolsd.required_files import RequiredFile
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput

TINY_RANDOM = "tiny_random"
CLEANING_MODES = ("reference", "lower", "none")


# -- caption cleaning ----------------------------------------------------------------------------------------
class _TextOnly(HTMLParser):
    """Collects the character data of a string that may contain HTML markup (entities decoded)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def _strip_markup(text: str) -> str:
    parser = _TextOnly()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts)


def _rules(*pairs: tuple[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(pattern), replacement) for pattern, replacement in pairs]


_URL = r"[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)"
# Applied before markup stripping: person tags, web addresses.
_BEFORE_MARKUP = _rules(
    (r"<person>", "person"),
    (r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|" + _URL + r"))", ""),
    (r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|" + _URL + r"))", ""),
)
# Applied after markup stripping: handles, CJK blocks, dash/quote unification, ids, file names, punctuation.
_PUNCTUATION = r"[#®•©™&@·º½¾¿¡§~\)\(\]\[\}\{\|\\\/\*]{1,}"
_DASHES = (r"[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030\u30A0"
           r"\uFE31\uFE32\uFE58\uFE63\uFF0D]+")
_AFTER_MARKUP = _rules(
    (r"@[\w\d]+\b", ""),
    *((block, "") for block in (r"[\u31c0-\u31ef]+", r"[\u31f0-\u31ff]+", r"[\u3200-\u32ff]+",
                                r"[\u3300-\u33ff]+", r"[\u3400-\u4dbf]+", r"[\u4dc0-\u4dff]+",
                                r"[\u4e00-\u9fff]+")),
    (_DASHES, "-"),
    (r"[`´«»“”¨]", '"'),
    (r"[‘’]", "'"),
    (r"&quot;?", ""),
    (r"&amp", ""),
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),
    (r"\d:\d\d\s+$", ""),
    (r"\\n", " "),
    (r"#\d{1,3}\b", ""),
    (r"#\d{5,}\b", ""),
    (r"\b\d{6,}\b", ""),
    (r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", ""),
    (r"[\"\']{2,}", r'"'),
    (r"[\.]{2,}", r" "),
    (_PUNCTUATION, r" "),
    (r"\s+\.\s+", r" "),
)
_SEPARATORS = re.compile(r"(?:\-|\_)")
# Applied after the unicode clean-up: product codes, shop boilerplate, sizes, spacing, stray edge characters.
_FINAL = _rules(
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),
    (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),
    (r"\b\d+[a-zA-Z]+\d+\b", ""),
    (r"(worldwide\s+)?(free\s+)?shipping", ""),
    (r"(free\s)?download(\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""),
    (r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", ""),
    (r"\bpage\s+\d+\b", ""),
    (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", r" "),
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),
    (r"\b\s+\:\s+", r": "),
    (r"(\D[,\./])\b", r"\1 "),
    (r"\s+", " "),
    (r"^[\"\']([\w\W]+)[\"\']$", r"\1"),
    (r"^[\'\_,\-\:;]", r""),
    (r"[\'\_,\-\:\-\+]$", r""),
    (r"^\.\S+$", ""),
)


def _clean_once(text: str) -> str:
    import ftfy  # installed with open_clip_torch (requirements.txt)

    text = urllib.parse.unquote_plus(str(text)).strip().lower()
    for pattern, replacement in _BEFORE_MARKUP:
        text = pattern.sub(replacement, text)
    text = _strip_markup(text)
    for pattern, replacement in _AFTER_MARKUP:
        text = pattern.sub(replacement, text)
    if len(_SEPARATORS.findall(text)) > 3:  # this-is-a-slug / this_is_a_slug -> words
        text = _SEPARATORS.sub(" ", text)
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    for pattern, replacement in _FINAL:
        text = pattern.sub(replacement, text)
    return text.strip()


def clean_caption(text: str, mode: str = "reference") -> str:
    """The caption as LlamaGen's T5 saw it in training.

    ``reference``: the PixArt/DeepFloyd clean-up that ``language/t5.py`` applies twice (lower case, no
    URLs, markup, handles, CJK, file names or shop boilerplate; unified dashes and quotes). Markup is
    stripped with the standard library's HTML parser where the reference uses BeautifulSoup.
    ``lower``: the reference's ``use_text_preprocessing=False`` branch. ``none``: the prompt unchanged.
    """
    if mode == "reference":
        return _clean_once(_clean_once(text))
    if mode == "lower":
        return text.lower().strip()
    if mode == "none":
        return text
    raise ValueError(f"model.caption_cleaning must be one of {CLEANING_MODES}, got {mode!r}")


# -- text encoders -------------------------------------------------------------------------------------------
class HashWordTokenizer:
    """A tokenizer with no vocabulary file: words and punctuation marks hash (CRC-32) to ids ``2..V-1``.

    Called like a ``transformers`` tokenizer with ``padding="max_length"`` (right padding, pad id 0, an
    end-of-sequence id 1 appended). Used by ``text_encoder=tiny_random`` only (tests, plumbing).
    """

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 3:
            raise ValueError(f"HashWordTokenizer needs vocab_size >= 3, got {vocab_size}")
        self.vocab_size = vocab_size

    def ids(self, text: str, max_length: int) -> list[int]:
        words = re.findall(r"\w+|[^\w\s]", text)
        ids = [2 + zlib.crc32(w.encode("utf-8")) % (self.vocab_size - 2) for w in words]
        return ids[: max_length - 1] + [self.eos_token_id]

    def __call__(self, texts: list[str], max_length: int, padding: str = "max_length", truncation: bool = True,
                 return_attention_mask: bool = True, add_special_tokens: bool = True,
                 return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        if padding != "max_length" or not truncation or return_tensors != "pt":
            raise ValueError("HashWordTokenizer supports padding='max_length', truncation=True, "
                             "return_tensors='pt' only")
        rows = [self.ids(t, max_length) for t in texts]
        input_ids = torch.full((len(rows), max_length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), max_length, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def tiny_random_t5(d_model: int, vocab_size: int = 512, seed: int = 0) -> nn.Module:
    """A seeded one-layer random ``T5EncoderModel`` of width ``d_model`` (tests and plumbing only)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=max(d_model // 4, 1), d_ff=2 * d_model,
                      num_layers=1, num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=32, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                      is_encoder_decoder=False, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T5EncoderModel(config).eval()


T5_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
              "pytorch_model.bin")
T5_PATTERNS = ("*.json", "*.model", "*.safetensors")  # what prefetch fetches of a hub T5 (no TF/Flax copies)


def _t5_unavailable(name: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (f"text encoder {name!r} (T5EncoderModel weights + tokenizer) is not available (looked in "
            f"{name if Path(name).expanduser().is_dir() else HF_HUB_CACHE}; HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '0')}). On a machine with network access run: "
            f"hf download {name} --exclude '*.h5' '*.msgpack'   (or set model.text_encoder to a local folder)")


def t5_missing(name: str, revision: str | None) -> str | None:
    """Why the T5 encoder ``name`` (hub id or folder) cannot be loaded, checked without loading it; ``None``
    if it can (online, a hub id is downloaded on first use)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        has_weights = any((folder / f).is_file() for f in T5_WEIGHTS)
        return None if (folder / "config.json").is_file() and has_weights else _t5_unavailable(name)
    if hub_cached(name, ("config.json",), revision) is None or hub_cached(name, T5_WEIGHTS, revision) is None:
        return _t5_unavailable(name)
    return None


def load_t5(name: str, revision: str | None, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """``T5EncoderModel`` + ``AutoTokenizer`` from a hub id or a local folder (no remote code).

    Only the encoder half of the checkpoint is used (the decoder's weights are skipped, as
    ``T5EncoderModel.from_pretrained`` does); every encoder parameter must be in the checkpoint."""
    from transformers import AutoTokenizer, T5EncoderModel

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
        encoder, info = T5EncoderModel.from_pretrained(name, revision=revision, dtype=dtype,
                                                       output_loading_info=True)
    except OSError as err:
        raise MissingWeightsError(_t5_unavailable(name)) from err
    tied = set(getattr(encoder, "_tied_weights_keys", None) or ())
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    if missing or info.get("mismatched_keys"):
        raise ValueError(f"text encoder {name!r} lacks T5 encoder parameters {missing[:6]} or has reshaped "
                         f"ones {list(info.get('mismatched_keys', ()))[:6]}; is it a T5 checkpoint?")
    return encoder.eval(), tokenizer


@dataclass(frozen=True)
class Caption:
    """A prompt's T5 features, left-padded: ``features`` (1, C, D) with zero rows in the padded slots and
    ``valid`` (1, C) bool, True on the last ``num_tokens`` slots."""

    features: torch.Tensor
    valid: torch.Tensor
    num_tokens: int


class CaptionEncoder:
    """Prompt -> ``Caption``: cleaning, tokenisation to ``max_length`` slots, T5 encoding, left padding.

    Holds a ``transformers`` T5 encoder and tokenizer (any objects with their call signatures). The encoder
    is not a submodule of the adapter, so the adapter's ``state_dict`` is exactly the official GPT + VQ
    keys and its dtype casts do not touch T5 (loaded in the model dtype with T5's own fp32 ``wo``, as the
    reference's ``from_pretrained(torch_dtype=...)`` does). Nothing is memoised: every prefill encodes its
    prompt, so every decoder's measured prefill includes the same text-encoding cost whatever their order.
    """

    def __init__(self, encoder: nn.Module, tokenizer: Any, max_length: int, cleaning: str = "reference") -> None:
        if cleaning not in CLEANING_MODES:
            raise ValueError(f"model.caption_cleaning must be one of {CLEANING_MODES}, got {cleaning!r}")
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.cleaning = cleaning

    @property
    def hidden_size(self) -> int:
        return int(self.encoder.config.d_model)

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    def to(self, device: torch.device) -> CaptionEncoder:
        self.encoder.to(device)
        return self

    @torch.inference_mode()
    def __call__(self, prompt: str) -> Caption:
        tokens = self.tokenizer(
            [clean_caption(prompt, self.cleaning)], max_length=self.max_length, padding="max_length",
            truncation=True, return_attention_mask=True, add_special_tokens=True, return_tensors="pt",
        )
        ids = tokens["input_ids"].to(self.device)  # (1, C)
        mask = tokens["attention_mask"].to(self.device).bool()  # (1, C), True on the valid tokens
        out = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # (1, C, D)
        n = int(mask.sum())
        features = torch.zeros_like(out)
        features[:, self.max_length - n :] = out[mask].unsqueeze(0)  # valid tokens moved to the end
        valid = torch.zeros_like(mask)
        valid[:, self.max_length - n :] = True
        return Caption(features=features, valid=valid, num_tokens=n)


# -- the adapter ---------------------------------------------------------------------------------------------
class LlamaGenT2I(LlamaGenAdapter):
    """Model adapter for LlamaGen text-to-image GPTs (``t2i``; prompts are captions). See the module doc."""

    model_type = "t2i"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the GPT and VQ files of ``hub_repo`` (``weights_dir`` looked in first); a
        hub or folder T5 text encoder (config, tokenizer, weights) unless ``tiny_random`` or a built module."""
        out = []
        if cfg.get("pretrained", True):
            repo = cfg.get("hub_repo", "peizesun/llamagen_t2i")
            for key, what in (("gpt_file", "LlamaGen T2I GPT weights"), ("vq_file", "LlamaGen VQ-16 weights")):
                out.append(RequiredFile(what, repo_id=repo, filename=str(cfg[key]), local_dir=cfg.get("weights_dir")))
        encoder = cfg.get("text_encoder", "google/flan-t5-xl")
        if isinstance(encoder, str) and encoder != TINY_RANDOM:
            weights = "|".join(T5_WEIGHTS)
            if Path(encoder).expanduser().is_dir() or encoder.startswith((".", "/", "~")):
                out.append(RequiredFile("T5 text encoder", local=encoder, must_have=("config.json", weights),
                                        manual=f"hf download google/flan-t5-xl --local-dir {encoder}"))
            else:
                out.append(RequiredFile("T5 text encoder (weights + tokenizer)", repo_id=encoder,
                                        patterns=T5_PATTERNS, revision=cfg.get("text_encoder_revision"),
                                        must_have=("config.json", "spiece.model|tokenizer.json", weights)))
        return out

    def __init__(
        self,
        gpt: dict | GPTConfig,
        vq: dict | VQConfig,
        sampling: dict | SamplingConfig,
        gpt_size: str | None = None,
        text_encoder: str | nn.Module | Callable[[], nn.Module] = "google/flan-t5-xl",
        tokenizer: Any = None,
        text_encoder_revision: str | None = None,
        caption_cleaning: str = "reference",
        pretrained: bool = True,
        hub_repo: str = "peizesun/llamagen_t2i",
        gpt_file: str = "t2i_XL_stage1_256.pt",
        vq_file: str = "vq_ds16_t2i.pt",
        weights_dir: str | None = None,
        init_seed: int = 0,
        init_std: float = 0.02,
        zero_init_output: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        """``text_encoder``: a hub id or local folder of a T5 encoder (with ``tokenizer=None`` its tokenizer
        comes from the same place), ``tiny_random`` (tests), or a built ``T5EncoderModel``-like module or a
        factory returning one (then pass ``tokenizer`` as an object or a factory too).
        ``pretrained``: load the official GPT and VQ files (``weights_dir`` is looked in first, then
        ``hub_repo``); false keeps the seeded random initialisation (tests, plumbing). Every file (GPT, VQ,
        text encoder) is looked up before anything is built, and one ``MissingWeightsError`` lists what is
        missing, so a run without weights fails in a second instead of after building a 775M-parameter GPT.
        ``runtime``: ``runtime_defaults`` (``sample_t2i.py``'s settings, dtype ``auto``); with ``pretrained``,
        ``requires_cuda`` stops ``device=auto`` without CUDA before any file is read (``coolsd.device``). CFG only
        above 1 is ``sampling.cfg_rule=above_one`` (the model configs set it)."""
        super().__init__(sampling, runtime)
        device, dtype = self.runtime.resolve(published=pretrained)  # before any file is looked up
        self.hub_repo, self.weights_dir = hub_repo, weights_dir
        files = self._look_up(pretrained, gpt_file, vq_file, text_encoder, text_encoder_revision)
        self._build(gpt, vq, gpt_size, init_seed, init_std, zero_init_output)
        if pretrained:
            load_gpt_checkpoint(self.gpt, files[gpt_file], strict=True)
            self._load_vq(files[vq_file])
        self._place(device, dtype)
        self.text = self._caption_encoder(text_encoder, tokenizer, text_encoder_revision, caption_cleaning)
        if self.text.hidden_size != self.cfg.caption_dim:
            raise ValueError(f"the text encoder's width ({self.text.hidden_size}) differs from "
                             f"model.gpt.caption_dim ({self.cfg.caption_dim})")
        self.class_names: list[str] = []

    # -- construction ----------------------------------------------------------------------------------
    def _look_up(self, pretrained: bool, gpt_file: str, vq_file: str, text_encoder: Any,
                 revision: str | None) -> dict[str, str]:
        """Local paths of the official files (downloading them when online); one error naming all missing."""
        files, errors = {}, []
        for name in (gpt_file, vq_file) if pretrained else ():
            try:
                files[name] = self._weights_file(name)
            except MissingWeightsError as err:
                errors.append(str(err))
        if isinstance(text_encoder, str) and text_encoder != TINY_RANDOM:
            problem = t5_missing(text_encoder, revision)
            if problem:
                errors.append(problem)
        missing_together("LlamaGen T2I weights are missing (looked up before building the model)", errors)
        return files

    def _weights_file(self, filename: str) -> str:
        """Local path of an official weights file: ``weights_dir/filename``, else the hub (downloading)."""
        from huggingface_hub.constants import HF_HUB_CACHE

        try:
            return hub_file(self.hub_repo, filename, local_dir=self.weights_dir)
        except MissingWeightsError as err:
            where = (f"{Path(self.weights_dir).expanduser() / filename}" if self.weights_dir
                     else f"the Hugging Face cache {HF_HUB_CACHE}")
            target = f" --local-dir {self.weights_dir}" if self.weights_dir else ""
            raise MissingWeightsError(
                f"{filename} (LlamaGen T2I, {self.hub_repo}) is not available: looked in {where}. On a machine "
                f"with network access run: hf download {self.hub_repo} {filename}{target}   (set "
                "model.weights_dir=<folder> to use files placed there)"
            ) from err

    def _load_vq(self, path: str) -> None:
        from coolsd.models.checkpoints import load_state_dict

        state = load_state_dict(path, nested_keys=("model",))
        expected = set(self.vq.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise RuntimeError(f"{path} does not match the configured VQ (model.vq): missing {missing[:5]} "
                               f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
        self.vq.load_state_dict(state, strict=True)

    def _caption_encoder(self, text_encoder, tokenizer, revision, cleaning) -> CaptionEncoder:
        max_length = self.cfg.cls_token_num
        dtype = self.gpt.tok_embeddings.weight.dtype
        if text_encoder == TINY_RANDOM:
            encoder = tiny_random_t5(self.cfg.caption_dim).to(dtype)  # fixed seed: a stand-in T5
            tokenizer = HashWordTokenizer(encoder.config.vocab_size)
        elif isinstance(text_encoder, str):
            encoder, hub_tokenizer = load_t5(text_encoder, revision, dtype)
            tokenizer = hub_tokenizer if tokenizer is None else tokenizer
        else:
            encoder = text_encoder() if _is_factory(text_encoder) else text_encoder
        if tokenizer is None:
            raise ValueError("model.tokenizer is required when model.text_encoder is a module or a factory: "
                             "pass a tokenizer object, a factory returning one, or a hub id")
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer, revision=revision)
        elif _is_factory(tokenizer):
            tokenizer = tokenizer()
        return CaptionEncoder(encoder, tokenizer, max_length, cleaning).to(self.device)

    # -- the adapter interface -------------------------------------------------------------------------
    def condition(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Condition embeddings (B·S, C, dim) and prefix key validity (B·S, C), image-major: each image's
        ``[caption, uncond]`` rows. Each caption is encoded alone, so an image does not depend on its batch."""
        captions = [self.text(p) for p in prompts]
        dtype = self.gpt.tok_embeddings.weight.dtype
        valid = torch.cat([c.valid for c in captions]).to(self.device)  # (B, C)
        cond = torch.cat([c.features for c in captions]).to(self.device, dtype) * valid[..., None]  # c = emb*mask
        if self.num_streams == 2:
            uncond = self.gpt.cls_embedding.uncond_embedding[None].expand(len(prompts), -1, -1)  # not masked
            cond = torch.stack([cond, uncond.to(dtype)], dim=1).flatten(0, 1)
            valid = valid.repeat_interleave(2, dim=0)  # the unconditional row reuses the caption's mask
        return self.gpt.condition(cond), valid

    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[LlamaGenCache, TargetOutput]:
        h, valid = self.condition(prompts)
        return self._prefill_condition(h, valid, extra_slots)


def _is_factory(obj: Any) -> bool:
    """A class, function or ``functools.partial`` (e.g. Hydra ``_partial_: true``) rather than a built object."""
    return isinstance(obj, (type, functools.partial)) or inspect.isfunction(obj)


__all__ = ["Caption", "CaptionEncoder", "HashWordTokenizer", "LlamaGenT2I", "clean_caption", "load_t5",
           "tiny_random_t5"]
