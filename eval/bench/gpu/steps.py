"""The GPU command's steps: what each measures, on which model, and how.

Default plan, in order (``default_steps``):

1. ``preflight``: the tiny models on the GPU in float32 (the trained embedded model and the random tiny LlamaGen
   T2I, TF32 off), AR, SD on an EAGLE chain and on the EAGLE-1 tree, COOL-SD and SJD, two images each at batch 1 on
   three paths: the eager loop, the static path run eagerly (uncaptured) and the static path captured in CUDA
   graphs. Captured tokens must equal uncaptured ones bitwise (the same kernels replayed), and static tokens the
   eager loop's (float32, the attention kernel the eager path uses). A mismatch stops the plan and says which.
2. ``blocks``: LlamaGen T2I-XL 512 (random bf16 weights) forwards of 1 token, a chain's verify block (``L + 1``)
   and the 26-node tree block (``mc_sim_7b_63`` and its root) after 512 image tokens, each captured and replayed,
   under every attention kernel SDPA offers (math, memory-efficient, flash, cuDNN; one that refuses the mask is
   reported so) and attending to the whole cache capacity or to the smallest length bucket that holds the block
   (``coolsd.kv_cache.bucket``).
3. ``ar``: captured AR at XL 512, two images after the graph is captured (s per image, ms per step).
4. ``iterations``: captured iterations of SD and COOL-SD (δ = 1.1) on an EAGLE chain of 4 and on the EAGLE-1 tree
   (an untrained head), and SJD (window 16): ms per iteration over a fixed number of iterations (random weights:
   accepted lengths mean nothing, an iteration's cost does not depend on them on a fixed-shape step); then each
   method's projected speedup over captured AR at its paper's accepted length (``PAPER_TAU``).
5. ``eager_ar``: one AR image on the eager loop at XL 512 (the papers' baseline).
6. ``throughput``: AR images per second and peak memory at B = 1, 8 and 32 captured; on the eager loop at B = 8 and
   32 only as the budget allows.

Named only (not in the default plan): ``sweep`` (the batch-size study at XL: AR, SD and COOL-SD on the EAGLE-1
tree and SJD at B = 1, 8, 32, captured; ``eval.bench.batch_sweep`` without Hydra), ``xl_numerics`` (XL forwards, bf16 against float32 logits), the checks of
the GPU smoke test (``smoke``, ``ranks``, ``bf16_acceptance``, ``compiled``: the embedded model's bf16 acceptance,
torchrun over NCCL, compiled against eager) and the bench presets (``bench_xl``, ``bench_xl_jacobi``,
``bench_xl_compiled``, ``bench_janus``, ``bench_lumina``), which compose Hydra configs and need the carried wheels
(``eval.bench.gpu.node``).

Every model here is built in Python, without Hydra, and LlamaGen T2I captions are cleaned with
``caption_cleaning=lower`` (the reference's clean-up needs ftfy, which the nodes lack; the report says so).
With ``--dry-run`` every step runs on the CPU at tiny sizes (the tiny T2I stands for XL, nothing is captured):
only to test the command.

Example: ``python scripts/gpu.py --out results/bench/h200 --budget 300``.
"""
from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

from coolsd.acceptance import ExactRule
from coolsd.decoding import Decoder
from coolsd.kv_cache import DeviceKVCache, bucket
from coolsd.trees import ancestor_mask, resolve_tree
from eval.bench.gpu.plan import ROOT, PreflightFailed, Session, Step

PROMPTS = ["A blue Porsche 356 parked in front of a yellow brick wall.", "A cat sleeping on a red sofa.",
           "Two boats on a calm lake at sunrise.", "A bowl of ramen with an egg."]
#: the papers' accepted lengths on LlamaGen-XL (COOL-SD's table; SJD: no LlamaGen-XL number is published, its
#: step compression on Lumina-mGPT in the SJD-PAC paper is used), for the projected speedups
PAPER_TAU = {"sd_tree": (2.42, "COOL-SD paper, LlamaGen-XL, EAGLE-1"),
             "coolsd_tree": (2.73, "COOL-SD paper, δ = 1.1"), "coolsd_tree_d2": (3.34, "COOL-SD paper, δ = 2"),
             "sjd": (2.22, "SJD-PAC paper, SJD on Lumina-mGPT")}
#: the decoders of the iterations step (PAPER_TAU's entries are timed by these)
ITERATED = ("sd", "coolsd", "sd_tree", "coolsd_tree", "sjd")
PREFLIGHT = ("ar", "sd", "sd_tree", "coolsd", "sjd")
DRAFT_LEN = 4
SJD_WINDOW = 16
TREE = "mc_sim_7b_63"
#: SDPA's kernels, timed against ``math`` in the blocks step
KERNELS = ("math", "efficient", "flash", "cudnn")
#: what a static step attends to: the cache's whole capacity, or the smallest bucket that holds the block
SPANS = ("full", "bucket")
CAPTION_CLEANING = "lower"


# -- models and decoders, built in Python (no Hydra on the node) -----------------------------------------------------
def yaml_model(name: str, **overrides: Any) -> torch.nn.Module:
    """The model of ``configs/model/<name>.yaml`` with ``overrides``, without Hydra: YAML read with PyYAML, the
    ``${asset:...}`` paths resolved, ``_target_`` imported and called (no other interpolation is allowed)."""
    import importlib

    import yaml

    from coolsd import ASSET_DIR

    cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{name}.yaml").read_text())
    cfg.pop("defaults", None)
    target = cfg.pop("_target_")
    for key, value in cfg.items():
        if isinstance(value, str) and value.startswith("${"):
            if not (value.startswith("${asset:") and value.endswith("}")):
                raise ValueError(f"configs/model/{name}.yaml: {key}={value} needs Hydra; only ${{asset:...}} "
                                 "resolves here")
            cfg[key] = str(ASSET_DIR / value[len("${asset:"):-1])
    cfg.update(overrides)
    module, cls = target.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(**cfg)


def xl_model(session: Session) -> torch.nn.Module:
    """LlamaGen T2I-XL at 512 px with random bf16 weights on CUDA (the tiny T2I on a dry run), built once."""
    if "xl" not in session.cache:
        if session.dry_run:
            model = yaml_model("llamagen_t2i_tiny", device="cpu", caption_cleaning=CAPTION_CLEANING)
        else:
            from coolsd.models.llamagen_t2i import LlamaGenT2I

            model = LlamaGenT2I(gpt={"model_type": "t2i", "vocab_size": 16384, "caption_dim": 2048,
                                     "cls_token_num": 120, "block_size": 1024},
                                vq={"codebook_size": 16384, "codebook_embed_dim": 8},
                                sampling={"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0},
                                gpt_size="GPT-XL", text_encoder="tiny_random", pretrained=False, init_seed=0,
                                init_std=0.02, zero_init_output=False, device="cuda", dtype="bfloat16",
                                caption_cleaning=CAPTION_CLEANING)
        session.cache["xl"] = model
        session.report["model"] = {"name": "tiny T2I (dry run)" if session.dry_run else "LlamaGen T2I-XL 512",
                                   "dtype": str(model.gpt.tok_embeddings.weight.dtype).removeprefix("torch."),
                                   "image_tokens": model.num_image_tokens, "weights": "random",
                                   "caption_cleaning": f"{CAPTION_CLEANING} (ftfy-free; not the reference's)"}
    return session.cache["xl"]


def decoder(model: torch.nn.Module, name: str, path: str, mode: str | None = None, drafter: Any = None) -> Decoder:
    """One decoder of the steps on ``path``; a static one runs its steps in ``mode`` (eager, or a CUDA graph)
    when given (else the device's: a graph on a GPU). ``drafter``: a trained EAGLE drafter (else a random head)."""
    from baselines.jacobi import JacobiDrafter
    from coolsd.cool import CoolSD
    from coolsd.drafters.eagle import EagleDrafter, EagleHead

    def eagle() -> Any:
        return drafter() if drafter is not None else EagleDrafter(model, head=EagleHead(model, init_seed=0))

    tree = TREE if name.endswith("_tree") else None
    if name == "ar":
        out = Decoder("ar", model, ExactRule(), path=path)
    elif name.startswith("sd"):
        out = Decoder(name, model, ExactRule(), draft_len=0 if tree else DRAFT_LEN, drafter=eagle(), path=path,
                      tree=tree)
    elif name.startswith("coolsd"):
        out = CoolSD(name, model, draft_len=DRAFT_LEN, delta=1.1, tree=tree, drafter=eagle(), path=path)
    elif name == "sjd":
        out = Decoder("sjd", model, ExactRule(), draft_len=SJD_WINDOW - 1, path=path,
                      drafter=JacobiDrafter(model, init="random"))
    else:
        raise ValueError(f"no GPU-step decoder named {name!r}")
    if out.static is not None and mode is not None:
        out.static.mode = mode
        for _, runner in out.static._workspaces.values():
            runner.mode = mode
    return out


def captured_mode(session: Session) -> str:
    """The static path's mode for "captured": a CUDA graph, or eager on a dry run (nothing is captured there)."""
    return "eager" if session.dry_run else "graph"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- 1. preflight ---------------------------------------------------------------------------------------------------
def preflight(session: Session) -> None:
    """Step 1 (module doc). Raises ``PreflightFailed`` naming every mismatch."""
    from coolsd.drafters.eagle import EagleDrafter

    device = "cpu" if session.dry_run else "cuda"
    models = {"embedded": (yaml_model("embedded", device=device, dtype="float32", tf32=False),
                           ["dress", "bag"]),
              "llamagen_t2i_tiny": (yaml_model("llamagen_t2i_tiny", device=device, dtype="float32", tf32=False,
                                               caption_cleaning=CAPTION_CLEANING), PROMPTS[:2])}
    from coolsd import ASSET_DIR

    results, mismatches = {}, []
    images = 1 if session.dry_run else 2
    for model_name, (model, prompts) in models.items():
        trained = None
        if model_name == "embedded":
            def trained(model=model):
                return EagleDrafter(model, checkpoint=str(ASSET_DIR / "embedded" / "drafter"))
        for name in PREFLIGHT:
            tokens = {}
            for path, mode in (("eager", None), ("static", "eager"), ("captured", captured_mode(session))):
                dec = decoder(model, name, "eager" if path == "eager" else "static", mode, trained)
                tokens[path] = [dec.generate(p, seed).tokens.cpu() for seed, p in enumerate(prompts[:images])]
            same = {"captured = static": _equal(tokens["captured"], tokens["static"]),
                    "static = eager": _equal(tokens["static"], tokens["eager"])}
            results[f"{model_name}/{name}"] = same
            mismatches += [f"{model_name}/{name}: {what} fails" for what, ok in same.items() if not ok]
        del model
    session.results["preflight"] = {"pairs": results, "images_per_pair": images, "dtype": "float32", "tf32": False,
                                    "captured": not session.dry_run, "mismatches": mismatches}
    if mismatches:
        raise PreflightFailed("; ".join(mismatches))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- 2. blocks ------------------------------------------------------------------------------------------------------
def replay_ms(fn: Callable[[], None], capture: bool, repeats: int) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed (run eagerly, timed on the host, without
    ``capture``)."""
    fn()
    if not capture:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def blocks(session: Session, repeats: int = 20) -> None:
    """Step 2 (module doc): ms of each block under each kernel and span; each against the 1-token forward of the
    same kernel and span."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    model = xl_model(session)
    device = model.device
    mask = ancestor_mask(resolve_tree(TREE, None).parents()).to(device)  # (26, 26)
    sizes = {"forward_1": (1, None), "verify_chain": (DRAFT_LEN + 1, None), "verify_tree_26": (mask.shape[0], mask)}
    out: dict[str, Any] = {"context_tokens": min(512, model.num_image_tokens // 2), "repeats": repeats, "ms": {}}
    with torch.inference_mode():
        cache = DeviceKVCache.of(model.prefill([PROMPTS[0]], extra_slots=64)[0])
        base = cache.lengths.clone() + out["context_tokens"]
        out["capacity"] = cache.max_len
        for kernel in KERNELS if not session.dry_run else ("math",):
            for span in SPANS:
                for name, (size, block_mask) in sizes.items():
                    key = f"{kernel}/{span}/{name}"
                    cache.span = cache.max_len if span == "full" else bucket(int(base[0]) + size, cache.max_len)
                    out.setdefault("spans", {})[f"{span}/{name}"] = cache.span
                    tokens = torch.randint(model.codebook_size, (1, size), device=device)
                    positions = torch.arange(size, device=device)[None] + base[:, None] - cache.prefix_len

                    def forward(tokens=tokens, positions=positions, block_mask=block_mask) -> None:
                        cache.lengths.copy_(base)
                        model.static_forward(cache, tokens, positions, block_mask)

                    try:
                        with sdpa_kernel(backends[kernel]):
                            out["ms"][key] = replay_ms(forward, not session.dry_run, repeats)
                    except RuntimeError as error:  # a kernel that refuses this mask, dtype or device
                        out["ms"][key] = None
                        out.setdefault("refused", {})[kernel] = str(error).strip().splitlines()[0][:200]
        cache.span = cache.max_len
    ms = out["ms"]
    out["ratio"] = {k: v / ms[k.rsplit("/", 1)[0] + "/forward_1"] for k, v in ms.items()
                    if v is not None and ms.get(k.rsplit("/", 1)[0] + "/forward_1")}
    session.results["blocks"] = out


# -- 3. captured AR, 4. captured iterations ---------------------------------------------------------------------------
def warm(dec: Decoder, batch: int) -> None:
    """Build a static decoder's workspace for ``batch`` images and capture its step: two calls of its runner (the
    first eager, the second captures), then leave the batch unfinished."""
    with torch.inference_mode(), dec.static.batch((PROMPTS * 16)[:batch], list(range(900, 900 + batch))) as (
            _, runner, _):
        runner()
        runner()
    sync()


def ar(session: Session, images: int = 2) -> None:
    """Step 3 (module doc)."""
    model = xl_model(session)
    dec = session.cache.setdefault("ar_captured", decoder(model, "ar", "static", captured_mode(session)))
    warm(dec, 1)
    rows = []
    for i in session.images(images):
        g = dec.generate(PROMPTS[i % len(PROMPTS)], i)
        rows.append({"s_per_image": g.stats.latency_s,
                     "ms_per_step": 1e3 * (g.stats.latency_s - g.stats.prefill_s) / (model.num_image_tokens - 1)})
        session.results["ar"] = _mean_rows(rows, "captured" if not session.dry_run else "static (dry run)")


def _mean_rows(rows: list[dict[str, float]], path: str) -> dict[str, Any]:
    out = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    return {**out, "images": len(rows), "path": path, "per_image_s": out["s_per_image"]}


def timed_calls(dec: Decoder, count: int) -> float:
    """Seconds of ``count`` calls of a static decoder's step (its runner) on one image, after two untimed calls (the
    first eager, the second captures); the image is left unfinished."""
    with torch.inference_mode(), dec.static.batch([PROMPTS[0]], [0]) as (_, runner, _):
        runner()
        runner()
        sync()
        start = time.perf_counter()
        for _ in range(count):
            runner()
        sync()
        return time.perf_counter() - start


def iterations(session: Session, count: int = 64) -> None:
    """Step 4 (module doc): ``count`` timed iterations per decoder after capture, then the projection."""
    model = xl_model(session)
    out = session.results["iterations"] = {"count": count, "ms_per_iteration": {}}
    for i in session.images(len(ITERATED), unit="decoder"):
        name = ITERATED[i]
        dec = decoder(model, name, "static", captured_mode(session))
        out["ms_per_iteration"][name] = 1e3 * timed_calls(dec, count) / count
        del dec
    ar_step = session.results.get("ar", {}).get("ms_per_step")
    if ar_step:
        out["projection"] = {name: {"tau": tau, "source": source, "ms_per_iteration": its,
                                    "projected_speedup": tau * ar_step / its}
                             for name, (tau, source) in PAPER_TAU.items()
                             if (its := out["ms_per_iteration"].get(name.removesuffix("_d2")))}


# -- 5. one eager AR image, 6. throughput ----------------------------------------------------------------------------
def eager_ar(session: Session) -> None:
    """Step 5 (module doc)."""
    model = xl_model(session)
    dec = decoder(model, "ar", "eager")
    for i in session.images(1):
        g = dec.generate(PROMPTS[0], 0)
        session.results["eager_ar"] = {
            "s_per_image": g.stats.latency_s, "images": 1, "path": "eager", "per_image_s": g.stats.latency_s,
            "ms_per_step": 1e3 * (g.stats.latency_s - g.stats.prefill_s) / (model.num_image_tokens - 1)}


def throughput(session: Session) -> None:
    """Step 6 (module doc): one timed batch per size after its capture; eager batches while the budget holds."""
    model = xl_model(session)
    sizes = (1, 2, 4) if session.dry_run else (1, 8, 32)
    out = session.results["throughput"] = {}
    captured = session.cache.setdefault("ar_captured", decoder(model, "ar", "static", captured_mode(session)))
    plan = [("captured", b) for b in sizes] + [("eager", b) for b in sizes[1:]]
    eager_batch = session.expected("throughput", "eager_per_batch")  # the eager loop's batch: host-bound, slow

    def floor(i: int) -> float:
        return eager_batch if plan[i][0] == "eager" and not session.dry_run else 0.0

    for i in session.images(len(plan), unit="batch", floor=floor):
        path, b = plan[i]
        dec = captured if path == "captured" else decoder(model, "ar", "eager")
        if path == "captured":
            warm(dec, b)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        dec.generate_batch((PROMPTS * 16)[:b], list(range(b)))
        sync()
        wall = time.perf_counter() - start
        label = "static (dry run)" if session.dry_run and path == "captured" else path
        out[f"{label}/B={b}"] = {"images_per_s": b / wall, "s_per_batch": wall, "batch": b, "path": label,
                                "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30
                                if torch.cuda.is_available() else None}


# -- named only: the other models' captured AR ----------------------------------------------------------------------
#: the other adapters at their published sizes with random weights (``models_ar``): config, keyword overrides
REAL_SIZE = {
    "janus_pro_1b": ("janus_tiny", {"arch": {
        "hidden_size": 2048, "num_layers": 24, "num_heads": 16, "num_kv_heads": 16, "intermediate_size": 5632,
        "vocab_size": 102400, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 16384,
        "image_size": 384, "patch_size": 16, "codebook_size": 16384, "codebook_dim": 8, "init_std": 0.02}}),
    "lumina_mgpt_7b": ("lumina_tiny", {"width": 768, "height": 768, "random_init": {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_codes": 8192, "vocab_size": 65536, "max_position_embeddings": 4096,
        "swin_norm": False, "init_std": 0.02, "seed": 0}}),
}


def models_ar(session: Session, count: int = 32) -> None:
    """Janus-Pro-1B (384 px, 576 tokens) and Lumina-mGPT-7B (768 px, 48 x 49 positions) at their published sizes
    with random bf16 weights (drawn on the GPU), captured AR: per model ``count`` timed calls of the captured step
    after its capture (each call ``ar_steps`` AR steps), ms per AR step and the projected seconds per image (steps
    x ms; random weights: an AR step's cost does not depend on the tokens). One model per budget check: the second
    runs only if the budget holds what the first took. A dry run builds the tiny configs on the CPU."""
    out = session.results["models_ar"] = {"count": count}
    names = list(REAL_SIZE)
    for i in session.images(len(names), unit="model"):
        name = names[i]
        tiny, sizes = REAL_SIZE[name]
        overrides: dict[str, Any] = {"device": "cpu"} if session.dry_run else {
            **sizes, "device": "cuda", "dtype": "bfloat16", "batch_invariant": False}
        model = yaml_model(tiny, **overrides)
        dec = decoder(model, "ar", "static", captured_mode(session))
        ms = 1e3 * timed_calls(dec, count) / (count * dec.static.ar_steps)
        out[name] = {"ms_per_step": ms, "image_tokens": model.num_image_tokens,
                     "projected_s_per_image": ms * (model.num_image_tokens - 1) / 1e3,
                     "path": "static (dry run)" if session.dry_run else "captured",
                     "model": f"{tiny} (dry run)" if session.dry_run else f"{name} sizes, random bf16 weights",
                     "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                     else None}
        del dec, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- named only: the batch sweep ----------------------------------------------------------------------------------
SWEEP_DECODERS = ("ar", "sd_tree", "coolsd_tree", "sjd")


def sweep(session: Session) -> None:
    """AR, SD and COOL-SD on the EAGLE-1 tree and SJD at B = 1, 8, 32 on the captured path (``eval.bench.batch_sweep``
    without Hydra): one timed batch per (decoder, B) after its capture; the measured speedup over AR at the same B
    (random weights: an untrained head accepts about nothing, so it measures the cost of speculating) and the
    projected one at the papers' accepted lengths (τ · AR's ms per step ÷ the decoder's ms per iteration)."""
    model = xl_model(session)
    sizes = (1, 2) if session.dry_run else (1, 8, 32)
    out = session.results["sweep"] = {"batches": {}}
    plan = [(b, name) for b in sizes for name in SWEEP_DECODERS]
    decoders = {name: decoder(model, name, "static", captured_mode(session)) for name in SWEEP_DECODERS}
    for i in session.images(len(plan), unit="batch"):
        b, name = plan[i]
        dec = decoders[name]
        warm(dec, b)
        start = time.perf_counter()
        gens = dec.generate_batch((PROMPTS * 16)[:b], list(range(b)))
        sync()
        wall = time.perf_counter() - start
        iterations = max(g.stats.iterations for g in gens)
        cell = out["batches"].setdefault(str(b), {})[name] = {
            "wall_s": wall, "images_per_s": b / wall, "iterations": iterations,
            "ms_per_iteration": 1e3 * (wall - max(g.stats.prefill_s for g in gens)) / iterations,
            "accepted_length": statistics.fmean(g.stats.mean_accepted_length for g in gens)}
        ar_cell = out["batches"][str(b)].get("ar")
        if ar_cell and name != "ar":
            cell["speedup"] = ar_cell["wall_s"] / wall
            tau = PAPER_TAU.get(name)
            if tau:
                cell["projected_speedup"] = tau[0] * ar_cell["ms_per_iteration"] / cell["ms_per_iteration"]
        session.write()


# -- named only: the older checks ------------------------------------------------------------------------------------
def xl_numerics(session: Session) -> None:
    """XL forwards at the CFG batch of 2 and bf16 against float32 logits on the same random weights
    (``eval.bench.gpu_check_llamagen``)."""
    from eval.bench.gpu_check_llamagen import run_check

    session.results["xl_numerics"] = run_check(block_size=256 if session.dry_run else 1024,
                                               device="cpu" if session.dry_run else "cuda", seed=0,
                                               tokens=8 if session.dry_run else 64, repeats=3 if session.dry_run
                                               else 20, gpt_size="GPT-B" if session.dry_run else "GPT-XL")


def smoke_check(*checks: str) -> Callable[[Session], None]:
    """The GPU smoke test's ``checks`` (``eval.bench.gpu_smoke``; they compose Hydra configs: the carried wheels)."""

    def run(session: Session) -> None:
        from eval.bench.gpu_smoke import run_smoke

        record = run_smoke(session.out_dir / "smoke", list(checks) or None, allow_cpu=session.dry_run,
                           acceptance_images=16 if session.dry_run else 128)
        session.results[session._step] = record
        if not record["passed"]:
            raise RuntimeError("failed checks: " + ", ".join(r["check"] for r in record["checks"]
                                                             if r["status"] == "fail"))
    return run


#: the bench presets (``scripts/bench.py``), as the H200 session ran them; each under its own time limit
BENCH = {"bench_xl": (["bench=llamagen_xl_512", "decoders=[ar,sd,coolsd,sjd]", "cuda_graphs=true", "cost.repeats=10"],
                      540),
         "bench_xl_jacobi": (["bench=llamagen_xl_512", "decoders=[ar,sjd_pac,gsd,scd_mc,scd_gs]",
                              "throughput.batch_sizes=[]"], 150),
         "bench_xl_compiled": (["bench=llamagen_xl_512", "layouts=[column_major,compiled]", "decoders=[ar]", "images=2",
                                "warmup=1", "throughput.batch_sizes=[]"], 200),
         "bench_janus": (["bench=janus_pro_1b"], 150),
         "bench_lumina": (["bench=lumina_mgpt_7b", "decoders=[ar,coolsd]"], 200)}


def bench(name: str) -> Callable[[Session], None]:
    """A bench preset in a subprocess, stopped at its own limit or the budget's end, its log kept."""

    def run(session: Session) -> None:
        overrides, limit = BENCH[name]
        if session.dry_run:
            overrides = ["bench=embedded_random", "images=1", "warmup=0", "throughput.batch_sizes=[]",
                         "decoders=[ar,sd]"]
        limit = min(limit, max(session.left(), 1.0))
        log = session.out_dir / f"{name}.log"
        from eval.bench.gpu.node import as_node

        cmd = as_node(str(ROOT / "scripts" / "bench.py"), f"out_dir={session.out_dir / 'bench'}", f"name={name}",
                      *overrides)
        with log.open("w") as handle:
            try:
                code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        session.results[name] = {"command": " ".join(cmd[cmd.index(str(ROOT / "scripts" / "bench.py")):]), "exit": code, "limit_s": limit, "log": log.name}
        if code != 0:
            raise RuntimeError(f"{name} ended with {code}; see {log}")
    return run


def default_steps() -> list[Step]:
    return [s for s in STEPS.values() if s.default]


STEPS = {s.name: s for s in [
    Step("preflight", "tiny models: captured = uncaptured static tokens, static = eager tokens (float32)", preflight),
    Step("blocks", "XL forwards of 1, L + 1 and 26-node tree blocks: SDPA kernels, full capacity or a bucket", blocks),
    Step("ar", "captured AR at XL 512, two images", ar),
    Step("iterations", "captured SD / COOL-SD (chain, tree) and SJD iterations; projected speedups", iterations),
    Step("eager_ar", "one eager AR image at XL 512 (the papers' baseline)", eager_ar),
    Step("throughput", "AR images/s and peak memory at B = 1, 8, 32 captured; eager as the budget allows",
         throughput),
    Step("sweep", "AR, SD / COOL-SD (tree) and SJD at B = 1, 8, 32 captured: speedup against batch size", sweep,
         default=False),
    Step("models_ar", "captured AR of Janus-Pro-1B and Lumina-mGPT-7B at real size (random weights)", models_ar,
         default=False),
    Step("xl_numerics", "XL bf16 against float32 logits and forward times", xl_numerics, default=False),
    Step("smoke", "the GPU smoke test, every check", smoke_check(), default=False, wheels=True),
    Step("ranks", "torchrun over NCCL against one process", smoke_check("ranks"), default=False, wheels=True),
    Step("bf16_acceptance", "the embedded model's accepted lengths in bf16 against float32",
         smoke_check("bf16_acceptance"), default=False, wheels=True),
    Step("compiled", "model.compile=true against eager tokens", smoke_check("compiled"), default=False, wheels=True),
    *(Step(name, f"scripts/bench.py {' '.join(args)}", bench(name), default=False, wheels=True)
      for name, (args, _) in BENCH.items()),
]}
