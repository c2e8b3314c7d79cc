"""Uncertainty of the harness's numbers: 95 % intervals over images, paired comparisons between decoders.

Sources: B. Efron and R. Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13 (percentile intervals),
ch. 10 (bootstrap bias) and ch. 16 (bootstrap tests: resample under the null by shifting the replicates);
B. L. Welch, "The generalization of Student's problem" (Biometrika 1947; ``scipy.stats.ttest_ind`` with
``equal_var=False``); E. B. Wilson, "Probable inference" (JASA 1927); Chong & Forsyth, "Effectively Unbiased
FID and Inception Score" (CVPR 2020) for FID's 1/N bias; Bińkowski et al., "Demystifying MMD GANs" (ICLR 2018)
for KID.

Which interval goes with which number (every ``<metric>_ci`` of ``run.json``; the level is
``eval.bootstrap.level``, 0.95 by default):

* **a mean over images** (latency, target / drafter forwards per image, TV per step and per image, CLIP score,
  ImageReward, HPS): Student's t interval ``mean ± t(n-1) s / sqrt(n)``. Exact for normal values and
  asymptotically exact for any finite variance (CLT); with the harness's N (tens to thousands) it covers as
  stated (``tests/test_stats.py``: 94-96 % of 2,000 seeded repetitions on skewed latencies), while the plain
  percentile bootstrap of a mean is too narrow by about ``sqrt((n-1)/n)`` and uses normal, not t, quantiles.
  No resampling, so it costs nothing and does not depend on the seed.
* **a proportion** (class accuracy): Wilson's score interval (never outside [0, 1], not degenerate at 0 or 1).
* **a ratio of sums** (pooled accepted length = committed tokens / verify forwards, TV per committed token,
  throughput = images / wall seconds over batches) and **speedup** (AR's mean latency / the decoder's, paired
  by prompt: both decoders' latencies of a prompt are resampled together): percentile bootstrap over the
  units (images, prompts, batches). A ratio's sampling distribution is skewed; the bootstrap follows it.
* **FID and KID**: bootstrap over the *generated* images (their features are resampled; the reference set is
  fixed, so the interval is the variability due to which images this decoder happened to draw). Resampling
  with replacement duplicates images, which shifts FID up (its bias grows like 1/N_distinct), so the
  percentile interval is *re-centred*: ``estimate + quantiles(replicates - mean(replicates))``. The interval
  says how much FID moves between two draws of N images at this N; it does not remove FID's own small-sample
  bias (large under ~1,000 images: the tables mark such FIDs and point to KID, which is unbiased). KID's
  replicates drop the pairs of a duplicated image with itself (the U-statistic over distinct images).

Comparisons (``per_decoder[<name>]["vs_<baseline>"]``, baselines from ``eval.compare_to``): Welch's t-test on
per-image accepted length (the COOL-SD paper's test) with its t interval for the difference of means; a
paired bootstrap (prompts resampled, both decoders' values of a prompt together) on latency and on every image
metric; for FID/KID the difference of the two decoders' replicates on the same resampled prompt sets. A
bootstrap p-value is the two-sided percentile one, twice the share of the (re-centred) replicates on the far
side of zero, ``min(1, 2 (1 + min(#{Δ*_b <= 0}, #{Δ*_b >= 0})) / (B + 1))``: below 1 - level only when the
interval excludes 0 (the +1 makes it a little conservative at the boundary), and never 0 (resolution
``2/(B+1)``).

Every resampling is seeded from ``(eval.bootstrap.seed, the unit's name, n)``: the same prompt sets for every
decoder and metric of a run (which is what makes comparisons paired), and results that do not depend on the
order in which metrics are computed.

Example: ``python run.py eval.bootstrap.resamples=2000 eval.compare_to=[sd,ar]``.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from scipy import special

from coolsd import validate

FID_MIN_IMAGES = 1000  # below this FID's upward bias (~ 1/N) is large: tables mark FID and point to KID


@dataclass(frozen=True)
class Bootstrap:
    """Settings of every interval and test (``eval.bootstrap``): ``resamples`` bootstrap replicates, the
    ``seed`` of their index draws, the confidence ``level`` of the intervals (0.95 = 95 %)."""

    resamples: int = 1000
    seed: int = 0
    level: float = 0.95

    def __post_init__(self) -> None:
        validate.integer("eval.bootstrap.resamples", self.resamples, minimum=10)
        validate.integer("eval.bootstrap.seed", self.seed, minimum=0)
        validate.number("eval.bootstrap.level", self.level, minimum=0.5, maximum=1.0, max_open=True)

    def weights(self, n: int, unit: str) -> np.ndarray:
        """(B, n) float64 counts: how often each of ``n`` units (images, prompts, batches) is drawn in each of
        the B resamples with replacement. Seeded by (seed, unit, n): equal for every decoder of a run."""
        rng = np.random.default_rng([self.seed, zlib.crc32(unit.encode()), n])
        b = self.resamples
        idx = rng.integers(0, n, size=(b, n)) + (np.arange(b) * n)[:, None]
        return np.bincount(idx.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)


# ------------------------------------------------------------------------------------------- intervals


def _pair(lo: float, hi: float) -> list[float]:
    return [float(lo), float(hi)]


def t_interval(values: Sequence[float], level: float = 0.95) -> list[float] | None:
    """Student's t interval of the mean of ``values`` (None for fewer than 2)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n < 2:
        return None
    half = float(special.stdtrit(n - 1, 0.5 + level / 2)) * float(x.std(ddof=1)) / math.sqrt(n)
    mean = float(x.mean())
    return _pair(mean - half, mean + half)


def geometric_ratio(numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95) -> dict:
    """Geometric mean of the paired ratios ``numerator[i] / denominator[i]`` (e.g. two timings of the same image)
    and the t-interval of the mean log ratio, mapped back (``interval`` None for fewer than 2 pairs): a paired
    interval, so a drift both sides share cancels."""
    logs = np.log(np.asarray(numerator, dtype=np.float64) / np.asarray(denominator, dtype=np.float64))
    mean = float(logs.mean())
    interval = t_interval(logs, level)
    return {"ratio": math.exp(mean), "interval": None if interval is None else [math.exp(x) for x in interval],
            "n": len(logs)}


def wilson_interval(successes: float, n: int, level: float = 0.95) -> list[float] | None:
    """Wilson's score interval of a proportion ``successes / n`` (None for n = 0)."""
    if n < 1:
        return None
    z = float(special.ndtri(0.5 + level / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return _pair(max(centre - half, 0.0), min(centre + half, 1.0))


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> list[float] | None:
    """The central ``level`` quantiles of the finite bootstrap replicates (None if there are none)."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if len(r) == 0:
        return None
    lo, hi = np.quantile(r, [0.5 - level / 2, 0.5 + level / 2])
    return _pair(lo, hi)


def shifted_interval(estimate: float, replicates: np.ndarray, level: float = 0.95) -> list[float] | None:
    """Percentile interval of the replicates re-centred on ``estimate`` (removes the bootstrap's own bias,
    e.g. FID's upward shift from duplicated images)."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if len(r) == 0:
        return None
    lo, hi = np.quantile(r - r.mean(), [0.5 - level / 2, 0.5 + level / 2])
    return _pair(estimate + lo, estimate + hi)


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float], boot: Bootstrap,
                   unit: str) -> list[float] | None:
    """Percentile bootstrap interval of ``sum(numerator) / sum(denominator)`` over units resampled together
    (None for fewer than 2 units)."""
    num, den = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    if len(num) < 2:
        return None
    w = boot.weights(len(num), unit)
    with np.errstate(divide="ignore", invalid="ignore"):
        return percentile_interval((w @ num) / (w @ den), boot.level)


def throughput_ratio(sizes: Sequence[float], walls: Sequence[float], base_sizes: Sequence[float],
                     base_walls: Sequence[float], boot: Bootstrap) -> tuple[float, list[float] | None]:
    """(A's images per second over B's, its percentile bootstrap interval): the speedup at batch > 1 of a decoder
    over AR, each throughput pooled over its own batches (sum of images / sum of wall seconds); the two sets of
    batches are resampled independently (they are not paired: different prompts per batch). Interval None for
    fewer than 2 batches on either side."""
    n, d = np.asarray(sizes, np.float64), np.asarray(walls, np.float64)
    bn, bd = np.asarray(base_sizes, np.float64), np.asarray(base_walls, np.float64)
    estimate = float((n.sum() / d.sum()) / (bn.sum() / bd.sum()))
    if len(n) < 2 or len(bn) < 2:
        return estimate, None
    w, wb = boot.weights(len(n), "batches"), boot.weights(len(bn), "baseline batches")
    with np.errstate(divide="ignore", invalid="ignore"):
        return estimate, percentile_interval(((w @ n) / (w @ d)) / ((wb @ bn) / (wb @ bd)), boot.level)


def paired_speedup(base: dict[int, float], mine: dict[int, float], boot: Bootstrap) -> dict[str, Any]:
    """AR's mean latency over a decoder's on the prompts both timed (``{prompt index: seconds}``), its percentile
    bootstrap interval over those prompts, and their number: the speedup of a row whose AR was timed in another
    row of its table (``eval.ar_timing=table``)."""
    common = sorted(set(base) & set(mine))
    if not common:
        return {}
    a, b = [base[i] for i in common], [mine[i] for i in common]
    return {"speedup": float(sum(a) / sum(b)), "speedup_ci": ratio_interval(a, b, boot, "timed"),
            "speedup_num_pairs": len(common)}


# ----------------------------------------------------------------------------------------- comparisons


def bootstrap_difference(estimate: float, replicates: np.ndarray, level: float = 0.95,
                         n: int | Sequence[int] | None = None) -> dict[str, Any]:
    """A difference, its re-centred bootstrap interval and the two-sided bootstrap p-value of 'no difference'."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    out: dict[str, Any] = {"test": "paired bootstrap", "difference": float(estimate),
                           "ci": shifted_interval(estimate, r, level), "p": None, "resamples": len(r)}
    if len(r):
        shifted = estimate + (r - r.mean())  # the distribution the interval's ends are quantiles of
        tol = 1e-12 * max(1.0, abs(estimate))
        tail = min(int((shifted <= tol).sum()), int((shifted >= -tol).sum()))
        out["p"] = float(min(1.0, 2 * (1 + tail) / (len(r) + 1)))
    if n is not None:
        out["n"] = n
    return out


def non_inferiority(estimate: float, replicates: np.ndarray, margin: float, level: float = 0.95) -> dict[str, Any]:
    """One-sided test that a difference (worse = larger, e.g. ΔFID = method − baseline) is below ``margin``:
    H0 Δ ≥ margin against H1 Δ < margin. Non-inferior at ``level`` when the one-sided upper bound (the
    ``level`` quantile of the replicates re-centred on the estimate) is below the margin; the p-value is the
    share of re-centred replicates at or above the margin, ``(1 + #{Δ*_b >= margin}) / (B + 1)``."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    out: dict[str, Any] = {"test": "non-inferiority (paired bootstrap, one-sided)", "difference": float(estimate),
                           "margin": float(margin), "upper": None, "p": None, "non_inferior": None,
                           "resamples": len(r)}
    if len(r) and math.isfinite(estimate):
        shifted = estimate + (r - r.mean())
        out["upper"] = float(np.quantile(shifted, level))
        out["p"] = float((1 + int((shifted >= margin).sum())) / (len(r) + 1))
        out["non_inferior"] = out["upper"] < margin
    return out


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (Holm 1979; family-wise error control for any dependence) in the
    order given; ``None`` entries (tests that could not be made) are left out of the family and stay ``None``."""
    index = [i for i, p in enumerate(pvalues) if p is not None]
    order = sorted(index, key=lambda i: pvalues[i])
    m = len(order)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def paired_bootstrap(a: Sequence[float], b: Sequence[float], boot: Bootstrap, unit: str) -> dict[str, Any]:
    """Mean of ``a - b`` over paired units (the same prompts), bootstrapped over the pairs."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if len(d) < 2:
        return {"test": "paired bootstrap", "difference": float(d.mean()) if len(d) else None, "ci": None,
                "p": None, "n": len(d)}
    w = boot.weights(len(d), unit)
    return bootstrap_difference(float(d.mean()), (w @ d) / len(d), boot.level, n=len(d))


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """Welch's two-sample t-test of mean(a) - mean(b) (unequal variances; as ``scipy.stats.ttest_ind(a, b,
    equal_var=False)``), with its t interval for the difference."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out: dict[str, Any] = {"test": "Welch t", "difference": float(x.mean() - y.mean()), "ci": None, "p": None,
                           "t": None, "df": None, "n": [len(x), len(y)]}
    if len(x) < 2 or len(y) < 2:
        return out
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se2 = vx + vy
    diff = out["difference"]
    if se2 == 0:  # both samples constant: the difference is exact
        out.update(ci=_pair(diff, diff), p=1.0 if diff == 0 else 0.0, t=0.0 if diff == 0 else math.copysign(
            math.inf, diff))
        return out
    df = se2 ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    t = diff / math.sqrt(se2)
    half = float(special.stdtrit(df, 0.5 + level / 2)) * math.sqrt(se2)
    out.update(t=float(t), df=float(df), p=float(2 * special.stdtr(df, -abs(t))), ci=_pair(diff - half, diff + half))
    return out


# --------------------------------------------------------------------------------- FID / KID replicates


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def _cov(x: torch.Tensor) -> torch.Tensor:
    xc = x - x.mean(0)
    return xc.T @ xc / (len(x) - 1)


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh((m + m.T) / 2)
    return (evecs * evals.clamp_min(0).sqrt()) @ evecs.T


@dataclass(frozen=True)
class ReferenceStats:
    """What FID needs of the fixed reference set: its mean, S_r^1/2 and tr S_r (float64, on a device)."""

    mean: torch.Tensor  # (D,)
    sqrt_cov: torch.Tensor  # (D, D)
    trace: torch.Tensor  # ()

    @classmethod
    def of(cls, reference: np.ndarray, device: torch.device | str = "cpu") -> "ReferenceStats":
        r = torch.as_tensor(np.asarray(reference), dtype=torch.float64, device=torch.device(device))  # (M, D)
        cov = _cov(r)
        return cls(r.mean(0), _sqrt_psd(cov), torch.trace(cov))

    @classmethod
    def from_moments(cls, mu: np.ndarray, sigma: np.ndarray, device: torch.device | str = "cpu") -> "ReferenceStats":
        """From a precomputed mean (D,) and covariance (D, D) (clean-fid's ``.npz`` statistics: ``mu``, ``sigma``)."""
        dev = torch.device(device)
        cov = torch.as_tensor(np.asarray(sigma), dtype=torch.float64, device=dev)
        return cls(torch.as_tensor(np.asarray(mu), dtype=torch.float64, device=dev), _sqrt_psd(cov), torch.trace(cov))


#: the batched route of ``fid_replicates`` holds one product per image and covariance entry (N × D(D+1)/2 float64);
#: above this many bytes (Inception's D = 2048), or when N < D, it takes one resample at a time
BATCHED_FID_BYTES = 512 * 2**20


def fid_replicates(generated: np.ndarray, reference: np.ndarray | ReferenceStats, weights: np.ndarray,
                   device: torch.device | str = "cpu", chunk: int = 256) -> np.ndarray:
    """FID of each resample (rows of ``weights``: counts per generated image) against the fixed reference
    (its features, or their ``ReferenceStats`` computed once).

    FID = |mu_g - mu_r|^2 + tr S_g + tr S_r - 2 tr (S_r^1/2 S_g S_r^1/2)^1/2 (the symmetric form of
    clean-fid's / torch-fidelity's tr sqrt(S_g S_r)), covariances with ddof 1. S_r^1/2 is taken once. For small
    feature sizes (the classifier's D = 128) every resample's S_r^1/2 S_g S_r^1/2 is one matrix product: the
    upper triangles of y_i y_i^T (y = S_r^1/2 x, centred) weighted by the counts, ``chunk`` resamples at a time,
    then one batched eigenvalue problem (about 3x faster than one resample at a time here). Otherwise each
    resample is one eigenvalue problem of size min(N, D) over its distinct images (the Gram matrix when N <= D).
    Both routes agree to rounding."""
    dev = torch.device(device)
    ref = reference if isinstance(reference, ReferenceStats) else ReferenceStats.of(reference, dev)
    x = torch.as_tensor(np.asarray(generated), dtype=torch.float64, device=dev)  # (N, D)
    w_all = torch.as_tensor(np.asarray(weights), dtype=torch.float64, device=dev)  # (B, N)
    n, d = x.shape
    mu_r, tr_r = ref.mean.to(dev), ref.trace.to(dev)
    y = x @ ref.sqrt_cov.to(dev)  # (N, D): S_r^1/2 applied to every generated feature
    sq = (x * x).sum(-1)  # (N,)
    out = np.empty(len(w_all))
    if n >= d and n * d * (d + 1) // 2 * 8 <= BATCHED_FID_BYTES:
        y = y - y.mean(0)  # the covariance does not depend on the shift; centring keeps the products small
        iu = torch.triu_indices(d, d, device=dev)
        products = y[:, iu[0]] * y[:, iu[1]]  # (N, D(D+1)/2)
        for part in _chunks(len(w_all), chunk):
            w = w_all[part]  # (C, N)
            mu = w @ x / n  # (C, D)
            tr_g = (w @ sq - n * (mu * mu).sum(-1)) / (n - 1)
            m = w @ y / n  # (C, D)
            upper = (w @ products - n * m[:, iu[0]] * m[:, iu[1]]) / (n - 1)  # (C, D(D+1)/2)
            s = torch.zeros(len(w), d, d, dtype=torch.float64, device=dev)
            s[:, iu[0], iu[1]] = upper
            evals = torch.linalg.eigvalsh(s, UPLO="U")  # (C, D)
            fid = ((mu - mu_r) ** 2).sum(-1) + tr_g + tr_r - 2 * evals.clamp_min(0).sqrt().sum(-1)
            out[part] = fid.cpu().numpy()
        return out
    for b, w in enumerate(w_all):  # one resample at a time: only its distinct images, weighted by their counts
        keep = w > 0
        wk, xk, yk = w[keep], x[keep], y[keep]  # (k,), (k, D), (k, D)
        mu = wk @ xk / n  # (D,)
        tr_g = (wk @ sq[keep] - n * mu @ mu) / (n - 1)
        a = wk.sqrt()[:, None] * (yk - wk @ yk / n)  # (k, D): A^T A / (n-1) = S_r^1/2 S_g* S_r^1/2
        gram = a @ a.T if len(a) <= d else a.T @ a  # the smaller of the two, same non-zero eigenvalues
        evals = torch.linalg.eigvalsh(gram) / (n - 1)
        out[b] = float(((mu - mu_r) ** 2).sum() + tr_g + tr_r - 2 * evals.clamp_min(0).sqrt().sum())
    return out


def fid_value(generated: np.ndarray, reference: np.ndarray) -> float:
    """FID of the generated set itself (the identity resample)."""
    return float(fid_replicates(generated, reference, np.ones((1, len(generated))))[0])


def _poly_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch-fidelity's KID kernel: (a . b / D + 1)^3."""
    return (a @ b.T / a.shape[1] + 1) ** 3


def kid_replicates(generated: np.ndarray, reference: np.ndarray, weights: np.ndarray,
                   device: torch.device | str = "cpu") -> np.ndarray:
    """Unbiased MMD^2 (KID's estimand, torch-fidelity's polynomial kernel) of each resample, over all its
    pairs of distinct generated images, against the whole fixed reference set. The reference-reference term is
    the same for every resample, so only the terms that vary are exact: use the replicates' *spread* (as
    ``shifted_interval`` and ``bootstrap_difference`` do), not their level."""
    dev = torch.device(device)
    x = torch.as_tensor(np.asarray(generated), dtype=torch.float64, device=dev)
    r = torch.as_tensor(np.asarray(reference), dtype=torch.float64, device=dev)
    w = torch.as_tensor(np.asarray(weights), dtype=torch.float64, device=dev)  # (B, N)
    n = x.shape[0]
    k_gg = _poly_kernel(x, x)  # (N, N)
    k_gr = torch.cat([_poly_kernel(x, r[sl]).sum(1, keepdim=True) for sl in _chunks(len(r), 4096)], 1).sum(1)
    k_gr = k_gr / len(r)  # (N,): mean kernel value of each generated image with the reference set
    diag = torch.diagonal(k_gg)
    pairs = n * n - (w * w).sum(-1)  # ordered pairs of draws that are two different images
    within = (((w @ k_gg) * w).sum(-1) - (w * w) @ diag) / pairs
    cross = w @ k_gr / n
    out = within - 2 * cross
    out[pairs <= 0] = float("nan")
    return out.cpu().numpy()
