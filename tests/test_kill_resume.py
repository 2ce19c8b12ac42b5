"""A whole run killed (SIGKILL, as the OOM killer or ``kill -9`` would) while a tier's
artifact is prepared and while its load stage runs, then ``qeval run --resume``: nothing
finished is lost or redone, nothing half-made is reused or left behind.

Faults come at named points only (``QEVAL_TEST_KILL_RUN=tier:stage:point``,
:func:`qeval.worker.inject_fault`), never from timers:

* ``int8:prepare:mid``: the prepare stage has built its artifact (renamed into place under
  ``$QEVAL_CACHE/artifacts/``) but not written its stage file;
* ``int8:prepare:build``: a point of this file's own, inside the build: the method has
  written its files into the staging folder (``<artifact>.tmp<pid>``,
  :func:`qeval.artifacts.get_or_build`) and the manifest is not written yet. The stage
  process reaches it through a ``sitecustomize`` on ``PYTHONPATH`` (:data:`BUILD_HOOK`) that
  wraps the build callback and calls :func:`qeval.worker.inject_fault` there, so the kill
  itself is the product's own;
* ``bf16:load:points``: the load stage has measured its closed-loop points (written to
  ``stages/bf16.load.partial.json``) and not begun its open loop.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_dir_of, write_recipe

GATE_SPEED = "gate: {reference: bf16, rules: {min_decode_tokens_per_s: 0.001}}"  # runs without suites

#: The test-only ``int8:prepare:build`` point: in a stage process whose
#: ``QEVAL_TEST_KILL_RUN`` names a ``build`` point, each artifact build of that tier's
#: method runs its method's build, then :func:`qeval.worker.inject_fault` at ``build``
#: (files in the staging folder, no manifest), then the rest of ``_build``.
BUILD_HOOK = '''\
import os
_spec = os.environ.get("QEVAL_TEST_KILL_RUN", "").split(":")
if len(_spec) >= 3 and _spec[1:3] == ["prepare", "build"]:
    import qeval.artifacts as _artifacts
    _orig_build = _artifacts._build

    def _build(folder, tmp, key, fields, build, *args, **kwargs):
        def built(out):
            info = build(out)
            if folder.name.startswith(_spec[0] + "-"):  # the tier's method's artifact (named <method>-<key>)
                from qeval.worker import inject_fault
                inject_fault(_spec[0], "prepare", "build")
            return info
        return _orig_build(folder, tmp, key, fields, built, *args, **kwargs)

    _artifacts._build = _build
'''


def _qeval(*args, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m qeval.cli ARGS`` in its own session, with its own timeout."""
    return subprocess.run([sys.executable, "-m", "qeval.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


def _env(cache: Path, **extra: str) -> dict:
    return dict(os.environ, QEVAL_CACHE=str(cache), **extra)


def _stage_hashes(run_dir: Path) -> dict[str, str]:
    """``{stages/<file>: sha256 of its bytes}`` of every stage file (temporary files left out)."""
    return {f"stages/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "stages").glob("*.json")) if not p.name.startswith(".")}


def _artifacts(cache: Path, method: str) -> list[Path]:
    """Everything under ``$QEVAL_CACHE/artifacts/`` made for ``method`` (final and staging folders)."""
    root = cache / "artifacts"
    return sorted(p for p in root.iterdir() if p.name.startswith(f"{method}-")) if root.is_dir() else []


def _int8_recipe(tmp_path: Path, model: Path) -> Path:
    tiers = "  - {name: bf16, method: bf16}\n  - {name: int8, method: int8}\n"
    return write_recipe(tmp_path / "tiny.yaml", model, tiers=tiers, suites=False, load=False, extra=GATE_SPEED)


def _check_int8_row(run_dir: Path, folder: Path, reused: bool) -> dict:
    """The finished run's int8 row: status ok, its artifact ``folder`` (reused as said) and its
    quant figures from the manifest of that artifact."""
    row = json.loads((run_dir / "tiers" / "int8.json").read_text())
    assert row["status"] == "ok", row.get("error")
    assert row["artifact"]["path"] == str(folder) and row["artifact"]["reused"] is reused
    q = row["quant"]
    info = json.loads((folder / "manifest.json").read_text())["info"]
    assert q["stored_bytes"] > 0 and 8.0 <= q["bits_per_weight"] < 16.0, q
    assert q["quant_seconds"] == info["quant_seconds"] > 0  # the build's own figures, from the one build
    assert row["speed"]["48"]["decode_tokens_per_s"] > 0
    return row


def test_a_stopped_builds_staging_folder_is_removed_and_a_live_ones_kept(tmp_path, monkeypatch):
    """get_or_build removes ``<artifact>.tmp<pid>`` left by a process that no longer runs
    (one started, then reaped) and keeps one whose process runs and started before it (the
    test's parent: another run building the same artifact now), whether it then builds the
    artifact or reuses it; each removal is logged."""
    from qeval.artifacts import artifact_dir, artifact_key, get_or_build
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    fields = {"k": 1}
    final = artifact_dir("m", artifact_key(fields))
    final.parent.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    dead = final.with_name(f"{final.name}.tmp{int(gone.stdout)}")  # its process has exited and been reaped
    live = final.with_name(f"{final.name}.tmp{os.getppid()}")
    another = artifact_dir("m", artifact_key({"k": 2}))
    other = another.with_name(f"{another.name}.tmp{int(gone.stdout)}")  # another artifact's, not this call's
    for d in (dead, live, other):
        d.mkdir()
        (d / "w.bin").write_bytes(b"half")

    def build(out: Path) -> dict:
        (out / "w.bin").write_bytes(b"weights")
        return {}
    logs: list[str] = []
    folder, _, reused = get_or_build("m", fields, build, log=logs.append)
    assert folder == final and not reused
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert [m for m in logs if "staging" in m] == [
        f"artifact {final.name}: removing the staging folder of a build that was stopped ({dead.name})"]
    dead.mkdir()  # the same left over beside a finished artifact: removed on reuse too
    assert get_or_build("m", fields, build, log=logs.append)[2] is True
    assert not dead.exists() and live.is_dir()


@pytest.mark.slow
def test_a_run_killed_after_its_artifact_is_built_resumes_on_that_artifact(tiny_llama, tmp_path):
    """Killed at ``int8:prepare:mid``: the artifact is complete and renamed into place, the
    prepare stage file is not written. ``--resume`` runs int8's prepare again, which reuses
    that artifact (verified against its manifest, not rebuilt: the manifest's bytes are the
    same); the run finishes with int8 ok and its quant figures from that one build; the
    cache holds the one int8 artifact and no staging folder."""
    from qeval.artifacts import verify
    recipe = _int8_recipe(tmp_path, tiny_llama)
    cache, base = tmp_path / "cache", tmp_path / "results"
    p = _qeval("run", recipe, "--out", base, env=_env(cache, QEVAL_TEST_KILL_RUN="int8:prepare:mid"))
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    run_dir = run_dir_of(base)
    assert not (run_dir / "stages" / "int8.prepare.json").exists()  # killed before its stage file
    made = _artifacts(cache, "int8")
    assert len(made) == 1 and ".tmp" not in made[0].name, made  # built and renamed into place
    folder = made[0]
    assert verify(folder) == (True, "ok")
    manifest = (folder / "manifest.json").read_bytes()
    before = _stage_hashes(run_dir)

    q = _qeval("run", recipe, "--resume", run_dir, env=_env(cache))
    assert q.returncode == 0, q.stderr[-3000:]
    assert _artifacts(cache, "int8") == [folder]  # no second build, no staging folder left
    assert (folder / "manifest.json").read_bytes() == manifest and verify(folder) == (True, "ok")
    prep = json.loads((run_dir / "stages" / "int8.prepare.json").read_text())
    assert prep["reused"] is True and prep["artifact"] == str(folder)
    _check_int8_row(run_dir, folder, reused=True)
    after = _stage_hashes(run_dir)
    assert {k: after.get(k) for k in before} == before  # every stage finished before the kill kept as it was


@pytest.mark.slow
def test_a_run_killed_while_its_artifact_is_built_rebuilds_it_and_leaves_no_staging(tiny_llama, tmp_path):
    """Killed at ``int8:prepare:build`` (:data:`BUILD_HOOK`): int8's files are in the staging
    folder ``int8-<key>.tmp<pid>``, without a manifest, and no ``int8-<key>`` folder exists.
    ``--resume`` does not take that half-built folder for the artifact: it builds int8 anew
    (the prepare stage says built, not reused), the artifact verifies against its manifest,
    the run finishes with int8 ok and its quant figures, and the killed build's staging
    folder is gone: the cache holds the one int8 artifact and nothing else of int8's."""
    from qeval.artifacts import verify
    recipe = _int8_recipe(tmp_path, tiny_llama)
    cache, base = tmp_path / "cache", tmp_path / "results"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BUILD_HOOK)
    path = os.pathsep.join([str(hook)] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    p = _qeval("run", recipe, "--out", base,
               env=_env(cache, QEVAL_TEST_KILL_RUN="int8:prepare:build", PYTHONPATH=path))
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    run_dir = run_dir_of(base)
    log = (run_dir / "logs" / "int8.prepare.log").read_text()
    assert "test fault QEVAL_TEST_KILL_RUN at int8:prepare:build" in log, log[-2000:]
    assert not (run_dir / "stages" / "int8.prepare.json").exists()
    made = _artifacts(cache, "int8")
    assert len(made) == 1 and ".tmp" in made[0].name, made  # only the staging folder: never renamed
    staged = made[0]
    assert not (staged / "manifest.json").exists() and any(f.is_file() for f in staged.rglob("*"))
    final = staged.with_name(staged.name.split(".tmp")[0])
    before = _stage_hashes(run_dir)

    q = _qeval("run", recipe, "--resume", run_dir, env=_env(cache))  # no hook, no fault
    assert q.returncode == 0, q.stderr[-3000:]
    assert _artifacts(cache, "int8") == [final], _artifacts(cache, "int8")  # the half-built folder is gone
    assert verify(final) == (True, "ok")
    prep = json.loads((run_dir / "stages" / "int8.prepare.json").read_text())
    assert prep["reused"] is False and prep["artifact"] == str(final)
    _check_int8_row(run_dir, final, reused=False)
    after = _stage_hashes(run_dir)
    assert {k: after.get(k) for k in before} == before


@pytest.mark.slow
def test_a_run_killed_between_its_load_workloads_resumes_to_a_complete_load_section(tiny_llama, tmp_path):
    """Killed at ``bf16:load:points``: bf16's closed-loop points are in
    ``stages/bf16.load.partial.json``, the open loop has not begun, no load stage file or
    error file exists. ``--resume`` runs bf16's load stage again and the run finishes: the
    row's load section is complete (not partial, no stop, no error; both closed-loop points
    and the open loop's point), and every stage file that existed before the kill other than
    bf16's load partial is unchanged byte for byte."""
    tiers = "  - {name: bf16, method: bf16}\n  - {name: b2, method: bf16}\n"
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers, suites=False, extra=GATE_SPEED)
    recipe.write_text(recipe.read_text().replace(
        "load: {enabled: true,",
        "load: {enabled: true, arrivals: {rates: [1.0], requests: 2}, queue: {max_waiting: 1, timeout_s: 30.0},"))
    cache, base = tmp_path / "cache", tmp_path / "results"
    p = _qeval("run", recipe, "--out", base, env=_env(cache, QEVAL_TEST_KILL_RUN="bf16:load:points"))
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    run_dir = run_dir_of(base)
    stages = run_dir / "stages"
    assert not (stages / "bf16.load.json").exists() and not (stages / "bf16.load.error.json").exists()
    kept = json.loads((stages / "bf16.load.partial.json").read_text())["load"]
    assert [pt["concurrency"] for pt in kept["points"]] == [1, 2] and "arrivals" not in kept
    before = _stage_hashes(run_dir)
    before.pop("stages/bf16.load.partial.json")  # the load stage's own journal: rewritten by its new attempt
    assert {"stages/_run.source.json", "stages/_run.env.json", "stages/bf16.prepare.json",
            "stages/bf16.measure.json"} <= set(before), sorted(before)

    q = _qeval("run", recipe, "--resume", run_dir, env=_env(cache))
    assert q.returncode == 0, q.stderr[-3000:]
    after = _stage_hashes(run_dir)
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert changed == [], changed  # nothing finished before the kill was redone or touched
    assert "stages/bf16.load.json" in after and "stages/bf16.load.error.json" not in after
    load = json.loads((run_dir / "tiers" / "bf16.json").read_text())["load"]
    assert load["partial"] is False and load["stopped"] is None and load["error"] is None
    assert [pt["concurrency"] for pt in load["points"]] == [1, 2] and all(pt["admitted"] for pt in load["points"])
    arr = load["arrivals"]["points"]
    assert [pt["rate_rps"] for pt in arr] == [1.0] and arr[0]["requests"] == 2
    assert arr[0]["completed"] + arr[0]["refused"] + arr[0]["timed_out"] + arr[0]["failed"] == 2
    gate = json.loads((run_dir / "gate.json").read_text())
    assert not gate.get("load_stopped"), gate.get("load_stopped")
    assert json.loads((run_dir / "tiers" / "b2.json").read_text())["load"]["partial"] is False
