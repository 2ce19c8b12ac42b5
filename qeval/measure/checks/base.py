"""What every check kind is built from: the :class:`CheckKind` record and the parameter
validators the kinds share (load-time validation raises :class:`ParamError`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class CheckKind:
    """One kind of check on a reply.

    Attributes:
        name: the ``kind`` in a suite row (``contains_all``).
        params: the parameter names a row may give.
        validate: ``validate(params)`` raises :class:`ParamError` for bad parameters (load time).
        evaluate: ``evaluate(params, reply text) -> (passed, one-line detail)``; never raises
            on validated parameters; ``passed`` is None when the check could not be decided
            in bounded time (a regex search that timed out: :mod:`qeval.measure.checks.regex`).
    """
    name: str
    params: frozenset[str]
    validate: Callable[[dict], None]
    evaluate: Callable[[dict, str], tuple[bool | None, str]]


class ParamError(Exception):
    """A check parameter is bad. ``field`` is relative to the check object."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def str_list(params: dict, key: str, *, required: bool) -> None:
    """``params[key]`` is a non-empty list of non-empty strings (or absent when not required)."""
    if key not in params:
        if required:
            raise ParamError(key, "missing required parameter")
        return
    v = params[key]
    if not isinstance(v, list) or not v:
        raise ParamError(key, f"must be a non-empty list of strings, got {describe(v)}")
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s.strip():
            raise ParamError(f"{key}[{i}]", f"must be a non-empty string, got {describe(s)}")


def boolean(params: dict, key: str) -> None:
    """``params[key]`` is true or false when present."""
    if key in params and not isinstance(params[key], bool):
        raise ParamError(key, f"must be true or false, got {describe(params[key])}")


def integer(params: dict, key: str, *, required: bool, minimum: int = 0) -> None:
    """``params[key]`` is an integer >= ``minimum`` (or absent when not required)."""
    if key not in params:
        if required:
            raise ParamError(key, "missing required parameter (integer)")
        return
    v = params[key]
    if not is_int(v):
        raise ParamError(key, f"must be an integer, got {describe(v)}")
    if v < minimum:
        raise ParamError(key, f"must be >= {minimum}, got {v}")


def describe(v: Any) -> str:
    """A value's kind for an error message (``empty list``, ``number 3``, ``object`` ...)."""
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


def short(s: str, n: int = 40) -> str:
    """``repr`` of ``s`` cut to ``n`` characters."""
    return repr(s if len(s) <= n else s[: n - 1] + "…")
