"""Accelerators ``qeval plan --gpu NAME`` knows: memory (bytes), peak memory bandwidth
(bytes/s) and where each figure comes from, read from the package data file
``qeval/data/gpus.yaml`` with :mod:`importlib.resources` (so it works from a wheel too)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

from ..errors import QevalInputError
from .capacity import parse_bandwidth, parse_size


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator of the table.

    Attributes:
        key: the table's name for it (``rtx4090``).
        name: the product name.
        memory_bytes: device memory in bytes.
        bandwidth_bytes_per_s: peak memory bandwidth in bytes/s (vendor figure).
        source: where both figures come from.
        usable: share of memory a process can use when it differs from the default, or None.
        note: caveats (e.g. unified memory limits), or "".
    """
    key: str
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    source: str
    usable: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "memory_bytes": self.memory_bytes,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "source": self.source,
                "usable": self.usable, "note": self.note}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


@lru_cache(maxsize=1)
def known_gpus() -> dict[str, GpuSpec]:
    """``{key: GpuSpec}`` of ``qeval/data/gpus.yaml``, in file order.

    Raises:
        RuntimeError: the shipped data file is broken (an internal error, not user input).
    """
    text = resources.files("qeval").joinpath("data/gpus.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    out: dict[str, GpuSpec] = {}
    try:
        for key, e in raw.items():
            usable = e.get("usable")
            out[str(key)] = GpuSpec(key=str(key), name=str(e["name"]), memory_bytes=parse_size(e["memory"]),
                                    bandwidth_bytes_per_s=parse_bandwidth(e["bandwidth"]), source=str(e["source"]),
                                    usable=float(usable) if usable is not None else None, note=str(e.get("note") or ""))
    except (KeyError, TypeError, AttributeError, QevalInputError) as err:
        raise RuntimeError(f"qeval/data/gpus.yaml is broken: {err}") from None
    return out


def find_gpu(name: str) -> GpuSpec:
    """The accelerator called ``name`` (case, spaces, dashes and underscores ignored:
    ``"RTX 4090"`` finds ``rtx4090``).

    Raises:
        QevalInputError: unknown name (field ``--gpu``); the message lists the known names.
    """
    gpus = known_gpus()
    want = _norm(name)
    for key, g in gpus.items():
        if _norm(key) == want:
            return g
    raise QevalInputError(f"unknown GPU {name!r:.60}; known: {', '.join(gpus)} (or give --gpu-mem and --bandwidth)",
                          field="--gpu")
