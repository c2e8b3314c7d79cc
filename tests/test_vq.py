"""Tests for coolsd.models.vq: shapes, lookup semantics, reference state_dict layout, checkpoint loading."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from coolsd.models.vq import VQ_MODELS, VQConfig, VQModel, load_vq_checkpoint

TINY = dict(
    ch=32, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2), z_channels=32, codebook_size=64,
    codebook_embed_dim=8, num_res_blocks=1,
)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny convs are latency-bound; extra intra-op threads only add contention on small CI boxes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_vq(seed: int = 0, **overrides) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(VQConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def vq() -> VQModel:
    return tiny_vq()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1  # (B, 3, H, W) in [-1, 1]


@pytest.fixture(scope="module")
def encoded(vq: VQModel, images: torch.Tensor) -> tuple:
    with torch.no_grad():
        return vq.encode(images)


def reference_keys(ch_mult: tuple[int, ...], num_res_blocks: int = 2, ch: int = 128) -> dict[str, tuple]:
    """Expected state_dict of LlamaGen's VQModel, spelled out from the reference module structure."""
    keys: dict[str, tuple] = {}

    def conv(name: str, cin: int, cout: int, k: int) -> None:
        keys[f"{name}.weight"] = (cout, cin, k, k)
        keys[f"{name}.bias"] = (cout,)

    def norm(name: str, c: int) -> None:
        keys[f"{name}.weight"] = (c,)
        keys[f"{name}.bias"] = (c,)

    def res(name: str, cin: int, cout: int) -> None:
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name: str, c: int) -> None:
        norm(f"{name}.norm", c)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{proj}", c, c, 1)

    def mid(name: str, c: int) -> None:
        res(f"{name}.0", c, c)
        attn(f"{name}.1", c)
        res(f"{name}.2", c, c)

    last = len(ch_mult) - 1
    conv("encoder.conv_in", 3, ch, 3)
    width = ch
    for level, mult in enumerate(ch_mult):
        for i in range(num_res_blocks):
            res(f"encoder.conv_blocks.{level}.res.{i}", width, ch * mult)
            width = ch * mult
            if level == last:
                attn(f"encoder.conv_blocks.{level}.attn.{i}", width)
        if level != last:
            conv(f"encoder.conv_blocks.{level}.downsample.conv", width, width, 3)
    mid("encoder.mid", width)
    norm("encoder.norm_out", width)
    conv("encoder.conv_out", width, 256, 3)

    width = ch * ch_mult[last]
    conv("decoder.conv_in", 256, width, 3)
    mid("decoder.mid", width)
    for pos, level in enumerate(reversed(range(len(ch_mult)))):
        for i in range(num_res_blocks + 1):
            res(f"decoder.conv_blocks.{pos}.res.{i}", width, ch * ch_mult[level])
            width = ch * ch_mult[level]
            if level == last:
                attn(f"decoder.conv_blocks.{pos}.attn.{i}", width)
        if level != 0:
            conv(f"decoder.conv_blocks.{pos}.upsample.conv", width, width, 3)
    norm("decoder.norm_out", width)
    conv("decoder.conv_out", width, 3, 3)

    keys["quantize.embedding.weight"] = (16384, 8)
    keys["quantize.codebook_used"] = (65536,)
    conv("quant_conv", 256, 8, 1)
    conv("post_quant_conv", 8, 256, 1)
    return keys


# -- shapes and semantics ------------------------------------------------------------------------------------
def test_encode_decode_shapes(vq: VQModel) -> None:
    assert vq.downsample_factor == 2  # two levels -> one downsample
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        quant, losses, info = vq.encode(image)
        recon, out_losses = vq(image)
    assert quant.shape == (1, 8, 32, 32)
    assert info[2].shape == (32 * 32,) and info[2].dtype == torch.long
    assert losses == (None, None, None, 0) and out_losses == (None, None, None, 0)
    assert recon.shape == (1, 3, 64, 64)


def test_downsample_factor_of_registry() -> None:
    with torch.device("meta"):
        assert VQ_MODELS["VQ-16"]().downsample_factor == 16
        assert VQ_MODELS["VQ-8"]().downsample_factor == 8
    assert VQConfig().downsample_factor == 16


def test_indices_are_argmin_of_normalised_distance(vq: VQModel, images: torch.Tensor, encoded: tuple) -> None:
    quant, _, info = encoded
    with torch.no_grad():
        z = vq.quant_conv(vq.encoder(images))  # (B, D, h, w)
    z_flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, 8), dim=-1)  # (B*h*w, D)
    codebook = F.normalize(vq.codebook(), dim=-1)  # (V, D)
    expected = torch.cdist(z_flat, codebook).argmin(dim=1)
    assert (expected == info[2]).float().mean() > 0.999  # float ties aside
    entries = codebook[info[2]].view(2, 16, 16, 8).permute(0, 3, 1, 2)
    torch.testing.assert_close(quant, entries)


def test_decode_code_matches_codebook_entry(vq: VQModel, encoded: tuple) -> None:
    _, _, info = encoded
    shape = (2, 8, 16, 16)
    entry = vq.quantize.get_codebook_entry(info[2], shape=shape, channel_first=True)
    torch.testing.assert_close(vq.quantize.get_codebook_entry(info[2].view(2, -1), shape=shape), entry)
    with torch.no_grad():
        torch.testing.assert_close(vq.decode_code(info[2], shape=shape), vq.decode(entry))
    last = vq.quantize.get_codebook_entry(info[2], shape=(2, 16, 16, 8), channel_first=False)
    torch.testing.assert_close(last.permute(0, 3, 1, 2), vq.quantize.get_codebook_entry(info[2], shape=shape))


def test_codebook_is_raw_and_lookup_normalises() -> None:
    model = tiny_vq()
    with torch.no_grad():
        model.quantize.embedding.weight.mul_(3.0)
    raw = model.codebook()
    assert raw.shape == (64, 8)
    torch.testing.assert_close(raw.norm(dim=-1), torch.full((64,), 3.0))
    idx = torch.tensor([0, 5, 63])
    torch.testing.assert_close(model.quantize.get_codebook_entry(idx), F.normalize(raw[idx], dim=-1))
    plain = tiny_vq(codebook_l2_norm=False)
    torch.testing.assert_close(plain.quantize.get_codebook_entry(idx), plain.codebook()[idx])


def test_convenience_round_trip(vq: VQModel, images: torch.Tensor, encoded: tuple) -> None:
    codes = vq.encode_to_indices(images)
    _, _, info = encoded
    assert codes.shape == (2, 16 * 16) and codes.dtype == torch.long
    assert torch.equal(codes, info[2].view(2, -1))
    pixels = vq.decode_to_uint8(codes, grid=(16, 16))
    assert pixels.shape == (2, 3, 32, 32) and pixels.dtype == torch.uint8
    with torch.no_grad():
        ref = vq.decode_code(codes, shape=(2, 8, 16, 16))
    expected = ((ref.clamp(-1, 1) + 1) / 2).mul(255).add(0.5).clamp(0, 255).to(torch.uint8)  # save_image's
    assert torch.equal(pixels, expected)
    rounded = ((ref.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    assert torch.equal(vq.decode_to_uint8(codes, grid=(16, 16), rounding="half_even"), rounded)
    assert torch.equal(vq.decode_to_uint8(codes[:1]), pixels[:1])  # square grid inferred
    with pytest.raises(ValueError, match="grid"):
        vq.decode_to_uint8(codes, grid=(8, 16))


def test_training_losses_and_straight_through(images: torch.Tensor) -> None:
    model = tiny_vq(entropy_loss_ratio=0.1).train()
    x = images[:1]
    recon, (vq_loss, commit_loss, ent_loss, usage) = model(x)
    for loss in (vq_loss, commit_loss, ent_loss):
        assert loss.dim() == 0 and torch.isfinite(loss)
    assert 0 < usage <= 1
    used = model.quantize.codebook_used
    assert torch.equal(used[-256:], model.encode_to_indices(x).flatten().float())
    assert torch.all(used[:-256] == 0)
    (recon.mean() + vq_loss + commit_loss + ent_loss).backward()
    assert model.encoder.conv_in.weight.grad is not None  # gradient crossed the quantizer
    assert model.quantize.embedding.weight.grad is not None
    assert model.quantize.embedding.weight.grad.abs().sum() > 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="ch"):
        VQConfig(ch=48)
    with pytest.raises(ValueError, match="encoder_ch_mult"):
        VQConfig(encoder_ch_mult=())
    with pytest.raises(ValueError, match="num_res_blocks"):
        VQConfig(num_res_blocks=0)
    assert VQConfig(decoder_ch_mult=[1, 2]).decoder_ch_mult == (1, 2)
    with pytest.raises(AttributeError):
        VQConfig().ch = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"VQConfig.encoder must be one of \['conv', 'patch'\]"):
        VQConfig(encoder="vit")


def test_patch_encoder_codes_depend_on_their_own_patch_only() -> None:
    """``encoder="patch"``: changing one f x f patch changes that code's features and no other; equal
    patches get equal codes wherever they are (the conv encoder gives neither: its GroupNorm, 3x3 convs and
    attention span the image)."""
    model = tiny_vq(encoder="patch")  # f = 2, 16x16 images -> 8x8 codes
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(2, 3, 16, 16, generator=gen) * 2 - 1
    y = x.clone()
    y[:, :, 6:8, 10:12] = 0.7  # patch (row 3, col 5)
    with torch.no_grad():
        changed = (model.encoder(x) - model.encoder(y)).abs().amax(dim=(0, 1)) > 0
        expected = torch.zeros(8, 8, dtype=torch.bool)
        expected[3, 5] = True
        assert torch.equal(changed, expected)
        blank = x.clone()
        blank[0, :, :8, :] = -1.0  # top half of image 0 blank: 4 rows of 8 equal patches
        codes = model.encode_to_indices(blank).reshape(2, 8, 8)
        assert (codes[0, :4] == codes[0, 0, 0]).all()
        conv = tiny_vq()  # the reference encoder, for contrast
        conv_changed = (conv.encoder(x) - conv.encoder(y)).abs().amax(dim=(0, 1)) > 0
        assert conv_changed.sum() > 1
        recon = model.decode_code(codes.flatten(1), (2, 8, 8, 8))
    assert recon.shape == (2, 3, 16, 16)


# -- reference layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, ch_mult", [("VQ-16", (1, 1, 2, 2, 4)), ("VQ-8", (1, 2, 2, 4))])
def test_state_dict_matches_reference_layout(name: str, ch_mult: tuple[int, ...]) -> None:
    with torch.device("meta"):
        model = VQ_MODELS[name]()
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == reference_keys(ch_mult)


def test_state_dict_spot_checks() -> None:
    with torch.device("meta"):
        sd = VQ_MODELS["VQ-16"]().state_dict()
    for key in (
        "encoder.conv_blocks.0.res.0.norm1.weight", "encoder.conv_blocks.4.attn.0.q.weight",
        "encoder.mid.1.proj_out.weight", "decoder.conv_blocks.0.res.2.conv2.weight",
        "decoder.conv_blocks.0.attn.2.k.weight", "decoder.conv_blocks.3.upsample.conv.weight",
        "quant_conv.weight", "post_quant_conv.weight",
    ):
        assert key in sd, key
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in sd
    assert "encoder.conv_blocks.4.downsample.conv.weight" not in sd
    assert sd["quantize.embedding.weight"].shape == (16384, 8)
    assert sd["quantize.codebook_used"].shape == (65536,)
    with torch.device("meta"):
        assert "quantize.codebook_used" not in VQ_MODELS["VQ-16"](codebook_show_usage=False).state_dict()
        assert sum(p.numel() for p in VQ_MODELS["VQ-16"]().parameters()) == 71_883_403


# -- checkpoint loading --------------------------------------------------------------------------------------
def _assert_same_weights(a: VQModel, b: VQModel) -> None:
    sb = b.state_dict()
    for key, value in a.state_dict().items():
        assert torch.equal(value, sb[key]), key


def test_load_torch_checkpoint_round_trip(tmp_path, images: torch.Tensor) -> None:
    src = tiny_vq(seed=0)
    path = tmp_path / "vq.pt"
    torch.save({"model": src.state_dict(), "steps": 10, "args": argparse.Namespace(lr=1e-4)}, path)
    dst = load_vq_checkpoint(tiny_vq(seed=123), path)
    _assert_same_weights(src, dst)
    assert torch.equal(dst.encode_to_indices(images), src.encode_to_indices(images))

    raw_path = tmp_path / "raw.pt"
    torch.save(src.state_dict(), raw_path)
    _assert_same_weights(src, load_vq_checkpoint(tiny_vq(seed=7), str(raw_path)))


def test_load_uses_model_not_ema_by_default(tmp_path) -> None:
    model_sd, ema_sd = tiny_vq(seed=0).state_dict(), tiny_vq(seed=1).state_dict()
    path = tmp_path / "both.pt"
    torch.save({"model": model_sd, "ema": ema_sd}, path)
    loaded = load_vq_checkpoint(tiny_vq(seed=2), path)
    assert torch.equal(loaded.encoder.conv_in.weight, model_sd["encoder.conv_in.weight"])
    ema = load_vq_checkpoint(tiny_vq(seed=2), path, use_ema=True)
    assert torch.equal(ema.encoder.conv_in.weight, ema_sd["encoder.conv_in.weight"])


def test_load_safetensors_without_usage_buffer(tmp_path) -> None:
    src = tiny_vq(seed=0)
    sd = {k: v.contiguous() for k, v in src.state_dict().items() if k != "quantize.codebook_used"}
    path = tmp_path / "vq.safetensors"
    save_file(sd, str(path))
    dst = load_vq_checkpoint(tiny_vq(seed=5), path)
    for key, value in sd.items():
        assert torch.equal(dst.state_dict()[key], value), key


def test_load_rejects_missing_parameters(tmp_path) -> None:
    sd = tiny_vq().state_dict()
    del sd["decoder.conv_out.weight"]
    path = tmp_path / "partial.pt"
    torch.save({"model": sd}, path)
    with pytest.raises(KeyError, match="decoder.conv_out.weight"):
        load_vq_checkpoint(tiny_vq(), path)


def test_load_missing_file_names_path(tmp_path) -> None:
    path = tmp_path / "nope" / "vq_ds16_t2i.pt"
    with pytest.raises(FileNotFoundError, match="vq_ds16_t2i.pt") as err:
        load_vq_checkpoint(tiny_vq(), path)
    assert str(path) in str(err.value)


def halfway_pixels() -> torch.Tensor:
    """float32 values x in [-1, 1] whose (x + 1) / 2 * 255 is exactly k + 0.5, where the roundings differ."""
    found = []
    for k in range(255):
        x = torch.tensor(2 * (k + 0.5) / 255 - 1, dtype=torch.float32)
        for _ in range(4):  # nudge by one ulp until the float32 arithmetic lands on the half
            y = (x + 1) / 2 * 255
            if float(y) == k + 0.5:
                found.append(float(x))
                break
            x = torch.nextafter(x, torch.tensor(1.0 if float(y) < k + 0.5 else -1.0))
    return torch.tensor(found)


def test_pixel_roundings_match_each_reference(tmp_path) -> None:
    """``half_up`` = torchvision ``save_image(normalize=True, value_range=(-1, 1))`` (LlamaGen, LANTERN),
    ``truncate`` = the Janus recipe's numpy clip-and-store and Meta's ``_pil_from_chw_tensor`` (Lumina);
    they differ exactly at the halves, where ``half_even`` (the former conversion) differs from both."""
    import io

    import numpy as np
    from PIL import Image
    from torchvision.utils import save_image

    from coolsd.models.base import pixels_to_uint8

    halves = halfway_pixels()
    assert halves.numel() > 50
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([halves, torch.rand(3 * 64 * 64 - halves.numel(), generator=gen) * 2.4 - 1.2])  # some clamp
    image = x[torch.randperm(x.numel(), generator=gen)].view(3, 64, 64)
    buf = io.BytesIO()
    save_image(image, buf, format="png", normalize=True, value_range=(-1, 1))
    torchvision_png = torch.from_numpy(np.array(Image.open(io.BytesIO(buf.getvalue())))).permute(2, 0, 1)
    assert torch.equal(pixels_to_uint8(image, "half_up"), torchvision_png)
    janus = np.zeros((64, 64, 3), dtype=np.uint8)
    janus[:, :, :] = np.clip((image.permute(1, 2, 0).numpy() + 1) / 2 * 255, 0, 255)
    meta = ((torch.clamp(image, -1.0, 1.0) + 1.0) / 2.0).permute(1, 2, 0).numpy()
    for reference in (janus, (meta * 255).astype(np.uint8)):
        assert torch.equal(pixels_to_uint8(image, "truncate"), torch.from_numpy(reference).permute(2, 0, 1))
    k = ((halves + 1) / 2 * 255).floor().to(torch.uint8)  # x maps to k + 0.5
    assert torch.equal(pixels_to_uint8(halves, "half_up"), k + 1)
    assert torch.equal(pixels_to_uint8(halves, "truncate"), k)
    assert torch.equal(pixels_to_uint8(halves, "half_even"), k + (k % 2))
    with pytest.raises(ValueError, match="pixel_rounding"):
        pixels_to_uint8(halves, "nearest")
