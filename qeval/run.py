"""A qeval run: stages in child processes, per-tier isolation, resume, outputs.

Flow (docs/design.md): source -> env (bandwidth) -> reference pass -> for each tier:
prepare -> measure -> load (concurrency sweep; engines that can batch, ``load.enabled``)
-> quality -> ``tiers/<tier>.json``; then tables, gate, report.

Every stage runs in its own process (:mod:`qeval.worker`): an exception, an
out-of-memory kill, a segfault or a timeout marks that tier ``failed`` with the reason
and the tail of its log, and the other tiers go on. Finished stages are files in
``stages/``; ``--resume`` redoes only what is missing.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .errors import EXIT_BAD_INPUT, QevalInputError
from .recipe import Recipe, TIER_METHODS, check_context
from .results import (STATUS_FAILED, STATUS_NOT_BUILT, STATUS_OK, atomic_write_json, read_json)
from .worker import short_path, stage_path

TIER_STAGES = ("prepare", "measure", "load", "quality")
TIMED_STAGES = ("measure", "load", "env")


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


class StageFailed(RuntimeError):
    """A run-wide stage (source, env, reference) failed: its reason, then its log's last lines."""


class Interrupted(Exception):
    """Ctrl-C during a run; finished stages stay on disk."""


# ---- fingerprints for resume --------------------------------------------------------

def tier_fingerprint(recipe_dict: dict, tier: str) -> str:
    """Hash of everything that shapes a tier's measured results (model, device, threads,
    speed, calibration, suites, quality and the tier's own spec). Gate and report settings
    are left out: changing them does not invalidate measurements."""
    spec = next((t for t in recipe_dict["tiers"] if t["name"] == tier), None)
    keep = {k: recipe_dict.get(k) for k in ("model", "device", "threads", "speed", "calibration", "suites",
                                            "quality")}
    keep["tier"] = spec
    keep["reference"] = next((t for t in recipe_dict["tiers"]
                              if t["name"] == recipe_dict["gate"]["reference"]), None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _changed_fields(old: dict, new: dict, tier: str) -> list[str]:
    out = []
    for k in ("model", "device", "threads", "speed", "calibration", "suites", "quality"):
        if old.get(k) != new.get(k):
            out.append(k)
    o = next((t for t in old["tiers"] if t["name"] == tier), None)
    n = next((t for t in new["tiers"] if t["name"] == tier), None)
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
    from .source import cache_root, model_source_path
    env.setdefault("GPTQMODEL_TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions"))
    env.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    is_hub = bool(recipe.model.source) and model_source_path(recipe.model.source, recipe.base_dir) is None
    if not is_hub:
        env["HF_HUB_OFFLINE"] = "1"
        env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"  # calibration and suites are local files
    from .storage import OPTIONS_ENV
    if recipe.storage_options:  # run.json holds them redacted; stages need the real ones
        env[OPTIONS_ENV] = json.dumps(recipe.storage_options)
    return env


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("qeval", "torch", "transformers", "torchao", "gptqmodel", "llama-cpp-python", "gguf",
                "accelerate", "datasets", "optimum", "hqq", "lm-eval", "ray", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    out["python"] = sys.version.split()[0]
    return out


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or None


# ---- the runner ---------------------------------------------------------------------

class Runner:
    """Runs a recipe into a run folder.

    Args:
        recipe: the validated recipe.
        run_dir: the run folder (created when missing).
        tiers: names of the tiers to run (None: all, in recipe order).
        on_event: callback ``(tier, stage, message)`` for the progress display.
    """

    def __init__(self, recipe: Recipe, run_dir: Path, tiers: list[str] | None = None,
                 on_event: Callable[[str, str, str], None] = lambda t, s, m: None,
                 executor: str | None = None, ray_address: str | None = None) -> None:
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.tiers = tiers or [t.name for t in recipe.tiers]
        self.on_event = on_event
        self.env = child_env(recipe)
        self.recipe_dict = recipe.model_dump(mode="json")
        self.executor = executor or recipe.executor
        self.ray_address = ray_address
        self._proc: subprocess.Popen | None = None
        from .storage import run_rel, storage_for
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

    def run_stage(self, stage: str, tier: str = "_run", timeout: float | None = None,
                  fingerprint: str | None = None) -> StageOutcome:
        """Run one stage in a child process and wait for it (polling the log for progress).

        The child runs in its own session (a timeout kills its whole process group) and
        is killed by the kernel if this process dies (PR_SET_PDEATHSIG), so a killed run
        leaves no orphan that would write a stage file behind a later ``--resume``."""
        log = self.run_dir / "logs" / f"{tier}.{stage}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        err_file = stage_path(self.run_dir, tier, stage, error=True)
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
                t = str(stage_threads(self.recipe, stage))
                env.update(OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, QEVAL_STAGE_THREADS=t)
            self._proc = proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True, stdin=subprocess.DEVNULL,
                                                 preexec_fn=_die_with_parent)
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
                self._proc = None
        if rc == 0 and stage_path(self.run_dir, tier, stage).exists():
            return StageOutcome(True)
        reason = None
        input_error = False
        if err_file.exists():
            try:
                e = json.loads(err_file.read_text())
                reason = e.get("error")
                input_error = e.get("type") == "input"
            except ValueError:
                pass
        if reason is None:
            if rc < 0:
                sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
                how = f"killed by {sig}" + (" (out of memory?)" if -rc == signal.SIGKILL else "")
            else:
                how = f"exited with code {rc}"
            # no error file: the child died before writing it, e.g. gptqmodel's worker threads print
            # the exception and call os._exit(1) (gptqmodel/utils/threadx.py, _abort_process)
            logged = reason_from_log(log) if rc > 0 else None  # a signal is its own reason
            reason = f"{logged} (from its log; the {stage} process {how})" if logged else f"{stage} process {how}"
        return StageOutcome(False, reason, _tail(log), input_error)

    # -- the run ----------------------------------------------------------------------
    def write_run_json(self, extra: dict | None = None) -> dict:
        """Write ``run.json`` atomically: resolved recipe, versions, CPU, threads, git commit, plus ``extra``."""
        p = self.run_dir / "run.json"
        run = read_json(p) if p.exists() else {}
        from .storage import redact_options
        stored = dict(self.recipe_dict, storage_options=redact_options(self.recipe_dict.get("storage_options") or {}))
        run.update({
            "recipe": stored,  # credentials in storage_options never reach run.json (nor the store)
            "recipe_path": str(self.recipe.path) if self.recipe.path else None,
            "recipe_dir": str(self.recipe.base_dir),  # where the recipe's relative paths start
            "qeval_commit": _git_commit(),
            "versions": _versions(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "threads": self.recipe.threads,
            "started_at": run.get("started_at") or datetime.now(timezone.utc).isoformat(),
        })
        run.update(extra or {})
        atomic_write_json(p, run)
        return run

    def run_global(self, stage: str) -> dict:
        """Run a run-wide stage (source, env, reference) unless already done; returns its JSON.

        Raises:
            QevalInputError: the stage failed on bad input.
            StageFailed: the stage failed otherwise (nothing can be measured without it).
        """
        p = stage_path(self.run_dir, "_run", stage)
        if p.exists():
            return read_json(p)
        self.on_event("run", stage, "starting")
        out = self.run_stage(stage)
        if not out.ok:
            if out.input_error:
                raise QevalInputError(out.reason or "bad input")
            raise StageFailed(f"stage {stage} failed: {failure_text(out.reason, out.log_tail)}")
        return read_json(p)

    def check_resume(self) -> None:
        """Refuse a resume whose recipe changed in a way that invalidates finished stages.

        Raises:
            QevalInputError: names the tier and the changed recipe sections.
        """
        p = self.run_dir / "run.json"
        if not p.exists():
            return
        old = read_json(p).get("recipe") or {}
        for tier in self.tiers:
            done = [s for s in TIER_STAGES if stage_path(self.run_dir, tier, s).exists()]
            if not done:
                continue
            fp = read_json(stage_path(self.run_dir, tier, done[0])).get("fingerprint")
            if fp and fp != tier_fingerprint(self.recipe_dict, tier):
                raise QevalInputError(
                    f"cannot resume: the recipe changed ({', '.join(_changed_fields(old, self.recipe_dict, tier))}) "
                    f"since tier {tier!r} was measured; start a new run", file=self.recipe.path)
        if old and old.get("model") != self.recipe_dict.get("model"):
            raise QevalInputError("cannot resume: the recipe's model changed; start a new run",
                                  file=self.recipe.path, field="model")

    def run(self) -> dict[str, dict]:
        """Run every stage that is not done yet. Returns ``{tier: tier result}``."""
        self.check_resume()
        self.write_run_json()
        if not stage_path(self.run_dir, "_run", "source").exists():
            self.check_download()
        src = self.run_global("source")
        check_context(self.recipe, src.get("max_context"))
        self.check_disk(src)
        env = self.run_global("env")
        self.write_run_json({"source": src, "env": env, "bandwidth_bytes_per_s": env.get("bandwidth_bytes_per_s"),
                             "device": env.get("device"), "gpu": env.get("gpu"),
                             "gpu_memory_bytes": env.get("gpu_memory_bytes")})
        reference_failed = self.reference_stage() if self.recipe.suites else None
        from .storage import run_wide_files
        self.push(lambda rel: run_wide_files(rel) or rel.startswith("logs/_run."))
        if self.executor == "ray":
            from .executors import run_tiers_on_ray
            results = run_tiers_on_ray(self, reference_failed)
        else:
            results = {tier: self.run_tier(tier, reference_failed) for tier in self.tiers}
        self.write_run_json({"finished_at": datetime.now(timezone.utc).isoformat()})
        return results

    def check_download(self) -> None:
        """Pre-flight for a hub id: free disk in the Hugging Face cache against the files the
        source stage will download (:func:`qeval.source.hub_download_bytes`).

        Raises:
            QevalInputError: too little free disk (names both figures).
        """
        from .source import hub_download_bytes
        got = hub_download_bytes(self.recipe.model, self.recipe.base_dir)
        if not got or not got[0]:
            return
        need, folder = got
        free = shutil.disk_usage(_existing_parent(folder)).free
        if free < need:
            raise QevalInputError(f"downloading {self.recipe.model.source} needs {need / 2**30:.1f} GiB in {folder}, "
                                  f"which has {free / 2**30:.1f} GiB free", file=self.recipe.path, field="model.source")

    def check_disk(self, src: dict) -> None:
        """Pre-flight: free disk in the artifact cache against what the tiers and the
        reference pass will write (:func:`disk_needs`).

        Raises:
            QevalInputError: too little free disk (names the total, its parts and the free space).
        """
        from .source import cache_root
        folder = Path(src["path"])
        weight_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        dtype_bytes = 4 if self.recipe.model.dtype == "float32" else 2
        params = weight_bytes // dtype_bytes
        todo = [t for t in self.tiers if not (self.run_dir / "tiers" / f"{t}.json").exists()]
        probe = _existing_parent(cache_root())
        tokens = None
        if self.recipe.suites and not stage_path(self.run_dir, "_run", "reference").exists():
            tokens = reference_answer_tokens(self.recipe)
        parts = disk_needs(self.recipe, todo, params, vocab=_vocab_size(folder), answer_tokens=tokens)
        if tokens and not _same_filesystem(probe, _existing_parent(self.run_dir)):
            parts["reference log-probabilities"] *= 2  # linked into the run folder: a copy across file systems
        need = sum(parts.values())
        free = shutil.disk_usage(probe).free
        if need and free < need:
            detail = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items() if v)
            raise QevalInputError(f"the run needs about {need / 2**30:.1f} GiB of disk ({detail} GiB), but {probe} "
                                  f"has {free / 2**30:.1f} GiB free", file=self.recipe.path, field="tiers")

    def reference_stage(self) -> str | None:
        """Run the reference pass (after preparing the reference tier's artifact if it has
        one). Returns None, or why it failed (every tier's quality then fails with it)."""
        from .tiers import get_method
        ref = self.recipe.gate.reference
        method = get_method(self.recipe.tier(ref).method)
        try:
            if method is None:
                return f"reference tier {ref!r} uses a method that is not built yet"
            if method.needs_artifact and not stage_path(self.run_dir, ref, "prepare").exists():
                out = self.run_stage("prepare", ref, fingerprint=tier_fingerprint(self.recipe_dict, ref))
                if not out.ok:
                    return f"preparing {ref}: {out.reason}"
            self.run_global("reference")
        except (RuntimeError, QevalInputError) as e:
            return str(e).splitlines()[0]
        return None

    def run_tier(self, tier: str, reference_failed: str | None = None) -> dict:
        """Run the tier's unfinished stages (prepare, measure, quality) in child processes
        and write ``tiers/<tier>.json``; returns that result."""
        from .storage import tier_files
        from .tiers import get_method
        spec = self.recipe.tier(tier)
        method = get_method(spec.method)
        if method is None:
            return self._finish(tier, STATUS_NOT_BUILT, error=f"method {spec.method!r} is not built yet")
        fp = tier_fingerprint(self.recipe_dict, tier)
        failed: StageOutcome | None = None
        for stage in TIER_STAGES:
            if stage == "quality" and not self.recipe.suites:
                continue
            if stage == "load" and not self._wants_load(tier):
                continue
            if stage_path(self.run_dir, tier, stage).exists():
                continue
            if stage == "quality" and reference_failed:
                failed = StageOutcome(False, f"reference pass failed: {reference_failed}")
                break
            self.on_event(tier, stage, "starting")
            timeout = self.recipe.load.timeout_s if stage == "load" else None
            out = self.run_stage(stage, tier, timeout=timeout, fingerprint=fp)
            self.push(tier_files(tier))  # a finished stage survives this machine (resume elsewhere)
            if not out.ok and stage == "load":  # the load sweep failing loses neither speed nor quality
                self.on_event(tier, "load", f"load sweep failed: {out.reason}")
                continue
            if not out.ok:
                failed = out
                break
        if failed:
            res = self._finish(tier, STATUS_FAILED, error=failed.reason, log_tail=failed.log_tail)
            self.on_event(tier, "failed", failure_text(failed.reason, failed.log_tail))
        else:
            res = self._finish(tier, STATUS_OK)
            self.on_event(tier, "done", "")
        return res

    def _wants_load(self, tier: str) -> bool:
        """Whether the tier gets a load stage: ``load.enabled``, and its measured engine can
        batch. A finished load stage from another ``load`` section is removed (run again)."""
        from .measure.serving import BATCHING_ENGINES
        from .worker import load_fingerprint
        if not self.recipe.load.enabled:
            return False
        m = stage_path(self.run_dir, tier, "measure")
        if m.exists() and read_json(m).get("engine") not in BATCHING_ENGINES:
            return False
        done = stage_path(self.run_dir, tier, "load")
        if done.exists() and read_json(done).get("load_fingerprint") != load_fingerprint(self.recipe_dict):
            done.unlink()
        return True

    def _finish(self, tier: str, status: str, error: str | None = None, log_tail: str | None = None) -> dict:
        """Merge the tier's stage files into ``tiers/<tier>.json`` (atomically)."""
        spec = self.recipe.tier(tier)
        res: dict = {"tier": tier, "method": spec.method, "status": status, "error": error,
                     "log_tail": log_tail, "spec": spec.model_dump(mode="json"), "timings": {}}
        for stage in TIER_STAGES:
            p = stage_path(self.run_dir, tier, stage)
            if not p.exists():
                continue
            d = read_json(p)
            res["timings"][f"{stage}_s"] = d.get("stage_seconds")
            if stage == "prepare":
                res["artifact"] = {"key": d.get("key"), "path": d.get("artifact"), "reused": d.get("reused")}
                res["quant"] = dict(d.get("info") or {})
                res["resolved"] = d.get("resolved")
            elif stage == "measure":
                for k in ("engine", "backend", "device", "threads", "kv_cache", "flash_attn", "memory", "speed",
                          "load_seconds", "decode_mode", "decode_note", "decode_tokens", "sampling", "runtime"):
                    res[k] = d.get(k)
                res.setdefault("quant", {}).update({k: v for k, v in (d.get("quant") or {}).items() if v is not None})
            elif stage == "load":
                res["load"] = d.get("load")
            elif stage == "quality":
                res["quality"] = d.get("quality")
        if res.get("load") is None and self.recipe.load.enabled:
            err = stage_path(self.run_dir, tier, "load", error=True)
            if err.exists():  # the sweep failed; the tier's other results stand
                res["load"] = {"error": read_json(err).get("error") or "load stage failed", "points": []}
        atomic_write_json(self.run_dir / "tiers" / f"{tier}.json", res)
        from .storage import tier_files
        self.push(tier_files(tier))
        return res


def failure_text(reason: str | None, log_tail: str | None, lines: int = 8) -> str:
    """What the terminal prints for a failed tier: the reason (first line), then the last
    ``lines`` lines of its stage log, indented."""
    head = (reason or "no reason recorded").splitlines()[0] if (reason or "").strip() else "no reason recorded"
    tail = [ln for ln in (log_tail or "").splitlines() if ln.strip()][-lines:]
    return head + "".join(f"\n      | {ln}" for ln in tail)


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL us when the parent dies."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
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


def reason_from_log(log: Path) -> str | None:
    """The last Python traceback in a stage log as one line, ``Type: message (at
    file:line)``, plus the failed statement for an ``AssertionError``, for a child that exited
    without writing its error file. Only the last attempt counts (the log is appended to on
    resume; each attempt starts with a ``--- <time> <command>`` line). None when that part
    holds no traceback."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    heads = [i for i, ln in enumerate(lines) if ln.startswith("--- ")]
    lines = lines[heads[-1] + 1:] if heads else lines
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last):" in ln]  # progress bars may precede it
    if not starts:
        return None
    where, code, last = None, None, None
    for i in range(starts[-1] + 1, len(lines)):
        ln = lines[i]
        m = _TB_FRAME.match(ln)
        if m:
            where = f"{short_path(m.group(1))}:{m.group(2)}"
            code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else None
            continue
        if ln and not ln.startswith((" ", "\t")):
            last = ln.strip()  # "ValueError: ..." ends the traceback
            break
    if last is None:
        return None
    at = f" (at {where}{': ' + code if code and last.startswith('AssertionError') else ''})" if where else ""
    return (last[:300] + at)[:500]


_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')


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


def new_run_dir(recipe: Recipe, out: Path | None) -> Path:
    """``<out or results>/<recipe name>/<UTC timestamp>/`` (created)."""
    base = Path(out) if out else Path("results")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    d = base / recipe.name / stamp
    i = 1
    while d.exists():
        d = base / recipe.name / f"{stamp}-{i}"
        i += 1
    d.mkdir(parents=True)
    return d


def preflight(recipe: Recipe, run_dir_parent: Path, tiers: list[str]) -> None:
    """Checks before any work (the disk check follows once the source's size is known:
    :meth:`Runner.check_disk`).

    Raises:
        QevalInputError: a CUDA recipe on a machine without CUDA (naming both).
    """
    if recipe.device == "cuda":
        try:
            import torch
            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            raise recipe.error(("device",), "the recipe asks for device cuda, but this machine has no CUDA "
                                            "device visible to torch (use device: auto or cpu)")


# Bytes per source parameter an artifact keeps in the cache (gguf: by its type, below).
_BYTES_PER_PARAM = {"bf16": 0.0, "int8": 1.1, "gptq": 0.6, "awq": 0.6}
# Written only while the artifact is built, then deleted, in source-dtype bytes per parameter:
# gptqmodel's offload folder (finished layers, about the whole model) and GGUF's 16-bit
# intermediate file (the converter's output before llama_model_quantize).
_TRANSIENT_DTYPE_COPIES = {"gptq": 1.0, "awq": 1.0, "gguf": 1.0}
# Spec fields that are engine settings, not part of the artifact (two tiers differing only in
# them share one artifact, e.g. a GGUF file with and without the int8 KV cache).
_ENGINE_ONLY_FIELDS = ("name", "kv_cache", "flash_attn", "quality_engine", "decode")
LOGPROB_BYTES = 2  # reference/logprobs.npy is float16 (measure/fidelity.py ROUND)


def _gguf_bytes_per_param(gguf_type: str) -> float:
    """Approximate bytes per parameter of a llama.cpp file type: F32 4, F16/BF16 2, else the
    type's bit count plus one bit of scales (Q4_K_M ~0.63, Q8_0 ~1.13)."""
    t = str(gguf_type).upper()
    if t == "F32":
        return 4.0
    if t in ("F16", "BF16"):
        return 2.0
    digits = [c for c in t if c.isdigit()]
    return (int(digits[0]) + 1) / 8 if digits else 1.0


def artifact_groups(recipe: Recipe, tiers: list[str]) -> list[str]:
    """``tiers`` less those whose artifact another listed tier already builds (same method
    and spec apart from engine settings such as ``kv_cache`` and ``flash_attn``)."""
    seen: set[str] = set()
    out = []
    for t in tiers:
        spec = recipe.tier(t).model_dump(mode="json")
        key = json.dumps({k: v for k, v in spec.items() if k not in _ENGINE_ONLY_FIELDS}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def disk_needs(recipe: Recipe, tiers: list[str], params: int | None, *, vocab: int | None = None,
               answer_tokens: int | None = None) -> dict[str, int]:
    """Bytes the run will write, by part: ``artifacts`` (kept: parameter count x bytes per
    parameter per method, one artifact per :func:`artifact_groups` entry), ``while
    quantizing`` (the largest transient folder of one build: gptqmodel's offload folder,
    GGUF's 16-bit intermediate; builds run one at a time per machine) and ``reference
    log-probabilities`` (float16, answer tokens x vocabulary). Unknown parameter count: 0
    for the tier parts (no check)."""
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    parts = {"artifacts": 0, "while quantizing": 0, "reference log-probabilities": 0}
    if params:
        for t in artifact_groups(recipe, tiers):
            spec = recipe.tier(t)
            per = _gguf_bytes_per_param(spec.type) if spec.method == "gguf" else _BYTES_PER_PARAM.get(spec.method, 2.0)
            parts["artifacts"] += int(params * per)
            parts["while quantizing"] = max(parts["while quantizing"],
                                            int(params * dtype_bytes * _TRANSIENT_DTYPE_COPIES.get(spec.method, 0)))
    if vocab and answer_tokens:
        parts["reference log-probabilities"] = int(answer_tokens) * int(vocab) * LOGPROB_BYTES
    return parts


def estimate_disk_bytes(recipe: Recipe, tiers: list[str], params: int | None = None) -> int:
    """Bytes the tiers' artifacts will write (kept plus the largest transient build folder,
    :func:`disk_needs` without the reference). Unknown parameter count -> 0 (no check)."""
    return sum(disk_needs(recipe, tiers, params).values())


def reference_answer_tokens(recipe: Recipe) -> int:
    """Upper bound of the reference pass's answer tokens: every turn of every suite item at
    its token budget (``quality._budget``: the suite's cap, the item's own, and
    ``fidelity_max_new_tokens`` past the suite's ``limit``)."""
    from .measure.quality import _budget, load_suites
    short = recipe.quality.fidelity_max_new_tokens
    return sum(_budget(spec, it, i, short) * len(it.turns)
               for spec, items in load_suites(recipe) for i, it in enumerate(items))


def _vocab_size(folder: Path) -> int | None:
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def _existing_parent(p: Path) -> Path:
    p = Path(p)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return True
