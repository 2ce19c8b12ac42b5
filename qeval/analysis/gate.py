"""Release gate: judge each candidate tier against the recipe's thresholds.

Rules are :data:`qeval.metrics.GATE_RULES` (the fields of the recipe's ``gate.rules``),
each a bound on one metric of the metric table, absolute, relative to the reference's
value, or against a multiple of a reference figure; a rule left unset (None) is not
checked. Each candidate also gets a ``status`` check first: its own tier's result and the
reference tier's must exist and have status ``ok``.

The gate never blames the model for qeval: a candidate whose tier, or whose reference
tier, has no result or a status other than ``ok`` (a crash in qeval's own code, a failed
stage, a stage aborted at a named fault point, a tier refused for a capability) gets the
verdict ``error`` (:data:`ERROR`), with the reason (which tier, its status, the short
error) in :attr:`CandidateVerdict.error` and its ``status`` check, and its set rules are
``not judged`` (:data:`NOT_JUDGED`), never measured failures. A reference left out by
``--tiers`` (no result) leaves the candidates unjudged only where a set rule reads the
reference tier's result (:func:`reads_reference`); absolute rules are judged without it. ``fail`` means a rule
measured damage. Exit codes (:meth:`GateReport.exit_code`): 1 when any candidate failed a
rule, else 4 (``EXIT_GATE_ERROR``) when any is ``error``, else 0; a gate that judges no
candidate exits 1 (it does not pass). Code 5 is reserved for the INCONCLUSIVE verdict of
the gate-statistics work (issue 58, not built yet).

Fail closed: a set rule whose figure is missing on a candidate that finished (or, for a
relative rule, on the reference) fails with a message naming what is missing. Figures that
are not finite numbers count as missing.

A run of a subset of tiers (``qeval run --tiers A,B``; ``run.json``'s ``tiers_run``) is
judged over the candidates it was asked to run: a candidate left out, with no result in the
run folder, is reported "not run (--tiers)" and is neither passed nor failed. A candidate
that was asked to run and has no result is ``error`` (it did not finish), and a gate that
judges no candidate does not pass.

Noise floor (:mod:`qeval.analysis.floor`): with a measured floor, a candidate whose KLD is
within twice the floor gets the note "indistinguishable from the reference here" (in its
``notes`` and in the messages of its fidelity rules), and a ``max_kld_mean`` below the
floor is flagged in the report's ``warnings``; neither changes a verdict.

Units: memory in bytes (``max_peak_memory_gib`` thresholds in GiB = 2**30 bytes), speed in
tokens/s, rates as shares 0..1, KLD in nats, users at SLO in streams. Memory and speed
rules use the gate depth (``gate.depth``, default ``speed.main_depth``);
``min_users_at_slo_rel`` the load sweep's depth (candidate users at SLO >= rule x the
reference's; value = the candidate's users, threshold = rule x reference users).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import EXIT_GATE_ERROR, EXIT_GATE_FAILED, EXIT_OK, QevalInputError
from ..metrics import GATE_RULES, GIB, METRICS, GateRule
from ..metrics import value as metric_value
from ..recipe import GateSpec, LoadSpec, ParetoSpec, ReportSpec, SpeedSpec, validation_error
from ..results import STATUS_OK, RunInfo, RunLayout, TierResult, get_path, load_run, short_error
from .evidence import FAIL, INSUFFICIENT, PASS, paired_rate_rule, share_rule
from .floor import FLOOR_FACTOR, INDISTINGUISHABLE, NoiseFloor, rule_below_floor

#: Rule names in the order they are checked and reported (qeval.metrics.GATE_RULES).
RULES: tuple[str, ...] = tuple(GATE_RULES)
STATUS_RULE = "status"
#: The verdict of a candidate left out of the run by ``--tiers`` (neither pass nor fail).
NOT_RUN = "not run"
NOT_RUN_WHY = "not run (--tiers)"
#: The verdict of a candidate the gate could not judge (its tier or the reference's did not
#: finish), and the outcome of its ``status`` check; the gate's own verdict then too.
ERROR = "error"
#: The outcome of a set rule on a candidate that is :data:`ERROR`: nothing was measured.
NOT_JUDGED = "not judged"
#: Characters of a tier's error kept in the verdict line (the candidate's line has more).
VERDICT_LINE_ERROR_CHARS = 120


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
        outcome: ``pass``, ``fail`` or ``not enough evidence`` for the rules decided on
            evidence (:mod:`qeval.analysis.evidence`); ``error`` for the ``status`` check of a
            candidate the gate could not judge and ``not judged`` for its set rules
            (``passed`` is then False, and nothing was measured); else None (``passed`` says
            it all).
        evidence: :meth:`qeval.analysis.evidence.Evidence.to_dict` (method, p-value,
            tolerance, detectable damage, ...) for those rules, else None.
    """
    rule: str
    passed: bool
    value: Any
    threshold: Any
    message: str
    outcome: str | None = None
    evidence: dict | None = None

    @property
    def undecided(self) -> bool:
        """The rule's suite could not decide (``not enough evidence``); ``passed`` then
        follows the recipe's ``gate.insufficient_evidence``."""
        return self.outcome == INSUFFICIENT

    @property
    def judged(self) -> bool:
        """The rule was applied to measured figures (not the ``status`` check of a candidate
        that is :data:`ERROR`, nor one of its rules left :data:`NOT_JUDGED`)."""
        return self.outcome not in (ERROR, NOT_JUDGED)


@dataclass
class CandidateVerdict:
    """All rule results for one candidate tier; ``not_run``: left out of the run by
    ``--tiers`` (no rules checked, neither pass nor fail); ``error``: why the gate could not
    judge it (its tier or the reference tier has no result or did not finish), None when it
    was judged."""
    tier: str
    status: str | None
    rules: list[RuleResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    not_run: bool = False
    error: str | None = None
    #: :attr:`error` with each tier's error cut shorter, for the verdict line.
    error_brief: str | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        """Every rule holds (a candidate that was not run, or could not be judged, has not
        passed)."""
        return not self.not_run and self.error is None and all(r.passed for r in self.rules)

    @property
    def errored(self) -> bool:
        """The gate could not judge this candidate (verdict :data:`ERROR`)."""
        return not self.not_run and self.error is not None

    @property
    def verdict(self) -> str:
        """``"pass"``, ``"fail"`` (a rule measured damage), ``"error"`` (:data:`ERROR`: not
        judged, see :attr:`error`) or ``"not run"`` (:data:`NOT_RUN`)."""
        if self.not_run:
            return NOT_RUN
        if self.error is not None:
            return ERROR
        return "pass" if self.passed else "fail"

    @property
    def failed_rules(self) -> list[RuleResult]:
        """The rules that measured a failure (none on a candidate that is :data:`ERROR`)."""
        return [r for r in self.rules if not r.passed and r.judged]

    @property
    def unjudged_rules(self) -> list[RuleResult]:
        """The set rules left :data:`NOT_JUDGED` on a candidate that is :data:`ERROR`."""
        return [r for r in self.rules if r.outcome == NOT_JUDGED]

    @property
    def undecided_rules(self) -> list[RuleResult]:
        """Rules whose suites could not decide (``not enough evidence``)."""
        return [r for r in self.rules if r.undecided]


@dataclass
class GateReport:
    """The gate's verdict for every candidate.

    Attributes:
        reference: reference tier name.
        depth: depth (tokens) used for memory and speed rules.
        rules: the rules that were set, ``{name: threshold}``.
        candidates: one :class:`CandidateVerdict` per candidate, in recipe order.
        noise_floor: the measured floor used for the notes (None: not measured).
        warnings: lines about the gate itself (a KLD rule below the floor).
        insufficient_evidence: the recipe's policy for a rule its suites cannot decide
            (``fail``, ``warn``, ``pass``).
        confidence, power: the behaviour rules' level and required power.
        reference_error: why the reference tier cannot serve (no result, or a status other
            than ``ok``): every candidate in scope is then :data:`ERROR`; None when it can.
    """
    reference: str
    depth: int
    rules: dict[str, float]
    candidates: list[CandidateVerdict] = field(default_factory=list)
    noise_floor: NoiseFloor | None = None
    warnings: list[str] = field(default_factory=list)
    insufficient_evidence: str = "fail"
    confidence: float = 0.95
    power: float = 0.8
    reference_error: str | None = None
    reference_error_brief: str | None = field(default=None, repr=False)

    @property
    def judged(self) -> list[CandidateVerdict]:
        """The candidates the gate judged (those not left out by ``--tiers``)."""
        return [c for c in self.candidates if not c.not_run]

    @property
    def not_run(self) -> list[str]:
        """Candidates left out of the run by ``--tiers``, in order."""
        return [c.tier for c in self.candidates if c.not_run]

    @property
    def passed(self) -> bool:
        """True when the gate judged at least one candidate and every judged candidate
        passes (a gate that judges nothing does not pass; candidates not run are not
        judged)."""
        judged = self.judged
        return bool(judged) and all(c.passed for c in judged)

    @property
    def errored(self) -> list[CandidateVerdict]:
        """The candidates the gate could not judge (verdict :data:`ERROR`), in order."""
        return [c for c in self.candidates if c.errored]

    @property
    def failed(self) -> list[CandidateVerdict]:
        """The candidates that failed a rule (damage measured), in order."""
        return [c for c in self.judged if c.verdict == "fail"]

    @property
    def verdict(self) -> str:
        """``"pass"``; ``"fail"`` when any candidate failed a rule, or the gate judged none;
        else ``"error"`` (:data:`ERROR`) when some candidate could not be judged."""
        if self.passed:
            return "pass"
        if self.failed or not self.judged:
            return "fail"
        return ERROR

    def exit_code(self) -> int:
        """The gate's exit code (qeval.errors): 1 (EXIT_GATE_FAILED) when any candidate
        failed a rule or none was judged, else 4 (EXIT_GATE_ERROR) when any candidate is
        :data:`ERROR`, else 0."""
        return {"pass": EXIT_OK, "fail": EXIT_GATE_FAILED, ERROR: EXIT_GATE_ERROR}[self.verdict]

    def error_reason(self, brief: bool = True) -> str | None:
        """Why some candidates could not be judged, one line (``brief``: each tier's error
        cut to :data:`VERDICT_LINE_ERROR_CHARS`); None when every candidate in scope was
        judged."""
        errs = self.errored
        if not errs:
            return None
        if self.reference_error is not None:
            return (self.reference_error_brief if brief else None) or self.reference_error
        return "; ".join(((c.error_brief if brief else None) or c.error or "") for c in errs)

    def reason(self) -> str | None:
        """The gate verdict's reason (``gate.json`` ``reason``): for ``error`` what left the
        candidates unjudged; for ``fail`` the candidates that failed a rule and which rules
        (or that none was judged), with the unjudged ones; None for ``pass``."""
        v = self.verdict
        if v == "pass":
            return None
        if v == ERROR:
            return self.error_reason(brief=False)
        if not self.judged:
            return "the gate judged no candidate"
        why = "; ".join(f"{c.tier} failed {', '.join(r.rule for r in c.failed_rules)}" for c in self.failed)
        err = self.error_reason(brief=False)
        return why + (f"; not judged: {err}" if err else "")

    def verdict_line(self) -> str:
        """The one-line verdict: ``gate: PASS over 2 of 3 candidates (not run: int8)
        (exit 0)``; ``gate: ERROR over 3 candidates: the reference tier 'bf16' did not
        finish (status failed: ...): nothing was judged (exit 4)``."""
        n, total = len(self.judged), len(self.candidates)
        over = f"over {n} candidate{'s' if n != 1 else ''}" if n == total else f"over {n} of {total} candidates"
        skipped = f" (not run, --tiers: {', '.join(self.not_run)})" if self.not_run else ""
        n_und = sum(len(c.undecided_rules) for c in self.judged)
        undecided = (f"; {n_und} rule{'s' if n_und != 1 else ''} without enough evidence "
                     f"({self.insufficient_evidence})" if n_und else "")
        errs, err = self.errored, self.error_reason()
        if self.verdict == ERROR:
            rest = n - len(errs)
            if not rest:
                scope = "nothing was judged"
            else:
                scope = (f"{len(errs)} of {n} not judged ({', '.join(c.tier for c in errs)}), "
                         f"the other{'s' if rest != 1 else ''} pass{'' if rest != 1 else 'es'}")
            return f"gate: ERROR {over}{skipped}: {err}: {scope}{undecided} (exit {self.exit_code()})"
        unjudged = f"; not judged: {err}" if errs else ""
        return (f"gate: {'PASS' if self.passed else 'FAIL'} {over}{skipped}{undecided}{unjudged} "
                f"(exit {self.exit_code()})")

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
            "verdict": self.verdict,
            "reason": self.reason(),
            "exit_code": self.exit_code(),
            "reference": self.reference,
            "depth": self.depth,
            "rules": dict(self.rules),
            "confidence": self.confidence, "power": self.power,
            "insufficient_evidence": self.insufficient_evidence,
            "noise_floor": self.noise_floor.to_dict() if self.noise_floor else None,
            "warnings": list(self.warnings),
            "judged": len(self.judged),
            "not_run": self.not_run,
            "candidates": [
                {"tier": c.tier, "status": c.status, "verdict": c.verdict, "error": c.error,
                 "failed_rules": [r.rule for r in c.failed_rules],
                 "not_judged_rules": [r.rule for r in c.unjudged_rules],
                 "undecided_rules": [r.rule for r in c.undecided_rules],
                 "rules": [asdict(r) for r in c.rules], "notes": list(c.notes)}
                for c in self.candidates],
        }


# ---- recipe helpers ---------------------------------------------------------------------

def validate_section(model: type, data: Any, where: str, file: str | None = None):
    """Validate one recipe section dict (``None``: all defaults) with a pydantic model.

    Raises:
        QevalInputError: the first validation error, naming ``file`` (when given) and the
            dotted field (``gate.quality_metric: ...``).
    """
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise validation_error(e, data, file=file, prefix=tuple(where.split("."))) from None


#: Sections of ``run.json``'s recorded recipe the analysis reads, and their schemas.
RECORDED_SECTIONS = (("speed", SpeedSpec), ("gate", GateSpec), ("report", ReportSpec), ("pareto", ParetoSpec),
                     ("load", LoadSpec))


def load_run_checked(run_dir: str | Path) -> tuple[RunInfo, dict[str, TierResult]]:
    """:func:`qeval.results.load_run`, and the recorded recipe's sections the analysis reads
    (:data:`RECORDED_SECTIONS`) validated against the recipe schema, so a bad one is one
    line naming ``run.json`` and the field (``recipe.gate.depth``) before any output is made.

    Raises:
        QevalInputError: as :func:`~qeval.results.load_run`, or a section that does not validate.
    """
    run, tiers = load_run(run_dir)
    file = str(RunLayout(run_dir).run_json)
    for key, model in RECORDED_SECTIONS:
        if run.recipe.get(key) is not None:
            validate_section(model, run.recipe[key], f"recipe.{key}", file=file)
    return run, tiers


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


def tier_order(recipe: dict | None, tiers: dict[str, TierResult]) -> list[str]:
    """Tier names in recipe order (a recipe dict's ``tiers``), then any other result."""
    order = [t.get("name") for t in get_path(recipe, "tiers") or [] if isinstance(t, dict)]
    order = [n for n in order if n]
    return order + [n for n in tiers if n not in order]


# ---- the gate ------------------------------------------------------------------------------

def reads_reference(rule: GateRule) -> bool:
    """The rule compares the candidate with the reference tier's own result (a ratio, a
    multiple of a reference figure, or a paired test against the reference's rate)."""
    return rule.kind != "absolute" or rule.evidence == "paired"


def unfinished_reason(name: str, t: TierResult | None, what: str = "tier", not_run: bool = False,
                      limit: int = 300) -> str | None:
    """Why tier ``name`` cannot be judged or serve as the reference, one line: ``tier 'awq' did
    not finish (status failed: <short error>)``, ``the reference tier 'bf16' has no result
    (tiers/bf16.json missing)``; None when its result has status ``ok``. ``what``: how the
    tier is named (``tier``, ``the reference tier``); ``not_run``: it was left out by
    ``--tiers``; ``limit``: characters of the tier's error kept (:func:`~qeval.results.short_error`)."""
    if t is not None and t.status == STATUS_OK:
        return None
    if t is None:
        return (f"{what} {name!r} was not run (--tiers)" if not_run
                else f"{what} {name!r} has no result (tiers/{name}.json missing)")
    err = t.error  # may hold a whole log: one short line here
    return f"{what} {name!r} did not finish (status {t.status}" + (f": {short_error(err, limit)})" if err else ")")


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


def _what(rule: GateRule, depth: int, reference: str | None = None) -> str:
    """How a rule's figure is named in its message: label, depth, path in the tier result."""
    m = METRICS[rule.metric]
    at = f" at depth {depth}" if m.per_depth else ""
    unit = " GiB" if rule.scale == GIB else ""
    if rule.kind == "ratio":
        return f"{m.label}{at} relative to reference"
    return f"{m.label}{unit}{at} ({m.where(depth)})"


def _paired_counts(rule: GateRule, cand: TierResult, depth: int) -> tuple[int, int, int] | None:
    """``(down, up, paired)`` of a rule decided on evidence (:attr:`GateRule.counts`). Results
    written before ``n_compared`` existed give it as (down + up) / flip rate, or the decided
    checks when nothing flipped. None when the flips are missing."""
    down_m, up_m, n_m = rule.counts  # type: ignore[misc]
    b, c = metric_value(cand, down_m, depth), metric_value(cand, up_m, depth)
    if b is None or c is None:
        return None
    n = metric_value(cand, n_m, depth)
    if n is None:
        rate = metric_value(cand, "lc_flip_rate" if n_m.startswith("lc_") else "flip_rate", depth)
        if rate:
            n = round((b + c) / rate)
        else:
            n = metric_value(cand, "lc_n_questions" if n_m.startswith("lc_") else "n_checks", depth)
    if n is None:
        return None
    return int(b), int(c), int(n)


def _evidence_rule(rule: GateRule, t: float, cand: TierResult, ref: TierResult | None, ref_name: str, depth: int,
                   spec: GateSpec) -> RuleResult:
    """A behaviour rule decided on evidence (:mod:`qeval.analysis.evidence`): a missing
    figure fails closed; ``not enough evidence`` passes or fails by ``spec.insufficient_evidence``."""
    alpha = 1.0 - spec.confidence
    counts = _paired_counts(rule, cand, depth)
    if counts is None:
        miss = f"missing the flips against the reference ({METRICS[rule.counts[0]].where(depth)})"  # type: ignore[index]
        return RuleResult(rule.name, False, None, t, miss + (f": {rule.missing_hint}" if rule.missing_hint else ""))
    b, c, n = counts
    if rule.evidence == "share":
        ev = share_rule(b + c, n, t, alpha=alpha, power=spec.power)
        value, threshold = ev.observed, t
    else:
        if ref is None or ref.status != STATUS_OK:
            why = "has no result" if ref is None else f"has status {ref.status}"
            return RuleResult(rule.name, False, None, None, f"reference tier {ref_name!r} {why}, so "
                                                            f"{rule.name} has no reference rate")
        rm = METRICS[rule.reference_metric]  # type: ignore[index]
        r = metric_value(ref, rm.name, depth)
        if r is None:
            return RuleResult(rule.name, False, None, None, f"reference tier {ref_name!r} lacks {rm.where(depth)}")
        ev = paired_rate_rule(b, c, n, r, t, alpha=alpha, power=spec.power, what=rm.label)
        value, threshold = ev.observed, ev.tolerance
    if ev.outcome == INSUFFICIENT:
        passed = spec.insufficient_evidence != "fail"
        msg = f"{rule.name}: not enough evidence ({spec.insufficient_evidence}): {ev.why}"
    else:
        passed = ev.outcome == PASS
        msg = f"{rule.name}: {'ok' if passed else 'FAILS'}: {ev.why}"
    return RuleResult(rule.name, passed, value, threshold, msg, outcome=ev.outcome, evidence=ev.to_dict())


def _check_rule(rule: GateRule, t: float, cand: TierResult, ref: TierResult | None, ref_name: str,
                depth: int, spec: GateSpec | None = None) -> RuleResult:
    """Apply one rule (:data:`qeval.metrics.GATE_RULES`) with threshold ``t`` to a candidate."""
    if rule.evidence is not None:
        return _evidence_rule(rule, t, cand, ref, ref_name, depth, spec or GateSpec())
    ref_ok = ref is not None and ref.status == STATUS_OK

    def ref_missing() -> str | None:
        if ref is None:
            return f"reference tier {ref_name!r} has no result, so {rule.name} has no reference value"
        if not ref_ok:
            return f"reference tier {ref_name!r} has status {ref.status}, so {rule.name} has no reference value"
        return None

    m = METRICS[rule.metric]
    what = _what(rule, depth)
    v = metric_value(cand, rule.metric, depth)
    if rule.kind == "absolute":
        return _cmp(rule.name, None if v is None else v / rule.scale, t, rule.bound, what,
                    None if v is not None or not rule.missing_hint else f"missing {what}: {rule.missing_hint}")
    if rule.kind == "ratio":
        miss = None if v is not None else f"missing {m.label} at depth {depth} ({m.where(depth)})"
        miss = miss or ref_missing()
        rv = metric_value(ref, rule.metric, depth) if miss is None else None
        if miss is None and not rv:
            miss = f"reference tier {ref_name!r} lacks {m.label} at depth {depth}"
        return _cmp(rule.name, None if miss else v / rv, t, rule.bound, what, miss)  # type: ignore[operator]
    # of_reference: the candidate's value against t x the reference's reference_metric
    rm = METRICS[rule.reference_metric]  # type: ignore[index]
    miss = ref_missing()
    r = metric_value(ref, rm.name, depth) if miss is None else None
    if miss is None and r is None:
        miss = f"reference tier {ref_name!r} lacks {rm.where(depth)}"
    if miss is None and v is None:
        miss = f"missing {what}" + (f": {rule.missing_hint}" if rule.missing_hint else "")
    res = _cmp(rule.name, v, None if r is None else t * r, rule.bound, what, miss)
    if miss is None:
        res.message += f" (= {_fmt(t)} x reference {rm.label} {_fmt(r)})"
    return res


#: Gate rules on teacher-forced fidelity (their metric lives under quality.fidelity): the
#: rules whose messages get the noise-floor note.
FIDELITY_RULES: tuple[str, ...] = tuple(n for n, r in GATE_RULES.items()
                                        if METRICS[r.metric].path[:2] == ("quality", "fidelity"))


def _floor_notes(verdict: CandidateVerdict, cand: TierResult, floor: NoiseFloor | None, below: str | None) -> None:
    """Add the noise-floor note to a judged candidate and its fidelity rules' messages."""
    if floor is None:
        return
    kld = metric_value(cand, "kld_mean")
    if floor.indistinguishable(kld):
        note = (f"KLD {kld:.3g} is within {FLOOR_FACTOR:g}x the noise floor "
                f"{floor.kld_mean:.3g}: {INDISTINGUISHABLE}")
        verdict.notes.append(note)
        for r in verdict.rules:
            if r.rule in FIDELITY_RULES:
                r.message += (f" ({INDISTINGUISHABLE}: KLD within {floor.threshold:.3g}, "
                              f"{FLOOR_FACTOR:g}x the noise floor)")
    if below:
        for r in verdict.rules:
            if r.rule == "max_kld_mean":
                r.message += f" (the rule is below the noise floor {floor.kld_mean:.3g})"


def evaluate_gate(recipe: dict | None, tiers: dict[str, TierResult], gate: GateSpec | dict | None,
                  depth: int, noise_floor: NoiseFloor | None = None,
                  tiers_run: list[str] | None = None) -> GateReport:
    """Judge every candidate tier against the gate's rules.

    Args:
        recipe: a recipe dict; only its ``tiers`` are used, for the order of the default
            candidates (every tier except the reference). May be None.
        tiers: ``{tier name: tier result}``.
        gate: the recipe's ``gate`` section (:class:`GateSpec` or its dict form).
        depth: depth in tokens for the memory and speed rules.
        noise_floor: the run's measured floor (:func:`qeval.analysis.floor.noise_floor`),
            for the "indistinguishable" notes and the below-floor warning; None: none.
        tiers_run: the tiers the run was asked to run (``qeval run --tiers``; ``run.json``
            ``tiers_run``); None: every tier. A candidate outside it with no result is
            reported not run and not judged.

    Returns:
        :class:`GateReport`. A candidate that was to run but has no result file, or has a
        status other than ``ok``, or whose reference tier has none or such a status, is
        :data:`ERROR`: its ``status`` check says why (outcome ``error``) and every set rule
        is :data:`NOT_JUDGED`; none of them is a measured failure.

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
        names = [n for n in tier_order(recipe, tiers) if n != ref_name]
    report = GateReport(reference=ref_name, depth=int(depth), rules=set_rules, noise_floor=noise_floor,
                        insufficient_evidence=spec.insufficient_evidence, confidence=spec.confidence,
                        power=spec.power)
    below = rule_below_floor(set_rules, noise_floor)
    if below:
        report.warnings.append(below)
    ref_left_out = ref is None and tiers_run is not None and ref_name not in tiers_run
    if not ref_left_out or any(reads_reference(GATE_RULES[r]) for r in set_rules):
        report.reference_error = unfinished_reason(ref_name, ref, "the reference tier", not_run=ref_left_out)
        report.reference_error_brief = unfinished_reason(ref_name, ref, "the reference tier", not_run=ref_left_out,
                                                         limit=VERDICT_LINE_ERROR_CHARS)
    for name in names:
        cand = tiers.get(name)
        status = cand.status if cand else None
        if cand is None and tiers_run is not None and name not in tiers_run:
            report.candidates.append(CandidateVerdict(tier=name, status=None, notes=[NOT_RUN_WHY], not_run=True))
            continue
        own = unfinished_reason(name, cand)
        why = "; ".join(w for w in (own, report.reference_error) if w) or None
        brief = "; ".join(w for w in (unfinished_reason(name, cand, limit=VERDICT_LINE_ERROR_CHARS),
                                      report.reference_error_brief) if w) or None
        verdict = CandidateVerdict(tier=name, status=status, error=why, error_brief=brief)
        if why is None:
            verdict.rules.append(RuleResult(STATUS_RULE, True, status, STATUS_OK, "status ok"))
        else:
            verdict.rules.append(RuleResult(STATUS_RULE, False, status, STATUS_OK, why, outcome=ERROR))
            short = ("tier has no result" if cand is None else f"tier has status {status}") if own else \
                f"reference tier {ref_name!r} " + ("has no result" if ref is None else f"has status {ref.status}")
        for rule in RULES:
            if rule not in set_rules:
                continue
            if why is not None:
                verdict.rules.append(RuleResult(rule, False, None, set_rules[rule],
                                                f"not judged: {short}", outcome=NOT_JUDGED))
            else:
                verdict.rules.append(_check_rule(GATE_RULES[rule], float(set_rules[rule]), cand,  # type: ignore[arg-type]
                                                 ref, ref_name, int(depth), spec))
        if why is None:
            _floor_notes(verdict, cand, noise_floor, below)  # type: ignore[arg-type]
        report.candidates.append(verdict)
    return report
