"""Compare two run folders tier by tier (``qeval compare RUN_A RUN_B``).

Tiers are matched by name. For each key figure the row holds A's value, B's value,
``delta = B - A`` and ``rel = B / A - 1`` (None when either side is missing or A is 0).
Figures: weights (bytes), peak memory at the depth (bytes), decode tokens/s at the depth,
KLD mean (nats), pass rate (share 0..1). The depth defaults to run A's analysis depth
(``gate.depth`` or ``speed.main_depth``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QevalInputError
from ..metrics import display_unit, format_value, metric
from ..metrics import value as metric_value
from ..results import RunInfo, TierResult, get_path
from .gate import analysis_depth, load_run_checked, tier_order

#: Metric names (qeval.metrics.METRICS) of the compared figures, in column order.
COMPARE_METRICS: tuple[str, ...] = ("weight_bytes", "peak_bytes", "decode_tokens_per_s", "kld_mean", "pass_rate")


@dataclass
class MetricDelta:
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def rel(self) -> float | None:
        return None if self.a is None or self.b is None or self.a == 0 else self.b / self.a - 1


@dataclass
class CompareRow:
    """One tier in both runs.

    Attributes:
        tier: tier name.
        in_a, in_b: whether each run has a result for it.
        status_a, status_b: each side's status (None when absent).
        metrics: ``{metric key: MetricDelta}`` for :data:`COMPARE_METRICS`.
    """
    tier: str
    in_a: bool
    in_b: bool
    status_a: str | None
    status_b: str | None
    metrics: dict[str, MetricDelta] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tier": self.tier, "in_a": self.in_a, "in_b": self.in_b,
                "status_a": self.status_a, "status_b": self.status_b,
                "metrics": {k: {"a": m.a, "b": m.b, "delta": m.delta, "rel": m.rel}
                            for k, m in self.metrics.items()}}


def _figures(t: TierResult | None, depth: int, is_ref: bool) -> dict[str, float | None]:
    return {k: metric_value(t, k, depth, is_reference=is_ref) if t else None for k in COMPARE_METRICS}


def _load(run_dir: str | Path, which: str) -> tuple[RunInfo, dict[str, TierResult]]:
    """:func:`qeval.analysis.gate.load_run_checked`, its errors saying which of the two runs is bad."""
    try:
        return load_run_checked(run_dir)
    except QevalInputError as e:
        raise QevalInputError(f"{which}: {e.message}", file=e.file or run_dir, line=e.line, field=e.field) from None


def compare_runs(run_a_dir: str | Path, run_b_dir: str | Path,
                 depth: int | None = None) -> list[CompareRow]:
    """Put the same tiers of two runs side by side.

    Args:
        run_a_dir, run_b_dir: run folders (``run.json`` + ``tiers/*.json``).
        depth: depth in tokens for peak memory and decode; default run A's analysis depth.

    Returns:
        Rows in run A's tier order, then tiers only in B.

    Raises:
        QevalInputError: either folder is not a run folder or holds malformed JSON.
    """
    run_a, tiers_a = _load(run_a_dir, "run A")
    run_b, tiers_b = _load(run_b_dir, "run B")
    if depth is None:
        depth = analysis_depth(run_a.recipe)
    ref_a = get_path(run_a.recipe, "gate", "reference") or "bf16"
    ref_b = get_path(run_b.recipe, "gate", "reference") or "bf16"
    names = tier_order(run_a.recipe, tiers_a)
    names += [n for n in tier_order(run_b.recipe, tiers_b) if n not in names]
    rows = []
    for n in names:
        ta, tb = tiers_a.get(n), tiers_b.get(n)
        if ta is None and tb is None:
            continue
        fa, fb = _figures(ta, depth, n == ref_a), _figures(tb, depth, n == ref_b)
        rows.append(CompareRow(tier=n, in_a=ta is not None, in_b=tb is not None,
                               status_a=ta.status if ta else None,
                               status_b=tb.status if tb else None,
                               metrics={k: MetricDelta(fa[k], fb[k]) for k in COMPARE_METRICS}))
    return rows


def compare_markdown(rows: list[CompareRow], label_a: str = "A", label_b: str = "B") -> str:
    """Markdown table of :func:`compare_runs` rows: per figure ``A``, ``B`` and ``Δ``
    (B − A; relative change in % after it). Memory in GiB, pass rate in %. ``label_a`` and
    ``label_b`` (e.g. the run folders) are named once above the table, not in every header."""
    head = ["tier", "status"]
    for key in COMPARE_METRICS:
        head += [f"{metric(key).label} A ({display_unit(key)})", f"{metric(key).label} B", "Δ"]
    lines = []
    if (label_a, label_b) != ("A", "B"):
        lines += [f"A = {label_a}  ", f"B = {label_b}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = (r.status_a or "absent") if r.status_a == r.status_b else \
            f"{r.status_a or 'absent'} → {r.status_b or 'absent'}"
        cells = [r.tier, status]
        for key in COMPARE_METRICS:
            m = r.metrics[key]
            d = format_value(key, m.delta, signed=True)
            if m.rel is not None:
                d += f" ({100 * m.rel:+.1f}%)"
            cells += [format_value(key, m.a), format_value(key, m.b), d]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
