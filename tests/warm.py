"""Warm starts for the tests: ``python -m src.train ...`` without importing torch, Lightning and Hydra each time.

A process that has imported the heavy packages once (and run nothing: no thread pool, no process group) forks a
child per run; the child takes the test's pipes, environment, working directory and process group, and runs the
module as ``python -m`` would (``runpy``, ``__main__`` and ``sys.argv`` alike). It is a real process: its own pid,
signals, exit status and process group; only its start is skipped. Each run's local ranks start the same way, from
spare children the run forks before it runs anything, so they are the run's children as ``subprocess.Popen``
(``strategy=ddp``) or multiprocessing's spawn (``strategy=ddp_spawn``: the spare takes the descriptors spawn passes
and runs spawn's own code) would make them; so does each rank's DataLoader forkserver (src/data/workers.py), from a
spare of that rank. ``popen()`` falls back to a cold ``subprocess.Popen`` where a warm start
could differ: another executable, a variable read when torch or Python load (``OMP_*``, ``TORCH*``, ``LD_*``, ...),
or ``CIFAR10_DDP_COLD=1``. Tests whose subject is the start itself (a launcher's own start, ``/proc``'s command
lines) start cold. A torchrun agent (``python -m torch.distributed.run ... -m src.X``) starts warm with a spare for
each worker of its node (twice that where it may restart them), so that its workers are its own children as torchrun
starts them (a session each).
Nothing in ``src/`` knows about this.

``python -m tests.warm SOCKET`` is the parent; ``popen()`` starts it on first use and it ends with the session.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import inspect
import io
import json
import multiprocessing.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
HEAVY = (
    "numpy",
    "torch",
    "torchvision",
    "lightning.pytorch",
    "torchmetrics",
    "hydra",
    "omegaconf",
    "torch.utils.tensorboard",
    "tensorboard.backend.event_processing.event_accumulator",
)
# imported by every run where installed (the s3 extra): Lightning's ModelCheckpoint asks whether its folder is in an
# object store, and that imports s3fs and aiobotocore (0.2 s of a warm run)
HEAVY_IF_INSTALLED = ("s3fs",)
# read when Python, torch or its libraries load: a run that sets them differently must start cold
IMPORT_TIME = (
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "LD_",
    "MALLOC_",
    "CUDA_",
    "TRITON_",
    "PYTHON",
)
# the parent runs unbuffered, as every test's run does; torch and Lightning set the others in the tests' own process
# (a CUDA count, inductor's config) or read them when they run, not when they load (torchrun's rendezvous, when it
# starts: whether its store is shared with the workers)
KEEP = (
    "PYTHONUNBUFFERED",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)
SPARES_MAX = 8  # spare children of one warm run, at most (each a fork: pages shared)
TORCHRUN = "torch.distributed.run"  # torchrun's module: an agent that starts python -u -m src.X workers
# what torchrun's agent sets for its workers, read only when they run (the elastic error file, the run's id and
# restart count, NCCL's error handling): a worker whose import-time variables differ from its agent's only in these
# starts warm
AGENT_SET = ("TORCHELASTIC_", "TORCH_NCCL_")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in KEEP}


# ---------------------------------------------------------------------------------------------------------- parent


def serve(path: str) -> dict[str, Any]:
    """Import, listen, fork a child per request and report each child's exit status on its connection. Returns
    only in a child, with its request."""
    import gc
    import importlib
    import importlib.util

    gc.disable()  # loaded as the commands load it, the collector off, then frozen (src/core/startup.py)
    for name in HEAVY:
        importlib.import_module(name)
    for name in HEAVY_IF_INSTALLED:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    gc.freeze()
    gc.enable()
    global _RECORDS
    _RECORDS = os.path.dirname(path)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable once it has its name
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    while True:
        if os.getppid() != parent:  # the session ended without saying so
            os._exit(0)
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                request["fds"] = fds
                request["socket"] = path
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def become(request: dict[str, Any]) -> None:
    """In a fresh child: the request's stdio, session or process group, directory and environment; spare children
    for its local ranks; then the module, as ``python -m`` runs it, or the script, as ``python SCRIPT`` does."""
    import runpy

    stdin, stdout, stderr = request.pop("fds")
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    # the SIGINT a cold start would have: ignored where its starter ignores it or asked for that (a shell's background
    # job), else Python's own handler; before the spares are forked, which are its local ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    # SIGHUP as its starter has it (ignored under nohup, which an exec keeps), not as this parent was started
    signal.signal(signal.SIGHUP, signal.SIG_IGN if request.get("sighup_ignored") else signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    else:
        try:
            os.setpgid(0, request["pgid"])  # Popen's child stays in its parent's process group
        except OSError:
            pass
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fork_spares(request["spares"])
    if request["spares"] and request["argv"][:2] == ["-m", TORCHRUN]:
        # torchrun's agent starts each worker with subprocess.Popen, a session of its own
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        global _AGENT
        _AGENT = True
        subprocess_handler.Popen = _SparePopen  # type: ignore[misc]
    _record(request["argv"])
    if request["argv"][0] == "-m":
        sys.argv = request["argv"][1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:  # python SCRIPT: sys.path[0] is the script's folder
        global _SOCKET
        _SOCKET = request["socket"]
        # a benchmark's own python -m src.X runs start warm too (a run of src.train keeps its ranks its children)
        subprocess.Popen = _ParentPopen
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


_RECORDS = ""  # the parent's folder: the command line each warm process stands for, by pid


def _record(argv: Sequence[str]) -> None:
    """Note the command line this process runs as, and the environment it was given (/proc shows the parent's:
    ``python -m tests.warm``, and the environment the parent was started with)."""
    environ = Path(_RECORDS, f"{os.getpid()}.environ")
    environ.with_suffix(".part").write_text("".join(f"{k}={v}\0" for k, v in os.environ.items()))
    environ.with_suffix(".part").rename(environ)  # whole or not there, for a test that reads it as the run starts
    Path(_RECORDS, f"{os.getpid()}.cmdline").write_text("\0".join([sys.executable, *argv]) + "\0")


def recorded_cmdline(pid: int) -> str:
    """For a warm process, the command line it runs as, as /proc/PID/cmdline would give it for a cold start (NULs
    as spaces); "" for the parent, or a spare that runs nothing yet."""
    if "path" not in _parent:
        return ""
    try:
        return Path(os.path.dirname(_parent["path"]), f"{pid}.cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def recorded_environ(pid: int) -> str | None:
    """For a warm process, the environment it runs with, in /proc/PID/environ's form (NUL after each
    ``KEY=VALUE``), as a cold start's /proc would show it; None for the parent, or a spare that runs nothing yet."""
    if "path" not in _parent:
        return None
    try:
        return Path(os.path.dirname(_parent["path"]), f"{pid}.environ").read_text(errors="replace")
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- local ranks' starts

_SPARES: list[tuple[int, socket.socket]] = []  # (pid, this run's end of its socket)
_AGENT = False  # this warm process is a torchrun agent: its spares become its workers
_SPARE_ENV: dict[str, str] = {}  # the import-time variables the spares were forked with
_COLD_SPAWNV_PASSFDS = multiprocessing.util.spawnv_passfds
# a spawn child is passed a descriptor for each tensor its arguments share (torch's file_descriptor strategy); Linux
# takes at most 253 in one message (SCM_MAX_FD)
FDS_PER_MESSAGE = 250
SPAWN_FLAG = "--multiprocessing-fork"  # the last word of a multiprocessing spawn child's command line
SPAWN_MAIN = "from multiprocessing.spawn import spawn_main;"  # how a spawn child's code (-c CODE) begins
FORKSERVER = "from multiprocessing.forkserver import main;"  # how a forkserver's code begins


def _fork_spares(count: int) -> None:
    """``count`` children of this run, forked before it runs anything, each waiting to become a local rank: a
    ``python -m src.X`` that ``strategy=ddp`` starts (``_SparePopen``) or a child that multiprocessing's ``spawn``
    starts (``strategy=ddp_spawn``: ``_spawn_with_spares``). A spare nobody asks for ends when this process does
    (its socket's end)."""
    for _ in range(min(count, SPARES_MAX)):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            mine.close()
            for _, other in _SPARES:
                other.close()
            _SPARES.clear()
            _serve_as_spare(theirs)
        theirs.close()
        _SPARES.append((pid, mine))
    global _SPARE_ENV
    _SPARE_ENV = _import_time_env(dict(os.environ))
    if count:
        import src.launch.ranks

        src.launch.ranks.subprocess = _SubprocessWithSpares()
        multiprocessing.util.spawnv_passfds = _spawn_with_spares


def _serve_as_spare(conn: socket.socket) -> None:
    """In a spare: wait for a request, become what it asks for, and exit as that process would."""
    parts: list[bytes] = []
    fds: list[int] = []
    try:
        while True:
            part, more, _, _ = socket.recv_fds(conn, 1 << 20, FDS_PER_MESSAGE)
            if not part:
                break
            parts.append(part)
            fds += more
    except KeyboardInterrupt:  # a Ctrl-C to the run's process group: a spare that was never used is not there
        os._exit(0)
    data = b"".join(parts).rstrip(b"\0")
    if not data:
        os._exit(0)
    request = json.loads(data)
    if request.get("new_session"):  # a session of its own before its starter goes on, as Popen's child has it
        os.setsid()
        conn.sendall(b"k")
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import runpy

    try:
        if "spawn" in request:
            # the descriptors multiprocessing passes, at the numbers its command line names (as fork_exec keeps them)
            above = max([*request["fds"], *fds]) + 1
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]  # out of the targets' way
            for fd in fds:
                os.close(fd)
            for number, fd in zip(request["fds"], moved):
                os.dup2(fd, number)  # inheritable, as fork_exec leaves the descriptors it passes
                os.close(fd)
            _record(request["spawn"][1:])
            command = _multiprocessing_command(request["spawn"])
            assert command is not None  # _spawn_with_spares hands over only such commands
            flags, code, rest = command
            _interpreter_flags(flags)
            sys.argv = ["-c", *rest]  # as python -c CODE [--multiprocessing-fork] has it
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            _fork_spares(request.get("spares", 0))  # its own forkserver's, before it runs anything
            _record(request.get("command") or ["-m", *request["argv"]])
            sys.argv = list(request["argv"])
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        _exit(stop.code)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        _exit(1)
    _exit(0)


def _hand_to_spare(request: dict[str, Any], fds: Sequence[int] = ()) -> int | None:
    """Give the next spare ``request`` (and ``fds``, as its own descriptors); its pid, or None where no spare is left
    (a signal to the run's process group ends those that wait)."""
    while _SPARES:
        pid, conn = _SPARES.pop(0)
        try:
            with conn:
                socket.send_fds(conn, [json.dumps(request).encode()], list(fds[:FDS_PER_MESSAGE]))
                for at in range(FDS_PER_MESSAGE, len(fds), FDS_PER_MESSAGE):  # a NUL byte carries each further batch
                    socket.send_fds(conn, [b"\0"], list(fds[at : at + FDS_PER_MESSAGE]))
                if request.get("new_session"):  # its session made, so that a signal to its group finds it
                    conn.shutdown(socket.SHUT_WR)
                    if conn.recv(1) != b"k":
                        continue
            return pid
        except OSError:
            continue
    return None


def _spawn_with_spares(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds`` in a warm run: a spawn child (``python -c 'from multiprocessing.spawn
    import spawn_main; spawn_main(...)' --multiprocessing-fork``) or a forkserver (``python -c 'from
    multiprocessing.forkserver import main; main(...)'``: the DataLoader's, src/data/workers.py) becomes a spare,
    which takes the descriptors it is passed at their numbers and runs that code, as the new interpreter would with
    torch already imported; it is this run's child, as fork_exec makes it. Anything else (the resource tracker), or
    an environment whose import-time variables differ from the spare's, starts as multiprocessing starts it."""
    words = [os.fsdecode(arg) for arg in args]  # multiprocessing passes the executable as bytes
    command = _multiprocessing_command(words)
    usable = (
        _SPARES
        and os.fsdecode(path) == sys.executable
        and words[0] == sys.executable
        and command is not None
        and command[0] == multiprocessing.util._args_from_interpreter_flags()  # this process's: the spare takes them on
        and _import_time_env(dict(os.environ)) == _SPARE_ENV
    )
    if not usable:
        return _COLD_SPAWNV_PASSFDS(path, args, passfds)
    fds = sorted(set(map(int, passfds)))
    pid = _hand_to_spare({"spawn": words, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}, fds)
    return pid if pid is not None else _COLD_SPAWNV_PASSFDS(path, args, passfds)


def _multiprocessing_command(words: Sequence[str]) -> tuple[list[str], str, list[str]] | None:
    """The interpreter flags, the code and the arguments after it of a command multiprocessing starts that a spare can
    run: a spawn child (``python FLAGS -c CODE --multiprocessing-fork``) or a forkserver (``python FLAGS -c CODE``);
    None for anything else (the resource tracker)."""
    if len(words) >= 4 and words[-3] == "-c" and words[-2].startswith(SPAWN_MAIN) and words[-1] == SPAWN_FLAG:
        return list(words[1:-3]), words[-2], [SPAWN_FLAG]
    if len(words) >= 3 and words[-2] == "-c" and words[-1].startswith(FORKSERVER):
        return list(words[1:-2]), words[-1], []
    return None


def _interpreter_flags(flags: Sequence[str]) -> None:
    """What multiprocessing's command line asks of the new interpreter (``-B``, ``-W ACTION``: the flags this run has,
    its warnings options added as it ran), taken on by a spare that runs that command's code."""
    import warnings

    for flag in flags:
        if flag == "-B":
            sys.dont_write_bytecode = True
        elif flag.startswith("-W") and flag[2:] not in sys.warnoptions:
            sys.warnoptions.append(flag[2:])
            warnings._processoptions([flag[2:]])  # type: ignore[attr-defined]


def _exit(code: Any) -> None:
    """End a spare turned rank as the interpreter would end it, without unwinding into the run that forked it."""
    import atexit as _atexit

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        _atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


_EXECUTE_CHILD = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]


def _workers_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in _import_time_env(env).items() if not k.startswith(AGENT_SET)}


class _SparePopen(subprocess.Popen):
    """``subprocess.Popen`` that hands ``python -m src.X ...`` with inherited stdio to a spare child, if one is
    left; in a torchrun agent, its workers' ``python -u -m src.X ...`` in a session of their own too (the spare runs
    unbuffered, as every warm process does). Anything else starts as Popen starts it."""

    def _execute_child(self, *args: Any) -> None:  # noqa: D401 - Popen's own hook
        a = dict(zip(_EXECUTE_CHILD, args))
        command = [str(w) for w in a["args"]] if not isinstance(a["args"], (str, bytes)) else []
        pipes = [a[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")]
        env = dict(a["env"] if a["env"] is not None else os.environ)
        worker = _AGENT and command[1:2] == ["-u"]  # torchrun's worker: python -u -m src.X
        words = [command[0], *command[2:]] if worker else command
        if _AGENT:  # as the agent was when its spares were forked, but for what the agent sets for its workers
            same_env = _workers_env(env) == _workers_env(_SPARE_ENV)
        else:
            same_env = _import_time_env(env) == _import_time_env(dict(os.environ))
        usable = (
            _SPARES
            and words[:2] == [sys.executable, "-m"]
            and len(words) > 2
            and words[2].startswith("src.")
            and all(p == -1 for p in pipes)
            and (not a["start_new_session"] or _AGENT)
            and a["preexec_fn"] is None
            and same_env
        )
        if not usable:
            return super()._execute_child(*args)
        request = {"argv": words[2:], "env": env, "cwd": str(a["cwd"] or os.getcwd()), "command": command[1:]}
        request["spares"] = forkservers(words[3:])
        pid = _hand_to_spare({**request, "new_session": bool(a["start_new_session"])})
        if pid is None:
            return super()._execute_child(*args)
        self.pid = pid
        self._child_created = True
        return None


class _SubprocessWithSpares:
    """``subprocess`` as src.launch.ranks sees it in a warm run: Popen uses the spares."""

    Popen = _SparePopen

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


# ------------------------------------------------------------------------------------- what a warm run starts itself

_SOCKET = ""  # in a warm run: its parent's socket


def _comparable(env: dict[str, str]) -> dict[str, str]:
    """The import-time variables, PYTHONPATH without the project's root (``python -m`` from the root has it first
    on sys.path already: benchmarks/bench.py adds it for its bare loop)."""
    found = _import_time_env(env)
    if "PYTHONPATH" in found:
        rest = [p for p in found.pop("PYTHONPATH").split(os.pathsep) if p and Path(p).resolve() != ROOT]
        found.update({"PYTHONPATH": os.pathsep.join(rest)} if rest else {})
    return found


class _ParentPopen(subprocess.Popen):
    """``subprocess.Popen`` inside a warm run (make gpu-check, a benchmark): ``python -m src.X ...`` and ``python
    benchmarks/X.py ...`` (the bare loop of make bench, the control-plane simulator's hosts) start warm, forked by the
    parent. It is not this process's child: its exit status comes on the connection the request went
    on, and wait/poll read it there. Anything else starts as Popen starts it."""

    _conn: socket.socket | None = None

    def _execute_child(self, *args: Any) -> None:  # noqa: D401 - Popen's own hook
        a = dict(zip(_EXECUTE_CHILD, args))
        command = list(a["args"]) if not isinstance(a["args"], (str, bytes)) else []
        env = dict(a["env"] if a["env"] is not None else os.environ)
        usable = (
            _SOCKET
            and startable(command)
            and a["executable"] is None
            and not a["shell"]
            and a["preexec_fn"] is None
            and not a["pass_fds"]
            and _comparable(env) == _comparable(dict(os.environ))
        )
        if not usable:
            return super()._execute_child(*args)
        group = a.get("process_group", -1)
        pgid = os.getpgrp() if group is None or group < 0 else group  # 0: a group of its own, as Popen makes it
        fds = [
            a["p2cread"] if a["p2cread"] != -1 else 0,
            a["c2pwrite"] if a["c2pwrite"] != -1 else 1,
            a["errwrite"] if a["errwrite"] != -1 else 2,
        ]
        self._conn = _request(command, env, a["cwd"] or os.getcwd(), bool(a["start_new_session"]), pgid, fds, _SOCKET)
        self._status = b""
        self._close_pipe_fds(*(a[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")))
        while not self._status.endswith(b"\n"):
            self._status += self._conn.recv(1)
        self.pid = int(self._status)
        self._status = b""
        self._child_created = True
        return None

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._conn is None:
            return super()._try_wait(wait_flags)
        while not self._status.endswith(b"\n"):
            if wait_flags and not select.select([self._conn], [], [], 0)[0]:
                return 0, 0
            chunk = self._conn.recv(16)
            if not chunk:
                raise RuntimeError(f"the warm parent went away while {self.args} ran")
            self._status += chunk
        code = int(self._status)
        return self.pid, (-code if code < 0 else code << 8)  # a wait status, as waitpid gives it

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self._conn is None:
            return super()._internal_poll(_deadstate=_deadstate)
        if self.returncode is None:
            pid, status = self._try_wait(os.WNOHANG)
            if pid == self.pid:
                self._handle_exitstatus(status)
        return self.returncode


# ---------------------------------------------------------------------------------------------------------- client

_parent: dict[str, Any] = {}
# the environment the session started with: the parent imports under it whatever a test has set by then
_SESSION_ENV = dict(os.environ)


def _socket_path() -> str:
    if "path" not in _parent:
        folder = tempfile.mkdtemp(prefix="warm-")
        path = os.path.join(folder, "parent.sock")
        env = {
            k: v
            for k, v in _SESSION_ENV.items()
            if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen([sys.executable, "-m", "tests.warm", path], cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
        _parent.update(path=path, proc=proc, env=env, folder=folder)
        atexit.register(_stop_parent)
    path, proc = _parent["path"], _parent["proc"]
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"the warm parent exited with {proc.returncode} before it listened")
        if time.monotonic() > deadline:
            raise RuntimeError("the warm parent did not listen within 300 s")
        time.sleep(0.02)
    return path


def _stop_parent() -> None:
    proc = _parent.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if "folder" in _parent:
        shutil.rmtree(_parent["folder"], ignore_errors=True)


def warm_possible(cmd: Sequence[str], env: dict[str, str]) -> bool:
    """Whether ``cmd`` with ``env`` can start warm: ``sys.executable -m src.X`` and the same import-time variables
    as the parent's."""
    if os.environ.get("CIFAR10_DDP_COLD") == "1" or env.get("CIFAR10_DDP_COLD") == "1":
        return False
    if not startable(cmd) and not torchrun_agent(cmd):
        return False
    base = _parent.get("env") or {**_SESSION_ENV, "PYTHONUNBUFFERED": "1"}
    return _import_time_env(env) == _import_time_env(base)


def startable(cmd: Sequence[str]) -> bool:
    """``sys.executable -m src.X ...`` or ``sys.executable benchmarks/X.py ...`` (a script of the project)."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if cmd[1] == "-m":
        return len(cmd) > 2 and cmd[2].startswith("src.")
    return cmd[1].endswith(".py") and Path(ROOT, cmd[1]).resolve().parent == ROOT / "benchmarks"


def _request(
    cmd: Sequence[str],
    env: dict[str, str],
    cwd: Any,
    new_session: bool,
    pgid: int,
    fds: list[int],
    path: str,
    ignore_sigint: bool = False,
    default_sigint: bool = False,
) -> socket.socket:
    """Ask the parent at ``path`` to start ``cmd`` with stdio ``fds``; the connection its pid and status come on.
    ``ignore_sigint``: SIGINT ignored, as a child started with it ignored has it; so does a child of a process that
    ignores it (an ignored signal stays ignored across exec). ``default_sigint``: Python's own handler however this
    process has it, as a shell starts a job in the foreground."""
    module = cmd[2] if cmd[1] == "-m" else ""
    request = {
        "argv": list(cmd[1:]),
        "env": env,
        "cwd": str(cwd),
        "new_session": new_session,
        "pgid": pgid,
        "sigint_ignored": ignore_sigint or (not default_sigint and signal.getsignal(signal.SIGINT) is signal.SIG_IGN),
        "sighup_ignored": signal.getsignal(signal.SIGHUP) is signal.SIG_IGN,
        "spares": local_ranks(cmd[3:]) + forkservers(cmd[3:])
        if module in ("src.train", "src.eval")
        else (torchrun_workers(cmd[3:]) if module == TORCHRUN else 0),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(request).encode()], fds)
    return conn


def torchrun_agent(cmd: Sequence[str]) -> bool:
    """``sys.executable -m torch.distributed.run ... -m src.X ...``: a torchrun agent whose workers are the
    project's modules (a test's torchrun; a script's, as make bench starts it, stays cold)."""
    return len(cmd) > 2 and cmd[0] == sys.executable and cmd[1:3] == ["-m", TORCHRUN] and torchrun_workers(cmd[3:]) > 0


def torchrun_workers(args: Sequence[str]) -> int:
    """A torchrun agent's spare children: its workers on this node (``--nproc-per-node``, a number), twice that where
    it may start them again (``--max-restarts`` above 0, or ``--nnodes=MIN:MAX``: a node that joins or leaves makes
    torchrun restart the workers), where they are ``python -u -m src.X`` (torchrun's ``-m``, not ``--no-python``); 0
    otherwise."""
    count, generations, at = 1, 1, 0
    while at < len(args) and args[at].startswith("-"):
        key, equals, value = args[at].partition("=")
        if key in ("--nproc-per-node", "--nproc_per_node", "--max-restarts", "--max_restarts", "--nnodes"):
            if not equals:  # --nproc-per-node N
                at += 1
                value = args[at] if at < len(args) else ""
            if key == "--nnodes":
                generations = 2 if ":" in value else generations
            elif key.startswith("--max"):
                generations = 2 if value.isdigit() and int(value) > 0 else generations
            else:
                count = int(value) if value.isdigit() else 0
        if key in ("--no-python", "--no_python"):
            return 0
        if key in ("-m", "--module"):
            return min(SPARES_MAX, count * generations) if at + 1 < len(args) and args[at + 1].startswith("src.") else 0
        at += 1
    return 0  # a script, or an option whose value stands apart: cold


def forkservers(overrides: Sequence[str]) -> int:
    """A spare for the forkserver a rank starts for its DataLoader workers (src/data/workers.py): 1 where the command
    line asks for workers of the DataLoader pipeline (``data.num_workers`` above 0, ``data.pipeline=dataloader``)
    started by ``forkserver``, or by ``auto`` where this Python's fork can hang (whether the world is larger than one
    is not read: an unused spare ends with its run); 0 under ``ddp_spawn``, whose ranks are spawned, and in a
    sweep."""
    values = dict(item.partition("=")[::2] for item in overrides)
    workers = values.get("data.num_workers", "0")
    if not workers.isdigit() or int(workers) == 0 or values.get("data.pipeline") != "dataloader":
        return 0
    if "ddp_spawn" in values.get("strategy", "") or "-m" in overrides or "--multirun" in overrides:
        return 0
    method = values.get("data.multiprocessing_context", "auto")
    if method == "auto":
        from src.data.workers import fork_can_hang

        return int(fork_can_hang())
    return int(method == "forkserver")


def local_ranks(overrides: Sequence[str]) -> int:
    """Spare children a ``src.train``/``src.eval`` command line may use as local ranks: the devices beyond the first
    (``strategy=ddp``), every device twice (``strategy=ddp_spawn``: fit, then test); in a sweep (``-m``), that many
    for each of up to SPARES_MAX jobs."""
    devices, strategies, multirun = [1], [], False
    for item in overrides:
        if item in ("-m", "--multirun"):
            multirun = True
        key, _, value = item.partition("=")
        if key == "trainer.devices":
            devices = [int(v) for v in value.split(",") if v.strip().isdigit()] or [1]
        if key == "strategy":
            strategies = value.split(",")
    # ddp starts the devices beyond the first as processes; ddp_spawn spawns one per device for fit and again for test
    extra = 2 * max(devices) if "ddp_spawn" in strategies else max(devices) - 1
    return min(SPARES_MAX, extra * SPARES_MAX if multirun else extra)


class WarmProcess:
    """What ``subprocess.Popen`` gives, for a child of the warm parent: pid, pipes, poll, wait, communicate,
    signals. Its exit status comes from the parent, which reaps it."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        cwd: str | os.PathLike,
        stdout: Any,
        stderr: Any,
        text: bool,
        start_new_session: bool,
        ignore_sigint: bool = False,
        default_sigint: bool = False,
    ) -> None:
        self.args = list(cmd)
        self.returncode: int | None = None
        self.stdin = None
        r_out = w_out = r_err = w_err = None
        if stdout == subprocess.PIPE:
            r_out, w_out = os.pipe()
        if stderr == subprocess.PIPE:
            r_err, w_err = os.pipe()
        out_fd = w_out if w_out is not None else (stdout.fileno() if hasattr(stdout, "fileno") else 1)
        if stderr == subprocess.STDOUT:
            err_fd = out_fd
        else:
            err_fd = w_err if w_err is not None else (stderr.fileno() if hasattr(stderr, "fileno") else 2)
        fds = [0, out_fd, err_fd]
        self._conn = _request(
            self.args, env, cwd, start_new_session, os.getpgrp(), fds, _socket_path(), ignore_sigint, default_sigint
        )
        for fd in (w_out, w_err):
            if fd is not None:
                os.close(fd)
        self._buffer = b""
        self.pid = int(self._read_line(None))
        wrap = (lambda fd: open(fd, errors="replace")) if text else (lambda fd: open(fd, "rb"))
        self.stdout = wrap(r_out) if r_out is not None else None
        self.stderr = wrap(r_err) if r_err is not None else None

    def _read_line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"the warm parent went away while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._read_line(0)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        """Read both pipes to their ends, then wait; a timeout leaves what was read for the next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not hasattr(self, "_read"):
            self._read = {"out": [], "err": []}
        streams = {
            s.fileno(): (key, s)
            for key, s in (("out", self.stdout), ("err", self.stderr))
            if s is not None and not s.closed
        }
        while streams:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            ready, _, _ = select.select(list(streams), [], [], left)
            for fd in ready:
                key, stream = streams[fd]
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError as err:
                    if err.errno != errno.EINTR:
                        raise
                    continue
                if chunk:
                    self._read[key].append(chunk)
                else:
                    stream.close()
                    del streams[fd]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        text = isinstance(self.stdout or self.stderr, io.TextIOWrapper)

        def joined(key: str, stream: Any) -> Any:
            if stream is None:
                return None
            data = b"".join(self._read[key])
            return data.decode(errors="replace") if text else data

        return joined("out", self.stdout), joined("err", self.stderr)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(
    cmd: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | os.PathLike,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = True,
    start_new_session: bool = False,
    ignore_sigint: bool = False,
    default_sigint: bool = False,
) -> Any:
    """``subprocess.Popen(cmd, ...)``, warm where that cannot differ (see the module's docstring). ``ignore_sigint``:
    the process starts with SIGINT ignored, as a shell starts a job in the background; ``default_sigint``: with
    SIGINT at its default where this process ignores it, as a shell starts one in the foreground (a terminal's Ctrl-C
    reaches it)."""
    if warm_possible(cmd, env):
        return WarmProcess(cmd, env, cwd, stdout, stderr, text, start_new_session, ignore_sigint, default_sigint)
    ignore = None
    if ignore_sigint or default_sigint:
        ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=stdout,
        stderr=stderr,
        text=text,
        start_new_session=start_new_session,
        preexec_fn=ignore,
    )


def run(
    cmd: Sequence[str], *, env: dict[str, str], cwd: str | os.PathLike, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, warm where possible. At the timeout
    the process is killed and TimeoutExpired raised, as subprocess.run does: after waiting for the process only,
    not for its pipes, which a process it left behind may hold open (a data loader's worker that never got past its
    fork: the test then hung with it instead of failing at its limit)."""
    # leaving the block closes the pipes and waits for the process, as Popen's own exit does
    with popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


if __name__ == "__main__":
    become(serve(sys.argv[1]))
