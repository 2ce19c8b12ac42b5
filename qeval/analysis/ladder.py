"""Fallback ladder: the gate-passing tiers, from most to least peak memory.

Under load a service steps down the ladder: each step frees memory (bytes, %) and costs
some quality. Members are the candidates that pass the gate plus the reference tier when
its result exists with status ``ok`` (the reference passes by definition). Order: peak
bytes at the gate depth, largest first; ties broken by better quality, then name.
A passing tier without a peak at that depth cannot be placed and is listed in
``Ladder.unplaced`` with the reason.

"Quality lost" is signed so that a positive number is always worse: for ``kld_mean`` and
``ppl_ratio`` (lower is better) it is ``q_step - q_other``; for ``pass_rate`` (higher is
better) it is ``q_other - q_step``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..results import STATUS_OK
from .gate import GateReport
from .pareto import peak_bytes_at, quality_direction, quality_value


@dataclass
class LadderStep:
    """One rung.

    Attributes:
        tier: tier name.
        peak_bytes: peak memory at the depth, bytes.
        quality: value of the quality metric (None when the tier lacks it).
        saved_vs_prev_bytes / saved_vs_prev_pct: memory freed versus the rung above
            (0 for the first rung).
        saved_vs_first_bytes / saved_vs_first_pct: memory freed versus the first rung.
        quality_lost_vs_prev / quality_lost_vs_first: quality given up (positive = worse),
            None when either side lacks the metric.
    """
    tier: str
    peak_bytes: float
    quality: float | None
    saved_vs_prev_bytes: float = 0.0
    saved_vs_prev_pct: float = 0.0
    saved_vs_first_bytes: float = 0.0
    saved_vs_first_pct: float = 0.0
    quality_lost_vs_prev: float | None = None
    quality_lost_vs_first: float | None = None


@dataclass
class Ladder:
    depth: int
    quality_metric: str
    steps: list[LadderStep] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)

    @property
    def order(self) -> list[str]:
        return [s.tier for s in self.steps]

    def to_dict(self) -> dict:
        return {"depth": self.depth, "quality_metric": self.quality_metric,
                "steps": [asdict(s) for s in self.steps], "unplaced": dict(self.unplaced)}


def fallback_ladder(tiers: dict[str, dict], gate_report: GateReport,
                    quality_metric: str = "kld_mean") -> Ladder:
    """Build the ladder from a gate verdict.

    Args:
        tiers: ``{tier name: tier result dict}``.
        gate_report: from :func:`qeval.analysis.gate.evaluate_gate`; its ``depth`` and
            ``reference`` are used.
        quality_metric: ``kld_mean`` | ``ppl_ratio`` | ``pass_rate``.

    Returns:
        :class:`Ladder` (empty when nothing passes).

    Raises:
        QevalInputError: unknown ``quality_metric``.
    """
    qdir = quality_direction(quality_metric)
    depth = gate_report.depth
    ref = gate_report.reference
    members: list[str] = []
    if ref in tiers and tiers[ref].get("status") == STATUS_OK:
        members.append(ref)
    members += [n for n in gate_report.passing if n not in members]

    ladder = Ladder(depth=depth, quality_metric=quality_metric)
    placed: list[LadderStep] = []
    for n in members:
        mem = peak_bytes_at(tiers.get(n), depth)
        if mem is None:
            ladder.unplaced[n] = f"no peak memory at depth {depth}"
            continue
        placed.append(LadderStep(n, mem, quality_value(tiers.get(n), quality_metric, is_reference=(n == ref))))

    def qkey(s: LadderStep) -> float:
        if s.quality is None:
            return float("inf")
        return s.quality if qdir == "min" else -s.quality

    placed.sort(key=lambda s: (-s.peak_bytes, qkey(s), s.tier))

    def lost(q: float | None, q_other: float | None) -> float | None:
        if q is None or q_other is None:
            return None
        return q - q_other if qdir == "min" else q_other - q

    for i, s in enumerate(placed):
        first = placed[0]
        prev = placed[i - 1] if i else s
        s.saved_vs_prev_bytes = prev.peak_bytes - s.peak_bytes
        s.saved_vs_prev_pct = 100.0 * s.saved_vs_prev_bytes / prev.peak_bytes if prev.peak_bytes else 0.0
        s.saved_vs_first_bytes = first.peak_bytes - s.peak_bytes
        s.saved_vs_first_pct = 100.0 * s.saved_vs_first_bytes / first.peak_bytes if first.peak_bytes else 0.0
        s.quality_lost_vs_prev = lost(s.quality, prev.quality)
        s.quality_lost_vs_first = lost(s.quality, first.quality)
    ladder.steps = placed
    return ladder
