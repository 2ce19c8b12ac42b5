"""Tier tables (``table.md``, ``table.csv``) and the self-contained ``report.html``
(template ``qeval/report/templates/report.html.j2``, rendered with jinja2; the tables'
columns are :data:`qeval.report.table.COLUMNS`).

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
from datetime import datetime, timezone
from pathlib import Path

from ..analysis import RunAnalysis, analyse_run
from ..analysis.capacity import DEFAULT_OVERHEAD_BYTES
from ..analysis.gate import load_run_checked, validate_section
from ..analysis.ladder import emulated_caption
from ..analysis.pareto import GIB, decode_at, finite, quality_direction
from ..analysis.speculative import SPEC_HEADERS, spec_caption, spec_table
from ..analysis.plan import build_plan, find_config, plan_header, plan_legend, plan_table, read_config, run_memory_bytes
from ..errors import QevalInputError
from ..measure.prompt_format import prompt_format_text
from ..recipe import ReportSpec
from ..results import (STATUS_OK, RunInfo, RunLayout, TierResult, atomic_write_text, get_path, read_speculative,
                       short_error)
from . import plots
from .review import REPORT_LIMIT, TierReview, run_reviews
from .table import (LOAD_HEADERS, RATE_HEADERS, SlowPath, _f, _gib, floor_line, load_caption, load_table,
                    markdown_table, rate_caption, rate_table, tier_table, workload_markdown, workload_sections)

DEFAULT_BUDGET_BYTES = 24 * GIB
DEFAULT_USERS = 8
TEMPLATE = "report.html.j2"  # qeval/report/templates/, rendered with jinja2 (autoescape)


# ---- small helpers ------------------------------------------------------------------------

def default_budget_bytes(run: RunInfo | None) -> tuple[int, str]:
    """GPU memory for the report's capacity section: ``(bytes, where it came from)``: what
    ``run.json`` records (:func:`qeval.analysis.plan.run_memory_bytes`), else 24 GiB."""
    v = run_memory_bytes(run)
    if v:
        return v, "the run's GPU memory"
    return DEFAULT_BUDGET_BYTES, "default 24 GiB (no GPU memory recorded in run.json)"


def slow_path_flags(tiers: dict[str, TierResult], reference: str, depth: int,
                    fraction: float = 0.5) -> dict[str, SlowPath]:
    """Tiers whose decode tokens/s at ``depth`` (tokens) is below ``fraction`` x the
    reference's at the same depth. Needs both figures; the reference is never flagged."""
    ref = decode_at(tiers.get(reference), depth)
    out: dict[str, SlowPath] = {}
    if ref is None:
        return out
    for name, t in tiers.items():
        if name == reference or t.status != STATUS_OK:
            continue
        v = decode_at(t, depth)
        if v is not None and v < fraction * ref:
            out[name] = SlowPath(name, depth, v, ref, fraction)
    return out


def _analyse(run_dir: str | Path, recipe_dict: dict | None) -> tuple[RunInfo, RunAnalysis, ReportSpec]:
    run, tiers = load_run_checked(run_dir)  # run.json's own sections are checked there, naming the file
    a = analyse_run(run, tiers, recipe_dict, speculative=read_speculative(RunLayout(run_dir)))
    spec = validate_section(ReportSpec, a.recipe.get("report"), "report")
    return run, a, spec


def _rate_emulated(a: RunAnalysis) -> str:
    """The rate ladder's sentence on its rungs that ran a dtype torch emulated on the run's
    CPU (:func:`qeval.analysis.ladder.emulated_caption`); "" when none did."""
    rungs = [r.tier for r in a.ladder.rates.steps] if a.ladder.rates is not None else []
    return emulated_caption(a.ladder.emulated, rungs, "knees")


def _tables_text(a: RunAnalysis, slow: dict[str, SlowPath], prompt_format: str | None = None) -> tuple[str, str]:
    tab = tier_table(a, slow)
    name = a.recipe.get("name", "run")
    md = [f"# {name}: tiers", "",
          f"Pareto front and gate at depth {a.depth} tokens; quality metric `{a.quality_metric}`; "
          f"reference `{a.reference}`; prompts: {prompt_format_text(prompt_format)}. Memory in GiB (2^30 bytes): "
          f"peak = what the model, its KV cache and its "
          f"working buffers add to the process once its runtime is loaded (runtime GiB, its own figure).", "",
          f"{floor_line(a)}", "",
          markdown_table(tab.headers, tab.rows)]
    lrows = load_table(a.tiers)
    if lrows:
        md += ["## Load: users at SLO", "", load_caption(a.tiers) or "", "",
               markdown_table(LOAD_HEADERS, lrows)]
    rrows = rate_table(a.tiers)
    if rrows:
        md += ["## Load: request rates (open loop)", "", rate_caption(a.tiers) or "", "",
               markdown_table(RATE_HEADERS, rrows)]
        if a.ladder.rates is not None and a.ladder.rates.steps:
            md += [f"Rate ladder: {a.ladder.rates.text()}. {_rate_emulated(a)}".rstrip(), ""]
        for n, why in (a.ladder.rates.unplaced.items() if a.ladder.rates is not None else ()):
            md.append(f"- `{n}` not on the rate ladder: {why}")
        md.append("")
    md += workload_markdown(a.tiers)
    srows = spec_table(a.speculative)
    if srows:
        md += ["## Speculative decoding: a tier as another's draft", "", spec_caption(a.speculative) or "", "",
               markdown_table(SPEC_HEADERS, srows)]
    unfinished = [(n, t) for n, t in a.tiers.items() if t.status != STATUS_OK]
    if unfinished:
        md += ["Tiers that did not finish:", ""]
        for n, t in unfinished:
            md.append(f"- `{n}`: {t.status}: {short_error(t.error or 'no error recorded')}")
            tail = [ln.replace("`", "'") for ln in str(t.log_tail or "").splitlines() if ln.strip()][-6:]
            if tail:  # the last lines of the failed stage's log (all of it: logs/<tier>.<stage>.log)
                md += ["", "  ```", *[f"  {ln}" for ln in tail], "  ```"]
        md.append("")
    n, total = len(a.gate.judged), len(a.gate.candidates)
    md.append(f"Gate: {a.gate.verdict.upper()} over {n} of {total} candidates "
              f"({', '.join(f'{c.tier} {c.verdict}' for c in a.gate.candidates) or 'no candidates'})."
              + (f" Not judged: {a.gate.error_reason()}." if a.gate.errored else ""))
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
    layout = RunLayout(run_dir)
    run, a, spec = _analyse(layout.root, recipe_dict)
    slow = slow_path_flags(a.tiers, a.reference, max(a.depths), spec.slow_path_fraction)
    md, csv_text = _tables_text(a, slow, run.prompt_format)
    atomic_write_text(layout.table_md, md)
    atomic_write_text(layout.table_csv, csv_text)
    return layout.table_md, layout.table_csv


# ---- HTML ---------------------------------------------------------------------------------

def _workloads(a: RunAnalysis) -> list[dict]:
    """The workload sections of the report (table, caption, plot), those the run has."""
    png = {"prefix": (plots.prefix_ttft_png, "TTFT p95 against concurrent streams: the shared prefix's KV reused "
                      "(solid) or prefilled per request (dashed)."),
           "interference": (plots.interference_png, "The running streams' largest inter-token gap and ITL p99 in "
                            "the window a long prefill spans, per prefill chunk size."),
           "grid": (plots.grid_heatmap_png, "Users at SLO at each depth, per tier.")}
    out = []
    for w in workload_sections(a.tiers):
        fn, cap = png.get(w["key"], (None, None))  # a workload without a plot (the burst): its table alone
        out.append(dict(w, src=_data_uri(fn(a.tiers)) if fn is not None else None, plot_caption=cap))
    return out


def _speculative(a: RunAnalysis) -> list[dict]:
    """The speculative pairs' section of the report in the workload sections' shape (a table,
    a caption, a plot), when the run has pairs."""
    out = []
    srows = spec_table(a.speculative)
    if srows:  # not a load workload, but the same shape: a table, a caption, a plot
        out.append({"key": "speculative", "title": "Speculative decoding: a tier as another's draft",
                    "caption": spec_caption(a.speculative) or "", "headers": SPEC_HEADERS, "rows": srows,
                    "src": _data_uri(plots.speculative_png(a.speculative)),
                    "plot_caption": "Accepted draft tokens per verification step against the draft length k, per "
                                    "pair and depth: measured (solid) and predicted from the fidelity run (dashed); "
                                    "the dotted line is k, every drafted token accepted."})
    return out


def _data_uri(png: bytes | None) -> str | None:
    return None if png is None else "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render_report(run: RunInfo, a: RunAnalysis, spec: ReportSpec | None = None,
                  budget_bytes: int | None = None, users: int = DEFAULT_USERS,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                  reviews: dict[str, TierReview] | None = None) -> str:
    """The HTML text of the report for an analysed run (see :func:`write_report`);
    ``reviews``: per tier, its flipped and failing items (:func:`qeval.report.review.run_reviews`)."""
    import jinja2  # start-up time: only the report renders HTML

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
        if c.not_run:
            cands.append({"tier": c.tier, "status": "not run", "verdict": c.verdict, "cls": "skip", "failed": [],
                          "undecided": [],
                          "rules": [], "error": None, "n_unjudged": 0, "notes": c.notes})
            continue
        # an "error" candidate (its tier or the reference's did not finish): why, and its rules not judged
        cands.append({"tier": c.tier, "status": c.status or "no result", "verdict": c.verdict, "cls": c.verdict,
                      "failed": c.failed_rules, "rules": c.rules, "error": c.error,
                      "undecided": [r for r in c.undecided_rules if r.passed],
                      "n_unjudged": len(c.unjudged_rules), "notes": c.notes})

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
    slo = next((t.load.slo for t in a.tiers.values() if t.load is not None and t.load.slo), None)
    load_plots = [
        {"title": "Throughput vs concurrency", "src": _data_uri(plots.load_throughput_png(a.tiers)),
         "caption": "Aggregate decode tokens/s against concurrent streams, per tier (x: not admitted)."},
        {"title": "Latency vs concurrency", "src": _data_uri(plots.load_latency_png(a.tiers, slo)),
         "caption": "TTFT p95 and ITL p95 against concurrent streams, per tier; dashed: the recipe's SLO."},
    ]
    rate_plots = [
        {"title": "Rate vs offered rate", "src": _data_uri(plots.rate_png(a.tiers, slo)),
         "caption": "Achieved rate, TTFT p95 and ITL p95 against the offered rate, per tier (open loop); dashed: "
                    "the SLO; dotted verticals: each tier's knee."},
        {"title": "Error rate vs offered rate",
         "src": _data_uri(plots.error_rate_png(a.tiers, slo.max_error_rate if slo is not None else None)),
         "caption": "Refused, timed-out and failed requests (% of arrivals) against the offered rate; dashed: "
                    "the SLO's limit."},
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
    if tab.lc_depths:
        plot_list.append({"title": "Long context by depth",
                          "src": _data_uri(plots.long_context_png(a.tiers, tab.lc_depths, a.reference)),
                          "caption": "Long-context recall (left) and KLD over the last document tokens (right) "
                                     "against document depth, per tier; int8-KV tiers dashed."})
    lc_rows = [{"cells": cells, "cls": "front" if cells[0] in a.pareto.front else ""}
               for cells in tab.html["long_context"]["rows"]]
    lc_tokens = sorted({str(v) for t in a.tiers.values()
                        for v in (get_path(t, "quality", "long_context", "fidelity_tokens") or {}).values()})
    row_cls = []
    for name, t in a.tiers.items():
        if t.status != STATUS_OK:
            row_cls.append("notok")
        else:
            row_cls.append("front" if name in a.pareto.front else "")
    rows = [{"build": b, "memory": m, "speed": sp, "quality": q, "cls": c} for b, m, sp, q, c in
            zip(tab.html["build"]["rows"], tab.html["memory"]["rows"], tab.html["speed"]["rows"],
                tab.html["quality"]["rows"], row_cls)]
    unfinished = [{"name": n, "status": t.status, "error": short_error(t.error or "no error recorded", 2000),
                   "log_tail": t.log_tail} for n, t in a.tiers.items() if t.status != STATUS_OK]
    device = run.device or a.recipe.get("device") or "?"
    gpu = run.gpu or "none"
    if run.gpu_memory_bytes:
        gpu += f" ({run.gpu_memory_bytes / GIB:.1f} GiB)"
    versions = [(k, v) for k, v in run.versions.items() if v]
    env = jinja2.Environment(loader=jinja2.PackageLoader("qeval.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template(TEMPLATE).render(
        name=a.recipe.get("name", "run"),
        model=get_path(a.recipe, "model", "source") or get_path(a.recipe, "model", "gguf_package") or "?",
        created=run.started_at or "time not recorded",
        device=device, cpu=run.cpu or "not recorded", cpu_count=run.cpu_count or "?", gpu=gpu,
        versions=versions, commit=run.qeval_commit, bandwidth=run.bandwidth_bytes_per_s,
        threads=a.recipe.get("threads", "?"), depth=a.depth, prompt_format=prompt_format_text(run.prompt_format),
        quality_metric=a.quality_metric, quality_dir=quality_direction(a.quality_metric),
        pareto_speed=a.pareto.speed,
        reference=a.reference, gate_verdict=a.gate.verdict, exit_code=a.gate.exit_code(),
        gate_error=a.gate.error_reason(brief=False) if a.gate.errored else None,
        gate_judged=len(a.gate.judged), gate_total=len(a.gate.candidates), gate_not_run=a.gate.not_run,
        unfinished=unfinished, slow=list(slow.values()), pareto=pareto_rows, rules=a.gate.rules,
        candidates=cands, ladder=ladder, unplaced=a.ladder.unplaced,
        ladder_by_users=a.ladder.basis == "users_at_slo", load_depth=a.ladder.load_depth or "-",
        ladder_emulated=emulated_caption(a.ladder.emulated, a.ladder.order) if a.ladder.basis == "users_at_slo" else "",
        rate_emulated=_rate_emulated(a),
        load_rows=load_table(a.tiers), load_headers=LOAD_HEADERS, load_caption=load_caption(a.tiers) or "",
        load_plots=load_plots, rate_rows=rate_table(a.tiers), rate_headers=RATE_HEADERS,
        workloads=_workloads(a) + _speculative(a),
        rate_caption=rate_caption(a.tiers) or "", rate_plots=rate_plots,
        rate_ladder=a.ladder.rates.text() if a.ladder.rates is not None else "",
        rate_unplaced=dict(a.ladder.rates.unplaced) if a.ladder.rates is not None else {},
        capacity_head=plan_header(cap)[1:], capacity_headers=cap_headers, capacity_rows=cap_rows,
        capacity_legend=plan_legend(cap), plots=plot_list,
        depths=a.depths, build=tab.html["build"], memory=tab.html["memory"], depth_headers=tab.html_depth_headers,
        quality=tab.html["quality"], table_rows=rows, floor_text=floor_line(a), warnings=a.gate.warnings,
        confidence=f"{a.gate.confidence:.0%}", power=f"{a.gate.power:.0%}",
        insufficient_evidence=a.gate.insufficient_evidence,
        reviews=list((reviews or {}).values()), review_limit=REPORT_LIMIT,
        lc_depths=tab.lc_depths, lc_depth_headers=tab.html_lc_depth_headers,
        lc_tail_headers=tab.html["long_context"]["headers"][1 + len(tab.html_lc_depth_headers):],
        lc_rows=lc_rows, lc_tokens=" / ".join(lc_tokens) or "N",
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def _capacity_plan(run: RunInfo, a: RunAnalysis, memory_bytes: int, memory_src: str, context: int, users: int,
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
    position bucket; long-context recall and KLD vs document depth), the full tier table with
    "slow path at long context" flags, the long-context table by document depth (int8-KV
    tiers against their base tier), and the tiers that failed or were not built with their
    errors and log tails, and per tier the items a reviewer reads: flipped and failing items
    with both answers side by side (first divergence marked, checks of both sides, budget
    exhaustion, item KLD) and the positions of highest KLD with both sides' top tokens.

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
    layout = RunLayout(run_dir)
    run, a, spec = _analyse(layout.root, recipe_dict)
    reviews = run_reviews(layout.root, list(a.tiers), a.reference)
    text = render_report(run, a, spec, budget_bytes=budget_bytes, users=users, overhead_bytes=overhead_bytes,
                         reviews=reviews)
    atomic_write_text(layout.report_html, text)
    return layout.report_html


__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_USERS", "TEMPLATE", "default_budget_bytes", "render_report",
           "slow_path_flags", "write_report", "write_tables"]
