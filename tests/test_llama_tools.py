"""llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server) built from the
vendored source of the installed llama-cpp-python: flags, cache key, no build when cached."""
from __future__ import annotations

import pytest

from conftest import REPO


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
    from qeval.engines import llama_tools as lt
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", False))
    monkeypatch.setattr(lt, "llama_cpp_version", lambda: "0.0.0-test")
    with pytest.raises(ValueError, match="llama-bench, llama-batched-bench, llama-server"):
        lt.tool_path("llama-cli")
    with pytest.raises(FileNotFoundError, match="not built yet"):
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

