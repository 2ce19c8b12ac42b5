"""Starting a stage's process: forked from a preloaded fork server, or a fresh interpreter.

Every stage runs in a process of its own (a tier that crashes loses only itself, a timed
stage has the machine alone, its peak memory is its own). A fresh interpreter pays for its
imports each time: torch, transformers' llama modules and torchao take about 5 s of one core
(``python -X importtime``), and a run of seven tiers starts about 30 stage processes, the
test suite hundreds. So the local executor starts them from a fork server that imported
those modules once: the standard library's :mod:`multiprocessing.forkserver` (checked
before writing anything of our own: it preloads modules, forks one child per request and
reports the child's exit status; ``os.posix_spawn`` and ``subprocess`` exec a new
interpreter, which is the cost to avoid). This module adds only what a stage needs around
it: its own session (a timeout kills its whole process group), its log as stdout and
stderr, its environment, its thread count, and the exit handlers a normal exit runs.

Fork safety: a fork copies only the forking thread. The server is started with one
OpenMP/BLAS thread and the preload (:mod:`qeval.stage_preload`) records whether the
process still has a single OS thread after its imports; a child forked from a server that
has more (a library that started a thread at import) does not run the stage in that
copy, it ``exec``\\ s a fresh interpreter (the plain path) instead. gptqmodel starts threads
at import, so it is not preloaded; its stages import it themselves.

``QEVAL_FORKSERVER=0`` in the run's environment turns the fork server off (every stage a
fresh interpreter, as before). It is off off Linux, and for a run whose import-time
environment (threads, hub and library settings) differs from the one the server started
with (the server is one per run process).
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Protocol

from .osutil import die_with_parent
from .paths import cache_root

#: Where the server's imports write what they print (a file; set by :func:`_ensure_server`).
PRELOAD_LOG_ENV = "QEVAL_PRELOAD_LOG"
#: The environment variable that turns the fork server off (``0``).
FORKSERVER_ENV = "QEVAL_FORKSERVER"

# Read when modules are imported (by libgomp, OpenBLAS, huggingface_hub, transformers): a
# child forked from the server keeps the values the server started with, so a run whose
# values differ gets fresh interpreters instead.
_IMPORT_TIME_KEYS = ("OMP_WAIT_POLICY", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                     "TRANSFORMERS_VERBOSITY", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED",
                     "GPTQMODEL_TORCH_EXTENSIONS_DIR", "PYTHONPATH", "PYTORCH_ALLOC_CONF")

_lock = threading.Lock()
_server_key: tuple | None = None  # the import-time environment the server started with
_broken: str | None = None        # why the fork server cannot be used in this process


class StageProcess(Protocol):
    """What :class:`qeval.stages.TierRunner` needs of a running stage: ``pid`` (also its
    process group), ``wait(timeout)`` (its exit code, negative for a signal, as
    :class:`subprocess.Popen`; raises :class:`subprocess.TimeoutExpired`) and ``kill()``
    (SIGKILL to its whole process group)."""
    pid: int

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Exec:
    """A stage in a fresh interpreter (:class:`subprocess.Popen`)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        self.pid = proc.pid

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout=timeout)

    def kill(self) -> None:
        _killpg(self.pid)


class _Forked:
    """A stage forked from the fork server (:class:`multiprocessing.Process`)."""

    def __init__(self, proc) -> None:
        self._proc = proc
        self.pid = proc.pid

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"stage process {self.pid}", timeout or 0)
        return self._proc.exitcode

    def kill(self) -> None:
        _killpg(self.pid)


def _killpg(pid: int) -> None:
    """SIGKILL the stage's process group; the process alone when it has not made its
    session yet (killed between the fork and ``setsid``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _import_key(env: dict[str, str]) -> tuple:
    return tuple((k, env.get(k)) for k in _IMPORT_TIME_KEYS)


def fork_wanted(env: dict[str, str]) -> bool:
    """Whether stages of a run with environment ``env`` are forked from the server: Linux,
    not turned off (``QEVAL_FORKSERVER=0``), the server usable in this process, and its
    import-time environment the one the server started with (or none started yet)."""
    if env.get(FORKSERVER_ENV, "1") == "0" or not sys.platform.startswith("linux") or _broken:
        return False
    return _server_key is None or _server_key == _import_key(env)


def _ensure_server(env: dict[str, str]) -> None:
    """Start the fork server (once per process) with ``env`` as its environment, one
    OpenMP/BLAS thread (no thread pool to lose in a fork; each child sets its own count)."""
    global _server_key
    if _server_key is not None:
        return
    from multiprocessing import forkserver  # start-up time: only when stages are forked
    server_env = dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # what the imports print (torchao's missing CUDA kernels, torch's deprecation warnings)
    # goes to a file in qeval's cache, not to the terminal of `qeval run`
    server_env.setdefault(PRELOAD_LOG_ENV, str(cache_root() / "stage_preload.log"))
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(server_env)  # the server process inherits this process's environment
    try:
        multiprocessing.set_forkserver_preload(["qeval.stage_preload"])
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _server_key = _import_key(env)


def start_stage(cmd: list[str], env: dict[str, str], log: IO[bytes], cwd: str | None = None) -> StageProcess:
    """Start the stage process ``cmd``: forked from the fork server when it is the worker
    (``python -m qeval.worker STAGE RUN_DIR TIER``) and :func:`fork_wanted`, else ``cmd`` in a
    fresh interpreter (any other command, e.g. a test's own worker, runs as given).

    Args:
        cmd: the command (:meth:`qeval.stages.TierRunner.worker_command`).
        env: the stage's whole environment.
        log: an open binary file: the stage's stdout and stderr are appended to it.
        cwd: working directory (default: this process's).

    Returns:
        a :class:`StageProcess`, in a session of its own, killed when its parent dies.

    Raises:
        OSError: the interpreter could not be started at all.
    """
    global _broken
    cwd = cwd or os.getcwd()
    argv = list(cmd[3:])
    if list(cmd[:3]) == [sys.executable, "-m", "qeval.worker"] and fork_wanted(env):
        try:
            with _lock:  # Process.start() walks multiprocessing's children set: one thread at a time
                _ensure_server(env)
                proc = multiprocessing.get_context("forkserver").Process(
                    target=_child_main, args=(list(argv), dict(env), log.name, cwd), name="qeval-stage")
                proc.start()
            return _Forked(proc)
        except Exception as e:  # noqa: BLE001 - a server that cannot start: fresh interpreters
            _broken = f"{e.__class__.__name__}: {e}"
            log.write(f"[qeval] fork server unusable ({_broken}); fresh interpreter\n".encode())
            log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    return _Exec(proc)


def _child_main(argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """In the forked child: become the stage (session, log, environment, threads) and run
    :func:`qeval.worker.main`; exit with its code after the exit handlers a normal exit
    runs (``atexit``: managed servers are stopped there) and C stdio flushed."""
    os.setsid()
    die_with_parent()
    os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    dn = os.open(os.devnull, os.O_RDONLY)
    os.dup2(dn, 0)
    os.close(dn)
    os.environ.clear()
    os.environ.update(env)
    from . import stage_preload  # start-up time: imported in the server already
    if not stage_preload.FORK_SAFE:  # a thread started at import would be missing here
        print(f"[qeval] fork server has {stage_preload.THREADS} threads: fresh interpreter", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "qeval.worker", *argv], env)
    stage_preload.set_threads(int(env.get("QEVAL_STAGE_THREADS") or env.get("OMP_NUM_THREADS") or 1))
    code = 3
    try:
        from .worker import main  # start-up time: imported in the server already (the preload)
        code = main(argv)
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                ctypes.CDLL(None).fflush(None)  # llama.cpp and other C code print through stdio
            except (OSError, AttributeError):
                pass
    sys.exit(code)
