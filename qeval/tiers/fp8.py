"""FP8 tier (float8 weights) on the transformers engine, in one of two modes chosen by the
GPU it runs on (:func:`fp8_mode`):

* ``dynamic`` on CUDA with compute capability >= 8.9 (Ada, Hopper and later: FP8 tensor
  cores): torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``:
  float8_e4m3fn weights with a scale per output channel, and each activation row scaled to
  float8 on the fly, so the matmul runs in FP8 (``torch._scaled_mm``). torchao itself
  requires SM 8.9+ for it (``is_sm_at_least_89`` in torchao.quantization.quant_api);
  ``PerRow`` is torchao's recommended granularity for LLM inference (README, "float8").
* ``weight-only`` everywhere else (CPU, CUDA below 8.9): ``Float8WeightOnlyConfig``
  (``float8_e4m3fn`` values, one float32 scale per output channel). torchao's float8
  weight-only linear dequantizes the weight and multiplies in the activation dtype
  (``torch.matmul(x, w.dequantize())`` in torchao's ``Float8Tensor``), so the tier saves
  weight memory, not compute; on CPU, where there is no float8 matmul, that is the only path.

The tied ``lm_head``/embedding stays in the source dtype; the artifact goes through
transformers' ``TorchAoConfig`` and is saved to safetensors like the INT8 tier
(:mod:`qeval.tiers.int8`, whose saving, storage accounting and dequantized loading it
shares). The mode is part of the artifact key and the row's backend says which ran.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from ..weight_formats import FP8_WEIGHT_ONLY, PerRow
from .base import TierContext
from .int8 import Int8Method, Int8Tier


#: the lowest CUDA compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0)
FP8_TENSOR_CORES = (8, 9)
FP8_MODES = ("dynamic", "weight-only")


def fp8_mode(device: str, capability: tuple[int, int] | None) -> str:
    """The FP8 tier's mode on ``device`` with CUDA compute ``capability`` (``(major,
    minor)``, None off CUDA): ``dynamic`` (float8 activations and weights on FP8 tensor
    cores) on CUDA at :data:`FP8_TENSOR_CORES` or above, ``weight-only`` (weights
    dequantized per matmul) elsewhere.

    Raises:
        ValueError: a capability that is not two integers.
    """
    if device != "cuda" or capability is None:
        return "weight-only"
    try:
        cap = (int(capability[0]), int(capability[1]))
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"compute capability {capability!r}: expected (major, minor)") from e
    return "dynamic" if cap >= FP8_TENSOR_CORES else "weight-only"


def device_capability(device: str) -> tuple[int, int] | None:
    """``torch.cuda.get_device_capability()`` of the device in use on CUDA, None elsewhere
    (torch is imported only on CUDA)."""
    if device != "cuda":
        return None
    import torch  # start-up time: torch loads only in stage processes
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


BACKEND_LABELS = {
    "dynamic": "torchao-float8-dynamic (float8 activations and weights, per-row scales, FP8 tensor cores)",
    "weight-only": "torchao-float8-weight-only (weights dequantized per matmul)",
}
SCHEMES = {
    "dynamic": "float8_e4m3fn weights and dynamic per-row activations, per output channel",
    "weight-only": "float8_e4m3fn weight-only, per output channel",
}


class Fp8Tier(Int8Tier):
    """FP8 (float8_e4m3fn weights, per output channel) through torchao: dynamic activation
    scaling on FP8 tensor cores (compute capability >= 8.9), weight-only elsewhere."""
    method: Literal["fp8"]  # type: ignore[assignment]
    backend: Literal["torchao"] = Field("torchao", description="torchao Float8DynamicActivationFloat8WeightConfig "  # type: ignore[assignment]
                                      "on compute capability >= 8.9, Float8WeightOnlyConfig elsewhere")


class Fp8Method(Int8Method):
    """FP8 through torchao: ``Float8DynamicActivationFloat8WeightConfig`` or
    ``Float8WeightOnlyConfig`` by :func:`fp8_mode`."""
    method = "fp8"
    # weight-only Linear swaps: the attention code is transformers' own; run on full-attention
    # models by the tests, not yet on windowed ones
    structures = {"full": "runs", "sliding": "untested", "hybrid": "untested", "experts": "untested",
                  "recurrent": "untested"}
    spec = Fp8Tier
    bytes_per_parameter = 1.1  # one byte per weight, a float32 scale per row, source-dtype embeddings

    def mode(self, ctx: TierContext | None) -> str:
        """:func:`fp8_mode` on ``ctx.device`` (``weight-only`` without a context)."""
        return fp8_mode(ctx.device, device_capability(ctx.device)) if ctx is not None else "weight-only"

    def backend_label(self, spec: Any, ctx: TierContext | None = None) -> str:
        return BACKEND_LABELS[self.mode(ctx)]

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        return {**super().key_fields(spec, ctx), "scheme": SCHEMES[self.mode(ctx)]}

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> PerRow:
        """float8_e4m3 codes and one fp32 scale per output row (torchao ``Float8Tensor``, in
        both modes); every other tensor in ``dtype``."""
        return replace(FP8_WEIGHT_ONLY, dtype=dtype)

    def _quant_config(self, spec: Any, ctx: TierContext | None = None) -> Any:
        from transformers import TorchAoConfig  # start-up time: transformers loads only in stage processes
        if self.mode(ctx) == "dynamic":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow  # optional: qeval[quant]
            return TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        from torchao.quantization import Float8WeightOnlyConfig  # optional: the qeval[quant] extra
        return TorchAoConfig(Float8WeightOnlyConfig())


METHODS = {"fp8": Fp8Method()}
