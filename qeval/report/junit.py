"""JUnit XML for the release gate, so CI systems show each rule as a test.

One ``<testcase>`` per (candidate tier, rule), including the ``status`` check every
candidate gets; a failing rule carries a ``<failure>`` with the rule's message.
``classname`` is ``qeval.gate.<tier>``, ``name`` the rule.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from ..analysis.gate import GateReport
from ..results import atomic_write_text


def junit_xml(gate_report: GateReport, suite_name: str = "qeval.gate") -> str:
    """The gate verdict as a JUnit XML document (string, UTF-8 declaration included)."""
    cases = [(c, r) for c in gate_report.candidates for r in c.rules]
    failures = sum(1 for _, r in cases if not r.passed)
    root = ET.Element("testsuites", name=suite_name, tests=str(len(cases)), failures=str(failures),
                      errors="0")
    suite = ET.SubElement(root, "testsuite", name=suite_name, tests=str(len(cases)),
                          failures=str(failures), errors="0", skipped="0")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="reference", value=gate_report.reference)
    ET.SubElement(props, "property", name="depth", value=str(gate_report.depth))
    for c, r in cases:
        tc = ET.SubElement(suite, "testcase", classname=f"qeval.gate.{c.tier}", name=r.rule, time="0")
        if not r.passed:
            f = ET.SubElement(tc, "failure", message=r.message, type="GateRuleFailed")
            f.text = (f"tier {c.tier}: rule {r.rule} failed\nvalue: {r.value}\n"
                      f"threshold: {r.threshold}\n{r.message}")
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = r.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(gate_report: GateReport, path: str | Path) -> Path:
    """Write :func:`junit_xml` to ``path`` atomically; returns the path."""
    p = Path(path)
    atomic_write_text(p, junit_xml(gate_report))
    return p
