"""The tier table: its columns, defined once (:data:`COLUMNS`), give ``table.md``,
``table.csv`` and the tables of ``report.html`` (build, what the peak holds at the analysis
depth, speed by depth, quality, and with a long_context suite long context by document depth).

Noise floor (:mod:`qeval.analysis.floor`): the "vs noise floor" column says ``noise floor``
on the reference tier whose fidelity is the measured floor, and "indistinguishable from
the reference here" on a tier whose KLD mean is within 2x of it; :func:`floor_line` is the
sentence above the tables.

Figures come from the metric table (:mod:`qeval.metrics`). CSV units: ``*_gib`` GiB
(2**30 bytes), ``*_s`` seconds, ``*_tokens_per_s`` tokens/s, ``*_rate``/``*_share`` shares
0..1, ``kv_bytes_per_token`` bytes, KLD nats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ..analysis import RunAnalysis
from ..analysis.floor import FLOOR_FACTOR, INDISTINGUISHABLE
from ..analysis.ladder import emulated_caption, emulated_members
from ..analysis.speculative import pair_results
from ..metrics import GIB, finite
from ..metrics import value as metric_value
from ..results import (STATUS_OK, Behaviour, Fidelity, LoadPoint, LoadSection, LoadSlo, RatePoint, TierResult, get_path,
                       short_error)

Section = Literal["build", "memory", "speed", "quality", "long_context"]
SECTIONS: tuple[Section, ...] = ("build", "memory", "speed", "quality", "long_context")


@dataclass
class SlowPath:
    """A tier flagged "slow path at long context" (decode tokens/s at ``depth``)."""
    tier: str
    depth: int
    decode_tokens_per_s: float
    reference_tokens_per_s: float
    fraction: float

    @property
    def text(self) -> str:
        return (f"slow path at long context: {self.decode_tokens_per_s:.3g} tok/s at depth {self.depth} "
                f"< {self.fraction:g} x reference {self.reference_tokens_per_s:.3g}")


@dataclass
class Row:
    """What the cells of one tier are computed from."""
    name: str
    t: TierResult
    a: RunAnalysis
    slow: SlowPath | None

    @property
    def ok(self) -> bool:
        return self.t.status == STATUS_OK

    @property
    def is_ref(self) -> bool:
        return self.name == self.a.reference

    def v(self, metric: str, depth: int | None = None) -> float | None:
        """A metric's value; the reference's by-definition values (KLD 0, PPL ratio 1,
        same-top 1) when it finished without them."""
        return metric_value(self.t, metric, depth, is_reference=self.quality_is_ref and self.ok)

    @property
    def quality_is_ref(self) -> bool:
        """Its quality is the reference's: the reference tier, or a speculative pair whose
        target it is (the pair's row keeps its target's spec: its answers are the target's)."""
        return self.is_ref or (self.t.spec or {}).get("name") == self.a.reference

    @property
    def fid(self) -> Fidelity:
        return get_path(self.t, "quality", "fidelity") or Fidelity()

    @property
    def beh(self) -> Behaviour:
        return get_path(self.t, "quality", "behaviour") or Behaviour()


# a cell: (text for Markdown/HTML, {csv field: raw value})
Cell = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Column:
    """One column of the tier table.

    Attributes:
        header: its header (Markdown; per-depth columns get `` @<depth>``).
        cell: ``cell(row)`` (per-depth: ``cell(row, depth)``) -> (text, {csv field: value}).
        section: the HTML table it is in (None: Markdown only).
        md: whether ``table.md`` has it.
        per_depth: one column per depth: each speed depth, or with ``depths="long_context"``
            each long-context document depth any tier has (:func:`long_context_depths`).
        html_header: its header in the HTML tables when it differs.
        html_cell: its HTML text when it differs from the Markdown one.
        numeric: right-aligned in HTML (figures); text columns are left-aligned.
    """
    header: str
    cell: Callable[..., Cell]
    section: Section | None
    md: bool = True
    per_depth: bool = False
    depths: Literal["speed", "long_context"] = "speed"
    html_header: str | None = None
    html_cell: Callable[[Row], str] | None = None
    numeric: bool = False


def _f(v: Any, fmt: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
    x = finite(v)
    return "-" if x is None else f"{x * scale:{fmt}}{suffix}"


def _gib(v: Any, digits: int = 2) -> str:
    x = finite(v)
    return "-" if x is None else f"{x / GIB:.{digits}f}"


def _r(v: float | None, div: float) -> float | None:
    return None if v is None else round(v / div, 4)


def _whole(v: float | None) -> float | int | None:
    return int(v) if v is not None and v.is_integer() else v


def _kld(r: Row) -> Cell:
    kld, se = r.v("kld_mean"), finite(r.fid.kld_se)
    text = "-" if kld is None else (f"{kld:.4f}" + (f" ± {se:.4f}" if se is not None else ""))
    if r.quality_is_ref and r.ok and r.fid.kld_mean is None:
        text = "0 (reference)"
    k = r.fid.kld_topk
    if kld is not None and k:  # a server's top-k: the estimate, a lower bound (qeval.measure.fidelity)
        text += f" (top-{k} est.)"
    return text, {"kld_mean": kld, "kld_se": se}


def vs_noise_floor(r: Row) -> str | None:
    """``noise floor`` (the reference tier, whose fidelity is the measured floor),
    :data:`~qeval.analysis.floor.INDISTINGUISHABLE` (a tier whose KLD mean is within
    ``FLOOR_FACTOR`` x the floor), or None (no floor, no KLD, or above it)."""
    floor, kld = r.a.noise_floor, r.v("kld_mean")
    if floor is None or not r.ok or kld is None:
        return None
    if r.quality_is_ref and get_path(r.t, "quality", "noise_floor"):
        return "noise floor"
    return INDISTINGUISHABLE if floor.indistinguishable(kld) else None


def _floor_cell(r: Row) -> Cell:
    v = vs_noise_floor(r)
    text = {None: "", "noise floor": "noise floor"}.get(v, f"{v} (KLD <= {FLOOR_FACTOR:g}x floor)")
    return text, {"vs_noise_floor": v}


def floor_line(a: RunAnalysis) -> str:
    """The noise floor as one sentence (measured, or why not)."""
    if a.noise_floor is not None:
        t = a.noise_floor.text()
        return t[:1].upper() + t[1:] + "."
    why = a.noise_floor_why or "no floor recorded in this run"
    return f"Noise floor: not measured ({why}); KLD figures have no stated floor."


def _kernel_name(op: str) -> str:
    for key, short in (("flash", "flash"), ("efficient", "mem-efficient"), ("cudnn", "cudnn"), ("math", "math")):
        if key in op:
            return short
    return op.replace("aten::", "")


def attention_text(t: TierResult) -> str:
    """The attention path and KV cache type a tier ran with, short (``sdpa math, KV bfloat16``,
    ``flash attn off, KV f16``); ``-`` when not recorded. Read from the row's ``attention``
    record (:meth:`qeval.engines.base.Engine.attention_info`): an engine that lists the
    kernels it saw run (transformers) shows them, per phase when prefill and decode differ."""
    att = t.attention or {}
    kvd = t.kv_cache_dtype or att.get("kv_cache_dtype")
    if not att and t.flash_attn is None:
        return "-"
    kv = f", KV {kvd}" if kvd else ""
    phases = att.get("kernels") or {}
    if not phases:  # an engine with one switch (llama.cpp): flash attention set on or off
        on = t.flash_attn if t.flash_attn is not None else att.get("flash_attn")
        return f"flash attn {'on' if on else 'off'}{kv}"
    names = {ph: "+".join(sorted({_kernel_name(k) for k in ks})) for ph, ks in phases.items()}
    if len(set(names.values())) > 1:
        kern = " / ".join(f"{v} ({ph})" for ph, v in names.items())
    else:
        kern = next(iter(names.values()), "")
    return f"{att.get('implementation') or 'attention'} {kern}".strip() + kv


def _attention(r: Row) -> Cell:
    text = attention_text(r.t)
    return text, {"attention": None if text == "-" else text, "flash_attn": r.t.flash_attn,
                  "kv_cache_dtype": r.t.kv_cache_dtype}


def _peak_split(r: Row, d: int) -> Cell:
    """CSV only: the peak at depth ``d`` split into weights, KV cache and the rest (GiB)."""
    return "", {f"peak_weights_gib_{d}": _r(r.v("peak_weights_bytes", d), GIB),
                f"peak_kv_gib_{d}": _r(r.v("peak_kv_cache_bytes", d), GIB),
                f"peak_other_gib_{d}": _r(r.v("peak_other_bytes", d), GIB)}


def _mem(metric: str, per_depth: bool = True) -> Callable[[Row], Cell]:
    """A cell of the report's peak-memory table: ``metric`` (bytes) in GiB at the analysis
    depth; its CSV values come from the per-depth columns."""
    return lambda r: (_gib(r.v(metric, r.a.depth if per_depth else None), 3), {})


def _pass(r: Row) -> Cell:
    pr, lo, hi = r.v("pass_rate"), r.v("pass_ci_low"), r.v("pass_ci_high")
    text = "-" if pr is None else (f"{100 * pr:.1f}" + (
        f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None and hi is not None else ""))
    return text, {"pass_rate": pr, "pass_ci_low": lo, "pass_ci_high": hi}


def _out_len(r: Row) -> Cell:
    """New tokens per free-running answer against the reference's on the same turns
    (qeval.measure.output_length): ``1.50x (90 vs 60)``; CSV: mean, p95, ratio, budget hit share."""
    rel, mean = r.v("output_tokens_rel"), r.v("output_tokens_mean")
    ref = finite(get_path(r.t, "quality", "output_length", "ref_mean_new_tokens"))
    text = "-" if rel is None else f"{rel:.2f}x" + (f" ({mean:.0f} vs {ref:.0f})" if mean is not None and ref else "")
    return text, {"output_tokens_mean": mean, "output_tokens_p95": r.v("output_tokens_p95"),
                  "output_tokens_rel": rel,
                  "output_budget_hit_rate": finite(get_path(r.t, "quality", "output_length", "budget_hit_rate"))}


def _flips(r: Row) -> Cell:
    flip, p2f, f2p = r.v("flip_rate"), r.beh.flips_pass_to_fail, r.beh.flips_fail_to_pass
    text = "-" if flip is None else f"{100 * flip:.1f}%" + (
        f" ({p2f}↓ {f2p}↑)" if isinstance(p2f, int) and isinstance(f2p, int) else "")
    return text, {"flip_rate": flip, "flips_pass_to_fail": p2f, "flips_fail_to_pass": f2p}


def _lm_eval(r: Row) -> Cell:
    lm = get_path(r.t, "quality", "lm_eval") or {}
    text = "; ".join(f"{task} {k} {v:.3f}" for task, ms in lm.items() if isinstance(ms, dict)
                     for k, v in ms.items()) or ("skipped" if "skipped" in lm else "-")
    return text, {"lm_eval": text if lm else None}


def _pareto(r: Row) -> Cell:
    try:
        mark = r.a.pareto.entry(r.name).mark
    except KeyError:  # pragma: no cover - every tier is in the front's entries
        mark = "-"
    return mark, {"pareto": mark}


def eager_gpu_decode(t: TierResult) -> bool:
    """True for a tier whose decode figures were measured eagerly on CUDA (a transformers
    tier's ``decode_mode``; engines with one decode loop record None): launch-bound there,
    the table marks them "eager"."""
    return t.device == "cuda" and t.decode_mode == "eager"


def static_decode_in_parts(t: TierResult) -> bool:
    """True for a tier whose static decode did not run as one compiled graph per step: the
    engine's ``decode_check`` (:mod:`qeval.engines.hf`) records graph breaks, a step compiled
    without ``fullgraph``, or dynamo's recompile limit hit (frames past it run eagerly).
    The table marks its decode figures "part-eager"; its note (``decode_note``) says why."""
    chk = t.decode_check or {}
    return t.decode_mode == "static" and bool(chk.get("graph_breaks") or chk.get("fullgraph") is False
                                              or chk.get("recompile_limit_hit"))


def _decode_graph(r: Row) -> Cell:
    """The CSV's ``decode_graph``: ``one graph``, ``N graphs, B breaks`` (parts ran eagerly)
    or ``-`` (no static decode, or a run from before issue 48)."""
    chk = r.t.decode_check
    if r.t.decode_mode != "static" or not chk:
        return "-", {"decode_graph": None}
    if not static_decode_in_parts(r.t):
        return "one graph", {"decode_graph": "one graph"}
    text = f"{chk.get('graphs')} graphs, {chk.get('graph_breaks') or 0} breaks" + \
        (", recompile limit hit" if chk.get("recompile_limit_hit") else "")
    return text, {"decode_graph": text}


def _decode(r: Row, d: int) -> Cell:
    dec = r.v("decode_tokens_per_s", d)
    mark = " eager" if eager_gpu_decode(r.t) else (" part-eager" if static_decode_in_parts(r.t) else "")
    text = _f(dec, ".3g") + (mark if dec is not None else "")
    return text, {f"decode_tokens_per_s_{d}": dec}


def kv_base_tier(tiers: dict[str, TierResult], name: str) -> str | None:
    """For an int8-KV tier, the tier with the same spec and the model's KV cache (or None)."""
    spec = dict(tiers[name].spec) if name in tiers else {}
    if spec.get("kv_cache") != "int8":
        return None
    want = {k: v for k, v in spec.items() if k not in ("name", "kv_cache", "flash_attn")}
    for other, o in tiers.items():
        os_ = dict(o.spec)
        if other != name and os_.get("kv_cache", "model") == "model" and \
                {k: v for k, v in os_.items() if k not in ("name", "kv_cache", "flash_attn")} == want:
            return other
    return None


# ---- long context by document depth ----------------------------------------------------

def long_context_depths(tiers: dict[str, TierResult]) -> list[int]:
    """Document depths (tokens) with a long-context result in any tier
    (``quality.long_context.depths``), ascending."""
    found: set[int] = set()
    for t in tiers.values():
        ds = get_path(t, "quality", "long_context", "depths")
        if isinstance(ds, dict):
            found.update(int(d) for d in ds if str(d).isdigit())
    return sorted(found)


LC_FIGURES = ("lc_recall", "lc_recall_ci_low", "lc_recall_ci_high", "lc_flip_rate", "lc_kld_mean",
              "lc_same_top_rate", "lc_ppl_ratio")


def long_context_at(t: TierResult | None, depth: int, is_reference: bool = False) -> dict[str, Any]:
    """A tier's long-context figures at ``depth`` (tokens), read through the metric table:
    ``{lc_recall, lc_recall_ci_low, lc_recall_ci_high, lc_flip_rate, lc_kld_mean,
    lc_same_top_rate, lc_ppl_ratio, flips_pass_to_fail, flips_fail_to_pass}`` (None when
    absent). The reference is not rescored against itself: where it has recall at that
    depth its KLD is 0, same-top 1 and PPL ratio 1 by definition."""
    has = metric_value(t, "lc_recall", depth) is not None
    out: dict[str, Any] = {m: metric_value(t, m, depth, is_reference=is_reference and has) for m in LC_FIGURES}
    row = get_path(t, "quality", "long_context", "depths", str(depth))
    out["flips_pass_to_fail"] = get_path(row, "flips_pass_to_fail")
    out["flips_fail_to_pass"] = get_path(row, "flips_fail_to_pass")
    return out


def kv_long_context_change(tiers: dict[str, TierResult], name: str, base: str, reference: str,
                           depths: list[int]) -> str | None:
    """``@d recall ±x pp, KLD ±y; ...``: an int8-KV tier's long-context recall
    (percentage points) and KLD over the last document tokens (nats) minus its base tier's at
    each depth, or None without figures."""
    parts = []
    for d in depths:
        mine = long_context_at(tiers.get(name), d, name == reference)
        theirs = long_context_at(tiers.get(base), d, base == reference)
        bits = []
        if mine["lc_recall"] is not None and theirs["lc_recall"] is not None:
            bits.append(f"recall {100 * (mine['lc_recall'] - theirs['lc_recall']):+.1f} pp")
        if mine["lc_kld_mean"] is not None and theirs["lc_kld_mean"] is not None:
            bits.append(f"KLD {mine['lc_kld_mean'] - theirs['lc_kld_mean']:+.3g}")
        if bits:
            parts.append(f"@{d} " + ", ".join(bits))
    return "; ".join(parts) if parts else None


def _lc(r: Row, d: int) -> dict[str, Any]:
    return long_context_at(r.t, d, r.quality_is_ref and r.ok)


def _lc_recall(r: Row, d: int) -> Cell:
    lc = _lc(r, d)
    pr, lo, hi = lc["lc_recall"], lc["lc_recall_ci_low"], lc["lc_recall_ci_high"]
    text = "-" if pr is None else (f"{100 * pr:.1f}" + (
        f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None and hi is not None else ""))
    return text, {f"recall_{d}": pr, f"recall_ci_low_{d}": lo, f"recall_ci_high_{d}": hi}


def _lc_flips(r: Row, d: int) -> Cell:
    lc = _lc(r, d)
    flip, p2f, f2p = lc["lc_flip_rate"], lc["flips_pass_to_fail"], lc["flips_fail_to_pass"]
    text = "-" if flip is None else f"{100 * flip:.0f}%" + (
        f" ({p2f}↓ {f2p}↑)" if isinstance(p2f, int) and isinstance(f2p, int) else "")
    return text, {f"recall_flip_rate_{d}": flip}


def _kv_lc_text(r: Row) -> str | None:
    base = kv_base_tier(r.a.tiers, r.name)
    if base is None or not r.ok:
        return None
    return kv_long_context_change(r.a.tiers, r.name, base, r.a.reference, long_context_depths(r.a.tiers))


def _reused_text(r: Row) -> str | None:
    """``quality reused (key …)`` when the tier's quality result came from an earlier run
    with the same content key (issue 18); speed, memory and load never do."""
    if get_path(r.t, "quality", "reused") is True:
        return f"quality reused (content key {get_path(r.t, 'quality', 'content_key')}; --fresh recomputes)"
    return None


def served_text(served: dict | None) -> str | None:
    """A served tier's prompt mode and where its token counts came from, for the row's
    notes (``prompt mode text; token counts: server usage; tokenizer check: chat template
    +3 tokens on the server``); None for a tier in tokens mode whose counts are the
    server's token ids (what every served tier did before prompt modes), or no record."""
    if not isinstance(served, dict):
        return None
    mode, counts = served.get("prompt_mode"), served.get("token_counts")
    if mode in (None, "tokens") and counts in (None, "server token ids"):
        return None
    out = f"prompt mode {mode or 'tokens'}" + (f"; token counts: {counts}" if counts else "")
    diffs = {c.get("difference") for c in served.get("tokenizer_check") or [] if isinstance(c, dict)}
    diffs.discard(None)
    if diffs:
        out += "; tokenizer check: the server's template " + ", ".join(f"{d:+d}" for d in sorted(diffs)) + \
            " tokens against the source's"
    return out


def _notes(r: Row) -> Cell:
    notes = [r.slow.text] if r.slow else []
    base = kv_base_tier(r.a.tiers, r.name)
    lc_change = _kv_lc_text(r)
    if lc_change:
        notes.append(f"int8 KV vs {base} at long context: {lc_change}")
    if base is not None and r.ok:
        d = max(r.a.depths)
        other = r.a.tiers[base]
        mine, theirs = (metric_value(x, "ttft_s", d) for x in (r.t, other))
        if mine and theirs:
            notes.append(f"int8 KV adds {100 * (mine / theirs - 1):+.0f}% prefill time vs {base} @{d}")
        fa, fa_base = r.t.flash_attn, other.flash_attn
        if fa is not None and fa_base is not None and bool(fa) != bool(fa_base):
            notes.append(f"flash attention {'on' if fa else 'off'} here, {'on' if fa_base else 'off'} in {base}: "
                         "the comparison with it mixes two changes")
        dm, dm_base = r.t.decode_mode, other.decode_mode
        if dm and dm_base and dm != dm_base:  # int8 KV cannot be compiled: eager beside a static twin
            notes.append(f"decode {dm} here, {dm_base} in {base}: the comparison with it mixes two changes")
    if eager_gpu_decode(r.t):
        notes.append("eager decode on the GPU (dynamic cache, no torch.compile): bound by kernel launches, "
                     "not bandwidth")
    if r.t.decode_note:
        notes.append(str(r.t.decode_note))
    served = served_text(r.t.served)
    if served:
        notes.append(served)
    not_measured = get_path(r.t, "quality", "fidelity", "not_measured")
    if not_measured:
        notes.append(str(not_measured))
    fb = get_path(r.t, "quant", "fallback_tensors")
    if isinstance(fb, int) and fb > 0:  # llama.cpp moved tensors off the nominal type (shape rules)
        types = get_path(r.t, "quant", "tensor_types")
        types = types if isinstance(types, dict) else {}  # quant keeps method extras: shapes not promised
        n_q = sum(v for k, v in types.items() if isinstance(v, int) and str(k).upper() not in ("F32", "F16", "BF16")) or None
        falls = get_path(r.t, "quant", "fallbacks")
        kinds = ", ".join(f"{k} ×{v}" for k, v in (falls if isinstance(falls, dict) else {}).items())
        notes.append(f"{fb}{f' of {n_q}' if n_q else ''} quantized tensors fell back from the nominal type"
                     + (f" ({kinds})" if kinds else ""))
    reused = _reused_text(r)
    if reused:
        notes.append(reused)
    timed_out = get_path(r.t, "quality", "behaviour", "checks_timed_out")
    if timed_out:
        notes.append(f"{timed_out} check{'s' if timed_out > 1 else ''} timed out (not judged)")
    if not r.ok and r.t.error:
        notes.append(short_error(r.t.error))  # a failed tier's error may hold a whole log
    if r.t.load is not None and r.t.load.stopped:
        notes.append(f"partial load: {short_error(r.t.load.stopped)}")
    elif r.t.load is not None and r.t.load.error:
        notes.append(f"load sweep failed: {short_error(r.t.load.error)}")
    return "; ".join(notes), {"slow_path": bool(r.slow)}


def _load(r: Row) -> Cell:
    """The load sweep's CSV fields (no Markdown/HTML cell: the load tables show it): depth,
    scheduling, users at SLO, best decode tokens/s, requests not admitted, and per
    concurrency any tier recorded (:func:`load_concurrencies`) decode tokens/s, batching
    gain, TTFT/ITL p95, goodput, peak GiB and admission; with an open loop, the knee
    (req/s) and per offered rate any tier recorded (:func:`load_rates`) the achieved rate,
    TTFT/ITL p95, error rate and refused / timed-out counts."""
    load = r.t.load or LoadSection()
    raw: dict[str, Any] = {"load_depth": load.depth,
                           "load_scheduling": ",".join(load.scheduling) or None,
                           "users_at_slo": _whole(r.v("users_at_slo")),
                           "load_max_decode_tokens_per_s": finite(load.max_decode_tokens_per_s),
                           "load_requests_not_admitted": load.requests_not_admitted}
    for c in load_concurrencies(r.a.tiers):
        p = load.point(c)
        pc = p or LoadPoint(concurrency=c)
        raw.update({f"load_decode_tokens_per_s_c{c}": finite(pc.decode_tokens_per_s),
                    f"load_batching_gain_c{c}": finite(load.batching_gain.get(str(c))),
                    f"load_ttft_p95_s_c{c}": finite(pc.ttft_s.p95 if pc.ttft_s else None),
                    f"load_itl_p95_s_c{c}": finite(pc.itl_s.p95 if pc.itl_s else None),
                    f"load_goodput_tokens_per_s_c{c}": finite(pc.goodput_tokens_per_s),
                    f"load_peak_gib_c{c}": _r(finite(pc.peak_bytes), GIB),
                    f"load_admitted_c{c}": p.admitted if p else None})
    rates = load_rates(r.a.tiers)
    if rates:
        ar = load.arrivals
        raw["load_knee_rps"] = finite(ar.knee.rate_rps) if ar and ar.knee else None
        by_rate = {p.rate_rps: p for p in (ar.rate_points if ar else [])}
        for x in rates:
            p = by_rate.get(x)
            k = f"{x:g}"
            raw.update({f"load_achieved_rps_r{k}": finite(p.achieved_rps) if p else None,
                        f"load_ttft_p95_s_r{k}": finite(p.ttft_s.p95) if p and p.ttft_s else None,
                        f"load_itl_p95_s_r{k}": finite(p.itl_s.p95) if p and p.itl_s else None,
                        f"load_error_rate_r{k}": finite(p.error_rate) if p else None,
                        f"load_refused_r{k}": p.refused if p else None,
                        f"load_timed_out_r{k}": p.timed_out if p else None,
                        f"load_meets_slo_r{k}": p.meets_slo if p else None})
    return "", raw


def _backend(r) -> tuple[str, dict]:
    """The engine's backend as the row stores it, with llama.cpp's CPU variant where one ran
    (``llama.cpp-cpu (zen4)``; the row's ``runtime.cpu_variant``, qeval.engines.ggml_cpu),
    and the better variants passed over with why (``haswell; passed over zen4: SIGILL
    (illegal instruction) in the probe``). A transformers tier that torch computed in a
    dtype the run's CPU has no instructions for says so in its stored backend
    (``torch-bfloat16 (emulated on this CPU: no AVX512_BF16)``, qeval.engines.hf); the cell
    shows it as measured, never re-judged on the machine that renders the table. CSV adds
    ``cpu_variant``, ``cpu_instruction_sets``, ``cpu_passed_over`` and ``dtype_emulated``
    (the row's, e.g. ``bfloat16``; empty when native)."""
    rt = r.t.runtime or {}
    variant = rt.get("cpu_variant")
    isa = rt.get("instruction_sets")
    over = [str(x) for x in rt.get("passed_over") or []]
    text = str(r.t.backend or "-") + (f" ({variant}" + "".join(f"; passed over {x}" for x in over) + ")"
                                      if variant else "")
    return text, {"backend": r.t.backend, "cpu_variant": variant,
                  "cpu_instruction_sets": " ".join(isa) if isa else None,
                  "cpu_passed_over": "; ".join(over) or None, "dtype_emulated": r.t.dtype_emulated}


#: Every column of the tier table, in order (CSV fields follow the same order).
COLUMNS: tuple[Column, ...] = (
    Column("tier", lambda r: (r.name, {"tier": r.name}), "build"),
    Column("status", lambda r: (r.t.status, {"status": r.t.status}), "build"),
    Column("weights GiB", lambda r: (_gib(r.v("weight_bytes")), {"weights_gib": _r(r.v("weight_bytes"), GIB)}),
           "build", numeric=True),
    Column("bits/w", lambda r: (_f(r.v("bits_per_weight"), ".2f"), {"bits_per_weight": r.v("bits_per_weight")}),
           "build", html_header="bits/weight", numeric=True),
    Column("backend", lambda r: _backend(r), "build"),
    Column("KV cache", lambda r: (str(r.t.kv_cache or "-"), {"kv_cache": r.t.kv_cache}), "build", md=False),
    Column("attention, KV", _attention, "build", html_header="attention path, KV type (as run)"),
    Column("KV B/token", lambda r: (_f(r.v("kv_bytes_per_token"), ",.0f"),
                                    {"kv_bytes_per_token": _whole(r.v("kv_bytes_per_token"))}),
           "build", html_header="KV bytes/token", numeric=True),
    Column("runtime GiB", lambda r: (_gib(r.v("runtime_bytes")), {"runtime_gib": _r(r.v("runtime_bytes"), GIB),
                                                                  "runtime_engine_gib": _r(r.v("runtime_engine_bytes"), GIB)}),
           "build", numeric=True),
    Column("error", lambda r: ("" if r.ok else str(r.t.error or ""), {"error": r.t.error}), "build", md=False),
    Column("decode mode", lambda r: (str(r.t.decode_mode or "-"), {"decode_mode": r.t.decode_mode}), None, md=False),
    Column("decode graph", _decode_graph, None, md=False),
    Column("peak GiB", lambda r, d: (_gib(r.v("peak_bytes", d)), {f"peak_gib_{d}": _r(r.v("peak_bytes", d), GIB)}),
           "speed", per_depth=True, numeric=True),
    Column("peak split", _peak_split, None, md=False, per_depth=True),
    # the report's "what the peak holds" table, at the analysis depth (CSV: the per-depth columns)
    Column("peak GiB", _mem("peak_bytes"), "memory", md=False, numeric=True),
    Column("weights", _mem("peak_weights_bytes"), "memory", md=False, numeric=True),
    Column("KV cache", _mem("peak_kv_cache_bytes"), "memory", md=False, numeric=True),
    Column("rest", _mem("peak_other_bytes"), "memory", md=False, numeric=True),
    Column("runtime GiB", _mem("runtime_bytes", False), "memory", md=False, numeric=True),
    Column("of which engine libraries", _mem("runtime_engine_bytes", False), "memory", md=False, numeric=True),
    Column("reserved, unallocated", _mem("reserved_unallocated_bytes"), "memory", md=False, numeric=True),
    Column("kind", lambda r: (str(get_path(r.t, "memory", "kind") or "-"), {}), "memory", md=False),
    Column("TTFT s", lambda r, d: (_f(r.v("ttft_s", d), ".3g"), {f"ttft_s_{d}": r.v("ttft_s", d)}),
           "speed", per_depth=True, numeric=True),
    Column("decode tok/s", _decode, "speed", per_depth=True, html_header="tok/s", numeric=True),
    Column("roofline %", lambda r, d: (_f(r.v("roofline_share", d), ".0f", 100),
                                       {f"roofline_share_{d}": r.v("roofline_share", d)}),
           "speed", per_depth=True, numeric=True),
    Column("KLD mean ± se", _kld, "quality", numeric=True),
    Column("vs noise floor", _floor_cell, "quality"),
    Column("same-top %", lambda r: (_f(r.v("same_top_rate"), ".1f", 100), {"same_top_rate": r.v("same_top_rate")}),
           "quality", numeric=True),
    Column("PPL ratio", lambda r: (_f(r.v("ppl_ratio"), ".4f"), {"ppl_ratio": r.v("ppl_ratio")}), "quality",
           numeric=True),
    Column("pass % [95% CI]", _pass, "quality", numeric=True),
    Column("flips", _flips, "quality", numeric=True),
    Column("budget exh. %", lambda r: (_f(r.v("budget_exhausted_rate"), ".1f", 100),
                                       {"budget_exhausted_rate": r.v("budget_exhausted_rate")}), "quality",
           numeric=True),
    Column("out tokens vs ref", _out_len, "quality", html_header="new tokens per answer vs reference",
           numeric=True),
    Column("recall % [95% CI]", _lc_recall, "long_context", per_depth=True, depths="long_context", numeric=True),
    Column("recall flips", _lc_flips, "long_context", md=False, per_depth=True, depths="long_context",
           html_header="flips", numeric=True),
    Column("KLD", lambda r, d: (_f(_lc(r, d)["lc_kld_mean"], ".4f"), {f"lc_kld_mean_{d}": _lc(r, d)["lc_kld_mean"]}),
           "long_context", per_depth=True, depths="long_context", numeric=True),
    Column("same-top %", lambda r, d: (_f(_lc(r, d)["lc_same_top_rate"], ".1f", 100),
                                       {f"lc_same_top_rate_{d}": _lc(r, d)["lc_same_top_rate"]}),
           "long_context", md=False, per_depth=True, depths="long_context", numeric=True),
    Column("PPL ratio", lambda r, d: (_f(_lc(r, d)["lc_ppl_ratio"], ".4f"), {f"lc_ppl_ratio_{d}": _lc(r, d)["lc_ppl_ratio"]}),
           None, md=False, per_depth=True, depths="long_context", numeric=True),
    Column("int8 KV vs base", lambda r: (_kv_lc_text(r) or "", {}), "long_context", md=False),
    Column("quality engine", lambda r: (str(get_path(r.t, "quality", "engine") or "-"),
                                        {"quality_engine": get_path(r.t, "quality", "engine")}), "quality"),
    Column("lm-eval", _lm_eval, "quality"),
    Column("users @SLO", lambda r: (_f(r.v("users_at_slo"), "g"), {}), "quality", numeric=True),  # CSV: _load
    Column("Pareto", _pareto, "quality"),
    Column("notes", _notes, "quality",
           html_cell=lambda r: "; ".join(x for x in ((r.slow.text if r.slow else ""), _reused_text(r) or "") if x)),
    Column("load", lambda r: _load(r), None, md=False),
)


@dataclass
class TierTable:
    """The tier table in three shapes: Markdown (``headers``, ``rows``), CSV
    (``csv_fields``, ``csv_rows`` of raw values) and the HTML sections (``html``:
    section -> {"headers": [{"text", "numeric"}, ...], "rows": [[cell, ...], ...]}; the
    speed section repeats ``html_depth_headers`` for every depth, the long_context section
    ``html_lc_depth_headers`` for every one of ``lc_depths`` and then its other headers).
    Without long-context results the long_context section has no rows."""
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    csv_fields: list[str] = field(default_factory=list)
    csv_rows: list[dict[str, Any]] = field(default_factory=list)
    html: dict[str, dict[str, list]] = field(default_factory=dict)
    html_depth_headers: list[dict] = field(default_factory=list)
    html_lc_depth_headers: list[dict] = field(default_factory=list)
    lc_depths: list[int] = field(default_factory=list)


def _column_depths(c: Column, a: RunAnalysis, lc_depths: list[int]) -> list[int | None]:
    if not c.per_depth:
        return [None]
    return list(a.depths if c.depths == "speed" else lc_depths)


def tier_table(a: RunAnalysis, slow: dict[str, SlowPath] | None = None) -> TierTable:
    """Build the per-tier table for every tier of the analysed run (recipe order), from :data:`COLUMNS`."""
    slow = slow or {}
    tab = TierTable(html={s: {"headers": [], "rows": []} for s in SECTIONS})
    tab.lc_depths = lc_depths = long_context_depths(a.tiers)
    first = COLUMNS[0]  # the tier name starts every HTML table
    for c in COLUMNS:
        ds = _column_depths(c, a, lc_depths)
        for d in ds:
            if c.md:
                tab.headers.append(c.header if d is None else f"{c.header} @{d}")
            if c.section and d in (None, ds[0]):
                tab.html[c.section]["headers"].append({"text": c.html_header or c.header, "numeric": c.numeric})
    tab.html_depth_headers = [{"text": c.html_header or c.header, "numeric": c.numeric} for c in COLUMNS
                              if c.per_depth and c.depths == "speed" and c.section == "speed"]
    tab.html_lc_depth_headers = [{"text": c.html_header or c.header, "numeric": c.numeric} for c in COLUMNS
                                 if c.per_depth and c.depths == "long_context" and c.section == "long_context"]
    for sec in SECTIONS[1:]:
        tab.html[sec]["headers"].insert(0, {"text": first.header, "numeric": first.numeric})
    rows = dict(a.tiers)
    rows.update(pair_results(a.speculative, a.tiers))  # speculative pairs: memory both, speed measured, quality the target's
    for name, t in rows.items():
        row = Row(name, t, a, slow.get(name))
        md: list[str] = []
        raw: dict[str, Any] = {}
        html: dict[str, list[str]] = {s: ([] if s == "build" else [row.name]) for s in SECTIONS}
        # HTML tables group per-depth cells by depth (all of a depth's columns together),
        # then the section's other columns
        by_depth: dict[str, dict[int, list[str]]] = {sec: {} for sec in SECTIONS}
        tail: dict[str, list[str]] = {sec: [] for sec in SECTIONS}
        for c in COLUMNS:
            for d in _column_depths(c, a, lc_depths):
                text, values = c.cell(row) if d is None else c.cell(row, d)
                raw.update(values)
                if c.md:
                    md.append(text)
                if c.section:
                    cell = c.html_cell(row) if c.html_cell else text
                    (tail[c.section] if d is None else by_depth[c.section].setdefault(d, [])).append(cell)
        tab.rows.append(md)
        tab.csv_rows.append(raw)
        for sec, cells in html.items():
            cells += [x for d in sorted(by_depth[sec]) for x in by_depth[sec][d]] + tail[sec]
            if sec != "long_context" or (lc_depths and row.ok):
                tab.html[sec]["rows"].append(cells)
    tab.csv_fields = _csv_fields(a, lc_depths)
    return tab


def _csv_fields(a: RunAnalysis, lc_depths: list[int]) -> list[str]:
    """The CSV fields, in column order: the keys the cells fill (taken from the cells of a
    placeholder tier, so they are written once, in :data:`COLUMNS`)."""
    row = Row("", TierResult(tier="", method="", status="not_built"), a, None)
    fields: list[str] = []
    for c in COLUMNS:
        for d in _column_depths(c, a, lc_depths):
            fields += list((c.cell(row) if d is None else c.cell(row, d))[1])
    return fields


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` inside cells escaped)."""
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


# ---- the load table ----------------------------------------------------------------------

def load_concurrencies(tiers: dict[str, TierResult]) -> list[int]:
    """Every concurrency any tier's load sweep recorded, ascending."""
    return sorted({p.concurrency for t in tiers.values() if t.load is not None for p in t.load.points})


def load_rates(tiers: dict[str, TierResult]) -> list[float]:
    """Every offered rate (req/s) any tier's open loop measured, ascending."""
    return sorted({p.rate_rps for t in tiers.values() if t.load is not None and t.load.arrivals is not None
                   for p in t.load.arrivals.rate_points if p.rate_rps})


LOAD_HEADERS = ["tier", "scheduling", "streams", "decode tok/s", "gain", "req/s", "TTFT p50/p95/p99 s",
                "ITL p50/p95/p99 s", "e2e p50/p95 s", "goodput tok/s", "peak GiB", "KV GiB at peak", "SLO"]


def _trio(d: Any, keys: tuple[str, ...]) -> str:
    return "/".join(_f(getattr(d, k, None) if d is not None else None, ".3g") for k in keys)


def load_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the load table: one per tier and concurrency (``LOAD_HEADERS``); a point not
    admitted shows the reason; a failed sweep one row with its error."""
    rows = []
    for name, t in tiers.items():
        load = t.load
        if load is None:
            continue
        if load.error and not load.points:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"failed: {short_error(load.error)}"])
            continue
        if load.stopped:  # the points the stage finished before it stopped, then why it stopped
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         f"partial: {short_error(load.stopped)}"])
        for p in load.points:
            c = p.concurrency
            if not p.admitted:
                rows.append([name, "-", str(c), "-", "-", "-", "-", "-", "-", "-", "-", "-",
                             f"not admitted ({p.requests_not_admitted} requests): {p.reason}"])
                continue
            rows.append([name, str(p.scheduling or "-"), str(c), _f(p.decode_tokens_per_s, ".3g"),
                         _f(load.batching_gain.get(str(c)), ".2f", suffix="x"), _f(p.requests_per_s, ".3g"),
                         _trio(p.ttft_s, ("p50", "p95", "p99")), _trio(p.itl_s, ("p50", "p95", "p99")),
                         _trio(p.e2e_s, ("p50", "p95")), _f(p.goodput_tokens_per_s, ".3g"),
                         _gib(p.peak_bytes, 3), _gib(p.kv_bytes_peak, 4),
                         "meets" if p.meets_slo else "misses"])
    return rows


def load_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the load table measured (depth, tokens, SLO), from the first sweep,
    and which swept tiers ran a dtype torch emulated on the run's CPU (their rows'
    ``dtype_emulated``: :func:`qeval.analysis.ladder.emulated_caption`)."""
    load = next((t.load for t in tiers.values() if t.load is not None and t.load.points), None)
    if load is None:
        return None
    slo = load.slo or LoadSlo()
    n = load.requests_per_stream
    swept = [name for name, t in tiers.items() if t.load is not None and t.load.points]
    emulated = emulated_caption(emulated_members(tiers, swept), swept)
    return (f"Closed loop: each stream sends {n} request{'' if n == 1 else 's'} in turn, each a fresh "
            f"{load.depth}-token prompt and {load.output_tokens} new tokens; prefill in chunks of "
            f"{load.prefill_chunk} tokens. SLO: TTFT p95 <= {slo.ttft_p95_s} s and ITL p95 <= "
            f"{slo.itl_p95_s} s. decode tok/s = all new tokens / run time; gain = / 1 stream; goodput = "
            "tokens of requests within the SLO / run time (qeval.measure.load)." + (f" {emulated}" if emulated else ""))


RATE_HEADERS = ["tier", "point", "offered req/s", "achieved req/s", "TTFT p50/p95/p99 s", "ITL p50/p95/p99 s",
                "e2e p50/p95/p99 s", "queue wait p50/p95 s", "done/refused/timed out/failed", "error rate",
                "goodput tok/s", "KV GiB at peak", "SLO"]


def _point_label(p: RatePoint) -> str:
    return f"{p.rate_rps:g} req/s" if p.kind == "rate" and p.rate_rps else p.kind


def rate_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the open-loop table (``RATE_HEADERS``): one per tier and measured point, in
    the order run (a sweep's synchronous and throughput ends first), then one row per tier
    with its knee and, when the sweep stopped early, why."""
    rows = []
    for name, t in tiers.items():
        ar = t.load.arrivals if t.load is not None else None
        if ar is None:
            continue
        for p in ar.points:
            if p.reason:
                rows.append([name, _point_label(p), _f(p.rate_rps, ".3g"), "-", "-", "-", "-", "-",
                             f"0/0/0/{p.failed}", "-", "-", "-", f"not run: {short_error(p.reason)}"])
                continue
            verdict = "-" if p.meets_slo is None else ("meets" if p.meets_slo else "misses")
            if p.saturated:
                verdict += ", saturated"
            rows.append([name, _point_label(p), _f(p.offered_rps, ".3g"), _f(p.achieved_rps, ".3g"),
                         _trio(p.ttft_s, ("p50", "p95", "p99")), _trio(p.itl_s, ("p50", "p95", "p99")),
                         _trio(p.e2e_s, ("p50", "p95", "p99")), _trio(p.queue_wait_s, ("p50", "p95")),
                         f"{p.completed}/{p.refused}/{p.timed_out}/{p.failed}", _f(p.error_rate, ".1%"),
                         _f(p.goodput_tokens_per_s, ".3g"), _gib(p.kv_bytes_peak, 4), verdict])
        k = ar.knee
        if k is not None:
            knee = f"knee {k.rate_rps:g} req/s" if k.rate_rps is not None else "no knee"
            rows.append([name, "knee", _f(k.rate_rps, ".3g"), "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         f"{knee}: {k.note}" + (f"; {ar.stopped}" if ar.stopped else "")])
    return rows


def rate_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the open loop measured (process, queue, SLO), from the first tier with one."""
    load = next((t.load for t in tiers.values() if t.load is not None and t.load.arrivals is not None), None)
    if load is None or load.arrivals is None:
        return None
    ar, slo = load.arrivals, load.slo or LoadSlo()
    length = f"{ar.requests_per_point} requests" if ar.requests_per_point else f"{ar.duration_s:g} s of arrivals"
    err = f" and at most {slo.max_error_rate:.0%} of requests refused, timed out or failed" \
        if slo.max_error_rate is not None else ""
    return (f"Open loop: {ar.process} arrivals (seed {ar.seed}), {length} per rate, each a fresh "
            f"{load.depth}-token prompt and {load.output_tokens} new tokens; {ar.slots} served at once, up to "
            f"{ar.max_waiting} waiting, dropped after {ar.timeout_s:g} s waiting. SLO: TTFT p95 <= {slo.ttft_p95_s} s, "
            f"ITL p95 <= {slo.itl_p95_s} s{err}. TTFT counts from the arrival (queue wait in it); achieved = completed "
            f"/ run time; a point is saturated when achieved < offered x {1 - ar.saturation_share:.2f}; the knee is "
            "the highest measured rate meeting the SLO (qeval.measure.openloop).")


# ---- the workload tables: shared prefix, interference, burst, context x concurrency grid --

PREFIX_HEADERS = ["tier", "prefix KV", "streams", "TTFT p50/p95 s", "ITL p95 s", "decode tok/s", "from cache",
                  "users at SLO", "SLO"]


def prefix_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the shared-prefix table (``PREFIX_HEADERS``): per tier, per run (prefilled per
    request, then reused) and concurrency, TTFT and the share of prompt tokens served from
    the cache; a point not admitted shows the reason."""
    rows = []
    for name, t in tiers.items():
        pre = t.load.prefix if t.load is not None else None
        if pre is None:
            continue
        for run in pre.runs:
            label = "reused" if run.reuse else "prefilled"
            for p in run.points:
                if not p.admitted:
                    rows.append([name, label, str(p.concurrency), "-", "-", "-", "-", "-",
                                 f"not admitted: {short_error(p.reason or '')}"])
                    continue
                rows.append([name, label, str(p.concurrency), _trio(p.ttft_s, ("p50", "p95")),
                             _f(p.itl_s.p95 if p.itl_s else None, ".3g"), _f(p.decode_tokens_per_s, ".3g"),
                             _f(p.prefix_hit_rate, ".0%"), _f(run.users_at_slo, "g"),
                             "-" if p.meets_slo is None else ("meets" if p.meets_slo else "misses")])
        if pre.not_measured:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", f"not measured: {pre.not_measured}"])
    return rows


def prefix_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the shared-prefix table measured."""
    pre = next((t.load.prefix for t in tiers.values() if t.load is not None and t.load.prefix is not None), None)
    if pre is None:
        return None
    return (f"Shared prefix: every request is the same {pre.shared_prefix_tokens}-token prefix (a system prompt) "
            f"and its own {pre.depth - pre.shared_prefix_tokens} tokens; the prefix's KV cache reused across "
            "requests or prefilled per request. from cache = prompt tokens served from the cache / all prompt "
            "tokens (the server's own count for served tiers).")


INTERFERENCE_HEADERS = ["tier", "long prompt", "streams", "prefill", "long TTFT s", "max gap s", "ITL p99 in window s",
                        "decode tok/s before", "in window", "lost tok/s", "tokens lost", "long steps"]


def interference_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the interference table (``INTERFERENCE_HEADERS``): per tier, the long prompt
    unchunked then per chunk size; a tier where it was not measured says why."""
    rows = []
    for name, t in tiers.items():
        it = t.load.interference if t.load is not None else None
        if it is None:
            continue
        for r in it.rows:
            rows.append([name, str(it.prompt_tokens), str(it.streams),
                         "unchunked" if r.chunk_size is None else f"{r.chunk_size}/step",
                         _f(r.long_ttft_s, ".3g"), _f(r.max_gap_s, ".3g"), _f(r.itl_p99_s, ".3g"),
                         _f(r.baseline_tokens_per_s, ".3g"), _f(r.window_tokens_per_s, ".3g"),
                         _f(r.lost_tokens_per_s, ".3g"), _f(r.lost_tokens, ".3g"), _f(r.long_steps, "g")])
        if it.not_measured:
            rows.append([name, str(it.prompt_tokens), str(it.streams), "-", "-", "-", "-", "-", "-", "-", "-",
                         f"not measured: {short_error(it.not_measured)}"])
    return rows


def interference_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the interference table measured."""
    it = next((t.load.interference for t in tiers.values()
               if t.load is not None and t.load.interference is not None), None)
    if it is None:
        return None
    return (f"Interference: {it.streams} streams decode; a {it.prompt_tokens}-token prompt arrives and is prefilled "
            "in one engine step (unchunked) or in chunks shared with the streams' decode. The window runs from "
            "its arrival to its first token; max gap and ITL p99 are the running streams' inter-token gaps in it; "
            "lost tok/s = their decode rate before the window - inside it (qeval.measure.interference).")


BURST_HEADERS = ["tier", "requests", "slots", "done/refused/timed out/failed", "TTFT p50/p95 s", "last first token s",
                 "drained in s", "decode tok/s", "scheduling"]


def burst_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the burst table (``BURST_HEADERS``): per tier, N requests at once on an idle
    engine; a tier where it was not run says why."""
    rows = []
    for name, t in tiers.items():
        b = t.load.burst if t.load is not None else None
        if b is None:
            continue
        if b.not_measured:
            rows.append([name, str(b.requests), str(b.slots), "-", "-", "-", "-", "-",
                         f"not measured: {short_error(b.not_measured)}"])
            continue
        rows.append([name, str(b.requests), str(b.slots), f"{b.completed}/{b.refused}/{b.timed_out}/{b.failed}",
                     _trio(b.ttft_s, ("p50", "p95")), _f(b.ttft_max_s, ".3g"), _f(b.drain_s, ".3g"),
                     _f(b.decode_tokens_per_s, ".3g"), b.scheduling or "-"])
    return rows


def burst_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the burst table measured."""
    b = next((t.load.burst for t in tiers.values() if t.load is not None and t.load.burst is not None), None)
    if b is None:
        return None
    return (f"Burst: {b.requests} requests arrive at once on an idle engine, {b.slots} served at a time through the "
            "load queue (load.queue: refused past max_waiting, dropped past timeout_s); last first token = the "
            "unluckiest caller's TTFT; drained in = the burst's arrival to the last request's end; scheduling: "
            "as in the open loop, transformers tiers in process run static batches there (qeval's queue admits "
            "each request, which transformers' continuous-batching manager, with a queue of its own, does not "
            "allow) (qeval.serving.burst).")


GRID_HEADERS = ["tier", "depth", "streams", "admitted", "TTFT p95 s", "ITL p95 s", "decode tok/s", "KV GiB at peak",
                "users at SLO (depth)", "SLO / reason"]


def grid_table(tiers: dict[str, TierResult]) -> list[list[str]]:
    """Rows of the context x concurrency grid (``GRID_HEADERS``): per tier, depth and
    concurrency, measured or not admitted with the reason."""
    rows = []
    for name, t in tiers.items():
        g = t.load.grid if t.load is not None else None
        if g is None:
            continue
        for d in g.depths:
            for p in d.points:
                if not p.admitted:
                    rows.append([name, str(d.depth), str(p.concurrency), "no", "-", "-", "-", "-",
                                 _f(d.users_at_slo, "g"), short_error(p.reason or "")])
                    continue
                rows.append([name, str(d.depth), str(p.concurrency), "yes", _f(p.ttft_s.p95 if p.ttft_s else None),
                             _f(p.itl_s.p95 if p.itl_s else None), _f(p.decode_tokens_per_s, ".3g"),
                             _gib(p.kv_bytes_peak, 4), _f(d.users_at_slo, "g"),
                             "-" if p.meets_slo is None else ("meets" if p.meets_slo else "misses")])
    return rows


def grid_caption(tiers: dict[str, TierResult]) -> str | None:
    """One line saying what the grid measured."""
    g = next((t.load for t in tiers.values() if t.load is not None and t.load.grid is not None), None)
    if g is None:
        return None
    return (f"Context x concurrency: the closed loop at each depth and number of streams ({g.output_tokens} new "
            "tokens each). A cell whose KV cache (streams x (depth + new tokens)) does not fit the model's context, "
            "the engine's KV pool or the memory budget after the weights is not admitted and never run; "
            "`qeval plan RUN_DIR` puts its prediction beside each cell.")


def workload_sections(tiers: dict[str, TierResult]) -> list[dict]:
    """The workload tables the run has: ``key`` (prefix | interference | burst | grid), ``title``,
    ``caption``, ``headers``, ``rows``."""
    out = []
    for key, title, rows, headers, caption in (
            ("prefix", "Load: shared prefix", prefix_table(tiers), PREFIX_HEADERS, prefix_caption(tiers)),
            ("interference", "Load: a long prompt landing mid-decode", interference_table(tiers),
             INTERFERENCE_HEADERS, interference_caption(tiers)),
            ("burst", "Load: a burst of requests at once", burst_table(tiers), BURST_HEADERS, burst_caption(tiers)),
            ("grid", "Load: context x concurrency", grid_table(tiers), GRID_HEADERS, grid_caption(tiers))):
        if rows:
            out.append({"key": key, "title": title, "caption": caption or "", "headers": headers, "rows": rows})
    return out


def workload_markdown(tiers: dict[str, TierResult]) -> list[str]:
    """The workload tables as Markdown lines (empty when the run has none)."""
    md: list[str] = []
    for w in workload_sections(tiers):
        md += [f"## {w['title']}", "", w["caption"], "", markdown_table(w["headers"], w["rows"])]
    return md
