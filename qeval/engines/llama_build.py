"""Build and install llama-cpp-python with ggml's CPU variants chosen at run time.

``make setup`` runs this file by path (before qeval's dependencies exist, so it imports
the standard library and :mod:`qeval.engines.ggml_cpu` only)::

    python qeval/engines/llama_build.py --cmake-args "..." [--variants auto|all|a,b] [SPEC]

It does what ``CMAKE_ARGS=... pip install llama-cpp-python`` does, with two changes:

1. The CPU variants. llama.cpp's release builds compile ggml's CPU backend once per
   instruction-set family (``GGML_BACKEND_DL=ON``, ``GGML_CPU_ALL_VARIANTS=ON``: 14 on
   x86-64) and load the best one at run time. Each variant costs about 55 s of one core
   (measured on this project's 2-core machines; the whole variant-free rest of the
   llama-cpp-python build is a few minutes), so all 14 would add about 9 CPU minutes (some 5 minutes of wall time) to
   ``make setup`` on 2 cores. ``--variants auto`` keeps two: the AVX2 baseline the
   portable build ran everywhere (``haswell``) and the best variant this machine may run
   (:func:`resolve_variants`; an AMX one only where the kernel grants AMX): the sdist's
   ``ggml/src/CMakeLists.txt`` is trimmed to those ``ggml_add_cpu_backend_variant``
   lines (the one edit; when its pattern is not found the build keeps all variants and
   says so). ``--variants all`` is llama.cpp's release set. Which variant runs is chosen
   in the process that loads the library (:func:`qeval.engines.ggml_cpu.load_backends`).
2. The wheel cache. pip keys the wheels it builds from an sdist by the sdist alone, so a
   changed ``CMAKE_ARGS`` would get the old wheel back (the reason the CUDA build used
   ``--no-cache-dir``). Here the built wheel is kept under
   ``$QEVAL_CACHE/wheels/llama_cpp_python/<version>-<key>/`` with ``key`` a hash of the
   sdist name, the CMake arguments and the variant list; the wheel chooses its CPU kernels
   at run time, so it may serve any x86-64 machine with AVX2.

Raises nothing to the shell: exit 1 with the last build lines on a failed build.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

try:
    from . import ggml_cpu
except ImportError:  # run by path from the Makefile: qeval's package is not importable yet
    import ggml_cpu  # type: ignore[no-redef]

PATCH_VERSION = 1  # part of the wheel key: bump when trim_variants changes what it writes
_VARIANT_LINE = re.compile(r"^(\s*)ggml_add_cpu_backend_variant\((\w+)\b[^)]*\)\s*$")


def cache_root() -> Path:
    """``$QEVAL_CACHE`` or ``~/.cache/qeval`` (as :func:`qeval.paths.cache_root`)."""
    env = os.environ.get("QEVAL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qeval"


def resolve_variants(spec: str, amx_ok: bool | None = None, flags: frozenset[str] | None = None) -> list[str] | None:
    """The variants to build: ``auto``, ``all`` (None: llama.cpp's whole list), or names
    separated by commas.

    ``auto`` is the AVX2 baseline (``haswell``: every x86-64 machine of this project runs
    it, so the wheel still serves a machine it was not built on) and the best variant this
    machine may run (:func:`qeval.engines.ggml_cpu.machine_variant`: every instruction set
    listed by the kernel, AMX only when granted; ``x64`` on a machine that lists none of
    their instruction sets); where the machine lists AMX, also its best variant without
    AMX (``zen4`` or ``icelake``...), the fallback when the AMX kernels trap in the run-time
    probe (:func:`qeval.engines.ggml_cpu.run_probes`). Each variant costs about 55 s of one core.

    Args:
        amx_ok, flags: whether AMX is granted and the cpuinfo flags (tests inject them;
            default: this machine's).

    Raises:
        ValueError: a name that is not one of ggml's x86 variants.
    """
    if spec == "all":
        return None
    if spec == "auto":
        ok = ggml_cpu.amx_granted() if amx_ok is None else amx_ok
        best = ggml_cpu.machine_variant(ggml_cpu.cpu_flags() if flags is None else flags, ok)
        if best is None:  # no x86 variant known to ggml_cpu at all
            return list(ggml_cpu.DEFAULT_VARIANTS)
        out = ["haswell"] + ([best] if best != "haswell" else [])
        fl = ggml_cpu.cpu_flags() if flags is None else flags
        if best in ggml_cpu.AMX_VARIANTS or set(fl) & set(ggml_cpu.AMX_FLAGS):
            # a machine that lists AMX may still trap its kernels (a virtual machine that grants
            # the tile state and dies at the first tileloadd): the probe then passes over the
            # AMX variant, and this fallback keeps the CPU's AVX-512 instead of AVX2
            wide = ggml_cpu.machine_variant(fl, False)
            if wide and wide not in out:
                out.append(wide)
        return out
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in ggml_cpu.VARIANT_FLAGS]
    if bad or not names:
        raise ValueError(f"unknown CPU variant {bad[0] if bad else spec!r}: expected auto, all or names "
                         f"among {', '.join(ggml_cpu.VARIANT_FLAGS)}")
    return names


def trim_variants(cmakelists: str, keep: list[str]) -> str | None:
    """``ggml/src/CMakeLists.txt`` with the x86 ``ggml_add_cpu_backend_variant(<name> ...)``
    lines of variants outside ``keep`` commented out; None when a kept name has no line
    (another llama.cpp layout: the caller builds every variant)."""
    seen: set[str] = set()
    out = []
    for line in cmakelists.splitlines(keepends=True):
        m = _VARIANT_LINE.match(line)
        if m and m.group(2) in ggml_cpu.VARIANT_FLAGS:
            seen.add(m.group(2))
            if m.group(2) not in keep:
                line = f"{m.group(1)}# qeval: variant not built: {line.lstrip()}"
        out.append(line)
    return "".join(out) if set(keep) <= seen else None


def _run(cmd: list[str], env: dict | None = None, log: Path | None = None) -> None:
    if log is None:
        p = subprocess.run(cmd, env=env)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {p.returncode})")
        return
    with open(log, "w") as lf:
        p = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT)
    if p.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {p.returncode}); last lines of {log}:\n{tail}")


def build_wheel(spec: str, cmake_args: str, variants: list[str] | None, *, python: str = sys.executable,
                log=print) -> Path:
    """The llama-cpp-python wheel for ``spec`` built with ``cmake_args`` and ``variants``
    (None: all), from the cache when built before; returns the wheel's path.

    Raises:
        RuntimeError: the sdist download or the build failed.
    """
    root = cache_root() / "wheels" / "llama_cpp_python"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qeval-llama-build-", dir=root) as td:
        t = Path(td)
        _run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(t / "dl"), spec])
        sdists = sorted((t / "dl").glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise RuntimeError(f"pip download {spec} gave {len(sdists)} llama-cpp-python sdists")
        sdist = sdists[0]
        version = sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]
        key_src = json.dumps([sdist.name, " ".join(cmake_args.split()), variants, PATCH_VERSION])  # Makefile spacing never rebuilds
        out = root / f"{version}-{hashlib.sha256(key_src.encode()).hexdigest()[:12]}"
        wheels = sorted(out.glob("*.whl"))
        if wheels:
            log(f"llama-cpp-python {version}: wheel from the cache ({out})")
            return wheels[0]
        with tarfile.open(sdist) as tf:
            tf.extractall(t / "src", filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(t / "src")
        tree = next((t / "src").iterdir())
        built = "all of llama.cpp's CPU variants"
        if variants is not None:
            f = tree / "vendor" / "llama.cpp" / "ggml" / "src" / "CMakeLists.txt"
            trimmed = trim_variants(f.read_text(), variants)
            if trimmed is None:
                log(f"warning: {f.relative_to(tree)} has no line for one of {', '.join(variants)}: building all variants")
            else:
                f.write_text(trimmed)
                built = "CPU variants " + ", ".join(variants)
        log(f"building llama-cpp-python {version} ({built}; CMAKE_ARGS={cmake_args}); minutes on 2 cores")
        env = dict(os.environ, CMAKE_ARGS=cmake_args, FORCE_CMAKE="1")
        t0 = time.time()
        _run([python, "-m", "pip", "wheel", "--no-deps", "-w", str(t / "whl"), str(tree)], env=env,
             log=t / "build.log")
        seconds = time.time() - t0
        whl = sorted((t / "whl").glob("llama_cpp_python-*.whl"))
        if len(whl) != 1:
            raise RuntimeError(f"pip wheel left {len(whl)} llama-cpp-python wheels in {t / 'whl'}")
        stage = t / "out"
        stage.mkdir()
        shutil.move(str(whl[0]), stage / whl[0].name)
        (stage / "build.json").write_text(json.dumps(
            {"sdist": sdist.name, "cmake_args": shlex.split(cmake_args), "variants": variants or "all",
             "seconds": round(seconds, 1)}, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(stage, out)
        log(f"llama-cpp-python {version} built in {seconds:.0f} s ({out})")
        return out / whl[0].name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python qeval/engines/llama_build.py",
                                 description="Build (or take from qeval's cache) and install llama-cpp-python "
                                             "with run-time CPU variant selection.")
    ap.add_argument("spec", nargs="?", default="llama-cpp-python>=0.3.8", help="pip requirement (default %(default)s)")
    ap.add_argument("--cmake-args", default="", help="CMAKE_ARGS of the build (the Makefile's LLAMA_CMAKE_ARGS)")
    ap.add_argument("--variants", default="auto", help="auto, all, or CPU variant names separated by commas")
    ap.add_argument("--wheel-only", action="store_true", help="build or find the wheel, print its path, install nothing")
    a = ap.parse_args(argv)
    try:
        variants = resolve_variants(a.variants)
    except ValueError as e:
        print(f"error: --variants: {e}", file=sys.stderr)
        return 2
    say = lambda s: print(f"[llama_build] {s}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        whl = build_wheel(a.spec, a.cmake_args, variants, log=say)
        if a.wheel_only:
            print(whl)
            return 0
        _run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", "-q", str(whl)])
        _run([sys.executable, "-m", "pip", "install", "-q", str(whl)])  # its dependencies (numpy, jinja2, ...)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
