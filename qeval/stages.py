"""Running stages: each stage of a run in its own child process (:mod:`qeval.worker`), a
tier's stages in order, and merging them into ``tiers/<tier>.json``. The local and the
Ray executor both run tiers through :class:`TierRunner`; the run-wide flow (source, env,
reference, resume checks, run.json) is :class:`qeval.run.Runner`.

Every stage runs in its own process: an exception, an out-of-memory kill, a segfault or
a timeout marks that tier ``failed`` with the reason and the tail of its log, and the
other tiers go on. Finished stages are files in ``stages/``; a resumed run redoes only
what is missing.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .engines import get_engine
from .failures import failure_text, reason_from_log, signal_reason
from .paths import torch_extensions_dir
from .recipe import (Recipe, stable_model_dict, stable_quality_dict, stable_speed_dict, stable_suite_dict,
                     stable_tier_dict)
from .results import (RUN_SCOPE, STATUS_FAILED, STATUS_NOT_BUILT, STATUS_OK, TIER_STAGES, Artifact, LoadSection,
                      QuantInfo, RunLayout, StageError, TierResult, read_partial_load, read_stage, read_stage_error,
                      stage_done, write_stage_error, write_tier_result)
from .serving.core import can_serve
from .source import model_source_path
from .stage_keys import FRESH_ENV, TIMED_STAGES, load_fingerprint  # noqa: F401 - re-exported
from .stage_proc import StageProcess, start_stage
from .storage import OPTIONS_ENV, run_rel, storage_for
from .tiers import get_method

# TIMED_STAGES, FRESH_ENV and load_fingerprint live below this module and the stage process
# (qeval.stage_keys); re-exported here for the run's side


def stage_threads(recipe: Recipe, stage: str) -> int:
    """Threads of a stage: the recipe's pinned ``threads`` where speed or bandwidth is
    measured, ``work_threads`` (default: every core) where nothing is timed."""
    if stage in TIMED_STAGES:
        return recipe.threads
    return recipe.work_threads or os.cpu_count() or recipe.threads


@dataclass
class StageOutcome:
    """How a stage ended: ``ok``; else ``reason`` (one line) and ``log_tail``."""
    ok: bool
    reason: str | None = None
    log_tail: str | None = None
    input_error: bool = False


class Interrupted(Exception):
    """Ctrl-C during a run; finished stages stay on disk."""


# ---- fingerprints for resume --------------------------------------------------------

#: Recipe sections that shape every measurement of a run (the tier specs shape their own).
RUN_WIDE = ("model", "device", "threads", "speed", "calibration", "suites", "quality")


def recipe_fingerprint(recipe_dict: dict) -> str:
    """Hash of the recipe's name and :data:`RUN_WIDE` sections (16 hex digits), stored in
    ``run.json``: a resume with a recipe of another name or content is refused."""
    keep = {k: recipe_dict.get(k) for k in RUN_WIDE}
    keep["suites"] = [stable_suite_dict(x) for x in keep["suites"] or []]
    keep["speed"] = stable_speed_dict(keep["speed"])
    keep["name"] = recipe_dict.get("name")
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tier_fingerprint(recipe_dict: dict, tier: str) -> str:
    """Hash of everything that shapes a tier's measured results (model, device, threads,
    speed, calibration, suites, quality and the tier's own spec). Gate and report settings
    are left out: changing them does not invalidate measurements."""
    spec = next((t for t in recipe_dict["tiers"] if t["name"] == tier), None)
    keep = {k: recipe_dict.get(k) for k in RUN_WIDE}
    keep["suites"] = [stable_suite_dict(x) for x in keep["suites"] or []]
    keep["speed"] = stable_speed_dict(keep["speed"])
    keep["quality"] = stable_quality_dict(keep["quality"])
    keep["model"] = stable_model_dict(keep.get("model"))
    keep["tier"] = stable_tier_dict(spec)
    keep["reference"] = stable_tier_dict(next((t for t in recipe_dict["tiers"]
                                               if t["name"] == recipe_dict["gate"]["reference"]), None))
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def changed_fields(old: dict, new: dict, tier: str | None = None) -> list[str]:
    """The :data:`RUN_WIDE` sections (and ``tiers[<tier>]`` when given) that differ between
    two recipe dicts; ``["reference tier"]`` when none does."""
    out = []
    for k in RUN_WIDE:
        a, b = old.get(k), new.get(k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict):
            a, b = stable_model_dict(a), stable_model_dict(b)
        if a != b:
            out.append(k)
    if tier is not None:
        o = next((t for t in old.get("tiers") or [] if isinstance(t, dict) and t.get("name") == tier), None)
        n = next((t for t in new.get("tiers") or [] if isinstance(t, dict) and t.get("name") == tier), None)
        if o != n:
            out.append(f"tiers[{tier}]")
    return out or ["reference tier"]


# ---- environment --------------------------------------------------------------------

def child_env(recipe: Recipe) -> dict[str, str]:
    """Environment of every stage process: threads pinned (torch reads OMP_NUM_THREADS,
    MKL_NUM_THREADS), passive OpenMP waiting (busy-waiting threads collapse decode on a
    shared machine), hub access off unless the model is a hub id, gptqmodel's workers
    and extension cache set."""
    env = dict(os.environ)
    t = str(recipe.threads)
    env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
                "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
                "GPTQMODEL_CPU_WORKERS": env.get("GPTQMODEL_CPU_WORKERS", str(max(1, min(2, os.cpu_count() or 1)))),
                "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": env.get("TRANSFORMERS_VERBOSITY", "error")})
    env.setdefault("GPTQMODEL_TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    env.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    is_hub = bool(recipe.model.source) and model_source_path(recipe.model.source, recipe.base_dir) is None
    if not is_hub:
        env["HF_HUB_OFFLINE"] = "1"
        env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"  # calibration and suites are local files
    if recipe.storage_options:  # run.json holds them redacted; stages need the real ones
        env[OPTIONS_ENV] = json.dumps(recipe.storage_options)
    return env


# ---- running a run folder's stages -------------------------------------------------------

class TierRunner:
    """Runs stages of one run folder in child processes and a tier's stages into its
    result; copies finished files to the recipe's storage URL when it has one.

    Args:
        recipe: the validated recipe.
        run_dir: the run folder.
        on_event: callback ``(tier, stage, message)`` for the progress display.

    Attributes (what executors read): ``recipe``, ``recipe_dict`` (its JSON form),
    ``run_dir``, ``layout`` (:class:`~qeval.results.RunLayout`), ``remote`` (the storage
    URL's :class:`~qeval.storage.RemoteStorage` or None), ``remote_rel`` (the run's place
    in it), ``on_event``, ``push_error`` (the last failed copy, or None).
    """

    def __init__(self, recipe: Recipe, run_dir: Path,
                 on_event: Callable[[str, str, str], None] = lambda t, s, m: None, fresh: bool = False) -> None:
        self.recipe = recipe
        self.recipe_dict = recipe.model_dump(mode="json")
        self.run_dir = Path(run_dir)
        self.layout = RunLayout(self.run_dir)
        self.on_event = on_event
        #: ``(tier, stage, seconds, ok)`` after every stage process ends (any thread).
        self.on_stage_end: Callable[..., None] = lambda t, s, sec, ok, reason=None: None
        self.env = child_env(recipe)
        self.env["QEVAL_RUN_PID"] = str(os.getpid())  # test faults aimed at the run (qeval.worker.inject_fault)
        if fresh:
            self.env[FRESH_ENV] = "1"
        self._procs: set[StageProcess] = set()  # stage processes running now
        self.remote = storage_for(recipe)  # a storage URL: run files are copied there as they finish
        self.remote_rel = run_rel(self.run_dir)
        self._pushed: dict[str, tuple[int, int]] = {}
        self.push_error: str | None = None

    def push(self, include: Callable[[str], bool]) -> int:
        """Copy the run folder's files passing ``include`` to the storage URL (none: no-op).
        Returns the number of files copied. A failed copy (network, credentials expired)
        does not stop the run: it is reported, the local copy stays complete, and
        :meth:`publish_outputs` tries every file not yet copied again."""
        if self.remote is None:
            return 0
        try:
            return self.remote.upload_dir(self.run_dir, self.remote_rel, include=include, seen=self._pushed)
        except Exception as e:  # noqa: BLE001 - storage trouble must not lose measured tiers
            self.push_error = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.on_event("run", "storage", f"copy to {self.remote.url} failed ({self.push_error})")
            return 0

    def publish_outputs(self) -> None:
        """Copy every file of the run folder not yet in the store (the outputs, and anything
        an earlier failed copy missed) to the storage URL.

        Raises:
            Exception: the store's error when this final copy fails too.
        """
        if self.remote is not None:
            self.remote.upload_dir(self.run_dir, self.remote_rel, seen=self._pushed)

    # -- stage execution --------------------------------------------------------------
    def worker_command(self, stage: str, tier: str) -> list[str]:
        """The child process of one stage: ``python -m qeval.worker STAGE RUN_DIR TIER``."""
        return [sys.executable, "-m", "qeval.worker", stage, str(self.run_dir), tier]

    def run_stage(self, stage: str, tier: str = RUN_SCOPE, timeout: float | None = None,
                  fingerprint: str | None = None, threads: int | None = None) -> StageOutcome:
        """Run one stage in a child process and wait for it (:meth:`_run_stage`); then call
        ``on_stage_end(tier, stage, seconds, ok, reason)`` (the progress display, the
        stage-time history), also when the stage failed (``reason``: why, one line)."""
        t0 = time.time()
        out = StageOutcome(False, "interrupted")
        try:
            out = self._run_stage(stage, tier, timeout, fingerprint, threads)
            return out
        finally:
            try:
                self.on_stage_end(tier, stage, time.time() - t0, out.ok, None if out.ok else out.reason)
            except Exception:  # noqa: BLE001 - a display error must not fail the stage
                pass

    def _run_stage(self, stage: str, tier: str = RUN_SCOPE, timeout: float | None = None,
                   fingerprint: str | None = None, threads: int | None = None) -> StageOutcome:
        """Run one stage in a child process and wait for it (polling the log for progress).

        ``threads``: OMP/torch threads of an untimed stage (default :func:`stage_threads`);
        timed stages always get the recipe's pinned ``threads``. Safe to call from several
        threads at once (the pipelined executor runs untimed stages side by side).

        The child runs in its own session (a timeout kills its whole process group) and
        is killed by the kernel if this process dies (PR_SET_PDEATHSIG), so a killed run
        leaves no orphan that would write a stage file behind a later ``--resume``."""
        log = self.layout.log(tier, stage)
        log.parent.mkdir(parents=True, exist_ok=True)
        err_file = self.layout.stage(tier, stage, error=True)
        if err_file.exists():
            err_file.unlink()
        timeout = timeout or self.recipe.stage_timeout_s
        cmd = self.worker_command(stage, tier)
        t0 = time.time()
        with open(log, "ab") as lf:
            lf.write(f"--- {datetime.now(timezone.utc).isoformat()} {' '.join(cmd)}\n".encode())
            lf.flush()
            env = dict(self.env, QEVAL_FINGERPRINT=fingerprint or "")
            if stage not in TIMED_STAGES:  # nothing is timed here: use the machine
                t = str(threads or stage_threads(self.recipe, stage))
                env.update(OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, QEVAL_STAGE_THREADS=t)
            proc = start_stage(cmd, env, lf)
            self._procs.add(proc)
            last = ""
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    line = _last_progress(log)
                    if line and line != last:
                        last = line
                        self.on_event(tier, stage, line)
                    if time.time() - t0 > timeout:
                        _kill(proc)
                        return StageOutcome(False, f"{stage} timed out after {timeout:.0f} s", _tail(log))
            except KeyboardInterrupt:
                _kill(proc)
                raise Interrupted() from None
            finally:
                self._procs.discard(proc)
        if rc == 0 and stage_done(self.layout, tier, stage):
            return StageOutcome(True)
        reason = None
        input_error = False
        err = read_stage_error(self.layout, tier, stage)
        if err is not None:
            reason, input_error = err.error, err.type == "input"
        if reason is None:
            if rc < 0:
                reason = signal_reason(rc, stage, log)
                try:  # the stage's log says it too, where the user looks first
                    with open(log, "a") as lf:
                        lf.write(f"[qeval] {reason}\n")
                except OSError:
                    pass
            else:
                # no error file: the child died before writing it, e.g. gptqmodel's worker threads print
                # the exception and call os._exit(1) (gptqmodel/utils/threadx.py, _abort_process)
                logged = reason_from_log(log)
                how = f"exited with code {rc}"
                reason = f"{logged} (from its log; the {stage} process {how})" if logged else f"{stage} process {how}"
        return StageOutcome(False, reason, _tail(log), input_error)

    def kill_stages(self) -> None:
        """Kill every stage process still running (an interrupted pipelined run)."""
        for proc in list(self._procs):
            _kill(proc)

    def stage_timeout(self, stage: str) -> float | None:
        """The time limit of a tier stage: ``load.timeout_s``, ``speed.timeout_s`` for
        measure, else None (``stage_timeout_s``)."""
        return {"load": self.recipe.load.timeout_s, "measure": self.recipe.speed.timeout_s}.get(stage)

    def run_tier(self, tier: str, reference_failed: str | None = None) -> TierResult:
        """Run the tier's unfinished stages (prepare, measure, load, quality) in child
        processes and write ``tiers/<tier>.json``; returns that result."""
        spec = self.recipe.tier(tier)
        method = get_method(spec.method)
        if method is None:
            return self.finish(tier, STATUS_NOT_BUILT, error=f"method {spec.method!r} is not built yet")
        fp = tier_fingerprint(self.recipe_dict, tier)
        failed: StageOutcome | None = None
        for stage in TIER_STAGES:
            if stage == "quality" and not self.recipe.suites:
                continue
            if stage == "load" and not self._wants_load(tier):
                continue
            if stage_done(self.layout, tier, stage):
                continue
            if stage == "quality" and reference_failed:
                failed = StageOutcome(False, f"reference pass failed: {reference_failed}")
                break
            self.on_event(tier, stage, "starting")
            out = self.run_stage(stage, tier, timeout=self.stage_timeout(stage), fingerprint=fp)
            self.push(RunLayout.tier_files(tier))  # a finished stage survives this machine (resume elsewhere)
            if not out.ok and stage == "load":  # the load sweep failing loses neither speed nor quality
                if read_stage_error(self.layout, tier, "load") is None:  # killed (timeout, signal): say why
                    write_stage_error(self.layout, tier, "load",
                                      StageError(error=out.reason or "load stage failed", type="exception"))
                kept = read_partial_load(self.layout, tier)
                n = len((kept or {}).get("points") or []) + len(((kept or {}).get("arrivals") or {}).get("points") or [])
                self.on_event(tier, "load", f"load sweep failed: {out.reason}"
                              + (f" ({n} points measured before it stopped are kept)" if n else ""))
                continue
            if not out.ok:
                failed = out
                break
        if failed:
            res = self.finish(tier, STATUS_FAILED, error=failed.reason, log_tail=failed.log_tail)
            self.on_event(tier, "failed", failure_text(failed.reason, failed.log_tail))
        else:
            res = self.finish(tier, STATUS_OK)
            self.on_event(tier, "done", "")
        return res

    def _wants_load(self, tier: str) -> bool:
        """Whether the tier gets a load stage: ``load.enabled``, and its measured engine can
        serve batches (it implements the serving core, :func:`qeval.serving.core.can_serve`). A
        finished load stage from another ``load`` section is removed (run again)."""
        if not self.recipe.load.enabled:
            return False
        if stage_done(self.layout, tier, "measure") and \
                not can_serve(get_engine(read_stage(self.layout, tier, "measure").engine)):
            return False
        if stage_done(self.layout, tier, "load") and \
                read_stage(self.layout, tier, "load").load_fingerprint != load_fingerprint(self.recipe_dict):
            self.layout.stage(tier, "load").unlink()
        return True

    #: Measure-stage fields copied into the tier result as they are.
    MEASURE_FIELDS = ("engine", "backend", "device", "threads", "kv_cache", "flash_attn", "kv_cache_dtype",
                      "attention", "memory", "speed", "open_seconds", "decode_mode", "decode_note", "decode_check",
                      "decode_tokens", "sampling", "runtime", "served", "dtype_emulated")

    def finish(self, tier: str, status: str, error: str | None = None, log_tail: str | None = None) -> TierResult:
        """Merge the tier's stage files into ``tiers/<tier>.json`` (atomically)."""
        spec = self.recipe.tier(tier)
        res = TierResult(tier=tier, method=spec.method, status=status, error=error, log_tail=log_tail,
                         spec=spec.model_dump(mode="json"))
        quant: dict = {}
        for stage in TIER_STAGES:
            if not stage_done(self.layout, tier, stage):
                continue
            d = read_stage(self.layout, tier, stage)
            setattr(res.timings, f"{stage}_s", d.stage_seconds)
            if stage == "prepare":
                res.artifact = Artifact(key=d.key, path=d.artifact, reused=d.reused)
                quant = d.info.model_dump()
                res.resolved = d.resolved
            elif stage == "measure":
                for k in self.MEASURE_FIELDS:
                    setattr(res, k, getattr(d, k))
                quant.update({k: v for k, v in d.quant.model_dump().items() if v is not None})
            elif stage == "load":
                res.load = d.load
            elif stage == "quality":
                res.quality = d.quality
        if quant or stage_done(self.layout, tier, "prepare"):
            res.quant = QuantInfo.model_validate(quant)
        if res.load is None and self.recipe.load.enabled:
            err = read_stage_error(self.layout, tier, "load")
            if err is not None:  # the sweep failed; the tier's other results stand, and so do its finished points
                why = err.error or "load stage failed"
                kept = read_partial_load(self.layout, tier)
                if kept:
                    where = kept.pop("_at", None) or "its last finished point"
                    res.load = LoadSection.model_validate(
                        {**kept, "error": why, "partial": True, "stopped": f"load stopped after {where}: {why}"})
                else:
                    res.load = LoadSection(error=why)
        write_tier_result(self.layout, res)
        self.push(RunLayout.tier_files(tier))
        return res


def _kill(proc: StageProcess) -> None:
    proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(log: Path, n: int = 25) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _last_progress(log: Path) -> str | None:
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            chunk = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(chunk.splitlines()):
        if line.startswith("[qeval] "):
            return line[8:]
    return None
