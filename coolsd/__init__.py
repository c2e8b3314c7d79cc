"""COOL-SD harness: speculative decoding for autoregressive text-to-image models, measured fairly.

The core (sampling pipeline, static KV cache, the shared speculative loop, acceptance rules) lives here;
prior methods live in ``baselines``; evaluation in ``eval``. Start with ``python run.py``.
"""
__version__ = "0.1.0"
