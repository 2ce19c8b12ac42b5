"""Free-running suites: load checkable prompts from JSONL and verify replies without a judge.

A suite file holds one JSON object per line (blank lines are skipped)::

    {"id": "lo-001", "category": "incident-postmortem", "system": "optional",
     "max_new_tokens": 768,
     "turns": [{"user": "...", "checks": [{"kind": "contains_all", "values": ["INC-4471"]}]}]}

Each check is an object with ``kind`` plus that kind's parameters (see ``datasets/README.md``).
Every row, turn and check is validated when the file is loaded, so :func:`run_check` never
raises on loaded data; bad input raises :class:`~qeval.errors.QevalInputError` whose message
is one line ``file:line: field: what is wrong``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qeval.errors import QevalInputError

__all__ = [
    "CHECK_KINDS",
    "Check",
    "CheckResult",
    "SuiteItem",
    "Turn",
    "describe_value",
    "jsonl_rows",
    "load_suite",
    "run_check",
    "run_checks",
]

#: Turn count a multi-turn row must have (inclusive).
MULTI_TURN_MIN = 3
MULTI_TURN_MAX = 6


@dataclass(frozen=True)
class Check:
    """One verifiable property of a reply.

    Attributes:
        kind: one of :data:`CHECK_KINDS`.
        params: the kind's parameters (the row's check object without ``kind``),
            already validated when loaded through :func:`load_suite`.
    """

    kind: str
    params: dict


@dataclass(frozen=True)
class Turn:
    """One user message and the checks applied to the assistant's reply to it.

    Attributes:
        user: the user message text.
        checks: checks on the reply to this turn (may be empty for a turn that only gives facts).
    """

    user: str
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class SuiteItem:
    """One suite item: a conversation of one or more user turns.

    Attributes:
        id: unique id within the file.
        suite: suite name given to :func:`load_suite` (e.g. ``"long_output"``).
        category: free-form grouping label (e.g. ``"incident-postmortem"``).
        system: optional system prompt, ``None`` when absent.
        turns: user turns in order; long-output items have 1, multi-turn items 3 to 6.
        max_new_tokens: per-reply generation budget in tokens, ``None`` means the recipe default.
        source: ``"file:line"`` where the row was read.
    """

    id: str
    suite: str
    category: str
    system: str | None
    turns: tuple[Turn, ...]
    max_new_tokens: int | None
    source: str


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check on one reply.

    Attributes:
        kind: the check kind.
        passed: whether the reply satisfies the check.
        detail: one short human-readable line explaining the outcome (what was missing, counts, ...).
    """

    kind: str
    passed: bool
    detail: str


# ----------------------------------------------------------------------------------------------
# parameter validation (load time)
# ----------------------------------------------------------------------------------------------

class _ParamError(Exception):
    """Internal: a check parameter is bad. ``field`` is relative to the check object."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(params: dict, key: str, *, required: bool) -> None:
    if key not in params:
        if required:
            raise _ParamError(key, "missing required parameter")
        return
    v = params[key]
    if not isinstance(v, list) or not v:
        raise _ParamError(key, f"must be a non-empty list of strings, got {_describe(v)}")
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s.strip():
            raise _ParamError(f"{key}[{i}]", f"must be a non-empty string, got {_describe(s)}")


def _bool(params: dict, key: str) -> None:
    if key in params and not isinstance(params[key], bool):
        raise _ParamError(key, f"must be true or false, got {_describe(params[key])}")


def _int(params: dict, key: str, *, required: bool, minimum: int = 0) -> None:
    if key not in params:
        if required:
            raise _ParamError(key, "missing required parameter (integer)")
        return
    v = params[key]
    if not _is_int(v):
        raise _ParamError(key, f"must be an integer, got {_describe(v)}")
    if v < minimum:
        raise _ParamError(key, f"must be >= {minimum}, got {v}")


_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}


def _validate_contains(p: dict) -> None:
    _str_list(p, "values", required=True)
    _bool(p, "case_sensitive")


def _validate_regex(p: dict) -> None:
    pat = p.get("pattern")
    if "pattern" not in p:
        raise _ParamError("pattern", "missing required parameter")
    if not isinstance(pat, str) or not pat:
        raise _ParamError("pattern", f"must be a non-empty string, got {_describe(pat)}")
    if "flags" in p:
        fl = p["flags"]
        if not isinstance(fl, str) or any(c not in _REGEX_FLAGS for c in fl):
            raise _ParamError("flags", f"must be a string of letters from 'ims', got {_describe(fl)}")
    try:
        re.compile(pat, _regex_flags(p))
    except re.error as exc:
        raise _ParamError("pattern", f"invalid regular expression: {exc}") from None


def _validate_json_keys(p: dict) -> None:
    _str_list(p, "keys", required=True)


def _validate_markdown_table(p: dict) -> None:
    _int(p, "min_rows", required=True, minimum=1)
    _int(p, "max_rows", required=False, minimum=1)
    if "max_rows" in p and p["max_rows"] < p["min_rows"]:
        raise _ParamError("max_rows", f"must be >= min_rows ({p['min_rows']}), got {p['max_rows']}")


def _validate_headings(p: dict) -> None:
    _int(p, "min_count", required=False, minimum=1)
    _str_list(p, "required", required=False)
    if "min_count" not in p and "required" not in p:
        raise _ParamError("min_count", "headings needs min_count and/or required")


def _validate_words(p: dict) -> None:
    _int(p, "value", required=True, minimum=1)


_VALIDATORS: dict[str, tuple[Callable[[dict], None], frozenset[str]]] = {
    "contains_all": (_validate_contains, frozenset({"values", "case_sensitive"})),
    "contains_any": (_validate_contains, frozenset({"values", "case_sensitive"})),
    "not_contains": (_validate_contains, frozenset({"values", "case_sensitive"})),
    "regex": (_validate_regex, frozenset({"pattern", "flags"})),
    "json_keys": (_validate_json_keys, frozenset({"keys"})),
    "markdown_table": (_validate_markdown_table, frozenset({"min_rows", "max_rows"})),
    "headings": (_validate_headings, frozenset({"min_count", "required"})),
    "max_words": (_validate_words, frozenset({"value"})),
    "min_words": (_validate_words, frozenset({"value"})),
}

#: Every check kind :func:`load_suite` accepts and :func:`run_check` evaluates.
CHECK_KINDS: frozenset[str] = frozenset(_VALIDATORS)


def _validate_check(kind: str, params: dict) -> None:
    """Raise _ParamError when ``params`` do not fit ``kind`` (kind must be known)."""
    validator, allowed = _VALIDATORS[kind]
    for key in params:
        if key not in allowed:
            raise _ParamError(key, f"unknown parameter for {kind} (allowed: {', '.join(sorted(allowed))})")
    validator(params)


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return f"number {v!r}"
    if isinstance(v, str):
        return "empty string" if not v.strip() else "string"
    if isinstance(v, list):
        return "empty list" if not v else "list"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------

_ROW_FIELDS = ("id", "category", "system", "max_new_tokens", "turns")
_TURN_FIELDS = ("user", "checks")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def jsonl_rows(path: str | Path, *, what: str = "file") -> list[tuple[int, Any]]:
    """Parsed rows of a UTF-8 JSONL file: ``[(1-based line number, value)]``, blank lines
    skipped (still counted), a leading BOM ignored. Duplicate keys in an object, ``NaN`` and
    ``Infinity`` are errors (the standard ``json`` module accepts them silently).

    Raises:
        QevalInputError: unreadable file (``cannot read <what>``), invalid UTF-8 or invalid
            JSON, naming file, line and field ``row``.
    """
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise QevalInputError(f"cannot read {what}: {exc.strerror or exc}", file=file) from None
    rows: list[tuple[int, Any]] = []
    for lineno, bline in enumerate(raw.split(b"\n"), start=1):
        if lineno == 1 and bline.startswith(b"\xef\xbb\xbf"):
            bline = bline[3:]
        try:
            line = bline.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise QevalInputError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})",
                                  file=file, line=lineno, field="row") from None
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line, object_pairs_hook=_no_duplicate_keys,
                                            parse_constant=_reject_constant)))
        except ValueError as exc:  # JSONDecodeError is a ValueError; so are the hooks' errors
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            col = f" (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
            raise QevalInputError(f"invalid JSON: {msg}{col}", file=file, line=lineno, field="row") from None
    return rows


def describe_value(v: Any) -> str:
    """A short name of a JSON value's type for error messages (``empty string``, ``number 3``, ...)."""
    return _describe(v)


def load_suite(path: str | Path, suite: str, *, multi_turn: bool | None = None) -> list[SuiteItem]:
    """Load and validate a suite JSONL file.

    Args:
        path: the JSONL file; one object per line, blank lines skipped, UTF-8.
        suite: suite name recorded on every item (e.g. ``"long_output"``, ``"multi_turn"``).
        multi_turn: ``True`` requires 3 to 6 turns per row, ``False`` exactly 1, ``None`` any count >= 1.

    Returns:
        Items in file order.

    Raises:
        QevalInputError: one line naming file, 1-based line and field, for an unreadable file,
            invalid JSON, a row that is not an object, missing/unknown fields, wrong types,
            empty strings, duplicate ids, empty ``turns``, a wrong turn count, an unknown check
            kind, missing/invalid check parameters (including regexes that do not compile),
            an item without any check, or a file with no items.
    """
    file = str(path)
    items: list[SuiteItem] = []
    seen_ids: dict[str, int] = {}
    for lineno, row in jsonl_rows(path, what="suite file"):
        item = _parse_row(row, file=file, line=lineno, suite=suite, multi_turn=multi_turn)
        if item.id in seen_ids:
            raise QevalInputError(f"duplicate id {item.id!r} (first on line {seen_ids[item.id]})",
                                  file=file, line=lineno, field="id")
        seen_ids[item.id] = lineno
        items.append(item)

    if not items:
        raise QevalInputError("suite file has no items", file=file)
    return items


def _parse_row(row: Any, *, file: str, line: int, suite: str, multi_turn: bool | None) -> SuiteItem:
    def err(field: str, message: str) -> QevalInputError:
        return QevalInputError(message, file=file, line=line, field=field)

    if not isinstance(row, dict):
        raise err("row", f"must be a JSON object, got {_describe(row)}")
    for key in row:
        if key not in _ROW_FIELDS:
            raise err(str(key), f"unknown field (allowed: {', '.join(_ROW_FIELDS)})")

    for key in ("id", "category"):
        if key not in row:
            raise err(key, "missing required field")
        if not isinstance(row[key], str) or not row[key].strip():
            raise err(key, f"must be a non-empty string, got {_describe(row[key])}")

    system = row.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise err("system", f"must be a non-empty string or omitted, got {_describe(system)}")

    mnt = row.get("max_new_tokens")
    if mnt is not None and (not _is_int(mnt) or mnt < 1):
        raise err("max_new_tokens", f"must be a positive integer or omitted, got {_describe(mnt)}")

    if "turns" not in row:
        raise err("turns", "missing required field")
    turns_raw = row["turns"]
    if not isinstance(turns_raw, list):
        raise err("turns", f"must be a list of turn objects, got {_describe(turns_raw)}")
    if not turns_raw:
        raise err("turns", "must not be empty")
    n = len(turns_raw)
    if multi_turn is True and not (MULTI_TURN_MIN <= n <= MULTI_TURN_MAX):
        raise err("turns", f"multi-turn item needs {MULTI_TURN_MIN} to {MULTI_TURN_MAX} turns, got {n}")
    if multi_turn is False and n != 1:
        raise err("turns", f"single-turn item needs exactly 1 turn, got {n}")

    turns: list[Turn] = []
    for ti, t in enumerate(turns_raw):
        tf = f"turns[{ti}]"
        if not isinstance(t, dict):
            raise err(tf, f"must be an object with user and checks, got {_describe(t)}")
        for key in t:
            if key not in _TURN_FIELDS:
                raise err(f"{tf}.{key}", f"unknown field (allowed: {', '.join(_TURN_FIELDS)})")
        if "user" not in t:
            raise err(f"{tf}.user", "missing required field")
        if not isinstance(t["user"], str) or not t["user"].strip():
            raise err(f"{tf}.user", f"must be a non-empty string, got {_describe(t['user'])}")
        if "checks" not in t:
            raise err(f"{tf}.checks", "missing required field (use [] for a turn without checks)")
        if not isinstance(t["checks"], list):
            raise err(f"{tf}.checks", f"must be a list of check objects, got {_describe(t['checks'])}")
        checks: list[Check] = []
        for ci, c in enumerate(t["checks"]):
            cf = f"{tf}.checks[{ci}]"
            if not isinstance(c, dict):
                raise err(cf, f"must be an object with a kind, got {_describe(c)}")
            if "kind" not in c:
                raise err(f"{cf}.kind", "missing required field")
            kind = c["kind"]
            if not isinstance(kind, str) or kind not in CHECK_KINDS:
                shown = repr(kind) if isinstance(kind, str) else _describe(kind)
                raise err(f"{cf}.kind", f"unknown check kind {shown} (known: {', '.join(sorted(CHECK_KINDS))})")
            params = {k: v for k, v in c.items() if k != "kind"}
            try:
                _validate_check(kind, params)
            except _ParamError as pe:
                raise err(f"{cf}.{pe.field}", pe.message) from None
            checks.append(Check(kind=kind, params=params))
        turns.append(Turn(user=t["user"], checks=tuple(checks)))

    if not any(t.checks for t in turns):
        raise err("turns", "item has no checks in any turn")

    return SuiteItem(id=row["id"], suite=suite, category=row["category"], system=system,
                     turns=tuple(turns), max_new_tokens=mnt, source=f"{file}:{line}")


# ----------------------------------------------------------------------------------------------
# running checks
# ----------------------------------------------------------------------------------------------

def _regex_flags(p: dict) -> int:
    flags = 0
    for c in p.get("flags", ""):
        flags |= _REGEX_FLAGS[c]
    return flags


def _short(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[: n - 1] + "…")


def _contains(p: dict, text: str) -> list[tuple[str, bool]]:
    if p.get("case_sensitive", False):
        return [(v, v in text) for v in p["values"]]
    folded = text.casefold()
    return [(v, v.casefold() in folded) for v in p["values"]]


def _check_contains_all(p: dict, text: str) -> tuple[bool, str]:
    missing = [v for v, hit in _contains(p, text) if not hit]
    if missing:
        return False, "missing: " + ", ".join(_short(v) for v in missing)
    return True, f"all {len(p['values'])} present"


def _check_contains_any(p: dict, text: str) -> tuple[bool, str]:
    found = [v for v, hit in _contains(p, text) if hit]
    if found:
        return True, "found: " + ", ".join(_short(v) for v in found)
    return False, "none of " + ", ".join(_short(v) for v in p["values"])


def _check_not_contains(p: dict, text: str) -> tuple[bool, str]:
    found = [v for v, hit in _contains(p, text) if hit]
    if found:
        return False, "forbidden present: " + ", ".join(_short(v) for v in found)
    return True, "none present"


def _check_regex(p: dict, text: str) -> tuple[bool, str]:
    m = re.search(p["pattern"], text, _regex_flags(p))
    if m:
        return True, f"matched {_short(m.group(0))}"
    return False, f"no match for {_short(p['pattern'])}"


_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|Json)?[ \t]*\r?\n(.*?)```", re.DOTALL)
_MAX_BARE_JSON_TRIES = 500


def _find_json_object(text: str) -> dict | None:
    """First JSON object in ``text``: fenced ```json blocks first, then bare ``{...}`` in text order."""
    for m in _FENCE_RE.finditer(text):
        try:
            obj = json.loads(m.group(1).strip())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    decoder = json.JSONDecoder()
    pos, tries = 0, 0
    while tries < _MAX_BARE_JSON_TRIES:
        start = text.find("{", pos)
        if start < 0:
            return None
        tries += 1
        try:
            obj, _end = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        return obj  # raw_decode at "{" always yields a dict
    return None


def _check_json_keys(p: dict, text: str) -> tuple[bool, str]:
    obj = _find_json_object(text)
    if obj is None:
        return False, "no JSON object found"
    missing = [k for k in p["keys"] if k not in obj]
    if missing:
        return False, "JSON object lacks keys: " + ", ".join(_short(k) for k in missing)
    return True, f"JSON object has all {len(p['keys'])} keys"


_TABLE_SEP_CELL = re.compile(r"^\s*:?-+:?\s*$")


def _is_table_separator(line: str) -> bool:
    s = line.strip()
    if "|" not in s:
        return False
    s = s.strip("|")
    cells = s.split("|")
    return bool(cells) and all(_TABLE_SEP_CELL.match(c) for c in cells)


def _table_row_counts(text: str) -> list[int]:
    """Data-row count of every Markdown table (header row, ``|---|`` separator, rows with ``|``)."""
    lines = text.splitlines()
    counts: list[int] = []
    i = 0
    while i + 1 < len(lines):
        header, sep = lines[i], lines[i + 1]
        if "|" in header and header.strip().strip("|").strip() and not _is_table_separator(header) \
                and _is_table_separator(sep):
            j = i + 2
            while j < len(lines) and "|" in lines[j] and lines[j].strip():
                j += 1
            counts.append(j - (i + 2))
            i = j
        else:
            i += 1
    return counts


def _check_markdown_table(p: dict, text: str) -> tuple[bool, str]:
    lo, hi = p["min_rows"], p.get("max_rows")
    want = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    counts = _table_row_counts(text)
    if not counts:
        return False, f"no Markdown table found (need {want} data rows)"
    ok = any(c >= lo and (hi is None or c <= hi) for c in counts)
    return ok, f"table data rows {counts}; need {want}"


_HEADING_RE = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
_FENCE_LINE_RE = re.compile(r"^ {0,3}(```|~~~)")


def _headings(text: str) -> list[str]:
    """Text of ATX Markdown headings outside fenced code blocks."""
    out: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if _FENCE_LINE_RE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        m = _HEADING_RE.match(line)
        if m and m.group(2).strip():
            out.append(m.group(2).strip())
    return out


def _check_headings(p: dict, text: str) -> tuple[bool, str]:
    heads = _headings(text)
    problems: list[str] = []
    if "min_count" in p and len(heads) < p["min_count"]:
        problems.append(f"{len(heads)} headings, need >= {p['min_count']}")
    folded = [h.casefold() for h in heads]
    missing = [r for r in p.get("required", []) if not any(r.casefold() in h for h in folded)]
    if missing:
        problems.append("missing headings: " + ", ".join(_short(r) for r in missing))
    if problems:
        return False, "; ".join(problems)
    return True, f"{len(heads)} headings"


def _check_max_words(p: dict, text: str) -> tuple[bool, str]:
    n = len(text.split())
    return n <= p["value"], f"{n} words (max {p['value']})"


def _check_min_words(p: dict, text: str) -> tuple[bool, str]:
    n = len(text.split())
    return n >= p["value"], f"{n} words (min {p['value']})"


_RUNNERS: dict[str, Callable[[dict, str], tuple[bool, str]]] = {
    "contains_all": _check_contains_all,
    "contains_any": _check_contains_any,
    "not_contains": _check_not_contains,
    "regex": _check_regex,
    "json_keys": _check_json_keys,
    "markdown_table": _check_markdown_table,
    "headings": _check_headings,
    "max_words": _check_max_words,
    "min_words": _check_min_words,
}
assert frozenset(_RUNNERS) == CHECK_KINDS


def run_check(check: Check, text: str) -> CheckResult:
    """Evaluate one check on one reply.

    Args:
        check: a check, normally from :func:`load_suite` (already validated).
        text: the assistant's reply to the turn, as decoded text.

    Returns:
        The outcome with a one-line detail. Never raises for checks loaded by :func:`load_suite`.

    Raises:
        ValueError: only for a hand-built check with an unknown kind or invalid parameters.
    """
    if check.kind not in CHECK_KINDS:
        raise ValueError(f"unknown check kind {check.kind!r} (known: {', '.join(sorted(CHECK_KINDS))})")
    try:
        _validate_check(check.kind, check.params)
    except _ParamError as pe:
        raise ValueError(f"{check.kind}.{pe.field}: {pe.message}") from None
    passed, detail = _RUNNERS[check.kind](check.params, text)
    return CheckResult(kind=check.kind, passed=bool(passed), detail=detail)


def run_checks(turn: Turn, text: str) -> list[CheckResult]:
    """Evaluate every check of ``turn`` on the reply ``text``; results in the turn's check order."""
    return [run_check(c, text) for c in turn.checks]
