"""tools/llama_src_trim.py: the trimmed llama-cpp-python source that travels to a GPU
machine (issue 49). What it keeps and drops (on a small sdist made here), the tools'
CMakeLists edit, the CUDA build's flags and its refusals, the placement of the built tools
where qeval's llama_tools finds them, and the trimmed llama.cpp tree of the installed
llama-cpp-python configured with CMake on this CPU machine (``-DGGML_CUDA=OFF``, no build:
a few seconds). The CUDA build itself runs on a GPU machine only (docs/gpu.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import write_tar

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("llama_src_trim_under_test", REPO / "tools" / "llama_src_trim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOLS_CMAKELISTS = """# tools
if (EMSCRIPTEN)
else()
    add_subdirectory(batched-bench)
    add_subdirectory(llama-bench)
    add_subdirectory(quantize)
    if (LLAMA_BUILD_SERVER)
        add_subdirectory(ui)
        add_subdirectory(cli)
        add_subdirectory(server)
    endif()
    add_subdirectory(mtmd)
endif()
"""


def test_keep_rules_drop_bulk_and_keep_what_the_build_and_converter_need():
    t = _tool()
    v = "vendor/llama.cpp"
    for rel in (".git/objects/pack/x.pack", "docs/index.md", "examples/x.py", f"{v}/.git", f"{v}/models/ggml-vocab-llama.gguf",
                f"{v}/docs/build.md", f"{v}/tests/test-backend-ops.cpp", f"{v}/examples/simple/simple.cpp",
                f"{v}/ggml/src/ggml-vulkan/ggml-vulkan.cpp", f"{v}/ggml/src/ggml-sycl/CMakeLists.txt",
                f"{v}/ggml/src/ggml-metal/ggml-metal.m", f"{v}/tools/quantize/quantize.cpp", f"{v}/tools/cli/cli.cpp"):
        assert not t.keep(rel), rel
    for rel in ("CMakeLists.txt", "pyproject.toml", "llama_cpp/llama_cpp.py", v, f"{v}/CMakeLists.txt",
                f"{v}/ggml/src/ggml-cuda/mmq.cu", f"{v}/ggml/src/ggml-cpu/ggml-cpu.c", f"{v}/ggml/src/ggml.c",
                f"{v}/ggml/src/ggml-backend-dl.cpp", f"{v}/tools/CMakeLists.txt", f"{v}/tools/llama-bench/llama-bench.cpp",
                f"{v}/tools/batched-bench/batched-bench.cpp", f"{v}/tools/server/server.cpp", f"{v}/tools/ui/CMakeLists.txt",
                f"{v}/tools/mtmd/mtmd.cpp", f"{v}/scripts/ui-assets.cmake", f"{v}/convert_hf_to_gguf.py",
                f"{v}/conversion/base.py", f"{v}/gguf-py/gguf/gguf.py", f"{v}/LICENSE", f"{v}/licenses/LICENSE-httplib",
                f"{v}/vendor/cpp-httplib/httplib.h", f"{v}/cmake/common.cmake", f"{v}/common/common.cpp"):
        assert t.keep(rel), rel


def test_tools_cmakelists_keeps_only_the_tools_qeval_runs():
    t = _tool()
    out = t.trim_tools_cmakelists(TOOLS_CMAKELISTS)
    live = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("add_subdirectory")]
    assert live == ["add_subdirectory(batched-bench)", "add_subdirectory(llama-bench)", "add_subdirectory(ui)",
                    "add_subdirectory(server)", "add_subdirectory(mtmd)"]
    assert "    # qeval: tool not in the trimmed source: add_subdirectory(quantize)" in out
    assert "if (LLAMA_BUILD_SERVER)" in out and out.count("endif()") == 2  # the blocks stay
    with pytest.raises(ValueError, match="llama-bench"):  # another layout: said, not a tree that cannot build
        t.trim_tools_cmakelists(TOOLS_CMAKELISTS.replace("add_subdirectory(llama-bench)", ""))


def test_trim_sdist_writes_the_same_name_without_the_bulk(tmp_path):
    t = _tool()
    top, v = "llama_cpp_python-9.9.9", "llama_cpp_python-9.9.9/vendor/llama.cpp"
    big = os.urandom(256 * 1024)  # incompressible: the size drop is the dropped files
    (tmp_path / "in").mkdir()
    src = write_tar(tmp_path / "in" / "llama_cpp_python-9.9.9.tar.gz", {
        f"{top}/pyproject.toml": b"[build-system]\n", f"{top}/CMakeLists.txt": b"add_subdirectory(vendor/llama.cpp)\n",
        f"{top}/llama_cpp/__init__.py": b"__version__ = '9.9.9'\n", f"{top}/.git/objects/pack/p.pack": big,
        f"{v}/CMakeLists.txt": b"project(llama.cpp)\n", f"{v}/models/ggml-vocab.gguf": big, f"{v}/docs/a.md": big,
        f"{v}/ggml/src/ggml-cuda/mmq.cu": b"//", f"{v}/ggml/src/ggml-vulkan/v.cpp": big,
        f"{v}/tools/CMakeLists.txt": TOOLS_CMAKELISTS.encode(), f"{v}/tools/quantize/q.cpp": big,
        f"{v}/tools/server/server.cpp": b"//", f"{v}/convert_hf_to_gguf.py": b"#", f"{v}/gguf-py/gguf/__init__.py": b"#"})
    r = t.trim_sdist(src, tmp_path / "out")
    assert r["path"] == tmp_path / "out" / "llama_cpp_python-9.9.9.tar.gz"  # pip download finds it by this name
    assert r["dropped_files"] == 5 and r["dropped_bytes"] == 5 * len(big) and r["bytes"] < len(big)
    with tarfile.open(r["path"]) as tf:
        names = set(tf.getnames())
        tools = tf.extractfile(f"{v}/tools/CMakeLists.txt").read().decode()
        note = json.loads(tf.extractfile(f"{top}/TRIMMED.json").read())
    assert {f"{v}/ggml/src/ggml-cuda/mmq.cu", f"{v}/tools/server/server.cpp", f"{v}/convert_hf_to_gguf.py",
            f"{v}/gguf-py/gguf/__init__.py", f"{top}/llama_cpp/__init__.py", f"{top}/pyproject.toml"} <= names
    assert not any("/models/" in n or "/.git/" in n or "ggml-vulkan" in n or "/quantize/" in n for n in names)
    assert "# qeval: tool not in the trimmed source: add_subdirectory(quantize)" in tools
    assert note["from"] == src.name and "cuda" in note["kept_backends"]
    with pytest.raises(ValueError, match="overwrite"):
        t.trim_sdist(r["path"], tmp_path / "out")
    other = write_tar(tmp_path / "llama_cpp_python-1.0.tar.gz", {"x-1.0/setup.py": b""})
    with pytest.raises(ValueError, match="not a llama-cpp-python sdist"):
        t.trim_sdist(other, tmp_path / "out2")
    assert not list((tmp_path / "out2").iterdir())  # nothing half-written left


def test_cuda_build_flags_name_one_architecture_and_the_tools():
    t = _tool()
    a = t.cuda_cmake_args("90")
    assert "-DGGML_CUDA=ON" in a and "-DCMAKE_CUDA_ARCHITECTURES=90-real" in a and "-DGGML_CUDA_FA_ALL_QUANTS=OFF" in a
    assert {"-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAVA_BUILD=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN"} <= set(a)
    # the Makefile's portable CPU flags (ggml's CPU variants chosen at run time) come first, as make setup builds them
    from qeval.engines.llama_tools import VARIANTS_CMAKE_ARGS
    assert a[:4] == VARIANTS_CMAKE_ARGS.split()
    assert "-DCMAKE_CUDA_ARCHITECTURES=80-real;89-real" in t.cuda_cmake_args("80;89")
    cpu = t.cuda_cmake_args(None, cpu_only=True)
    assert "-DGGML_CUDA=OFF" in cpu and not any("CUDA_ARCH" in x or "FA_ALL" in x for x in cpu)
    for bad in ("native", "", "9.0", None):
        with pytest.raises(ValueError, match="compute capabilities"):
            t.cuda_cmake_args(bad)


@pytest.mark.parametrize("args,needle", [(["flags", "--archs", "native"], "--archs"),
                                         (["build", "--sdist", "/nonexistent/llama_cpp_python-1.tar.gz"], "--sdist"),
                                         (["trim", "--sdist", str(REPO / "README.md"), "--dest", "/tmp"], "--sdist"),
                                         (["carry", "--phase", "gguf", "--dest", "/tmp/x", "--python-version", "312"],
                                          "--python-version")])
def test_bad_flags_refuse_in_one_line(args, needle):
    p = subprocess.run([sys.executable, str(REPO / "tools" / "llama_src_trim.py"), *args], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 1 and needle in err[0] and err[0].startswith("llama_src_trim: ")


def test_built_tools_are_placed_where_qeval_finds_them(tmp_path, monkeypatch):
    """place_tools: the one-step build's bin/ lands in the folder tool_path reads for the
    installed llama-cpp-python, with the build's seconds; a build without a tool is refused."""
    t = _tool()
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    bin_dir = tmp_path / "cmake" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    with pytest.raises(RuntimeError, match="llama-server"):
        t.place_tools(bin_dir, 1.0, ["-DGGML_CUDA=ON"], "llama_cpp_python-0.3.36.tar.gz")
    (bin_dir / "llama-server").write_text("#!/bin/sh\n")
    (bin_dir / "llama-server").chmod(0o755)
    (bin_dir / "libggml-cuda.so").write_bytes(b"\x7fELF")  # the backend modules travel with the tools
    out = t.place_tools(bin_dir, 321.04, ["-DGGML_CUDA=ON"], "llama_cpp_python-0.3.36.tar.gz")
    from qeval.engines import llama_tools
    assert llama_tools.tool_path("llama-bench", build=False) == out / "bin" / "llama-bench"
    assert (out / "bin" / "libggml-cuda.so").exists()
    info = json.loads((out / "build.json").read_text())
    assert info["seconds"] == 321.0 and info["cmake_args"] == ["-DGGML_CUDA=ON"] and "llama_src_trim" in info["built_with"]


def _cmake() -> str:
    exe = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    assert Path(exe).exists(), "cmake not found (make setup installs it with scikit-build-core's build requirements)"
    return exe


def test_trimmed_llama_cpp_tree_configures_with_cmake(tmp_path):
    """The vendored llama.cpp of the installed llama-cpp-python (qeval's cache; fetched as
    llama_tools does when missing), trimmed, configured as llama-cpp-python configures it (a
    subproject, shared libraries, the common library forced on) with the one-step build's
    flags and ``-DGGML_CUDA=OFF``: CMake succeeds, the three tools are targets, a dropped tool
    is not. The top-level file is llama-cpp-python's LLAMA_BUILD block in short (its sdist is
    not kept on this machine)."""
    t = _tool()
    from qeval.engines import llama_tools
    src = llama_tools.ensure_source()
    root = tmp_path / "llama_cpp_python"
    n = t.trim_tree(src, root / "vendor" / "llama.cpp")
    tree = root / "vendor" / "llama.cpp"
    assert n > 500
    for gone in ("models", "docs", "tests", "examples", "ggml/src/ggml-vulkan", "ggml/src/ggml-sycl", "tools/quantize"):
        assert (src / gone).exists() and not (tree / gone).exists(), gone
    for kept in ("CMakeLists.txt", "ggml/src/ggml-cuda/CMakeLists.txt", "ggml/src/ggml-cpu/CMakeLists.txt",
                 "tools/llama-bench/CMakeLists.txt", "tools/server/CMakeLists.txt", "tools/mtmd/CMakeLists.txt",
                 "scripts/ui-assets.cmake", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"):
        assert (tree / kept).exists(), kept
    (root / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(llama_cpp)\noption(LLAVA_BUILD \"\" ON)\n"
        "set(BUILD_SHARED_LIBS \"On\")\nset(LLAMA_BUILD_COMMON ON CACHE BOOL \"\" FORCE)\n"
        "set(LLAMA_CURL OFF CACHE BOOL \"\" FORCE)\nadd_subdirectory(vendor/llama.cpp)\n")
    build = tmp_path / "build"
    p = subprocess.run([_cmake(), "-S", str(root), "-B", str(build), *t.cuda_cmake_args(None, cpu_only=True)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "Ignoring extra path" not in p.stderr  # every flag reached CMake as a definition
    cache = (build / "CMakeCache.txt").read_text()
    assert "LLAMA_BUILD_TOOLS:BOOL=ON" in cache and "GGML_CUDA:BOOL=OFF" in cache
    made = {d.name for d in (build / "vendor" / "llama.cpp" / "tools").iterdir() if d.is_dir()}
    assert {"llama-bench", "batched-bench", "server", "mtmd"} <= made and "quantize" not in made and "cli" not in made


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_write_the_trimmed_sdist_and_a_phases_carry(tmp_path):
    def dry(*args):
        p = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return " ".join(p.stdout.replace("\\\n", " ").split())
    out = dry("llama-src", f"LLAMA_SRC={tmp_path / 'c'}", f"LLAMA_SDIST={tmp_path / 'llama_cpp_python-1.tar.gz'}")
    assert f"tools/llama_src_trim.py trim --dest {tmp_path / 'c'} --sdist {tmp_path / 'llama_cpp_python-1.tar.gz'}" in out
    out = dry("gpu-carry", "GPU_PHASE=gptq", "GPU_PYTHON=3.13", f"LLAMA_SRC={tmp_path / 'c'}")
    assert f"tools/llama_src_trim.py carry --phase gptq --dest {tmp_path / 'c'}/gptq --python-version 3.13" in out


def test_one_step_build_runs_pip_on_the_trimmed_tree_with_the_cuda_flags(tmp_path, monkeypatch):
    """build(): the trimmed sdist unpacked, ggml's CPU variants trimmed, pip install with
    CMAKE_ARGS and a kept CMake folder, then the tools placed; pip is faked (no CUDA here)."""
    t = _tool()
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    top = "llama_cpp_python-0.3.36/vendor/llama.cpp"
    variants = "".join(f"    ggml_add_cpu_backend_variant({v} AVX)\n" for v in ("x64", "haswell", "zen4", "icelake"))
    sd = write_tar(tmp_path / "llama_cpp_python-0.3.36.tar.gz", {f"{top}/CMakeLists.txt": b"",
                                                              f"{top}/ggml/src/CMakeLists.txt": variants.encode()})
    seen = {}

    def fake_run(cmd, env=None, stdout=None, stderr=None, **kw):
        if "-c" in cmd:  # place_tools asks qeval for the folder: the real call
            return real_run(cmd, env=env, stdout=stdout, stderr=stderr, **kw)
        seen.update(cmd=cmd, env=env)
        tree = Path(cmd[-1])
        seen["ggml"] = (tree / "vendor" / "llama.cpp" / "ggml" / "src" / "CMakeLists.txt").read_text()
        b = Path(next(c for c in cmd if c.startswith("build-dir="))[len("build-dir="):]) / "bin"
        b.mkdir(parents=True)
        for name in t.TOOL_BINARIES:
            (b / name).write_text("#!/bin/sh\n")
            (b / name).chmod(0o755)
        return subprocess.CompletedProcess(cmd, 0)
    real_run = subprocess.run
    monkeypatch.setattr(t.subprocess, "run", fake_run)
    r = t.build(sd, "90", tmp_path / "b", 16, variants="haswell")
    assert seen["cmd"][3:5] == ["install", "--force-reinstall"] and f"build-dir={tmp_path / 'b' / 'cmake'}" in seen["cmd"]
    assert seen["env"]["CMAKE_ARGS"] == " ".join(t.cuda_cmake_args("90")) and seen["env"]["CMAKE_BUILD_PARALLEL_LEVEL"] == "16"
    assert "# qeval: variant not built: ggml_add_cpu_backend_variant(zen4" in seen["ggml"]
    assert "\n    ggml_add_cpu_backend_variant(haswell AVX)" in seen["ggml"]
    from qeval.engines import llama_tools
    assert llama_tools.tool_path("llama-server", build=False) == Path(r["tools"]) / "llama-server"
    assert json.loads((Path(r["tools"]).parent / "build.json").read_text())["cmake_args"] == t.cuda_cmake_args("90")
