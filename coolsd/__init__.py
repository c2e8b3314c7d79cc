"""COOL-SD harness: speculative decoding for autoregressive text-to-image models, measured fairly.

The core (sampling pipeline, static KV cache, the shared speculative loop, acceptance rules) lives here;
prior methods live in ``baselines``; evaluation in ``eval``. Start with ``python run.py``.
"""
__version__ = "0.1.0"

from pathlib import Path

from omegaconf import OmegaConf

#: Shipped artefacts (the embedded model); configs refer to them as ``${asset:embedded/target.safetensors}``.
ASSET_DIR = Path(__file__).resolve().parent / "assets"
if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", lambda relative: str(ASSET_DIR / relative))
