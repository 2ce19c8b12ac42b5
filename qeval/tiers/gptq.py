"""GPTQ and AWQ weight-only tiers (W4A16 by default) through gptqmodel, on the
transformers engine.

Both quantize every ``nn.Linear`` of the decoder blocks (not the output head) with the
recipe's calibration set (``calibration.samples`` texts cut to ``calibration.seq_len``
tokens of the source tokenizer) and save a gptqmodel checkpoint (safetensors:
``qweight``/``qzeros`` packed int32, ``scales`` in the source dtype, ``g_idx`` for GPTQ;
``quantize_config.json``). The artifact is loaded again with ``GPTQModel.load``, which
picks the fastest kernel for the device (on CPU the ATen ``_weight_int4pack_mm_for_cpu``
kernel; ``engine.backend`` names the class that ran).

Notes from trials on a 2-core CPU machine with gptqmodel 7.6:
- gptqmodel's loader asks for 2 CPU workers: ``GPTQMODEL_CPU_WORKERS`` must be at least
  2 or it fails ("requests 2 workers but parent 'cpu' only has 1"); set here when unset.
- AWQ quantization on CPU needs ``backend=AWQ_TORCH`` ("AWQ: CUDA is not available").
- The int4pack CPU kernel needs each layer's in_features divisible by the group size
  (group 128 on a 576-wide model quantizes but cannot generate): :meth:`check` refuses
  such a group size before any work, or picks one with ``group_size: auto``.
- AWQ needs output features it can batch and pack (:func:`check_awq_out_features`): its
  clip search asserts out_features % 64 == 0 on every clipped layer (a tiny llama's 32-wide
  v_proj fails there), and its GEMM packing needs multiples of 8. gptqmodel's worker
  threads then call ``os._exit(1)``; :meth:`check` refuses such a model before any work.
- Quantization offloads finished layers to disk; the folder is a temporary sibling of the
  artifact, deleted afterwards (gptqmodel's default is a model-sized folder in /tmp).
  gptqmodel's own quantization log (``./logs/<method>_log_*.log`` in the current
  directory) goes there too.
- GPTQ packs its int32 words with a C++ extension that gptqmodel compiles on first use
  (``pack_block_cpu``: 31 to 48 s on 2 cores, once per cache) or, with
  ``GPTQMODEL_DISABLE_PACK_EXT=1``, in its own vectorized torch path, bit-identical
  (checked on a 1536x576 group-64 layer: equal ``qweight`` and ``qzeros``) at about 0.13 s
  per million weights on this project's CPUs. :func:`pack_extension_choice` compiles the
  extension only when that pays.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import Field, field_validator

from ..engines import get_engine
from ..engines.bf16_matmul import float32_linear_calls, resolve_bf16_matmul
from ..engines.hf import HFEngine
from ..errors import QevalInputError, TierUnavailable
from ..paths import torch_extensions_dir
from ..weight_formats import GroupWise
from .base import HfTierSpec, TierContext, TierMethod
from .int8 import (check_no_pickle, decoder_linear_shapes, layer_tensors, lib_version, quant_summary,
                   source_parameter_count)

# Group sizes gptqmodel's kernels accept (TorchLinear: -1 and powers of two 16..1024; the
# CPU int4pack and most GPU kernels: 16..128).
KERNEL_GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
AUTO_MAX_GROUP = 128

# AWQ's constraints on out_features in gptqmodel 7.6 (read in its source; importing gptqmodel
# to ask takes ~25 s, too slow for `qeval validate`; tests/test_tiers_quant.py checks these
# against the installed gptqmodel):
# - looper/awq_processor.py, AWQProcessor._compute_best_clip: output channels are searched in
#   batches of 256 when out_features divides by 256, else 64, under
#   ``assert org_w_shape[0] % oc_batch_size == 0``; _search_best_clip skips layers whose name
#   (inside the decoder layer) contains one of ``avoid_clipping``.
# - nn_modules/qlinear/torch_awq.py, AwqTorchLinear (the CPU quantization backend, AWQ_TORCH):
#   SUPPORTS_OUT_FEATURES_DIVISIBLE_BY = [8] (the GEMM format packs 8 int4 values per int32
#   along the output features); every layer.
AWQ_CLIP_OUT_MULTIPLE = 64
AWQ_CLIP_SKIPPED = ("q_", "k_", "query", "key", "Wqkv")
AWQ_KERNEL_OUT_MULTIPLE = 8


def _setup_env() -> None:
    """Environment gptqmodel reads at import time (see the module notes)."""
    if "GPTQMODEL_CPU_WORKERS" not in os.environ and (os.cpu_count() or 1) < 3:
        os.environ["GPTQMODEL_CPU_WORKERS"] = "2"  # its default, (cores + 1) // 2, is 1 here
    if "GPTQMODEL_TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["GPTQMODEL_TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir())
    # gptqmodel's tokenizer helper (tokenicer) points HF_HOME at /tmp when it is unset
    os.environ.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))


# gptqmodel's torch packing path, seconds per weight (measured: 0.114 s for a 1536x576
# layer on a 2-core EPYC), and what compiling its C++ packer costs once (31 s is gptqmodel's
# own estimate, jit_compile_baselines.py; 48 s measured cold on 2 cores)
TORCH_PACK_S_PER_WEIGHT = 0.13e-6
PACK_EXT_COMPILE_S = 40.0


def pack_extension_choice(n_weights: int, ext_dir: Path, env: dict | None = None) -> tuple[bool, str]:
    """Whether GPTQ packs with gptqmodel's compiled ``pack_block_cpu`` extension, and why.

    Args:
        n_weights: weights of the Linear layers to quantize (sum of in x out).
        ext_dir: gptqmodel's extension folder (``GPTQMODEL_TORCH_EXTENSIONS_DIR``).
        env: the environment to read (``os.environ`` when None).

    Returns:
        ``(use_extension, reason)``: the extension when the user forces it either way
        (``GPTQMODEL_DISABLE_PACK_EXT`` / ``GPTQMODEL_FORCE_PACK_EXT``), when it is already
        compiled under ``ext_dir``, or when the torch path would take longer than compiling
        it (:data:`TORCH_PACK_S_PER_WEIGHT` x ``n_weights`` > :data:`PACK_EXT_COMPILE_S`:
        above about 300 M weights). Both paths write the same words.
    """
    env = os.environ if env is None else env
    if env.get("GPTQMODEL_DISABLE_PACK_EXT") or env.get("GPTQMODEL_FORCE_PACK_EXT"):
        forced = bool(env.get("GPTQMODEL_FORCE_PACK_EXT"))
        return forced, "set in the environment"
    if any(ext_dir.glob("pack_block_cpu/*/*.so")):
        return True, "already compiled"
    torch_s = TORCH_PACK_S_PER_WEIGHT * n_weights
    if torch_s > PACK_EXT_COMPILE_S:
        return True, f"the torch path would take about {torch_s:.0f} s, compiling about {PACK_EXT_COMPILE_S:.0f} s"
    return False, f"the torch path takes about {torch_s:.0f} s, compiling the extension about {PACK_EXT_COMPILE_S:.0f} s"


def _import_gptqmodel() -> Any:
    _setup_env()
    try:
        import gptqmodel  # optional: the qeval[quant] extra
    except ImportError as e:
        raise RuntimeError("gptq/awq tiers need gptqmodel (pip install 'gptqmodel>=7.6,<7.7'; "
                           f"see pyproject extra 'quant'): {e}") from e
    return gptqmodel


def _redirect_quant_logs(folder: Path) -> None:
    """gptqmodel writes a per-processor log to ``./logs/`` of the current directory (the
    repository when run from there); point it at ``folder`` (deleted after quantizing;
    the per-layer losses stay in the artifact's ``quant_log.csv``)."""
    try:
        from gptqmodel.looper import loop_processor  # optional: the qeval[quant] extra
    except ImportError:
        return
    if hasattr(loop_processor, "_PROJECT_LOG_DIR"):
        loop_processor._PROJECT_LOG_DIR = folder


def working_group_sizes(in_features: dict[str, int]) -> list[int]:
    """Kernel group sizes dividing every layer's in_features (largest last)."""
    return [g for g in KERNEL_GROUP_SIZES if all(n % g == 0 for n in in_features.values())]


def resolve_group_size(spec: Any, in_features: dict[str, int]) -> int:
    """The group size to quantize with: ``spec.group_size`` checked against every quantized
    layer, or for ``auto`` the largest power of two not above 128 dividing them all (-1,
    one group per output channel, when none does).

    Raises:
        QevalInputError: a group size that does not divide a layer's in_features, or one
            no gptqmodel kernel runs; the message names the layer and the sizes that work.
    """
    field = f"tiers.{spec.name}.group_size"
    ok = working_group_sizes(in_features)
    if spec.group_size == "auto":
        fits = [g for g in ok if g <= AUTO_MAX_GROUP]
        return fits[-1] if fits else -1
    g = int(spec.group_size)
    works = ", ".join(str(x) for x in ok) or "none"
    if g == -1:
        return g
    if g not in KERNEL_GROUP_SIZES:
        raise QevalInputError(f"group size {g} is not one gptqmodel's kernels run; sizes that work for this "
                              f"model: {works}, -1 (per channel) or 'auto'", field=field)
    for name, n in in_features.items():
        if n % g:
            sizes = sorted({k for k, v in in_features.items() if v == n})
            where = name if len(sizes) == 1 else f"{name} (and {len(sizes) - 1} more layers)"
            raise QevalInputError(f"group size {g} does not divide the input features {n} of layer {where}; "
                                  f"sizes that work for this model: {works}, -1 (per channel) or 'auto'",
                                  field=field)
    return g


def awq_clipped(name: str) -> bool:
    """Whether gptqmodel's AWQ clip search runs on the Linear ``name`` (a full module name;
    the search sees it relative to its decoder layer, ``self_attn.v_proj``)."""
    inner = re.sub(r"^.*?\.\d+\.", "", name, count=1)
    return not any(s in inner for s in AWQ_CLIP_SKIPPED)


def check_awq_out_features(shapes: dict[str, tuple[int, int]], field: str) -> None:
    """Refuse a model whose Linear output features gptqmodel's AWQ cannot take (see
    :data:`AWQ_CLIP_OUT_MULTIPLE`, :data:`AWQ_KERNEL_OUT_MULTIPLE` for the source).

    Args:
        shapes: ``{module name: (in_features, out_features)}`` of the quantized Linears.
        field: the recipe field the error names (``tiers.<name>.method``).

    Raises:
        QevalInputError: naming the first layer that fails, its output features, how many
            layers share the problem, and the output sizes that work.
    """
    def first_bad(need: int, layers: list[str]) -> tuple[str, int, int] | None:
        bad = [n for n in layers if shapes[n][1] % need]
        return (bad[0], shapes[bad[0]][1], len(bad)) if bad else None

    names = list(shapes)
    clipped = [n for n in names if awq_clipped(n)]
    for need, layers, what in (
            (AWQ_KERNEL_OUT_MULTIPLE, names, "AWQ's GEMM packing (gptqmodel AwqTorchLinear)"),
            (AWQ_CLIP_OUT_MULTIPLE, clipped, "AWQ's clip search (gptqmodel AWQProcessor._compute_best_clip, "
                                             "batches of 64 or 256 output channels)")):
        hit = first_bad(need, layers)
        if hit:
            name, n, count = hit
            more = f" (and {count - 1} more layer{'s' if count > 2 else ''})" if count > 1 else ""
            raise QevalInputError(
                f"{what} needs each layer's output features to be a multiple of {need}; layer {name}{more} has "
                f"{n}; sizes that work: multiples of {need} ({', '.join(str(need * k) for k in (1, 2, 4))}, ...). "
                f"This model cannot be AWQ-quantized by gptqmodel; a gptq tier has no such limit", field=field)


def _quant_layers(model: Any) -> list[Any]:
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear  # optional: the qeval[quant] extra
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)]


class W4Tier(HfTierSpec):
    """Fields GPTQ and AWQ tiers share: ``bits``, ``group_size`` (weights per scale; -1 per
    output channel; ``auto`` picks one the model's layers allow), ``sym``, ``desc_act``."""
    bits: Literal[2, 3, 4, 8] = Field(4, description="bits per weight")
    group_size: Annotated[int, Field(le=1 << 20)] | Literal["auto"] = Field(
        128, description="weights per scale and zero along the input features; -1: one group per output channel; "
                         "auto: the largest power of two up to 128 dividing every layer's input features")
    sym: bool = Field(True, description="symmetric quantization (no zero point)")
    desc_act: bool = Field(False, description="GPTQ only: quantize columns in order of decreasing activation "
                           "(act-order)")

    @field_validator("group_size")
    @classmethod
    def _pos_group(cls, v: Any) -> Any:
        if isinstance(v, int) and v <= 0 and v != -1:
            raise ValueError("group_size must be a positive integer, -1 (per-channel) or 'auto'")
        return v


class GptqTier(W4Tier):
    """GPTQ W4A16 through gptqmodel (Frantar et al. 2022, arXiv:2210.17323)."""
    method: Literal["gptq"]


class AwqTier(W4Tier):
    """AWQ W4A16 through gptqmodel (Lin et al. 2023, arXiv:2306.00978).

    ``calibration_matmul``: how the calibration forwards of AWQ's scale search compute
    their bfloat16 linear layers (:class:`qeval.engines.bf16_matmul.float32_linear_calls`).
    ``auto``: float32 matmuls on a CPU without a fast bfloat16 path (the search is 20 block
    forwards per layer, which torch's CPU bfloat16 GEMM runs about 6 times slower), else
    native. The algorithm (grid, duo scaling, clipping search) is gptqmodel's, unchanged.

    ``clip_search``: AWQ's second search (the paper's weight clipping, section 3.3), on by
    default. In gptqmodel 7.6 it is the costly part on CPU: for every linear but q/k it
    tries 20 clipping ratios over 512 sampled calibration tokens per output-channel batch
    (``AWQProcessor._compute_best_clip``, ``n_grid=20``, ``n_sample_token=512``, neither
    settable), as element-wise tensors, not matmuls: about 30 minutes for SmolLM2-135M on
    2 cores whatever the calibration size. Off keeps the activation-aware scale search and
    skips clipping (AutoAWQ's ``apply_clip=False``; gptqmodel has the same attribute,
    ``AWQProcessor.apply_clip``, but no option that sets it, so qeval sets it on the
    processor it builds: :func:`awq_clip_search`)."""
    method: Literal["awq"]
    clip_search: bool = Field(True, description="AWQ's weight-clipping search after the scale search (the "
                              "paper's method; off skips it: much faster on CPU, usually a little less accurate)")
    calibration_matmul: Literal["auto", "native", "float32"] = Field(
        "auto", description="how AWQ's calibration forwards compute bfloat16 linear layers: native, or float32 "
                            "matmuls over the bfloat16 weights; auto: float32 on a CPU without a fast bfloat16 path")


def per_layer_rotary(model: Any) -> bool:
    """Whether ``model``'s rotary embedding is computed per layer type (its ``forward`` takes
    a required argument beyond ``x`` and ``position_ids``: Gemma 3's ``layer_type``, local
    RoPE for sliding-window layers and global RoPE for full-attention ones), read from the
    module's signature, never the model's name. Such a model's decoder layers receive their
    ``position_embeddings`` from the model's forward, and the one-argument recomputation in
    gptqmodel 7.6's AWQ scale search (``AWQProcessor._iter_module_forward_outputs``:
    ``rotary(x, pos)``) raises ``TypeError: ... missing 1 required positional argument:
    'layer_type'``."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None) or getattr(getattr(inner, "language_model", None), "rotary_emb", None)
    if rotary is None:
        return False
    try:
        params = list(inspect.signature(rotary.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return len(required) > 2


def keep_captured_position_embeddings(gm: Any, log: Callable[[str], None]) -> bool:
    """Fix at a named point for gptqmodel 7.6's AWQ on models with per-layer-type RoPE
    (:func:`per_layer_rotary`): set the model definition's own switch
    ``awq_preserve_explicit_position_embeddings`` (``models/base.py``; gptqmodel sets it for
    Cohere Compass only) on this instance, so the scale search reuses the
    ``position_embeddings`` captured from the model's forward instead of recomputing them with
    one argument. The switch is upstream's; what it cannot fix is said in the log: gptqmodel
    captures layer 0's inputs (its attention mask and RoPE) and replays them to every layer,
    so on a hybrid model the full-attention layers calibrate with layer 0's kind of mask and
    RoPE (GPTQ and AWQ alike). Returns whether the switch was set."""
    if not per_layer_rotary(gm.model):
        return False
    gm.awq_preserve_explicit_position_embeddings = True
    log("rotary embedding per layer type: AWQ keeps the captured position_embeddings "
        "(gptqmodel's awq_preserve_explicit_position_embeddings); every layer calibrates with layer 0's "
        "captured attention mask and RoPE (gptqmodel replays one layer's inputs)")
    return True


@contextlib.contextmanager
def awq_clip_search(enabled: bool):
    """Within the block, gptqmodel's AWQ processors run the clipping search or not.

    gptqmodel 7.6 sets ``AWQProcessor.apply_clip = True`` in its ``__init__`` and exposes
    no setting (read in ``gptqmodel/looper/awq_processor.py``; ``QuantizeConfig`` has none,
    unlike AutoAWQ's ``quantize(apply_clip=...)``), so the constructor is wrapped for the
    block's length and restored after. ``enabled=True`` changes nothing.

    Raises:
        RuntimeError: gptqmodel's ``AWQProcessor`` has no ``apply_clip`` attribute any more
            (a gptqmodel release changed it: the option would silently do nothing).
    """
    if enabled:
        yield
        return
    from gptqmodel.looper import awq_processor  # optional: the qeval[quant] extra

    cls = awq_processor.AWQProcessor
    if "apply_clip" not in cls.__init__.__code__.co_names and not hasattr(cls, "apply_clip"):
        raise RuntimeError("gptqmodel's AWQProcessor no longer has apply_clip: clip_search: false cannot be applied")
    original = cls.__init__

    def init(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.apply_clip = False

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


class _GptqModelMethod(TierMethod):
    """Shared by GPTQ and AWQ: both go through gptqmodel's quantize/save/load. The
    artifact is a gptqmodel checkpoint, which only gptqmodel's loader opens (into a
    transformers model on the ``hf`` engine)."""
    quant_method = "gptq"
    # gptqmodel replays layer 0's captured inputs to every layer; per-layer-type RoPE is kept
    # (keep_captured_position_embeddings): a hybrid tiny gemma3 round-trips in
    # tests/test_tiers_quant.py
    structures = {"full": "runs", "sliding": "untested", "hybrid": "runs", "experts": "untested",
                  "recurrent": "untested"}
    builder_modules = ("qeval.tiers.int8", "qeval.calibration", "qeval.engines.bf16_matmul")  # shared helpers
    artifact_format = "gptqmodel"
    bytes_per_parameter = 0.6  # packed 4-bit weights, scales and zeros, source-dtype embeddings
    transient_dtype_copies = 1.0  # gptqmodel's offload folder (finished layers), deleted after
    needs_calibration = True
    has_dequantized = True
    # side by side at one thread each, GPTQ and AWQ estimated 13 and 128 minutes where each
    # alone at two threads took about 2 and 9 (2-core machine, 2026-12-01: qeval.pipeline)
    prepare_alone = True

    def check_at_validate(self, checkpoint: Path | None) -> bool:
        return checkpoint is not None  # the group size is checked against the config's layers

    def loaders(self) -> dict:
        return {"hf": self._load_hf}

    # -- what identifies the artifact ---------------------------------------------------
    def _format(self) -> str:
        return "gptq" if self.quant_method == "gptq" else "gemm"

    def _quant_backend(self, device: str) -> str:
        """gptqmodel backend used while quantizing (name of its BACKEND enum)."""
        if self.quant_method == "awq" and device != "cuda":
            return "awq_torch"
        return "auto"

    def _calibration_matmul(self, spec: Any, ctx: TierContext) -> str:
        """``native`` or ``float32`` (:class:`AwqTier`); GPTQ: always ``native`` (one forward
        per layer, then float32 Hessian arithmetic: little to win)."""
        if self.quant_method != "awq":
            return "native"
        # a spec built outside the recipe (tests, plugins) may lack the field: AwqTier's default
        return resolve_bf16_matmul(getattr(spec, "calibration_matmul", "auto"), ctx.device, ctx.dtype)

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        return {"method": self.method, "source_sha256": ctx.source_sha256, "dtype": ctx.dtype,
                "bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym,
                "desc_act": spec.desc_act if self.quant_method == "gptq" else None,
                "format": self._format(), "quant_backend": self._quant_backend(ctx.device),
                "calibration": dict(ctx.calibration_fields),
                **({"calibration_matmul": "float32"} if self._calibration_matmul(spec, ctx) == "float32" else {}),
                **({"clip_search": False} if not getattr(spec, "clip_search", True) else {}),
                "library": {"gptqmodel": lib_version("gptqmodel"), "transformers": lib_version("transformers"),
                            "torch": lib_version("torch")}}

    # -- before any work ----------------------------------------------------------------
    def check(self, spec: Any, ctx: TierContext) -> dict:
        return {"group_size": self._checked_shapes(spec, ctx)[0]}

    def _checked_shapes(self, spec: Any, ctx: TierContext) -> tuple[int, dict[str, tuple[int, int]]]:
        """:meth:`check`'s work: the resolved group size and the decoder's Linear shapes
        (``{name: (in, out)}``, from one meta-device model). Raises as :meth:`check`."""
        if lib_version("gptqmodel") is None:
            raise QevalInputError("needs the 'gptqmodel' package, which is not installed "
                                  "(pip install 'gptqmodel>=7.6,<7.7')", field=f"tiers.{spec.name}.method")
        if self.quant_method == "awq" and spec.desc_act:
            raise QevalInputError("desc_act applies to GPTQ only; remove it from this AWQ tier",
                                  field=f"tiers.{spec.name}.desc_act")
        shapes = decoder_linear_shapes(ctx.source_path, ctx.trust_remote_code)
        if not shapes:
            raise QevalInputError("the model has no Linear layers to quantize", field=f"tiers.{spec.name}.method")
        group = resolve_group_size(spec, {n: i for n, (i, _) in shapes.items()})
        if self.quant_method == "awq":
            check_awq_out_features(shapes, field=f"tiers.{spec.name}.method")
        return group, shapes

    # -- build --------------------------------------------------------------------------
    def _calibration(self, ctx: TierContext) -> tuple[list[dict], int]:
        from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes

        if ctx.calibration is None:
            raise RuntimeError(f"{self.method} needs calibration text (TierContext.calibration is None)")
        texts = ctx.calibration()
        seq_len = int(ctx.calibration_fields.get("seq_len") or 512)
        tok = AutoTokenizer.from_pretrained(ctx.source_path, trust_remote_code=ctx.trust_remote_code)
        rows, n_tok = [], 0
        for t in texts:
            ids = tok(t, add_special_tokens=True, truncation=False)["input_ids"][:seq_len]
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
            n_tok += len(ids)
        return rows, n_tok

    def _quantize_config(self, spec: Any, group_size: int, offload: str) -> Any:
        from gptqmodel import QuantizeConfig  # optional: the qeval[quant] extra
        from gptqmodel.quantization import FORMAT, METHOD  # optional: the qeval[quant] extra

        kw: dict[str, Any] = {"bits": spec.bits, "group_size": group_size, "sym": spec.sym,
                              "offload_to_disk": True, "offload_to_disk_path": offload}
        if self.quant_method == "gptq":
            kw.update(desc_act=spec.desc_act, method=METHOD.GPTQ, format=FORMAT.GPTQ)
        else:
            kw.update(method=METHOD.AWQ, format=FORMAT.GEMM)
        return QuantizeConfig(**kw)

    def prepare(self, spec: Any, ctx: TierContext, out_dir: Path) -> dict:
        import torch  # start-up time: torch loads only in stage processes

        gptqmodel = _import_gptqmodel()
        from gptqmodel import BACKEND, GPTQModel  # optional: the qeval[quant] extra

        group, shapes = self._checked_shapes(spec, ctx)
        if self.quant_method == "gptq" and ctx.device == "cpu":
            n_weights = sum(i * o for i, o in shapes.values())
            use_ext, why = pack_extension_choice(n_weights, Path(os.environ["GPTQMODEL_TORCH_EXTENSIONS_DIR"]))
            if not use_ext:
                os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = "1"  # read by gptqmodel at pack time
            ctx.log(f"{self.method}: packing {n_weights / 1e6:.0f} M weights with "
                    f"{'the compiled extension' if use_ext else 'the torch path'} ({why})")
        calib, n_tok = self._calibration(ctx)
        offload = tempfile.mkdtemp(prefix=f".{out_dir.name}.offload-", dir=out_dir.parent)
        try:
            _redirect_quant_logs(Path(offload) / "logs")
            t0 = time.time()
            qc = self._quantize_config(spec, group, offload)
            gm = GPTQModel.load(ctx.source_path, qc, device=ctx.device, trust_remote_code=ctx.trust_remote_code,
                                dtype=getattr(torch, ctx.dtype))
            torch.set_num_threads(ctx.threads)  # gptqmodel may re-pin threads while loading
            per_layer_rope = keep_captured_position_embeddings(gm, lambda m: ctx.log(f"{self.method}: {m}"))
            matmul = self._calibration_matmul(spec, ctx)
            ctx.log(f"{self.method}: quantizing with {len(calib)} calibration rows ({n_tok} tokens), "
                    f"bits {spec.bits}, group {group}, calibration matmuls {matmul}")
            clip = bool(getattr(spec, "clip_search", True)) if self.quant_method == "awq" else True
            if not clip:
                ctx.log(f"{self.method}: clipping search off (clip_search: false)")
            with (float32_linear_calls() if matmul == "float32" else contextlib.nullcontext()), awq_clip_search(clip):
                gm.quantize(calib, batch_size=1, backend=BACKEND(self._quant_backend(ctx.device)))
            quant_s = time.time() - t0
            gm.save(str(out_dir))
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        check_no_pickle(out_dir)
        return {"quant_seconds": quant_s, "group_size": group, "bits": spec.bits,
                "backend": f"gptqmodel:{self._quant_backend(ctx.device)}",
                "calibration_rows": len(calib), "calibration_tokens": n_tok, "calibration_matmul": matmul,
                **({"clip_search": clip} if self.quant_method == "awq" else {}),
                **({"calibration_note": "per-layer-type RoPE: every layer calibrated with layer 0's captured "
                                        "attention mask and RoPE (gptqmodel replays one layer's inputs)"}
                   if per_layer_rope else {}),
                "library": {"gptqmodel": gptqmodel.__version__}}

    # -- runtime -------------------------------------------------------------------------
    def prepare_runtime(self, spec: Any, ctx: TierContext, artifact: Path | None = None) -> dict:
        """The transformers runtime, then gptqmodel and its quantized-linear kernel classes
        imported (several hundred MiB resident on CPU with gptqmodel 7.6: not the model's);
        on CUDA, gptqmodel's kernels built before the timed load (see :func:`cuda_kernels_ready`)."""
        kernels = (cuda_kernels_ready(self.method, self.quant_method, self._format(), spec, ctx, artifact)
                   if ctx.device == "cuda" else {})  # first: an unbuildable kernel stops the tier at once
        info = super().prepare_runtime(spec, ctx, artifact)
        if get_engine(self.engine_name(spec)).capabilities.memory_counter == "server":
            return info  # served from another process: gptqmodel runs there, not here
        gptqmodel = _import_gptqmodel()  # optional dependency (extra 'quant')
        import gptqmodel.nn_modules.qlinear  # optional (extra 'quant'): the kernel classes the loader picks from  # noqa: F401
        info["libraries"].append(f"gptqmodel {gptqmodel.__version__}")
        return {**info, **kernels}

    # -- load ---------------------------------------------------------------------------
    def _load_qmodel(self, ctx: TierContext, artifact: Path, device: str, backend: str = "auto") -> Any:
        import torch  # start-up time: torch loads only in stage processes

        _import_gptqmodel()
        from gptqmodel import BACKEND, GPTQModel  # optional: the qeval[quant] extra

        gm = GPTQModel.load(str(artifact), device=device, backend=BACKEND(backend),
                            trust_remote_code=ctx.trust_remote_code)
        torch.set_num_threads(ctx.threads)
        gm.model.eval()
        return gm

    def _load_hf(self, spec: Any, ctx: TierContext, artifact: Path | None) -> HFEngine:
        """gptqmodel's loader (the fastest kernel for the device) into the transformers engine."""
        if artifact is None:
            raise ValueError(f"{self.method} needs its artifact")
        gm = self._load_qmodel(ctx, artifact, ctx.device)
        kernels = sorted({type(m).__name__ for _, m in _quant_layers(gm.model)})
        if not kernels:
            raise RuntimeError(f"{artifact} loaded without any quantized layer")
        engine = HFEngine(gm.model, ctx.device, kv_cache=spec.kv_cache, backend="gptqmodel:" + "+".join(kernels),
                          decode=getattr(spec, "decode", "auto"), kv_residual=getattr(spec, "kv_residual_tokens", None))
        engine.qmodel = gm  # keep gptqmodel's wrapper alive with the model
        return engine

    def load_dequantized(self, spec: Any, ctx: TierContext, artifact: Path | None) -> HFEngine:
        """Dense transformers model whose Linear weights are the artifact's weights
        dequantized (scale * (q - zero), in ``ctx.dtype``). Loaded with gptqmodel's plain
        torch kernels on CPU, unpacked before any forward pass (the fused CPU kernels
        repack their buffers on first use)."""
        import torch  # start-up time: torch loads only in stage processes

        if artifact is None:
            raise ValueError(f"{self.method} needs its artifact")
        backend = "gptq_torch" if self.quant_method == "gptq" else "awq_torch"
        gm = self._load_qmodel(ctx, artifact, "cpu", backend)
        model = gm.model
        dtype = getattr(torch, ctx.dtype)
        for name, mod in _quant_layers(model):
            w = dequantize_layer(mod)[: mod.out_features, : mod.in_features]
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  device="cpu", dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(w.to(dtype))
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias.to(dtype))
            lin.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, lin)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if ctx.device == "cuda":
            model = model.to("cuda")
        model.eval()
        return HFEngine(model, ctx.device, kv_cache=spec.kv_cache, kv_residual=getattr(spec, "kv_residual_tokens", None),
                        backend=f"torch-{ctx.dtype} (dequantized {self.method})")

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> GroupWise:
        """gptqmodel's checkpoint layout for ``spec.bits`` and the group size this tier
        would use on ``shape`` (``auto`` resolved as :meth:`check` does); GPTQ stores a
        ``g_idx``, AWQ does not.

        Raises:
            QevalInputError: the group size does not fit the model's layers.
        """
        group = resolve_group_size(spec, shape.in_features())
        return GroupWise(method=self.method, bits=spec.bits, group_size=group, g_idx=self.method == "gptq",
                         dtype=dtype)

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:

        model = engine.model
        params = source_parameter_count(ctx.source_path, ctx.trust_remote_code)
        layers = [(layer_tensors(m), int(m.in_features) * int(m.out_features)) for _, m in _quant_layers(model)]
        group = None
        if artifact is not None and (artifact / "quantize_config.json").is_file():
            group = json.loads((artifact / "quantize_config.json").read_text()).get("group_size")
        info = quant_summary(model, params, layers, group)
        info.update(bits=spec.bits, backend=engine.backend, quantized_layers=len(layers))
        return info


def _nvcc() -> str | None:
    """The nvcc gptqmodel's JIT builds would use: on PATH, else ``$CUDA_HOME/bin/nvcc``."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(home) / "bin" / "nvcc" if home else None
    return str(cand) if cand is not None and cand.is_file() else None


def cuda_kernels_ready(method: str, quant_method: str, fmt: str, spec: Any, ctx: TierContext,
                       artifact: Path | None) -> dict:
    """Build (or find cached) the CUDA kernels gptqmodel will pick for this checkpoint,
    before the model's opening is timed (``open_seconds``).

    What gptqmodel 7.6 does at load (read in ``gptqmodel/utils/importer.py`` and the
    ``qlinear`` kernels): with ``backend=auto`` on CUDA it tries Swordfish and Machete
    (whose ``validate_once`` JIT-compiles them with nvcc, Machete after fetching CUTLASS
    from the network, and skips them when that fails), then Marlin, whose validation does
    *not* compile: its JIT build runs in ``post_init`` during the load, so a machine
    without nvcc (or without the CUDA headers) fails the load there, and with nvcc the
    build's minutes land in ``open_seconds``. Here the same selection runs first
    (``select_quant_linear``), and when Marlin is the pick its extension is built
    (``gptqmodel.extension.is_available``; a cached build loads without nvcc).

    Returns:
        ``{"kernel_build_seconds", "selected_kernel", "nvcc"}``.
    Raises:
        TierUnavailable: the picked kernel cannot be built here; the line names what to
            install (nvcc of the CUDA toolkit matching torch's CUDA version).
    """
    import torch  # start-up time: torch loads only in stage processes


    _import_gptqmodel()
    from gptqmodel import extension  # optional: the qeval[quant] extra
    from gptqmodel.quantization import FORMAT, METHOD  # optional: the qeval[quant] extra
    from gptqmodel.utils.backend import BACKEND  # optional: the qeval[quant] extra
    from gptqmodel.utils.importer import select_quant_linear  # optional: the qeval[quant] extra

    qc = {}
    if artifact is not None and (Path(artifact) / "quantize_config.json").is_file():
        qc = json.loads((Path(artifact) / "quantize_config.json").read_text())
    bits = int(qc.get("bits", spec.bits))
    group = int(qc.get("group_size", spec.group_size if isinstance(spec.group_size, int) else 128))
    desc_act = bool(qc.get("desc_act", getattr(spec, "desc_act", False)))
    sym = bool(qc.get("sym", spec.sym))
    dtype = getattr(torch, ctx.dtype)
    nvcc = _nvcc()
    t0 = time.time()
    try:
        cls = select_quant_linear(bits=bits, group_size=group, desc_act=desc_act, sym=sym, device="cuda",
                                  backend=BACKEND.AUTO, format=FORMAT(fmt), quant_method=METHOD(quant_method),
                                  pack_dtype=torch.int32)  # as gptqmodel's loader calls it
        picked = cls.__name__
    except Exception as e:  # noqa: BLE001 - no kernel at all: say so in one line
        raise TierUnavailable(f"{method} on cuda: gptqmodel found no CUDA kernel for bits {bits}, group {group} "
                              f"({e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if "Marlin" in picked:
        name = "marlin_bf16" if dtype == torch.bfloat16 else "marlin_fp16"
        if not extension.is_available(name):
            err = (extension.error(name) or "").strip().splitlines()
            why = err[0][:240] if err else "no message"
            need = ("no nvcc on PATH or in $CUDA_HOME/bin: install the CUDA toolkit (nvcc >= 12.8) matching "
                    f"torch's CUDA {torch.version.cuda}" if nvcc is None else
                    f"nvcc is {nvcc}: check that its version matches torch's CUDA {torch.version.cuda} and "
                    "that the CUDA headers are there (pip install 'gptqmodel[marlin-cuda12]')")
            raise TierUnavailable(f"{method} on cuda: gptqmodel compiles its Marlin kernel ({name}) on this "
                                  f"machine and the build failed ({why}); {need}")
    return {"kernel_build_seconds": time.time() - t0, "selected_kernel": picked, "nvcc": nvcc}


def dequantize_layer(mod: Any) -> Any:
    """Dense ``[out_features, in_features]`` float weight of a gptqmodel quantized layer,
    from gptqmodel's own unpacking (``dequantize_weight`` for GPTQ layouts,
    ``dequantize_gemm`` for AWQ GEMM)."""
    if hasattr(mod, "dequantize_weight"):
        return mod.dequantize_weight().T.float()
    if hasattr(mod, "qweight") and hasattr(mod, "qzeros") and hasattr(mod, "scales"):
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm  # optional: the qeval[quant] extra
        return dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, mod.bits, mod.group_size).T.float()
    raise RuntimeError(f"cannot dequantize {type(mod).__name__}")


class GptqMethod(_GptqModelMethod):
    """GPTQ (Frantar et al. 2022, arXiv:2210.17323) through gptqmodel."""
    method = "gptq"
    spec = GptqTier
    quant_method = "gptq"


class AwqMethod(_GptqModelMethod):
    """AWQ (Lin et al. 2023, arXiv:2306.00978) through gptqmodel."""
    method = "awq"
    spec = AwqTier
    quant_method = "awq"


METHODS = {"gptq": GptqMethod(), "awq": AwqMethod()}

__all__ = ["GptqMethod", "AwqMethod", "GptqTier", "AwqTier", "W4Tier", "METHODS", "resolve_group_size", "working_group_sizes",
           "dequantize_layer", "check_awq_out_features", "awq_clipped"]
