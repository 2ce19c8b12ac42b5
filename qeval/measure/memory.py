"""Peak memory: VmHWM of this process on CPU, ``torch.cuda.max_memory_allocated`` on CUDA
(NVML for engines outside torch: :mod:`qeval.measure.nvml`).

CPU figures come from ``/proc/self/status`` (Linux). The peak is reset between depths by
writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)), which sets VmHWM back
to the current VmRSS. psutil was checked: it reports RSS but cannot reset the peak.
"""
from __future__ import annotations

from pathlib import Path

from .nvml import NvmlMemory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size (VmRSS) of this process, bytes; None off Linux."""
    k = _status_kib("VmRSS")
    return None if k is None else k * 1024


def hwm_bytes() -> int | None:
    """Peak resident set size (VmHWM) of this process since start or last reset, bytes."""
    k = _status_kib("VmHWM")
    return None if k is None else k * 1024


def reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS; False when the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory of a code region, on the engine's device.

    ``kind`` is ``cuda_max_allocated`` (bytes from ``torch.cuda.max_memory_allocated``,
    reset with ``reset_peak_memory_stats``), ``cpu_vmhwm`` (VmHWM minus ``baseline``,
    the RSS right after imports, before the model was loaded), or for ``device="nvml"``
    ``cuda_nvml_process`` / ``cuda_nvml_device`` (:class:`qeval.measure.nvml.NvmlMemory`,
    which must be created before the model is loaded).

    Usage::

        pm = PeakMemory("cpu", baseline=rss_after_imports)
        pm.reset(); ...run...; peak = pm.read()   # bytes
    """

    def __init__(self, device: str, baseline: int | None = None) -> None:
        self.device = device
        self.baseline = baseline or 0
        self.kind = {"cuda": "cuda_max_allocated"}.get(device, "cpu_vmhwm")
        self._nvml = None
        if device == "nvml":  # engines outside torch on a GPU: NVML, sampled (measure/nvml.py)
            self._nvml = NvmlMemory()  # create before the model loads: the baseline; raises TierUnavailable
            self.kind = self._nvml.kind

    def reset(self) -> None:
        if self._nvml is not None:
            self._nvml.reset()
            return
        if self.device == "cuda":
            import torch  # start-up time: torch loads only in stage processes
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_cpu_peak()

    def read(self) -> int | None:
        """Peak bytes since :meth:`reset` (CPU: less the baseline; NVML: the sampled peak of
        this process's GPU memory less its baseline before load, see :mod:`qeval.measure.nvml`)."""
        if self._nvml is not None:
            out = self._nvml.read()
            self.kind = self._nvml.kind
            return out
        if self.device == "cuda":
            import torch  # start-up time: torch loads only in stage processes
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        h = hwm_bytes()
        return None if h is None else max(h - self.baseline, 0)

    def close(self) -> None:
        """Stop the NVML sampling thread (no-op for the other kinds)."""
        if self._nvml is not None:
            self._nvml.close()
