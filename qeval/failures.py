"""Why a stage failed, in one line: what a stage process records about its exception
(:func:`describe_exception`, into the stage's ``.error.json``), what the parent reads from
a log when the child died before writing that (:func:`reason_from_log`), and what the
terminal prints (:func:`failure_text`). Read by :mod:`qeval.worker` (the child) and
:mod:`qeval.stages` / :mod:`qeval.executors` (the parent); :mod:`traceback` and
:mod:`linecache` give the frames and source lines.
"""
from __future__ import annotations

import linecache
import re
import signal
import traceback
from pathlib import Path


def short_path(filename: str) -> str:
    """A traceback file name without its install prefix: ``gptqmodel/looper/x.py`` for a
    file under site-packages (or dist-packages), ``qeval/run.py`` for qeval's own."""
    norm = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in norm:
            return norm.rsplit(marker, 1)[1]
    pkg_parent = str(Path(__file__).resolve().parent.parent).replace("\\", "/") + "/"
    return norm[len(pkg_parent):] if norm.startswith(pkg_parent) else norm


def _statement(frame: traceback.FrameSummary) -> str:
    """The source of the statement a frame was running (every line of a multi-line one,
    whitespace collapsed), from :mod:`linecache` as :mod:`traceback` reads it."""
    end = getattr(frame, "end_lineno", None) or frame.lineno
    if frame.lineno is None:
        return frame.line or ""
    lines = [linecache.getline(frame.filename, n) for n in range(frame.lineno, min(end, frame.lineno + 9) + 1)]
    text = " ".join(" ".join(lines).split()) or (frame.line or "")
    return text[:240] + ("..." if len(text) > 240 else "")


def describe_exception(e: BaseException) -> dict:
    """What a failed stage records about its exception (stage ``.error.json``).

    Returns:
        ``{"error": one-line reason, "exception": type name, "message": the message on one
        line (whitespace collapsed, at most 300 characters), "where": "file:line" of the raising frame, "condition": the failed
        statement's source (assertions only) or None, "cause": the same for the root
        exception it was raised from, or None}``. The reason reads
        ``AssertionError (at gptqmodel/x.py:812: assert a % b == 0)`` or
        ``ValueError: bad shape (at torch/nn/functional.py:99)``; a chained root cause is
        appended as ``; caused by ...``.
    """
    def one(x: BaseException) -> dict:
        frames = traceback.extract_tb(x.__traceback__)
        where = f"{short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else None
        cond = _statement(frames[-1]) if frames and isinstance(x, AssertionError) else None
        msg = " ".join(str(x).split()[:80])[:300] if str(x).strip() else ""
        name = x.__class__.__name__
        at = f" (at {where}{': ' + cond if cond else ''})" if where else ""
        return {"exception": name, "message": msg, "where": where, "condition": cond,
                "reason": f"{name}{': ' + msg if msg else ''}{at}"}

    top = one(e)
    root, seen = e, {id(e)}
    while True:
        nxt = root.__cause__ or (None if root.__suppress_context__ else root.__context__)
        if nxt is None or id(nxt) in seen:
            break
        root = nxt
        seen.add(id(root))
    cause = one(root) if root is not e else None
    reason = top["reason"] + (f"; caused by {cause['reason']}" if cause else "")
    return {"error": reason, "exception": top["exception"], "message": top["message"], "where": top["where"],
            "condition": top["condition"], "cause": cause}


def failure_text(reason: str | None, log_tail: str | None, lines: int = 8) -> str:
    """What the terminal prints for a failed tier: the reason (first line), then the last
    ``lines`` lines of its stage log, indented."""
    head = (reason or "no reason recorded").splitlines()[0] if (reason or "").strip() else "no reason recorded"
    tail = [ln for ln in (log_tail or "").splitlines() if ln.strip()][-lines:]
    return head + "".join(f"\n      | {ln}" for ln in tail)


def reason_from_log(log: Path) -> str | None:
    """The last Python traceback in a stage log as one line, ``Type: message (at
    file:line)``, plus the failed statement for an ``AssertionError``, for a child that exited
    without writing its error file. Only the last attempt counts (the log is appended to on
    resume; each attempt starts with a ``--- <time> <command>`` line). None when that part
    holds no traceback."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    heads = [i for i, ln in enumerate(lines) if ln.startswith("--- ")]
    lines = lines[heads[-1] + 1:] if heads else lines
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last):" in ln]  # progress bars may precede it
    if not starts:
        return None
    where, code, last = None, None, None
    for i in range(starts[-1] + 1, len(lines)):
        ln = lines[i]
        m = _TB_FRAME.match(ln)
        if m:
            where = f"{short_path(m.group(1))}:{m.group(2)}"
            code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else None
            continue
        if ln and not ln.startswith((" ", "\t")):
            last = ln.strip()  # "ValueError: ..." ends the traceback
            break
    if last is None:
        return None
    at = f" (at {where}{': ' + code if code and last.startswith('AssertionError') else ''})" if where else ""
    return (last[:300] + at)[:500]


_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')


_SIGNAL_WHAT = {"SIGILL": "illegal instruction", "SIGSEGV": "segmentation fault", "SIGBUS": "bus error",
                "SIGFPE": "arithmetic fault", "SIGABRT": "abort", "SIGKILL": "killed"}


def signal_text(rc: int) -> str:
    """``SIGILL (illegal instruction)`` for a child's return code ``-4`` (a process killed by
    signal 4); ``exit 3`` for a positive code."""
    if rc >= 0:
        return f"exit {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    return f"{name} ({_SIGNAL_WHAT[name]})" if name in _SIGNAL_WHAT else name


#: The line a stage prints (to its log) when it loads llama.cpp's CPU backend
#: (:func:`qeval.engines.llamacpp._llama`): what a stage killed by a signal ran last.
LLAMA_CPU_MARK = "[qeval] llama.cpp CPU backend: "
_FIXES = {
    "SIGILL": ("a kernel used an instruction this CPU does not execute (a virtual machine can list "
               "instruction sets, AMX among them, that it traps)"),
    "SIGKILL": "killed from outside: the out-of-memory killer, or a person",
    "SIGSEGV": "a native library crashed (a bug, or memory it could not get)",
    "SIGBUS": "a native library crashed (a memory-mapped file changed or a bad address)",
}


def _last_attempt(log: Path) -> list[str]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    heads = [i for i, ln in enumerate(lines) if ln.startswith("--- ")]
    return lines[heads[-1] + 1:] if heads else lines


def signal_reason(rc: int, stage: str, log: Path | None = None) -> str:
    """Why a stage process that died by a signal (``rc`` < 0) died, in one line that names
    the signal, where it happened and what to do: ``quality process killed by SIGILL
    (illegal instruction) in llama.cpp's CPU backend zen4: <cause>; fix: ...``. Whether it
    ran llama.cpp, and which variant, is read from the log's last attempt
    (:data:`LLAMA_CPU_MARK`)."""
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    variant = None
    for ln in _last_attempt(log) if log is not None else []:
        if ln.startswith(LLAMA_CPU_MARK):
            variant = ln[len(LLAMA_CPU_MARK):].split()[0] if ln[len(LLAMA_CPU_MARK):].strip() else None
    where = f" in llama.cpp's CPU backend {variant}" if variant else ""
    text = f"{stage} process killed by {signal_text(rc)}{where}"
    cause = _FIXES.get(name)
    if cause:
        text += f": {cause}"
    if name == "SIGILL":
        if variant:
            text += (f"; fix: run this variant's probe again (delete $QEVAL_CACHE/llama_cpu_probe) or choose "
                     f"another with QEVAL_LLAMA_CPU_VARIANT=haswell, then `qeval run --resume`")
        else:
            text += "; fix: rebuild the failing library for this CPU's instruction sets"
    return text
