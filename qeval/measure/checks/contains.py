"""Substring checks: ``contains_all``, ``contains_any``, ``not_contains`` (``values``, optional
``case_sensitive``; case-insensitive matching folds with ``str.casefold``)."""
from __future__ import annotations

from .base import CheckKind, boolean, short, str_list


def _validate_contains(p: dict) -> None:
    str_list(p, "values", required=True)
    boolean(p, "case_sensitive")


def _contains(p: dict, text: str) -> list[tuple[str, bool]]:
    if p.get("case_sensitive", False):
        return [(v, v in text) for v in p["values"]]
    folded = text.casefold()
    return [(v, v.casefold() in folded) for v in p["values"]]


def _check_contains_all(p: dict, text: str) -> tuple[bool, str]:
    missing = [v for v, hit in _contains(p, text) if not hit]
    if missing:
        return False, "missing: " + ", ".join(short(v) for v in missing)
    return True, f"all {len(p['values'])} present"


def _check_contains_any(p: dict, text: str) -> tuple[bool, str]:
    found = [v for v, hit in _contains(p, text) if hit]
    if found:
        return True, "found: " + ", ".join(short(v) for v in found)
    return False, "none of " + ", ".join(short(v) for v in p["values"])


def _check_not_contains(p: dict, text: str) -> tuple[bool, str]:
    found = [v for v, hit in _contains(p, text) if hit]
    if found:
        return False, "forbidden present: " + ", ".join(short(v) for v in found)
    return True, "none present"


_PARAMS = frozenset({"values", "case_sensitive"})
KINDS = (CheckKind("contains_all", _PARAMS, _validate_contains, _check_contains_all),
         CheckKind("contains_any", _PARAMS, _validate_contains, _check_contains_any),
         CheckKind("not_contains", _PARAMS, _validate_contains, _check_not_contains))
