"""``max_words`` / ``min_words``: the reply's whitespace-separated word count against ``value``."""
from __future__ import annotations

from .base import CheckKind, integer


def _validate_words(p: dict) -> None:
    integer(p, "value", required=True, minimum=1)


def _check_max_words(p: dict, text: str) -> tuple[bool, str]:
    n = len(text.split())
    return n <= p["value"], f"{n} words (max {p['value']})"


def _check_min_words(p: dict, text: str) -> tuple[bool, str]:
    n = len(text.split())
    return n >= p["value"], f"{n} words (min {p['value']})"


KINDS = (CheckKind("max_words", frozenset({"value"}), _validate_words, _check_max_words),
         CheckKind("min_words", frozenset({"value"}), _validate_words, _check_min_words))
