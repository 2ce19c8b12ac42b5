"""Tier tables (``table.md``, ``table.csv``) and the self-contained ``report.html``.

Everything here works from the stored JSON of a run folder alone (``run.json`` +
``tiers/*.json``): no model, no torch. Plots are embedded as base64 PNG so the HTML file
can be mailed or attached to a CI job on its own.

Defaults of the report:

* analysis depth: ``gate.depth`` or ``speed.main_depth`` (tokens).
* capacity section: the ``qeval plan`` table (:mod:`qeval.analysis.plan`) of the run's
  tiers with their measured figures (estimates from the source config where a tier has
  none and the config is on this machine): memory = the run's GPU memory when ``run.json``
  records it (see :func:`default_budget_bytes`), else 24 GiB, times the default usable
  share; bandwidth = the run's measured one; context = the deepest speed depth;
  :data:`DEFAULT_USERS` users; overhead :data:`qeval.analysis.capacity.DEFAULT_OVERHEAD_BYTES`.
* "slow path at long context": a tier's decode tokens/s at the deepest depth is below
  ``report.slow_path_fraction`` (default 0.5) x the reference's there.
"""
from __future__ import annotations

import base64
import csv
import io
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..analysis import RunAnalysis, analyse_run
from ..analysis.capacity import DEFAULT_OVERHEAD_BYTES
from ..analysis.gate import validate_section
from ..analysis.pareto import GIB, decode_at, finite, peak_bytes_at
from ..analysis.plan import build_plan, find_config, plan_header, plan_legend, plan_table, read_config, run_memory_bytes
from ..errors import QevalInputError
from ..recipe import ReportSpec
from ..results import STATUS_OK, atomic_write_text, get_path, load_run
from . import plots

DEFAULT_BUDGET_BYTES = 24 * GIB
DEFAULT_USERS = 8
_DTYPE_BITS = {"bfloat16": 16.0, "float16": 16.0, "float32": 32.0}


# ---- small helpers ------------------------------------------------------------------------

def _f(v: Any, fmt: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
    x = finite(v)
    return "-" if x is None else f"{x * scale:{fmt}}{suffix}"


def _gib(v: Any, digits: int = 2) -> str:
    x = finite(v)
    return "-" if x is None else f"{x / GIB:.{digits}f}"


def default_budget_bytes(run: dict | None) -> tuple[int, str]:
    """GPU memory for the report's capacity section: ``(bytes, where it came from)``: what
    ``run.json`` records (:func:`qeval.analysis.plan.run_memory_bytes`), else 24 GiB."""
    v = run_memory_bytes(run)
    if v:
        return v, "the run's GPU memory"
    return DEFAULT_BUDGET_BYTES, "default 24 GiB (no GPU memory recorded in run.json)"


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


def slow_path_flags(tiers: dict[str, dict], reference: str, depth: int,
                    fraction: float = 0.5) -> dict[str, SlowPath]:
    """Tiers whose decode tokens/s at ``depth`` (tokens) is below ``fraction`` x the
    reference's at the same depth. Needs both figures; the reference is never flagged."""
    ref = decode_at(tiers.get(reference), depth)
    out: dict[str, SlowPath] = {}
    if ref is None:
        return out
    for name, t in tiers.items():
        if name == reference or t.get("status") != STATUS_OK:
            continue
        v = decode_at(t, depth)
        if v is not None and v < fraction * ref:
            out[name] = SlowPath(name, depth, v, ref, fraction)
    return out


# ---- the tier table -----------------------------------------------------------------------

@dataclass
class TierTable:
    """The tier table in two shapes: formatted cells (Markdown/HTML) and raw values (CSV).

    CSV units: ``*_gib`` GiB (2**30 bytes), ``*_s`` seconds, ``*_tokens_per_s`` tokens/s,
    ``*_rate``/``*_share`` shares 0..1, ``kv_bytes_per_token`` bytes, KLD nats.
    """
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    csv_fields: list[str] = field(default_factory=list)
    csv_rows: list[dict[str, Any]] = field(default_factory=list)


def tier_table(a: RunAnalysis, slow: dict[str, SlowPath] | None = None) -> TierTable:
    """Build the per-tier table for every tier of the analysed run (recipe order)."""
    slow = slow or {}
    depths = a.depths
    tab = TierTable()
    tab.headers = ["tier", "status", "weights GiB", "bits/w", "backend", "KV B/token"]
    tab.csv_fields = ["tier", "status", "error", "weights_gib", "bits_per_weight", "backend", "kv_cache",
                      "kv_bytes_per_token", "decode_mode"]
    for d in depths:
        tab.headers += [f"peak GiB @{d}", f"TTFT s @{d}", f"decode tok/s @{d}", f"roofline % @{d}"]
        tab.csv_fields += [f"peak_gib_{d}", f"ttft_s_{d}", f"decode_tokens_per_s_{d}", f"roofline_share_{d}"]
    tab.headers += ["KLD mean ± se", "same-top %", "PPL ratio", "pass % [95% CI]", "flips",
                    "budget exh. %", "quality engine", "lm-eval", "users @SLO", "Pareto", "notes"]
    tab.csv_fields += ["kld_mean", "kld_se", "same_top_rate", "ppl_ratio", "pass_rate", "pass_ci_low",
                       "pass_ci_high", "flip_rate", "flips_pass_to_fail", "flips_fail_to_pass",
                       "budget_exhausted_rate", "quality_engine", "lm_eval", "pareto", "slow_path"]
    conc = load_concurrencies(a.tiers)
    tab.csv_fields += ["load_depth", "load_scheduling", "users_at_slo", "load_max_decode_tokens_per_s",
                       "load_requests_not_admitted"]
    for c in conc:
        tab.csv_fields += [f"load_decode_tokens_per_s_c{c}", f"load_batching_gain_c{c}", f"load_ttft_p95_s_c{c}",
                           f"load_itl_p95_s_c{c}", f"load_goodput_tokens_per_s_c{c}", f"load_peak_gib_c{c}",
                           f"load_admitted_c{c}"]
    dtype = get_path(a.recipe, "model", "dtype") or "bfloat16"
    for name, t in a.tiers.items():
        status = t.get("status") or "?"
        is_ref = name == a.reference
        fid = get_path(t, "quality", "fidelity") or {}
        beh = get_path(t, "quality", "behaviour") or {}
        bpw = finite(get_path(t, "quant", "bits_per_weight"))
        if bpw is None and t.get("method") == "bf16" and status == STATUS_OK:
            bpw = _DTYPE_BITS.get(dtype)
        kld = finite(fid.get("kld_mean"))
        kld_se = finite(fid.get("kld_se"))
        ppl = finite(fid.get("ppl_ratio"))
        top = finite(fid.get("same_top_rate"))
        if is_ref and status == STATUS_OK:
            kld = 0.0 if kld is None else kld
            ppl = 1.0 if ppl is None else ppl
            top = 1.0 if top is None else top
        try:
            mark = a.pareto.entry(name).mark
        except KeyError:  # pragma: no cover - every tier is in the front's entries
            mark = "-"
        sp = slow.get(name)
        raw: dict[str, Any] = {
            "tier": name, "status": status, "error": t.get("error"),
            "weights_gib": _r(finite(get_path(t, "memory", "weight_bytes")), GIB),
            "bits_per_weight": bpw, "backend": t.get("backend"), "kv_cache": t.get("kv_cache"),
            "kv_bytes_per_token": _whole(finite(get_path(t, "memory", "kv_bytes_per_token"))),
        }
        cells = [name, status, _gib(get_path(t, "memory", "weight_bytes")), _f(bpw, ".2f"),
                 str(t.get("backend") or "-"), _f(get_path(t, "memory", "kv_bytes_per_token"), ",.0f")]
        eager_gpu = eager_gpu_decode(t)
        raw["decode_mode"] = t.get("decode_mode")
        for d in depths:
            peak = peak_bytes_at(t, d)
            ttft = finite(get_path(t, "speed", str(d), "ttft_s"))
            dec = decode_at(t, d)
            roof = finite(get_path(t, "speed", str(d), "roofline_share"))
            raw.update({f"peak_gib_{d}": _r(peak, GIB), f"ttft_s_{d}": ttft,
                        f"decode_tokens_per_s_{d}": dec, f"roofline_share_{d}": roof})
            dec_cell = _f(dec, ".3g") + (" eager" if eager_gpu and dec is not None else "")
            cells += [_gib(peak), _f(ttft, ".3g"), dec_cell, _f(roof, ".0f", 100)]
        pr, lo, hi = (finite(beh.get(k)) for k in ("pass_rate", "pass_ci_low", "pass_ci_high"))
        flip = finite(beh.get("flip_rate"))
        p2f, f2p = beh.get("flips_pass_to_fail"), beh.get("flips_fail_to_pass")
        budget = finite(beh.get("budget_exhausted_rate"))
        raw.update({"kld_mean": kld, "kld_se": kld_se, "same_top_rate": top, "ppl_ratio": ppl,
                    "pass_rate": pr, "pass_ci_low": lo, "pass_ci_high": hi, "flip_rate": flip,
                    "flips_pass_to_fail": p2f, "flips_fail_to_pass": f2p, "budget_exhausted_rate": budget,
                    "pareto": mark, "slow_path": bool(sp)})
        kld_cell = "-" if kld is None else (f"{kld:.4f}" + (f" ± {kld_se:.4f}" if kld_se is not None else ""))
        if is_ref and status == STATUS_OK and fid.get("kld_mean") is None:
            kld_cell = "0 (reference)"
        pass_cell = "-" if pr is None else (f"{100 * pr:.1f}" + (
            f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None and hi is not None else ""))
        flips_cell = "-" if flip is None else f"{100 * flip:.1f}%" + (
            f" ({p2f}↓ {f2p}↑)" if isinstance(p2f, int) and isinstance(f2p, int) else "")
        notes = []
        if sp:
            notes.append(sp.text)
        base = _kv_base_tier(a.tiers, name)
        if base is not None and status == STATUS_OK:
            d = max(depths)
            mine, theirs = (finite(get_path(x, "speed", str(d), "ttft_s")) for x in (t, a.tiers[base]))
            if mine and theirs:
                notes.append(f"int8 KV adds {100 * (mine / theirs - 1):+.0f}% prefill time vs {base} @{d}")
            fa, fa_base = t.get("flash_attn"), a.tiers[base].get("flash_attn")
            if fa is not None and fa_base is not None and bool(fa) != bool(fa_base):
                notes.append(f"flash attention {'on' if fa else 'off'} here, {'on' if fa_base else 'off'} in {base}: "
                             "the comparison with it mixes two changes")
            dm, dm_base = t.get("decode_mode"), a.tiers[base].get("decode_mode")
            if dm and dm_base and dm != dm_base:  # int8 KV cannot be compiled: eager beside a static twin
                notes.append(f"decode {dm} here, {dm_base} in {base}: the comparison with it mixes two changes")
        if eager_gpu:
            notes.append("eager decode on the GPU (dynamic cache, no torch.compile): bound by kernel launches, "
                         "not bandwidth")
        if t.get("decode_note"):
            notes.append(str(t["decode_note"]))
        fb = get_path(t, "quant", "fallback_tensors")
        if isinstance(fb, int) and fb > 0:  # llama.cpp moved tensors off the nominal type (shape rules)
            types = get_path(t, "quant", "tensor_types") or {}
            n_q = sum(v for k, v in types.items() if str(k).upper() not in ("F32", "F16", "BF16")) or None
            kinds = ", ".join(f"{k} ×{v}" for k, v in (get_path(t, "quant", "fallbacks") or {}).items())
            notes.append(f"{fb}{f' of {n_q}' if n_q else ''} quantized tensors fell back from the nominal type"
                         + (f" ({kinds})" if kinds else ""))
        if status != STATUS_OK and t.get("error"):
            notes.append(str(t["error"]))
        q_engine = get_path(t, "quality", "engine")
        lm = get_path(t, "quality", "lm_eval") or {}
        lm_cell = "; ".join(f"{task} {k} {v:.3f}" for task, ms in lm.items() if isinstance(ms, dict)
                            for k, v in ms.items()) or ("skipped" if "skipped" in lm else "-")
        raw.update({"quality_engine": q_engine, "lm_eval": lm_cell if lm else None})
        load = t.get("load") or {}
        users = finite(load.get("users_at_slo"))
        raw.update({"load_depth": load.get("depth"), "load_scheduling": ",".join(load.get("scheduling") or []) or None,
                    "users_at_slo": _whole(users), "load_max_decode_tokens_per_s": finite(load.get("max_decode_tokens_per_s")),
                    "load_requests_not_admitted": load.get("requests_not_admitted")})
        pts = {int(p["concurrency"]): p for p in load.get("points") or []}
        gain = load.get("batching_gain") or {}
        for c in conc:
            p = pts.get(c) or {}
            raw.update({f"load_decode_tokens_per_s_c{c}": finite(p.get("decode_tokens_per_s")),
                        f"load_batching_gain_c{c}": finite(gain.get(str(c))),
                        f"load_ttft_p95_s_c{c}": finite(get_path(p, "ttft_s", "p95")),
                        f"load_itl_p95_s_c{c}": finite(get_path(p, "itl_s", "p95")),
                        f"load_goodput_tokens_per_s_c{c}": finite(p.get("goodput_tokens_per_s")),
                        f"load_peak_gib_c{c}": _r(finite(p.get("peak_bytes")), GIB),
                        f"load_admitted_c{c}": p.get("admitted") if p else None})
        if load.get("error"):
            notes.append(f"load sweep failed: {load['error']}")
        cells += [kld_cell, _f(top, ".1f", 100), _f(ppl, ".4f"), pass_cell, flips_cell,
                  _f(budget, ".1f", 100), str(q_engine or "-"), lm_cell, _f(users, "g"), mark,
                  "; ".join(notes) or ""]
        tab.rows.append(cells)
        tab.csv_rows.append(raw)
    return tab


def eager_gpu_decode(t: dict) -> bool:
    """True for a transformers tier whose decode figures were measured eagerly on CUDA
    (launch-bound there: the table marks them "eager")."""
    return t.get("device") == "cuda" and t.get("engine") == "hf" and t.get("decode_mode") == "eager"


def load_concurrencies(tiers: dict[str, dict]) -> list[int]:
    """Every concurrency any tier's load sweep recorded, ascending."""
    return sorted({int(p["concurrency"]) for t in tiers.values() for p in get_path(t, "load", "points") or []})


LOAD_HEADERS = ["tier", "scheduling", "streams", "decode tok/s", "gain", "req/s", "TTFT p50/p95/p99 s",
                "ITL p50/p95/p99 s", "e2e p50/p95 s", "goodput tok/s", "peak GiB", "KV GiB at peak", "SLO"]


def load_table(tiers: dict[str, dict]) -> list[list[str]]:
    """Rows of the load table: one per tier and concurrency (``LOAD_HEADERS``); a point not
    admitted shows the reason; a failed sweep one row with its error."""
    def trio(d: Any, keys: tuple[str, ...]) -> str:
        return "/".join(_f((d or {}).get(k), ".3g") for k in keys)

    rows = []
    for name, t in tiers.items():
        load = t.get("load") or {}
        if load.get("error"):
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"failed: {load['error']}"])
            continue
        gain = load.get("batching_gain") or {}
        for p in load.get("points") or []:
            c = int(p["concurrency"])
            if not p.get("admitted"):
                rows.append([name, "-", str(c), "-", "-", "-", "-", "-", "-", "-", "-", "-",
                             f"not admitted ({p.get('requests_not_admitted')} requests): {p.get('reason')}"])
                continue
            rows.append([name, str(p.get("scheduling") or "-"), str(c), _f(p.get("decode_tokens_per_s"), ".3g"),
                         _f(gain.get(str(c)), ".2f", suffix="x"), _f(p.get("requests_per_s"), ".3g"),
                         trio(p.get("ttft_s"), ("p50", "p95", "p99")), trio(p.get("itl_s"), ("p50", "p95", "p99")),
                         trio(p.get("e2e_s"), ("p50", "p95")), _f(p.get("goodput_tokens_per_s"), ".3g"),
                         _gib(p.get("peak_bytes"), 3), _gib(p.get("kv_bytes_peak"), 4),
                         "meets" if p.get("meets_slo") else "misses"])
    return rows


def load_caption(tiers: dict[str, dict]) -> str | None:
    """One line saying what the load table measured (depth, tokens, SLO), from the first sweep."""
    load = next((t.get("load") for t in tiers.values() if (t.get("load") or {}).get("points")), None)
    if not load:
        return None
    slo = load.get("slo") or {}
    return (f"Closed loop: each stream sends {load.get('requests_per_stream')} requests in turn, each a fresh "
            f"{load.get('depth')}-token prompt and {load.get('output_tokens')} new tokens; prefill in chunks of "
            f"{load.get('prefill_chunk')} tokens. SLO: TTFT p95 <= {slo.get('ttft_p95_s')} s and ITL p95 <= "
            f"{slo.get('itl_p95_s')} s. decode tok/s = all new tokens / run time; gain = / 1 stream; goodput = "
            "tokens of requests within the SLO / run time (qeval.measure.load).")


def _kv_base_tier(tiers: dict[str, dict], name: str) -> str | None:
    """For an int8-KV tier, the tier with the same spec and the model's KV cache (or None)."""
    t = tiers[name]
    spec = dict(t.get("spec") or {})
    if spec.get("kv_cache") != "int8":
        return None
    want = {k: v for k, v in spec.items() if k not in ("name", "kv_cache", "flash_attn")}
    for other, o in tiers.items():
        os_ = dict(o.get("spec") or {})
        if other != name and os_.get("kv_cache", "model") == "model" and \
                {k: v for k, v in os_.items() if k not in ("name", "kv_cache", "flash_attn")} == want:
            return other
    return None


def _whole(v: float | None) -> float | int | None:
    return int(v) if v is not None and v.is_integer() else v


def _r(v: float | None, div: float) -> float | None:
    return None if v is None else round(v / div, 4)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` inside cells escaped)."""
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _analyse(run_dir: str | Path, recipe_dict: dict | None) -> tuple[dict, RunAnalysis, ReportSpec]:
    run, tiers = load_run(run_dir)
    a = analyse_run(run, tiers, recipe_dict)
    spec = validate_section(ReportSpec, a.recipe.get("report"), "report")
    return run, a, spec


def _tables_text(a: RunAnalysis, slow: dict[str, SlowPath]) -> tuple[str, str]:
    tab = tier_table(a, slow)
    name = a.recipe.get("name", "run")
    md = [f"# {name}: tiers", "",
          f"Pareto front and gate at depth {a.depth} tokens; quality metric `{a.quality_metric}`; "
          f"reference `{a.reference}`. Memory in GiB (2^30 bytes).", "",
          markdown_table(tab.headers, tab.rows)]
    lrows = load_table(a.tiers)
    if lrows:
        md += ["## Load: users at SLO", "", load_caption(a.tiers) or "", "",
               markdown_table(LOAD_HEADERS, lrows)]
    unfinished = [(n, t) for n, t in a.tiers.items() if t.get("status") != STATUS_OK]
    if unfinished:
        md += ["Tiers that did not finish:", ""]
        for n, t in unfinished:
            md.append(f"- `{n}`: {t.get('status')}: {t.get('error') or 'no error recorded'}")
            tail = [ln.replace("`", "'") for ln in str(t.get("log_tail") or "").splitlines() if ln.strip()][-6:]
            if tail:  # the last lines of the failed stage's log (all of it: logs/<tier>.<stage>.log)
                md += ["", "  ```", *[f"  {ln}" for ln in tail], "  ```"]
        md.append("")
    md.append(f"Gate: {'PASS' if a.gate.passed else 'FAIL'} "
              f"({', '.join(f'{c.tier} {c.verdict}' for c in a.gate.candidates) or 'no candidates'}).")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=tab.csv_fields, lineterminator="\n")
    w.writeheader()
    for r in tab.csv_rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return "\n".join(md) + "\n", buf.getvalue()


def write_tables(run_dir: str | Path, recipe_dict: dict | None = None) -> tuple[Path, Path]:
    """Write ``table.md`` and ``table.csv`` into the run folder from its stored JSON.

    Args:
        run_dir: run folder.
        recipe_dict: recipe to judge with instead of ``run.json``'s (optional).

    Returns:
        ``(table.md path, table.csv path)``.

    Raises:
        QevalInputError: not a run folder, malformed JSON, or a recipe section that does
            not validate.
    """
    d = Path(run_dir)
    run, a, spec = _analyse(d, recipe_dict)
    slow = slow_path_flags(a.tiers, a.reference, max(a.depths), spec.slow_path_fraction)
    md, csv_text = _tables_text(a, slow)
    atomic_write_text(d / "table.md", md)
    atomic_write_text(d / "table.csv", csv_text)
    return d / "table.md", d / "table.csv"


# ---- HTML ---------------------------------------------------------------------------------

_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>qeval report: {{ name }}</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;margin:0;background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:24px 28px 60px;background:#fff;min-height:100vh;box-sizing:border-box}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:30px 0 8px;padding-bottom:4px;border-bottom:1px solid #e3e6eb}
.meta{color:#5a6270;font-size:13px;margin:0 0 14px}.meta code{font-size:12px}
.badge{display:inline-block;padding:2px 9px;border-radius:10px;font-weight:600;font-size:12px;letter-spacing:.02em}
.pass{background:#ddf4e4;color:#17623a}.fail{background:#fbe0e0;color:#9b1c1c}.warn{background:#fff1d6;color:#8a5300}
.muted{color:#6b7280}
.wide{overflow-x:auto;max-width:100%;border:1px solid #e3e6eb;border-radius:6px}
table{border-collapse:collapse;font-size:12.5px;width:100%}
.wide table{width:max-content;min-width:100%}.wide table.fit{width:100%}
th,td{padding:4px 8px;border-bottom:1px solid #eceef2;text-align:right;white-space:nowrap;vertical-align:top}
th{background:#f3f5f8;font-weight:600}th.c{text-align:center}
td.grp,th.grp{border-left:1px solid #d9dde3}
td.l,th.l{text-align:left}td.wrap{white-space:normal;min-width:150px;max-width:520px}
tr.front td:first-child{font-weight:600}tr.notok td{color:#8b93a1}
.star{color:#b7791f}
ul.rules{margin:0;padding-left:16px;text-align:left}
details summary{cursor:pointer;color:#3451b2}
pre{background:#f6f8fa;border:1px solid #e3e6eb;padding:8px;font-size:12px;overflow-x:auto;white-space:pre-wrap}
figure{margin:14px 0}figure img{max-width:100%;height:auto;border:1px solid #eceef2;border-radius:4px}
figcaption{font-size:12px;color:#5a6270}
.plots figure{max-width:880px}
</style></head><body><main>
<h1>qeval report: {{ name }}</h1>
<p class="meta">model <code>{{ model }}</code> · {{ created }} · device {{ device }} · threads {{ threads }}<br>
decisions at depth <b>{{ depth }}</b> tokens · quality metric <code>{{ quality_metric }}</code> ·
reference <code>{{ reference }}</code> · gate
<span class="badge {{ 'pass' if gate_passed else 'fail' }}">{{ 'PASS' if gate_passed else 'FAIL' }}</span>
<span class="muted">(exit code {{ exit_code }})</span></p>

{% if unfinished %}
<p>{% for u in unfinished %}<span class="badge warn">{{ u.name }}: {{ u.status }}</span> {% endfor %}
<span class="muted">tiers that did not finish are listed at the end with their errors.</span></p>
{% endif %}
{% if slow %}<p>{% for s in slow %}<span class="badge warn">{{ s.tier }}: slow path at long context</span> {% endfor %}</p>{% endif %}

<h2>Pareto front at depth {{ depth }}</h2>
<p class="muted">Objectives: peak memory (lower), {{ 'users at SLO from the load sweep' if pareto_speed == 'users_at_slo' else 'decode tokens/s' }} (higher; <code>pareto.speed: {{ pareto_speed }}</code>), {{ quality_metric }} ({{ 'lower' if quality_dir == 'min' else 'higher' }}).
A tier is dominated when another is no worse on all three and strictly better on one.</p>
<div class="wide"><table>
<tr><th class="l">tier</th><th>peak GiB</th><th>decode tok/s</th><th>users @SLO</th><th>{{ quality_metric }}</th><th class="l">Pareto</th></tr>
{% for e in pareto %}<tr class="{{ e.cls }}"><td class="l">{% if e.front %}<span class="star">★</span> {% endif %}{{ e.tier }}</td>
<td>{{ e.mem }}</td><td>{{ e.dec }}</td><td>{{ e.users }}</td><td>{{ e.q }}</td><td class="l">{{ e.mark }}</td></tr>
{% endfor %}</table></div>

<h2>Release gate</h2>
<p class="muted">Rules: {% for r, v in rules.items() %}<code>{{ r }} = {{ v }}</code>{% if not loop.last %}, {% endif %}{% else %}none set{% endfor %}.
Memory and speed rules at depth {{ depth }}. A missing figure fails its rule.</p>
<div class="wide"><table>
<tr><th class="l">candidate</th><th class="l">status</th><th class="l">verdict</th><th class="l">failing rules</th></tr>
{% for c in candidates %}<tr><td class="l">{{ c.tier }}</td><td class="l">{{ c.status }}</td>
<td class="l"><span class="badge {{ c.verdict }}">{{ c.verdict|upper }}</span></td>
<td class="l wrap">{% if c.not_run %}<ul class="rules"><li><code>status</code>: {{ c.not_run }}</li>{% if c.n_unjudged %}<li>all {{ c.n_unjudged }} set rules fail: not judged</li>{% endif %}</ul>
{% elif c.failed %}<ul class="rules">{% for r in c.failed %}<li><code>{{ r.rule }}</code>: {{ r.message }}</li>{% endfor %}</ul>{% else %}<span class="muted">none</span>{% endif %}
<details><summary>all {{ c.rules|length }} checks</summary><ul class="rules">{% for r in c.rules %}<li>{{ '✔' if r.passed else '✘' }} <code>{{ r.rule }}</code>: {{ r.message }}</li>{% endfor %}</ul></details></td></tr>
{% else %}<tr><td class="l" colspan="4">no candidates</td></tr>{% endfor %}
</table></div>

{% if ladder_by_users %}<h2>Overload ladder</h2>
<p class="muted">Gate-passing tiers (and the reference) by users at SLO at load depth {{ load_depth }}, fewest first: step down when load peaks. Each rung: users gained, memory saved (single-stream peak at depth {{ depth }}) and {{ quality_metric }} given up (positive = worse).</p>
{% else %}<h2>Fallback ladder</h2>
<p class="muted">Gate-passing tiers (and the reference) from most to least peak memory at depth {{ depth }} (no load sweep in this run). "Quality lost" is the change in {{ quality_metric }}, positive = worse.</p>{% endif %}
{% if ladder %}<div class="wide"><table>
<tr><th>#</th><th class="l">tier</th>{% if ladder_by_users %}<th>users at SLO</th><th>users gained vs prev</th><th>vs first</th>{% endif %}<th>peak GiB</th><th>saved vs prev</th><th>saved vs first</th><th>{{ quality_metric }}</th><th>quality lost vs prev</th><th>vs first</th></tr>
{% for s in ladder %}<tr><td>{{ loop.index }}</td><td class="l">{{ s.tier }}</td>{% if ladder_by_users %}<td>{{ s.users }}</td><td>{{ s.gained_prev }}</td><td>{{ s.gained_first }}</td>{% endif %}<td>{{ s.peak }}</td><td>{{ s.saved_prev }}</td><td>{{ s.saved_first }}</td><td>{{ s.q }}</td><td>{{ s.lost_prev }}</td><td>{{ s.lost_first }}</td></tr>
{% endfor %}</table></div>{% else %}<p>No tier passes the gate.</p>{% endif %}
{% for n, why in unplaced.items() %}<p class="muted">{{ n }} passes but is not placed: {{ why }}</p>{% endfor %}

{% if load_rows %}<h2>Load: throughput and latency under concurrency</h2>
<p class="muted">{{ load_caption }}</p>
<div class="wide"><table>
<tr>{% for h in load_headers %}<th class="{{ 'l' if loop.index0 in (0, 1) or loop.last else '' }}">{{ h }}</th>{% endfor %}</tr>
{% for r in load_rows %}<tr>{% for c in r %}<td class="{{ 'l' if loop.index0 in (0, 1) else '' }}{{ ' l wrap' if loop.last else '' }}">{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table></div>
<div class="plots">{% for p in load_plots %}<figure>{% if p.src %}<img alt="{{ p.title }}" src="{{ p.src }}">{% else %}<p class="muted">{{ p.title }}: no data.</p>{% endif %}<figcaption>{{ p.caption }}</figcaption></figure>
{% endfor %}</div>{% endif %}

<h2>Capacity</h2>
{% for line in capacity_head %}<p class="muted">{{ line }}</p>
{% endfor %}<div class="wide"><table>
<tr>{% for h in capacity_headers %}<th class="{{ 'l' if loop.first or loop.last else '' }}">{{ h }}</th>{% endfor %}</tr>
{% for r in capacity_rows %}<tr>{% for c in r %}<td class="{{ 'l' if loop.first else ('l wrap' if loop.last else '') }}">{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table></div>
{% for line in capacity_legend %}<p class="muted">{{ line }}</p>
{% endfor %}

<h2>Plots</h2>
<div class="plots">
{% for p in plots %}<figure>{% if p.src %}<img alt="{{ p.title }}" src="{{ p.src }}">{% else %}<p class="muted">{{ p.title }}: no data.</p>{% endif %}<figcaption>{{ p.caption }}</figcaption></figure>
{% endfor %}</div>

<h2>All tiers</h2>
<div class="wide"><table class="fit">
<tr><th class="l">tier</th><th class="l">status</th><th>weights GiB</th><th>bits/weight</th><th class="l">backend</th><th class="l">KV cache</th><th>KV bytes/token</th><th class="l">error</th></tr>
{% for r in table_rows %}<tr class="{{ r.cls }}">{% for c in r.build %}<td class="{{ '' if loop.index0 in (2, 3, 6) else 'l' }}{{ ' wrap' if loop.last else '' }}">{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table></div>

<h2>Memory and speed by context depth</h2>
<p class="muted">Peak memory in GiB; TTFT in seconds; decode in tokens/s; roofline % = achieved decode / (bandwidth / bytes read per token).</p>
<div class="wide"><table>
<tr><th class="l" rowspan="2">tier</th>
{% for d in depths %}<th colspan="4" class="grp c">depth {{ d }} tokens</th>{% endfor %}</tr>
<tr>{% for d in depths %}<th class="grp">peak GiB</th><th>TTFT s</th><th>tok/s</th><th>roofline %</th>{% endfor %}</tr>
{% for r in table_rows %}<tr class="{{ r.cls }}">{% for c in r.speed %}<td class="{{ 'l' if loop.index0 == 0 else '' }}{{ ' grp' if loop.index0 >= 1 and (loop.index0 - 1) % 4 == 0 else '' }}">{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table></div>

<h2>All tiers: quality</h2>
<p class="muted">KLD in nats against the reference on its own tokens; pass rate over the checkable items with its 95% interval; flips: share of items whose pass/fail differs from the reference (↓ pass→fail, ↑ fail→pass).</p>
<div class="wide"><table class="fit">
<tr>{% for h in quality_headers %}<th class="{{ 'l' if loop.index0 == 0 or loop.index0 >= quality_headers|length - 2 else '' }}">{{ h }}</th>{% endfor %}</tr>
{% for r in table_rows %}<tr class="{{ r.cls }}">{% for c in r.quality %}<td class="{{ 'l' if loop.index0 == 0 or loop.index0 >= quality_headers|length - 2 else '' }}{{ ' wrap' if loop.last else '' }}">{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table></div>

{% if unfinished %}<h2>Tiers that did not finish</h2>
{% for u in unfinished %}<p><b>{{ u.name }}</b> <span class="badge fail">{{ u.status }}</span> {{ u.error }}</p>
{% if u.log_tail %}<details><summary>log tail</summary><pre>{{ u.log_tail }}</pre></details>{% endif %}
{% endfor %}{% endif %}
<p class="muted" style="margin-top:30px">Generated by qeval from the stored JSON of this run at {{ generated }}. GiB = 2<sup>30</sup> bytes.</p>
</main></body></html>
"""


def _data_uri(png: bytes | None) -> str | None:
    return None if png is None else "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render_report(run: dict, a: RunAnalysis, spec: ReportSpec | None = None,
                  budget_bytes: int | None = None, users: int = DEFAULT_USERS,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> str:
    """The HTML text of the report for an analysed run (see :func:`write_report`)."""
    import jinja2

    from ..analysis.pareto import quality_direction

    spec = spec or ReportSpec()
    deepest = max(a.depths)
    slow = slow_path_flags(a.tiers, a.reference, deepest, spec.slow_path_fraction)
    if budget_bytes is None:
        budget_bytes, budget_src = default_budget_bytes(run)
    else:
        budget_src = "given"
    qfmt = ".4f" if a.quality_metric != "pass_rate" else ".3f"

    pareto_rows = [{"tier": e.tier, "front": e.status == "front", "mark": e.mark,
                    "cls": {"front": "front", "dominated": "", "not_compared": "notok"}[e.status],
                    "mem": _gib(e.memory_bytes), "dec": _f(e.decode_tokens_per_s, ".3g"),
                    "users": _f(e.users_at_slo, "g"), "q": _f(e.quality, qfmt)} for e in a.pareto.entries]
    cands = []
    for c in a.gate.candidates:
        status_rule = next((r for r in c.rules if r.rule == "status"), None)
        not_run = status_rule.message if status_rule is not None and not status_rule.passed else None
        cands.append({"tier": c.tier, "status": c.status or "no result", "verdict": c.verdict,
                      "failed": c.failed_rules, "rules": c.rules, "not_run": not_run,
                      "n_unjudged": len(c.rules) - 1})

    def signed(v: float | None, fmt: str) -> str:
        return "-" if v is None else f"{v:+{fmt}}"

    def saved(b: float | None, pct: float | None) -> str:
        return "-" if b is None or pct is None else f"{b / GIB:.2f} GiB ({pct:.0f}%)"

    ladder = [{"tier": s.tier, "peak": _gib(s.peak_bytes),
               "saved_prev": saved(s.saved_vs_prev_bytes, s.saved_vs_prev_pct),
               "saved_first": saved(s.saved_vs_first_bytes, s.saved_vs_first_pct),
               "users": _f(s.users_at_slo, "g"), "gained_prev": signed(s.users_gained_vs_prev, "g"),
               "gained_first": signed(s.users_gained_vs_first, "g"),
               "q": _f(s.quality, qfmt), "lost_prev": signed(s.quality_lost_vs_prev, qfmt),
               "lost_first": signed(s.quality_lost_vs_first, qfmt)} for s in a.ladder.steps]
    slo = next((get_path(t, "load", "slo") for t in a.tiers.values() if get_path(t, "load", "slo")), None)
    load_plots = [
        {"title": "Throughput vs concurrency", "src": _data_uri(plots.load_throughput_png(a.tiers)),
         "caption": "Aggregate decode tokens/s against concurrent streams, per tier (x: not admitted)."},
        {"title": "Latency vs concurrency", "src": _data_uri(plots.load_latency_png(a.tiers, slo)),
         "caption": "TTFT p95 and ITL p95 against concurrent streams, per tier; dashed: the recipe's SLO."},
    ]
    cap = _capacity_plan(run, a, budget_bytes, budget_src, deepest, users, overhead_bytes)
    cap_headers, cap_rows = plan_table(cap)
    plot_list = [
        {"title": "Quality vs memory", "src": _data_uri(plots.quality_vs_memory_png(a.pareto)),
         "caption": f"{a.quality_metric} against peak memory at depth {a.depth}; marker size = decode tokens/s; "
                    "filled markers are on the Pareto front."},
        {"title": "Decode vs depth", "src": _data_uri(plots.decode_vs_depth_png(a.tiers, a.depths)),
         "caption": "Decode tokens/s at each context depth, per tier."},
        {"title": "KLD by position", "src": _data_uri(plots.kld_by_bucket_png(a.tiers)),
         "caption": "KLD mean by position bucket inside long outputs (drift), per tier."},
    ]
    tab = tier_table(a, slow)
    row_cls = []
    for name, t in a.tiers.items():
        if t.get("status") != STATUS_OK:
            row_cls.append("notok")
        else:
            row_cls.append("front" if name in a.pareto.front else "")
    n_speed = 6 + 4 * len(a.depths)
    rows = []
    for (name, t), r, c in zip(a.tiers.items(), tab.rows, row_cls):
        build = r[:5] + [str(t.get("kv_cache") or "-"), r[5],
                         "" if t.get("status") == STATUS_OK else str(t.get("error") or "")]
        quality = r[:1] + r[n_speed:-1] + [slow[name].text if name in slow else ""]
        rows.append({"build": build, "speed": r[:1] + r[6:n_speed], "quality": quality, "cls": c})
    unfinished = [{"name": n, "status": t.get("status"), "error": t.get("error") or "no error recorded",
                   "log_tail": t.get("log_tail")} for n, t in a.tiers.items() if t.get("status") != STATUS_OK]
    host = run.get("host") if isinstance(run.get("host"), dict) else {}
    device = a.recipe.get("device") or "?"
    if host.get("cpu"):
        device += f" ({host['cpu']}" + (f", GPU {host['gpu']}" if host.get("gpu") else "") + ")"
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        name=a.recipe.get("name", "run"),
        model=get_path(a.recipe, "model", "source") or get_path(a.recipe, "model", "gguf_package") or "?",
        created=run.get("started_at") or run.get("created_utc") or "time not recorded",
        device=device, threads=a.recipe.get("threads", "?"), depth=a.depth,
        quality_metric=a.quality_metric, quality_dir=quality_direction(a.quality_metric),
        pareto_speed=a.pareto.speed,
        reference=a.reference, gate_passed=a.gate.passed, exit_code=a.gate.exit_code(),
        unfinished=unfinished, slow=list(slow.values()), pareto=pareto_rows, rules=a.gate.rules,
        candidates=cands, ladder=ladder, unplaced=a.ladder.unplaced,
        ladder_by_users=a.ladder.basis == "users_at_slo", load_depth=a.ladder.load_depth or "-",
        load_rows=load_table(a.tiers), load_headers=LOAD_HEADERS, load_caption=load_caption(a.tiers) or "",
        load_plots=load_plots,
        capacity_head=plan_header(cap)[1:], capacity_headers=cap_headers, capacity_rows=cap_rows,
        capacity_legend=plan_legend(cap), plots=plot_list,
        depths=a.depths, quality_headers=tab.headers[:1] + tab.headers[n_speed:], table_rows=rows,
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def _capacity_plan(run: dict, a: RunAnalysis, memory_bytes: int, memory_src: str, context: int, users: int,
                   overhead_bytes: int):
    """The ``qeval plan`` of the run's tiers for the report (see the module doc)."""
    cfg = cfg_path = None
    found = find_config(None, run)
    if found is not None:
        try:
            cfg, cfg_path = read_config(found)
        except QevalInputError:  # an unreadable source config: measured figures only
            cfg = cfg_path = None
    try:
        plan = build_plan(config=cfg, config_path=str(cfg_path) if cfg_path else None, results=a.tiers, run=run,
                          memory_bytes=memory_bytes, overhead_bytes=overhead_bytes, context=context, users=users)
    except QevalInputError:  # a source config the estimates cannot read: measured figures only
        plan = build_plan(results=a.tiers, run=run, memory_bytes=memory_bytes, overhead_bytes=overhead_bytes,
                          context=context, users=users)
    plan.memory_source = memory_src
    return plan


def write_report(run_dir: str | Path, recipe_dict: dict | None = None, *,
                 budget_bytes: int | None = None, users: int = DEFAULT_USERS,
                 overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> Path:
    """Write a self-contained ``report.html`` into the run folder from its stored JSON.

    Sections: gate verdict badge, Pareto table (front marked ★, dominated tiers name a
    dominator), gate verdicts with failing rules, the overload ladder (or, without a load
    sweep, the fallback ladder by memory), the load table with throughput- and
    latency-vs-concurrency plots (SLO drawn), capacity table, plots
    (quality vs memory with marker size = decode tokens/s; decode tokens/s vs depth; KLD by
    position bucket), the full tier table with "slow path at long context" flags, and the
    tiers that failed or were not built with their errors and log tails.

    Args:
        run_dir: run folder.
        recipe_dict: recipe to judge with instead of ``run.json``'s (optional).
        budget_bytes: capacity budget in bytes (default :func:`default_budget_bytes`).
        users: concurrent users for the capacity table's longest context.
        overhead_bytes: capacity overhead allowance in bytes (default 1 GiB).

    Returns:
        Path of ``report.html``.

    Raises:
        QevalInputError: not a run folder, malformed JSON, or a recipe section that does
            not validate.
    """
    d = Path(run_dir)
    run, a, spec = _analyse(d, recipe_dict)
    text = render_report(run, a, spec, budget_bytes=budget_bytes, users=users, overhead_bytes=overhead_bytes)
    atomic_write_text(d / "report.html", text)
    return d / "report.html"


__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_USERS", "SlowPath", "TierTable", "default_budget_bytes",
           "markdown_table", "render_report", "slow_path_flags", "tier_table", "write_report",
           "write_tables"]
