"""llama.cpp's own command-line tools, built from the source llama-cpp-python compiled.

qeval measures GGUF tiers through llama-cpp-python; llama.cpp's ``llama-bench``,
``llama-batched-bench``, ``llama-server`` and ``llama-speculative`` are the independent
yardsticks (``benchmarks/against_llama_cpp.py``, serving checks,
``benchmarks/speculative_llama.py``). None of them ships in the llama-cpp-python wheel,
and a system llama.cpp would be another version, so they come from the vendored llama.cpp
of the *installed* llama-cpp-python, one of two ways:

1. **From the wheel's own CMake build** (the normal case): ``make setup`` builds the wheel
   with :mod:`qeval.engines.llama_build`, which adds the four tools to the same CMake build
   (the llama.cpp sources compile once) and copies them out of its tree with every shared
   library and ggml backend module. They are found again by a hash of the installed
   package's ``llama_cpp/lib`` files (:func:`qeval.engines.llama_build.installed_fingerprint`,
   the same bytes as in the wheel), so they are exactly the installed build's: its flags,
   its CPU variant modules, its GPU backend with ``CUDA=1``. ggml loads its CPU variant
   module from the running binary's own folder (``ggml_backend_load_best``: the
   executable's folder, then the current one) and would pick it by CPUID alone, so
   :func:`tool_path` returns the tool in ``cpu-<variant>/``: hard links of the tools and of
   exactly the variant qeval chose in this process (:func:`qeval.engines.ggml_cpu.load_backends`:
   the probe; never an AMX variant whose kernels trap) plus any GPU backend module, made on
   first use. Every caller runs qeval's variant with no environment to pass.
2. **A separate static build** (the fallback): where the installed wheel has no such tools
   (built before qeval built them together, another source layout, the cache wiped),
   ``QEVAL_LLAMA_CMAKE_ARGS`` is set, or the ``native`` flavour is asked for, the tools are
   compiled again from the sdist's source (fetched through pip as
   :mod:`qeval.engines.gguf_convert` does), and the build says why in one line. Flavours:

   * ``qeval`` (the default): the instruction sets of the CPU variant qeval's
     llama-cpp-python runs on this machine (``zen4`` -> AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI,
     BF16), so the tools run the kernels the GGUF tiers run; the portable AVX2 flags when
     llama-cpp-python has its CPU backend built in. Plus the CUDA flags when the installed
     llama-cpp-python offloads to a GPU.
   * ``native``: ``-march=native`` (``GGML_NATIVE=ON``), the fastest build that runs here,
     without AMX where the CPU lists it and the kernel does not grant it
     (:func:`qeval.engines.ggml_cpu.amx_granted`; a ``-march=native`` llama-bench died with
     SIGILL in ``tinygemm_kernel_amx`` on such a machine): ``benchmarks/against_llama_cpp.py``
     compares qeval with it. Always a build of its own.

Cache layout (``$QEVAL_CACHE``, default ``~/.cache/qeval``)::

    llama_tools/<version>-wheel-<fp>/bin/        the tools as the wheel's build made them (run
                                                 paths $ORIGIN:$ORIGIN/../lib; not run from here)
    llama_tools/<version>-wheel-<fp>/lib/        libllama, libggml*, libllama-common, libmtmd, the
                                                 tools' own libraries, every libggml-cpu-<variant>.so
                                                 and GPU backend module of that build
    llama_tools/<version>-wheel-<fp>/cpu-<variant>/   what tool_path returns: hard links of bin/*
                                                 and of that variant's module (cpu-builtin: a
                                                 build with its CPU backend linked in)
    llama_tools/<version>-wheel-<fp>/build.json  the wheel's build: cmake arguments, variants,
                                                 seconds (wheel and tools together)
    llama_cpp_src/<version>/llama.cpp/           (fallback) the whole vendored tree, kept
    llama_tools/<version>-<flags hash>/bin/      (fallback) the static build's four tools
    llama_tools/<version>-<flags hash>/build.json   version, cmake arguments, tools built, seconds

The static build is made only when :func:`tool_path` or :func:`build_tools` needs it (a
recipe with a llama-server tier, a benchmark, ``make test``'s first line): minutes on 2
cores (565 s here on 2026-12-05 for the four tools, the sdist's download and extraction not
counted). Concurrent callers wait on a file lock instead of building twice.
``QEVAL_LLAMA_CMAKE_ARGS`` replaces the portable flags (e.g. ``-DGGML_CUDA=on`` on a CUDA
machine); a different set of flags is a different cache entry.

``llama-speculative`` (llama.cpp's ``examples/speculative``: a target and a draft model,
greedy or sampled verification, the independent peer of qeval's speculative decoding figures)
is an example, not a tool: its CMake target exists only with ``LLAMA_BUILD_EXAMPLES=ON``
(``examples/CMakeLists.txt`` adds ``speculative`` under ``if (LLAMA_BUILD_COMMON AND
LLAMA_BUILD_EXAMPLES)`` of the top ``CMakeLists.txt``; the wheel's build adds that one folder),
so the static build configures the examples too and compiles only the named targets
(``--target``). It is built where the source has ``examples/speculative``
(:data:`EXAMPLE_TOOLS`); a tools folder without it is still complete (the trimmed source
``tools/llama_src_trim.py`` carries to a GPU machine drops ``examples/``, and its build
places only llama-bench, llama-batched-bench and llama-server), and :func:`tool_path` then
says so instead of building again.

Command line (one line on stderr says where the tools came from: ``make test`` runs it first)::

    python -m qeval.engines.llama_tools --build        # find or build them, print the paths
    python -m qeval.engines.llama_tools llama-bench    # print one tool's path (builds if needed)
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..paths import cache_root
from . import ggml_cpu
from . import llama_build
from .gguf_convert import download_sdist, llama_cpp_version

TOOLS = llama_build.TOOL_TARGETS
"""The tool names :func:`tool_path` accepts (CMake target names, also the binary names)."""
EXAMPLE_TOOLS = dict(llama_build.OPTIONAL_TOOLS)
"""Tools of :data:`TOOLS` from llama.cpp's ``examples/`` (name -> folder in the source): built
only where the source has the folder; a tools folder is complete without them (module notes)."""

# The Makefile's LLAMA_CPU_FLAGS (tests/test_llama_tools.py checks it): llama-cpp-python
# with ggml's CPU variants as modules, one chosen at run time (qeval.engines.ggml_cpu).
VARIANTS_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF"
# The tools' flags when llama-cpp-python has its CPU backend built in (the build before
# run-time variants): portable AVX2.
PORTABLE_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                       "-DGGML_F16C=ON -DGGML_AVX512=OFF")
# The Makefile's LLAMA_CUDA_FLAGS (CUDA=1), added when the installed llama-cpp-python offloads to a GPU.
CUDA_CMAKE_ARGS = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
CMAKE_ARGS_ENV = "QEVAL_LLAMA_CMAKE_ARGS"
FLAVORS = ("qeval", "native")

# Fixed for every build: a static Release build of the tools, with no network at build time
# (no curl, no web UI download) and no tests; the examples are configured (llama-speculative's
# target exists only then) and only the targets named are compiled.
_FIXED_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF")
_MARKER = llama_build.TOOLS_MARKER
NATIVE_REASON = "the native flavour (-march=native) is a build of its own"


def _installed() -> tuple[str, bool]:
    """The CPU variant the installed llama-cpp-python runs here (``built-in`` for a build
    without variant modules; ``none`` when llama-cpp-python is missing) and whether it
    offloads to a GPU (a CUDA build). Loads ggml's backends the way qeval's GGUF engine
    does, so llama.cpp's own loader never runs first."""
    try:
        import llama_cpp  # optional dependency (extra 'gguf'); only to mirror its build
        sel = ggml_cpu.load_backends(Path(llama_cpp.__file__).resolve().parent)
        return str(sel.variant), bool(llama_cpp.llama_supports_gpu_offload())
    except (ImportError, AttributeError, OSError):
        return "none", False


def _gpu_build() -> bool:
    """Whether the installed llama-cpp-python was built with GPU offload (a CUDA build)."""
    return _installed()[1]


def native_cmake_args(flags: frozenset[str] | None = None, amx_ok: bool | None = None) -> list[str]:
    """CPU flags of the ``native`` flavour: ``-DGGML_NATIVE=ON`` (``-march=native``), and where
    the CPU lists AMX that the kernel does not grant, the AMX instruction sets switched off
    in the compiler (GCC and Clang give an explicit ``-mno-*`` precedence over ``-march``)."""
    flags = ggml_cpu.cpu_flags() if flags is None else flags
    amx_ok = ggml_cpu.amx_granted() if amx_ok is None else amx_ok
    out = ["-DGGML_NATIVE=ON"]
    if set(ggml_cpu.AMX_FLAGS) & set(flags) and not amx_ok:
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        out += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
                "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return out


def cmake_args(flavor: str = "qeval") -> list[str]:
    """The CMake arguments of a tools build: the fixed ones, then ``$QEVAL_LLAMA_CMAKE_ARGS``
    (shell-split) when set, else the flavour's CPU flags (module notes) plus
    :data:`CUDA_CMAKE_ARGS` when the installed llama-cpp-python offloads to a GPU.

    Raises:
        ValueError: an unknown flavour.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"unknown tools flavour {flavor!r}: expected one of {', '.join(FLAVORS)}")
    user = os.environ.get(CMAKE_ARGS_ENV)
    if user is not None:
        return list(_FIXED_ARGS) + shlex.split(user)
    variant, gpu = _installed()
    if flavor == "native":
        cpu = native_cmake_args()
    elif variant in ggml_cpu.VARIANT_OPTIONS:
        cpu = ggml_cpu.variant_cmake_args(variant)
    else:
        cpu = shlex.split(PORTABLE_CMAKE_ARGS)
    return list(_FIXED_ARGS) + cpu + (shlex.split(CUDA_CMAKE_ARGS) if gpu else [])


def _cache() -> Path:
    return cache_root()


def source_dir(version: str | None = None) -> Path:
    """Folder of the vendored llama.cpp tree of llama-cpp-python ``version`` (default: installed)."""
    return _cache() / "llama_cpp_src" / (version or llama_cpp_version()) / "llama.cpp"


def tools_dir(version: str | None = None, args: list[str] | None = None) -> Path:
    """Cache folder of the tools for ``version`` built with CMake ``args`` (default :func:`cmake_args`):
    ``llama_tools/<version>-<first 12 hex of sha256(args)>``."""
    version = version or llama_cpp_version()
    key = hashlib.sha256("\0".join(args if args is not None else cmake_args()).encode()).hexdigest()[:12]
    return _cache() / "llama_tools" / f"{version}-{key}"


def _core_tools() -> tuple[str, ...]:
    """The tools every complete tools folder holds (:data:`TOOLS` less :data:`EXAMPLE_TOOLS`)."""
    return tuple(t for t in TOOLS if t not in EXAMPLE_TOOLS)


def _tools_present(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and all(os.access(folder / "bin" / t, os.X_OK) for t in _core_tools())


def build_targets(src: Path) -> list[str]:
    """The CMake targets a tools build of the llama.cpp tree ``src`` makes: every tool of
    :data:`TOOLS` but the examples whose folder ``src`` lacks (:data:`EXAMPLE_TOOLS`)."""
    return [t for t in TOOLS if t not in EXAMPLE_TOOLS or (src / EXAMPLE_TOOLS[t] / "CMakeLists.txt").is_file()]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_source(version: str | None = None, log: Callable[[str], None] = print,
                  timeout: float = 900.0) -> Path:
    """The vendored llama.cpp tree of llama-cpp-python ``version`` (default: installed),
    extracted whole from its sdist on first use (the sdist is downloaded through pip and
    not kept).

    Raises:
        RuntimeError: pip failed, or the sdist has no ``vendor/llama.cpp/CMakeLists.txt``.
    """
    version = version or llama_cpp_version()
    dest = source_dir(version)
    if (dest.parent / _MARKER).is_file() and (dest / "CMakeLists.txt").is_file():
        return dest
    with _locked(dest.parent.with_name(dest.parent.name + ".lock")):
        if (dest.parent / _MARKER).is_file() and (dest / "CMakeLists.txt").is_file():
            return dest  # another process extracted it while we waited
        dest.parent.parent.mkdir(parents=True, exist_ok=True)
        log(f"fetching the llama.cpp source of llama-cpp-python {version} (sdist) into {dest}")
        with tempfile.TemporaryDirectory(prefix="qeval-llama-src-", dir=dest.parent.parent) as td:
            sdist = download_sdist(version, Path(td) / "dl", timeout=timeout, purpose="llama.cpp's tools")
            stage = Path(td) / "llama.cpp"
            n = 0
            with tarfile.open(sdist, "r:*") as tf:
                for m in tf:
                    parts = m.name.split("/")
                    # <pkg>-<ver>/vendor/llama.cpp/<rel>
                    if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or ".." in parts:
                        continue
                    if not (m.isfile() or m.isdir()):
                        continue  # links and devices: the build needs none
                    target = stage.joinpath(*parts[3:])
                    if m.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    assert src is not None
                    with src, open(target, "wb") as f:
                        shutil.copyfileobj(src, f)
                    if m.mode & 0o111:
                        target.chmod(0o755)
                    n += 1
            if not (stage / "CMakeLists.txt").is_file():
                raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp/CMakeLists.txt")
            shutil.rmtree(dest.parent, ignore_errors=True)
            dest.parent.mkdir(parents=True)
            os.replace(stage, dest)
            (dest.parent / _MARKER).write_text(f"{sdist.name} files={n}\n")
    return dest


def _llama_cpp_dir() -> Path | None:
    """The installed ``llama_cpp`` package folder, found without importing it (None: absent)."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent


def wheel_tools(version: str | None = None) -> tuple[Path | None, str]:
    """The tools built in the installed llama-cpp-python's own CMake build (module notes, 1):
    ``(folder, "")`` with ``folder`` = ``llama_tools/<version>-wheel-<fp>``, or ``(None, why
    not)``: ``$QEVAL_LLAMA_CMAKE_ARGS`` set, llama-cpp-python missing, ``version`` not the
    installed one, or no complete folder for the installed build's fingerprint."""
    if os.environ.get(CMAKE_ARGS_ENV) is not None:
        return None, f"{CMAKE_ARGS_ENV} is set (the tools get those flags, not the wheel's)"
    pkg = _llama_cpp_dir()
    fp = llama_build.installed_fingerprint(pkg) if pkg is not None else None
    if fp is None:
        return None, "llama-cpp-python is not installed (no llama_cpp/lib)"
    try:
        installed = llama_cpp_version()
    except RuntimeError as e:
        return None, str(e)
    if version is not None and version != installed:
        return None, f"llama-cpp-python {version} is not the installed one ({installed})"
    folder = llama_build.wheel_tools_dir(installed, fp, root=_cache())
    if not llama_build.tools_complete(folder):
        return None, (f"the installed llama-cpp-python {installed} has no tools from its own build ({folder} is "
                      f"missing: a wheel built before qeval built them together, a source of another layout, "
                      f"or a wiped cache)")
    return folder, ""


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link of ``src`` (a copy where the file system refuses links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def variant_dir(folder: Path, variant: str) -> Path:
    """``folder/cpu-<variant>`` of a wheel's tools folder (:func:`wheel_tools`): hard links
    (copies where linking fails) of every tool in ``bin/`` and, of the ggml modules in
    ``lib/``, exactly CPU variant ``variant``'s and every non-CPU backend module (GPU); made
    on first use, whole (made aside, then renamed into place). ggml loads a CPU variant from
    the running binary's own folder (``/proc/self/exe``: a hard link's own folder) and from
    the current one, by CPUID alone; a tool run from here finds only qeval's choice, and its
    run path (``$ORIGIN/../lib``) finds the libraries. Without variant modules (the CPU
    backend linked in, or one ``libggml-cpu.so``) the folder is ``cpu-builtin``.

    Raises:
        FileNotFoundError: the folder has variant modules, none of them ``variant``.
    """
    lib = folder / "lib"
    mods = dict(ggml_cpu.variant_modules([lib]))
    if mods:
        if variant not in mods:
            raise FileNotFoundError(f"the CPU variant qeval runs here ({variant}) has no module among the tools' "
                                    f"({lib}: {', '.join(mods)})")
        tag, keep = variant, [mods[variant]]
    else:
        tag, keep = "builtin", [p for p in (lib / "libggml-cpu.so",) if p.is_file()]
    keep += ggml_cpu.other_backend_modules([lib])
    want = [folder / "bin" / t for t in TOOLS if (folder / "bin" / t).is_file()] + keep
    d = folder / f"cpu-{tag}"

    def complete(x: Path) -> bool:
        return x.is_dir() and all((x / p.name).is_file() for p in want)
    if complete(d):
        return d
    stage = folder / f".cpu-{tag}.{os.getpid()}.part"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    for p in want:
        _link(p.resolve(), stage / p.name)
    try:
        os.rename(stage, d)
    except OSError:  # there already: made meanwhile by another process, or left incomplete
        if complete(d):
            shutil.rmtree(stage, ignore_errors=True)
            return d
        shutil.rmtree(d, ignore_errors=True)
        os.rename(stage, d)
    return d


def _from_wheel(version: str | None = None) -> tuple[Path | None, str]:
    """The ``cpu-<variant>`` folder of the wheel's tools for the variant qeval runs in this
    process (:func:`_installed`), or ``(None, why not)``."""
    folder, why = wheel_tools(version)
    if folder is None:
        return None, why
    try:
        return variant_dir(folder, _installed()[0]), ""
    except FileNotFoundError as e:
        return None, str(e)


def build_tools(version: str | None = None, log: Callable[[str], None] = print,
                timeout: float = 3600.0, jobs: int | None = None, flavor: str = "qeval",
                why: str | None = None) -> Path:
    """The separate static build (module notes, 2): build (when missing) llama-bench,
    llama-batched-bench, llama-server and, where the source has it, llama-speculative
    (:func:`build_targets`) in one CMake build of the vendored source of llama-cpp-python
    ``version`` (default: installed); returns the folder whose ``bin/`` holds them. A build
    says in one line why it compiles again (``why``; default: why :func:`wheel_tools` has
    none, or :data:`NATIVE_REASON`).

    Args:
        timeout: seconds for configure plus build (s).
        jobs: parallel compile jobs (default: ``os.cpu_count()``).
        flavor: ``qeval`` (the kernels qeval's GGUF tiers run) or ``native`` (module notes).

    Raises:
        RuntimeError: the sdist fetch, CMake configure or the build failed (the last log
            lines in the message); nothing is left in the cache folder.
    """
    version = version or llama_cpp_version()
    args = cmake_args(flavor)
    out = tools_dir(version, args)
    if _tools_present(out):
        return out
    with _locked(out.with_name(out.name + ".lock")):
        if _tools_present(out):
            return out
        if why is None:
            why = NATIVE_REASON if flavor == "native" else (wheel_tools(version)[1] or "asked for the static build")
        log(f"llama.cpp tools: compiling again because {why}")
        src = ensure_source(version, log=log)
        out.parent.mkdir(parents=True, exist_ok=True)
        jobs = jobs or os.cpu_count() or 1
        targets = build_targets(src)
        log(f"building {', '.join(targets)} from llama-cpp-python {version}'s llama.cpp "
            f"({' '.join(args[len(_FIXED_ARGS):])}); minutes on 2 cores")
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f"{out.name}-", dir=out.parent) as td:
            build = Path(td) / "build"
            logf = Path(td) / "build.log"
            steps = [["cmake", "-S", str(src), "-B", str(build), *args],
                     ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                      "--target", *targets]]
            with open(logf, "w") as lf:
                for cmd in steps:
                    left = timeout - (time.time() - t0)
                    try:
                        p = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=max(left, 1))
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"llama.cpp tools build ran past {timeout:.0f} s") from None
                    if p.returncode != 0:
                        lf.flush()
                        tail = "\n".join(logf.read_text(errors="replace").strip().splitlines()[-15:])
                        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {p.returncode}) building "
                                           f"llama.cpp tools:\n{tail}")
            stage = Path(td) / "out"
            (stage / "bin").mkdir(parents=True)
            for t in targets:
                shutil.copy2(build / "bin" / t, stage / "bin" / t)
            info = {"llama_cpp_python": version, "cmake_args": args, "seconds": round(time.time() - t0, 1),
                    "tools": targets, "source": str(src), "flavor": flavor, "why": why}
            (stage / "build.json").write_text(json.dumps(info, indent=1) + "\n")
            (stage / _MARKER).write_text("ok\n")
            shutil.rmtree(out, ignore_errors=True)
            os.replace(stage, out)
        log(f"llama.cpp tools ready in {out} ({time.time() - t0:.0f} s)")
    return out


def tool_path(name: str, *, build: bool = True, log: Callable[[str], None] = print, flavor: str = "qeval") -> Path:
    """Path of llama.cpp tool ``name`` (one of :data:`TOOLS`) matching the installed
    llama-cpp-python: for the ``qeval`` flavour the one built with the installed wheel, in
    the folder of the CPU variant qeval runs (:func:`wheel_tools`, :func:`variant_dir`),
    else the separate static build's, built on first call (see :func:`build_tools`).

    Args:
        build: when False, never build: a missing tool raises FileNotFoundError.
        flavor: ``qeval`` or ``native`` (module notes).

    Raises:
        ValueError: ``name`` is not in :data:`TOOLS`.
        FileNotFoundError: not built yet and ``build`` is False; or an example tool
            (:data:`EXAMPLE_TOOLS`) missing from a complete tools folder (built from a source
            without its folder, e.g. the trimmed GPU source: never rebuilt here).
        RuntimeError: llama-cpp-python is not installed, or fetching/building failed.
    """
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}: expected one of {', '.join(TOOLS)}")
    if flavor == "qeval":
        d, why = _from_wheel()
        if d is not None:
            path = d / name
            if name in EXAMPLE_TOOLS and not os.access(path, os.X_OK):
                raise FileNotFoundError(f"{name} is not in {d}: the wheel's llama.cpp source had no "
                                        f"{EXAMPLE_TOOLS[name]}")
            return path
    else:
        why = NATIVE_REASON
    folder = tools_dir(args=cmake_args(flavor))
    if not _tools_present(folder):
        if not build:
            raise FileNotFoundError(f"{name} is not built yet ({folder}; the wheel's own: {why}); "
                                    f"run python -m qeval.engines.llama_tools --build")
        folder = build_tools(log=log, flavor=flavor, why=why)
    path = folder / "bin" / name
    if name in EXAMPLE_TOOLS and not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{name} is not in {folder / 'bin'}: that build's llama.cpp source had no "
                                f"{EXAMPLE_TOOLS[name]} (remove the folder to build again from the full source)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qeval.engines.llama_tools",
                                 description="Find (built with the installed llama-cpp-python) or build llama.cpp's "
                                             "tools and print their paths.")
    ap.add_argument("names", nargs="*", metavar="TOOL", help=f"print these tools' paths ({', '.join(TOOLS)})")
    ap.add_argument("--build", action="store_true", help="build when missing and print every tool's path")
    ap.add_argument("--version", dest="llama_version", help="llama-cpp-python version (default: installed)")
    ap.add_argument("--flavor", choices=FLAVORS, default="qeval",
                    help="qeval: the CPU kernels qeval's GGUF tiers run; native: -march=native (no AMX where "
                         "the kernel refuses it)")
    a = ap.parse_args(argv)
    if not (a.build or a.names):
        ap.error("give --build or tool names")
    bad = [n for n in a.names if n not in TOOLS]
    if bad:
        ap.error(f"unknown tool {bad[0]!r}: expected one of {', '.join(TOOLS)}")
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    if a.flavor == "qeval":
        d, why = _from_wheel(a.llama_version)
        if d is not None:
            say(f"llama.cpp tools: from the wheel's build tree ({d}), {time.time() - t0:.0f} s")
            for n in (a.names or [t for t in TOOLS if (d / t).exists()]):
                print(d / n)
            return 0
    else:
        why = NATIVE_REASON
    try:
        cached = _tools_present(tools_dir(a.llama_version, cmake_args(a.flavor)))
        folder = build_tools(a.llama_version, log=say, flavor=a.flavor, why=why)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if cached:
        say(f"llama.cpp tools: from their separate build ({folder}, compiled before because {why}), 0 s")
    for n in (a.names or [t for t in TOOLS if (folder / "bin" / t).exists()]):
        print(folder / "bin" / n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
