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
# Extra overrides a group option needs before it can be built on this machine (mandatory values);
# ``{name}`` fields are filled from the ``made_files`` fixture (files the tests create).
NEEDS = {
    ("data", "file"): [f"data.path={CONFIGS.parent / 'pyproject.toml'}"],
    ("drafter", "eagle"): ["drafter.checkpoint={eagle_checkpoint}"],
}


@pytest.fixture(scope="module")
def made_files(tmp_path_factory) -> dict[str, str]:
    """An untrained EAGLE drafter checkpoint for the tiny model (what ``drafter=eagle`` loads)."""
    from coolsd.drafters.eagle import EagleHead, save_eagle
    from tests.helpers import tiny_llamagen

    path = tmp_path_factory.mktemp("eagle_tiny")
    save_eagle(EagleHead(tiny_llamagen()), path)
    return {"eagle_checkpoint": str(path)}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_with(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


CASES = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}/{o}" for g, o in CASES])
def test_every_group_option_instantiates(group, option, made_files):
    overrides = [f"{group}={option}", *(o.format(**made_files) for o in NEEDS.get((group, option), []))]
    if group == "drafter":  # a drafter is built for the model of the same name (the tiny one otherwise)
        overrides.append(f"model={option if option in options('model') else 'tiny'}")
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
