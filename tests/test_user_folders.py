"""src/core/user_folders.py: where a process keeps its own files when the home folder cannot be written (a container
run as a user without a home, ``docker run --user UID``). The ranks' shared bf16 answer there: tests/test_fast_path.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from src.core import user_folders
from tests.conftest import ROOT

# what a process prints of its folders, once src has loaded and matplotlib with it (torchmetrics' import in a run)
SHOW = (
    "import os, src, matplotlib.pyplot as p, matplotlib as m; print(os.environ.get('MPLCONFIGDIR'), m.get_cachedir())"
)


def show_folders(home: Path, tmp: Path) -> subprocess.CompletedProcess:
    """A real process whose home is ``home`` and whose temp dir is ``tmp``, nothing else set of its folders."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MPL"))}
    env.update(HOME=str(home), TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-c", SHOW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_home_that_cannot_be_written_gives_matplotlib_a_folder_of_the_users_own_and_no_warning(tmp_path):
    """Before, each process said ``mkdir -p failed for path ...`` and ``Matplotlib created a temporary cache directory
    ...`` (two warnings a rank, every run) and built matplotlib's font cache again in a folder of its own."""
    (tmp_path / "file").write_text("")
    node = tmp_path / "node"
    node.mkdir()
    for _ in range(2):  # the second finds the font cache the first built
        done = show_folders(tmp_path / "file" / "home", node)  # a home under a file: nothing can be made there
        assert done.returncode == 0, done.stderr
        assert "matplotlib" not in done.stderr.lower(), done.stderr
        own = node / f"cifar10-ddp-{os.getuid()}"
        assert done.stdout.split() == [str(own / "matplotlib")] * 2
    assert (own.stat().st_mode & 0o777) == 0o700 and list((own / "matplotlib").glob("fontlist-*.json"))
    # a home that can be written: matplotlib's own folders there, the variable unset
    done = show_folders(tmp_path / "home", node)
    assert done.returncode == 0 and "matplotlib" not in done.stderr.lower(), done.stderr
    assert done.stdout.split() == ["None", str(tmp_path / "home" / ".cache" / "matplotlib")]


def test_a_cache_folder_is_the_homes_where_it_can_be_written_else_the_users_node_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert user_folders.cache_folder("c") == tmp_path / "cache" / "c" and (tmp_path / "cache" / "c").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    own = tmp_path / "tmp" / f"cifar10-ddp-{os.getuid()}"
    assert user_folders.cache_folder("c") == own / "c"
    # a node folder's name that another user or a link holds is not taken: the home's path, which cannot be kept
    own.rmdir()
    (tmp_path / "elsewhere").mkdir()
    own.symlink_to(tmp_path / "elsewhere")
    assert user_folders.cache_folder("c") == tmp_path / "file" / "cache" / "c"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert user_folders.cache_folder("c") == own / "c"  # no home to name: the node folder's path all the same
