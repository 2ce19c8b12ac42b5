"""Stage drivers of the quality stages, run by :mod:`qeval.worker` beside ``stage_measure``
and ``stage_load``: the reference pass (once per run), the noise floor and each tier's
quality. They tie a run folder (:class:`qeval.results.RunLayout`), the artifact cache and
the tier methods to the answering and scoring primitives of :mod:`qeval.measure.quality`.

Reference pass (stage ``reference``): the reference tier answers every suite prompt greedily
once (in multi-turn conversations its own answers become the history). Its answer token ids
go to ``reference/segments.json`` and its full-vocabulary log-probabilities at every answer
position to ``reference/logprobs.npy`` (float16, ``[answer tokens, vocab]``), computed once
and read by every tier. It computes in ``quality.reference_dtype``
(:func:`qeval.measure.quality.resolve_reference_dtype`: float32 on CPU, the model dtype on CUDA).

Noise floor (:func:`noise_floor_pass`, stage ``floor``): the reference tier as served,
scored against the stored reference like any tier; the reference tier's quality stage
scores the same engine on the same tokens again (its review needs the per-item KLD), so
its fidelity is the floor's, and, since it no longer is the reference pass itself, it
answers the suites on its own.

Tier quality (stage ``quality``): teacher-forced fidelity on exactly the reference ids (every
item), and free-running behaviour (the first ``limit`` items of each suite) with checks,
flips, divergence and similarity against the reference. Long-context suites: the reference
pass also answers every item at every depth (``reference/long_context.json``) and stores the
log-probabilities of the last ``fidelity_tokens`` document tokens of each
(``reference/long_context_logprobs.npy``); each tier answers the same prompts and is scored
on the same document tokens, per depth (:mod:`qeval.measure.long_context`). A tier on a slow
kernel may compute quality on its weights dequantized into a dense model
(:func:`qeval.measure.quality.choose_quality_engine`); speed is always measured with the real
kernel. The tier row records which engine produced the figures.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .artifacts import get_or_build
from .engines.bf16_matmul import apply_to_engine, resolve_bf16_matmul
from .hashing import file_sha256
from .measure.behaviour import summarise_behaviour
from .measure.output_length import summarise_output_length
from .measure.fidelity import ROUND, FidelityAccumulator, note_skipped
from .measure.lmeval import run_lm_eval
from .measure.long_context import (answer_long_context, check_depths_fit, filler_files, recipe_long_context,
                                   summarise_long_context)
from .measure.quality import (answer_all, choose_quality_engine, conversations, fidelity, iter_answer_logprobs,
                              load_suites, resolve_reference_dtype, stop_token_ids)
from .measure.review import ReviewCollector
from .recipe import stable_suite_dict, stable_tier_dict
from .results import (RUN_SCOPE, AnswerRow, ReviewFile, RunLayout, Segment, atomic_write_json, read_floor_review,
                      read_segments, read_stage, stage_done, write_answers, write_segments)
from .measure.prompt_format import load_tokenizer, prompt_format_key
from .source import model_max_context
from .storage import storage_for
from .tiers import get_method


def reference_context(recipe, ctx):
    """``ctx`` with its dtype replaced by :func:`resolve_reference_dtype` (the reference
    tier loads in it for the reference pass)."""
    return dataclasses.replace(ctx, dtype=resolve_reference_dtype(recipe, ctx.device))


def reference_fields(recipe, ctx) -> dict:
    """What determines the reference pass (its cache key): source, reference tier, the
    dtype it computes in (``ctx.dtype``, from :func:`reference_context`; keyed only when it
    differs from ``model.dtype``, so a reference in the model dtype keeps the key it always
    had), every suite file and setting, the quality settings that shape answers, device,
    threads and library versions."""
    suites = [{**stable_suite_dict(s.model_dump(mode="json")), "sha256": file_sha256(recipe.resolve_path(s.path))}
              for s in recipe.suites]
    fillers = {str(p.name): file_sha256(p) for p in filler_files(recipe)}
    q = recipe.quality
    return {"kind": "reference", "source_sha256": ctx.source_sha256,
            "tier": stable_tier_dict(recipe.tier(recipe.gate.reference).model_dump(mode="json")), "suites": suites,
            **({"filler_sha256": fillers} if fillers else {}),
            # long-context answers before this fix skipped one prompt token when the scored
            # span was whole windows (engines' generate_scored): such references are not reused
            **({"long_context_prefill": 2} if recipe_long_context(recipe) else {}),
            "window": q.window, "batch_size": q.batch_size, "fidelity_max_new_tokens": q.fidelity_max_new_tokens,
            "device": ctx.device, "threads": ctx.threads,
            "versions": {p: version(p) for p in ("torch", "transformers")},
            **({"dtype": ctx.dtype} if ctx.dtype != recipe.model.dtype else {}),
            # model.chat_template: keyed only when set, so the tokenizer's own template keeps its key
            **prompt_format_key(recipe.model, recipe.base_dir),
            # keyed only when it changes the arithmetic (a bfloat16 reference as float32 matmuls),
            # so a float32 reference keeps its key
            **({"bf16_matmul": "float32"}
               if resolve_bf16_matmul(q.bf16_matmul, ctx.device, ctx.dtype) == "float32" else {})}


def reference_pass(recipe, run_dir: Path, ctx, progress: Callable[[str], None] = print,
                   fresh: bool = False) -> dict:
    """Reference answers and log-probabilities into ``run_dir/reference/``: built once per
    :func:`reference_fields` in the artifact cache (a second run of the same recipe
    reuses them; ``fresh``: built again) and linked into the run folder."""
    folder, manifest, reused = get_or_build("reference", reference_fields(recipe, ctx),
                                            lambda out: build_reference(recipe, run_dir, ctx, out, progress),
                                            log=progress, remote=storage_for(recipe), fresh=fresh)
    layout = RunLayout(run_dir)
    layout.reference_dir.mkdir(parents=True, exist_ok=True)
    for dst in (layout.reference_segments, layout.reference_logprobs, layout.reference_long_context,
                layout.reference_long_context_logprobs):
        name = dst.name
        if not (folder / name).exists():  # the long-context files exist only with such a suite
            continue
        tmp = dst.with_name(f".{name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(folder / name, tmp)  # same file system: no copy of the log-probabilities
        except OSError:
            shutil.copyfile(folder / name, tmp)
        os.replace(tmp, dst)
    progress(f"reference {'reused' if reused else 'built'}: {folder}")
    return {**manifest["info"], "reused": reused, "artifact": str(folder)}


def build_reference(recipe, run_dir: Path, ctx, out_dir: Path, progress: Callable[[str], None] = print) -> dict:
    """Run the reference tier on every suite item; write ``segments.json`` (ids, texts,
    checks) and ``logprobs.npy`` (float16 ``[answer tokens, vocab]``) into ``out_dir``; with
    a long_context suite also ``long_context.json`` (answers and checks per item and depth)
    and ``long_context_logprobs.npy`` (float16 ``[fidelity_tokens per item and depth, vocab]``).

    Raises:
        QevalInputError: a long_context depth plus its max_new_tokens exceeds the model's context.
    """
    t0 = time.time()
    check_depths_fit(recipe, model_max_context(ctx.source_path))
    ref_spec = recipe.tier(recipe.gate.reference)
    method = get_method(ref_spec.method)
    engine = method.open_engine(ref_spec, ctx, None if not method.needs_artifact else _artifact(run_dir, ref_spec.name))
    # a reference in bfloat16 computes as the tiers' quality stages do (quality.bf16_matmul), so
    # the reference tier served in the same dtype still scores 0 by construction; a float32
    # reference has no bfloat16 layer and is left as it is
    _bf16_matmul(engine, recipe, ctx)
    tok = load_tokenizer(ctx.source_path, recipe.model, recipe.base_dir)  # model.chat_template
    stop = stop_token_ids(tok, ctx.source_path)
    suites = load_suites(recipe)
    segments = answer_all(engine, tok, stop, suites, recipe.quality.batch_size, progress, limit_items=False,
                          short_budget=recipe.quality.fidelity_max_new_tokens)
    gen_s = time.time() - t0
    total = sum(len(s["answer_ids"]) for s in segments)
    mm = _logprob_file(out_dir / "logprobs.npy", total, engine.vocab_size)
    off = 0
    for s in segments:
        s["offset"] = off
        off += len(s["answer_ids"])
    groups = conversations(segments)
    for i, group in enumerate(groups):
        progress(f"reference log-probabilities: sequence {i + 1}/{len(groups)}")
        for s, j, logp in iter_answer_logprobs(engine, group, recipe.quality.window):
            mm[s["offset"] + j: s["offset"] + j + len(logp)] = logp.astype(ROUND)
    _flush(mm)
    del mm
    write_segments(out_dir / "segments.json", [Segment(**s) for s in segments])
    info = {"segments": len(segments), "answer_tokens": total, "vocab": engine.vocab_size,
            "generate_seconds": gen_s, "stop_ids": stop, "backend": engine.backend}
    lc = recipe_long_context(recipe)
    if lc:
        t1 = time.time()
        rows = sum(len(items) * len(spec.depths) * spec.fidelity_tokens for spec, items in lc)
        mm = _logprob_file(out_dir / "long_context_logprobs.npy", rows, engine.vocab_size)
        off = [0]

        def store(seg: dict, _r, scored: list) -> None:
            seg["offset"] = off[0]
            for j, logp in scored:
                mm[off[0] + j: off[0] + j + len(logp)] = logp.astype(ROUND)
            off[0] += seg["score_tokens"]

        lc_segments = answer_long_context(engine, tok, stop, lc, progress, recipe.quality.window, store)
        _flush(mm)
        del mm
        atomic_write_json(out_dir / "long_context.json", lc_segments)
        info.update({"long_context_segments": len(lc_segments), "long_context_seconds": time.time() - t1})
    info["reference_seconds"] = time.time() - t0
    return info


def _flush(mm: np.ndarray) -> None:
    if isinstance(mm, np.memmap):
        mm.flush()


def _logprob_file(path: Path, rows: int, vocab: int):
    """A float16 ``[rows, vocab]`` .npy memmap (an empty array when ``rows`` is 0, which
    cannot be memory-mapped)."""
    if rows == 0:
        np.save(path, np.zeros((0, vocab), dtype=ROUND))
        return np.zeros((0, vocab), dtype=ROUND)
    return np.lib.format.open_memmap(path, mode="w+", dtype=ROUND, shape=(rows, vocab))


def long_context_quality(engine: Any, tok: Any, recipe, layout: RunLayout, stop: list[int], is_reference: bool,
                         progress: Callable[[str], None] = lambda s: None) -> tuple[dict | None, list[dict]]:
    """Long-context recall, flips and fidelity at depth of ``engine`` against the stored
    reference (``reference/long_context.json`` and ``long_context_logprobs.npy`` of the run
    folder ``layout``).

    Returns:
        ``(summary, segments)``: :func:`~qeval.measure.long_context.summarise_long_context`
        plus ``fidelity_tokens`` and ``seconds`` (None without a long_context suite), and the
        tier's answer segments. The reference tier's answers are the reference pass itself
        and its fidelity is not rescored (KLD 0 and PPL ratio 1 by definition).
    """
    lc = recipe_long_context(recipe)
    path = layout.reference_long_context
    if not lc or not path.exists():
        return None, []
    t0 = time.time()
    ref_segments = json.loads(path.read_text())
    if is_reference:
        summary = summarise_long_context(ref_segments, None, None, recipe.quality.bootstrap)
        mine = ref_segments
    else:
        ref_lp = np.load(layout.reference_long_context_logprobs, mmap_mode="r")
        ref_by_key = {(s["item"], s["depth"]): s for s in ref_segments}
        accs: dict[int, FidelityAccumulator] = {}
        skipped: dict[int, int] = {}  # a served text-mode tier: positions without a top-k, per depth
        seen = [int(getattr(engine, "topk_skipped", 0) or 0)]

        def score(seg: dict, r, scored: list) -> None:
            now = int(getattr(engine, "topk_skipped", 0) or 0)  # the rows of this segment were just computed
            skipped[seg["depth"]] = skipped.get(seg["depth"], 0) + now - seen[0]
            seen[0] = now
            ref = ref_by_key.get((seg["item"], seg["depth"]))
            if ref is None:
                return
            if ref["prompt_sha"] != seg["prompt_sha"] or ref["score_tokens"] != seg["score_tokens"]:
                raise RuntimeError(f"{seg['item']} at depth {seg['depth']}: the rendered prompt differs from the "
                                   "reference pass's (tokenizer or suite files changed)")
            w = seg["score_tokens"]
            targets = np.asarray(r.prompt_ids[r.doc_end - w:r.doc_end], dtype=np.int64)
            acc = accs.setdefault(seg["depth"], FidelityAccumulator(topk=getattr(engine, "score_topk", None)))
            for j, logp in scored:
                m = len(logp)
                acc.add(np.asarray(ref_lp[ref["offset"] + j: ref["offset"] + j + m]), logp, targets[j:j + m],
                        np.arange(j, j + m))

        mine = answer_long_context(engine, tok, stop, lc, progress, recipe.quality.window, score)
        fid = {}
        for d, acc in accs.items():
            f = note_skipped(acc.summary(), skipped.get(d, 0))
            f.pop("kld_by_bucket", None)  # positions inside one window: no drift to show
            fid[d] = f
        summary = summarise_long_context(mine, ref_by_key, fid, recipe.quality.bootstrap)
    summary["fidelity_tokens"] = {spec.name: spec.fidelity_tokens for spec, _ in lc}
    summary["seconds"] = time.time() - t0
    return summary, mine


def noise_floor_pass(recipe, run_dir: Path, ctx, progress: Callable[[str], None] = print,
                     fresh: bool = False) -> dict:
    """The run's noise floor: the reference tier as served (``ctx.dtype``, the model dtype),
    teacher-forced on the stored reference tokens and scored against the stored reference
    (computed in :func:`resolve_reference_dtype`) exactly as every tier is
    (:func:`fidelity`). It is what the same weights differ by through compute precision
    alone, so a tier's KLD near it is not a measured effect of quantization.

    When the reference pass ran in the served dtype the pass would compare a computation
    with itself: the floor is not measured (``measured`` False, no figures) and the
    reference tier's KLD is 0 by construction.

    The pass also collects the reference tier's review (per-item KLD, worst positions) into
    ``reference/floor_review.json``, so that tier's quality stage does not score the same
    tokens again, and is cached under :func:`floor_fields` (``fresh``: computed again).

    Returns:
        ``{"tier", "served_dtype", "reference_dtype", "measured", "fidelity" (the
        :meth:`FidelityAccumulator.summary` dict or None), "backend", "why", "reused"}``.
    """
    ref_name = recipe.gate.reference
    spec = recipe.tier(ref_name)
    ref_dtype = resolve_reference_dtype(recipe, ctx.device)
    out = {"tier": ref_name, "served_dtype": ctx.dtype, "reference_dtype": ref_dtype}
    if ref_dtype == ctx.dtype:
        return {**out, "measured": False, "fidelity": None, "backend": None,
                "why": f"the reference pass computes in the served dtype ({ctx.dtype}), so the reference tier "
                       f"scores 0 by construction; set quality.reference_dtype: float32 to measure the floor"}
    layout = RunLayout(run_dir)

    def build(folder: Path) -> dict:
        from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes
        method = get_method(spec.method)
        engine = method.open_engine(spec, ctx, _artifact(run_dir, ref_name) if method.needs_artifact else None)
        matmul, backend = _bf16_matmul(engine, recipe, ctx)
        progress(f"noise floor: {ref_name} served in {ctx.dtype} against the {ref_dtype} reference "
                 f"({backend})")
        segments = [s.model_dump() for s in read_segments(layout)]  # the primitives' segment dicts
        ref_lp = np.load(layout.reference_logprobs, mmap_mode="r")
        t0 = time.time()
        review = ReviewCollector()
        fid = fidelity(engine, segments, ref_lp, recipe.quality.window, progress, review)
        engine.close()
        tok = AutoTokenizer.from_pretrained(ctx.source_path)
        atomic_write_json(folder / "review.json", ReviewFile(tier=ref_name, **review.result(
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            lambda i: tok.decode([i], skip_special_tokens=False))))
        return {**out, "measured": True, "fidelity": fid, "backend": backend, "bf16_matmul": matmul,
                "seconds": time.time() - t0, "why": None}

    fields = floor_fields(recipe, layout, ctx)
    if fields is None:
        d = Path(tempfile.mkdtemp(prefix="qeval-floor-"))
        try:
            got = build(d)
            _copy_into(d / "review.json", layout.floor_review)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return {**got, "reused": False}
    folder, manifest, reused = get_or_build("floor", fields, build, log=progress, remote=storage_for(recipe),
                                            fresh=fresh)
    _copy_into(folder / "review.json", layout.floor_review)
    if reused:
        progress(f"noise floor reused: {folder.name} (same content key; qeval run --fresh recomputes)")
    return {**json.loads(json.dumps(manifest["info"])), "reused": reused}


def floor_fields(recipe, layout: RunLayout, ctx) -> dict | None:
    """The content key of the noise floor: the reference pass's key, the reference tier's
    spec, the quality window, device, threads, library versions and qeval's code hash
    (None without a finished reference stage)."""
    if not stage_done(layout, RUN_SCOPE, "reference"):
        return None
    ref_key = Path(str(getattr(read_stage(layout, RUN_SCOPE, "reference"), "artifact", "") or "")).name
    if not ref_key:
        return None
    return {"kind": "floor", "reference": ref_key, "served_dtype": ctx.dtype,
            "bf16_matmul": resolve_bf16_matmul(recipe.quality.bf16_matmul, ctx.device, ctx.dtype),
            "tier": stable_tier_dict(recipe.tier(recipe.gate.reference).model_dump(mode="json")),
            "window": recipe.quality.window, "device": ctx.device, "threads": ctx.threads,
            "stage_threads": os.environ.get("QEVAL_STAGE_THREADS"),
            "versions": {p: _package_version(p) for p in QUALITY_KEY_PACKAGES}, "qeval_code": qeval_code_sha256()}


def _bf16_matmul(engine: Any, recipe, ctx) -> tuple[str, str]:
    """Apply ``quality.bf16_matmul`` to a quality stage's engine
    (:func:`qeval.engines.bf16_matmul.apply_to_engine`): ``(as applied, backend label)``,
    the label naming float32 matmuls when they are used."""
    matmul, n = apply_to_engine(engine, recipe.quality.bf16_matmul, ctx.device, ctx.dtype)
    label = engine.backend if matmul == "native" else f"{engine.backend}, {n} linear layers as float32 matmuls"
    return matmul, label


def _copy_into(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` atomically (a temporary sibling renamed into place)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _floor(run_dir: Path) -> Any:
    """The run's floor stage (:class:`qeval.results.FloorStage`), None when it did not run."""
    layout = RunLayout(run_dir)
    return read_stage(layout, RUN_SCOPE, "floor") if stage_done(layout, RUN_SCOPE, "floor") else None


def _artifact(run_dir: Path, tier: str) -> Path | None:
    """The tier's prepared artifact folder (None: not prepared, or served from the source)."""
    layout = RunLayout(run_dir)
    if stage_done(layout, tier, "prepare"):
        a = read_stage(layout, tier, "prepare").artifact
        return Path(a) if a else None
    return None


#: Packages whose versions are part of a quality result's content key (:func:`quality_fields`).
QUALITY_KEY_PACKAGES = ("torch", "transformers", "torchao", "gptqmodel", "llama-cpp-python", "gguf", "hqq",
                        "lm-eval", "numpy", "tokenizers")


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except Exception:  # PackageNotFoundError: an optional extra not installed
        return None


def qeval_code_sha256() -> str:
    """SHA-256 over qeval's own Python sources (sorted relative paths and bytes): a quality
    result computed by other qeval code is not reused (its version string does not move
    with every change)."""
    root = Path(__file__).resolve().parent  # the qeval package folder
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def quality_engine_choice(recipe, layout: RunLayout, tier: str) -> str:
    """``real`` or ``dequantized``: what :func:`choose_quality_engine` asks for this tier,
    given its measured decode tokens/s at the main depth (when measured)."""
    spec = recipe.tier(tier)
    measured = None
    if stage_done(layout, tier, "measure"):
        point = read_stage(layout, tier, "measure").speed.get(str(recipe.speed.main_depth))
        measured = point.decode_tokens_per_s if point is not None else None
    return choose_quality_engine(recipe, spec, measured, get_method(spec.method).has_dequantized)


def quality_fields(recipe, layout: RunLayout, tier: str, ctx, which: str) -> dict | None:
    """The content key of a tier's quality result (issue 18: warm runs reuse what cannot
    have changed): the reference pass's own key (source, reference tier, suites and their
    file hashes, quality settings, reference dtype), the tier's spec and artifact key, the
    quality engine asked for (``which``), the lm-eval task files and limit, device, stage
    threads, library versions and qeval's code hash.

    Returns None when the result cannot be keyed: a tier behind an ``endpoint:`` URL (the
    server may change under the same URL), or no finished reference stage."""
    spec = recipe.tier(tier)
    if getattr(spec, "endpoint", None) is not None or not stage_done(layout, RUN_SCOPE, "reference"):
        return None
    ref = read_stage(layout, RUN_SCOPE, "reference")
    ref_key = Path(str(getattr(ref, "artifact", "") or "")).name
    if not ref_key:
        return None
    prep = read_stage(layout, tier, "prepare") if stage_done(layout, tier, "prepare") else None
    tasks = {}
    for p in recipe.quality.lm_eval_tasks or []:
        path = recipe.resolve_path(p)
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        tasks[str(p)] = {str(f.relative_to(path) if path.is_dir() else f.name): file_sha256(f) for f in files}
    q = recipe.quality
    return {"kind": "quality", "reference": ref_key, "tier": stable_tier_dict(spec.model_dump(mode="json")),
            "artifact": getattr(prep, "key", None) if prep is not None else None,
            "source_sha256": ctx.source_sha256, "engine": which,
            "bf16_matmul": resolve_bf16_matmul(q.bf16_matmul, ctx.device, ctx.dtype),
            "window": q.window, "batch_size": q.batch_size, "fidelity_max_new_tokens": q.fidelity_max_new_tokens,
            "bootstrap": q.bootstrap, "lm_eval": tasks, "lm_eval_limit": q.lm_eval_limit,
            "reference_is_tier": tier == recipe.gate.reference,
            "device": ctx.device, "threads": ctx.threads, "stage_threads": os.environ.get("QEVAL_STAGE_THREADS"),
            "versions": {p: _package_version(p) for p in QUALITY_KEY_PACKAGES},
            "qeval_code": qeval_code_sha256()}


def tier_quality(recipe, run_dir: Path, tier: str, ctx, progress: Callable[[str], None] = print,
                 fresh: bool = False) -> dict:
    """Quality of one tier against the stored reference: ``{"quality": {...}}``.

    The result, its answers and its review are kept in the artifact cache under
    :func:`quality_fields` (kind ``quality``); a later run with the same content key reuses
    them (``quality.reused`` True, ``quality.content_key`` the key) instead of scoring
    again. ``fresh`` (``qeval run --fresh``) recomputes and replaces the cached copy.
    Speed, memory and load are never reused."""
    layout = RunLayout(run_dir)
    which = quality_engine_choice(recipe, layout, tier)
    fields = quality_fields(recipe, layout, tier, ctx, which)
    if fields is None:
        out = _tier_quality(recipe, run_dir, tier, ctx, which, progress)
        out["quality"].update(reused=False, content_key=None)
        return out
    kept = (("answers.json", layout.answers(tier)), ("review.json", layout.review(tier)))

    def build(folder: Path) -> dict:
        got = _tier_quality(recipe, run_dir, tier, ctx, which, progress)
        for name, path in kept:
            shutil.copyfile(path, folder / name)
        return got

    folder, manifest, reused = get_or_build("quality", fields, build, log=progress, remote=storage_for(recipe),
                                            fresh=fresh)
    if reused:
        for name, path in kept:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            shutil.copyfile(folder / name, tmp)
            os.replace(tmp, path)
        progress(f"quality reused: {folder.name} (same content key; qeval run --fresh recomputes)")
    out = json.loads(json.dumps(manifest["info"]))
    out["quality"].update(reused=reused, content_key=manifest["key"])
    return out


def _tier_quality(recipe, run_dir: Path, tier: str, ctx, which: str, progress: Callable[[str], None]) -> dict:
    """Score and answer: the body of :func:`tier_quality` (``which``: the engine asked for)."""
    spec = recipe.tier(tier)
    method = get_method(spec.method)
    artifact = _artifact(run_dir, tier)
    layout = RunLayout(run_dir)
    engine = None
    if which == "dequantized":
        engine = method.load_dequantized(spec, ctx, artifact)
        if engine is None:
            which = "real"
    if engine is None:
        engine = method.open_engine(spec, ctx, artifact)
    if not engine.capabilities.score:
        raise RuntimeError(f"the {engine.name} engine cannot score tokens: fidelity needs teacher-forced "
                           "log-probabilities")
    matmul, backend = _bf16_matmul(engine, recipe, ctx)
    progress(f"quality on the {which} engine ({backend})")
    tok = load_tokenizer(ctx.source_path, recipe.model, recipe.base_dir)  # model.chat_template
    segments = [s.model_dump() for s in read_segments(layout)]  # the primitives' segment dicts
    ref_lp = np.load(layout.reference_logprobs, mmap_mode="r")
    floor = _floor(run_dir) if tier == recipe.gate.reference else None
    t0 = time.time()
    review = ReviewCollector()
    floor_review = read_floor_review(layout) if floor is not None and floor.measured and floor.fidelity is not None \
        else None
    if floor_review is not None:
        # the reference tier's figures are the noise floor's: the floor stage scored the same
        # engine on the same tokens and kept the review; not scored twice
        progress("fidelity: the noise floor's scoring of this tier (same engine, same tokens)")
        fid = floor.fidelity.model_dump()
    elif getattr(engine, "fidelity_note", None):  # a chat-mode endpoint, a text one without top-k by id
        progress(engine.fidelity_note)
        fid = {"n_tokens": 0, "not_measured": engine.fidelity_note}
    else:
        fid = fidelity(engine, segments, ref_lp, recipe.quality.window, progress, review)
        # a served text-mode tier: positions the server gave no top-k for were skipped, counted here
        fid = note_skipped(fid, int(getattr(engine, "topk_skipped", 0) or 0))
    fid_s = time.time() - t0
    ref_by_key = {(s["item"], s["turn"]): s for s in segments}
    stop = (read_stage(layout, RUN_SCOPE, "reference").stop_ids if stage_done(layout, RUN_SCOPE, "reference")
            else None) or stop_token_ids(tok, ctx.source_path)
    t0 = time.time()
    if tier == recipe.gate.reference and not (floor is not None and floor.measured):
        # the reference's free-running answers are the reference pass itself
        limited = set()
        for spec_s in recipe.suites:
            items = [s for s in segments if s["suite"] == spec_s.name]
            ids = list(dict.fromkeys(s["item"] for s in items))
            limited.update(ids[: spec_s.limit] if spec_s.limit else ids)
        mine = [s for s in segments if s["item"] in limited]
    else:
        mine = answer_all(engine, tok, stop, load_suites(recipe), recipe.quality.batch_size, progress,
                          limit_items=True)
    beh = summarise_behaviour(mine, ref_by_key, recipe.quality.bootstrap)
    out_len = summarise_output_length(mine, ref_by_key,
                                      lambda text: len(tok(text, add_special_tokens=False)["input_ids"]))
    beh_s = time.time() - t0
    long_context, lc_mine = long_context_quality(engine, tok, recipe, layout, stop, tier == recipe.gate.reference,
                                                 progress)
    lm_eval = None
    if recipe.quality.lm_eval_tasks:
        progress("lm-eval tasks")
        lm_eval = run_lm_eval(engine, tok, [recipe.resolve_path(p) for p in recipe.quality.lm_eval_tasks],
                              layout.lm_eval_tasks(tier), recipe.quality.lm_eval_limit)
    prompts = {(f"{sp.name}/{it.id}", t): (it.system, turn.user)
               for sp, items in load_suites(recipe) for it in items for t, turn in enumerate(it.turns)}
    write_answers(layout, tier, [
        AnswerRow(item=s["item"], turn=s["turn"], text=s["text"], finished=s["finished"], checks=s["checks"],
                  check_details=s["check_details"], system=prompts.get((s["item"], s["turn"]), (None, None))[0],
                  prompt=prompts.get((s["item"], s["turn"]), (None, None))[1]) for s in mine]
        + [AnswerRow(item=s["item"], depth=s["depth"], text=s["text"], finished=s["finished"], checks=s["checks"],
                     check_details=s["check_details"]) for s in lc_mine])
    if floor_review is not None:
        atomic_write_json(layout.review(tier), floor_review)
    else:
        atomic_write_json(layout.review(tier), ReviewFile(tier=tier, **review.result(
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            lambda i: tok.decode([i], skip_special_tokens=False))))
    return {"quality": {"engine": which, "backend": backend, "bf16_matmul": matmul, "fidelity": fid,
                        "behaviour": beh, "output_length": out_len,
                        "fidelity_seconds": fid_s, "behaviour_seconds": beh_s, "lm_eval": lm_eval,
                        "long_context": long_context,
                        "reference_dtype": resolve_reference_dtype(recipe, ctx.device),
                        "noise_floor": bool(tier == recipe.gate.reference and floor is not None and floor.measured)}}
