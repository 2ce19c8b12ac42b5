"""Tier methods: one module per way of serving the model, registered by name.

Every module of this package that defines ``METHODS`` (``{method name: TierMethod}``) adds
those methods; each method carries its recipe schema (``spec``), so the recipe's ``Tier``
union (:mod:`qeval.recipe`) and the disk estimate come from here. Adding a method is
adding its module. The modules import no heavy library at import time (torch,
transformers, gptqmodel and llama_cpp load inside the methods).
"""
from __future__ import annotations

from ..plugins import one_each, registered
from .base import TierMethod, TierSpec

_REGISTRY: dict[str, TierMethod] | None = None


def _registry() -> dict[str, TierMethod]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = one_each(((m, name, method) for m, methods in registered(__name__, __path__, "METHODS")
                              for name, method in methods.items()), "tier method")
    return _REGISTRY


def method_names() -> tuple[str, ...]:
    """Every registered method name, in module order."""
    return tuple(_registry())


def get_method(method: str) -> TierMethod | None:
    """The :class:`TierMethod` registered as ``method``, or None when there is none."""
    return _registry().get(method)


def tier_specs() -> tuple[type[TierSpec], ...]:
    """The recipe schema of every method (one class each, in :func:`method_names` order)."""
    return tuple(dict.fromkeys(m.spec for m in _registry().values()))


__all__ = ["TierMethod", "TierSpec", "get_method", "method_names", "tier_specs"]
