"""``regex``: ``pattern`` (Python ``re`` syntax) found in the reply; ``flags`` from ``ims``."""
from __future__ import annotations

import re

from .base import CheckKind, ParamError, describe, short

_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}


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
    try:
        re.compile(pat, _regex_flags(p))
    except re.error as exc:
        raise ParamError("pattern", f"invalid regular expression: {exc}") from None


def _regex_flags(p: dict) -> int:
    flags = 0
    for c in p.get("flags", ""):
        flags |= _REGEX_FLAGS[c]
    return flags


def _check_regex(p: dict, text: str) -> tuple[bool, str]:
    m = re.search(p["pattern"], text, _regex_flags(p))
    if m:
        return True, f"matched {short(m.group(0))}"
    return False, f"no match for {short(p['pattern'])}"


KINDS = (CheckKind("regex", frozenset({"pattern", "flags"}), _validate_regex, _check_regex),)
