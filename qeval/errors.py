"""Errors qeval raises for bad input, and how the CLI turns them into exit codes.

Exit codes (used by model-release CI; the contract is applied in :func:`qeval.cli.main`):
    0    run finished and every gate candidate passed
    1    run finished and a gate candidate failed a rule: damage measured (or the gate judged
         no candidate); wins over 4 when both occur
    4    the gate could not judge some candidate: its tier or the reference tier has no
         result or did not finish (a crash in qeval's own code, a failed or aborted stage, a
         tier refused for a capability); no candidate failed a rule (that would be 1)
    5    reserved: the gate-statistics work's INCONCLUSIVE verdict (issue 58, not built yet)
    2    bad input (recipe, dataset, model config, run folder, flags, an output that cannot
         be written): one line on stderr naming file, line and field, no traceback
    3    internal error: an unexpected exception (one line naming the log with the
         traceback), or a run-wide stage (source, env) failed (its reason and log tail printed)
    130  interrupted by Ctrl-C (SIGINT); 143 by SIGTERM

A tier that cannot run on this machine as the recipe asks (a llama.cpp build without GPU
offload asked for ``device: cuda``, gptqmodel CUDA kernels that cannot be built here, no
NVML to measure GPU memory) raises :class:`TierUnavailable`: that tier fails alone before
anything is measured, its row says in one line what to install, and the others go on.
"""
from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
#: The gate could not judge some candidate (its tier or the reference's did not finish) and
#: none failed a rule: not a verdict on the model (qeval.analysis.gate.GateReport.exit_code).
EXIT_GATE_ERROR = 4
# 5 is reserved for the gate's INCONCLUSIVE verdict (issue 58: gate statistics, not built yet).
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class QevalInputError(Exception):
    """Bad user input. ``str(err)`` is a single line naming file, line and field.

    Args:
        message: what is wrong, one line.
        file: the offending file, if any.
        line: 1-based line number in ``file``, if known.
        field: dotted field path (``tiers[2].method``), if known.
    """

    def __init__(self, message: str, *, file: str | Path | None = None,
                 line: int | None = None, field: str | None = None) -> None:
        self.message = " ".join(str(message).split())  # always one line
        self.file = str(file) if file is not None else None
        self.line = line
        self.field = field
        super().__init__(self.format())

    def format(self) -> str:
        """``file:line: field: message`` with absent parts left out."""
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "") + ": "
        fld = f"{self.field}: " if self.field else ""
        return f"{where}{fld}{self.message}"


class TierUnavailable(RuntimeError):
    """A tier cannot run here as asked (missing GPU build, compiler or library).

    ``str(err)`` is one line saying what is missing and what to install; the worker records
    it as the tier's error without a traceback (see :mod:`qeval.worker`).
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
