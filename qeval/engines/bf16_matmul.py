"""bfloat16 matmuls in float32 for the quality stages, on CPUs with no fast bfloat16 path.

Why: on a CPU without AVX512 (this project's AMD EPYC has AVX2 and FMA only) torch runs a
bfloat16 ``linear`` through its reference GEMM: 7.7 GFLOP/s against 50.7 in float32 on one
thread here (a 256x576 by 576x1536 product, measured 2026-12-01). A SmolLM2-135M forward
over 256 tokens took 9.15 s in native bfloat16 and 1.95 s with every linear layer computed
as below. The quality stages (noise floor, fidelity, free-running answers, long context)
are nearly all such matmuls, so they ran 4 to 5 times slower than they need to; speed,
memory and load are never computed this way (they measure the tier as served).

What ``float32`` does to a layer whose weight is a plain bfloat16 tensor: the bfloat16
activations and weights are widened exactly to float32, multiplied with float32
accumulation, and the output is rounded back to bfloat16: the arithmetic of a GPU bfloat16
GEMM (cuBLAS accumulates in float32 and rounds the output once). torch's CPU reference
GEMM rounds differently (partial sums pass through bfloat16), so the two bfloat16 paths are
not bit-identical: on the default model over 256 tokens of text, KLD against the float32
reference was 9.1e-4 nats natively and 9.9e-4 with this, and 1.5e-3 between the two; the
default run's noise floor over its 5938 reference tokens was 7.25e-4 +- 1.7e-5 natively and
7.06e-4 +- 1.7e-5 this way, computed in 532 s and 115 s (2026-12-01). The
noise floor is computed with the same choice as every tier (``quality.bf16_matmul`` is in
both content keys), so a tier's KLD is still read against a floor of the same arithmetic.

Checked first: torch has no switch for this (``torch.set_float32_matmul_precision`` goes
the other way, float32 inputs in lower precision; oneDNN's bfloat16 path needs AVX512),
and transformers' quantizers do not cover an unquantized model, so it is a small patch of
each ``nn.Linear``'s forward here.
"""
from __future__ import annotations

import functools
from typing import Any

from .ggml_cpu import cpu_flags, forced_kind  # standard library only: cheap at import

#: Settings of ``quality.bf16_matmul``.
SETTINGS = ("auto", "native", "float32")


def cpu_has_fast_bf16() -> bool:
    """Whether torch has a fast bfloat16 matmul on this CPU: oneDNN's bfloat16 support
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX512 or AMX), else the CPU flags
    ``avx512_bf16`` / ``amx_bf16`` in ``/proc/cpuinfo``. False when neither can be read.
    With a forced CPU kind (tests: :data:`qeval.engines.ggml_cpu.CPU_KIND_ENV`), oneDNN's
    rule on that kind's flags (AVX-512 BW: ``avx512_core``, the ISA oneDNN's bfloat16
    path needs)."""
    if forced_kind() is not None:
        return "avx512bw" in cpu_flags()
    return _machine_has_fast_bf16()


@functools.lru_cache(maxsize=1)
def _machine_has_fast_bf16() -> bool:
    try:
        import torch  # start-up time: torch loads only in stage processes
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older or CPU-less torch build: read the flags
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_bf16_matmul(setting: str, device: str, dtype: str) -> str:
    """``native`` or ``float32``: what ``quality.bf16_matmul`` means on ``device`` for a
    model computing in ``dtype``. ``auto``: ``float32`` on a CPU without a fast bfloat16
    path (:func:`cpu_has_fast_bf16`) for a bfloat16 model, else ``native``.

    Raises:
        ValueError: a setting outside :data:`SETTINGS`.
    """
    if setting not in SETTINGS:
        raise ValueError(f"quality.bf16_matmul must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if dtype != "bfloat16":
        return "native"
    if setting != "auto":
        return setting
    return "float32" if device == "cpu" and not cpu_has_fast_bf16() else "native"


def _float32_forward(weight32: Any, bias32: Any):
    import torch.nn.functional as F  # start-up time: torch loads only in stage processes

    def forward(x):
        return F.linear(x.to(weight32.dtype), weight32, bias32).to(x.dtype)
    return forward


def float32_matmuls(model: Any) -> int:
    """Compute every ``nn.Linear`` of ``model`` whose weight is a plain bfloat16 tensor as a
    float32 matmul (module docstring), in place; the layer keeps a float32 copy of its
    weight (4 bytes per parameter beside the 2 of the bfloat16 one). Layers whose weight is
    a tensor subclass (torchao) or another dtype, and modules that are not ``nn.Linear``
    (gptqmodel's kernels, embeddings, norms), are left as they are.

    Returns:
        the number of layers changed (0: nothing to do, e.g. a float32 or quantized model).
    """
    import torch  # start-up time: torch loads only in stage processes

    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight
        if w.dtype != torch.bfloat16 or type(w.data) is not torch.Tensor:
            continue
        b = mod.bias
        mod.forward = _float32_forward(w.detach().float(), None if b is None else b.detach().float())
        n += 1
    return n


def apply_to_engine(engine: Any, setting: str, device: str, dtype: str) -> tuple[str, int]:
    """Apply ``quality.bf16_matmul`` to a loaded engine: a transformers engine (an object
    with a ``model``) gets :func:`float32_matmuls` when the setting resolves to ``float32``;
    other engines (llama.cpp, a server) compute as they do.

    Returns:
        ``(resolved setting as applied, layers changed)``: ``("native", 0)`` when nothing
        was changed, so a row never claims float32 matmuls it did not get.
    """
    resolved = resolve_bf16_matmul(setting, device, dtype)
    model = getattr(engine, "model", None)
    if resolved != "float32" or model is None or not hasattr(model, "modules"):
        return "native", 0
    n = float32_matmuls(model)
    return ("float32", n) if n else ("native", 0)


class float32_linear_calls:
    """Context manager: while active, every ``torch.nn.functional.linear`` call on CPU whose
    input and weight are both plain bfloat16 tensors computes as a float32 matmul (module
    docstring), reading the weight as it is at that call. For code that rewrites weights in
    place between forwards, where :func:`float32_matmuls`' float32 copies would go stale:
    AWQ's scale search (gptqmodel ``AWQProcessor._compute_best_scale``) scales, fake-quantizes
    and restores each layer's weight 20 times per layer and runs the block forward after each.
    ``nn.Linear.forward`` and gptqmodel's ``HookedLinear`` both call
    ``torch.nn.functional.linear`` by attribute, so both are covered. Not reentrant.

    Checked first: torch offers no per-dtype matmul override (``torch.backends`` settings
    cover float32 inputs only) and gptqmodel 7.6 has no calibration-dtype setting separate
    from the model's dtype.
    """

    def __enter__(self) -> "float32_linear_calls":
        import torch  # start-up time: torch loads only in stage processes
        import torch.nn.functional as F  # start-up time: as above

        self._F = F
        self._orig = orig = F.linear
        bf16 = torch.bfloat16

        def linear(x, weight, bias=None):
            if (x.dtype == bf16 and weight.dtype == bf16 and x.device.type == "cpu"
                    and type(weight) in (torch.Tensor, torch.nn.Parameter)):
                b = None if bias is None else bias.float()
                return orig(x.float(), weight.float(), b).to(bf16)
            return orig(x, weight, bias)

        F.linear = linear
        return self

    def __exit__(self, *exc: Any) -> None:
        self._F.linear = self._orig
