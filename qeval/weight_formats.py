"""Bytes each weight format stores for a model, and bytes per KV-cache element, from the
model's tensor shapes alone (:mod:`qeval.model_config`): the estimates ``qeval plan``
starts from before anything is measured.

Every format counts what its files hold, tensor by tensor (the tier modules say which
format a tier builds, :meth:`qeval.tiers.base.TierMethod.weight_format`):

* :class:`Dense` (BF16/F16/F32): every tensor at the dtype's bytes.
* :class:`FlatBits`: ``params x bits / 8`` for every tensor, no scales. Not a real
  format: the rule of thumb ("4-bit = 0.5 bytes per parameter") kept to compare against.
* :class:`PerRow` (INT8 weight-only, FP8 weight-only): the decoder Linears at
  ``weight_bits`` plus a scale (and zero) per output row; embedding, LM head, norms and biases
  stay in the source dtype (transformers' torchao and bitsandbytes integrations leave
  the output embedding out by default).
* :class:`GroupWise` (GPTQ, AWQ ``bits`` / ``group_size``): per decoder Linear the packed
  codes ``rows x cols x bits / 8``, one scale (source dtype, 2 bytes) and one packed
  ``bits``-bit zero per group of ``group_size`` inputs per row, and for GPTQ the ``g_idx``
  (one int32 per input column), as gptqmodel saves them (``qweight``, ``scales``,
  ``qzeros``, ``g_idx``); embedding, LM head, norms and biases in the source dtype
  (gptqmodel's default ``lm_head=False``).
* :class:`GgufMix` (llama.cpp file types such as Q4_K_M): the tensor type llama.cpp picks
  for each tensor (:func:`gguf_tensor_types`, a port of ``llama_tensor_get_type`` in
  llama.cpp ``src/llama-quant.cpp``), at that type's block size and bytes per block from
  the PyPI ``gguf`` package (``GGML_QUANT_SIZES``); 1-D tensors (norms, biases) are F32 as
  ``convert_hf_to_gguf.py`` writes them.

KV cache (:func:`kv_format`): the engine's default cache holds K and V in 16 bits; the
``int8`` cache of both engines holds 8.5 bits per element: llama.cpp ``q8_0`` (blocks of
32 int8 values and one F16 scale: 34 bytes / 32) and transformers' HQQ ``QuantizedCache``
as qeval configures it (8-bit codes, groups of 64 with a 16-bit scale and zero:
8 + 32/64 bits). HQQ also keeps the newest ``residual_length`` (128 by default) tokens of each
sequence unquantized; that per-sequence constant is not counted here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import QevalInputError
from .model_config import ModelShape, TensorShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "f16": 2, "f32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a checkpoint dtype name (2 for unknown names, the BF16 default)."""
    return DTYPE_BYTES.get(str(dtype).lower().replace("torch.", ""), 2)


@dataclass
class WeightEstimate:
    """Estimated storage of one weight format for one model.

    Attributes:
        format: the format's short name (``bf16``, ``int8``, ``w4g128-gptq``, ``Q4_K_M``...).
        bytes: stored weight bytes (tensor data; file metadata such as a GGUF's tokenizer
            is not counted).
        params: parameters of the model (tied weights once).
        quantized_params, quantized_bytes: the same over the tensors the format quantizes.
        formula: how ``bytes`` was counted, one line.
        tensor_types: for GGUF, ``{type name: tensor count}``.
        fallback_tensors: for GGUF, tensors moved off the mix's type because their rows
            are not a multiple of its block (llama.cpp's "falling back" warnings).
    """
    format: str
    bytes: int
    params: int
    quantized_params: int
    quantized_bytes: int
    formula: str
    tensor_types: dict[str, int] | None = None
    fallback_tensors: int | None = None

    @property
    def bits_per_weight(self) -> float:
        """``8 x bytes / params`` over the whole model (bits)."""
        return 8 * self.bytes / self.params if self.params else float("nan")

    @property
    def bits_per_weight_quantized(self) -> float | None:
        """``8 x quantized_bytes / quantized_params`` (bits), None when nothing is quantized."""
        return 8 * self.quantized_bytes / self.quantized_params if self.quantized_params else None

    def to_dict(self) -> dict:
        return {"format": self.format, "bytes": self.bytes, "params": self.params,
                "quantized_params": self.quantized_params, "quantized_bytes": self.quantized_bytes,
                "bits_per_weight": self.bits_per_weight, "bits_per_weight_quantized": self.bits_per_weight_quantized,
                "formula": self.formula, "tensor_types": self.tensor_types, "fallback_tensors": self.fallback_tensors}


class WeightFormat:
    """A way of storing the weights. Subclasses implement :meth:`estimate`."""
    name: str = ""

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        """Stored bytes for ``shape``.

        Raises:
            QevalInputError: the format cannot hold this model (e.g. a group size that does
                not divide a layer's inputs).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class Dense(WeightFormat):
    """Every tensor at ``dtype`` (``bfloat16``: 2 bytes per parameter)."""
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:  # type: ignore[override]
        return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(self.dtype, self.dtype)

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        b = dtype_bytes(self.dtype)
        n = shape.params
        return WeightEstimate(self.name, n * b, n, 0, 0, f"{n:,} parameters x {b} bytes ({self.dtype})")


@dataclass(frozen=True)
class FlatBits(WeightFormat):
    """Rule of thumb: every parameter at ``bits``, no scales (``bits=4``: 0.5 bytes each)."""
    bits: float = 4

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.bits:g}bit-flat"

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        n = shape.params
        b = int(round(n * self.bits / 8))
        return WeightEstimate(self.name, b, n, n, b, f"{n:,} parameters x {self.bits / 8:g} bytes "
                              f"(rule of thumb: no scales, no unquantized tensors; no tier builds this)")


def _dense_rest(shape: ModelShape, quantized: list[TensorShape], dtype: str) -> int:
    b = dtype_bytes(dtype)
    q = {id(t) for t in quantized}
    return sum(t.numel * b for t in shape.tensors if id(t) not in q)


@dataclass(frozen=True)
class PerRow(WeightFormat):
    """Decoder Linears at ``weight_bits`` with ``row_bytes`` of scale (and zero) per output
    row; every other tensor in ``dtype``.

    torchao ``Int8WeightOnlyConfig(version=2)`` (``Int8Tensor``: ``qdata`` int8, ``scale``
    fp32 and ``zero_point`` int8 per row, checked with torchao 0.18) -> ``row_bytes=5``;
    bitsandbytes LLM.int8(): int8 rows and an fp32 ``SCB`` per row -> 4; torchao
    ``Float8WeightOnlyConfig`` (``Float8Tensor``: float8_e4m3 ``qdata``, fp32 ``scale`` per
    row) -> 4.
    """
    label: str = "int8"
    weight_bits: int = 8
    row_bytes: int = 5
    dtype: str = "bfloat16"
    detail: str = "torchao: fp32 scale + int8 zero per row"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        lin = [t for t in shape.tensors if t.is_decoder_linear]
        qb = sum(t.rows * t.cols * self.weight_bits // 8 + t.rows * self.row_bytes for t in lin)  # type: ignore[operator]
        qn = sum(t.numel for t in lin)
        rest = _dense_rest(shape, lin, self.dtype)
        return WeightEstimate(self.name, qb + rest, shape.params, qn, qb,
                              f"decoder Linears {self.weight_bits} bits + {self.row_bytes} bytes per row "
                              f"({self.detail}); embedding, LM head, norms, biases {self.dtype}")


@dataclass(frozen=True)
class GroupWise(WeightFormat):
    """GPTQ/AWQ: ``bits``-bit codes with a scale and a ``bits``-bit zero per ``group_size``
    inputs of each row (``group_size=-1``: one group per row), plus GPTQ's ``g_idx``."""
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    scale_bytes: int = 2
    g_idx: bool = True
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:  # type: ignore[override]
        g = "ch" if self.group_size == -1 else str(self.group_size)
        return f"{self.method}-w{self.bits}g{g}"

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        lin = [t for t in shape.tensors if t.is_decoder_linear]
        qb = 0
        for t in lin:
            cols = int(t.cols)  # type: ignore[arg-type]
            if self.group_size != -1 and cols % self.group_size:
                raise QevalInputError(f"group size {self.group_size} does not divide the input features {cols} "
                                      f"of layer {t.layer} {t.role}", field="group_size")
            groups = 1 if self.group_size == -1 else cols // self.group_size
            packed_row = math.ceil(t.rows * self.bits / 32) * 4  # qzeros: int32 words per group
            qb += (t.rows * cols * self.bits) // 8 + groups * t.rows * self.scale_bytes + groups * packed_row
            if self.g_idx:
                qb += cols * 4
        qn = sum(t.numel for t in lin)
        rest = _dense_rest(shape, lin, self.dtype)
        g = "per row" if self.group_size == -1 else f"per {self.group_size} inputs"
        return WeightEstimate(self.name, qb + rest, shape.params, qn, qb,
                              f"decoder Linears {self.bits} bits + {self.scale_bytes}-byte scale and "
                              f"{self.bits}-bit zero {g}" + (" + int32 g_idx" if self.g_idx else "")
                              + f"; embedding, LM head, norms, biases {self.dtype}")


# ---- GGUF: llama.cpp's per-tensor type choice ----------------------------------------------

#: File type -> default tensor type, from llama.cpp ``llama_ftype_get_default_type``.
GGUF_DEFAULT_TYPE = {
    "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
}
#: llama.cpp's fallback when a tensor's row length is not a multiple of the type's block
#: (``tensor_type_fallback``; Q2_K/Q3_K go to Q4_0 in current llama.cpp, IQ4_NL in older
#: releases: both 4.5 bits per weight).
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
#: model types whose 80-layer size llama.cpp calls ``LLM_TYPE_70B`` (its attn_v rule).
_70B_ARCHS = ("llama", "qwen2")


def _quant_size(t: str) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of GGML type ``t``, from the PyPI ``gguf``
    package (function-level import: start-up time, ``gguf`` loads its reader and writer)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # start-up time: see above
    return GGML_QUANT_SIZES[GGMLQuantizationType[t]]


def _blck(t: str) -> int:
    return _quant_size(t)[0]


def _type_bytes(t: str, n: int) -> int:
    block, size = _quant_size(t)
    return n // block * size


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp: i_layer < n/8 || i_layer >= 7n/8 || (i_layer - n/8) % 3 == 2 (C++ integer division)
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _mix(ftype: str, t: TensorShape, shape: ModelShape, i_v: int) -> str:
    """llama.cpp's choice before the shape fallback, for a non-MoE, non-Falcon decoder."""
    default = GGUF_DEFAULT_TYPE[ftype]
    n = shape.layers
    if t.role == "lm_head" or (t.role == "embed" and shape.tied):
        if int(t.cols) % _blck(default):  # type: ignore[arg-type]
            return "Q8_0"
        return default if default == "Q8_0" else "Q6_K"
    if t.role == "embed":
        return default
    new = default
    if t.role == "v":
        if ftype == "Q2_K":
            new = "Q4_K" if shape.heads // shape.kv_heads >= 4 else "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i_v < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_v, n):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i_v < 4:
            new = "Q5_K"
        if n == 80 and shape.model_type in _70B_ARCHS and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
    elif t.role == "down":
        i = int(t.layer)  # type: ignore[arg-type]
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i < n // 16 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype == "Q4_K_M" and _use_more_bits(i, n):
            new = "Q6_K"
        elif ftype == "Q5_K_M" and _use_more_bits(i, n):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < n // 8:
            new = "Q5_K"
    elif t.role == "o":
        new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, default)
    return new


def gguf_tensor_types(shape: ModelShape, ftype: str) -> list[tuple[TensorShape, str, bool]]:
    """The GGML type llama.cpp's quantizer gives each tensor for file type ``ftype``
    (llama.cpp ``src/llama-quant.cpp``, ``llama_tensor_get_type``, without an importance
    matrix or overrides): the file type's default type, moved up on the LM head (Q6_K),
    on ``attn_v`` and ``ffn_down`` of some layers (``use_more_bits``) and on the layers
    the mix names; then, when a row is not a multiple of the type's block, the fallback
    type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0; F16 when even 32
    does not divide it). 1-D tensors are F32. Returns ``(tensor, type, fell back)`` per tensor.

    Raises:
        QevalInputError: a file type without a size model here (the IQ types, TQ types).
    """
    ft = str(ftype).strip().upper()
    if ft not in GGUF_DEFAULT_TYPE:
        raise QevalInputError(f"no size model for llama.cpp type {ftype!r} (modelled: "
                              f"{', '.join(GGUF_DEFAULT_TYPE)}); measure it", field="type")
    out: list[tuple[TensorShape, str, bool]] = []
    i_v = 0
    for t in shape.tensors:
        if not t.is_matrix:
            out.append((t, "F32", False))
            continue
        if ft in ("F16", "BF16"):
            out.append((t, ft, False))
            continue
        new = _mix(ft, t, shape, i_v)
        if t.role == "v":
            i_v += 1
        fell = bool(int(t.cols) % _blck(new))  # type: ignore[arg-type]
        if fell:
            new = _FALLBACK.get(new, new)
            if int(t.cols) % _blck(new):  # type: ignore[arg-type]
                new = "F16"
        out.append((t, new, fell))
    return out


@dataclass(frozen=True)
class GgufMix(WeightFormat):
    """A llama.cpp GGUF file type (``Q4_K_M`` ...): each tensor at the type llama.cpp picks."""
    ftype: str = "Q4_K_M"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.ftype.upper()

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        types = gguf_tensor_types(shape, self.ftype)
        total = qb = qn = fallbacks = 0
        hist: dict[str, int] = {}
        for t, ty, fell in types:
            fallbacks += fell
            b = _type_bytes(ty, t.numel)
            total += b
            hist[ty] = hist.get(ty, 0) + 1
            if t.is_matrix:
                qb += b
                qn += t.numel
        mix = ", ".join(f"{k} x{v}" for k, v in sorted(hist.items()))
        fb = f"; {fallbacks} tensors fall back (rows not a multiple of the block)" if fallbacks else ""
        return WeightEstimate(self.name, total, shape.params, qn, qb,
                              f"llama.cpp {self.name} type per tensor ({mix}){fb}; block sizes from gguf", hist,
                              fallbacks)


# ---- KV cache ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVFormat:
    """Bits per cached K or V element, and what holds them."""
    kind: str          # "model" or "int8"
    bits: float
    label: str

    def bytes_per_token(self, shape: ModelShape) -> float:
        """``2 x layers x kv_heads x head_dim x bits / 8`` (bytes)."""
        return shape.kv_elements_per_token * self.bits / 8


def kv_format(engine: str, kv_cache: str, dtype: str = "bfloat16") -> KVFormat:
    """The KV cache format of ``engine`` (``hf`` or ``llamacpp``) for a tier's ``kv_cache``
    (see the module doc).

    Raises:
        QevalInputError: an unknown ``kv_cache``.
    """
    if kv_cache == "int8":
        if engine == "llamacpp":
            return KVFormat("int8", 8.5, "q8_0 K/V: 32 int8 + F16 scale per block")
        return KVFormat("int8", 8.5, "HQQ int8, group 64, 16-bit scale + zero")
    if kv_cache == "model":
        if engine == "llamacpp":
            return KVFormat("model", 16, "F16 K/V")
        return KVFormat("model", 8 * dtype_bytes(dtype), f"{dtype} K/V")
    raise QevalInputError(f"unknown kv_cache {kv_cache!r} (model or int8)", field="kv_cache")


@dataclass(frozen=True)
class PairFormat(WeightFormat):
    """Two models held together (a speculative target and its draft): the sum of their
    formats' stored bytes; ``params`` and the quantized counts are both models' together."""
    target: WeightFormat
    draft: WeightFormat

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.target.name}+{self.draft.name}"

    def estimate(self, shape: ModelShape) -> WeightEstimate:
        a, b = self.target.estimate(shape), self.draft.estimate(shape)
        return WeightEstimate(self.name, a.bytes + b.bytes, a.params + b.params, a.quantized_params + b.quantized_params,
                              a.quantized_bytes + b.quantized_bytes,
                              f"target {a.bytes:,} + draft {b.bytes:,} bytes (both models are held)")


@dataclass(frozen=True)
class PairKV(KVFormat):
    """Two KV caches kept token for token (a speculative target's and its draft's): bytes per
    token are the sum of both (each model caches every token of the sequence)."""
    draft_bits: float = 16

    def bytes_per_token(self, shape: ModelShape) -> float:
        """``2 x layers x kv_heads x head_dim x (target bits + draft bits) / 8`` (bytes)."""
        return shape.kv_elements_per_token * (self.bits + self.draft_bits) / 8


#: Formats ``qeval plan`` estimates when no recipe names the tiers (the FP8 row has no tier
#: method yet: torchao ``Float8WeightOnlyConfig``, e4m3 codes + fp32 scale per row).
FP8_WEIGHT_ONLY = PerRow(label="fp8", weight_bits=8, row_bytes=4, detail="float8_e4m3, fp32 scale per row")

__all__ = ["DTYPE_BYTES", "Dense", "FlatBits", "FP8_WEIGHT_ONLY", "GGUF_DEFAULT_TYPE", "GgufMix", "GroupWise",
           "KVFormat", "PairFormat", "PairKV", "PerRow", "WeightEstimate", "WeightFormat", "dtype_bytes", "gguf_tensor_types", "kv_format"]
