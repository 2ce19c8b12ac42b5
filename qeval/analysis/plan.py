"""``qeval plan``: memory, capacity and decode speed of every tier on a named GPU, estimated
from a model config before anything is measured, and replaced row by row by a run's
measured figures where a run is given.

Per tier (a weight format served by an engine with a KV cache kind):

* weights: the format's stored bytes (:mod:`qeval.weight_formats`, per tensor of the
  config's model) or the run's ``memory.weight_bytes``;
* KV bytes/token: ``2 x layers x kv_heads x head_dim x bits/8`` of the KV format, or the
  run's ``memory.kv_bytes_per_token``;
* budget ``M x usable``; KV budget ``M x usable - weights - overhead``; sequences at c and
  the longest context for N users: :mod:`qeval.analysis.capacity` (vLLM, arXiv:2309.06180 §2);
* decode: roofline bound ``bandwidth / (weights + kv x c)`` for one stream (and at c = 0),
  times an efficiency range: the run's measured roofline share (``speed.<d>.roofline_share``,
  lowest to highest over its depths) or :data:`DEFAULT_EFFICIENCY`, 0.5 to 0.8, the share of
  the roofline serving engines commonly reach at batch 1; N streams batched:
  ``N x bandwidth / (weights + N x kv x c)`` (memory only: compute binds at large N);
* prefill: compute bound, so no estimate ("measure it") unless the run measured it;
* users at SLO: only ever measured (the load stage's ``load.users_at_slo``); until a run has
  it the cell says so. :func:`measured_users_at_slo` is where that figure is read.
* a run's tier that torch computed in a dtype its CPU has no native instructions for (the
  row's ``dtype_emulated``, e.g. BF16 without AVX512_BF16: qeval.engines.hf) gets a note
  (:func:`emulated_note`): its measured speed, roofline share and users at SLO are torch's
  emulated CPU path, not that dtype as served on a GPU.

Every cell carries its source: ``estimate`` (from the config and the formulas above) or
``measured`` (from the run, or computed from measured figures only).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..bounded import expand_user, load_json
from ..errors import QevalInputError
from ..model_config import ModelShape, model_shape
from ..recipe import Tier
from ..results import STATUS_OK, Memory, RunInfo, TierResult, get_path
from ..tiers import get_method
from ..weight_formats import FlatBits, KVFormat, PairFormat, PairKV, WeightEstimate, WeightFormat, kv_format
from .capacity import (DEFAULT_OVERHEAD_BYTES, GridCheck, LoadCheck, decode_bound, grid_vs_formula, load_vs_formula,
                       max_context, max_sequences)
from .gpus import GpuSpec
from .ladder import DTYPE_NAMES
from .pareto import GIB, finite

#: Share of memory a process can use when neither ``--usable`` nor the GPU entry says.
DEFAULT_USABLE = 0.95
#: Memory when neither ``--gpu`` nor ``--gpu-mem`` nor a run gives one (bytes).
DEFAULT_MEMORY_BYTES = 24 * GIB
#: Share of the decode roofline real engines reach at batch 1 (low, high), used when no run
#: measured it: llama.cpp, vLLM and TensorRT-LLM single-stream decode typically lands at
#: 50-80 % of bandwidth / bytes read per token.
DEFAULT_EFFICIENCY = (0.5, 0.8)

EST, MEAS = "estimate", "measured"


@dataclass
class Cell:
    """One figure of the plan and where it comes from.

    Attributes:
        value: number (bytes, tokens, tokens/s), ``[low, high]``, bool, or None when unknown.
        source: ``"estimate"``, ``"measured"``, or ``"none"`` (nothing to show).
        formula: how it was obtained, one line.
        estimate: for a measured value, the estimate it replaced (None when there was none).
    """
    value: Any = None
    source: str = "none"
    formula: str = ""
    estimate: Any = None

    def to_dict(self) -> dict:
        return {"value": self.value, "source": self.source, "formula": self.formula, "estimate": self.estimate}


@dataclass
class PlanTier:
    """A tier to plan: its weight format and KV format (None when unknown). ``note`` says
    why a format could not be worked out, or what the row stands for."""
    name: str
    method: str
    engine: str
    kv_cache: str
    weight_format: WeightFormat | None = None
    kv: KVFormat | None = None
    note: str = ""
    pair: tuple[str, str] | None = None  # a speculative pair's (target, draft)


@dataclass
class PlanRow:
    """One tier of the plan; every figure a :class:`Cell` (units: bytes, tokens, tokens/s)."""
    tier: str
    method: str
    format: str
    kv_cache: str
    weights_bytes: Cell = field(default_factory=Cell)
    bits_per_weight: Cell = field(default_factory=Cell)
    kv_bytes_per_token: Cell = field(default_factory=Cell)
    kv_budget_bytes: Cell = field(default_factory=Cell)
    sequences: Cell = field(default_factory=Cell)
    max_context_tokens: Cell = field(default_factory=Cell)
    fits: Cell = field(default_factory=Cell)
    decode_bound_empty: Cell = field(default_factory=Cell)
    decode_bound: Cell = field(default_factory=Cell)
    efficiency: Cell = field(default_factory=Cell)
    decode_expected: Cell = field(default_factory=Cell)
    aggregate_bound: Cell = field(default_factory=Cell)
    prefill_tokens_per_s: Cell = field(default_factory=Cell)
    users_at_slo: Cell = field(default_factory=Cell)
    notes: list[str] = field(default_factory=list)

    CELLS = ("weights_bytes", "bits_per_weight", "kv_bytes_per_token", "kv_budget_bytes", "sequences",
             "max_context_tokens", "fits", "decode_bound_empty", "decode_bound", "efficiency", "decode_expected",
             "aggregate_bound", "prefill_tokens_per_s", "users_at_slo")

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"tier": self.tier, "method": self.method, "format": self.format,
                             "kv_cache": self.kv_cache}
        d.update({c: getattr(self, c).to_dict() for c in self.CELLS})
        d["notes"] = list(self.notes)
        return d


@dataclass
class Plan:
    """The whole plan: the machine, the question (context, users), one row per tier.

    Attributes:
        model: config path (or None); params: parameter count from it.
        run_dir: the run folder whose measured figures were used, or None.
        gpu: the named GPU, or None.
        memory_bytes, usable, budget_bytes (= memory x usable), overhead_bytes: bytes.
        bandwidth_bytes_per_s: bytes/s, or None when unknown (decode cells stay empty).
        *_source: where each came from, one phrase.
        context: tokens per sequence; users: concurrent sequences.
        efficiency_default: the stated default range used where no run measured a share.
    """
    model: str | None
    params: int | None
    run_dir: str | None
    gpu: GpuSpec | None
    memory_bytes: int
    memory_source: str
    usable: float
    usable_source: str
    budget_bytes: int
    overhead_bytes: int
    bandwidth_bytes_per_s: float | None
    bandwidth_source: str
    context: int
    users: int
    efficiency_default: tuple[float, float]
    rows: list[PlanRow]
    notes: list[str] = field(default_factory=list)
    load_checks: list[LoadCheck] = field(default_factory=list)
    knees: list[MeasuredKnee] = field(default_factory=list)
    grid_checks: list[GridCheck] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "params": self.params, "run_dir": self.run_dir,
                "gpu": self.gpu.to_dict() if self.gpu else None,
                "memory_bytes": self.memory_bytes, "memory_source": self.memory_source,
                "usable": self.usable, "usable_source": self.usable_source, "budget_bytes": self.budget_bytes,
                "overhead_bytes": self.overhead_bytes, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "bandwidth_source": self.bandwidth_source, "context": self.context, "users": self.users,
                "efficiency_default": list(self.efficiency_default),
                "rows": [r.to_dict() for r in self.rows], "notes": list(self.notes),
                "load_checks": [c.to_dict() for c in self.load_checks],
                "knees": [k.to_dict() for k in self.knees],
                "grid_checks": [g.to_dict() for g in self.grid_checks]}


# ---- which tiers --------------------------------------------------------------------------------

def tiers_from_specs(specs: list[Any], shape: ModelShape | None, dtype: str) -> list[PlanTier]:
    """Plan tiers for recipe tier specs (pydantic models with ``name``, ``method``,
    ``kv_cache``): the weight format from each tier module
    (:meth:`qeval.tiers.base.TierMethod.weight_format`) and the KV format of its engine."""
    out = []
    for spec in specs:
        m = get_method(spec.method)
        kv_kind = getattr(spec, "kv_cache", "model") or "model"
        pt = PlanTier(spec.name, spec.method, m.engine_name(spec) if m else "hf", kv_kind)
        if m is None:
            pt.note = f"no tier module for method {spec.method!r}"
        elif shape is not None:
            try:
                pt.weight_format = m.weight_format(spec, shape, dtype)
            except QevalInputError as e:
                pt.note = f"{spec.name}: {e.message}"
        pt.kv = kv_format(pt.engine, kv_kind, dtype)
        out.append(pt)
    return out


def speculative_plan_tiers(pairs: list[tuple[str, str]], tiers: list[PlanTier]) -> list[PlanTier]:
    """A plan row per speculative pair ``(target, draft)`` whose two tiers are planned: both
    models' weights (:class:`~qeval.weight_formats.PairFormat`) and both KV caches
    (:class:`~qeval.weight_formats.PairKV`), named ``target+draft``."""
    by = {t.name: t for t in tiers}
    out = []
    for target, draft in pairs:
        t, d = by.get(target), by.get(draft)
        if t is None or d is None:
            continue
        pt = PlanTier(f"{target}+{draft}", "speculative", t.engine, t.kv_cache,
                      note=f"speculative: {target} with {draft} as its draft; weights and KV of both",
                      pair=(target, draft))
        if t.weight_format is not None and d.weight_format is not None:
            pt.weight_format = PairFormat(t.weight_format, d.weight_format)
        if t.kv is not None and d.kv is not None:
            pt.kv = PairKV(t.kv.kind, t.kv.bits, f"{t.kv.label} + draft {d.kv.label}", draft_bits=d.kv.bits)
        out.append(pt)
    return out


def speculative_pairs(recipe: dict | None) -> list[tuple[str, str]]:
    """``(target, draft)`` of each ``speculative`` pair of a recipe dict (run.json's)."""
    out = []
    for p in (recipe or {}).get("speculative") or []:
        if isinstance(p, dict) and isinstance(p.get("target"), str) and isinstance(p.get("draft"), str):
            out.append((p["target"], p["draft"]))
    return out


def pair_result(target: TierResult | None, draft: TierResult | None, name: str) -> TierResult | None:
    """A speculative pair's measured weight and KV figures: both tiers' sums (None unless both
    finished with them)."""
    if target is None or draft is None or not (target.status == draft.status == STATUS_OK):
        return None
    w = [get_path(x, "memory", "weight_bytes") for x in (target, draft)]
    kv = [get_path(x, "memory", "kv_bytes_per_token") for x in (target, draft)]
    return TierResult(tier=name, method="speculative", status=STATUS_OK, memory=Memory(
        weight_bytes=sum(w) if all(w) else None, kv_bytes_per_token=sum(kv) if all(kv) else None))


def default_tiers(shape: ModelShape | None, dtype: str) -> list[PlanTier]:
    """Every tier kind qeval builds, each with the engine's default KV cache and an int8
    one: bf16, int8 (torchao), fp8 weight-only, gptq and awq W4 g128, gguf Q4_K_M; then the
    flat 4-bit rule of thumb (0.5 bytes per parameter) for comparison."""
    base = [get_method(m).spec(name=n, method=m, **kw) for n, m, kw in (
        ("bf16", "bf16", {}), ("int8", "int8", {}), ("fp8", "fp8", {}),
        ("gptq-w4g128", "gptq", {"bits": 4, "group_size": 128}),
        ("awq-w4g128", "awq", {"bits": 4, "group_size": 128}), ("gguf-q4_k_m", "gguf", {"type": "Q4_K_M"}))]
    specs = []
    for s in base:
        specs += [s, s.model_copy(update={"name": f"{s.name}-kv8", "kv_cache": "int8"})]
    tiers = tiers_from_specs(specs, shape, dtype)
    flat = PlanTier("4bit-flat", "-", "hf", "model", FlatBits(4), kv_format("hf", "model", dtype))
    return tiers + [flat]


def measured_users_at_slo(result: TierResult | None) -> tuple[Any, str] | None:
    """The load stage's users at SLO of a tier result, with what it was measured at:
    ``(users, formula)``, or None when the run has no load figures. This is where the
    measured load point replaces the plan's "not measured" cell."""
    load = result.load if result is not None else None
    if load is None or load.users_at_slo is None:
        return None
    slo = f"TTFT p95 <= {load.slo.ttft_p95_s} s, ITL p95 <= {load.slo.itl_p95_s} s" if load.slo else ""
    return load.users_at_slo, (f"load stage: largest concurrency meeting the SLO {slo} at depth "
                               f"{load.depth or '?'}").replace("  ", " ")


@dataclass
class MeasuredKnee:
    """A tier's measured knee from the run's open loop (never estimated).

    Attributes:
        tier: tier name.
        knee_rps: highest measured offered rate meeting the SLO (req/s), None when none did.
        below_rps / above_rps: the measured rates bracketing it (None at an end).
        note: what the bracket means, one line; stopped: why the sweep stopped early, or None.
        rates_rps: every offered rate measured, ascending.
    """
    tier: str
    knee_rps: float | None
    below_rps: float | None
    above_rps: float | None
    note: str
    stopped: str | None
    rates_rps: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def measured_knees(results: dict[str, TierResult]) -> list[MeasuredKnee]:
    """One :class:`MeasuredKnee` per tier whose load stage ran the open loop, in tier order."""
    out = []
    for name, t in results.items():
        ar = t.load.arrivals if t is not None and t.load is not None else None
        if ar is None or ar.knee is None:
            continue
        k = ar.knee
        out.append(MeasuredKnee(name, k.rate_rps, k.below_rps, k.above_rps, k.note, ar.stopped,
                                [float(p.rate_rps) for p in ar.rate_points if p.rate_rps]))
    return out


# ---- the plan -----------------------------------------------------------------------------------

def _speed_figures(result: TierResult) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    shares, prefill = [], []
    for d, s in (result.speed or {}).items():
        try:
            depth = int(d)
        except (TypeError, ValueError):
            continue
        sh = finite(s.roofline_share)
        if sh is not None and sh > 0:
            shares.append((depth, sh))
        pf = finite(s.prefill_tokens_per_s)
        if pf is not None and pf > 0:
            prefill.append((depth, pf))
    return sorted(shares), sorted(prefill)


def emulated_note(result: TierResult | None) -> str | None:
    """The plan row's note for a run's tier that torch computed in a dtype the run's CPU
    emulates (the stored ``dtype_emulated``; None for any other row)."""
    dtype = result.dtype_emulated if result is not None and result.status == STATUS_OK else None
    if not dtype or (result.device or "cpu") != "cpu":
        return None
    d = DTYPE_NAMES.get(dtype, dtype)
    return (f"run on a CPU without native {d} instructions: torch emulated {d}, so the measured decode, "
            f"roofline share, prefill and users at SLO are torch's CPU path, not {d} as served on a GPU")


def _src(*cells: Cell) -> str:
    return MEAS if cells and all(c.source == MEAS for c in cells) else EST


def _row(pt: PlanTier, shape: ModelShape | None, result: TierResult | None, *, budget: int, overhead: int,
         bandwidth: float | None, context: int, users: int, efficiency: tuple[float, float],
         run_device: str) -> PlanRow:
    row = PlanRow(pt.name, pt.method,
                  pt.weight_format.name if pt.weight_format else "-", pt.kv_cache)
    if pt.note:
        row.notes.append(pt.note)
    est: WeightEstimate | None = None
    if pt.weight_format is not None and shape is not None:
        try:
            est = pt.weight_format.estimate(shape)
        except QevalInputError as e:
            row.notes.append(e.message)
    if est is not None:
        row.weights_bytes = Cell(est.bytes, EST, est.formula)
        row.bits_per_weight = Cell(est.bits_per_weight, EST, "8 x weight bytes / parameters")
    if pt.kv is not None and shape is not None:
        row.kv_bytes_per_token = Cell(pt.kv.bytes_per_token(shape), EST,
                                      f"2 x {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} "
                                      f"x {pt.kv.bits:g} bits / 8 ({pt.kv.label})")
    ok = result is not None and result.status == STATUS_OK
    if result is not None and not ok:
        row.notes.append(f"run: status {result.status}" + ("; estimates only" if est else ""))
    if ok:
        emulated = emulated_note(result)
        if emulated:
            row.notes.append(emulated)
        w = finite(get_path(result, "memory", "weight_bytes"))
        if w and w > _MAX_BYTES:  # a hostile or corrupt run folder: not a figure to plan with
            row.notes.append("run: memory.weight_bytes out of range, ignored")
            w = None
        if w and w > 0:
            row.weights_bytes = Cell(int(w), MEAS, "run: memory.weight_bytes", row.weights_bytes.value)
            if est is not None:
                row.notes.append(f"weights measured {w / 1e9:.2f} GB vs estimate {est.bytes / 1e9:.2f} GB "
                                 f"({100 * (w - est.bytes) / est.bytes:+.1f} %)")
        b = finite(get_path(result, "quant", "bits_per_weight"))
        if b and b > 0:
            row.bits_per_weight = Cell(b, MEAS, "run: quant.bits_per_weight", row.bits_per_weight.value)
        kv = finite(get_path(result, "memory", "kv_bytes_per_token"))
        if kv and not 1 <= kv <= _MAX_BYTES:  # every real cache holds at least a byte per token
            row.notes.append("run: memory.kv_bytes_per_token out of range, ignored")
            kv = None
        if kv and kv > 0:
            row.kv_bytes_per_token = Cell(kv, MEAS, "run: memory.kv_bytes_per_token (from the cache object)",
                                          row.kv_bytes_per_token.value)
    row.efficiency = Cell(list(efficiency), EST, f"stated default {efficiency[0]:g}-{efficiency[1]:g} of the roofline")
    row.prefill_tokens_per_s = Cell(None, "none", "compute bound: measure it (qeval run)")
    row.users_at_slo = Cell(None, "none", "measured only: the load stage of qeval run")
    if ok:
        shares, prefill = _speed_figures(result)
        if shares:
            lo, hi = min(s for _, s in shares), max(s for _, s in shares)
            row.efficiency = Cell([lo, hi], MEAS, f"run: decode / roofline at depths {', '.join(str(d) for d, _ in shares)}"
                                  f" on {run_device} (assumed to carry over to this GPU)", list(efficiency))
        if prefill:
            below = [p for p in prefill if p[0] <= context]
            d, v = below[-1] if below else prefill[0]
            row.prefill_tokens_per_s = Cell(v, MEAS, f"run: prefill at depth {d} on {run_device} (compute bound: "
                                            "does not carry over to another GPU)")
        load = measured_users_at_slo(result)
        if load is not None:
            row.users_at_slo = Cell(load[0], MEAS, load[1])
    w, kv = row.weights_bytes, row.kv_bytes_per_token
    if w.value is None or kv.value is None or kv.value <= 0:
        if w.value is None:
            row.notes.append("no weight figure (give --model config.json for an estimate)")
        return row
    src = _src(w, kv)
    free = budget - w.value - overhead
    row.kv_budget_bytes = Cell(free, src, "M x usable - weights - overhead")
    full_kv, sliding = kv.value, None
    if shape is not None and shape.sliding_layers and pt.kv is not None:
        # a sliding-window model: a sequence at context c holds full x c + sliding x min(c, window)
        # (vLLM's hybrid KV manager and llama.cpp's SWA cache size sliding layers at the window);
        # the per-layer split from the config and this tier's KV type, whatever the row measured
        per_layer = pt.kv.bytes_per_token(shape) / shape.layers
        full_kv, sliding = per_layer * shape.full_layers, (per_layer * shape.sliding_layers, int(shape.sliding_window))
        src = EST
        row.notes.append(f"sliding-window model ({shape.kv_layout()}): KV at context c = {full_kv:,.0f} B x c + "
                         f"{sliding[0]:,.0f} B x min(c, {sliding[1]}); sequences and max context from that split")
    row.sequences = Cell(max_sequences(budget, w.value, overhead, full_kv, context, sliding=sliding), src,
                         f"floor(KV budget / (KV bytes/token x {context}))" if sliding is None else
                         f"floor(KV budget / (full x {context} + sliding x min({context}, window)))")
    mc = max_context(budget, w.value, overhead, full_kv, users, sliding=sliding)
    row.max_context_tokens = Cell(mc, src, f"floor(KV budget / (KV bytes/token x {users}))" if sliding is None else
                                  f"largest c with {users} x (full x c + sliding x min(c, window)) <= KV budget")
    row.fits = Cell(mc >= context, src, f"{users} x {context} x KV bytes/token <= KV budget")
    if free < 0:
        row.notes.append("weights + overhead exceed the budget")
    if shape is not None and shape.max_position and mc > shape.max_position:
        row.notes.append(f"longest context capped by the model at {shape.max_position:,}")
    if bandwidth:
        row.decode_bound_empty = Cell(decode_bound(bandwidth, w.value, kv.value, 0), _src(w),
                                      "bandwidth / weights (1 stream, empty context)")
        row.decode_bound = Cell(decode_bound(bandwidth, w.value, kv.value, context), src,
                                f"bandwidth / (weights + KV bytes/token x {context}) (1 stream)")
        lo, hi = row.efficiency.value
        row.decode_expected = Cell([row.decode_bound.value * lo, row.decode_bound.value * hi],
                                   _src(w, kv, row.efficiency), "decode bound x efficiency range")
        if mc >= context:
            row.aggregate_bound = Cell(decode_bound(bandwidth, w.value, kv.value, context, users), src,
                                       f"{users} x bandwidth / (weights + {users} x KV bytes/token x {context}) "
                                       "(memory only; compute binds at large batches)")
    return row


def build_plan(*, config: dict | None = None, config_path: str | None = None, tiers: list[PlanTier] | None = None,
               results: dict[str, TierResult] | None = None, run_dir: str | None = None,
               run: RunInfo | None = None,
               gpu: GpuSpec | None = None, memory_bytes: int | None = None, bandwidth_bytes_per_s: float | None = None,
               usable: float | None = None, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES, context: int = 32768,
               users: int = 8, dtype: str | None = None, speculative: list[tuple[str, str]] | None = None) -> Plan:
    """Build the plan.

    Args:
        config: HF ``config.json`` dict (estimates), or None (measured figures only).
        config_path: where ``config`` came from (for the header).
        tiers: the tiers to plan (:func:`tiers_from_specs`); None: the run's tiers, or
            :func:`default_tiers` when there is no run.
        results: ``{tier: tier result}`` of a run (measured figures), or None.
        run_dir, run: the run folder and its ``run.json`` (device, bandwidth, GPU memory).
        gpu: a named GPU; ``memory_bytes`` / ``bandwidth_bytes_per_s`` override its figures.
        usable: share of memory usable (default: the GPU entry's, else 0.95).
        overhead_bytes: runtime allowance (CUDA context, activations), bytes.
        context: tokens per sequence; users: concurrent sequences.
        dtype: source dtype (default: the config's ``torch_dtype``).
        speculative: ``(target, draft)`` pairs planned as one row each (both models' weights
            and KV; :func:`speculative_plan_tiers`); None: the run's recipe's.

    Raises:
        QevalInputError: bad config, non-positive context/users/memory, usable outside (0, 1],
            negative overhead.
    """
    if context <= 0:
        raise QevalInputError(f"must be a positive number of tokens (got {context})", field="--context")
    if users <= 0:
        raise QevalInputError(f"must be a positive number of sequences (got {users})", field="--users")
    if overhead_bytes < 0:
        raise QevalInputError("must not be negative", field="--overhead")
    try:
        shape = model_shape(config) if config is not None else None
    except QevalInputError as e:
        raise QevalInputError(e.message, file=config_path or e.file, field=e.field) from None
    dtype = dtype or (shape.dtype if shape else "bfloat16")
    run_device = str((run.device if run else None) or get_path(run, "recipe", "device") or "the run's machine")
    if memory_bytes is not None:
        mem, mem_src = int(memory_bytes), "--gpu-mem"
    elif gpu is not None:
        mem, mem_src = gpu.memory_bytes, f"--gpu {gpu.key}"
    elif run_memory_bytes(run) is not None:
        mem, mem_src = int(run_memory_bytes(run)), "the run's GPU memory"  # type: ignore[arg-type]
    else:
        mem, mem_src = DEFAULT_MEMORY_BYTES, "default; give --gpu or --gpu-mem"
    if mem <= 0:
        raise QevalInputError(f"memory must be positive (got {mem} bytes)", field="--gpu-mem")
    if usable is not None:
        us, us_src = float(usable), "--usable"
    elif gpu is not None and gpu.usable is not None:
        us, us_src = gpu.usable, f"{gpu.key} entry ({gpu.note or 'usable share'})"
    else:
        us, us_src = DEFAULT_USABLE, "default"
    if not (0 < us <= 1) or math.isnan(us):
        raise QevalInputError(f"must be a share of memory in (0, 1] (got {us:g})", field="--usable")
    if bandwidth_bytes_per_s is not None:
        bw, bw_src = float(bandwidth_bytes_per_s), "--bandwidth"
    elif gpu is not None:
        bw, bw_src = gpu.bandwidth_bytes_per_s, f"--gpu {gpu.key}: {gpu.source}"
    else:
        rb = finite(run.bandwidth_bytes_per_s) if run else None
        if rb and rb > 0:
            bw, bw_src = rb, f"measured on {run_device} by the run (STREAM copy)"
        else:
            bw, bw_src = None, "unknown: give --gpu or --bandwidth for decode estimates"  # type: ignore[assignment]
    if tiers is None:
        if results:
            specs = _run_tier_specs(run, results)
            tiers = tiers_from_specs(specs, shape, dtype) if specs else []
            named = {t.name for t in tiers}
            tiers += [PlanTier(n, r.method or "-", r.engine or "hf", r.kv_cache or "model",
                               note="tier spec not in run.json: no estimate" if shape is not None else "")
                      for n, r in results.items() if n not in named]
        else:
            tiers = default_tiers(shape, dtype)
    pairs = speculative if speculative is not None else speculative_pairs(run.recipe if run is not None else None)
    pair_tiers = speculative_plan_tiers(pairs, tiers)
    results = dict(results or {})
    for pt in pair_tiers:
        pr = pair_result(results.get(pt.pair[0]), results.get(pt.pair[1]), pt.name)
        if pr is not None:
            results[pt.name] = pr
    tiers = list(tiers) + pair_tiers
    budget = int(mem * us)
    eff = DEFAULT_EFFICIENCY
    rows = [_row(t, shape, results.get(t.name), budget=budget, overhead=overhead_bytes, bandwidth=bw,
                 context=context, users=users, efficiency=eff, run_device=run_device) for t in tiers]
    for row, t in zip(rows, tiers):
        if t.pair is not None:  # a step reads both models: the one-model bandwidth bound does not apply
            why = "speculative: measured only (qeval run's speculative stage), not a bandwidth bound"
            for c in ("decode_bound_empty", "decode_bound", "decode_expected", "aggregate_bound"):
                setattr(row, c, Cell(None, "none", why))
    notes = []
    if shape is None:
        notes.append("no model config: measured figures only (give --model config.json for estimates)")
    return Plan(model=config_path, params=shape.params if shape else None, run_dir=run_dir, gpu=gpu,
                memory_bytes=mem, memory_source=mem_src, usable=us, usable_source=us_src, budget_bytes=budget,
                overhead_bytes=int(overhead_bytes), bandwidth_bytes_per_s=bw, bandwidth_source=bw_src,
                context=int(context), users=int(users), efficiency_default=eff, rows=rows, notes=notes,
                load_checks=load_vs_formula(results or {}, overhead_bytes,  # the run's machine, not the target
                                            finite(run.bandwidth_bytes_per_s) if run else None),
                knees=measured_knees(results or {}),
                grid_checks=grid_vs_formula(results or {}, overhead_bytes,
                                            finite(run.bandwidth_bytes_per_s) if run else None,
                                            shape.max_position if shape else None))


def _run_tier_specs(run: RunInfo | None, results: dict[str, TierResult]) -> list[Any]:
    """The recipe tier specs stored in ``run.json`` (validated with the recipe's schema),
    for the tiers that have results, in recipe order; unreadable specs are skipped."""
    adapter = TypeAdapter(Tier)
    out = []
    for t in get_path(run, "recipe", "tiers") or []:
        if not isinstance(t, dict) or t.get("name") not in results:
            continue
        try:
            out.append(adapter.validate_python({k: v for k, v in t.items() if v is not None}))
        except ValidationError:
            continue
    return out


#: Largest byte figure read from a run folder (1 EiB); above it a figure is corrupt or hostile.
_MAX_BYTES = float(1 << 60)


def run_memory_bytes(run: RunInfo | None) -> int | None:
    """GPU memory recorded in a ``run.json`` (``gpu_memory_bytes``, bytes); None when absent
    (or above 1 EiB: not a GPU)."""
    v = finite(run.gpu_memory_bytes) if run is not None else None
    return int(v) if v and 0 < v <= _MAX_BYTES else None


# ---- output -------------------------------------------------------------------------------------

def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _mark(c: Cell) -> str:
    return {EST: " est", MEAS: " meas"}.get(c.source, "")


def _tok(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.2g}")


def plan_table(plan: Plan) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells of the plan table (shared by ``qeval plan`` and the
    report's capacity section). Sizes in GB (10^9 bytes); each figure ends in ``est`` or
    ``meas`` (:class:`Cell` source)."""
    c, n = plan.context, plan.users
    headers = ["tier", "weights", "bits/w", "KV B/token", "KV budget", f"seqs @ {c}", f"ctx for {n} users",
               f"{n} x {c} fits", "decode bound tok/s (ctx 0 -> c)", f"expected tok/s @ {c}",
               f"{n}-stream bound tok/s", "prefill tok/s", "users at SLO", "note"]
    rows = []
    for r in plan.rows:
        cells = [r.tier + (f" ({r.format})" if r.format != "-" and r.format.lower() not in r.tier.lower() else ""),
                 _gb(r.weights_bytes.value) + _mark(r.weights_bytes),
                 ("-" if r.bits_per_weight.value is None else f"{r.bits_per_weight.value:.2f}") + _mark(r.bits_per_weight),
                 ("-" if r.kv_bytes_per_token.value is None else f"{r.kv_bytes_per_token.value:,.0f}")
                 + _mark(r.kv_bytes_per_token),
                 _gb(r.kv_budget_bytes.value) + _mark(r.kv_budget_bytes),
                 ("-" if r.sequences.value is None else f"{r.sequences.value:,}") + _mark(r.sequences),
                 ("-" if r.max_context_tokens.value is None else f"{r.max_context_tokens.value:,}")
                 + _mark(r.max_context_tokens),
                 ("-" if r.fits.value is None else ("yes" if r.fits.value else "no")) + _mark(r.fits),
                 ("-" if r.decode_bound.value is None else
                  f"{_tok(r.decode_bound_empty.value)} -> {_tok(r.decode_bound.value)}") + _mark(r.decode_bound),
                 ("-" if r.decode_expected.value is None else
                  f"{_tok(r.decode_expected.value[0])}-{_tok(r.decode_expected.value[1])}") + _mark(r.decode_expected),
                 (_tok(r.aggregate_bound.value) + _mark(r.aggregate_bound)) if r.aggregate_bound.value is not None
                 else ("does not fit" if r.fits.value is False else "-"),
                 (_tok(r.prefill_tokens_per_s.value) + _mark(r.prefill_tokens_per_s))
                 if r.prefill_tokens_per_s.value is not None else "measure it",
                 (str(r.users_at_slo.value) + _mark(r.users_at_slo)) if r.users_at_slo.value is not None
                 else "not measured",
                 "; ".join(r.notes)]
        rows.append(cells)
    return headers, rows


def plan_header(plan: Plan) -> list[str]:
    """The lines above the table: what was estimated from what, on which machine."""
    what = []
    if plan.model:
        what.append(f"ESTIMATES from {plan.model}" + (f" ({plan.params:,} parameters)" if plan.params else ""))
    if plan.run_dir:
        what.append(f"measured figures from {plan.run_dir}")
    gpu = f"{plan.gpu.name}: " if plan.gpu else ""
    bw = "unknown" if plan.bandwidth_bytes_per_s is None else f"{plan.bandwidth_bytes_per_s / 1e9:,.0f} GB/s"
    return ["qeval plan: " + ("; ".join(what) or "no figures"),
            f"{gpu}memory {plan.memory_bytes / GIB:.2f} GiB ({plan.memory_source}) x usable {plan.usable:g} "
            f"({plan.usable_source}) = budget {_gb(plan.budget_bytes)}; overhead {_gb(plan.overhead_bytes)}; "
            f"bandwidth {bw} ({plan.bandwidth_source})",
            f"question: {plan.users} users x {plan.context} tokens; decode efficiency where not measured: "
            f"{plan.efficiency_default[0]:g}-{plan.efficiency_default[1]:g} of the roofline (stated default)"]


def plan_legend(plan: Plan) -> list[str]:
    """The lines under the table: the markers, the formulas, and each weight format's count."""
    lines = ["est = estimated from the config with the formulas below; meas = measured in the run, or computed "
             "from measured figures only. GB = 10^9 bytes.",
             "KV budget = memory x usable - weights - overhead; seqs = floor(KV budget / (KV B/token x context)); "
             "ctx for N users = floor(KV budget / (KV B/token x N)) (vLLM, arXiv:2309.06180 §2).",
             "decode bound = bandwidth / (weights + KV B/token x context), one stream (roofline: each token reads "
             "every weight and the cached K/V once); expected = bound x efficiency; N-stream bound = "
             "N x bandwidth / (weights + N x KV B/token x context), memory only.",
             "prefill is compute bound: no estimate. users at SLO: measured by the load stage only."]
    seen = set()
    for r in plan.rows:
        for cell, what in ((r.weights_bytes, "weights"), (r.kv_bytes_per_token, "KV"), (r.efficiency, "efficiency")):
            if cell.source == EST and cell.formula and (what, cell.formula) not in seen and what != "efficiency":
                seen.add((what, cell.formula))
                lines.append(f"{r.format if what == 'weights' else r.kv_cache + ' KV'}: {cell.formula}")
    for n in plan.notes:
        lines.append(n)
    return lines


def plan_markdown(plan: Plan) -> str:
    """The plan as text: header lines, a Markdown table, the legend."""
    headers, rows = plan_table(plan)
    out = plan_header(plan) + ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    out += [""] + plan_legend(plan)
    out += load_check_lines(plan)
    out += grid_check_lines(plan)
    out += knee_lines(plan)
    return "\n".join(out)


def grid_check_lines(plan: Plan) -> list[str]:
    """The run's context x concurrency grid, each cell beside the formulas' prediction, and
    where the prediction was wrong and by how much (empty without a grid)."""
    checks = plan.grid_checks
    if not checks:
        return []
    out = ["", "context x concurrency (the run's grid, on the run's machine) beside the formulas: admitted = "
           f"weights + overhead {_gb(plan.overhead_bytes)} + N x context x KV B/token within the run's memory "
           "budget", "",
           "| tier | depth | streams N | predicted | measured | memory formula | measured peak | decode bound tok/s | "
           "measured tok/s | where the prediction was wrong |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        pred = "-" if c.predicted_admitted is None else ("admitted" if c.predicted_admitted else "not admitted")
        meas = "admitted" if c.admitted else f"not admitted: {(c.reason or '').replace('|', '/')[:120]}"
        out.append(f"| {c.tier} | {c.depth} | {c.concurrency} | {pred} | {meas} | {_gb(c.predicted_bytes)} | "
                   f"{_gb(c.measured_peak_bytes)} | {_tok(c.bound_tokens_per_s)} | {_tok(c.measured_tokens_per_s)} | "
                   f"{(c.wrong or 'right').replace('|', '/')} |")
    n_wrong = sum(1 for c in checks if c.wrong)
    out += ["", f"the prediction was wrong in {n_wrong} of {len(checks)} cells"]
    return out


def knee_lines(plan: Plan) -> list[str]:
    """The run's measured knees (open loop, on the run's machine), one row per tier: the
    knee and the measured rates bracketing it; empty without an open loop."""
    if not plan.knees:
        return []
    def r(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"
    out = ["", "measured knees (the run's open loop, on the run's machine; the highest measured offered rate "
           "meeting the SLO, never extrapolated):", "",
           "| tier | knee req/s | measured below | measured above | rates measured | note |", "|---|---|---|---|---|---|"]
    for k in plan.knees:
        note = k.note + (f"; {k.stopped}" if k.stopped else "")
        out.append(f"| {k.tier} | {r(k.knee_rps)} | {r(k.below_rps)} | {r(k.above_rps)} | "
                   f"{', '.join(f'{x:g}' for x in k.rates_rps) or '-'} | {note.replace('|', '/')} |")
    return out


def load_check_lines(plan: Plan) -> list[str]:
    """The run's measured load points beside the formulas (empty without a load sweep):
    memory formula vs measured peak, N-stream decode bound (the run's measured bandwidth)
    vs measured aggregate decode tokens/s, and how far the formula was on average."""
    checks = plan.load_checks
    if not checks:
        return []
    out = ["", "measured under load (the run's load sweep, on the run's machine) beside the formulas: memory = "
           f"weights + overhead {_gb(plan.overhead_bytes)} + N x context x KV B/token; bound = N-stream decode "
           "bound at the run's measured bandwidth", "",
           "| tier | streams N | context | memory formula | measured peak | formula vs measured | "
           "decode bound tok/s | measured tok/s | share of bound | meets SLO | users at SLO |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        out.append(f"| {c.tier} | {c.concurrency} | {c.context} | {_gb(c.predicted_bytes)} | "
                   f"{_gb(c.measured_peak_bytes)} | "
                   f"{'-' if c.memory_error_pct is None else f'{c.memory_error_pct:+.0f}%'} | "
                   f"{_tok(c.bound_tokens_per_s)} | {_tok(c.measured_tokens_per_s)} | "
                   f"{'-' if c.share_of_bound is None else f'{100 * c.share_of_bound:.0f}%'} | "
                   f"{'-' if c.meets_slo is None else ('yes' if c.meets_slo else 'no')} | "
                   f"{'-' if c.users_at_slo is None else c.users_at_slo} |")
    errs = [abs(c.memory_error_pct) for c in checks if c.memory_error_pct is not None]
    if errs:
        out += ["", f"the memory formula was {sum(errs) / len(errs):.0f}% from the measured peaks on average "
                    f"(largest {max(errs):.0f}%, {len(errs)} points); it bounds memory only: users at SLO is where "
                    "latency, not memory, stops a tier"]
    return out


def plan_json(plan: Plan) -> str:
    """The plan as JSON (bytes, tokens, tokens/s; each figure with its source and formula)."""
    return json.dumps(plan.to_dict(), indent=2)


def read_config(path: str | Path, field_name: str = "--model") -> tuple[dict, Path]:
    """Load ``config.json`` (or ``<folder>/config.json``) with the bounded JSON loader
    (:func:`qeval.bounded.load_json`: a regular file, size and depth bounded).

    Raises:
        QevalInputError: no such file, ``~nosuchuser``, not a regular file, too large, not
            UTF-8, not JSON, too deep, not a JSON object.
    """
    p = expand_user(path, field=field_name)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.exists():
        raise QevalInputError("no config.json there (give a config.json or a local model folder)",
                              file=str(path), field=field_name)
    cfg = load_json(cfg_path, expect=dict, what="model config", field=field_name)
    return cfg, cfg_path


def find_config(recipe: Any, run: RunInfo | None) -> Path | None:
    """A local ``config.json`` for the recipe's (a :class:`qeval.recipe.Recipe`, or None)
    or the run's model: a local model folder, the run's source checkpoint, or the file in
    the Hugging Face cache (never fetched); None when there is none on this machine."""
    sources = []
    if recipe is not None:
        sources.append((recipe.model.source, recipe.model.revision))
    if run:
        sources.append((get_path(run, "recipe", "model", "source"), get_path(run, "recipe", "model", "revision")))
        sources.append((get_path(run, "source", "path"), None))
    for src, rev in sources:
        if not src:
            continue
        try:
            p = expand_user(str(src))
        except QevalInputError:  # ~nosuchuser in a recipe or run.json: no local config
            continue
        if (p / "config.json").is_file():
            return p / "config.json"
        if p.is_file() and p.suffix == ".json":
            return p
        if "/" in str(src) and not p.exists():
            try:
                from huggingface_hub import try_to_load_from_cache  # start-up time: only a hub id needs it
                hit = try_to_load_from_cache(str(src), "config.json", revision=rev or None)
            except Exception:  # not installed, or an id the cache cannot parse
                hit = None
            if isinstance(hit, str) and Path(hit).is_file():
                return Path(hit)
    return None
