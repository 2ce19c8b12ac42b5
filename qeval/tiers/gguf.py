"""GGUF tiers on llama.cpp (``method: gguf``, ``type: Q4_K_M`` or any llama.cpp file type).

The artifact is built from the same BF16 source checkpoint as every other tier:

1. the source is converted to a 16-bit GGUF with llama.cpp's own ``convert_hf_to_gguf.py``
   (fetched once for the installed llama-cpp-python, :mod:`qeval.engines.gguf_convert`):
   BF16 for a BF16 source (lossless), F16 or F32 for those sources;
2. ``llama_model_quantize`` turns it into ``type``; the 16-bit intermediate is deleted.

llama.cpp falls back from K-quants on tensors whose rows are not a multiple of 256 (on
SmolLM2, hidden size 576, 180 of 272 tensors), so a "Q4_K_M" file can hold far more than
4.5 bits per weight. ``quant_info`` reports the effective figures from the file: stored
bytes, bits per weight, the tensor-type histogram and the fallback count (from
llama.cpp's per-tensor fallback warnings, kept in ``quantize.json``).

The KV cache (``kv_cache: int8`` = ``q8_0`` K and V) and flash attention are engine
settings, not part of the artifact: a Q4_K_M tier with and without the int8 cache share
one GGUF file. ``device: cuda`` needs a llama-cpp-python build with GPU offload: a CPU
build stops the tier in :meth:`GgufMethod.check` with the rebuild command (never a GGUF
"cuda" row measured on the CPU).
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from ..engines.gguf_convert import convert_hf_to_gguf, llama_cpp_version
from ..engines.llamacpp import (ftype_names, gguf_file, gguf_tensor_stats, NEEDS_IMATRIX, quantize_gguf,
                                require_gpu_offload)
from ..errors import QevalInputError
from ..measure.memory import hwm_bytes, rss_bytes
from ..weight_formats import GgufMix
from .base import TierContext, TierMethod, TierSpec

_INTERMEDIATE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
_SIDECAR = "quantize.json"


def _ftypes() -> dict[str, int]:
    try:
        return ftype_names()
    except ImportError:
        raise QevalInputError("llama-cpp-python is not installed: GGUF tiers need it "
                              "(pip install 'qeval[gguf]'; `make` builds it for this CPU)") from None


class GgufTier(TierSpec):
    """A llama.cpp GGUF file quantized to ``type`` (any llama.cpp ftype name, e.g. Q4_K_M)."""
    method: Literal["gguf"]
    type: str = Field("Q4_K_M", min_length=1, max_length=64, description="llama.cpp file type (llama-quantize's "
                      "name: Q4_K_M, Q8_0, Q5_K_S, F16, ...)")
    engine_fields: ClassVar[tuple[str, ...]] = TierSpec.engine_fields + ("flash_attn",)
    flash_attn: bool | None = Field(None, description="None: on for every GGUF tier on CUDA; on the CPU on only "
                                    "when kv_cache is int8 (llama.cpp needs it there)")


class GgufMethod(TierMethod):
    """A llama.cpp GGUF file of ``spec.type``, served by any engine that opens GGUF files
    (default: llama.cpp)."""
    builder_modules = ("qeval.engines.gguf_convert", "qeval.engines.llamacpp")  # convert, quantize_gguf
    method = "gguf"
    # llama.cpp's converter and kernels: full attention tested (tests/test_llamacpp.py); SWA
    # models convert where the converter registers the architecture (checked at validate)
    structures = {"full": "runs", "sliding": "untested", "hybrid": "untested", "experts": "untested",
                  "recurrent": "untested"}
    spec = GgufTier
    transient_dtype_copies = 1.0  # the 16-bit intermediate GGUF, deleted once quantized
    artifact_format = "gguf"
    default_engine = "llamacpp"

    def artifact_bytes_per_parameter(self, spec: Any) -> float:
        """Approximate bytes per parameter of the llama.cpp file type: F32 4, F16/BF16 2, else
        the type's bit count plus one bit of scales (Q4_K_M ~0.63, Q8_0 ~1.13)."""
        t = str(spec.type).upper()
        if t == "F32":
            return 4.0
        if t in ("F16", "BF16"):
            return 2.0
        digits = [c for c in t if c.isdigit()]
        return (int(digits[0]) + 1) / 8 if digits else 1.0

    def capability(self, spec: Any, structure: Any) -> tuple[str, str]:
        """:meth:`TierMethod.capability`, and llama.cpp's converter must know the model's
        architecture (:func:`qeval.engines.gguf_convert.converter_architectures`, read from the
        converter's own ``ModelBase.register`` lines; skipped while it is not fetched)."""
        verdict, text = super().capability(spec, structure)
        if verdict == "refused" or not structure.architectures:
            return verdict, text
        from ..engines.gguf_convert import converter_architectures  # start-up time: reads files only when asked
        known = converter_architectures()
        if known and not set(structure.architectures) & known:
            return "refused", (f"llama.cpp's HF-to-GGUF converter registers no {', '.join(structure.architectures)} "
                               f"(of {len(known)} architectures): this model cannot become a GGUF file here")
        return verdict, text

    def check_at_validate(self, checkpoint: Path | None) -> bool:
        """The type name is checked against the installed llama.cpp (any machine)."""
        try:
            import llama_cpp  # optional: the qeval[gguf] extra; noqa: F401 - optional: the type names come from the installed llama.cpp
        except ImportError:
            return False
        return True

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        return {"method": self.method, "source_sha256": ctx.source_sha256, "type": spec.type.upper(),
                "llama_cpp_python": llama_cpp_version(), "intermediate": _INTERMEDIATE.get(ctx.dtype, "f32")}

    def check(self, spec: Any, ctx: TierContext) -> dict:
        """Resolve ``type`` to a llama.cpp file type.

        Raises:
            QevalInputError: unknown type (field ``tiers.<name>.type``, with the valid
                names), a type that needs an importance matrix, or ``kv_cache: int8`` with
                ``flash_attn: false`` (field ``tiers.<name>.flash_attn``).
            TierUnavailable: ``device: cuda`` with a llama-cpp-python build without GPU
                offload (before anything is quantized or measured).
        """
        names = _ftypes()
        if ctx.device == "cuda":
            require_gpu_offload(f"GGUF tier {spec.name}")
        t = str(spec.type).strip().upper()
        if t not in names:
            raise QevalInputError(f"unknown llama.cpp type {spec.type!r}; valid: {', '.join(names)}",
                                  field=f"tiers.{spec.name}.type")
        if t in NEEDS_IMATRIX:
            raise QevalInputError(f"type {t} needs an importance matrix, which qeval does not compute; "
                                  f"pick another type (e.g. Q2_K, IQ3_S, Q4_K_M)", field=f"tiers.{spec.name}.type")
        if spec.kv_cache == "int8" and spec.flash_attn is False:
            raise QevalInputError("kv_cache int8 (q8_0 K and V) needs flash attention in llama.cpp; "
                                  "set flash_attn to true or leave it out", field=f"tiers.{spec.name}.flash_attn")
        return {"type": t, "ftype": names[t]}

    def prepare(self, spec: Any, ctx: TierContext, out_dir: Path) -> dict:

        t = str(spec.type).strip().upper()
        outtype = _INTERMEDIATE.get(ctx.dtype, "f32")
        base = rss_bytes() or 0
        t0 = time.time()
        mid = out_dir / f"source-{outtype}.gguf.tmp"
        final = out_dir / f"model-{t}.gguf"
        try:
            conv = convert_hf_to_gguf(ctx.source_path, mid, outtype, threads=ctx.threads, log=ctx.log)
            ctx.log(f"converted to {outtype} GGUF in {conv['seconds']:.1f} s; quantizing to {t}")
            if t == outtype.upper():
                mid.rename(final)
                q = {"seconds": 0.0, "fallback_tensors": 0, "fallbacks": {}, "fallback_names": []}
            else:
                q = quantize_gguf(mid, final, t, threads=ctx.threads)
        finally:
            mid.unlink(missing_ok=True)
        ctx.log(f"quantized to {t} in {q['seconds']:.1f} s ({q['fallback_tensors']} tensors fell back)")
        child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        own = (hwm_bytes() or 0) - base
        sidecar = {"type": t, "intermediate": outtype, "converter": conv["converter"],
                   "convert_seconds": conv["seconds"], "quantize_seconds": q["seconds"],
                   "fallback_tensors": q["fallback_tensors"], "fallbacks": q["fallbacks"],
                   "fallback_names": q["fallback_names"]}
        (out_dir / _SIDECAR).write_text(json.dumps(sidecar, indent=1) + "\n")
        st = gguf_tensor_stats(final)
        info = {k: v for k, v in sidecar.items() if k != "fallback_names"}
        info.update({k: st[k] for k in ("stored_bytes", "parameters", "bits_per_weight", "bits_per_weight_quantized",
                                        "tensor_types", "non_kquant_matrices")})
        info.update({"quant_seconds": time.time() - t0, "quant_peak_bytes": max(child_peak, own),
                     "convert_peak_bytes": child_peak, "group_size": None, "backend": "llama.cpp"})
        return info

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> GgufMix:
        """The llama.cpp file type ``spec.type`` (each tensor at the type llama.cpp picks)."""
        return GgufMix(str(spec.type).strip().upper())

    def stored_info(self, spec: Any, ctx: TierContext, artifact: Path | None) -> dict:
        """From the GGUF file, as :meth:`quant_info` (it reads the file, not the engine)."""
        return self.quant_info(spec, ctx, artifact, None)

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        """Effective storage of the GGUF file: ``stored_bytes`` (tensor data), ``parameters``,
        ``bits_per_weight`` (all tensors), ``bits_per_weight_quantized`` (2-D weights),
        ``fallback_tensors`` (tensors llama.cpp moved off the intended K-quant type),
        ``fallbacks`` (``"q4_K->q5_0": n``), ``tensor_types`` histogram."""
        st = gguf_tensor_stats(gguf_file(artifact))
        out = {k: st[k] for k in ("stored_bytes", "parameters", "bits_per_weight", "bits_per_weight_quantized",
                                  "tensor_types", "non_kquant_matrices", "file_bytes")}
        side = Path(artifact) / _SIDECAR if artifact else None
        if side is not None and side.is_file():
            s = json.loads(side.read_text())
            out["fallback_tensors"] = s.get("fallback_tensors")
            out["fallbacks"] = s.get("fallbacks")
        else:  # no record of the quantizer's warnings: 2-D tensors outside the K-quant family
            out["fallback_tensors"] = st["non_kquant_matrices"]
        out["type"] = str(spec.type).upper()
        out["group_size"] = None
        return out


METHODS = {"gguf": GgufMethod()}
