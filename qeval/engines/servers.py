"""OpenAI-compatible servers for the ``openai`` engine (:mod:`qeval.engines.openai`): the
recipe's ``endpoint:`` / ``serve:`` settings of a tier, the server processes qeval starts
as managed children (llama.cpp's ``llama-server``, vLLM's ``vllm serve``), and the peak
memory of such a process.

A managed server:

* listens on a free port of 127.0.0.1 (the kernel picks it: ``bind(("127.0.0.1", 0))``);
* is ready when its health route answers 200 (llama-server: ``GET /health``, 503 while the
  model loads; vLLM: ``GET /health``), polled every 0.25 s; a process that exits first, or
  a timeout, is an error naming the log and carrying its last lines;
* writes its output to ``logs/<tier>.server.log`` of the run folder
  (:meth:`qeval.results.RunLayout.log`), appended per start, each start headed by the
  command line;
* is a child of the stage process, in its process group (a stage timeout kills the group)
  and with ``PR_SET_PDEATHSIG`` (a killed stage takes its server with it); it is stopped
  (SIGTERM, then SIGKILL after 10 s) and reaped when the engine closes, at interpreter
  exit, or when the stage fails.

llama-server is built from the vendored llama.cpp of the installed llama-cpp-python
(:func:`qeval.engines.llama_tools.tool_path`, cached, the same portable flags). vLLM runs
only on CUDA: ``vllm`` must be on ``PATH`` (or ``QEVAL_VLLM`` names it); vLLM pins its own
torch, so it is best installed in its own environment. Memory of a served tier: the
server process's resident memory with its children (psutil, sampled every 10 ms) on the
CPU; NVML's per-process figure for the server's pid on CUDA (:mod:`qeval.measure.nvml`).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SERVERS = ("llama-server", "vllm")
VLLM_ENV = "QEVAL_VLLM"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EndpointSpec(_Strict):
    """A server that already runs (a staging server, a release CI's target).

    Attributes:
        url: the server's base URL (``http://host:port``, with or without ``/v1``).
        api_key_env: the environment variable holding its API key (the key itself is
            never in a recipe, ``run.json`` or a log); None: no key.
        model: the model name sent in requests; None: the first of ``GET /v1/models``.
        timeout_s: seconds one request may take.
    """
    url: str
    api_key_env: str | None = Field(None, description="environment variable with the API key (never the key)")
    model: str | None = None
    timeout_s: float = Field(600.0, gt=0)

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


class ServeSpec(_Strict):
    """A server qeval starts on the tier's artifact (``serve: llama-server`` is short for
    ``serve: {server: llama-server}``).

    Attributes:
        server: ``llama-server`` (GGUF; any device) or ``vllm`` (transformers, GPTQ and AWQ
            checkpoints; CUDA only).
        parallel: concurrent sequences the server batches (llama-server ``--parallel``
            slots, vLLM ``--max-num-seqs``); None: the recipe's largest ``load.concurrency``.
        ctx_size: llama-server ``--ctx-size``: KV cells its slots share (``--kv-unified``);
            vLLM ``--max-model-len``: tokens per sequence (vLLM pages its KV cache inside
            ``gpu_memory_utilization``). None: from the recipe: the longest speed sequence,
            or for llama-server ``parallel`` x the load sequence when that is more, rounded
            up to 256.
        gpu_memory_utilization: vLLM ``--gpu-memory-utilization`` (share of GPU memory).
        startup_timeout_s: seconds for the server to answer its health route.
        args: extra command-line arguments, appended as they are.
    """
    server: Literal["llama-server", "vllm"]
    parallel: int | None = Field(None, gt=0)
    ctx_size: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    args: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"server": v} if isinstance(v, str) else v


# ---- a managed server process ------------------------------------------------------------

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


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (the stage process) dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; qeval.stages does the same for stage processes)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


_LIVE: "set[ManagedServer]" = set()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter exit
    for s in list(_LIVE):
        s.stop()


class ManagedServer:
    """A server process qeval started, its log and its readiness.

    Args:
        cmd: the command line (its port already in it).
        port: the port it listens on (127.0.0.1).
        log_path: the file its stdout and stderr go to (appended).
        name: for messages (``llama-server``, ``vllm``).
        health_path: the route that answers 200 once the model is loaded.
        env: its environment (default: this process's).
    """

    def __init__(self, cmd: Sequence[str], *, port: int, log_path: Path, name: str,
                 health_path: str = "/health", env: dict | None = None) -> None:
        self.cmd = [str(c) for c in cmd]
        self.port = int(port)
        self.log_path = Path(log_path)
        self.name = name
        self.health_path = health_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 600.0) -> "ManagedServer":
        """Start the process and wait until its health route answers 200.

        Raises:
            ServerFailed: the executable is missing, the process exited before it was
                ready, or it was not ready within ``timeout_s`` (then it is stopped).
        """
        import httpx  # start-up time: only served tiers talk HTTP
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as lf:
            lf.write(f"--- {datetime.now(timezone.utc).isoformat()} {' '.join(self.cmd)}\n".encode())
            lf.flush()
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env, preexec_fn=_die_with_parent)
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

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s, and reap (no zombie). Idempotent."""
        p = self.proc
        _LIVE.discard(self)
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


# ---- commands ----------------------------------------------------------------------------

def llama_server_command(binary: str | Path, gguf: str | Path, *, port: int, threads: int, parallel: int,
                         ctx_size: int, kv_cache: str = "model", flash_attn: bool = False,
                         device: str = "cpu", args: Sequence[str] = ()) -> list[str]:
    """llama-server on one GGUF file as qeval measures it: 127.0.0.1, ``threads`` for
    decode and batches, ``parallel`` slots sharing one KV pool of ``ctx_size`` cells
    (``--kv-unified``: one deep speed prompt or N load streams fit the same server), flash
    attention set explicitly, the int8 KV cache as ``q8_0`` K and V, every layer on the
    GPU for ``device="cuda"``, no prompt-cache RAM and no web UI."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx_size),
           "--kv-unified", "-fa", "on" if flash_attn else "off", "-ngl", "999" if device == "cuda" else "0",
           "--cache-ram", "0", "--no-webui", "--no-context-shift"]
    if kv_cache == "int8":
        cmd += ["-ctk", "q8_0", "-ctv", "q8_0"]
    return cmd + [str(a) for a in args]


#: vLLM ``--quantization`` per qeval artifact format (None: read from the checkpoint's config).
VLLM_QUANTIZATION = {"hf": None, "gptqmodel": None, "gguf": "gguf"}


def vllm_binary() -> str | None:
    """The ``vllm`` executable: ``$QEVAL_VLLM``, else ``vllm`` on ``PATH``; None if neither."""
    named = os.environ.get(VLLM_ENV)
    if named:
        return named if Path(named).is_file() else shutil.which(named)
    return shutil.which("vllm")


def vllm_command(binary: str, artifact: str | Path, fmt: str, *, port: int, parallel: int, max_model_len: int,
                 gpu_memory_utilization: float, tokenizer: str | None = None, kv_cache: str = "model",
                 served_name: str = "qeval", args: Sequence[str] = ()) -> list[str]:
    """``vllm serve <artifact>`` on 127.0.0.1: ``--max-num-seqs`` = ``parallel``,
    ``--max-model-len``, ``--gpu-memory-utilization``, prefix caching off
    (repeated speed prompts would hit it), the source's tokenizer, an int8 KV cache as
    ``--kv-cache-dtype fp8`` (vLLM has no int8 KV cache; the row's backend says so)."""
    cmd = [binary, "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--max-num-seqs", str(parallel), "--max-model-len", str(max_model_len),
           "--gpu-memory-utilization", str(gpu_memory_utilization), "--no-enable-prefix-caching",
           "--disable-log-requests"]
    q = VLLM_QUANTIZATION.get(fmt)
    if q:
        cmd += ["--quantization", q]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    if kv_cache == "int8":
        cmd += ["--kv-cache-dtype", "fp8"]
    return cmd + [str(a) for a in args]


# ---- memory of a server process ----------------------------------------------------------

class ServerRss:
    """Peak resident memory of a process and its children (bytes), sampled every
    ``interval_s`` in a thread (psutil's ``memory_info().rss`` over
    ``children(recursive=True)``; /proc's VmHWM cannot be reset from outside the process
    and misses children). The counter API of :class:`qeval.measure.memory.PeakMemory`:
    ``reset``, ``read``, ``reserved_unallocated``, ``close``, ``kind``.

    Args:
        pid: the server's pid.
        baseline: bytes subtracted from every figure (0: the whole server).
    """
    kind = "server_rss_sampled"

    def __init__(self, pid: int, baseline: int = 0, interval_s: float = 0.01) -> None:
        import psutil  # start-up time: only served tiers sample another process
        self._proc = psutil.Process(int(pid))
        self._psutil = psutil
        self.baseline = int(baseline)
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._peak = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qeval-server-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        ps = self._psutil
        total = 0
        try:
            procs = [self._proc] + self._proc.children(recursive=True)
        except ps.Error:
            return 0
        for p in procs:
            try:
                total += int(p.memory_info().rss)
            except ps.Error:
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
        """Peak bytes of the window (less the baseline)."""
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


def server_peak_counter(pid: int, device: str) -> Any:
    """The peak-memory counter of a served tier: :class:`ServerRss` on the CPU,
    :class:`qeval.measure.nvml.NvmlMemory` for the server's pid on CUDA.

    Raises:
        TierUnavailable: CUDA without NVML (what to install).
    """
    if device == "cuda":
        from ..measure.nvml import NvmlMemory  # start-up time: NVML only on CUDA
        return NvmlMemory(pid=pid)
    return ServerRss(pid)


def round_ctx(n: int, cap: int | None = None) -> int:
    """``n`` tokens rounded up to 256 (llama.cpp pads contexts to 256 cells), at most ``cap``
    (the model's context) when given."""
    n = -(-max(int(n), 1) // 256) * 256
    return min(n, int(cap)) if cap else n
