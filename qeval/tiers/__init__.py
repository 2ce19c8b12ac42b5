"""Tier methods: one module per way of serving the model. :func:`get_method` returns the
implementation for a recipe ``method`` or None when it is not built yet."""
from __future__ import annotations

import importlib

from .base import TierMethod

_MODULES = {"bf16": "bf16", "int8": "int8", "gptq": "gptq", "awq": "gptq", "gguf": "gguf"}


def get_method(method: str) -> TierMethod | None:
    """The :class:`TierMethod` for ``method``, or None when its module is not built yet."""
    mod = _MODULES.get(method)
    if mod is None:
        return None
    try:
        m = importlib.import_module(f"{__name__}.{mod}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith(f"{__name__}.{mod}"):
            return None
        raise
    return m.METHODS[method]
