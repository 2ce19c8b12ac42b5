"""Release gate: judge each candidate tier against the recipe's thresholds.

Rules are exactly the fields of :class:`qeval.recipe.GateRules`; a rule left unset
(None) is not checked. Each candidate also gets a ``status`` check first (the tier's
result must exist and have status ``ok``), so a tier that failed or was never built
fails the gate even when no rule is set.

Fail closed: a set rule whose figure is missing on the candidate (or, for a relative
rule, on the reference), or whose tier did not finish, fails with a message naming what
is missing. Figures that are not finite numbers count as missing.

Units: memory in bytes (``max_peak_memory_gib`` thresholds in GiB = 2**30 bytes), speed in
tokens/s, rates as shares 0..1, KLD in nats, users at SLO in streams. Memory and speed
rules use the gate depth (``gate.depth``, default ``speed.main_depth``);
``min_users_at_slo_rel`` the load sweep's depth (candidate users at SLO >= rule x the
reference's; value = the candidate's users, threshold = rule x reference users).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from ..errors import EXIT_GATE_FAILED, EXIT_OK, QevalInputError
from ..recipe import GateRules, GateSpec, SpeedSpec
from ..results import STATUS_OK, get_path
from .pareto import GIB, decode_at, finite, peak_bytes_at, users_at_slo_of

#: Rule names in the order they are checked and reported (GateRules field order).
RULES: tuple[str, ...] = tuple(GateRules.model_fields)
STATUS_RULE = "status"


@dataclass
class RuleResult:
    """One rule applied to one candidate.

    Attributes:
        rule: GateRules field name (or ``"status"``).
        passed: whether the candidate meets it.
        value: the candidate's figure as compared (None when missing). For
            ``max_peak_memory_gib`` in GiB; for ``max_peak_memory_rel``/``min_decode_rel``
            the ratio candidate/reference; for ``min_pass_rate_rel`` the candidate's
            ``pass_ci_low``.
        threshold: the bound the value is compared with (for ``min_pass_rate_rel``:
            rule x reference pass rate; None when it cannot be formed).
        message: one line a person can read.
    """
    rule: str
    passed: bool
    value: Any
    threshold: Any
    message: str


@dataclass
class CandidateVerdict:
    """All rule results for one candidate tier."""
    tier: str
    status: str | None
    rules: list[RuleResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rules)

    @property
    def verdict(self) -> str:
        """``"pass"`` or ``"fail"``."""
        return "pass" if self.passed else "fail"

    @property
    def failed_rules(self) -> list[RuleResult]:
        return [r for r in self.rules if not r.passed]


@dataclass
class GateReport:
    """The gate's verdict for every candidate.

    Attributes:
        reference: reference tier name.
        depth: depth (tokens) used for memory and speed rules.
        rules: the rules that were set, ``{name: threshold}``.
        candidates: one :class:`CandidateVerdict` per candidate, in recipe order.
    """
    reference: str
    depth: int
    rules: dict[str, float]
    candidates: list[CandidateVerdict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every candidate passes (vacuously true with no candidates)."""
        return all(c.passed for c in self.candidates)

    def exit_code(self) -> int:
        """0 when every candidate passes, 1 when any fails (qeval.errors exit codes)."""
        return EXIT_OK if self.passed else EXIT_GATE_FAILED

    def candidate(self, tier: str) -> CandidateVerdict:
        """The verdict for ``tier``; KeyError if it was not a candidate."""
        for c in self.candidates:
            if c.tier == tier:
                return c
        raise KeyError(tier)

    @property
    def passing(self) -> list[str]:
        return [c.tier for c in self.candidates if c.passed]

    def to_dict(self) -> dict:
        """JSON-ready form written to ``gate.json``."""
        return {
            "passed": self.passed,
            "exit_code": self.exit_code(),
            "reference": self.reference,
            "depth": self.depth,
            "rules": dict(self.rules),
            "candidates": [
                {"tier": c.tier, "status": c.status, "verdict": c.verdict,
                 "failed_rules": [r.rule for r in c.failed_rules],
                 "rules": [asdict(r) for r in c.rules]}
                for c in self.candidates],
        }


# ---- recipe helpers ---------------------------------------------------------------------

def validate_section(model: type, data: Any, where: str):
    """Validate one recipe section dict (``None``: all defaults) with a pydantic model.

    Raises:
        QevalInputError: the first validation error, naming the dotted field
            (``gate.quality_metric: ...``).
    """
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in (where, *err["loc"]))
        raise QevalInputError(err.get("msg", "invalid value"), field=loc) from None


def as_gate_spec(gate: GateSpec | dict | None) -> GateSpec:
    """A :class:`GateSpec` from a spec or its dict form (None: all defaults).

    Raises:
        QevalInputError: the dict does not validate (names the field).
    """
    if isinstance(gate, GateSpec):
        return gate
    return validate_section(GateSpec, gate, "gate")


def analysis_depth(recipe: dict | None) -> int:
    """Depth (tokens) for the Pareto front and the gate: ``gate.depth`` or ``speed.main_depth``
    (default: the middle of ``speed.depths``) from a recipe dict.

    Raises:
        QevalInputError: the recipe's ``speed`` or ``gate`` section does not validate.
    """
    recipe = recipe or {}
    speed = validate_section(SpeedSpec, recipe.get("speed"), "speed")
    gate = as_gate_spec(recipe.get("gate"))
    return int(gate.depth or speed.main_depth)


def tier_order(run: dict | None, tiers: dict[str, dict]) -> list[str]:
    """Tier names in recipe order (``run["recipe"]["tiers"]``), then any other result."""
    order = [t.get("name") for t in get_path(run, "recipe", "tiers") or [] if isinstance(t, dict)]
    order = [n for n in order if n]
    return order + [n for n in tiers if n not in order]


# ---- the gate ------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cmp(rule: str, value: float | None, threshold: float | None, kind: str, what: str,
         missing: str | None = None) -> RuleResult:
    """``kind`` is ``"max"`` (value <= threshold) or ``"min"`` (value >= threshold)."""
    if missing is not None or value is None or threshold is None:
        return RuleResult(rule, False, value, threshold, missing or f"missing {what}")
    ok = value <= threshold if kind == "max" else value >= threshold
    op = "<=" if kind == "max" else ">="
    verdict = "ok" if ok else "FAILS"
    return RuleResult(rule, ok, value, threshold, f"{what} {_fmt(value)} {op} {_fmt(threshold)}: {verdict}"
                      if ok else f"{what} {_fmt(value)} is not {op} {_fmt(threshold)}")


def _check_rule(rule: str, t: float, cand: dict, ref: dict | None, ref_name: str,
                depth: int) -> RuleResult:
    ref_ok = ref is not None and ref.get("status") == STATUS_OK

    def ref_missing(what: str) -> str | None:
        if ref is None:
            return f"reference tier {ref_name!r} has no result, so {what} has no reference value"
        if not ref_ok:
            return f"reference tier {ref_name!r} has status {ref.get('status')}, so {what} has no reference value"
        return None

    if rule == "max_kld_mean":
        v = finite(get_path(cand, "quality", "fidelity", "kld_mean"))
        return _cmp(rule, v, t, "max", "KLD mean (quality.fidelity.kld_mean)")
    if rule == "min_same_top_rate":
        v = finite(get_path(cand, "quality", "fidelity", "same_top_rate"))
        return _cmp(rule, v, t, "min", "same-top rate (quality.fidelity.same_top_rate)")
    if rule == "max_ppl_ratio":
        v = finite(get_path(cand, "quality", "fidelity", "ppl_ratio"))
        return _cmp(rule, v, t, "max", "PPL ratio (quality.fidelity.ppl_ratio)")
    if rule == "min_pass_rate_rel":
        v = finite(get_path(cand, "quality", "behaviour", "pass_ci_low"))
        what = "pass rate 95% lower bound (quality.behaviour.pass_ci_low)"
        miss = ref_missing("min_pass_rate_rel")
        r = finite(get_path(ref, "quality", "behaviour", "pass_rate")) if miss is None else None
        if miss is None and r is None:
            miss = f"reference tier {ref_name!r} lacks quality.behaviour.pass_rate"
        if miss is None and v is None:
            miss = f"missing {what}"
        res = _cmp(rule, v, None if r is None else t * r, "min", what, miss)
        if miss is None:
            res.message += f" (= {_fmt(t)} x reference pass rate {_fmt(r)})"
        return res
    if rule == "max_flip_rate":
        v = finite(get_path(cand, "quality", "behaviour", "flip_rate"))
        return _cmp(rule, v, t, "max", "flip rate (quality.behaviour.flip_rate)")
    if rule == "max_peak_memory_gib":
        b = peak_bytes_at(cand, depth)
        return _cmp(rule, None if b is None else b / GIB, t, "max",
                    f"peak memory GiB at depth {depth} (memory.peak_bytes.{depth})")
    if rule == "max_peak_memory_rel":
        what = f"peak memory at depth {depth} relative to reference"
        b = peak_bytes_at(cand, depth)
        miss = None if b is not None else f"missing peak memory at depth {depth} (memory.peak_bytes.{depth})"
        miss = miss or ref_missing("max_peak_memory_rel")
        rb = peak_bytes_at(ref, depth) if miss is None else None
        if miss is None and not rb:
            miss = f"reference tier {ref_name!r} lacks peak memory at depth {depth}"
        return _cmp(rule, None if miss else b / rb, t, "max", what, miss)  # type: ignore[operator]
    if rule == "min_decode_tokens_per_s":
        v = decode_at(cand, depth)
        return _cmp(rule, v, t, "min", f"decode tokens/s at depth {depth} (speed.{depth}.decode_tokens_per_s)")
    if rule == "min_decode_rel":
        what = f"decode tokens/s at depth {depth} relative to reference"
        v = decode_at(cand, depth)
        miss = None if v is not None else (f"missing decode tokens/s at depth {depth} "
                                           f"(speed.{depth}.decode_tokens_per_s)")
        miss = miss or ref_missing("min_decode_rel")
        rv = decode_at(ref, depth) if miss is None else None
        if miss is None and not rv:
            miss = f"reference tier {ref_name!r} lacks decode tokens/s at depth {depth}"
        return _cmp(rule, None if miss else v / rv, t, "min", what, miss)  # type: ignore[operator]
    if rule == "min_users_at_slo_rel":
        what = "users at SLO (load.users_at_slo)"
        v = users_at_slo_of(cand)
        miss = None if v is not None else f"missing {what}: no load sweep"
        miss = miss or ref_missing("min_users_at_slo_rel")
        r = users_at_slo_of(ref) if miss is None else None
        if miss is None and r is None:
            miss = f"reference tier {ref_name!r} lacks load.users_at_slo"
        res = _cmp(rule, v, None if r is None else t * r, "min", what, miss)
        if miss is None:
            res.message += f" (= {_fmt(t)} x reference users at SLO {_fmt(r)})"
        return res
    if rule == "max_budget_exhaustion":
        v = finite(get_path(cand, "quality", "behaviour", "budget_exhausted_rate"))
        return _cmp(rule, v, t, "max", "budget exhaustion rate (quality.behaviour.budget_exhausted_rate)")
    raise QevalInputError(f"unknown gate rule {rule!r}", field="gate.rules")  # pragma: no cover


def evaluate_gate(run: dict | None, tiers: dict[str, dict], gate: GateSpec | dict | None,
                  depth: int) -> GateReport:
    """Judge every candidate tier against the gate's rules.

    Args:
        run: ``run.json`` content; only ``run["recipe"]["tiers"]`` is used, for the order
            of the default candidates (every tier except the reference). May be None.
        tiers: ``{tier name: tier result dict}``.
        gate: the recipe's ``gate`` section (:class:`GateSpec` or its dict form).
        depth: depth in tokens for the memory and speed rules.

    Returns:
        :class:`GateReport`. A candidate with no result file, or a status other than ``ok``,
        fails its ``status`` check and every set rule (fail closed).

    Raises:
        QevalInputError: ``gate`` does not validate.
    """
    spec = as_gate_spec(gate)
    ref_name = spec.reference
    ref = tiers.get(ref_name)
    set_rules = {k: v for k, v in spec.rules.model_dump().items() if v is not None}
    if spec.candidates is not None:
        names = list(spec.candidates)
    else:
        names = [n for n in tier_order(run, tiers) if n != ref_name]
    report = GateReport(reference=ref_name, depth=int(depth), rules=set_rules)
    for name in names:
        cand = tiers.get(name)
        status = cand.get("status") if cand else None
        verdict = CandidateVerdict(tier=name, status=status)
        if cand is None:
            why, short = f"tier {name!r} has no result (tiers/{name}.json missing)", "no result"
        elif status != STATUS_OK:
            err = str(cand.get("error") or "").strip().splitlines()
            why = f"tier {name!r} has status {status}" + (f": {err[0]}" if err else "")  # its first line
            short = f"status {status}"
        else:
            why = short = None
        verdict.rules.append(RuleResult(STATUS_RULE, why is None, status, STATUS_OK,
                                        why or "status ok"))
        for rule in RULES:
            if rule not in set_rules:
                continue
            if why is not None:
                verdict.rules.append(RuleResult(rule, False, None, set_rules[rule],
                                                f"not judged: tier has {short}"))
            else:
                verdict.rules.append(_check_rule(rule, float(set_rules[rule]), cand, ref,  # type: ignore[arg-type]
                                                 ref_name, int(depth)))
        report.candidates.append(verdict)
    return report
