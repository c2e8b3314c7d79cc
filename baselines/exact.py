"""Vanilla speculative sampling: the exact (lossless) acceptance rule, under the name the decoder configs use.

Accept ``x`` with ``min(1, p(x)/q(x))``; after a rejection sample from ``norm([p − q]_+)``
(Leviathan et al. 2023; Chen et al. 2023; the "EAGLE-1" rows of the papers). The rule is defined in the core
(``coolsd.acceptance.ExactRule``), which needs it for plain AR decoding and for validating trained drafters;
the core never imports ``baselines``.

Example: ``python run.py decoder=sd``.
"""
from __future__ import annotations

from coolsd.acceptance import ExactRule

__all__ = ["ExactRule"]
