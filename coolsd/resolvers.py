"""The config resolvers of this project's Hydra configs: ``${asset:embedded/target.safetensors}`` is the path of a
shipped artefact (``coolsd.ASSET_DIR``).

Imported by everything that composes or resolves configs (``run.py``, ``scripts/bench.py``, ``eval.run``,
``eval.bench.efficiency``, ``coolsd.training``, the tests), not by the core's decode path, which runs without
OmegaConf.

Example: ``import coolsd.resolvers  # noqa: F401`` before ``compose``.
"""
from omegaconf import OmegaConf

from coolsd import ASSET_DIR

if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", lambda relative: str(ASSET_DIR / relative))
