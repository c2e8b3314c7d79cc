"""The evaluation suite: the settings of one run's generation-and-measurement pass (``configs/eval/*.yaml``,
``EvalSuite``), the seeds of its images, and the decoders it compares (``select_decoders``).

Seeds: image ``i`` of every decoder is drawn with ``seed + i`` (identical for every decoder, and independent of
batching and sharding); warm-up images draw seeds counting down from ``WARMUP_SEED``, never a measured image's.

Example: ``configs/eval/quick.yaml`` is ``EvalSuite(num_prompts=8, ...)`` through Hydra's ``_target_``;
``select_decoders(cfg, decoder_overridden=False)`` is the default run's ``ar`` plus the suite's decoders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd import validate
from eval.metrics.intervals import Bootstrap

#: warm-up images (of a run, the benchmark, the peer bench) use seeds counting down from here: never the seed of
#: a measured image, and still a valid numpy seed
WARMUP_SEED = 2**31 - 1
RESUME = ("auto", "overwrite")
NUMERICS_MISMATCH = ("refuse", "accept")
CODE_MISMATCH = ("refuse", "rerun", "accept")
AR_TIMING = ("run", "table")


@dataclass
class EvalSuite:
    """Settings of the generation-and-measurement pass (``configs/eval/*.yaml``).

    ``num_prompts`` images per decoder; ``seed`` + prompt index seeds each image (identical for every
    decoder). The first ``speed_prompts`` prompts (None = all) are the timed subset: generated at batch 1,
    decoders interleaved per prompt, after ``warmup`` untimed images each; latency and speedup come from
    them. The other prompts are generated in batches of ``batch_size`` (decoders interleaved per batch);
    throughput comes from them. An image depends only on its prompt, seed and the config, not on how it
    was batched. ``threads`` sets torch's CPU threads (None keeps torch's default); ``metrics`` are
    image-quality metrics computed on each decoder's images; ``resume``: ``auto`` reuses finished records
    that match this run's fingerprint and refuses on any that do not, ``overwrite`` deletes mismatching
    records first; ``reuse_ar``: take AR images of the batched set from the cache of earlier runs with the
    same fingerprint (``$COOLSD_CACHE/ar``). ``numerics_mismatch``: records of this folder, or ranks of this run,
    whose float32 arithmetic differs from this machine's (the start-up self-check's signature,
    ``coolsd.numerics``: another GPU kind after a requeue, another CPU), ``accept`` (the default: the row carries
    on; every record keeps its signature, ``run.json`` counts the images per signature and the tables mark the
    row) or ``refuse`` (stop before any work). ``code_mismatch``: records of this folder made by other code than
    this checkout's (the digest of the source that makes a decoder's tokens, ``eval.records.code_digest``: an edited
    acceptance rule, drafter, loop or model adapter), ``refuse`` (the default: stop before any work, naming the
    files), ``rerun`` (delete those decoders' records and make them again) or ``accept`` (keep them; ``run.json``
    names the files and the tables mark the row §). ``ar_timing``: ``run`` times AR at batch 1 in every run
    (the speedup's denominator from the same process); ``table`` times it once per table, AR configuration and
    GPU kind, in the row that claims it first (interleaved there with that row's decoder), and the other rows
    divide its latency (``eval.run.experiment.ar_timing``; the paper-table experiments set it). ``preflight``:
    before the timed phase, one batch of every decoder at ``batch_size`` (real images, recorded) and one scoring
    batch through every metric, so an out-of-memory or a metric's missing weights show in minutes, not after the
    timed phase (``eval.run.generator``). ``bootstrap``: resamples, seed and level of every interval and
    test (``eval.metrics.intervals.Bootstrap``); ``compare_to``: the baselines of the paired comparisons (see
    ``baselines``).
    """

    num_prompts: int = 8
    warmup: int = 1
    seed: int = 0
    save_images: bool = True
    threads: int | None = None
    speed_prompts: int | None = None
    batch_size: int = 1
    resume: str = "auto"
    reuse_ar: bool = True
    numerics_mismatch: str = "accept"
    code_mismatch: str = "refuse"
    ar_timing: str = "run"
    preflight: bool = True
    metrics: list[Any] = field(default_factory=list)
    bootstrap: Bootstrap = field(default_factory=Bootstrap)
    compare_to: Any = ("sd",)

    def __post_init__(self) -> None:
        validate.eval_options(self.num_prompts, self.warmup, self.seed, self.save_images, self.threads,
                              self.speed_prompts)
        validate.integer("eval.batch_size", self.batch_size, minimum=1)
        validate.choice("eval.resume", self.resume, RESUME)
        validate.boolean("eval.reuse_ar", self.reuse_ar)
        validate.choice("eval.numerics_mismatch", self.numerics_mismatch, NUMERICS_MISMATCH)
        validate.choice("eval.code_mismatch", self.code_mismatch, CODE_MISMATCH)
        validate.choice("eval.ar_timing", self.ar_timing, AR_TIMING)
        validate.boolean("eval.preflight", self.preflight)
        if self.metrics and not self.save_images:
            raise ValueError("eval.metrics score the saved images: set eval.save_images=true or eval.metrics=[]")
        if not isinstance(self.bootstrap, Bootstrap):
            self.bootstrap = Bootstrap(**validate.mapping("eval.bootstrap", self.bootstrap,
                                                          ("resamples", "seed", "level")))
        names = [self.compare_to] if isinstance(self.compare_to, str) or self.compare_to is None else \
            list(self.compare_to)
        self.compare_to = [validate.string("eval.compare_to", n) for n in names if n is not None]
        for metric in self.metrics:  # before any image: FID of one image crashes only after generation
            need = getattr(metric, "min_images", 1)
            if self.num_prompts < need:
                raise ValueError(f"eval.metrics: {type(metric).__name__} needs at least {need} images per decoder "
                                 f"(the covariance of one image's features is undefined), but eval.num_prompts="
                                 f"{self.num_prompts}: set eval.num_prompts>={need} or leave that metric out of "
                                 "eval.metrics")

    @property
    def num_timed(self) -> int:
        return min(self.speed_prompts or self.num_prompts, self.num_prompts)


def select_decoders(cfg: DictConfig, decoder_overridden: bool) -> dict[str, DictConfig]:
    """The decoder configs this run compares, AR first; ``cfg.decoder`` (with its overrides) wins its name, and
    every one runs on its path (``decoder.path``), so each speedup is over AR on the same path, and with
    ``decoder.refill=true`` every one refills its finished rows (AR's batches are unchanged by it).

    ``compare``: ``auto`` (the set ``all``, the default run's decoders, when no ``decoder=`` was given on the
    command line, else the decoder's ``compare_auto`` entry, e.g. PathRelax beside SJD, or none), ``none``, the
    name of a set of ``compare_sets`` (suite entry -> overrides of its config, e.g. ``jacobi``: every window as long
    as SJD's), or a list of suite names.
    """
    suite = cfg.suite
    mode = cfg.compare
    sets = OmegaConf.select(cfg, "compare_sets", default=None) or {}
    if mode == "auto":
        beside = OmegaConf.select(cfg, f"compare_auto.{cfg.decoder.name}", default=None)
        mode = "all" if not decoder_overridden else list(beside) if beside else "none"
    overrides: dict[str, Any] = {}
    if mode == "none":
        names = []
    elif isinstance(mode, str) and mode in sets:
        overrides = {name: sets[mode][name] or {} for name in sets[mode]}
        names = list(overrides)
    elif OmegaConf.is_list(mode) or isinstance(mode, list):
        names = list(mode)
    else:
        raise ValueError(f"compare must be auto, none, one of the sets {sorted(sets)} (compare_sets) or a list of "
                         f"suite decoders {list(suite)}; got {mode!r}")
    unknown = [n for n in names if n not in suite]
    if unknown:
        raise ValueError(f"compare lists unknown decoders {unknown}; allowed: {list(suite)}")
    if "ar" not in suite:
        raise ValueError("suite.ar (the AR baseline) is missing from the config")
    chosen: dict[str, DictConfig] = {"ar": suite.ar}
    for name in names:
        if overrides.get(name):  # resolved first: a merged copy no longer sees the config's root
            chosen[name] = OmegaConf.merge(OmegaConf.to_container(suite[name], resolve=True),
                                           OmegaConf.to_container(overrides[name], resolve=True))
        else:
            chosen[name] = suite[name]
    chosen[cfg.decoder.name] = cfg.decoder
    path = OmegaConf.select(cfg, "decoder.path", default="eager")
    refill = OmegaConf.select(cfg, "decoder.refill", default=False)
    for name, node in chosen.items():  # one path per run: a speedup is over AR on the same path
        if OmegaConf.select(node, "path", default="eager") != path:
            chosen[name] = OmegaConf.merge(OmegaConf.to_container(node, resolve=True), {"path": path})
        if refill and OmegaConf.select(chosen[name], "refill", default=False) != refill:  # and one way of batching
            chosen[name] = OmegaConf.merge(OmegaConf.to_container(chosen[name], resolve=True), {"refill": refill})
    return chosen
