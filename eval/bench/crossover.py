"""Where speculation stops paying, from a speedup curve over batch sizes (no Hydra: the GPU command uses it too).

* ``crossover``: the batch size from which on speculation no longer pays: the smallest measured B whose 95 %
  interval lies below 1 and stays below 1 at every larger B measured (a single noisy dip followed by an interval
  that reaches 1 again is not a crossover);
* ``lockstep_waste``: the share of a batch's row-iterations that decode an image already finished.

Example: ``crossover({1: (1.8, 1.6, 2.0), 8: (1.1, 0.97, 1.2), 32: (0.8, 0.7, 0.9), 64: (0.7, 0.6, 0.8)})`` is 32.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping


def crossover(curve: Mapping[int, tuple[float, float, float]]) -> int | None:
    """The smallest batch size from which every interval ``(estimate, low, high)`` of ``curve`` (batch size ->
    speedup) lies below 1, or None ("none up to" the largest batch size measured)."""
    found = None
    for batch in sorted(curve, reverse=True):
        if curve[batch][2] < 1.0:
            found = batch
        else:
            break
    return found


def lockstep_waste(iterations: list[int]) -> float:
    """The share of a batch's row-iterations that decode an image already finished: ``1 − mean / max``."""
    return 1.0 - statistics.fmean(iterations) / max(iterations) if iterations and max(iterations) else 0.0
