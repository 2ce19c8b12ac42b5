"""llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server, llama-speculative):
built in the same CMake build as the llama-cpp-python wheel (qeval/engines/llama_build.py:
the patch, the wheel's pip call, the tools copied out of its tree, found again by the
installed package's fingerprint, run from the folder of qeval's CPU variant), and the
separate static build where the wheel has none (flags, cache key, no build when cached, its
one-line reason). Fast: no compile, the builds faked at named points (llama_build._run,
llama_tools' subprocess and source fetch)."""
from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, write_tar

LIBS = ("libllama.so", "libllama.so.0", "libggml.so.0", "libggml-base.so.0")


def test_llama_tools_flags_match_the_makefile_and_key_the_cache(qeval_cache, monkeypatch):
    import re
    from qeval.engines import llama_tools as lt
    make = (REPO / "Makefile").read_text()
    cpu = re.search(r"^LLAMA_CPU_FLAGS :?= (.+)$", make, re.M)
    cuda = re.search(r"^LLAMA_CUDA_FLAGS :?= \$\(if \$\(CUDA\),(.+),\)$", make, re.M)
    assert cpu and cpu.group(1).strip() == lt.VARIANTS_CMAKE_ARGS
    assert cuda and cuda.group(1).replace("$(CUDA_ARCHS)", "native") == lt.CUDA_CMAKE_ARGS
    monkeypatch.delenv(lt.CMAKE_ARGS_ENV, raising=False)
    # the qeval flavour builds the instruction sets of the CPU variant qeval runs here
    monkeypatch.setattr(lt, "_installed", lambda: ("zen4", False))
    assert "-DGGML_AVX512_BF16=ON" in lt.cmake_args() and "-DGGML_AMX_INT8=OFF" in lt.cmake_args()
    monkeypatch.setattr(lt, "_installed", lambda: ("built-in", False))
    assert " ".join(lt.cmake_args()).endswith(lt.PORTABLE_CMAKE_ARGS)
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", True))
    assert "-DGGML_AVX512=OFF" in lt.cmake_args() and "-DGGML_CUDA=on" in lt.cmake_args()
    with pytest.raises(ValueError, match="flavour"):
        lt.cmake_args("fastest")
    a = lt.tools_dir("0.3.36")
    monkeypatch.setenv(lt.CMAKE_ARGS_ENV, "-DGGML_CUDA=on")
    b = lt.tools_dir("0.3.36")
    assert a != b and a.parent == b.parent == qeval_cache / "llama_tools" and a.name.startswith("0.3.36-")
    assert "-DGGML_CUDA=on" in lt.cmake_args() and "-DLLAMA_CURL=OFF" in lt.cmake_args()


def test_native_flavour_keeps_amx_out_where_the_kernel_refuses_it():
    from qeval.engines import llama_tools as lt
    spr = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    refused = lt.native_cmake_args(spr, amx_ok=False)
    assert refused[0] == "-DGGML_NATIVE=ON" and "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in refused
    assert lt.native_cmake_args(spr, amx_ok=True) == ["-DGGML_NATIVE=ON"]  # granted: -march=native as it is
    assert lt.native_cmake_args(frozenset({"avx2"}), amx_ok=False) == ["-DGGML_NATIVE=ON"]  # no AMX to leave out


def test_tool_path_checks_the_name_and_builds_only_when_asked(qeval_cache, monkeypatch):
    """The separate static build (the installed wheel has no tools of its own here): its
    folder's bin/ is used as it is when complete, never built when build=False."""
    from qeval.engines import llama_tools as lt
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", False))
    monkeypatch.setattr(lt, "llama_cpp_version", lambda: "0.0.0-test")
    monkeypatch.setattr(lt, "wheel_tools", lambda version=None: (None, "no tools of its own (test)"))
    with pytest.raises(ValueError, match="llama-bench, llama-batched-bench, llama-server"):
        lt.tool_path("llama-cli")
    with pytest.raises(FileNotFoundError, match=r"not built yet .*no tools of its own \(test\)"):
        lt.tool_path("llama-bench", build=False)
    # a complete cache entry is used as it is, without building
    folder = lt.tools_dir("0.0.0-test")
    (folder / "bin").mkdir(parents=True)
    for t in lt.TOOLS:
        (folder / "bin" / t).write_text("#!/bin/sh\n")
        (folder / "bin" / t).chmod(0o755)
    (folder / ".qeval-complete").write_text("ok\n")
    monkeypatch.setattr(lt, "build_tools", lambda **kw: pytest.fail("built although cached"))
    assert lt.tool_path("llama-server") == folder / "bin" / "llama-server"



# ---- the tools built with the wheel (qeval/engines/llama_build.py) -------------------------

VENDOR_CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project("llama.cpp" C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)

add_subdirectory(ggml)
add_subdirectory(src)
if (LLAMA_BUILD_COMMON AND LLAMA_BUILD_TOOLS)
    add_subdirectory(tools)
endif()
install(TARGETS llama LIBRARY PUBLIC_HEADER)
"""


def _lb():
    from qeval.engines import llama_build
    return llama_build


def test_patch_puts_the_four_tools_and_relative_run_paths_in_the_wheels_build():
    lb = _lb()
    out = lb.add_tools(VENDOR_CMAKELISTS)
    assert out is not None and out.startswith(VENDOR_CMAKELISTS.split("add_subdirectory(ggml)")[0].rstrip("\n"))
    # the run paths are set before any target exists (ggml), the tools come after everything
    rpath = out.index('set(CMAKE_BUILD_RPATH "$ORIGIN/../lib")')
    assert out.index("CMAKE_LIBRARY_OUTPUT_DIRECTORY") < out.index("set(CMAKE_BUILD_RPATH_USE_ORIGIN ON)") < rpath
    assert rpath < out.index("add_subdirectory(ggml)") < out.index("install(TARGETS llama") < out.index("tools/server")
    added = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("add_subdirectory(")][3:]
    assert added == ["add_subdirectory(tools/mtmd)", "add_subdirectory(tools/batched-bench)",
                     "add_subdirectory(tools/llama-bench)", "add_subdirectory(tools/ui)",
                     "add_subdirectory(tools/server)", "add_subdirectory(examples/speculative)"]
    # in the default build (the folders hold those targets only), no download, and none added
    # twice where llama.cpp or llama-cpp-python adds them itself
    assert "EXCLUDE_FROM_ALL" not in out and "set(LLAMA_USE_PREBUILT_UI OFF)" in out
    assert "if (NOT LLAMA_BUILD_TOOLS)" in out and "if (NOT LLAVA_BUILD AND NOT TARGET mtmd)" in out
    assert 'if (NOT LLAMA_BUILD_EXAMPLES AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/examples/speculative/CMakeLists.txt")' in out
    assert out.count("qeval (qeval/engines/llama_build.py)") == 2
    assert lb.add_tools(VENDOR_CMAKELISTS.replace("set(CMAKE_LIBRARY_OUTPUT_DIRECTORY", "set(OTHER")) is None
    assert lb.PATCH_VERSION >= 2  # the wheel key changed with the patch: an old wheel is not taken from the cache


def test_patch_tools_needs_every_folder_and_names_the_missing_one(tmp_path):
    lb = _lb()
    v = tmp_path / "llama.cpp"
    v.mkdir()
    (v / "CMakeLists.txt").write_text(VENDOR_CMAKELISTS)
    for d in lb.TOOL_DIRS[:-1]:
        (v / d).mkdir(parents=True)
        (v / d / "CMakeLists.txt").write_text("")
    assert lb.patch_tools(v) == "the source has no tools/mtmd"
    assert (v / "CMakeLists.txt").read_text() == VENDOR_CMAKELISTS
    (v / "tools" / "mtmd").mkdir()
    (v / "tools" / "mtmd" / "CMakeLists.txt").write_text("")
    assert lb.patch_tools(v) is None and "add_subdirectory(tools/server)" in (v / "CMakeLists.txt").read_text()


def test_wheel_excludes_follow_llava_build():
    lb = _lb()
    assert lb.wheel_excludes("-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF ") == ["bin/llama-*", "lib/libmtmd*", "include/mtmd*"]
    assert lb.wheel_excludes("-DGGML_NATIVE=OFF") == ["bin/llama-*"]  # llama-cpp-python's default: it installs mtmd
    assert lb.wheel_excludes("-DLLAVA_BUILD=OFF -DLLAVA_BUILD:BOOL=ON") == ["bin/llama-*"]  # the last one wins
    assert not lb.cmake_bool("-DX=0", "X", True) and lb.cmake_bool("-DX=on", "X", False)


def _wheel(path: Path, libs: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for n, data in libs.items():
            z.writestr(f"llama_cpp/lib/{n}", data)
        z.writestr("llama_cpp/__init__.py", "")
        z.writestr("bin/libggml-cpu-haswell.so", b"module")
    return path


def _installed_pkg(root: Path, libs: dict[str, bytes]) -> Path:
    pkg = root / "site-packages" / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for n, data in libs.items():
        (pkg / "lib" / n).write_bytes(data)
    return pkg


def test_the_installed_package_has_the_fingerprint_of_its_wheel(tmp_path):
    lb = _lb()
    libs = {n: f"bytes of {n}".encode() for n in LIBS}
    whl = _wheel(tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", libs)
    pkg = _installed_pkg(tmp_path, libs)
    (pkg / "lib" / "notes.txt").write_text("not a library")
    fp = lb.wheel_fingerprint(whl)
    assert len(fp) == 16 and lb.installed_fingerprint(pkg) == fp
    (pkg / "lib" / "libllama.so").write_bytes(b"another build")
    assert lb.installed_fingerprint(pkg) != fp
    assert lb.installed_fingerprint(tmp_path / "nowhere") is None
    assert lb.wheel_tools_dir("0.3.36", fp, root=tmp_path) == tmp_path / "llama_tools" / f"0.3.36-wheel-{fp}"


def _elf_with_run_path(path: Path, run_path: bytes) -> Path:
    """A minimal ELF64 little-endian file: one PT_LOAD over the whole file, a PT_DYNAMIC
    with DT_STRTAB, DT_RUNPATH and DT_NULL, and its string table."""
    strtab = b"\0" + run_path + b"\0"
    phoff, ph = 64, 56
    dyn_off = phoff + 2 * ph
    str_off = dyn_off + 3 * 16
    size = str_off + len(strtab)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x20, phoff)
    struct.pack_into("<HH", hdr, 0x36, ph, 2)
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, 0x400000, 0x400000, size, size, 0x1000)
    dyn = struct.pack("<IIQQQQQQ", 2, 6, dyn_off, 0x400000 + dyn_off, 0x400000 + dyn_off, 48, 48, 8)
    entries = struct.pack("<qQqQqQ", 5, 0x400000 + str_off, 29, 1, 0, 0)
    path.write_bytes(bytes(hdr) + load + dyn + entries + strtab)
    return path


def test_run_paths_lose_cmakes_empty_padding(tmp_path):
    """CMake pads a build tree's run path with ':' for its install step; an empty entry is the
    current folder to the dynamic loader: the copies placed have none."""
    lb = _lb()
    f = _elf_with_run_path(tmp_path / "llama-bench", b"$ORIGIN/../lib:$ORIGIN:")
    size = f.stat().st_size
    assert lb.clean_run_path(f) == "$ORIGIN/../lib:$ORIGIN"
    assert f.stat().st_size == size and b"$ORIGIN/../lib:$ORIGIN\0\0" in f.read_bytes()
    assert lb.clean_run_path(f) == "$ORIGIN/../lib:$ORIGIN"  # idempotent
    (tmp_path / "script").write_text("#!/bin/sh\n")
    assert lb.clean_run_path(tmp_path / "script") is None


def _fake_build_bin(b: Path, tools=("llama-bench", "llama-batched-bench", "llama-server", "llama-speculative"),
                    variants=("haswell", "zen4"), gpu=("libggml-cuda.so",)) -> Path:
    """A CMake build tree's bin/ as the patched wheel build leaves it."""
    b.mkdir(parents=True)
    for t in tools:
        (b / t).write_text(f"#!/bin/sh\necho {t}\n")
        (b / t).chmod(0o755)
    for real, links in (("libllama.so.0.5.0", ("libllama.so.0", "libllama.so")),
                        ("libggml.so.0.25.3", ("libggml.so.0", "libggml.so")),
                        ("libggml-base.so.0.25.3", ("libggml-base.so.0", "libggml-base.so")),
                        ("libllama-common.so.0.5.0", ("libllama-common.so.0",)),
                        ("libmtmd.so.0.5.0", ("libmtmd.so.0",))):
        (b / real).write_bytes(real.encode())
        for ln in links:
            (b / ln).symlink_to(real)
    for n in ("libllama-server-impl.so", "libllama-bench-impl.so", *(f"libggml-cpu-{v}.so" for v in variants), *gpu):
        (b / n).write_bytes(n.encode())
    (b / "ggml-common.h").write_text("not copied")
    return b


def test_place_tools_copies_the_tools_and_every_library_out_of_the_build_tree(tmp_path):
    lb = _lb()
    b = _fake_build_bin(tmp_path / "cmake" / "bin")
    dest = tmp_path / "cache" / "llama_tools" / "0.3.36-wheel-0123456789abcdef"
    assert lb.place_tools(b, dest, {"seconds": 400.0}) == list(lb.TOOL_TARGETS)
    assert sorted(p.name for p in (dest / "bin").iterdir()) == sorted(lb.TOOL_TARGETS)
    lib = {p.name: p for p in (dest / "lib").iterdir()}
    assert {"libggml-cpu-haswell.so", "libggml-cpu-zen4.so", "libggml-cuda.so", "libllama-server-impl.so",
            "libmtmd.so.0.5.0"} <= set(lib) and "ggml-common.h" not in lib
    assert lib["libllama.so.0"].is_symlink() and os.readlink(lib["libllama.so.0"]) == "libllama.so.0.5.0"
    info = json.loads((dest / "build.json").read_text())
    assert info["seconds"] == 400.0 and info["tools"] == list(lb.TOOL_TARGETS) and lb.tools_complete(dest)
    # llama-speculative is optional (a source without examples/); llama-server is not
    b2 = _fake_build_bin(tmp_path / "b2", tools=("llama-bench", "llama-batched-bench", "llama-server"))
    assert lb.place_tools(b2, tmp_path / "d2", {}) == ["llama-bench", "llama-batched-bench", "llama-server"]
    b3 = _fake_build_bin(tmp_path / "b3", tools=("llama-bench", "llama-batched-bench"))
    with pytest.raises(RuntimeError, match="no llama-server"):
        lb.place_tools(b3, tmp_path / "d3", {})
    assert not (tmp_path / "d3").exists()


def _sdist(path: Path) -> Path:
    top = "llama_cpp_python-0.3.36"
    files = {f"{top}/pyproject.toml": b"", f"{top}/vendor/llama.cpp/CMakeLists.txt": VENDOR_CMAKELISTS.encode(),
             f"{top}/vendor/llama.cpp/ggml/src/CMakeLists.txt":
                 "".join(f"    ggml_add_cpu_backend_variant({v} AVX)\n" for v in ("x64", "haswell", "zen4")).encode()}
    files.update({f"{top}/vendor/llama.cpp/{d}/CMakeLists.txt": b"" for d in _lb().TOOL_DIRS})
    return write_tar(path, files)


def test_build_wheel_builds_the_tools_in_the_same_cmake_tree_and_places_them(qeval_cache, tmp_path, monkeypatch):
    """build_wheel with pip faked at llama_build._run: one pip wheel call with the kept build
    folder and the tools' install rules left out of the wheel, the vendored CMakeLists.txt
    patched, the tools placed under the wheel's fingerprint; a cached wheel says where its
    tools are, or that they are gone."""
    lb = _lb()
    libs = {n: f"bytes of {n}".encode() for n in LIBS}
    calls = []

    def fake_run(cmd, env=None, log=None):
        calls.append((cmd, env))
        if "download" in cmd:
            d = Path(cmd[cmd.index("-d") + 1])
            d.mkdir(parents=True)
            _sdist(d / "llama_cpp_python-0.3.36.tar.gz")
            return
        assert "wheel" in cmd
        tree = Path(cmd[-1])
        calls.append(((tree / "vendor" / "llama.cpp" / "CMakeLists.txt").read_text(), None))
        build_dir = Path(next(c for c in cmd if c.startswith("--config-settings=build-dir="))
                         .split("=", 2)[2])
        _fake_build_bin(build_dir / "bin", gpu=())
        w = Path(cmd[cmd.index("-w") + 1])
        w.mkdir(parents=True)
        _wheel(w / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", libs)
        log.write_text("[10/20] Linking CXX executable bin/llama-server\n")
    monkeypatch.setattr(lb, "_run", fake_run)
    said = []
    whl = lb.build_wheel("llama-cpp-python>=0.3.8", "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF", ["haswell", "zen4"],
                         log=said.append)
    cmd, env = calls[1]
    assert "-v" in cmd and "--config-settings=wheel.exclude=bin/llama-*;lib/libmtmd*;include/mtmd*" in cmd
    assert env["CMAKE_ARGS"] == "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
    assert "add_subdirectory(tools/server)" in calls[2][0]
    fp = lb.wheel_fingerprint(whl)
    tools = qeval_cache / "llama_tools" / f"0.3.36-wheel-{fp}"
    assert lb.tools_complete(tools) and (tools / "lib" / "libggml-cpu-zen4.so").is_file()
    info = json.loads((whl.parent / "build.json").read_text())
    assert info["tools"] == {"path": str(tools), "built": list(lb.TOOL_TARGETS)}
    assert json.loads((tools / "build.json").read_text())["wheel"] == whl.name
    assert "Linking CXX executable bin/llama-server" in (whl.parent / "build.log").read_text()
    assert any("in one CMake build" in s for s in said) and said[-1].endswith(f"from the same build in {tools}")
    assert not list((qeval_cache / "wheels" / "llama_cpp_python").glob("qeval-llama-build-*"))  # tree deleted
    # from the cache: no build, and the tools' place said
    said.clear()
    assert lb.build_wheel("llama-cpp-python>=0.3.8", "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF", ["haswell", "zen4"],
                          log=said.append) == whl
    assert sum("wheel" in c[0] for c in calls if isinstance(c[0], list)) == 1 and said[-1] == f"llama.cpp tools of this wheel: {tools}"
    import shutil
    shutil.rmtree(tools)
    said.clear()
    lb.build_wheel("llama-cpp-python>=0.3.8", "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF", ["haswell", "zen4"], log=said.append)
    assert "are not in" in said[-1] and "compiles them apart" in said[-1]


def _wheel_tools(qeval_cache: Path, tmp_path: Path, monkeypatch, **kw) -> Path:
    """A placed wheel tools folder and a fake installed llama_cpp whose fingerprint finds it."""
    lb = _lb()
    from qeval.engines import llama_tools as lt
    libs = {n: f"bytes of {n}".encode() for n in LIBS}
    pkg = _installed_pkg(tmp_path / "venv", libs)
    monkeypatch.setattr(lt, "_llama_cpp_dir", lambda: pkg)
    monkeypatch.setattr(lt, "llama_cpp_version", lambda: "0.0.0-test")
    monkeypatch.delenv(lt.CMAKE_ARGS_ENV, raising=False)
    folder = lb.wheel_tools_dir("0.0.0-test", lb.installed_fingerprint(pkg), root=qeval_cache)
    lb.place_tools(_fake_build_bin(tmp_path / "cmake" / "bin", **kw), folder, {"seconds": 1.0})
    monkeypatch.setattr(lt, "build_tools", lambda **k: pytest.fail("compiled again although the wheel has its tools"))
    return folder


def test_tool_path_runs_the_wheels_tools_from_the_folder_of_qevals_variant(qeval_cache, tmp_path, monkeypatch):
    """Every caller of tool_path gets the binary in cpu-<variant>/: hard links of the tools and
    of exactly the variant qeval chose (ggml loads the CPU module from the binary's folder),
    plus the GPU backend module; made once."""
    from qeval.engines import llama_tools as lt
    folder = _wheel_tools(qeval_cache, tmp_path, monkeypatch)
    monkeypatch.setattr(lt, "_installed", lambda: ("zen4", False))
    p = lt.tool_path("llama-bench")
    d = folder / "cpu-zen4"
    assert p == d / "llama-bench" and os.access(p, os.X_OK)
    assert sorted(x.name for x in d.iterdir()) == sorted([*lt.TOOLS, "libggml-cpu-zen4.so", "libggml-cuda.so"])
    assert os.stat(p).st_ino == os.stat(folder / "bin" / "llama-bench").st_ino  # a link, not a copy
    assert os.stat(d / "libggml-cpu-zen4.so").st_ino == os.stat(folder / "lib" / "libggml-cpu-zen4.so").st_ino
    # another variant chosen (the AMX one trapped in the probe, say): its own folder
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", False))
    h = lt.tool_path("llama-batched-bench").parent
    assert h == folder / "cpu-haswell" and not (h / "libggml-cpu-zen4.so").exists() and (h / "libggml-cpu-haswell.so").exists()
    monkeypatch.setattr(lt, "_installed", lambda: ("zen4", False))
    monkeypatch.setattr(lt, "_link", lambda s, t: pytest.fail("made again"))
    assert lt.tool_path("llama-server", build=False) == d / "llama-server"


def test_variant_dir_copies_where_links_fail_and_says_a_missing_variant(qeval_cache, tmp_path, monkeypatch):
    from qeval.engines import llama_tools as lt
    folder = _wheel_tools(qeval_cache, tmp_path, monkeypatch, gpu=())

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(lt.os, "link", no_links)
    d = lt.variant_dir(folder, "zen4")
    assert os.stat(d / "llama-bench").st_ino != os.stat(folder / "bin" / "llama-bench").st_ino
    assert (d / "llama-bench").read_text() == (folder / "bin" / "llama-bench").read_text()
    with pytest.raises(FileNotFoundError, match=r"\(sapphirerapids\) has no module"):
        lt.variant_dir(folder, "sapphirerapids")
    # a build with the CPU backend linked in: cpu-builtin, the tools alone
    bare = _wheel_tools(qeval_cache, tmp_path / "bare", monkeypatch, variants=(), gpu=())
    assert sorted(x.name for x in lt.variant_dir(bare, "built-in").iterdir()) == sorted(lt.TOOLS)


def test_without_the_wheels_tools_the_static_build_says_why_it_compiles_again(qeval_cache, tmp_path, monkeypatch):
    """The fallback: the installed wheel has no tools folder (built before this change, or the
    cache was wiped): the separate static build runs (compile faked at subprocess.run) and
    its first line says why; a variant the wheel's tools lack falls back the same way."""
    from qeval.engines import llama_tools as lt
    libs = {n: f"bytes of {n}".encode() for n in LIBS}
    pkg = _installed_pkg(tmp_path / "venv", libs)
    monkeypatch.setattr(lt, "_llama_cpp_dir", lambda: pkg)
    monkeypatch.setattr(lt, "llama_cpp_version", lambda: "0.0.0-test")
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", False))
    monkeypatch.delenv(lt.CMAKE_ARGS_ENV, raising=False)
    folder, why = lt.wheel_tools()
    assert folder is None and "has no tools from its own build" in why and "wiped cache" in why
    src = tmp_path / "src" / "llama.cpp"
    src.mkdir(parents=True)
    monkeypatch.setattr(lt, "ensure_source", lambda version=None, log=None: src)

    def fake_cmake(cmd, stdout=None, stderr=None, timeout=None):
        if "--build" in cmd:
            b = Path(cmd[cmd.index("--build") + 1]) / "bin"
            b.mkdir(parents=True)
            for t in cmd[cmd.index("--target") + 1:]:
                (b / t).write_text("#!/bin/sh\n")
                (b / t).chmod(0o755)
        import subprocess
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(lt.subprocess, "run", fake_cmake)
    said = []
    p = lt.tool_path("llama-server", log=said.append)
    assert p == lt.tools_dir("0.0.0-test") / "bin" / "llama-server"
    assert said[0] == f"llama.cpp tools: compiling again because {why}"
    assert why.startswith("the installed llama-cpp-python 0.0.0-test has no tools from its own build (")
    assert said[1].startswith("building llama-bench, llama-batched-bench, llama-server")
    assert json.loads((p.parent.parent / "build.json").read_text())["why"] == why
    # the wheel's tools exist but lack the variant qeval runs: the static build, saying so
    monkeypatch.setattr(lt, "wheel_tools", lambda version=None: (tmp_path / "w", ""))
    monkeypatch.setattr(lt, "variant_dir", lambda f, v: (_ for _ in ()).throw(FileNotFoundError("no module for x")))
    assert lt._from_wheel() == (None, "no module for x")


def test_build_command_says_where_the_tools_came_from(qeval_cache, tmp_path, monkeypatch, capsys):
    """make test's first line (python -m qeval.engines.llama_tools --build >/dev/null): one
    line on stderr either way, the paths on stdout."""
    from qeval.engines import llama_tools as lt
    real_build = lt.build_tools
    folder = _wheel_tools(qeval_cache, tmp_path, monkeypatch)
    monkeypatch.setattr(lt, "_installed", lambda: ("zen4", False))
    assert lt.main(["--build"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"llama.cpp tools: from the wheel's build tree ({folder / 'cpu-zen4'}), 0 s"
    assert out.split() == [str(folder / "cpu-zen4" / t) for t in lt.TOOLS]
    # a separate build made before (the wheel had none): used, and said so
    monkeypatch.setattr(lt, "wheel_tools", lambda version=None: (None, "no tools of its own (test)"))
    monkeypatch.setattr(lt, "build_tools", real_build)  # finds it complete: compiles nothing
    static = lt.tools_dir("0.0.0-test")
    (static / "bin").mkdir(parents=True)
    for t in lt.TOOLS:
        (static / "bin" / t).write_text("#!/bin/sh\n")
        (static / "bin" / t).chmod(0o755)
    (static / ".qeval-complete").write_text("ok\n")
    assert lt.main(["--build"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == (f"llama.cpp tools: from their separate build ({static}, compiled before because "
                           f"no tools of its own (test)), 0 s")
    assert out.split()[0] == str(static / "bin" / "llama-bench")


def test_makefile_runs_the_tools_step_with_its_line_visible():
    make = (REPO / "Makefile").read_text()
    assert "\t@$(PY) -m qeval.engines.llama_tools --build >/dev/null\n" in make  # stdout (paths) only is hidden
