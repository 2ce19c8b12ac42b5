"""Engine on transformers: any ``AutoModelForCausalLM`` (BF16, torchao INT8, gptqmodel
GPTQ/AWQ checkpoints), with the model's default KV cache or an int8 quantized cache.

The decode loop is a plain greedy loop over ``model.forward`` with a cache object, so
each token's time is taken where it becomes known (``benchmarks/decode_overhead.py``
compares it to a bare loop). ``generate()`` of transformers was checked and not used
there: it exposes no per-token timings without a streamer thread.

Decode modes (``decode`` of a transformers tier, recorded as ``engine.decode_mode``):

* ``eager``: ``DynamicCache`` (concatenating every step) and one Python-dispatched
  forward per token. On a GPU this is bound by kernel launches, not by memory bandwidth.
* ``static``: transformers' ``StaticCache`` (preallocated, written in place) and the
  decode step compiled by transformers' ``get_compiled_call`` (``torch.compile``,
  ``mode="reduce-overhead"``: CUDA graphs, on CUDA), as ``generate`` does with a static
  cache; the prefill runs uncompiled. The cache length is rounded up to 256 tokens; one
  cache (the latest length) is kept, and each length's graph is compiled and warmed up by
  :meth:`HFEngine.prepare_decode` before that depth is timed. Attention reads the whole
  preallocated cache (masked), as in transformers' static-cache ``generate``.
* ``auto`` (default): ``static`` on CUDA with the model's KV cache, ``eager`` otherwise
  (the CPU, or the int8 ``QuantizedCache``, which cannot be compiled). When compiling
  fails under ``auto`` the engine decodes eagerly and says why in ``engine.decode_note``.

The static step is compiled ``fullgraph=True`` first (one graph per step, or an error);
where the model breaks the graph (or dynamo hits its recompile limit) it is compiled again
with ``fullgraph=False`` and the parts between the breaks run eagerly. What happened is in
``engine.decode_check`` (:func:`decode_check_summary`: graph breaks and their reasons,
graphs compiled, recompiles, graphs compiled inside a timed decode, CUDA-graph replays per
step and skips, read from ``torch._dynamo.utils.counters`` and dynamo's compilation
metrics), and a step that broke into eager parts says so in ``engine.decode_note``.

Emulated dtypes: on a CPU without native bfloat16 instructions (no AVX512_BF16, no
AMX-BF16) torch computes a bfloat16 model through an emulated path (widened to float32 in
software, or its reference GEMM): on an AVX2-only Zen 3 (issue 65) a BF16 tier read 5.61 s
TTFT at 256 tokens and 18.3 tok/s where GGUF Q4_K_M read 1.31 s and 69.7 tok/s. That is
what torch's CPU path costs, not what BF16 costs, so the engine says so in the one place
every tier on it passes (:class:`HFEngine`, from the loaded model's compute dtype and the
device, whichever tier module built the label): ``engine.backend`` carries the note of
:func:`qeval.engines.ggml_cpu.torch_bf16_note` (``torch-bfloat16 (emulated on this CPU: no
AVX512_BF16)``) and ``engine.dtype_emulated`` the dtype, which the measure stage stores in
the row (``dtype_emulated``) for the table, the ladder's caption and ``qeval plan``.

Sliding-window and hybrid attention (issue 64; Gemma 3: five sliding layers to one full,
mistral: every layer sliding). transformers builds a ``DynamicSlidingWindowLayer`` for a
sliding layer, which keeps its last ``window - 1`` tokens and drops the rest as it goes, so:

* :meth:`HFEngine.decode_again` cannot ``crop`` such a layer back past the window (the
  positions it needs were dropped; transformers raises). Of the exact ways (a fresh prefill
  whenever a layer has dropped positions, a whole copy of the cache at the depth, a layer
  that keeps what it drops), the engine takes the cheapest: a copy of the **sliding
  layers' own window only**, taken once right after the timed prefill (the layers record
  the prefill's full states for that forward, ``activate_past_recording``, and are cut to
  their window again at once, so the decode that follows and its memory are the model's
  own). That is ``sliding_layers x (window - 1)`` token rows (Gemma 3 270M at window 512:
  15 x 511 x 1 KiB, 7.5 MiB, a copy inside the TTFT that no decode sees); the full layers
  are cut back by ``crop`` as before. A fresh prefill would cost the whole depth per
  repeat (what ``decode_again`` exists to avoid); a whole copy doubles the full layers'
  memory; a recording layer grows every step (its decode then reads and concatenates the
  whole depth, not its window). A layer of another kind (indexed, linear attention) is
  not cut: ``decode_again`` answers None and the sweep prefills that repeat.
* the int8 KV cache quantizes the full-attention layers (transformers'
  ``HQQQuantizedLayer``) and keeps the sliding ones in the model's dtype within their
  window (``DynamicSlidingWindowLayer``), in one ``Cache(layers=...)``: transformers'
  ``QuantizedCache`` refuses any layer type but full attention. The backend says so
  (``+ KV int8 (HQQ) on 1 of 4 layers (3 sliding, BF16, window 32)``); a model with no
  full-attention layer is refused (:func:`int8_kv_plan`).
* the KV bytes at a depth are ``full x depth + sliding x min(depth, window)`` times a
  layer's bytes per token (:meth:`HFEngine.kv_bytes_at_depth`,
  :func:`qeval.model_config.kv_bytes_at_depth`), not a per-token figure times the depth:
  the sweep's slope between two depths past the window counts the full layers only.

Greedy means greedy: free-running answers go through ``model.generate`` with an explicit
greedy :class:`~transformers.GenerationConfig` and the model's own
``generation_config.json`` defaults set aside for the call (transformers fills every
unset field from them, so a shipped ``repetition_penalty`` or ``no_repeat_ngram_size``
would otherwise apply); :attr:`HFEngine.sampling` lists what was set aside.
"""
from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .base import Capabilities, EngineOptions, Generation, MemoryInfo, greedy_loop
from .ggml_cpu import torch_bf16_note
from .hf_core import cache_nbytes, open_core as open_hf_core


def cache_kwarg(model: Any) -> str:
    """The keyword a causal LM's ``forward`` takes its KV cache by: ``cache`` (transformers
    5.2x renamed it; ``past_key_values`` is deprecated and removed in 5.40) or
    ``past_key_values`` (earlier 5.x). Read from the signature of ``model.forward``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def compute_dtype(model: Any) -> str | None:
    """The dtype a transformers model computes in, as torch names it without ``torch.``
    (``bfloat16``): the model's ``dtype`` (transformers: its first floating-point
    parameter, e.g. the embeddings beside torchao or gptqmodel's packed weights, whose
    activations run in it), else its first parameter's; None when neither can be read."""
    dt = getattr(model, "dtype", None)
    if dt is None:
        try:
            dt = next(model.parameters()).dtype
        except (AttributeError, StopIteration, TypeError):
            return None
    return str(dt).replace("torch.", "")


def emulated_label(backend: str, dtype: str, note: str) -> str:
    """``backend`` with ``note`` (:func:`qeval.engines.ggml_cpu.torch_bf16_note`) in its
    parentheses: ``torch-bfloat16 (emulated on this CPU: no AVX512_BF16)``; a label that
    does not name ``dtype`` gets it in front of the note (``torchao-int8-weight-only
    (bfloat16 emulated on this CPU: ...)``), and one that ends in parentheses gets the note
    inside them (``torch-bfloat16 (dequantized gptq; emulated on this CPU: ...)``)."""
    what = note if dtype in backend else f"{dtype} {note}"
    if backend.endswith(")"):
        return f"{backend[:-1]}; {what})"
    return f"{backend} ({what})"


def tensor_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable of tensors).

    Tensor subclasses that pack data (torchao's quantized tensors) are walked through
    ``__tensor_flatten__`` so their packed inner tensors count as stored; views and tied
    weights sharing one storage count once. ``model.get_memory_footprint()`` was checked
    and misreports torchao tensors (it counts ``numel x dtype`` of the outer tensor).
    """
    seen: set[tuple[str, int]] = set()
    total = 0

    def visit(t: Any) -> None:
        nonlocal total
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t).__name__ not in ("Parameter", "Tensor"):
            try:
                names, _ = flatten()
                for n in names:
                    visit(getattr(t, n))
                return
            except Exception:  # not a wrapper after all
                pass
        data = t.data if hasattr(t, "data") and type(t).__name__ == "Parameter" else t
        if type(data).__name__ != "Tensor" and hasattr(data, "__tensor_flatten__"):
            visit(data)
            return
        try:
            st = data.untyped_storage()
            key = (str(data.device), st.data_ptr())
            if key in seen:
                return
            seen.add(key)
            total += st.nbytes()
        except Exception:
            total += data.numel() * data.element_size()

    for t in tensors:
        visit(t)
    return total


def model_weight_bytes(model: Any) -> int:
    """Stored bytes of all parameters and buffers of a torch module (see
    :func:`tensor_storage_bytes`)."""
    return tensor_storage_bytes(list(model.parameters()) + list(model.buffers()))


def attention_kernels(op_names: Any) -> list[str]:
    """The scaled-dot-product attention kernels among profiler op names (sorted, each
    once): the backend ops under ``aten::scaled_dot_product_attention`` (flash, efficient,
    cuDNN, math), ``sdpa (kernel not seen)`` when only the dispatcher op shows, ``eager``
    when no attention op ran at all."""
    names = set(op_names)
    found = sorted(n for n in names if ("scaled_dot_product" in n or "flash_attention" in n
                                        or "flash_attn" in n) and n != "aten::scaled_dot_product_attention")
    if found:
        return found
    return ["sdpa (kernel not seen)"] if "aten::scaled_dot_product_attention" in names else ["eager"]


def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``.

    Raises:
        RuntimeError: ``cuda`` asked for on a machine without CUDA.
    """
    import torch  # start-up time: torch loads only in stage processes

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the recipe asks for device cuda but torch sees no CUDA device")
    return device


# Sampling and logits-processor fields of a GenerationConfig that change which token a
# greedy decode picks (transformers' ``_get_logits_processor``): listed when a model's
# generation_config.json sets them, and never applied.
_PROCESSOR_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                     "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                     "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
                     "forced_eos_token_id", "exponential_decay_length_penalty", "guidance_scale",
                     "renormalize_logits", "min_length", "min_new_tokens", "num_beams", "penalty_alpha",
                     "watermarking_config", "cache_implementation")

HQQ_RESIDUAL_LENGTH = 128  # tokens kept in full precision before the int8 cache re-quantizes
STATIC_CACHE_ROUND = 256
DECODE_MODES = ("auto", "eager", "static")


def ignored_generation_defaults(model: Any) -> dict:
    """The model's ``generation_config`` fields that would change a greedy answer
    (sampling, penalties, forced or suppressed tokens), with their values: what qeval sets
    aside. Empty when the model ships none."""
    from transformers import GenerationConfig  # start-up time: transformers loads only in stage processes

    gc = getattr(model, "generation_config", None)
    if gc is None:
        return {}
    defaults = GenerationConfig._get_default_generation_params()
    out = {}
    for k in _PROCESSOR_FIELDS:
        v = getattr(gc, k, None)
        if v is None or v == defaults.get(k, None) or (k == "num_beams" and v == 1) or (k == "do_sample" and not v):
            continue
        out[k] = v.to_dict() if hasattr(v, "to_dict") else v
    return out


def greedy_generation_config(max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, **extra: Any) -> Any:
    """A :class:`~transformers.GenerationConfig` for plain argmax decoding: no sampling, no
    beams, every logits processor at its neutral value, ``max_new_tokens`` new tokens at
    most, ending at any of ``stop_ids``; ``extra`` adds cache settings."""
    from transformers import GenerationConfig  # start-up time: transformers loads only in stage processes

    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens), min_new_tokens=0,
                            min_length=0, repetition_penalty=1.0, no_repeat_ngram_size=0, length_penalty=1.0,
                            encoder_repetition_penalty=1.0, renormalize_logits=False, remove_invalid_values=False,
                            eos_token_id=list(stop_ids) or None, pad_token_id=int(pad_id), **extra)


class _ModelDefaultsAside:
    """Context manager: ``model.generation_config`` replaced by an empty one for the call,
    so ``generate`` (which fills every unset field of the config it is given from the
    model's own, transformers ``_prepare_generation_config``) takes only transformers'
    neutral global defaults."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.saved = None

    def __enter__(self) -> None:
        from transformers import GenerationConfig  # start-up time: transformers loads only in stage processes
        self.saved = self.model.generation_config
        self.model.generation_config = GenerationConfig()

    def __exit__(self, *exc: Any) -> None:
        self.model.generation_config = self.saved


def resolve_decode_mode(decode: str, device: str, kv_cache: str) -> str:
    """``eager`` or ``static`` for a tier's ``decode`` setting (module notes).

    Raises:
        ValueError: ``static`` with the int8 KV cache (``QuantizedCache`` cannot be compiled)
            or an unknown mode.
    """
    if decode not in DECODE_MODES:
        raise ValueError(f"decode {decode!r}: expected one of {', '.join(DECODE_MODES)}")
    if decode == "static" and kv_cache != "model":
        raise ValueError("decode static needs the model's KV cache (the int8 QuantizedCache cannot be compiled)")
    if decode == "auto":
        return "static" if (device == "cuda" and kv_cache == "model") else "eager"
    return decode



def dynamo_snapshot() -> dict:
    """What torch's compiler has counted so far in this process, to subtract later
    (:func:`dynamo_delta`): graph-break reasons with their counts
    (``torch._dynamo.utils.counters["graph_break"]``), graphs compiled
    (``counters["stats"]["unique_graphs"]``), CUDA-graph skips
    (``counters["inductor"]["cudagraph_skips"]``: graphs inductor left out of CUDA graphs)
    and the compilation events (``torch._dynamo.utils.get_compilation_metrics()``, one per
    frame compiled; a recompile carries its ``recompile_reason``). Nothing is reset."""
    from torch._dynamo import utils as dutils  # start-up time: torch loads only in stage processes

    c = dutils.counters
    get_metrics = getattr(dutils, "get_compilation_metrics", None)  # torch >= 2.5
    return {"breaks": dict(c["graph_break"]), "graphs": int(c["stats"]["unique_graphs"]),
            "cudagraph_skips": int(c["inductor"]["cudagraph_skips"]),
            "metrics": list(get_metrics()) if get_metrics else None}


def dynamo_delta(before: dict, after: dict) -> dict:
    """The compiler's events between two :func:`dynamo_snapshot` calls: ``graph_breaks``
    (int), ``break_reasons`` ({reason: count}), ``graphs`` (graphs compiled), ``recompiles``
    (frames compiled again after a guard failed; None where this torch keeps no compilation
    metrics), ``recompile_reasons`` (list), ``recompile_limit_hit`` (bool: a frame past
    ``torch._dynamo.config.recompile_limit`` runs eagerly from then on) and
    ``cudagraph_skips``."""
    reasons: dict[str, int] = {}
    for k, v in after["breaks"].items():  # dynamo's reasons run to many lines: the first names it
        if v - before["breaks"].get(k, 0) > 0:
            key = (str(k).strip().splitlines() or [""])[0][:160]
            reasons[key] = reasons.get(key, 0) + v - before["breaks"].get(k, 0)
    out = {"graph_breaks": sum(reasons.values()), "break_reasons": reasons,
           "graphs": after["graphs"] - before["graphs"],
           "cudagraph_skips": after["cudagraph_skips"] - before["cudagraph_skips"],
           "recompiles": None, "recompile_reasons": [], "recompile_limit_hit": False}
    if before["metrics"] is not None and after["metrics"] is not None:
        seen = {id(m) for m in before["metrics"]}
        new = [m for m in after["metrics"] if id(m) not in seen]
        rec = [str(m.recompile_reason).strip().splitlines()[0][:200] for m in new
               if getattr(m, "recompile_reason", None)]
        out["recompiles"], out["recompile_reasons"] = len(rec), rec
        out["recompile_limit_hit"] = any("recompile limit" in str(getattr(m, "fail_reason", "") or "").lower()
                                         or "recompile_limit" in str(getattr(m, "fail_reason", "") or "")
                                         for m in new)
    return out


def merge_dynamo(total: dict, part: dict) -> dict:
    """``total`` with the counts of ``part`` (two :func:`dynamo_delta` results) added:
    counts summed, reasons merged, ``recompile_limit_hit`` or-ed; returns ``total``."""
    for k in ("graph_breaks", "graphs", "cudagraph_skips"):
        total[k] = total.get(k, 0) + part.get(k, 0)
    reasons = total.setdefault("break_reasons", {})
    for k, v in part.get("break_reasons", {}).items():
        reasons[k] = reasons.get(k, 0) + v
    if part.get("recompiles") is not None:
        total["recompiles"] = (total.get("recompiles") or 0) + part["recompiles"]
    else:
        total.setdefault("recompiles", None)
    total["recompile_reasons"] = (total.get("recompile_reasons") or []) + list(part.get("recompile_reasons") or [])
    total["recompile_limit_hit"] = bool(total.get("recompile_limit_hit")) or bool(part.get("recompile_limit_hit"))
    return total


class CudagraphReplays:
    """Context manager counting CUDA-graph replays: wraps ``execute_node`` of inductor's
    ``CUDAGraphTreeManager`` (``torch._inductor.cudagraph_trees``; the call that replays a
    recorded graph under ``mode="reduce-overhead"``) for the duration, restoring it on exit.
    ``count`` is None where that class or method is missing (another torch), else the
    replays seen. ``manager_cls`` is for tests (a stand-in class)."""

    def __init__(self, manager_cls: Any = None) -> None:
        self.manager_cls = manager_cls
        self.count: int | None = None
        self._orig: Any = None

    def __enter__(self) -> "CudagraphReplays":
        cls = self.manager_cls
        if cls is None:
            try:
                from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as cls  # start-up time: as torch (private, checked on 2.13)
            except ImportError:
                return self
        orig = getattr(cls, "execute_node", None)
        if orig is None:
            return self
        self.count, self._orig, self.manager_cls = 0, orig, cls
        counter = self

        def execute_node(mgr: Any, *a: Any, **kw: Any) -> Any:
            counter.count += 1
            return orig(mgr, *a, **kw)

        cls.execute_node = execute_node
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._orig is not None:
            self.manager_cls.execute_node = self._orig
            self._orig = None


def decode_check_summary(check: dict | None) -> str | None:
    """One line on a static decode that did not run as one graph per step (None when it
    did, or for ``check`` None): graph breaks with their first reasons, recompiles past the
    limit, graphs compiled inside a timed decode, CUDA-graph skips, replays per step other
    than one. ``check``: ``engine.decode_check``."""
    if not check:
        return None
    parts = []
    if check.get("graph_breaks"):
        reasons = check.get("break_reasons") or {}
        why = "; ".join(list(reasons)[:2]) + ("; ..." if len(reasons) > 2 else "")
        parts.append(f"graph breaks ({why[:240]}), {check['graph_breaks']} seen while compiling, "
                     f"{check.get('graphs')} graphs")
    elif check.get("fullgraph") is False and check.get("fullgraph_error"):
        parts.append(f"not one graph ({check['fullgraph_error'][:160]})")
    if check.get("recompile_limit_hit"):
        parts.append("dynamo's recompile limit hit (frames past it run eagerly)")
    if check.get("compiles_in_timed_decode"):
        parts.append(f"{check['compiles_in_timed_decode']} graph(s) compiled inside a timed decode")
    if check.get("cudagraph_skips"):
        parts.append(f"{check['cudagraph_skips']} graph(s) left out of CUDA graphs")
    rps = check.get("cudagraph_replays_per_step")
    if rps is not None and check.get("graph_breaks") == 0 and abs(rps - 1) > 0.01:
        parts.append(f"{rps:.2f} CUDA-graph replays per step (1 expected)")
    if not parts:
        return None
    eager = check.get("graph_breaks") or check.get("recompile_limit_hit") or check.get("fullgraph") is False
    return ("static decode not one compiled graph per step: " + ", ".join(parts)
            + (": parts of each step ran eagerly" if eager else ""))


def _next_token(out: Any, state: dict) -> int:
    """The greedy next token of a forward pass ``out`` (argmax of the last position's
    logits), kept in ``state["nxt"]`` as the next step's input; the host copy synchronises
    CUDA too."""
    state["nxt"] = out.logits[:, -1].argmax(-1, keepdim=True)
    return int(state["nxt"])


def _greedy_step(fn: Any, kw: dict, state: dict) -> Any:
    """The decode step of :func:`qeval.engines.base.greedy_loop`: feed ``state["nxt"]``
    through ``fn`` (the model, or its compiled call) with the cache in ``kw``."""
    def step(_tok: int) -> int:
        return _next_token(fn(input_ids=state["nxt"], **kw), state)
    return step

def cache_layer_types(model: Any) -> tuple[list[str], int | None]:
    """``(layer type per layer, sliding window or None)`` as transformers builds the model's
    cache (``cache_utils.get_layer_types_and_kwargs`` over the decoder config: what
    ``DynamicCache(config=...)`` dispatches on)."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # start-up time: transformers loads only in stage processes

    cfg = model.config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    windows = [kw["sliding_window"] for t, kw in zip(types, kwargs) if t == "sliding_attention" and "sliding_window" in kw]
    return list(types), (int(windows[0]) if windows else None)


_DTYPE_SHORT = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}


def int8_kv_plan(types: Sequence[str], window: int | None, dtype: str | None) -> tuple[list[int], str]:
    """The int8 KV cache's layers and its label for a model of layer ``types``: ``(full-
    attention layer indices to quantize, label)``, the label `` + KV int8 (HQQ)`` when every
    layer is quantized, else `` + KV int8 (HQQ) on 1 of 4 layers (3 sliding, BF16, window 32)``
    (the other layers kept in the model's ``dtype``).

    Raises:
        ValueError: no full-attention layer (every layer sliding, as mistral with a
            ``sliding_window``): nothing the int8 cache could hold (module notes).
    """
    quant = [i for i, t in enumerate(types) if t == "full_attention"]
    if not quant:
        kinds = sorted(set(types))
        raise ValueError(f"kv_cache int8 on transformers quantizes full-attention layers only, and none of this "
                         f"model's {len(types)} layers is one ({', '.join(kinds)}"
                         f"{f', window {window}' if window else ''}): transformers' quantized cache layers "
                         f"do not slide; use the model's KV cache")
    if len(quant) == len(types):
        return quant, " + KV int8 (HQQ)"
    kept: dict[str, int] = {}
    for t in types:
        if t != "full_attention":
            name = "sliding" if t == "sliding_attention" else t
            kept[name] = kept.get(name, 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in kept.items())
    dt = _DTYPE_SHORT.get(str(dtype), str(dtype))
    return quant, (f" + KV int8 (HQQ) on {len(quant)} of {len(types)} layers ({what}, {dt}"
                   f"{f', window {window}' if window and 'sliding' in kept else ''})")


def _sliding(layer: Any) -> bool:
    """A transformers cache layer that keeps a window of tokens (``DynamicSlidingWindowLayer``)."""
    return bool(getattr(layer, "is_sliding", False)) and hasattr(layer, "sliding_window") \
        and hasattr(layer, "cumulative_length")


def record_sliding(cache: Any, tokens: int) -> list[int]:
    """Make ``cache``'s sliding layers whose window ``tokens`` (the prompt and the tokens
    to decode) reach keep the next forward's full states (transformers'
    ``activate_past_recording``; :func:`window_copy` cuts them back): their indices. A
    layer the decode leaves inside its window is cropped as a full one."""
    idx = [i for i, lay in enumerate(cache.layers) if _sliding(lay) and tokens - 1 >= lay.sliding_window]
    for i in idx:
        cache.layers[i].record_past = True
    return idx


def window_copy(cache: Any, idx: Sequence[int], depth: int) -> dict[int, tuple]:
    """After a forward recorded by :func:`record_sliding`: each sliding layer's state at
    ``depth`` tokens (``(keys, values, depth)``: the ``min(depth, window - 1)`` rows before
    position ``depth``, copied), then the layer cut to its window (``crop(0)``) and its
    recording turned off, as if it had never recorded."""
    out: dict[int, tuple] = {}
    for i in idx:
        lay = cache.layers[i]
        if lay.keys is None or lay.keys.dim() != 4:
            continue
        held = lay.keys.shape[-2]  # every position recorded: cumulative_length rows
        if held == lay.cumulative_length and depth <= held:
            lo = max(0, depth - (lay.sliding_window - 1))
            out[i] = (lay.keys[:, :, lo:depth].clone(), lay.values[:, :, lo:depth].clone(), int(depth))
        lay.crop(0)
        lay.record_past = False
    return out


def cut_back(cache: Any, depth: int, windows: dict[int, tuple] | None) -> bool:
    """Cut ``cache`` back to ``depth`` tokens, exactly: a sliding layer from its window copy
    (:func:`window_copy`, taken at that depth), where it has one; any other layer by
    ``crop``. False where a layer cannot be cut exactly (a sliding layer past its window
    without a copy, another kind of layer): the caller prefills again."""
    windows = windows or {}
    for i, lay in enumerate(cache.layers):
        got = windows.get(i)
        if got is not None and got[2] == depth:
            lay.keys, lay.values, lay.cumulative_length = got  # never written in place: update concatenates
            continue
        held = lay.get_seq_length()
        if held < depth:
            return False
        try:
            lay.crop(depth - held)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
    return all(lay.get_seq_length() == depth for lay in cache.layers if getattr(lay, "is_initialized", False))


class HFEngine:
    """Engine over a transformers causal LM.

    Args:
        model: a loaded ``PreTrainedModel`` in eval mode, on ``device``.
        device: "cpu" or "cuda".
        kv_cache: "model" (the default dynamic cache) or "int8" (``QuantizedCache`` with
            the HQQ backend, nbits 8, groups of :meth:`kv_group_size`; the quanto backend only
            takes 2 and 4 bits).
        backend: a label for the kernel that runs the weights.
        decode: "auto", "eager" or "static" for the timed decode loop (module notes).
        compile_backend: ``torch.compile`` backend of the static mode ("inductor"; tests
            use "eager", dynamo without code generation).
        kv_residual: the int8 cache's ``residual_length`` (tokens kept in full precision, and
            the re-quantization period); None: :data:`HQQ_RESIDUAL_LENGTH`. On a model with
            sliding layers only its full-attention layers are quantized (module notes).

    Attributes:
        backend: ``backend`` as run: with the note of a dtype torch emulates on this CPU
            (:func:`emulated_label`) and `` + KV int8 (HQQ)`` for the int8 cache (`` on 1 of
            4 layers (3 sliding, BF16, window 32)`` where sliding layers are kept: :func:`int8_kv_plan`).
        layer_types, sliding_window: the cache's layer types and window (:func:`cache_layer_types`).
        dtype_emulated: the model's compute dtype (:func:`compute_dtype`) when torch runs it
            without native instructions on this CPU (``bfloat16`` without AVX512_BF16 or
            AMX-BF16; :func:`qeval.engines.ggml_cpu.torch_bf16_note`), else None.
        decode_mode: "eager" or "static" as run; ``decode_note`` says why when ``auto``
            fell back to eager.
        sampling: ``{"decode": "argmax", "ignored_file_defaults": {...}}``.
        kv_requant_period: tokens between re-quantizations of the int8 KV cache (None for
            the model's cache): a timed decode should span whole periods.

    Raises:
        ValueError: see :func:`resolve_decode_mode`; the int8 cache on a model without a
            full-attention layer (:func:`int8_kv_plan`).
    """

    name = "hf"
    formats = ("hf",)
    capabilities = Capabilities(score=True, generate=True, batch=True, memory_counter="torch", kv_bytes=True,
                                lm_eval=True, scored_generate=True)
    flash_attn = None  # transformers picks its attention kernel; qeval does not switch it
    last_cache_allocated_bytes = None  # the cache holds what it allocates: last_cache_bytes

    @classmethod
    def warm_runtime(cls, source_path: str, options: EngineOptions) -> dict:
        """transformers and the checkpoint's modeling module imported and torch's kernels
        warmed on ``options.device``, no model (:func:`warm_runtime`)."""
        return warm_runtime(source_path, options.device, options.dtype, trust_remote_code=options.trust_remote_code)

    @classmethod
    def open(cls, fmt: str, path: Path, options: EngineOptions) -> "HFEngine":
        """A transformers checkpoint folder (``fmt`` ``hf``; torchao and bitsandbytes
        checkpoints load the same way) on ``options.device``.

        Raises:
            ValueError: another format.
        """
        if fmt not in cls.formats:
            raise ValueError(f"the {cls.name} engine opens {', '.join(cls.formats)} artifacts, not {fmt!r}")
        model = load_hf_model(str(path), options.device, options.dtype, trust_remote_code=options.trust_remote_code)
        return cls(model, options.device, kv_cache=options.kv_cache, backend=options.backend or f"torch-{options.dtype}",
                   decode=options.decode, kv_residual=options.kv_residual)

    def __init__(self, model: Any, device: str, *, kv_cache: str = "model", backend: str = "torch",
                 decode: str = "eager", compile_backend: str = "inductor", kv_residual: int | None = None) -> None:
        self.model = model
        self.device = device
        self.kv_cache = kv_cache
        self.decode_requested = decode
        self.decode_mode = resolve_decode_mode(decode, device, kv_cache)
        self.decode_note: str | None = None
        self.compile_backend = compile_backend
        # what ran: a dtype torch computes without this CPU's native instructions says so in
        # the label (and dtype_emulated), whichever tier built the label (module notes)
        dtype = compute_dtype(model)
        note = torch_bf16_note(dtype, device) if dtype else None
        self.dtype_emulated: str | None = dtype if note else None
        self.layer_types, self.sliding_window = cache_layer_types(model)
        self.kv_quantized_layers: list[int] | None = None
        kv_label = ""
        if kv_cache == "int8":  # full-attention layers quantized, sliding ones kept (module notes)
            self.kv_quantized_layers, kv_label = int8_kv_plan(self.layer_types, self.sliding_window, dtype)
        self.backend = (emulated_label(backend, dtype, note) if note else backend) + kv_label
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self._torch = __import__("torch")
        self._cache_kw = cache_kwarg(model)
        self.sampling = {"decode": "argmax", "ignored_file_defaults": ignored_generation_defaults(model)}
        self.kv_residual = kv_residual or HQQ_RESIDUAL_LENGTH
        self.kv_requant_period = self.kv_residual if kv_cache == "int8" else None
        self._static: dict[int, Any] = {}  # cache length -> StaticCache, warmed up
        self._step_fn: Any = None
        self._fullgraph = True  # the static step as one graph, until the model breaks it
        self.decode_check: dict | None = None  # static decode only: what torch.compile did (module notes)
        self._check_line: str | None = None  # the check's line in decode_note (decode_check_summary)

    # -- serving -------------------------------------------------------------------
    def open_core(self, spec: Any, clock: Any) -> Any:
        """The engine core of :mod:`qeval.serving` for one workload run
        (:func:`qeval.engines.hf_core.open_core`: transformers' continuous batching manager
        or qeval's static batches over the tier's cache, by ``spec.scheduling``).

        Raises:
            ValueError: an unknown schedule; Exception: what the manager raised when
                ``continuous`` was asked for explicitly."""
        return open_hf_core(self, spec, clock)

    def prefix_how(self) -> str:
        """How the core reuses a shared prefix (recorded beside the prefix figures)."""
        return "prefix prefilled once, its cache deep-copied per batch"

    # -- cache ---------------------------------------------------------------------
    def new_cache(self) -> Any:
        """A fresh cache object of the configured kind (a dynamic one in static mode too:
        scoring and answers are not timed)."""
        from transformers import DynamicCache, QuantizedCache  # start-up time: transformers loads only in stage processes

        cfg = self.model.config
        if self.kv_cache == "int8":
            if len(self.kv_quantized_layers or ()) < len(self.layer_types):
                return self._hybrid_int8_cache()
            return QuantizedCache(backend="hqq", config=cfg, nbits=8, axis_key=1, axis_value=1,
                                  q_group_size=self.kv_group_size(), residual_length=self.kv_residual)
        return DynamicCache(config=cfg)

    def _hybrid_int8_cache(self) -> Any:
        """The int8 cache of a model with sliding layers: transformers' ``HQQQuantizedLayer``
        (as ``QuantizedCache`` builds it) on the full-attention layers, the layer
        ``DynamicCache`` would build (``DynamicSlidingWindowLayer``) on the others, in one
        ``Cache(layers=...)`` (module notes)."""
        from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache,  # start-up time: as transformers
                                              HQQQuantizedLayer, get_layer_types_and_kwargs)

        types, kwargs = get_layer_types_and_kwargs(self.model.config.get_text_config(decoder=True))
        quant = set(self.kv_quantized_layers or ())
        g = self.kv_group_size()
        layers = [HQQQuantizedLayer(nbits=8, axis_key=1, axis_value=1, q_group_size=g,
                                    residual_length=self.kv_residual) if i in quant
                  else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw) for i, (t, kw) in enumerate(zip(types, kwargs))]
        return Cache(layers=layers)

    def _compiled_step(self) -> Any:
        """The model's ``__call__`` compiled by transformers' own ``get_compiled_call`` (what
        ``generate`` uses with a static cache): CUDA graphs (``reduce-overhead``) on CUDA,
        static shapes, ``fullgraph=True`` until :meth:`static_cache` found that the model
        breaks the graph (then ``fullgraph=False``)."""
        if self._step_fn is None:
            from transformers import CompileConfig  # start-up time: transformers loads only in stage processes
            mode = "reduce-overhead" if (self.device == "cuda" and self.compile_backend == "inductor") else None
            self._step_fn = self.model.get_compiled_call(
                CompileConfig(fullgraph=self._fullgraph, dynamic=False, backend=self.compile_backend, mode=mode))
            if self.decode_check is None:
                self.decode_check = {"fullgraph": True, "fullgraph_error": None, "backend": self.compile_backend,
                                     "mode": mode, "torch": self._torch.__version__, "graph_breaks": 0,
                                     "break_reasons": {}, "graphs": 0, "recompiles": 0, "recompile_reasons": [],
                                     "recompile_limit_hit": False, "cudagraph_skips": 0,
                                     "compiles_in_timed_decode": 0, "cudagraph_replays": None,
                                     "cudagraph_replays_per_step": None, "timed_steps": 0}
        return self._step_fn

    def _record(self, delta: dict) -> None:
        """Add a :func:`dynamo_delta` to ``decode_check`` and restate ``decode_note`` (the
        check's line after any note set from outside, e.g. the int8 tier's)."""
        merge_dynamo(self.decode_check, delta)
        self.decode_check["recompile_reasons"] = self.decode_check["recompile_reasons"][-5:]
        line, prev, note = decode_check_summary(self.decode_check), self._check_line, self.decode_note
        if prev and note:  # the check's earlier line off, a note set from outside kept
            note = None if note == prev else (note[:-len(prev) - 2] if note.endswith("; " + prev) else note)
        self.decode_note = "; ".join(x for x in (note, line) if x) or None
        self._check_line = line

    def _warm_static(self, cache: Any) -> None:
        """Prefill one token into ``cache`` and run the compiled step three times (CUDA
        graphs record on the second call and replay from the third)."""
        torch = self._torch
        step = self._compiled_step()
        kw = {self._cache_kw: cache, "use_cache": True}
        with torch.inference_mode():
            out = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), **kw)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(3):
                nxt = step(input_ids=nxt, **kw).logits[:, -1].argmax(-1, keepdim=True)
            self._sync()

    def static_cache(self, n_tokens: int) -> Any:
        """A reset ``StaticCache`` of at least ``n_tokens`` (rounded up to 256), its compiled
        decode step warmed up (three steps) the first time that length is used.

        Raises:
            RuntimeError: compiling failed (``decode: static``); under ``auto`` the engine
                falls back to eager instead and records why.
        """
        from transformers import StaticCache  # start-up time: transformers loads only in stage processes

        n = -(-int(n_tokens) // STATIC_CACHE_ROUND) * STATIC_CACHE_ROUND
        cache = self._static.get(n)
        if cache is None:
            self._static.clear()  # one preallocated cache at a time: a deeper depth's replaces the last
            cache = StaticCache(config=self.model.config, max_cache_len=n)
            before = dynamo_snapshot()
            try:
                self._warm_static(cache)
            except Exception as e:  # noqa: BLE001 - dynamo's Unsupported, FailOnRecompileLimitHit, backend errors
                if not self._fullgraph:
                    raise
                # the model breaks the graph (or hit the recompile limit): compile it in parts
                self._fullgraph, self._step_fn = False, None
                self._compiled_step()
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                self.decode_check.update(fullgraph=False, fullgraph_error=f"{e.__class__.__name__}: {msg}")
                with self._torch.inference_mode():
                    cache.reset()
                before = dynamo_snapshot()  # the failed fullgraph trace is not counted as a break
                self._warm_static(cache)
            self._record(dynamo_delta(before, dynamo_snapshot()))
            self._static[n] = cache
        with self._torch.inference_mode():  # its tensors are inference tensors
            cache.reset()
        return cache

    def _sync(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.synchronize()

    def kv_group_size(self) -> int:
        """HQQ group size of the int8 KV cache: 64, or the largest power of two dividing a
        token's K (or V) elements in a layer (kv heads x head dim) when 64 does not. HQQ groups
        the whole tensor, so its element count must divide into groups at every length: a
        model with 2 KV heads of 16 dimensions (32 per token) fails at odd lengths with 64."""
        cfg = self.model.config.get_text_config()
        heads = getattr(cfg, "num_attention_heads", 1) or 1
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        per_token = int((getattr(cfg, "num_key_value_heads", None) or heads) * head_dim)
        g = 64
        while g > 1 and per_token % g:
            g //= 2
        return g

    # -- Engine API ----------------------------------------------------------------
    def iter_logprobs(self, token_ids: Sequence[int], window: int = 256,
                      first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """See :meth:`qeval.engines.base.Engine.iter_logprobs`: chunked forward passes over
        one cache, log-softmax in float32 on ``window`` positions at a time; positions
        before ``first`` only fill the cache."""
        torch = self._torch
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        cache = self.new_cache()
        with torch.inference_mode():
            if first > 0:  # prefix: fill the cache only
                for start in range(0, first, window):
                    chunk = ids[:, start:min(start + window, first)]
                    self.model(input_ids=chunk, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
            for start in range(first, n - 1, window):
                chunk = ids[:, start:start + window]
                out = self.model(input_ids=chunk, **{self._cache_kw: cache}, use_cache=True)
                m = min(chunk.shape[1], n - 1 - start)
                logp = torch.log_softmax(out.logits[0, :m].float(), dim=-1)
                yield start, logp.cpu().numpy()
                del out, logp

    def prepare_decode(self, n_tokens: int) -> None:
        """Before a depth is timed (and its peak memory window opens): in static mode, the
        cache for ``n_tokens`` allocated and its decode step compiled and warmed up, so
        neither compile time nor compile memory lands in that depth's figures."""
        if self.decode_mode == "static":
            self._static_or_fallback(n_tokens)

    def _static_or_fallback(self, n_tokens: int) -> Any:
        """The static cache for ``n_tokens``, or None after falling back to eager (``auto``).

        Raises:
            RuntimeError: compiling failed under ``decode: static``.
        """
        try:
            return self.static_cache(n_tokens)
        except Exception as e:  # noqa: BLE001 - torch.compile failures have many types
            why = f"{e.__class__.__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if self.decode_requested == "static":
                raise RuntimeError(f"decode static: torch.compile failed ({why})") from e
            self.decode_mode, self.decode_note = "eager", f"static decode failed ({why}): decoded eagerly"
            self._static.clear()
            return None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy decoding in the engine's decode mode; see
        :class:`qeval.engines.base.Generation` for timings (seconds). Sets
        ``last_cache_bytes`` (KV bytes held for the tokens in the cache; a static cache's
        preallocated rows beyond them are left out) and ``last_cache_tokens``."""
        torch = self._torch
        model = self.model
        self._cached = None  # the last call's cache is freed before this one allocates (peak memory)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        cache, step_fn = None, model
        if self.decode_mode == "static":
            cache = self._static_or_fallback(ids.shape[1] + max_new_tokens)
            if cache is not None:
                step_fn = self._compiled_step()
        if cache is None:
            cache = self.new_cache()
        kw = {self._cache_kw: cache, "use_cache": True}
        state = {}
        keep = type(cache).__name__ == "DynamicCache" and step_fn is model  # decode_again may cut it back
        # sliding layers past their window cannot be cropped: their window at the depth is
        # copied right after the prefill (module notes)
        sliding = record_sliding(cache, ids.shape[1] + max_new_tokens) if keep else []
        windows: dict = {}

        def prefill() -> int:
            out = model(input_ids=ids, **kw, logits_to_keep=1)
            if sliding:
                windows.update(window_copy(cache, sliding, ids.shape[1] - 1))
            return _next_token(out, state)  # the host copy synchronises CUDA too

        step = _greedy_step(step_fn, kw, state)

        compiled = step_fn is not model
        before = dynamo_snapshot() if compiled else None
        replays = CudagraphReplays() if compiled and self.device == "cuda" else None
        with torch.inference_mode():
            self._sync()
            if replays is not None:
                with replays:
                    gen = greedy_loop(prefill, step, max_new_tokens, stop_ids, ignore_stop)
            else:
                gen = greedy_loop(prefill, step, max_new_tokens, stop_ids, ignore_stop)
        if compiled:
            self._record_timed(dynamo_delta(before, dynamo_snapshot()), len(gen.token_ids) - 1,
                               replays.count if replays is not None else None)
        # a dynamic (unquantized) cache can be cut back for decode_again; others are not kept
        self._cached = (list(prompt_ids), cache, windows) if keep else None
        self.last_cache_tokens = ids.shape[1] + len(gen.token_ids) - 1
        if self.decode_mode == "static":  # K/V rows of the tokens held, not the preallocated length
            # (a sliding layer's rows are its window: max_cache_len is min(window, length) there)
            held = sum((lay.keys.nbytes + lay.values.nbytes) * min(self.last_cache_tokens, lay.max_cache_len)
                       // lay.max_cache_len for lay in cache.layers if getattr(lay, "is_initialized", False))
        else:
            held = cache_nbytes(cache)
        self.last_cache_bytes = held
        return gen

    def _record_timed(self, delta: dict, steps: int, replays: int | None) -> None:
        """Add one timed static decode to ``decode_check``: graphs compiled inside it
        (``compiles_in_timed_decode``: compile time in the figure), breaks and recompiles,
        ``steps`` compiled steps and the CUDA-graph ``replays`` seen (None: not counted),
        with ``cudagraph_replays_per_step`` over every timed decode so far."""
        chk = self.decode_check
        chk["compiles_in_timed_decode"] += delta["graphs"]
        chk["timed_steps"] += max(0, steps)
        if replays is not None:
            chk["cudagraph_replays"] = (chk["cudagraph_replays"] or 0) + replays
            chk["cudagraph_replays_per_step"] = (chk["cudagraph_replays"] / chk["timed_steps"]
                                                 if chk["timed_steps"] else None)
        self._record(delta)

    def decode_again(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation | None:
        """Decode ``max_new_tokens`` after ``prompt_ids`` again without prefilling it: the
        dynamic cache of the last :meth:`generate` of the same prompt is cut back to
        ``len(prompt_ids) - 1`` tokens (each layer's ``crop``), the last prompt token is fed
        again, then the same greedy loop (stop tokens ignored). Its ``prefill_s`` is one
        token's time, not a TTFT. A sliding layer past its window is restored from the copy
        of its window :meth:`generate` took at that depth (module notes). None when the last
        cache was not a plain dynamic one (int8 KV, static decode), held another prompt, or
        has a layer that cannot be cut back exactly (:func:`cut_back`)."""
        torch = self._torch
        got = getattr(self, "_cached", None)
        ids = list(prompt_ids)
        if got is None or got[0] != ids or not ids:
            return None
        cache = got[1]
        if not cut_back(cache, len(ids) - 1, got[2]) or cache.get_seq_length() != len(ids) - 1:
            self._cached = None
            return None
        model = self.model
        kw = {self._cache_kw: cache, "use_cache": True}
        last = torch.tensor([ids[-1:]], dtype=torch.long, device=self.device)
        state = {}

        def prefill() -> int:
            out = model(input_ids=last, **kw)
            return _next_token(out, state)

        step = _greedy_step(model, kw, state)

        with torch.inference_mode():
            self._sync()
            return greedy_loop(prefill, step, max_new_tokens, (), True)

    def generate_scored(self, prompt_ids: Sequence[int], score_start: int, score_end: int, max_new_tokens: int, *,
                        stop_ids: Sequence[int] = (), window: int = 256) -> tuple[Generation, list]:
        """Greedy answer to ``prompt_ids`` whose prefill also yields the teacher-forced
        log-probabilities of prompt tokens ``score_start .. score_end - 1`` (one prefill
        instead of :meth:`iter_logprobs` plus :meth:`generate`).

        The prefill runs in the chunks ``iter_logprobs(prompt_ids[:score_end], window,
        score_start - 1)`` uses, so its rows are exactly that call's; the rest of the prompt
        follows on the same cache, then greedy decoding. Returns ``(generation, [(j, logp)])``
        with ``logp`` float32 ``[m, vocab]`` rows predicting tokens ``score_start + j ...``.
        Timings in the generation cover the whole chunked prefill (not a TTFT measurement).
        """
        torch = self._torch
        model = self.model
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        first = score_start - 1
        if not 0 <= first < score_end - 1 < n:
            raise ValueError(f"score range {score_start}..{score_end} must lie inside the {n}-token prompt")
        cache = self.new_cache()
        kw = {self._cache_kw: cache, "use_cache": True}
        rows: list = []
        state: dict = {}

        def prefill() -> int:
            for start in range(0, first, window):  # as iter_logprobs: prefix fills the cache only
                model(input_ids=ids[:, start:min(start + window, first)], **kw, logits_to_keep=1)
            out = None
            done = first  # the prompt tokens in the cache
            for start in range(first, score_end - 1, window):
                end = min(start + window, score_end)
                out = model(input_ids=ids[:, start:end], **kw)
                m = min(window, score_end - 1 - start)
                rows.append((start - first, torch.log_softmax(out.logits[0, :m].float(), dim=-1).cpu().numpy()))
                done = end
            # the rest of the prompt from where the scored chunks stopped: when the scored span
            # is a whole number of windows, the last scored chunk ends one token short of
            # score_end, and that token must not be skipped
            for start in range(done, n, window):
                out = model(input_ids=ids[:, start:min(start + window, n)], **kw, logits_to_keep=1)
            return _next_token(out, state)

        step = _greedy_step(model, kw, state)

        with torch.inference_mode():
            gen = greedy_loop(prefill, step, max_new_tokens, stop_ids)
        return gen, rows

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       stop_ids: Sequence[int] = (), pad_id: int = 0) -> list[tuple[list[int], bool]]:
        """Greedy answers to several prompts at once (quality only: no timings).

        Uses transformers' ``generate`` with left padding, the tier's cache kind and
        :func:`greedy_generation_config` (the model's generation_config.json defaults set
        aside: plain argmax). Returns per prompt ``(new token ids up to and including the stop token, finished)``.
        Batched matmuls round differently from single-sequence ones, so the reference
        pass and every tier's free-running answers all go through this same path.
        """
        torch = self._torch
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        kwargs: dict = {}
        cache_obj: dict = {}
        if self.kv_cache == "int8" and len(self.kv_quantized_layers or ()) < len(self.layer_types):
            cache_obj[self._cache_kw] = self._hybrid_int8_cache()  # transformers' "quantized" refuses sliding layers
        elif self.kv_cache == "int8":
            kwargs["cache_implementation"] = "quantized"
            kwargs["cache_config"] = {"backend": "hqq", "nbits": 8, "axis_key": 1, "axis_value": 1,
                                      "q_group_size": self.kv_group_size(), "residual_length": self.kv_residual}
        stop = [int(s) for s in stop_ids]
        gc = greedy_generation_config(max_new_tokens, stop, pad_id, **kwargs)
        with torch.inference_mode(), _ModelDefaultsAside(self.model):
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=gc, **cache_obj)
        res = []
        for row in out[:, width:].tolist():
            toks: list[int] = []
            finished = False
            for t in row:
                toks.append(t)
                if t in stop:
                    finished = True
                    break
            res.append((toks, finished))
        return res

    def kv_cache_dtype(self, cache: Any = None) -> str:
        """The KV cache's element type as it runs: the dtype of ``cache``'s first-layer keys
        (a filled cache of this engine; default: the weights' dtype), or ``int8 (HQQ, group
        64) + <dtype> residual`` for the quantized cache."""
        dtype = str(next(self.model.parameters()).dtype).replace("torch.", "")
        layer = (getattr(cache, "layers", None) or [None])[0]
        keys = getattr(layer, "keys", None)
        if isinstance(keys, self._torch.Tensor) and keys.numel():
            dtype = str(keys.dtype).replace("torch.", "")
        lay = self.kv_layout() if self.sliding_window else None
        if self.kv_cache == "int8":
            out = f"int8 (HQQ, group 64) + {dtype} residual of {self.kv_residual} tokens"
            if lay and lay["full"] < lay["layers"]:
                out += f" on {lay['full']} of {lay['layers']} layers; {dtype} on {lay['sliding']} sliding (window {lay['window']})"
            return out
        if lay and lay["sliding"]:
            return f"{dtype} ({lay['sliding']} of {lay['layers']} layers sliding, window {lay['window']})"
        return dtype

    def attention_info(self, prompt_ids: Sequence[int]) -> dict:
        """Which attention kernels ran, seen by torch's profiler over one prefill of
        ``prompt_ids`` and one decode step (``torch.profiler`` records every aten op).

        Returns:
            ``{"engine": "transformers", "implementation": config._attn_implementation,
            "kernels": {"prefill": [...], "decode": [...]}, "flash_attn": bool,
            "kv_cache_dtype": str}``; ``flash_attn`` is True when a flash-attention kernel
            ran in either phase. ``kernels`` lists the scaled-dot-product kernels (e.g.
            ``aten::_scaled_dot_product_flash_attention_for_cpu``), or ``eager`` when none
            ran (attention as matmul + softmax).
        """
        torch = self._torch
        from torch.profiler import ProfilerActivity, profile  # start-up time: torch loads only in stage processes
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        cache = self.new_cache()
        kw = {self._cache_kw: cache, "use_cache": True}
        phases: dict[str, list[str]] = {}
        with torch.inference_mode():
            with profile(activities=acts) as prof:
                out = self.model(input_ids=ids, **kw, logits_to_keep=1)
                self._sync()
            phases["prefill"] = attention_kernels(e.key for e in prof.key_averages())
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            with profile(activities=acts) as prof:
                self.model(input_ids=nxt, **kw)
                self._sync()
            phases["decode"] = attention_kernels(e.key for e in prof.key_averages())
        impl = getattr(self.model.config, "_attn_implementation", None)
        flash = any("flash" in k for ks in phases.values() for k in ks)
        # the profiled steps are eager forwards on a dynamic cache; a static-mode decode
        # runs the same attention implementation through its compiled call
        out = {"engine": "transformers", "implementation": impl, "kernels": phases, "flash_attn": flash,
               "kv_cache_dtype": self.kv_cache_dtype(cache), "profiled": "eager forward, dynamic cache",
               "decode_mode": getattr(self, "decode_mode", None)}
        if self.sliding_window:  # KV bytes at a depth are not depth x a per-token figure (module notes)
            lay = self.kv_layout()
            out["kv_layout"] = {**lay, "kv_bytes_at_depth": (f"{lay['bytes_per_layer_token']} x ({lay['full']} x depth"
                                                             f" + {lay['sliding']} x min(depth, {lay['window']}))")}
        return out

    def kv_bytes_per_token(self, depth: int = 256) -> float:
        """Bytes per token of a cache filled with ``depth`` tokens by one forward pass (with
        sliding layers: :meth:`filled_cache_bytes` over ``depth``, the figure at that depth
        only, see :meth:`kv_bytes_at_depth`)."""
        if self.sliding_window:
            return self.filled_cache_bytes(depth) / depth
        torch = self._torch
        cache = self.new_cache()
        ids = torch.randint(0, self.vocab_size, (1, depth), device=self.device)
        with torch.inference_mode():
            self.model(input_ids=ids, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return cache_nbytes(cache) / depth

    def filled_cache_bytes(self, depth: int) -> int:
        """Bytes (:func:`qeval.engines.hf_core.cache_nbytes`: the storages behind the cache's
        tensors) of a cache holding ``depth`` tokens as a decode holds them: ``depth - 1``
        prefilled, then one decode step. One step matters for sliding layers: right after a
        prefill their window is a view of the prefill's whole states, which the first step
        frees."""
        torch = self._torch
        cache = self.new_cache()
        ids = torch.randint(0, self.vocab_size, (1, max(1, depth)), device=self.device)
        kw = {self._cache_kw: cache, "use_cache": True}
        with torch.inference_mode():
            if depth > 1:
                self.model(input_ids=ids[:, :-1], **kw, logits_to_keep=1)
            self.model(input_ids=ids[:, -1:], **kw, logits_to_keep=1)
        return cache_nbytes(cache)

    def kv_layout(self) -> dict:
        """The cache's layers by kind: ``{"layers", "full", "sliding", "window",
        "bytes_per_layer_token"}`` (the last: K and V of one layer and token in the model's
        dtype)."""
        cfg = self.model.config.get_text_config(decoder=True)
        heads = getattr(cfg, "num_attention_heads", 1) or 1
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        dt = getattr(self.model, "dtype", None)  # activations' dtype (packed int weights beside it)
        elt = (self._torch.empty((), dtype=dt) if dt is not None else next(self.model.parameters())).element_size()
        sliding = sum(t == "sliding_attention" for t in self.layer_types) if self.sliding_window else 0
        return {"layers": len(self.layer_types), "full": len(self.layer_types) - sliding, "sliding": sliding,
                "window": self.sliding_window, "bytes_per_layer_token": int(2 * kv_heads * head_dim * elt)}

    def kv_bytes_at_depth(self, depth: int) -> int:
        """KV bytes of the model's cache at ``depth`` tokens, from the config:
        ``bytes_per_layer_token x (full x depth + sliding x min(depth, window))`` (module
        notes; :func:`qeval.model_config.kv_bytes_at_depth` from a config file). The int8
        cache's quantized layers hold less: measure it (:meth:`filled_cache_bytes`)."""
        lay = self.kv_layout()
        d = max(0, int(depth))
        return lay["bytes_per_layer_token"] * (lay["full"] * d + lay["sliding"] * min(d, lay["window"] or d))

    def memory(self) -> MemoryInfo:
        """Stored weight bytes and KV bytes per token (cache filled with 256 tokens)."""
        return MemoryInfo(model_weight_bytes(self.model), self.kv_bytes_per_token(256), self.device,
                          {"backend": self.backend, "kv_cache": self.kv_cache})

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            self._torch.cuda.empty_cache()


def warm_runtime(source_path: str, device: str, dtype: str = "bfloat16", *,
                 trust_remote_code: bool = False) -> dict:
    """Import and warm what :class:`HFEngine` runs on, without the model: transformers'
    causal-LM class for the checkpoint's architecture (which imports its modeling module)
    and one small matmul, scaled-dot-product attention and log-softmax in ``dtype`` on
    ``device`` (first-call set-up of the kernels and their thread pools). A few MiB of
    tensors, freed again. Returns ``{"libraries": [...]}``.

    Raises:
        OSError/ValueError from transformers when ``source_path`` has no readable config.
    """
    import torch  # start-up time: torch loads only in stage processes
    import transformers  # start-up time: transformers loads only in stage processes
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up time: as transformers

    libs = ["torch", "transformers"]
    cfg = AutoConfig.from_pretrained(source_path, trust_remote_code=trust_remote_code)
    try:  # the lazy auto-mapping imports the architecture's modeling module on lookup
        cls = AutoModelForCausalLM._model_mapping[type(cfg)]
        libs.append(cls.__module__)
    except (KeyError, AttributeError, ImportError):
        pass  # remote code or an unmapped config: imported at load instead
    t = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.inference_mode():
        x = torch.randn(64, 64, device=device).to(t)
        q = torch.randn(1, 2, 16, 32, device=device).to(t)
        (x @ x).sum().item()
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
        torch.log_softmax(torch.randn(4, 256, device=device), dim=-1).sum().item()
    del x, q
    if device == "cuda":
        torch.cuda.synchronize()
    return {"libraries": libs, "transformers": transformers.__version__}


def load_hf_model(path: str, device: str, dtype: str = "bfloat16", *, trust_remote_code: bool = False,
                  **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode on ``device``.

    Raises:
        OSError/ValueError from transformers when the folder is not a loadable checkpoint.
    """
    import torch  # start-up time: torch loads only in stage processes
    from transformers import AutoModelForCausalLM  # start-up time: transformers loads only in stage processes

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
        trust_remote_code=trust_remote_code, **kwargs)
    if device == "cuda" and next(model.parameters()).device.type != "cuda":
        model = model.to("cuda")
    model.eval()
    return model


ENGINE = HFEngine
