"""Decisions on evidence for the gate's behaviour rules: paired tests against the reference,
the smallest damage a suite can see, and "not enough evidence" where it cannot.

A quality rule on pass rates compares a candidate with the reference *on the same checks*
(the same prompts, the same regex or heading checks), so the test is paired: only the
discordant checks carry information, ``b`` that passed on the reference and fail on the
candidate, ``c`` the other way (McNemar 1947). Under "no damage" each discordant check is
equally likely either way, so ``b`` given ``b + c`` is Binomial(b + c, 1/2) and the exact
one-sided p-value of "the candidate is worse" is ``P(X >= b)`` (McNemar's exact test, the
conditional binomial test; lm-evaluation-harness issue #3831 asks for the same paired
comparison of models on one item set). scipy.stats.binomtest computes it; this module only
puts it together with the rule's tolerance and the suite's power.

Three outcomes per rule (:class:`Evidence`):

* **fail**: the damage is shown (p < alpha) *and* the observed drop exceeds what the rule
  tolerates (``tolerance = (1 - rule) x reference rate``);
* **pass**: no damage beyond the tolerance is shown, the observed drop is within it, and the
  suite could have seen a drop the size of the tolerance (its detectable drop, below, is at
  most the tolerance);
* **not enough evidence**: neither: the suite is too small to see the damage the rule guards
  against, or the result is in between. The recipe's ``gate.insufficient_evidence`` says
  what that does to the verdict (fail, warn or pass).

The detectable drop (the power statement) is the smallest true drop ``d`` in pass rate
that the test finds at level alpha with probability ``power`` (default 0.8) over ``n``
paired checks, in the most favourable case for the test (every discordant check one way:
``b ~ Binomial(n, d)``, ``c = 0``): the test rejects when ``b >= k`` with ``k`` the fewest
one-way flips for which ``0.5 ** k <= alpha`` (5 at alpha 0.05), so ``d`` solves
``P(Binomial(n, d) >= k) = power``. Opposite flips only make it larger, so a suite whose
detectable drop exceeds the tolerance cannot see the damage the rule guards against.

For a bound on a share of its own (``max_flip_rate``: flips either way over the compared
checks), the interval decides: Clopper-Pearson's exact one-sided bounds at level alpha
(scipy.stats.binomtest's ``proportion_ci``); fail when the lower bound is above the rule,
pass when the upper bound is at or below it, else not enough evidence; the detectable
share is the smallest observed share whose lower bound would be above the rule.

Libraries checked: scipy.stats (binomtest, binom) computes every probability here;
statsmodels' ``mcnemar`` gives the same two-sided figure but no one-sided paired decision
with a margin, so the decision logic is written here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

PASS, FAIL, INSUFFICIENT = "pass", "fail", "not enough evidence"
Outcome = Literal["pass", "fail", "not enough evidence"]


@dataclass
class Evidence:
    """What one behaviour rule found.

    Attributes:
        outcome: ``pass``, ``fail`` or ``not enough evidence``.
        method: the test, in words (``McNemar exact, one-sided, paired on 21 checks``).
        n: paired checks (or compared checks for a share).
        p_value: one-sided p-value of "worse than allowed" (None where no test ran).
        observed: the observed drop in pass rate (paired) or the observed share.
        tolerance: the largest drop the rule allows (paired) or the rule's bound (share).
        detectable: the smallest drop (paired) or share (share) the suite sees at
            ``alpha`` with ``power``; None when no size of damage can be seen (too few checks).
        interval: the one-sided bounds used (share rules), else None.
        alpha, power: the test's level and the power of the detectable figure.
        why: one line: the figures and the reason for the outcome.
        short: the same in a few words, for the terminal.
    """
    outcome: Outcome
    method: str
    n: int
    p_value: float | None
    observed: float | None
    tolerance: float | None
    detectable: float | None
    interval: tuple[float, float] | None
    alpha: float
    power: float
    why: str
    short: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["interval"] = list(self.interval) if self.interval else None
        return d


def mcnemar_worse_p(b: int, c: int) -> float:
    """Exact one-sided McNemar p-value that the candidate is worse: ``P(X >= b)`` for
    ``X ~ Binomial(b + c, 1/2)`` (1.0 when there are no discordant pairs).

    Args:
        b: checks that pass on the reference and fail on the candidate.
        c: checks that fail on the reference and pass on the candidate.
    """
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest  # start-up time: scipy.stats costs 0.6 s; the gate's CLI paths load lazily
    return float(binomtest(int(b), int(b + c), 0.5, alternative="greater").pvalue)


def fewest_significant_flips(alpha: float) -> int:
    """The fewest one-way discordant pairs (``c = 0``) that reach ``p <= alpha`` in
    :func:`mcnemar_worse_p`: the smallest ``k`` with ``0.5 ** k <= alpha`` (5 at 0.05)."""
    k = 1
    while 0.5 ** k > alpha:
        k += 1
    return k


def detectable_drop(n: int, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest true drop in pass rate that ``n`` paired checks detect at level
    ``alpha`` with probability ``power`` (module notes): the ``d`` with
    ``P(Binomial(n, d) >= k) = power``, ``k`` = :func:`fewest_significant_flips`, found by
    bisection to 1e-4. None when ``n < k`` (no drop can be detected).
    """
    k = fewest_significant_flips(alpha)
    if n < k:
        return None
    def at_least_k(d: float) -> float:  # P(Binomial(n, d) >= k), k small: 1 - the first k terms (math.comb)
        return 1.0 - sum(math.comb(n, i) * d ** i * (1 - d) ** (n - i) for i in range(k))
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if at_least_k(mid) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def paired_rate_rule(b: int, c: int, n: int, ref_rate: float, rule: float, *, alpha: float = 0.05,
                     power: float = 0.8, what: str = "pass rate") -> Evidence:
    """Judge ``candidate rate >= rule x reference rate`` on paired checks (module notes).

    Args:
        b, c: discordant checks (pass on the reference and fail on the candidate; the other way).
        n: paired checks decided on both sides.
        ref_rate: the reference's rate (share 0..1).
        rule: the rule's factor (``min_pass_rate_rel``).

    Raises:
        ValueError: ``n`` < ``b + c`` or a negative count.
    """
    if min(b, c, n) < 0 or b + c > n:
        raise ValueError(f"paired counts b={b}, c={c} do not fit in n={n} checks")
    tolerance = max(0.0, (1.0 - rule) * ref_rate)
    p = mcnemar_worse_p(b, c)
    drop = (b - c) / n if n else None
    det = detectable_drop(n, alpha, power)
    method = f"McNemar exact, one-sided, paired on {n} checks"
    figures = (f"{b} down, {c} up of {n} paired checks (McNemar exact p={p:.3g}); drop "
               f"{'n/a' if drop is None else f'{drop:.3f}'} against a tolerance of {tolerance:.3f} "
               f"(= (1 - {rule:g}) x reference {what} {ref_rate:.3f})")
    see = (f"the suite detects a drop of {det:.3f} at {1 - alpha:.0%} with {power:.0%} power" if det is not None
           else f"{n} checks cannot detect any drop at {1 - alpha:.0%}")
    if tolerance >= ref_rate:  # rule <= 0: even losing every check the reference passes is allowed
        out, why = PASS, f"{figures}: the rule allows losing every check the reference passes"
    elif drop is not None and p < alpha and drop > tolerance:
        out, why = FAIL, f"{figures}: worse than allowed, shown at p < {alpha:g}"
    elif drop is not None and drop <= tolerance and det is not None and det <= tolerance:
        out, why = PASS, f"{figures}; {see}: no damage beyond the tolerance"
    else:
        reason = (f"{see}, more than the {tolerance:.3f} the rule guards against" if det is None or det > tolerance
                  else "the drop is beyond the tolerance but not shown")
        out, why = INSUFFICIENT, f"{figures}; {reason}"
    short = (f"{b} down, {c} up of {n} checks, McNemar p={p:.2g}; drop {drop if drop is not None else 0:.3f}, "
             f"tolerated {tolerance:.3f}, detectable " + (f"{det:.3f}" if det is not None else "none"))
    return Evidence(out, method, n, p, drop, tolerance, det, None, alpha, power, why, short)


def share_rule(k: int, n: int, bound: float, *, alpha: float = 0.05, power: float = 0.8,
               what: str = "flip rate") -> Evidence:
    """Judge ``share <= bound`` for ``k`` events in ``n`` trials (``max_flip_rate``) by
    Clopper-Pearson one-sided bounds at level ``alpha`` (module notes).

    Raises:
        ValueError: ``k`` > ``n`` or a negative count.
    """
    if k < 0 or n < 0 or k > n:
        raise ValueError(f"{k} events do not fit in {n} trials")
    method = f"Clopper-Pearson exact, one-sided {1 - alpha:.0%} bounds, on {n} checks"
    if n == 0:
        return Evidence(INSUFFICIENT, method, 0, None, None, bound, None, None, alpha, power,
                        f"no compared checks: the {what} is unknown")
    from scipy.stats import binomtest  # start-up time: as in mcnemar_worse_p
    lo, hi = cp_bounds(k, n, alpha)
    p = float(binomtest(k, n, bound, alternative="greater").pvalue) if 0 < bound < 1 else None
    rate = k / n
    det = next((j / n for j in range(int(bound * n), n + 1) if cp_bounds(j, n, alpha)[0] > bound), None)
    figures = f"{what} {rate:.3f} ({k} of {n}), one-sided {1 - alpha:.0%} bounds [{lo:.3f}, {hi:.3f}] against {bound:g}"
    if lo > bound:
        out, why = FAIL, f"{figures}: above the bound, shown"
    elif hi <= bound:
        out, why = PASS, f"{figures}: within the bound, shown"
    else:
        shown = f"a {what} of {det:.3f} or more would be shown above it" if det is not None else \
            f"no {what} would be shown above it"
        out, why = INSUFFICIENT, f"{figures}: the interval straddles the bound ({n} checks: {shown})"
    short = f"{k} of {n} checks flipped, {1 - alpha:.0%} bounds [{lo:.3f}, {hi:.3f}] against {bound:g}"
    return Evidence(out, method, n, p, rate, bound, det, (lo, hi), alpha, power, why, short)


def cp_bounds(k: int, n: int, alpha: float) -> tuple[float, float]:
    """Clopper-Pearson one-sided bounds of a share ``k / n`` at level ``alpha`` each:
    ``(beta.ppf(alpha, k, n - k + 1), beta.ppf(1 - alpha, k + 1, n - k))``, 0 and 1 at the
    ends (Clopper & Pearson 1934; scipy's ``binomtest(...).proportion_ci`` computes the
    same, one bound at a time)."""
    from scipy.stats import beta  # start-up time: as in mcnemar_worse_p
    lo = 0.0 if k == 0 else float(beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi
