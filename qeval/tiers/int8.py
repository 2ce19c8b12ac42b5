"""INT8 weight-only tier (W8A16) on the transformers engine.

``backend: torchao`` (default) quantizes every ``nn.Linear`` of the decoder with torchao's
``Int8WeightOnlyConfig`` (per output channel, symmetric; the tied ``lm_head``/embedding
stays in the source dtype) through transformers' ``TorchAoConfig``. transformers 5 saves
torchao tensors to safetensors (``flatten_tensor_state_dict``: the inner ``qdata``,
``scale`` and ``zero_point`` tensors plus JSON metadata torchao checks against a list of
allowed classes), so the artifact holds no pickle and loads with ``from_pretrained``.

``backend: bitsandbytes`` uses ``BitsAndBytesConfig(load_in_8bit=True)`` (LLM.int8());
it needs the ``bitsandbytes`` package and a device its build supports.

The helpers at the top (parameter count and quantizable layers from the source config,
stored bytes of quantized layers) are shared with :mod:`qeval.tiers.gptq`.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import Field

from ..engines import get_engine
from ..engines.hf import HFEngine, load_hf_model, tensor_storage_bytes
from ..errors import QevalInputError
from ..paths import cache_root
from ..weight_formats import PerRow
from .base import HfTierSpec, TierContext, TierMethod

# ---- shared helpers (also used by gptq.py) ------------------------------------------------

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def lib_version(name: str) -> str | None:
    """Installed version of distribution ``name`` or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def meta_model(source_path: str, trust_remote_code: bool = False) -> Any:
    """The source architecture built on the meta device from its config: names, shapes and
    tied weights without reading any weight."""
    import torch  # start-up time: torch loads only in stage processes
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up time: transformers loads only in stage processes

    cfg = AutoConfig.from_pretrained(source_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)


def source_parameter_count(source_path: str, trust_remote_code: bool = False) -> int:
    """Logical parameter count of the source model (tied weights once)."""
    m = meta_model(source_path, trust_remote_code)
    return sum(p.numel() for p in m.parameters())  # parameters() yields a tied Parameter once


def decoder_linear_shapes(source_path: str, trust_remote_code: bool = False) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of the ``nn.Linear`` layers the
    quantizers convert (every Linear except the output head), from a meta-device model.

    Cached in ``$QEVAL_CACHE/validate/linear-shapes-<key>.json`` (key: the checkpoint's
    ``config.json`` bytes and the transformers and torch versions), so ``qeval validate``
    does not import torch and transformers (seconds) to learn what it learned before; never
    cached with ``trust_remote_code`` (the model's own code may change under the same config)."""
    cache = None if trust_remote_code else _shapes_cache_file(source_path)
    if cache is not None:
        try:
            return {k: (int(v[0]), int(v[1])) for k, v in json.loads(cache.read_text()).items()}
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            pass
    import torch  # start-up time: torch loads only in stage processes

    m = meta_model(source_path, trust_remote_code)
    out_emb = m.get_output_embeddings()
    shapes = {n: (mod.in_features, mod.out_features) for n, mod in m.named_modules()
              if isinstance(mod, torch.nn.Linear) and mod is not out_emb}
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(shapes))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only cache: built again next time
    return shapes


def _shapes_cache_file(source_path: str) -> Path | None:
    """:func:`decoder_linear_shapes`' cache file, None when the config cannot be read."""
    try:
        cfg = (Path(source_path) / "config.json").read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(cfg + f"|{lib_version('transformers')}|{lib_version('torch')}".encode()).hexdigest()[:16]
    return cache_root() / "validate" / f"linear-shapes-{key}.json"



def stored_bytes(model: Any) -> int:
    """Stored bytes of a model's persistent state (what its checkpoint holds): packed
    integer data, scales and zeros as stored, each storage once (tied weights once)."""
    return tensor_storage_bytes(list(model.state_dict().values()))


def layer_tensors(mod: Any) -> list[Any]:
    """A quantized layer's stored tensors: its own state_dict (packed weight, scales,
    zeros, g_idx, bitsandbytes' SCB), bias left out."""
    return [t for k, t in mod.state_dict(keep_vars=True).items()
            if k != "bias" and hasattr(t, "shape")]


def check_no_pickle(folder: Path) -> None:
    """Refuse an artifact that contains pickle-based weight files."""
    bad = [p.name for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    if bad:
        raise RuntimeError(f"artifact would contain pickle files {bad}; only safetensors are allowed")


def quant_summary(model: Any, params: int, layers: Iterable[tuple[Any, int]], group_size: Any) -> dict:
    """The ``quant_info`` dict: ``layers`` yields ``(stored tensors of one quantized layer,
    logical weight count)``."""
    stored = stored_bytes(model)
    q_bytes = q_weights = 0
    for tensors, n in layers:
        q_bytes += tensor_storage_bytes(tensors)
        q_weights += n
    return {"stored_bytes": stored, "parameters": params, "bits_per_weight": 8 * stored / params,
            "bits_per_weight_quantized": (8 * q_bytes / q_weights) if q_weights else None,
            "quantized_layers_bytes": q_bytes, "quantized_layers_weights": q_weights,
            "group_size": group_size}


# ---- INT8 ---------------------------------------------------------------------------------

# torchao 0.18 Int8Tensor's weight-only linear (quantize_/workflows/int8/int8_tensor.py) runs
# ``x @ qdata.t().to(x.dtype)`` and scales the result: uncompiled, each call writes a full
# bf16 copy of the weight and reads it again, so decode moves more bytes than bf16 does;
# torch.compile (decode: static) fuses the conversion into the matmul.
EAGER_INT8_NOTE = ("eager torchao int8: each call converts the whole int8 weight to bf16 before the matmul "
                   "(no torch.compile), so decode is slower than bf16; use decode: static (auto on CUDA)")

def _is_packed(t: Any) -> bool:
    """True for a weight held as a tensor subclass (torchao) or a bitsandbytes Int8Params."""
    if t is None:
        return False
    data = getattr(t, "data", t)
    return type(data).__name__ not in ("Tensor", "Parameter") or type(t).__name__ == "Int8Params"


class Int8Tier(HfTierSpec):
    """INT8 weight-only (W8A16). ``backend``: torchao ``Int8WeightOnlyConfig`` or bitsandbytes."""
    method: Literal["int8"]
    backend: Literal["torchao", "bitsandbytes"] = Field("torchao", description="torchao Int8WeightOnlyConfig, or "
                                                        "bitsandbytes LLM.int8() (a device its build supports)")


class Int8Method(TierMethod):
    """INT8 weight-only through torchao (default) or bitsandbytes."""
    method = "int8"
    # weight-only Linear swaps: the attention code is transformers' own; run on full-attention
    # models by the tests, not yet on windowed ones
    structures = {"full": "runs", "sliding": "untested", "hybrid": "untested", "experts": "untested",
                  "recurrent": "untested"}
    spec = Int8Tier
    bytes_per_parameter = 1.1  # one byte per weight plus scales and the source-dtype embeddings
    has_dequantized = True

    def backend_label(self, spec: Any, ctx: TierContext | None = None) -> str:
        return "torchao-int8-weight-only" if spec.backend == "torchao" else "bitsandbytes-llm.int8"

    def _libs(self, spec: Any) -> dict:
        libs = {"transformers": lib_version("transformers")}
        libs["torchao" if spec.backend == "torchao" else "bitsandbytes"] = \
            lib_version("torchao" if spec.backend == "torchao" else "bitsandbytes")
        return libs

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        return {"method": self.method, "source_sha256": ctx.source_sha256, "dtype": ctx.dtype,
                "bits": 8, "scheme": ("weight-only, per output channel, symmetric" if spec.backend == "torchao"
                                      else "LLM.int8(): int8 rows, fp16 outlier columns above 6.0"),
                "backend": spec.backend, "library": self._libs(spec)}

    def check(self, spec: Any, ctx: TierContext) -> dict:
        pkg = "torchao" if spec.backend == "torchao" else "bitsandbytes"
        if lib_version(pkg) is None:
            raise QevalInputError(f"backend {spec.backend} needs the '{pkg}' package, which is not installed "
                                  f"(pip install {pkg})", field=f"tiers.{spec.name}.backend")
        return {}

    def prepare_runtime(self, spec: Any, ctx: TierContext, artifact: Path | None = None) -> dict:
        """The transformers runtime, then torchao (or bitsandbytes) imported."""
        info = super().prepare_runtime(spec, ctx, artifact)
        if get_engine(self.engine_name(spec)).capabilities.memory_counter == "server":
            return info  # served from another process: its libraries run there, not here
        if spec.backend == "torchao":  # optional dependencies (extra 'quant'): imported here only
            import torchao  # optional: the qeval[quant] extra
            from torchao.quantization import Int8WeightOnlyConfig  # optional, as torchao: the tensor subclasses it loads  # noqa: F401
            info["libraries"].append(f"torchao {torchao.__version__}")
        else:
            import bitsandbytes  # optional: the qeval[quant] extra
            info["libraries"].append(f"bitsandbytes {bitsandbytes.__version__}")
        return info

    def _quant_config(self, spec: Any, ctx: TierContext | None = None) -> Any:
        """The transformers quantization config of ``spec`` (``ctx``: the device it runs on,
        for methods whose kernel depends on it, as FP8's)."""
        if spec.backend == "torchao":
            from torchao.quantization import Int8WeightOnlyConfig  # optional: the qeval[quant] extra
            from transformers import TorchAoConfig  # start-up time: transformers loads only in stage processes
            return TorchAoConfig(Int8WeightOnlyConfig(version=2))
        from transformers import BitsAndBytesConfig  # start-up time: transformers loads only in stage processes
        return BitsAndBytesConfig(load_in_8bit=True)

    def prepare(self, spec: Any, ctx: TierContext, out_dir: Path) -> dict:
        t0 = time.time()
        try:
            model = load_hf_model(ctx.source_path, ctx.device, ctx.dtype, trust_remote_code=ctx.trust_remote_code,
                                  quantization_config=self._quant_config(spec, ctx))
        except Exception as e:
            if spec.backend == "bitsandbytes":
                raise RuntimeError(f"bitsandbytes 8-bit quantization failed on {ctx.device}: "
                                   f"{e.__class__.__name__}: {str(e)[:300]} (use backend: torchao)") from e
            raise
        n_q = sum(1 for m in model.modules() if _is_packed(getattr(m, "weight", None)) and hasattr(m, "in_features"))
        if n_q == 0:
            raise RuntimeError(f"{spec.backend} quantized no Linear layer of the model")
        quant_s = time.time() - t0
        model.save_pretrained(out_dir)  # safetensors (torchao tensors flattened, JSON metadata)
        check_no_pickle(out_dir)
        return {"quant_seconds": quant_s, "group_size": None, "backend": self.backend_label(spec, ctx),
                "quantized_layers": n_q, "library": self._libs(spec)}

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> PerRow:
        """torchao: int8 codes, fp32 scale + int8 zero per row (``Int8Tensor``, 5 bytes a
        row); bitsandbytes: int8 codes, fp32 ``SCB`` per row. Decoder Linears only."""
        if spec.backend == "bitsandbytes":
            return PerRow(label="int8-bnb", row_bytes=4, dtype=dtype, detail="bitsandbytes LLM.int8(): fp32 SCB per row")
        return PerRow(label="int8", row_bytes=5, dtype=dtype)

    def open_engine(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any:
        """The artifact on the tier's engine (:meth:`TierMethod.open_engine`); eager torchao
        int8 on CUDA says why it is slow (``decode_note``)."""
        engine = super().open_engine(spec, ctx, artifact)
        if ctx.device == "cuda" and engine.decode_mode == "eager" and spec.backend == "torchao":
            engine.decode_note = EAGER_INT8_NOTE
        return engine

    def load_dequantized(self, spec: Any, ctx: TierContext, artifact: Path | None) -> HFEngine:
        """The artifact with every int8 weight dequantized back to a dense ``ctx.dtype``
        tensor (the int8 values times their scales), so quality runs on plain matmuls."""
        import torch  # start-up time: torch loads only in stage processes

        if artifact is None:
            raise ValueError("int8 needs its artifact")
        model = load_hf_model(str(artifact), "cpu", ctx.dtype, trust_remote_code=ctx.trust_remote_code)
        dtype = getattr(torch, ctx.dtype)
        packed = [(n, m) for n, m in model.named_modules()
                  if hasattr(m, "in_features") and getattr(m, "weight", None) is not None and _is_packed(m.weight)]
        for name, mod in packed:  # a plain Linear in place of each quantized one
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(_dequantize(mod, mod.weight).to(dtype))
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias.to(dtype))
            lin.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, lin)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if ctx.device == "cuda":
            model = model.to("cuda")
        return HFEngine(model, ctx.device, kv_cache=spec.kv_cache, kv_residual=getattr(spec, "kv_residual_tokens", None),
                        backend=f"torch-{ctx.dtype} (dequantized {self.backend_label(spec, ctx)})")

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        model = engine.model
        params = source_parameter_count(ctx.source_path, ctx.trust_remote_code)
        layers = [(layer_tensors(mod), int(mod.in_features) * int(mod.out_features))
                  for mod in model.modules()
                  if hasattr(mod, "in_features") and getattr(mod, "weight", None) is not None and _is_packed(mod.weight)]
        info = quant_summary(model, params, layers, None)
        info["backend"] = engine.backend
        return info


def _dequantize(mod: Any, w: Any) -> Any:
    """Dense weight of a torchao tensor subclass or a bitsandbytes Int8Params."""
    if hasattr(w, "dequantize") and type(w).__name__ != "Int8Params":
        return w.dequantize()
    scb = getattr(w, "SCB", None)
    if scb is None:  # bitsandbytes moves SCB to the module state on the first forward
        scb = getattr(getattr(mod, "state", None), "SCB", None)
    if scb is not None:  # LLM.int8(): w = int8 * row_absmax / 127
        return w.data.float() * (scb.float().unsqueeze(1) / 127.0)
    raise RuntimeError(f"cannot dequantize weight of type {type(w).__name__}")


METHODS = {"int8": Int8Method()}
