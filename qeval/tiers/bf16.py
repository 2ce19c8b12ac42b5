"""The BF16 reference tier: the source checkpoint served as it is."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..engines.hf import model_weight_bytes
from .base import HfTierSpec, TierContext, TierMethod


class Bf16Tier(HfTierSpec):
    """The unquantized reference tier (dtype from ``model.dtype``)."""
    method: Literal["bf16"]


def count_parameters(model: Any) -> int:
    """Number of distinct parameters (tied weights once)."""
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        n += p.numel()
    return n


class Bf16Method(TierMethod):
    """Unquantized weights in the source dtype: the source checkpoint folder, opened by any
    engine that takes a transformers checkpoint (default: transformers)."""
    method = "bf16"
    spec = Bf16Tier
    bytes_per_parameter = 0.0  # served from the source checkpoint: writes nothing
    needs_artifact = False
    # transformers runs the model's own code: sliding and hybrid caches are tested
    # (tests/test_sliding_window.py, tiny gemma3 and mistral)
    structures = {"full": "runs", "sliding": "runs", "hybrid": "runs", "experts": "untested", "recurrent": "untested"}

    def backend_label(self, spec: Any, ctx: TierContext) -> str:
        return f"torch-{ctx.dtype}"

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        stored = model_weight_bytes(engine.model)
        n = count_parameters(engine.model)
        return {"stored_bytes": stored, "parameters": n, "bits_per_weight": 8 * stored / n,
                "bits_per_weight_quantized": None, "group_size": None}


METHODS = {"bf16": Bf16Method()}
