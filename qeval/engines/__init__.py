"""Engines: what loads a tier's artifact and runs it (interface in :mod:`qeval.engines.base`).

Registered by name: every module of this package that defines ``ENGINE`` (an engine class
with ``name``, ``formats``, ``capabilities`` and ``open``) is an engine, so adding one is
adding its module. A recipe picks one per tier with ``engine:``; each tier method has a
default (:attr:`qeval.tiers.base.TierMethod.default_engine`). The modules are imported on
the first lookup (they import numpy, nothing heavy: torch and llama_cpp load when an
engine opens a model).
"""
from __future__ import annotations

from typing import Any

from ..plugins import one_each, registered

_REGISTRY: dict[str, Any] | None = None


def _registry() -> dict[str, Any]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = one_each(((m, cls.name, cls) for m, cls in registered(__name__, __path__, "ENGINE")), "engine")
    return _REGISTRY


def engine_names() -> tuple[str, ...]:
    """Names of the registered engines, sorted."""
    return tuple(sorted(_registry()))


def get_engine(name: str) -> Any:
    """The engine class registered as ``name``.

    Raises:
        KeyError: no such engine (the message lists the known ones).
    """
    try:
        return _registry()[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r} (known: {', '.join(engine_names())})") from None


def engines_for_format(fmt: str) -> tuple[str, ...]:
    """Names of the engines whose ``open`` takes artifact format ``fmt``, sorted."""
    return tuple(n for n in engine_names() if fmt in get_engine(n).formats)
