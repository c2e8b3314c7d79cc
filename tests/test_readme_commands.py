"""Every command the README and the pages of ``docs/`` document composes: each ``python run.py …``, ``python scripts/<x>.py …``,
``torchrun …`` and ``accelerate launch …`` line of its code blocks, and each such command written as inline
code in its tables and prose (line continuations joined, comments,
``&&`` chains and environment prefixes handled) is composed with Hydra's compose API and its overrides (a
multirun ``-m``: once per swept value), or, for an argparse script, its arguments are parsed by the script's
own parser (stopped right after parsing; a script that takes ``run.py``'s overrides, as ``scripts/prefetch.py``
does, has them composed too). Nothing is loaded or run, so a documented command that would fail
at start-up fails here in a second.

Placeholders: ``model=<m>`` stands for any model and composes as ``model=tiny``; a placeholder in any other
value composes as its name (``data.path=<prompts.txt>`` as ``data.path=prompts.txt``). Anything else, e.g. a
literal ``...``, fails.
"""
from __future__ import annotations

import argparse
import ast
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver that configs use)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LAUNCHERS = {"torchrun", "srun"}
GROUP_PLACEHOLDERS = {"model": "tiny"}  # a config group given as <placeholder> composes with this option
PLACEHOLDER = re.compile(r"<[^<>\s]*>")


@dataclass(frozen=True)
class Command:
    line: str  # the command as the README writes it (one line)
    script: str  # path relative to the repository, e.g. run.py or scripts/bench.py
    args: tuple[str, ...]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def logical_lines(block: str) -> list[str]:
    """Lines of a shell block with ``\\``-continuations joined."""
    return [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def split_commands(tokens: list[str]) -> list[list[str]]:
    """Commands of a shell line: split at ``&&``, ``||``, ``;``, ``|`` and ``&``; redirections dropped."""
    out, current = [], []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in ("&&", "||", ";", "|", "&"):
            out.append(current)
            current = []
        elif re.fullmatch(r"[0-9]?>>?(&[0-9])?", tok):  # > file, >> file, 2>&1
            skip = not tok.endswith(("&1", "&2"))
        elif re.match(r"[0-9]?>", tok):  # >file, 2>file
            continue
        else:
            current.append(tok)
    out.append(current)
    return [c for c in out if c]


def script_of(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(script, its arguments) of a documented Python entry point, or None for other commands."""
    i = 0
    while i < len(tokens) and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[i]) or tokens[i] in ("env", "nohup")):
        i += 1  # environment prefixes: COCO_DIR=... python run.py, nohup python run.py
    rest = tokens[i:]
    if not rest:
        return None
    head = rest[0]
    if head in LAUNCHERS or head == "accelerate":
        k = 2 if head == "accelerate" and rest[1:2] == ["launch"] else 1
        if head == "srun":  # srun [options] python script.py ...
            rest = rest[1:]
            while rest and rest[0].startswith("-"):
                rest = rest[1:]
            return script_of(rest)
        rest = rest[k:]
        while rest and rest[0].startswith("-"):  # launcher options (--nproc_per_node=8, --multi_gpu, ...)
            takes_value = "=" not in rest[0] and len(rest) > 1 and not rest[1].endswith(".py") \
                and not rest[1].startswith("-") and rest[0] not in ("--multi_gpu", "--standalone")
            rest = rest[2:] if takes_value else rest[1:]
        return (rest[0], rest[1:]) if rest and rest[0].endswith(".py") else None
    if re.fullmatch(r"python[0-9.]*", head):
        rest = rest[1:]
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return script_of(["torchrun", *rest[2:]])
        if rest and rest[0].endswith(".py"):
            return rest[0], rest[1:]
    return None


INLINE_COMMAND = re.compile(r"([A-Za-z_]\w*=\S+ )*(python[0-9.]* (run\.py|scripts/|-m torch\.distributed\.run)"
                            r"|torchrun |accelerate launch |srun )")


def inline_commands(text: str) -> list[str]:
    """Commands written as inline code outside the code blocks (tables, prose): `python run.py …`."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if INLINE_COMMAND.match(span)]


def readme_commands(text: str) -> list[Command]:
    commands = []
    for block in [*code_blocks(text), "\n".join(inline_commands(text))]:
        for line in logical_lines(block):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (a code sample)
            for part in split_commands(tokens):
                found = script_of(part)
                if found is not None:
                    commands.append(Command(line.strip(), found[0], tuple(found[1])))
    return commands


def hydra_entry(script: Path) -> tuple[Path, str] | None:
    """(config folder, config name) of a script's ``@hydra.main``, or None for a script without it."""
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "main" and \
                getattr(node.func.value, "id", None) == "hydra":
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg in ("config_path", "config_name")}
            return (script.parent / kw["config_path"]).resolve(), kw["config_name"]
    return None


def with_placeholders(override: str) -> str:
    key, sep, value = override.partition("=")
    if sep and PLACEHOLDER.fullmatch(value) and key.lstrip("+~") in GROUP_PLACEHOLDERS:
        return f"{key}={GROUP_PLACEHOLDERS[key.lstrip('+~')]}"
    return PLACEHOLDER.sub(lambda m: m.group(0)[1:-1] or "x", override) if sep else override


def override_sets(args: list[str]) -> tuple[str | None, list[list[str]]]:
    """The config name given with ``--config-name`` (or None) and the override lists to compose: one list, or
    for a multirun one per swept value (the other sweeps at their first value)."""
    config_name, multirun, overrides = None, False, []
    it = iter(args)
    for a in it:
        if a in ("-m", "--multirun"):
            multirun = True
        elif a in ("--config-name", "-cn"):
            config_name = next(it)
        elif a.startswith("--config-name="):
            config_name = a.split("=", 1)[1]
        elif a in ("--cfg", "-c"):  # print the config instead of running: job, hydra or all
            part = next(it)
            assert part in ("job", "hydra", "all"), f"--cfg {part!r}: Hydra takes job, hydra or all"
        elif a in ("--resolve",):
            continue
        elif a.startswith("-"):
            raise AssertionError(f"unknown Hydra flag {a!r}")
        else:
            overrides.append(with_placeholders(a))
    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = [(k, o) for k, o in enumerate(parsed) if o.is_sweep_override()]
    if sweeps and not multirun:
        raise AssertionError(f"sweep values without -m: {[overrides[k] for k, _ in sweeps]}")
    first = list(overrides)
    values = {k: list(o.sweep_string_iterator()) for k, o in sweeps}
    for k, o in sweeps:
        first[k] = f"{o.get_key_element()}={values[k][0]}"
    sets = [first]
    for k, o in sweeps:
        for v in values[k][1:]:
            s = list(first)
            s[k] = f"{o.get_key_element()}={v}"
            sets.append(s)
    return config_name, sets


class _Parsed(Exception):
    pass


def parse_with_script_parser(script: Path, args: list[str]) -> argparse.Namespace:
    """Run the script's ``main`` until its parser has parsed ``args``: a bad argument exits with argparse's
    error (status 2); a good one stops there, before any work."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args_=None, namespace=None):
        raise _Parsed(real(self, args_, namespace))

    saved = sys.argv
    sys.argv = [str(script), *args]
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Parsed as done:
        return done.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = saved
    raise AssertionError(f"{script.name} finished without parsing arguments")


#: the README and every topic page of docs/ (docs/reference/ holds notes on other projects' code, not ours)
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = [c for page in PAGES for c in readme_commands(page.read_text())]
IDS = [f"{page.name}: {c.line[:80]}" for page in PAGES for c in readme_commands(page.read_text())]


def test_the_readme_documents_commands():
    scripts = {c.script for c in readme_commands(README.read_text())}
    assert "run.py" in scripts


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_readme_command_composes(command: Command):
    script = ROOT / command.script
    assert script.is_file(), f"{command.line}: no such script {command.script}"
    entry = hydra_entry(script)
    if entry is None:
        try:
            namespace = parse_with_script_parser(script, list(command.args))
        except SystemExit as e:
            raise AssertionError(f"{command.line}: its arguments do not parse (exit {e.code})") from None
        if isinstance(getattr(namespace, "overrides", None), list):  # run.py's overrides (scripts/prefetch.py)
            multirun = ["-m"] if getattr(namespace, "multirun", False) else []
            for overrides in override_sets([*multirun, *namespace.overrides])[1]:
                compose_job(ROOT / "configs", "config", overrides)
        return
    config_dir, default_name = entry
    config_name, sets = override_sets(list(command.args))
    for overrides in sets:
        compose_job(config_dir, config_name or default_name, overrides)


def compose_job(config_dir: Path, config_name: str, overrides: list[str]) -> None:
    """Compose like the script's ``@hydra.main`` would and resolve every interpolation of the job's config."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.to_container(task, resolve=True)  # every interpolation of the job's config resolves


def test_extraction_handles_continuations_comments_chains_and_launchers():
    text = "```bash\nCOCO_DIR=/d python run.py -m decoder=sd \\\n    decoder.draft_len=2,3   # sweep\n" \
           "python run.py -m experiment=x && python scripts/claims.py runs/x --out results\n" \
           "torchrun --nproc_per_node 8 --standalone run.py model=tiny\n" \
           "accelerate launch --multi_gpu --num_processes=8 scripts/train_drafter.py stage=train\n" \
           "srun --ntasks-per-node=8 python run.py model=tiny\npython -m pytest\npip install -r requirements.txt\n" \
           "nohup python run.py -m decoder=sd > submit.log 2>&1 &\n```\n"
    got = [(c.script, c.args) for c in readme_commands(text)]
    assert got == [("run.py", ("-m", "decoder=sd", "decoder.draft_len=2,3")),
                   ("run.py", ("-m", "experiment=x")), ("scripts/claims.py", ("runs/x", "--out", "results")),
                   ("run.py", ("model=tiny",)), ("scripts/train_drafter.py", ("stage=train",)),
                   ("run.py", ("model=tiny",)), ("run.py", ("-m", "decoder=sd"))]
    assert override_sets(["-m", "decoder=sd", "decoder.draft_len=2,3"])[1] == [
        ["decoder=sd", "decoder.draft_len=2"], ["decoder=sd", "decoder.draft_len=3"]]
    assert override_sets(["model=<m>", "data.path=<p.txt>"])[1] == [["model=tiny", "data.path=p.txt"]]


def test_a_command_that_does_not_compose_fails():
    bad = readme_commands("```\npython scripts/train_drafter.py model=janus_pro_1b data.prompt_file=p.txt\n"
                          "python scripts/make_tables.py --no-such-flag\n```\n")
    bad += readme_commands("```\npython scripts/prefetch.py model=no_such_model\n```\n")
    assert len(bad) == 3
    for command in bad:
        with pytest.raises(Exception):
            test_readme_command_composes(command)
