"""What every managed server shares: the recipe settings all servers take, the contract
a server module implements (:class:`ServerKind`), the wire dialect it speaks
(:class:`Dialect`), the server process (:class:`ManagedServer`), its KV pool's state
(:class:`PoolState`) and the memory of its process tree.

A managed server:

* listens on a free port of 127.0.0.1 (the kernel picks it: ``bind(("127.0.0.1", 0))``);
* is ready when its health route answers 200 (:attr:`ServerKind.health_path`), polled
  every 0.25 s; a process that exits first, or a timeout, is an error naming the log and
  carrying its last lines;
* writes its output to ``logs/<tier>.server.log`` of the run folder
  (:meth:`qeval.results.RunLayout.log`), appended per start, each start headed by the
  command line;
* is a child of the stage process, in its process group (a stage timeout kills the group)
  and with ``PR_SET_PDEATHSIG`` (a killed stage takes its server with it); it is stopped
  (SIGTERM, then SIGKILL after 10 s) and reaped when the engine closes, at interpreter
  exit, or when the stage fails;
* is measured from before it starts: its memory counter takes its baseline before the
  process exists and sums over the server's whole process tree (vLLM's GPU memory is in
  its ``EngineCore`` child, not in the ``vllm serve`` process): psutil's RSS of the root
  and ``children(recursive=True)`` on the CPU; on CUDA NVML's per-process figures for
  every pid of the tree, summed (device-wide use less the baseline only while NVML lists
  none of them: :mod:`qeval.measure.nvml`).
"""
from __future__ import annotations

import atexit
import json
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...osutil import die_with_parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- recipe settings -----------------------------------------------------------------------

#: Names an endpoint's ``dialect:`` may take: filled by the registry
#: (:func:`qeval.engines.servers.dialect_names`) as the package is imported, before any recipe
#: is read (this module cannot import the registry, which imports it).
DIALECT_NAMES: set[str] = set()


class EndpointSpec(_Strict):
    """A server that already runs (a staging server, a release CI's target).

    Attributes:
        url: the server's base URL (``http://host:port``, with or without ``/v1``).
        api_key_env: the environment variable holding its API key (the key itself is
            never in a recipe, ``run.json`` or a log); None: no key.
        model: the model name sent in requests; None: the first of ``GET /v1/models``
            (Ollama: the name ``ollama list`` shows, from ``GET /api/tags``).
        timeout_s: seconds one request may take.
        dialect: the server's wire dialect by name (a registered one:
            :func:`qeval.engines.servers.dialect_names`; ``ollama`` is Ollama's native
            API, :mod:`qeval.engines.servers.ollama`); None: from ``owned_by`` of
            ``GET /v1/models``.
    """
    url: str
    api_key_env: str | None = Field(None, description="environment variable with the API key (never the key)")
    model: str | None = None
    timeout_s: float = Field(600.0, gt=0)
    dialect: str | None = Field(None, description="the server's wire dialect (ollama: Ollama's native /api/chat and "
                                "/api/generate; llama.cpp, vllm, sglang, openai); default: from GET /v1/models")

    @field_validator("dialect")
    @classmethod
    def _dialect(cls, v: str | None) -> str | None:
        if v is not None and v not in DIALECT_NAMES:
            raise ValueError(f"unknown dialect {v!r} (known: {', '.join(sorted(DIALECT_NAMES))})")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError(f"endpoint url {v!r} must start with http:// or https://")
        return v[:-3] if v.endswith("/v1") else v

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and (not v or not all(c.isalnum() or c == "_" for c in v) or v[0].isdigit()):
            raise ValueError(f"api_key_env {v!r} must be an environment variable name (the key stays out of "
                             "the recipe)")
        return v


class ServeOptions(_Strict):
    """The settings every managed server takes (a server module's options class adds its
    own and narrows ``kind`` to its name: the recipe's ``serve:`` is discriminated by it).

    Attributes:
        kind: the server (``llama-server``, ``vllm``, ``sglang``).
        parallel: concurrent sequences the server batches (its own flag: llama-server
            ``--parallel`` slots, vLLM ``--max-num-seqs``, SGLang ``--max-running-requests``);
            None: the recipe's largest ``load.concurrency``.
        ctx_size: the KV the server holds, in tokens, given to the server's own flag (the
            server module says which and what it means there); None: from the recipe's
            sequences (:meth:`ServerKind.context_tokens`).
        startup_timeout_s: seconds for the server to answer its health route.
        args: extra command-line arguments, appended as they are.
    """
    kind: str
    parallel: int | None = Field(None, gt=0)
    ctx_size: int | None = Field(None, gt=0)
    startup_timeout_s: float = Field(600.0, gt=0)
    args: list[str] = Field(default_factory=list)


# ---- the wire ------------------------------------------------------------------------------

class Dialect:
    """How one server family extends ``/v1/completions``: the request fields that make it
    greedy and return token ids, and where a chunk carries them. This base is a server
    that is none of the known ones (plain OpenAI: no token ids, no top-k by id).

    Attributes:
        name: the dialect's name as rows show it (``llama.cpp``, ``vllm``, ``sglang``, ``openai``).
        owned_by: a lowercase substring of ``GET /v1/models``' ``owned_by`` that marks an
            endpoint as this server ("" for the base).
        logprobs: the server returns top-k log-probabilities keyed by token id (the
            fidelity stage can score through it).
    """
    name: ClassVar[str] = "openai"
    owned_by: ClassVar[str] = ""
    logprobs: ClassVar[bool] = False
    #: the server takes a prompt of token ids (Ollama's native API takes text or messages only)
    token_prompts: ClassVar[bool] = True
    #: a stream that ends without the dialect's last object was cut (Ollama's ``done: true``);
    #: SSE streams of the OpenAI servers are read to their end as they come
    requires_end: ClassVar[bool] = False
    #: where an answer's token count comes from when the server gives one (the row's ``token_counts``)
    usage_source: ClassVar[str] = "server usage"
    #: the route that lists the served models
    models_path: ClassVar[str] = "/v1/models"

    def extras(self, *, logprobs: int, cache_prompt: bool) -> dict:
        """Request fields beyond OpenAI's (greedy sampling, token ids, prompt caching)."""
        return {}

    def token_ids(self, chunk: dict) -> list[int]:
        """Token ids a completion chunk (or a whole answer) carries; [] when none."""
        return []

    def topk(self, chunk: dict) -> list[list[tuple[int, float]]]:
        """Per generated token, its top-k ``(token id, logprob)``; [] when not given by id."""
        return []

    def answer_ids(self, post: Callable[[str, dict], dict], prompt_ids: Sequence[int], max_new_tokens: int,
                   ignore_stop: bool) -> list[int] | None:
        """Every answer token id of a non-streamed request through the server's own route,
        or None to use ``/v1/completions`` (``post(path, body) -> JSON``)."""
        return None

    # -- the wire itself (the OpenAI servers: identity; a native dialect translates) --
    def route(self, path: str, body: dict, settings: dict | None = None) -> tuple[str, dict]:
        """The ``(path, body)`` actually sent for an OpenAI ``path`` and ``body``
        (``settings``: the tier's dialect settings, e.g. Ollama's ``num_ctx``)."""
        return path, body

    def read_line(self, line: str) -> tuple[dict | None, bool]:
        """One line of a streamed answer: ``(chunk or None, the stream's end)``. SSE: a
        ``data:`` line is a JSON chunk, ``data: [DONE]`` the end, any other line nothing."""
        if not line.startswith("data:"):
            return None, False
        data = line[5:].strip()
        if data == "[DONE]":
            return None, True
        return json.loads(data), False

    def answer(self, obj: Any) -> Any:
        """A non-streamed JSON answer as the engine reads it (the OpenAI shape)."""
        return obj

    def topk_text(self, chunk: dict) -> list[list[tuple[str, float]]]:
        """Per generated token, its top-k ``(token text, logprob)`` where the server gives
        them by text and not by id (Ollama); [] otherwise."""
        return []

    def model_names(self, answer: dict) -> list[tuple[str, str]]:
        """``(model id, owned_by)`` of every model in the answer of :attr:`models_path`."""
        return [(m.get("id"), str(m.get("owned_by") or "")) for m in answer.get("data") or [] if isinstance(m, dict)]

    def pick_model(self, base_url: str, model: str | None, names: Sequence[str]) -> str:
        """``model`` when served, else the first served (``model`` None).

        Raises:
            ValueError: none served, or ``model`` not among them (one line).
        """
        if not names:
            raise ValueError(f"{base_url} serves no model (GET {self.models_path} is empty)")
        if model is not None and model not in names:
            raise ValueError(f"{base_url} does not serve {model!r} (it serves {', '.join(map(str, names))})")
        return model or names[0]

    def refused(self, status: int, text: str, model: str | None) -> str | None:
        """One line for an HTTP error answer that says the endpoint is set up wrong (the
        tier's field to fix: a model not pulled), or None for any other."""
        return None


OPENAI = Dialect()


# ---- the KV pool ---------------------------------------------------------------------------

@dataclass
class PoolState:
    """A managed server's KV pool as the server reports it.

    Attributes:
        counters: the server's own figures (names as the server's ``/metrics`` or
            ``/slots`` give them; float).
        empty: no sequence holds KV cells and no request runs or waits.
        why: when not empty, what holds the pool (one line).
    """
    counters: dict[str, float] = field(default_factory=dict)
    empty: bool = True
    why: str = ""


class PoolNotCleared(RuntimeError):
    """A managed server's KV pool was not empty at the start of a timed phase (one line:
    the tier, the server, the phase and what held the pool)."""


def parse_prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """``{name: value}`` for the metric ``names`` in a Prometheus text exposition (the
    samples of a name summed over its label sets). prometheus_client's parser was checked:
    it is not a qeval dependency, and only these few gauge and counter lines are read."""
    want = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        name = head.split("{", 1)[0]
        if "{" in head and "}" not in head:  # a label value with a space: the name is before "{"
            rest = line.split("} ", 1)[-1]
        if name in want:
            try:
                out[name] = out.get(name, 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                pass
    return out


# ---- a server module's contract --------------------------------------------------------------

@dataclass
class Launch:
    """What a server's command is built from (besides its options).

    Attributes:
        artifact: the tier's artifact (a folder, or a GGUF folder or file).
        fmt: its format (``gguf``, ``hf``, ``gptqmodel``).
        port: the port to listen on (127.0.0.1).
        threads: CPU threads (servers that take a count).
        parallel: concurrent sequences.
        tokens: ``sequence`` (the longest sequence), ``load_sequence`` (one load request)
            and ``model`` (the model's context), tokens.
        kv_cache: ``model`` or ``int8``.
        flash_attn: True/False, or None for the server's default.
        device: ``cpu`` or ``cuda``.
        tokenizer: the source checkpoint folder (its tokenizer).
        scratch: a private folder the server may write to (removed with it).
        served_name: the model name the server answers to.
        prefix_caching: keep a prefix cache across requests (a load stage whose requests share
            a reused system prompt); servers that always keep one ignore it.
    """
    artifact: Path
    fmt: str
    port: int
    threads: int = 1
    parallel: int = 1
    tokens: dict = field(default_factory=dict)
    kv_cache: str = "model"
    flash_attn: bool | None = None
    device: str = "cpu"
    tokenizer: str | None = None
    scratch: Path | None = None
    served_name: str = "qeval"
    prefix_caching: bool = False


class ServerKind:
    """A managed server: one module of :mod:`qeval.engines.servers` defines a subclass and
    names it ``SERVER``.

    Attributes:
        kind: the name the recipe's ``serve: {kind: ...}`` uses.
        label: the name in messages (``vLLM``).
        options: the pydantic class of its recipe settings (``kind: Literal[<kind>]``).
        formats: the artifact formats it serves.
        devices: the devices it runs on.
        health_path: the route that answers 200 once the model is loaded.
        dialect: its wire dialect (:class:`Dialect`).
    """
    kind: ClassVar[str] = ""
    label: ClassVar[str] = ""
    options: ClassVar[type[ServeOptions]] = ServeOptions
    formats: ClassVar[tuple[str, ...]] = ()
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    health_path: ClassVar[str] = "/health"
    dialect: ClassVar[Dialect] = OPENAI

    @classmethod
    def check(cls, fmt: str | None, device: str | None) -> str | None:
        """Why this server cannot serve an artifact of ``fmt`` on ``device`` (one line), or
        None; an unknown format or device (``auto``) is not held against it."""
        if fmt is not None and fmt not in cls.formats:
            return f"{cls.label} serves {', '.join(cls.formats)} artifacts, not {fmt}"
        if device is not None and device != "auto" and device not in cls.devices:
            return (f"{cls.label} serves on {' or '.join(d.upper() for d in cls.devices)} only and this stage "
                    f"runs on {device}")
        return None

    @classmethod
    def binary(cls) -> str:
        """The server's executable.

        Raises:
            TierUnavailable: not installed (what to install, one line).
        """
        raise NotImplementedError

    @classmethod
    def context_tokens(cls, opts: ServeOptions, launch: Launch) -> int:
        """The KV the server is started with, in tokens of its own context flag: the
        recipe's ``ctx_size`` when set, else the longest sequence rounded up to 256 (at
        most the model's context)."""
        return opts.ctx_size or round_ctx(int(launch.tokens.get("sequence") or 2048), launch.tokens.get("model"))

    @classmethod
    def command(cls, binary: str, opts: ServeOptions, launch: Launch) -> list[str]:
        """The command line that starts the server on ``launch.artifact``."""
        raise NotImplementedError

    @classmethod
    def env(cls, opts: ServeOptions) -> dict[str, str]:
        """Environment variables the server needs beyond this process's."""
        return {}

    @classmethod
    def attention(cls, opts: ServeOptions, launch: Launch) -> dict:
        """The attention path as the command sets it: ``flash_attn`` (bool or None: not
        visible) and ``kv_cache_dtype`` (str or None)."""
        return {"flash_attn": None, "kv_cache_dtype": None}

    @classmethod
    def clear_pool(cls, http: Any, parallel: int) -> str:
        """Empty the server's KV pool through its own API (``http``: an ``httpx.Client`` on
        the server's URL) and return what was done (the row's ``cleared_by``).

        Raises:
            NotImplementedError: the server has no such API (the engine restarts it).
            RuntimeError: the server refused (its answer, cut to 200 characters).
        """
        raise NotImplementedError

    @classmethod
    def pool_state(cls, http: Any) -> PoolState:
        """The pool's state from the server's own counters.

        Raises:
            RuntimeError: the server did not answer its counter route.
        """
        return PoolState()


# ---- a managed server process ----------------------------------------------------------------

class ServerFailed(RuntimeError):
    """A managed server did not start, or died: one line, then the server log's last lines
    in :attr:`log_tail`."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def round_ctx(n: int, cap: int | None = None) -> int:
    """``n`` tokens rounded up to 256 (llama.cpp pads contexts to 256 cells), at most ``cap``
    (the model's context) when given."""
    n = -(-max(int(n), 1) // 256) * 256
    return min(n, int(cap)) if cap else n


_LIVE: "set[ManagedServer]" = set()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter exit
    for s in list(_LIVE):
        s.stop()


class ManagedServer:
    """A server process qeval started, its log, its readiness and its memory counter.

    Args:
        cmd: the command line (its port already in it).
        port: the port it listens on (127.0.0.1).
        log_path: the file its stdout and stderr go to (appended).
        name: for messages (``llama-server``, ``vllm``).
        health_path: the route that answers 200 once the model is loaded.
        env: its environment (default: this process's).
        device: ``cpu`` or ``cuda``: which memory counter :meth:`start` creates.
        nvml: a ``pynvml``-like module for the CUDA counter (tests pass a fake).

    Attributes:
        memory: the peak-memory counter of the server's process tree, created by
            :meth:`start` *before* the process (:func:`tree_memory_counter`); None before.
    """

    def __init__(self, cmd: Sequence[str], *, port: int, log_path: Path, name: str,
                 health_path: str = "/health", env: dict | None = None, device: str = "cpu",
                 nvml: Any = None) -> None:
        self.cmd = [str(c) for c in cmd]
        self.port = int(port)
        self.log_path = Path(log_path)
        self.name = name
        self.health_path = health_path
        self.env = env
        self.device = device
        self.nvml = nvml
        self.proc: subprocess.Popen | None = None
        self.memory: Any = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 600.0) -> "ManagedServer":
        """Start the memory counter, then the process, and wait until its health route
        answers 200.

        Raises:
            ServerFailed: the executable is missing, the process exited before it was
                ready, or it was not ready within ``timeout_s`` (then it is stopped).
            TierUnavailable: CUDA without NVML (the memory counter; what to install).
        """
        import httpx  # start-up time: only served tiers talk HTTP
        if self.memory is None:  # the baseline before the process exists
            self.memory = tree_memory_counter(lambda: self.pid, self.device, nvml=self.nvml)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as lf:
            lf.write(f"--- {datetime.now(timezone.utc).isoformat()} {' '.join(self.cmd)}\n".encode())
            lf.flush()
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env, preexec_fn=die_with_parent)
            except OSError as e:
                raise ServerFailed(f"cannot start {self.name} ({self.cmd[0]}): {e.strerror or e}") from None
        _LIVE.add(self)
        t0 = time.monotonic()
        with httpx.Client(timeout=2.0) as c:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    _LIVE.discard(self)
                    raise ServerFailed(f"{self.name} exited with code {rc} before it was ready "
                                       f"(log: {self.log_path})", self.tail())
                try:
                    if c.get(self.url + self.health_path).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout_s:
                    self.stop()
                    raise ServerFailed(f"{self.name} did not answer {self.health_path} within {timeout_s:.0f} s "
                                       f"(log: {self.log_path})", self.tail())
                time.sleep(0.25)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self) -> ServerFailed | None:
        """A :class:`ServerFailed` saying how the process ended, or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        rc = self.proc.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.Signals._value2member_map_ \
            else f"exited with code {rc}"
        return ServerFailed(f"{self.name} (pid {self.proc.pid}) {how} mid-stage (log: {self.log_path})", self.tail())

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, keep_counter: bool = False) -> None:
        """SIGTERM, SIGKILL after 10 s, and reap (no zombie); the memory counter stops too
        unless ``keep_counter`` (a restart keeps one window). Idempotent."""
        p = self.proc
        _LIVE.discard(self)
        if not keep_counter and self.memory is not None:
            self.memory.close()
        if p is None:
            return
        if p.poll() is None:
            try:
                p.terminate()
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            except ProcessLookupError:
                pass
        else:
            p.wait()


# ---- memory of a server's process tree ---------------------------------------------------------

def tree_pids(root: int | None) -> list[int]:
    """The pid ``root`` and every descendant's (psutil ``children(recursive=True)``); []
    when ``root`` is None or gone."""
    import psutil  # start-up time: only served tiers look at another process tree
    if root is None:
        return []
    try:
        p = psutil.Process(int(root))
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


class TreeRss:
    """Peak resident memory of a server's process tree (bytes), sampled every
    ``interval_s`` in a thread: psutil's ``memory_info().rss`` of the root and every
    descendant, summed (/proc's VmHWM cannot be reset from outside a process and misses
    children). Created before the server starts, so its first window covers the load.
    The counter API of :class:`qeval.measure.memory.PeakMemory`: ``reset``, ``read``,
    ``reserved_unallocated``, ``close``, ``kind``.

    Args:
        root: ``() -> pid`` of the tree's root (None until the process exists).
        interval_s: seconds between samples.

    Attributes:
        baseline: bytes of the tree before the server started (0: no process yet), taken
            at creation and subtracted from every figure.
        baseline_pids: the pids seen at creation (``[]`` when created before the start).
    """
    kind = "server_rss_sampled"

    def __init__(self, root: Callable[[], int | None], interval_s: float = 0.01) -> None:
        import psutil  # start-up time: only served tiers sample another process
        self._psutil = psutil
        self._root = root
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self.baseline_pids = tree_pids(root())
        self.baseline = self._sample()
        self._peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qeval-server-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for pid in tree_pids(self._root()):
            try:
                total += int(self._psutil.Process(pid).memory_info().rss)
            except self._psutil.Error:
                pass
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            v = self._sample()
            with self._lock:
                self._peak = max(self._peak, v)

    def reset(self) -> None:
        """Start a new window: its peak starts at the memory in use now."""
        v = self._sample()
        with self._lock:
            self._peak = v

    def read(self) -> int:
        """Peak bytes of the window, less the baseline."""
        v = self._sample()
        with self._lock:
            self._peak = max(self._peak, v)
            return max(self._peak - self.baseline, 0)

    def reserved_unallocated(self) -> None:
        """No allocator to ask outside the process: None (the counter API of PeakMemory)."""
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def tree_memory_counter(root: Callable[[], int | None], device: str, nvml: Any = None) -> Any:
    """The peak-memory counter of a managed server, to create before it starts:
    :class:`TreeRss` on the CPU; on CUDA :class:`qeval.measure.nvml.NvmlMemory` summing
    NVML's per-process figures over the tree's pids (device-wide less the baseline only
    while NVML lists none of them).

    Raises:
        TierUnavailable: CUDA without NVML (what to install).
    """
    if device == "cuda":
        from ...measure.nvml import NvmlMemory  # start-up time: NVML only on CUDA
        return NvmlMemory(pids=lambda: tree_pids(root()), nvml=nvml)
    return TreeRss(root)
