"""Pareto front over memory, decode speed and quality at one context depth.

Objectives (docs/design.md, "Pareto front"), all read from stored tier results through
the metric table (:mod:`qeval.metrics`; format in :mod:`qeval.results`):

* **memory**: peak bytes at the depth, ``memory.peak_bytes["<depth>"]`` (minimise).
  There is deliberately *no* fallback to ``memory.weight_bytes``: weights alone leave out
  the KV cache and activations, so mixing them with measured peaks would compare unlike
  figures. A tier without a peak at the depth is "not compared".
* **speed** (``pareto.speed`` in the recipe): ``decode``, the single-stream
  ``speed["<depth>"].decode_tokens_per_s`` in tokens/s (maximise, the default), or
  ``users_at_slo``, the capacity the load sweep measured (``load.users_at_slo``, streams,
  maximise).
* **quality**: the recipe's ``gate.quality_metric``: ``kld_mean`` (nats, minimise),
  ``ppl_ratio`` (minimise) or ``pass_rate`` (share 0..1, maximise).

A tier is *dominated* when another tier is no worse on all three and strictly better on
at least one. Tiers identical on all three do not dominate each other, so ties are all on
the front. Only tiers with status ``ok`` and all three figures take part; the others are
listed as not compared, with the reason, and so is a tier the gate could not judge (verdict
``error``: its reference did not finish; ``excluded``).

The reference tier's KLD is 0 and its PPL ratio 1 by definition, so a reference result
that lacks them (the reference is not scored against itself) uses those values. Other
tiers never get defaults.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from ..errors import QevalInputError
from ..metrics import GIB, MEMORY_OBJECTIVE, METRICS, SPEED_OBJECTIVE, SPEED_OBJECTIVES, finite, objective
from ..metrics import value as metric_value
from ..results import STATUS_OK, TierResult

__all__ = ["GIB", "ParetoEntry", "ParetoResult", "decode_at", "dominates", "finite", "pareto_front",
           "peak_bytes_at", "quality_direction", "quality_value", "users_at_slo_of"]


def peak_bytes_at(tier: TierResult | None, depth: int) -> float | None:
    """Peak memory (bytes) measured at context ``depth`` (tokens), or None."""
    return metric_value(tier, MEMORY_OBJECTIVE, depth)


def decode_at(tier: TierResult | None, depth: int) -> float | None:
    """Decode speed (tokens/s) after ``depth`` context tokens, or None."""
    return metric_value(tier, SPEED_OBJECTIVE, depth)


def users_at_slo_of(tier: TierResult | None) -> float | None:
    """Users at SLO measured by the tier's load sweep (``load.users_at_slo``: the largest
    concurrency meeting both SLO percentiles with nothing refused; qeval.measure.load), or None."""
    return metric_value(tier, "users_at_slo")


def quality_value(tier: TierResult | None, metric: str, *, is_reference: bool = False) -> float | None:
    """The quality objective ``metric`` (``kld_mean``, ``ppl_ratio`` or ``pass_rate``) of a tier.

    For the reference tier a missing ``kld_mean`` is 0 and a missing ``ppl_ratio`` is 1
    (by definition, :attr:`qeval.metrics.Metric.reference_value`); nothing else is defaulted.

    Raises:
        QevalInputError: not a quality objective.
    """
    return metric_value(tier, objective(metric).name, is_reference=is_reference)


def quality_direction(metric: str) -> Literal["min", "max"]:
    """``"min"`` when lower is better for ``metric``, ``"max"`` when higher is better."""
    return objective(metric).direction


@dataclass
class ParetoEntry:
    """One tier's place relative to the front.

    Attributes:
        tier: tier name.
        status: ``"front"``, ``"dominated"`` or ``"not_compared"``.
        memory_bytes: peak bytes at the depth (None when not compared for lack of it).
        decode_tokens_per_s: decode speed at the depth, tokens/s.
        quality: value of the quality metric.
        dominated_by: for a dominated tier, one tier on the front that dominates it.
        reason: for a tier not compared, why (e.g. ``"status failed"``).
        users_at_slo: users at SLO from the load sweep (streams), when measured.
    """
    tier: str
    status: Literal["front", "dominated", "not_compared"]
    memory_bytes: float | None = None
    decode_tokens_per_s: float | None = None
    quality: float | None = None
    dominated_by: str | None = None
    reason: str | None = None
    users_at_slo: float | None = None

    @property
    def mark(self) -> str:
        """Short text for tables: ``front``, ``dominated by X`` or ``not compared (reason)``."""
        if self.status == "front":
            return "front"
        if self.status == "dominated":
            return f"dominated by {self.dominated_by}"
        return f"not compared ({self.reason})"


@dataclass
class ParetoResult:
    """The front at one depth: ``entries`` in the order the tiers were given; ``speed`` the
    speed objective (``decode`` or ``users_at_slo``)."""
    depth: int
    quality_metric: str
    entries: list[ParetoEntry] = field(default_factory=list)
    speed: str = "decode"

    def speed_of(self, e: ParetoEntry) -> float | None:
        """The entry's value of the speed objective."""
        return e.users_at_slo if self.speed == "users_at_slo" else e.decode_tokens_per_s

    @property
    def front(self) -> list[str]:
        """Names of the tiers on the front."""
        return [e.tier for e in self.entries if e.status == "front"]

    @property
    def dominated(self) -> dict[str, str]:
        """``{dominated tier: a tier on the front that dominates it}``."""
        return {e.tier: e.dominated_by for e in self.entries if e.status == "dominated"}  # type: ignore[misc]

    @property
    def not_compared(self) -> dict[str, str]:
        """``{tier: reason it was left out}``."""
        return {e.tier: e.reason or "" for e in self.entries if e.status == "not_compared"}

    def entry(self, tier: str) -> ParetoEntry:
        """The entry for ``tier``; KeyError if absent."""
        for e in self.entries:
            if e.tier == tier:
                return e
        raise KeyError(tier)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"depth": self.depth, "quality_metric": self.quality_metric, "speed": self.speed,
                "front": self.front, "entries": [asdict(e) for e in self.entries]}


def dominates(a: tuple[float, float, float], b: tuple[float, float, float],
              quality_dir: str = "min") -> bool:
    """True when point ``a`` dominates ``b``. Points are ``(memory_bytes, speed, quality)``
    (speed: decode tokens/s or users at SLO, :data:`qeval.metrics.SPEED_OBJECTIVES`); memory
    and speed in their metrics' directions (memory minimised, speed maximised), quality per
    ``quality_dir``."""
    dirs = (METRICS[MEMORY_OBJECTIVE].direction, METRICS[SPEED_OBJECTIVE].direction, quality_dir)
    sa = [x if d == "min" else -x for x, d in zip(a, dirs)]
    sb = [x if d == "min" else -x for x, d in zip(b, dirs)]
    return all(p <= q for p, q in zip(sa, sb)) and any(p < q for p, q in zip(sa, sb))


def pareto_front(tiers: dict[str, TierResult], depth: int, quality_metric: str = "kld_mean",
                 reference: str | None = None, speed: str = "decode",
                 excluded: dict[str, str] | None = None) -> ParetoResult:
    """Split tiers into the Pareto front, dominated tiers and tiers not compared.

    Args:
        tiers: ``{tier name: tier result}`` (as from :func:`qeval.results.load_run`).
        depth: context depth in tokens for memory and decode speed.
        quality_metric: ``kld_mean`` | ``ppl_ratio`` | ``pass_rate``.
        reference: name of the reference tier (gets KLD 0 / PPL ratio 1 when missing).
        speed: the speed objective: ``decode`` (tokens/s at ``depth``) or ``users_at_slo``.
        excluded: ``{tier: reason}`` kept off the front whatever their figures (not
            compared, with the reason): the gate's ``error`` candidates, whose figures it
            could not vouch for (:mod:`qeval.analysis.gate`).

    Returns:
        :class:`ParetoResult`; each dominated tier names a dominating tier that is itself
        on the front (one always exists: domination is transitive over a finite set),
        the first such in the given order.

    Raises:
        QevalInputError: unknown ``quality_metric`` or ``speed``.
    """
    qdir = quality_direction(quality_metric)
    if speed not in SPEED_OBJECTIVES:
        raise QevalInputError(f"unknown speed objective {speed!r} (expected {' or '.join(SPEED_OBJECTIVES)})",
                              field="pareto.speed")
    result = ParetoResult(depth=int(depth), quality_metric=quality_metric, speed=speed)
    points: dict[str, tuple[float, float, float]] = {}
    for name, t in tiers.items():
        status = t.status if t is not None else None
        mem = peak_bytes_at(t, depth)
        dec = decode_at(t, depth)
        users = users_at_slo_of(t)
        q = quality_value(t, quality_metric, is_reference=(name == reference))
        entry = ParetoEntry(tier=name, status="not_compared", memory_bytes=mem,
                            decode_tokens_per_s=dec, quality=q, users_at_slo=users)
        sp, sp_label = (users, "users at SLO (load sweep)") if speed == "users_at_slo" else \
            (dec, f"decode tokens/s at depth {depth}")
        if status != STATUS_OK:
            entry.reason = f"status {status}"
        elif excluded and name in excluded:
            entry.reason = excluded[name]
        else:
            missing = [label for label, v in ((f"peak memory at depth {depth}", mem), (sp_label, sp),
                                              (quality_metric, q)) if v is None]
            if missing:
                entry.reason = "no " + ", no ".join(missing)
            else:
                points[name] = (mem, sp, q)  # type: ignore[assignment]
        result.entries.append(entry)

    front = [n for n in points if not any(dominates(points[o], points[n], qdir)
                                          for o in points if o != n)]
    for e in result.entries:
        if e.tier not in points:
            continue
        if e.tier in front:
            e.status = "front"
        else:
            e.status = "dominated"
            e.dominated_by = next(f for f in front if dominates(points[f], points[e.tier], qdir))
    return result
