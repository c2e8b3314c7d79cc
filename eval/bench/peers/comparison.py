"""Each decoder against its authors' own code, side by side on the same weights (``scripts/bench_peers.py``).

For every peer given as ``--peer NAME=<checkout>`` (a clone of its repository at the commit its glue module
pins, ``eval/bench/peers/<NAME>.py``) and every pair of that peer (one decoder of ours, one method of theirs):

1. **Same inputs.** Our model config ``SPEC.model`` is built (tiny random weights); the glue exports its weights
   (and the drafter's) into the peer's own model classes in a worker process (``eval.bench.peers.worker``, the
   peer's interpreter), with our prompt conditioning, CFG, top-k, temperature and window or tree.
2. **Interleaved timing at batch 1.** After ``warmup`` untimed images on both sides, prompt ``i`` with seed
   ``seed + i`` is decoded by both, ours first on even ``i`` and theirs first on odd ``i`` (a drift of the
   machine's load hits both alike). Each side's time is its whole decode call up to the last grid token, measured
   in its own process (ours: ``DecodeStats.latency_s``; theirs: the glue's timer around their call).
3. **Paired latency ratio.** r_i = ours_i / theirs_i; the ratio reported is the geometric mean of r_i with the
   t-interval of mean(log r_i) (95 %), i.e. a paired interval: a ratio below 1 means ours is faster.
4. **Same algorithm, same statistics.** Per-image accepted lengths tau = (tokens - 1) / (target forwards - 1)
   and target forwards of both sides are compared with a two-sided Mann-Whitney U test (unpaired: the two
   sides draw from different random streams), 5 % false-alarm probability per test, Holm-adjusted over all
   pairs of the run. Where a peer's rule differs on purpose (``Pair.difference``) the table says so beside the
   test.

Peers that were not given, or cannot run on this device (``SPEC.cpu``), are listed with the reason and the
command that gets their checkout.

Example::

    python scripts/bench_peers.py --peer llamagen=../LlamaGen --peer lantern=../LANTERN --prompts 20
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from scipy import stats as sps

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.metrics.intervals import geometric_ratio
from eval.run.suite import WARMUP_SEED

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"

#: --peer NAME -> its glue module, in the order of the table (the issue's list)
PEERS: dict[str, str] = {
    "llamagen": "eval.bench.peers.llamagen",
    "lantern": "eval.bench.peers.lantern",
    "sjd": "eval.bench.peers.sjd",
    "scd": "eval.bench.peers.scd",
    "sjd_pac": "eval.bench.peers.sjd_pac",
    "gsd": "eval.bench.peers.gsd",
    "zipar": "eval.bench.peers.zipar",
    "vvs": "eval.bench.peers.vvs",
    "pjd": "eval.bench.peers.pjd",
    "pathrelax": "eval.bench.peers.pathrelax",
}

LEVEL = 0.95
ALPHA = 0.05


# -- the checkout ----------------------------------------------------------------------------------------------
def clone_command(spec: PeerSpec, where: str = "<dir>") -> str:
    return (f"git clone https://github.com/{spec.repo} {where} && git -C {where} checkout {spec.commit}")


def check_checkout(spec: PeerSpec, checkout: Path) -> None:
    """The checkout must be a git work tree at the pinned commit: the glue was written against that code."""
    if not checkout.is_dir():
        raise FileNotFoundError(f"--peer {spec.name}: {checkout} is not a directory; get it with: "
                                f"{clone_command(spec, str(checkout))}")
    try:
        head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise ValueError(f"--peer {spec.name}: {checkout} is not a git checkout of {spec.repo} ({e}); get one "
                         f"with: {clone_command(spec, str(checkout))}") from e
    if head != spec.commit:
        raise ValueError(f"--peer {spec.name}: {checkout} is at commit {head}, but eval/bench/peers/{spec.name}.py "
                         f"was written against {spec.commit}; run: git -C {checkout} checkout {spec.commit}")


# -- the worker --------------------------------------------------------------------------------------------------
class PeerWorker:
    """A peer's side: ``python -m eval.bench.peers.worker`` under the peer's interpreter, spoken to in pickles."""

    def __init__(self, python: str | None = None, log_dir: Path | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # idle threads sleep while the other side runs
        self.log = tempfile.NamedTemporaryFile("w+", prefix="peer-worker-", suffix=".log", dir=log_dir,
                                               delete=False)
        self.proc = subprocess.Popen([python or sys.executable, "-m", "eval.bench.peers.worker"], cwd=str(ROOT),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)

    def ask(self, *request: Any) -> Any:
        try:
            pickle.dump(request, self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (EOFError, BrokenPipeError) as e:
            raise RuntimeError(f"the peer worker died ({request[0]}); its output:\n{self.tail()}") from e
        if status == "error":
            raise RuntimeError(f"the peer's side failed on {request[0]}:\n{value}")
        return value

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                pickle.dump(("quit",), self.proc.stdin)
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> "PeerWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- our side ------------------------------------------------------------------------------------------------------
def compose(overrides: Sequence[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def build_ours(glue: Any, pair: Pair, models: dict, path: str = "eager", compiled: bool = False) -> Any:
    """Our decoder of ``pair`` on the peer's model config (one model per set of model overrides, shared), on the
    decode ``path`` (``decoder.path``); ``compiled``: with ``model.compile=true`` (the static path's step compiled
    whole, the eager path's layers piecewise)."""
    from hydra.utils import instantiate

    spec: PeerSpec = glue.SPEC
    cfg = compose([f"model={spec.model}", *spec.model_overrides, f"decoder={pair.ours}", *pair.overrides,
                   f"decoder.path={path}", *(["model.compile=true"] if compiled else [])])
    key = (spec.model, spec.model_overrides, compiled)
    if key not in models:
        models[key] = instantiate(cfg.model)
    model = models[key]
    make = getattr(glue, "make_ours", None)
    return make(cfg, model, pair) if make else instantiate(cfg.decoder, model=model)


def run_ours(decoder: Any, prompt: str, seed: int) -> PeerImage:
    stats = decoder.generate(prompt, seed).stats
    return PeerImage(seconds=stats.latency_s, tokens=stats.num_tokens, target_forwards=stats.target_forwards)


def anatomy_ours(decoder: Any, prompt: str, seed: int) -> dict[str, Any]:
    """Ours, as the worker records theirs (``eval.bench.peers.worker.anatomy_record``): the target's prefill and
    block forwards, the drafter's network and the loop (the rest), one decode timed and one counted."""
    from eval.bench.call_counts import PhaseCounter, phase_hooks
    from eval.bench.peers.worker import anatomy_record, phase_pass

    def hooks(timer: Any) -> list[Callable[[], None]]:
        # the target's prefill is a target forward; the drafter's begin (its own prefill) is drafter work
        return [timer.wrap_method(obj, name, ("target" if obj is decoder.model else "drafter")
                                  if phase == "prefill" else phase)
                for obj, name, phase, _ in phase_hooks(decoder)]

    timed, counted = PhaseCounter(), PhaseCounter()
    image = phase_pass(timed, lambda: run_ours(decoder, prompt, seed), hooks)
    phase_pass(counted, lambda: run_ours(decoder, prompt, seed), hooks, count=True)
    return anatomy_record(timed, counted, image)


def prompts_for(count: int, path: str | None) -> list[str]:
    """``count`` prompts: the lines of ``path``, or the project's fixed prompts (``configs/data/fixed.yaml``),
    cycled (every prompt index gets its own seed, so a cycled prompt is still another image)."""
    from omegaconf import OmegaConf

    from coolsd.prompts import FilePrompts

    if path:
        lines = FilePrompts(path).load(None, None)
    else:
        lines = list(OmegaConf.load(CONFIGS / "data" / "fixed.yaml").prompts)
    return [lines[i % len(lines)] for i in range(count)]


# -- measuring a pair ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PairResult:
    peer: str
    pair: Pair
    ours: list[PeerImage]
    theirs: list[PeerImage]
    patches: dict[str, int]
    worker: dict[str, Any]
    anatomy: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)   # "ours" / "theirs"


def interleave(ours: Callable[[str, int], PeerImage], theirs: Callable[[str, int], PeerImage],
               prompts: Sequence[str], seed: int, warmup: int,
               progress: Callable[[str], None] | None = None,
               after_warmup: Callable[[], Any] | None = None) -> tuple[list[PeerImage], list[PeerImage]]:
    """Warm both sides up (then ``after_warmup()``), then decode prompt i with seed + i on both, ours first on even
    i, theirs on odd i."""
    for i in range(warmup):
        ours(prompts[i % len(prompts)], WARMUP_SEED - i)
        theirs(prompts[i % len(prompts)], WARMUP_SEED - i)
    if after_warmup:
        after_warmup()
    a, b = [], []
    for i, prompt in enumerate(prompts):
        if i % 2 == 0:
            a.append(ours(prompt, seed + i))
            b.append(theirs(prompt, seed + i))
        else:
            b.append(theirs(prompt, seed + i))
            a.append(ours(prompt, seed + i))
        if progress:
            progress(f"{i + 1}/{len(prompts)}")
    return a, b


def measure_pair(glue: Any, checkout: Path, pair: Pair, prompts: Sequence[str], seed: int, warmup: int,
                 threads: int | None, python: str | None, models: dict,
                 progress: Callable[[str], None] | None = None, path: str = "eager",
                 compiled: bool = False) -> PairResult:
    ours = build_ours(glue, pair, models, path, compiled)
    with PeerWorker(python) as worker:
        info = worker.ask("build", glue.__name__, str(checkout), glue.export(ours, pair), pair, threads)
        # their conditioning (our caption features or prompt ids) is prepared before the timing
        conditioning = {prompt: glue.inputs(ours, prompt) for prompt in dict.fromkeys(prompts)}
        a, b = interleave(lambda p, s: run_ours(ours, p, s), lambda p, s: worker.ask("run", conditioning[p], s),
                          prompts, seed, warmup, progress,
                          after_warmup=lambda: worker.ask("reset"))   # patch counts: the timed images only
        hits = worker.ask("hits")
        # a compiled step has no phases to hook (its forwards run inside one compiled graph): no anatomy then
        anatomy = {} if compiled else {"ours": anatomy_ours(ours, prompts[0], seed),
                                       "theirs": worker.ask("anatomy", conditioning[prompts[0]], seed)}
    return PairResult(peer=glue.SPEC.name, pair=pair, ours=a, theirs=b, patches=hits, worker=info, anatomy=anatomy)


# -- statistics ----------------------------------------------------------------------------------------------------
def ratio_interval(ours: Sequence[float], theirs: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """Geometric mean of the paired ratios ours/theirs with the t-interval of the mean log ratio."""
    return geometric_ratio(ours, theirs, level)


def two_sample(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Means and the two-sided Mann-Whitney U p-value (1.0 when every value is the same, e.g. AR's tau)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if np.ptp(np.concatenate([a, b])) == 0:
        p = 1.0
    else:
        p = float(sps.mannwhitneyu(a, b, alternative="two-sided").pvalue)
    return {"ours": float(a.mean()), "theirs": float(b.mean()), "p": p}


def summarize(results: Sequence[PairResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        rows.append({
            "peer": r.peer,
            "ours": r.pair.ours,
            "theirs": r.pair.theirs,
            "difference": r.pair.difference,
            "n": len(r.ours),
            "latency_ours_s": float(np.median([x.seconds for x in r.ours])),
            "latency_theirs_s": float(np.median([x.seconds for x in r.theirs])),
            "ratio": ratio_interval([x.seconds for x in r.ours], [x.seconds for x in r.theirs]),
            "tau": two_sample([x.tau for x in r.ours], [x.tau for x in r.theirs]),
            "forwards": two_sample([x.target_forwards for x in r.ours], [x.target_forwards for x in r.theirs]),
            "patches": r.patches,
            "worker": r.worker,
            "anatomy": r.anatomy,
        })
    from eval.metrics.intervals import holm

    tau_holm = holm([row["tau"]["p"] for row in rows])
    fwd_holm = holm([row["forwards"]["p"] for row in rows])
    for row, pt, pf in zip(rows, tau_holm, fwd_holm):
        row["tau"]["p_holm"] = pt
        row["forwards"]["p_holm"] = pf
        same = pt >= ALPHA and pf >= ALPHA
        row["same_statistics"] = same
    return rows


# -- the report ------------------------------------------------------------------------------------------------------
def _p(p: float) -> str:
    return "1" if p >= 0.9995 else (f"{p:.3f}" if p >= 0.001 else "< 0.001")


def verdict(row: dict[str, Any]) -> str:
    lo, hi = row["ratio"]["interval"] or (None, None)
    if lo is None:
        return "one image: no interval"
    if hi < 1.0:
        return "ours faster"
    if lo > 1.0:
        return "ours slower"
    return "no difference shown"


def markdown(rows: Sequence[dict[str, Any]], skipped: dict[str, str], meta: dict[str, Any],
             specs: dict[str, PeerSpec]) -> str:
    lines = [
        f"# Each decoder against its authors' code ({meta['device']}"
        + (", ours on the static decode path" if meta.get("path") == "static" else "")
        + (", compiled (`model.compile=true`)" if meta.get("compiled") else "") + ")",
        "",
        f"{_written(meta, rows)}. Batch 1, {meta['prompts']} prompts per pair "
        f"(seed {meta['seed']} + i), {meta['warmup']} warm-up image(s) per side, {meta['threads']} torch "
        f"thread(s) per side, interleaved per prompt (ours first on even prompts). Latency = each side's whole "
        "decode call up to its last grid token (cache and tree setup included; ours also encodes the caption with "
        "the tiny text encoder where the model has one), timed in its own process; medians in ms. **Ratio** = "
        "geometric mean of ours ÷ theirs per prompt with its paired 95 % t-interval (below 1: ours faster). "
        "τ = (tokens − 1) ÷ (target forwards − 1) per image; p = two-sided Mann–Whitney U of the per-image τ "
        "(and of the target forwards), Holm-adjusted over the pairs; 5 % false-alarm probability per test.",
        "",
        f"CPU: {meta['cpu']}; torch {meta['torch']}; our transformers {meta['transformers']}"
        + (f" (this writing; the kept rows: {meta['kept']['cpu']}; torch {meta['kept']['torch']}; our transformers "
           f"{meta['kept']['transformers']})" if meta.get("kept") and any(
               meta["kept"].get(k) != meta.get(k) for k in ("cpu", "torch", "transformers")) else "") + ".",
        "",
        "| peer | ours | theirs | n | ours ms | theirs ms | ratio [95 % CI] | | τ ours | τ theirs | p(τ) | "
        "fwd ours | fwd theirs | p(fwd) |",
        "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ci = row["ratio"]["interval"]
        ratio = f"{row['ratio']['ratio']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(
            f"| {row['peer']} | `{row['ours']}` | {row['theirs']} | {row['n']} | "
            f"{row['latency_ours_s'] * 1e3:.1f} | {row['latency_theirs_s'] * 1e3:.1f} | {ratio} | {verdict(row)} | "
            f"{row['tau']['ours']:.2f} | {row['tau']['theirs']:.2f} | {_p(row['tau']['p_holm'])} | "
            f"{row['forwards']['ours']:.1f} | {row['forwards']['theirs']:.1f} | {_p(row['forwards']['p_holm'])} |")
    lines += anatomy_lines(rows)
    lines += ["", "## Per peer: what runs, what was patched, what differs", ""]
    for name, spec in specs.items():
        lines.append(f"### {name}: [{spec.repo}](https://github.com/{spec.repo}) at `{spec.commit[:12]}`")
        lines.append("")
        lines.append(f"- Our model: `model={spec.model}` {' '.join(spec.model_overrides)}".rstrip())
        if name in skipped:
            lines.append(f"- **Not run:** {skipped[name]}")
        peer_rows = [r for r in rows if r["peer"] == name]
        for row in peer_rows:
            patched = ", ".join(f"{k}: {v} calls" for k, v in sorted(row["patches"].items())) or "none hit"
            lines.append(f"- `{row['ours']}` vs {row['theirs']}: patched at run time: {patched}; their side ran "
                         f"under {row['worker'].get('versions', {})}.")
            if row["difference"]:
                lines.append(f"  Differs on purpose: {row['difference']}")
            if not row["same_statistics"]:
                lines.append("  The accepted lengths or forward counts differ (p < 0.05 after Holm)"
                             + (": explained by the difference above." if row["difference"] else
                                ": not explained, see the notes."))
        if spec.patches:
            from eval.bench.peers.patches import PATCHES

            installed = [f"`{p}` ({PATCHES[p]})" for p in spec.patches if p in PATCHES]
            lines.append("- Patches installed: " + "; ".join(installed))
        for note in spec.notes:
            lines.append(f"- {note}")
        if spec.requirements:
            lines.append(f"- Their side runs in a peer venv with {', '.join(spec.requirements)} over our torch.")
        lines.append("")
    return "\n".join(lines) + "\n"


def _written(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """Who wrote the table: this run's command, and where rows were kept from an earlier run (``keep``) that run's."""
    text = f"Written by `{meta['command']}` on {meta['date']}"
    kept = meta.get("kept")
    if not kept:
        return text
    new = sorted({r["peer"] for r in rows} - set(kept["peers"]))
    return (f"{text}, measuring {', '.join(new) if new else 'no pair'}; the rows of {', '.join(kept['peers'])} are "
            f"kept as measured by `{kept['command']}` on {kept['date']} (`--keep`)")


def keep(record: dict[str, Any], meta: dict[str, Any], kept: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``record`` and ``meta`` of this run with the rows of an earlier run's record ``kept`` (its ``.json``) for every
    peer this run did not measure, kept as measured: their rows, images and the specs recorded with them (this run's
    specs for the rest, so a new peer or a new reason shows). Peers with kept rows leave ``skipped``; ``meta["kept"]``
    says whose rows they are and how they were measured. Rows in the order of ``PEERS``; each row keeps the Holm
    adjustment of its own run."""
    measured = {r["peer"] for r in record["rows"]}
    old = [r for r in kept["rows"] if r["peer"] not in measured]
    peers = list(dict.fromkeys(r["peer"] for r in old))
    order = {name: i for i, name in enumerate(PEERS)}
    rows = sorted([*old, *record["rows"]], key=lambda r: order.get(r["peer"], len(order)))
    specs = {**record["specs"], **{name: spec_from(kept["specs"][name]) for name in peers}}
    specs = {name: specs[name] for name in sorted(specs, key=lambda n: order.get(n, len(order)))}
    images = {**{k: v for k, v in kept.get("images", {}).items() if k.split("/")[0] in peers}, **record["images"]}
    skipped = {k: v for k, v in record["skipped"].items() if k not in peers}
    earlier = kept["meta"]
    if earlier.get("kept") and set(peers) <= set(earlier["kept"]["peers"]):
        earlier = {**earlier, **earlier["kept"]}   # rows the earlier run kept itself: their own run measured them
    info = {k: earlier.get(k) for k in ("command", "date", "cpu", "torch", "transformers", "prompts", "seed", "warmup",
                                        "threads", "path", "compiled")}
    for k in ("prompts", "seed", "warmup", "threads"):
        if peers and earlier.get(k) != meta.get(k):
            raise ValueError(f"--keep: the kept rows were measured with {k}={earlier.get(k)}, this run with "
                             f"{k}={meta.get(k)}; one table holds one protocol")
    return ({"rows": rows, "skipped": skipped, "specs": specs, "images": images},
            {**meta, "kept": {"peers": peers, **info}} if peers else meta)


def spec_from(data: dict[str, Any]) -> PeerSpec:
    """A ``PeerSpec`` from its JSON form (``write``'s ``specs``)."""
    fields = {f.name for f in dataclasses.fields(PeerSpec)}
    given = {k: v for k, v in data.items() if k in fields}
    given["pairs"] = tuple(Pair(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.items()})
                           for p in data.get("pairs", ()))
    for k in ("model_overrides", "patches", "requirements", "notes"):
        if k in given:
            given[k] = tuple(given[k])
    return PeerSpec(**given)


def anatomy_figures(a: dict[str, Any]) -> dict[str, float | None]:
    """ms per target forward, drafter and loop ms per committed token, loop torch calls per committed token."""
    committed = max(a["tokens"] - 1, 1)
    forwards = max(a["target_forwards"], 1)
    loop_calls = a["calls"].get("loop", 0)
    return {
        "forward_ms": None if a["target_s"] is None else a["target_s"] / forwards * 1e3,
        "drafter_ms_token": a["drafter_s"] / committed * 1e3 if a.get("drafter_s") else 0.0,
        "loop_ms_token": None if a["loop_s"] is None else a["loop_s"] / committed * 1e3,
        "loop_calls_token": loop_calls / committed,
        "forward_calls": (a["calls"].get("target", 0) / forwards) if a["target_s"] is not None else None,
    }


def anatomy_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The anatomy table: where one image's time and torch calls went on each side (first prompt, untimed)."""
    rows = [r for r in rows if r.get("anatomy")]
    if not rows:
        return []

    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    lines = ["", "## Where the time goes", "",
             "One more image per side (the first prompt, untimed, under a torch-function counter): milliseconds "
             "per target forward (prefill included, its network only), drafter and loop milliseconds per committed "
             "token (the loop = everything outside the networks: sampling, acceptance, masks, caches, Python), and "
             "torch API calls per committed token in the loop and per target forward. A ratio above 1 in the "
             "table above comes from whichever of these is larger on our side.", "",
             "| peer | ours | side | ms / target forward | torch calls / forward | drafter ms / token | "
             "loop ms / token | loop torch calls / token |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for side in ("ours", "theirs"):
            f = anatomy_figures(row["anatomy"][side])
            lines.append(f"| {row['peer']} | `{row['ours']}` | {side} | {num(f['forward_ms'], '.2f')} | "
                         f"{num(f['forward_calls'], '.0f')} | {num(f['drafter_ms_token'], '.2f')} | "
                         f"{num(f['loop_ms_token'], '.2f')} | {f['loop_calls_token']:.0f} |")
    return lines


def load_glue(name: str) -> Any:
    if name not in PEERS:
        raise ValueError(f"--peer {name}: unknown peer; known: {', '.join(PEERS)}")
    return importlib.import_module(PEERS[name])


def run(peers: dict[str, Path], pythons: dict[str, str], prompts: Sequence[str], seed: int, warmup: int,
        threads: int | None, only: Sequence[str] = (), log: Callable[[str], None] = print,
        path: str = "eager", compiled: bool = False) -> dict[str, Any]:
    """Measure every pair of every given peer, ours on decode ``path`` (``compiled``: with ``model.compile=true``);
    list the known peers that were not given with the reason."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    specs: dict[str, PeerSpec] = {}
    skipped: dict[str, str] = {}
    results: list[PairResult] = []
    models: dict = {}
    for name in PEERS:
        try:
            glue = load_glue(name)
        except ModuleNotFoundError as e:
            if e.name != PEERS[name]:
                raise
            continue
        spec: PeerSpec = glue.SPEC
        specs[name] = spec
        if spec.not_run or spec.cpu:  # a glue not written yet, or code that cannot run here: said whether or not
            skipped[name] = spec.not_run or spec.cpu  # a checkout was given
            continue
        if name not in peers:
            skipped[name] = f"no checkout given (--peer {name}=<dir>; get it: `{clone_command(spec)}`)"
            continue
        check_checkout(spec, peers[name])
        for pair in spec.pairs:
            if only and pair.ours not in only:
                continue
            log(f"{name}: ours {pair.ours} vs theirs {pair.theirs} ({len(prompts)} prompts)")
            results.append(measure_pair(glue, peers[name], pair, prompts, seed, warmup, threads,
                                        pythons.get(name), models,
                                        progress=lambda text: log(f"  {text}"), path=path,
                                        compiled=compiled))
    unknown = sorted(set(peers) - set(specs))
    if unknown:
        raise ValueError(f"--peer {unknown}: unknown peers; known: {', '.join(specs)}")
    rows = summarize(results)
    return {"rows": rows, "skipped": skipped, "specs": specs,
            "images": {f"{r.peer}/{r.pair.ours}": {"ours": [dataclasses.asdict(x) for x in r.ours],
                                                   "theirs": [dataclasses.asdict(x) for x in r.theirs]}
                       for r in results}}


def write(out: Path, record: dict[str, Any], meta: dict[str, Any]) -> None:
    """``out`` (.md) and its .json twin, each written to a temporary file and renamed."""
    from coolsd.io import atomic_write_bytes, atomic_write_json

    text = markdown(record["rows"], record["skipped"], meta, record["specs"])
    payload = {"meta": meta, "rows": record["rows"], "skipped": record["skipped"], "images": record["images"],
               "specs": {k: dataclasses.asdict(v) for k, v in record["specs"].items()}}
    atomic_write_bytes(out, text.encode())
    atomic_write_json(out.with_suffix(".json"), payload)


def meta_for(command: str, prompts: int, seed: int, warmup: int, threads: int | None, device: str,
             path: str = "eager", compiled: bool = False) -> dict:
    from eval.records.environment import environment

    env = environment(packages=("transformers",))
    return {"command": command, "date": dt.date.today().isoformat(), "prompts": prompts, "seed": seed,
            "warmup": warmup, "threads": threads or "default", "device": device, "path": path,
            "compiled": compiled, **env}
