"""``headings``: ATX Markdown headings outside code fences: at least ``min_count``, and/or
every ``required`` text inside some heading (case-insensitive)."""
from __future__ import annotations

import re

from .base import CheckKind, ParamError, integer, short, str_list


def _validate_headings(p: dict) -> None:
    integer(p, "min_count", required=False, minimum=1)
    str_list(p, "required", required=False)
    if "min_count" not in p and "required" not in p:
        raise ParamError("min_count", "headings needs min_count and/or required")


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
        problems.append("missing headings: " + ", ".join(short(r) for r in missing))
    if problems:
        return False, "; ".join(problems)
    return True, f"{len(heads)} headings"


KINDS = (CheckKind("headings", frozenset({"min_count", "required"}), _validate_headings, _check_headings),)
