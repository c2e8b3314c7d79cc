"""How far SJD-SV (unofficial: the rule of a secondary description of the paper, ``baselines/sv.py``), its options and
LANTERN-SV in the Jacobi loop are from the target: the plug-in total-variation
distance between each decoder's sequence distribution and the exact one, on the lookup model of the exactness
tests (3 codes, a 1×5 grid: 243 sequences per prompt, two prompts), window 4.

Each variant decodes seeds 0 .. 2N − 1 (the two prompts alternating, N images per prompt, batches of 100) and
the script prints a markdown table of accepted length and TV per prompt (docs/jacobi-and-spatial.md quotes it).
The plug-in TV of an exact decoder is pure sampling noise (about 0.01 at N = 20,000: SJD's row shows it); a
decoder's departure is the gap above that. ``tests/test_sv.py`` decides the same question with a χ² test and a
split-sample lower bound at N = 1,000.

Example::

    python scripts/sv_tv.py                 # N = 20,000 per prompt (about 30 s on one CPU thread)
    python scripts/sv_tv.py --images 2000   # a quick look
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines.exact import ExactRule  # noqa: E402
from baselines.jacobi import JacobiDrafter  # noqa: E402
from baselines.lantern import lantern_rule  # noqa: E402
from baselines.sv import SVDecoder  # noqa: E402
from coolsd.decoding import Decoder  # noqa: E402
from coolsd.models.lookup import LookupModel  # noqa: E402
from coolsd.types import pooled_accepted_length  # noqa: E402

PROMPTS = ("a", "b")
WINDOW_DRAFTS = 3  # W = 4


def lookup() -> LookupModel:
    """The exactness tests' lookup model (``tests.test_jacobi.lookup``)."""
    return LookupModel(vocab=3, grid=(1, 5), seed=5, scale=1.5, sampling=dict(cfg_scale=2.0), prompts=PROMPTS)


def variants(model: LookupModel) -> dict[str, Decoder]:
    def jacobi() -> JacobiDrafter:
        return JacobiDrafter(model, init="random")

    def sv(rule, **options) -> SVDecoder:
        return SVDecoder("sjd_sv", model, rule, WINDOW_DRAFTS, jacobi(), sv={"enabled": True, **options})

    lantern = lantern_rule(model, k=1, mode="additive", budget=0.1, resample="reference",
                           neighbour_metric="l2_raw", neighbour_cache=None)
    return {
        "SJD": Decoder("sjd", model, ExactRule(), draft_len=WINDOW_DRAFTS, drafter=jacobi()),
        "SJD-SV, α = 0.8 (default: the same uniform for a run's tests)": sv(ExactRule()),
        "SJD-SV, α = 0.8, a fresh uniform per fallback test": sv(ExactRule(), fallback_uniform="fresh"),
        "SJD-SV, α = 0.5": sv(ExactRule(), alpha=0.5),
        "SJD-SV, no fallback": sv(ExactRule(), fallback=False),
        "SJD-SV, α = 1 (the whole run's mass in the product)": sv(ExactRule(), alpha=1.0),
        "SJD-SV, α = 1, zero_prob = test (no token outside the product)": sv(ExactRule(), alpha=1.0,
                                                                             zero_prob="test"),
        "LANTERN (Jacobi), k = 1, δ = 0.1 (token tests)": Decoder("lantern_sjd", model, lantern,
                                                                  draft_len=WINDOW_DRAFTS, drafter=jacobi()),
        "LANTERN-SV (Jacobi), k = 1, δ = 0.1": sv(lantern),
    }


def measure(decoder: Decoder, model: LookupModel, images: int, batch: int = 100) -> tuple[float, list[float]]:
    """Accepted length (pooled) and the plug-in TV per prompt over ``images`` images per prompt."""
    cells = model.codebook_size ** model.num_image_tokens
    counts = {p: torch.zeros(cells, dtype=torch.float64) for p in PROMPTS}
    stats = []
    for start in range(0, 2 * images, batch):
        seeds = list(range(start, min(start + batch, 2 * images)))
        prompts = [PROMPTS[s % 2] for s in seeds]
        for prompt, gen in zip(prompts, decoder.generate_batch(prompts, seeds)):
            counts[prompt][model.sequence_index(gen.tokens)] += 1
            stats.append(gen.stats)
    tv = [0.5 * float((counts[p] / counts[p].sum() - model.exact_sequence_probs(p).double()).abs().sum())
          for p in PROMPTS]
    return pooled_accepted_length(stats), tv


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000, help="images per prompt (default 20,000)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = lookup()
    print(f"lookup model (3 codes, 1x5 grid), window {WINDOW_DRAFTS + 1}, {args.images:,} images per prompt\n")
    print("| variant | accepted length | TV (prompt a / b) |\n|---|---|---|")
    for name, decoder in variants(model).items():
        accepted, tv = measure(decoder, model, args.images)
        print(f"| {name} | {accepted:.2f} | {tv[0]:.3f} / {tv[1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
