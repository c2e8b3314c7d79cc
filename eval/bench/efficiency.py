"""Benchmark: where a decode's time goes, and how close each decoder comes to its ideal speedup.

Everything is measured side by side in one process, after warm-up:

1. **Cost model** (medians of at least ``cost.repeats`` timed calls, CUDA-synchronised on GPU): the
   target's forward over a block of ``T`` tokens for ``T`` in ``cost.block_sizes`` (causal chains) and over
   every static draft tree in ``cost.trees`` (its ancestor mask, ``T`` = nodes + 1), after ``cost.context``
   committed image tokens; the sampling pipeline over ``T`` rows (``model.probs``) and one draw; the
   drafter's step (one network forward over one new token, its head included) and its ``q`` pipeline +
   draw. Probes run in rounds spread between the end-to-end images, so that drifts of a shared machine's
   load hit both alike; in a round each probe runs one untimed call and a burst of ``cost.burst`` timed
   ones, as a decode loop repeats its shapes. With ``cuda_graphs=true`` every fixed-shape target forward is
   also captured once in a CUDA graph and replayed: the same kernels without Python or launch overhead
   (and a projection of AR latency with such forwards). The torch API calls of one 1-token forward, by
   the function that makes them, show where per-op overhead (on a GPU, kernel launches) comes from.
2. **End to end**: every decoder of ``decoders`` generates ``images`` images, interleaved per image (image
   ``i`` with every decoder, then image ``i + 1``; prompt ``i``, seed ``seed + i`` for all), after
   ``warmup`` untimed images each; latencies are medians over images; ``ar`` is the speedup denominator.
3. **Ideal speedup and efficiency.** With ``τ`` the mean committed tokens per iteration (the mean accepted
   length), ``c_v(T)`` the verify cost of the decoder's block (target forward over ``T`` tokens + the
   pipeline over its ``T`` rows + one draw; ``T`` = draft_len + 1 for a chain, nodes + 1 for a tree),
   ``c_d`` the drafter cost per iteration (measured drafter forwards per iteration × (drafter step + its
   pipeline and draw)) and ``c_1 = c_v(1)`` the AR cost per token (1-token forward + its sampling)::

       ideal latency per token = (c_d + c_v(T)) / τ          ideal speedup = τ · c_1 / (c_d + c_v(T))

   The measured speedup is AR latency ÷ decoder latency (end to end, same prompts and seeds, same process);
   **efficiency = measured speedup ÷ ideal speedup**. When ``accepted_lengths`` gives a decoder's τ (from
   the paper: the GPU presets run random weights, whose accepted lengths mean nothing) the measured
   speedup is not comparable, and the table uses the *projected* speedup ``τ · t_AR / t_iter`` (AR time
   per token and the decoder's time per iteration, both measured) instead.
4. **Overhead per iteration** = iteration wall time − the network forwards inside it, where the iteration
   time comes from the decoders' own statistics (``DecodeStats``: (latency − prefill) / iterations) and the
   forwards from the cost model (drafter forwards per iteration × drafter step + target forward over
   ``T``). It is everything a decoder does outside its networks: sampling, acceptance, masks, bookkeeping.
   The per-phase times (draft / verify / accept / observe, per iteration) come from ``DecodeStats``. AR's
   own overhead shows in its row; every measured speedup is relative to that AR.

5. **Torch calls** (``decode_counts``): every decoder decodes the first prompt once more at batch 1 under a
   ``TorchFunctionMode`` that counts torch API calls per committed token in the target's forwards, the
   drafter's network, and the loop (everything else), and host synchronisations per iteration; the same counts
   are held under ceilings in ``tests/test_call_counts.py``. Unlike timings, they do not drift.

Costs depend on the block size and the tree only: a dynamic tree's verify is costed as a causal block of
the same size, and a tree drafter's level expansion (several nodes in one forward) or an EAGLE step that
feeds several pending tokens as one drafter step (equal on a GPU; on a CPU they cost more, which then shows
as overhead). ``compile=true`` compiles the target's stateless blocks (``compile_modules``).

Output: a markdown table and a JSON record in ``out_dir`` (``results/bench/<name>.{md,json}``) with the
hardware and versions; ``scripts/bench.py`` composes the config (``configs/bench.yaml``), calls ``run_bench``
and prints the table.

GPU presets (``configs/bench/``) build the real architectures with random weights, without downloads:
``bench=llamagen_xl_512`` (LlamaGen T2I-XL, 1,024 tokens, CFG batch 2) and ``bench=janus_pro_1b`` (576
tokens), bf16, with an untrained EAGLE head as drafter; accepted lengths come from the COOL-SD paper.

Examples::

    python scripts/bench.py                                   # CPU, the default model, every decoder
    python scripts/bench.py bench=embedded_random             # the embedded model's sizes, random weights
    python scripts/bench.py bench=llamagen_xl_512 cuda_graphs=true
    python scripts/bench.py bench=janus_pro_1b compile=true
"""
from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import coolsd  # noqa: F401  (registers the ${asset:} resolver)
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.io import atomic_write_bytes
from coolsd.models.base import ImageARModel
from coolsd.sampling import sample, stream_probs
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from eval.bench.call_counts import call_anatomy, decode_counts
from eval.records.environment import environment, git_commit
from eval.run.suite import WARMUP_SEED

DRAFTER_WEIGHTS = ("config", "random")


# -- timing ------------------------------------------------------------------------------------------------
class Timer:
    """Wall seconds of callables, CUDA-synchronised on GPU; optional capture into CUDA graphs."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def graph(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """``fn`` captured once in a CUDA graph (fixed shapes): returns the replay, which runs the same
        kernels without Python or per-kernel launch overhead."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # capture needs a warm-up on a side stream
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


class Probes:
    """Named timed callables, run in rounds (every probe in turn, a short burst each) so that a drift of
    the machine's load hits all of them alike; the rounds are spread between the end-to-end images."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.fns: dict[str, Callable[[], Any]] = {}
        self.samples: dict[str, list[float]] = {}

    def add(self, key: str, fn: Callable[[], Any]) -> None:
        self.fns[key] = fn
        self.samples[key] = []

    def warm_up(self, calls: int) -> None:
        for fn in self.fns.values():
            for _ in range(calls):
                fn()

    def round(self, burst: int) -> None:
        """Every probe: one untimed call (its shapes back in the caches), then ``burst`` timed calls."""
        for key, fn in self.fns.items():
            fn()
            self.samples[key].extend(self.timer.once(fn) for _ in range(burst))

    def median(self, key: str) -> float:
        return statistics.median(self.samples[key])


# -- the cost model ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterCost:
    """One drafter network forward over one new token (``step_s``, head included) and its ``q`` pipeline
    plus one draw (``pipeline_s``). ``kind`` names the drafter; 0 for drafters without a network."""

    kind: str
    step_s: float
    pipeline_s: float


@dataclass(frozen=True)
class Costs:
    """The measured cost model (seconds). Keys of the dicts are block sizes ``T`` or tree names."""

    context: int
    forward_s: dict[int, float]
    probs_s: dict[int, float]
    sample_s: float
    tree_tokens: dict[str, int]
    tree_forward_s: dict[str, float]
    graph_forward_s: dict[int, float]
    graph_tree_forward_s: dict[str, float]
    drafters: dict[str, DrafterCost]

    def verify(self, tokens: int, tree: str | None) -> float:
        """``c_v(T)``: the target forward over the block (tree mask for a static tree), the pipeline over its
        ``T`` rows and one draw."""
        return self.target_forward(tokens, tree) + self.probs_s[tokens] + self.sample_s

    def target_forward(self, tokens: int, tree: str | None) -> float:
        return self.tree_forward_s[tree] if tree is not None else self.forward_s[tokens]


class ForwardProbe:
    """An own cache holding the prompt and ``context`` image tokens; each call forwards one more block."""

    def __init__(self, model: ImageARModel, prompt: str, context: int, max_block: int) -> None:
        self.model = model
        self.cache, _ = model.prefill([prompt], extra_slots=max_block + 1)
        if context:
            tokens = torch.randint(model.codebook_size, (1, context), device=model.device)
            model.forward_block(self.cache, tokens, torch.arange(context, device=model.device)[None])
        self.base = self.cache.lengths[0]
        self.context = context

    def block(self, tokens: int, tree: TreeShape | None) -> Callable[[], Any]:
        """A callable forwarding ``tokens`` random tokens after the context: a chain (causal) or ``tree``
        (root + its nodes, node positions by depth). Positions past the grid are clamped (costs only)."""
        model, last = self.model, self.model.num_image_tokens - 1
        x = torch.randint(model.codebook_size, (1, tokens), device=model.device)
        if tree is None:
            positions, mask = torch.arange(self.context, self.context + tokens, device=model.device), None
        else:
            parents = tree.parents()
            positions = torch.tensor([self.context] + [self.context + d for d in depths_of(parents)],
                                     device=model.device)
            mask = ancestor_mask(parents).to(model.device)
        positions = positions.clamp(max=last)[None]

        def run():
            self.cache.rollback(self.base)
            return model.forward_block(self.cache, x, positions, mask)

        return run


def drafter_probes(drafter: Any, model: ImageARModel, prompt: str, context: int,
                   gen: torch.Generator) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """(one drafter step, its q pipeline + draw) on an own cache: EAGLE heads (``EagleDrafter``) and draft
    models (``ModelDrafter``) have networks; other drafters (Jacobi windows, none) return None (cost 0)."""
    if isinstance(drafter, ModelDrafter):
        step = ForwardProbe(drafter.model, prompt, context, max_block=1).block(1, None)
        logits = step().logits[:, :, -1:]
        return step, lambda: sample(stream_probs(logits, model.sampling)[0], gen)
    if isinstance(drafter, EagleDrafter):
        _, out = model.prefill([prompt], extra_slots=1)
        cache, pairs = drafter.new_cache(batch=1), max(context, 1)
        features = out.hidden[:, 0, -1:].expand(-1, pairs, -1).contiguous()  # (S, pairs, H)
        tokens = torch.randint(model.codebook_size, (pairs,), device=model.device)
        drafter.head(features, tokens, torch.arange(-1, pairs - 1, device=model.device), cache,
                     cache.begin_block(pairs))
        base = cache.lengths[0]
        position = torch.tensor([pairs - 1], device=model.device)
        last_features, last_token = features[:, -1:], tokens[-1:]  # the step's inputs, as a decode has them

        def step():
            cache.rollback(base)
            mask = cache.begin_block(1)
            f_hat = drafter.head(last_features, last_token, position, cache, mask)  # (S, 1, H)
            return drafter.head.logits(f_hat)

        logits = step()
        return step, lambda: sample(stream_probs(logits, model.sampling)[-1], gen)
    return None


def drafter_key(decoder: Decoder) -> str:
    """Decoders whose drafters run the same network share one cost entry."""
    drafter = decoder.drafter
    if isinstance(drafter, ModelDrafter):
        return f"ModelDrafter({getattr(drafter.model, 'active_layers', '?')} layers)"
    return type(drafter).__name__


class CostModel:
    """Builds the probes of the cost model at ``cost.context`` committed tokens (a fraction of the image,
    or a count) and turns their samples into ``Costs``."""

    def __init__(self, cfg: DictConfig, model: ImageARModel, decoders: dict[str, Decoder], prompt: str,
                 timer: Timer) -> None:
        n = model.num_image_tokens
        context = int(cfg.cost.context * n) if cfg.cost.context < 1 else int(cfg.cost.context)
        self.context = min(max(context, 0), n - 1)
        blocks = [verify_block(d) for d in decoders.values()]
        self.sizes = sorted({1, *cfg.cost.block_sizes, *(v.tokens for v in blocks if v.tree is None)})
        names = [*cfg.cost.trees, *(v.tree for v in blocks if v.tree)]
        trees = {name: TreeShape.load(name) for name in names}
        self.tree_tokens = {name: len(t.paths) + 1 for name, t in trees.items()}
        self.graphs = bool(cfg.cuda_graphs)
        self.graph_errors: dict[str, str] = {}
        self.probes = probes = Probes(timer)
        gen = torch.Generator(device=model.device).manual_seed(cfg.seed)
        target = ForwardProbe(model, prompt, self.context, max(self.sizes + list(self.tree_tokens.values())))
        for t in sorted({*self.sizes, *self.tree_tokens.values()}):
            run = target.block(t, None)
            out = run()
            probes.add(f"probs/{t}", lambda out=out: model.probs(out))
            if t in self.sizes:
                probes.add(f"forward/{t}", run)
                self.add_graph(f"graph/{t}", run, timer)
        for name, tree in trees.items():
            run = target.block(self.tree_tokens[name], tree)
            probes.add(f"tree/{name}", run)
            self.add_graph(f"graph_tree/{name}", run, timer)
        self.anatomy = {"target forward, T=1": call_anatomy(target.block(1, None))}
        p1 = model.probs(target.block(1, None)())[0, -1]
        probes.add("sample", lambda: sample(p1, gen))
        self.drafter_kinds: dict[str, bool] = {}
        for dec in decoders.values():
            key = drafter_key(dec)
            if key not in self.drafter_kinds:
                pair = drafter_probes(dec.drafter, model, prompt, self.context, gen)
                self.drafter_kinds[key] = pair is not None
                if pair is not None:
                    self.anatomy[f"{key} step"] = call_anatomy(pair[0])
                    probes.add(f"drafter/{key}", pair[0])
                    probes.add(f"drafter_pipeline/{key}", pair[1])

    def add_graph(self, key: str, run: Callable[[], Any], timer: Timer) -> None:
        """With ``cuda_graphs``: a probe replaying ``run`` from a CUDA graph. A forward that cannot be
        captured (e.g. it copies from host memory) is reported in ``graph_errors`` instead."""
        if not self.graphs:
            return
        try:
            self.probes.add(key, timer.graph(run))
        except RuntimeError as err:
            self.graph_errors[key] = str(err).splitlines()[0][:300]

    def costs(self) -> Costs:
        med = self.probes.median
        drafters = {key: DrafterCost(key, med(f"drafter/{key}"), med(f"drafter_pipeline/{key}")) if has
                    else DrafterCost(key, 0.0, 0.0) for key, has in self.drafter_kinds.items()}
        return Costs(
            context=self.context,
            forward_s={t: med(f"forward/{t}") for t in self.sizes},
            probs_s={t: med(f"probs/{t}") for t in sorted({*self.sizes, *self.tree_tokens.values()})},
            sample_s=med("sample"),
            tree_tokens=self.tree_tokens,
            tree_forward_s={name: med(f"tree/{name}") for name in self.tree_tokens},
            graph_forward_s={t: med(f"graph/{t}") for t in self.sizes if f"graph/{t}" in self.probes.fns},
            graph_tree_forward_s={n: med(f"graph_tree/{n}") for n in self.tree_tokens
                                  if f"graph_tree/{n}" in self.probes.fns},
            drafters=drafters,
        )


# -- decoders ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verify:
    """The verify block of a decoder: ``tokens`` = T, ``tree`` = static tree name (None: causal block)."""

    tokens: int
    tree: str | None


def verify_block(decoder: Decoder) -> Verify:
    tree = decoder.tree
    return Verify(tokens=decoder.max_nodes + 1, tree=tree.name if isinstance(tree, TreeShape) else None)


#: the label suffix of a decoder on the static path (``sd@static``); its speedup is over ``ar@static``
STATIC = "@static"


def path_of(label: str) -> str:
    """``eager`` or ``static``: the decode path of a bench label (``STATIC``)."""
    return "static" if label.endswith(STATIC) else "eager"


def ar_label(label: str) -> str:
    """The AR decoder on the path of ``label``: each speedup is over AR on the same path."""
    return "ar" + STATIC if path_of(label) == "static" else "ar"


def build_decoders(cfg: DictConfig, model: ImageARModel, path: str = "eager",
                   refused: dict[str, str] | None = None) -> dict[str, Decoder]:
    """The decoders named in ``cfg.decoders``: suite entries, or ``cfg.variants`` (label -> a suite decoder
    ``decoder:`` with overrides of its config), on ``path`` (static labels end in ``@static``).

    ``drafter_weights=random`` gives every decoder that uses the model's drafter group one shared untrained
    EAGLE head of the target's own kind (real costs, meaningless acceptance); ``config`` builds the group. A
    decoder the static path refuses (a tree, the layer-skip drafter, ...) is left out of ``path=static`` and its
    reason put in ``refused``.
    """
    refused = {} if refused is None else refused
    if cfg.drafter_weights not in DRAFTER_WEIGHTS:
        raise ValueError(f"drafter_weights must be one of {DRAFTER_WEIGHTS}, got {cfg.drafter_weights!r}")
    labels = list(cfg.decoders)
    if "ar" not in labels:
        raise ValueError(f"decoders must include ar (the speedup denominator), got {labels}")
    shared = None
    if cfg.drafter_weights == "random":
        shared = EagleDrafter(target=model, head=EagleHead(model, init_seed=cfg.seed), extra_slots=64)
    variants = cfg.variants or {}
    cuda = model.device.type == "cuda"
    decoders = {}
    for label in labels:
        spec = dict(variants.get(label) or {})
        base = spec.pop("decoder", label)
        if base not in cfg.suite:
            raise ValueError(f"decoders: {label!r} is neither a suite decoder {list(cfg.suite)} nor a "
                             f"variant with a suite `decoder:` (variants: {list(variants)})")
        uses_group = OmegaConf.to_container(cfg.suite[base], resolve=False).get("drafter") == "${drafter}"
        node = OmegaConf.to_container(cfg.suite[base], resolve=not (shared and uses_group))
        node.update(spec, name=label, track_tv=False, sync_phases=cuda and path == "eager", path=path)
        key = label + (STATIC if path == "static" else "")
        try:
            if shared is not None and uses_group:
                node["drafter"] = None
                decoders[key] = instantiate(node, model=model, drafter=shared)
            else:
                decoders[key] = instantiate(node, model=model)
        except Exception as error:  # a decoder the static path refuses is left out of it, with the reason
            reason = str(error.__cause__ or error)
            if path != "static" or "cannot run on decoder.path=static" not in reason:
                raise
            refused[key] = reason.split(": ", 1)[-1]
            progress(f"{key} left out: {refused[key]}")
    return decoders


# -- end to end --------------------------------------------------------------------------------------------
def run_interleaved(decoders: dict[str, Decoder], prompts: list[str], cfg: DictConfig,
                    cost: CostModel) -> dict[str, list]:
    """Per-image ``DecodeStats`` of every decoder (image i with every decoder, then image i + 1), with the
    cost-model rounds spread in between; warm-up first."""
    cost.probes.warm_up(cfg.cost.warmup)
    for dec in decoders.values():
        for w in range(cfg.warmup):
            dec.generate(prompts[0], WARMUP_SEED - w)
    if cfg.cost.burst < 1 or cfg.cost.repeats < 1:
        raise ValueError(f"cost.burst and cost.repeats must be >= 1, got {cfg.cost.burst}, "
                         f"{cfg.cost.repeats}")
    rounds = -(-cfg.cost.repeats // (cfg.cost.burst * len(prompts)))  # per image, rounded up
    stats: dict[str, list] = {name: [] for name in decoders}
    for i, prompt in enumerate(prompts):
        for _ in range(rounds):
            cost.probes.round(cfg.cost.burst)
        for name, dec in decoders.items():
            stats[name].append(dec.generate(prompt, cfg.seed + i).stats)
            progress(f"image {i + 1}/{len(prompts)} {name}: {stats[name][-1].latency_s:.3f} s, "
                     f"{stats[name][-1].iterations} iterations")
    return stats


def progress(text: str) -> None:
    """One line on stderr per finished measurement, so a long GPU bench shows where it is."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def throughput_decoders(cfg: DictConfig, decoders: dict[str, Decoder]) -> dict[str, Decoder]:
    """The decoders whose throughput is measured: ``throughput.decoders`` (null: every decoder of the run)."""
    names = OmegaConf.select(cfg, "throughput.decoders", default=None)
    if names is None:
        return decoders
    unknown = [n for n in names if n not in decoders]
    if unknown:
        raise ValueError(f"throughput.decoders names decoders that are not run: {unknown}; run: {list(decoders)}")
    return {n: decoders[n] for n in names}


def measure_throughput(decoders: dict[str, Decoder], prompts: list[str], cfg: DictConfig,
                       timer: Timer) -> dict[str, dict[str, Any]]:
    """Images per second of every decoder at each batch size of ``throughput.batch_sizes``: at least
    ``throughput.images`` images per (decoder, batch size) in whole batches (``throughput.batches``, when set:
    exactly that many batches per batch size instead), decoders interleaved batch by batch; with peak GPU memory
    per (decoder, batch size) on CUDA and the mean accepted length of the batch's images (``tau``)."""
    cuda = timer.cuda
    out: dict[str, dict[str, Any]] = {name: {"img_s": {}, "peak_mem_mb": {}, "images": {}, "tau": {}}
                                      for name in decoders}
    fixed = OmegaConf.select(cfg, "throughput.batches", default=None)
    if fixed is not None and int(fixed) < 1:
        raise ValueError(f"throughput.batches must be >= 1 or null, got {fixed}")
    offset = 0
    for b in cfg.throughput.batch_sizes:
        batches = int(fixed) if fixed is not None else -(-int(cfg.throughput.images) // b)
        taus: dict[str, list[float]] = {name: [] for name in decoders}
        wall = {name: 0.0 for name in decoders}
        peak = {name: 0.0 for name in decoders}
        for _ in range(batches):
            chunk = [prompts[(offset + k) % len(prompts)] for k in range(b)]
            seeds = [cfg.seed + 10_000 + offset + k for k in range(b)]
            offset += b
            for name, dec in decoders.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                gens: list = []
                wall[name] += timer.once(lambda dec=dec, gens=gens: gens.extend(dec.generate_batch(chunk, seeds)))
                taus[name] += [g.stats.mean_accepted_length for g in gens]
                if cuda:
                    peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 2**20)
                progress(f"throughput B={b} {name}: {wall[name]:.2f} s so far")
        for name in decoders:
            out[name]["img_s"][b] = batches * b / wall[name]
            out[name]["images"][b] = batches * b
            out[name]["peak_mem_mb"][b] = peak[name] if cuda else None
            out[name]["tau"][b] = statistics.fmean(taus[name])
    return out


@dataclass(frozen=True)
class DecoderResult:
    """One decoder's row (times in seconds; ``phase_s`` and ``iteration_s`` per iteration)."""

    name: str
    verify_tokens: int
    tree: str | None
    drafter: str
    images: int
    latency_s: float
    prefill_s: float
    accepted_length: float
    tau: float
    tau_source: str
    iterations: float
    drafter_forwards_per_iter: float
    phase_s: dict[str, float]
    iteration_s: float
    forwards_s: float
    overhead_s: float
    overhead_frac: float
    ideal_speedup: float
    measured_speedup: float
    projected_speedup: float
    efficiency: float
    efficiency_basis: str


def ideal_speedup(tau: float, c_1: float, c_d: float, c_v: float) -> float:
    """``τ · c_1 / (c_d + c_v(T))``: the speedup if nothing but the forwards and sampling cost time."""
    return tau * c_1 / (c_d + c_v)


def summarize(name: str, stats: list, decoder: Decoder, costs: Costs, ar: dict[str, float] | None,
              paper_tau: float | None) -> DecoderResult:
    """Medians over images, the cost-model ideal and the efficiency of one decoder."""
    med = statistics.median
    iterations = [max(s.iterations, 1) for s in stats]
    committed = sum(s.num_tokens - 1 for s in stats)
    tau_measured = committed / sum(iterations)
    tau = paper_tau if paper_tau is not None else tau_measured
    block = verify_block(decoder)
    dkey = drafter_key(decoder)
    dcost = costs.drafters[dkey]
    d_fwd = sum(s.drafter_forwards for s in stats) / sum(iterations)
    iteration = med([(s.latency_s - s.prefill_s) / k for s, k in zip(stats, iterations)])
    phases = {p: med([getattr(s, f"{p}_s") / k for s, k in zip(stats, iterations)])
              for p in ("draft", "verify", "accept", "observe")}
    forwards = d_fwd * dcost.step_s + costs.target_forward(block.tokens, block.tree)
    c_1 = costs.verify(1, None)
    c_d = d_fwd * (dcost.step_s + dcost.pipeline_s)
    ideal = ideal_speedup(tau, c_1, c_d, costs.verify(block.tokens, block.tree))
    latency = med([s.latency_s for s in stats])
    measured = ar["latency_s"] / latency if ar else 1.0
    projected = tau * ar["iteration_s"] / iteration if ar else 1.0
    basis = "measured" if paper_tau is None else "projected"
    return DecoderResult(
        name=name, verify_tokens=block.tokens, tree=block.tree, drafter=dkey, images=len(stats),
        latency_s=latency, prefill_s=med([s.prefill_s for s in stats]), accepted_length=tau_measured, tau=tau,
        tau_source="measured" if paper_tau is None else "paper", iterations=med(iterations),
        drafter_forwards_per_iter=d_fwd, phase_s=phases, iteration_s=iteration, forwards_s=forwards,
        overhead_s=iteration - forwards, overhead_frac=(iteration - forwards) / iteration,
        ideal_speedup=ideal, measured_speedup=measured, projected_speedup=projected,
        efficiency=(measured if paper_tau is None else projected) / ideal, efficiency_basis=basis,
    )


# -- goals and the report ----------------------------------------------------------------------------------
def record_gains(throughput: dict[str, dict[str, Any]]) -> dict[str, dict[str, tuple[int, float]]]:
    """Per decoder: (largest B, img/s there ÷ img/s at B = 1) and (the best B, its gain); needs B = 1."""
    gains = {}
    for name, t in throughput.items():
        rates = t["img_s"]
        if 1 not in rates or len(rates) < 2:
            continue
        largest = max(rates)
        best = max(rates, key=lambda b: rates[b])
        gains[name] = {"at_largest": (largest, rates[largest] / rates[1]), "best": (best, rates[best] / rates[1])}
    return gains


def check_goals(cfg: DictConfig, costs: Costs, results: dict[str, DecoderResult],
                throughput: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals that this run can check (``goals`` in the config; null skips one)."""
    goals = cfg.goals
    out = []

    def add(goal: str, value: float, limit: float, ok: bool) -> None:
        out.append({"goal": goal, "value": value, "limit": limit, "met": bool(ok)})

    if goals.min_efficiency is not None:
        for name in [n + suffix for n in goals.efficiency_decoders for suffix in ("", STATIC)]:
            if name in results:
                r = results[name]
                add(f"{name}: efficiency ({r.efficiency_basis}) >= {goals.min_efficiency}", r.efficiency,
                    goals.min_efficiency, r.efficiency >= goals.min_efficiency)
    for ar in ("ar", "ar" + STATIC):
        if goals.max_ar_latency_s is not None and ar in results:
            lat = results[ar].latency_s
            add(f"{ar}: latency per image <= {goals.max_ar_latency_s} s", lat, goals.max_ar_latency_s,
                lat <= goals.max_ar_latency_s)
    if goals.max_tree_ratio is not None and goals.tree in costs.tree_forward_s:
        tokens = costs.tree_tokens[goals.tree]
        ratio = costs.tree_forward_s[goals.tree] / costs.forward_s[1]
        add(f"verify over {goals.tree} ({tokens - 1} nodes) / 1-token forward <= {goals.max_tree_ratio}",
            ratio, goals.max_tree_ratio, ratio <= goals.max_tree_ratio)
        if goals.tree in costs.graph_tree_forward_s and 1 in costs.graph_forward_s:
            ratio = costs.graph_tree_forward_s[goals.tree] / costs.graph_forward_s[1]
            add(f"same, CUDA-graph replay <= {goals.max_tree_ratio}", ratio, goals.max_tree_ratio,
                ratio <= goals.max_tree_ratio)
    gains = record_gains(throughput)
    for ar in ("ar", "ar" + STATIC):
        if goals.min_ar_batch_gain is not None and ar in gains:
            b, gain = gains[ar]["at_largest"]
            add(f"{ar}: img/s at B = {b} >= {goals.min_ar_batch_gain}x its batch-1 img/s", gain,
                goals.min_ar_batch_gain, gain >= goals.min_ar_batch_gain)
    if goals.min_batch_gain is not None:
        for name, g in gains.items():
            if name != ar_label(name):
                b, gain = g["best"]
                add(f"{name}: best batched img/s (B = {b}) >= {goals.min_batch_gain}x its batch-1 img/s", gain,
                    goals.min_batch_gain, gain >= goals.min_batch_gain)
    if goals.max_overhead_frac is not None:
        for name, r in results.items():
            add(f"{name}: overhead outside forwards <= {goals.max_overhead_frac:.0%} of an iteration",
                r.overhead_frac, goals.max_overhead_frac, r.overhead_frac <= goals.max_overhead_frac)
    return out


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1e3 * seconds:.3f}"


def markdown(record: dict[str, Any], costs: Costs, results: dict[str, DecoderResult]) -> str:
    env, setup = record["environment"], record["setup"]
    hw = env.get("gpu") or (f"{env['processor']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch "
                            "threads")
    dirty = " (uncommitted changes)" if record["git"].get("dirty") else ""
    lines = [
        f"# Benchmark: {setup['name']}",
        "",
        f"model `{setup['model']}` ({setup['image_tokens']} image tokens, {setup['streams']} CFG streams, "
        f"{setup['dtype']}) on {setup['device']} — {hw}; torch {env['torch']}"
        + (f", CUDA {env['cuda_version']}" if env.get("cuda_version") else "") + f", python {env['python']}; "
        f"git {record['git'].get('commit') or 'n/a'}{dirty}; "
        f"{record['started']}. "
        f"Drafter weights: {setup['drafter_weights']}; compile: {setup['compile']}; "
        f"{setup['images']} images per decoder after {setup['warmup']} warm-up, interleaved; medians.",
        "",
        f"## Cost model (ms; context {costs.context} image tokens; median of {setup['repeats']})",
        "",
        "| block | target forward | × 1-token | CUDA-graph replay | pipeline over T rows |",
        "|---|---|---|---|---|",
    ]
    f1 = costs.forward_s[1]
    for t, f in sorted(costs.forward_s.items()):
        lines.append(f"| chain T={t} | {ms(f)} | {f / f1:.2f} | {ms(costs.graph_forward_s.get(t))} | "
                     f"{ms(costs.probs_s[t])} |")
    for name, f in costs.tree_forward_s.items():
        t = costs.tree_tokens[name]
        lines.append(f"| tree {name} (T={t}) | {ms(f)} | {f / f1:.2f} | "
                     f"{ms(costs.graph_tree_forward_s.get(name))} | {ms(costs.probs_s[t])} |")
    lines += ["", f"One draw from p: {ms(costs.sample_s)} ms. AR cost per token c_1 = "
              f"{ms(costs.verify(1, None))} ms."]
    if record["ar_graph_projection_s"] is not None:
        lines.append(f"AR per image with CUDA-graph-replayed forwards (projection: prefill + (N − 1) × "
                     f"(graph forward + pipeline + draw)): {record['ar_graph_projection_s']:.3f} s.")
    lines += [f"CUDA-graph capture failed for {k}: {v}" for k, v in record["graph_errors"].items()]
    lines.append("")
    lines += ["| drafter | step (network, 1 token) | q pipeline + draw |", "|---|---|---|"]
    lines += [f"| {k} | {ms(d.step_s)} | {ms(d.pipeline_s)} |" for k, d in costs.drafters.items()]
    lines += ["", ("Torch API calls per forward (per-op overhead; on a GPU, roughly the kernel launches), by "
                   "the function that makes them:"), ""]
    for what, a in record["call_anatomy"].items():
        parts = ", ".join(f"{k} {v}" for k, v in a["by_function"].items())
        lines.append(f"* {what}: {a['total']} — {parts}")
    lines += call_count_lines(record.get("call_counts") or {})
    lines += [
        "",
        "## Decoders",
        "",
        ("ideal speedup = τ·c_1 / (c_d + c_v(T)); efficiency = measured speedup ÷ ideal (τ measured) or "
         "projected speedup τ·t_AR/t_iter ÷ ideal (τ from the paper: random weights). Times per iteration "
         "in ms; overhead = iteration − network forwards (drafter steps + target forward over T). A decoder "
         f"ending in {STATIC} ran on the static path (decoder.path=static, steps: {setup.get('static_steps')}): "
         f"its speedup is over ar{STATIC}, and its phases are not timed there (–); the forwards and the ideal "
         "are the eager path's cost model.")
        + "".join(f" Not on the static path: {k} ({v})." for k, v in (setup.get("static_refused") or {}).items()),
        "",
        ("| decoder | T | τ | τ source | latency s/img | speedup | ideal | efficiency | drafter fwd/iter | "
         "iteration | draft | verify | accept | observe | forwards | overhead |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        t = f"{r.verify_tokens}" + (f" ({r.tree})" if r.tree else "")
        projected = f" (proj. {r.projected_speedup:.2f}x)" if r.tau_source == "paper" else ""
        speed = f"{r.measured_speedup:.2f}x{projected}"
        lines.append(
            f"| {r.name} | {t} | {r.tau:.2f} | {r.tau_source} | {r.latency_s:.3f} | {speed} | "
            f"{r.ideal_speedup:.2f}x | {r.efficiency:.2f} | {r.drafter_forwards_per_iter:.2f} | "
            f"{ms(r.iteration_s)} | " + " | ".join(ms(None if path_of(r.name) == "static" else r.phase_s[p])
                                                   for p in ("draft", "verify", "accept", "observe")) + " | "
            f"{ms(r.forwards_s)} | "
            f"{ms(r.overhead_s)} ({r.overhead_frac:.0%}) |")
    throughput = record.get("throughput") or {}
    if throughput:
        sizes = sorted({int(b) for t in throughput.values() for b in t["img_s"]})
        cuda = any(v is not None for t in throughput.values() for v in t["peak_mem_mb"].values())
        lines += ["", "## Throughput (images per second; decoders interleaved batch by batch)", "",
                  "| decoder | " + " | ".join(f"B={b}" for b in sizes) + " | best ÷ B=1 |"
                  + (" peak GPU MB " + " / ".join(f"B={b}" for b in sizes) + " |" if cuda else ""),
                  "|---|" + "---|" * len(sizes) + "---|" + ("---|" if cuda else "")]
        gains = record_gains(throughput)
        for name, t in throughput.items():
            cells = [f"{t['img_s'][b]:.2f}" for b in sizes]
            gain = gains.get(name, {}).get("best")
            row = f"| {name} | " + " | ".join(cells) + f" | {gain[1]:.1f}x (B={gain[0]}) |" if gain else \
                f"| {name} | " + " | ".join(cells) + " | – |"
            if cuda:
                row += " " + " / ".join(f"{t['peak_mem_mb'][b]:.0f}" for b in sizes) + " |"
            lines.append(row)
        images = {b: next(iter(throughput.values()))["images"][b] for b in sizes}
        lines.append("")
        lines.append("Images per decoder and batch size: " + ", ".join(f"B={b}: {n}" for b, n in images.items())
                     + ". Latency (the table above) is measured at batch 1; throughput is a separate run.")
        paper = (record.get("config") or {}).get("accepted_lengths") or {}
        for name, t in throughput.items():
            taus = t.get("tau") or {}
            if name in paper and taus:
                lines.append(f"{name}: measured τ " + ", ".join(f"B={b}: {taus[b]:.2f}" for b in sizes)
                             + f"; projected img/s at the paper's τ = {paper[name]} (img/s × paper τ ÷ measured τ: "
                             "the same cost per iteration, fewer iterations; the prefill is scaled too, so a slight "
                             "overestimate): " + ", ".join(f"B={b}: {t['img_s'][b] * paper[name] / taus[b]:.2f}"
                                                           for b in sizes) + ".")
    if record["goals"]:
        lines += ["", "## Goals", "", "| goal | value | met |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['value']:.3f} | {'yes' if g['met'] else 'no'} |"
                  for g in record["goals"]]
    if setup["note"]:
        lines += ["", setup["note"]]
    return "\n".join(lines) + "\n"


def call_count_lines(counts: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table of ``decode_counts`` per decoder (one image, batch 1)."""
    if not counts:
        return []
    seed = next(iter(counts.values()))["seed"]
    lines = ["", f"Torch API calls of one decode (batch 1, the first prompt, seed {seed}; ``decode_counts``): per "
             "committed token by phase, per network forward, the loop's calls and the host synchronisations "
             "(`.item()`, `.tolist()`, `bool()` of a tensor, `nonzero`, …) per iteration:", "",
             "| decoder | target / token | drafter / token | loop / token | target / forward | drafter / step | "
             "loop / iteration | syncs / iteration |", "|---|---|---|---|---|---|---|---|"]
    for name, c in counts.items():
        lines.append(f"| {name} | {c['target_per_token']:.1f} | {c['drafter_per_token']:.1f} | "
                     f"{c['loop_per_token']:.1f} | {c['target_per_forward']:.1f} | {c['drafter_per_forward']:.1f} | "
                     f"{c['loop_per_iteration']:.1f} | {c['syncs_per_iteration']:.2f} |")
    return lines


def ar_graph_projection(costs: Costs, ar: DecoderResult, num_tokens: int) -> float | None:
    """AR seconds per image if each 1-token forward were replayed from a CUDA graph and nothing else cost
    more than now: measured prefill + (N − 1) × (graph-replayed forward + pipeline + draw). None without
    graph timings."""
    if 1 not in costs.graph_forward_s:
        return None
    return ar.prefill_s + (num_tokens - 1) * (costs.graph_forward_s[1] + costs.probs_s[1] + costs.sample_s)


def compile_modules(model: ImageARModel, names: list[str], mode: str) -> int:
    """``torch.compile`` every submodule whose class name is in ``names`` (stateless blocks: norms, MLPs);
    returns how many. Modules that touch the KV cache stay eager (their slices change every step)."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compile(mode=mode, dynamic=True)
            count += 1
    if not count:
        raise ValueError(f"compile_modules {list(names)} matched no submodule of {type(model).__name__}")
    return count


#: ``layouts``: the model variants a layout comparison builds: the linear layers' arithmetic
#: (``coolsd.models.base.batch_invariant_linears``): ``column_major`` (the default, ``model.batch_invariant=true``),
#: ``row_block`` (also ``model.row_block=4``: products of whole 4-row blocks), ``row_major`` (PyTorch's layout,
#: ``model.batch_invariant=false``); and ``compiled``: the default with ``model.compile=true`` (the piecewise
#: compiled decode layers, ``coolsd.models.llamagen.compiled_region``)
LAYOUTS = {"column_major": {"batch_invariant": True, "row_block": 1},
           "row_block": {"batch_invariant": True, "row_block": 4},
           "row_major": {"batch_invariant": False, "row_block": 1},
           "compiled": {"batch_invariant": True, "row_block": 1, "compile": True}}


def layout_model(cfg: DictConfig, layout: str) -> ImageARModel:
    """The bench's model built with one of ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layouts: {layout!r} is not one of {list(LAYOUTS)}")
    node = OmegaConf.to_container(cfg.model, resolve=True)
    node.update(LAYOUTS[layout])
    return instantiate(node)


def run_layouts(cfg: DictConfig, model_name: str) -> dict[str, Any]:
    """The cost of a model variant (``LAYOUTS``: batch-invariant arithmetic, the compiled path) at batch 1 and
    batched: every decoder of ``cfg.decoders`` on the model built with each of ``cfg.layouts``, interleaved per
    image (image i with every layout and decoder, then i + 1; seeds ``seed + i``) after ``warmup`` untimed images;
    median latency per (layout, decoder), its ratio to the first layout and the images whose tokens equal the
    first layout's; then, with ``throughput.batch_sizes``, img/s at the largest batch size (``measure_throughput``,
    every (layout, decoder) interleaved batch by batch after one untimed batch each). Writes
    ``<out_dir>/<name>_layouts.{md,json}``."""
    started = dt.datetime.now(dt.timezone.utc)
    layouts = list(cfg.layouts)
    models = {layout: build_decoders(cfg, layout_model(cfg, layout)) for layout in layouts}  # heads follow
    first = next(iter(models.values()))
    prompts = instantiate(cfg.data).load(next(iter(first.values())).model, cfg.images, key="images")
    with torch.inference_mode():
        for decs in models.values():
            for dec in decs.values():
                for w in range(cfg.warmup):
                    dec.generate(prompts[0], WARMUP_SEED - w)
        lat: dict[str, dict[str, list[float]]] = {lay: {n: [] for n in cfg.decoders} for lay in layouts}
        same: dict[str, dict[str, int]] = {lay: {n: 0 for n in cfg.decoders} for lay in layouts}
        for i, prompt in enumerate(prompts):
            for name in cfg.decoders:
                tokens = None
                for layout in layouts:
                    gen = models[layout][name].generate(prompt, cfg.seed + i)
                    lat[layout][name].append(gen.stats.latency_s)
                    tokens = gen.tokens if tokens is None else tokens
                    same[layout][name] += int(torch.equal(gen.tokens, tokens))
        thr: dict[str, dict[str, Any]] = {}
        batch = max(cfg.throughput.batch_sizes or [0])
        if batch:
            pairs = {f"{lay}/{n}": models[lay][n] for lay in layouts for n in cfg.decoders}
            for dec in pairs.values():  # untimed: a compiled region's first batched shapes compile here
                dec.generate_batch([prompts[k % len(prompts)] for k in range(batch)], list(range(batch)))
            thr = measure_throughput(pairs, prompts, OmegaConf.merge(cfg, {"throughput": {"batch_sizes": [batch]}}),
                                     Timer(first[next(iter(first))].model.device))
    base = layouts[0]
    rows = {lay: {n: {"median_latency_s": statistics.median(v), "same_tokens_as_first": same[lay][n]}
                  for n, v in per.items()} for lay, per in lat.items()}
    for lay in layouts:
        for n in cfg.decoders:
            rows[lay][n]["ratio_to_first"] = rows[lay][n]["median_latency_s"] / rows[base][n]["median_latency_s"]
            if thr:
                rows[lay][n]["img_s"] = thr[f"{lay}/{n}"]["img_s"][batch]
    name = (cfg.name or f"{model_name}_cpu") + "_layouts"
    record = {"setup": {"name": name, "model": model_name, "layouts": layouts, "images": cfg.images,
                        "threads": torch.get_num_threads(), "warmup": cfg.warmup, "throughput_batch": batch or None,
                        "throughput_images": int(cfg.throughput.images) if batch else None},
              "layouts": rows, "git": git_commit(), "environment": environment(),
              "started": started.isoformat(timespec="seconds")}
    lines = [f"# Batch-1 latency per linear layout: {model_name}, {cfg.images} images per cell, interleaved",
             "", f"Median latency (ms per image) and its ratio to `{base}`; `same` = images whose tokens equal "
             f"`{base}`'s. {torch.get_num_threads()} threads; {environment().get('processor')}.", "",
             "| decoder | " + " | ".join(f"{lay} ms | ratio | same" + (" | img/s" if thr else "") for lay in layouts)
             + " |", "|---|" + ("---|---|---|" + ("---|" if thr else "")) * len(layouts)]
    for n in cfg.decoders:
        cells = [f"{1000 * rows[lay][n]['median_latency_s']:.1f} | {rows[lay][n]['ratio_to_first']:.3f} | "
                 f"{rows[lay][n]['same_tokens_as_first']}/{cfg.images}"
                 + (f" | {rows[lay][n]['img_s']:.1f}" if thr else "") for lay in layouts]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if thr:
        lines += ["", f"img/s: {cfg.throughput.images} images or more per cell in batches of {batch}, every (layout, "
                      "decoder) interleaved batch by batch after one untimed batch."]
    out_dir = Path(cfg.out_dir)
    atomic_write_bytes(out_dir / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(out_dir / f"{name}.md", ("\n".join(lines) + "\n").encode())
    return record


def run_bench(cfg: DictConfig, model_name: str) -> dict[str, Any]:
    """Build, measure, write ``<out_dir>/<name>.{md,json}`` (``name``: ``cfg.name`` or ``<model>_<device>``,
    as ``record["setup"]["name"]``); returns the JSON record. With ``layouts`` set, only the layout comparison
    (``run_layouts``) runs. The record is first written when the latency part is done (``"complete": false``,
    no throughput yet), so a bench stopped during the throughput run (a GPU lease's limit) keeps its cost model
    and latencies; the end writes it again, complete."""
    started = dt.datetime.now(dt.timezone.utc)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    if cfg.images < 1:
        raise ValueError(f"images must be >= 1, got {cfg.images}")
    paper = dict(cfg.accepted_lengths or {})
    unknown = sorted(set(paper) - set(cfg.suite) - set(cfg.variants or {}))
    if unknown:  # a typo; a known decoder that this run leaves out (decoders=[...]) is skipped
        raise ValueError(f"accepted_lengths names decoders that are neither suite decoders nor variants: "
                         f"{unknown}; suite: {list(cfg.suite)}, variants: {list(cfg.variants or {})}")
    if cfg.get("layouts"):
        return run_layouts(cfg, model_name)
    model: ImageARModel = instantiate(cfg.model)
    if cfg.cuda_graphs and model.device.type != "cuda":
        raise ValueError("cuda_graphs=true needs model.device=cuda")
    if cfg.compile:
        compile_modules(model, list(cfg.compile_modules), cfg.compile_mode)
    paths = list(OmegaConf.select(cfg, "paths", default=["eager"]))
    if not paths or any(p not in ("eager", "static") for p in paths) or len(set(paths)) != len(paths):
        raise ValueError(f"paths must list eager and/or static once each, got {paths}")
    eager = build_decoders(cfg, model) if "eager" in paths else {}
    refused: dict[str, str] = {}
    decoders = {**eager, **(build_decoders(cfg, model, "static", refused) if "static" in paths else {})}
    prompts = instantiate(cfg.data).load(model, cfg.images, key="images")
    timer = Timer(model.device)
    name = cfg.name or f"{model_name}_{model.device.type}"
    setup = {
        "name": name, "model": model_name, "device": str(model.device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "image_tokens": model.num_image_tokens, "streams": model.num_streams, "images": cfg.images,
        "warmup": cfg.warmup, "drafter_weights": cfg.drafter_weights,
        "compile": cfg.compile_mode if cfg.compile else False, "cuda_graphs": cfg.cuda_graphs, "note": cfg.note,
        "paths": paths, "static_steps": next((d.static.mode for d in decoders.values() if d.static), None),
        "static_refused": refused,
    }
    with torch.inference_mode():
        cost = CostModel(cfg, model, eager or decoders, prompts[0], timer)
        progress(f"cost model probes built ({len(cost.probes.fns)})")
        stats = run_interleaved(decoders, prompts, cfg, cost)
        counts = {name: decode_counts(dec, prompts[0], cfg.seed) for name, dec in eager.items()} \
            if cfg.call_counts else {}  # the static path's forwards are not hooked: its steps read nothing
        costs = cost.costs()
        results: dict[str, DecoderResult] = {}
        for label in decoders:  # AR of each path first: the denominator of that path's speedups
            if label == ar_label(label):
                results[label] = summarize(label, stats[label], decoders[label], costs, None, None)
        for label in decoders:
            if label != ar_label(label):
                base = results[ar_label(label)]
                ar = {"latency_s": base.latency_s, "iteration_s": base.iteration_s}
                results[label] = summarize(label, stats[label], decoders[label], costs, ar,
                                           paper.get(label.removesuffix(STATIC)))
        record = {
            "setup": {**setup, "repeats": len(cost.probes.samples["sample"])},
            "complete": False,
            "costs": asdict(costs),
            "call_anatomy": cost.anatomy,
            "call_counts": {label: {**asdict(c), **c.summary()} for label, c in counts.items()},
            "graph_errors": cost.graph_errors,
            "ar_graph_projection_s": ar_graph_projection(costs, results[next(iter(results))],
                                                         model.num_image_tokens),
            "decoders": {k: asdict(v) for k, v in results.items()},
            "per_image": {k: [s.as_dict() for s in v] for k, v in stats.items()},
            "throughput": {},
            "goals": check_goals(cfg, costs, results, {}),
            "config": OmegaConf.to_container(cfg, resolve=True),
            "git": git_commit(),
            "environment": environment(),
            "started": started.isoformat(timespec="seconds"),
        }
        write_bench(cfg, record, costs, results)
        if cfg.throughput.batch_sizes:
            progress(f"latency part written to {Path(cfg.out_dir) / name}.md; throughput next")
            throughput = measure_throughput(throughput_decoders(cfg, decoders), prompts, cfg, timer)
            record.update(throughput=throughput, goals=check_goals(cfg, costs, results, throughput))
    record["complete"] = True
    write_bench(cfg, record, costs, results)
    return record


def write_bench(cfg: DictConfig, record: dict[str, Any], costs: Costs, results: dict[str, DecoderResult]) -> None:
    """``<out_dir>/<name>.{json,md}`` of a bench record, atomically (a reader never sees half a file)."""
    out_dir, name = Path(cfg.out_dir), record["setup"]["name"]
    table = markdown(record, costs, results)
    if not record.get("complete", True):
        table += "\n**Incomplete**: the throughput run had not finished when this was written.\n"
    atomic_write_bytes(out_dir / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(out_dir / f"{name}.md", table.encode())
