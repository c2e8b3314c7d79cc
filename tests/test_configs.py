"""Every YAML in every config group composes and instantiates (on the tiny model), and bad values fail loudly."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from tests.helpers import CONFIGS

GROUPS = ("model", "drafter", "decoder", "eval", "data", "logger")
LLAMAGEN_T2I = ("llamagen_t2i_256", "llamagen_t2i_512", "llamagen_t2i_256_lantern", "llamagen_t2i_512_lantern")
LLAMAGEN_T2I_TINY = [
    "model.pretrained=false", "model.text_encoder=tiny_random", "model.gpt_size=null", "model.dtype=float32",
    "+model.gpt.dim=64", "+model.gpt.n_layer=2", "+model.gpt.n_head=4", "+model.gpt.multiple_of=32",
    "model.gpt.vocab_size=1024", "model.gpt.caption_dim=32", "model.gpt.cls_token_num=8", "model.gpt.block_size=16",
    "model.vq.codebook_size=1024", "model.vq.ch=32", "model.vq.encoder_ch_mult=[1,2]",
    "model.vq.decoder_ch_mult=[1,2]", "model.vq.z_channels=32", "model.vq.num_res_blocks=1",
]
GLM_IMAGE_TINY = ["model.pretrained=false", "model.arch={}", "model.height=128", "model.width=128",
                  "model.preview_side=2", "model.pixel_decoder=codes"]
# Extra overrides a group option needs before it can be built on this machine (mandatory values);
# ``{name}`` fields are filled from the ``made_files`` fixture (files the tests create).
NEEDS = {
    ("data", "file"): [f"data.path={CONFIGS.parent / 'pyproject.toml'}"],
    ("data", "coco"): ["data.path={coco_captions}"],
    ("data", "coco_train"): ["data.path={coco_captions}"],  # the same file format (train2017 captions)
    ("data", "coco2014"): ["data.path={coco_captions}"],  # the same file format (val2014 captions, COCO-30k)
    ("data", "parti"): ["data.path={parti}"],
    ("drafter", "eagle"): ["drafter.checkpoint={eagle_checkpoint}"],
    # Janus-Pro: a random tiny model instead of the hub download; its EAGLE drafter from a tiny checkpoint
    ("model", "janus_pro_1b"): ["model.pretrained=false", "model.arch={}"],
    ("model", "janus_pro_7b"): ["model.pretrained=false", "model.arch={}"],
    ("drafter", "janus_pro_1b"): ["model.pretrained=false", "model.arch={}",
                                  "drafter.checkpoint={janus_eagle_checkpoint}"],
    ("drafter", "janus_pro_7b"): ["model.pretrained=false", "model.arch={}",
                                  "drafter.checkpoint={janus_eagle_checkpoint}"],
    # LlamaGen T2I: random tiny sizes, the tiny random T5; its EAGLE drafter from a tiny c2i checkpoint
    # (the same width, heads, FFN and vocabulary) saved with LANTERN's prefix convention (prefix: all)
    **{("model", name): LLAMAGEN_T2I_TINY for name in LLAMAGEN_T2I},
    **{("drafter", name): [*LLAMAGEN_T2I_TINY, "drafter.checkpoint={eagle_all_checkpoint}"] for name in LLAMAGEN_T2I},
    # Lumina-mGPT: random weights of random_init's sizes (no hub, no Meta files); EAGLE from a tiny checkpoint
    ("model", "lumina_mgpt_768"): ["model.pretrained=false"],
    ("drafter", "lumina_mgpt_768"): ["model.pretrained=false", "drafter.checkpoint={lumina_eagle_checkpoint}"],
    # Anole: the same random Chameleon sizes (random_init as lumina_mgpt_768's); EAGLE from that tiny checkpoint
    ("model", "anole_7b"): ["model.pretrained=false"],
    ("drafter", "anole_7b"): ["model.pretrained=false", "drafter.checkpoint={lumina_eagle_checkpoint}"],
    # Emu3-Gen: a random tiny model on a 4x4 grid instead of the hub download; EAGLE from a tiny checkpoint
    ("model", "emu3_gen"): ["model.pretrained=false", "model.arch={}", "model.image_area=1024"],
    ("drafter", "emu3_gen"): ["model.pretrained=false", "model.arch={}", "model.image_area=1024",
                              "drafter.checkpoint={emu3_eagle_checkpoint}"],
    # GLM-Image: a random tiny AR stage at glm_image_tiny's layout, pixels as code colours (no diffusers); EAGLE from
    # a tiny checkpoint
    ("model", "glm_image"): GLM_IMAGE_TINY,
    ("drafter", "glm_image"): [*GLM_IMAGE_TINY, "drafter.checkpoint={glm_image_eagle_checkpoint}"],
}


@pytest.fixture(scope="module")
def made_files(tmp_path_factory) -> dict[str, str]:
    """An untrained EAGLE drafter checkpoint for the tiny model (what ``drafter=eagle`` loads)."""
    from coolsd.drafters.eagle import EagleHead, save_eagle
    from tests.helpers import tiny_llamagen

    path = tmp_path_factory.mktemp("eagle_tiny")
    save_eagle(EagleHead(tiny_llamagen()), path)
    all_prefix = tmp_path_factory.mktemp("eagle_tiny_all")
    save_eagle(EagleHead(tiny_llamagen(), prefix="all"), all_prefix)
    from coolsd.models.janus_pro import JanusPro

    janus = tmp_path_factory.mktemp("eagle_janus_tiny")  # for the janus_pro_* drafters on JanusArch() sizes
    save_eagle(EagleHead(JanusPro(sampling={"cfg_scale": 5.0}, pretrained=False, arch={}, device="cpu")), janus)
    from coolsd.models.lumina_mgpt import LuminaMGPT

    lumina = tmp_path_factory.mktemp("eagle_lumina_tiny")  # for lumina_mgpt_768 with pretrained=false
    save_eagle(EagleHead(LuminaMGPT(sampling={"cfg_scale": 3.0}, pretrained=False, device="cpu")), lumina)
    from coolsd.models.emu3 import Emu3Gen
    from coolsd.models.glm_image import GlmImage

    glm = tmp_path_factory.mktemp("eagle_glm_image_tiny")  # for glm_image with GLM_IMAGE_TINY
    save_eagle(EagleHead(GlmImage(sampling={}, pretrained=False, arch={}, height=128, width=128, preview_side=2,
                                  pixel_decoder="codes", device="cpu")), glm)
    emu3 = tmp_path_factory.mktemp("eagle_emu3_tiny")  # for emu3_gen with pretrained=false
    save_eagle(EagleHead(Emu3Gen(sampling={"cfg_scale": 3.0}, pretrained=False, arch={}, image_area=1024,
                                 device="cpu")), emu3)
    data = tmp_path_factory.mktemp("prompt_sets")  # tiny COCO captions and PartiPrompts files
    (data / "annotations").mkdir()
    (data / "annotations" / "captions_val2017.json").write_text(
        '{"annotations": [' + ", ".join(f'{{"image_id": {i}, "id": {i}, "caption": "c{i}"}}' for i in range(3)) + "]}")
    (data / "parti.tsv").write_text("Prompt\tCategory\tChallenge\tNote\n" + "".join(f"p{i}\tA\tB\t\n" for i in range(3)))
    return {"eagle_checkpoint": str(path), "eagle_all_checkpoint": str(all_prefix), "janus_eagle_checkpoint": str(janus), "lumina_eagle_checkpoint": str(lumina),
            "emu3_eagle_checkpoint": str(emu3), "glm_image_eagle_checkpoint": str(glm),
            "coco_captions": str(data / "annotations" / "captions_val2017.json"), "parti": str(data / "parti.tsv")}


def fill(override: str, files: dict[str, str]) -> str:
    """Replace the ``{name}`` fields of ``files`` in an override (other braces, e.g. ``arch={}``, stay)."""
    for name, path in files.items():
        override = override.replace("{" + name + "}", path)
    return override


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_with(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


CASES = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}/{o}" for g, o in CASES])
def test_every_group_option_instantiates(group, option, made_files):
    overrides = [f"{group}={option}", *(fill(o, made_files) for o in NEEDS.get((group, option), []))]
    if group == "drafter":  # a drafter is built for the model of the same name (the tiny one otherwise)
        model = option if option in options("model") else "embedded" if option.startswith("embedded") else "tiny"
        overrides.append(f"model={model}")  # drafter=embedded_weak: the embedded model's second drafter
    cfg = compose_with(overrides)
    if group == "model":
        assert isinstance(instantiate(cfg.model), ImageARModel)
        return
    model = instantiate(cfg.model)
    if group == "drafter":
        assert isinstance(instantiate(cfg.drafter)(target=model), Drafter)
    elif group == "decoder":
        assert isinstance(instantiate(cfg.decoder, model=model), Decoder)
    elif group == "data":
        assert len(instantiate(cfg.data).load(model, 3)) == 3
    else:
        assert instantiate(cfg[group]) is not None


def test_suite_holds_every_decoder_option():
    cfg = compose_with([])
    assert set(cfg.suite) == set(options("decoder"))
    assert all(cfg.suite[name].name == name for name in cfg.suite)


def test_bad_values_name_the_key():
    cfg = compose_with(["model.sampling.top_p=2.0"])
    with pytest.raises(Exception, match="sampling.top_p"):
        instantiate(cfg.model)
    cfg = compose_with(["decoder.draft_len=-1"])
    model = instantiate(compose_with([]).model)
    with pytest.raises(Exception, match="draft_len"):
        instantiate(cfg.decoder, model=model)
