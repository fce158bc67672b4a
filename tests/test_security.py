"""What the project trusts and exposes: the locked dependency set and its floors, make install / make audit, the
rendezvous's listening sockets, and a checkpoint's hyperparameters read as data (docs/security.md).

The multi-process runs are watched where other tests start them already: a sweep of ddp and ddp_spawn jobs
(tests/test_sweep.py) and torchrun --standalone (tests/test_torchrun.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import struct
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from src.checkpoints.files import read_checkpoint
from src.checkpoints.resume import check_compatible, model_hparams_of
from src.core.errors import UserError
from src.distributed.strategy import LOOPBACK, _bound_listener, keep_to_loopback, rendezvous_store
from tests.conftest import ROOT, free_port, output, run_module
from tests.test_serving import WILDCARD, listeners_of

LOCK = ROOT / "requirements.lock"

# advisory: (packages, the versions it affects, releases pyproject.toml must refuse)
ADVISORIES = {
    "GHSA-w37p-236h-pfx3": (("lightning",), ("==2.6.2", "==2.6.3"), ("2.6.2", "2.6.3")),
    "CVE-2026-58659": (("lightning", "pytorch-lightning"), ("<2.6.6",), ("2.4.0", "2.6.1", "2.6.5")),
    "CVE-2025-32434": (("torch",), ("<2.6.0",), ("2.4.0", "2.5.1")),
    "CVE-2026-24747": (("torch",), ("<2.10.0",), ("2.6.0", "2.9.1")),
}


def locked() -> dict[str, tuple[Version, int]]:
    """{package: (version, number of hashes)} of requirements.lock."""
    found = {}
    for block in re.split(r"\n(?=\S)", LOCK.read_text()):
        match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if match:
            found[match[1].lower().replace("_", "-")] = (Version(match[2]), block.count("--hash=sha256:"))
    return found


def pyproject_requirements() -> list[Requirement]:
    """Every requirement of pyproject.toml, its extras' too, but the project's own (dev names it)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(text) for text in texts if not text.startswith(project["name"])]


def test_the_lock_holds_no_release_an_advisory_names_and_pyproject_refuses_them_too():
    versions, requirements = locked(), {r.name: r for r in pyproject_requirements()}
    for advisory, (packages, affected, examples) in ADVISORIES.items():
        for package in packages:
            version = versions[package][0]
            assert not any(SpecifierSet(spec).contains(version) for spec in affected), (advisory, package, version)
        # pip install -e . without the lock must not admit them either
        assert not any(requirements[packages[0]].specifier.contains(v) for v in examples), advisory


def test_every_locked_file_has_a_hash_and_every_dependency_is_locked_within_its_range():
    versions, text = locked(), LOCK.read_text()
    assert len(versions) > 100 and all(hashes for _, hashes in versions.values())
    assert " @ " not in text and "--index-url" not in text and "--find-links" not in text  # no path, no local index
    assert re.search(r"with Python \d+\.\d+\n# for: \w+-\w+", text)  # what make install checks first
    for requirement in pyproject_requirements():
        assert requirement.name in versions, f"{requirement} is not in the lock: make lock"
        assert requirement.specifier.contains(versions[requirement.name][0]), (requirement, versions[requirement.name])
    assert {"pip", "setuptools"} <= versions.keys()  # the installer and the project's build backend: locked too


def test_make_install_installs_the_lock_with_hash_checking_and_the_project_without_dependencies(tmp_path):
    result = subprocess.run(
        ["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, output(result)
    commands = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert len(commands) == 2 and "--require-hashes -r requirements.lock" in commands[0]
    assert "--no-deps --no-build-isolation -e ." in commands[1]


def test_a_lock_for_another_python_stops_make_install_in_one_line(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text(re.sub(r"with Python \S+", "with Python 3.99", LOCK.read_text(), count=1))
    result = subprocess.run(
        ["make", "-s", "install", f"LOCK={lock}", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert re.fullmatch(
        rf"error: {lock} is for Python 3\.99 on \S+, but python3 is Python "
        r"\d+\.\d+ on \S+: run make lock to lock for this machine, .*",
        result.stderr.splitlines()[0],
    )
    assert not (tmp_path / "venv").exists()


def test_make_audit_that_cannot_reach_its_advisory_service_fails_in_one_line(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "https_proxy": closed, "HTTPS_PROXY": closed}
    result = subprocess.run(
        ["make", "-s", "audit", f"TOOLS={tmp_path / 'tools'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, output(result)
    assert result.stderr.startswith("error: make audit cannot read the advisory data of pypi (https://pypi.org/pypi/")
    assert "nothing was audited" in result.stderr.splitlines()[0]
    assert not (tmp_path / "tools").exists()  # it stopped before installing pip-audit


# -- what a run listens on ----------------------------------------------------------------------------------------


def listened(port: int) -> set[str]:
    return {address for address, listening, _ in listeners_of([os.getpid()]) if listening == port}


def test_the_rendezvous_store_of_one_node_listens_on_loopback_only(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", LOOPBACK)
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = rendezvous_store(0, 1, timedelta(seconds=30))
    store.set("key", "value")
    assert listened(port) == {LOOPBACK}
    del store


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine's interfaces other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                address = socket.inet_ntoa(
                    fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24]
                )  # SIOCGIFADDR
            except OSError:
                continue
            if not address.startswith("127."):
                return address
    return None


def test_the_rendezvous_store_across_nodes_listens_on_master_addr_only(monkeypatch):
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no network interface beside loopback")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = rendezvous_store(0, 1, timedelta(seconds=30))
    assert listened(port) == {address}
    del store


@pytest.mark.parametrize(
    "host, why",
    [
        ("203.0.113.1", "(203.0.113.1) is not an address of this node"),  # TEST-NET-3: no address of this machine
        ("localhost", "(127.0.0.1) resolves to loopback on this node"),  # as a node's name in /etc/hosts often does
    ],
)
def test_a_master_addr_other_nodes_cannot_reach_here_leaves_the_store_on_every_interface_and_says_so(caplog, host, why):
    with caplog.at_level(logging.WARNING, logger="src.distributed.strategy"):
        assert _bound_listener(host, free_port()) is None
    assert f"MASTER_ADDR={host} {why}" in caplog.text
    assert "the rendezvous store listens on every interface" in caplog.text


def test_a_taken_master_port_is_one_error_line():
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        with pytest.raises(UserError, match=rf"^MASTER_PORT={taken.getsockname()[1]} cannot be used on 127\.0\.0\.1 "):
            _bound_listener(LOOPBACK, taken.getsockname()[1])


def test_one_node_keeps_gloo_and_nccl_to_loopback_unless_told_otherwise(monkeypatch):
    if "lo" not in {name for _, name in socket.if_nameindex()}:
        pytest.skip("no interface named lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    keep_to_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def assert_loopback_only(listeners: set[tuple[str, int, int]], what: str) -> None:
    """Something listened (the test saw the run), and only on loopback."""
    assert listeners, f"no listening socket seen during {what}"
    assert {address for address, _, _ in listeners} <= {LOOPBACK, "::1"}, listeners
    assert not {address for address, _, _ in listeners} & WILDCARD


# -- checkpoint metadata is data ---------------------------------------------------------------------------------


def crafted(path: Path, **hparams) -> Path:
    """A checkpoint that loads under weights_only=True, with this project's hyperparameters changed by ``hparams``."""
    from src.models.classifier import ImageClassifier

    saved = {**dict(ImageClassifier(arch="resnet18").hparams), **hparams}
    torch.save(
        {
            "state_dict": {},
            "hyper_parameters": saved,
            "pytorch-lightning_version": "2.6.6",
            "epoch": 0,
            "global_step": 0,
        },
        path,
    )
    return path


MODEL = {"arch": "resnet18", "stem": "cifar", "num_classes": 10}


@pytest.mark.parametrize(
    "hparams, named",
    [
        ({"_instantiator": "os.system"}, "hyperparameter '_instantiator' which this project's model does not have"),
        ({"_target_": "builtins.exec"}, "hyperparameter '_target_' which"),
        ({"arch": "os.system"}, "hyperparameter arch='os.system' that is no torchvision ResNet"),
        (
            {"optimizer": {"lr": 0.1, "_target_": "os.system"}},
            "hyperparameter optimizer.'_target_' which model.optimizer",
        ),
        ({"scheduler": {"decay": ["os.system"]}}, "hyperparameter scheduler.decay = list, not a number"),
        ({"stem": "../../etc"}, "hyperparameter stem='../../etc' that is not one of cifar, imagenet"),
        ({"num_classes": -1}, "hyperparameter num_classes='-1' that is not a class count"),
    ],
)
def test_a_crafted_checkpoint_that_loads_weights_only_is_refused_by_its_hyperparameters(tmp_path, hparams, named):
    path = crafted(tmp_path / "crafted.ckpt", **hparams)
    checkpoint = read_checkpoint(path)  # weights_only=True loads it: the values are plain data
    with pytest.raises(UserError) as refused:
        check_compatible(checkpoint, path, MODEL)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).endswith(
        "it is not a checkpoint src.train wrote, or was altered; pass another checkpoint"
    )


def test_the_hyperparameters_the_model_saves_pass_the_check(tmp_path):
    path = crafted(tmp_path / "plain.ckpt")
    checkpoint = read_checkpoint(path)
    check_compatible(checkpoint, path, MODEL)
    assert model_hparams_of(checkpoint, path)["arch"] == "resnet18"


@pytest.mark.parametrize("entry", ["src.eval", "src.train"])
def test_eval_and_resume_refuse_an_instantiator_in_one_line_before_loading_anything(tmp_path, entry):
    path = crafted(tmp_path / "crafted.ckpt", _instantiator="os.system")
    result = run_module(
        entry,
        f"ckpt_path={path}",
        "data=synthetic",
        "trainer.accelerator=cpu",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert result.returncode == 2, output(result)[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: ckpt_path={path} holds hyperparameter '_instantiator' which this project's model does "
        "not have (it has arch, channels_last, compile, label_smoothing, num_classes, optimizer, "
        "scheduler, stem, width): it is not a checkpoint src.train wrote, or was altered; pass another "
        "checkpoint"
    ], output(result)[-3000:]
    assert "Traceback" not in output(result)


def test_nothing_here_imports_a_module_named_by_a_checkpoint():
    """The guard above is the only door: no src module hands checkpoint values to import or instantiate."""
    for path in (ROOT / "src").rglob("*.py"):
        text = path.read_text()
        for call in re.findall(r"(?:instantiate|import_module|__import__|locate)\(([^)]*)\)", text):
            assert "hyper_parameters" not in call and "checkpoint" not in call, (path, call)
