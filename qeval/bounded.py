"""Bounded reading of every file qeval takes from a user: YAML (recipes, lm-eval task
files), JSON (model configs, run folders) and JSONL rows (suites).

Each reader caps what hostile input can cost and answers bad input with one
:class:`~qeval.errors.QevalInputError` line naming the file (and the line when known):

* size: at most ``limit`` bytes are read (``/dev/zero`` or a FIFO is refused before any
  read: only regular files are opened);
* nesting depth: at most :data:`MAX_DEPTH` levels (deeper input would hit Python's
  recursion limit in PyYAML's composer, ``json``'s decoder or pydantic);
* YAML aliases: the document's size *with aliases expanded* is at most :data:`MAX_NODES`
  nodes, and an alias may not refer to the node it sits in (a "billion laughs" of a few
  hundred bytes, or a recursive alias, is refused in linear time, before anything walks it);
* values that Python refuses to build (an integer of more than 4300 digits, a timestamp of
  month 13) become input errors too.

Library checked: PyYAML (and its libyaml binding, used when installed) has no limits of
its own for aliases or depth, and the standard ``json`` module has none for depth or size,
so these checks are done here on PyYAML's event stream (a non-recursive parser) and on
the decoded JSON object (an iterative walk).

The safe path join (:func:`safe_join`) is here too: every name read from a file (a tier
name in ``run.json``) that becomes a path goes through it, so nothing outside the run
folder is ever read or written.
"""
from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import QevalInputError

#: Bytes read at most from a YAML file (recipes and lm-eval task files are a few KiB).
MAX_YAML_BYTES = 1 << 20
#: Bytes read at most from a JSON file (model configs, run.json, tier results).
MAX_JSON_BYTES = 64 << 20
#: Bytes read at most from a suite JSONL file.
MAX_JSONL_BYTES = 64 << 20
#: Nesting levels allowed in any YAML or JSON document (qeval's own files need fewer than 10).
MAX_DEPTH = 64
#: Nodes a YAML document may hold with its aliases expanded.
MAX_NODES = 100_000

_YAML_LOADER = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader  # libyaml when built


class _Loader(_YAML_LOADER):  # type: ignore[misc, valid-type]
    """Safe loader that also reads YAML 1.2 floats without a dot (``1e-3``): YAML 1.1
    (PyYAML) would load them as strings, which a strict number field then refuses."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# ---- names and messages ---------------------------------------------------------------------

#: Longest tier, suite or recipe name (characters): names become file and folder names
#: with suffixes such as ``.quality.error.json``, and a file name has at most 255 bytes.
MAX_NAME_LEN = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def name_problem(v: Any, what: str = "name") -> str | None:
    """Why ``v`` is not a valid tier/suite/recipe name (None when it is): letters, digits,
    ``-``, ``_``, ``.``, ``+``, starting with a letter or digit, at most
    :data:`MAX_NAME_LEN` characters, no ``..`` (the whole string must match: a trailing
    newline does not pass, unlike ``re.match`` with ``$``)."""
    if not isinstance(v, str):
        return f"{what} must be a string"
    if len(v) > MAX_NAME_LEN:
        return f"{what} is {len(v)} characters long; at most {MAX_NAME_LEN} (it names files)"
    if ".." in v or not _NAME.fullmatch(v):
        return (f"{what} {show_value(v)} must be letters, digits, '-', '_', '.', '+', starting with a letter "
                "or digit (no path separators, no '..'; it names files)")
    return None


def checked_name(v: Any, what: str = "name") -> str:
    """``v`` when it is a valid name (:func:`name_problem`), for pydantic field validators.

    Raises:
        ValueError: the problem, one line.
    """
    problem = name_problem(v, what)
    if problem:
        raise ValueError(problem)
    return v


def show_value(v: Any, limit: int = 60) -> str:
    """A short, one-line ``repr`` of a user value for an error message (a 400-digit
    integer or a megabyte string is summarised, never printed whole)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"
    r = repr(v) if not isinstance(v, (str, bytes)) or len(v) <= 4 * limit else repr(v[: 2 * limit])
    return r if len(r) <= limit else r[: limit - 1] + "…"


def pydantic_message(err: dict) -> str:
    """One line for one pydantic error dict (``ValidationError.errors()[i]``): the
    ``Value error, `` prefix dropped, the offending value shown short (:func:`show_value`)."""
    typ = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    if typ == "extra_forbidden":
        return "unknown field"
    if typ == "missing":
        return "required field is missing"
    if typ == "int_parsing_size":  # pydantic's text speaks of parsing a string
        msg = "integer out of range"
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if "input" in err and typ not in ("model_attributes_type",) and not isinstance(err["input"], (dict, list)):
        msg += f" (got {show_value(err['input'])})"
    return " ".join(msg.split())


# ---- paths ------------------------------------------------------------------------------------

def expand_user(path: str | Path, *, field: str | None = None, file: str | Path | None = None) -> Path:
    """``Path(path).expanduser()``, where ``~nosuchuser/x`` is an input error instead of
    Python's RuntimeError.

    Raises:
        QevalInputError: the ``~user`` part names no user (or there is no home folder).
    """
    try:
        return Path(path).expanduser()
    except RuntimeError:
        head = str(path).split("/", 1)[0]
        raise QevalInputError(f"cannot expand {head!r} in {str(path)!r}: no such user or home folder",
                              file=file, field=field) from None


def safe_join(root: str | Path, *names: str, what: str = "name", file: str | Path | None = None) -> Path:
    """``root / names[0] / names[1] ...`` that stays inside ``root``.

    Each name must be one plain path component (no ``/``, ``\\``, NUL, ``..`` or ``.``,
    not empty), and the joined path, symlinks resolved, must lie inside ``root`` resolved.

    Raises:
        QevalInputError: a name that would leave ``root`` (naming ``file`` when given).
    """
    base = Path(root)
    out = base
    for n in names:
        if (not isinstance(n, str) or not n or n in (".", "..") or "/" in n or "\\" in n or "\0" in n
                or len(n) > 255):
            shown = repr(n)[:80]
            raise QevalInputError(f"{what} {shown} is not a plain file name (it would leave {base})",
                                  file=file)
        out = out / n
    try:
        inside = out.resolve().is_relative_to(base.resolve())
    except (OSError, RuntimeError, ValueError):
        inside = False
    if not inside:
        raise QevalInputError(f"{what} {names[-1]!r} leads outside {base} (a symlink?)", file=file)
    return out


# ---- bytes and text ---------------------------------------------------------------------------

def read_bytes(path: str | Path, *, limit: int, what: str = "file", field: str | None = None) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``.

    Raises:
        QevalInputError: missing, a folder, not a regular file (device, FIFO, socket),
            unreadable, or larger than ``limit`` bytes.
    """
    p = expand_user(path, field=field)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise QevalInputError(f"{what} not found", file=p, field=field) from None
    except OSError as e:
        raise QevalInputError(f"cannot read {what}: {e.strerror or e.__class__.__name__}", file=p,
                              field=field) from None
    if stat.S_ISDIR(st.st_mode):
        raise QevalInputError(f"{what} is a folder, not a file", file=p, field=field)
    if not stat.S_ISREG(st.st_mode):
        raise QevalInputError(f"{what} is not a regular file (a device, pipe or socket)", file=p, field=field)
    if st.st_size > limit:
        raise QevalInputError(f"{what} is {st.st_size:,} bytes, more than the {limit:,} allowed", file=p,
                              field=field)
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise QevalInputError(f"cannot read {what}: {e.strerror or e.__class__.__name__}", file=p,
                              field=field) from None
    if len(data) > limit:  # grew while we looked
        raise QevalInputError(f"{what} is more than the {limit:,} bytes allowed", file=p, field=field)
    return data


def decode_utf8(raw: bytes, *, file: str | Path | None = None, field: str | None = None) -> str:
    """UTF-8 text of ``raw`` (a leading BOM dropped).

    Raises:
        QevalInputError: not UTF-8, naming the line of the first bad byte.
    """
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise QevalInputError(f"not valid UTF-8 text ({e.reason} at byte {e.start})", file=file, line=line,
                              field=field) from None


# ---- YAML -------------------------------------------------------------------------------------

def _yaml_error(e: yaml.YAMLError, file: str | Path | None) -> QevalInputError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return QevalInputError(f"not valid YAML: {problem}", file=file, line=(mark.line + 1) if mark else None)


def _scan_yaml(text: str, file: str | Path | None, max_depth: int, max_nodes: int) -> None:
    """Walk PyYAML's event stream (no recursion, no objects built) and refuse documents
    nested deeper than ``max_depth`` or bigger than ``max_nodes`` with aliases expanded."""
    sizes: dict[str, int] = {}    # anchor -> expanded node count
    open_anchors: set[str] = set()
    stack: list[list] = []        # [node count so far, anchor] per open collection
    total = 0

    def add(n: int, mark) -> None:
        nonlocal total
        if stack:
            stack[-1][0] += n
            big = stack[-1][0] > max_nodes
        else:
            total += n
            big = total > max_nodes
        if big:
            raise QevalInputError(f"document is too large: more than {max_nodes:,} values with its aliases "
                                  "expanded (nested aliases?)", file=file, line=mark.line + 1 if mark else None)

    for ev in yaml.parse(text, Loader=_Loader):
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= max_depth:
                raise QevalInputError(f"nested more than {max_depth} levels deep", file=file,
                                      line=ev.start_mark.line + 1)
            stack.append([1, ev.anchor])
            if ev.anchor:
                open_anchors.add(ev.anchor)
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            n, anchor = stack.pop()
            if anchor:
                sizes[anchor] = n
                open_anchors.discard(anchor)
            add(n, ev.start_mark)
        elif isinstance(ev, yaml.ScalarEvent):
            if ev.anchor:
                sizes[ev.anchor] = 1
            add(1, ev.start_mark)
        elif isinstance(ev, yaml.AliasEvent):
            if ev.anchor in open_anchors:
                raise QevalInputError(f"alias *{ev.anchor} refers to the collection it is inside (a recursive "
                                      "structure)", file=file, line=ev.start_mark.line + 1)
            add(sizes.get(ev.anchor, 1), ev.start_mark)


def parse_yaml(text: str, *, file: str | Path | None = None, max_depth: int = MAX_DEPTH,
               max_nodes: int = MAX_NODES,
               on_node: Callable[[yaml.Node | None], None] | None = None) -> tuple[Any, yaml.Node | None]:
    """Parse one YAML document with the bounds of this module.

    ``on_node`` sees PyYAML's node tree before values are built (building rewrites merge
    keys ``<<`` in the tree); an error it raises propagates.

    Returns:
        ``(data, node)``: the loaded value (None for an empty document) and PyYAML's node
        tree (its marks give line numbers).

    Raises:
        QevalInputError: invalid YAML, too deep, too large with aliases expanded, a
            recursive alias, or a value Python cannot build; names ``file`` and the line.
    """
    try:
        _scan_yaml(text, file, max_depth, max_nodes)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if on_node is not None:
                on_node(node)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise _yaml_error(e, file) from None
    except RecursionError:  # pragma: no cover - the depth scan stops this first
        raise QevalInputError(f"nested too deeply (more than {max_depth} levels)", file=file) from None
    except (ValueError, TypeError, OverflowError) as e:  # int('1' * 5000), a timestamp of month 13
        raise QevalInputError(f"a value cannot be read: {' '.join(str(e).split())[:200]}", file=file) from None
    return data, node


def load_yaml(path: str | Path, *, limit: int = MAX_YAML_BYTES, what: str = "YAML file",
              field: str | None = None) -> tuple[Any, yaml.Node | None]:
    """:func:`read_bytes` + :func:`decode_utf8` + :func:`parse_yaml` of ``path``.

    Raises:
        QevalInputError: as those three; naming the file.
    """
    text = decode_utf8(read_bytes(path, limit=limit, what=what, field=field), file=path, field=field)
    return parse_yaml(text, file=path)


# ---- JSON -------------------------------------------------------------------------------------

def json_depth_exceeds(obj: Any, max_depth: int = MAX_DEPTH) -> bool:
    """Whether ``obj`` (lists and dicts) nests deeper than ``max_depth`` (iterative walk)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            children = o.values()
        elif isinstance(o, list):
            children = o
        else:
            continue
        if d > max_depth:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[\[\]{}\n]')


def _deep_line(text: str, max_depth: int) -> int | None:
    """1-based line where ``text``'s bracket nesting first passes ``max_depth``."""
    depth, line = 0, 1
    for m in _JSON_TOKEN.finditer(text):
        c = m.group(0)
        if c == "\n":
            line += 1
        elif c in "[{":
            depth += 1
            if depth > max_depth:
                return line
        elif c in "]}":
            depth -= 1
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str, *, file: str | Path | None = None, line: int | None = None,
               field: str | None = None, strict: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text with a depth bound.

    Args:
        strict: refuse duplicate keys and ``NaN``/``Infinity`` (user-written files such as
            suite rows); qeval's own run files may hold NaN figures.
        line: the text's line in ``file`` (for a JSONL row).

    Raises:
        QevalInputError: invalid JSON, nested deeper than ``max_depth``, a number Python
            refuses (more than 4300 digits); names ``file`` and the line.
    """
    hooks = {"object_pairs_hook": _no_duplicate_keys, "parse_constant": _reject_constant} if strict else {}
    try:
        obj = json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        where = line if line is not None else e.lineno
        col = f" (column {e.colno})" if line is not None else ""
        raise QevalInputError(f"invalid JSON: {e.msg}{col}", file=file, line=where, field=field) from None
    except RecursionError:
        raise QevalInputError(f"nested more than {max_depth} levels deep", file=file,
                              line=line if line is not None else _deep_line(text, max_depth), field=field) from None
    except ValueError as e:  # the hooks' errors, int('1' * 5000)
        raise QevalInputError(f"invalid JSON: {' '.join(str(e).split())[:200]}", file=file, line=line,
                              field=field) from None
    if json_depth_exceeds(obj, max_depth):
        raise QevalInputError(f"nested more than {max_depth} levels deep", file=file,
                              line=line if line is not None else _deep_line(text, max_depth), field=field)
    return obj


_KINDS = {dict: "a JSON object", list: "a JSON array"}


def _describe(v: Any) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "a boolean"
    if v is None:
        return "null"
    return "a number"


def load_json(path: str | Path, *, limit: int = MAX_JSON_BYTES, expect: type | None = dict,
              what: str = "JSON file", field: str | None = None, strict: bool = False) -> Any:
    """A bounded JSON file: :func:`read_bytes`, UTF-8, :func:`parse_json`, and the top
    level of type ``expect`` (None: any).

    Raises:
        QevalInputError: as those; or the top level is not ``expect`` (naming the file).
    """
    text = decode_utf8(read_bytes(path, limit=limit, what=what, field=field), file=path, field=field)
    obj = parse_json(text, file=path, field=field, strict=strict)
    if expect is not None and not isinstance(obj, expect):
        raise QevalInputError(f"must be {_KINDS.get(expect, expect.__name__)}, not {_describe(obj)}",
                              file=path, line=1, field=field)
    return obj


# ---- outputs ----------------------------------------------------------------------------------

def _probe_dir(folder: Path, *, field: str | None) -> None:
    """Create and remove a temporary file in ``folder``: the honest writability test
    (``os.access`` does not see read-only mounts, and root passes every mode check)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".qeval-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise QevalInputError(f"cannot write into this folder: {e.strerror or e.__class__.__name__}",
                              file=folder, field=field) from None


def check_output_dir(path: str | Path, *, field: str | None = None, create: bool = True) -> Path:
    """A folder qeval will write into: created when ``create`` (with its parents) and
    missing, and writable (:func:`_probe_dir`). Checked before any stage starts.

    Raises:
        QevalInputError: empty, an existing non-folder (``/dev/null``), cannot be created
            (``/proc/x``), or not writable (a read-only run folder).
    """
    if str(path) == "":
        raise QevalInputError("an empty path is not a folder", field=field)
    p = expand_user(path, field=field)
    if p.exists() and not p.is_dir():
        raise QevalInputError("is not a folder", file=p, field=field)
    if not p.exists():
        if not create:
            raise QevalInputError("folder not found", file=p, field=field)
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QevalInputError(f"cannot create this folder: {e.strerror or e.__class__.__name__}", file=p,
                                  field=field) from None
    _probe_dir(p, field=field)
    return p


def check_output_file(path: str | Path, *, field: str | None = None, not_in: tuple[Path, ...] = ()) -> Path:
    """A file qeval will write (atomically, beside itself): not empty, not a folder nor a
    device, not one of ``not_in`` (qeval's own outputs), its folder creatable and writable.
    Checked before any stage starts.

    Raises:
        QevalInputError: naming the flag and the path.
    """
    if str(path).strip() == "":
        raise QevalInputError("give a file name (got an empty string)", field=field)
    p = expand_user(path, field=field)
    if p.is_dir():
        raise QevalInputError("is a folder; give a file name", file=p, field=field)
    if p.exists() and not p.is_file():
        raise QevalInputError("is not a regular file (a device or pipe)", file=p, field=field)
    try:
        resolved = p.resolve()
        clash = any(resolved == q.resolve() for q in not_in)
    except (OSError, RuntimeError):
        clash = False
    if clash:
        raise QevalInputError("would overwrite one of the run's own outputs", file=p, field=field)
    check_output_dir(p.parent if str(p.parent) else Path("."), field=field)
    return p
