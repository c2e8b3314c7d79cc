"""The start-up self-check of batch invariance, and a signature of this machine's float32 arithmetic.

The harness promises that an image depends only on its prompt, seed and config: bitwise the same alone, inside
any batch and after a resume. On a CPU that rests on the BLAS library's kernel choice, which depends on the
shape **and on the CPU's vendor and instruction set** (``coolsd.models.base.batch_invariant_linears``), so the
promise is measured on the machine that runs, not assumed. ``check_batch_invariance`` runs a few rows of the
run's own target model (eight check prompts, a ragged sequence of 1-, 5- and 3-token blocks whose rows keep
different numbers of tokens) once as a batch of eight and once in sub-batches of one to three images, inside
``padding_invariant_attention`` exactly as the speculative decoders verify, and compares the logits bit by bit.

* ``batch_invariant``: every sub-batch's logits equal the batch's rows bitwise. Where it is false the run says
  so once, and only the weaker property holds: logits within float32 rounding (``max_rel_diff``, measured
  here) and, on the default run, the same tokens for most images (``README``, "Bitwise reproducibility").
* ``signature``: SHA-1 of the batch's logits bits. Two machines with equal signatures computed the same bits
  for the same inputs; machines with different signatures (another CPU kind, another thread count, CUDA)
  may give an image other tokens. The run records both in ``run.json`` and in every record fingerprint, so a
  resume or a shard merge across machines that disagree is recorded and marked (``eval.numerics_mismatch=accept``,
  the default) or refused (``refuse``).

Example: ``check_batch_invariance(model).batch_invariant`` -> True on this project's CPUs (``run.json``
``numerics``); ``python -m pytest -m invariance`` runs the tests that branch on it.
"""
from __future__ import annotations

import hashlib
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from coolsd.kv_cache import padding_invariant_attention

#: prompts of the self-check for models that take text (class-conditional models use their class names)
CHECK_TEXTS = ("a photo of a cat", "a red bus on a street", "two people on a beach", "a bowl of fruit",
               "a city at night", "a dog in the snow", "a wooden table", "a mountain lake")
#: the sub-batches (original row indices) compared with the batch of eight, and the ragged block schedule
CHECK_SUBSETS = ((3,), (0,), (2, 5), (7, 1, 4))
CHECK_BLOCKS = (1, 5, 3)


@dataclass(frozen=True)
class NumericsCheck:
    """The self-check's outcome on this machine (``check_batch_invariance``)."""

    batch_invariant: bool
    max_rel_diff: float  # max over comparisons of |sub − batch|∞ / |batch|∞ (0.0 when invariant)
    signature: str  # SHA-1 of the batch's logits bits
    platform: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def fingerprint(self) -> dict[str, Any]:
        """What a record's tokens depend on: whether the promise holds here, and this machine's arithmetic."""
        return {"batch_invariant": self.batch_invariant, "signature": self.signature}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        where = self.platform.get("cpu") or self.platform.get("device", "?")
        return (f"{where} ({self.platform.get('device')}, {self.platform.get('capability')}, "
                f"{self.platform.get('threads')} threads)")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def platform_facts(device: torch.device) -> dict[str, Any]:
    """What the arithmetic of a forward depends on besides the code: device, CPU, kernel libraries, threads."""
    facts: dict[str, Any] = {
        "device": str(device),
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
    }
    for key in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE"):
        if os.environ.get(key):
            facts[key] = os.environ[key]
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
    return facts


def check_prompts(model, n: int) -> list[str]:
    """``n`` prompts the model accepts: its ``check_prompts`` or class names, cycled, else ``CHECK_TEXTS``."""
    names = list(getattr(model, "check_prompt_set", None) or getattr(model, "class_names", None) or CHECK_TEXTS)
    return [names[i % len(names)] for i in range(n)]


def _ragged_logits(model, prompts: list[str], rows: list[int], blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits (S, b, T, V) of the prefill and of each block for the images ``rows`` of the check batch; after
    the middle block every image keeps its own number of tokens (1 + row % 4), so later blocks are ragged."""
    cache, out = model.prefill([prompts[i] for i in rows], extra_slots=max(b.shape[1] for b in blocks) + 1)
    outs = [out.logits]
    device = model.device
    pos = torch.zeros(len(rows), dtype=torch.long, device=device)
    for k, tokens in enumerate(blocks):
        t = tokens.shape[1]
        positions = pos[:, None] + torch.arange(t, device=device)
        outs.append(model.forward_block(cache, tokens[rows].to(device), positions).logits.float())
        kept = [1 + r % 4 for r in rows] if k == 1 else [t] * len(rows)
        cache.keep(kept)
        pos = pos + torch.tensor(kept, device=device)
    return outs


@torch.inference_mode()
def check_batch_invariance(model, batch: int = 8, seed: int = 0) -> NumericsCheck:
    """Run the self-check on ``model`` (an ``ImageARModel``) in its dtype, on its device (module doc)."""
    start = time.perf_counter()
    prompts = check_prompts(model, batch)
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randint(0, model.codebook_size, (batch, t), generator=gen) for t in CHECK_BLOCKS]
    invariant, worst = True, 0.0
    with padding_invariant_attention(bool(getattr(model, "batch_invariant", True))):
        full = _ragged_logits(model, prompts, list(range(batch)), blocks)
        for subset in CHECK_SUBSETS:
            rows = [r for r in subset if r < batch]
            for part, whole in zip(_ragged_logits(model, prompts, rows, blocks), full):
                whole = whole[:, rows]
                if not torch.equal(part, whole):
                    invariant = False
                    scale = whole.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
                    worst = max(worst, float((part - whole).abs().max() / scale))
    digest = hashlib.sha1()
    for logits in full:
        digest.update(logits.float().contiguous().cpu().numpy().tobytes())
    return NumericsCheck(batch_invariant=invariant, max_rel_diff=worst, signature=digest.hexdigest(),
                         platform=platform_facts(model.device), seconds=time.perf_counter() - start)
