"""Peer glue, not yet written: PJD (Liao, Li, Jian & Wang, parallel Jacobi decoding, arXiv 2606.05703, CVPR 2026) as
published in ``boyaliao/PJD``, its Lumina-mGPT path, against our ``decoder=pjd`` (``coolsd.orders.RowJacobi``).

**Not run** (``SPEC.not_run``): the repository could not be cloned on the machine that last wrote the peer table
(github.com was unreachable from it; the project's fetch service had no snapshot of it either). Its files were read
one by one through a code index (``docs/reference/spatial-parallel-decoding.md``: the scheduler and scripts at
``e7b93ad``, the Lumina-mGPT files at ``187f1bf``), which gives no git checkout at one commit to write and check a
glue against, and the comparison refuses anything else (``comparison.check_checkout``). So this module holds the
pair, the pinned commit and what the glue must do, and ``export``/``inputs``/``build`` refuse with that reason.

What the glue is to run (the peer of ``sjd.py``, whose weight handover, conditioning and Lumina overrides it reuses):

* **Their side.** ``generate_lumina_mgpt.py``'s path: ``lumina_mgpt.inference_solver.FlexARInferenceSolver`` made a
  PJD pipeline by ``scheduler.jacobi_iteration_lumina_mgpt.renew_pipeline_sampler`` (``renew_pipeline``,
  ``renew_sampler`` -> ``JacobiSampler``, ``renew_backbone``; ``prefix_token_sampler_scheme='speculative_jacobi'``,
  ``multi_token_init_scheme='random'``, their vendored ``modeling_chameleon.py``), its ``generate`` with the logits
  processors of ``create_logits_processor`` (``MultiModalLogitsProcessor_JACOBI``,
  ``MultiTokensInterleavedTopKLogitsWarper``), without the text tokenizer and the VQGAN (our prompt ids, as
  ``sjd.py``). Patched at run time, as the issue allows, only: CUDA device calls (``patches.py``) and the missing
  script entry point (``scripts/gen_lumina_mgpt.sh`` calls a ``generate_images.py`` the repository lacks; the
  glue calls ``generate`` itself, as ``generate_lumina_mgpt.py`` does). Their side needs transformers 4.47.1 and
  absl (the peer venv); which CUDA calls need redirecting (``SPEC.patches``) is known once it runs.
* **Their constants.** ``JacobiSampler._init_new_params`` hard-codes the window (``window_size`` 8 inputs: the
  anchor and 7 drafts) and the start threshold (``long_size`` 9: a row starts once the row above has 8 image
  tokens), and the grid of a 768-px image (``tokens_per_row``); the scripts' window and threshold arguments are
  parsed and dropped. The tiny Lumina model must therefore have their row length, and ours runs with
  ``decoder.order.context=8 decoder.order.draft_window=8`` (the pair's overrides).
* **Where their rule differs from ours** (each to show in the accepted lengths, as the other peers' differences
  do): their row-causal mask accumulates each row's query offset, so only the second active row is masked as
  the paper says and lower rows see the drafts above them; a rejected row keeps an old draft and its ``q`` where
  ``p/q > 0.5`` (SJD refreshes it); their random drafts are drawn unseeded (``torch.randint``); their CFG masks the
  prompt of the unconditional stream and shifts its positions. Ours follows the paper (the intended mask, SJD's
  refresh, keyed draws).

Example (once a checkout at ``SPEC.commit`` can be had and the glue below is written)::

    python scripts/bench_peers.py --peer pjd=.peers/PJD --python pjd=.peers/venv/bin/python --prompts 20
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.sjd import LUMINA_OVERRIDES

#: why the pair is not measured (the table's "Not run")
NOT_RUN = ("not measured: no checkout of boyaliao/PJD could be had on the machine that wrote this table "
           "(github.com unreachable, no snapshot from the project's fetch service); its files were read one by one "
           "through a code index (docs/reference/spatial-parallel-decoding.md), which gives no git checkout at a "
           "commit to write and check the glue against (eval/bench/peers/pjd.py says what it must do)")

SPEC = PeerSpec(
    name="pjd",
    repo="boyaliao/PJD",
    commit="e7b93ad3c258b94af9786c22053ad7cc2df566f3",
    model="lumina_tiny",
    model_overrides=LUMINA_OVERRIDES,
    pairs=(
        Pair(ours="pjd", theirs="pjd (Lumina-mGPT path)",
             overrides=("decoder.order.context=8", "decoder.order.draft_window=8"),
             difference=("their row-causal mask accumulates row offsets (rows below the second see the drafts "
                         "above them), a rejected row keeps old drafts where p/q > 0.5, their random drafts are "
                         "unseeded, and their CFG masks the unconditional stream's prompt; ours: the paper's mask, "
                         "SJD's refresh, keyed draws")),
    ),
    patches=(),                                          # which CUDA calls need redirecting: known once it runs
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),   # their scheduler imports absl, as SJD's
    not_run=NOT_RUN,
    notes=(
        "Their Lumina-mGPT path (generate_lumina_mgpt.py: FlexARInferenceSolver made a PJD pipeline by "
        "scheduler/jacobi_iteration_lumina_mgpt.py renew_pipeline_sampler, speculative_jacobi, random init); "
        "scripts/gen_lumina_mgpt.sh calls a generate_images.py that is not in the repository (the entry point the "
        "glue supplies at run time, with the CUDA device calls: nothing else of theirs is patched).",
        "Their window (8 inputs: the anchor and 7 drafts) and start threshold (a row starts once the row above has 8 "
        "image tokens) are hard-coded (JacobiSampler._init_new_params), as is the 768-px grid; ours runs with "
        "decoder.order.context=8 decoder.order.draft_window=8 on a tiny model of their row length.",
    ),
)


def _refuse(*_: Any) -> Any:
    raise NotImplementedError(f"eval/bench/peers/pjd.py: {NOT_RUN}")


def export(ours: Any, pair: Pair) -> dict:
    """(Our process) weights and settings for their side: not written (``NOT_RUN``)."""
    return _refuse(ours, pair)


def inputs(ours: Any, prompt: str) -> object:
    """(Our process) one prompt's conditioning for their side: not written (``NOT_RUN``)."""
    return _refuse(ours, prompt)


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[object, int], PeerImage]:
    """(Worker) their decode of one image: not written (``NOT_RUN``)."""
    return _refuse(checkout, payload, pair)
