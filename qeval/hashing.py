"""File and checkpoint hashes (SHA-256, hex): the roots of artifact-cache keys and the
identity of a source checkpoint between machines. ``hashlib`` does the hashing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """SHA-256 hex digest of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def checkpoint_sha256(folder: str | Path) -> str:
    """Hash of a checkpoint folder: SHA-256 over (name, SHA-256) of its weight and config
    files, cached in ``.qeval-sha256`` keyed by their sizes and modification times."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin", ".gguf") or p.name in ("config.json", "generation_config.json")))
    stamp = json.dumps([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])
    memo = folder / ".qeval-sha256"
    try:
        cached = json.loads(memo.read_text())
        if cached.get("stamp") == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError, AttributeError, RecursionError):  # a stale or foreign memo: rehash
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + file_sha256(p).encode() + b"\n")
    digest = h.hexdigest()
    try:
        memo.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass
    return digest
