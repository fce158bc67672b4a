"""src/core/startup.py: which command lines load with the garbage collector off, and that each command turns it on
again. A cold worker's collector, as training starts, is checked in tests/test_torchrun.py."""

from __future__ import annotations

import ast
import gc

import pytest

from src.core import startup
from tests.conftest import ROOT


@pytest.mark.parametrize(
    "argv, ours",
    [
        (["python", "-m", "src.train", "trainer.devices=2"], True),
        (["/venv/bin/python", "-u", "-m", "src.train"], True),  # a torchrun worker
        (["python", "-X", "importtime", "-B", "-m", "src.eval", "ckpt_path=x"], True),
        (["python", "-Ximporttime", "-m", "src.predict"], True),
        (["python", "-m", "src.export"], True),
        (["python", "-m", "src.slurm_sweep", "--", "trainer.devices=1,2"], False),  # loads no torch
        (["python", "-m", "pytest", "tests"], False),
        (["python", "-m", "tests.warm", "/tmp/socket"], False),
        (["python", "-c", "import src.train", "-m", "src.train"], False),
        (["python", "benchmarks/bench.py", "-m", "src.train"], False),
        (["python", "-m"], False),
        (["python"], False),
    ],
)
def test_only_the_four_commands_started_with_dash_m_pause_the_collector(argv, ours):
    assert startup.started_as_command(argv) is ours


def test_resume_freezes_and_turns_on_only_what_pause_turned_off(monkeypatch):
    assert gc.isenabled()
    made = [[] for _ in range(1000)]  # objects the collector tracks, made since the suite's own freeze
    frozen = gc.get_freeze_count()
    startup.resume()  # not paused: nothing frozen
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    monkeypatch.setattr("sys.orig_argv", ["python", "-m", "src.train"])
    try:
        startup.pause()
        assert not gc.isenabled()
        startup.resume()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.enable()


@pytest.mark.parametrize("command", startup.COMMANDS)
def test_every_command_that_pauses_turns_the_collector_on_again_in_its_main(command):
    """A command left out would train with no cyclic garbage collection at all."""
    tree = ast.parse((ROOT / (command.replace(".", "/") + ".py")).read_text())
    (main,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    calls = [
        node for node in ast.walk(main) if isinstance(node, ast.Call) and ast.unparse(node.func) == "startup.resume"
    ]
    assert calls, f"{command}'s main never calls startup.resume()"
