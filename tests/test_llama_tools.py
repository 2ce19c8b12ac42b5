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
    assert cpu and cpu.group(1).strip() == lt.PORTABLE_CMAKE_ARGS
    assert cuda and cuda.group(1).replace("$(CUDA_ARCHS)", "native") == lt.CUDA_CMAKE_ARGS
    monkeypatch.delenv(lt.CMAKE_ARGS_ENV, raising=False)
    a = lt.tools_dir("0.3.36")
    monkeypatch.setenv(lt.CMAKE_ARGS_ENV, "-DGGML_CUDA=on")
    b = lt.tools_dir("0.3.36")
    assert a != b and a.parent == b.parent == qeval_cache / "llama_tools" and a.name.startswith("0.3.36-")
    assert "-DGGML_CUDA=on" in lt.cmake_args() and "-DLLAMA_CURL=OFF" in lt.cmake_args()


def test_tool_path_checks_the_name_and_builds_only_when_asked(qeval_cache, monkeypatch):
    from qeval.engines import llama_tools as lt
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

