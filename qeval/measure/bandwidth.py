"""Memory bandwidth of this machine, for the decode roofline.

Measured as a STREAM-style copy (McCalpin's STREAM "Copy": bytes counted = 2 x buffer,
one read and one write) with torch on the run's device and thread count; best of
``repeats``. Decode is memory-bandwidth bound, so bound tokens/s =
bandwidth / (weight bytes + KV bytes read at depth d) (docs/design.md, Roofline).
"""
from __future__ import annotations

import time
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30


def _llc_bytes() -> int | None:
    """Size of the largest CPU cache level (bytes) from sysfs, None when unknown."""
    best = None
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            txt = f.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": MIB, "G": GIB}.get(txt[-1:], 1)
            v = int(txt.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
        best = v if best is None else max(best, v)
    return best


def probe_size_bytes(device: str, total_memory: int | None = None, free_memory: int | None = None,
                     llc_bytes: int | None = None, available_memory: int | None = None) -> int:
    """Buffer size of the bandwidth copy, scaled to the device (STREAM's rule: each array
    well beyond the last-level cache, and long enough to time).

    CUDA: 1/32 of the GPU's memory, between 1 GiB and 4 GiB (an H200's 141 GB gives 4 GiB;
    256 MiB moves in ~0.1 ms there, too short to time), and at most a quarter of the free
    memory (source and destination must fit). CPU: 8 x the last-level cache, at least
    256 MiB, at most 2 GiB, and at most an eighth of the memory available now
    (``available_memory``, default psutil's ``virtual_memory().available``: the two buffers
    then take a quarter of it), never below 32 MiB.
    """
    if device == "cuda":
        if total_memory is None or free_memory is None:
            import torch  # start-up time: torch loads only in stage processes
            free_memory, total_memory = torch.cuda.mem_get_info()
        size = min(4 * GIB, max(GIB, total_memory // 32))
        return int(max(256 * MIB, min(size, free_memory // 4)))
    llc = _llc_bytes() if llc_bytes is None else llc_bytes
    if available_memory is None:
        import psutil  # start-up time: only the environment stage sizes the probe
        available_memory = int(psutil.virtual_memory().available)
    size = min(2 * GIB, max(256 * MIB, 8 * (llc or 0)))
    return int(max(32 * MIB, min(size, available_memory // 8)))


def measure_bandwidth(device: str = "cpu", size_bytes: int | None = None, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (2 x ``size_bytes`` moved per copy), best of ``repeats``;
    ``size_bytes`` defaults to :func:`probe_size_bytes` for the device."""
    import torch  # start-up time: torch loads only in stage processes

    if size_bytes is None:
        size_bytes = probe_size_bytes(device)
    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def roofline_tokens_per_s(bandwidth_bytes_per_s: float | None, weight_bytes: int | None,
                          kv_bytes_per_token: float | None, depth: int) -> float | None:
    """Decode bound (tokens/s) = bandwidth / (weight bytes + KV bytes/token x depth)."""
    if not bandwidth_bytes_per_s or not weight_bytes:
        return None
    read = weight_bytes + (kv_bytes_per_token or 0.0) * depth
    return bandwidth_bytes_per_s / read
