"""qeval's cache folder and what lives in it (the run folder's own paths are
:class:`qeval.results.RunLayout`)::

    $QEVAL_CACHE (default ~/.cache/qeval)/
      sources/            BF16 source checkpoints (converted GGUF packages, fetched from a store)
      artifacts/          prepared tier artifacts and reference passes (qeval.artifacts)
      staging/            local run folders of runs whose storage is a URL
      nodes/<tier>/       a Ray tier task's copy of its run (storage URL), dropped when stored
      torch_extensions/   gptqmodel's compiled kernels
      llama_cpp_convert/  llama.cpp's HF->GGUF converter for the installed llama-cpp-python
"""
from __future__ import annotations

import os
from pathlib import Path

from .bounded import expand_user


def cache_root() -> Path:
    """qeval's cache folder: ``$QEVAL_CACHE`` or ``~/.cache/qeval``.

    Raises:
        QevalInputError: ``$QEVAL_CACHE`` starts with ``~user`` for no such user.
    """
    env = os.environ.get("QEVAL_CACHE")
    if env:
        return expand_user(env, field="$QEVAL_CACHE")
    return Path.home() / ".cache" / "qeval"


def sources_dir() -> Path:
    """Source checkpoints: ``<cache>/sources``."""
    return cache_root() / "sources"


def artifacts_dir() -> Path:
    """Prepared artifacts: ``<cache>/artifacts``."""
    return cache_root() / "artifacts"


def staging_dir() -> Path:
    """Local run folders of runs whose storage is a URL: ``<cache>/staging``."""
    return cache_root() / "staging"


def node_dir(tier: str) -> Path:
    """A Ray tier task's copy of its run on a node: ``<cache>/nodes/<tier>`` (per tier: the
    tasks of one run may share a node)."""
    return cache_root() / "nodes" / tier


def torch_extensions_dir() -> Path:
    """gptqmodel's compiled kernels: ``<cache>/torch_extensions``."""
    return cache_root() / "torch_extensions"


def converter_dir() -> Path:
    """llama.cpp's HF->GGUF converter: ``<cache>/llama_cpp_convert``."""
    return cache_root() / "llama_cpp_convert"
