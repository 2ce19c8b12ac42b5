"""``regex``: ``pattern`` (Python ``re`` syntax) found in the reply; ``flags`` from ``ims``.

Checks run on the PyPI ``regex`` engine with a match timeout (:data:`REGEX_TIMEOUT_S`):
the standard ``re`` has none, so a catastrophic pattern such as ``(a+)+$`` on a long reply
would hang the quality stage. A search that times out returns ``passed=None`` (status
``timeout``): neither a pass nor a fail (:mod:`qeval.measure.behaviour` counts it in
``checks_timed_out``). Patterns are bounded before they are compiled
(:func:`pattern_problem`: length, group nesting, repeat counts), since ``regex`` expands
counted repeats at compile time (``a{100000000}`` would take gigabytes) and thousands of
nested groups exhaust the compiler's stack. Library checked: ``re`` and ``regex`` have no
compile-time bounds of their own.
"""
from __future__ import annotations

import functools
import re

import regex

from .base import CheckKind, ParamError, describe, short

_REGEX_FLAGS = {"i": regex.IGNORECASE, "m": regex.MULTILINE, "s": regex.DOTALL}
#: Seconds one regex search may take on one reply before the check is reported as timed out.
REGEX_TIMEOUT_S = 1.0
#: Bounds on a regex check's pattern, checked before it is compiled.
MAX_PATTERN_LEN = 1000
MAX_GROUP_DEPTH = 32
MAX_REPEAT = 1000         # largest count in {m,n}
MAX_EXPANSION = 10_000    # largest product of nested counted repeats ((a{100}){100})
_QUANT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def pattern_problem(pat: str) -> str | None:
    """Why a regex check's pattern is too costly to compile (None when it is fine): longer
    than :data:`MAX_PATTERN_LEN`, groups nested deeper than :data:`MAX_GROUP_DEPTH`, a
    ``{m,n}`` count above :data:`MAX_REPEAT`, or nested counted repeats multiplying past
    :data:`MAX_EXPANSION`. A linear scan of the pattern text (escapes and ``[...]`` sets
    skipped), no recursion."""
    if len(pat) > MAX_PATTERN_LEN:
        return f"pattern is {len(pat)} characters long; at most {MAX_PATTERN_LEN}"
    frames = [1]          # per open group: the largest expansion factor inside it
    i, n = 0, len(pat)
    last: int | None = None  # factor of the atom just read (a quantifier multiplies it)
    while i < n:
        c = pat[i]
        if c == "\\":
            i += 2
            if i - 1 < n and pat[i - 1].isalpha() and i < n and pat[i] == "{":
                close = pat.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pat[j] == "^":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 2 if pat[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            frames.append(1)
            if len(frames) - 1 > MAX_GROUP_DEPTH:
                return f"groups are nested more than {MAX_GROUP_DEPTH} deep"
            i, last = i + 1, None
            continue
        if c == ")":
            inner = frames.pop() if len(frames) > 1 else 1
            i, last = i + 1, inner
            frames[-1] = max(frames[-1], inner)
            continue
        if c == "{":
            m = _QUANT.match(pat, i)
            if m and (m.group(1) or m.group(3)):
                nums = [g for g in (m.group(1), m.group(3)) if g]
                if any(len(g) > 6 or int(g) > MAX_REPEAT for g in nums):
                    return f"repeat count {m.group(0)} is above {MAX_REPEAT}"
                factor = (last or 1) * max(int(g) for g in nums)
                if factor > MAX_EXPANSION:
                    return (f"nested counted repeats expand to {factor:,} copies; at most {MAX_EXPANSION:,} "
                            "(e.g. (a{100}){100})")
                frames[-1] = max(frames[-1], factor)
                i, last = m.end(), factor
                continue
        i, last = i + 1, 1
    return None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str, flags: int) -> "regex.Pattern":
    return regex.compile(pattern, flags)


def _validate_regex(p: dict) -> None:
    pat = p.get("pattern")
    if "pattern" not in p:
        raise ParamError("pattern", "missing required parameter")
    if not isinstance(pat, str) or not pat:
        raise ParamError("pattern", f"must be a non-empty string, got {describe(pat)}")
    if "flags" in p:
        fl = p["flags"]
        if not isinstance(fl, str) or any(c not in _REGEX_FLAGS for c in fl):
            raise ParamError("flags", f"must be a string of letters from 'ims', got {describe(fl)}")
    problem = pattern_problem(pat)
    if problem:
        raise ParamError("pattern", problem)
    try:
        _compiled(pat, _regex_flags(p))
    except (regex.error, OverflowError, RecursionError, MemoryError, ValueError, TypeError) as exc:
        raise ParamError("pattern", f"invalid regular expression: {' '.join(str(exc).split())[:200]}") from None


def _regex_flags(p: dict) -> int:
    flags = 0
    for c in p.get("flags", ""):
        flags |= _REGEX_FLAGS[c]
    return flags


def _check_regex(p: dict, text: str) -> tuple[bool | None, str]:
    try:
        m = _compiled(p["pattern"], _regex_flags(p)).search(text, timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        return None, f"timed out after {REGEX_TIMEOUT_S:g} s on a reply of {len(text)} characters (not judged)"
    if m:
        return True, f"matched {short(m.group(0))}"
    return False, f"no match for {short(p['pattern'])}"


KINDS = (CheckKind("regex", frozenset({"pattern", "flags"}), _validate_regex, _check_regex),)
