"""Free-running suites: load checkable prompts from JSONL and verify replies without a judge.

A suite file holds one JSON object per line (blank lines are skipped)::

    {"id": "lo-001", "category": "incident-postmortem", "system": "optional",
     "max_new_tokens": 768,
     "turns": [{"user": "...", "checks": [{"kind": "contains_all", "values": ["INC-4471"]}]}]}

Each check is an object with ``kind`` plus that kind's parameters (see ``datasets/README.md``;
the kinds are :mod:`qeval.measure.checks`, one module each).
Every row, turn and check is validated when the file is loaded, so :func:`run_check` never
raises on loaded data; bad input raises :class:`~qeval.errors.QevalInputError` whose message
is one line ``file:line: field: what is wrong``.

The file is read with the bounded loaders of :mod:`qeval.bounded` (size, nesting depth).
A check that could not be decided in bounded time (a regex search that timed out,
:mod:`qeval.measure.checks.regex`) has ``passed=None`` and ``status="timeout"``: neither a
pass nor a fail.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bounded import MAX_DEPTH, MAX_JSONL_BYTES, parse_json, read_bytes
from ..errors import QevalInputError
from .checks import ParamError, check_kinds, validate_params
from .checks.base import describe as _describe
from .checks.base import is_int as _is_int

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
        passed: whether the reply satisfies the check; None when the check could not be
            decided in bounded time (a regex that timed out: :mod:`qeval.measure.checks.regex`).
        detail: one short human-readable line explaining the outcome (what was missing, counts, ...).
    """

    kind: str
    passed: bool | None
    detail: str

    @property
    def status(self) -> str:
        """``"pass"``, ``"fail"`` or ``"timeout"``."""
        return "timeout" if self.passed is None else ("pass" if self.passed else "fail")


CHECK_KINDS: frozenset[str] = frozenset(check_kinds())
"""Every check kind :func:`load_suite` accepts and :func:`run_check` evaluates (qeval.measure.checks)."""


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------

_ROW_FIELDS = ("id", "category", "system", "max_new_tokens", "turns")
_TURN_FIELDS = ("user", "checks")


def jsonl_rows(path: str | Path, *, what: str = "file") -> list[tuple[int, Any]]:
    """Parsed rows of a UTF-8 JSONL file: ``[(1-based line number, value)]``, blank lines
    skipped (still counted), a leading BOM ignored. Read with the bounded loaders of
    :mod:`qeval.bounded`: a regular file of at most :data:`~qeval.bounded.MAX_JSONL_BYTES`
    bytes, each row nested at most :data:`~qeval.bounded.MAX_DEPTH` levels. Duplicate keys
    in an object, ``NaN`` and ``Infinity`` are errors (the standard ``json`` module accepts
    them silently).

    Raises:
        QevalInputError: missing, not a regular file or too large (naming ``what``), invalid
            UTF-8, invalid or too deeply nested JSON, naming file, line and field ``row``.
    """
    file = str(path)
    raw = read_bytes(path, limit=MAX_JSONL_BYTES, what=what)
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
        rows.append((lineno, parse_json(line, file=file, line=lineno, field="row", strict=True,
                                        max_depth=MAX_DEPTH)))
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
                validate_params(kind, params)
            except ParamError as pe:
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
        validate_params(check.kind, check.params)
    except ParamError as pe:
        raise ValueError(f"{check.kind}.{pe.field}: {pe.message}") from None
    passed, detail = check_kinds()[check.kind].evaluate(check.params, text)
    return CheckResult(kind=check.kind, passed=None if passed is None else bool(passed), detail=detail)


def run_checks(turn: Turn, text: str) -> list[CheckResult]:
    """Evaluate every check of ``turn`` on the reply ``text``; results in the turn's check order."""
    return [run_check(c, text) for c in turn.checks]
