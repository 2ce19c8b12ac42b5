"""What the stage fork server (:mod:`qeval.stage_proc`) imports once, before it forks stages.

torch, transformers' llama modules and torchao are what every stage of a run imports and
what a fresh interpreter spends about 5 s of one core on; qeval's own stage modules import
lazily and cost little. Nothing here runs a tensor operation (no OpenMP team, no thread to
lose in a fork). gptqmodel is left out: its import starts threads (its log bar and worker
pool), which a fork would not copy.

What the imports print goes to the file named by ``QEVAL_PRELOAD_LOG`` when it is set
(the server's stdout and stderr are those of ``qeval run``'s terminal).

``FORK_SAFE`` says whether this process still had one OS thread after the imports;
``THREADS`` how many it had.
"""
from __future__ import annotations

import os


def _imports() -> None:
    try:
        import torch  # noqa: F401  # start-up time: the point of the preload
        import transformers  # noqa: F401  # start-up time: the point of the preload
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  # start-up time: as above
        import transformers.models.llama.modeling_llama  # noqa: F401  # start-up time: as above
    except Exception:  # noqa: BLE001 - a stage that needs them reports the error itself
        return
    try:
        import torchao  # noqa: F401  # optional: int8 tiers; start-up time
    except Exception:  # noqa: BLE001 - optional (int8 tiers)
        pass
    try:  # qeval's stage modules (they import the heavy ones lazily)
        import qeval.worker  # noqa: F401  # start-up time: the stage modules, once
    except Exception:  # noqa: BLE001
        pass


def _quietly(fn) -> None:
    """Run ``fn`` with file descriptors 1 and 2 on the file ``$QEVAL_PRELOAD_LOG`` (when
    set and writable), then put them back."""
    path = os.environ.get("QEVAL_PRELOAD_LOG")
    try:
        if path:  # a first run with a new QEVAL_CACHE: its folder does not exist yet
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if path else -1
    except OSError:
        fd = -1
    if fd < 0:
        fn()
        return
    import sys  # start-up time: already loaded by the interpreter
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        fn()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading  # start-up time: only off Linux
        return threading.active_count()


def set_threads(n: int) -> None:
    """Pin torch's intra-op threads to ``n`` in a forked stage (libgomp read OMP_NUM_THREADS
    when the server loaded it: 1)."""
    import torch  # start-up time: loaded by the preload already
    torch.set_num_threads(max(1, n))


_quietly(_imports)
THREADS = _thread_count()
FORK_SAFE = THREADS == 1
