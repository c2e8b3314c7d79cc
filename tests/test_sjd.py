"""Speculative Jacobi decoding: exactness, Jacobi convergence on a deterministic model, window bookkeeping.

Statistical test: on the lookup model (3 codes, a 2x2 grid: 81 sequences, known exactly) we draw
``N_SAMPLES`` complete sequences with ``sjd`` for each initialisation and apply Pearson's chi-square
goodness-of-fit test (cells with expected count < 5 pooled). It fails when the p-value is below
``ALPHA = 1e-3``: for a correct implementation and random seeds that happens with probability 0.001 (the
false-alarm probability per test); the seeds are fixed (0 .. N_SAMPLES-1), so the outcome is deterministic.
A deliberately broken Jacobi update (carried drafts set to the arg-max of the stored ``p_{t−1}`` while still
claiming ``q = p_{t−1}``) must fail the same test. (Treating every draft as one-hot would *not* be a bug:
accepting a fixed token ``d`` with ``p(d)`` and otherwise sampling ``p`` without ``d`` outputs exactly ``p``.)

Runtime: about 35 s on one idle CPU thread (up to ~60 s on a shared machine).
"""
from __future__ import annotations

import json

import pytest
import torch

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.models.base import ImageARModel
from coolsd.models.llamagen import LlamaGen
from coolsd.models.lookup import LookupModel, TokenCache
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput
from tests.helpers import chi_square_pvalue, sequence_counts, tiny_llamagen
from tests.test_run import LOOKUP, run_py

ALPHA = 1e-3
N_SAMPLES = 4000
WINDOW = 16


class GreedyJacobiUpdate(JacobiDrafter):
    """A bug: carried drafts are the arg-max of p_{t−1} but are verified as if sampled from it."""

    def jacobi_update(self, q, t):
        return q.argmax(-1)


class RecordingDrafter(JacobiDrafter):
    """Records every proposal's (position, draft_len) and every committed image index."""

    def begin(self, prompts, prefill, first_tokens, streams):
        super().begin(prompts, prefill, first_tokens, streams)
        self.proposals: list[tuple[int, int]] = []
        self.commits = [0]
        self.committed = [int(first_tokens[0])]
        self.position = 0

    def propose(self, last_tokens, t, limit, depth, tree=None):
        assert int(t[0]) - 1 == self.position  # the loop drafts after the last committed index
        self.proposals.append((self.position, int(limit[0])))
        return super().propose(last_tokens, t, limit, depth, tree)

    def observe(self, out, p, draft, verdict):
        super().observe(out, p, draft, verdict)
        n = int(verdict.num_accepted[0])
        self.committed += draft.tokens[0, :n].tolist() + [int(verdict.next_token[0])]
        self.commits += list(range(self.position + 1, self.position + 2 + n))
        self.position += n + 1


class RowModel(ImageARModel):
    """A deterministic image model: token i = (above + 3·i) mod V, ``above`` = the token one row up.

    ``above`` is 0 in row 0. Every next-token distribution is one-hot, so sampling it is deterministic.
    """

    def __init__(self, vocab: int = 7, grid: tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        self.codebook_size, self.grid, self.hidden_size = vocab, grid, vocab
        self.sampling = SamplingConfig()

    def next_token(self, prefix: list[int]) -> int:
        i = len(prefix)
        above = prefix[i - self.grid[1]] if i >= self.grid[1] else 0
        return (above + 3 * i) % self.codebook_size

    def prefill(self, prompts, extra_slots=64, streams=None):
        return TokenCache([0] * len(prompts), self.num_image_tokens + extra_slots), self.rows([[[]] for _ in prompts])

    def forward_block(self, cache, tokens, positions, tree_mask=None):
        prefixes = []
        cache.block_starts, cache.block_len = cache.lengths, tokens.shape[1]
        for i, row in enumerate(tokens.tolist()):
            committed = cache.tokens[i]
            cache.tokens[i] = committed + row
            prefixes.append([committed + row[: j + 1] for j in range(len(row))])
        return self.rows(prefixes)

    def rows(self, prefixes: list[list[list[int]]]) -> TargetOutput:
        chosen = torch.tensor([[self.next_token(pre) for pre in image] for image in prefixes])  # (B, T)
        logits = torch.full((1, *chosen.shape, self.codebook_size), -1e4)  # (S=1, B, T, V)
        logits.scatter_(-1, chosen[None, :, :, None], 0.0)
        return TargetOutput(logits=logits, hidden=logits.clone())

    def embed(self, tokens):
        return torch.nn.functional.one_hot(tokens, self.codebook_size).float()

    def head(self, hidden):
        return hidden

    def codebook(self):
        return torch.eye(self.codebook_size)

    def decode_image(self, tokens):
        return tokens.to(torch.uint8).reshape(1, *self.grid).expand(3, -1, -1)


def sjd(model, init: str, drafter_cls=JacobiDrafter, window: int = WINDOW) -> Decoder:
    return Decoder("sjd", model, ExactRule(), draft_len=window - 1, drafter=drafter_cls(model, init=init))


def lookup_model() -> LookupModel:
    # table seed 2: the broken variant's bias is large on it (seeds 0, 1 give weaker but failing p-values)
    return LookupModel(vocab=3, grid=(2, 2), seed=2, sampling={"cfg_scale": 2.0, "top_k": 2})


@pytest.mark.parametrize("init", ["random", "repeat_horizon"])
def test_sjd_matches_exact_sequence_distribution(init):
    model = lookup_model()
    counts = sequence_counts(sjd(model, init), model, N_SAMPLES)
    assert chi_square_pvalue(counts, model.exact_sequence_probs()) > ALPHA


def test_greedy_jacobi_update_fails_the_same_test():
    model = lookup_model()
    counts = sequence_counts(sjd(model, "random", GreedyJacobiUpdate), model, N_SAMPLES)
    assert chi_square_pvalue(counts, model.exact_sequence_probs()) < ALPHA


@pytest.mark.parametrize("init", ["random", "repeat_horizon"])
def test_jacobi_converges_on_a_deterministic_model(init):
    model = RowModel()
    n = model.num_image_tokens
    ar = Decoder("ar", model, ExactRule()).generate("p", 0)
    for seed in range(3):
        out = sjd(model, init).generate("p", seed)
        assert torch.equal(out.tokens, ar.tokens)
        assert out.stats.target_forwards <= n // 4  # 64 tokens: AR needs 64 forwards
        assert out.stats.mean_accepted_length >= 4.0


@pytest.mark.parametrize("init", ["random", "repeat_horizon"])
def test_greedy_sjd_equals_greedy_ar_on_tiny_model(init):
    model = tiny_llamagen(dtype="float64", temperature=0.0)
    ar = Decoder("ar", model, ExactRule())
    decoder = sjd(model, init)
    for prompt in ("zero", "seven"):
        assert torch.equal(ar.generate(prompt, 0).tokens, decoder.generate(prompt, 1).tokens)


@pytest.mark.parametrize("model_name", ["lookup", "row", "tiny"])
def test_window_bookkeeping(model_name):
    builders = {"lookup": lookup_model, "row": RowModel, "tiny": lambda: tiny_llamagen(dtype="float32")}
    model = builders[model_name]()
    n = model.num_image_tokens
    decoder = sjd(model, "auto", RecordingDrafter, window=5)
    for seed in range(4):
        out = decoder.generate("zero", seed)
        drafter = decoder.drafter
        stats = out.stats
        assert stats.num_tokens == n and stats.target_forwards <= n and stats.drafter_forwards == 0
        assert stats.target_forwards == 1 + stats.iterations == 1 + len(drafter.proposals)
        assert sorted(drafter.commits) == list(range(n))  # every index, the last one included, exactly once
        assert drafter.committed == out.tokens.tolist()
        for position, draft_len in drafter.proposals:
            assert draft_len == min(4, n - position - 2)  # the window shrinks to end at the grid's end


def test_auto_init_follows_the_model_and_bad_values_name_the_key():
    assert JacobiDrafter(lookup_model()).init == "random"
    assert LlamaGen.sjd_init == "repeat_horizon"
    assert JacobiDrafter(tiny_llamagen()).init == "repeat_horizon"
    with pytest.raises(ValueError, match="decoder.drafter.init"):
        JacobiDrafter(lookup_model(), init="sample_horizon")


def test_repeat_horizon_copies_the_left_neighbour():
    model = RowModel(vocab=7, grid=(3, 4))
    drafter = JacobiDrafter(model, init="repeat_horizon")
    drafter.begin(["p", "p"], None, torch.tensor([5, 2]), Streams([0, 1], "cpu"))
    # image 0 drafts image indices 1..6 (index 4 starts row 1); image 1 indices 3..8 (4 and 8 start rows)
    draft = drafter.propose(torch.tensor([5, 2]), torch.tensor([1, 3]), torch.tensor([6, 6]), 6)
    x, y = draft.tokens.tolist()
    assert x[:3] == [5, 5, 5] and x[4:] == [x[3]] * 2
    assert y[0] == 2 and y[1:4] == [y[1]] * 3  # index 3 copies x_2; index 4 is random, 5..7 copy it
    assert torch.equal(draft.q, torch.nn.functional.one_hot(draft.tokens, 7).float())


@pytest.mark.parametrize("extra", [pytest.param(["logger=none"], marks=pytest.mark.slow), LOOKUP],
                         ids=["tiny", "lookup"])  # tiny: also in the every-decoder runs; CI's -m slow pass
def test_run_py_sjd_end_to_end(tmp_path, extra):
    run_py("decoder=sjd", "compare=[sd]", "eval.num_prompts=2", "eval.threads=1", *extra,
           f"hydra.run.dir={tmp_path}")
    record = json.loads((tmp_path / "run.json").read_text())
    assert set(record["per_decoder"]) == {"ar", "sd", "sjd"}
    sjd_metrics = record["per_decoder"]["sjd"]
    assert 1.0 <= sjd_metrics["mean_accepted_length"] <= WINDOW
    assert sjd_metrics["drafter_forwards_per_image"] == 0 and sjd_metrics["tv_per_step"] == 0.0
