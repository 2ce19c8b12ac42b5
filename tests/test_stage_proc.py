"""Stage processes forked from the preloaded fork server (qeval/stage_proc.py) behave as the
fresh interpreters they replace: the stage's own environment, its log as stdout and stderr,
its exit status (a signal as a negative code), its own process group for a kill, and the
run's pid for faults aimed at the run.

The stage is the real worker (``python -m qeval.worker env RUN_DIR``) on a copy of a
fixture run folder, stopped at its named fault point ``_run:env:start``: nothing is timed."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qeval import stage_proc
from qeval.stage_proc import FORKSERVER_ENV, fork_wanted, start_stage

FIXTURE = Path(__file__).parent / "fixtures" / "run_review"


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    return d


def _env(match_server=True, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for k in ("QEVAL_TEST_CRASH", "QEVAL_TEST_KILL_RUN", "QEVAL_TEST_SIGNAL_RUN", "QEVAL_RUN_PID"):
        env.pop(k, None)
    env.update(extra)
    if match_server and stage_proc._server_key is not None:  # a server this test process started
        for k, v in stage_proc._server_key:  # earlier (another file's run): its import-time settings
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
    return env


def _start(run_dir, log_path, env):
    with open(log_path, "ab") as lf:
        return start_stage([sys.executable, "-m", "qeval.worker", "env", str(run_dir)], env, lf)


@pytest.mark.parametrize("forked", ["1", "0"])
def test_a_crash_at_a_named_point_is_the_stage_s_own_signal_and_its_log(run_dir, tmp_path, forked):
    """QEVAL_TEST_CRASH is in the stage's environment only (never the server's): the stage
    reads it, says so in its log, and dies of SIGABRT, forked or not."""
    log = tmp_path / "env.log"
    proc = _start(run_dir, log, _env(QEVAL_TEST_CRASH="_run:env:start", **{FORKSERVER_ENV: forked}))
    rc = proc.wait(timeout=300)
    assert rc == -signal.SIGABRT
    text = log.read_text()
    assert "[qeval] test fault QEVAL_TEST_CRASH at _run:env:start" in text
    assert isinstance(proc, stage_proc._Forked if forked == "1" else stage_proc._Exec)


def test_a_forked_stage_signals_the_run_pid_and_dies_with_its_group(run_dir, tmp_path):
    """The fault aimed at the run goes to QEVAL_RUN_PID (a forked stage's parent is the
    server, not the run); kill() ends the stage, which waits in its own session."""
    target = subprocess.Popen(["sleep", "300"])
    try:
        log = tmp_path / "env.log"
        proc = _start(run_dir, log, _env(QEVAL_TEST_SIGNAL_RUN="_run:env:start:SIGTERM",
                                         QEVAL_RUN_PID=str(target.pid)))
        assert isinstance(proc, stage_proc._Forked)
        assert target.wait(timeout=300) == -signal.SIGTERM  # the stage reached the run's pid
        assert os.getpgid(proc.pid) == proc.pid  # its own process group
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)  # it waits to be stopped, as by a run
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert "[qeval] test fault QEVAL_TEST_SIGNAL_RUN at _run:env:start" in log.read_text()
    finally:
        target.kill()
        target.wait()


def test_a_command_other_than_the_worker_runs_as_given(tmp_path):
    """A runner that overrides worker_command (tests do) gets its own command, not a fork."""
    log = tmp_path / "x.log"
    with open(log, "ab") as lf:
        proc = start_stage([sys.executable, "-c", "print('own command'); raise SystemExit(7)"], _env(), lf)
    assert isinstance(proc, stage_proc._Exec)
    assert proc.wait(timeout=60) == 7
    assert "own command" in log.read_text()


def test_fork_wanted_follows_the_switch_and_the_import_time_environment(monkeypatch):
    assert not fork_wanted(_env(False, **{FORKSERVER_ENV: "0"}))
    monkeypatch.setattr(stage_proc, "_server_key", stage_proc._import_key(_env(False, HF_HUB_OFFLINE="1")))
    assert fork_wanted(_env(False, HF_HUB_OFFLINE="1"))
    assert not fork_wanted(_env(False, HF_HUB_OFFLINE="0"))  # a server started with other import-time settings
    monkeypatch.setattr(stage_proc, "_broken", "OSError: no server")
    assert not fork_wanted(_env(False, HF_HUB_OFFLINE="1"))
