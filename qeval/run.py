"""A qeval run: the run-wide stages, resume checks, ``run.json``, and the tiers through an
executor.

Flow (docs/design.md): source -> env (bandwidth) -> reference pass -> noise floor -> for
each tier: prepare -> measure -> quality -> ``tiers/<tier>.json``; then tables, gate,
report. Each stage is a child process (:mod:`qeval.stages`); where the tiers run is the
executor's business (:mod:`qeval.executors`: local or Ray).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

from .bounded import show_value
from .errors import QevalInputError
from .executors import Executor, make_executor
from .failures import failure_text
from .measure.long_context import recipe_long_context
from .measure.quality import _budget, load_suites
from .paths import cache_root
from .pipeline import Pipeline, default_lanes
from .progress import read_history
from .recipe import Recipe, check_context
from .results import (RUN_SCOPE, TIER_STAGES, FloorStage, NoiseFloorSummary, RunInfo, RunLayout, TierResult,
                      SpecPair, SpeculativeStage, read_run_info, read_stage, stage_done, write_run_info,
                      write_stage)
from .stages import (Interrupted, StageOutcome, TierRunner, changed_fields, child_env, recipe_fingerprint,
                     stage_threads, tier_fingerprint)
from .measure.prompt_format import prompt_format
from .source import hub_download_bytes, model_source_path
from .storage import redact_options
from .tiers import get_method
from .validate import check_long_context_depths, check_prompt_format

__all__ = ["Interrupted", "Runner", "StageFailed", "StageOutcome", "child_env", "estimate_disk_bytes", "new_run_dir", "preflight",
           "stage_threads", "tier_fingerprint"]


class StageFailed(RuntimeError):
    """A run-wide stage (source, env, reference) failed: its reason, then its log's last lines."""


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str | None]:
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
    return platform.processor() or None


# ---- the runner ---------------------------------------------------------------------

class Runner(TierRunner):
    """Runs a recipe into a run folder: the run-wide stages here, the tiers through the
    executor.

    Args:
        recipe: the validated recipe.
        run_dir: the run folder (created when missing).
        tiers: names of the tiers to run (None: all, in recipe order).
        on_event: callback ``(tier, stage, message)`` for the progress display.
        executor: where the tiers run: an :class:`~qeval.executors.Executor`, or its name
            (``local``, ``ray``); None: the recipe's ``executor``.
        ray_address: the Ray cluster's address when ``executor`` is a name.
        fresh: recompute the reference pass and every quality result instead of reusing
            cached ones with the same content key (``qeval run --fresh``).
    """

    def __init__(self, recipe: Recipe, run_dir: Path, tiers: list[str] | None = None,
                 on_event: Callable[[str, str, str], None] = lambda t, s, m: None,
                 executor: Executor | str | None = None, ray_address: str | None = None,
                 fresh: bool = False, depths_checked: bool = False) -> None:
        super().__init__(recipe, run_dir, on_event, fresh=fresh)
        self.subset = list(tiers) if tiers else None  # `--tiers`: recorded in run.json for the gate
        self.tiers = tiers or [t.name for t in recipe.tiers]
        if executor is None or isinstance(executor, str):
            executor = make_executor(executor, ray_address) if executor else \
                make_executor(recipe.executor, ray_address, recipe=recipe)
        self.executor = executor
        # whether the long_context depths were checked before the run (qeval.validate.static_checks:
        # a local checkpoint or an expanded GGUF package); if not, right after the source stage
        self.depths_checked = depths_checked

    # -- the run ----------------------------------------------------------------------
    def write_run_json(self, extra: dict | None = None) -> RunInfo:
        """Write ``run.json`` atomically: resolved recipe, versions, CPU, threads, git commit,
        plus ``extra`` (fields of :class:`~qeval.results.RunInfo`)."""
        run = read_run_info(self.layout).model_dump() if self.layout.is_run() else {}
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
            "recipe_fingerprint": recipe_fingerprint(self.recipe_dict),
            "started_at": run.get("started_at") or datetime.now(timezone.utc).isoformat(),
            "tiers_run": self.subset,
            "prompt_format": prompt_format(self.recipe.model),
        })
        run.update(extra or {})
        info = RunInfo.model_validate(run)
        write_run_info(self.layout, info)
        return info

    def run_global(self, stage: str):
        """Run a run-wide stage (source, env, reference) unless already done; returns its
        model (:data:`qeval.results.STAGE_MODELS`).

        Raises:
            QevalInputError: the stage failed on bad input.
            StageFailed: the stage failed otherwise (nothing can be measured without it).
        """
        if stage_done(self.layout, RUN_SCOPE, stage):
            return read_stage(self.layout, RUN_SCOPE, stage)
        self.on_event("run", stage, "starting")
        out = self.run_stage(stage)
        if not out.ok:
            if out.input_error:
                raise QevalInputError(out.reason or "bad input")
            raise StageFailed(f"stage {stage} failed: {failure_text(out.reason, out.log_tail)}")
        return read_stage(self.layout, RUN_SCOPE, stage)

    def check_resume(self) -> None:
        """Refuse a resume of a run folder made by another recipe, or whose recipe changed
        in a way that invalidates finished stages. Reads only; changes nothing (``run.json``
        is rewritten by :meth:`run` after this passes).

        Refused: ``run.json`` missing or malformed, or recording no recipe; another recipe
        name; any change in the run-wide sections (:data:`RUN_WIDE`: model, device,
        threads, speed, calibration, suites, quality; compared through
        :func:`recipe_fingerprint`); a changed spec of a tier with finished stages. Gate,
        report, executor, storage and stage_timeout_s settings may change.

        Raises:
            QevalInputError: naming the run folder's ``run.json`` or the recipe, and what differs.
        """
        p = self.layout.run_json
        if not (p.exists() or p.is_symlink()):
            return
        run = read_run_info(self.layout)
        old = run.recipe
        if not old:
            raise QevalInputError("records no recipe, so it cannot be resumed; start a new run", file=p,
                                  field="recipe")
        new = self.recipe_dict
        if old.get("name") != new.get("name"):
            raise QevalInputError(f"cannot resume: this run folder was made by recipe {show_value(old.get('name'))}, "
                                  f"not {new.get('name')!r}; start a new run", file=p, field="recipe.name")
        stored = run.recipe_fingerprint
        if stored != recipe_fingerprint(new) and (stored is not None or recipe_fingerprint(old) != recipe_fingerprint(new)):
            raise QevalInputError(f"cannot resume: the recipe differs from the one this run was made with "
                                  f"({', '.join(changed_fields(old, new))}); start a new run",
                                  file=self.recipe.path)
        for tier in self.tiers:
            done = [s for s in TIER_STAGES if stage_done(self.layout, tier, s)]
            if not done:
                continue
            fp = read_stage(self.layout, tier, done[0]).fingerprint
            if fp and fp != tier_fingerprint(new, tier):
                raise QevalInputError(
                    f"cannot resume: the recipe changed ({', '.join(changed_fields(old, new, tier))}) "
                    f"since tier {tier!r} was measured; start a new run", file=self.recipe.path)

    def run(self) -> dict[str, TierResult]:
        """Run every stage that is not done yet. Returns ``{tier: tier result}``."""
        self.check_resume()
        self.write_run_json()
        if not stage_done(self.layout, RUN_SCOPE, "source"):
            self.check_download()
        try:
            src = self.run_global("source")
        except QevalInputError as e:  # the source stage's one line: give it the recipe's file and line
            field, _, rest = e.message.partition(": ")
            if field in ("model.source", "model.gguf_package") and rest:
                raise self.recipe.error(tuple(field.split(".")), rest) from None
            raise
        check_context(self.recipe, src.max_context)
        check_endpoints(self.recipe, Path(src.path))  # the tokenizer check where preflight had no tokenizer
        m = self.recipe.model
        check_prompt_format(self.recipe, Path(src.path))  # a hub id or package:function: its tokenizer is here only now
        if not self.depths_checked:  # a hub id or a GGUF package not expanded yet: its tokenizer is here only now
            check_long_context_depths(self.recipe, Path(src.path))
        self.check_disk(Path(src.path))
        env = self.run_global("env")
        self.write_run_json({"source": src, "env": env, "bandwidth_bytes_per_s": env.bandwidth_bytes_per_s,
                             "device": env.device, "gpu": env.gpu, "gpu_memory_bytes": env.gpu_memory_bytes})
        lanes = default_lanes(self.recipe, env.device)
        if getattr(self.executor, "in_process", False) and lanes > 1:
            results = self.run_pipelined(lanes)
        else:
            reference_failed = self.reference_stage() if self.recipe.suites else None
            if self.recipe.suites and not reference_failed:
                self.write_run_json({"noise_floor": self.floor_stage()})
            self.push(lambda rel: RunLayout.run_wide_file(rel) or RunLayout.run_log(rel))
            results = self.executor.run_tiers(self, self.tiers, reference_failed)
        if self.recipe.speculative:
            self.speculative_stage()
        self.write_run_json({"finished_at": datetime.now(timezone.utc).isoformat(),
                             "llama_cpp": llama_cpp_backends(results)})
        return results

    def speculative_stage(self) -> None:
        """The recipe's speculative pairs (stage ``speculative``, run-wide, timed, after every
        tier). A finished stage is kept when it ran these pairs without an error; a failed
        stage process writes the stage file with its reason as every pair's ``error``, so the
        tiers' figures and the report stand."""
        spec = [p.model_dump(mode="json") for p in self.recipe.speculative]
        if stage_done(self.layout, RUN_SCOPE, "speculative"):
            done = read_stage(self.layout, RUN_SCOPE, "speculative")
            if done.spec == spec and not any(p.error for p in done.pairs):
                return
        self.on_event("run", "speculative", "starting")
        out = self.run_stage("speculative")
        if not out.ok:
            why = f"the speculative stage failed: {(out.reason or 'failed').splitlines()[0]}"
            self.on_event("run", "speculative", why)
            write_stage(self.layout, RUN_SCOPE, "speculative", SpeculativeStage(
                pairs=[SpecPair(target=p.target, draft=p.draft, draft_tokens=list(p.draft_tokens), error=why)
                       for p in self.recipe.speculative], spec=spec))

    def run_pipelined(self, lanes: int) -> dict[str, TierResult]:
        """The reference, floor and tier stages through :class:`~qeval.pipeline.Pipeline`
        (untimed stages side by side, at most ``lanes``; timed ones alone); ``run.json``
        records ``lanes`` and the ``schedule``."""
        def on_floor(out: StageOutcome) -> None:
            if out.ok:
                summary = floor_summary(read_stage(self.layout, RUN_SCOPE, "floor"))
            else:
                why = (out.reason or "failed").splitlines()[0]
                self.on_event("run", "floor", f"noise floor not measured: {why}")
                summary = NoiseFloorSummary(measured=False, why=f"the floor stage failed: {why}")
            self.write_run_json({"noise_floor": summary})

        pipe = Pipeline(self, self.tiers, lanes, on_floor=on_floor,
                        expected=read_history(self.recipe.name))
        try:
            return pipe.run()
        finally:
            self.write_run_json({"lanes": lanes, "schedule": pipe.schedule()})

    def check_download(self) -> None:
        """Pre-flight for a hub id: free disk in the Hugging Face cache against the files the
        source stage will download (:func:`qeval.source.hub_download_bytes`).

        Raises:
            QevalInputError: too little free disk (names both figures).
        """
        got = hub_download_bytes(self.recipe.model, self.recipe.base_dir)
        if not got or not got[0]:
            return
        need, folder = got
        free = shutil.disk_usage(_existing_parent(folder)).free
        if free < need:
            raise QevalInputError(f"downloading {self.recipe.model.source} needs {need / 2**30:.1f} GiB in {folder}, "
                                  f"which has {free / 2**30:.1f} GiB free", file=self.recipe.path, field="model.source")

    def check_disk(self, folder: Path) -> None:
        """Pre-flight: free disk in the artifact cache against what the tiers and the
        reference pass will write (:func:`disk_needs`; ``folder``: the source checkpoint,
        whose safetensors give the parameter count).

        Raises:
            QevalInputError: too little free disk (names the total, its parts and the free space).
        """
        weight_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        dtype_bytes = 4 if self.recipe.model.dtype == "float32" else 2
        params = weight_bytes // dtype_bytes
        todo = [t for t in self.tiers if not self.layout.tier_result(t).exists()]
        probe = _existing_parent(cache_root())
        tokens = None
        if self.recipe.suites and not stage_done(self.layout, RUN_SCOPE, "reference"):
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
        ref = self.recipe.gate.reference
        method = get_method(self.recipe.tier(ref).method)
        try:
            if method is None:
                return f"reference tier {ref!r} uses a method that is not built yet"
            if method.needs_artifact and not stage_done(self.layout, ref, "prepare"):
                out = self.run_stage("prepare", ref, fingerprint=tier_fingerprint(self.recipe_dict, ref))
                if not out.ok:
                    return f"preparing {ref}: {out.reason}"
            self.run_global("reference")
        except (RuntimeError, QevalInputError) as e:  # StageFailed is one
            return str(e).splitlines()[0]
        return None

    def floor_stage(self) -> NoiseFloorSummary:
        """Measure the noise floor (stage ``floor``, once per run) and return its summary
        for ``run.json`` (:func:`floor_summary`). A failed floor stage does not stop the
        run: the summary says why it is missing."""
        try:
            return floor_summary(self.run_global("floor"))
        except (RuntimeError, QevalInputError) as e:
            self.on_event("run", "floor", f"noise floor not measured: {str(e).splitlines()[0]}")
            return NoiseFloorSummary(measured=False, why=f"the floor stage failed: {str(e).splitlines()[0]}")


def llama_cpp_backends(results: dict[str, TierResult]) -> list[dict] | None:
    """``run.json``'s ``llama_cpp``: the CPU variant and instruction sets llama.cpp ran
    (each tier's ``runtime``, :func:`qeval.engines.llamacpp.warm_runtime`), one entry per
    distinct variant with the tiers that ran it; None when no tier ran llama.cpp in process."""
    seen: dict[tuple, dict] = {}
    for name, r in results.items():
        rt = r.runtime or {}
        if not rt.get("cpu_variant"):
            continue
        key = (rt["cpu_variant"], tuple(rt.get("instruction_sets") or ()))
        entry = seen.setdefault(key, {"cpu_variant": rt["cpu_variant"], "instruction_sets": list(key[1]),
                                      "devices": rt.get("devices"), "amx_granted": rt.get("amx_granted"),
                                      "passed_over": rt.get("passed_over") or [], "tiers": []})
        entry["tiers"].append(name)
    return list(seen.values()) or None


def floor_summary(floor: FloorStage) -> NoiseFloorSummary:
    """The ``run.json`` form of the floor stage's output: tier, served and reference
    dtypes, ``measured``, the KLD figures (nats) and same-top/PPL ratio of the reference
    tier as served, and ``why`` when not measured."""
    fid = floor.fidelity.model_dump() if floor.fidelity is not None else {}
    keep = ("kld_mean", "kld_se", "kld_median", "kld_p99", "kld_max", "same_top_rate", "ppl_ratio", "n_tokens")
    return NoiseFloorSummary(tier=floor.tier, served_dtype=floor.served_dtype, reference_dtype=floor.reference_dtype,
                             measured=floor.measured, backend=floor.backend, bf16_matmul=floor.bf16_matmul,
                             why=floor.why,
                             **{k: fid.get(k) for k in keep})


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


def preflight(recipe: Recipe) -> None:
    """Checks before any work (the disk check follows once the source's size is known:
    :meth:`Runner.check_disk`).

    Raises:
        QevalInputError: a CUDA recipe on a machine without CUDA (naming both).
    """
    if recipe.device == "cuda":
        try:
            import torch  # start-up time: only a CUDA recipe needs torch here
            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            raise recipe.error(("device",), "the recipe asks for device cuda, but this machine has no CUDA "
                                            "device visible to torch (use device: auto or cpu)")
    local = model_source_path(recipe.model.source, recipe.base_dir) if recipe.model.source else None
    check_endpoints(recipe, local if local is not None and (local / "config.json").is_file() else None)


_CHECKED: set[tuple[str, bool]] = set()


def check_endpoints(recipe: Recipe, tokenizer: Path | None) -> None:
    """Every ``endpoint:`` tier's server, before any of its stages: reachable, the API key
    (from its environment variable) accepted, a model served, and, given the source
    ``tokenizer`` folder, the same token counts on the depth prompts
    (:func:`qeval.engines.openai.preflight_endpoint`). Each check runs once per process.

    Raises:
        QevalInputError: one line naming the recipe file, the tier's line and field.
    """
    from .engines.openai import EndpointError, preflight_endpoint  # start-up time: httpx
    for i, t in enumerate(recipe.tiers):
        if t.endpoint is None or (t.name, tokenizer is not None) in _CHECKED:
            continue
        try:
            preflight_endpoint(t.endpoint, tokenizer=tokenizer, depth_text=recipe.resolve_path(recipe.speed.depth_text),
                               depths=recipe.speed.depths, prompt_mode=getattr(t, "prompt_mode", None))
        except EndpointError as e:  # TokenizerMismatch is one
            field = (e.field or "endpoint").split(".")
            raise recipe.error(("tiers", i, *field), e.message) from None
        _CHECKED.add((t.name, tokenizer is not None))


LOGPROB_BYTES = 2  # reference/logprobs.npy is float16 (measure/fidelity.py ROUND)


def artifact_groups(recipe: Recipe, tiers: list[str]) -> list[str]:
    """``tiers`` less those whose artifact another listed tier already builds (same method
    and spec apart from engine settings, each spec's ``engine_fields``: ``kv_cache``,
    ``flash_attn``, ``decode`` ...)."""
    seen: set[str] = set()
    out = []
    for t in tiers:
        spec = recipe.tier(t)
        key = json.dumps({k: v for k, v in spec.model_dump(mode="json").items() if k not in spec.engine_fields},
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def disk_needs(recipe: Recipe, tiers: list[str], params: int | None, *, vocab: int | None = None,
               answer_tokens: int | None = None) -> dict[str, int]:
    """Bytes the run will write, by part: ``artifacts`` (kept: parameter count x each
    method's :meth:`~qeval.tiers.base.TierMethod.artifact_bytes_per_parameter`, one artifact
    per :func:`artifact_groups` entry), ``while quantizing`` (the largest transient folder of
    one build, the method's ``transient_dtype_copies`` of the source: gptqmodel's offload
    folder, GGUF's 16-bit intermediate; builds run one at a time per machine) and
    ``reference log-probabilities`` (float16, answer tokens x vocabulary). Unknown parameter
    count: 0 for the tier parts (no check)."""
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    parts = {"artifacts": 0, "while quantizing": 0, "reference log-probabilities": 0}
    if params:
        for t in artifact_groups(recipe, tiers):
            spec = recipe.tier(t)
            method = get_method(spec.method)
            parts["artifacts"] += int(params * method.artifact_bytes_per_parameter(spec))
            parts["while quantizing"] = max(parts["while quantizing"],
                                            int(params * dtype_bytes * method.transient_dtype_copies))
    if vocab and answer_tokens:
        parts["reference log-probabilities"] = int(answer_tokens) * int(vocab) * LOGPROB_BYTES
    return parts


def estimate_disk_bytes(recipe: Recipe, tiers: list[str], params: int | None = None) -> int:
    """Bytes the tiers' artifacts will write (kept plus the largest transient build folder,
    :func:`disk_needs` without the reference). Unknown parameter count -> 0 (no check)."""
    return sum(disk_needs(recipe, tiers, params).values())


def reference_answer_tokens(recipe: Recipe) -> int:
    """Upper bound of the rows of log-probabilities the reference pass stores: every turn of
    every suite item at its token budget (``quality._budget``: the suite's cap, the item's
    own, and ``fidelity_max_new_tokens`` past the suite's ``limit``), plus ``fidelity_tokens``
    per long_context item and depth."""
    short = recipe.quality.fidelity_max_new_tokens
    answers = sum(_budget(spec, it, i, short) * len(it.turns)
                  for spec, items in load_suites(recipe) for i, it in enumerate(items))
    return answers + sum(len(items) * len(spec.depths) * spec.fidelity_tokens
                         for spec, items in recipe_long_context(recipe))


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
