"""Both decode paths on a GPU: LlamaGen T2I-XL at 512 px (random bf16 weights, no download), eager against static
against captured, in one process, each step under its own time limit.

Steps (``STEPS``; each writes its numbers as soon as it ends, so a step that runs out of time leaves the others'):

1. ``ar``: AR at batch 1 on the eager path (the papers' loop), the static path run eagerly and the static path
   captured in CUDA graphs (``coolsd.static``): seconds per image, ms per step, and whether the tokens are equal.
2. ``blocks``: captured forwards of a 1-token block, a chain's verify block (``L + 1`` tokens) and a 26-node tree
   block (the 25-node ``mc_sim_7b_63`` tree and its root) over the static cache: ms each, and each block against
   the 1-token forward.
3. ``iterations``: SD and COOL-SD on an EAGLE chain of ``L`` drafts and on the EAGLE-1 tree (``mc_sim_7b_63``, 25
   nodes; a random head), and SJD (a window of 16) at batch 1 on each path: ms per iteration (latency ÷ iterations;
   random weights, so accepted lengths mean nothing, but an iteration's cost barely depends on them).
4. ``projection``: the speedup each method would have at its paper's accepted length (``PAPER_TAU``, the papers'
   EAGLE-1 trees) on each path: ``τ · (AR ms per step) / (ms per iteration)``, the AR step of the same path.
5. ``throughput``: AR images per second and peak memory at B = 1, 8, 32, eager against captured.

Then the goals (``GOALS``), each met or not by the measurements: AR at most 2 s per image captured; a chain's
verify block at most 1.3× a 1-token forward; SD and COOL-SD projected faster than AR captured; loop overhead at most
10 % (captured AR step against the captured 1-token forward it contains).

``allow_cpu`` (``--allow-cpu``) runs every step on the CPU with the tiny LlamaGen T2I (the static path compiled
nothing and captured nothing there; throughput at B = 1 and 2): only to test this module; its report says so.

Example: ``python scripts/gpu_paths.py --out results/bench/h100`` (writes ``gpu_paths.{md,json}``).
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baselines.jacobi import JacobiDrafter
from coolsd.acceptance import ExactRule
from coolsd.cool import CoolSD
from coolsd.decoding import Decoder
from coolsd.device import cuda_available, cuda_diagnosis
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.io import atomic_write_bytes
from coolsd.kv_cache import DeviceKVCache
from coolsd.models.llamagen_t2i import LlamaGenT2I
from coolsd.trees import ancestor_mask, resolve_tree

STEPS = ("ar", "blocks", "iterations", "projection", "throughput")
PROMPTS = ["A blue Porsche 356 parked in front of a yellow brick wall.", "A cat sleeping on a red sofa.",
           "Two boats on a calm lake at sunrise.", "A bowl of ramen with an egg."]
#: the papers' accepted lengths on LlamaGen-XL (COOL-SD's table; SJD: no LlamaGen-XL number is published, its
#: step compression on Lumina-mGPT in the SJD-PAC paper is used), for the projected speedups
PAPER_TAU = {"sd_tree": (2.42, "COOL-SD paper, LlamaGen-XL, EAGLE-1"),
             "coolsd_tree": (2.73, "COOL-SD paper, δ = 1.1"), "coolsd_tree_d2": (3.34, "COOL-SD paper, δ = 2"),
             "sjd": (2.22, "SJD-PAC paper, SJD on Lumina-mGPT")}
#: the decoders of the iterations step (PAPER_TAU's entries are timed by these)
ITERATED = ("sd", "coolsd", "sd_tree", "coolsd_tree", "sjd")
GOALS = {"ar_s_per_image": 2.0, "verify_ratio": 1.3, "loop_overhead": 0.10}
DRAFT_LEN = 4
SJD_WINDOW = 16


def build_model(allow_cpu: bool) -> LlamaGenT2I:
    """LlamaGen T2I-XL at 512 px with random bf16 weights on CUDA, or the tiny T2I on the CPU (``allow_cpu``)."""
    if not allow_cpu:
        return LlamaGenT2I(gpt={"model_type": "t2i", "vocab_size": 16384, "caption_dim": 2048, "cls_token_num": 120,
                                "block_size": 1024}, vq={"codebook_size": 16384, "codebook_embed_dim": 8},
                           sampling={"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0},
                           gpt_size="GPT-XL", text_encoder="tiny_random", pretrained=False, init_seed=0,
                           init_std=0.02, zero_init_output=False, device="cuda", dtype="bfloat16")
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=llamagen_t2i_tiny", "model.device=cpu"])
    return instantiate(cfg.model)


def decoders(model: LlamaGenT2I, path: str, captured: bool) -> dict[str, Decoder]:
    """AR, SD and COOL-SD (δ = 1.1) on an EAGLE chain and on the EAGLE-1 tree, and SJD (window 16) on ``path``; a
    static decoder runs its steps eagerly unless ``captured`` (CUDA graphs on a GPU)."""
    head = EagleHead(model, init_seed=0)
    out = {
        "sd_tree": Decoder("sd_tree", model, ExactRule(), drafter=EagleDrafter(model, head=head), path=path,
                           tree="mc_sim_7b_63"),
        "coolsd_tree": CoolSD("coolsd_tree", model, draft_len=DRAFT_LEN, delta=1.1, tree="mc_sim_7b_63",
                              drafter=EagleDrafter(model, head=head), path=path),
        "ar": Decoder("ar", model, ExactRule(), path=path),
        "sd": Decoder("sd", model, ExactRule(), draft_len=DRAFT_LEN, drafter=EagleDrafter(model, head=head),
                      path=path),
        "coolsd": CoolSD("coolsd", model, draft_len=DRAFT_LEN, delta=1.1, drafter=EagleDrafter(model, head=head),
                         path=path),
        "sjd": Decoder("sjd", model, ExactRule(), draft_len=SJD_WINDOW - 1, path=path,
                       drafter=JacobiDrafter(model, init="random")),
    }
    if path == "static" and not captured:
        for decoder in out.values():
            decoder.static.mode = "eager"
    return out


def timed_images(decoder: Decoder, prompts: list[str], batch: int = 1) -> dict[str, Any]:
    """One warm-up batch, then ``prompts`` in batches of ``batch``: seconds per image, ms per iteration and step."""
    decoder.generate_batch(prompts[:batch], list(range(100, 100 + batch)))
    gens = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        gens += decoder.generate_batch(prompts[i:i + batch], list(range(i, i + batch)))
    wall = time.perf_counter() - start
    latency = statistics.mean(g.stats.latency_s for g in gens)
    iterations = statistics.mean(g.stats.iterations for g in gens)
    return {"s_per_image": latency, "ms_per_iteration": 1e3 * latency / iterations, "images": len(gens),
            "images_per_s": len(gens) / wall, "accepted_length": statistics.mean(
                g.stats.mean_accepted_length for g in gens), "tokens": [g.tokens.tolist() for g in gens]}


def replay_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed (``fn`` eager on the CPU)."""
    fn()
    if device.type != "cuda":
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


def block_ms(model: LlamaGenT2I, repeats: int) -> dict[str, float]:
    """Captured forwards of blocks of 1, ``DRAFT_LEN + 1`` (a chain) and 26 (a tree) tokens after 512 tokens."""
    device = model.device
    tree = resolve_tree("mc_sim_7b_63", None)
    mask = ancestor_mask(tree.parents()).to(device)  # (26, 26)
    out = {}
    with torch.inference_mode(), model.decode_context():
        cache = DeviceKVCache.of(model.prefill([PROMPTS[0]], extra_slots=64)[0])
        base = cache.lengths.clone() + min(512, model.num_image_tokens // 2)
        for name, size, block_mask in (("forward_1", 1, None), ("verify_chain", DRAFT_LEN + 1, None),
                                       ("verify_tree_26", mask.shape[0], mask)):
            tokens = torch.randint(model.codebook_size, (1, size), device=device)
            positions = torch.arange(size, device=device)[None] + base[:, None] - cache.prefix_len

            def forward(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions,
                        block_mask: torch.Tensor | None = block_mask) -> None:
                cache.lengths.copy_(base)
                model.static_forward(cache, tokens, positions, block_mask)

            out[f"{name}_ms"] = replay_ms(forward, device, repeats)
    out["verify_chain_ratio"] = out["verify_chain_ms"] / out["forward_1_ms"]
    out["verify_tree_26_ratio"] = out["verify_tree_26_ms"] / out["forward_1_ms"]
    return out


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def run(out_dir: str | Path, steps: tuple[str, ...] = STEPS, allow_cpu: bool = False, images: int = 2,
        repeats: int = 20, budget: float = 360.0) -> dict[str, Any]:
    """Run ``steps`` in order, none starting after ``budget`` seconds (those are reported as skipped), write
    ``gpu_paths.{json,md}`` into ``out_dir`` after each, return the report."""
    if not cuda_available() and not allow_cpu:
        raise SystemExit(cuda_diagnosis())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(),
                              "hardware": _hardware(), "versions": {"torch": torch.__version__,
                                                                    "python": platform.python_version()},
                              "cpu_dry_run": allow_cpu, "steps": {}, "results": {}}
    model = build_model(allow_cpu)
    report["model"] = {"gpt_size": "GPT-XL" if not allow_cpu else "tiny",
                       "dtype": str(model.gpt.tok_embeddings.weight.dtype), "image_tokens": model.num_image_tokens}
    prompts = (PROMPTS * ((images + len(PROMPTS) - 1) // len(PROMPTS)))[:images]
    paths = {"eager": decoders(model, "eager", False), "static": decoders(model, "static", False),
             "captured": decoders(model, "static", True)}
    results = report["results"]
    for step in steps:
        begin = time.perf_counter()
        if begin - started > budget:
            report["steps"][step] = {"status": f"skipped (the {budget:.0f} s budget was spent)", "seconds": 0.0}
            _write(out_dir, report)
            continue
        try:
            if step == "ar":
                results["ar"] = {p: timed_images(d["ar"], prompts) for p, d in paths.items()}
                ref = results["ar"]["eager"]["tokens"]
                for p in ("static", "captured"):
                    results["ar"][p]["tokens_equal_eager"] = results["ar"][p]["tokens"] == ref
                for p in paths:
                    r = results["ar"][p]
                    r["ms_per_step"] = 1e3 * r["s_per_image"] / model.num_image_tokens
                    r.pop("tokens")
            elif step == "blocks":
                results["blocks"] = block_ms(model, repeats)
            elif step == "iterations":
                results["iterations"] = {p: {name: _dropped(timed_images(d[name], prompts[:1])) for name in ITERATED}
                                         for p, d in paths.items()}
            elif step == "projection":
                results["projection"] = _projection(results)
            elif step == "throughput":
                results["throughput"] = {}
                for p in ("eager", "captured"):
                    for b in ((1, 2) if allow_cpu else (1, 8, 32)):
                        if model.device.type == "cuda":
                            torch.cuda.reset_peak_memory_stats()
                        r = _dropped(timed_images(paths[p]["ar"], (prompts * 32)[:b], batch=b))
                        r["peak_memory_gb"] = peak_memory_gb(model.device)
                        results["throughput"][f"{p}_b{b}"] = r
            report["steps"][step] = {"status": "done", "seconds": time.perf_counter() - begin}
        except Exception as error:  # a step's failure is reported; the others still run
            report["steps"][step] = {"status": "failed", "seconds": time.perf_counter() - begin,
                                     "error": "".join(traceback.format_exception_only(error)).strip()}
        report["goals"] = _goals(results)
        report["seconds"] = time.perf_counter() - started
        _write(out_dir, report)
    return report


def _dropped(result: dict[str, Any]) -> dict[str, Any]:
    result.pop("tokens", None)
    return result


def _projection(results: dict[str, Any]) -> dict[str, Any]:
    """Projected speedup per method and path at the paper's accepted length (module doc, step 4)."""
    out = {}
    ar, its = results.get("ar", {}), results.get("iterations", {})
    for path in ("eager", "static", "captured"):
        if path not in ar or path not in its:
            continue
        step_ms = ar[path]["ms_per_step"]
        for name, (tau, source) in PAPER_TAU.items():
            it = its[path][name.removesuffix("_d2")]["ms_per_iteration"]
            out[f"{path}/{name}"] = {"tau": tau, "source": source, "ms_per_iteration": it,
                                     "projected_speedup": tau * step_ms / it}
    return out


def _goals(results: dict[str, Any]) -> dict[str, Any]:
    """Each goal with its measurement and whether it is met (None: not measured)."""
    ar = results.get("ar", {}).get("captured")
    blocks = results.get("blocks")
    proj = results.get("projection", {})
    goals = {"ar_captured_s_per_image <= 2": None, "verify_chain <= 1.3x forward_1": None,
             "sd and coolsd faster than ar (captured, projected)": None, "loop_overhead <= 10 %": None}
    if ar:
        goals["ar_captured_s_per_image <= 2"] = {"value": ar["s_per_image"],
                                                 "met": ar["s_per_image"] <= GOALS["ar_s_per_image"]}
    if blocks:
        goals["verify_chain <= 1.3x forward_1"] = {"value": blocks["verify_chain_ratio"],
                                                   "met": blocks["verify_chain_ratio"] <= GOALS["verify_ratio"]}
    if "captured/sd_tree" in proj and "captured/coolsd_tree" in proj:
        values = {k: proj[f"captured/{k}"]["projected_speedup"] for k in ("sd_tree", "coolsd_tree")}
        goals["sd and coolsd faster than ar (captured, projected)"] = {"value": values,
                                                                        "met": min(values.values()) > 1.0}
    if ar and blocks:
        overhead = 1.0 - blocks["forward_1_ms"] / ar["ms_per_step"]
        goals["loop_overhead <= 10 %"] = {"value": overhead, "met": overhead <= GOALS["loop_overhead"]}
    return goals


def _hardware() -> dict[str, Any]:
    if cuda_available():
        props = torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "memory_gb": props.total_memory / 2**30, "cuda": torch.version.cuda,
                "driver": _driver()}
    return {"gpu": None, "cpu": platform.processor() or platform.machine()}


def _driver() -> str | None:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _write(out_dir: Path, report: dict[str, Any]) -> None:
    atomic_write_bytes(out_dir / "gpu_paths.json", json.dumps(report, indent=2).encode())
    atomic_write_bytes(out_dir / "gpu_paths.md", markdown(report).encode())


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: hardware, versions and command, then each step's table and the goals."""
    hw = report["hardware"]
    lines = [f"# Both decode paths: LlamaGen T2I-{report['model']['gpt_size']} ({report['model']['dtype']}, "
             f"{report['model']['image_tokens']} image tokens, random weights)", "",
             f"Hardware: {hw.get('gpu') or 'CPU ' + str(hw.get('cpu'))}"
             + (f", CUDA {hw.get('cuda')}, driver {hw.get('driver')}" if hw.get("gpu") else "")
             + f"; torch {report['versions']['torch']}, Python {report['versions']['python']}; {report['date']}.",
             f"Command: `{report['command']}`", ""]
    if report["cpu_dry_run"]:
        lines += ["**CPU dry run** (`--allow-cpu`, the tiny model): nothing was captured; these numbers only test "
                  "the script.", ""]
    lines += ["| step | status | s |", "|---|---|---|"]
    lines += [f"| {k} | {v['status']}{' (' + v['error'] + ')' if 'error' in v else ''} | {v['seconds']:.1f} |"
              for k, v in report["steps"].items()]
    res = report["results"]
    if "ar" in res:
        lines += ["", "AR at batch 1:", "", "| path | s / image | ms / step | tokens equal the eager path's |",
                  "|---|---|---|---|"]
        lines += [f"| {p} | {r['s_per_image']:.3f} | {r['ms_per_step']:.2f} | "
                  f"{r.get('tokens_equal_eager', '—')} |" for p, r in res["ar"].items()]
    if "blocks" in res:
        b = res["blocks"]
        lines += ["", "Captured forwards after 512 tokens:", "", "| block | ms | × 1-token forward |", "|---|---|---|",
                  f"| 1 token | {b['forward_1_ms']:.3f} | 1.00 |",
                  f"| chain verify ({DRAFT_LEN + 1} tokens) | {b['verify_chain_ms']:.3f} | "
                  f"{b['verify_chain_ratio']:.2f} |",
                  f"| tree verify (26 nodes) | {b['verify_tree_26_ms']:.3f} | {b['verify_tree_26_ratio']:.2f} |"]
    if "iterations" in res:
        lines += ["", "ms per iteration at batch 1:", "",
                  "| path | SD (chain) | COOL-SD (chain) | SD (EAGLE-1 tree) | COOL-SD (EAGLE-1 tree) | SJD (window 16) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {p} | " + " | ".join(f"{r[n]['ms_per_iteration']:.2f}" for n in ITERATED) + " |"
                  for p, r in res["iterations"].items()]
    if "projection" in res:
        lines += ["", "Projected speedup over AR on the same path at the papers' accepted lengths:", "",
                  "| path / method | τ (source) | ms / iteration | projected speedup |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['tau']} ({v['source']}) | {v['ms_per_iteration']:.2f} | "
                  f"{v['projected_speedup']:.2f}× |" for k, v in res["projection"].items()]
    if "throughput" in res:
        lines += ["", "AR throughput:", "", "| path, batch | images / s | peak memory (GB) |", "|---|---|---|"]
        lines += [f"| {k} | {v['images_per_s']:.3f} | "
                  f"{'—' if v['peak_memory_gb'] is None else format(v['peak_memory_gb'], '.1f')} |"
                  for k, v in res["throughput"].items()]
    lines += ["", "Goals:", ""]
    for goal, state in report.get("goals", {}).items():
        lines.append(f"- {goal}: " + ("not measured" if state is None else
                                       f"{'met' if state['met'] else 'not met'} ({state['value']})"))
    return "\n".join(lines) + "\n"
