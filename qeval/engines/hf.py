"""Engine on transformers: any ``AutoModelForCausalLM`` (BF16, torchao INT8, gptqmodel
GPTQ/AWQ checkpoints), with the model's default KV cache or an int8 quantized cache.

The decode loop is a plain greedy loop over ``model.forward`` with a cache object, so
each token's time is taken where it becomes known (``benchmarks/decode_overhead.py``
compares it to a bare loop). ``generate()`` of transformers was checked and not used:
it exposes no per-token timings without a streamer thread.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import numpy as np

from .base import Generation, MemoryInfo, greedy_loop


def cache_kwarg(model: Any) -> str:
    """The keyword a causal LM's ``forward`` takes its KV cache by: ``cache`` (transformers
    5.2x renamed it; ``past_key_values`` is deprecated and removed in 5.40) or
    ``past_key_values`` (earlier 5.x). Read from the signature of ``model.forward``."""
    import inspect
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


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache object: every tensor reachable from its
    layers (keys, values, quantized data, scales, residual buffers), each storage once."""
    import torch

    seen: set[int] = set()
    total = 0

    def walk(o: Any, depth: int = 0) -> None:
        nonlocal total
        if depth > 6 or o is None:
            return
        if isinstance(o, torch.Tensor):
            if o.numel() == 0:
                return
            st = o.untyped_storage()
            if st.data_ptr() in seen:
                return
            seen.add(st.data_ptr())
            total += st.nbytes()
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x, depth + 1)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (torch.nn.Module, type)):
            for k, x in vars(o).items():
                if k in ("config",):
                    continue
                walk(x, depth + 1)

    for layer in getattr(cache, "layers", []) or []:
        walk(layer)
    return total


def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``.

    Raises:
        RuntimeError: ``cuda`` asked for on a machine without CUDA.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the recipe asks for device cuda but torch sees no CUDA device")
    return device


class HFEngine:
    """Engine over a transformers causal LM.

    Args:
        model: a loaded ``PreTrainedModel`` in eval mode, on ``device``.
        device: "cpu" or "cuda".
        kv_cache: "model" (the default dynamic cache) or "int8" (``QuantizedCache`` with
            the HQQ backend, nbits 8; the quanto backend only takes 2 and 4 bits).
        backend: a label for the kernel that runs the weights.
    """

    name = "hf"

    def __init__(self, model: Any, device: str, *, kv_cache: str = "model", backend: str = "torch") -> None:
        self.model = model
        self.device = device
        self.kv_cache = kv_cache
        self.backend = backend + (" + KV int8 (HQQ)" if kv_cache == "int8" else "")
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self._torch = __import__("torch")
        self._cache_kw = cache_kwarg(model)

    # -- cache ---------------------------------------------------------------------
    def new_cache(self) -> Any:
        """A fresh cache object of the configured kind."""
        from transformers import DynamicCache, QuantizedCache

        cfg = self.model.config
        if self.kv_cache == "int8":
            return QuantizedCache(backend="hqq", config=cfg, nbits=8, axis_key=1, axis_value=1,
                                  q_group_size=64, residual_length=128)
        return DynamicCache(config=cfg)

    def _sync(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.synchronize()

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

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy decoding; see :class:`qeval.engines.base.Generation` for timings (seconds)."""
        torch = self._torch
        model = self.model
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        cache = self.new_cache()
        kw = {self._cache_kw: cache, "use_cache": True}
        state = {}

        def prefill() -> int:
            out = model(input_ids=ids, **kw, logits_to_keep=1)
            state["nxt"] = out.logits[:, -1].argmax(-1, keepdim=True)
            return int(state["nxt"])  # the host copy synchronises CUDA too

        def step(_tok: int) -> int:
            out = model(input_ids=state["nxt"], **kw)
            state["nxt"] = out.logits[:, -1].argmax(-1, keepdim=True)
            return int(state["nxt"])

        with torch.inference_mode():
            self._sync()
            gen = greedy_loop(prefill, step, max_new_tokens, stop_ids, ignore_stop)
        self.last_cache_bytes = cache_nbytes(cache)
        self.last_cache_tokens = ids.shape[1] + len(gen.token_ids) - 1
        return gen

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       stop_ids: Sequence[int] = (), pad_id: int = 0) -> list[tuple[list[int], bool]]:
        """Greedy answers to several prompts at once (quality only: no timings).

        Uses transformers' ``generate`` with left padding and the tier's cache kind.
        Returns per prompt ``(new token ids up to and including the stop token, finished)``.
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
                                      "q_group_size": 64, "residual_length": 128}
        stop = [int(s) for s in stop_ids]
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                      eos_token_id=stop or None, pad_token_id=pad_id,
                                      temperature=None, top_p=None, top_k=None, **kwargs)
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


def load_hf_model(path: str, device: str, dtype: str = "bfloat16", *, trust_remote_code: bool = False,
                  **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode on ``device``.

    Raises:
        OSError/ValueError from transformers when the folder is not a loadable checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
        trust_remote_code=trust_remote_code, **kwargs)
    if device == "cuda" and next(model.parameters()).device.type != "cuda":
        model = model.to("cuda")
    model.eval()
    return model
