"""The BF16 reference tier: the source checkpoint served as it is."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engines.hf import HFEngine, load_hf_model, model_weight_bytes
from .base import TierContext, TierMethod


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
    """Unquantized weights in the source dtype on the transformers engine."""
    method = "bf16"
    needs_artifact = False

    def load(self, spec: Any, ctx: TierContext, artifact: Path | None) -> HFEngine:
        model = load_hf_model(ctx.source_path, ctx.device, ctx.dtype, trust_remote_code=ctx.trust_remote_code)
        return HFEngine(model, ctx.device, kv_cache=spec.kv_cache, backend=f"torch-{ctx.dtype}",
                        decode=getattr(spec, "decode", "auto"))

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        stored = model_weight_bytes(engine.model)
        n = count_parameters(engine.model)
        return {"stored_bytes": stored, "parameters": n, "bits_per_weight": 8 * stored / n,
                "bits_per_weight_quantized": None, "group_size": None}


METHODS = {"bf16": Bf16Method()}
