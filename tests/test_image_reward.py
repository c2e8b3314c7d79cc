"""ImageReward (eval/metrics/image_reward.py): strict checkpoint layout, an independent re-computation of one
forward after THUDM/ImageReward (ImageReward.py ``score``, BLIP vit.py / med.py), inputs, and fetch-command
errors.

Offline: the real ``ImageReward.pt`` is checked by key names and shapes on the meta device; numbers come from
tiny random-weight instances of the same architecture with a tiny ``bert-base-uncased``-style vocabulary.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from coolsd.models.checkpoints import MissingWeightsError
from eval.metrics import image_reward as ir

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "bus", "on", "the", "street", "big", "small", "##s"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_VOCAB = len(SPECIALS) + len(WORDS)
TINY_VISION = {"image_size": 32, "patch_size": 8, "vision_width": 32, "vision_layers": 2, "vision_heads": 4}
TINY_TEXT = {"text_width": 24, "text_layers": 2, "text_heads": 4, "text_intermediate": 48,
             "vocab_size": N_VOCAB + 2, "max_positions": 40, "mlp_sizes": (16, 8, 8, 4)}
TINY_MED = {**ir.MED_CONFIG, "hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 48, "vocab_size": N_VOCAB + 2, "max_position_embeddings": 40}
PROMPTS = ["a photo of a red bus on the street", "a small blue dog"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_tiny")
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + WORDS) + "\n")
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two RGB PNGs (one non-square, so resize + centre crop both act), one palette PNG."""
    folder = tmp_path_factory.mktemp("ir_images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(48, 40), (64, 64)]):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    path = folder / "2.png"
    Image.fromarray(rng.integers(0, 256, (50, 36, 3), dtype=np.uint8)).convert("P").save(path)
    return paths + [path]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A folder with ImageReward.pt (every key of the real layout, tiny sizes, random values) + med_config."""
    folder = tmp_path_factory.mktemp("ir_tiny_ckpt")
    layout = ir.checkpoint_layout(ir.arch_from_med_config(TINY_MED, TINY_VISION))
    g = torch.Generator().manual_seed(7)
    state = {}
    for key, (shape, dtype) in layout.items():
        if dtype == torch.int64:
            state[key] = torch.arange(shape[-1]).reshape(shape)
        elif key.endswith("LayerNorm.weight") or ".norm" in key and key.endswith("weight"):
            state[key] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            matrix = len(shape) > 1 and "embed" not in key and "token" not in key
            fan_in = torch.Size(shape[1:]).numel() if matrix else 1
            state[key] = torch.randn(shape, generator=g) / fan_in ** 0.5
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(TINY_MED))
    return folder, state


def reference_transform(image: Image.Image, size: int) -> torch.Tensor:
    """ImageReward.py ``_transform(n_px)``, written as the reference composes it."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    normalize = Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    return Compose([Resize(size, interpolation=InterpolationMode.BICUBIC), CenterCrop(size),
                    lambda im: im.convert("RGB"), ToTensor(), normalize])(image)


def reference_tokens(tokenizer_dir, prompts):
    """blip.py ``init_tokenizer`` + ImageReward.py's tokenizer call (ids passed on unchanged)."""
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    enc = tok(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    return enc.input_ids, enc.attention_mask, tok.convert_tokens_to_ids("[ENC]")


def reference_score(sd, pixels, ids, mask, vision_heads, text_heads, patch):
    """One ImageReward forward from the checkpoint tensors, op by op as the reference modules compute it."""
    def lin(x, name):
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)

    def heads(x, n):  # (B, L, C) -> (B, H, L, d)
        return x.reshape(x.shape[0], x.shape[1], n, -1).permute(0, 2, 1, 3)

    def merge(x):
        return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)

    # vit.py VisionTransformer.forward
    v = "blip.visual_encoder"
    b = len(pixels)
    x = F.conv2d(pixels, sd[f"{v}.patch_embed.proj.weight"], sd[f"{v}.patch_embed.proj.bias"], stride=patch)
    x = torch.cat([sd[f"{v}.cls_token"].expand(b, -1, -1), x.flatten(2).transpose(1, 2)], 1)
    x = x + sd[f"{v}.pos_embed"]
    n_blocks = len({k.split(".")[3] for k in sd if k.startswith(f"{v}.blocks.")})
    for i in range(n_blocks):
        p = f"{v}.blocks.{i}"
        n, c = x.shape[1], x.shape[2]
        qkv = lin(ln(x, f"{p}.norm1", 1e-6), f"{p}.attn.qkv")
        qkv = qkv.reshape(b, n, 3, vision_heads, c // vision_heads)
        q, k, val = qkv.permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (c // vision_heads) ** -0.5).softmax(-1)
        x = x + lin((attn @ val).transpose(1, 2).reshape(b, n, c), f"{p}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{p}.norm2", 1e-6), f"{p}.mlp.fc1")), f"{p}.mlp.fc2")
    image_embeds = ln(x, f"{v}.norm", 1e-6)

    # med.py BertModel.forward(mode="multimodal"), encoder (not decoder) masks
    t = "blip.text_encoder"
    emb = sd[f"{t}.embeddings.word_embeddings.weight"][ids]
    emb = emb + sd[f"{t}.embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = ln(emb, f"{t}.embeddings.LayerNorm", 1e-12)
    ext = (1.0 - mask[:, None, None, :].float()) * -10000.0
    n_layers = len({k.split(".")[4] for k in sd if k.startswith(f"{t}.encoder.layer.")})
    for i in range(n_layers):
        p = f"{t}.encoder.layer.{i}"
        for block, ctx, add in (("attention", h, ext), ("crossattention", image_embeds, 0.0)):
            q = heads(lin(h, f"{p}.{block}.self.query"), text_heads)
            k = heads(lin(ctx, f"{p}.{block}.self.key"), text_heads)
            val = heads(lin(ctx, f"{p}.{block}.self.value"), text_heads)
            probs = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + add).softmax(-1)
            out = lin(merge(probs @ val), f"{p}.{block}.output.dense")
            h = ln(out + h, f"{p}.{block}.output.LayerNorm", 1e-12)
        out = lin(F.gelu(lin(h, f"{p}.intermediate.dense")), f"{p}.output.dense")
        h = ln(out + h, f"{p}.output.LayerNorm", 1e-12)

    # ImageReward.py score: [CLS] (first token) -> MLP (indices 0, 2, 4, 6, 7) -> (r - mean) / std
    r = h[:, 0, :]
    for index in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{index}")
    return ((r - 0.16717362830052426) / 1.0333394966054072).squeeze(-1)


@pytest.fixture()
def empty_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ---------------------------------------------------------------- checkpoint layout

def test_real_checkpoint_layout_loads_strictly_on_meta():
    layout = ir.checkpoint_layout()
    # ViT (24 blocks), BERT (12 layers, no pooler, no token types), contrastive projections, MLP
    assert len(layout) == 4 + 24 * 12 + 2 + 1 + 2 + 2 + 12 * 26 + 4 + 10
    assert layout["blip.visual_encoder.pos_embed"][0] == (1, 197, 1024)
    assert layout["blip.visual_encoder.patch_embed.proj.weight"][0] == (1024, 3, 16, 16)
    assert layout["blip.text_encoder.embeddings.word_embeddings.weight"][0] == (30524, 768)
    assert layout["blip.text_encoder.encoder.layer.11.crossattention.self.key.weight"][0] == (768, 1024)
    assert layout["blip.text_encoder.encoder.layer.0.attention.self.key.weight"][0] == (768, 768)
    assert layout["mlp.layers.0.weight"][0] == (1024, 768) and layout["mlp.layers.7.weight"][0] == (1, 16)
    assert not any("token_type" in k or "pooler" in k for k in layout)
    with torch.device("meta"):
        model = ir.ImageRewardModel()
    state = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in layout.items()}
    model.load_state_dict(ir.drop_unused_keys(state), strict=True, assign=True)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        k: shape for k, (shape, _) in layout.items() if k not in ir.UNUSED_CHECKPOINT_KEYS}
    assert all(p.device.type == "meta" for p in model.parameters())
    # ImageReward-v1.0 has 446.67M float32 numbers beside the 512 position ids (a 1.79 GB file)
    assert sum(torch.Size(s).numel() for s, d in layout.values() if d == torch.float32) == 446_665_953


def test_tiny_checkpoint_loads_strictly_from_folder(tiny_checkpoint, tokenizer_dir):
    folder, state = tiny_checkpoint
    metric = ir.ImageReward(pretrained=str(folder), tokenizer=str(tokenizer_dir), arch=TINY_VISION)
    metric.preflight()
    assert metric._model is None  # pre-flight resolves files, builds nothing
    loaded = metric.model.state_dict()
    assert set(loaded) == set(state) - set(ir.UNUSED_CHECKPOINT_KEYS)
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


def test_unexpected_checkpoint_key_fails(tiny_checkpoint, tokenizer_dir, tmp_path):
    folder, state = tiny_checkpoint
    extra = {"blip.text_encoder.pooler.dense.weight": torch.zeros(24, 24)}
    torch.save({**state, **extra}, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text((folder / "med_config.json").read_text())
    metric = ir.ImageReward(pretrained=str(tmp_path), tokenizer=str(tokenizer_dir), arch=TINY_VISION)
    with pytest.raises(RuntimeError, match="pooler"):
        _ = metric.model


def test_position_ids_must_be_arange(tiny_checkpoint):
    _, state = tiny_checkpoint
    bad = {**state, "blip.text_encoder.embeddings.position_ids": torch.zeros(1, 40, dtype=torch.int64)}
    with pytest.raises(ValueError, match="position_ids"):
        ir.drop_unused_keys(bad)
    assert set(ir.drop_unused_keys(state)) == set(state) - set(ir.UNUSED_CHECKPOINT_KEYS)


# ---------------------------------------------------------------- the score

def test_score_matches_reference_recomputation(tiny_checkpoint, tokenizer_dir, images):
    folder, state = tiny_checkpoint
    metric = ir.ImageReward(pretrained=str(folder), tokenizer=str(tokenizer_dir), arch=TINY_VISION,
                            batch_size=2)
    prompts = PROMPTS + ["a big cat"]
    got = metric.scores(images, prompts, device="cpu")
    pixels = torch.stack([reference_transform(Image.open(p), 32) for p in images])
    ids, mask, enc_id = reference_tokens(tokenizer_dir, prompts)
    with torch.no_grad():
        want = reference_score(state, pixels, ids, mask, vision_heads=4, text_heads=4, patch=8)
        # the test can tell: BLIP-ITM's [ENC] first token gives another score
        enc_ids = ids.clone()
        enc_ids[:, 0] = enc_id
        other = reference_score(state, pixels, enc_ids, mask, vision_heads=4, text_heads=4, patch=8)
    want, other = want.double().numpy(), other.double().numpy()
    assert got.shape == (3,) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(other - want).min() > 1e-3
    assert np.abs(want).min() > 1e-3 and np.ptp(want) > 1e-3


def test_score_deterministic_and_prompt_dependent(tokenizer_dir, images):
    metric = ir.ImageReward(pretrained=None, tokenizer=str(tokenizer_dir), arch={**TINY_VISION, **TINY_TEXT})
    first = metric.scores(images[:2], PROMPTS, device="cpu")
    again = ir.ImageReward(pretrained=None, tokenizer=str(tokenizer_dir), arch={**TINY_VISION, **TINY_TEXT})
    np.testing.assert_array_equal(first, metric.scores(images[:2], PROMPTS, device="cpu"))
    np.testing.assert_array_equal(first, again.scores(images[:2], PROMPTS, device="cpu"))
    swapped = metric.scores(images[:2], PROMPTS[::-1], device="cpu")
    assert np.abs(swapped - first).min() > 1e-4
    out = metric.compute(images[:2], PROMPTS, device="cpu")
    assert out == {"image_reward": pytest.approx(float(first.mean())), "image_reward_num_images": 2}


def test_batch_size_does_not_change_scores(tiny_checkpoint, tokenizer_dir, images):
    folder, _ = tiny_checkpoint
    prompts = PROMPTS + ["a big cat"]
    one, three = (ir.ImageReward(pretrained=str(folder), tokenizer=str(tokenizer_dir), arch=TINY_VISION,
                                 batch_size=n) for n in (1, 3))
    # float32 through a BLIP tower: batched products may sum in another order (measured on an AMD EPYC: 1.37e-6)
    np.testing.assert_allclose(one.scores(images, prompts, "cpu"), three.scores(images, prompts, "cpu"),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- inputs

def test_preprocess_is_imagereward_transform(images):
    for path in images:
        with Image.open(path) as im:
            got = ir.preprocess(im, 224)
        with Image.open(path) as im:
            want = reference_transform(im, 224)
        assert got.shape == (3, 224, 224)
        assert torch.equal(got, want)


def test_tokenizer_is_blip_init_tokenizer_with_cls_first(tokenizer_dir):
    tok = ir.load_blip_tokenizer(tokenizer_dir)
    assert len(tok) == N_VOCAB + 2
    assert tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [N_VOCAB, N_VOCAB + 1]
    assert tok.enc_token_id == N_VOCAB + 1
    ids, mask = ir.tokenize(tok, ["a red bus", " ".join(["cat"] * 50)])
    assert ids.shape == mask.shape == (2, 35)
    cls, sep = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    assert ids[:, 0].tolist() == [cls, cls]  # ImageReward feeds [CLS], not [ENC]
    assert ids[0, :5].tolist() == [cls, *tok.convert_tokens_to_ids(["a", "red", "bus"]), sep]
    assert mask[0].sum() == 5 and ids[0, 5:].eq(0).all()
    assert mask[1].all() and ids[1, -1] == sep  # truncated at 35 tokens


def test_tokenizer_vocabulary_must_match_text_encoder(tokenizer_dir):
    metric = ir.ImageReward(pretrained=None, tokenizer=str(tokenizer_dir),
                            arch={**TINY_VISION, **TINY_TEXT, "vocab_size": N_VOCAB + 5})
    with pytest.raises(ValueError, match="bert-base-uncased"):
        _ = metric.model


def test_unknown_arch_key_fails():
    with pytest.raises(ValueError, match="vision_widht"):
        ir.ImageReward(pretrained=None, arch={"vision_widht": 8}).preflight()


# ---------------------------------------------------------------- missing files

def test_missing_hub_weights_name_the_fetch_command(empty_hub_cache, tokenizer_dir, images):
    metric = ir.ImageReward(pretrained="hub:THUDM/ImageReward", tokenizer=str(tokenizer_dir))
    for call in (metric.preflight, lambda: metric.scores(images[:1], PROMPTS[:1], "cpu")):
        with pytest.raises(MissingWeightsError) as err:
            call()
        msg = str(err.value)
        assert "THUDM/ImageReward" in msg and "ImageReward.pt" in msg and "med_config.json" in msg
        assert "hf download THUDM/ImageReward ImageReward.pt med_config.json" in msg


def test_missing_local_weights_name_folder_and_command(tmp_path, tokenizer_dir):
    (tmp_path / "med_config.json").write_text(json.dumps(TINY_MED))
    with pytest.raises(MissingWeightsError) as err:
        ir.ImageReward(pretrained=str(tmp_path), tokenizer=str(tokenizer_dir)).preflight()
    msg = str(err.value)
    assert str(tmp_path / "ImageReward.pt") in msg and "med_config.json," not in msg.split("looked")[0]
    assert f"hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir {tmp_path}" in msg


def test_missing_tokenizer_names_the_fetch_command(empty_hub_cache, tmp_path):
    with pytest.raises(MissingWeightsError) as err:
        ir.ImageReward(pretrained=None, tokenizer="bert-base-uncased").preflight()
    assert "hf download bert-base-uncased vocab.txt" in str(err.value)
    with pytest.raises(MissingWeightsError) as err:
        ir.ImageReward(pretrained=None, tokenizer=str(tmp_path)).preflight()
    assert str(tmp_path / "vocab.txt") in str(err.value) and "hf download bert-base-uncased" in str(err.value)
