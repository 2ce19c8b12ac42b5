"""Build and install llama-cpp-python with ggml's CPU variants chosen at run time, and
llama.cpp's tools from the same CMake build.

``make setup`` runs this file by path (before qeval's dependencies exist, so it imports
the standard library and :mod:`qeval.engines.ggml_cpu` only)::

    python qeval/engines/llama_build.py --cmake-args "..." [--variants auto|all|a,b] [SPEC]

It does what ``CMAKE_ARGS=... pip install llama-cpp-python`` does, with three changes:

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
3. llama.cpp's tools in the same CMake build. qeval runs ``llama-bench``,
   ``llama-batched-bench``, ``llama-server`` and ``llama-speculative``
   (:mod:`qeval.engines.llama_tools`); none ships in the wheel. A separate static build of
   them compiles the same llama.cpp sources again (565 s on 2 cores). So the vendored
   ``CMakeLists.txt`` is patched (:func:`add_tools`) to add exactly those four targets and
   what they link (``mtmd``, the server's web UI stub: no download) to the wheel's default
   build, with run paths relative to each binary (``$ORIGIN``, ``$ORIGIN/../lib``);
   scikit-build-core keeps the build tree (``build-dir``) and leaves the tools' install
   rules out of the wheel (``wheel.exclude``: ``bin/llama-*``, and mtmd where
   ``LLAVA_BUILD`` is off). The four binaries and every shared library and ggml module of
   the tree's ``bin/`` are then copied to ``$QEVAL_CACHE/llama_tools/<version>-wheel-<fp>/``
   (:func:`place_tools`; ``fp``: :func:`wheel_fingerprint`, a hash of the wheel's
   ``llama_cpp/lib`` files, which :mod:`qeval.engines.llama_tools` recomputes from the
   installed package to find them) and the tree is deleted. When the source has another
   layout, the wheel is built without tools and says so; ``llama_tools`` then compiles
   them apart, as before.

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
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterable

try:
    from . import ggml_cpu
except ImportError:  # run by path from the Makefile: qeval's package is not importable yet
    import ggml_cpu  # type: ignore[no-redef]

PATCH_VERSION = 2  # part of the wheel key: bump when trim_variants or add_tools changes what it writes
_VARIANT_LINE = re.compile(r"^(\s*)ggml_add_cpu_backend_variant\((\w+)\b[^)]*\)\s*$")

TOOL_TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-speculative")
"""llama.cpp's tools built with the wheel (CMake target names, also the binary names)."""
OPTIONAL_TOOLS = {"llama-speculative": "examples/speculative"}
"""Tools of :data:`TOOL_TARGETS` built only where the source has the folder (an example)."""
#: llama.cpp folders the tools' targets come from (relative to vendor/llama.cpp); all needed
TOOL_DIRS = ("tools/llama-bench", "tools/batched-bench", "tools/server", "tools/ui", "tools/mtmd")
TOOLS_MARKER = ".qeval-complete"
#: the vendored CMakeLists.txt line after which the run-path settings go (before any target)
_RPATH_ANCHOR = re.compile(r"^\s*set\(\s*CMAKE_LIBRARY_OUTPUT_DIRECTORY\s+\$\{CMAKE_BINARY_DIR\}/bin\s*\)\s*$", re.M)
_RPATH_BLOCK = """
# qeval (qeval/engines/llama_build.py): run paths relative to each binary ($ORIGIN, not this
# build tree), so llama.cpp's tools copied out of it find their libraries in ../lib
set(CMAKE_BUILD_RPATH_USE_ORIGIN ON)
set(CMAKE_BUILD_RPATH "$ORIGIN/../lib")
"""
_TOOLS_BLOCK = """
# qeval (qeval/engines/llama_build.py): the llama.cpp tools qeval runs, compiled in this build
# beside the wheel's libraries (the sources compile once): llama-bench, llama-batched-bench,
# llama-server, llama-speculative, and what they link (mtmd, the server's web UI stub) and
# nothing else. Their install rules reach no wheel: qeval excludes bin/llama-* (and mtmd
# where LLAVA_BUILD is off) through scikit-build-core's wheel.exclude.
if (LLAMA_BUILD_COMMON AND NOT EMSCRIPTEN)
    find_package(Threads REQUIRED)
    llama_add_compile_flags()
    set(LLAMA_BUILD_UI OFF)         # the server's web UI: a stub, nothing built or downloaded
    set(LLAMA_USE_PREBUILT_UI OFF)
    if (NOT LLAMA_BUILD_TOOLS)      # (ON: llama.cpp's own tools/ already added them)
        if (NOT LLAVA_BUILD AND NOT TARGET mtmd)  # (ON: llama-cpp-python adds mtmd itself)
            add_subdirectory(tools/mtmd)
        endif()
        add_subdirectory(tools/batched-bench)
        add_subdirectory(tools/llama-bench)
        add_subdirectory(tools/ui)
        add_subdirectory(tools/server)
    endif()
    if (NOT LLAMA_BUILD_EXAMPLES AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/examples/speculative/CMakeLists.txt")
        add_subdirectory(examples/speculative)
    endif()
endif()
"""


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


def add_tools(cmakelists: str) -> str | None:
    """The vendored llama.cpp ``CMakeLists.txt`` (llama-cpp-python adds it as a subproject,
    ``LLAMA_BUILD_COMMON`` forced on, its tools and examples off) with qeval's two edits:
    run paths relative to each binary (after the ``CMAKE_LIBRARY_OUTPUT_DIRECTORY`` line,
    before any target exists: ``CMAKE_BUILD_RPATH_USE_ORIGIN`` and ``$ORIGIN/../lib``; the
    targets llama-cpp-python installs keep their own ``$ORIGIN``, and every installed copy
    gets its install run path as before) and, at the end, the subdirectories of
    :data:`TOOL_TARGETS` in the default build (no ``EXCLUDE_FROM_ALL``: these folders
    hold those targets and what they link, nothing else). None when the anchor line is not
    found (another llama.cpp layout: the caller builds the wheel without tools)."""
    m = _RPATH_ANCHOR.search(cmakelists)
    if m is None:
        return None
    pos = cmakelists.find("\n", m.end()) + 1 or len(cmakelists)  # after the anchor line
    out = cmakelists[:pos] + _RPATH_BLOCK + cmakelists[pos:]
    return out.rstrip("\n") + "\n" + _TOOLS_BLOCK


def cmake_bool(args: str, name: str, default: bool) -> bool:
    """The value CMake gets for ``-D<name>=...`` in ``args`` (the last one wins; CMake's false
    words are false), else ``default``."""
    value = None
    for a in shlex.split(args):
        m = re.fullmatch(rf"-D{re.escape(name)}(?::\w+)?=(.*)", a)
        if m:
            value = m.group(1)
    if value is None:
        return default
    v = value.strip().upper()
    return not (v in ("", "0", "OFF", "NO", "N", "FALSE", "IGNORE", "NOTFOUND") or v.endswith("-NOTFOUND"))


def wheel_excludes(cmake_args: str) -> list[str]:
    """What the tools' install rules would add to the wheel (its ``platlib`` paths, for
    scikit-build-core's ``wheel.exclude``): ``bin/llama-*`` (llama-server's and
    llama-speculative's unconditional ``install(TARGETS ... RUNTIME)``), and where
    ``LLAVA_BUILD`` is off (the patch then adds mtmd, which llama-server links) mtmd's
    library and headers; with ``LLAVA_BUILD`` on, llama-cpp-python installs mtmd itself."""
    out = ["bin/llama-*"]
    if not cmake_bool(cmake_args, "LLAVA_BUILD", True):
        out += ["lib/libmtmd*", "include/mtmd*"]
    return out


def _is_shared_lib(name: str) -> bool:
    return name.endswith((".so", ".dylib", ".dll")) or ".so." in name


def lib_fingerprint(files: Iterable[tuple[str, bytes]]) -> str:
    """16 hex digits of sha256 over ``(name, sha256(content))`` of a build's ``llama_cpp/lib``
    shared libraries, by name (``libllama.so``, ``libggml-base.so.0``, ...)."""
    items = sorted((n, hashlib.sha256(data).hexdigest()) for n, data in files if _is_shared_lib(n))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def wheel_fingerprint(whl: Path) -> str:
    """:func:`lib_fingerprint` of a llama-cpp-python wheel's ``llama_cpp/lib/*`` entries: the
    bytes pip installs, so :func:`installed_fingerprint` of that install is the same."""
    with zipfile.ZipFile(whl) as z:
        return lib_fingerprint((n.split("/")[-1], z.read(n)) for n in z.namelist()
                               if n.startswith("llama_cpp/lib/") and n.count("/") == 2 and not n.endswith("/"))


_FP_MEMO: dict[tuple, str] = {}


def installed_fingerprint(llama_cpp_dir: Path) -> str | None:
    """:func:`lib_fingerprint` of an installed ``llama_cpp`` package's ``lib/`` (None: no
    shared library there); read once per process for the same files (names, sizes, times)."""
    lib = llama_cpp_dir / "lib"
    try:
        files = sorted(p for p in lib.iterdir() if p.is_file() and _is_shared_lib(p.name))
    except OSError:
        return None
    if not files:
        return None
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _FP_MEMO:
        _FP_MEMO[key] = lib_fingerprint((p.name, p.read_bytes()) for p in files)
    return _FP_MEMO[key]


def wheel_tools_dir(version: str, fingerprint: str, root: Path | None = None) -> Path:
    """``$QEVAL_CACHE/llama_tools/<version>-wheel-<fingerprint>`` (``root``: the cache folder,
    default :func:`cache_root`): the tools built with the wheel whose ``llama_cpp/lib`` has that
    :func:`lib_fingerprint` (the separate static builds of :mod:`qeval.engines.llama_tools`
    are ``<version>-<flags hash>`` beside them)."""
    return (cache_root() if root is None else root) / "llama_tools" / f"{version}-wheel-{fingerprint}"


def clean_run_path(path: Path) -> str | None:
    """Drop the empty entries from an ELF file's run path (``DT_RUNPATH``/``DT_RPATH``), in
    place: CMake pads a build tree's run path with ``:`` so its install step can write a
    longer one over it, and the dynamic loader reads an empty entry as the current folder.
    Returns the run path now in the file (None: not a 64-bit little-endian ELF file, or it
    has none; the file is then left as it was)."""
    try:
        data = bytearray(path.read_bytes())
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return None
    strtab, runpaths = None, []
    for off in range(dynamic[0], dynamic[0] + dynamic[1] - 15, 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag in (15, 29):
            runpaths.append(val)
    base = next((v - va + po for va, po, fs in loads for v in [strtab] if v is not None and va <= v < va + fs), None)
    if base is None or not runpaths:
        return None
    out, changed = None, False
    for rp in runpaths:
        start = base + rp
        end = data.index(0, start)
        old = data[start:end].decode(errors="surrogateescape")
        out = ":".join(e for e in old.split(":") if e)
        if out != old:
            new = out.encode(errors="surrogateescape")
            data[start:end] = new + b"\0" * (end - start - len(new))
            changed = True
    if changed:
        path.write_bytes(bytes(data))
    return out


def place_tools(build_bin: Path, dest: Path, info: dict) -> list[str]:
    """Copy the tools out of the CMake build tree's ``bin/`` (where llama.cpp writes every
    executable, shared library and ggml module) to ``dest``: ``bin/`` the tool binaries of
    :data:`TOOL_TARGETS` present, ``lib/`` every shared library and module (links kept as
    links), each run path without empty entries (:func:`clean_run_path`), ``build.json``
    (``info`` and the tools) and the completion marker; made aside and moved in whole.
    Returns the tools placed.

    Raises:
        RuntimeError: a tool outside :data:`OPTIONAL_TOOLS` is missing from ``build_bin``.
    """
    tools = [t for t in TOOL_TARGETS if (build_bin / t).is_file() and os.access(build_bin / t, os.X_OK)]
    missing = [t for t in TOOL_TARGETS if t not in tools and t not in OPTIONAL_TOOLS]
    if missing:
        raise RuntimeError(f"the build left no {', '.join(missing)} in {build_bin}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "bin").mkdir(parents=True)
    (stage / "lib").mkdir()
    for t in tools:
        shutil.copy2(build_bin / t, stage / "bin" / t)
        clean_run_path(stage / "bin" / t)
    for p in sorted(build_bin.iterdir()):
        if not _is_shared_lib(p.name):
            continue
        if p.is_symlink():
            os.symlink(os.readlink(p), stage / "lib" / p.name)
        elif p.is_file():
            shutil.copy2(p, stage / "lib" / p.name)
            clean_run_path(stage / "lib" / p.name)
    (stage / "build.json").write_text(json.dumps(dict(info, tools=tools), indent=1) + "\n")
    (stage / TOOLS_MARKER).write_text("ok\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(stage, dest)
    return tools


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


def tools_complete(folder: Path) -> bool:
    """Whether ``folder`` (:func:`wheel_tools_dir`) holds a finished :func:`place_tools`: its
    marker, ``lib/`` and every tool but the optional ones in ``bin/``."""
    return ((folder / TOOLS_MARKER).is_file() and (folder / "lib").is_dir()
            and all(os.access(folder / "bin" / t, os.X_OK) for t in TOOL_TARGETS if t not in OPTIONAL_TOOLS))


def patch_tools(vendor: Path) -> str | None:
    """Apply :func:`add_tools` to the vendored llama.cpp tree ``vendor``; returns None when
    done, else why not (a folder of :data:`TOOL_DIRS` or the anchor line missing)."""
    missing = [d for d in TOOL_DIRS if not (vendor / d / "CMakeLists.txt").is_file()]
    if missing:
        return f"the source has no {', '.join(missing)}"
    f = vendor / "CMakeLists.txt"
    patched = add_tools(f.read_text())
    if patched is None:
        return f"{f.name} has no CMAKE_LIBRARY_OUTPUT_DIRECTORY line (another llama.cpp layout)"
    f.write_text(patched)
    return None


def build_wheel(spec: str, cmake_args: str, variants: list[str] | None, *, python: str = sys.executable,
                log=print) -> Path:
    """The llama-cpp-python wheel for ``spec`` built with ``cmake_args`` and ``variants``
    (None: all), from the cache when built before; returns the wheel's path. A wheel built
    here places llama.cpp's tools from the same CMake build (:func:`place_tools`, module
    notes); a cached one says whether its tools are still there.

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
            dest = wheel_tools_dir(version, wheel_fingerprint(wheels[0]))
            if tools_complete(dest):
                log(f"llama.cpp tools of this wheel: {dest}")
            else:
                log(f"llama.cpp tools of this wheel are not in {dest} (the cache was wiped, or its build placed "
                    f"none): their first use compiles them apart (qeval/engines/llama_tools.py)")
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
        no_tools = patch_tools(tree / "vendor" / "llama.cpp")
        cmake_dir = t / "cmake"
        cmd = [python, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(t / "whl")]
        if no_tools is None:
            cmd += [f"--config-settings=build-dir={cmake_dir}",
                    f"--config-settings=wheel.exclude={';'.join(wheel_excludes(cmake_args))}"]
            what = f"llama-cpp-python {version} and llama.cpp's {', '.join(TOOL_TARGETS)} in one CMake build"
        else:
            log(f"warning: llama.cpp's tools are not built with the wheel ({no_tools}): their first use "
                f"compiles them apart (qeval/engines/llama_tools.py)")
            what = f"llama-cpp-python {version}"
        log(f"building {what} ({built}; CMAKE_ARGS={cmake_args}); minutes on 2 cores")
        env = dict(os.environ, CMAKE_ARGS=cmake_args, FORCE_CMAKE="1")
        t0 = time.time()
        _run(cmd + [str(tree)], env=env, log=t / "build.log")
        seconds = time.time() - t0
        whl = sorted((t / "whl").glob("llama_cpp_python-*.whl"))
        if len(whl) != 1:
            raise RuntimeError(f"pip wheel left {len(whl)} llama-cpp-python wheels in {t / 'whl'}")
        info = {"sdist": sdist.name, "cmake_args": shlex.split(cmake_args), "variants": variants or "all",
                "seconds": round(seconds, 1)}
        tools_at = None
        if no_tools is None:
            dest = wheel_tools_dir(version, wheel_fingerprint(whl[0]))
            try:
                tools = place_tools(cmake_dir / "bin", dest, dict(
                    info, llama_cpp_python=version, wheel=whl[0].name, wheel_key=out.name,
                    built_with="the wheel's CMake build (qeval/engines/llama_build.py)"))
                tools_at = str(dest)
                info["tools"] = {"path": tools_at, "built": tools}
            except RuntimeError as e:
                log(f"warning: {e}: their first use compiles them apart (qeval/engines/llama_tools.py)")
                info["tools"] = {"path": None, "why": str(e)}
        else:
            info["tools"] = {"path": None, "why": no_tools}
        shutil.rmtree(cmake_dir, ignore_errors=True)  # the objects (hundreds of MB): every output is copied
        stage = t / "out"
        stage.mkdir()
        shutil.move(str(whl[0]), stage / whl[0].name)
        shutil.move(str(t / "build.log"), stage / "build.log")
        (stage / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(stage, out)
        log(f"llama-cpp-python {version} built in {seconds:.0f} s ({out})"
            + (f"; llama.cpp's tools from the same build in {tools_at}" if tools_at else ""))
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
