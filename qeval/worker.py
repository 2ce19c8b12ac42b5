"""Stage worker: runs one stage of one tier in its own process.

``python -m qeval.worker STAGE RUN_DIR [TIER]``

Stages: ``source`` (resolve/convert the BF16 checkpoint), ``env`` (memory bandwidth,
hardware), ``reference`` (BF16 answers to every suite prompt, in ``quality.reference_dtype``),
``floor`` (the reference tier as served scored against the reference: the noise floor), and
per tier ``prepare`` (build or reuse the artifact), ``measure`` (memory and speed in a fresh
process), ``load`` (the concurrency sweep, in its own fresh process; engines that can batch) and
``quality`` (fidelity and behaviour); run-wide again at the end, ``speculative`` (the recipe's
target + draft pairs, :mod:`qeval.speculative_stage`). Each writes ``stages/<tier>.<stage>.json``
atomically when it succeeds; an exception writes ``stages/<tier>.<stage>.error.json``
(:func:`qeval.failures.describe_exception`: type, message, the raising frame and, for an assertion, its
failed condition) and exits 1. The parent (:mod:`qeval.run`) reads them.

Tests inject faults at named points of a stage (:func:`inject_fault`, environment variables
never set in normal use): ``start`` (before the stage's work), ``mid`` (its work done, its
file not yet written) and ``write`` (its file half-written to a temporary sibling that is
never renamed).
"""
from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from .artifacts import get_or_build
from .calibration import calibration_fields, load_calibration_texts
from .engines import get_engine
from .engines.hf import pick_device
from .errors import QevalInputError, TierUnavailable
from .failures import describe_exception
from .measure.bandwidth import measure_bandwidth, probe_size_bytes
from .measure.memory import hwm_bytes, peak_breakdown, PeakMemory, release_freed_memory, rss_bytes
from .measure.nvml import NvmlMemory, PairedPeak
from .serving.core import can_serve
from .serving.workload import ServingContext, run_workloads
from .measure.speed import add_roofline, depth_prompt_ids, kv_bytes_per_token_from_sweep, speed_sweep
from .quality_stages import noise_floor_pass, reference_context, reference_pass, tier_quality
from .recipe import Recipe, validation_error
from .results import (RUN_SCOPE, RunLayout, StageError, atomic_write_json, json_text, read_run_info, read_stage,
                      write_stage, write_stage_error)
from .source import model_max_context, resolve_source
from .stage_keys import FRESH_ENV, load_fingerprint
from .storage import OPTIONS_ENV, publish_source, storage_for
from .tiers import get_method
from .tiers.base import TierContext


_stage_t0: float | None = None  # set by main(): progress lines say the seconds since the stage began


def _progress(msg: str) -> None:
    """One ``[qeval] msg`` line in the stage's log (the run's terminal shows the last one),
    with the seconds since the stage began (where each part of a stage spends its time)."""
    at = f"  [+{time.time() - _stage_t0:.1f} s]" if _stage_t0 is not None else ""
    print(f"[qeval] {msg}{at}", flush=True)


def load_recipe_from_run(run_dir: Path):
    """The resolved :class:`~qeval.recipe.Recipe` stored in ``run.json``, and the
    :class:`~qeval.results.RunInfo`; its relative paths start at the recipe's folder
    recorded there (``recipe_dir``).

    Raises:
        QevalInputError: ``run.json`` is not bounded JSON of the right shape, or its recipe
            does not validate (one line naming ``run.json`` and the field).
    """
    layout = RunLayout(run_dir)
    run = read_run_info(layout)
    rd = dict(run.recipe)
    if os.environ.get(OPTIONS_ENV):  # the real storage options (run.json's are redacted)
        rd["storage_options"] = json.loads(os.environ[OPTIONS_ENV])
    try:
        r = Recipe.model_validate(rd)
    except ValidationError as e:
        raise validation_error(e, rd, file=layout.run_json, prefix=("recipe",)) from None
    r._path = Path(run.recipe_path or "recipe.yaml")
    if run.recipe_dir:
        r._base = Path(run.recipe_dir)
    return r, run


def pin_threads(threads: int) -> None:
    """Pin torch intra-op and inter-op threads (OMP_NUM_THREADS is set by the parent).
    Untimed stages get their count from OMP_NUM_THREADS (see ``qeval.run.stage_threads``)."""
    import torch  # start-up time: torch loads only in stage processes
    threads = int(os.environ.get("QEVAL_STAGE_THREADS") or threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def tier_context(recipe, run_dir: Path, device: str):
    """The :class:`~qeval.tiers.base.TierContext` of this run (source from the source stage; threads from QEVAL_STAGE_THREADS or the recipe)."""
    src = read_stage(RunLayout(run_dir), RUN_SCOPE, "source")

    def calib() -> list[str]:
        return load_calibration_texts(recipe)

    threads = int(os.environ.get("QEVAL_STAGE_THREADS") or recipe.threads)
    return TierContext(source_path=src.path, source_sha256=src.sha256, device=device,
                       dtype=recipe.model.dtype, threads=threads, calibration=calib,
                       calibration_fields=calibration_fields(recipe), log=_progress,
                       trust_remote_code=recipe.model.trust_remote_code, run_dir=str(run_dir),
                       depth_text=str(recipe.resolve_path(recipe.speed.depth_text)),
                       depths=tuple(recipe.speed.depths), served_tokens=served_tokens(recipe, src.max_context))


def served_tokens(recipe, max_context: int | None) -> dict:
    """What a served tier's server must hold (tokens): ``sequence``, the deepest speed
    prompt plus its decode and at least 2048 for the suites' conversations (at most the
    model's context); ``load_sequence``, one load request (0 without a load stage);
    ``model``, the model's context. The load request is the longest of the load depth, the
    grid's depths (``load.depths``) and the long interference prompt."""
    n = max(max(recipe.speed.depths) + recipe.speed.decode_tokens + 1, 2048)
    ld = recipe.load
    deepest = max([recipe.load_depth, *(ld.depths or []), *([ld.interference.prompt_tokens] if ld.interference else [])])
    load = deepest + ld.output_tokens + 1 if ld.enabled else 0
    return {"sequence": min(n, max_context) if max_context else n, "load_sequence": load, "model": max_context}


# ---- stages -----------------------------------------------------------------------------

def stage_source(recipe, run_dir: Path, tier: str | None) -> dict:
    """Resolve (convert once, then reuse) the BF16 source checkpoint; adds its max context (tokens)."""
    _progress("resolving source checkpoint")
    src = resolve_source(recipe.model, convert=True, base=recipe.base_dir)
    out = src.to_dict()
    out["max_context"] = model_max_context(src.path)
    remote = storage_for(recipe)
    if remote is not None:  # nodes without a shared mount fetch the exact checkpoint from the store
        _progress(f"uploading the source checkpoint to {remote.url} (once per checkpoint)")
        out["storage_rel"] = publish_source(remote, src.path, src.sha256)
    return out


def stage_env(recipe, run_dir: Path, tier: str | None) -> dict:
    """Device, GPU name and memory (bytes), and the memory bandwidth (bytes/s) for the roofline."""
    import torch  # start-up time: torch loads only in stage processes
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    size = probe_size_bytes(device)
    _progress(f"measuring memory bandwidth on {device} ({size / 2**30:.2f} GiB buffers)")
    bw = measure_bandwidth(device, size)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    return {"device": device, "bandwidth_bytes_per_s": bw, "bandwidth_probe_bytes": size, "gpu": gpu,
            "gpu_memory_bytes": gpu_mem, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "llama_cpu": _llama_cpu_choice(recipe)}


def _llama_cpu_choice(recipe) -> dict | None:
    """Before the first GGUF stage: llama.cpp's CPU variant chosen by running each candidate
    in a child process (:func:`qeval.engines.ggml_cpu.run_probes`, verdicts cached per
    machine), so no stage of a tier loads a variant that traps. None when no tier runs on
    llama.cpp or llama-cpp-python is not installed (the tier says so itself)."""
    import importlib.util  # start-up time: only runs with GGUF tiers need it
    if not any(getattr(get_method(t.method), "default_engine", None) == "llamacpp"
               or getattr(t, "engine", None) == "llamacpp" for t in recipe.tiers):
        return None
    spec = importlib.util.find_spec("llama_cpp")  # located, not imported: the probes run in children
    if spec is None or spec.origin is None:
        return None
    from .engines import ggml_cpu  # start-up time: ctypes and the variant table, GGUF runs only
    here = Path(spec.origin).resolve().parent
    mods = ggml_cpu.variant_modules(ggml_cpu.lib_dirs(here))
    if not mods:
        return {"variant": "built-in", "passed_over": [], "probes": []}
    _progress("probing llama.cpp's CPU variants (each in a child process, best first)")
    forced = os.environ.get(ggml_cpu.VARIANT_ENV) or None
    try:
        sel, _ = ggml_cpu.select_variant(here)
    except RuntimeError as e:  # the GGUF tiers will fail with the same reason; the run goes on
        return {"variant": None, "error": str(e), "passed_over": [], "probes": [], "forced": forced}
    for line in sel.passed_over():
        _progress(f"llama.cpp CPU variant {sel.variant}: passed over {line}")
    return {"variant": sel.variant, "passed_over": sel.passed_over(), "probes": sel.probes,
            "candidates": sel.candidates, "amx_granted": sel.amx_granted, "forced": forced}


def stage_prepare(recipe, run_dir: Path, tier: str) -> dict:
    """Check the tier against the model, then build or reuse its artifact (quantization time in s, peak bytes)."""
    spec = recipe.tier(tier)
    method = get_method(spec.method)
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    ctx = tier_context(recipe, run_dir, device)
    resolved = method.check(spec, ctx)
    if not method.needs_artifact:
        return {"artifact": None, "reused": True, "resolved": resolved, "info": {}}
    fields = method.artifact_fields(spec, ctx)  # the spec's fields and the builder code's hash
    fields["resolved"] = resolved
    base = rss_bytes() or 0

    def build(out: Path) -> dict:
        _progress(f"quantizing {tier} ({spec.method})")
        t0 = time.time()
        info = method.prepare(spec, ctx, out)
        info.setdefault("quant_seconds", time.time() - t0)
        h = hwm_bytes()
        info.setdefault("quant_peak_bytes", (h - base) if h else None)
        return info

    folder, manifest, reused = get_or_build(spec.method, fields, build, log=_progress, remote=storage_for(recipe))
    _progress(f"artifact {'reused' if reused else 'built'}: {folder}")
    return {"artifact": str(folder), "key": manifest["key"], "reused": reused, "resolved": resolved,
            "info": manifest.get("info", {})}


def _peak_counters(memory_counter: str, device: str, baseline: int | None):
    """The peak-memory counter of a tier, created *before* its model loads (so no baseline
    holds weights): ``(counter, notes)``.

    ``memory_counter`` is the engine's :attr:`~qeval.engines.base.Capabilities.memory_counter`.
    CPU: VmHWM less ``baseline``. CUDA, an engine in torch (transformers):
    ``torch.cuda.max_memory_allocated`` with NVML's per-process figure beside it when NVML is
    there (``notes["nvml"]`` says why not otherwise). CUDA, an engine outside torch
    (llama.cpp): NVML only; without it the tier stops (:class:`~qeval.errors.TierUnavailable`,
    saying what to install).
    """
    if memory_counter == "server":  # replaced by the engine's own counter once its server runs
        return PeakMemory("cpu", baseline), {}
    if device != "cuda":
        return PeakMemory(device, baseline), {}
    if memory_counter != "torch":
        return PeakMemory("nvml"), {}
    try:
        return PairedPeak(PeakMemory("cuda"), NvmlMemory()), {}
    except TierUnavailable as e:
        return PeakMemory("cuda"), {"nvml": str(e)}


def decode_tokens_for(spec, engine, decode_tokens: int) -> int:
    """Tokens each timed decode makes: the recipe's ``speed.decode_tokens``, raised for a
    quantized KV cache that re-quantizes every ``residual_length`` tokens (transformers'
    ``QuantizedCache``, HQQ) to whole periods plus one (``k * residual_length + 1``), so the
    decode figure carries its periodic re-quantization at its real rate."""
    period = engine.kv_requant_period
    if not period:
        return decode_tokens
    k = max(1, -(-(decode_tokens - 1) // period))
    return k * period + 1


def stage_measure(recipe, run_dir: Path, tier: str) -> dict:
    """In a fresh process: the tier's runtime imported and warmed, the memory baseline, the
    artifact loaded; then weight bytes, KV bytes/token, peak memory at every depth (bytes,
    split into weights, KV cache and the rest), TTFT (s), decode tokens/s, and the
    attention path and KV cache type that ran.

    Baseline rule (CPU): the RSS once the prompts are tokenized and the tier's engine
    libraries are imported and warmed (:meth:`~qeval.tiers.base.TierMethod.prepare_runtime`),
    before the model loads; ``memory.runtime_bytes`` reports that resident size on its own
    and ``memory.runtime_engine_bytes`` the part the tier's engine libraries added. The
    peak counters (:func:`_peak_counters`) are created after it, before the load.
    """
    from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes

    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    spec = recipe.tier(tier)
    method = get_method(spec.method)
    ctx = tier_context(recipe, run_dir, device)
    layout = RunLayout(run_dir)
    prep = read_stage(layout, tier, "prepare")
    artifact = Path(prep.artifact) if prep.artifact else None
    tok = AutoTokenizer.from_pretrained(ctx.source_path)  # the harness's inputs, before the baseline
    text = recipe.resolve_path(recipe.speed.depth_text)
    prompts = {d: depth_prompt_ids(tok, text, d) for d in recipe.speed.depths}
    release_freed_memory()  # the harness and the runtime figures count live memory alike
    harness = rss_bytes()
    engine_name = method.engine_name(spec)
    _progress(f"warming the {engine_name} runtime of {tier}")
    runtime = method.prepare_runtime(spec, ctx, artifact)  # libraries warmed; gptqmodel's CUDA kernels built
    release_freed_memory()  # the baseline counts live memory, as each reset does (qeval.measure.memory)
    runtime_bytes = rss_bytes()
    baseline = runtime_bytes if device == "cpu" else None  # after the runtime, before the model
    counter = get_engine(engine_name).capabilities.memory_counter  # before the model loads
    peak, mem_notes = _peak_counters(counter, device, baseline)
    peak.reset()
    _progress(f"loading {tier}")
    t0 = time.time()
    engine = method.open_engine(spec, ctx, artifact)
    load_s = time.time() - t0
    if counter == "server":  # the model lives in the server: its counter, started before the server, over its tree
        peak = engine.peak_counter()
    if engine.device != device:  # never measure one device and label it another
        raise TierUnavailable(f"tier {tier} asked for {device} but its engine ({engine.backend}) runs on "
                              f"{engine.device}")
    if not engine.capabilities.generate:
        raise RuntimeError(f"the {engine.name} engine cannot generate: the speed sweep needs timed decoding")
    after_load = peak.read()
    quant = method.stored_info(spec, ctx, artifact) if counter == "server" else \
        method.quant_info(spec, ctx, artifact, engine)  # a served model is not in this process: its files
    weight_bytes = quant.get("stored_bytes")
    bw = read_stage(layout, RUN_SCOPE, "env").bandwidth_bytes_per_s
    n_decode = decode_tokens_for(spec, engine, recipe.speed.decode_tokens)
    maxctx = read_stage(layout, RUN_SCOPE, "source").max_context
    if n_decode != recipe.speed.decode_tokens and maxctx and max(prompts) + n_decode > maxctx:
        n_decode = recipe.speed.decode_tokens  # the deepest depth leaves no room for a whole period
        engine.decode_note = (f"decode over {n_decode} tokens, fewer than the int8 KV cache's re-quantization "
                              f"period of {engine.kv_requant_period}: the figure leaves re-quantization out")
    speed, peaks, kv, extra = speed_sweep(engine, prompts, decode_tokens=n_decode,
                                          repeats=recipe.speed.repeats, warmup=recipe.speed.warmup, peak=peak,
                                          prefill_repeats=recipe.speed.prefill_repeats,
                                          warmup_tokens=recipe.speed.decode_tokens, progress=_progress)
    kv_alloc = {d: e["kv_allocated_bytes"] for d, e in extra.items()}
    kvpt = kv_bytes_per_token_from_sweep(kv, n_decode)
    add_roofline(speed, bw, weight_bytes, kvpt)
    reserved = {d: e["reserved_unallocated_bytes"] for d, e in extra.items()}
    memory = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kvpt, "kv_bytes_at_depth": kv,
              "kv_allocated_bytes_at_depth": kv_alloc, "peak_bytes": peaks,
              "peak_breakdown": {d: peak_breakdown(p, weight_bytes, kv_alloc.get(d)) for d, p in peaks.items()},
              "after_load_bytes": after_load, "baseline_bytes": baseline,
              "runtime_bytes": runtime_bytes,
              "runtime_engine_bytes": (runtime_bytes - harness) if runtime_bytes and harness else None,
              "runtime_libraries": runtime.get("libraries"),
              "reserved_unallocated_bytes": reserved if any(v is not None for v in reserved.values()) else None,
              "kind": peak.kind, **mem_notes}
    second = getattr(peak, "secondary", None)
    if second is not None:  # NVML beside torch's counter: [after load, then one per depth]
        reads = peak.secondary_reads
        memory.update({"nvml_kind": second.kind, "nvml_after_load_bytes": reads[0] if reads else None,
                       "nvml_peak_bytes": dict(zip([str(d) for d in sorted(prompts)], reads[1:]))})
    for c in (getattr(peak, "primary", peak), second):
        if c is not None:
            c.close()
    attention = engine.attention_info(prompts[min(prompts)][:64])  # the Engine interface: every engine has it
    if counter == "server":
        engine.close()  # stop and reap the tier's server now, not at interpreter exit
    return {
        "engine": engine.name, "backend": engine.backend, "device": device, "threads": recipe.threads,
        "kv_cache": spec.kv_cache, "flash_attn": attention.get("flash_attn"),
        "kv_cache_dtype": attention.get("kv_cache_dtype"), "attention": attention,
        "decode_mode": engine.decode_mode, "decode_note": engine.decode_note,
        "decode_check": getattr(engine, "decode_check", None),  # transformers' static decode only
        "dtype_emulated": getattr(engine, "dtype_emulated", None),  # transformers on a CPU without the dtype's ISA
        "sampling": engine.sampling,
        "decode_tokens": n_decode,
        "open_seconds": load_s, "runtime": runtime,
        "served": engine.served_info() if hasattr(engine, "served_info") else None,
        "quant": quant,
        "memory": memory,
        "speed": speed,
    }


def kv_budget_bytes(recipe, env, device: str, held_bytes: int | None) -> tuple[float, str]:
    """Bytes the KV cache may take under load: the memory budget (``load.memory_budget_gib``,
    else the GPU's memory from the env stage, else this machine's physical memory) less what
    the loaded engine already holds (``held_bytes``). Returns ``(bytes, where the budget came from)``."""
    if recipe.load.memory_budget_gib:
        budget, src = recipe.load.memory_budget_gib * 2**30, "load.memory_budget_gib"
    elif device == "cuda" and env.gpu_memory_bytes:
        budget, src = float(env.gpu_memory_bytes), "the GPU's memory"
    else:
        budget = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # MemTotal
        src = "this machine's physical memory"
    return budget - (held_bytes or 0), src


def stage_load(recipe, run_dir: Path, tier: str) -> dict:
    """In a fresh process: load the artifact and run the serving workloads of
    :mod:`qeval.serving` on its engine core (:func:`qeval.serving.workload.run_workloads`, each
    reading its own field of the typed ``recipe.load``): the concurrency sweep (closed loop) at
    the load depth, then the grid (``load.depths``), the shared prefix
    (``load.shared_prefix_tokens``), the long prompt landing mid-decode (``load.interference``),
    a burst (``load.burst``) and the open loop (``load.arrivals``); per point TTFT/ITL/e2e
    percentiles (s), decode tokens/s, peak memory and KV bytes, users at SLO, goodput
    (:mod:`qeval.measure.load`, :mod:`qeval.measure.openloop`)."""
    from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes

    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    spec = recipe.tier(tier)
    method = get_method(spec.method)
    ctx = tier_context(recipe, run_dir, device)
    ld = recipe.load
    if ld.shared_prefix_tokens and ld.prefix_cache != "off":  # vLLM: prefix caching on in this stage's server
        ctx.prefix_caching = True
    layout = RunLayout(run_dir)
    prep = read_stage(layout, tier, "prepare")
    meas = read_stage(layout, tier, "measure")
    artifact = Path(prep.artifact) if prep.artifact else None
    method.prepare_runtime(spec, ctx, artifact)  # the measure stage's baseline rule: runtime in, model out
    baseline = rss_bytes() if device == "cpu" else None
    _progress(f"loading {tier} for the load sweep")
    engine = method.open_engine(spec, ctx, artifact)
    if not can_serve(engine):
        return {"load": None, "skipped": f"engine {engine.name} cannot batch",
                "load_fingerprint": load_fingerprint(recipe.model_dump(mode="json"))}
    engine_device = getattr(engine, "device", device)
    kind = engine_device if engine_device != "cuda" else \
        ("cuda" if engine.capabilities.memory_counter == "torch" else "nvml")
    peak = engine.peak_counter() if engine.capabilities.memory_counter == "server" else PeakMemory(kind, baseline)
    held = peak.read()
    env = read_stage(layout, RUN_SCOPE, "env")
    budget, budget_src = kv_budget_bytes(recipe, env, engine_device, held)
    src = read_stage(layout, RUN_SCOPE, "source")
    depth = recipe.load_depth
    tok = AutoTokenizer.from_pretrained(ctx.source_path)
    base = depth_prompt_ids(tok, recipe.resolve_path(recipe.speed.depth_text), max(4 * depth, 4096))
    pool_tokens = engine.kv_pool_tokens() if hasattr(engine, "kv_pool_tokens") else None
    # every finished point goes to stages/<tier>.load.partial.json at once: a stage stopped by
    # its timeout, a signal or a memory error keeps what it measured (qeval.stages.TierRunner.finish)
    journal: dict = {}
    partial = layout.stage_partial(tier, "load")
    partial.unlink(missing_ok=True)  # an earlier attempt's points are not this one's

    def keep(at: str, key: str | None, section: dict) -> None:
        if key is None:
            journal.update(section)
        else:
            journal[key] = section
        journal["_at"] = at
        atomic_write_json(partial, {"load": json.loads(json_text(journal))})

    def checkpoint(name: str) -> None:
        if name == "arrivals":  # the named fault point between the closed-loop workloads and the open loop
            inject_fault(tier, "load", "points")

    # the workloads of qeval.serving, each reading its own field of the typed load section
    sctx = ServingContext(engine=engine, load=ld, base_ids=base, depth=depth,
                          kv_bytes_per_token=meas.memory.kv_bytes_per_token, kv_budget_bytes=budget,
                          max_context=src.max_context, pool_tokens=pool_tokens, peak=peak, progress=_progress,
                          keep=keep, checkpoint=checkpoint)
    out = run_workloads(sctx)
    out["slo"] = {"ttft_p95_s": ld.slo.ttft_p95_s, "itl_p95_s": ld.slo.itl_p95_s,
                  "max_error_rate": ld.slo.max_error_rate}
    out.update({"engine": engine.name, "backend": engine.backend, "device": engine_device, "threads": recipe.threads,
                "memory_kind": peak.kind, "held_bytes": held, "kv_budget_source": budget_src})
    engine.close()
    out = json.loads(json_text(out))  # numpy scalars as the file will hold them (the section's models are strict)
    partial.unlink(missing_ok=True)  # the whole section follows in the stage file
    return {"load": out, "load_fingerprint": load_fingerprint(recipe.model_dump(mode="json"))}


def stage_reference(recipe, run_dir: Path, tier: str | None) -> dict:
    """The reference tier answers every suite item in ``quality.reference_dtype``; ids and
    log-probabilities stored once (:mod:`qeval.quality_stages`)."""
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    ctx = reference_context(recipe, tier_context(recipe, run_dir, device))
    return reference_pass(recipe, run_dir, ctx, progress=_progress, fresh=os.environ.get(FRESH_ENV) == "1")


def stage_floor(recipe, run_dir: Path, tier: str | None) -> dict:
    """The noise floor: the reference tier as served, scored against the stored reference
    (:func:`qeval.quality_stages.noise_floor_pass`)."""
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    ctx = tier_context(recipe, run_dir, device)
    return noise_floor_pass(recipe, run_dir, ctx, progress=_progress, fresh=os.environ.get(FRESH_ENV) == "1")


def stage_quality(recipe, run_dir: Path, tier: str) -> dict:
    """Fidelity and behaviour of one tier against the stored reference."""
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    ctx = tier_context(recipe, run_dir, device)
    return tier_quality(recipe, run_dir, tier, ctx, progress=_progress, fresh=os.environ.get(FRESH_ENV) == "1")


def stage_speculative(recipe, run_dir: Path, tier: str | None) -> dict:
    """Every recipe ``speculative`` pair: the target alone and with its draft, per depth and
    draft length (:mod:`qeval.speculative_stage`); run-wide, after every tier's stages."""
    from .speculative_stage import method_engine, stage_speculative as run  # start-up time: only this stage
    device = pick_device(recipe.device)
    pin_threads(recipe.threads)
    ctx = tier_context(recipe, run_dir, device)
    return run(recipe, run_dir, method_engine(recipe, ctx, run_dir), _progress)


STAGES = {"source": stage_source, "env": stage_env, "prepare": stage_prepare, "measure": stage_measure,
          "load": stage_load,
          "reference": stage_reference, "floor": stage_floor, "quality": stage_quality,
          "speculative": stage_speculative}


#: The named points of a stage where :func:`inject_fault` may act, in the order they come
#: (``points``: the load stage, after its closed-loop workloads and before its open loop).
FAULT_POINTS = ("start", "points", "mid", "write")


def _fault_at(spec: str | None, tier: str, stage: str, point: str) -> list[str] | None:
    """``spec`` (``tier:stage[:point[:extra]]``, point default ``start``) split, when it names this point."""
    parts = (spec or "").split(":")
    if len(parts) >= 2 and parts[:2] == [tier, stage] and (parts[2] if len(parts) > 2 and parts[2] else "start") == point:
        return parts
    return None


def _run_pid() -> int:
    """The run's process: ``QEVAL_RUN_PID`` (set by :class:`qeval.stages.TierRunner`; a
    stage forked from the fork server has that server as its parent), else the parent."""
    return int(os.environ.get("QEVAL_RUN_PID") or os.getppid())


def inject_fault(tier: str, stage: str, point: str, layout: RunLayout | None = None,
                 text: Callable[[], str] = str) -> None:
    """Test-only faults at a named point of a stage (:data:`FAULT_POINTS`), from environment
    variables that are never set in normal use; each value names ``tier:stage[:point]``
    (``_run`` for run-wide stages; point default ``start``):

    * ``QEVAL_TEST_CRASH`` (``tier:stage:point[:SIGNAL]``): this stage process aborts (SIGABRT)
      there, or dies by SIGNAL (``SIGILL``: a kernel that traps): a hard crash of one stage.
    * ``QEVAL_TEST_KILL_RUN``: SIGKILL to the run (the parent process; this one dies with it,
      PR_SET_PDEATHSIG): the whole run killed at that moment, as by the OOM killer or ``kill -9``.
    * ``QEVAL_TEST_SIGNAL_RUN`` (``tier:stage:point:SIGINT`` or ``...:SIGTERM``): that signal to
      the run (Ctrl-C; a CI cancel), then this process waits for the run to stop it.

    At ``write``, ``text()`` (the stage file's JSON) is first half-written to a temporary sibling
    of the stage file in ``layout``, as a kill during an atomic write leaves it.
    """
    env = os.environ
    hits = [(name, _fault_at(env.get(name), tier, stage, point))
            for name in ("QEVAL_TEST_CRASH", "QEVAL_TEST_KILL_RUN", "QEVAL_TEST_SIGNAL_RUN")]
    hits = [(name, parts) for name, parts in hits if parts]
    if not hits:
        return
    if point == "write" and layout is not None:
        dst = layout.stage(tier, stage)
        dst.parent.mkdir(parents=True, exist_ok=True)
        body = text()
        (dst.parent / f".{dst.name}.fault.tmp").write_text(body[: len(body) // 2])
    for name, parts in hits:
        print(f"[qeval] test fault {name} at {tier}:{stage}:{point}", flush=True)
        if name == "QEVAL_TEST_CRASH":
            if len(parts) > 3 and parts[3]:
                sig = signal.Signals[parts[3]]
                if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os.abort()
        if name == "QEVAL_TEST_KILL_RUN":
            os.kill(_run_pid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "QEVAL_TEST_SIGNAL_RUN":
            sig = signal.Signals[parts[3] if len(parts) > 3 else "SIGINT"]
            os.kill(_run_pid(), sig)
            for _ in range(300):  # the run kills this stage's process group as it stops
                time.sleep(1)
            # a hang guard, not a timing: a run started with SIGINT ignored (a background job
            # of a shell without job control) never hears it; fail the stage instead of waiting
            print(f"[qeval] test fault: the run did not stop on {sig.name} (ignored in its process?)", flush=True)
            os.abort()


def main(argv: list[str] | None = None) -> int:
    """Run ``STAGE RUN_DIR [TIER]``; exit 0 ok, 1 exception (recorded), 2 bad input (recorded)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stage, run_dir = argv[0], Path(argv[1])
    tier = argv[2] if len(argv) > 2 else RUN_SCOPE
    layout = RunLayout(run_dir)
    recipe, _ = load_recipe_from_run(run_dir)
    inject_fault(tier, stage, "start")
    global _stage_t0
    try:
        t0 = _stage_t0 = time.time()
        out = STAGES[stage](recipe, run_dir, None if tier == RUN_SCOPE else tier)
        out["stage_seconds"] = time.time() - t0
        out["host"] = platform.node()
        out["fingerprint"] = os.environ.get("QEVAL_FINGERPRINT") or None
        inject_fault(tier, stage, "mid")
        inject_fault(tier, stage, "write", layout, lambda: json_text(out))
        write_stage(layout, tier, stage, out)
        return 0
    except TierUnavailable as e:  # cannot run here as asked: one line, what to install
        write_stage_error(layout, tier, stage, StageError(error=str(e), type="unavailable",
                                                          traceback=traceback.format_exc()))
        print(f"error: {e}", file=sys.stderr)
        return 1
    except QevalInputError as e:
        write_stage_error(layout, tier, stage, StageError(error=str(e), type="input", traceback=traceback.format_exc()))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (Exception, SystemExit) as e:  # a tier failing alone: recorded, reported, others go on
        # SystemExit too: a library calling sys.exit() inside a stage is a failure with a frame
        info = describe_exception(e)
        write_stage_error(layout, tier, stage, StageError(**info, type="exception", traceback=traceback.format_exc()))
        traceback.print_exc()
        if getattr(e, "log_tail", None):  # e.g. a tier's server that died: its log's last lines, in the row's tail
            print(f"--- log tail of what failed ---\n{e.log_tail}", file=sys.stderr, flush=True)
        print(f"[qeval] failed: {info['error']}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
