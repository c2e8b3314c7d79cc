"""The GPU smoke test: a user's first minutes on a GPU node, one command, a pass/fail table.

Each check runs the harness's own code on CUDA and says ``pass``, ``fail`` (with the error's last line) or
``skip`` (with the reason); one failing check does not stop the others. The checks:

* ``tiny_models``: the small models of ``configs/model/`` (the embedded model with its trained weights, and
  the random-weight tiny LlamaGen T2I, Janus-Pro and Lumina-mGPT) generate with the default run's decoders on
  CUDA: a batch of four images per decoder, and the first image again alone. Passes when every decoder
  finishes with tokens inside the codebook; says how many images decoded alone equal their batch rows
  (CUDA kernels are chosen by shape, so equality is reported, not required) and each decoder's mean accepted
  length.
* ``ranks``: ``run.py`` on the tiny LlamaGen T2I under ``torchrun`` with one process per GPU (two at most, so
  NCCL carries the start-up collectives when the node has two GPUs), against the same run in one plain
  process: the records (tokens, accepted lengths) must be equal. On a one-GPU node the run has one rank and
  NCCL's collectives are checked on their own at world size 1 (NCCL does not put two ranks on one GPU).
* ``bf16_self_check``: the start-up self-check (``coolsd.numerics.check_batch_invariance``) of the embedded
  model and the tiny LlamaGen T2I in bf16 on CUDA. Passes when it runs and every sub-batch's logits stay
  within bf16 rounding of the batch's (``BF16_TOLERANCE``); says whether they were bitwise equal.
* ``bf16_acceptance``: the trained embedded model's mean accepted length per decoder (SD, COOL-SD, LANTERN,
  LANTERN++, SJD) in float32 and in bf16 on the same prompts and seeds (256 images each by default): passes
  when no paired bootstrap difference is significant after Holm's correction (family-wise false alarm 5 %,
  bootstrap seed 0, 2,000 resamples); the table gives both means and the difference's 95 % interval.
* ``compiled``: ``model.compile=true`` (CUDA graphs through ``reduce-overhead``) against eager on the embedded
  model: the logits of a teacher-forced block within float32 rounding (``COMPILED_TOLERANCE``), then AR and
  SD images from both; the count of images with equal tokens is reported (a fused kernel may move a last bit
  and with it a near-tie).
* ``bench``: ``scripts/bench.py bench=embedded_random`` on CUDA (two images per decoder, throughput at
  B = 1 and 8): the bench preset runs end to end and writes its table.

Without CUDA it stops at once with ``coolsd.device.cuda_diagnosis`` (which build, which driver).
``allow_cpu=True`` (``--allow-cpu``) runs the same checks on the CPU, gloo instead of NCCL: only for testing
this module on a machine without a GPU; its table says so.

Example: ``python scripts/gpu.py --steps smoke --out gpu_run`` (writes ``gpu_run/smoke/gpu_smoke.{md,json}``; it
composes Hydra configs, so on an offline node it needs the carried wheels, ``eval.bench.gpu.node``).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.device import cuda_available, cuda_diagnosis
from coolsd.io import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
#: the small models of ``tiny_models`` and the decoders each runs (the default run's six)
TINY_MODELS = ("embedded", "llamagen_t2i_tiny", "janus_tiny", "lumina_tiny")
DECODERS = ("ar", "sd", "lantern", "lantern_pp", "coolsd", "sjd")
CHECKS = ("tiny_models", "ranks", "bf16_self_check", "bf16_acceptance", "compiled", "bench")
#: largest |sub-batch − batch| / max |batch| of the bf16 self-check that counts as rounding (bf16 keeps 8
#: significant bits: one rounding of a logit of the largest magnitude is 2^-8 ≈ 0.004 of it; a few layers of
#: sums reordered by another kernel move a logit by a few such steps)
BF16_TOLERANCE = 0.05
#: largest |compiled − eager| / max |eager| of a float32 teacher-forced block that counts as rounding
COMPILED_TOLERANCE = 1e-4
#: the run of the ``ranks`` check (tiny LlamaGen T2I, two decoders, four prompts, no metrics)
RANKS_ARGS = ("model=llamagen_t2i_tiny", "logger=none", "eval=quick", "eval.num_prompts=4", "eval.warmup=0",
              "eval.reuse_ar=false", "compare=[sd]", "data=fixed", "data.prompts=[a red bus,a cat,a bowl]")


def require_cuda(allow_cpu: bool) -> torch.device:
    """CUDA's device, or a ``SystemExit`` that says why there is none (``allow_cpu``: the CPU instead)."""
    if cuda_available():
        return torch.device("cuda")
    if allow_cpu:
        return torch.device("cpu")
    raise SystemExit("gpu_smoke: no usable CUDA device, so there is nothing to smoke-test here: "
                     f"{cuda_diagnosis()}. Run it on a GPU node (e.g. srun --gpus=1 python scripts/gpu.py --steps smoke); "
                     "the CPU path is covered by python -m pytest")


def composed(overrides: list[str], config: str = "config"):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=config, overrides=overrides)


def build(model_name: str, device: torch.device, *overrides: str):
    """The model ``model_name`` on ``device`` and the default run's decoders over it, as ``run.py`` builds them."""
    from eval.run.suite import select_decoders

    cfg = composed([f"model={model_name}", f"model.device={device.type}", "compare=all", *overrides])
    model = instantiate(cfg.model)
    decoders = {name: instantiate(dc, model=model) for name, dc in select_decoders(cfg, False).items()}
    prompts = instantiate(cfg.data).load(model, 4)
    return model, decoders, prompts


# -- the checks ----------------------------------------------------------------------------------------------------
def check_tiny_models(device: torch.device, out: Path) -> str:
    lines = []
    for name in TINY_MODELS:
        model, decoders, prompts = build(name, device)
        for dec_name in DECODERS:
            dec = decoders[dec_name]
            batch = dec.generate_batch(prompts, [0, 1, 2, 3])
            alone = dec.generate(prompts[0], 0)
            for gen in [*batch, alone]:
                t = gen.tokens
                if t.numel() != model.num_image_tokens or int(t.min()) < 0 or int(t.max()) >= model.codebook_size:
                    raise AssertionError(f"{name}/{dec_name}: tokens {tuple(t.shape)} outside [0, "
                                         f"{model.codebook_size}) or not {model.num_image_tokens} long")
            same = int(torch.equal(alone.tokens.cpu(), batch[0].tokens.cpu()))
            tau = sum(g.stats.mean_accepted_length for g in batch) / len(batch)
            lines.append(f"{name}/{dec_name}: tau {tau:.2f}, alone = batch row {same}/1")
        del model, decoders
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "tiny_models.txt").write_text("\n".join(lines) + "\n")
    equal = sum(ln.endswith("row 1/1") for ln in lines)
    return (f"{len(TINY_MODELS)} models x {len(DECODERS)} decoders finished on {device.type}; image 0 alone = its "
            f"batch row for {equal}/{len(lines)}; " + "; ".join(ln.split(",")[0] for ln in lines if "/sd:" in ln)
            + " (tiny_models.txt)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without another launcher's placement, offline, plus ``extra``."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return {**env, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", **extra}


def run_command(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """Run ``args`` in the repository, its output into ``log``; raise with the output's last line if it fails."""
    with open(log, "w") as fh:
        proc = subprocess.run(args, cwd=ROOT, env=env or child_env(), stdout=fh, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(args[:4])} ... exited with {proc.returncode}: {tail[0]} (log: {log})")


def nccl_world_one(device: torch.device) -> str:
    """The start-up collectives of ``eval.run.shards.Shards`` through a process group of one rank (NCCL on
    CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = tempfile.NamedTemporaryFile(delete=False)
    store.close()
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        box = [{"folder": "x", "attempt": 7}]
        dist.broadcast_object_list(box, src=0)
        gathered = [None]
        dist.all_gather_object(gathered, "sig")
        dist.barrier()
        if box[0] != {"folder": "x", "attempt": 7} or gathered != ["sig"]:
            raise AssertionError(f"{backend} collectives at world size 1 returned {box}, {gathered}")
    finally:
        dist.destroy_process_group()
        Path(store.name).unlink(missing_ok=True)  # the file store removes its file when the group ends
    return backend


def check_ranks(device: torch.device, out: Path) -> str:
    from eval.records.image_records import load_records

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    nproc = 2 if gpus >= 2 or device.type == "cpu" else 1
    one, many = out / "ranks_one", out / "ranks_torchrun"
    dev = f"model.device={device.type}"
    run_command([sys.executable, "run.py", *RANKS_ARGS, dev, f"hydra.run.dir={one}"], out / "ranks_one.log", 600)
    run_command([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                 f"--master_port={free_port()}", "run.py", *RANKS_ARGS, dev, f"hydra.run.dir={many}",
                 "dist.poll_s=0.5"], out / "ranks_torchrun.log", 600)
    compared = 0
    for name in ("ar", "sd"):
        a, b = load_records(one / "records", name), load_records(many / "records", name)
        if sorted(a) != sorted(b) or not a:
            raise AssertionError(f"{name}: records {sorted(a)} in one process, {sorted(b)} under torchrun")
        for i in a:
            if a[i]["tokens"] != b[i]["tokens"] or a[i]["stats"]["accepted_hist"] != b[i]["stats"]["accepted_hist"]:
                raise AssertionError(f"{name} image {i}: tokens or accepted lengths differ between one process and "
                                     f"{nproc} torchrun rank(s)")
            compared += 1
    world = json.loads((many / "run.json").read_text())["world_size"]
    text = f"{compared} records equal: one process vs torchrun with {world} rank(s)"
    if world == 1:
        backend = nccl_world_one(device)
        text += f"; one GPU, so {backend} collectives checked at world size 1 (two ranks need two GPUs)"
    else:
        text += " (" + ("NCCL" if device.type == "cuda" else "gloo") + ")"
    return text


def check_bf16(device: torch.device, out: Path) -> str:
    from coolsd.numerics import check_batch_invariance

    parts, worst = [], 0.0
    for name in ("embedded", "llamagen_t2i_tiny"):
        cfg = composed([f"model={name}", f"model.device={device.type}", "model.dtype=bfloat16"])
        model = instantiate(cfg.model)
        result = check_batch_invariance(model)
        worst = max(worst, result.max_rel_diff)
        parts.append(f"{name}: {'bitwise' if result.batch_invariant else 'not bitwise'}, max rel diff "
                     f"{result.max_rel_diff:.2e}")
    if worst > BF16_TOLERANCE:
        raise AssertionError("; ".join(parts) + f": over bf16 rounding ({BF16_TOLERANCE})")
    return "; ".join(parts)


def check_compiled(device: torch.device, out: Path) -> str:
    eager, dec_eager, prompts = build("embedded", device)
    compiled, dec_compiled, _ = build("embedded", device, "model.compile=true")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, eager.codebook_size, (2, 12), generator=gen).to(device)
    with torch.inference_mode():
        a = eager.teacher_force(prompts[:2], tokens)
        b = compiled.teacher_force(prompts[:2], tokens)
        b = compiled.teacher_force(prompts[:2], tokens)  # a second call: the captured graphs replay
    rel = float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30))
    same, total = {}, 8
    for name in ("ar", "sd"):
        same[name] = sum(int(torch.equal(dec_eager[name].generate(prompts[i % 4], i).tokens,
                                         dec_compiled[name].generate(prompts[i % 4], i).tokens))
                         for i in range(total))
    text = (f"teacher-forced logits max rel diff {rel:.2e}; same tokens as eager: "
            + ", ".join(f"{n} {k}/{total}" for n, k in same.items()))
    if not rel <= COMPILED_TOLERANCE:
        raise AssertionError(text + f": over float32 rounding ({COMPILED_TOLERANCE})")
    return text


#: the decoders whose acceptance ``bf16_acceptance`` compares, and the bootstrap of its paired differences
ACCEPTANCE_DECODERS = ("sd", "coolsd", "lantern", "lantern_pp", "sjd")
ACCEPTANCE_BOOTSTRAP = {"resamples": 2000, "seed": 0, "level": 0.95}


def acceptance_by_dtype(device: torch.device, images: int, batch: int = 64) -> dict[str, Any]:
    """Mean accepted length of each of ``ACCEPTANCE_DECODERS`` on the trained embedded model in float32 and in
    bf16 (same prompts, seeds 0..images−1), and the paired bootstrap difference bf16 − float32 per decoder
    with Holm-adjusted p-values (family-wise false alarm 5 % over the decoders; seed and resamples in
    ``ACCEPTANCE_BOOTSTRAP``). Pairs diverge once a token differs, so the test compares the two precisions'
    acceptance statistics, not their tokens."""
    from eval.metrics.intervals import Bootstrap, holm, paired_bootstrap

    taus: dict[str, dict[str, list[float]]] = {}
    for dtype in ("float32", "bfloat16"):
        model, decoders, _ = build("embedded", device, f"model.dtype={dtype}")
        names = list(model.class_names)
        prompts = [names[i % len(names)] for i in range(images)]
        for name in ACCEPTANCE_DECODERS:
            got = taus.setdefault(name, {}).setdefault(dtype, [])
            for start in range(0, images, batch):
                seeds = list(range(start, min(start + batch, images)))
                got += [g.stats.mean_accepted_length
                        for g in decoders[name].generate_batch(prompts[start:start + len(seeds)], seeds)]
    boot = Bootstrap(**ACCEPTANCE_BOOTSTRAP)
    rows = {name: {"tau_float32": sum(t["float32"]) / images, "tau_bfloat16": sum(t["bfloat16"]) / images,
                   **paired_bootstrap(t["bfloat16"], t["float32"], boot, f"bf16_acceptance/{name}")}
            for name, t in taus.items()}
    for name, p in zip(rows, holm([r["p"] for r in rows.values()])):
        rows[name]["p_holm"] = p
        rows[name]["agree"] = p is None or p >= 0.05
    return {"images": images, "bootstrap": ACCEPTANCE_BOOTSTRAP, "decoders": rows}


def check_bf16_acceptance(device: torch.device, out: Path, images: int = 256) -> str:
    result = acceptance_by_dtype(device, images)
    (out / "bf16_acceptance.json").write_text(json.dumps(result, indent=2) + "\n")
    parts = [f"{n} {r['tau_float32']:.3f} -> {r['tau_bfloat16']:.3f} (diff {r['difference']:+.3f}, CI "
             f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}], Holm p {r['p_holm']:.3f})" if r["ci"] else f"{n}: too few images"
             for n, r in result["decoders"].items()]
    text = f"embedded model, {images} images per decoder and precision, accepted length fp32 -> bf16: " + "; ".join(parts)
    differ = [n for n, r in result["decoders"].items() if not r["agree"]]
    if differ:
        raise AssertionError(text + f". bf16 changes the acceptance of {differ} (Holm-adjusted p < 0.05)")
    return text


def check_bench(device: torch.device, out: Path) -> str:
    name = f"embedded_random_{device.type}_smoke"
    run_command([sys.executable, "scripts/bench.py", "bench=embedded_random", f"model.device={device.type}",
                 "images=2", "cost.repeats=5", "throughput.batch_sizes=[1,8]", "throughput.images=8",
                 f"out_dir={out}", f"name={name}"], out / "bench.log", 900)
    record = json.loads((out / f"{name}.json").read_text())
    ar = record["decoders"]["ar"]
    return (f"bench=embedded_random on {record['setup']['device']}: AR {1e3 * ar['latency_s']:.0f} ms/img, "
            f"{len(record['decoders'])} decoders, {len(record['goals'])} goals checked ({name}.md)")


CHECK_FUNCTIONS: dict[str, Callable[[torch.device, Path], str]] = {
    "tiny_models": check_tiny_models, "ranks": check_ranks, "bf16_self_check": check_bf16,
    "bf16_acceptance": check_bf16_acceptance, "compiled": check_compiled, "bench": check_bench}


def run_smoke(out: Path, checks: list[str] | None = None, allow_cpu: bool = False,
              acceptance_images: int = 256) -> dict[str, Any]:
    """Run ``checks`` (default: all of ``CHECKS``) and write ``<out>/gpu_smoke.{md,json}``; returns the record.
    ``acceptance_images``: images per decoder and precision of ``bf16_acceptance``."""
    device = require_cuda(allow_cpu)
    checks = list(checks or CHECKS)
    unknown = [c for c in checks if c not in CHECK_FUNCTIONS]
    if unknown:
        raise SystemExit(f"gpu_smoke: unknown checks {unknown}; choose from {list(CHECKS)}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in checks:
        start = time.perf_counter()
        try:
            run = CHECK_FUNCTIONS[name]
            detail = run(device, out, acceptance_images) if name == "bf16_acceptance" else run(device, out)
            status = "pass"
        except Exception as err:  # one failing check does not stop the others; the table says why
            status, detail = "fail", f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            (out / f"{name}.error.txt").write_text(traceback.format_exc())
        rows.append({"check": name, "status": status, "seconds": round(time.perf_counter() - start, 1),
                     "detail": detail})
        print(f"[gpu_smoke] {name}: {status} ({rows[-1]['seconds']} s) {detail}", flush=True)
    from eval.records.environment import environment, git_commit

    record = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
              "gpus": torch.cuda.device_count() if device.type == "cuda" else 0, "torch": torch.__version__,
              "cuda": torch.version.cuda, "checks": rows, "passed": all(r["status"] == "pass" for r in rows),
              "git": git_commit(), "environment": environment(),
              "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_bytes(out / "gpu_smoke.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(out / "gpu_smoke.md", markdown(record).encode())
    return record


def markdown(record: dict[str, Any]) -> str:
    where = record["gpu"] or "the CPU (--allow-cpu: a test of this script, not a GPU smoke test)"
    lines = [f"# GPU smoke test: {where}", "",
             f"torch {record['torch']}, CUDA {record['cuda']}, {record['gpus']} GPU(s), git "
             f"{str(record['git'].get('commit'))[:10]}{' (dirty)' if record['git'].get('dirty') else ''}, "
             f"{record['finished']}", "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    for r in record["checks"]:
        lines.append(f"| {r['check']} | {r['status'].upper()} | {r['seconds']} | {r['detail'].replace('|', '/')} |")
    lines += ["", "All checks passed." if record["passed"] else "Some checks FAILED: the `<check>.error.txt` files "
              "beside this table hold their tracebacks."]
    return "\n".join(lines) + "\n"
