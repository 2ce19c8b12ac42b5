"""FP8 weight-only tier (W8A16 with float8 weights) on the transformers engine.

Every ``nn.Linear`` of the decoder is quantized with torchao's ``Float8WeightOnlyConfig``
(``float8_e4m3fn`` values, one float32 scale per output channel; the tied
``lm_head``/embedding stays in the source dtype) through transformers' ``TorchAoConfig``,
and saved to safetensors like the INT8 tier (:mod:`qeval.tiers.int8`, whose saving,
storage accounting and dequantized loading it shares).

What runs: torchao's float8 weight-only linear dequantizes the weight and multiplies in
the activation dtype (``torch.matmul(x, w.dequantize())`` in torchao's ``Float8Tensor``)
on every device, so the tier saves weight memory, not compute; on CPU, where there is no
float8 matmul, that is the only path. The row's backend says so.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from ..weight_formats import FP8_WEIGHT_ONLY, PerRow
from .base import TierContext
from .int8 import Int8Method, Int8Tier


class Fp8Tier(Int8Tier):
    """FP8 weight-only (float8_e4m3fn weights, per output channel) through torchao."""
    method: Literal["fp8"]  # type: ignore[assignment]
    backend: Literal["torchao"] = Field("torchao", description="torchao Float8WeightOnlyConfig")  # type: ignore[assignment]


class Fp8Method(Int8Method):
    """FP8 weight-only through torchao's ``Float8WeightOnlyConfig``."""
    method = "fp8"
    spec = Fp8Tier
    bytes_per_parameter = 1.1  # one byte per weight, a float32 scale per row, source-dtype embeddings

    def backend_label(self, spec: Any, ctx: TierContext | None = None) -> str:
        return "torchao-float8-weight-only (weights dequantized per matmul)"

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        return {**super().key_fields(spec, ctx), "scheme": "float8_e4m3fn weight-only, per output channel"}

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> PerRow:
        """float8_e4m3 codes and one fp32 scale per output row (torchao ``Float8Tensor``);
        every other tensor in ``dtype``."""
        return replace(FP8_WEIGHT_ONLY, dtype=dtype)

    def _quant_config(self, spec: Any) -> Any:
        from torchao.quantization import Float8WeightOnlyConfig  # optional: the qeval[quant] extra
        from transformers import TorchAoConfig  # start-up time: transformers loads only in stage processes
        return TorchAoConfig(Float8WeightOnlyConfig())


METHODS = {"fp8": Fp8Method()}
