"""Speculative decoding on llama.cpp: one GGUF tier as the draft of another, through
llama-server's draft model (``-md DRAFT.gguf``), measured with the figures of
:mod:`qeval.measure.speculative` (:class:`~qeval.measure.speculative.SpeculativeRun`,
:class:`~qeval.measure.speculative.PairRuns`).

What was checked, and where (llama-cpp-python 0.3.36 and its vendored llama.cpp, the source
:func:`qeval.engines.llama_tools.source_dir` holds once :func:`qeval.engines.llama_tools.ensure_source`
has fetched it):

* llama-cpp-python's own draft interface takes no draft *model*: ``llama_cpp/llama_speculative.py``
  holds ``LlamaDraftModel``, an abstract ``__call__(input_ids) -> draft ids``, and its only
  implementation ``LlamaPromptLookupDecoding`` (n-gram lookup in the prompt, no model);
  ``Llama.generate`` appends whatever the callable returns and verifies it in its Python
  loop, with no drafted/accepted counters. A model-backed draft would be a second ``Llama``
  with its own KV cache kept in step by hand, written here. llama-server's draft model is
  llama.cpp's own loop, so it is used instead.
* ``common/arg.cpp``: in this llama.cpp the draft-model options are ``-md``/``--spec-draft-model``,
  ``--spec-draft-n-max``, ``--spec-draft-n-min``, ``--spec-draft-p-min`` (alias ``--draft-p-min``),
  ``-td``/``--spec-draft-threads``, ``-tbd``/``--spec-draft-threads-batch``, ``-devd``,
  ``-ngld``, ``-ctkd``/``-ctvd``; ``--draft-max``/``--draft-min`` are *removed* (they exit
  with "the argument has been removed"), and there is no ``-cd``/``--ctx-size-draft``: the
  draft context holds as many tokens per sequence as the target's
  (``common/speculative.cpp``, ``common_speculative_init_result``: ``cparams.n_ctx =
  llama_n_ctx(ctx_tgt)``). ``-md`` alone loads the draft but drafts nothing: the speculative
  types default to ``none`` and ``draft-simple`` (a standalone draft model) is used only when
  named, ``--spec-type draft-simple`` (``common_speculative_init`` adds an implementation per
  listed type). :func:`speculative_server` checks ``GET /slots``' ``speculative`` flag after
  the start.
* ``tools/server/server-schema.cpp``: the per-request ``speculative.n_max``, ``n_min`` and
  ``p_min`` fields are compiled out (``#if 0``, "disable speculative parameter adjustments
  for now"): a request can neither set k nor switch drafting off. So one server runs per
  draft length k (``--spec-draft-n-min k --spec-draft-n-max k --draft-p-min 0``: the k asked
  is the k drafted, no confidence cut-off), and the target alone runs on a server without
  ``-md``; the servers run one after another, never two at once.
* ``tools/server/server-context.cpp``: a step drafts ``min(k, n_ctx - tokens - 2, tokens
  still to generate - 1)`` and ``draft-simple`` drops a draft shorter than ``n_min``
  (``common/speculative.cpp``), so near the answer's end the last steps draft nothing;
  ``slot.stats.n_draft_tokens`` counts the tokens drafted, ``n_draft_accepted`` those the
  target kept, and ``server_slot_stats::to_json`` (``tools/server/server-common.cpp``) puts
  them in the answer's ``timings`` as ``draft_n`` and ``draft_n_accepted`` (left out when
  nothing was drafted: 0 here), beside ``prompt_ms`` and ``predicted_ms``. The draft model
  picks its top token (a top-k 10 sampler, ``data[0]``), the target verifies greedily
  (``common_sampler_sample_and_accept_n`` with the request's temperature 0).

Lossless at greedy, up to rounding (measured here, CPU, zen4 kernels): the speculative answer is
the target's own greedy answer token for token until a position where the target's top two
logits are within a rounding error of each other; there the verification batch (k + 1 rows
through the target at once) and the alone server's one-token decode take different kernel
paths, may pick different tokens, and the answers part from there on. Seen with SmolLM2-135M
Q8_0 (from the BF16 checkpoint) as target and its Q4_K_M as draft, 256-token prompts: the
first difference at margins of 0.104 and 0.001 nats, the same position for every k, the
speculative token being the argmax of the target's logits recomputed in one batch; the
target as its own draft accepts 17 of 18 drafted tokens, not all, for the same reason (the
draft decodes one token at a time). :func:`first_divergence` says where and how close.

Each request is the existing llama-server dialect's own
(:meth:`qeval.engines.servers.llama_server.LlamaDialect.answer_ids`: native ``/completion``,
the prompt as token ids, ``temperature 0``, ``top_k 1``, ``n_predict`` new tokens,
``ignore_eos``, ``cache_prompt: false``, ``return_tokens``), sent through
:class:`qeval.engines.openai.Client`; the servers are :class:`~qeval.engines.servers.base.ManagedServer`
processes on :func:`~qeval.engines.servers.llama_server.llama_server_command` plus the draft
flags. Sources: llama.cpp's ``tools/server/README.md`` (the draft options) and the files
named above; Leviathan et al. 2023 (arXiv:2211.17192) for the method.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from numbers import Integral
from pathlib import Path
from typing import Any, Sequence

from ..measure.speculative import PairRuns, SpeculativeRun
from .gguf_convert import llama_cpp_version
from .llama_tools import tool_path
from .llamacpp import default_flash_attn, gguf_file
from .openai import Client
from .servers.base import ManagedServer, ServerFailed, free_port
from .servers.llama_server import LlamaDialect, llama_server_command

#: Positions before a divergence at which :func:`first_divergence` compares the target's own
#: two passes (the whole sequence in one batch against one token at a time): their largest
#: logit difference is the noise of the target's own kernel paths there.
PATH_NOISE_TOKENS = 8

#: Tokens of the untimed warm-up request each server answers before its timed ones.
WARMUP_TOKENS = 4


def draft_args(draft_gguf: str | Path, k: int, *, threads: int, device: str = "cpu",
               kv_cache: str = "model") -> list[str]:
    """llama-server's draft-model flags (module notes): ``-md`` with ``--spec-type
    draft-simple``, exactly ``k`` tokens drafted per step (``--spec-draft-n-min k
    --spec-draft-n-max k --draft-p-min 0``), the draft's threads, on CUDA every draft layer
    on the GPU (``-ngld 999``), with the int8 KV cache the draft's cache ``q8_0`` too."""
    out = ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(int(k)),
           "--spec-draft-n-min", str(int(k)), "--draft-p-min", "0", "-td", str(threads), "-tbd", str(threads)]
    if device == "cuda":
        out += ["-ngld", "999"]
    if kv_cache == "int8":
        out += ["-ctkd", "q8_0", "-ctvd", "q8_0"]
    return out


def _gguf(what: str, path: str | Path) -> Path:
    """``path`` when it is a file, the single ``*.gguf`` file in it when it is a folder (a GGUF
    tier's artifact), else ValueError (one line)."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        try:
            return gguf_file(p)
        except RuntimeError as e:
            raise ValueError(f"{what} GGUF: {e}") from None
    raise ValueError(f"{what} GGUF {p}: no such file")


def _check(prompts: Sequence[Sequence[int]], draft_tokens: Sequence[int], new_tokens: int, threads: int,
           ctx_size: int, device: str, kv_cache: str) -> list[int]:
    """The draft lengths to run (in the order given, each once), or ValueError (one line)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: at least one prompt, each of at least one token id")
    if any(isinstance(t, bool) or not isinstance(t, Integral) or t < 0 for p in prompts for t in p):
        raise ValueError("prompts: token ids must be whole numbers >= 0")
    ks = list(dict.fromkeys(draft_tokens or []))
    if not ks or any(isinstance(k, bool) or not isinstance(k, Integral) or k < 1 for k in ks):
        raise ValueError(f"draft_tokens {list(draft_tokens)}: at least one, each a whole number >= 1")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, Integral) or new_tokens < 2:
        raise ValueError(f"new_tokens {new_tokens}: at least 2 (a step drafts at most the tokens left - 1)")
    for name, v in (("threads", threads), ("ctx_size", ctx_size)):
        if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
            raise ValueError(f"{name} {v!r}: a whole number >= 1")
    need = max(len(p) for p in prompts) + new_tokens + max(ks) + 2
    if ctx_size < need:
        raise ValueError(f"ctx_size {ctx_size}: the longest prompt + new_tokens + the largest k + 2 need {need}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: cpu or cuda")
    if kv_cache not in ("model", "int8"):
        raise ValueError(f"kv_cache {kv_cache!r}: model or int8")
    return [int(k) for k in ks]


class _Served:
    """One llama-server on ``cmd``'s model(s), started at entry, stopped at exit; :meth:`answer`
    is one timed greedy request."""

    def __init__(self, cmd: list[str], port: int, log: Path, device: str, timeout_s: float) -> None:
        self.server = ManagedServer(cmd, port=port, log_path=log, name="llama-server", device=device)
        self.timeout_s = timeout_s
        self.client: Client | None = None
        self.wire = LlamaDialect()
        self.peak_bytes: int | None = None

    def __enter__(self) -> "_Served":
        try:
            self.server.start(self.timeout_s)
        except BaseException:
            self.server.stop()  # the memory counter's thread too
            raise
        self.client = Client(self.server.url, timeout_s=self.timeout_s)
        self.client.wire = self.wire
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.server.memory is not None and self.server.alive():
                self.peak_bytes = int(self.server.memory.read())
        finally:
            if self.client is not None:
                self.client.close()
            self.server.stop()

    def get(self, path: str) -> Any:
        r = self.client.http.get(path)
        r.raise_for_status()
        return r.json()

    def answer(self, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], dict, float]:
        """``(token ids, the answer's timings, wall seconds of the request)``.

        Raises:
            ServerFailed: the server died during the request.
            RuntimeError: the server refused, or answered another number of tokens.
        """
        got: dict = {}

        def post(path: str, body: dict) -> dict:
            got.update(self.client.post(path, body))
            return got

        t0 = time.perf_counter()
        try:
            ids = self.wire.answer_ids(post, prompt, new_tokens, True)
        except Exception:
            try:  # a connection cut by a dying server is seen before its exit status: wait for it
                self.server.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - still running: the error is the server's answer
                pass
            died = self.server.died()
            if died is not None:
                raise died from None
            raise
        seconds = time.perf_counter() - t0
        if len(ids) != new_tokens:
            raise RuntimeError(f"llama-server answered {len(ids)} tokens, {new_tokens} asked (ignore_eos set)")
        return ids, dict(got.get("timings") or {}), seconds


def speculative_server(target_gguf: Path, draft_gguf: Path, prompts: list[list[int]], draft_tokens: list[int],
                       new_tokens: int, *, threads: int, ctx_size: int, device: str = "cpu",
                       kv_cache: str = "model", log_dir: Path | None = None,
                       startup_timeout_s: float = 600.0) -> PairRuns:
    """Speculative decoding of ``target_gguf`` with ``draft_gguf`` as its draft on llama-server,
    greedy, end of sequence ignored (exactly ``new_tokens`` new tokens per answer).

    Per prompt, the target alone (a server without ``-md``), then for each ``k`` of
    ``draft_tokens`` the same request on a server started with the draft proposing exactly ``k``
    tokens per step (module notes: one server per k, one after another; each answers one
    untimed warm-up request of :data:`WARMUP_TOKENS` tokens first). Each run is
    :meth:`SpeculativeRun.from_counts` of the answer's ``timings.draft_n`` (drafted) and
    ``draft_n_accepted`` (accepted), its wall time (seconds, the HTTP request) and ``ttft_s`` =
    ``timings.prompt_ms`` / 1000, a TTFT proxy (the server's prompt processing; the first
    token's sampling and the HTTP round trip are not in it); ``lossless`` compares with that
    prompt's alone answer.

    Args:
        target_gguf, draft_gguf: GGUF files of one tokenizer, or GGUF tiers' artifact folders
            holding one each (llama.cpp refuses a draft whose vocabulary differs: the server
            then fails to start).
        prompts: prompts as token ids (sent as they are: no BOS added).
        draft_tokens: the k values (>= 1), each run once in the order given.
        new_tokens: tokens per answer (>= 2).
        threads: CPU threads of target and draft (``-t``/``-tb``, ``-td``/``-tbd``).
        ctx_size: ``--ctx-size`` (tokens; the draft's context is the same): at least the
            longest prompt + ``new_tokens`` + the largest k + 2.
        device: ``cpu`` or ``cuda`` (every layer of both models on the GPU).
        kv_cache: ``model`` or ``int8`` (``q8_0`` K and V for both models, flash attention on).
        log_dir: where the servers' logs go (``alone.server.log``, ``k<k>.server.log``);
            default a temporary folder, removed unless a server failed.
        startup_timeout_s: seconds a server may take to answer ``/health``.

    Returns:
        :class:`PairRuns`: ``alone`` (``draft_tokens`` 0), ``runs`` ``{k: [run per prompt]}``,
        ``peak_bytes`` the largest peak RSS of a speculative server's process (both models
        loaded, their KV caches and the answers; bytes), ``memory_counter`` what it counts,
        ``how`` the command in words, ``details`` the llama.cpp build, the alone server's
        peak and the log folder.

    Raises:
        ValueError: a missing GGUF file (or a folder without exactly one), or a bad argument
            (one line).
        ServerFailed: a server did not start (its log's last lines in ``log_tail``) or died.
        RuntimeError: a server refused a request, answered another number of tokens, or
            started with ``-md`` and does not speculate; or llama-server is not built and
            building it failed (:func:`qeval.engines.llama_tools.tool_path`).
    """
    target_gguf, draft_gguf = _gguf("target", target_gguf), _gguf("draft", draft_gguf)
    ks = _check(prompts, draft_tokens, new_tokens, threads, ctx_size, device, kv_cache)
    binary = tool_path("llama-server", log=lambda m: print(f"[qeval] {m}", flush=True))
    fa = default_flash_attn(device, kv_cache)
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="qeval-spec-"))
    logs.mkdir(parents=True, exist_ok=True)
    warm = [int(t) for t in prompts[0][:16]]

    def serve(name: str, extra: list[str]) -> _Served:
        port = free_port()
        cmd = llama_server_command(binary, target_gguf, port=port, threads=threads, parallel=1, ctx_size=ctx_size,
                                   kv_cache=kv_cache, flash_attn=fa, device=device, args=extra)
        return _Served(cmd, port, logs / f"{name}.server.log", device, startup_timeout_s)

    failed = True
    try:
        build = None
        alone: list[SpeculativeRun] = []
        with serve("alone", []) as s:
            build = (s.get("/props") or {}).get("build_info")
            build = None if build is None or "unknown" in str(build) else build  # b0-unknown: built from the sdist
            s.answer(warm, WARMUP_TOKENS)
            for p in prompts:
                ids, tm, sec = s.answer(p, new_tokens)
                alone.append(SpeculativeRun.from_counts(
                    draft_tokens=0, token_ids=ids, drafted=0, accepted=0, seconds=sec,
                    ttft_s=_ttft(tm), details={"engine": "llama-server", "timings": tm}))
        alone_peak = s.peak_bytes
        runs: dict[int, list[SpeculativeRun]] = {}
        peaks: list[int] = []
        for k in ks:
            with serve(f"k{k}", draft_args(draft_gguf, k, threads=threads, device=device, kv_cache=kv_cache)) as s:
                slots = s.get("/slots")
                if not slots or not all(sl.get("speculative") for sl in slots):
                    raise RuntimeError(f"llama-server started with -md {draft_gguf.name} does not speculate "
                                       f"(GET /slots: speculative false; log {s.server.log_path})")
                s.answer(warm, WARMUP_TOKENS)
                out = []
                for p, ref in zip(prompts, alone):
                    ids, tm, sec = s.answer(p, new_tokens)
                    out.append(SpeculativeRun.from_counts(
                        draft_tokens=k, token_ids=ids, drafted=int(tm.get("draft_n") or 0),
                        accepted=int(tm.get("draft_n_accepted") or 0), seconds=sec, ttft_s=_ttft(tm),
                        reference_ids=ref.token_ids, details={"engine": "llama-server -md", "timings": tm}))
                runs[k] = out
            if s.peak_bytes is not None:
                peaks.append(s.peak_bytes)
        failed = False
    finally:
        if log_dir is None and not failed:
            shutil.rmtree(logs, ignore_errors=True)
    version = llama_cpp_version()
    return PairRuns(
        alone=alone, runs=runs, peak_bytes=max(peaks) if peaks else None,
        memory_counter="peak RSS of the llama-server process with target and draft loaded (psutil, sampled "
                       "every 10 ms, less the baseline before start)" if device == "cpu" else
                       "GPU memory of the llama-server process (NVML), target and draft loaded",
        how=(f"llama-server -m {target_gguf.name} -md {draft_gguf.name} (llama.cpp of llama-cpp-python {version}"
             f"{', build ' + str(build) if build else ''}), --spec-type draft-simple --spec-draft-n-min k "
             f"--spec-draft-n-max k --draft-p-min 0, one server per k; greedy (temperature 0, top_k 1), "
             f"ignore_eos, cache_prompt false, -t {threads}, -c {ctx_size}, flash attention "
             f"{'on' if fa else 'off'}; the target alone on a server without -md"),
        details={"llama_cpp_python": version, "build_info": build, "target_alone_peak_bytes": alone_peak,
                 "logs": None if log_dir is None else str(logs), "ttft": "timings.prompt_ms (a TTFT proxy)"})


def first_divergence(target_gguf: str | Path, prompt: Sequence[int], reference: Sequence[int],
                     answer: Sequence[int], *, threads: int = 1) -> dict | None:
    """Where ``answer`` first leaves ``reference`` (the target's own greedy answer to
    ``prompt``), and how close the target's choice was there: its logits at that position,
    recomputed by llama-cpp-python in one batch over the prompt and the reference answer
    (``logits_all``, flash attention off, every layer on the CPU). None when they are equal.

    A speculative answer is the target's greedy answer up to rounding (module notes): where
    the target's top two tokens are within a rounding error of each other, the verification
    batch and the one-token decode may pick different ones.

    The target's own two paths beside it: its logits computed twice, the prompt and the answer
    up to the divergence in one batch (as a verification step computes several tokens at
    once), and the prompt in one batch then the answer one token at a time (as the target alone
    decoded it); ``path_noise`` their largest difference over the last :data:`PATH_NOISE_TOKENS`
    answer positions
    over the vocabulary, and at the divergence the gap between the target-alone token and the
    speculative one in each pass (``gap_batch``, ``gap_single``: > 0 where the pass prefers
    the target-alone token). ``paths_disagree``: the two passes of the target itself pick
    different tokens there, so the answers part through the target's own numerics, not the
    draft (a tie, llama.cpp's quantized activations rounding differently in the two paths).

    Returns:
        ``{"position", "reference_token", "answer_token", "top2": [id, id], "top_logits",
        "margin", "gap_batch", "gap_single", "paths_disagree", "path_noise",
        "path_noise_positions"}`` (``margin``: the batch pass's top logit less its second,
        nats), or None.

    Raises:
        ValueError: ``answer`` and ``reference`` differ in length, or ``target_gguf`` is missing.
    """
    if len(answer) != len(reference):
        raise ValueError(f"answer of {len(answer)} tokens against a reference of {len(reference)}")
    target_gguf = _gguf("target", target_gguf)
    i = next((j for j, (a, b) in enumerate(zip(answer, reference)) if int(a) != int(b)), None)
    if i is None:
        return None
    import llama_cpp  # optional: the qeval[gguf] extra
    import numpy as np  # start-up time: only a divergent answer is looked at
    from .llamacpp import cpu_backend  # start-up time: llama-cpp-python loads only to look at a divergence
    cpu_backend()  # ggml's backends loaded as qeval loads them, before the model
    seq = [int(t) for t in prompt] + [int(t) for t in reference[:i]]
    n_ctx = -(-(len(seq) + 1) // 256) * 256
    tail = max(1, min(PATH_NOISE_TOKENS, i))  # rows compared: the divergence and the answer tokens before it

    def logits(one_by_one: int) -> np.ndarray:
        """Rows of the last ``tail`` positions: the whole sequence in one batch (0), or its
        last ``one_by_one`` tokens decoded one at a time after the rest in one batch."""
        llm = llama_cpp.Llama(model_path=str(target_gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                              n_threads=threads, n_threads_batch=threads, logits_all=True, flash_attn=False,
                              n_gpu_layers=0, verbose=False)
        try:
            llm.eval(seq[:len(seq) - one_by_one])
            for t in seq[len(seq) - one_by_one:]:
                llm.eval([t])
            return np.asarray(llm.scores[len(seq) - tail:len(seq)], dtype=np.float64)
        finally:
            llm.close()

    batch = logits(0)
    single = logits(i) if i > 0 else batch  # the prompt in one batch, the answer token by token: the alone path
    row = batch[-1]
    top = np.argsort(row)[::-1][:2]
    ref_t, ans_t = int(reference[i]), int(answer[i])
    gap_batch = float(batch[-1][ref_t] - batch[-1][ans_t])  # > 0: this pass keeps the target-alone token
    gap_single = float(single[-1][ref_t] - single[-1][ans_t])
    return {"position": i, "reference_token": ref_t, "answer_token": ans_t,
            "top2": [int(t) for t in top], "top_logits": [float(row[t]) for t in top],
            "margin": float(row[top[0]] - row[top[1]]),
            "gap_batch": gap_batch, "gap_single": gap_single,
            "paths_disagree": (gap_batch > 0) != (gap_single > 0),
            "path_noise": float(np.abs(batch - single).max()), "path_noise_positions": int(tail)}


def draft_agreement(draft_gguf: str | Path, prompt: Sequence[int], answer: Sequence[int], *,
                    threads: int = 1) -> list[bool]:
    """Teacher-forced agreement of the draft (a GGUF file, or an artifact folder holding one) with
    the target's own answer: ``out[j]`` is True
    where the draft's top token after the prompt and ``answer[:j]`` is ``answer[j]`` (its
    logits over the prompt and the answer in one batch, llama-cpp-python ``logits_all``, every
    layer on the CPU); the speculative stage's same-prompt prediction
    (:func:`qeval.measure.speculative.accepted_per_step`).

    Raises:
        ValueError: ``draft_gguf`` is missing, or an empty prompt or answer.
    """
    draft_gguf = _gguf("draft", draft_gguf)
    if not prompt or not answer:
        raise ValueError("a prompt and an answer of at least one token each")
    import llama_cpp  # optional: the qeval[gguf] extra
    import numpy as np  # start-up time: only a llama.cpp pair is looked at
    from .llamacpp import cpu_backend  # start-up time: llama-cpp-python loads only here
    cpu_backend()
    seq = [int(t) for t in prompt] + [int(t) for t in answer[:-1]]
    n_ctx = -(-(len(seq) + 1) // 256) * 256
    llm = llama_cpp.Llama(model_path=str(draft_gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, flash_attn=False, n_gpu_layers=0, verbose=False)
    try:
        llm.eval(seq)
        rows = np.asarray(llm.scores[len(prompt) - 1:len(seq)], dtype=np.float32)
    finally:
        llm.close()
    return [bool(int(t) == int(a)) for t, a in zip(rows.argmax(axis=1), answer)]


def _ttft(timings: dict) -> float | None:
    """``timings.prompt_ms`` in seconds (a TTFT proxy), None when absent."""
    ms = timings.get("prompt_ms")
    return float(ms) / 1000.0 if isinstance(ms, (int, float)) else None


__all__ = ["speculative_server", "draft_args", "draft_agreement", "first_divergence", "ServerFailed"]
