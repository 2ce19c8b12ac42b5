"""Check kinds: properties of a reply verified without a judge, registered by name.

Every module of this package that defines ``KINDS`` (a tuple of
:class:`~qeval.measure.checks.base.CheckKind`: name, parameters, validation, evaluation)
adds those kinds, so a new kind is a new module (and its rows in datasets/README.md).
Suites (:mod:`qeval.measure.suites`) validate every check of a row against its kind when
the file is loaded, and evaluate it on each answer.
"""
from __future__ import annotations

from ...plugins import one_each, registered
from .base import CheckKind, ParamError

_REGISTRY: dict[str, CheckKind] | None = None


def check_kinds() -> dict[str, CheckKind]:
    """``{kind name: CheckKind}`` of every registered kind, sorted by name."""
    global _REGISTRY
    if _REGISTRY is None:
        found = one_each(((m, k.name, k) for m, kinds in registered(__name__, __path__, "KINDS") for k in kinds),
                         "check kind")
        _REGISTRY = dict(sorted(found.items()))
    return _REGISTRY


def validate_params(kind: str, params: dict) -> None:
    """Check a check's parameters (the row's object without ``kind``) against its kind.

    Raises:
        KeyError: unknown kind.
        ParamError: an unknown parameter, or one the kind rejects (``field`` names it).
    """
    k = check_kinds()[kind]
    for key in params:
        if key not in k.params:
            raise ParamError(key, f"unknown parameter for {kind} (allowed: {', '.join(sorted(k.params))})")
    k.validate(params)


__all__ = ["CheckKind", "ParamError", "check_kinds", "validate_params"]
