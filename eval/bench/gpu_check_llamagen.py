"""GPU check of the LlamaGen T2I-XL adapter at real size with random weights (no downloads).

Builds ``coolsd.models.llamagen_t2i.LlamaGenT2I`` with the GPT-XL architecture (36 layers, width 1280, 120
caption slots, VQ-16) and a stand-in random T5 of flan-t5-xl's width, on CUDA, then

* times the target's forwards at the CFG batch of 2 (median of ``--repeats`` after warm-up, synchronised):
  the 120-slot caption prefill, a 1-token block (an AR step) and a 25-token block (a draft tree);
* compares bf16 against float32 on the same weights over the prefill + a teacher-forced block of
  ``--tokens`` random image tokens: max / mean absolute logit difference (also relative to the mean
  |logit|), arg-max agreement per stream and position, and the mean total variation between the guided
  sampling distributions.

The output head is initialised like the other layers (the reference zero-initialises it, which would make
every logit 0). Numbers on random weights bound the numerics of the implementation, not image quality.

Example: ``python scripts/gpu.py --steps xl_numerics`` (the GPU command's named step; also run by
``pytest -m gpu tests/test_llamagen_t2i.py``).
"""
from __future__ import annotations

import statistics
import time

import torch

from coolsd.models.llamagen_t2i import LlamaGenT2I
from coolsd.sampling import stream_probs

PROMPT = "A blue Porsche 356 parked in front of a yellow brick wall."


def build(block_size: int, device: str, seed: int, gpt_size: str) -> LlamaGenT2I:
    return LlamaGenT2I(
        gpt={"model_type": "t2i", "vocab_size": 16384, "caption_dim": 2048, "cls_token_num": 120,
             "block_size": block_size},
        vq={"codebook_size": 16384, "codebook_embed_dim": 8},
        sampling={"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0},
        gpt_size=gpt_size, text_encoder="tiny_random", pretrained=False, init_seed=seed, init_std=0.02,
        zero_init_output=False, device=device, dtype="float32",
    )


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` (synchronising CUDA around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def timings(model: LlamaGenT2I, warmup: int, repeats: int) -> dict[str, float]:
    device = model.device
    cache, _ = model.prefill([PROMPT], extra_slots=64)
    base = cache.lengths[0]
    out = {"prefill_ms": time_ms(lambda: model.prefill([PROMPT], extra_slots=64), device, warmup, repeats)}
    for n in (1, 25):
        tokens = torch.randint(model.codebook_size, (1, n), device=device)
        positions = torch.arange(n, device=device)[None]

        def step(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions) -> None:
            cache.rollback(base)
            model.forward_block(cache, tokens, positions)

        out[f"forward_{n}_tokens_ms"] = time_ms(step, device, warmup, repeats)
    return out


@torch.inference_mode()
def teacher_forced(model: LlamaGenT2I, tokens: torch.Tensor) -> torch.Tensor:
    cache, first = model.prefill([PROMPT], extra_slots=0)
    block = model.forward_block(cache, tokens[None], torch.arange(tokens.shape[0], device=model.device)[None])
    return torch.cat([first.logits, block.logits], dim=2)[:, 0].float()  # (2, T + 1, V)


def run_check(block_size: int = 1024, device: str = "cuda", seed: int = 0, tokens: int = 64,
              warmup: int = 3, repeats: int = 20, gpt_size: str = "GPT-XL") -> dict:
    """Build, time and compare; returns the report (a flat dict of numbers). ``gpt_size`` other than
    GPT-XL and ``device="cpu"`` only serve to smoke-test this script without a GPU."""
    started = time.perf_counter()
    model = build(block_size, device, seed, gpt_size)
    name = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    report: dict = {
        "device": name, "gpt_size": gpt_size, "block_size": block_size, "torch": torch.__version__,
        "gpt_parameters_m": sum(p.numel() for p in model.gpt.parameters()) / 1e6,
        "build_s": time.perf_counter() - started,
    }
    ids = torch.randint(model.codebook_size, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    fp32 = teacher_forced(model, ids)
    report.update({f"fp32_{k}": v for k, v in timings(model, warmup, repeats).items()})
    model.to(torch.bfloat16)  # the same weights in bf16 (the RoPE table stays float32); the VQ back to fp32
    model.vq.float()
    bf16 = teacher_forced(model, ids)
    report.update({f"bf16_{k}": v for k, v in timings(model, warmup, repeats).items()})
    diff = (bf16 - fp32).abs()
    p32, p16 = stream_probs(fp32, model.sampling), stream_probs(bf16, model.sampling)  # (T + 1, V) guided
    report.update({
        "logit_abs_mean": float(fp32.abs().mean()),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "rel_max_abs_diff": float(diff.max() / fp32.abs().mean()),
        "rel_mean_abs_diff": float(diff.mean() / fp32.abs().mean()),
        "argmax_agreement": float((bf16.argmax(-1) == fp32.argmax(-1)).float().mean()),
        "guided_tv_mean": float(0.5 * (p32 - p16).abs().sum(-1).mean()),
        "positions_compared": int(fp32.shape[1]),
    })
    return report
