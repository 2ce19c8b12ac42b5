#!/usr/bin/env python3
"""A trimmed llama-cpp-python source that travels to a GPU machine, and its one-step CUDA
build there (the Python package and llama.cpp's tools in one CMake build).

    python tools/llama_src_trim.py trim [--sdist PATH | --version V] --dest DIR    # any machine (make llama-src)
    python tools/llama_src_trim.py build --sdist DIR/llama_cpp_python-V.tar.gz [--archs 90] [--build-dir DIR]
    python tools/llama_src_trim.py flags [--archs 90] [--cpu]                    # print the CMake flags

Why: llama-cpp-python's sdist (about 73 MiB) vendors the whole llama.cpp tree: its test
vocabularies (``models/``, 74 MiB unpacked), ``docs/`` (38 MiB), a copy of the repository's
``.git`` (39 MiB), every ggml backend (Vulkan, SYCL, Metal, OpenCL, CANN, ...) and some
twenty tools. A call to the GPU machine carries about 64 MiB in all. ``trim`` writes
``llama_cpp_python-<version>.tar.gz`` (the same name, so ``pip download`` from a wheelhouse
finds it: :mod:`qeval.engines.llama_build`, :mod:`qeval.engines.gguf_convert` and
:mod:`qeval.engines.llama_tools` take it unchanged) without:

* :data:`DROP_TOP` outside the vendored tree (``.git``, docs, tests, examples);
* :data:`DROP_VENDOR` inside it (models, docs, tests, examples, benches, media, CI files);
* the ggml backends other than CPU and CUDA (:data:`KEEP_BACKENDS`; ggml adds a backend's
  folder only when its ``GGML_<NAME>`` option is on, ``ggml/src/CMakeLists.txt``
  ``ggml_add_backend``);
* the tools qeval does not run: ``tools/CMakeLists.txt`` keeps the ``add_subdirectory``
  lines of :data:`KEEP_TOOLS` (llama-bench, llama-batched-bench, llama-server with the web
  UI's CMake step, and mtmd, which llama-server links) and comments out the others, whose
  folders are dropped.

It keeps what the build and qeval need: the package (``llama_cpp/``, ``pyproject.toml``,
``CMakeLists.txt``), llama.cpp's ``CMakeLists.txt``, ``cmake/``, ``ggml/`` (CPU and CUDA),
``src/``, ``include/``, ``common/``, ``vendor/``, ``scripts/`` (the web UI's
``ui-assets.cmake``), the licenses, and the HF->GGUF converter (``convert_hf_to_gguf.py``,
``conversion/``, ``gguf-py/``) that ``python -m qeval.engines.gguf_convert --fetch`` takes
from the sdist. It prints the size against the 64 MiB a call carries.

``build`` (on the GPU machine, offline: the wheelhouse holds scikit-build-core, CMake and
Ninja) installs llama-cpp-python from the trimmed sdist with :func:`cuda_cmake_args`
(this GPU's architecture only, flash attention only for the KV types the GGUF tiers use,
ggml's CPU variants trimmed as ``make setup`` trims them, llama.cpp's tools in the same CMake
build with ``$ORIGIN`` in their run path), keeps the CMake build folder, copies its ``bin/``
(the tools and the shared libraries and backend modules they load) into the folder where
:func:`qeval.engines.llama_tools.tool_path` looks for them, and records the seconds in its
``build.json``. Exit 0 when the build ran and the tools were placed; 1 with the build's last
lines; 2 on bad input (one line).

Library checked: scikit-build-core (llama-cpp-python's build backend) keeps its CMake build
folder with ``-C build-dir=DIR`` and takes ``CMAKE_ARGS`` from the environment; pip's own
``pip install`` drives it, so nothing here reimplements the wheel build.
"""
from __future__ import annotations

import argparse
import io
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

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2 ** 20  # bytes a call to the device machine carries in all (docs/gpu.md)
VENDOR = "vendor/llama.cpp"
#: dropped outside the vendored tree (paths relative to the sdist's top folder)
DROP_TOP = (".git", ".github", "docs", "tests", "examples", "docker", "mkdocs.yml", ".readthedocs.yaml")
#: dropped inside the vendored llama.cpp tree
DROP_VENDOR = (".git", ".github", ".devops", ".gemini", ".pi", "models", "docs", "tests", "examples", "pocs",
               "benches", "media", "ci", "app", "skills", "build-xcframework.sh", "flake.nix")
#: the ggml backends kept (folders ``ggml/src/ggml-<name>``); the others are never configured here
KEEP_BACKENDS = ("cpu", "cuda", "blas", "rpc")
#: the tools kept (folders under ``tools/``): llama-bench, llama-batched-bench, llama-server
#: (with its web UI's CMake step) and mtmd (linked by llama-server)
KEEP_TOOLS = ("llama-bench", "batched-bench", "server", "ui", "mtmd")
#: the tools' binaries qeval runs (qeval.engines.llama_tools.TOOLS)
TOOL_BINARIES = ("llama-bench", "llama-batched-bench", "llama-server")
PATCH_VERSION = 1  # bump when what trim keeps or rewrites changes (recorded in TRIMMED.json)
_SUBDIR = re.compile(r"^(\s*)add_subdirectory\(\s*([\w.-]+)\s*\)\s*$")


def keep(rel: str) -> bool:
    """Whether the trimmed sdist keeps ``rel``, a path relative to the sdist's top folder
    (``vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu``; ``/``-separated, no leading folder)."""
    parts = rel.split("/")
    if parts[0] in DROP_TOP:
        return False
    if rel == VENDOR or not rel.startswith(VENDOR + "/"):
        return True
    sub = parts[2:]
    if sub[0] in DROP_VENDOR:
        return False
    if sub[:2] == ["ggml", "src"] and len(sub) >= 3 and sub[2].startswith("ggml-") and "." not in sub[2]:
        return sub[2][len("ggml-"):] in KEEP_BACKENDS
    if sub[0] == "tools" and len(sub) >= 2 and sub[1] != "CMakeLists.txt":
        return sub[1] in KEEP_TOOLS
    return True


def trim_tools_cmakelists(text: str) -> str:
    """``tools/CMakeLists.txt`` with the ``add_subdirectory(<tool>)`` lines of tools outside
    :data:`KEEP_TOOLS` commented out (the other lines, the ``if`` blocks among them, as they were).

    Raises:
        ValueError: a kept tool has no ``add_subdirectory`` line (another llama.cpp layout:
            the trimmed tree would not build it).
    """
    out, seen = [], set()
    for line in text.splitlines(keepends=True):
        m = _SUBDIR.match(line)
        if m:
            seen.add(m.group(2))
            if m.group(2) not in KEEP_TOOLS:
                line = f"{m.group(1)}# qeval: tool not in the trimmed source: {line.lstrip()}"
        out.append(line)
    missing = [t for t in KEEP_TOOLS if t not in seen]
    if missing:
        raise ValueError(f"tools/CMakeLists.txt adds no {', '.join(missing)} (another llama.cpp layout)")
    return "".join(out)


def trim_sdist(sdist: Path, dest: Path) -> dict:
    """Write the trimmed copy of llama-cpp-python's ``sdist`` (a ``.tar.gz``) to folder
    ``dest`` under the same file name; returns ``{"path", "bytes", "source_bytes",
    "files", "dropped_files", "dropped_bytes"}`` (bytes unpacked for the ``dropped_*``).

    Raises:
        ValueError: not a llama-cpp-python sdist (no ``vendor/llama.cpp/CMakeLists.txt``),
            or :func:`trim_tools_cmakelists` found another layout.
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / sdist.name
    if out.resolve() == sdist.resolve():
        raise ValueError(f"{sdist}: the trimmed copy would overwrite it (give another --dest)")
    kept = dropped = dropped_bytes = 0
    seen_cmake = False
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(sdist, "r:gz") as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for m in src:
            top, _, rel = m.name.partition("/")
            if rel and not keep(rel):
                dropped += 1
                dropped_bytes += m.size
                continue
            if m.isfile():
                f = src.extractfile(m)
                data = f.read() if f is not None else b""
                if rel == f"{VENDOR}/tools/CMakeLists.txt":
                    data = trim_tools_cmakelists(data.decode()).encode()
                    m.size = len(data)
                seen_cmake = seen_cmake or rel == f"{VENDOR}/CMakeLists.txt"
                dst.addfile(m, io.BytesIO(data))
            else:
                dst.addfile(m)
            kept += 1
        note = json.dumps({"from": sdist.name, "trim": PATCH_VERSION, "dropped_files": dropped,
                           "kept_backends": list(KEEP_BACKENDS), "kept_tools": list(KEEP_TOOLS)}, indent=1).encode()
        info = tarfile.TarInfo(f"{top}/TRIMMED.json")
        info.size, info.mtime = len(note), int(time.time())
        dst.addfile(info, io.BytesIO(note))
    if not seen_cmake:
        tmp.unlink()
        raise ValueError(f"{sdist.name}: no {VENDOR}/CMakeLists.txt (not a llama-cpp-python sdist)")
    os.replace(tmp, out)
    return {"path": out, "bytes": out.stat().st_size, "source_bytes": sdist.stat().st_size, "files": kept,
            "dropped_files": dropped, "dropped_bytes": dropped_bytes}


def trim_tree(src: Path, dest: Path) -> int:
    """Copy the vendored llama.cpp folder ``src`` (as ``$QEVAL_CACHE/llama_cpp_src/<v>/llama.cpp``)
    to ``dest`` with what :func:`keep` keeps and ``tools/CMakeLists.txt`` trimmed; returns the
    number of files copied (the tests configure this tree; the tool trims sdists).

    Raises:
        ValueError: as :func:`trim_tools_cmakelists`.
    """
    n = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        if not p.is_file() or p.is_symlink() or not keep(f"{VENDOR}/{rel}"):
            continue
        t = dest / rel
        t.parent.mkdir(parents=True, exist_ok=True)
        if rel == "tools/CMakeLists.txt":
            t.write_text(trim_tools_cmakelists(p.read_text()))
        else:
            shutil.copy2(p, t)
        n += 1
    return n


def cuda_cmake_args(archs: str | None, *, cpu_only: bool = False) -> list[str]:
    """CMake arguments of the one-step build: llama-cpp-python with ggml's CPU variants
    chosen at run time (the Makefile's ``LLAMA_CPU_FLAGS``), CUDA for ``archs`` only
    (``CMAKE_CUDA_ARCHITECTURES``: compute capability without the dot, ``-real`` added so
    no PTX is embedded for other GPUs), flash attention for the KV-type pairs ggml builds by
    default (f16, q4_0, q8_0 with themselves: the GGUF tiers' f16 and q8_0 caches;
    ``GGML_CUDA_FA_ALL_QUANTS=OFF`` leaves out the mixed pairs), and llama.cpp's tools in the
    same build (``LLAMA_BUILD_TOOLS``/``SERVER``; no tests, examples, web UI download or curl),
    their run path ``$ORIGIN`` so the copied ``bin/`` folder finds its libraries.

    Args:
        archs: e.g. ``"90"`` (H100/H200), ``"80;89"``; ignored with ``cpu_only``.
        cpu_only: ``-DGGML_CUDA=OFF`` instead (the CPU machine's configure check).

    Raises:
        ValueError: ``archs`` empty or not digits separated by ``;`` (``native`` is refused:
            the GPU machine names its compute capability, from torch).
    """
    args = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DLLAVA_BUILD=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN"]
    if cpu_only:
        return args + ["-DGGML_CUDA=OFF"]
    parts = [a.strip() for a in (archs or "").split(";") if a.strip()]
    if not parts or not all(a.isdigit() for a in parts):
        raise ValueError(f"CUDA architectures {archs!r}: expected compute capabilities without the dot, e.g. 90 or 80;89")
    return args + ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(f"{a}-real" for a in parts),
                   "-DGGML_CUDA_FA_ALL_QUANTS=OFF"]


def _llama_build():
    """:mod:`qeval.engines.llama_build` by path (this tool may run before qeval is installed)."""
    sys.path.insert(0, str(REPO / "qeval" / "engines"))
    try:
        import llama_build  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return llama_build


def _installed_version() -> str | None:
    """The installed llama-cpp-python's version (None: not installed; the newest is taken)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def _download(version: str | None, into: Path) -> Path:
    """llama-cpp-python's sdist through pip (``version`` or the newest), into ``into``."""
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python>=0.3.8"
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        "--disable-pip-version-check", "-q", "-d", str(into), spec], text=True, capture_output=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if p.returncode != 0 or len(found) != 1:
        tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        sys.exit(f"llama_src_trim: pip download {spec} failed (exit {p.returncode}): {tail}")
    return found[0]


def place_tools(bin_dir: Path, seconds: float, args: list[str], sdist: str) -> Path:
    """Copy ``bin_dir`` (the CMake build's ``bin/``: the tools, ``libllama``, ``libggml*``
    and the backend modules) to the folder :func:`qeval.engines.llama_tools.tool_path`
    reads for the installed llama-cpp-python (asked of a fresh interpreter: this one may
    hold the old build), with ``build.json`` (``seconds``: the whole one-step build, wheel
    included) and its completion marker; returns that folder.

    Raises:
        RuntimeError: a tool of :data:`TOOL_BINARIES` is missing from ``bin_dir``, or qeval
            cannot name the folder.
    """
    missing = [t for t in TOOL_BINARIES if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        raise RuntimeError(f"the build left no {', '.join(missing)} in {bin_dir}")
    code = ("import json; from qeval.engines import llama_tools as t; "
            "print(json.dumps([str(t.tools_dir()), t.llama_cpp_version(), t._MARKER]))")
    p = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"qeval cannot name its llama.cpp tools folder: {p.stderr.strip().splitlines()[-1:]}")
    folder, version, marker = json.loads(p.stdout.strip().splitlines()[-1])
    out = Path(folder)
    stage = out.with_name(out.name + ".part")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(bin_dir, stage / "bin", symlinks=True)
    (stage / "build.json").write_text(json.dumps(
        {"llama_cpp_python": version, "cmake_args": args, "seconds": round(seconds, 1), "tools": list(TOOL_BINARIES),
         "source": sdist, "built_with": "llama-cpp-python's CMake build (tools/llama_src_trim.py build)"},
        indent=1) + "\n")
    (stage / marker).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(stage, out)
    return out


def build(sdist: Path, archs: str, build_dir: Path, jobs: int, variants: str = "auto") -> dict:
    """Install llama-cpp-python from the trimmed ``sdist`` with :func:`cuda_cmake_args`
    (``archs``) in one CMake build kept in ``build_dir``, ggml's CPU variants trimmed to
    ``variants`` (:func:`qeval.engines.llama_build.resolve_variants`), then
    :func:`place_tools`. Returns ``{"seconds", "cmake_args", "tools"}`` (seconds: wall
    time of configure, compile and install, s).

    Raises:
        RuntimeError: the build failed (its last lines) or left a tool out.
        ValueError: bad ``archs`` or ``variants``.
    """
    lb = _llama_build()
    args = cuda_cmake_args(archs)
    keep_variants = lb.resolve_variants(variants)
    src = build_dir / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(src, filter="data")
    tree = next(p for p in src.iterdir() if p.is_dir())
    if keep_variants is not None:
        f = tree / VENDOR / "ggml" / "src" / "CMakeLists.txt"
        trimmed = lb.trim_variants(f.read_text(), keep_variants)
        if trimmed is not None:
            f.write_text(trimmed)
    cmake_dir = build_dir / "cmake"
    # plain spaces, no quotes: every argument is free of blanks and quotes, and CMAKE_ARGS is
    # split on blanks ($ORIGIN reaches CMake literally, which writes it into the run path)
    assert all(" " not in x and "'" not in x for x in args), args
    env = dict(os.environ, CMAKE_ARGS=" ".join(args), FORCE_CMAKE="1", CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    cmd = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--disable-pip-version-check",
           "-C", f"build-dir={cmake_dir}", str(tree)]
    print(f"building llama-cpp-python and {', '.join(TOOL_BINARIES)} in one CMake build ({jobs} jobs)\n"
          f"  CMAKE_ARGS={' '.join(args)}\n  CPU variants: {', '.join(keep_variants or ['all'])}", flush=True)
    log = build_dir / "build.log"
    t0 = time.time()
    with open(log, "w") as lf:
        p = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    if p.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"pip install of the trimmed source failed (exit {p.returncode}) after {seconds:.0f} s; "
                           f"last lines of {log}:\n{tail}")
    out = place_tools(cmake_dir / "bin", seconds, args, sdist.name)
    return {"seconds": seconds, "cmake_args": args, "tools": str(out / "bin")}


#: what each phase's call carries besides the working tree, fetched by ``carry`` for the GPU
#: machine's Python: wheels where PyPI has them (``--prefer-binary``), else sdists (device-smi;
#: gptqmodel, whose sdist is pure Python: no ``ext_modules`` in 7.6's setup.py, its CUDA
#: kernels are compiled at first use).
#: gguf: the trimmed sdist's build backend and tools (scikit-build-core, its packaging and
#: pathspec, CMake and Ninja wheels: the GPU image may have neither) and llama-cpp-python's
#: one dependency a torch image lacks (diskcache). gptq: gptqmodel 7.6 and its small
#: dependencies an HF image lacks (qeval's own extras went over as wheels on 2026-12-04,
#: docs/measurements.md "On a GPU"); torch, transformers, accelerate, datasets, pyarrow,
#: safetensors, numpy are the image's.
CARRY = {
    "gguf": ("scikit-build-core>=0.9.2", "packaging", "pathspec", "cmake>=3.21", "ninja>=1.5", "diskcache>=5.6.1",
             "setuptools>=64", "wheel"),
    "gptq": ("device-smi>=0.5.7", "pypcre>=0.6.2", "tokenicer>=0.0.14", "logbar>=0.4.14", "defuser>=0.0.28",
             "threadpoolctl>=3.6.0", "dill>=0.3.8", "setuptools>=77.0.1,<83"),
}
GPTQMODEL_SPEC = "gptqmodel==7.6.0"
#: qeval's own packages a torch + transformers GPU image lacked on 2026-12-04 (docs/measurements.md
#: "On a GPU"), plus NVML's binding (GGUF memory) and optimum (GPTQ checkpoints): every call
#: to a fresh machine carries them; pinned to this venv's versions when installed here (the
#: versions the suite ran; pydantic and pydantic-core must match each other)
CARRY["qeval"] = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf", "hqq", "torchao",
                  "rouge-score", "nltk", "nvidia-ml-py", "optimum")


def _pinned(names: tuple[str, ...]) -> list[str]:
    """``name==<installed version>`` for each name installed here, else the bare name."""
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for n in names:
        if any(c in n for c in "<>=!~"):
            out.append(n)
            continue
        try:
            out.append(f"{n}=={version(n)}")
        except PackageNotFoundError:
            out.append(n)
    return out


def carry(dest: Path, phase: str, python_version: str, sdist: Path | None = None, version: str | None = None) -> list[Path]:
    """Fill ``dest`` with what the ``phase``'s call carries (:data:`CARRY`) for CPython
    ``python_version`` on x86-64 Linux (pip download ``--prefer-binary --python-version
    --platform manylinux...``, ``--no-deps``), the gguf phase's trimmed sdist, the gptq
    phase's gptqmodel sdist (``qeval``: qeval's own packages, for either phase); returns the
    files in ``dest``.

    Raises:
        SystemExit: pip failed (its last lines).
    """
    dest.mkdir(parents=True, exist_ok=True)
    plat = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--implementation", "cp", "--python-version", python_version]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--prefer-binary", "--disable-pip-version-check",
           "-q", "-d", str(dest), *plat, *(_pinned(CARRY[phase]) if phase == "qeval" else CARRY[phase])]
    p = subprocess.run(cmd, text=True, capture_output=True)
    if p.returncode != 0:
        sys.exit(f"llama_src_trim: pip download for Python {python_version} failed: "
                 + " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:]))
    if phase == "gguf":
        with tempfile.TemporaryDirectory(prefix="qeval-llama-trim-") as td:
            trim_sdist(sdist or _download(version, Path(td)), dest)
    elif phase == "gptq":
        q = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "gptqmodel",
                            "--no-build-isolation", "--disable-pip-version-check", "-q", "-d", str(dest), GPTQMODEL_SPEC],
                           text=True, capture_output=True)
        if q.returncode != 0:
            sys.exit(f"llama_src_trim: pip download {GPTQMODEL_SPEC} failed: "
                     + " | ".join((q.stdout + q.stderr).strip().splitlines()[-3:]))
    return sorted(x for x in dest.iterdir() if x.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim", help="write the trimmed sdist (any machine; downloads the sdist unless --sdist)")
    t.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (default: pip download)")
    t.add_argument("--version", help="llama-cpp-python version to download (default: the installed one, else newest)")
    t.add_argument("--dest", type=Path, required=True, help="folder of the trimmed sdist (e.g. the wheelhouse)")
    b = sub.add_parser("build", help="on the GPU machine: install it with CUDA and place llama.cpp's tools")
    b.add_argument("--sdist", type=Path, required=True, help="the trimmed sdist")
    b.add_argument("--archs", default=None, help="CUDA compute capabilities without the dot (default: GPU 0's, from torch)")
    b.add_argument("--build-dir", type=Path, default=None, help="kept CMake build folder (default: $QEVAL_CACHE/llama_cuda_build)")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    b.add_argument("--variants", default="auto", help="ggml CPU variants: auto, all or names (as make setup)")
    c = sub.add_parser("carry", help="fill a folder with what a GPU phase's call carries (see CARRY)")
    c.add_argument("--phase", choices=sorted(CARRY), required=True)
    c.add_argument("--dest", type=Path, required=True)
    c.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default %(default)s)")
    c.add_argument("--sdist", type=Path, help="gguf: llama-cpp-python's sdist (default: pip download)")
    c.add_argument("--version", help="gguf: llama-cpp-python version (default: the installed one)")
    f = sub.add_parser("flags", help="print the CMake arguments of the build")
    f.add_argument("--archs", default="90")
    f.add_argument("--cpu", action="store_true", help="the CPU configure check's flags (-DGGML_CUDA=OFF)")
    a = ap.parse_args(argv)

    def bad(msg: str) -> int:
        print(f"llama_src_trim: {msg}", file=sys.stderr)
        return 2

    if a.cmd == "flags":
        try:
            print(shlex.join(cuda_cmake_args(a.archs, cpu_only=a.cpu)))
        except ValueError as e:
            return bad(f"--archs: {e}")
        return 0
    if a.cmd == "carry" and not re.fullmatch(r"3\.\d+", a.python_version):
        return bad(f"--python-version {a.python_version!r}: expected 3.N")
    if getattr(a, "sdist", None) is not None and not (a.sdist.is_file() and a.sdist.name.startswith("llama_cpp_python-")
                                    and a.sdist.name.endswith(".tar.gz")):
        return bad(f"--sdist {a.sdist}: not a llama_cpp_python-<version>.tar.gz file")
    if a.cmd == "carry":
        version = a.version or _installed_version()
        files = carry(a.dest, a.phase, a.python_version, a.sdist, version)
        total = sum(x.stat().st_size for x in files)
        for x in sorted(files, key=lambda x: -x.stat().st_size):
            print(f"  {x.stat().st_size / 2 ** 20:7.1f} MiB  {x.name}")
        print(f"{a.dest}: {len(files)} files, {total / 2 ** 20:.1f} MiB = {100 * total / CARRY_LIMIT:.0f} % of the "
              f"{CARRY_LIMIT / 2 ** 20:.0f} MiB a device call carries (the {a.phase} phase's call)")
        return 0 if total <= CARRY_LIMIT else 1
    if a.cmd == "trim":
        with tempfile.TemporaryDirectory(prefix="qeval-llama-trim-") as td:
            version = a.version or (None if a.sdist is not None else _installed_version())
            sdist = a.sdist or _download(version, Path(td))
            try:
                r = trim_sdist(sdist, a.dest)
            except ValueError as e:
                return bad(f"--sdist {sdist}: {e}")
        mib = lambda n: f"{n / 2 ** 20:.1f} MiB"  # noqa: E731
        print(f"{r['path']}: {mib(r['bytes'])} (from {mib(r['source_bytes'])}; {r['files']} entries kept, "
              f"{r['dropped_files']} dropped, {mib(r['dropped_bytes'])} unpacked)\n"
              f"  {100 * r['bytes'] / CARRY_LIMIT:.0f} % of the {mib(CARRY_LIMIT)} a device call carries; "
              f"{mib(CARRY_LIMIT - r['bytes'])} left for the rest")
        return 0
    try:
        archs = a.archs
        if archs is None:
            import torch
            if not torch.cuda.is_available():
                return bad("build: no --archs and torch sees no CUDA GPU")
            archs = "".join(map(str, torch.cuda.get_device_capability(0)))
        cuda_cmake_args(archs)
        build_dir = a.build_dir or Path(_llama_build().cache_root()) / "llama_cuda_build"
        r = build(a.sdist.resolve(), archs, build_dir.resolve(), a.jobs, a.variants)
    except ValueError as e:
        return bad(str(e))
    except RuntimeError as e:
        print(f"llama_src_trim: {e}", file=sys.stderr)
        return 1
    print(f"llama-cpp-python and its tools built in {r['seconds']:.0f} s; tools in {r['tools']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
