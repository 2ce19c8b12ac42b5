"""Run qeval CLI commands as separate processes with a memory cap and a time limit, fast.

``python tests/hostile_driver.py CASES.json RESULTS.json``

CASES.json holds ``[{"id", "argv", "cwd", "env"}]``. The driver imports qeval's CLI once,
then forks one child per case: the child caps its address space with
``resource.setrlimit(RLIMIT_AS, 1 GiB)``, points fd 1 and 2 at files, and runs
``qeval.cli.main()`` with the case's argv, exactly as the ``qeval`` console script does.
The parent kills a child still running after the time limit. Per case it records the exit
code, wall seconds, peak resident memory (``ru_maxrss`` from ``os.wait4``), stdout and
stderr. A fork per case (instead of a fresh interpreter) keeps a corpus of a hundred
inputs at a few seconds of start-up in total; the children are real processes, so exit
codes, the memory cap and crashes are real.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

MEMORY_CAP = 1 << 30   # bytes of address space per case
TIME_LIMIT = 120.0     # seconds per case: a hang guard (the case is killed), not a timing check


def run_case(case: dict, tmp: str) -> dict:
    out_p, err_p = os.path.join(tmp, "out.txt"), os.path.join(tmp, "err.txt")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
            os.chdir(case["cwd"])
            os.environ.update(case.get("env") or {})
            for fd, path in ((1, out_p), (2, err_p)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.argv = ["qeval", *case["argv"]]
            from qeval.cli import main
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # a traceback escaping main(): the test fails on it
            import traceback
            traceback.print_exc()
            code = 98
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    timed_out = False
    while True:
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid == pid:
            break
        if time.monotonic() - t0 > TIME_LIMIT:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)

    def read(p: str) -> str:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.read(200_000)
        except OSError:
            return ""
    return {"id": case["id"], "rc": rc, "seconds": seconds, "maxrss_bytes": usage.ru_maxrss * 1024,
            "timed_out": timed_out, "stdout": read(out_p), "stderr": read(err_p)}


def main() -> None:
    cases_path, results_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    import tempfile

    # Imported once, so every child starts warm: the time limit is for the command's work
    # on its input, not for importing libraries (matplotlib alone takes seconds on a
    # loaded machine). torch is not imported here: its address space would count against
    # every child's cap.
    import jinja2  # noqa: F401
    import matplotlib.figure  # noqa: F401
    from matplotlib.backends import backend_agg  # noqa: F401

    import qeval.analysis  # noqa: F401
    import qeval.cli  # noqa: F401
    import qeval.measure.suites  # noqa: F401
    import qeval.recipe  # noqa: F401
    import qeval.report  # noqa: F401
    import qeval.report.outputs  # noqa: F401
    import qeval.results  # noqa: F401
    import qeval.source  # noqa: F401
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            results.append(run_case(case, tmp))
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
