"""Peak memory: VmHWM of this process on CPU, ``torch.cuda.max_memory_allocated`` on CUDA
(NVML for engines outside torch: :mod:`qeval.measure.nvml`).

CPU figures come from ``/proc/self/status`` (Linux). The peak is reset between depths by
writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)), which sets VmHWM back
to the current VmRSS. psutil was checked: it reports RSS but cannot reset the peak.

CPU baseline rule (the measure stage, :func:`qeval.worker.stage_measure`): the baseline is
the RSS after the tier's engine libraries are imported and warmed
(:meth:`qeval.tiers.base.TierMethod.prepare_runtime`) and before the model is loaded, so a
peak less the baseline is what the model, its KV cache and its working buffers take; the
baseline itself is reported as the runtime's resident size. :func:`peak_breakdown` splits
a peak into weights, KV cache and the rest.

Freed memory first: the baseline and every reset start from :func:`release_freed_memory`
(glibc's ``malloc_trim(0)`` returning freed heap pages to the kernel; for the baseline,
Python's cyclic garbage collected before). Without it the RSS a reset starts from held whatever the allocator
had kept from earlier work: two identical GPTQ measure stages read peaks 0.29 and 0.36 GB
above the baseline (gptqmodel's CPU kernel repacks its weights on the first forward and
frees the old buffers), and the gate's memory rule flipped between runs.
"""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path

from .nvml import NvmlMemory


def release_freed_memory(collect_garbage: bool = True) -> bool:
    """Return glibc's freed heap pages to the kernel (``malloc_trim(0)``, malloc_trim(3)),
    after collecting Python's cyclic garbage when ``collect_garbage`` (0.1 to 0.4 s with
    torch loaded: the baseline does, each reset does not, since tensors are freed by their
    reference counts), so RSS counts live memory. Returns whether ``malloc_trim`` ran (False
    off glibc). Live buffers are never touched."""
    if collect_garbage:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


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
    """Reset VmHWM to the current RSS (after :func:`release_freed_memory`); False when the
    kernel does not allow it."""
    release_freed_memory(collect_garbage=False)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_breakdown(peak: int | None, weight_bytes: int | None, kv_bytes: int | None) -> dict | None:
    """Split a model peak (bytes, baseline already taken off) into ``weights_bytes`` (the
    stored weight bytes), ``kv_cache_bytes`` (the KV cache held at that depth) and
    ``other_bytes`` = peak - weights - KV (activations, logits, workspace, kernel repacks of
    the weights, allocator slack; negative when weights are memory-mapped and not all
    resident). None when the peak is unknown."""
    if peak is None:
        return None
    w, kv = int(weight_bytes or 0), int(kv_bytes or 0)
    return {"weights_bytes": w, "kv_cache_bytes": kv, "other_bytes": int(peak) - w - kv}


class PeakMemory:
    """Peak memory of a code region, on the engine's device.

    ``kind`` is ``cuda_max_allocated`` (bytes from ``torch.cuda.max_memory_allocated``,
    reset with ``reset_peak_memory_stats``), ``cpu_vmhwm`` (VmHWM minus ``baseline``,
    the RSS once the engine runtime is imported and warmed, before the model is loaded), or for ``device="nvml"``
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

    def reserved_unallocated(self) -> int | None:
        """CUDA only: bytes the caching allocator reserved beyond the peak allocation
        (``max_memory_reserved - max_memory_allocated``, since :meth:`reset`); memory the
        process holds on the device that ``max_memory_allocated`` does not show. None
        elsewhere."""
        if self.device != "cuda":
            return None
        import torch  # start-up time: torch loads only in stage processes
        return int(torch.cuda.max_memory_reserved()) - int(torch.cuda.max_memory_allocated())

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
