"""What one ``run.py`` invocation does: build the model and decoders, generate, measure, score, record.

One run = one model, one prompt set, one or more decoders compared in the same process, with ``ar`` always
measured as the speedup denominator on the same prompts and seeds (``seed + prompt index``, so results do
not depend on sharding). Decoders are interleaved per prompt (prompt 0 with every decoder, then prompt 1,
...) so slow drifts of the machine hit all of them alike. The run's settings and the decoders it compares:
``eval/run/suite.py``; one rank's generation: ``eval/run/generator.py``.

Resumable: per-image records are appended to ``records/<decoder>[.rank<r>].jsonl`` as they finish and images
are written atomically (``eval/records/image_records.py``); rerunning with the same output folder
(``hydra.run.dir=<folder>``) skips every finished (decoder, prompt), whichever process finished it
(``eval/run/resume.py``), and a row whose ``run.json`` is complete for its config is not run again
(``finished_record``).

Sharded: launched by ``torchrun --nproc_per_node=K run.py ...``, or as the K tasks of a SLURM job
(``hydra/launcher=slurm`` with ``tasks_per_node``; ``eval/run/shards.py`` reads the ranks), every rank takes
the prompts with ``index % K == rank`` (on GPU one device per local rank); rank 0 waits for all through their
markers on disk (no collective that could time out), gathers the records, computes the metrics and writes
``run.json``.

Every metric of ``run.json`` carries its 95 % interval (``<metric>_ci: [lo, hi]``) and every decoder its
paired comparisons with the baselines of ``eval.compare_to`` (``vs_<baseline>``); ``eval/metrics/intervals.py``
says which interval and test goes with which number, ``run.json``'s ``uncertainty`` block repeats it.

Example: ``python run.py decoder=sd eval.num_prompts=32``;
``torchrun --nproc_per_node=8 run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k hydra.run.dir=runs/x``.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.decoding import Decoder
from coolsd.device import DeviceError, check_model_device
from coolsd.fingerprint import TOKEN_CODE_VERSION, weights_digest
from coolsd.io import atomic_write_bytes, atomic_write_json
from coolsd.launch import launch_environment
from coolsd.numerics import check_batch_invariance
from coolsd.required_files import MissingFilesError
from coolsd.types import pooled_accepted_length
from eval.metrics import intervals
from eval.metrics.intervals import Bootstrap
from eval.records.code_digest import CodeIdentity, current_files, decoder_code, mismatch_text
from eval.records.environment import environment, git_commit, hardware_name, write_environment
from eval.records.fingerprints import decoder_fingerprint
from eval.records.image_records import load_records, record_signatures, timed_records
from eval.records.run_json import read_run
from eval.report.evaluation_card import card_lines, record_card
from eval.report.labels import canonical, decoder_options, method_label
from eval.report.run_table import (comparison_table, markdown_table, one_line_summary, save_grid,
                                   speed_quality_plot)
from eval.run.ar_cache import ARCache, ar_key
from eval.run.generator import Generator
from eval.run.loggers import Progress
from eval.run.prefetch import check_run_files, run_overrides
from eval.run.preflight import validate_decoders
from eval.run.resume import RunRecords
from eval.run.shards import Shards, dist_options
from eval.run.suite import EvalSuite, select_decoders

log = logging.getLogger("coolsd")
PHASES = ("prefill_s", "draft_s", "verify_s", "accept_s", "observe_s", "diagnostics_s", "decode_s")


def _mean_ci(out: dict[str, Any], key: str, values: list[float], level: float) -> None:
    out[key] = sum(values) / len(values)
    out[f"{key}_ci"] = intervals.t_interval(values, level)


def _timed_latency(records: list[dict]) -> dict[int, float]:
    return {r["index"]: r["stats"]["latency_s"] for r in records if r.get("timed")}


def summarize(records: list[dict], ar_records: list[dict] | None = None,
              bootstrap: Bootstrap | None = None) -> dict[str, Any]:
    """Flat metrics of one decoder over its images, each with its interval (``<key>_ci``,
    ``eval/metrics/intervals.py``).

    Latency and phase times come from the timed images (``timed``: batch 1, interleaved); speedup is AR's mean
    latency over the decoder's, on the prompts timed for both (``ar_records``; None: no speedup); throughput
    from the batches generated in this run (reused images have no timing here); counts from every image.
    Intervals: t over images for means, percentile bootstrap over images / prompts / batches for the pooled
    accepted length, TV per token, speedup and throughput; None where there are fewer than 2 units.
    """
    boot = bootstrap or Bootstrap()
    level = boot.level
    n = len(records)
    stats_ = [r["stats"] for r in records]
    timed = [r["stats"] for r in records if r.get("timed")]
    tokens = sum(s["num_tokens"] for s in stats_)
    out: dict[str, Any] = {
        "num_images": n,
        "num_timed": len(timed),
        "mean_accepted_length": pooled_accepted_length(stats_),
        "mean_accepted_length_ci": intervals.ratio_interval([s["num_tokens"] - 1 for s in stats_],
                                                        [s["iterations"] for s in stats_], boot, "images"),
    }
    _mean_ci(out, "target_forwards_per_image", [s["target_forwards"] for s in stats_], level)
    _mean_ci(out, "drafter_forwards_per_image", [s["drafter_forwards"] for s in stats_], level)
    measured = all(s.get("tv_measured", True) for s in stats_)
    if measured:
        _mean_ci(out, "tv_per_step", [s["tv_per_step"] for s in stats_], level)
    else:  # joint tests (SJD-SV): no analytic one-step TV; the tables show "–" and a note, never 0
        out["tv_measured"] = False
    if measured and all("tv_sum" in s for s in stats_):
        _mean_ci(out, "tv_per_image", [s["tv_sum"] for s in stats_], level)
        out["tv_per_token"] = sum(s["tv_sum"] for s in stats_) / max(tokens, 1)
        out["tv_per_token_ci"] = intervals.ratio_interval([s["tv_sum"] for s in stats_],
                                                      [s["num_tokens"] for s in stats_], boot, "images")
    if timed:
        latencies = [s["latency_s"] for s in timed]
        _mean_ci(out, "latency_s", latencies, level)
        latency = out["latency_s"]
        out["latency_std_s"] = math.sqrt(sum((x - latency) ** 2 for x in latencies) / max(len(timed) - 1, 1))
        for phase in PHASES:
            if all(phase in s for s in timed):
                _mean_ci(out, phase, [s[phase] for s in timed], level)
        ar = _timed_latency(ar_records) if ar_records is not None else {}
        if ar:
            mine = _timed_latency(records)
            common = sorted(set(ar) & set(mine))  # the same prompts (and seeds): paired by prompt
            out["speedup"] = (sum(ar.values()) / len(ar)) / latency
            out["speedup_ci"] = intervals.ratio_interval([ar[i] for i in common], [mine[i] for i in common], boot,
                                                     "timed")
            out["speedup_num_pairs"] = len(common)
    batches = _batches(records)
    if batches:
        sizes = [b for b, _ in batches.values()]
        walls = [w for _, w in batches.values()]
        out["throughput_img_s"] = sum(sizes) / sum(walls)
        out["throughput_img_s_ci"] = intervals.ratio_interval(sizes, walls, boot, "batches")  # over batches
        out["throughput_images"] = sum(sizes)
        out["throughput_batches"] = len(batches)
        out["throughput_batch_size"] = max(r["stats"]["batch_size"] for r in records if r.get("batch_id") in batches)
        base = _batches(ar_records or [])
        if base:  # the speedup at batch > 1: images per second over AR's, each over its own batches
            out["batch_speedup"], out["batch_speedup_ci"] = intervals.throughput_ratio(
                sizes, walls, [b for b, _ in base.values()], [w for _, w in base.values()], boot)
    peaks = [s["peak_mem_mb"] for s in stats_ if s.get("peak_mem_mb") is not None]
    if peaks:
        out["peak_mem_mb"] = max(peaks)
    signatures: dict[str, int] = {}  # the arithmetics its images were made under (several: a requeue elsewhere)
    for r in records:
        key = r.get("numerics") or "unknown"
        signatures[key] = signatures.get(key, 0) + 1
    out["numerics_signatures"] = signatures
    codes: dict[str, int] = {}  # the code digests its images were made by (several: eval.code_mismatch=accept)
    for r in records:
        key = r.get("code") or "unknown"
        codes[key] = codes.get(key, 0) + 1
    out["code_digests"] = codes
    made_on: dict[str, int] = {}
    for r in records:
        if r.get("timed"):
            made_on[r.get("hardware") or "unknown"] = made_on.get(r.get("hardware") or "unknown", 0) + 1
    if made_on:
        out["timed_hardware"] = made_on
    return out


def _batches(records: list[dict]) -> dict[str, tuple[int, float]]:
    """{batch id: (images, wall seconds)} of the batches that have a timing on this hardware (images reused from
    another GPU kind carry none, ``eval.run.generator.Generator._reuse_ar``); a refilled queue's images are its
    ``batch_images`` (``decoder.refill``: more than its width, the records' ``batch_size``)."""
    out: dict[str, tuple[int, float]] = {}
    for r in records:
        if r.get("batch_id") and r.get("batch_s"):
            out[r["batch_id"]] = (r.get("batch_images") or r["stats"]["batch_size"], r["batch_s"])
    return out


def baselines(names: list[str], compare_to: list[str]) -> dict[str, list[str]]:
    """Which decoders each decoder of the run is compared with (``eval.compare_to``, default ``[sd]``).

    Every decoder but ``ar`` is compared with each ``compare_to`` decoder this run measured, except itself;
    one left with none (the baseline itself, or a run without it) is compared with ``ar``. ``ar`` is compared
    with nothing: it is the speedup's denominator (``speedup_ci`` is the comparison with AR's speed).
    """
    out = {}
    for name in names:
        if name == "ar":
            out[name] = []
            continue
        chosen = [b for b in compare_to if b != name and b in names]
        out[name] = chosen or (["ar"] if "ar" in names else [])
    return out


def compare_records(records: list[dict], base_records: list[dict], bootstrap: Bootstrap) -> dict[str, Any]:
    """Decoding comparisons of a decoder with a baseline on the same prompts: Welch's t-test on per-image
    accepted length (the COOL-SD paper's test) and a paired bootstrap on latency (prompts timed for both)."""
    out: dict[str, Any] = {
        "mean_accepted_length": {
            **intervals.welch([r["stats"]["mean_accepted_length"] for r in records],
                          [r["stats"]["mean_accepted_length"] for r in base_records], bootstrap.level),
            "statistic": "mean of per-image accepted lengths"}}
    mine, base = _timed_latency(records), _timed_latency(base_records)
    common = sorted(set(mine) & set(base))
    if common:
        out["latency_s"] = intervals.paired_bootstrap([mine[i] for i in common], [base[i] for i in common],
                                                  bootstrap, "timed")
    return out


def score_metric(metric: Any, ordered: dict[str, list[dict]], out_dir: Path, device: torch.device,
                 bootstrap: Bootstrap, compared: dict[str, list[str]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """One image metric on every decoder: ({decoder: estimates with ``_ci``}, {decoder: {baseline:
    {key: paired difference}}}). Per-image values are computed once; every decoder's replicates use the same
    resampled prompt sets, so differences of replicates are paired by prompt."""
    values, estimates, reps = {}, {}, {}
    for name, recs in tqdm(ordered.items(), desc=f"scoring {type(metric).__name__}", unit="decoder"):
        values[name] = metric.per_image([out_dir / r["image"] for r in recs], [r["prompt"] for r in recs], device)
        estimates[name] = metric.estimate(values[name], device)
    n = len(next(iter(ordered.values())))
    weights = bootstrap.weights(n, "images")
    for name in ordered:
        reps[name] = metric.replicates(values[name], weights, device)
        for key in reps[name]:
            estimates[name][f"{key}_ci"] = metric.interval(key, values[name], estimates[name], reps[name],
                                                           bootstrap.level)
    differences: dict[str, dict] = {}
    for name, bases in compared.items():
        for base in bases:
            differences.setdefault(name, {})[base] = {
                key: intervals.bootstrap_difference(estimates[name][key] - estimates[base][key],
                                                reps[name][key] - reps[base][key], bootstrap.level, n=n)
                for key in reps[name]}
    return estimates, differences


def run_labels(decoder_cfgs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{suite name: label}: the method's paper name (from the decoder config's ``name``, so suite entries such
    as ``coolsd_d2`` read "COOL-SD δ=2") with its headline options, plus the options that differ between the
    run's entries of the same method (``(uniform schedule)``, ``(G* resampling)``)."""
    options = {name: decoder_options(dc) for name, dc in decoder_cfgs.items()}
    method = {name: str(dc.get("name", name)) for name, dc in decoder_cfgs.items()}
    labels = {}
    for name, opts in options.items():
        same = [options[n] for n in options if method[n] == method[name]]
        noted = sorted({k for o in same for k in set(o) | set(opts) if canonical(o.get(k)) != canonical(opts.get(k))})
        labels[name] = method_label(method[name], opts, noted)
    return labels


UNCERTAINTY = {  # run.json's description of each interval (eval/metrics/intervals.py has the reasons)
    "mean_accepted_length": "percentile bootstrap over images of committed tokens / verify forwards (pooled)",
    "target_forwards_per_image": "t interval over images", "drafter_forwards_per_image": "t interval over images",
    "tv_per_step": "t interval over images (per-image mean TV per acceptance test)",
    "tv_per_image": "t interval over images", "tv_per_token": "percentile bootstrap over images (ratio of sums)",
    "latency_s": "t interval over the timed images", "<phase>_s": "t interval over the timed images",
    "speedup": "percentile bootstrap over prompts timed for both the decoder and AR (ratio of mean latencies)",
    "throughput_img_s": "percentile bootstrap over batches (images / wall seconds)",
    "fid, kid": "bootstrap over generated images' features, reference fixed, re-centred on the estimate",
    "clip_score, image_reward, hps_v2": "t interval over images",
    "class_accuracy": "Wilson score interval",
    "vs_<baseline>": "mean_accepted_length: Welch t-test on per-image accepted lengths; latency_s: paired "
                     "bootstrap over prompts; image metrics (fid, kid, clip_score, ...): paired bootstrap over "
                     "prompts (difference of the two decoders' replicates); p two-sided",
    "none": "counts, maxima (peak_mem_mb) and spreads (latency_std_s, kid_std) carry no interval",
}


def check_device_then_files(cfg: DictConfig, decoder_cfgs: Mapping[str, Any]) -> None:
    """No silent CPU fallback (``coolsd.device``), then every file the run needs (model, drafters, prompts,
    metrics), both before the target is built. A device error also names the files that are missing, with their
    fetch commands, so one message says everything that stands between this machine and the run."""
    try:
        check_model_device(OmegaConf.to_container(cfg.model, resolve=True))
    except DeviceError as device_error:
        try:
            check_run_files(cfg, decoder_cfgs, run_overrides())
        except MissingFilesError as missing:
            raise DeviceError(f"{device_error}\n\nOn top of that, {missing}") from None
        raise
    check_run_files(cfg, decoder_cfgs, run_overrides())


def run_experiment(cfg: DictConfig, output_dir: str | Path, decoder_overridden: bool = True,
                   choices: dict[str, Any] | None = None, job: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate, measure and score on every rank (``eval.run.shards.Shards``: torchrun, SLURM tasks or one
    process, ``dist.*`` keys); rank 0 writes ``run.json`` and returns the record, other ranks return ``{}``.
    A rank that stops on an error, or is requeued (``SystemExit``), says so in its marker
    (``ranks/rank<k>.json``), so the ranks waiting for it stop waiting."""
    finished = finished_record(Path(output_dir), cfg)
    if finished is not None:  # a resubmitted or requeued row that is complete: no process group, no model
        if launch_environment().rank == 0:
            print(f"{output_dir}/run.json is complete for this config ({finished['num_prompts']} prompts, "
                  f"{len(finished['per_decoder'])} decoders); nothing to do. Delete it to score again.")
            print(one_line_summary(finished))
            return finished
        return {}
    shards = Shards(**dist_options(OmegaConf.select(cfg, "dist", default=None)))
    try:
        return _run_experiment(cfg, shards, output_dir, decoder_overridden, choices, job)
    except BaseException as error:
        shards.fail(error)
        raise
    finally:
        shards.close()


#: config keys that change no number of run.json (how ranks meet and wait)
UNSCORED_KEYS = ("dist",)
#: ``eval`` keys that change no number either: what to do on a code mismatch, whether to try a batch first
UNSCORED_EVAL_KEYS = ("code_mismatch", "preflight")


def _scored(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config without ``UNSCORED_KEYS`` and ``UNSCORED_EVAL_KEYS``."""
    out = {k: v for k, v in config.items() if k not in UNSCORED_KEYS}
    if isinstance(out.get("eval"), dict):
        out["eval"] = {k: v for k, v in out["eval"].items() if k not in UNSCORED_EVAL_KEYS}
    return out


def finished_record(out_dir: Path, cfg: DictConfig) -> dict[str, Any] | None:
    """``out_dir/run.json`` if it holds this run, complete: the same resolved config (but ``UNSCORED_KEYS``), every
    decoder's records made by this token code version and by today's code (``records/<decoder>.code.json``, the
    digest of the source that makes its tokens), all of them on disk and readable, with their image files; else
    None (a damaged or deleted record or image is made again by the normal resume). Records of code edited since
    are refused here, before anything loads, under ``eval.code_mismatch=refuse`` (the default); ``rerun`` and
    ``accept`` go on to the normal resume, which makes them again or keeps and marks them."""
    path = out_dir / "run.json"
    if not path.is_file():
        return None
    try:
        record = read_run(path)  # a run.json of an earlier version: its config with today's class paths
        current = OmegaConf.to_container(cfg, resolve=True)
    except (OSError, ValueError):
        return None
    if _scored(record.get("config") or {}) != _scored(current):
        return None
    n = record.get("num_prompts")
    changed = []
    for name, metrics in (record.get("per_decoder") or {}).items():
        meta = out_dir / "records" / f"{name}.fingerprint.json"
        try:
            version = json.loads(meta.read_text()).get("code_version")
        except (OSError, ValueError):
            return None
        if version != TOKEN_CODE_VERSION or metrics.get("num_images") != n:
            return None
        code = out_dir / "records" / f"{name}.code.json"
        if code.is_file():  # records made before code digests have none: TOKEN_CODE_VERSION alone judges them
            try:
                old = CodeIdentity.from_dict(json.loads(code.read_text()))
            except (OSError, ValueError):
                return None
            now = current_files(old.files)
            if now.changed(old):
                changed.append(mismatch_text(name, now.changed(old), old, now))
        with warnings.catch_warnings():  # a damaged line is reported by the resume that follows
            warnings.simplefilter("ignore")
            records = load_records(out_dir / "records", name)
        if sorted(records) != list(range(n or 0)) or any(r.get("image") and not (out_dir / r["image"]).is_file()
                                                          for r in records.values()):
            return None
    if changed:
        policy = OmegaConf.select(cfg, "eval.code_mismatch", default="refuse")
        if policy == "refuse":
            raise RuntimeError(
                f"{out_dir}/run.json is complete for this config, but made by other code than this checkout's:\n  - "
                + "\n  - ".join(changed) + "\nNothing was loaded. eval.code_mismatch=rerun makes those decoders' "
                "images again with today's code (it DELETES their records in this folder); eval.code_mismatch=accept "
                "keeps them and scores the row again (run.json names the files, the tables mark it §); or restore the "
                "code (git checkout <the commit in run.json>).")
        return None
    return record if record.get("per_decoder") else None


def _run_experiment(cfg: DictConfig, shards: Shards, output_dir: str | Path, decoder_overridden: bool,
                    choices: dict[str, Any] | None, job: dict[str, Any] | None) -> dict[str, Any]:
    """Generate, measure and score; rank 0 writes ``run.json``, ``table.md``, grids; returns the record.

    ``job``: what Hydra says about this job (``name``, ``override_dirname``, ``sweep_dir``, ``num``), recorded
    in ``run.json`` and used by the W&B logger for the run's name and group.

    Order of work: cheap checks first (config values, metric resources, prompts and class names, finished
    records), then the model and decoders (which look up their checkpoint files before building), then
    generation and scoring.
    """
    started = dt.datetime.now(dt.timezone.utc)
    wall0 = time.perf_counter()
    out_dir = shards.begin(output_dir)  # the row's lease (one attempt per row), this rank's heartbeat marker
    logger, progress = None, None
    if shards.rank == 0:  # the W&B run opens first (a login or network problem shows before anything loads)
        write_environment(out_dir / "environment.txt")  # the exact software this row ran with
        logger = instantiate(cfg.logger)
        if hasattr(logger, "begin"):
            logger.begin({"decoder": cfg.decoder.name, "config": OmegaConf.to_container(cfg, resolve=True),
                          "job": dict(job or {})}, out_dir)
        progress = Progress(logger, every=getattr(logger, "progress_every", 10),
                            every_s=getattr(logger, "progress_every_s", 60.0))
    suite: EvalSuite = instantiate(cfg.eval)
    for metric in suite.metrics:  # every weight, reference and tokenizer file before the first image
        metric.preflight()
    if suite.threads:
        torch.set_num_threads(int(suite.threads))
    class_names = list(OmegaConf.select(cfg, "model.class_names", default=None) or [])
    prompts = instantiate(cfg.data).load(class_names, suite.num_prompts)
    if class_names:
        unknown = sorted({p for p in prompts if p not in class_names})
        if unknown:
            raise ValueError(f"prompts {unknown[:5]} are not classes of this class-conditional model "
                             f"(model.class_names: {class_names}); choose data=classes or a prompt file of "
                             "class names")
    decoder_cfgs = select_decoders(cfg, decoder_overridden)
    fingerprints = {name: decoder_fingerprint(cfg, name, dc) for name, dc in decoder_cfgs.items()}
    model_plain = OmegaConf.to_container(cfg.model, resolve=True)
    codes = {name: decoder_code(model_plain, OmegaConf.to_container(dc, resolve=True))
             for name, dc in decoder_cfgs.items()}
    torch.manual_seed(suite.seed)

    check_device_then_files(cfg, decoder_cfgs)
    for note in validate_decoders(cfg, decoder_cfgs):  # option values and drafter fit on a weightless stand-in
        log.info(note)
    model = instantiate(cfg.model)
    decoders: dict[str, Decoder] = {name: instantiate(dc, model=model) for name, dc in decoder_cfgs.items()}
    weights = weights_digest(model)
    numerics = machine_numerics(model, shards, suite.numerics_mismatch)
    for name, dec in decoders.items():
        fingerprints[name]["weights_sha1"] = weights
        fingerprints[name]["numerics"] = numerics["fingerprint"]
        head = getattr(dec.drafter, "head", None)
        if isinstance(head, torch.nn.Module):
            fingerprints[name]["drafter_weights_sha1"] = weights_digest(head)
    records = RunRecords(out_dir, fingerprints, suite.resume, shards, suite.numerics_mismatch, codes,
                         suite.code_mismatch)
    done = records.check(prompts, suite.seed)
    hardware = hardware_name(model.device)
    cache_root = Path(os.environ.get("COOLSD_CACHE", "~/.cache/coolsd")).expanduser()
    shared = suite.reuse_ar and (suite.num_timed < len(prompts) or suite.ar_timing == "table")
    ar_cache = ARCache(cache_root, ar_key(records.fingerprints["ar"], records.code_digest("ar"))) if shared else None
    timing = ar_timing(suite, ar_cache, hardware, out_dir, shards)
    generator = Generator(decoders, prompts, suite, out_dir, shards, records, ar_cache, numerics["signature"],
                          progress, hardware, time_ar=timing["timed_here"])
    generator.run(done)
    counts = {name: len(log.done) for name, log in generator.logs.items()}
    if shards.rank != 0:  # no collective from here on: markers on disk (ranks/rank<k>.json)
        shards.finish(counts)
        shards.wait_for_rank_zero()  # until run.json is written, so all ranks leave the process group together
        return {}
    shards.wait_for_ranks()  # polls the other ranks' markers; raises on a failed or silent rank

    found = {name: load_records(out_dir / "records", name) for name in decoders}
    missing = {name: [i for i in range(len(prompts)) if i not in recs] for name, recs in found.items()}
    if any(missing.values()):
        raise RuntimeError(f"records missing after generation: {missing}" + (
            f" (every rank said it was done: {out_dir} must be one folder that every node shares, not a node-local "
            "disk)" if shards.world > 1 else ""))
    ordered = {name: [found[name][i] for i in range(len(prompts))] for name in decoders}
    boot = suite.bootstrap
    ar_timed = ordered["ar"]
    if not timing["timed_here"]:  # AR timed by another row of the table: its timed records, once complete
        ar_timed = timed_records(Path(timing["timing_row"]), "ar", suite.num_timed)
        timing["pending"] = ar_timed is None
        if ar_timed is None:
            log.warning(f"AR's latency for this table is timed in {timing['timing_row']}, which has not finished its "
                        "timed images yet: this row's speedup is left out of run.json; scripts/make_tables.py "
                        "computes it from both rows' records once that row is done")
        ar_timed = [r for r in ordered["ar"] if not r.get("timed")] + (ar_timed or [])
    per_decoder = {name: summarize(recs, ar_timed if name != "ar" else recs, boot)
                   for name, recs in ordered.items()}
    for name in decoders:
        per_decoder[name]["code_digest"] = records.code_digest(name)
        if name in records.accepted_code:
            per_decoder[name]["code_accepted"] = records.accepted_code[name]
    compared = baselines(list(decoders), suite.compare_to)
    comparisons = {name: {base: compare_records(ordered[name], ordered[base], boot) for base in bases}
                   for name, bases in compared.items()}
    for metric in suite.metrics:
        estimates, differences = score_metric(metric, ordered, out_dir, model.device, boot, compared)
        for name in ordered:
            per_decoder[name].update(estimates[name])
            for base, diffs in differences.get(name, {}).items():
                comparisons[name][base].update(diffs)
    for name, by_base in comparisons.items():
        for base, diffs in by_base.items():
            per_decoder[name][f"vs_{base}"] = {"baseline": base, **diffs}
    if suite.save_images:
        for name, recs in ordered.items():
            save_grid(out_dir / f"grid_{name}.png", out_dir, recs)

    selected = cfg.decoder.name
    labels = run_labels({name: OmegaConf.to_container(dc, resolve=True) for name, dc in decoder_cfgs.items()})
    record = {
        "decoder": selected,
        "model": (choices or {}).get("model"),
        "metrics": per_decoder[selected],
        "per_decoder": per_decoder,
        "labels": labels,
        "uncertainty": {"level": boot.level, "resamples": boot.resamples, "seed": boot.seed,
                        "compare_to": compared, "fid_min_images": intervals.FID_MIN_IMAGES, "intervals": UNCERTAINTY},
        "job": dict(job or {}),
        "num_prompts": len(prompts),
        **decode_path(decoders[selected]),
        "world_size": shards.world,
        "numerics": {**numerics["check"], "ranks": numerics["ranks"], "accepted_mismatch": records.accepted_numerics,
                     "record_signatures": record_signatures(ordered)},
        "code": {"decoders": {name: codes[name].as_dict() for name in decoders},
                 "accepted_mismatch": records.accepted_code, "rerun": records.rerun_code,
                 "token_code_version": TOKEN_CODE_VERSION},
        "ar_timing": timing,
        "hardware": hardware,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git": git_commit(),
        "environment": environment(),
        "started": started.isoformat(),
        "wall_s": time.perf_counter() - wall0,
        "output_dir": str(out_dir),
    }
    record["evaluation_card"] = record_card(record)  # the protocol of these numbers (evaluation_card.py)
    table = markdown_table(per_decoder)
    versus = comparison_table(per_decoder)
    if versus:
        table += "\n\n" + versus
    table += "\n\n" + "\n".join(card_lines(record["evaluation_card"]))
    speed_quality_plot(per_decoder, out_dir / "speed_quality.png", len(prompts), labels=labels)
    atomic_write_json(out_dir / "run.json", record)
    atomic_write_bytes(out_dir / "table.md", (table + "\n").encode())
    logger.log_run(record, out_dir)
    report = run_report(out_dir)
    print(table)
    if report:
        print(f"report (tables, evaluation card, images side by side): {report}")
    print(one_line_summary(record))
    shards.finish(counts)  # the ranks waiting for rank 0 may leave
    return record


def ar_timing(suite: EvalSuite, ar_cache: ARCache | None, hardware: str, out_dir: Path,
              shards: Shards) -> dict[str, Any]:
    """Where AR's latency comes from (``run.json["ar_timing"]``): ``eval.ar_timing=run`` times it in this run;
    ``table`` in the one row of the table that claimed it for this AR key, hardware and timed subset
    (``ARCache.claim_timing``: the first to ask), interleaved per prompt with that row's decoder; the other rows
    time their decoder alone and divide that row's AR latency (``timing_row``)."""
    timing: dict[str, Any] = {"mode": suite.ar_timing, "timed_here": True, "hardware": hardware,
                              "num_timed": suite.num_timed}
    if suite.ar_timing != "table":
        return timing
    if ar_cache is None:  # eval.reuse_ar=false: no shared cache for the rows to meet in
        return {**timing, "note": "eval.reuse_ar=false: AR timed in this row"}
    claim = ar_cache.claim_timing(hardware, suite.num_timed, out_dir) if shards.rank == 0 else None
    claim = shards.gather(claim)[0]
    here = Path(claim["out_dir"]) == Path(out_dir).resolve()
    if shards.rank == 0:
        print(f"AR's latency: {'timed in this row' if here else 'timed in ' + claim['out_dir']} for every row of "
              f"this table on {hardware} (eval.ar_timing=table, {ar_cache.timing_file(hardware, suite.num_timed)})")
    return {**timing, "timed_here": here, "timing_row": claim["out_dir"], "key": ar_cache.key}


def decode_path(decoder: Decoder) -> dict[str, str | None]:
    """Which path made a run's images (every decoder of a run shares it, ``eval.run.suite.select_decoders``):
    ``decode_path`` ``eager`` (the papers' loop) or ``static``, and how the static steps ran (``static_steps``:
    ``graph``, CUDA graphs; ``compiled``, ``torch.compile``; ``eager``, uncaptured)."""
    loop = getattr(decoder, "static", None)
    return {"decode_path": "eager" if loop is None else "static", "static_steps": None if loop is None else loop.mode}


def run_report(out_dir: Path) -> Path | None:
    """Write the run's ``report.html`` (``eval.report.html_page``); a failure is reported, never fatal: the run's
    records, images and table are already written, and ``scripts/report.py`` writes the page again."""
    from eval.report.html_page import write_report

    try:
        return write_report(out_dir)
    except Exception as err:  # noqa: BLE001 - the run's results stand; the page is derived from them
        logging.getLogger("coolsd").warning(f"the report page was not written ({type(err).__name__}: {err}); "
                                            f"`python scripts/report.py {out_dir}` writes it from the run's files")
        return None


def machine_numerics(model, shards: Shards, mismatch: str) -> dict[str, Any]:
    """The start-up self-check (``coolsd.numerics``) on every rank: this rank's result, each rank's signature,
    and the fingerprint entry. Says once when batch invariance does not hold here; ranks whose arithmetic differs
    (e.g. nodes of two GPU kinds) are recorded (``eval.numerics_mismatch=accept``, the default) or refused
    (``refuse``)."""
    check = check_batch_invariance(model)
    ranks = shards.gather({"signature": check.signature, "batch_invariant": check.batch_invariant,
                           "machine": check.describe()})
    if len({r["signature"] for r in ranks}) > 1 and mismatch != "accept":
        listing = "; ".join(f"rank {i}: {r['machine']}, signature {r['signature'][:12]}" for i, r in enumerate(ranks))
        raise RuntimeError(f"the ranks of this run compute different float32 bits ({listing}), so their shards "
                           "would mix images of two arithmetics. Nothing was generated. Run every rank on one "
                           "kind of machine, or set eval.numerics_mismatch=accept to merge them anyway (recorded "
                           "in run.json numerics.ranks)")
    if not check.batch_invariant and shards.rank == 0:
        logging.getLogger("coolsd").warning(
            f"batch invariance does not hold on this machine ({check.describe()}): the self-check's logits alone "
            f"and inside a batch differ by up to {check.max_rel_diff:.1e} (relative), so an image may differ in its "
            "last bits, and rarely in its tokens, between batch sizes and resumes (README, \"Bitwise "
            "reproducibility\"; model.row_block=4 restored it on an AMD EPYC at a cost); run.json numerics records it")
    return {"check": check.as_dict(), "ranks": ranks, "fingerprint": check.fingerprint(),
            "signature": check.signature}
