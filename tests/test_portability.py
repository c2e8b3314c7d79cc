"""Portability and the silent or late failures of issue 31: the start-up self-check (``coolsd.numerics``) and
its record in ``run.json`` and the fingerprint, records made on a machine whose arithmetic differs, full-byte
weight digests, records without images, non-UTF-8 prompt files, boolean model options, SJD with a tree, and
released LANTERN drafters' prefix convention (that one is in ``test_real_size_layouts.py``).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.fingerprint import json_digest, weights_digest
from coolsd.models.base import RowBlockLinear, batch_invariant_linears
from coolsd.numerics import NumericsCheck, check_batch_invariance
from tests.helpers import CONFIGS, tiny_llamagen
from tests.test_run import LOOKUP, ROOT, run_py


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# -- the self-check -------------------------------------------------------------------------------------------
def test_row_block_linears_multiply_whole_blocks_and_keep_values():
    """``model.row_block=4``: ``RowBlockLinear`` pads a product to a multiple of 4 rows: its rows equal
    ``F.linear``'s on that padded product exactly, and every shape of input works (1-D, 3-D, whole blocks);
    the default (1) keeps ``nn.Linear``; other block sizes are refused naming the key."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 10)
    batch_invariant_linears(torch.nn.Sequential(plain))
    assert type(plain) is torch.nn.Linear and not plain.weight.is_contiguous()
    layer = torch.nn.Linear(24, 10)
    assert batch_invariant_linears(torch.nn.Sequential(layer), row_block=4) == 1 and type(layer) is RowBlockLinear
    with pytest.raises(ValueError, match="model.row_block must be one of"):
        batch_invariant_linears(torch.nn.Sequential(torch.nn.Linear(3, 3)), row_block=3)
    for shape in ((24,), (1, 24), (2, 3, 24), (4, 24), (5, 1, 24)):
        x = torch.randn(*shape)
        rows = x.numel() // 24
        padded = torch.cat([x.reshape(rows, 24), torch.zeros(-rows % 4, 24)])
        want = torch.nn.functional.linear(padded, layer.weight, layer.bias)[:rows].view(*shape[:-1], 10)
        assert torch.equal(layer(x), want), shape


def test_the_self_check_passes_on_the_shipped_model_and_fails_where_rows_change_bits():
    """On the shipped model the check reports whether logits alone and in a batch are bitwise equal, with a
    signature of the bits. A model whose output depends on the batch (a row-count-dependent perturbation, as
    a BLAS kernel switch would be) fails it, with the relative size of the difference, and gives another
    signature; the lookup model (no arithmetic across rows) passes."""
    from coolsd.models.lookup import LookupModel

    model = tiny_llamagen()
    check = check_batch_invariance(model)
    assert isinstance(check, NumericsCheck) and len(check.signature) == 40
    assert check.platform["threads"] == torch.get_num_threads() and check.platform["device"] == "cpu"
    assert check.fingerprint() == {"batch_invariant": check.batch_invariant, "signature": check.signature}
    assert check_batch_invariance(model).signature == check.signature  # deterministic

    class BatchDependent(type(model)):
        def forward_block(self, cache, tokens, positions, tree_mask=None):
            out = super().forward_block(cache, tokens, positions, tree_mask)
            bump = 1.0 + 1e-6 * (tokens.shape[0] < 4)  # small batches take "another kernel"
            return type(out)(logits=out.logits * bump, hidden=out.hidden)

    model.__class__ = BatchDependent
    bad = check_batch_invariance(model)
    assert not bad.batch_invariant and 0 < bad.max_rel_diff < 1e-5
    assert bad.signature == check.signature  # the batch of eight itself is unchanged
    assert check_batch_invariance(LookupModel(prompts=("a", "b"))).batch_invariant


@pytest.mark.slow  # three end-to-end runs (CI's -m slow pass)
def test_a_row_resumed_on_another_machine_carries_on_and_says_so(tmp_path):
    """``run.json`` has the self-check (``numerics``: result, signature, per-rank machines, the signatures its
    records were made under) and every fingerprint its result. A row requeued onto a machine whose arithmetic
    differs (another GPU kind) resumes its own records by default (``eval.numerics_mismatch=accept``): run.json
    counts its images per signature and the table marks the decoder; ``refuse`` stops before any image, naming
    the machines, and its advice says that ``eval.resume=overwrite`` deletes finished images."""
    common = [*LOOKUP, "eval.threads=1", "eval.warmup=0", "decoder=sd", "compare=none", "eval.num_prompts=3",
              f"hydra.run.dir={tmp_path}"]
    run_py(*common)
    record = json.loads((tmp_path / "run.json").read_text())
    numerics = record["numerics"]
    assert numerics["batch_invariant"] is True and len(numerics["signature"]) == 40
    assert numerics["ranks"][0]["signature"] == numerics["signature"]
    assert numerics["record_signatures"] == {numerics["signature"]: 6}  # 3 images x (ar, sd)
    meta = tmp_path / "records" / "sd.fingerprint.json"
    fp = json.loads(meta.read_text())
    assert fp["numerics"] == {"batch_invariant": True, "signature": numerics["signature"]}
    other = {**fp, "numerics": {"batch_invariant": False, "signature": "0" * 40}}  # made on another machine
    meta.write_text(json.dumps(other))
    log = tmp_path / "records" / "sd.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**r, "fingerprint": json_digest([json_digest(other), r["prompt"], r["seed"]]),
                                       "numerics": "0" * 40}) + "\n" for r in lines))
    before = log.read_text()
    proc = subprocess.run([sys.executable, "run.py", *common, "eval.num_prompts=4", "eval.numerics_mismatch=refuse"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "float32 arithmetic differs" in proc.stderr, proc.stderr[-2000:]
    assert "eval.numerics_mismatch=accept" in proc.stderr and "DELETES" in proc.stderr
    assert (tmp_path / "records" / "sd.jsonl").read_text() == before  # nothing generated, nothing lost
    run_py(*common, "eval.num_prompts=4")  # the default: the row carries on
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["numerics"]["accepted_mismatch"]["sd"] == other["numerics"]
    assert record["per_decoder"]["sd"]["num_images"] == 4
    assert log.read_text().startswith(before)  # the old records kept, one new one added
    assert record["numerics"]["record_signatures"] == {numerics["signature"]: 5, "0" * 40: 3}
    assert record["per_decoder"]["sd"]["numerics_signatures"] == {numerics["signature"]: 1, "0" * 40: 3}
    assert record["per_decoder"]["ar"]["numerics_signatures"] == {numerics["signature"]: 4}
    table = (tmp_path / "table.md").read_text()
    assert "| sd ‡ |" in table and "| ar |" in table and "several float32 arithmetics" in table


def test_ranks_whose_arithmetic_differs_are_refused_before_any_image(monkeypatch, tmp_path):
    """Shards of one run on two kinds of machine (each rank's self-check gathered) would mix two arithmetics:
    refused unless accepted."""
    from eval.run import experiment as runner

    class TwoRanks(runner.Shards):
        def gather(self, value):
            return [value, {**value, "signature": "f" * 40, "machine": "AMD EPYC (cpu, AVX2, 2 threads)"}]

    model = tiny_llamagen()
    with pytest.raises(RuntimeError, match="rank 1: AMD EPYC.*Nothing was generated"):
        runner.machine_numerics(model, TwoRanks(), "refuse")
    out = runner.machine_numerics(model, TwoRanks(), "accept")
    assert len({r["signature"] for r in out["ranks"]}) == 2


# -- full-byte weight digests ---------------------------------------------------------------------------------
def test_the_weights_digest_sees_every_byte_of_every_tensor():
    """A change past the first 4,096 values of a tensor (where the old digest stopped looking) changes the digest;
    bfloat16 tensors and buffers are hashed too; the thread count does not change it."""
    model = tiny_llamagen()
    base = weights_digest(model)
    assert weights_digest(model, threads=1) == base
    w = model.gpt.layers[-1].feed_forward.w2.weight
    assert w.numel() > 4096
    with torch.no_grad():
        w[-1, -1] += 1e-3  # the last value in memory order too (column-major: batch_invariant_linears)
    assert weights_digest(model) != base
    half = torch.nn.Linear(3000, 2).to(torch.bfloat16)
    first = weights_digest(half)
    with torch.no_grad():
        half.weight.view(-1)[-1] += 1.0
    assert weights_digest(half) != first


@pytest.mark.slow  # an end-to-end run (CI's -m slow pass)
def test_a_checkpoint_that_differs_only_at_its_end_does_not_reuse_records(tmp_path):
    """The issue's probe: a target checkpoint that differs from the first only after 4,096 values of a tensor
    is refused in the same folder (the old prefix digest reused the records and reported their accepted
    length)."""
    from safetensors.torch import save_file

    model = tiny_llamagen()
    state = {k: v.contiguous() for k, v in model.gpt.state_dict().items()}
    save_file(state, str(tmp_path / "a.safetensors"))
    key = "layers.3.feed_forward.w2.weight"
    state[key] = state[key].clone()
    state[key].view(-1)[-1] += 1.0
    save_file(state, str(tmp_path / "b.safetensors"))
    common = ["model=tiny", "logger=none", "eval.threads=1", "eval.warmup=0", "decoder=ar", "compare=none",
              "eval.num_prompts=1", "eval.save_images=false", f"hydra.run.dir={tmp_path / 'run'}"]
    run_py(*common, f"model.gpt_checkpoint={tmp_path / 'a.safetensors'}")
    proc = subprocess.run([sys.executable, "run.py", *common, f"model.gpt_checkpoint={tmp_path / 'b.safetensors'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "weights_sha1" in proc.stderr, proc.stderr[-2000:]


# -- records without images -------------------------------------------------------------------------------------
@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_records_without_images_get_their_images_from_their_tokens_before_scoring(tmp_path):
    """The issue's probe: 4 images with eval.save_images=false eval.metrics=[], then 8 with the default metrics in
    the same folder. The first four records get their images decoded from their recorded tokens before any
    generation (the pixels the generating run writes for those tokens), and every metric scores 8 images."""
    import io

    from PIL import Image

    from eval.records.image_records import save_png
    from tests.test_batched import shipped_model

    common = ["decoder=sd", "compare=none", "logger=none", "eval.warmup=0", "eval.speed_prompts=2",
              "eval.batch_size=4", f"hydra.run.dir={tmp_path}"]
    run_py(*common, "eval.num_prompts=4", "eval.save_images=false", "eval.metrics=[]")
    run_py(*common, "eval.num_prompts=8")
    record = json.loads((tmp_path / "run.json").read_text())["per_decoder"]["sd"]
    assert record["num_images"] == 8 and "fid_classifier" in record and "class_accuracy" in record
    model, _ = shipped_model()
    records = {r["index"]: r for r in map(json.loads, (tmp_path / "records" / "sd.jsonl").read_text().splitlines())}
    for i in range(8):
        want = tmp_path / "want.png"
        save_png(want, model.decode_images(torch.tensor([records[i]["tokens"]]))[0])
        got = Image.open(tmp_path / records[i]["image"])
        assert got.tobytes() == Image.open(io.BytesIO(want.read_bytes())).tobytes(), i


# -- bad input, early and named -------------------------------------------------------------------------------
def test_a_prompt_file_that_is_not_utf8_names_the_file_the_byte_and_the_key(tmp_path):
    from coolsd.prompts import FilePrompts, PartiPrompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("a caf\u00e9\nsecond line\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"prompts.txt \(data.path\) is not UTF-8 text: byte 0xe9 at offset 5 "
                                         r"\(line 1\).*iconv"):
        FilePrompts(str(path)).load(None, 2)
    tsv = tmp_path / "parti.tsv"
    tsv.write_bytes("Prompt\tCategory\n\xff\tx\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"parti.tsv \(data.path\) is not UTF-8"):
        PartiPrompts(str(tsv)).load(None, 1)


@pytest.mark.parametrize("model", ["tiny", "janus_tiny", "lumina_tiny", "emu3_tiny"])
@pytest.mark.parametrize("value", ["maybe", "off", "no"])
def test_model_batch_invariant_must_be_a_boolean(model, value):
    """``bool("off")`` is True: a string must not switch the option on in silence."""
    cfg = compose_cfg(f"model={model}", f"model.batch_invariant={value}")
    with pytest.raises(InstantiationException, match="model.batch_invariant must be true or false"):
        instantiate(cfg.model)


def test_sjd_with_a_tree_is_refused_when_the_decoder_is_built(tmp_path):
    """A Jacobi window is a chain: ``decoder.tree`` is refused at build time, before AR's first image."""
    model = tiny_llamagen()
    with pytest.raises(ValueError, match="drafts chains only.*decoder.tree=null"):
        Decoder("sjd", model, ExactRule(), draft_len=3, drafter=JacobiDrafter(model), tree="naive_extend_57")
    proc = subprocess.run([sys.executable, "run.py", *LOOKUP, "decoder=sjd", "+decoder.tree=naive_extend_57",
                           "compare=none", f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "drafts chains only" in proc.stderr
    assert not (tmp_path / "records").exists() or not list((tmp_path / "records").glob("*.jsonl"))
