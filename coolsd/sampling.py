"""The sampling pipeline shared by the target, every drafter and the AR baseline.

raw logits of the conditional and unconditional streams -> classifier-free guidance ``l = u + s(c - u)``
-> (model masks: applied by the model adapter, which returns logits over image codes only) -> temperature
-> top-k -> top-p -> softmax. All arithmetic runs in float32, even when the model runs in bf16.

Order and tie handling follow LlamaGen ``autoregressive/models/generate.py`` (top-k keeps ties with the k-th
logit; top-p keeps the smallest prefix whose mass reaches ``top_p``, always at least one token).
Temperature 0 means greedy: the distribution is one-hot on the arg-max.

When guidance runs at all is a named rule, ``cfg_rule``: ``not_one`` (the general rule, the default: two
streams whenever ``cfg_scale != 1``, so a scale below 1 interpolates towards the unconditional stream, as
transformers' ``ClassifierFreeGuidanceLogitsProcessor`` and Lumina-mGPT's CFG processor do) or
``above_one`` (FoundationVision/LlamaGen ``generate.py``: guidance only when ``cfg_scale > 1``; at 0.5 it
samples the conditional stream alone). Each model config names its reference's rule.

Example: ``python run.py model.sampling.temperature=0`` runs every decoder greedily.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coolsd import validate

CFG_RULES = ("not_one", "above_one")


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling hyper-parameters; one instance is used for target and drafter alike."""

    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    cfg_rule: str = "not_one"

    def __post_init__(self) -> None:
        validate.number("sampling.cfg_scale", self.cfg_scale)
        validate.number("sampling.temperature", self.temperature, minimum=0.0)
        validate.integer("sampling.top_k", self.top_k, minimum=0)  # 0 = off
        validate.number("sampling.top_p", self.top_p, minimum=0.0, maximum=1.0, min_open=True)
        validate.choice("sampling.cfg_rule", self.cfg_rule, CFG_RULES)


    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance runs (two streams) under ``cfg_rule`` (see the module doc)."""
        if self.cfg_rule == "above_one":
            return self.cfg_scale > 1.0
        return self.cfg_scale != 1.0


def guide(logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Combine CFG streams: ``logits`` is (S, ..., V) with stream 0 conditional and stream 1 unconditional.

    With one stream the conditional logits are returned unchanged.
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    streams = logits.unbind(0)
    if len(streams) == 1:
        return streams[0]
    cond, uncond = streams
    return uncond + cfg_scale * (cond - uncond)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering on float32 logits (..., V); removed entries become -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        remove_sorted = mass_before > top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Guided logits (..., V) -> float32 probabilities (..., V) through temperature, top-k, top-p."""
    return _float_probs(logits.float(), cfg)


def _float_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """``logits_to_probs`` of float32 logits."""
    if cfg.temperature == 0.0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # one-hot, no host read
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    logits = filter_logits(logits, cfg.top_k, cfg.top_p)
    return torch.softmax(logits, dim=-1)


def stream_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The whole pipeline: per-stream raw logits (S, T, V) -> guided probabilities (T, V)."""
    return _float_probs(guide(logits, cfg.cfg_scale), cfg)  # guide returns float32


def finite_images(logits: torch.Tensor) -> torch.Tensor:
    """(B,) bool: whether every logit of each image is finite; ``logits`` (S, B, T, V), always four axes."""
    return torch.isfinite(logits).all(dim=(0, 2, 3))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` (..., V) from a ``torch.Generator`` -> int64 tensor (...).

    For training-data scripts; the decoders draw from per-image counter-based streams (``coolsd.rng``).
    """
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


#: A residual whose total mass is at most this is empty: ``normalize`` returns its fallback instead.
EMPTY_MASS = 1e-12


def normalize(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Renormalise non-negative rows (..., V); a row whose total is (numerically) zero becomes ``fallback``.

    Row-wise and without a host sync (the threshold is ``EMPTY_MASS``, as in every rule's residual).
    """
    total = mass.sum(-1, keepdim=True)
    ok = total > EMPTY_MASS
    return torch.where(ok, mass / total.clamp_min(EMPTY_MASS), fallback)
