"""The examples of ``docs/extending.md`` run against the current interfaces.

The page's Python blocks run in order in one namespace on the tiny random-weight LlamaGen (``model=tiny``,
``drafter=tiny``), each block's own ``assert`` lines checking what it claims (the raster order gives AR's tokens,
the capped verifier never commits more than ``cap + 1`` tokens, …). A block whose first line names a module file
(``# baselines/floor.py``) is loaded as that module, so the blocks after it (and a config's ``_target_``) import
it as a user's file would be. The rule's three files (module, ``configs/decoder/<name>.yaml`` and the suite line of
``configs/config.yaml``) are written into a copy of ``configs/`` and the decoder is composed and instantiated there
as ``run.py`` would, with the suite check of ``tests/test_configs.py``.

Example: ``python -m pytest -q -n 0 tests/test_extending.py``.
"""
from __future__ import annotations

import re
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver that configs use)
from coolsd.decoding import Decoder

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "extending.md"
FILE_HEADER = re.compile(r"#\s*(\S+\.(?:py|yaml))\s*$")
SUITE_LINE = re.compile(r"^\s*-\s*decoder@suite\.(\w+):\s*(\w+)\s*$")


@dataclass(frozen=True)
class Block:
    language: str
    code: str

    @property
    def file(self) -> str | None:
        """The repository path a block stands for (its first line ``# <path>``), or None for a snippet."""
        first = self.code.splitlines()[0] if self.code.strip() else ""
        match = FILE_HEADER.fullmatch(first.strip())
        return match.group(1) if match else None


def blocks(text: str) -> list[Block]:
    return [Block(lang, code) for lang, code in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)]


PAGE_BLOCKS = blocks(PAGE.read_text(encoding="utf-8"))
MODULES = [b for b in PAGE_BLOCKS if b.language == "python" and b.file]
SNIPPETS = [b for b in PAGE_BLOCKS if b.language == "python" and not b.file]
CONFIGS = [b for b in PAGE_BLOCKS if b.language == "yaml" and b.file]
SUITE_LINES = [line for b in PAGE_BLOCKS if b.language == "yaml" and not b.file for line in b.code.splitlines()
               if SUITE_LINE.match(line)]


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


@pytest.fixture
def page_modules(monkeypatch):
    """The page's module files, loaded under their dotted names for the test's duration (nothing is written
    into the repository)."""
    for block in MODULES:
        name = module_name(block.file)
        assert not (ROOT / block.file).exists(), f"{block.file}: the page's example would shadow a real file"
        module = types.ModuleType(name)
        module.__file__ = str(ROOT / block.file)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, leaf = name.rpartition(".")
        if parent:
            __import__(parent)
            monkeypatch.setattr(sys.modules[parent], leaf, module, raising=False)
        exec(compile(block.code, block.file, "exec"), module.__dict__)
    return MODULES


def test_the_page_has_the_examples_it_promises():
    assert len(SNIPPETS) >= 6, "a setup block and one runnable example per extension point"
    assert [b.file for b in MODULES] == ["baselines/floor.py"]
    assert [b.file for b in CONFIGS] == ["configs/decoder/floor.yaml"]
    assert len(SUITE_LINES) == 1


def test_the_python_examples_run_in_order(page_modules, monkeypatch):
    monkeypatch.chdir(ROOT)  # the setup block composes configs/ as run.py does
    namespace: dict = {"__name__": "docs_extending"}
    for i, block in enumerate(SNIPPETS):
        exec(compile(block.code, f"docs/extending.md, python block {i + 1}", "exec"), namespace)
    assert isinstance(namespace["floor"], Decoder)


def test_a_rule_is_three_files(page_modules, tmp_path):
    """The page's module, decoder config and suite line make a decoder ``run.py`` can compose and compare."""
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    (config,) = CONFIGS
    target = configs / Path(config.file).relative_to("configs")
    assert not target.exists()
    target.write_text(config.code, encoding="utf-8")
    (suite_line,) = SUITE_LINES
    name = SUITE_LINE.match(suite_line).group(1)
    main = configs / "config.yaml"
    lines = main.read_text(encoding="utf-8").splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if SUITE_LINE.match(line.split("#")[0]))
    lines.insert(last + 1, suite_line.rstrip() + "\n")
    main.write_text("".join(lines), encoding="utf-8")
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"decoder={name}", "model=tiny", "drafter=tiny"])
    decoders = {p.stem for p in (configs / "decoder").glob("*.yaml")}
    assert set(cfg.suite) == decoders and cfg.suite[name].name == name  # tests/test_configs.py's suite check
    model = instantiate(cfg.model)
    decoder = instantiate(cfg.decoder, model=model)
    assert isinstance(decoder, Decoder) and decoder.name == name
    assert type(decoder.rule).__module__ == module_name(MODULES[0].file)
    (image,) = decoder.generate_batch(["three"], [0])
    assert image.tokens.shape == (model.num_image_tokens,) and image.stats.tv_per_step > 0
