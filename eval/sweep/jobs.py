"""Every job of a ``run.py`` command line, expanded as ``run.py -m`` expands it, composed and checked before submission.

A sweep (``python run.py -m experiment=table_llamagen``, ``decoder.delta=1.1,2``) is expanded with Hydra's own
code, exactly as its multirun does: the primary config is composed in multirun mode, its sweeper config
(``hydra.sweeper``, where an experiment puts ``params``) must be Hydra's ``BasicSweeper``, whose ``params`` come
first and the command line's overrides after, parsed by Hydra's ``OverridesParser`` and crossed by
``BasicSweeper.split_arguments``; jobs are numbered in that order from 0, as ``hydra.job.num``. Each job is
composed with Hydra's overrides plus its own, as the launcher composes it, then checked:

* its decoders (``eval.run.suite.select_decoders``, ``eval.run.preflight.check_decoders``): option values and the
  drafter-target fit, without building the target;
* its files (``eval.run.prefetch.run_files``): looked up (``download=False``) or fetched; each file once per sweep;
* its GPU-hours (``eval.sweep.costs``), on each basis of the cost table.

``scripts/prefetch.py -m`` prints one line per job (``sweep_report``).

Example: ``python scripts/prefetch.py --check -m experiment=table_llamagen``.
"""
from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.required_files import RequiredFile, Resolution, resolve, table
from eval.run.prefetch import run_files
from eval.run.preflight import check_decoders
from eval.sweep.costs import BASES, Cost, Estimate, estimate, load_costs, sources_text

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass
class JobCheck:
    """One job: its number, overrides, compared decoders, problems (decoder or model config, then each missing
    file), what could not be checked, its files' resolutions and its GPU-hour estimates."""

    num: int
    overrides: list[str]
    decoders: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: list[Resolution] = field(default_factory=list)
    estimates: list[Estimate] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def expand_sweep(config_name: str, overrides: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """(Hydra's own overrides, each job's task overrides in job order) of ``run.py -m <overrides>``; needs an
    initialised Hydra (``initialize_config_dir``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    gh = GlobalHydra.instance()
    cfg = gh.hydra.compose_config(config_name=config_name, overrides=list(overrides), run_mode=RunMode.MULTIRUN,
                                  with_log_configuration=False)
    sweeper = cfg.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER:
        raise ValueError(f"hydra.sweeper is {sweeper.get('_target_')}; only Hydra's BasicSweeper can be expanded "
                         "before submission (a search sweeper picks its jobs while it runs)")
    basic = BasicSweeper(max_batch_size=sweeper.get("max_batch_size"), params=sweeper.get("params") or {})
    arguments = basic._parse_config() + list(OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False))
    parsed = OverridesParser.create(config_loader=gh.config_loader()).parse_overrides(arguments)
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, basic.max_batch_size) for job in batch]
    return list(OmegaConf.to_container(cfg.hydra.overrides.hydra, resolve=False)), jobs


def compose_job(config_name: str, overrides: Sequence[str]) -> tuple[DictConfig, dict[str, Any]]:
    """(The job's config without the ``hydra`` node, Hydra's config-group choices) of one set of overrides."""
    cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    choices = dict(OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False))
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


class FileResolver:
    """``resolve`` with each file looked up (or fetched) once, however many jobs need it."""

    def __init__(self, download: bool) -> None:
        self.download = download
        self.done: dict[tuple, Resolution] = {}

    def __call__(self, f: RequiredFile) -> Resolution:
        if f.key not in self.done:
            self.done[f.key] = resolve(f, download=self.download)
        found = self.done[f.key]
        return Resolution(f, found.status, found.path, found.reason)


def check_job(num: int, task_overrides: list[str], cfg: DictConfig, choices: dict[str, Any],
              decoder_chosen: Callable[[list[str]], bool], files: FileResolver, costs: Sequence[Cost],
              ar_made: set[tuple]) -> JobCheck:
    """Check one composed job (see the module doc); ``ar_made``: the AR batched sets (and, ``eval.ar_timing=table``,
    the AR timed sets) earlier jobs made."""
    from eval.run.suite import select_decoders

    job = JobCheck(num, list(task_overrides))
    try:
        decoder_cfgs = select_decoders(cfg, decoder_chosen(list(task_overrides)))
    except ValueError as err:
        job.problems.append(str(err))
        return job
    job.decoders = list(decoder_cfgs)
    found = check_decoders(cfg, decoder_cfgs)
    job.problems += found.problems
    job.notes += found.notes
    job.files = [files(f) for f in run_files(cfg, decoder_cfgs)]
    job.problems += [f"missing: {r.file.what} ({r.file.owner}) {r.file.name}" for r in job.files if not r.ok]
    plain = {name: OmegaConf.to_container(dc, resolve=True) for name, dc in decoder_cfgs.items()}
    suite = OmegaConf.to_container(cfg.eval, resolve=True)
    model = str(choices.get("model"))
    ar_key = (model, OmegaConf.to_yaml(cfg.data), suite.get("seed"), suite.get("num_prompts"))
    reused = bool(suite.get("reuse_ar", True)) and ar_key in ar_made
    ar_made.add(ar_key)
    timed_key = ("timed", *ar_key, suite.get("speed_prompts"))
    shared = bool(suite.get("reuse_ar", True)) and suite.get("ar_timing", "run") == "table"
    timed_elsewhere = shared and timed_key in ar_made
    if shared:
        ar_made.add(timed_key)
    job.estimates = [estimate(costs, basis, model, plain, suite, ar_batched=not reused, ar_timed=not timed_elsewhere)
                     for basis in BASES]
    return job


def check_sweep(config_dir: str | Path, overrides: Sequence[str], decoder_chosen: Callable[[list[str]], bool],
                download: bool = True, multirun: bool = True, config_name: str = "config") -> list[JobCheck]:
    """Every job of ``run.py [-m] <overrides>`` checked (``multirun=False``: the one job of the overrides)."""
    files, costs, ar_made = FileResolver(download), load_costs(), set()
    checks = []
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        hydra_overrides, jobs = expand_sweep(config_name, overrides) if multirun else ([], [list(overrides)])
        for num, task in enumerate(jobs):
            try:
                cfg, choices = compose_job(config_name, hydra_overrides + task)
            except Exception as err:  # noqa: BLE001  a job that does not compose is that job's problem
                checks.append(JobCheck(num, task, problems=[f"does not compose: {str(err).splitlines()[0]}"]))
                continue
            checks.append(check_job(num, task, cfg, choices, decoder_chosen, files, costs, ar_made))
    return checks


def _first_problem(job: JobCheck) -> str:
    if job.ok:
        return "OK"
    more = len(job.problems) - 1
    return job.problems[0] + (f"  (+{more} more)" if more else "")


def sweep_report(checks: Sequence[JobCheck]) -> str:
    """One line per job (number, overrides, decoders, GPU-hours per basis, OK or the first problem), then the
    totals, where the estimate comes from, what was not checked and every missing file with its manual step."""
    head = ("job", "overrides", "decoders", *(f"GPU-h {b}" for b in BASES), "status")
    rows = [(f"#{c.num}", " ".join(shlex.quote(o) for o in c.overrides) or "(defaults)", ",".join(c.decoders),
             *(e.text() for e in c.estimates or [Estimate(b, None) for b in BASES]), _first_problem(c))
            for c in checks]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) + "  " + r[-1] for r in [head, *rows]]
    bad = sum(not c.ok for c in checks)
    totals = []
    for basis in BASES:
        known = [e.gpu_hours for c in checks for e in c.estimates if e.basis == basis and e.gpu_hours is not None]
        without = len(checks) - len(known)
        totals.append(f"{basis} " + (f"{sum(known):.1f}" + (f" ({without} job(s) without one)" if without else "")
                                     if known else "-"))
    lines.append(f"{len(checks)} job(s): {len(checks) - bad} OK, {bad} with a problem; GPU-hours in all "
                 f"(estimate): {', '.join(totals)}")
    saved = {basis: sum(e.saved_hours for c in checks for e in c.estimates if e.basis == basis) for basis in BASES}
    if any(saved.values()):
        rows = sum(1 for c in checks if any(e.saved_hours for e in c.estimates))
        lines.append(f"Fewer GPU-hours because AR is timed at batch 1 once per table and GPU kind (eval.ar_timing=table):"
                     f" {rows} of {len(checks)} jobs take AR's latency from the row that times it and make AR's "
                     f"timed-subset images batched instead; saved " + ", ".join(f"{b} {h:.1f}" for b, h in saved.items() if h)
                     + " GPU-h against timing AR in every row (eval.ar_timing=run).")
    lines += sources_text([e for c in checks for e in c.estimates if e.gpu_hours is not None])
    notes = list(dict.fromkeys(n for c in checks for n in c.notes))
    lines += ["Not checked before submission:", *(f"  {n}" for n in notes)] if notes else []
    missing: dict[tuple, Resolution] = {}
    for r in (r for c in checks for r in c.files if not r.ok):
        missing.setdefault(r.file.key, r)
    if missing:
        lines += ["Missing files (every job's, each once):", table(list(missing.values()))]
    return "\n".join(lines)


def job_report(job: JobCheck) -> str:
    """One job in full: the table of its files (present, fetched, missing with the manual step), its decoders'
    problems and what was not checked, its GPU-hour estimate and where it comes from."""
    if not job.decoders:  # it did not compose, or its decoders could not be selected
        return "\n".join(job.problems)
    missing = sum(not r.ok for r in job.files)
    lines = [table(job.files)] if job.files else []
    lines.append(f"{len(job.files)} files: {sum(r.status == 'present' for r in job.files)} present, "
                 f"{sum(r.status == 'fetched' for r in job.files)} fetched, {missing} missing")
    decoder_problems = job.problems[:len(job.problems) - missing]
    lines.append(f"decoders {', '.join(job.decoders)}: {'problems' if decoder_problems else 'OK'}")
    lines += [f"  - {p}" for p in decoder_problems] + [f"  note: {n}" for n in job.notes]
    usable = [e for e in job.estimates if e.gpu_hours is not None]
    if usable:
        lines.append("GPU-hours (estimate): " + ", ".join(f"{e.basis} {e.text()}" for e in usable))
        lines += sources_text(usable)
    else:
        lines.append("GPU-hours (estimate): - (this model has no row in eval/sweep/gpu_costs.csv)")
    return "\n".join(lines)
