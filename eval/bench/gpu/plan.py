"""The GPU command's frame: named steps run in a plan under one time budget, checked before every image, with the
report written after every image and the goals printed last.

* ``Step``: a named measurement (``eval.bench.gpu.steps.STEPS``), in the default plan or run only when named.
* The **timing table** (``results/bench/gpu_step_seconds.json``, committed): each step's expected seconds on the
  H200, and per image or batch where a step loops over them, each entry marked measured (with its date and
  source) or an allowance (not measured: the most the plan lets the step take). Every run prints its plan's
  estimate from it before it starts, and each step its expected seconds; the run writes the table again with
  what it measured (``gpu_step_seconds.json`` in its folder) for the next commit.
* ``Session.images``: the loop of a step over its images (or batches): before each one it checks that the
  budget has at least the seconds the last one took (the table's for the first) and stops the step otherwise,
  saying so; after each one it writes ``gpu.json`` and ``gpu.md``. A run stopped at its limit still leaves what
  it measured.

Example: ``run_plan(out, steps=default_steps(), budget=300)``; ``python scripts/gpu.py --dry-run`` prints the plan.
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coolsd.io import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[3]
TIMING_TABLE = ROOT / "results" / "bench" / "gpu_step_seconds.json"
#: the default budget: the five minutes a GPU call plans for (a lease is about 15 minutes, start-up included, and
#: one command at most 10)
DEFAULT_BUDGET = 300.0


class PreflightFailed(RuntimeError):
    """The preflight found tokens that differ where they must not; the plan stops (``--keep-going`` goes on)."""


@dataclass(frozen=True)
class Step:
    """A named step: ``run(session)`` measures and stores its results in ``session.results[name]``."""

    name: str
    doc: str
    run: Callable[["Session"], None]
    default: bool = True
    #: needs the carried wheels (Hydra composes its configs): ``python scripts/gpu.py --fetch-wheels`` first
    wheels: bool = False


@dataclass
class Session:
    """What a step sees: where to write, the budget and clock, the timing table, the results so far."""

    out_dir: Path
    budget: float
    dry_run: bool
    table: dict[str, Any]
    clock: Callable[[], float] = time.perf_counter
    keep_going: bool = False
    report: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # models and decoders shared between steps
    started: float = 0.0
    _step: str = ""

    def __post_init__(self) -> None:
        self.started = self.clock()

    @property
    def results(self) -> dict[str, Any]:
        return self.report["results"]

    def left(self) -> float:
        return self.budget - (self.clock() - self.started)

    def expected(self, step: str, key: str = "seconds") -> float:
        return float(self.table["steps"].get(step, {}).get(key, 0.0))

    def say(self, text: str) -> None:
        print(f"[{self.clock() - self.started:6.1f} s] {text}", flush=True)

    def images(self, count: int, first: float | None = None, unit: str = "image",
               floor: Callable[[int], float] | None = None) -> Iterator[int]:
        """Yield ``0 .. count − 1``, one image (or batch) each, while the budget holds the next one (the last one's
        seconds, at least ``floor(i)`` where given; ``first`` or the table's ``per_image`` for the first); write the
        report after each."""
        step = self._step
        expected = self.expected(step, "per_image") if first is None else first
        for i in range(count):
            if floor is not None:
                expected = max(expected, floor(i))
            left = self.left()
            if left < expected:
                self.report["steps"][step]["stopped"] = (f"after {i} of {count} {unit}s: {left:.0f} s of the budget "
                                                         f"left, the next {unit} needs about {expected:.0f} s")
                self.say(f"{step}: stopped {self.report['steps'][step]['stopped']}")
                return
            begin = self.clock()
            yield i
            expected = self.clock() - begin
            self.write()

    def write(self) -> None:
        self.report["seconds"] = self.clock() - self.started
        atomic_write_bytes(self.out_dir / "gpu.json", json.dumps(self.report, indent=2, default=str).encode())
        from eval.bench.gpu.report import markdown  # the page's layout lives with the goals

        atomic_write_bytes(self.out_dir / "gpu.md", markdown(self.report).encode())


def load_table(path: Path = TIMING_TABLE) -> dict[str, Any]:
    return json.loads(path.read_text())


def estimate(table: dict[str, Any], steps: list[Step]) -> float:
    """The plan's expected seconds: start-up and every step's entry in the timing table."""
    return table["steps"]["setup"]["seconds"] + sum(table["steps"].get(s.name, {}).get("seconds", 0.0) for s in steps)


def plan_lines(table: dict[str, Any], steps: list[Step], budget: float) -> list[str]:
    """The plan as printed before a run: each step's expected seconds and where they come from, and the total."""
    entries = table["steps"]
    lines = [f"plan on {table['gpu']} (timing table {TIMING_TABLE.relative_to(ROOT)}, {table['updated']}):"]
    for name in ["setup", *(s.name for s in steps)]:
        entry = entries.get(name, {"seconds": 0.0, "source": "not in the table"})
        lines.append(f"  {name:<18} {entry['seconds']:6.0f} s  ({entry['source']})")
    total = estimate(table, steps)
    lines.append(f"  estimate {total:.0f} s ({total / 60:.1f} min) against a budget of {budget:.0f} s")
    return lines


def run_plan(out_dir: str | Path, steps: list[Step], budget: float = DEFAULT_BUDGET, dry_run: bool = False,
             keep_going: bool = False, clock: Callable[[], float] = time.perf_counter,
             table: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``steps`` in order under ``budget`` seconds and return the report (also in ``out_dir``: ``gpu.json``,
    ``gpu.md`` and ``gpu_step_seconds.json``). A step that fails is reported and the next one runs; a failed
    preflight stops the plan unless ``keep_going``."""
    import torch

    from eval.bench.gpu.report import goals, goal_lines

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = load_table() if table is None else table
    if dry_run:  # a rehearsal, not a measurement: one thread never fights another job's for the cores
        torch.set_num_threads(1)
    session = Session(out_dir, budget, dry_run, table, clock, keep_going)
    session.report = {"command": " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                      "hardware": hardware(), "versions": versions(), "dry_run": dry_run, "budget_s": budget,
                      "estimate_s": estimate(table, steps), "steps": {}, "results": {}, "notes": []}
    for line in plan_lines(table, steps, budget):
        print(line, flush=True)
    stop = None
    for step in steps:
        state = session.report["steps"][step.name] = {"expected_s": session.expected(step.name)}
        if stop is not None:
            state["status"] = f"not run ({stop})"
            continue
        if session.left() <= 0:
            state["status"] = "skipped (the budget was spent)"
            session.write()
            continue
        session._step = step.name
        session.say(f"{step.name}: starting, expected {state['expected_s']:.0f} s ({session.left():.0f} s left)")
        begin = clock()
        try:
            step.run(session)
            state["status"] = "stopped (budget)" if "stopped" in state else "done"
        except PreflightFailed as error:
            state["status"] = f"failed: {error}"
            if not keep_going:
                stop = "the preflight failed"
        except Exception as error:  # a step's failure is reported; the others still run
            state["status"] = "failed: " + "".join(traceback.format_exception_only(error)).strip()
            state["traceback"] = traceback.format_exc()
        state["seconds"] = clock() - begin
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        session.say(f"{step.name}: {state['status']} in {state['seconds']:.1f} s")
        session.report["goals"] = goals(session.results)
        session.write()
    session.report["goals"] = goals(session.results)
    session.write()
    measured = updated_table(table, session.report)
    atomic_write_bytes(out_dir / "gpu_step_seconds.json", (json.dumps(measured, indent=2) + "\n").encode())
    for line in goal_lines(session.report):
        print(line, flush=True)
    return session.report


def updated_table(table: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The timing table with the seconds this run measured (a GPU run's, for the next commit; a dry run's only to
    test this function)."""
    out = json.loads(json.dumps(table))
    if report["dry_run"]:
        out["gpu"] = "CPU dry run (not GPU numbers)"
    else:
        out["gpu"] = report["hardware"].get("gpu") or out["gpu"]
    out["updated"] = report["date"][:10]
    for name, state in report["steps"].items():
        if state.get("status") == "done":
            entry = out["steps"].setdefault(name, {})
            entry.update(seconds=round(state["seconds"], 1), measured=True,
                         source=f"measured {out['updated']} on {out['gpu']}")
            per = report["results"].get(name, {}).get("per_image_s") if isinstance(
                report["results"].get(name), dict) else None
            if per:
                entry["per_image"] = round(per, 2)
    return out


def hardware() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "memory_gb": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                "driver": _driver()}
    return {"gpu": None, "cpu": platform.processor() or platform.machine()}


def versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    out["commit"] = _commit()
    return out


def _commit() -> str | None:
    """The checkout's commit, or ``COOLSD_COMMIT`` where the tree travelled without its git folder."""
    import os
    import subprocess

    if os.environ.get("COOLSD_COMMIT"):
        return os.environ["COOLSD_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = head.stdout.strip() or None if head.returncode == 0 else None
    return f"{sha} (uncommitted changes)" if sha and dirty.stdout.strip() else sha


def _driver() -> str | None:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
