"""JUnit XML for the release gate, so CI systems show each rule as a test.

One ``<testcase>`` per (candidate tier, rule), including the ``status`` check every
candidate gets; a failing rule carries a ``<failure>`` with the rule's message and, for a
quality rule, the items that most explain it (:func:`qeval.report.review.offending_items`),
so a CI system that renders JUnit shows what failed. A gate with no candidate gets one
failing ``no_candidates`` case (a gate that judges nothing does not pass, and CI must not
read an empty suite as green). A candidate left out of the run by ``--tiers`` is one
``<skipped>`` case (neither pass nor fail). A candidate the gate could not judge (verdict
``error``: its tier or the reference's has no result or did not finish) is not a failure
of the model: its ``status`` case carries JUnit's ``<error>`` with the reason (which tier,
its status, the short error), counted in ``errors``, and each set rule is a ``<skipped>``
case saying it was not judged.
``classname`` is ``qeval.gate.<tier>``, ``name`` the rule.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from ..analysis.gate import ERROR, NOT_JUDGED, CandidateVerdict, GateReport, RuleResult
from ..metrics import GATE_RULES
from ..results import atomic_write_text
from .review import TierReview, offending_items

#: Offending items named per failing rule.
OFFENDERS = 5


def gate_offenders(gate_report: GateReport, reviews: dict[str, TierReview]) -> dict[tuple[str, str], list[str]]:
    """``{(tier, rule): [one-line item descriptions]}`` for each failing rule of each
    candidate that has stored answers (:func:`qeval.report.review.offending_items`)."""
    out: dict[tuple[str, str], list[str]] = {}
    for c in gate_report.candidates:
        for r in c.rules:
            rule = GATE_RULES.get(r.rule)
            if not r.passed and r.judged and rule is not None:
                items = offending_items(reviews.get(c.tier), rule.metric, OFFENDERS)
                if items:
                    out[(c.tier, r.rule)] = items
    return out


def junit_xml(gate_report: GateReport, suite_name: str = "qeval.gate",
              offenders: dict[tuple[str, str], list[str]] | None = None) -> str:
    """The gate verdict as a JUnit XML document (string, UTF-8 declaration included);
    ``offenders`` (:func:`gate_offenders`) adds a failing rule's worst items to its message."""
    offenders = offenders or {}
    cases: list[tuple[CandidateVerdict, RuleResult | None]] = [
        (c, r) for c in gate_report.judged for r in c.rules]
    if not gate_report.judged:
        cases = [(CandidateVerdict("none", None), RuleResult("no_candidates", False, None, None,
                                                              "the gate judged no candidate tier"))]
    cases += [(c, None) for c in gate_report.candidates if c.not_run]  # skipped: left out by --tiers
    failures = sum(1 for _, r in cases if r is not None and not r.passed and r.judged)
    errors = sum(1 for _, r in cases if r is not None and r.outcome == ERROR)
    skipped = sum(1 for _, r in cases if r is None or r.outcome == NOT_JUDGED)
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": str(errors), "skipped": str(skipped)}
    root = ET.Element("testsuites", name=suite_name, **counts)
    suite = ET.SubElement(root, "testsuite", name=suite_name, **counts)
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="reference", value=gate_report.reference)
    ET.SubElement(props, "property", name="depth", value=str(gate_report.depth))
    for c, r in cases:
        if r is None:
            tc = ET.SubElement(suite, "testcase", classname=f"qeval.gate.{c.tier}", name="status", time="0")
            ET.SubElement(tc, "skipped", message=c.notes[0] if c.notes else "not run")
            continue
        tc = ET.SubElement(suite, "testcase", classname=f"qeval.gate.{c.tier}", name=r.rule, time="0")
        if r.outcome == ERROR:  # qeval could not measure it: not a verdict on the model
            e = ET.SubElement(tc, "error", message=r.message, type="GateCannotJudge")
            e.text = (f"tier {c.tier}: not judged, the gate could not measure it\n{r.message}\n"
                      f"not judged: {', '.join(u.rule for u in c.unjudged_rules) or 'no rule set'}")
        elif r.outcome == NOT_JUDGED:
            ET.SubElement(tc, "skipped", message=r.message)
        elif not r.passed:
            worst = offenders.get((c.tier, r.rule), [])
            msg = r.message + (f"; worst items: {'; '.join(worst[:3])}" if worst else "")
            f = ET.SubElement(tc, "failure", message=msg, type="GateRuleFailed")
            f.text = (f"tier {c.tier}: rule {r.rule} failed\nvalue: {r.value}\n"
                      f"threshold: {r.threshold}\n{r.message}"
                      + ("\nworst items:" + "".join(f"\n  {w}" for w in worst) if worst else ""))
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = r.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(gate_report: GateReport, path: str | Path,
                offenders: dict[tuple[str, str], list[str]] | None = None) -> Path:
    """Write :func:`junit_xml` to ``path`` atomically; returns the path."""
    p = Path(path)
    atomic_write_text(p, junit_xml(gate_report, offenders=offenders))
    return p
