#!/usr/bin/env python3
"""``vllm serve``'s own argument parser, from a pinned vLLM in an environment of its own:
the command qeval builds (``qeval/engines/servers/vllm.py``) is checked against it.

    python tools/vllm_args.py setup [--torch-spec SPEC]   # the venv: $QEVAL_CACHE/vllm_args/<version>/venv
    python tools/vllm_args.py dump [--out FILE]           # the parser's options -> tests/data/vllm_serve_args-<version>.json
    python tools/vllm_args.py check -- MODEL --flag ...   # parse one `vllm serve` command line; exit 0, or 2 and vLLM's error

The parser is the one ``vllm serve`` builds (``vllm/entrypoints/cli/main.py`` and
``ServeSubcommand.subparser_init`` in ``vllm/entrypoints/cli/serve.py``): a
``vllm.utils.argparse_utils.FlexibleArgumentParser`` with a ``serve`` subparser filled by
``vllm.entrypoints.common.cli_args.make_arg_parser`` (the frontend's arguments, then
``AsyncEngineArgs.add_cli_args``); ``check`` then runs ``validate_parsed_serve_args``, the
quick checks ``vllm serve`` makes before it loads anything. Only those modules are imported,
not the server, so the environment needs vLLM installed without its dependencies
(``pip install --no-deps``) and the dependencies of those imports only (:data:`PARSER_DEPS`:
read from the imports' source, then completed by importing the parser until nothing was
missing), with a CPU torch (``--torch-spec``: pip's own choice by default, a CUDA build from
PyPI on Linux unless your pip points at a CPU index or a local wheel; vLLM 0.34.0 pins torch
2.14.0, and its parser imports and runs with 2.13.0+cpu, which the snapshot records). No
GPU, no model, no CUDA library is needed: vLLM runs as its CPU platform there
(``VLLM_TARGET_DEVICE=cpu``).

The snapshot ``dump`` writes lists every option string the parser accepts (those it hides
from ``--help`` too, marked ``hidden``; a flag's ``negative`` strings set it off) with
``nargs``, ``choices``, the known values vLLM lists as ``metavar`` where it also takes any
string (``--kv-cache-dtype``; ``--quantization``'s list exists only for type checkers, so its
parser takes any string), and the value's type by name. :func:`parser_from_snapshot` rebuilds a
plain ``argparse`` parser from it (no abbreviations, plain ints and floats where vLLM parses
numbers), which is what ``make test`` checks qeval's commands with where vLLM is not installed.
Checked first: vLLM publishes no machine-readable list of its serve flags (its docs page
``configuration/serve_args`` is generated from the same parser by ``create_parser_for_docs``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The vLLM this repository is checked against (the README's Limits and docs/gpu.md name it).
VLLM_VERSION = "0.34.0"
#: What importing vLLM's serve parser needs beside vLLM (``--no-deps``) and torch, with the
#: versions vLLM's own metadata asks for where it pins them.
PARSER_DEPS: tuple[str, ...] = (
    "transformers>=5.16.1,<5.23.0", "huggingface_hub>=2.0.0", "tokenizers>=0.23.3", "safetensors>=0.6.2",
    "pydantic>=2.12.0", "fastapi>=0.133.0,<0.137.0", "openai>=2.25.0", "oss-harmony>=0.0.11", "aiohttp>=3.14.4",
    "requests>=2.33.0", "pillow>=13.0.0", "prometheus_client>=0.18.0", "pyzmq>=25.0.0", "msgspec", "cbor2",
    "cloudpickle", "cachetools", "py-cpuinfo", "psutil", "pybase64", "partial-json-parser", "regex", "pyyaml",
    "numpy", "packaging", "typing_extensions>=4.10", "uvloop",
    # structured-output backends whose classes the import reaches (annotations evaluated at import)
    "llguidance>=1.7.0,<1.8.0", "apache-tvm-ffi==0.1.11",
)
#: Installed with ``--no-deps`` beside vLLM: xgrammar's own dependencies would pull triton
#: (about 1 GB), which importing the parser never touches (the rest are in PARSER_DEPS).
NO_DEPS: tuple[str, ...] = ("xgrammar==0.2.8",)
SNAPSHOT = REPO / "tests" / "data" / f"vllm_serve_args-{VLLM_VERSION}.json"
#: Types whose values are integers (``human_readable_int*`` also take ``1k``; qeval writes digits).
INT_TYPES = ("int", "human_readable_int", "human_readable_int_or_auto")


def venv_dir(version: str = VLLM_VERSION) -> Path:
    """``$QEVAL_CACHE/vllm_args/<version>/venv`` (qeval's cache folder, :func:`qeval.paths.cache_root`)."""
    sys.path.insert(0, str(REPO))
    from qeval.paths import cache_root
    return cache_root() / "vllm_args" / version / "venv"


def venv_python(version: str = VLLM_VERSION) -> Path:
    """The venv's interpreter (it may not exist)."""
    return venv_dir(version) / "bin" / "python"


def setup(version: str, torch_spec: str) -> int:
    """Create the venv and install torch (``torch_spec``: pip arguments, e.g.
    ``"torch==2.14.0 --index-url https://download.pytorch.org/whl/cpu"``; default ``torch``),
    :data:`PARSER_DEPS`, then :data:`NO_DEPS` and vLLM ``version`` (``--no-deps``); then build
    the parser once.
    Returns an exit code (pip's on a failed install)."""
    d = venv_dir(version)
    py = d / "bin" / "python"
    if not py.exists():
        print(f"+ python -m venv {d}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(d)
    steps = [torch_spec.split() if torch_spec else ["torch"], list(PARSER_DEPS),
             ["--no-deps", *NO_DEPS, f"vllm=={version}"]]
    for args in steps:
        cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
        print("+ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            return 1
    return subprocess.run([str(py), __file__, "_inside", "dump", "--out", os.devnull]).returncode


# ---- inside the venv ---------------------------------------------------------------------

def _serve_parser():
    """``(top parser, serve parser)`` as ``vllm serve`` builds them."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    top = FlexibleArgumentParser(description="vLLM CLI")
    sub = top.add_subparsers(required=False, dest="subparser")
    serve = sub.add_parser("serve", usage="vllm serve [model_tag] [options]")
    return top, make_arg_parser(serve)


def _type_name(t) -> str | None:
    """A type callable's name; a wrapper (vLLM's ``optional_type``) adds its inner type's: ``_optional_type[int]``."""
    if t is None:
        return None
    name = getattr(t, "__name__", None) or type(t).__name__
    inner = [c.cell_contents for c in (getattr(t, "__closure__", None) or ()) if callable(c.cell_contents)]
    return f"{name}[{_type_name(inner[0])}]" if inner else name


def _json_value(v):
    """``v`` as JSON holds it: lists and tuples as lists, anything but a plain value as its ``str``."""
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def _dump() -> dict:
    import torch
    import vllm
    _top, p = _serve_parser()
    by_action: dict[int, list[str]] = {}
    for s, a in p._option_string_actions.items():  # what parsing looks up, hidden aliases included
        by_action.setdefault(id(a), []).append(s)
    options, positionals = [], []
    for a in p._actions:
        row = {"dest": a.dest, "action": type(a).__name__, "nargs": a.nargs,  # 0: a flag (store_true, --x/--no-x)
               "choices": [_json_value(c) for c in a.choices] if a.choices is not None else None,
               "known_values": [_json_value(c) for c in a.metavar] if isinstance(a.metavar, (list, tuple)) else None,
               "type": _type_name(a.type)}
        if not a.option_strings:
            if isinstance(a, argparse._SubParsersAction):
                continue
            positionals.append(row)
            continue
        names = sorted(by_action.get(id(a), a.option_strings))
        negative = sorted(getattr(a, "negative_option_strings", None) or
                          ({n for n in names if n.startswith("--no-")} if isinstance(a, argparse.BooleanOptionalAction)
                           else set()))
        row = {"strings": names, "hidden": sorted(set(names) - set(a.option_strings)), "negative": negative, **row}
        options.append(row)
    options.sort(key=lambda r: r["strings"][0])
    from vllm.platforms import current_platform
    return {"vllm": vllm.__version__, "python": sys.version.split()[0], "torch": torch.__version__,
            "platform": f"{type(current_platform).__name__} (VLLM_TARGET_DEVICE={os.environ.get('VLLM_TARGET_DEVICE')})",
            "parser": "the `serve` subparser of vllm.utils.argparse_utils.FlexibleArgumentParser filled by "
                      "vllm.entrypoints.common.cli_args.make_arg_parser (as vllm/entrypoints/cli/main.py and "
                      "ServeSubcommand.subparser_init build it)",
            "produced_by": f"python tools/vllm_args.py dump (vLLM {vllm.__version__} installed with --no-deps in "
                           "its own venv, its parser imported and read)",
            "positionals": positionals, "options": options}


def _check(lines: list[list[str]]) -> list[dict]:
    """Parse each ``vllm serve`` argument list as ``vllm serve`` does (then its
    ``validate_parsed_serve_args``): ``[{"ok", "error", "args"}]``, ``error`` vLLM's message."""
    import contextlib
    import io

    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    out = []
    for argv in lines:
        top, _serve = _serve_parser()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = top.parse_args(["serve", *argv])
                validate_parsed_serve_args(args)
        except SystemExit:  # argparse printed its usage, then "<prog>: error: <message>" (and vLLM's hints)
            text = err.getvalue()
            out.append({"ok": False, "error": " ".join(text[text.find(": error: ") + 9:].split()), "args": None})
            continue
        except (ValueError, TypeError) as e:
            out.append({"ok": False, "error": str(e), "args": None})
            continue
        out.append({"ok": True, "error": None,
                    "args": {k: _json_value(v) for k, v in sorted(vars(args).items()) if k in _given(argv, _serve)}})
    return out


def _given(argv: list[str], parser) -> set[str]:
    """The dests of the options named in ``argv`` (and the model)."""
    dests = {"model_tag"}
    for a in argv:
        act = parser._option_string_actions.get(a.split("=", 1)[0])
        if act is not None:
            dests.add(act.dest)
    return dests


def _inside(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's CPU platform (its own switch): without a GPU the platform is "unspecified" and the
    # parser's defaults cannot infer a device type. The options are the same on every
    # platform; one choice list follows it (--mm-processor-device adds the GPU's device type)
    # and so do some defaults (not in the snapshot).
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    cmd, rest = argv[0], argv[1:]
    if cmd == "dump":
        out = rest[rest.index("--out") + 1] if "--out" in rest else str(SNAPSHOT)
        text = json.dumps(_dump(), indent=1) + "\n"
        Path(out).write_text(text)
        if out != os.devnull:
            print(f"wrote {out} ({len(json.loads(text)['options'])} options)")
        return 0
    if cmd == "check":  # check IN OUT: a JSON list of argument lists in, the results out
        Path(rest[1]).write_text(json.dumps(_check(json.loads(Path(rest[0]).read_text())), indent=1) + "\n")
        return 0
    raise SystemExit(f"unknown inside command {cmd!r}")


# ---- the snapshot, without vLLM ----------------------------------------------------------

def load_snapshot(path: Path = SNAPSHOT) -> dict:
    """The snapshot ``dump`` wrote (JSON)."""
    return json.loads(Path(path).read_text())


class SnapshotParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors raise ``ValueError`` (argparse's message) instead of exiting."""

    def error(self, message: str):
        raise ValueError(message)


def parser_from_snapshot(snap: dict) -> SnapshotParser:
    """A plain ``argparse`` parser with the snapshot's positionals and option strings,
    ``nargs`` and ``choices``: flags store True, their negative strings (``--no-x``,
    ``--disable-x``) False; values of integer and float types must parse as such
    (:data:`INT_TYPES`, ``float``); known values (``metavar`` lists) are not enforced here
    (:func:`unknown_values`). No abbreviations (qeval writes whole option names); an
    unknown option, a missing or extra value, a value outside ``choices`` raise
    ``ValueError``. vLLM's parser also takes ``--opt_name`` spellings, ``--opt.key`` JSON
    parts and ``--config FILE``; qeval writes none of them."""
    p = SnapshotParser(prog="vllm serve", allow_abbrev=False, add_help=False, exit_on_error=False)
    for row in snap["positionals"]:
        p.add_argument(row["dest"], nargs=row["nargs"])
    for row in snap["options"]:
        typ = row["type"] or ""
        inner = typ.rpartition("[")[2].rstrip("]") if "[" in typ else typ
        conv = int if inner in INT_TYPES else float if inner == "float" else None
        if row["nargs"] == 0:
            pos = [x for x in row["strings"] if x not in row["negative"]]
            if pos:
                p.add_argument(*pos, dest=row["dest"], action="store_const", const=True)
            if row["negative"]:
                p.add_argument(*row["negative"], dest=row["dest"], action="store_const", const=False)
            continue
        kw: dict = {"dest": row["dest"]}
        if row["nargs"] is not None:
            kw["nargs"] = row["nargs"]
        if row["choices"] is not None:
            kw["choices"] = [str(c) for c in row["choices"] if c is not None]
        elif conv is not None:
            kw["type"] = conv
        p.add_argument(*row["strings"], **kw)
    return p


def unknown_values(snap: dict, argv: list[str]) -> list[str]:
    """``"--flag value"`` for each value in ``argv`` outside the flag's known values (vLLM
    lists them where it also takes any string, e.g. ``--quantization``: a value outside
    them needs a plugin that registers it)."""
    known = {s: row["known_values"] for row in snap["options"] if row.get("known_values") for s in row["strings"]}
    return [f"{a} {argv[i + 1]}" for i, a in enumerate(argv[:-1]) if a in known and argv[i + 1] not in known[a]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_inside"]:
        return _inside(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, what in (("setup", "make the venv"), ("dump", "write the snapshot"), ("check", "parse one command line")):
        c = sub.add_parser(name, help=what)
        c.add_argument("--version", default=VLLM_VERSION, help="the vLLM version (default %(default)s)")
        if name == "setup":
            c.add_argument("--torch-spec", default="", help="pip arguments for torch (default: torch, pip's choice)")
        elif name == "dump":
            c.add_argument("--out", default=None, help="the snapshot file (default tests/data/vllm_serve_args-<version>.json)")
        else:
            c.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the arguments after `vllm serve`")
    a = ap.parse_args(argv)
    if a.command == "setup":
        return setup(a.version, a.torch_spec)
    py = venv_python(a.version)
    if not py.exists():
        print(f"no vLLM {a.version} parser environment at {py.parent.parent}: run python tools/vllm_args.py setup",
              file=sys.stderr)
        return 2
    if a.command == "dump":
        out = a.out or str(REPO / "tests" / "data" / f"vllm_serve_args-{a.version}.json")
        return subprocess.run([str(py), __file__, "_inside", "dump", "--out", out]).returncode
    res = check_lines([a.rest[1:] if a.rest[:1] == ["--"] else a.rest], a.version)[0]
    print(json.dumps(res["args"], indent=1) if res["ok"] else f"vllm serve: {res['error']}",
          file=sys.stdout if res["ok"] else sys.stderr)
    return 0 if res["ok"] else 2


def check_lines(lines: list[list[str]], version: str = VLLM_VERSION) -> list[dict]:
    """Run vLLM's own parser (in its venv, one process for all) on each ``vllm serve``
    argument list (what follows ``vllm serve``). Returns ``[{"ok": bool, "error": vLLM's
    message or None, "args": {dest: value} of the options given}]``.

    Raises:
        FileNotFoundError: no venv for ``version`` (``setup`` makes it).
        RuntimeError: the parser could not be imported (its stderr's tail).
    """
    import tempfile
    py = venv_python(version)
    if not py.exists():
        raise FileNotFoundError(f"no vLLM {version} parser environment at {py.parent.parent}")
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.json", Path(d) / "out.json"
        src.write_text(json.dumps(lines))
        p = subprocess.run([str(py), __file__, "_inside", "check", str(src), str(dst)], capture_output=True, text=True)
        if p.returncode or not dst.exists():
            raise RuntimeError(f"vLLM's parser did not run (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
        return json.loads(dst.read_text())


if __name__ == "__main__":
    sys.exit(main())
