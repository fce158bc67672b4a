"""The documentation stays true: its commands compose, its make targets exist, its links resolve.

Every ``python -m src.<module> ...``, ``torchrun ... -m src.train ...``, ``sbatch slurm/X.sbatch ...`` and
``make <target> ...`` of README.md and docs/*.md, in code blocks and inline code, is checked without running it:
a Hydra entry point's config is composed in-process with the command's overrides (an option, key or sweep
value that does not exist fails). Placeholders: a word ``...``, ``OVERRIDES`` or ``[...]`` in a command is
left out; a value written in capitals (``DIR``, ``PATH``) stays as it is, since composing reads no files; a
command with ``…`` in it (``python -m src.…``) names a family of commands, not one, and is not checked. A synopsis,
a command with ``a|b`` alternatives or ``[key=value]`` optional parts, is checked for its keys only.
"""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Iterator

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from omegaconf import OmegaConf, read_write

import src  # noqa: F401 - registers the resolvers conf/hydra uses
from src.cli.entry import check_group_choices
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"...", "OVERRIDES", "[OVERRIDES]", "[overrides]", "[sbatch", "options]"}
ENV = re.compile(r"[A-Z_][A-Z0-9_]*=.*")  # VAR=value: before a command, or a make variable
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(``?)(.+?)\1", re.S)


def commands(text: str) -> list[str]:
    """The shell commands of a page: each code-block line (continuations joined) and each inline code span."""
    found = []
    for block in FENCE.findall(text):
        found += [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    prose = FENCE.sub("", text)
    found += [" ".join(span.split()) for tick, span in INLINE.findall(prose) if tick == "`"]
    return [c for c in (_strip_env(c) for c in found) if c]


def _strip_env(line: str) -> str:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell (an unbalanced quote in prose)
        return ""
    while words and ENV.fullmatch(words[0]):
        words.pop(0)
    if words and Path(words[0]).name in ("python", "python3"):
        words[0] = "python"
    return shlex.join(words) if words and words[0] in ("python", "torchrun", "sbatch", "make") else ""


def documented() -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), c) for page in DOCS for c in commands(page.read_text()) if "…" not in c]


def src_call(command: str) -> tuple[str, list[str]] | None:
    """(module, arguments) of a command that runs a ``src`` module, directly or through a launcher."""
    words = [w for w in shlex.split(command) if w not in PLACEHOLDERS]
    if words[0] == "sbatch":
        script = next((w for w in words if w.endswith(".sbatch")), None)
        if script is None:  # sbatch options shown alone
            return None
        assert (ROOT / script).is_file(), f"{command}: {script} does not exist"
        fixed = re.search(r"-m src\.train (.*?)\"\$@\"", (ROOT / script).read_text().replace("\\\n", " "), re.S)
        assert fixed, f"{script} does not pass its arguments to python -m src.train"
        # the script's own arguments, less those it fills from the allocation (${...})
        return "src.train", [w for w in shlex.split(fixed.group(1)) if "$" not in w] + words[words.index(script) + 1 :]
    if "-m" in words and words.index("-m") + 1 < len(words) and words[words.index("-m") + 1].startswith("src."):
        at = words.index("-m")
        return words[at + 1], words[at + 2 :]
    return None


@cache
def hydra_config_name(module: str) -> str | None:
    """The config an entry point's ``@hydra.main`` composes, or None for a plain command-line tool."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    assert path.is_file(), f"python -m {module}: {path.relative_to(ROOT)} does not exist"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "hydra.main":
            return next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "config_name")
    return None


@cache
def compose_run(config_name: str, overrides: tuple[str, ...]) -> None:
    """Compose as the entry point would: Hydra's config with the overrides, its group checks, every value resolved."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        with read_write(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = str(ROOT / "outputs" / "docs-check")  # never written: nothing runs
        HydraConfig.instance().set_config(cfg)
        try:
            check_group_choices()  # src.cli.entry's: an unknown option of an optional group (experiment=...)
            OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
        finally:
            HydraConfig.instance().cfg = None  # no later test in this process sees a run


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Overrides to compose: each value of every swept key once (the others at their first value)."""
    if not multirun:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [_values(o) if o.is_sweep_override() else [o.input_line] for o in parsed]
    first = [v[0] for v in values]
    return [first] + [first[:i] + [v] + first[i + 1 :] for i, vs in enumerate(values) for v in vs[1:]]


def _values(override) -> list[str]:
    prefix = f"{override.get_key_element()}="
    if isinstance(override.value(), IntervalSweep):  # a search space: both ends
        return [prefix + str(override.value().start), prefix + str(override.value().end)]
    return [prefix + v for v in override.sweep_string_iterator()]


def check_src_command(module: str, args: list[str]) -> None:
    config_name = hydra_config_name(module)
    if config_name is not None and any("|" in a or (a.startswith("[") and "=" in a) for a in args):
        check_synopsis_keys(config_name, " ".join(args))
        return
    if module == "src.slurm_sweep":  # its overrides after "--" are src.train's, swept
        module, args, config_name = "src.train", ["-m", *args[args.index("--") + 1 :]], "train"
    if config_name is None:
        return  # a plain argparse tool: its file exists
    flags = {"-m", "--multirun", "--resolve"}
    overrides = [
        a
        for i, a in enumerate(args)
        if a not in flags and not a.startswith("--") and not (i and args[i - 1] == "--cfg")
    ]
    for job in jobs(overrides, "-m" in args or "--multirun" in args):
        compose_run(config_name, tuple(job))


def check_synopsis_keys(config_name: str, synopsis: str) -> None:
    """Every ``key=`` of a synopsis (``ckpt_path=PATH [format=onnx|safetensors] [top_k=3]``) is a key or a group."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    for key in re.findall(r"(?<![\w.\-])([a-z_][\w.]*)=", synopsis):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        assert key in cfg.hydra.runtime.choices or (OmegaConf.is_dict(node) and leaf in node.keys()), (
            f"{synopsis}: {key} is not a key of conf/{config_name}.yaml"
        )


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_make(command: str) -> None:
    words = [w for w in shlex.split(command)[1:] if w not in PLACEHOLDERS]
    makefile = (ROOT / "Makefile").read_text()
    for word in words:
        if ENV.fullmatch(word):  # a variable of the Makefile's, and for ARGS src.train's overrides
            name, value = word.split("=", 1)
            assert f"$({name})" in makefile, f"{command}: the Makefile has no variable {name}"
            if name == "ARGS" and "train" in words:
                check_src_command("src.train", shlex.split(value))
        else:
            assert word in make_targets(), f"{command}: the Makefile has no target {word}"


COMMANDS = documented()


def test_the_documentation_has_commands_of_every_kind():
    kinds = {c.split()[0] for _, c in COMMANDS}
    assert {"python", "torchrun", "sbatch", "make"} <= kinds
    assert any("src.eval" in c for _, c in COMMANDS) and any("slurm_sweep" in c for _, c in COMMANDS)


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_each_documented_command_composes(page, command):
    if command.startswith("make"):
        check_make(command)
        return
    for script in (w for w in shlex.split(command) if re.fullmatch(r"[\w./-]+/[\w-]+\.(py|sbatch)", w)):
        assert (ROOT / script).is_file(), f"{command}: {script} does not exist"
    call = src_call(command)
    if call is not None:
        check_src_command(*call)


def test_a_renamed_key_or_option_fails_the_check():
    with pytest.raises(Exception, match="max_epoch"):
        check_src_command("src.train", ["trainer.max_epoch=3"])
    with pytest.raises(Exception, match="horovod"):
        check_src_command("src.train", ["-m", "strategy=ddp,horovod"])
    with pytest.raises(Exception, match="resnet50"):
        check_src_command("src.train", ["experiment=resnet50"])  # an optional group Hydra alone would skip
    with pytest.raises(AssertionError, match="formt"):
        check_src_command("src.train", ["ckpt_path=PATH", "[formt=onnx|safetensors]"])
    with pytest.raises(AssertionError, match="no target"):
        check_make("make bench-gpu")
    with pytest.raises(AssertionError, match="no variable"):
        check_make("make bench BENCH_ARG=--compile")
    assert [c for c in commands("`error: ... (python -m src.train -m x)` and `A=1 python -m src.eval b=2`")] == [
        "python -m src.eval b=2"
    ]


def anchors(text: str) -> Iterator[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation dropped, spaces to '-', repeats get -1, -2."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def links(text: str) -> list[str]:
    prose = INLINE.sub("", FENCE.sub("", text))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    for link in links(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} points at nothing"
        if anchor:
            assert target.suffix == ".md", f"{page.name}: {link}: an anchor into a file that is not a page"
            assert anchor in set(anchors(target.read_text())), f"{page.name}: {link}: no such heading"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_the_documentation_names_exists(page):
    """A path in inline code (``src/launch/ranks.py``, ``conf/hydra/default.yaml``, ``tests/slurm/``) is a file or
    folder."""
    for _tick, span in INLINE.findall(FENCE.sub("", page.read_text())):
        for path in re.findall(
            r"(?<![\w./-])((?:src|tests|conf|benchmarks|slurm|hydra_plugins|docs)/[\w./-]*[\w/])", span
        ):
            assert (ROOT / path).exists(), f"{page.name}: {path} does not exist"


def test_the_anchor_rules_are_githubs():
    text = "# The GPU path\n## `make gpu-check`: the first run\n## Notes\n## Notes\n```\n# not a heading\n```\n"
    assert list(anchors(text)) == ["the-gpu-path", "make-gpu-check-the-first-run", "notes", "notes-1"]
