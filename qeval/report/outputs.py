"""What the CLI prints and writes after a run: glue over :func:`qeval.report.rebuild_outputs`
and the capacity functions, returning text for the terminal."""
from __future__ import annotations

from pathlib import Path

from ..analysis.capacity import format_gib, parse_bandwidth, parse_size
from ..analysis.gpus import find_gpu
from ..analysis.ladder import emulated_caption
from ..analysis.plan import build_plan, find_config, plan_json, plan_markdown, read_config, tiers_from_specs
from ..errors import QevalInputError
from ..model_config import model_shape
from ..recipe import load_recipe
from ..analysis.gate import load_run_checked
from ..results import RunLayout
from . import rebuild_outputs

#: Files of a run folder that qeval itself writes; ``--junit`` may not name one of them
#: (its own default, ``junit.xml``, aside).
OUTPUT_NAMES = tuple(n for n in RunLayout.OUTPUT_FILES if n != "junit.xml")


def build_outputs(run_dir: Path, junit: Path | None = None) -> tuple[int, str]:
    """Rebuild table.md/csv, gate.json, report.html (and JUnit XML when ``junit`` is set).

    Returns:
        ``(exit code of the gate: 0 pass / 1 fail / 4 error (some candidate could not be
        judged), text for the terminal)``.
    Raises:
        QevalInputError: not a run folder or malformed stored JSON.
    """
    outs = rebuild_outputs(run_dir, None, junit=junit or False)
    g = outs.gate
    lines = [outs.table_md.read_text(), "", f"gate (reference {g.reference}, depth {g.depth}):"]
    if not g.judged:
        lines.append("  no candidate judged: a gate that judges nothing does not pass")
    lines += [f"  warning: {w}" for w in g.warnings]
    for c in g.candidates:
        if c.not_run:
            lines.append(f"  {'-':4} {c.tier}  -- {c.notes[0] if c.notes else 'not run'}")
            continue
        if c.errored:  # not a verdict on the model: which tier did not finish, and what was left unjudged
            unjudged = len(c.unjudged_rules)
            why = "; ".join([c.error or "not judged"]
                            + ([f"{unjudged} rule{'s' if unjudged > 1 else ''} not judged"] if unjudged else []))
        else:
            why = "; ".join(r.message for r in c.failed_rules)
        lines.append(f"  {c.verdict.upper():4} {c.tier}" + (f"  -- {why}" if why else ""))
        lines += evidence_lines(c, g)
        lines += [f"       note: {n}" for n in c.notes]
    gate_file = outs.gate_file  # gate.json as written (qeval.results.GateFile)
    lad = gate_file.ladder
    if lad.steps:
        by_users = lad.basis == "users_at_slo"
        lines.append(f"overload ladder (users at SLO at depth {lad.load_depth or '-'}, fewest first):"
                     if by_users else "fallback ladder (most to least memory):")
        emulated = emulated_caption(lad.emulated, [s.tier for s in lad.steps]) if by_users else ""
        if emulated:
            lines.append(f"  note: {emulated}")
        for i, s in enumerate(lad.steps):
            q, saved = s.quality, s.saved_vs_first_pct
            lines.append(f"  {i + 1}. {s.tier:<18}"
                         + (f" users {s.users_at_slo:g} ({s.users_gained_vs_first:+g} vs first) "
                            if by_users else "")
                         + f" peak {format_gib(s.peak_bytes)}"
                         + (f"  saved {saved:.0f}% vs first" if saved is not None else "")
                         + (f"  quality {q:.4g}" if q is not None else ""))
    for name, text in gate_file.slow_path.items():
        lines.append(f"  slow path: {name}: {text}")
    for name, text in gate_file.load_stopped.items():
        lines.append(f"  partial load: {name}: {text}")
    lines.append(f"report: {outs.report_html}")
    if outs.junit_xml:
        lines.append(f"junit: {outs.junit_xml}")
    lines.append(g.verdict_line())
    return outs.exit_code(), "\n".join(lines)


_FIDELITY_SHORT = {"max_kld_mean": ("KLD", "<="), "min_same_top_rate": ("same-top", ">="),
                   "max_ppl_ratio": ("PPL ratio", "<=")}


def evidence_lines(c, g) -> list[str]:
    """What a judged candidate's quality verdict rests on, for the terminal: one line of its
    fidelity rules (with the KLD as a multiple of the noise floor) and one per behaviour rule
    decided on evidence (:mod:`qeval.analysis.evidence`: its outcome, counts and p-value).
    Rules that failed are named above; a candidate not judged (``error``) gets none."""
    if c.status != "ok" or c.errored:
        return []
    fid = []
    for r in c.rules:
        if r.rule in _FIDELITY_SHORT and isinstance(r.value, (int, float)):
            label, op = _FIDELITY_SHORT[r.rule]
            floor = (f" ({r.value / g.noise_floor.kld_mean:.1f}x the noise floor)"
                     if r.rule == "max_kld_mean" and g.noise_floor and g.noise_floor.kld_mean else "")
            fid.append(f"{label} {r.value:.4g}{floor} {op} {r.threshold:g}")
    out = [f"       fidelity: {'; '.join(fid)}"] if fid else []
    for r in c.rules:
        if r.evidence:
            policy = f" ({g.insufficient_evidence})" if r.undecided else ""
            out.append(f"       {r.rule}: {r.outcome}{policy}: {r.evidence.get('short') or r.evidence.get('why')}")
    return out


def plan_text(run_dir: Path | None, model: str | None, gpu_mem: str | None, context: int, users: int,
              overhead: str, *, recipe: str | None = None, gpu: str | None = None, bandwidth: str | None = None,
              usable: float | None = None, as_json: bool = False) -> str:
    """``qeval plan``'s output: the plan table (:func:`qeval.analysis.plan.plan_markdown`) or
    its JSON. Estimates come from a model config: ``model`` (config.json or a local model
    folder), else the recipe's (``recipe`` or the run's) local model folder or its
    ``config.json`` in the Hugging Face cache, else the run's source checkpoint. Tiers: the
    recipe's, else the run's, else every kind (:func:`qeval.analysis.plan.default_tiers`).

    Raises:
        QevalInputError: bad sizes, unknown GPU, missing or bad config, not a run folder,
            nothing to plan from.
    """
    mem = parse_size(gpu_mem, field="--gpu-mem") if gpu_mem is not None else None
    over = parse_size(overhead, field="--overhead")
    bw = parse_bandwidth(bandwidth, field="--bandwidth") if bandwidth is not None else None
    g = find_gpu(gpu) if gpu is not None else None
    run, results = (None, None)
    if run_dir is not None:
        run, results = load_run_checked(run_dir)
    rec = None
    if recipe is not None:
        rec = load_recipe(recipe)
    cfg = cfg_path = None
    if model is not None:
        cfg, cfg_path = read_config(model)
    else:
        found = find_config(rec, run)
        if found is not None:
            cfg, cfg_path = read_config(found, field_name="model.source")
    if cfg is None and results is None:
        src = (rec.model.source if rec is not None else None) or "the recipe's model"
        raise QevalInputError(f"no config.json for {src} on this machine: give --model path/to/config.json"
                              if rec is not None else "give RUN_DIR, --model or --recipe", field="plan")
    tiers = None
    dtype = rec.model.dtype if rec is not None else None
    if rec is not None:
        try:
            shape = model_shape(cfg) if cfg is not None else None
        except QevalInputError as e:
            raise QevalInputError(e.message, file=cfg_path, field=e.field) from None
        tiers = tiers_from_specs(list(rec.tiers), shape, dtype or "bfloat16")
    plan = build_plan(config=cfg, config_path=str(cfg_path) if cfg_path else None, tiers=tiers, results=results,
                      run_dir=str(run_dir) if run_dir is not None else None, run=run, gpu=g, memory_bytes=mem,
                      bandwidth_bytes_per_s=bw, usable=usable, overhead_bytes=over, context=context, users=users,
                      dtype=dtype, speculative=[(p.target, p.draft) for p in rec.speculative] if rec is not None else None)
    return plan_json(plan) if as_json else plan_markdown(plan)
