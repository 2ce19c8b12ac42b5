"""Suites: check kinds, JSONL validation errors (file, line, field), and the shipped datasets."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from qeval.errors import QevalInputError
from qeval.measure.suites import (CHECK_KINDS, Check, CheckResult, SuiteItem, Turn, load_suite, run_check,
                                  run_checks)

REPO = Path(__file__).resolve().parent.parent
DATASETS = REPO / "datasets"


def chk(kind: str, **params) -> Check:
    return Check(kind=kind, params=params)


def passes(kind: str, text: str, **params) -> bool:
    res = run_check(chk(kind, **params), text)
    assert isinstance(res, CheckResult) and res.kind == kind and res.detail
    return res.passed


# ------------------------------------------------------------------------------------------
# check kinds
# ------------------------------------------------------------------------------------------

def test_check_kinds_are_the_documented_set():
    assert CHECK_KINDS == {"contains_all", "contains_any", "not_contains", "regex", "json_keys",
                           "markdown_table", "headings", "max_words", "min_words"}


def test_contains_all():
    text = "Incident INC-4471 started at 14:32 UTC."
    assert passes("contains_all", text, values=["INC-4471", "14:32"])
    assert passes("contains_all", text, values=["inc-4471"])  # case-insensitive by default
    assert not passes("contains_all", text, values=["INC-4471", "16:05"])
    assert not passes("contains_all", text, values=["inc-4471"], case_sensitive=True)
    res = run_check(chk("contains_all", values=["INC-4471", "16:05"]), text)
    assert "16:05" in res.detail and "INC-4471" not in res.detail


def test_contains_any():
    assert passes("contains_any", "We offer a full REFUND.", values=["credit", "refund"])
    assert not passes("contains_any", "We offer a voucher.", values=["credit", "refund"])
    assert not passes("contains_any", "We offer a full REFUND.", values=["refund"], case_sensitive=True)


def test_not_contains():
    assert passes("not_contains", "Refer to the on-call engineer.", values=["Priya", "Nair"])
    assert not passes("not_contains", "priya fixed it.", values=["Priya", "Nair"])
    assert passes("not_contains", "priya fixed it.", values=["Priya"], case_sensitive=True)


def test_regex():
    assert passes("regex", "Remaining: 17 days", pattern=r"Remaining:\s*17 days")
    assert not passes("regex", "remaining: 17 days", pattern=r"Remaining:\s*17 days")
    assert passes("regex", "remaining: 17 days", pattern=r"Remaining:\s*17 days", flags="i")
    # multi-line flag: ^ matches at line starts only with "m"
    assert not passes("regex", "intro\n- a bullet", pattern=r"^- ")
    assert passes("regex", "intro\n- a bullet", pattern=r"^- ", flags="m")
    assert passes("regex", "a\nb", pattern=r"a.b", flags="s")


def test_json_keys_bare_and_fenced():
    keys = ["incident_id", "severity"]
    assert passes("json_keys", 'Here it is: {"incident_id": "INC-1", "severity": 2} done.', keys=keys)
    fenced = 'Record:\n```json\n{\n  "incident_id": "INC-1",\n  "severity": "SEV-2"\n}\n```\n'
    assert passes("json_keys", fenced, keys=keys)
    assert passes("json_keys", '```\n{"incident_id": 1, "severity": 2}\n```', keys=keys)
    assert not passes("json_keys", '{"incident_id": "INC-1"}', keys=keys)  # missing key
    assert not passes("json_keys", "no json here at all", keys=keys)
    assert not passes("json_keys", '{"incident_id": "INC-1", severity: 2}', keys=keys)  # not valid JSON
    # keys must be at the top level, not nested
    assert not passes("json_keys", '{"record": {"incident_id": 1, "severity": 2}}', keys=keys)


def test_json_keys_takes_the_first_object_that_parses():
    # a broken object first, then a valid one: the valid one is used
    text = 'Draft: {"incident_id": oops}\nFinal: {"incident_id": "INC-9", "severity": 1}'
    assert passes("json_keys", text, keys=["incident_id", "severity"])
    # the first parsable object lacks the keys; a later one has them: the first one decides
    text = '{"note": "x"} and then {"incident_id": "INC-9", "severity": 1}'
    assert not passes("json_keys", text, keys=["incident_id", "severity"])
    # a fenced block wins over a bare object earlier in the text
    text = 'Example {"a": 1}\n```json\n{"incident_id": 1, "severity": 2}\n```'
    assert passes("json_keys", text, keys=["incident_id", "severity"])


TABLE = """Intro line.

| Region | Revenue | Change |
|---|:---:|---:|
| North | 1.2 | +8% |
| South | 0.9 | -3% |
| East | 1.5 | +12% |

After the table."""


def test_markdown_table_rows_in_range():
    assert passes("markdown_table", TABLE, min_rows=3)
    assert passes("markdown_table", TABLE, min_rows=3, max_rows=3)
    assert not passes("markdown_table", TABLE, min_rows=4)
    assert not passes("markdown_table", TABLE, min_rows=1, max_rows=2)
    res = run_check(chk("markdown_table", min_rows=4), TABLE)
    assert "[3]" in res.detail


def test_markdown_table_needs_header_and_separator():
    no_sep = "| Region | Revenue |\n| North | 1.2 |\n| South | 0.9 |"
    assert not passes("markdown_table", no_sep, min_rows=1)
    no_pipes_sep = "Region | Revenue\n---\nNorth | 1.2"
    assert not passes("markdown_table", no_pipes_sep, min_rows=1)
    assert not passes("markdown_table", "just prose, no table", min_rows=1)
    # tables without outer pipes are still tables
    assert passes("markdown_table", "Region | Revenue\n--- | ---\nNorth | 1.2\nSouth | 0.9", min_rows=2, max_rows=2)


def test_markdown_table_any_table_may_satisfy():
    two = "| a | b |\n|---|---|\n| 1 | 2 |\n\ntext\n\n| c | d |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n| 5 | 6 |"
    assert passes("markdown_table", two, min_rows=3, max_rows=3)
    assert passes("markdown_table", two, min_rows=1, max_rows=1)
    assert not passes("markdown_table", two, min_rows=2, max_rows=2)


HEADED = """# Incident INC-4471 Post-mortem

## Summary
text
## Timeline ##
text
### Root cause analysis
```python
# not a heading inside code
```
####### seven hashes is not a heading
#nospace is not a heading
"""


def test_headings_count_and_required():
    assert passes("headings", HEADED, min_count=4)
    assert not passes("headings", HEADED, min_count=5)  # the code comment and malformed lines do not count
    assert passes("headings", HEADED, required=["summary", "TIMELINE", "Root Cause"])
    res = run_check(chk("headings", required=["Summary", "Action Items"]), HEADED)
    assert not res.passed and "Action Items" in res.detail
    assert not passes("headings", "Summary\nno markdown headings here", min_count=1)
    assert not passes("headings", HEADED, min_count=1, required=["not a heading inside code"])


def test_word_limits():
    text = "one two  three\nfour\tfive"
    assert passes("max_words", text, value=5)
    assert not passes("max_words", text, value=4)
    assert passes("min_words", text, value=5)
    assert not passes("min_words", text, value=6)
    assert not passes("min_words", "", value=1)


def test_run_checks_keeps_order():
    turn = Turn(user="q", checks=(chk("contains_all", values=["x"]), chk("max_words", value=1),
                                  chk("min_words", value=1)))
    res = run_checks(turn, "x y")
    assert [r.kind for r in res] == ["contains_all", "max_words", "min_words"]
    assert [r.passed for r in res] == [True, False, True]
    assert run_checks(Turn(user="q", checks=()), "anything") == []


def test_run_check_rejects_hand_built_bad_checks():
    with pytest.raises(ValueError, match="unknown check kind"):
        run_check(chk("foo"), "text")
    with pytest.raises(ValueError, match="min_rows"):
        run_check(chk("markdown_table"), "text")


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------

def row(id="a-1", turns=None, **extra) -> str:
    d = {"id": id, "category": "report", **extra}
    d["turns"] = turns if turns is not None else [{"user": "Write.", "checks": [{"kind": "min_words", "value": 1}]}]
    return json.dumps(d)


def turn(checks=None, user="Hi") -> dict:
    return {"user": user, "checks": checks if checks is not None else [{"kind": "min_words", "value": 1}]}


def write(tmp_path: Path, lines: list[str], name: str = "suite.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_load_suite_parses_items(tmp_path):
    p = write(tmp_path, [
        row("lo-001", max_new_tokens=768, system="Be brief."),
        "",
        "   ",
        row("lo-002", turns=[turn([{"kind": "contains_all", "values": ["X"], "case_sensitive": True},
                                   {"kind": "markdown_table", "min_rows": 2, "max_rows": 4}])]),
    ])
    items = load_suite(p, "long_output", multi_turn=False)
    assert [i.id for i in items] == ["lo-001", "lo-002"]
    a, b = items
    assert isinstance(a, SuiteItem) and a.suite == "long_output" and a.category == "report"
    assert a.system == "Be brief." and a.max_new_tokens == 768 and a.source == f"{p}:1"
    assert b.system is None and b.max_new_tokens is None and b.source == f"{p}:4"  # blank lines still counted
    assert b.turns[0].checks == (Check("contains_all", {"values": ["X"], "case_sensitive": True}),
                                 Check("markdown_table", {"min_rows": 2, "max_rows": 4}))
    assert isinstance(b.turns, tuple) and isinstance(b.turns[0].checks, tuple)


def test_load_suite_turn_counts(tmp_path):
    three = row("m-1", turns=[turn(), turn([]), turn()])
    p = write(tmp_path, [three])
    assert len(load_suite(p, "mt", multi_turn=True)[0].turns) == 3
    assert len(load_suite(p, "mt")[0].turns) == 3  # None: any count
    six = write(tmp_path, [row("m-1", turns=[turn()] * 6)], "six.jsonl")
    assert len(load_suite(six, "mt", multi_turn=True)[0].turns) == 6


GOOD = row("ok-1")

# (lines, multi_turn, expected line, expected field, message fragment)
BAD_CASES = {
    "invalid json": ([GOOD, '{"id": "x", "category": "r",'], None, 2, "row", "invalid JSON"),
    "not an object": ([GOOD, "[1, 2]"], None, 2, "row", "JSON object"),
    "duplicate json key": ([GOOD, '{"id": "x", "id": "y", "category": "r", "turns": []}'], None, 2, "row",
                           "duplicate key"),
    "nan constant": ([GOOD, row("x", max_new_tokens=1).replace("1,", "NaN,", 1)], None, 2, "row", "NaN"),
    "missing id": ([GOOD, json.dumps({"category": "r", "turns": [turn()]})], None, 2, "id", "missing"),
    "id wrong type": ([GOOD, row(7)], None, 2, "id", "non-empty string"),
    "empty category": ([GOOD, row("x", category="  ")], None, 2, "category", "non-empty string"),
    "unknown field": ([GOOD, row("x", colour="red")], None, 2, "colour", "unknown field"),
    "system not string": ([GOOD, row("x", system=["a"])], None, 2, "system", "string"),
    "max_new_tokens zero": ([GOOD, row("x", max_new_tokens=0)], None, 2, "max_new_tokens", "positive"),
    "max_new_tokens bool": ([GOOD, row("x", max_new_tokens=True)], None, 2, "max_new_tokens", "positive"),
    "max_new_tokens str": ([GOOD, row("x", max_new_tokens="512")], None, 2, "max_new_tokens", "positive"),
    "missing turns": ([GOOD, json.dumps({"id": "x", "category": "r"})], None, 2, "turns", "missing"),
    "turns not list": ([GOOD, row("x", turns={"user": "a"})], None, 2, "turns", "list"),
    "empty turns": ([GOOD, row("x", turns=[])], None, 2, "turns", "empty"),
    "turn not object": ([GOOD, row("x", turns=["hello"])], None, 2, "turns[0]", "object"),
    "turn missing user": ([GOOD, row("x", turns=[{"checks": []}])], None, 2, "turns[0].user", "missing"),
    "turn empty user": ([GOOD, row("x", turns=[turn(user="")])], None, 2, "turns[0].user", "non-empty"),
    "turn unknown field": ([GOOD, row("x", turns=[{**turn(), "answer": "x"}])], None, 2, "turns[0].answer",
                           "unknown field"),
    "turn missing checks": ([GOOD, row("x", turns=[{"user": "a"}])], None, 2, "turns[0].checks", "missing"),
    "checks not list": ([GOOD, row("x", turns=[{"user": "a", "checks": {"kind": "regex"}}])], None, 2,
                        "turns[0].checks", "list"),
    "check not object": ([GOOD, row("x", turns=[turn(["min_words"])])], None, 2, "turns[0].checks[0]", "object"),
    "check missing kind": ([GOOD, row("x", turns=[turn([{"value": 3}])])], None, 2, "turns[0].checks[0].kind",
                           "missing"),
    "no checks at all": ([GOOD, row("x", turns=[turn([]), turn([]), turn([])])], None, 2, "turns", "no checks"),
    "duplicate id": ([GOOD, "", row("ok-1")], None, 3, "id", "first on line 1"),
    "multi-turn too few": ([row("m0", turns=[turn()] * 3), row("x", turns=[turn(), turn()])], True, 2, "turns",
                           "3 to 6"),
    "multi-turn too many": ([row("x", turns=[turn()] * 3), row("y", turns=[turn()] * 7)], True, 2, "turns",
                            "got 7"),
    "single-turn has two": ([GOOD, row("x", turns=[turn(), turn()])], False, 2, "turns", "exactly 1"),
    # check parameters
    "table without min_rows": ([GOOD, row("x", turns=[turn([{"kind": "markdown_table"}])])], None, 2,
                               "turns[0].checks[0].min_rows", "missing"),
    "table min_rows not int": ([GOOD, row("x", turns=[turn([{"kind": "markdown_table", "min_rows": "3"}])])],
                               None, 2, "turns[0].checks[0].min_rows", "integer"),
    "table max below min": ([GOOD, row("x", turns=[turn([{"kind": "markdown_table", "min_rows": 3,
                                                            "max_rows": 2}])])], None, 2,
                            "turns[0].checks[0].max_rows", ">= min_rows"),
    "invalid regex": ([GOOD, row("x", turns=[turn([{"kind": "regex", "pattern": "(unclosed"}])])], None, 2,
                      "turns[0].checks[0].pattern", "invalid regular expression"),
    "regex missing pattern": ([GOOD, row("x", turns=[turn([{"kind": "regex", "flags": "i"}])])], None, 2,
                              "turns[0].checks[0].pattern", "missing"),
    "regex bad flags": ([GOOD, row("x", turns=[turn([{"kind": "regex", "pattern": "a", "flags": "ix"}])])], None,
                        2, "turns[0].checks[0].flags", "ims"),
    "values empty": ([GOOD, row("x", turns=[turn([{"kind": "contains_all", "values": []}])])], None, 2,
                     "turns[0].checks[0].values", "non-empty list"),
    "values is a string": ([GOOD, row("x", turns=[turn([{"kind": "not_contains", "values": "abc"}])])], None, 2,
                           "turns[0].checks[0].values", "list"),
    "values item not string": ([GOOD, row("x", turns=[turn([{"kind": "contains_any", "values": ["a", 3]}])])],
                               None, 2, "turns[0].checks[0].values[1]", "string"),
    "case_sensitive not bool": ([GOOD, row("x", turns=[turn([{"kind": "contains_all", "values": ["a"],
                                                              "case_sensitive": "yes"}])])], None, 2,
                                "turns[0].checks[0].case_sensitive", "true or false"),
    "unknown param": ([GOOD, row("x", turns=[turn([{"kind": "contains_all", "values": ["a"], "value": 1}])])],
                      None, 2, "turns[0].checks[0].value", "unknown parameter"),
    "json_keys missing keys": ([GOOD, row("x", turns=[turn([{"kind": "json_keys"}])])], None, 2,
                               "turns[0].checks[0].keys", "missing"),
    "headings without params": ([GOOD, row("x", turns=[turn([{"kind": "headings"}])])], None, 2,
                                "turns[0].checks[0].min_count", "min_count and/or required"),
    "headings required not list": ([GOOD, row("x", turns=[turn([{"kind": "headings", "required": "Summary"}])])],
                                   None, 2, "turns[0].checks[0].required", "list"),
    "max_words missing value": ([GOOD, row("x", turns=[turn([{"kind": "max_words"}])])], None, 2,
                                "turns[0].checks[0].value", "missing"),
    "min_words bool value": ([GOOD, row("x", turns=[turn([{"kind": "min_words", "value": True}])])], None, 2,
                             "turns[0].checks[0].value", "integer"),
    "max_words negative": ([GOOD, row("x", turns=[turn([{"kind": "max_words", "value": -5}])])], None, 2,
                           "turns[0].checks[0].value", ">= 1"),
    "check in a later turn": ([row("m0", turns=[turn()] * 3),
                               row("x", turns=[turn(), turn(), turn([{"kind": "min_words", "value": 1},
                                                                     {"kind": "regex", "pattern": "["}])])],
                              True, 2, "turns[2].checks[1].pattern", "invalid regular expression"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_load_suite_rejects_bad_rows(tmp_path, case):
    lines, multi, line, field, fragment = BAD_CASES[case]
    p = write(tmp_path, lines, name="bad_suite.jsonl")
    with pytest.raises(QevalInputError) as ei:
        load_suite(p, "s", multi_turn=multi)
    err = ei.value
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:{line}: {field}: "), msg
    assert fragment in msg, msg
    assert (err.file, err.line, err.field) == (str(p), line, field)


def test_unknown_kind_message_format(tmp_path):
    p = write(tmp_path, [row("m0", turns=[turn()] * 3), row("m1", turns=[turn(), turn([{"kind": "foo"}]), turn()])])
    with pytest.raises(QevalInputError) as ei:
        load_suite(p, "mt", multi_turn=True)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:2: turns[1].checks[0].kind: unknown check kind 'foo' (known: "), msg
    for kind in CHECK_KINDS:
        assert kind in msg


def test_unreadable_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(QevalInputError) as ei:
        load_suite(missing, "s")
    assert str(missing) in str(ei.value) and "suite file not found" in str(ei.value)
    with pytest.raises(QevalInputError) as ei:
        load_suite(tmp_path, "s")  # a directory
    assert "is a folder" in str(ei.value)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n   \n\n", encoding="utf-8")
    with pytest.raises(QevalInputError, match="no items") as ei:
        load_suite(blank, "s")
    assert str(blank) in str(ei.value)


def test_invalid_utf8_names_the_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes((GOOD + "\n").encode() + row("x").replace('"report"', '"caf\u00e9"').encode("latin-1") + b"\n")
    with pytest.raises(QevalInputError) as ei:
        load_suite(p, "s")
    assert str(ei.value).startswith(f"{p}:2: row: ") and "UTF-8" in str(ei.value)


def test_loaded_checks_never_raise(tmp_path):
    p = write(tmp_path, [row("x", turns=[turn([
        {"kind": "contains_all", "values": ["a"]}, {"kind": "contains_any", "values": ["a"]},
        {"kind": "not_contains", "values": ["a"]}, {"kind": "regex", "pattern": "a+", "flags": "ims"},
        {"kind": "json_keys", "keys": ["a"]}, {"kind": "markdown_table", "min_rows": 1},
        {"kind": "headings", "required": ["a"]}, {"kind": "max_words", "value": 1},
        {"kind": "min_words", "value": 1}])])])
    (item,) = load_suite(p, "s")
    for text in ["", "{", "| a |\n|---|", "```json\n{bad\n```", "# \n#", "\x00\ufffd", "{" * 2000]:
        res = run_checks(item.turns[0], text)
        assert len(res) == 9 and all(isinstance(r.passed, bool) for r in res)


# ------------------------------------------------------------------------------------------
# shipped datasets
# ------------------------------------------------------------------------------------------

def test_shipped_long_output_suite():
    items = load_suite(DATASETS / "long_output.jsonl", "long_output", multi_turn=False)
    assert len(items) >= 40
    assert all(len(i.turns) == 1 and i.turns[0].checks for i in items)
    assert len({i.category for i in items}) >= 7
    kinds = {c.kind for i in items for c in i.turns[0].checks}
    assert kinds == CHECK_KINDS  # every check kind is exercised
    assert all(i.max_new_tokens is None or 256 <= i.max_new_tokens <= 2048 for i in items)


def test_shipped_multi_turn_suite():
    items = load_suite(DATASETS / "multi_turn.jsonl", "multi_turn", multi_turn=True)
    assert len(items) >= 20
    assert all(3 <= len(i.turns) <= 6 for i in items)
    assert all(t.checks for i in items for t in i.turns)  # every user turn is checked
    assert {"support", "sales", "hr", "finance", "operations"} <= {i.category for i in items}


def test_shipped_suite_checks_are_satisfiable_by_a_good_reply():
    """Hand-written correct replies pass the shipped checks (guards against broken patterns)."""
    lo = {i.id: i for i in load_suite(DATASETS / "long_output.jsonl", "lo", multi_turn=False)}
    mt = {i.id: i for i in load_suite(DATASETS / "multi_turn.jsonl", "mt", multi_turn=True)}
    replies = [
        (mt["mt-001"], 1, "Option A: within budget\n**Option B:** over budget\nOption C: within budget"),
        (mt["mt-001"], 2, "Your order number is ORD-55812. Option C costs $149, leaving $31 of your $180."),
        (mt["mt-003"], 0, "25 + 3 - 11 = 17.\n\n**Remaining: 17 days**"),
        (mt["mt-010"], 2, "Wednesday, 8 October 2025: Monday 6, Tuesday 7 and Wednesday 8."),
        (mt["mt-015"], 1, "No. Monday 22 December falls inside the change freeze."),
        (mt["mt-004"], 3, '```json\n{"invoice_number": "INV-7781", "supplier": "Marlowe Print", "net": 3262.50, '
                          '"vat": 652.50, "total": 3915.00}\n```'),
        (lo["lo-006"], 0, "| Region | Revenue Q2 2025 | Change vs Q2 2024 |\n|---|---|---|\n"
                          "| North | €1.20M | +8% |\n"
                          "| South | €0.90M | −3% |\n| East | €1.50M | +12% |\n| West | €1.10M | +1% |\n\n"
                          + "East was strongest and South weakest. " * 40),
        (lo["lo-021"], 0, "| Metric | 2023 | 2024 | Change |\n|---|---|---|---|\n| Electricity (MWh) | 2,140 | 1,980 "
                          "| -7.5% |\n| Water (m³) | 18,400 | 17,100 | -7.1% |\n| Waste to landfill (tonnes) | 96 "
                          "| 61 | -36.5% |\n\n72% of electricity is renewable; the target is 85% by 2026. "
                          + "Progress continued across all sites this year. " * 50),
        (lo["lo-028"], 0, "## Attendees\nRosa Delgado\n## Objectives\nProject Willow: £140,000, Lowmoor, by "
                          "30 September 2025.\n## Decisions\nPilot.\n## Action Items\n- Femi\n"
                          + "The team agreed the plan. " * 60 + "\nNext meeting: 2 May 2025 at 15:00\n"),
    ]
    for item, t, text in replies:
        failed = [r for r in run_checks(item.turns[t], text) if not r.passed]
        assert not failed, (item.id, t, failed)


def _calibration_rows() -> list[dict]:
    rows = []
    for line in (DATASETS / "calibration.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def test_calibration_file():
    rows = _calibration_rows()
    assert len(rows) >= 256
    assert all(set(r) == {"id", "text"} for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["text"] for r in rows}) == len(rows)
    counts = [len(r["text"].split()) for r in rows]
    assert all(180 <= c <= 750 for c in counts), (min(counts), max(counts))
    assert max(counts) - min(counts) > 300  # a real spread of lengths, not one size


def test_calibration_file_matches_its_generator():
    spec = importlib.util.spec_from_file_location("make_calibration", DATASETS / "tools" / "make_calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.generate() == _calibration_rows()


def test_depth_text():
    text = (DATASETS / "depth_text.txt").read_text(encoding="utf-8")
    assert len(text.split()) >= 6000
    assert "\ufffd" not in text


# ---- the check-kind registry ------------------------------------------------------------------

def test_check_kinds_come_from_the_registry():
    from qeval.measure.checks import check_kinds
    kinds = check_kinds()
    assert CHECK_KINDS == frozenset(kinds) >= {"contains_all", "regex", "json_keys", "markdown_table",
                                               "headings", "max_words", "min_words", "not_contains"}
    for name, k in kinds.items():
        assert k.name == name and k.params and callable(k.validate) and callable(k.evaluate)


NEW_KIND = '''
from qeval.measure.checks.base import CheckKind, ParamError

def _validate(p):
    if not isinstance(p.get("word"), str):
        raise ParamError("word", "must be a string")

def _evaluate(p, text):
    ok = text.strip().endswith(p["word"])
    return ok, "ends with it" if ok else "does not end with it"

KINDS = (CheckKind("ends_with", frozenset({"word"}), _validate, _evaluate),)
'''


def test_a_new_check_kind_is_one_module(tmp_path):
    """A module added to the checks package (here on an extra package path) is a kind that
    suites load, validate (file:line: field) and evaluate; nothing else is edited."""
    import subprocess
    import sys
    (tmp_path / "ends_with.py").write_text(NEW_KIND)
    suite = tmp_path / "s.jsonl"
    suite.write_text('{"id": "a", "category": "c", "turns": [{"user": "hi", "checks": [{"kind": "ends_with", '
                     '"word": "bye"}]}]}\n{"id": "b", "category": "c", "turns": [{"user": "hi", "checks": '
                     '[{"kind": "ends_with", "word": 3}]}]}\n')
    code = (f"import qeval.measure.checks as c; c.__path__.append({str(tmp_path)!r})\n"
            "from qeval.measure.suites import Check, load_suite, run_check\n"
            "print(run_check(Check('ends_with', {'word': 'bye'}), 'ok bye').passed)\n"
            f"load_suite({str(suite)!r}, 's')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.stdout.split() == ["True"], p.stderr[-2000:]
    assert "s.jsonl:2: turns[0].checks[0].word: must be a string" in p.stderr
