"""What the CLI prints and writes after a run: glue over :func:`qeval.report.rebuild_outputs`
and the capacity functions, returning text for the terminal."""
from __future__ import annotations

import json
from pathlib import Path

from ..analysis.capacity import capacity_from_run, estimate_from_config, format_gib, parse_size
from ..errors import QevalInputError
from ..results import load_run


def build_outputs(run_dir: Path, junit: Path | None = None) -> tuple[int, str]:
    """Rebuild table.md/csv, gate.json, report.html (and JUnit XML when ``junit`` is set).

    Returns:
        ``(exit code of the gate: 0 pass / 1 fail, text for the terminal)``.
    Raises:
        QevalInputError: not a run folder or malformed stored JSON.
    """
    from . import rebuild_outputs
    outs = rebuild_outputs(run_dir, None, junit=junit or False)
    g = outs.gate
    lines = [outs.table_md.read_text(), "", f"gate (reference {g.reference}, depth {g.depth}):"]
    for c in g.candidates:
        judged = [r.message for r in c.failed_rules if not r.message.startswith("not judged")]
        unjudged = len(c.failed_rules) - len(judged)
        why = "; ".join(judged + ([f"{unjudged} rule{'s' if unjudged > 1 else ''} not judged"] if unjudged else []))
        lines.append(f"  {c.verdict.upper():4} {c.tier}" + (f"  -- {why}" if why else ""))
    gate_doc = json.loads(outs.gate_json.read_text())
    steps = (gate_doc.get("ladder") or {}).get("steps") or []
    if steps:
        lines.append("fallback ladder (most to least memory):")
        for i, s in enumerate(steps):
            q = s.get("quality")
            lines.append(f"  {i + 1}. {s['tier']:<18} peak {format_gib(s['peak_bytes'])}"
                         f"  saved {s['saved_vs_first_pct']:.0f}% vs first"
                         + (f"  quality {q:.4g}" if isinstance(q, (int, float)) else ""))
    for name, text in (gate_doc.get("slow_path") or {}).items():
        lines.append(f"  slow path: {name}: {text}")
    lines.append(f"report: {outs.report_html}")
    if outs.junit_xml:
        lines.append(f"junit: {outs.junit_xml}")
    lines.append(f"gate: {'PASS' if g.passed else 'FAIL'} (exit {outs.exit_code()})")
    return outs.exit_code(), "\n".join(lines)


def plan_text(run_dir: Path | None, model: str | None, gpu_mem: str, context: int, users: int,
              overhead: str) -> str:
    """Capacity plan as a Markdown table: from a run's measured figures, or an estimate
    from a model config (``--model`` config.json or checkpoint folder).

    Raises:
        QevalInputError: bad sizes, missing config, not a run folder.
    """
    budget = parse_size(gpu_mem, field="--gpu-mem")
    over = parse_size(overhead, field="--overhead")
    if run_dir is not None:
        _, tiers = load_run(run_dir)
        rows = capacity_from_run(tiers, budget, context, users, over)
        head = f"capacity from measured figures in {run_dir}"
    else:
        p = Path(model).expanduser()
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise QevalInputError("no config.json there (give a config.json or a local model folder)",
                                  file=str(model), field="--model")
        try:
            cfg = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise QevalInputError(f"not valid JSON: {e}", file=cfg_path, field="--model") from None
        rows = [estimate_from_config(cfg, budget, context, users, overhead_bytes=over)]
        head = f"ESTIMATE from {cfg_path} (not measured; BF16 weights and KV cache assumed)"
    out = [head, f"budget {format_gib(budget)}, overhead {format_gib(over)}, context {context} tokens, {users} users",
           "", f"| tier | source | weights | KV bytes/token | sequences at {context} | longest context for {users} users | fits | note |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = f"{r.kv_bytes_per_token:,.0f}" if r.kv_bytes_per_token else "-"
        out.append(f"| {r.tier} | {r.label} | {format_gib(r.weights_bytes)} | {kv} | "
                   f"{r.sequences if r.sequences is not None else '-'} | "
                   f"{r.max_context_tokens if r.max_context_tokens is not None else '-'} | "
                   f"{'yes' if r.fits else ('no' if r.fits is not None else '-')} | {r.note or ''} |")
    return "\n".join(out)
