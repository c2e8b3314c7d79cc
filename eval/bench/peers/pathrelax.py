"""Peer glue: PathRelax, parallel-path relaxed speculative Jacobi decoding (Lei et al., arXiv 2606.10492), as
published in ``Haodong-Lei-Ray/PathSpec`` (a fork of the SJD code), on Lumina-mGPT; and the acceptance fixtures
made by their own verifier.

Their side is ``main.py`` with ``script/mscoco2017_pathspec.sh``'s settings (``--method speculative_jacobi --isp
random --static_tree --tree_choices Grouped_Tree_2``): their vendored Chameleon made a static-tree sampler by their
``renew_pipeline_sampler(..., static_tree=True)`` (``scheduler/jacobi_iteration_lumina_mgpt.py``:
``renew_static_tree_sampler``, ``renew_static_tree_backbone``), the logits processors of their
``create_logits_processor(static_tree=True)`` (``MultiTreeTokensVLLogitsProcessor``, the top-k warper) and
``generate`` with ``tree_choices = Grouped_Tree_2`` (``lumina_mgpt/data/drafters/choices.py``: two chains of 12
nodes under the root), as their ``inference_solver.generate`` does. Everything else is driven as
``eval/bench/peers/sjd.py`` and ``eval/bench/peers/scd.py`` drive the SJD code (``scd.build_lumina``: the stand-in
solver, our weights and prompt ids, our unconditional stream, the grid stopping criterion, forward counting); this
module holds only the difference: the tree options of their sampler and their generation config.

* **Settings.** Their window is the tree (``len(tree_choices) + 1`` inputs: the last token and 2 x 12 drafts;
  ``--num_init_new_token`` does not reach the tree loop), so ours runs ``decoder.draft_len=24
  decoder.drafter.paths=2 decoder.drafter.init=random``. Their script decodes the last 10 tokens of a 768 px image
  plainly (``jacobi_loop_interval_r``), but their tree loop never reads that bound (the line is commented out):
  every token after the first is decoded in the tree, as ours.
* **The acceptance fixtures** (``fixtures`` below): their ``scheduler/tree_until.py`` ``SpeculativeSampler.__call__``
  run on shared inputs, its verdicts written to ``tests/golden/pathrelax_acceptance.json`` so CI checks ours against
  theirs without their clone::

      python -m eval.bench.peers.pathrelax fixtures --peer <clone at SPEC.commit> \\
          --out tests/golden/pathrelax_acceptance.json

Example (the peer bench)::

    python scripts/bench_peers.py --peer pathrelax=.peers/PathSpec --python pathrelax=.peers/venv/bin/python
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.sjd import MODEL_OVERRIDES

REPO = "Haodong-Lei-Ray/PathSpec"
COMMIT = "8a3df48431ed38e70a349fbfad95642f3971dcf7"
SAMPLER_FILE = "scheduler/tree_until.py"
SAMPLER = "SpeculativeSampler.__call__"
#: their script's tree (--tree_choices Grouped_Tree_2): two chains of 12 under the root
TREE = "Grouped_Tree_2"
PATHS, DEPTH = 2, 12
#: their script's jacobi_loop_interval_r (768 px: 48 * 48 + 48 - 10); the tree loop never reads it, but the step
#: that starts the tree cuts the first tree to ``min(len(tree) + 1, interval_r)`` inputs
SCRIPT_INTERVAL_R = (768 // 16) ** 2 + 768 // 16 - 10

SPEC = PeerSpec(
    name="pathrelax",
    repo=REPO,
    commit=COMMIT,
    model="lumina_tiny",
    model_overrides=MODEL_OVERRIDES,
    pairs=(
        Pair(
            ours="pathrelax",
            theirs="PathSpec static tree (Grouped_Tree_2)",
            overrides=(f"decoder.draft_len={PATHS * DEPTH}", f"decoder.drafter.paths={PATHS}",
                       "decoder.drafter.init=random"),
            difference=("their tree counts end-of-row tokens as nodes (a fresh draft there is always rejected "
                        "and the forced end-of-row token committed in its place); ours drafts image codes only and "
                        "inserts each end-of-row token for free"),
        ),
    ),
    patches=("cuda_sync", "cuda_event"),
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),
    cpu="",
    notes=(
        "Their main.py path with script/mscoco2017_pathspec.sh's settings (--method speculative_jacobi --isp random "
        "--static_tree --tree_choices Grouped_Tree_2): their vendored Chameleon made a static-tree sampler by "
        "renew_pipeline_sampler(static_tree=True) (scheduler/jacobi_iteration_lumina_mgpt.py "
        "renew_static_tree_sampler, renew_static_tree_backbone), create_logits_processor(static_tree=True), "
        "transformers 4.47.1 generate with tree_choices=Grouped_Tree_2; driven as the SJD peers are "
        "(eval/bench/peers/scd.py build_lumina): our prompt ids and unconditional stream, stopped at the last "
        "image code.",
        "Their window is the tree: the last token and 2 x 12 drafts (--num_init_new_token does not reach the tree "
        "loop); ours runs decoder.draft_len=24 decoder.drafter.paths=2. Their script's jacobi_loop_interval_r "
        "(meant for plain decoding of the last 10 tokens) is passed as is: their tree loop does not read it.",
        "Their tree loop starts from the state a plain decode step leaves (their script decodes the header "
        "plainly, jacobi_loop_interval_l=3): init_successful = False and a 3-D attention mask. Ours forces the "
        "header, so the prefill is the only plain step (jacobi_loop_interval_l=0): the glue sets init_successful "
        "= False before each image and hands the first tree step the prefill mask's last row as (B, 1, keys), "
        "what a plain step leaves; nothing else of theirs is changed.",
        "Tiny Lumina as for SJD (eval/bench/peers/sjd.py): Chameleon's 8,192 codes, 4 key/value heads, image top-k "
        "2000, weights drawn at init_std=0.06; their side maps our size tokens to ids 8804 + units.",
        "Timed over their whole generate call (its setup included) to the commit of the last image code; their "
        "_sample's CUDA-event timer (cuda_event) and torch.cuda.synchronize() (cuda_sync) are patched.",
        "tokens = image codes (16 on the 4x4 grid), as our DecodeStats.num_tokens; end-of-row tokens count on "
        "neither side.",
        "Their residual after a rejection goes through their logits processors (the forced end-of-row token and "
        "top-k; a no-op on an image slot), their fresh drafts are unseeded torch.randint draws (the global "
        "generator, seeded by their set_seed), the carried drafts their own torch.multinomial samples.",
    ),
)


# -- the acceptance fixtures -------------------------------------------------------------------------------------
def their_sampler(checkout: Path) -> type:
    """Their ``SpeculativeSampler`` class, loaded from ``checkout/scheduler/tree_until.py`` alone (it needs only
    torch and numpy; the rest of their package needs transformers 4.47.1)."""
    path = Path(checkout) / SAMPLER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: clone {REPO} at {COMMIT} (git clone "
                                f"https://github.com/{REPO} <dir> && git -C <dir> checkout {COMMIT})")
    spec = importlib.util.spec_from_file_location("_pathspec_tree_until", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SpeculativeSampler


def round7(x: torch.Tensor) -> list:
    """``x`` as nested lists of floats rounded to 7 significant digits (the values the fixtures store)."""
    return [round7(row) for row in x] if x.dim() > 1 else [float(f"{v:.7g}") for v in x.tolist()]


def exact32(x: torch.Tensor) -> list:
    """A float32 ``x`` as nested lists of floats with 9 significant digits (each converts back to the same
    float32)."""
    return [exact32(row) for row in x] if x.dim() > 1 else [float(f"{v:.9g}") for v in x.tolist()]


def stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) moved to values that survive the fixture file: float32 of their 7-digit rounding, repeated
    until it no longer changes (a 7-digit decimal does not always come back from float32 as itself)."""
    while True:
        y = torch.tensor(round7(x), dtype=torch.float32)
        if torch.equal(y, x):
            return x
        x = y


def _dist(gen: torch.Generator, v: int, keep: int | None = None, sharp: float = 2.5) -> torch.Tensor:
    """A random distribution over ``v`` codes; ``keep``: only that many codes have mass (the others exactly 0)."""
    logits = torch.randn(v, generator=gen) * sharp
    if keep is not None:
        drop = torch.randperm(v, generator=gen)[keep:]
        logits[drop] = -float("inf")
    return torch.softmax(logits, -1)


def _pick(gen: torch.Generator, weights: torch.Tensor) -> int:
    return int(torch.multinomial(weights, 1, generator=gen))


def build_case(name: str, paths: int, depth: int, vocab: int, seed: int, script: Sequence[str] | None = None,
               soft: float = 0.5, keep: int | None = None, tags: Sequence[str] = ()) -> dict[str, Any]:
    """One case's inputs (module doc of ``fixtures``): ``paths`` chains of ``depth`` nodes under one root over
    ``vocab`` codes. ``script[k]`` forces path ``k``'s outcome node by node, one letter per node: ``a`` accepted
    whatever the uniform (its ``q`` is the target row it is tested against: ratio 1), ``r`` rejected whatever the
    uniform (the drafted code has target probability 0), ``z`` the drafted code has ``q = 0`` (``p > 0``: their
    ratio is inf, clamped to 1), ``Z`` both 0 (their ratio is nan: rejected), ``.`` free (a one-hot ``q`` with
    probability ``1 - soft``, on a uniform code or one drawn from the target's row, else a soft one near the
    target's row, the code drawn from it). Unscripted nodes are free. ``keep``: target
    rows (and soft ``q`` rows) have mass on only that many codes. Every probability is rounded to 7 significant
    digits before anything uses it, so the stored values are the ones their code ran on."""
    gen = torch.Generator().manual_seed(seed)
    l1 = depth + 1

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(round7(x), dtype=torch.float32)

    root_p = rounded(_dist(gen, vocab, keep))
    target = torch.stack([  # (P, L+1, V): column i = the distribution after node i
        torch.cat([root_p[None], rounded(torch.stack([_dist(gen, vocab, keep) for _ in range(depth)]))])
        for _ in range(paths)])
    root = _pick(gen, torch.ones(vocab))
    tokens = torch.zeros(paths, l1, dtype=torch.long)
    tokens[:, 0] = root
    q = torch.zeros(paths, l1, vocab)
    for k in range(paths):
        q[k, 0] = rounded(_dist(gen, vocab)) if _pick(gen, torch.tensor([1.0, 1.0])) else torch.eye(vocab)[root]
        plan = (script[k] if script else "").ljust(depth, ".")
        for i in range(1, l1):
            p = target[k, i - 1]  # node i is tested against the target's output at its parent
            how = plan[i - 1]
            if how == "a":
                x, row = _pick(gen, p), p.clone()
            elif how == "r":
                x = _pick(gen, (p == 0).float())
                row = torch.eye(vocab)[x] if _pick(gen, torch.tensor([1.0, 1.0])) else None
                if row is None:
                    weights = _dist(gen, vocab, keep)
                    weights[x] = weights.max()
                    row = rounded(weights / weights.sum())
            elif how in "zZ":
                x = _pick(gen, (p > 0).float() if how == "z" else (p == 0).float())
                weights = _dist(gen, vocab)
                weights[x] = 0.0
                row = rounded(weights / weights.sum())
            elif torch.rand(1, generator=gen).item() < soft:  # a carried draft: q near the target's row
                mix = 0.3 + 0.65 * torch.rand(1, generator=gen).item()
                row = rounded(mix * p + (1 - mix) * _dist(gen, vocab, keep))
                x = _pick(gen, row)
            else:  # a fresh draft: q one-hot on a uniform code, or on a likely one
                x = _pick(gen, p if _pick(gen, torch.tensor([1.0, 1.0])) else torch.ones(vocab))
                row = torch.eye(vocab)[x]
            tokens[k, i], q[k, i] = x, row
    q, target = stored(q), stored(target)
    return {"name": name, "tags": list(tags), "P": paths, "L": depth, "V": vocab, "seed": seed,
            "draft_tokens": tokens, "draft_prob": q, "target_prob": target}


def fixture_cases() -> list[dict[str, Any]]:
    """The ~40 cases: free ones (one-hot and soft ``q``, with and without zero-probability codes), forced ones
    (every path rejected at depth 1, one path or every path accepted whole, ties, a later path winning) and the two
    corner cases of a drafted code with ``q = 0``."""
    cases = []
    n = 0

    def add(name: str, paths: int, depth: int, vocab: int, **kw: Any) -> None:
        nonlocal n
        cases.append(build_case(f"{n:02d}_{name}", paths, depth, vocab, seed=1000 + n, **kw))
        n += 1

    for paths in (2, 3):
        for depth, vocab in ((12, 16), (4, 32)):
            for soft in (0.0, 0.5, 1.0):
                add(f"free_P{paths}_L{depth}_soft{soft:g}", paths, depth, vocab, soft=soft, tags=["free"])
            add(f"free_zeros_P{paths}_L{depth}", paths, depth, vocab, keep=5, tags=["free", "zeros"])
    for paths in (2, 3):
        for depth, vocab in ((12, 16), (4, 24)):
            add(f"all_reject_depth1_P{paths}_L{depth}", paths, depth, vocab, script=["r"] * paths, keep=6,
                tags=["forced", "zeros", "tie"])
    for depth, vocab, paths, winner in ((12, 16, 2, 0), (12, 16, 2, 1), (12, 16, 3, 2), (4, 24, 3, 1)):
        script = ["a" * depth if k == winner else "" for k in range(paths)]
        add(f"one_path_accepts_all_P{paths}_L{depth}_path{winner}", paths, depth, vocab, script=script,
            tags=["forced"])
    for depth, vocab, paths in ((12, 16, 2), (4, 24, 3)):
        add(f"every_path_accepts_all_P{paths}_L{depth}", paths, depth, vocab, script=["a" * depth] * paths,
            tags=["forced", "tie"])
    for depth, vocab, paths, at in ((12, 16, 2, 3), (12, 16, 3, 6), (4, 24, 2, 2), (4, 24, 3, 4)):
        add(f"tie_at_{at}_P{paths}_L{depth}", paths, depth, vocab, script=["a" * (at - 1) + "r"] * paths, keep=8,
            tags=["forced", "tie", "zeros"])
    add("later_paths_tie_P3_L12", 3, 12, 16, script=["aar", "aaaaar", "aaaaar"], keep=8,
        tags=["forced", "tie", "zeros"])
    add("last_path_longest_P3_L12", 3, 12, 16, script=["aaaar", "ar", "aaaaaaar"], keep=8,
        tags=["forced", "zeros"])
    add("first_path_longest_P2_L4", 2, 4, 24, script=["aaar", "ar"], keep=8, tags=["forced", "zeros"])
    for depth, vocab, paths, prefix in ((12, 16, 2, 3), (12, 20, 3, 5), (4, 24, 2, 1), (12, 16, 3, 8)):
        add(f"accepted_prefix_then_free_P{paths}_L{depth}_{prefix}", paths, depth, vocab,
            script=["a" * prefix] * paths, tags=["forced", "free"])
    add("zeros_soft_P2_L12", 2, 12, 16, soft=1.0, keep=4, tags=["free", "zeros"])
    add("zeros_soft_P3_L4", 3, 4, 32, soft=1.0, keep=3, tags=["free", "zeros"])
    add("zero_q_at_draft_P2_L4", 2, 4, 16, script=["aaz", "aZ"], keep=8, tags=["forced", "zeros", "q_zero_at_draft"])
    add("zero_q_at_draft_P3_L12", 3, 12, 16, script=["z", "aZ", "azz"], keep=8,
        tags=["forced", "zeros", "q_zero_at_draft"])
    return cases


def run_their_sampler(sampler_class: type, case: dict[str, Any], seed: int) -> dict[str, Any]:
    """Their ``SpeculativeSampler.__call__`` on one case, as their ``prefix_matching_next_tree_tokens`` calls it
    (every path a row of ``retrieve_indices``, no logits processor: the rule alone), with a generator seeded
    ``seed``. Returns their ``first_misaligned`` list, the path and count their caller commits, the uniform each
    node's test reads (regenerated from the generator's state before the call: their ``rs = torch.rand(shape,
    generator)`` comes first) and the residual each rejecting path's correction was drawn from (the
    ``resampled_scores`` of their ``reject_sampling_single_token``)."""
    tokens, q, p = case["draft_tokens"], case["draft_prob"], case["target_prob"]
    paths, l1, vocab = p.shape
    gen = torch.Generator().manual_seed(seed)
    state = gen.get_state()
    sampler = sampler_class(  # as their _sample builds it (their dtype: the input ids')
        generator=gen,
        reject_sampling_relative_ids=-torch.ones(1, dtype=torch.long),
        reject_sampling_draft_token_logits=torch.zeros((1, vocab), dtype=torch.long),
        sampling_last_draft_token=torch.zeros(1, dtype=torch.long),
    )
    residuals: list[torch.Tensor] = []
    single = sampler.reject_sampling_single_token

    def recording(*args: Any, **kwargs: Any) -> Any:
        token, scores = single(*args, **kwargs)
        residuals.append(scores.detach().clone())
        return token, scores

    sampler.reject_sampling_single_token = recording
    retrieve = torch.arange(paths * l1).view(paths, l1)  # every path full length (all indices >= 0)
    first, _, _ = sampler(draft_tokens=tokens.clone(), advanced_tokens=torch.zeros_like(tokens),
                          draft_prob=q.clone(), advanced_prob=p.clone(), logits_processor=None,
                          logits_warper=None, all_collected_input_ids=torch.zeros(1, 1, dtype=torch.long),
                          retrieve_indices=retrieve)
    first = [int(f) for f in first]
    replay = torch.Generator()
    replay.set_state(state)
    rs = torch.rand(p.shape, generator=replay)  # (P, L+1, V): their draw
    u = rs[torch.arange(paths)[:, None], torch.arange(1, l1)[None, :], tokens[:, 1:]]  # (P, L)
    rejected = [k for k in range(paths) if first[k] < l1]
    if len(rejected) != len(residuals):
        raise RuntimeError(f"{case['name']}: {len(residuals)} residuals for the rejecting paths {rejected}")
    per_path: list[torch.Tensor | None] = [None] * paths
    for k, r in zip(rejected, residuals):
        per_path[k] = r
    # the replayed uniforms must give their verdicts (u < min(1, p/q) in float32; nan fails)
    for k in range(paths):
        ratio = (p[k, torch.arange(l1 - 1), tokens[k, 1:]] / q[k, torch.arange(1, l1), tokens[k, 1:]]).clamp(max=1)
        passed = (u[k] < ratio).long().cumprod(0).sum().item()
        if passed + 1 != first[k]:
            raise RuntimeError(f"{case['name']}: path {k} passes {passed} nodes under the replayed uniforms, "
                               f"their code says {first[k] - 1}")
    best = max(first)
    chosen = first.index(best)
    return {"first_misaligned": first, "chosen_path": chosen, "matched_num": best, "u": u,
            "residual": per_path[chosen], "residual_per_path": per_path}


def fixtures(checkout: Path, command: str) -> dict[str, Any]:
    """Every case of ``fixture_cases`` with their sampler's verdicts (the JSON written by ``main``)."""
    sampler_class = their_sampler(checkout)
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if head != COMMIT:
        raise ValueError(f"{checkout} is at {head}; the fixtures are made at {COMMIT}: git -C {checkout} checkout "
                         f"{COMMIT}")
    out = []
    for case in fixture_cases():
        verdict = run_their_sampler(sampler_class, case, seed=case["seed"])
        for key in ("draft_prob", "target_prob"):   # what the file says is what their code ran on
            if not torch.equal(torch.tensor(round7(case[key]), dtype=torch.float32), case[key]):
                raise RuntimeError(f"{case['name']}: {key} does not survive its 7-digit rounding")
        out.append({
            "name": case["name"], "tags": case["tags"], "P": case["P"], "L": case["L"], "V": case["V"],
            "seed": case["seed"],
            "draft_tokens": case["draft_tokens"].tolist(),
            "draft_prob": round7(case["draft_prob"]),
            "target_prob": round7(case["target_prob"]),
            "u": exact32(verdict["u"]),
            "first_misaligned": verdict["first_misaligned"],
            "chosen_path": verdict["chosen_path"],
            "matched_num": verdict["matched_num"],
            "residual": None if verdict["residual"] is None else exact32(verdict["residual"]),
            "residual_per_path": [None if r is None else exact32(r) for r in verdict["residual_per_path"]],
        })
    return {
        "source": {"repo": REPO, "commit": head, "file": SAMPLER_FILE, "function": SAMPLER,
                   "caller": "scheduler/jacobi_iteration_lumina_mgpt.py renew_static_tree_sampler "
                             "prefix_matching_next_tree_tokens",
                   "command": command, "torch": torch.__version__},
        "schema": SCHEMA,
        "cases": out,
    }


SCHEMA = (
    "Per case: P paths of depth L under one root over V codes. draft_tokens (P, L+1) int, column 0 the root (the "
    "same for every path); draft_prob (P, L+1, V) each node's stored q (column 0 unused); target_prob (P, L+1, V), "
    "column i the target's distribution after node i (column 0, the root's output, the same for every path; "
    "column L is read by no test: the next token after a path accepted whole). Probabilities are float32 values "
    "rounded to 7 significant digits, not renormalised; their code ran on exactly these values in float32. "
    "Their test of node i (1..L) of path b: accept iff u[b][i-1] < min(1, target_prob[b][i-1][x] / "
    "draft_prob[b][i][x]) in float32, x = draft_tokens[b][i] (q = 0 and p > 0: inf, accepted; both 0: nan, "
    "rejected); u (P, L) the uniform their test read (their rs[b, i, x]; entries after a path's first failure were "
    "drawn but not read), 9 significant digits (exact float32). first_misaligned[b] = the depth of path b's first "
    "rejected node, L+1 when it accepted all (accepted drafts = first_misaligned - 1). chosen_path = the first "
    "index of the maximum, matched_num = that maximum (the tokens their caller commits: matched_num - 1 drafts and "
    "one more). residual (V,) = the distribution their code drew the chosen path's correction token from "
    "(softmax(log(clamp(p - q, min=0))) at its first rejected node, no logits processor), null when the chosen "
    "path accepted all (the next token is then drawn from target_prob[chosen_path][L]); residual_per_path the same "
    "for every path (null where it accepted all). Tags: free (outcomes decided by the uniforms), forced (scripted "
    "outcomes), tie, zeros (zero-probability codes), q_zero_at_draft (a drafted code with q = 0)."
)


# -- the peer bench: our process ------------------------------------------------------------------------------
def export(ours: Any, pair: Pair) -> dict:
    """Our tiny Lumina's weights under their vocabulary layout (``eval.bench.peers.scd.export_lumina``), after
    checking that ours runs their tree: ``PATHS`` chains of ``DEPTH``, fresh drafts uniform with a one-hot ``q``."""
    from eval.bench.peers.scd import export_lumina

    drafter = ours.drafter
    if (getattr(drafter, "paths", None), getattr(drafter, "init", None), int(ours.draft_len)) != (
            PATHS, "random", PATHS * DEPTH):
        raise ValueError(f"{pair.ours}: their {TREE} is {PATHS} paths of {DEPTH} with random fresh drafts: run "
                         f"decoder.drafter.paths={PATHS} decoder.draft_len={PATHS * DEPTH} decoder.drafter.init=random")
    return export_lumina(ours)


def inputs(ours: Any, prompt: str) -> dict:
    from eval.bench.peers.scd import lumina_inputs

    return lumina_inputs(ours, prompt)


# -- the peer bench: the worker -------------------------------------------------------------------------------
def their_tree(checkout: Path) -> list:
    """Their ``Grouped_Tree_2`` from ``lumina_mgpt/data/drafters/choices.py`` (as their main.py reads it)."""
    path = Path(checkout) / "lumina_mgpt" / "data" / "drafters" / "choices.py"
    spec = importlib.util.spec_from_file_location("_pathspec_choices", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, TREE)


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    """Their static-tree sampler on our weights: ``scd.build_lumina`` with their tree options."""
    from eval.bench.peers.scd import build_lumina

    if pair.theirs != SPEC.pairs[0].theirs:
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    tree = their_tree(checkout)
    if len(tree) + 1 != payload["window"]:
        raise ValueError(f"their {TREE} has {len(tree)} nodes; ours drafts {payload['window'] - 1}")
    options = {"jacobi_loop_interval_l": 0, "jacobi_loop_interval_r": SCRIPT_INTERVAL_R,
               "multi_token_init_scheme": "random", "prefix_token_sampler_scheme": "speculative_jacobi",
               "static_tree": True}
    decode = build_lumina(Path(checkout), payload, "scheduler.jacobi_iteration_lumina_mgpt", options,
                          processor_options={"static_tree": True},
                          generation_options={"static_tree": True, "tree_choices": tree})
    net = decode.target
    # Their tree loop takes the state a plain decode step leaves (their script decodes the image header plainly
    # first: jacobi_loop_interval_l=3): ``init_successful`` False and a (B, rows, keys) attention mask, whose last
    # row the first tree step extends. Ours forces the header, so the prefill (its mask (B, keys)) is the only plain
    # step: the glue leaves what a plain step would (nothing else of theirs changes).
    update = net._update_model_kwargs_for_generation

    def after_plain_step(outputs: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> dict:
        mask = model_kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and not kwargs.get("is_prefilling_phase", True):
            model_kwargs["attention_mask"] = mask[:, None, :]   # the one row a plain step's mask ends with
        return update(outputs, model_kwargs, *args, **kwargs)

    net._update_model_kwargs_for_generation = after_plain_step

    def call(cond: dict, seed: int) -> PeerImage:
        net.init_successful = False   # what their plain steps set, so that the first tree step builds the tree
        return decode(cond, seed)

    call.target = net   # their model: the anatomy pass times its forwards
    return call


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PathRelax peer glue: make the acceptance fixtures from their code.")
    sub = parser.add_subparsers(dest="what", required=True)
    make = sub.add_parser("fixtures", help="run their SpeculativeSampler on the shared cases; write the JSON")
    make.add_argument("--peer", required=True, help=f"a clone of {REPO} at {COMMIT}")
    make.add_argument("--out", default="tests/golden/pathrelax_acceptance.json")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m eval.bench.peers.pathrelax " + " ".join(argv)
    record = fixtures(Path(args.peer).expanduser().resolve(), command)
    cases = record.pop("cases")
    text = json.dumps(record, indent=1)[:-2] + ',\n "cases": [\n' + ",\n".join(
        json.dumps(c, separators=(",", ":")) for c in cases) + "\n ]\n}\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    chosen = sum(c["chosen_path"] > 0 for c in cases)
    print(f"wrote {out}: {len(cases)} cases ({chosen} won by a later path), {out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
