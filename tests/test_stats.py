"""Intervals and paired tests (``eval/metrics/intervals.py``) and how the runner attaches them to ``run.json``.

Coverage checks are seeded; each states its false-alarm probability (the chance that a correct interval lands
outside the band). The whole file takes 10-20 s on 2 CPU cores.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from eval.metrics import FIDKID, ClassAccuracy, MeanScore, intervals
from eval.metrics.intervals import Bootstrap
from eval.run.experiment import baselines, compare_records, summarize
from eval.run.suite import EvalSuite

CPU = torch.device("cpu")


def test_t_interval_covers_the_mean_of_skewed_values_as_stated():
    """2,000 repetitions (seed 20240) of 200 lognormal 'latencies' (sigma 0.25, mean exp(sigma^2/2)). The t
    interval's coverage there is 94.97 % (measured over 20,000 repetitions); with 2,000 repetitions the
    binomial spread is 0.49 %, so a correct interval lands outside 94-96 % with probability ~4 %."""
    rng = np.random.default_rng(20240)
    sigma, n, reps = 0.25, 200, 2000
    true = np.exp(sigma ** 2 / 2)
    covered = 0
    for _ in range(reps):
        lo, hi = intervals.t_interval(rng.lognormal(0.0, sigma, n), 0.95)
        covered += lo <= true <= hi
    assert 0.94 <= covered / reps <= 0.96, covered / reps


def test_speedup_interval_covers_the_ratio_of_mean_latencies():
    """1,000 repetitions (seed 7) of 200 paired prompts: AR latency a_i (lognormal), speedup per prompt s_i
    (lognormal, median 2, independent of a_i), the decoder's latency a_i / s_i; the true ratio of means is
    1 / E[1/s]. The paired percentile bootstrap covers it in ~94.5 %; the band 92.5-97 % is 2.9 binomial
    standard deviations below and 3.6 above (false alarm ~0.2 %)."""
    rng = np.random.default_rng(7)
    mu, sg, n, reps = np.log(2.0), 0.2, 200, 1000
    true = np.exp(mu - sg ** 2 / 2)
    covered = 0
    for r in range(reps):
        ar = rng.lognormal(0.0, 0.3, n)
        mine = ar / rng.lognormal(mu, sg, n)
        lo, hi = intervals.ratio_interval(ar, mine, Bootstrap(resamples=1000, seed=r), "timed")
        covered += lo <= true <= hi
    assert 0.925 <= covered / reps <= 0.97, covered / reps


def test_bootstrap_weights_are_seeded_counts():
    boot = Bootstrap(resamples=50, seed=3)
    w = boot.weights(7, "images")
    assert w.shape == (50, 7) and np.all(w.sum(1) == 7) and np.all(w >= 0)
    assert np.array_equal(w, Bootstrap(resamples=50, seed=3).weights(7, "images"))  # same for every decoder
    assert not np.array_equal(w, boot.weights(7, "timed"))  # units get their own draws
    assert not np.array_equal(w, Bootstrap(resamples=50, seed=4).weights(7, "images"))
    with pytest.raises(ValueError, match="eval.bootstrap.level"):
        Bootstrap(level=1.0)


def test_welch_reproduces_scipy():
    a = [2.9, 3.4, 3.1, 2.7, 3.8, 3.3, 3.0, 3.6, 2.8]
    b = [2.5, 2.6, 2.9, 2.4, 2.7, 3.1, 2.2]
    ours = intervals.welch(a, b)
    ref = scipy_stats.ttest_ind(a, b, equal_var=False)
    assert ours["t"] == pytest.approx(ref.statistic, rel=1e-12)
    assert ours["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    assert ours["df"] == pytest.approx(ref.df, rel=1e-12)
    lo, hi = ref.confidence_interval(0.95)
    assert ours["ci"] == pytest.approx([lo, hi], rel=1e-10)
    assert ours["difference"] == pytest.approx(np.mean(a) - np.mean(b))
    same = intervals.welch([1.0, 1.0, 1.0], [1.0, 1.0])  # two constant samples: an exact difference
    assert same["difference"] == 0 and same["p"] == 1.0 and same["ci"] == [0.0, 0.0]


def test_paired_bootstrap_on_identical_inputs_gives_zero_difference():
    x = np.random.default_rng(0).lognormal(0, 0.3, 40)
    out = intervals.paired_bootstrap(x, x.copy(), Bootstrap(), "timed")
    assert out["difference"] == 0.0 and out["ci"] == [0.0, 0.0] and out["p"] == 1.0 and out["n"] == 40
    shifted = intervals.paired_bootstrap(x + 0.5, x, Bootstrap(), "timed")  # a constant shift: exact, p minimal
    assert shifted["difference"] == pytest.approx(0.5) and shifted["ci"] == pytest.approx([0.5, 0.5])
    assert shifted["p"] == pytest.approx(2 / 1001)
    noisy = intervals.paired_bootstrap(x + np.random.default_rng(1).normal(0, 0.3, 40), x, Bootstrap(), "timed")
    assert noisy["ci"][0] < noisy["difference"] < noisy["ci"][1] and 0.0 < noisy["p"] <= 1.0
    # the p-value agrees with the interval: p < 0.05 only when the 95 % interval excludes 0 (the +1 of the
    # p-value makes it a little conservative at the boundary)
    rng = np.random.default_rng(3)
    outcomes = set()
    for _ in range(30):
        d = intervals.paired_bootstrap(x + rng.normal(0.08, 0.3, 40), x, Bootstrap(resamples=400), "timed")
        excludes = d["ci"][0] > 0 or d["ci"][1] < 0
        assert excludes or d["p"] >= 0.05, d
        outcomes.add(d["p"] < 0.05)
    assert outcomes == {True, False}  # both cases were seen


def test_wilson_interval():
    lo, hi = intervals.wilson_interval(8, 10, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)  # the textbook value
    high = intervals.wilson_interval(10, 10)
    assert high[1] == pytest.approx(1.0) and high[0] < 0.9  # not degenerate
    assert intervals.wilson_interval(0, 0) is None


def gaussian_features(n: int, shift: float, seed: int, dim: int = 12) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(shift, 1.0, (n, dim)) @ np.diag(np.linspace(0.5, 1.5, dim))


def test_fid_replicates_match_clean_fid_and_torch_fidelity():
    from cleanfid.fid import fid_from_feats
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric

    for n in (8, 60):  # N < D (Gram route) and N > D (covariance route)
        gen, ref = gaussian_features(n, 0.3, 1, dim=16 if n == 8 else 12), gaussian_features(200, 0.0, 2,
                                                                                              16 if n == 8 else 12)
        ours = intervals.fid_value(gen, ref)
        assert ours == pytest.approx(float(fid_from_feats(ref, gen)), rel=1e-6, abs=1e-6)
        tf = fid_statistics_to_metric(fid_features_to_statistics(torch.from_numpy(ref)),
                                      fid_features_to_statistics(torch.from_numpy(gen)), verbose=False)
        assert ours == pytest.approx(float(tf["frechet_inception_distance"]), rel=1e-6, abs=1e-6)
    # a resample given by counts equals the FID of the resampled rows themselves
    gen, ref = gaussian_features(30, 0.3, 3), gaussian_features(100, 0.0, 4)
    idx = np.random.default_rng(5).integers(0, 30, 30)
    counts = np.bincount(idx, minlength=30)[None].astype(float)
    assert intervals.fid_replicates(gen, ref, counts)[0] == pytest.approx(float(fid_from_feats(ref, gen[idx])),
                                                                          rel=1e-6)


def test_fid_replicates_batched_route_equals_one_resample_at_a_time(monkeypatch):
    """The batched route (products of centred features, chunked resamples, one batched eigenvalue problem) and the
    per-resample route give the same replicates to rounding, across chunk boundaries and for shifted features."""
    gen, ref = gaussian_features(90, 25.0, 6, dim=10), gaussian_features(300, 24.0, 7, dim=10)
    counts = np.random.default_rng(8).multinomial(90, np.full(90, 1 / 90), size=37).astype(float)
    batched = intervals.fid_replicates(gen, ref, counts, chunk=16)
    monkeypatch.setattr(intervals, "BATCHED_FID_BYTES", 0)
    one_at_a_time = intervals.fid_replicates(gen, ref, counts)
    assert np.allclose(batched, one_at_a_time, rtol=1e-10, atol=1e-10)
    assert batched.std() > 0.01  # the resamples differ: the comparison is not of 37 copies


def test_kid_replicates_are_the_unbiased_mmd_over_distinct_images():
    gen, ref = gaussian_features(20, 0.3, 6), gaussian_features(50, 0.0, 7)
    d = gen.shape[1]
    k = lambda a, b: (a @ b.T / d + 1) ** 3  # noqa: E731  torch-fidelity's kernel
    kgg = k(gen, gen)
    full = (kgg.sum() - np.trace(kgg)) / (20 * 19) - 2 * k(gen, ref).mean()
    assert intervals.kid_replicates(gen, ref, np.ones((1, 20)))[0] == pytest.approx(full, rel=1e-9)
    counts = np.zeros((1, 20))
    counts[0, 0] = 20  # one image drawn 20 times: no pair of distinct images
    assert np.isnan(intervals.kid_replicates(gen, ref, counts)[0])


def test_fid_bootstrap_interval_contains_the_estimate_and_is_not_degenerate(tmp_path):
    ref = gaussian_features(300, 0.0, 8)
    np.save(tmp_path / "ref.npy", ref)
    metric = FIDKID(reference_features=str(tmp_path / "ref.npy"), protocol="torch_fidelity",
                    extractor="random_conv", kid_subset_size=50)
    gen = gaussian_features(80, 0.4, 9)
    boot = Bootstrap(resamples=300)
    estimate = metric.estimate(gen, CPU)
    reps = metric.replicates(gen, boot.weights(80, "images"), CPU)
    for key in ("fid_random_conv", "kid_random_conv"):
        lo, hi = metric.interval(key, gen, estimate, reps, boot.level)
        assert lo < estimate[key] < hi and hi - lo > 1e-3 * abs(estimate[key]), (key, lo, estimate[key], hi)
    # the raw bootstrap replicates of FID sit above the estimate (duplicated images): the interval is re-centred
    assert np.mean(reps["fid_random_conv"]) > estimate["fid_random_conv"]


def test_fid_refuses_fewer_than_two_images_before_generation(tmp_path):
    np.save(tmp_path / "ref.npy", gaussian_features(20, 0.0, 0, dim=64))
    fid = FIDKID(reference_features=str(tmp_path / "ref.npy"), protocol="torch_fidelity", extractor="random_conv")
    with pytest.raises(ValueError, match="FIDKID needs at least 2 images.*eval.num_prompts=1"):
        EvalSuite(num_prompts=1, metrics=[fid])
    EvalSuite(num_prompts=2, metrics=[fid])


def stats_record(index: int, iterations: int, latency: float, timed: bool = True, tv: float = 0.0) -> dict:
    tokens = 17
    return {"index": index, "prompt": f"p{index}", "seed": index, "timed": timed, "batch_id": None,
            "batch_s": latency,
            "stats": {"num_tokens": tokens, "iterations": iterations, "mean_accepted_length": (tokens - 1) / iterations,
                      "target_forwards": iterations + 1, "drafter_forwards": 2 * iterations, "latency_s": latency,
                      "tv_per_step": tv, "tv_sum": tv * iterations, "tv_steps": iterations, "batch_size": 1}}


def test_summarize_and_compare_records_attach_intervals_and_tests():
    rng = np.random.default_rng(0)
    ar = [stats_record(i, 16, 1.0 + 0.1 * rng.random()) for i in range(12)]
    sd = [stats_record(i, int(rng.integers(5, 9)), 0.5 + 0.1 * rng.random(), tv=0.01 * rng.random())
          for i in range(12)]
    boot = Bootstrap(resamples=200)
    s_ar, s_sd = summarize(ar, ar, boot), summarize(sd, ar, boot)
    assert s_ar["speedup"] == 1.0 and s_ar["speedup_ci"] == [1.0, 1.0] and s_ar["mean_accepted_length_ci"] == [1.0, 1.0]
    for key in ("mean_accepted_length", "latency_s", "speedup", "target_forwards_per_image",
                "drafter_forwards_per_image", "tv_per_step", "tv_per_image", "tv_per_token"):
        lo, hi = s_sd[f"{key}_ci"]
        assert lo < s_sd[key] < hi, key
    assert s_sd["speedup_num_pairs"] == 12
    comp = compare_records(sd, ar, boot)
    welch = comp["mean_accepted_length"]
    assert welch["test"] == "Welch t" and welch["difference"] > 0 and welch["p"] < 1e-6
    assert comp["latency_s"]["difference"] < 0 and comp["latency_s"]["ci"][1] < 0 and comp["latency_s"]["n"] == 12
    json.dumps([s_ar, s_sd, comp])  # run.json-ready


def test_baselines_rule():
    names = ["ar", "sd", "coolsd", "lantern_pp"]
    assert baselines(names, ["sd"]) == {"ar": [], "sd": ["ar"], "coolsd": ["sd"], "lantern_pp": ["sd"]}
    assert baselines(["ar", "coolsd"], ["sd"]) == {"ar": [], "coolsd": ["ar"]}  # a run without sd
    assert baselines(names, ["sd", "ar"])["coolsd"] == ["sd", "ar"]
    assert EvalSuite(compare_to="sd").compare_to == ["sd"]


class Constant(MeanScore):
    key = "constant"

    def __init__(self, values):
        self.values = np.asarray(values, float)

    def scores(self, image_paths, prompts, device):
        return self.values[: len(image_paths)]


def test_mean_scores_get_t_intervals_and_accuracy_gets_wilson():
    values = np.random.default_rng(2).normal(0.3, 0.02, 50)
    metric = Constant(values)
    est = metric.compute(["x"] * 50, ["p"] * 50, CPU)
    assert est == {"constant": pytest.approx(values.mean())}
    reps = metric.replicates(values, Bootstrap(resamples=100).weights(50, "images"), CPU)
    assert metric.interval("constant", values, est, reps, 0.95) == pytest.approx(intervals.t_interval(values))
    correct = np.array([1.0] * 9 + [0.0])
    acc = ClassAccuracy.__new__(ClassAccuracy)  # the interval needs no classifier
    assert acc.interval("class_accuracy", correct, {}, {}, 0.95) == pytest.approx(intervals.wilson_interval(9, 10))
