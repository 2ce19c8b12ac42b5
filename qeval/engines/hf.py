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
            the re-quantization period); None: :data:`HQQ_RESIDUAL_LENGTH`.

    Attributes:
        decode_mode: "eager" or "static" as run; ``decode_note`` says why when ``auto``
            fell back to eager.
        sampling: ``{"decode": "argmax", "ignored_file_defaults": {...}}``.
        kv_requant_period: tokens between re-quantizations of the int8 KV cache (None for
            the model's cache): a timed decode should span whole periods.

    Raises:
        ValueError: see :func:`resolve_decode_mode`.
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
        self.backend = backend + (" + KV int8 (HQQ)" if kv_cache == "int8" else "")
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self._torch = __import__("torch")
        self._cache_kw = cache_kwarg(model)
        self.sampling = {"decode": "argmax", "ignored_file_defaults": ignored_generation_defaults(model)}
        self.kv_residual = kv_residual or HQQ_RESIDUAL_LENGTH
        self.kv_requant_period = self.kv_residual if kv_cache == "int8" else None
        self._static: dict[int, Any] = {}  # cache length -> StaticCache, warmed up
        self._step_fn: Any = None

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
            return QuantizedCache(backend="hqq", config=cfg, nbits=8, axis_key=1, axis_value=1,
                                  q_group_size=self.kv_group_size(), residual_length=self.kv_residual)
        return DynamicCache(config=cfg)

    def _compiled_step(self) -> Any:
        """The model's ``__call__`` compiled by transformers' own ``get_compiled_call`` (what
        ``generate`` uses with a static cache): CUDA graphs (``reduce-overhead``) on CUDA,
        static shapes."""
        if self._step_fn is None:
            from transformers import CompileConfig  # start-up time: transformers loads only in stage processes
            mode = "reduce-overhead" if (self.device == "cuda" and self.compile_backend == "inductor") else None
            self._step_fn = self.model.get_compiled_call(
                CompileConfig(fullgraph=False, dynamic=False, backend=self.compile_backend, mode=mode))
        return self._step_fn

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
            torch = self._torch
            self._static.clear()  # one preallocated cache at a time: a deeper depth's replaces the last
            cache = StaticCache(config=self.model.config, max_cache_len=n)
            step = self._compiled_step()
            kw = {self._cache_kw: cache, "use_cache": True}
            with torch.inference_mode():
                out = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), **kw)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(3):  # CUDA graphs record on the second call and replay from the third
                    nxt = step(input_ids=nxt, **kw).logits[:, -1].argmax(-1, keepdim=True)
                self._sync()
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

        def prefill() -> int:
            out = model(input_ids=ids, **kw, logits_to_keep=1)
            return _next_token(out, state)  # the host copy synchronises CUDA too

        step = _greedy_step(step_fn, kw, state)

        with torch.inference_mode():
            self._sync()
            gen = greedy_loop(prefill, step, max_new_tokens, stop_ids, ignore_stop)
        # a dynamic (unquantized) cache can be cut back for decode_again; others are not kept
        self._cached = (list(prompt_ids), cache) if (type(cache).__name__ == "DynamicCache"
                                                    and step_fn is model) else None
        self.last_cache_tokens = ids.shape[1] + len(gen.token_ids) - 1
        if self.decode_mode == "static":  # K/V rows of the tokens held, not the preallocated length
            held = sum((lay.keys.nbytes + lay.values.nbytes) * self.last_cache_tokens // lay.max_cache_len
                       for lay in cache.layers if getattr(lay, "is_initialized", False))
        else:
            held = cache_nbytes(cache)
        self.last_cache_bytes = held
        return gen

    def decode_again(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation | None:
        """Decode ``max_new_tokens`` after ``prompt_ids`` again without prefilling it: the
        dynamic cache of the last :meth:`generate` of the same prompt is cut back to
        ``len(prompt_ids) - 1`` tokens (each layer's ``crop``), the last prompt token is fed
        again, then the same greedy loop (stop tokens ignored). Its ``prefill_s`` is one
        token's time, not a TTFT. None when the last cache was not a plain dynamic one
        (int8 KV, static decode) or held another prompt."""
        torch = self._torch
        got = getattr(self, "_cached", None)
        ids = list(prompt_ids)
        if got is None or got[0] != ids or not ids:
            return None
        cache = got[1]
        held = cache.get_seq_length()
        drop = held - (len(ids) - 1)
        if drop > 0:
            for layer in cache.layers:
                layer.crop(-drop)
        if cache.get_seq_length() != len(ids) - 1:
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
        if self.kv_cache == "int8":
            kwargs["cache_implementation"] = "quantized"
            kwargs["cache_config"] = {"backend": "hqq", "nbits": 8, "axis_key": 1, "axis_value": 1,
                                      "q_group_size": self.kv_group_size(), "residual_length": self.kv_residual}
        stop = [int(s) for s in stop_ids]
        gc = greedy_generation_config(max_new_tokens, stop, pad_id, **kwargs)
        with torch.inference_mode(), _ModelDefaultsAside(self.model):
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=gc)
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
        if self.kv_cache == "int8":
            return f"int8 (HQQ, group 64) + {dtype} residual of {self.kv_residual} tokens"
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
        return {"engine": "transformers", "implementation": impl, "kernels": phases, "flash_attn": flash,
                "kv_cache_dtype": self.kv_cache_dtype(cache), "profiled": "eager forward, dynamic cache",
                "decode_mode": getattr(self, "decode_mode", None)}

    def kv_bytes_per_token(self, depth: int = 256) -> float:
        """Bytes per token of a cache filled with ``depth`` tokens by one forward pass."""
        torch = self._torch
        cache = self.new_cache()
        ids = torch.randint(0, self.vocab_size, (1, depth), device=self.device)
        with torch.inference_mode():
            self.model(input_ids=ids, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return cache_nbytes(cache) / depth

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
