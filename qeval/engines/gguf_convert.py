"""Hugging Face checkpoint -> F16/BF16 GGUF, with the converter that matches the installed llama.cpp.

The PyPI ``gguf`` package has no HF-to-GGUF converter, and its release lags llama.cpp
(0.19.0 lacks ``LazyChunkedTensor``, which the current converter needs). The converter
that matches the llama.cpp compiled into llama-cpp-python is ``vendor/llama.cpp/
convert_hf_to_gguf.py`` in the llama-cpp-python sdist of the installed version, with its
``conversion/`` package and its bundled ``gguf-py``. :func:`ensure_converter` downloads
that sdist once through pip and keeps only those three parts (and llama.cpp's LICENSE) in
``$QEVAL_LLAMA_CONVERTER_DIR/<version>/`` (default ``$QEVAL_CACHE/llama_cpp_convert/``).
Nothing of it is committed to this repository.

:func:`convert_hf_to_gguf` runs the converter in a subprocess whose ``PYTHONPATH`` starts
with the bundled ``gguf-py``, so it never clashes with the installed ``gguf`` (which qeval
and transformers use to read GGUF files).

Install-time fetch (the Makefile calls it)::

    python -m qeval.engines.gguf_convert --fetch
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

from ..hashing import file_sha256
from .. import paths

CONVERTER_DIR_ENV = "QEVAL_LLAMA_CONVERTER_DIR"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE")
_MARKER = ".qeval-complete"

# Runs inside the converter subprocess: ``python -c _RUNNER CONVERTER_DIR ARGS...``.
# The converter's llama/granite vocab path imports sentencepiece before it checks for a
# tokenizer.model file, so without sentencepiece installed a BPE (tokenizer.json) model
# fails with ModuleNotFoundError instead of falling through to the BPE vocab. When
# sentencepiece is missing, the check for the file is made first; a checkpoint that does
# ship tokenizer.model still gets the converter's own ImportError.
_RUNNER = r"""
import importlib.util, os, runpy, sys
conv = sys.argv[1]
script = os.path.join(conv, "convert_hf_to_gguf.py")
sys.path[:0] = [conv, os.path.join(conv, "gguf-py")]
import gguf
if not os.path.abspath(gguf.__file__).startswith(os.path.abspath(conv)):
    raise SystemExit(f"qeval: the converter picked up gguf from {gguf.__file__}, not its bundled gguf-py")
if importlib.util.find_spec("sentencepiece") is None:
    import conversion.base as _cb
    _orig = _cb.TextModel._create_vocab_sentencepiece
    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return _orig(self)
    _cb.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def llama_cpp_version() -> str:
    """Installed llama-cpp-python version (from package metadata; llama_cpp is not imported).

    Raises:
        RuntimeError: llama-cpp-python is not installed.
    """
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        raise RuntimeError("llama-cpp-python is not installed (pip install 'qeval[gguf]', see the Makefile)") from None


def converter_root() -> Path:
    """``$QEVAL_LLAMA_CONVERTER_DIR`` or ``$QEVAL_CACHE/llama_cpp_convert``."""
    env = os.environ.get(CONVERTER_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return paths.converter_dir()


def converter_dir(version: str | None = None) -> Path:
    """Folder of the converter for llama-cpp-python ``version`` (default: the installed one)."""
    return converter_root() / (version or llama_cpp_version())


def converter_present(folder: Path) -> bool:
    """True when ``folder`` holds a complete extracted converter."""
    return ((folder / _MARKER).is_file() and (folder / "convert_hf_to_gguf.py").is_file()
            and (folder / "conversion" / "__init__.py").is_file()
            and (folder / "gguf-py" / "gguf" / "__init__.py").is_file())


_REGISTER = re.compile(r"@ModelBase\.register\(([^)]*)\)", re.S)


def converter_architectures(folder: Path | None = None) -> frozenset[str]:
    """The HF ``architectures`` names llama.cpp's converter in ``folder`` (default:
    :func:`converter_dir`) converts: the strings of every ``@ModelBase.register(...)`` line in
    ``convert_hf_to_gguf.py`` and ``conversion/*.py``; empty when the converter is not there
    (nothing can be said before it is fetched)."""
    try:
        folder = folder or converter_dir()
    except Exception:  # noqa: BLE001 - no llama-cpp-python: no converter to read
        return frozenset()
    if not converter_present(folder):
        return frozenset()
    names: set[str] = set()
    for f in [folder / "convert_hf_to_gguf.py", *sorted((folder / "conversion").glob("*.py"))]:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for m in _REGISTER.finditer(text):
            names.update(re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", m.group(1)))
    return frozenset(names)


def _wanted(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in _PARTS)


def extract_converter(sdist: Path, dest: Path) -> int:
    """Extract the converter parts of a llama-cpp-python sdist into ``dest``; returns the
    number of files written.

    Raises:
        RuntimeError: the sdist has no ``vendor/llama.cpp/convert_hf_to_gguf.py``.
    """
    n = 0
    with tarfile.open(sdist, "r:*") as tf:
        for m in tf:
            parts = m.name.split("/")
            # <pkg>-<ver>/vendor/llama.cpp/<rel>
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not m.isfile():
                continue
            rel = "/".join(parts[3:])
            if not _wanted(rel) or "/__pycache__/" in rel or ".." in parts:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(m)
            assert src is not None
            with src, open(target, "wb") as f:
                shutil.copyfileobj(src, f)
            n += 1
    if not (dest / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return n


def download_sdist(version: str, into: Path, *, timeout: float = 900.0, purpose: str = "its llama.cpp source") -> Path:
    """Download the llama-cpp-python ``version`` sdist (about 75 MB) into folder ``into``
    through pip (``pip download --no-deps --no-binary llama-cpp-python``: the sdist, while its
    build requirements, which pip installs to read its metadata, may be wheels, as an offline
    wheelhouse holds them; ``PIP_NO_INDEX``/``PIP_FIND_LINKS`` point pip there) and return its path.

    Raises:
        RuntimeError: pip failed (no network, version not on the index); the message
            carries pip's last lines and names ``purpose``.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
           "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", str(into)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    sdists = sorted(into.glob("llama_cpp_python-*.tar.gz")) if into.is_dir() else []
    if p.returncode != 0 or not sdists:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"cannot download the llama-cpp-python {version} sdist for {purpose} "
                           f"({' '.join(cmd)} exited {p.returncode}):\n{tail}")
    return sdists[0]


def ensure_converter(version: str | None = None, log: Callable[[str], None] = print,
                     timeout: float = 900.0) -> Path:
    """Folder of the converter matching llama-cpp-python ``version`` (default: installed),
    fetched on first use: ``pip download --no-deps --no-binary llama-cpp-python
    llama-cpp-python==<version>`` (about 75 MB, about a minute), then only the converter,
    ``conversion/`` and ``gguf-py/gguf`` are kept. Safe against concurrent fetches (the
    folder is renamed into place complete).

    Raises:
        RuntimeError: pip failed (no network, version not on the index) or the sdist
            lacks the converter; the message carries pip's last lines.
    """
    version = version or llama_cpp_version()
    dest = converter_dir(version)
    if converter_present(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching the llama.cpp HF-to-GGUF converter (llama-cpp-python {version} sdist) into {dest}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="qeval-llama-sdist-", dir=dest.parent) as td:
        sdist = download_sdist(version, Path(td) / "dl", timeout=timeout, purpose="its GGUF converter")
        stage = Path(td) / "converter"
        stage.mkdir()
        n = extract_converter(sdist, stage)
        (stage / _MARKER).write_text(f"{sdist.name} sha256={file_sha256(sdist)} files={n}\n")
        if converter_present(dest):  # another process won the race
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(stage, dest)
        except OSError:
            if not converter_present(dest):  # not a lost race: a real error
                raise
            return dest
    log(f"converter ready in {time.time() - t0:.0f} s")
    return dest


def convert_hf_to_gguf(checkpoint: str | Path, out_file: str | Path, outtype: str = "f16", *,
                       threads: int | None = None, log: Callable[[str], None] = print,
                       timeout: float | None = None) -> dict:
    """Convert a Hugging Face checkpoint folder to one GGUF file of ``outtype``.

    Args:
        checkpoint: folder with config.json, safetensors and tokenizer files.
        out_file: the GGUF file to write (written as ``<out_file>.part``, renamed when done).
        outtype: ``f16``, ``bf16`` or ``f32`` (the converter's ``--outtype``).
        threads: torch/OpenMP threads of the converter process.

    Returns:
        ``{"seconds", "outtype", "converter", "bytes"}``.

    Raises:
        ValueError: ``outtype`` is not f16/bf16/f32.
        RuntimeError: the converter failed (its last lines in the message); nothing is left
            at ``out_file``.
    """
    if outtype not in ("f16", "bf16", "f32"):
        raise ValueError(f"outtype {outtype!r}: expected f16, bf16 or f32")
    conv = ensure_converter(log=log)
    out = Path(out_file)
    part = out.with_name(out.name + ".part")
    part.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(conv / "gguf-py")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("NO_LOCAL_GGUF", None)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-c", _RUNNER, str(conv), str(checkpoint), "--outfile", str(part), "--outtype", outtype]
    t0 = time.time()
    log(f"converting {Path(checkpoint).name} to {outtype} GGUF")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if p.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-12:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint} (exit {p.returncode}):\n{tail}")
    os.replace(part, out)
    return {"seconds": time.time() - t0, "outtype": outtype, "converter": f"llama-cpp-python {conv.name}",
            "bytes": out.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qeval.engines.gguf_convert",
                                 description="Fetch the llama.cpp HF-to-GGUF converter matching the installed "
                                             "llama-cpp-python, or convert a checkpoint with it.")
    ap.add_argument("--fetch", action="store_true", help="download the converter when missing and print its folder")
    ap.add_argument("--convert", nargs=2, metavar=("CHECKPOINT", "OUT_GGUF"), help="convert a checkpoint folder")
    ap.add_argument("--outtype", default="f16", choices=["f16", "bf16", "f32"])
    a = ap.parse_args(argv)
    if not (a.fetch or a.convert):
        ap.error("give --fetch or --convert")
    try:
        if a.fetch:
            print(ensure_converter(log=lambda s: print(s, file=sys.stderr)))
        if a.convert:
            info = convert_hf_to_gguf(a.convert[0], a.convert[1], a.outtype, log=lambda s: print(s, file=sys.stderr))
            print(f"{a.convert[1]}: {info['bytes']} bytes in {info['seconds']:.1f} s")
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
