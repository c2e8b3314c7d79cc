"""COOL-SD harness: speculative decoding for autoregressive text-to-image models, measured fairly.

The core (sampling pipeline, static KV cache, the shared speculative loop, acceptance rules) lives here;
prior methods live in ``baselines``; evaluation in ``eval``. Start with ``python run.py``.

Importing the core needs torch and the model packages only: the decode path runs where Hydra and OmegaConf are
not installed (the offline GPU nodes, ``eval.bench.gpu.node``). ``coolsd.resolvers`` registers the config
resolvers for whatever composes configs.
"""
__version__ = "0.1.0"

from pathlib import Path

#: Shipped artefacts (the embedded model); configs refer to them as ``${asset:embedded/target.safetensors}``.
ASSET_DIR = Path(__file__).resolve().parent / "assets"
