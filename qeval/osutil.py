"""Small process-level helpers shared by several modules."""
from __future__ import annotations

import ctypes
import os
import signal
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


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``):
    a killed run leaves no stage or managed server behind. A no-op where libc has no prctl."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
