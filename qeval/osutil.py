"""Small process-level helpers shared by several modules."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def stderr_fd_to(fileno: int) -> Iterator[None]:
    """Point file descriptor 2 at ``fileno`` inside the block, so C libraries and Python
    writers alike (llama.cpp's tensor warnings, torchao's load notices) go there; fd 2 is
    restored afterwards even when the block raises. ``contextlib.redirect_stderr`` was
    checked: it swaps ``sys.stderr`` only and misses C-level writes."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fileno, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
