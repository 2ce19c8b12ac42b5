"""The data qeval ships, installed with the package and found through ``importlib.resources``.

A recipe names one of these files as ``builtin:<name>`` in any path field (``speed.depth_text``,
``calibration.path``, ``suites[].path``, ``quality.lm_eval_tasks[]``), so a recipe written in
any folder works without a copy of this repository::

    builtin:depth_text                 depth_text.txt     prompts of an exact token depth
    builtin:calibration                calibration.jsonl  GPTQ/AWQ calibration text (288 documents)
    builtin:long_output                long_output.jsonl  free-running suite, kind long_output
    builtin:multi_turn                 multi_turn.jsonl   free-running suite, kind multi_turn
    builtin:long_context               long_context.jsonl long-context items (their filler,
                                       long_context_filler.jsonl, beside them)
    builtin:lm_eval/qeval_business_mc  lm_eval/qeval_business_mc.yaml   local lm-eval task (+ .jsonl)

The file name (``builtin:long_output.jsonl``) works too. The editable source is the
repository's ``datasets/`` folder (described in ``datasets/README.md``); the copies in this
package are refreshed from it by ``python datasets/tools/sync_package_data.py`` (``make
package-data``), and ``tests/test_package_data.py`` fails when they differ byte for byte.
"""
from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path

#: Prefix of a path field naming a file shipped with qeval.
PREFIX = "builtin:"

#: builtin name -> file, relative to this package (and to the repository's ``datasets/``).
BUILTIN: dict[str, str] = {
    "depth_text": "depth_text.txt",
    "calibration": "calibration.jsonl",
    "long_output": "long_output.jsonl",
    "multi_turn": "multi_turn.jsonl",
    "long_context": "long_context.jsonl",
    "lm_eval/qeval_business_mc": "lm_eval/qeval_business_mc.yaml",
}

#: Every packaged file, relative to this package; each has a byte-identical twin in ``datasets/``
#: (files named relative to another travel beside it: the lm-eval task's data, the filler).
FILES: tuple[str, ...] = tuple(BUILTIN.values()) + ("lm_eval/qeval_business_mc.jsonl",
                                                    "long_context_filler.jsonl")

_extracted = contextlib.ExitStack()  # files extracted from a zipped install live until exit
atexit.register(_extracted.close)


def is_builtin(value: str) -> bool:
    """True when a recipe path field names shipped data (``builtin:...``)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def builtin_file(value: str) -> str:
    """The packaged file (relative to this package) that ``builtin:<name>`` names.

    Raises:
        KeyError: an unknown name; its message lists the known ones.
    """
    name = value[len(PREFIX):] if is_builtin(value) else value
    if name in BUILTIN:
        return BUILTIN[name]
    if name in FILES:
        return name
    raise KeyError(f"unknown builtin data {value!r} (known: "
                   + ", ".join(PREFIX + n for n in BUILTIN) + ")")


def builtin_path(value: str) -> Path:
    """A filesystem path of the packaged file ``builtin:<name>`` names: the file itself
    in a regular install (site-packages or an editable checkout); from a zipped install
    an extracted copy that lives until the process exits.

    Raises:
        KeyError: an unknown name.
    """
    res = resources.files(__name__).joinpath(*builtin_file(value).split("/"))
    if isinstance(res, Path):
        return res
    return Path(_extracted.enter_context(resources.as_file(res)))


__all__ = ["PREFIX", "BUILTIN", "FILES", "is_builtin", "builtin_file", "builtin_path"]
