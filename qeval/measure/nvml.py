"""GPU memory through NVML, for engines outside torch (llama.cpp CUDA builds) and as a
second counter beside ``torch.cuda.max_memory_allocated`` for transformers tiers.

What is counted (NVIDIA's NVML reference, ``nvmlDeviceGetComputeRunningProcesses`` and
``nvmlDeviceGetMemoryInfo``):

* ``cuda_nvml_process``: the GPU memory NVML attributes to *this* process
  (``usedGpuMemory`` of its entry in the compute process list): its CUDA context, every
  allocation, the caching allocators' reserve. Other processes on the GPU do not count.
* ``cuda_nvml_device``: the device's memory in use (``used``), less what was in use
  when the counter started. Used only where NVML gives no per-process figure (a
  container whose PID namespace hides the host PIDs NVML reports, or a driver that
  returns "not available"): other processes' allocations during the run count too, so
  the kind says so.

The counter is created *before* the model is loaded (its baseline holds neither the
weights nor the CUDA context) and samples in a background thread every
``interval_s`` between :meth:`NvmlMemory.reset` and :meth:`NvmlMemory.read`, so a
depth's figure is the peak of that window, not the value at its end.

The device is the one this process uses: ordinal ``ordinal`` of ``CUDA_VISIBLE_DEVICES``
(indices, ``GPU-<uuid>`` or ``MIG-<uuid>`` entries), not NVML index 0. The NVML library
comes from the ``nvidia-ml-py`` package (module ``pynvml``); without it, or without a
driver, creating the counter raises :class:`~qeval.errors.TierUnavailable` saying what
to install instead of leaving the figure silently empty. gpustat and torch.cuda's own
NVML helpers were checked: neither gives a per-process peak.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterable

from ..errors import TierUnavailable

INSTALL_HINT = "pip install nvidia-ml-py (`make setup CUDA=1` installs it)"
KIND_PROCESS = "cuda_nvml_process"
KIND_DEVICE = "cuda_nvml_device"


def import_pynvml() -> Any:
    """The ``pynvml`` module (from ``nvidia-ml-py``), initialised.

    Raises:
        TierUnavailable: not installed, or NVML cannot start (no driver).
    """
    try:
        import pynvml  # optional dependency (extra 'gpu'): only CUDA runs need it
    except ImportError:
        raise TierUnavailable(f"measuring GPU memory needs NVML, and the 'pynvml' module is not "
                              f"installed: {INSTALL_HINT}") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: driver missing or too old
        raise TierUnavailable(f"NVML cannot start ({e.__class__.__name__}: {e}); GPU memory cannot be "
                              "measured: check the NVIDIA driver") from None
    return pynvml


def visible_device(ordinal: int = 0, env: dict | None = None) -> int | str:
    """The physical device behind CUDA ordinal ``ordinal`` of this process: an NVML index
    (int) or a ``GPU-``/``MIG-`` UUID (str), read from ``CUDA_VISIBLE_DEVICES``.

    Unset: ``ordinal`` itself. Entries are comma-separated (CUDA's rules: an invalid entry
    hides the ones after it, so they are cut there).

    Raises:
        TierUnavailable: ``ordinal`` is not visible (e.g. ``CUDA_VISIBLE_DEVICES`` empty).
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return int(ordinal)
    entries: list[int | str] = []
    for part in raw.split(","):
        p = part.strip()
        if p.isdigit():
            entries.append(int(p))
        elif p.startswith(("GPU-", "MIG-")):
            entries.append(p)
        else:
            break
    if ordinal >= len(entries):
        raise TierUnavailable(f"CUDA device {ordinal} is not visible (CUDA_VISIBLE_DEVICES={raw!r})")
    return entries[ordinal]


class NvmlMemory:
    """Peak GPU memory of this process (or, failing that, of the device) by NVML sampling.

    Args:
        ordinal: the CUDA device ordinal the engine uses (0 unless the engine picks another).
        pid: the process to count (default: this one).
        pids: ``() -> pids`` to count instead, summed, asked at every sample (a managed
            server's process tree: :func:`qeval.engines.servers.base.tree_pids`); a tree
            that does not exist yet counts 0 bytes, so a counter created before the server
            starts has the device's use before it as its baseline.
        interval_s: seconds between samples of the background thread.
        nvml: a ``pynvml``-like module (tests pass a fake); default :func:`import_pynvml`.

    Usage::

        nv = NvmlMemory()          # before the model is loaded: the baseline
        ...load...
        nv.reset(); ...run...; peak = nv.read()   # bytes above the baseline, window peak
        nv.close()

    Attributes:
        kind: :data:`KIND_PROCESS` or :data:`KIND_DEVICE` (see the module notes); decided
            by the samples (per-process once this process shows up in NVML's list).
        device: what :func:`visible_device` resolved (NVML index or UUID).

    Raises:
        TierUnavailable: NVML missing or the device not found.
    """

    def __init__(self, ordinal: int = 0, *, pid: int | None = None, interval_s: float = 0.01,
                 nvml: Any = None, pids: Callable[[], Iterable[int]] | None = None) -> None:
        self._nv = nvml if nvml is not None else import_pynvml()
        self.device = visible_device(ordinal)
        try:
            if isinstance(self.device, str):
                self._h = self._nv.nvmlDeviceGetHandleByUUID(self.device)
            else:
                self._h = self._nv.nvmlDeviceGetHandleByIndex(self.device)
        except Exception as e:
            raise TierUnavailable(f"NVML cannot open GPU {self.device!r}: {e}") from None
        self.pid = os.getpid() if pid is None else int(pid)
        self._pids = pids
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._seen_process = False
        dev, proc = self._sample()
        self.baseline_device = dev
        self.baseline_process = proc or 0  # no CUDA context yet: not in the list, 0 bytes
        self._win_dev = dev
        self._win_proc = proc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qeval-nvml", daemon=True)
        self._thread.start()

    # -- sampling -----------------------------------------------------------------------
    def _sample(self) -> tuple[int, int | None]:
        """(device bytes in use, the counted processes' bytes or None when NVML lists none of them)."""
        used = int(self._nv.nvmlDeviceGetMemoryInfo(self._h).used)
        mine = None
        wanted = {int(p) for p in self._pids()} if self._pids is not None else {self.pid}
        try:
            for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self._h):
                if int(p.pid) in wanted and p.usedGpuMemory is not None:
                    mine = (mine or 0) + int(p.usedGpuMemory)
        except Exception:  # NVML_ERROR_NOT_SUPPORTED on some drivers / vGPUs
            mine = None
        if mine is not None:
            self._seen_process = True
        return used, mine

    def _take(self) -> None:
        dev, proc = self._sample()
        with self._lock:
            self._win_dev = max(self._win_dev, dev)
            if proc is not None:
                self._win_proc = proc if self._win_proc is None else max(self._win_proc, proc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._take()
            except Exception:  # a transient NVML error: keep the samples taken so far
                pass

    # -- the counter API (as :class:`qeval.measure.memory.PeakMemory`) -----------------
    @property
    def kind(self) -> str:
        return KIND_PROCESS if self._seen_process else KIND_DEVICE

    def reset(self) -> None:
        """Start a new window: its peak starts at the memory in use now."""
        dev, proc = self._sample()
        with self._lock:
            self._win_dev, self._win_proc = dev, proc

    def read(self) -> int:
        """Peak bytes of the window since :meth:`reset` (or creation), above the baseline."""
        self._take()
        with self._lock:
            if self._seen_process and self._win_proc is not None:
                return max(self._win_proc - self.baseline_process, 0)
            return max(self._win_dev - self.baseline_device, 0)

    def reserved_unallocated(self) -> None:
        """NVML sees no allocator: None (the counter API of :class:`qeval.measure.memory.PeakMemory`)."""
        return None

    def close(self) -> None:
        """Stop the sampling thread."""
        self._stop.set()
        self._thread.join(timeout=1.0)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._stop.set()
        except Exception:
            pass


class PairedPeak:
    """Two peak counters run together: ``primary`` answers :meth:`read`, ``secondary``'s
    reads are kept in :attr:`secondary_reads` (one per read, in call order) — for
    transformers tiers on CUDA, torch's allocator counter with NVML beside it."""

    def __init__(self, primary: Any, secondary: Any) -> None:
        self.primary, self.secondary = primary, secondary
        self.secondary_reads: list[int | None] = []

    @property
    def kind(self) -> str:
        return self.primary.kind

    def reset(self) -> None:
        self.primary.reset()
        self.secondary.reset()

    def read(self) -> int | None:
        self.secondary_reads.append(self.secondary.read())
        return self.primary.read()

    def reserved_unallocated(self) -> int | None:
        """The primary counter's reserved-but-unallocated bytes (torch's allocator)."""
        return self.primary.reserved_unallocated()

    def close(self) -> None:
        self.primary.close()
        self.secondary.close()
