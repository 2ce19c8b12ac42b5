"""The Engine interface (:class:`Engine`: eight methods, thirteen attributes; kept small as
lm-evaluation-harness keeps its model interface): open and warm, score, generate, attention
path, KV bytes, memory, close. Implementations: :mod:`qeval.engines.hf` (transformers),
:mod:`qeval.engines.llamacpp` (llama-cpp-python) and :mod:`qeval.engines.openai` (an
OpenAI-compatible server), found by :mod:`qeval.engines`.

Every engine takes and returns token ids from the source model's Hugging Face tokenizer,
so every tier scores the very same tokens. An engine says what it can do in
:class:`Capabilities` and which artifact formats it opens (``formats``, :meth:`Engine.open`);
callers read those instead of probing engine names or attributes. Four optional members
are looked up with ``getattr``: ``prepare_decode`` and ``decode_again``
(:func:`qeval.measure.speed.speed_sweep`), ``score_topk`` (below) and ``model``
(:mod:`qeval.engines.bf16_matmul`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import time
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Literal, Protocol, Sequence

import numpy as np


@dataclass
class Generation:
    """Result of :meth:`Engine.generate`.

    Attributes:
        token_ids: new token ids (the stop token included when one ended generation).
        prefill_s: seconds from call to the first new token being known (TTFT).
        token_times_s: for each new token, seconds since the call when it was known;
            ``token_times_s[0] == prefill_s``.
        finished: True when a stop token ended generation before ``max_new_tokens``.
    """
    token_ids: list[int]
    prefill_s: float
    token_times_s: list[float]
    finished: bool

    @property
    def decode_tokens_per_s(self) -> float | None:
        """(n - 1) / (t_last - t_first) over the n new tokens (docs/design.md); None if n < 2."""
        n = len(self.token_times_s)
        if n < 2:
            return None
        dt = self.token_times_s[-1] - self.token_times_s[0]
        return (n - 1) / dt if dt > 0 else None


@dataclass
class MemoryInfo:
    """Memory figures of a loaded engine.

    Attributes:
        weight_bytes: bytes the weights occupy as stored (packed integers counted as stored).
        kv_bytes_per_token: KV cache bytes per token, measured from a filled cache object.
        device: "cpu" or "cuda".
        details: engine-specific extras (per-dtype byte counts, backend names).
    """
    weight_bytes: int
    kv_bytes_per_token: float | None
    device: str
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do. (Serving batches is not a flag: an engine that serves them
    implements the serving core, ``open_core(spec, clock)``, :mod:`qeval.serving.core`.)

    Attributes:
        score: :meth:`Engine.iter_logprobs` (teacher-forced log-probabilities): fidelity needs it.
        generate: :meth:`Engine.generate` with per-token timings: the speed sweep needs it.
        batch: ``generate_batch(prompts, max_new_tokens, stop_ids=, pad_id=)``, several
            answers at once without timings: free-running answers use it when present.
        memory_counter: where the engine's memory shows: ``"torch"`` (torch's allocator:
            ``torch.cuda.max_memory_allocated`` on CUDA, the process's VmHWM on CPU),
            ``"process"`` (outside torch: VmHWM on CPU, NVML device memory on CUDA) or
            ``"server"`` (another process: the engine's ``peak_counter()`` after it opened,
            e.g. a served model's RSS with its children, or NVML for its pid).
        kv_bytes: after :meth:`Engine.generate`, ``last_cache_bytes`` holds the bytes of the
            KV cache it filled (the sweep's KV bytes per token come from it), and
            ``last_cache_allocated_bytes`` the bytes allocated for it (None: the same; an
            engine that allocates its whole context, as llama.cpp does, says more).
        lm_eval: ``engine.model`` is a transformers model lm-evaluation-harness's HFLM wraps.
        scored_generate: ``generate_scored(prompt_ids, score_start, score_end, max_new_tokens,
            stop_ids=, window=)``: a greedy answer whose prefill also yields the rows
            :meth:`Engine.iter_logprobs` gives for a span of the prompt (long-context suites
            score the document tail in the answer's prefill: one prefill per item and depth);
            without it they score with :meth:`Engine.iter_logprobs` and then generate.
    """
    score: bool = True
    generate: bool = True
    batch: bool = False
    memory_counter: Literal["torch", "process", "server"] = "torch"
    kv_bytes: bool = True
    lm_eval: bool = False
    scored_generate: bool = False


@dataclass
class EngineOptions:
    """How a tier asks an engine to open its artifact.

    Attributes:
        device: "cpu" or "cuda" (resolved).
        dtype: source dtype name ("bfloat16").
        threads: CPU threads for engines that take a count (llama.cpp).
        kv_cache: "model" (the engine's default) or "int8".
        flash_attn: True/False, or None for the engine's default.
        trust_remote_code: from the recipe.
        backend: a label for the kernel that runs the weights (None: the engine's own).
        decode: the transformers engine's timed decode loop (``auto``, ``eager``, ``static``;
            :func:`qeval.engines.hf.resolve_decode_mode`); other engines have one loop.
        kv_residual: the transformers engine's int8 KV cache: tokens kept in full precision
            and its re-quantization period (None: transformers' default, 128).
        server: for engines that reach a model over HTTP (``openai``): the tier's
            ``endpoint`` or ``serve`` settings, ``log`` (the server log's path),
            ``tokenizer`` (the source folder), ``depth_text`` and ``depths`` (the depth
            prompts whose token counts the engine checks against the server's), ``tokens``
            (sequence lengths the server must hold); None for in-process engines.
    """
    device: str
    dtype: str = "bfloat16"
    threads: int = 1
    kv_cache: str = "model"
    flash_attn: bool | None = None
    trust_remote_code: bool = False
    backend: str | None = None
    decode: str = "auto"
    kv_residual: int | None = None
    server: dict | None = None


class Engine(Protocol):
    """A loaded model that qeval measures.

    Attributes:
        name: the registry name (``hf``, ``llamacpp``); the recipe's ``engine:``.
        formats: artifact formats :meth:`open` takes (``hf``: a transformers checkpoint
            folder; ``gguf``: a folder holding one GGUF file, or the file).
        capabilities: what the engine can do (:class:`Capabilities`).
        backend: the kernel/backend that runs the weights (e.g. ``torch-bf16``, ``torchao-int8``).
        device: where the weights run ("cpu" or "cuda"; may differ from the one asked for).
        flash_attn: whether flash attention is on (None: the engine has no such switch).
        vocab_size: width of the distributions :meth:`iter_logprobs` yields.
        decode_mode: the timed decode loop as run (``eager``/``static``; None: one loop only).
        decode_note: why a decode is slow or fell back (None: nothing to say).
        sampling: ``{"decode": "argmax", "ignored_file_defaults": {...}}``: the model's
            sampling defaults qeval set aside.
        kv_requant_period: tokens between re-quantizations of a quantized KV cache (None:
            never re-quantized), so the speed sweep times whole periods.
        score_topk: optional; k when :meth:`iter_logprobs` rows hold only a server's top-k
            (the fidelity KLD is then the top-k estimate, :mod:`qeval.measure.fidelity`);
            absent or None: the full vocabulary.
        last_cache_bytes: bytes of the KV cache the last :meth:`generate` filled
            (:attr:`Capabilities.kv_bytes`).
        last_cache_allocated_bytes: see :attr:`Capabilities.kv_bytes` (bytes; None: as held).
    """
    name: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]
    capabilities: ClassVar[Capabilities]
    backend: str
    device: str
    flash_attn: bool | None
    vocab_size: int
    decode_mode: str | None
    decode_note: str | None
    sampling: dict | None
    kv_requant_period: int | None
    last_cache_bytes: int | None
    last_cache_allocated_bytes: int | None

    @classmethod
    def warm_runtime(cls, source_path: str, options: EngineOptions) -> dict:
        """Import and warm the libraries this engine runs on, without loading a model (the
        measure stage's memory baseline is taken after it: :func:`qeval.worker.stage_measure`).
        ``source_path`` is the source checkpoint folder (its config picks the modeling code).

        Returns:
            ``{"libraries": ["name version", ...], ...}``: what was imported.
        """
        ...

    @classmethod
    def open(cls, fmt: str, path: Path, options: EngineOptions) -> "Engine":
        """Load the artifact at ``path`` (format ``fmt``, one of :attr:`formats`).

        Raises:
            ValueError: a format this engine does not open.
        """
        ...

    def iter_logprobs(self, token_ids: Sequence[int], window: int = 256,
                      first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Teacher-forced next-token log-probabilities over the full vocabulary.

        Yields ``(start, logp)`` where ``logp`` has shape ``[m, vocab]`` (float32, natural
        log) and row ``j`` is the distribution of token ``start + j + 1`` given tokens
        ``0 .. start + j``. Windows of at most ``window`` positions bound memory: a long
        sequence never holds logits for every position at once. Covers positions
        ``first .. len(token_ids) - 2`` (earlier positions only fill the KV cache).
        """
        ...

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy decoding from ``prompt_ids`` with per-token timings (seconds)."""
        ...

    def attention_info(self, prompt_ids: Sequence[int]) -> dict:
        """The attention path and KV cache type that run, as seen over a short ``prompt_ids``.

        Returns:
            ``{"engine": str, "implementation": str, "flash_attn": bool, "kv_cache_dtype":
            str, ...engine extras (kernels seen, KV types of K and V)}``.
        """
        ...

    def kv_bytes_per_token(self, depth: int = 64) -> float:
        """KV cache bytes per token, measured by filling a cache with ``depth`` tokens."""
        ...

    def memory(self) -> MemoryInfo:
        """Weight bytes and KV bytes per token."""
        ...

    def close(self) -> None:
        """Release the model."""
        ...


def greedy_loop(prefill: "Callable[[], int]", step: "Callable[[int], int]", max_new_tokens: int,
                stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
    """The timed greedy loop every engine shares.

    Args:
        prefill: runs the prompt, returns the first new token id.
        step: feeds one token, returns the next token id.
    Returns:
        :class:`Generation` with each token's time (seconds since the call) taken when the
        token id is known on the host.
    """
    stop = set(int(s) for s in stop_ids)
    toks: list[int] = []
    times: list[float] = []
    finished = False
    t0 = time.perf_counter()
    tok = prefill()
    times.append(time.perf_counter() - t0)
    toks.append(tok)
    while True:
        if not ignore_stop and tok in stop:
            finished = True
            break
        if len(toks) >= max_new_tokens:
            break
        tok = step(tok)
        times.append(time.perf_counter() - t0)
        toks.append(tok)
    return Generation(toks, times[0], times, finished)


def score(engine: Engine, token_ids: Sequence[int], window: int = 256) -> np.ndarray:
    """Log-probability (nats) of each actual next token, shape ``[len(token_ids) - 1]``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.empty(max(len(ids) - 1, 0), dtype=np.float64)
    for start, logp in engine.iter_logprobs(token_ids, window):  # first=0: every position
        m = logp.shape[0]
        out[start:start + m] = logp[np.arange(m), ids[start + 1:start + 1 + m]]
    return out
