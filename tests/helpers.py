"""Test helpers: tiny model builders and a chi-square goodness-of-fit test with merged sparse cells."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from scipy import stats

from coolsd.models.llamagen import LlamaGen

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def tiny_llamagen(dtype: str = "float32", **sampling) -> LlamaGen:
    """The model of ``configs/model/tiny.yaml`` with optional sampling overrides."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))
    cfg.pop("_target_")
    cfg.pop("defaults", None)
    cfg["sampling"].update(sampling)
    cfg.update(dtype=dtype, device="cpu")
    return LlamaGen(**cfg)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed ``counts`` against cell ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled into one cell so the chi-square
    approximation holds.
    """
    counts = counts.double()
    expected = probs.double() * counts.sum()
    big = expected >= min_expected
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs = torch.cat([obs, counts[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(statistic, df=len(obs) - 1))
