"""Memory bandwidth of this machine, for the decode roofline.

Measured as a STREAM-style copy (McCalpin's STREAM "Copy": bytes counted = 2 x buffer,
one read and one write) with torch on the run's device and thread count; best of
``repeats``. Decode is memory-bandwidth bound, so bound tokens/s =
bandwidth / (weight bytes + KV bytes read at depth d) (docs/design.md, Roofline).
"""
from __future__ import annotations

import time


def measure_bandwidth(device: str = "cpu", size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (2 x ``size_bytes`` moved per copy), best of ``repeats``."""
    import torch

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
