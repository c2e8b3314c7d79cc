"""The COOL-SD paper's claims, decided on the runs of ``experiment=embedded_claims`` (or ``_quick``).

Input: the multirun folder, one sub-folder per drafter regime (``configs/regime/``), each a ``run.py`` run whose
suite holds every method point, all generating the same prompts and seeds. Everything here is recomputed from
the per-image records and images of those runs, so every comparison is **paired**: one set of bootstrap
resamples of the prompts (seeded, ``resamples`` replicates) is applied to every method point of a regime, and a
statistic that combines several points (an interpolated frontier, a difference) is computed on each replicate.

Per point: accepted length (committed tokens ÷ verify forwards, pooled), TV per committed token (pooled),
FID in the shipped classifier's feature space (reference fixed, generated features resampled; the same
statistics code as the runs, ``eval.metrics.intervals.fid_replicates``) and, over the timed subset, speedup over AR
(paired by prompt). An interval of a difference is the re-centred percentile interval of its replicates
(``eval.metrics.intervals.bootstrap_difference``), its p-value the two-sided bootstrap one.

The claims (``docs/algorithms.md``; the paper's tables):

* **C1** COOL-SD's frontier dominates LANTERN++'s. At each LANTERN++ point (its published resampling) whose
  accepted length lies inside COOL-SD's curve (exponential schedule, every μ, linear in accepted length),
  ΔTV per token and ΔFID = COOL-SD interpolated there − the LANTERN++ point.
* **C2** At matched accepted length the exponential schedule gives lower TV per token and FID than the uniform
  one (UniformRSD), and is at least as good as the linear one: the same interpolation, at each uniform (linear)
  point, for TV per token and FID.
* **C3** COOL-SD's resampling G* improves LANTERN++ over its reference resampling (ΔTV, ΔFID at the same k, λ),
  more at larger k (the difference of those differences between the largest and smallest k at each λ).
* **C4** COOL-SD at δ = 1.1 is faster than vanilla SD at comparable quality: Δ speedup (paired over the timed
  prompts) and Δ accepted length > 0, with ΔFID shown non-inferior (below its margin, 10 % of SD's FID).

Verdict of a claim over its comparisons (each oriented so that < 0 favours the claim), significance
Holm-corrected at 5 % within the claim and regime (``holm_family``; bootstrap p-values, so use ≥ 10,000
resamples for p to reach 1e-4): **held** when at least one is significantly in its favour and none significantly
against it; **not held** when any is significantly against it; **inconclusive** when compared and none is
significant; **not compared** when no comparison could be made (e.g. no LANTERN++ point inside COOL-SD's range).
Frontier claims also say where along the accepted length each outcome lies (``regions``: crossings), and C1
lists direct dominance between points beside the interpolated frontier. "Comparable quality" (C4) is a
non-inferiority test with the margins ``MARGINS`` (``claims.margins``), fixed before the run.

Every exponential COOL-SD point, whatever its μ, is on the exponential curve. C1 is decided on TV per token and
FID; LANTERN++'s points are those with the resampling its published code uses on the regime's path
(``claims.lantern_pp_resample``).

**The μ question** (weak-drafter regime): every exponential COOL-SD point, whatever its ``mu``, lies on one curve
of R = accepted length ÷ vanilla SD's against ω₁ = δ·exp(−ν − μ) (μ only rescales ω). Interpolating R in
log ω₁ gives the ω₁ at which R equals the paper's LlamaGen ratios (×1.13 at δ = 1.1, ×1.38 at δ = 2), hence the
fitted μ = ln(δ·e^(−ν)/ω₁) for each δ, with bootstrap intervals; one μ fits both when the interval of
μ(δ=2) − μ(δ=1.1) contains 0. A ratio outside the measured range is reported as such (no extrapolation).
The page then prints the command of the follow-up run (``regime=weak_tree_fitted``: COOL-SD at δ = 1.1 and 2,
each with its fitted μ, same prompts and seeds, into the same sweep folder); once it is there its points join
weak_tree's, labelled "(μ fitted)", with their measured R, and C1 and C4 are decided with them too
("C1 (fitted μ)", "C4 (fitted μ)"). The fitted points' speedups are against their own run's AR.

**More images for the deciding points** (issue 60): where a regime's own images leave a FID non-inferiority test
underpowered, ``experiment=embedded_claims_more`` generates the regime's next images (the same prompts and seeds
continued) for the points that decide it; ``build_extensions`` joins them to the regime's compact data as
``<regime>.<group>.claims.npz`` (``extend``), and ``decide_extensions`` decides the claims each one names by the same
rule and puts them in place of the regime's own, which the page keeps as "before". An inconclusive FID difference
states its power to find a difference of the FID margin (``compare``'s ``effect``).

Example: ``python scripts/claims.py results/runs/embedded_claims --out results``.
"""
from eval.studies.claims.analysis import *
from eval.studies.claims.data import *
from eval.studies.claims.data import _ci_text, _per_image
from eval.studies.claims.figures import *
from eval.studies.claims.page import *
