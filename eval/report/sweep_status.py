"""Where a sweep stands: one line per row (one job of a multirun) of a sweep folder, or of one run folder, and
a total line.

Everything is read from the folders alone, with no SLURM command, so a folder copied from a cluster works too
(copy it with ``rsync -a`` or ``cp -p``: a run without markers is judged by its files' modification times). A
row is a folder holding Hydra's ``.hydra/``, ``run.json``, ``records/`` or ``ranks/``; a sweep folder holds
one row per job (``<hydra.sweep.dir>/<hydra.sweep.subdir>``, the job's overrides by default) and Hydra's
``multirun.yaml``. The states, in the order they are decided:

* ``done``: ``run.json`` is written (its prompt count and decoders are shown).
* ``failed``: a rank marker of the latest attempt says ``failed`` (``ranks/rank<k>.json``,
  ``eval.records.rank_markers.RankMarkers``; the first rank to fail is named, its error's last line shown), or
  the job ended without writing ``run.json``: submitit's result file of task 0 (``<job id>_0_result.pkl``) is
  there. The log to read is named (submitit's ``<job id>_<task>_log.err`` or ``.out``, else Hydra's
  ``<job>.log``).
* ``requeued``: the latest attempt ended with ``SystemExit`` (what a SLURM requeue leaves in rank 0's marker)
  or the job's log ends with submitit's ``Requeued job`` line: it waits in the queue for its next attempt.
* ``stale``: a rank's ``running`` marker has not been rewritten for ``dist.stale_min`` minutes (the row's
  ``.hydra/config.yaml``, default 30): the job died without saying so (out of memory, a lost node,
  ``scancel``). Every rank writes a marker, one process too; a run made before markers existed for one process
  has none: it is stale when none of its files (records, logs)
  changed for that long; such a run may also be loading a large model or scoring metrics that long.
* ``running`` (also when the row's lease, ``lease.json``, has a live heartbeat: ``eval.records.lease``, whatever a
  later attempt that was refused left behind): per decoder, the images recorded out of the run's prompts (``eval.num_prompts`` of
  ``.hydra/config.yaml``; per rank when it has several), and the age of the freshest heartbeat (no markers:
  of its newest file).
* ``not started``: a job of the sweep's job list (Hydra's ``multirun.yaml``, expanded as Hydra's basic sweeper
  does) with no folder yet: still queued, or never submitted.

Where the logs are: the submitit launcher writes ``<hydra.sweep.dir>/.submitit/<job id>/<job id>_<task>_log.out``
and ``.err`` (``hydra.launcher.submitit_folder``), the job id being in the row's ``.hydra/hydra.yaml``
(``hydra.job.id``: the SLURM job id, ``<array id>_<index>`` inside a job array; a requeue keeps it); the
``.submitit`` folder is looked for in the row's ancestors. A Python error of the run is caught by Hydra inside
the job, so it is not in these logs: the runner writes it into the rank's marker (one process too); for a job
that stopped before its marker existed, submitit's result file holds it, which is read here without importing
anything it names (a pickle read by an unpickler that makes every class a placeholder, so no code of the file
runs).

For a sweep with failed or stale rows, ``resubmit_commands`` gives the command that resubmits only those rows: the
sweep's own Hydra overrides (launcher, partition, ``hydra.sweep.dir``) from ``multirun.yaml`` and the rows' job
overrides, their swept key joined with commas (``row=sjd,coolsd_d2``; rows that differ in more than one key get one
command each); the command line's values win over an experiment's ``hydra.sweeper.params``, and each row keeps its
folder (``hydra.sweep.subdir``), so only those rows run again and resume their records. Rows still running are
left out: resubmitting them would double the work (a second attempt would stop at their lease anyway).

Example: ``python scripts/status.py results/runs/table_llamagen`` (exit code 0 when every row is done).
"""
from __future__ import annotations

import datetime as dt
import os
import pickle
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from eval.records.image_records import RECORD_FILE, JsonlLog
from eval.records.lease import Lease, describe, lease_age_s
from eval.records.rank_markers import MARKER_DEFAULTS, RankMarkers
from eval.records.run_json import read_run

#: the states, in the order of the total line
STATES = ("done", "running", "requeued", "stale", "failed", "not started")
#: files and folders that mark a folder as a run folder (a row)
ROW_MARKS = (".hydra", "run.json", "records", "ranks")
#: the sweeper whose job list ``sweep_jobs`` can expand (Hydra's default)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
#: a line of a log that reports an error: a Python exception's last line, SLURM's or the kernel's words
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*"
                        r"|.*\b(slurmstepd|srun): error:.*|.*\bCANCELLED AT\b.*|.*\boom[-_]kill\b.*")
#: lines that Hydra, PyTorch and the harness's own pre-flight check (``eval.run.preflight``) append to an error's
#: message, skipped when its last line is taken
HINT_LINES = re.compile(r"full_key: |Set the environment variable HYDRA_FULL_ERROR|CUDA kernel errors might be "
                        r"asynchronously reported|For debugging consider passing CUDA_LAUNCH_BLOCKING|Compile with "
                        r"`TORCH_USE_CUDA_DSA`|Fix the value on the command line")
#: how much of the end of a log is searched for an error line
LOG_TAIL_BYTES = 256 * 1024
#: the longest error line shown
MAX_ERROR_CHARS = 300
RERUN = ("resubmit it with the command printed at the end (only the failed and stale rows), or rerun the sweep command "
         "(same hydra.sweep.dir: done rows exit at once, running ones stop at their lease)")


class StatusError(Exception):
    """The folder given holds no run folder and no sweep job list."""


@dataclass(frozen=True)
class RowStatus:
    """One row: ``label`` (its folder relative to the folder given, i.e. its overrides), ``state`` (one of
    ``STATES``), a one-line ``detail``; ``log`` the log to read (failed and stale rows), ``error`` the error's
    last line (failed rows), ``num`` its job number in the sweep (None: unknown)."""

    label: str
    state: str
    detail: str
    folder: Path | None = None
    log: Path | None = None
    error: str | None = None
    num: int | None = None

    def line(self, width: int = len("not started")) -> str:
        return f"{self.state:<{width}}  {self.label}  {self.detail}".rstrip()


def last_line(text: str) -> str:
    """The last non-empty line of an error text, a traceback's or an exception's (the hints Hydra and PyTorch
    append, ``HINT_LINES``, skipped: ``full_key: decoder``, ``Compile with `TORCH_USE_CUDA_DSA` ...``), shortened
    to ``MAX_ERROR_CHARS``."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    while len(lines) > 1 and HINT_LINES.match(lines[-1]):
        lines.pop()
    line = lines[-1] if lines else text.strip()
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 1] + "…"


def age(seconds: float) -> str:
    """``12 s``, ``4 min``, ``2.5 h``, ``3.0 d``."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# -- submitit's result file, read without importing what it names ------------------------------------------------
class _Placeholder:
    """Any object of a pickle read by ``read_job_result``: keeps its constructor arguments and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, *args: Any, **kwargs: Any) -> "_Placeholder":  # cloudpickle's ``_builtin_type(name)(...)``
        return _Placeholder(*args)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("values", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("values", []).extend(values)


class _PlaceholderUnpickler(pickle.Unpickler):
    """Every global of the pickle becomes a ``_Placeholder`` class of the same name: nothing is imported."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type(name.rpartition(".")[2] or "object", (_Placeholder,), {"module": module})
        return self._classes[key]


def read_job_result(path: Path) -> tuple[bool, str | None]:
    """(whether the job's task function succeeded, its error) from submitit's ``<job id>_<task>_result.pkl``:
    ``("error", traceback)`` when the job raised past Hydra, ``("success", JobReturn)`` otherwise, whose
    ``status`` is ``JobStatus.FAILED`` (2) when the run raised inside Hydra's ``run_job`` (the exception is the
    return value). An unreadable file counts as a failure without a message."""
    try:
        with open(path, "rb") as f:
            kind, payload = _PlaceholderUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError) as e:
        return False, f"submitit's result file {path.name} could not be read ({type(e).__name__}: {e})"
    if kind == "error":
        return False, str(payload)
    state = getattr(payload, "state", None)
    state = state if isinstance(state, dict) else {}
    status = getattr(state.get("status"), "args", ())
    if status != (2,):
        return True, None
    value = state.get("_return_value")
    args = getattr(value, "args", ())
    message = " ".join(str(a) for a in args if isinstance(a, (str, int, float)))
    return False, f"{type(value).__name__}: {message}" if value is not None else "the run failed"


# -- one row ----------------------------------------------------------------------------------------------------
def _load_yaml(path: Path) -> Any:
    """The YAML file, or None where it is missing or unreadable (the row is then judged without it)."""
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
        return None


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.<key>`` resolved, or ``default`` where it is missing or does not resolve (a resolver of the
    project not registered here)."""
    if cfg is None:
        return default
    try:
        value = OmegaConf.select(cfg, key, default=default)
    except OmegaConfBaseException:  # an interpolation that does not resolve here: the key is unknown
        return default
    return default if value is None else value


def record_counts(folder: Path) -> dict[str, tuple[int, dict[int, int]]]:
    """{decoder: (images recorded, {rank: images in its file})} of a row's ``records/`` (``JsonlLog``, read
    only; an image recorded in two files, a resume with another number of ranks, counts once)."""
    records = folder / "records"
    names = {p.name[: -len(".fingerprint.json")] for p in records.glob("*.fingerprint.json")}
    done: dict[str, set] = {name: set() for name in names}
    per_rank: dict[str, dict[int, int]] = {name: {} for name in names}
    for path in sorted(records.glob("*.jsonl")):
        match = RECORD_FILE.match(path.name)
        name = match["name"]
        keys = JsonlLog(path, key="index", repair=False).done.keys()
        done.setdefault(name, set()).update(keys)
        if match["rank"] is not None:
            per_rank.setdefault(name, {})[int(match["rank"])] = len(keys)
    return {name: (len(done[name]), per_rank.get(name, {})) for name in sorted(done)}


def _progress(counts: dict[str, tuple[int, dict[int, int]]], num_prompts: int | None, world: int) -> str:
    if not counts:
        return "no image recorded yet"
    parts = []
    for name, (total, ranks) in counts.items():
        text = f"{name} {total}/{num_prompts if num_prompts is not None else '?'}"
        if len(ranks) > 1 or world > 1:
            shard = {r: len(range(r, num_prompts, world)) for r in range(world)} if num_prompts and world > 1 else {}
            text += " [" + " ".join(f"r{r} {n}" + (f"/{shard[r]}" if r in shard else "")
                                    for r, n in sorted(ranks.items())) + "]"
        parts.append(text)
    return ", ".join(parts)


def _job_folder(folder: Path, job_id: str | None) -> Path | None:
    """``<sweep>/.submitit/<job id>`` of the row, looked for in its ancestors."""
    if not job_id:
        return None
    for parent in [*folder.parents, *folder.resolve().parents]:  # as given first: the path printed is the user's
        candidate = parent / ".submitit" / job_id
        if candidate.is_dir():
            return candidate
    return None


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(path.stat().st_size - LOG_TAIL_BYTES, 0))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def log_error(path: Path) -> str | None:
    """The last error line of a log (``ERROR_LINE``), None if it has none."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", _tail(path)) if ERROR_LINE.match(ln.strip())]
    return last_line(lines[-1]) if lines else None


def _requeued_in_log(path: Path) -> bool:
    """submitit's ``Requeued job`` is the last word of the job's log (no ``Starting with`` after it)."""
    events = re.findall(r"Requeued job|Starting with JobEnvironment", _tail(path))
    return bool(events) and events[-1] == "Requeued job"


class Row:
    """What one run folder says: its Hydra files, markers, records, submitit logs and result."""

    def __init__(self, folder: Path, label: str, now: float) -> None:
        self.folder, self.label, self.now = folder, label, now
        self.hydra = _load_yaml(folder / ".hydra" / "hydra.yaml")
        self.config = _load_yaml(folder / ".hydra" / "config.yaml")
        self.overrides = _load_yaml(folder / ".hydra" / "overrides.yaml")
        num = _select(self.hydra, "hydra.job.num")
        self.num = int(num) if isinstance(num, int) else None
        job_id = _select(self.hydra, "hydra.job.id")
        self.job_id = str(job_id) if job_id is not None else None
        self.job_dir = _job_folder(folder, self.job_id)
        stale = _select(self.config, "dist.stale_min", MARKER_DEFAULTS["stale_min"])
        self.stale_min = float(stale) if isinstance(stale, (int, float)) else MARKER_DEFAULTS["stale_min"]
        prompts = _select(self.config, "eval.num_prompts")
        self.num_prompts = int(prompts) if isinstance(prompts, int) else None

    def submitit_logs(self, task: int = 0) -> list[Path]:
        """submitit's ``<job id>_<task>_log.err`` and ``.out`` of task ``task`` (the rank), those that exist."""
        if self.job_dir is None:
            return []
        return [p for p in (self.job_dir / f"{self.job_id}_{task}_log.{ext}" for ext in ("err", "out")) if p.is_file()]

    def logs(self, task: int = 0) -> list[Path]:
        """The logs of task ``task``: submitit's, then Hydra's ``<job>.log`` in the row folder."""
        return self.submitit_logs(task) + sorted(p for p in self.folder.glob("*.log") if p.is_file())

    def log_with_error(self, task: int = 0) -> tuple[Path | None, str | None]:
        """The first log of ``task`` that holds an error line, and that line; else its first log, None."""
        logs = self.logs(task)
        for path in logs:
            line = log_error(path)
            if line:
                return path, line
        return (logs[0] if logs else None), None

    def newest_write(self) -> float | None:
        paths = list((self.folder / "records").glob("*.jsonl")) + self.logs() + [self.folder / ".hydra" / "hydra.yaml"]
        times = [p.stat().st_mtime for p in paths if p.is_file()]
        return max(times) if times else None

    def status(self) -> RowStatus:
        make = dict(label=self.label, folder=self.folder, num=self.num)
        run_json = self.folder / "run.json"
        if run_json.is_file():
            try:
                record = read_run(run_json)
            except (OSError, ValueError) as e:
                return RowStatus(state="failed", detail=f"run.json is not readable JSON ({e}); {RERUN}",
                                 error=str(e), **make)
            decoders = ", ".join(record.get("per_decoder") or {})
            return RowStatus(state="done", detail=f"{record.get('num_prompts', '?')} prompts: {decoders}", **make)
        markers = RankMarkers.latest(self.folder)
        world = max([int(m.get("world") or 1) for m in markers] or [1])
        progress = _progress(record_counts(self.folder), self.num_prompts, world)
        lease = Lease.read(self.folder)
        now = dt.datetime.fromtimestamp(self.now, dt.timezone.utc)
        age_s = lease_age_s(lease, now) if lease else None
        if lease and age_s is not None and age_s <= 60.0 * float(lease.get("stale_min") or self.stale_min):
            return RowStatus(state="running", detail=f"{progress}; held by {describe(lease, now)}", **make)
        failed = sorted((m for m in markers if m.get("state") == "failed"), key=lambda m: m["_t"])
        real = [m for m in failed if not str(m.get("error", "")).startswith("SystemExit")]
        if real:
            first = real[0]
            error = last_line(str(first.get("error") or "no message"))
            log, _ = self.log_with_error(int(first["rank"]))
            where = f"rank {first['rank']} of {world} on {first.get('host')}: " if world > 1 else ""
            return RowStatus(state="failed", detail=f"{where}{error}; log: {log or 'none found'}; {progress}",
                             log=log, error=error, **make)
        result = self.job_dir / f"{self.job_id}_0_result.pkl" if self.job_dir is not None else None
        if result is not None and result.is_file():
            ok, text = read_job_result(result)
            log, log_line = self.log_with_error(0)
            if text:
                error = last_line(text)
            elif log_line:
                error = log_line
            else:
                error = "the job ended without writing run.json" + ("" if ok else " (its error has no message)")
            return RowStatus(state="failed", detail=f"{error}; log: {log or 'none found'}; {progress}", log=log,
                             error=error, **make)
        if failed or any(_requeued_in_log(p) for p in self.submitit_logs(0)):
            since = f" {age(self.now - failed[-1]['_t'])} ago" if failed else ""
            return RowStatus(state="requeued", detail=f"the attempt ended by a requeue{since} and waits in the queue "
                             f"for its next one (it resumes from its records); {progress}", **make)
        stale_s = 60.0 * self.stale_min
        running = [m for m in markers if m.get("state") == "running"]
        if running:
            silent = [m for m in running if self.now - m["_t"] > stale_s]
            if silent:
                last = max(silent, key=lambda m: m["_t"])
                ranks = ", ".join(str(m["rank"]) for m in silent)
                several = len(silent) > 1
                return self._stale(f"rank{'s' if several else ''} {ranks} silent for {'at least ' if several else ''}"
                                   f"{age(self.now - last['_t'])} (> dist.stale_min = {self.stale_min:g} min; rank "
                                   f"{last['rank']} on {last.get('host')} pid {last.get('pid')})", progress, make)
            beat = max(m["_t"] for m in running)
            return RowStatus(state="running", detail=f"{progress}; heartbeat {age(self.now - beat)} ago "
                             f"({world} rank{'s' if world > 1 else ''})", **make)
        newest = self.newest_write()
        if newest is not None and self.now - newest > stale_s:
            return self._stale(f"no file written for {age(self.now - newest)} (> dist.stale_min = "
                               f"{self.stale_min:g} min; no heartbeat markers: it may also be loading "
                               "or scoring)", progress, make)
        last = f"; last write {age(self.now - newest)} ago" if newest is not None else ""
        return RowStatus(state="running", detail=f"{progress}{last} (no heartbeat markers)", **make)

    def _stale(self, why: str, progress: str, make: dict[str, Any]) -> RowStatus:
        log, line = self.log_with_error(0)
        said = f"; log {log}: {line}" if line else (f"; log: {log}" if log else "")
        return RowStatus(state="stale", detail=f"{why}: the job died without saying so (out of memory, a lost "
                         f"node, scancel), or hangs; {progress}{said}; if its job is gone, {RERUN}", log=log, **make)


# -- the sweep ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One job of a sweep's job list: its number, overrides and the folder Hydra gives it."""

    num: int
    overrides: tuple[str, ...]
    folder: Path


def sweep_jobs(sweep: Path) -> list[Job] | None:
    """The jobs of the multirun whose ``multirun.yaml`` is in ``sweep`` (the sweeper's ``params`` and the command
    line's task overrides, expanded as Hydra's basic sweeper does), each with the folder Hydra gives it
    (``hydra.sweep.subdir``: the job's ``override_dirname`` by default). None without ``multirun.yaml`` or for
    another sweeper."""
    cfg = _load_yaml(sweep / "multirun.yaml")
    if cfg is None or _select(cfg, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        hydra = OmegaConf.to_container(cfg.hydra, resolve=False)
        params = hydra["sweeper"].get("params") or {}
        arguments = [f"{k}={v}" for k, v in params.items()] + list(hydra["overrides"]["task"])
        parser = OverridesParser.create()
        batches = BasicSweeper.split_arguments(parser.parse_overrides(arguments), None)
        naming = hydra["job"]["config"]["override_dirname"]
        jobs = []
        for num, overrides in enumerate(o for batch in batches for o in batch):
            dirname = get_overrides_dirname(parser.parse_overrides(overrides),
                                            exclude_keys=list(naming["exclude_keys"]), item_sep=naming["item_sep"],
                                            kv_sep=naming["kv_sep"])
            template = OmegaConf.create({"hydra": {"job": {**hydra["job"], "override_dirname": dirname, "num": num},
                                                   "sweep": {"subdir": hydra["sweep"]["subdir"]}}})
            subdir = _select(template, "hydra.sweep.subdir", dirname)
            jobs.append(Job(num, tuple(overrides), sweep / str(subdir)))
    except (KeyError, TypeError, AttributeError, HydraException, OmegaConfBaseException):
        return None  # not the multirun.yaml of a Hydra version this reads: the rows on disk are still reported
    return jobs


def find_rows(root: Path) -> tuple[list[Path], list[Path]]:
    """(run folders, sweep folders with a ``multirun.yaml``) at or below ``root``; a run folder's own subfolders
    are not searched, nor hidden folders (``.submitit``, ``.hydra``)."""
    rows, sweeps = [], []
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        if "multirun.yaml" in files:
            sweeps.append(here)
        if any(mark in files or mark in subfolders for mark in ROW_MARKS) and "multirun.yaml" not in files:
            rows.append(here)
            subfolders[:] = []
            continue
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
    return rows, sweeps


def _label(folder: Path, root: Path) -> str:
    relative = folder.relative_to(root).as_posix() if folder != root else ""
    return relative or folder.name


def sweep_status(root: str | os.PathLike, now: dt.datetime | None = None) -> list[RowStatus]:
    """Every row at or below ``root`` (a sweep folder, a folder of sweeps or one run folder) and every job of its
    sweeps' job lists with no folder yet (``not started``), in job order. ``now``: the clock (tests)."""
    root = Path(root)
    if not root.is_dir():
        raise StatusError(f"{root} is not a folder: give a sweep folder (hydra.sweep.dir, e.g. "
                          "results/runs/<experiment>) or one run folder")
    clock = (now or dt.datetime.now(dt.timezone.utc)).timestamp()
    folders, sweeps = find_rows(root)
    rows = [Row(folder, _label(folder, root), clock) for folder in folders]
    statuses = [row.status() for row in rows]
    started = {tuple(sorted(row.overrides)) for row in rows if row.overrides is not None}
    present = {row.folder.resolve() for row in rows}
    for sweep in sweeps:
        for job in sweep_jobs(sweep) or []:
            if tuple(sorted(job.overrides)) in started or job.folder.resolve() in present:
                continue
            statuses.append(RowStatus(label=_label(job.folder, root) if job.folder.is_relative_to(root) else
                                      str(job.folder), state="not started", folder=job.folder, num=job.num,
                                      detail="no folder yet: queued, or not submitted"))
    if not statuses:
        raise StatusError(f"no run folder under {root}: a run folder holds .hydra/, run.json, records/ or ranks/, "
                          "a sweep folder one such folder per job and Hydra's multirun.yaml; give the folder that "
                          "run.py -m wrote (hydra.sweep.dir)")
    return sorted(statuses, key=lambda s: (str(s.folder.parent) if s.folder else "", s.num is None, s.num or 0,
                                           s.label))


def total_line(statuses: list[RowStatus]) -> str:
    """``5 rows: 1 done, 1 running, 1 stale, 1 failed, 1 not started``."""
    counts = Counter(s.state for s in statuses)
    parts = [f"{counts[state]} {state}" for state in STATES if counts[state]]
    return f"{len(statuses)} row{'s' if len(statuses) != 1 else ''}: " + ", ".join(parts)


def exit_code(statuses: list[RowStatus]) -> int:
    """0 when every row is done, else 1."""
    return 0 if statuses and all(s.state == "done" for s in statuses) else 1


#: the states whose rows the resubmission command runs again
RESUBMIT = ("failed", "stale")


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def resubmit_commands(root: str | os.PathLike, statuses: list[RowStatus]) -> list[str]:
    """The commands that resubmit only the failed and stale rows of the sweeps at or below ``root`` (module doc);
    [] when there are none, or a row's sweep has no ``multirun.yaml`` (a single run: rerun its own command)."""
    wanted = [s for s in statuses if s.state in RESUBMIT and s.folder is not None]
    commands = []
    for sweep in find_rows(Path(root))[1]:
        cfg = _load_yaml(sweep / "multirun.yaml")
        jobs = {j.folder.resolve(): j for j in sweep_jobs(sweep) or []}
        picked = [jobs[s.folder.resolve()] for s in wanted if s.folder.resolve() in jobs]
        if not picked or cfg is None:
            continue
        hydra = [str(o) for o in (_select(cfg, "hydra.overrides.hydra") or [])]
        if not any(_key(o) == "hydra.sweep.dir" for o in hydra):
            hydra.append(f"hydra.sweep.dir={sweep.resolve()}")  # the folder the rows live in, whatever the experiment says
        head = ["python", "run.py", "-m", *hydra]
        overrides = [dict((_key(o), o) for o in job.overrides) for job in sorted(picked, key=lambda j: j.num)]
        keys = list(dict.fromkeys(k for o in overrides for k in o))
        differ = [k for k in keys if len({o.get(k) for o in overrides}) > 1]
        if len(overrides) > 1 and len(differ) == 1 and all(differ[0] in o for o in overrides):
            key = differ[0]
            joined = ",".join(o[key].split("=", 1)[1] for o in overrides)
            parts = [o if _key(o) != key else f"{key}={joined}" for o in overrides[0].values()]
            commands.append(shlex.join([*head, *parts]))
        else:
            commands += [shlex.join([*head, *o.values()]) for o in overrides]
    return commands


def report(root: str | os.PathLike, now: dt.datetime | None = None) -> tuple[str, int]:
    """The printed report (one line per row, then the total, then the command that resubmits only the failed and
    stale rows) and the exit code."""
    statuses = sweep_status(root, now)
    width = max(len(s.state) for s in statuses)
    lines = [*(s.line(width) for s in statuses), total_line(statuses)]
    commands = resubmit_commands(root, statuses)
    if commands:
        lines.append("Resubmit only the failed and stale rows (from the repository root; the running ones are left "
                     "alone, finished images are kept):")
        lines += [f"  {c}" for c in commands]
    return "\n".join(lines), exit_code(statuses)
