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
   forwards from drafter forwards per iteration × the cost model's drafter step + the target's forwards timed
   inside the same decodes (``TargetClock``: each ``forward_block`` call of the timed images, at the blocks the
   loop really verified). It is everything a decoder does outside its networks: sampling, acceptance, masks,
   bookkeeping. A static row (``<name>@static``) has its own cost model (``StaticCostModel``: every probe run as
   the static step runs, compiled whole or captured; ``costs.static`` in the record): its forwards are every
   network of one iteration in one call, its overhead one call of the decoder's own step − those forwards,
   timed back to back in alternating order (``Probes.add_pair``), and its ideal uses the static verify and
   ``static_propose``.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.io import atomic_write_bytes
from coolsd.kv_cache import DeviceKVCache, padding_invariant_attention
from coolsd.models.base import ImageARModel, per_stream, to_rows
from coolsd.rng import Streams
from coolsd.rng import sample as rng_sample
from coolsd.sampling import sample, stream_probs
from coolsd.static.capture import Runner
from coolsd.static.loop import _piecewise_off
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
        #: key -> its partner's key: a pair timed back to back in alternating order (``add_pair``)
        self.partners: dict[str, str] = {}

    def add(self, key: str, fn: Callable[[], Any]) -> None:
        self.fns[key] = fn
        self.samples[key] = []

    def add_pair(self, key: str, fn: Callable[[], Any], partner: str, partner_fn: Callable[[], Any]) -> None:
        """Two probes whose difference is reported: in each round they run back to back, call after call, in
        alternating order (a b, b a, ...), so that sample i of both comes from the same moment and neither holds
        a fixed place in the round (a probe's place in it moved its time by up to 0.9 ms here)."""
        self.add(key, fn)
        self.add(partner, partner_fn)
        self.partners[key] = partner

    def warm_up(self, calls: int) -> None:
        for fn in self.fns.values():
            for _ in range(calls):
                fn()

    def round(self, burst: int) -> None:
        """Every probe: one untimed call (its shapes back in the caches), then ``burst`` timed calls (a pair:
        ``burst`` calls of each, alternating)."""
        paired = set(self.partners.values())
        for key, fn in self.fns.items():
            if key in paired:
                continue
            partner = self.partners.get(key)
            if partner is None:
                fn()
                self.samples[key].extend(self.timer.once(fn) for _ in range(burst))
                continue
            other = self.fns[partner]
            fn()
            other()
            for i in range(burst):
                for k, f in ((key, fn), (partner, other))[::1 if i % 2 == 0 else -1]:
                    self.samples[k].append(self.timer.once(f))

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


# -- the static path's cost model --------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticBlockCost:
    """The static step's target forward over one verify block (``forward_s``): ``model.static_forward`` over a
    ``DeviceKVCache`` of ``slots`` key slots (the whole capacity is attended, under the mask the step builds from
    positions), ``tokens`` = T in a chain (causal) or under ``tree``'s ancestor mask; and ``verify_s``, the same
    forward, the ``p`` pipeline over its T rows and one draw in one call (c_v(T), as the step runs them)."""

    tokens: int
    tree: str | None
    slots: int
    forward_s: float
    verify_s: float


@dataclass(frozen=True)
class StaticDrafterCost:
    """A drafter network on the static path, at the fixed shape its step drafts every iteration (``depth`` = L
    levels, whatever fits in the image): ``feed_s`` the network over the pending block (an EAGLE drafter's
    L + 1 pairs, a draft model's W tokens: 2 for a chain, L + 1 for a tree; each image's own count),
    ``step_s`` the network over one pair or token (head included), ``pipeline_s`` one row's ``q`` pipeline +
    draw, and ``propose_s`` the whole drafting of one iteration as the step runs it
    (``Drafter.static_propose``: the feed, L − 1 steps or a tree's level expansions, their pipelines and
    draws)."""

    kind: str
    depth: int
    feed_s: float
    step_s: float
    pipeline_s: float
    propose_s: float

    @property
    def separate_s(self) -> float:
        """The drafter network forwards of one iteration as separate calls: the feed and L − 1 one-pair (or
        one-token) steps (a tree's level expansions are costed as one-pair steps, as on the eager path)."""
        return self.feed_s + max(self.depth - 1, 0) * self.step_s


@dataclass(frozen=True)
class StaticCosts:
    """The static path's cost model (seconds), every probe run as the static step runs (``mode``: eager,
    ``compiled`` whole with ``torch.compile(fullgraph=True, dynamic=False)``, or replayed from a CUDA
    ``graph``; ``coolsd.static.capture.Runner``). ``blocks`` and ``drafters`` are keyed by
    ``static_block_key`` and ``static_drafter_key``; ``networks_s`` by ``"<drafter key>; <block key>"``: every
    network forward of one iteration of a drafter-based step (the drafter's feed, its L − 1 steps or a draft
    model's tree expansions, the target's forward over the block) in one call, the decomposition of a static
    row's iteration (a step without a drafter network has only the block's forward)."""

    mode: str
    context: int
    blocks: dict[str, StaticBlockCost]
    drafters: dict[str, StaticDrafterCost]
    networks_s: dict[str, float]
    ar_block: str  # the block of ar@static: c_1 of the static rows
    #: per static decoder label: one call of its own compiled step (per AR step), in the same rounds
    step_s: dict[str, float]
    #: per static decoder label: a 95 % interval of step − forwards (paired bootstrap over the probes' samples)
    overhead_ci_s: dict[str, tuple[float, float]]
    #: per static decoder label: its forwards (``forwards``) timed back to back with its step, alternating
    #: (``Probes.add_pair``): the forwards its overhead subtracts
    step_forwards_s: dict[str, float] = field(default_factory=dict)

    def verify(self, key: str) -> float:
        """``c_v(T)`` on the static path: the static forward over the block, its pipeline and one draw."""
        return self.blocks[key].verify_s

    def forwards(self, decoder: Decoder) -> float:
        """The network forwards of one iteration of a static decoder, measured in one call."""
        key = static_block_key(decoder)
        return self.networks_s.get(f"{static_drafter_key(decoder)}; {key}", self.blocks[key].forward_s)


def static_block_key(decoder: Decoder) -> str:
    """The static cost entry of a decoder's verify block: its shape and the key slots of its cache (the static
    loop prefills with ``max_nodes + 1`` extra slots and attends to all of them)."""
    block = verify_block(decoder)
    shape = f"tree {block.tree} (T={block.tokens})" if block.tree else f"chain T={block.tokens}"
    return f"{shape}, +{decoder.max_nodes + 1} slots"


def static_drafter_key(decoder: Decoder) -> str:
    """Decoders whose drafters run the same network at the same depth, in the same tree (or chain), share one
    static drafter entry."""
    tree = decoder.static.tree
    shape = "" if tree is None else f" ({tree.name})" if isinstance(tree, TreeShape) else \
        f" (dynamic, top_k={tree.top_k}, {tree.total_tokens} nodes)"
    return f"{drafter_key(decoder)}, L={decoder.static.depth}{shape}"


def static_call(fn: Callable[[], tuple[torch.Tensor, ...]], mode: str, model: ImageARModel,
                invariant: bool) -> Callable[[], None]:
    """``fn`` run as the static loop runs its step: through a ``Runner`` in ``mode`` (its first call eager, then
    compiled whole or captured), inside the target's decode context and, for the speculative steps, padding-
    invariant attention (``StaticLoop.generate_batch``). Like a step, which writes what it needs into its
    workspace and returns nothing, the call keeps only a sum over the last axis of each tensor ``fn`` returns, in
    buffers of its own (allocated by the first, eager call): enough that the compiler keeps the work that makes
    them, without materialising outputs the step never writes out. A compiled forward that returned its
    ``TargetOutput`` measured slower than the same forward followed by its pipeline and a draw, and one that
    copied its logits and hidden states out still did at T = 1 (0.15–0.5 ms, in four runs)."""
    sinks: list[torch.Tensor] = []

    def sunk() -> None:
        outs = [out.sum(-1) for out in fn()]
        if not sinks:
            sinks.extend(torch.empty_like(out) for out in outs)
        for sink, out in zip(sinks, outs):
            sink.copy_(out)

    runner = Runner(sunk, mode)

    def call() -> None:
        with model.decode_context(), padding_invariant_attention(invariant):
            runner()

    call.runner = runner  # type: ignore[attr-defined]
    return call


def commit_context(model: ImageARModel, cache: DeviceKVCache, context: int) -> None:
    """``context`` random image tokens committed to a batch-1 static ``cache`` as AR commits them: one
    ``static_forward`` of one token and a ``keep`` each (a static cache with structural slots, Lumina-mGPT's
    ``RowEndKVCache``, places them as a step does)."""
    one = torch.ones(1, dtype=torch.long, device=model.device)
    with model.decode_context():
        for i, token in enumerate(torch.randint(model.codebook_size, (context,), device=model.device)):
            model.static_forward(cache, token.view(1, 1), torch.full((1, 1), i, device=model.device))
            cache.keep(one)


class StaticForwardProbe:
    """A static cache as the static loop has it (the model's ``static_cache`` over its ``static_prefill`` with
    ``extra_slots``, sized for a block of ``levels``), holding the prompt and ``context`` image tokens; each call
    rewinds its lengths and forwards one more block with ``model.static_forward`` (the mask over the whole capacity,
    built on the device from positions)."""

    def __init__(self, model: ImageARModel, prompt: str, context: int, extra_slots: int,
                 levels: tuple[int, ...] | None = None) -> None:
        self.model = model
        with _piecewise_off(model):
            prefilled, _ = model.static_prefill([prompt], extra_slots=extra_slots)
        self.cache = model.static_cache(prefilled, levels)
        commit_context(model, self.cache, context)
        self.base = self.cache.lengths.clone()
        self.context = context

    def block(self, tokens: int, tree: TreeShape | None) -> Callable[[], Any]:
        """A function forwarding ``tokens`` random tokens after the context, at the positions the static step gives
        them (a chain: consecutive; a tree: by depth, under its ancestor mask), clamped to the grid."""
        model, last = self.model, self.model.num_image_tokens - 1
        device = model.device
        x = torch.randint(model.codebook_size, (1, tokens), device=device)
        if tree is None:
            positions, mask = torch.arange(self.context, self.context + tokens, device=device), None
        else:
            parents = tree.parents()
            positions = self.context + torch.tensor([0] + depths_of(parents), device=device)
            mask = ancestor_mask(parents).to(device)
        positions = positions.clamp(max=last)[None]
        cache, base = self.cache, self.base

        def run():
            cache.lengths.copy_(base)
            return model.static_forward(cache, x, positions, mask)

        return run


def bound_probes(bind: Callable[[], None], fns: dict[str, Callable[[], Any]], logits: torch.Tensor,
                 model: ImageARModel, u: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """A drafter's static probes: each of ``fns`` first points the drafter at the probes' own state (``bind``), and
    ``pipeline`` is one row's ``q`` pipeline and one draw over ``logits`` (a step's)."""
    def bound(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call():
            bind()
            return fn()
        return call

    def pipeline():
        return (rng_sample(stream_probs(logits, model.sampling)[:, -1], u),)

    return {**{name: bound(fn) for name, fn in fns.items()}, "pipeline": pipeline}


def static_drafter_probes(decoder: Decoder, prompt: str, context: int, seed: int,
                          target: Callable[[], Any]) -> dict[str, Callable[[], Any]] | None:
    """The static path's drafter probes of an EAGLE drafter (``feed``, ``step``, ``pipeline``, ``propose``:
    ``StaticDrafterCost``) and ``networks`` (the feed, L − 1 steps and ``target``, the static target forward
    over the verify block, in one function: the networks of one iteration, compiled as one graph like the
    step) over its own batch-1 static state (``Drafter.static_begin`` with the decoder's depth and room)
    holding ``context`` pairs; a draft model's (``ModelDrafter``) are ``static_model_drafter_probes``; None
    for drafters without a network (Jacobi windows: cost 0). Each function first points the drafter at that
    state (the decoders sharing the drafter repoint it at theirs in every ``static_begin``) and rewinds the
    drafter cache."""
    drafter, loop, model = decoder.drafter, decoder.static, decoder.model
    if isinstance(drafter, ModelDrafter):
        return static_model_drafter_probes(decoder, prompt, context, seed, target)
    if not isinstance(drafter, EagleDrafter):
        return None
    device, depth = model.device, loop.depth
    streams = Streams.persistent_for(1, device)
    streams.reseed([seed])
    with _piecewise_off(model):
        _, out = model.prefill([prompt], extra_slots=decoder.max_nodes + 1, streams=streams)
    first = torch.zeros(1, dtype=torch.long, device=device)
    with model.decode_context():
        drafter.static_begin(out, first, streams, depth, room=loop.drafter_room)
    state, s = drafter.static, model.num_streams
    pairs = max(context, 1)
    if pairs > 1:  # the committed pairs of the context (pair positions −1 .. pairs − 2), as decoding leaves them
        features = out.hidden[:, :, -1:].expand(-1, -1, pairs - 1, -1).contiguous()  # (S, 1, pairs − 1, H)
        tokens = torch.randint(model.codebook_size, (1, pairs - 1), device=device)
        with model.decode_context():
            drafter.step_in_context(features, tokens, torch.arange(-1, pairs - 2, device=device)[None])
        state.cache.keep(pairs - 1)
    width = state.tokens.shape[1]  # L + 1: the pending block's fixed width
    state.features.copy_(out.hidden[:, :, -1:].expand(-1, -1, width, -1))
    state.tokens.random_(model.codebook_size)
    state.count.fill_(width)  # a fully accepted iteration's pending pairs (the feed's cost does not depend on it)
    state.start.fill_(pairs - 2)
    base = state.cache.lengths.clone()
    head, cache = drafter.head, state.cache
    t = torch.full((1,), pairs + 1, dtype=torch.long, device=device)  # the loop's t after the pending block
    limit = torch.full((1,), depth, dtype=torch.long, device=device)
    last = state.tokens[:, -1]
    constants: dict = {}
    rows_1 = to_rows(state.features[:, :, :1])  # (S, 1, H): one pair's feature as cache rows
    token_1 = state.tokens[:, :1]
    position_1 = (state.start + state.count)[:, None]
    feed_positions = state.start[:, None] + state.columns
    u = torch.rand(1, generator=torch.Generator(device=device).manual_seed(seed), device=device)

    def bind() -> None:
        drafter.static, drafter.cache, drafter.streams, drafter.device = state, cache, streams, device

    def network(rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, rewind: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``EagleDrafter.step_in_context`` without its ``q`` pipeline: the block's mask, the head, the logits of its
        last row; returns them and the last row's predicted feature as cache rows (what the next step feeds)."""
        if rewind:
            cache.lengths.copy_(base)
        mask = cache.begin_block(tokens.shape[1])
        out = head(rows, tokens, positions, cache, mask)  # (S, T, H) cache rows of the one image
        return head.logits(per_stream(out[:, -1:], s)), out[:, -1:]

    def feed():
        return network(to_rows(state.features), state.tokens, feed_positions)

    def step():
        return network(rows_1, token_1, position_1)

    def networks():
        logits, rows = network(to_rows(state.features), state.tokens, feed_positions)
        for i in range(depth - 1):
            logits, rows = network(rows, token_1, position_1 + i, rewind=False)
        out = target()
        return logits, out.logits, out.hidden

    logits = step()[0]

    def propose():
        cache.lengths.copy_(base)
        draft = drafter.static_propose(last, t, limit, depth, loop.tree, cache=constants)
        return draft.tokens, draft.q

    return bound_probes(bind, {"feed": feed, "step": step, "propose": propose, "networks": networks}, logits,
                        model, u)


def static_model_drafter_probes(decoder: Decoder, prompt: str, context: int, seed: int,
                                target: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """``static_drafter_probes`` of a draft model (``ModelDrafter``): ``feed`` the draft model's
    ``static_forward`` over the fixed pending block (W tokens, ``ModelDrafter.static_width``: 2 for a chain,
    L + 1 for a tree), ``step`` its static forward over one token, ``pipeline`` one row's ``q`` pipeline +
    draw, ``propose`` one ``static_propose`` of the decoder's depth and tree (c_d), and ``networks`` the draft
    model's forwards of one iteration (the feed, then a chain's L − 1 one-token forwards or a tree's level
    expansions, the requests of one ``static_propose`` recorded and replayed) and ``target``, in one function.
    They run over the drafter's own batch-1 static state (``static_prefill`` and ``static_begin``), holding
    the prompt and ``context`` committed tokens, kept out of the drafter's states of a batch size (no
    decoder's ``static_begin`` takes it up); the drafter's attributes are put back afterwards, and each
    function first points the drafter at that state and rewinds its cache."""
    drafter, loop, model = decoder.drafter, decoder.static, decoder.model
    draft_model, device, depth, tree = drafter.model, model.device, loop.depth, loop.tree
    saved = dict(vars(drafter))
    drafter._static = {}  # a state of its own, whatever the decoders of this batch size hold
    streams = Streams.persistent_for(1, device)
    streams.reseed([seed])
    drafter.static_prefill([prompt], depth, tree)
    first = torch.zeros(1, dtype=torch.long, device=device)
    with model.decode_context():
        drafter.static_begin(None, first, streams, depth, room=loop.drafter_room)
    state = drafter.static
    cache, width = state.cache, state.tokens.shape[1]
    with padding_invariant_attention(model.batch_invariant):  # the context's committed tokens, in its own cache
        commit_context(draft_model, cache, context)
    state.tokens.random_(model.codebook_size)
    state.count.fill_(width)  # a fully accepted iteration's pending tokens (the feed's cost is the same)
    state.start.fill_(context)
    base = cache.lengths.clone()
    t = torch.full((1,), context + width, dtype=torch.long, device=device)  # the loop's t after the pending
    limit = torch.full((1,), depth, dtype=torch.long, device=device)
    last, token_1 = state.tokens[:, -1], state.tokens[:, -1:]
    feed_positions = drafter._clamp(state.start[:, None] + state.columns)
    step_positions = [drafter._clamp(t - 1 + i)[:, None] for i in range(1, max(depth, 2))]  # a chain's drafts
    u = torch.rand(1, generator=torch.Generator(device=device).manual_seed(seed), device=device)
    constants: dict = {}

    def bind() -> None:
        drafter.static, drafter.cache, drafter.streams, drafter.device = state, cache, streams, device

    def feed():
        cache.lengths.copy_(base)
        return (draft_model.static_forward(cache, state.tokens, feed_positions).logits,)

    def step():
        cache.lengths.copy_(base)
        return (draft_model.static_forward(cache, token_1, step_positions[0]).logits,)

    def propose():
        cache.lengths.copy_(base)
        draft = drafter.static_propose(last, t, limit, depth, tree, cache=constants)
        return draft.tokens, draft.q

    # a tree's level expansions (tokens, positions, mask), recorded from one eager static_propose of its own
    expansions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    if tree is not None:
        expand = drafter._static_expand

        def record(request):
            if not request.root:
                mask = request.mask.clone() if request.mask is not None else None
                expansions.append((request.tokens.clone(), drafter._clamp(request.positions).clone(), mask))
            return expand(request)

        bind()
        drafter._static_expand = record
        try:
            with model.decode_context(), padding_invariant_attention(model.batch_invariant):
                cache.lengths.copy_(base)
                drafter.static_propose(last, t, limit, depth, tree, cache={})
        finally:
            del drafter._static_expand

    def networks():
        logits = feed()[0]
        if tree is None:
            for positions in step_positions[: depth - 1]:
                logits = draft_model.static_forward(cache, token_1, positions).logits
        for tokens, positions, mask in expansions:
            logits = draft_model.static_forward(cache, tokens, positions, mask).logits
        out = target()
        return logits, out.logits, out.hidden

    with model.decode_context(), padding_invariant_attention(model.batch_invariant):
        logits = step()[0]
    vars(drafter).update(saved)

    return bound_probes(bind, {"feed": feed, "step": step, "propose": propose, "networks": networks}, logits,
                        model, u)


def paired_interval(step: list[float], forwards: list[float], per_call: int = 1, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A 95 % interval of median(step) / per_call − median(forwards): a bootstrap over the paired samples
    (sample i of both probes comes from back-to-back calls, ``Probes.add_pair``), so the interval holds what the machine's drift and noise
    leave of a difference of two probes."""
    import random

    pairs = list(zip(step, forwards))
    rng, med = random.Random(seed), statistics.median
    diffs = sorted(med(a for a, _ in draw) / per_call - med(b for _, b in draw)
                   for draw in ([rng.choice(pairs) for _ in pairs] for _ in range(resamples)))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


class StaticCostModel:
    """The probes of the static path's cost model (``StaticCosts``) for the static decoders of a run, in the
    rounds of the eager cost model's ``Probes``: per distinct verify block (``static_block_key``) the static
    forward and the verify (forward, ``p`` pipeline over its rows and one draw), per drafter and depth
    (``static_drafter_key``) its four probes, and per (drafter, block) pair the networks of one iteration; every
    probe runs as the static step runs (``static_call``: compiled whole on a CPU with ``model.compile``, captured in
    a CUDA graph on a GPU)."""

    def __init__(self, decoders: dict[str, Decoder], model: ImageARModel, prompt: str, context: int, seed: int,
                 probes: Probes) -> None:
        self.probes, self.context = probes, context
        self.mode = next(d.static.mode for d in decoders.values())
        self.ar_block = ""
        self.block_probes: dict[str, tuple[int, str | None, int]] = {}
        self.drafter_depths: dict[str, int | None] = {}
        self.network_keys: list[str] = []
        self.steps: dict[str, int] = {}  # label -> steps per runner call (add_step)
        self.model = model
        caches: dict[tuple, StaticForwardProbe] = {}
        runs: dict[str, Callable[[], Any]] = {}
        gen = torch.Generator(device=model.device).manual_seed(seed)
        for dec in decoders.values():
            key, block, plain = static_block_key(dec), verify_block(dec), dec.plain_ar
            invariant = model.batch_invariant and not plain  # as StaticLoop.generate_batch
            if plain:
                self.ar_block = key
            if key not in self.block_probes:
                slots, levels = dec.max_nodes + 1, dec.static.levels
                target = caches.get((slots, levels)) or caches.setdefault(
                    (slots, levels), StaticForwardProbe(model, prompt, context, slots, levels))
                run = runs[key] = target.block(block.tokens, TreeShape.load(block.tree) if block.tree else None)
                u = torch.rand(1, generator=gen, device=model.device)

                def forward(run=run):
                    out = run()
                    return out.logits, out.hidden

                def verify(run=run, u=u):  # the p pipeline over every row of the block, one draw
                    p = model.probs(run())
                    return p, rng_sample(p[:, -1], u)

                self.block_probes[key] = (block.tokens, block.tree, int(target.cache.max_len))
                probes.add(f"static/forward/{key}", static_call(forward, self.mode, model, invariant))
                probes.add(f"static/verify/{key}", static_call(verify, self.mode, model, invariant))
            dkey = static_drafter_key(dec)
            fns = None if plain else static_drafter_probes(dec, prompt, context, seed, runs[key])
            if dkey not in self.drafter_depths:
                self.drafter_depths[dkey] = None if fns is None else dec.static.depth
                for name in ("feed", "step", "pipeline", "propose"):
                    if fns:
                        probes.add(f"static/drafter_{name}/{dkey}", static_call(fns[name], self.mode, model, invariant))
            if fns and f"{dkey}; {key}" not in self.network_keys:
                self.network_keys.append(f"{dkey}; {key}")
                probes.add(f"static/networks/{dkey}; {key}", static_call(fns["networks"], self.mode, model, invariant))

        self._transition(probes)

    @staticmethod
    def _transition(probes: Probes) -> None:
        """Put a throwaway call of the first static probe's function (``static/transition``, never reported) before
        the static probes of every round: the first compiled probe after the eager ones measured 0.5–0.9 ms slower
        than it does after another compiled probe, whichever function came first (the T = 1 forward, or the verify
        when it went first), a switch from eager to compiled work that a single untimed call did not absorb."""
        keys = list(probes.fns)
        first = next((i for i, k in enumerate(keys) if k.startswith("static/")), None)
        if first is None:
            return
        fns = list(probes.fns.items())
        probes.fns = dict(fns[:first] + [("static/transition", fns[first][1])] + fns[first:])
        probes.samples["static/transition"] = []

    def costs(self) -> StaticCosts:
        med = self.probes.median
        blocks = {key: StaticBlockCost(tokens, tree, slots, med(f"static/forward/{key}"), med(f"static/verify/{key}"))
                  for key, (tokens, tree, slots) in self.block_probes.items()}
        drafters = {key: StaticDrafterCost(key, depth, *(med(f"static/drafter_{n}/{key}")
                                                         for n in ("feed", "step", "pipeline", "propose")))
                    if depth is not None else StaticDrafterCost(key, 0, 0.0, 0.0, 0.0, 0.0)
                    for key, depth in self.drafter_depths.items()}
        return StaticCosts(mode=self.mode, context=self.context, blocks=blocks, drafters=drafters,
                           networks_s={key: med(f"static/networks/{key}") for key in self.network_keys},
                           ar_block=self.ar_block,
                           step_s={label: med(f"static/step/{label}") / n for label, n in self.steps.items()},
                           overhead_ci_s={label: paired_interval(self.probes.samples[f"static/step/{label}"],
                                                                 self.probes.samples[f"static/step_forwards/{label}"],
                                                                 self.steps[label])
                                          for label in self.steps},
                           step_forwards_s={label: med(f"static/step_forwards/{label}") for label in self.steps})

    def add_step(self, label: str, decoder: Decoder, prompt: str, warmup: int) -> None:
        """After the decoder's warm-up images: its own step (the ``Runner`` over its batch-1 workspace, compiled or
        captured as the decode runs it) as the probe ``static/step/<label>``. The workspace's images have finished,
        so a call does the same fixed-shape work as an iteration and commits nothing. The drafter's attributes as
        the decoder's last image left them (its streams, its state) are restored before each call: decoders
        sharing a drafter, and the drafter probes, point it at theirs."""
        loop, model = decoder.static, self.model
        if 1 not in loop._workspaces:  # no warm-up image: one untimed image builds the workspace
            decoder.generate(prompt, WARMUP_SEED)
        runner = loop._workspaces[1][1]
        drafter, invariant = decoder.drafter, model.batch_invariant and not decoder.plain_ar
        state = dict(vars(drafter))

        def step() -> None:
            vars(drafter).update(state)
            with model.decode_context(), padding_invariant_attention(invariant):
                runner()

        self.steps[label] = loop.ar_steps if decoder.plain_ar else 1
        networks = f"{static_drafter_key(decoder)}; {static_block_key(decoder)}"
        forwards = self.probes.fns[f"static/networks/{networks}" if networks in self.network_keys else
                                   f"static/forward/{static_block_key(decoder)}"]
        self.probes.add_pair(f"static/step/{label}", step, f"static/step_forwards/{label}", forwards)
        for _ in range(warmup):
            step()

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
class TargetClock:
    """Seconds the target spends in ``forward_block`` during an eager decode (CUDA-synchronised around each call on
    a GPU, where the eager loop already synchronises its phases): the eager rows' target forwards as the loop
    runs them, at the blocks it really verifies (shorter near an image's end) and in the conditions of the decode,
    so that the overhead, iteration − forwards, is a difference of two times of the same iterations."""

    def __init__(self, model: ImageARModel, timer: Timer) -> None:
        self.model, self.seconds = model, 0.0
        inner = model.forward_block

        def timed(*args: Any, **kwargs: Any) -> Any:
            timer.sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            timer.sync()
            self.seconds += time.perf_counter() - start
            return out

        self._timed = timed

    def generate(self, decoder: Decoder, prompt: str, seed: int) -> tuple[Any, float]:
        """``decoder.generate`` with the target's forwards timed: (its statistics, seconds in them)."""
        self.seconds = 0.0
        self.model.forward_block = self._timed  # an instance attribute over the method, removed after
        try:
            stats = decoder.generate(prompt, seed).stats
        finally:
            del self.model.forward_block
        return stats, self.seconds


def run_interleaved(decoders: dict[str, Decoder], prompts: list[str], cfg: DictConfig, cost: CostModel,
                    static_cost: StaticCostModel | None = None) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Per-image ``DecodeStats`` of every decoder (image i with every decoder, then image i + 1), with the
    cost-model rounds spread in between, and per eager decoder the seconds of each image in the target's forwards
    (``TargetClock``); warm-up first (a static decoder's step joins the probes after its warm-up images:
    ``StaticCostModel.add_step``)."""
    cost.probes.warm_up(cfg.cost.warmup)
    for label, dec in decoders.items():
        for w in range(cfg.warmup):
            dec.generate(prompts[0], WARMUP_SEED - w)
        if static_cost is not None and path_of(label) == "static":
            static_cost.add_step(label, dec, prompts[0], cfg.cost.warmup)
    if cfg.cost.burst < 1 or cfg.cost.repeats < 1:
        raise ValueError(f"cost.burst and cost.repeats must be >= 1, got {cfg.cost.burst}, "
                         f"{cfg.cost.repeats}")
    rounds = -(-cfg.cost.repeats // (cfg.cost.burst * len(prompts)))  # per image, rounded up
    stats: dict[str, list] = {name: [] for name in decoders}
    clock = TargetClock(next(iter(decoders.values())).model, cost.probes.timer)
    target: dict[str, list[float]] = {name: [] for name in decoders if path_of(name) == "eager"}
    for i, prompt in enumerate(prompts):
        for _ in range(rounds):
            cost.probes.round(cfg.cost.burst)
        for name, dec in decoders.items():
            if path_of(name) == "eager":  # the static step's forwards are inside one compiled call: probes only
                image, seconds = clock.generate(dec, prompt, cfg.seed + i)
                stats[name].append(image)
                target[name].append(seconds)
            else:
                stats[name].append(dec.generate(prompt, cfg.seed + i).stats)
            progress(f"image {i + 1}/{len(prompts)} {name}: {stats[name][-1].latency_s:.3f} s, "
                     f"{stats[name][-1].iterations} iterations")
    return stats, target


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
    cost_path: str = "eager"  # whose cost model gave forwards, overhead and ideal: eager, or static (its mode)
    #: a static row: one call of its own step in the cost model's rounds (the overhead's iteration: step − forwards)
    step_s: float | None = None
    overhead_ci_s: tuple[float, float] | None = None  # a static row: 95 % interval of its overhead (paired_interval)


def ideal_speedup(tau: float, c_1: float, c_d: float, c_v: float) -> float:
    """``τ · c_1 / (c_d + c_v(T))``: the speedup if nothing but the forwards and sampling cost time."""
    return tau * c_1 / (c_d + c_v)


def summarize(name: str, stats: list, decoder: Decoder, costs: Costs, ar: dict[str, float] | None,
              paper_tau: float | None, static: StaticCosts | None = None,
              target_s: list[float] | None = None) -> DecoderResult:
    """Medians over images, the cost-model ideal and the efficiency of one decoder: a static row (``@static``)
    with the static path's costs (``static``), every other with the eager path's (``costs``). ``target_s``: an
    eager row's seconds per image in the target's forwards (``TargetClock``), which then replace the cost model's
    target forward in its forwards and overhead (its ideal keeps the cost model)."""
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
    if static is not None and path_of(name) == "static":
        # the static step's networks (the drafter's feed + L − 1 steps or a draft model's tree expansions,
        # every iteration, and the target's static forward over the whole cache) measured in one call; c_d one
        # static_propose, c_v and c_1 one verify each
        key, sdc = static_block_key(decoder), static.drafters[static_drafter_key(decoder)]
        forwards = static.step_forwards_s.get(name, static.forwards(decoder))
        c_1, c_d, c_v = static.verify(static.ar_block), sdc.propose_s, static.verify(key)
        cost_path = f"static ({static.mode})"
        step, interval = static.step_s.get(name), static.overhead_ci_s.get(name)
    else:
        step, interval = None, None
        target = costs.target_forward(block.tokens, block.tree) if not target_s else \
            med([x / k for x, k in zip(target_s, iterations)])
        forwards = d_fwd * dcost.step_s + target
        c_1, c_v = costs.verify(1, None), costs.verify(block.tokens, block.tree)
        c_d = d_fwd * (dcost.step_s + dcost.pipeline_s)
        cost_path = "eager"
    ideal = ideal_speedup(tau, c_1, c_d, c_v)
    whole = step if step is not None else iteration  # what the overhead is a part of
    latency = med([s.latency_s for s in stats])
    measured = ar["latency_s"] / latency if ar else 1.0
    projected = tau * ar["iteration_s"] / iteration if ar else 1.0
    basis = "measured" if paper_tau is None else "projected"
    return DecoderResult(
        name=name, verify_tokens=block.tokens, tree=block.tree, drafter=dkey, images=len(stats),
        latency_s=latency, prefill_s=med([s.prefill_s for s in stats]), accepted_length=tau_measured, tau=tau,
        tau_source="measured" if paper_tau is None else "paper", iterations=med(iterations),
        drafter_forwards_per_iter=d_fwd, phase_s=phases, iteration_s=iteration, forwards_s=forwards,
        overhead_s=whole - forwards, overhead_frac=(whole - forwards) / whole,
        ideal_speedup=ideal, measured_speedup=measured, projected_speedup=projected,
        efficiency=(measured if paper_tau is None else projected) / ideal, efficiency_basis=basis,
        cost_path=cost_path, step_s=step, overhead_ci_s=interval,
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
        f"Drafter weights: {setup['drafter_weights']}; compile: {setup['compile']}"
        + (f"; model.compile: {setup['model_compile']}" if "model_compile" in setup else "") + "; "
        f"{setup['images']} images per decoder after {setup['warmup']} warm-up, interleaved; medians."
        + (f" Command: `{setup['command']}`." if setup.get("command") else ""),
        "",
        f"## Cost model, eager path (ms; context {costs.context} image tokens; median of {setup['repeats']})",
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
    lines += static_cost_lines(record["costs"].get("static"), setup["repeats"])
    lines += [
        "",
        "## Decoders",
        "",
        ("ideal speedup = τ·c_1 / (c_d + c_v(T)); efficiency = measured speedup ÷ ideal (τ measured) or "
         "projected speedup τ·t_AR/t_iter ÷ ideal (τ from the paper: random weights). Times per iteration "
         "in ms; overhead = iteration − network forwards (drafter steps + target forward over T). A decoder "
         f"ending in {STATIC} ran on the static path (decoder.path=static, steps: {setup.get('static_steps')}): "
         f"its speedup is over ar{STATIC}, and its phases are not timed there (–). Column `costs` says whose cost "
         "model gave a row's forwards, overhead and ideal: an eager row the eager path's (forwards = drafter "
         "forwards per iteration × drafter step + the target's forwards timed inside the row's own decodes, at the "
         "blocks it verified; overhead = iteration − forwards; the ideal from the cost model); a static row the "
         "static path's (the section above: forwards = every network of one iteration in one call, the drafter's "
         "feed + (L − 1) steps or a draft model's tree expansions, which the fixed-shape step runs every "
         "iteration, and the static target forward; "
         "c_d = one static_propose, c_1 and c_v(T) one verify each), and its overhead = step − forwards, where "
         "step is one call of the decoder's own compiled or captured step (its workspace's images finished: the "
         "same fixed-shape work, nothing committed), timed back to back with one call of those forwards, in "
         "alternating order, in every round (the row's forwards column is that probe's median), so both sides of "
         "the difference are measured alike, with a 95 % interval in brackets (a paired bootstrap over the "
         "calls); iteration is the decode's own, for comparison.")
        + "".join(f" Not on the static path: {k} ({v})." for k, v in (setup.get("static_refused") or {}).items()),
        "",
        ("| decoder | T | τ | τ source | latency s/img | speedup | ideal | efficiency | drafter fwd/iter | "
         "iteration | step | draft | verify | accept | observe | forwards | overhead | costs |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        t = f"{r.verify_tokens}" + (f" ({r.tree})" if r.tree else "")
        projected = f" (proj. {r.projected_speedup:.2f}x)" if r.tau_source == "paper" else ""
        speed = f"{r.measured_speedup:.2f}x{projected}"
        lines.append(
            f"| {r.name} | {t} | {r.tau:.2f} | {r.tau_source} | {r.latency_s:.3f} | {speed} | "
            f"{r.ideal_speedup:.2f}x | {r.efficiency:.2f} | {r.drafter_forwards_per_iter:.2f} | "
            f"{ms(r.iteration_s)} | {ms(r.step_s)} | "
            + " | ".join(ms(None if path_of(r.name) == "static" else r.phase_s[p])
                         for p in ("draft", "verify", "accept", "observe")) + " | "
            f"{ms(r.forwards_s)} | "
            f"{ms(r.overhead_s)} ({r.overhead_frac:.0%}){interval_text(r)} | {r.cost_path} |")
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


def interval_text(r: DecoderResult) -> str:
    """`` [lo, hi]`` (ms): a static row's 95 % interval of its overhead, or nothing."""
    if r.overhead_ci_s is None:
        return ""
    return f" [{ms(r.overhead_ci_s[0])}, {ms(r.overhead_ci_s[1])}]"


def static_cost_lines(static: dict[str, Any] | None, repeats: int) -> list[str]:
    """The markdown of the static path's cost model (``StaticCosts`` as its JSON record), or nothing."""
    if not static:
        return []
    blocks = static["blocks"]
    f1 = blocks[static["ar_block"]]["forward_s"]
    lines = ["", f"## Cost model, static path (ms; steps: {static['mode']}; context {static['context']} image tokens; "
             f"median of {repeats})", "",
             ("Every probe runs as the static step runs (`coolsd.static.capture.Runner`: compiled whole with "
              "`torch.compile(fullgraph=True, dynamic=False)` on a CPU with model.compile=true, captured in a CUDA "
              "graph on a GPU, else eager), each probe one call: the target's `static_forward` over a `DeviceKVCache` "
              "of the decoder's capacity, attending to every key slot under the mask built from positions (a static "
              "tree: its ancestor mask); the verify (that forward, the p pipeline over its T rows and one draw: c_v(T)); "
              "the drafter's network over the pending block (feed: an EAGLE head over L + 1 pairs; a "
              "draft model, ModelDrafter, its `static_forward` over its 2 pending tokens for a chain, L + 1 "
              "for a tree) and over one pair or token (step), one row's q pipeline + draw, and the whole "
              "drafting of one iteration (`static_propose`: c_d); and every network of one drafter-based "
              "iteration in one call (feed, L − 1 steps or a draft model's tree expansions, target forward), "
              "which a static row's overhead subtracts."),
             "", "| block | key slots | static forward | × ar@static's | verify (forward + pipeline + draw) |",
             "|---|---|---|---|---|"]
    lines += [f"| {key} | {b['slots']} | {ms(b['forward_s'])} | {b['forward_s'] / f1:.2f} | {ms(b['verify_s'])} |"
              for key, b in blocks.items()]
    lines += ["", f"AR cost per token on this path c_1 = {ms(blocks[static['ar_block']]['verify_s'])} ms.", "",
              "| drafter | feed (pending block) | step (1 pair or token) | q pipeline + draw | feed + "
              "(L − 1) steps, separately | drafting / iteration (static_propose) |",
              "|---|---|---|---|---|---|"]
    for key, d in static["drafters"].items():
        separate = d["feed_s"] + max(d["depth"] - 1, 0) * d["step_s"]
        lines.append(f"| {key} | {ms(d['feed_s'])} | {ms(d['step_s'])} | {ms(d['pipeline_s'])} | {ms(separate)} | "
                     f"{ms(d['propose_s'])} |")
    if static["networks_s"]:
        lines += ["", "| networks of one iteration, one call | ms | the same as separate calls |", "|---|---|---|"]
        for key, value in static["networks_s"].items():
            dkey, bkey = key.split("; ", 1)
            d = static["drafters"][dkey]
            separate = d["feed_s"] + max(d["depth"] - 1, 0) * d["step_s"] + blocks[bkey]["forward_s"]
            lines.append(f"| {key} | {ms(value)} | {ms(separate)} |")
    return lines


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
    batched: every decoder of ``cfg.decoders`` on the model built with each of ``cfg.layouts``, on each decode
    path of ``cfg.paths`` (a static decoder labelled ``<name>@static``; on the ``compiled`` layout the eager path
    runs its layers compiled piecewise and the static path its steps compiled whole), interleaved per image
    (image i with every cell, then i + 1; seeds ``seed + i``) after ``warmup`` untimed images. Per cell: the median
    latency, its ratio to the same decoder on the first layout's eager path (the geometric mean of the paired
    per-image ratios with its 95 % t-interval) and the images whose tokens equal that baseline's; with
    ``anatomy``, where one more image's time goes (``profile_anatomy``); then, with ``throughput.batch_sizes``, img/s
    at the largest batch size (``measure_throughput``, every cell interleaved batch by batch after one untimed batch
    each). Writes ``<out_dir>/<name>_layouts.{md,json}``."""
    from coolsd.numerics import cpu_name
    from eval.metrics.intervals import geometric_ratio

    started = dt.datetime.now(dt.timezone.utc)
    layouts = list(cfg.layouts)
    paths = list(cfg.paths)
    refused: dict[str, str] = {}
    models = {}
    for layout in layouts:
        model = layout_model(cfg, layout)
        models[layout] = {key: dec for path in paths for key, dec in build_decoders(cfg, model, path, refused).items()}
    first = next(iter(models.values()))
    keys = [k for k in first if all(k in decs for decs in models.values())]
    prompts = instantiate(cfg.data).load(next(iter(first.values())).model, cfg.images, key="images")
    base = layouts[0]

    def baseline(key: str) -> tuple[str, str]:
        name = key.removesuffix(STATIC)
        return base, name if name in first else key

    with torch.inference_mode():
        for decs in models.values():
            for key in keys:
                for w in range(cfg.warmup):
                    decs[key].generate(prompts[0], WARMUP_SEED - w)
        lat: dict[str, dict[str, list[float]]] = {lay: {k: [] for k in keys} for lay in layouts}
        toks: dict[str, dict[str, list[torch.Tensor]]] = {lay: {k: [] for k in keys} for lay in layouts}
        for i, prompt in enumerate(prompts):
            for key in keys:
                for layout in layouts:
                    gen = models[layout][key].generate(prompt, cfg.seed + i)
                    lat[layout][key].append(gen.stats.latency_s)
                    toks[layout][key].append(gen.tokens.cpu())
            progress(f"layouts: image {i + 1}/{len(prompts)}")
        anatomy = {lay: {k: profile_anatomy(models[lay][k], prompts[0], cfg.seed) for k in keys} for lay in layouts} \
            if cfg.get("anatomy") else {}
        thr: dict[str, dict[str, Any]] = {}
        batch = max(cfg.throughput.batch_sizes or [0])
        if batch:
            pairs = {f"{lay}/{k}": models[lay][k] for lay in layouts for k in keys}
            for dec in pairs.values():  # untimed: a compiled region's first batched shapes compile here
                dec.generate_batch([prompts[j % len(prompts)] for j in range(batch)], list(range(batch)))
            thr = measure_throughput(pairs, prompts, OmegaConf.merge(cfg, {"throughput": {"batch_sizes": [batch]}}),
                                     Timer(first[next(iter(first))].model.device))
    rows: dict[str, dict[str, Any]] = {lay: {} for lay in layouts}
    for lay in layouts:
        for k in keys:
            ref_lay, ref_key = baseline(k)
            ratio = geometric_ratio(lat[lay][k], lat[ref_lay][ref_key])
            rows[lay][k] = {"median_latency_s": statistics.median(lat[lay][k]),
                            "ratio_to_first": statistics.median(lat[lay][k]) / statistics.median(lat[ref_lay][ref_key]),
                            "ratio": ratio["ratio"], "ratio_ci": ratio["interval"], "baseline": f"{ref_lay}/{ref_key}",
                            "same_tokens_as_first": sum(int(torch.equal(a, b)) for a, b in
                                                        zip(toks[lay][k], toks[ref_lay][ref_key]))}
            if thr:
                rows[lay][k]["img_s"] = thr[f"{lay}/{k}"]["img_s"][batch]
            if anatomy:
                rows[lay][k]["anatomy"] = anatomy[lay][k]
    name = (cfg.name or f"{model_name}_cpu") + "_layouts"
    command = "python scripts/bench.py " + " ".join(sys.argv[1:])
    record = {"setup": {"name": name, "model": model_name, "layouts": layouts, "paths": paths, "images": cfg.images,
                        "threads": torch.get_num_threads(), "warmup": cfg.warmup, "throughput_batch": batch or None,
                        "throughput_images": int(cfg.throughput.images) if batch else None, "refused": refused,
                        "command": command, "cpu": cpu_name()},
              "layouts": rows, "git": git_commit(), "environment": environment(),
              "started": started.isoformat(timespec="seconds")}
    atomic_write_bytes(Path(cfg.out_dir) / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(Path(cfg.out_dir) / f"{name}.md", layouts_markdown(record, cfg).encode())
    return record


#: ``profile_anatomy``'s categories: (name, what it holds, the profiler's op names it sums (self time))
ANATOMY = (("linear", "the linear layers' matrix products", ("aten::mm", "aten::addmm")),
           ("attention", "attention: its batched products, softmax and kernels",
            ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_safe_softmax",
             "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "coolsd::attention")),
           ("compiled", "inductor's generated code (a compiled region's own time)", ("## Call CompiledFxGraph",)),
           ("guards", "dynamo's guard checks before each compiled call", ("TorchDynamo Cache Lookup",)))


def profile_anatomy(decoder: Decoder, prompt: str, seed: int) -> dict[str, float]:
    """Where one image's time goes, from ``torch.profiler``'s self CPU time per op (``ANATOMY``'s categories and
    ``other``, the rest), in seconds, with ``total``: works on a compiled step, which has no phase clocks."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoder.generate(prompt, seed)
    out = {name: 0.0 for name, _, _ in ANATOMY}
    total = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        total += seconds
        for name, _, ops in ANATOMY:
            if any(event.key == op or event.key.startswith(op + " ") for op in ops):
                out[name] += seconds
                break
    out["other"] = total - sum(out.values())
    out["total"] = total
    return out


def layouts_markdown(record: dict[str, Any], cfg: DictConfig) -> str:
    """The layout comparison's page: per decoder and cell, latency, the paired ratio to its baseline, equal tokens,
    img/s; the anatomy of each cell where measured."""
    setup, rows = record["setup"], record["layouts"]
    layouts = setup["layouts"]
    keys = list(rows[layouts[0]])
    thr = any("img_s" in r for r in rows[layouts[0]].values())
    env = record["environment"]
    lines = [f"# Batch-1 latency per model variant and decode path: {setup['name'].removesuffix('_layouts')} "
             f"(model {setup['model']}), {setup['images']} images per cell, interleaved", "",
             f"`{setup['command']}`; {setup['threads']} torch thread(s); {setup['cpu']}; torch "
             f"{env.get('torch', torch.__version__)}; git {record['git'].get('commit')}"
             f"{' (uncommitted changes)' if record['git'].get('dirty') else ''}; {record['started']}.", "",
             "Median latency (ms per image); ratio = the geometric mean of the paired per-image latency ratios to the "
             f"same decoder on `{layouts[0]}`'s eager path, with its 95 % t-interval (below 1: faster); `same` = "
             "images whose tokens equal that baseline's.", "",
             "| decoder | " + " | ".join(f"{lay} ms | ratio [95 % CI] | same" + (" | img/s" if thr else "")
                                         for lay in layouts) + " |",
             "|---|" + ("---|---|---|" + ("---|" if thr else "")) * len(layouts)]
    for k in keys:
        cells = []
        for lay in layouts:
            r = rows[lay][k]
            ci = r["ratio_ci"]
            interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
            cells.append(f"{1000 * r['median_latency_s']:.1f} | {r['ratio']:.3f}{interval} | "
                         f"{r['same_tokens_as_first']}/{setup['images']}" + (f" | {r['img_s']:.1f}" if thr else ""))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if setup.get("refused"):
        lines += ["", "Not on the static path: " + "; ".join(f"{k} ({v})" for k, v in setup["refused"].items()) + "."]
    if thr:
        lines += ["", f"img/s: {setup['throughput_images']} images or more per cell in batches of "
                      f"{setup['throughput_batch']}, every cell interleaved batch by batch after one untimed batch."]
    if any("anatomy" in r for r in rows[layouts[0]].values()):
        names = [name for name, _, _ in ANATOMY] + ["other"]
        lines += ["", "Where one image's time goes (self CPU time from torch.profiler, s; " + "; ".join(
            f"{name}: {what}" for name, what, _ in ANATOMY) + "; other: the rest):", "",
            "| cell | total | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for lay in layouts:
            for k in keys:
                a = rows[lay][k]["anatomy"]
                lines.append(f"| {lay} / {k} | {a['total']:.2f} | " + " | ".join(
                    f"{a[n]:.2f} ({a[n] / a['total']:.0%})" for n in names) + " |")
    if cfg.note:
        lines += ["", str(cfg.note)]
    return "\n".join(lines) + "\n"


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
        "static_refused": refused, "model_compile": bool(getattr(model, "compile", False)),
        "command": bench_command(),
    }
    with torch.inference_mode():
        cost = CostModel(cfg, model, eager or decoders, prompts[0], timer)
        static_decoders = {label: dec for label, dec in decoders.items() if path_of(label) == "static"}
        static_cost = StaticCostModel(static_decoders, model, prompts[0], cost.context, cfg.seed, cost.probes) \
            if static_decoders else None
        progress(f"cost model probes built ({len(cost.probes.fns)})")
        stats, target_s = run_interleaved(decoders, prompts, cfg, cost, static_cost)
        counts = {name: decode_counts(dec, prompts[0], cfg.seed) for name, dec in eager.items()} \
            if cfg.call_counts else {}  # the static path's forwards are not hooked: its steps read nothing
        costs = cost.costs()
        static_costs = static_cost.costs() if static_cost else None
        results: dict[str, DecoderResult] = {}
        for label in decoders:  # AR of each path first: the denominator of that path's speedups
            if label == ar_label(label):
                results[label] = summarize(label, stats[label], decoders[label], costs, None, None, static_costs,
                                           target_s.get(label))
        for label in decoders:
            if label != ar_label(label):
                base = results[ar_label(label)]
                ar = {"latency_s": base.latency_s, "iteration_s": base.iteration_s}
                results[label] = summarize(label, stats[label], decoders[label], costs, ar,
                                           paper.get(label.removesuffix(STATIC)), static_costs, target_s.get(label))
        record = {
            "setup": {**setup, "repeats": len(cost.probes.samples["sample"])},
            "complete": False,
            "costs": {"eager": asdict(costs), "static": asdict(static_costs) if static_costs else None},
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


def negative_overheads(folder: Path) -> list[str]:
    """``"<file>: <row> <overhead>"`` for every decoder row of a bench record (``decoders.<row>.overhead_s``) in
    ``folder`` or below whose overhead is negative: an iteration that took less than the network forwards its cost
    model puts inside it, i.e. a cost model that does not describe the path the row ran on. A static row whose
    record holds a 95 % interval of its overhead (``overhead_ci_s``) counts when the whole interval is below 0: a
    difference of two probes that noise put below 0 is not a wrong cost model."""
    found = []
    for path in sorted(Path(folder).rglob("*.json")):
        record = json.loads(path.read_text())
        rows = record.get("decoders") if isinstance(record, dict) else None
        for name, row in (rows or {}).items() if isinstance(rows, dict) else ():
            interval = row.get("overhead_ci_s") if isinstance(row, dict) else None
            if isinstance(row, dict) and row.get("overhead_s") is not None and row["overhead_s"] < 0 and \
                    (interval is None or interval[1] < 0):
                found.append(f"{path.relative_to(folder)}: {name} {row['overhead_s'] * 1e3:.3f} ms "
                             f"({row.get('overhead_frac', 0):.0%})")
    return found


def bench_command() -> str | None:
    """The command line that made this record (``scripts/bench.py`` and its overrides), None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return " ".join(["python scripts/bench.py", *HydraConfig.get().overrides.task])


def write_bench(cfg: DictConfig, record: dict[str, Any], costs: Costs, results: dict[str, DecoderResult]) -> None:
    """``<out_dir>/<name>.{json,md}`` of a bench record, atomically (a reader never sees half a file)."""
    out_dir, name = Path(cfg.out_dir), record["setup"]["name"]
    table = markdown(record, costs, results)
    if not record.get("complete", True):
        table += "\n**Incomplete**: the throughput run had not finished when this was written.\n"
    atomic_write_bytes(out_dir / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(out_dir / f"{name}.md", table.encode())
