"""Overload ladder: the gate-passing tiers in the order a service steps down them when
load peaks, each rung showing the users it gains and the memory and quality it gives up.

Members are the candidates that pass the gate plus the reference tier when its result
exists with status ``ok`` (the reference passes by definition); a candidate the gate could
not judge (verdict ``error``) has not passed and is never a member.

Order (``Ladder.basis``):

* ``users_at_slo`` (whenever a member has a load sweep): users at SLO at the recipe's load
  depth (``load.users_at_slo``, qeval.measure.load), fewest first: the first rung is the
  tier to serve while load allows, each later rung serves more users at the SLO. Ties are
  broken by better quality, then more peak memory, then name. A passing tier without a
  load sweep cannot be placed and is listed in ``Ladder.unplaced`` with the reason.
* ``peak_memory`` (no member has a load sweep, e.g. ``load.enabled: false``): peak bytes at
  the gate depth, largest first; ties by better quality, then name; a tier without a peak
  at that depth is unplaced.

Each rung also carries its requests/s at the SLO at its own output length (a tier whose
answers run longer than the reference's serves fewer requests at the same users;
:func:`qeval.analysis.capacity.requests_per_s_at_slo`). Users gained are counted against the rung above and the first rung. Memory is the
single-stream peak at the gate depth (bytes); "saved" is positive when a rung needs less.
"Quality lost" is signed so that a positive number is always worse: for ``kld_mean`` and
``ppl_ratio`` (lower is better) it is ``q_step - q_other``; for ``pass_rate`` (higher is
better) it is ``q_other - q_step``.

The **rate ladder** (``Ladder.rates``, :func:`rate_ladder`; whenever a member has an open
loop, ``load.arrivals``) says at what offered rate to step down: "serve A up to R1 req/s;
above R1 step down to B (quality given up vs A), which holds to R2; ...; above R_last
refuse (rate-limit here)". Each rung's rate is its tier's measured knee (the highest
measured rate meeting the SLO; qeval.measure.openloop), never extrapolated. The first rung
is the member of best quality with a knee; each next rung is the best-quality remaining
member whose knee is higher than the rung above's (a member that holds no higher rate than
a better one is left out, with the reason). The closed loop's users-at-SLO order above
stays as it is.

**Emulated dtypes** (``Ladder.emulated``, :func:`emulated_members`): the members whose
stored row says torch computed them in a dtype the run's CPU has no native instructions
for (``TierResult.dtype_emulated``, e.g. BF16 without AVX512_BF16: qeval.engines.hf). Their
users at SLO and knees are torch's emulated CPU path, not that dtype as served natively (on
a GPU), and the ladders' captions say so (:func:`emulated_caption`). Read from the rows, as
measured, never from the machine that renders the report.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..results import STATUS_OK, LoadSection, TierResult
from .capacity import requests_per_s_at_slo
from .gate import GateReport
from .pareto import finite, peak_bytes_at, quality_direction, quality_value, users_at_slo_of


@dataclass
class LadderStep:
    """One rung.

    Attributes:
        tier: tier name.
        peak_bytes: peak memory at the gate depth, bytes (None when not measured).
        quality: value of the quality metric (None when the tier lacks it).
        users_at_slo: users at SLO at the load depth (None without a load sweep).
        max_decode_tokens_per_s: the sweep's best aggregate decode tokens/s.
        requests_per_s_at_slo: requests/s at the SLO at the tier's own output length
            (:func:`qeval.analysis.capacity.requests_per_s_at_slo`; None without load figures).
        output_tokens_rel: the tier's new tokens per answer / the reference's (None: no answers).
        users_gained_vs_prev / users_gained_vs_first: users at SLO gained versus the rung
            above / the first rung (0 for the first rung; None without load figures).
        saved_vs_prev_bytes / saved_vs_prev_pct: memory freed versus the rung above
            (0 for the first rung; None when either peak is missing).
        saved_vs_first_bytes / saved_vs_first_pct: memory freed versus the first rung.
        quality_lost_vs_prev / quality_lost_vs_first: quality given up (positive = worse),
            None when either side lacks the metric.
    """
    tier: str
    peak_bytes: float | None
    quality: float | None
    users_at_slo: float | None = None
    max_decode_tokens_per_s: float | None = None
    users_gained_vs_prev: float | None = None
    users_gained_vs_first: float | None = None
    saved_vs_prev_bytes: float | None = 0.0
    saved_vs_prev_pct: float | None = 0.0
    saved_vs_first_bytes: float | None = 0.0
    saved_vs_first_pct: float | None = 0.0
    quality_lost_vs_prev: float | None = None
    quality_lost_vs_first: float | None = None
    requests_per_s_at_slo: float | None = None
    output_tokens_rel: float | None = None


@dataclass
class Ladder:
    """The ladder: ``basis`` ``users_at_slo`` or ``peak_memory``; ``depth`` the gate depth
    (memory), ``load_depth`` the load sweep's prompt depth (None without one)."""
    depth: int
    quality_metric: str
    steps: list[LadderStep] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)
    basis: str = "peak_memory"
    load_depth: int | None = None
    rates: "RateLadder | None" = None
    emulated: dict[str, str] = field(default_factory=dict)  # {member: dtype torch emulated on the run's CPU}

    @property
    def order(self) -> list[str]:
        return [s.tier for s in self.steps]

    def to_dict(self) -> dict:
        return {"depth": self.depth, "quality_metric": self.quality_metric, "basis": self.basis,
                "load_depth": self.load_depth, "steps": [asdict(s) for s in self.steps],
                "unplaced": dict(self.unplaced), "rates": self.rates.to_dict() if self.rates else None,
                "emulated": dict(self.emulated)}


#: How a caption names a dtype torch emulated on the run's CPU.
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "FP16"}


def emulated_members(tiers: dict[str, TierResult], members: list[str]) -> dict[str, str]:
    """``{member: dtype}`` of the ``members`` whose stored row says torch computed them in a
    dtype without native instructions on the run's CPU (``TierResult.dtype_emulated``)."""
    out = {}
    for n in members:
        t = tiers.get(n)
        if t is not None and t.dtype_emulated:
            out[n] = t.dtype_emulated
    return out


def emulated_caption(emulated: dict[str, str], on: list[str], what: str = "users at SLO") -> str:
    """The ladder caption's sentence on the rungs among ``on`` that ran an emulated dtype
    (``emulated``: :attr:`Ladder.emulated`), e.g. "bf16, bf16-kv8: users at SLO on the
    run's CPU are torch's CPU path with BF16 emulated (no native BF16 instructions), not
    BF16 as served on a GPU."; "" when there are none."""
    by: dict[str, list[str]] = {}
    for n in on:
        if n in emulated:
            by.setdefault(emulated[n], []).append(n)
    parts = []
    for dtype, names in by.items():
        d = DTYPE_NAMES.get(dtype, dtype)
        parts.append(f"{', '.join(names)}: {what} on the run's CPU are torch's CPU path with {d} emulated "
                     f"(no native {d} instructions), not {d} as served on a GPU")
    return "; ".join(parts) + "." if parts else ""


@dataclass
class RateRung:
    """One rung of the rate ladder.

    Attributes:
        tier: tier name.
        knee_rps: the tier's knee: the highest measured offered rate meeting the SLO (req/s).
        from_rps: the rate above which the service steps down to this rung (the rung above's
            knee; None for the first rung).
        above_rps: the first measured rate above the knee (missing the SLO), None when the
            knee is the last measured rate.
        kld_mean, pass_rate, flips_pass_to_fail: the tier's quality (KLD nats and flips
            against the reference; pass rate a share).
        kld_given_up / pass_rate_given_up / flips_given_up: versus the first rung (positive =
            worse; None when either side lacks the figure).
    """
    tier: str
    knee_rps: float
    from_rps: float | None = None
    above_rps: float | None = None
    kld_mean: float | None = None
    pass_rate: float | None = None
    flips_pass_to_fail: int | None = None
    kld_given_up: float | None = None
    pass_rate_given_up: float | None = None
    flips_given_up: int | None = None


@dataclass
class RateLadder:
    """The ladder in rates: rungs in the order a service steps down them, the rate above
    which it refuses (the last rung's knee), members left out with why, and the sentence."""
    steps: list[RateRung] = field(default_factory=list)
    refuse_above_rps: float | None = None
    unplaced: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        """"serve A up to R1 req/s; above R1 req/s step down to B (gives up vs A: ...), which
        holds to R2 req/s; above R2 req/s refuse (rate-limit here)"; "" when empty."""
        if not self.steps:
            return ""
        first = self.steps[0]
        out = [f"serve {first.tier} up to {first.knee_rps:g} req/s"]
        for r in self.steps[1:]:
            lost = []
            if r.kld_given_up is not None:
                lost.append(f"KLD {r.kld_given_up:+.3g} nats")
            if r.pass_rate_given_up is not None:
                lost.append(f"pass rate {-100 * r.pass_rate_given_up:+.1f} pts")
            if r.flips_given_up is not None:
                lost.append(f"{r.flips_given_up:+d} pass->fail flips")
            gives = f" (gives up vs {first.tier}: {', '.join(lost)})" if lost else ""
            out.append(f"above {r.from_rps:g} req/s step down to {r.tier}{gives}, which holds to {r.knee_rps:g} req/s")
        out.append(f"above {self.refuse_above_rps:g} req/s refuse (rate-limit here)")
        return "; ".join(out)

    def to_dict(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps], "refuse_above_rps": self.refuse_above_rps,
                "unplaced": dict(self.unplaced), "text": self.text()}


def _quality(t: TierResult | None, is_reference: bool) -> tuple[float | None, float | None, int | None]:
    """(KLD mean, pass rate, pass->fail flips) of a tier, the reference's KLD 0 and flips 0."""
    q = t.quality if t is not None else None
    fid = q.fidelity if q is not None else None
    beh = q.behaviour if q is not None else None
    kld = finite(fid.kld_mean) if fid is not None else None
    flips = beh.flips_pass_to_fail if beh is not None else None
    if is_reference:
        kld = 0.0 if kld is None else kld
        flips = 0 if flips is None else flips
    return kld, (finite(beh.pass_rate) if beh is not None else None), flips


def rate_ladder(tiers: dict[str, TierResult], members: list[str], reference: str,
                quality_metric: str = "kld_mean") -> RateLadder | None:
    """The ladder in rates over ``members`` (gate-passing tiers and the reference; rules in
    the module docstring); None when no member has an open loop."""
    qdir = quality_direction(quality_metric)
    with_loop = [n for n in members if tiers.get(n) is not None and tiers[n].load is not None
                 and tiers[n].load.arrivals is not None]
    if not with_loop:
        return None
    lad = RateLadder()
    cands = []
    for n in members:
        ar = tiers[n].load.arrivals if n in with_loop else None
        if ar is None:
            lad.unplaced[n] = "no open loop (load.arrivals)"
            continue
        if ar.knee is None or ar.knee.rate_rps is None:
            lad.unplaced[n] = "no measured rate meets the SLO" + (f" ({ar.stopped})" if ar.stopped else "")
            continue
        q = quality_value(tiers[n], quality_metric, is_reference=(n == reference))
        qk = float("inf") if q is None else (q if qdir == "min" else -q)
        cands.append((qk, n != reference, n, ar.knee))
    cands.sort(key=lambda c: (c[0], c[1], c[2]))
    top = None
    for _, _, n, k in cands:
        if top is not None and k.rate_rps <= top:
            better = lad.steps[-1].tier
            lad.unplaced[n] = f"holds no higher rate ({k.rate_rps:g} req/s) than {better} of better quality"
            continue
        kld, pr, flips = _quality(tiers[n], n == reference)
        lad.steps.append(RateRung(n, float(k.rate_rps), top, k.above_rps, kld, pr, flips))
        top = float(k.rate_rps)
    first = lad.steps[0] if lad.steps else None
    for r in lad.steps[1:]:
        r.kld_given_up = r.kld_mean - first.kld_mean if r.kld_mean is not None and first.kld_mean is not None else None
        r.pass_rate_given_up = (first.pass_rate - r.pass_rate
                                if r.pass_rate is not None and first.pass_rate is not None else None)
        r.flips_given_up = (r.flips_pass_to_fail - first.flips_pass_to_fail
                            if r.flips_pass_to_fail is not None and first.flips_pass_to_fail is not None else None)
    lad.refuse_above_rps = top
    return lad


def _load(t: TierResult | None) -> LoadSection:
    """The tier's load section, or an empty one."""
    return (t.load if t is not None else None) or LoadSection()


def _saved(a: float | None, b: float | None) -> tuple[float | None, float | None]:
    if a is None or b is None:
        return None, None
    return a - b, (100.0 * (a - b) / a if a else 0.0)


def fallback_ladder(tiers: dict[str, TierResult], gate_report: GateReport,
                    quality_metric: str = "kld_mean") -> Ladder:
    """Build the overload ladder from a gate verdict (see the module docstring).

    Args:
        tiers: ``{tier name: tier result}``.
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
    if ref in tiers and tiers[ref].status == STATUS_OK:
        members.append(ref)
    members += [n for n in gate_report.passing if n not in members]

    by_users = any(users_at_slo_of(tiers.get(n)) is not None for n in members)
    ladder = Ladder(depth=depth, quality_metric=quality_metric, basis="users_at_slo" if by_users else "peak_memory")
    ladder.rates = rate_ladder(tiers, members, ref, quality_metric)
    ladder.emulated = emulated_members(tiers, members)
    if by_users:
        depths = {_load(tiers.get(n)).depth for n in members} - {None}
        ladder.load_depth = int(next(iter(depths))) if len(depths) == 1 else None
    placed: list[LadderStep] = []
    for n in members:
        t = tiers.get(n)
        mem = peak_bytes_at(t, depth)
        users = users_at_slo_of(t)
        if by_users and users is None:
            err = _load(t).error
            ladder.unplaced[n] = f"no load sweep ({err})" if err else "no load sweep (users at SLO)"
            continue
        if not by_users and mem is None:
            ladder.unplaced[n] = f"no peak memory at depth {depth}"
            continue
        step = LadderStep(n, mem, quality_value(t, quality_metric, is_reference=(n == ref)), users,
                          finite(_load(t).max_decode_tokens_per_s))
        req = requests_per_s_at_slo(n, t, is_reference=(n == ref))
        step.requests_per_s_at_slo = req.requests_per_s if req is not None else None
        step.output_tokens_rel = req.output_tokens_rel if req is not None else None
        placed.append(step)

    def qkey(s: LadderStep) -> float:
        if s.quality is None:
            return float("inf")
        return s.quality if qdir == "min" else -s.quality

    if by_users:
        placed.sort(key=lambda s: (s.users_at_slo, qkey(s), -(s.peak_bytes or 0.0), s.tier))
    else:
        placed.sort(key=lambda s: (-(s.peak_bytes or 0.0), qkey(s), s.tier))

    def lost(q: float | None, q_other: float | None) -> float | None:
        if q is None or q_other is None:
            return None
        return q - q_other if qdir == "min" else q_other - q

    for i, s in enumerate(placed):
        first = placed[0]
        prev = placed[i - 1] if i else s
        s.saved_vs_prev_bytes, s.saved_vs_prev_pct = _saved(prev.peak_bytes, s.peak_bytes)
        s.saved_vs_first_bytes, s.saved_vs_first_pct = _saved(first.peak_bytes, s.peak_bytes)
        if by_users:
            s.users_gained_vs_prev = s.users_at_slo - prev.users_at_slo  # type: ignore[operator]
            s.users_gained_vs_first = s.users_at_slo - first.users_at_slo  # type: ignore[operator]
        s.quality_lost_vs_prev = lost(s.quality, prev.quality)
        s.quality_lost_vs_first = lost(s.quality, first.quality)
    ladder.steps = placed
    return ladder
