"""llama.cpp's CPU variant chosen at run time (qeval.engines.ggml_cpu) and the trimmed
variant build (qeval.engines.llama_build): the AMX grant, the choice on machines with and
without AVX-512 or AMX, the CMakeLists edit. The tiny-model runs in fresh processes are
in tests/test_llamacpp.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from qeval.engines import ggml_cpu as gc
from qeval.engines import llama_build as lb

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse4_2 avx f16c fma avx2 bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16
"""


def test_amx_is_granted_only_when_the_kernel_says_so():
    calls = []

    def ok(*a):
        calls.append(a)
        return 0
    assert gc.amx_granted(ok) is True
    assert calls == [(158, 0x1023, 18)]  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    assert gc.amx_granted(lambda *a: -1) is False  # EINVAL/EPERM: the CPU may list AMX all the same

    def boom(*a):
        raise OSError("no syscall")
    assert gc.amx_granted(boom) is False


def test_cpuinfo_flags_are_read_from_the_first_processor():
    fl = gc.cpu_flags(CPUINFO)
    assert "amx_tile" in fl and "avx512_bf16" in fl and "sse4_2" in fl
    assert gc.cpu_flags("no flags here") == frozenset()


def _cands(**scores):
    return [gc.Candidate(n, Path(f"/x/libggml-cpu-{n}.so"), s) for n, s in scores.items()]


def test_a_machine_listing_amx_without_the_grant_never_runs_the_amx_variant():
    # llama.cpp's CPUID score ranks sapphirerapids first on such a machine (it would load it)
    spr = gc.cpu_flags(CPUINFO)
    c = gc.judge(_cands(haswell=63, skylakex=191, icelake=1471, zen4=1983, sapphirerapids=4031), spr, amx_ok=False)
    best = gc.choose(c)
    assert best.name == "zen4"
    assert [x.name for x in c if x.excluded] == ["sapphirerapids"] and "not granted" in c[-1].excluded
    # granted: nothing is left out
    c = gc.judge(_cands(haswell=63, zen4=1983, sapphirerapids=4031), spr, amx_ok=True)
    assert gc.choose(c).name == "sapphirerapids" and not any(x.excluded for x in c)


def test_a_machine_without_avx512_runs_the_avx2_variant():
    haswell_flags = frozenset(gc.VARIANT_FLAGS["haswell"])
    # CPUID (the score) and the kernel's flags both count: a variant missing either stays out
    c = gc.judge(_cands(haswell=63, skylakex=0, zen4=1983), haswell_flags, amx_ok=False)
    assert gc.choose(c).name == "haswell"
    assert c[1].excluded.startswith("llama.cpp's CPUID score is 0")
    assert c[2].excluded.startswith("not in /proc/cpuinfo") and "avx512f" in c[2].excluded
    # none may run: nothing is chosen (load_backends raises then)
    assert gc.choose(gc.judge(_cands(zen4=0), haswell_flags, amx_ok=False)) is None
    assert gc.machine_variant(haswell_flags, False, gc.DEFAULT_VARIANTS) == "haswell"
    assert gc.machine_variant(gc.cpu_flags(CPUINFO), False, list(gc.VARIANT_FLAGS)) == "zen4"
    assert gc.machine_variant(gc.cpu_flags(CPUINFO), True, list(gc.VARIANT_FLAGS)) == "sapphirerapids"


def test_variant_tables_agree_with_ggml_and_name_cmake_options():
    assert gc.AMX_VARIANTS == ("sapphirerapids",)
    assert set(gc.DEFAULT_VARIANTS) <= set(gc.VARIANT_OPTIONS) and not set(gc.DEFAULT_VARIANTS) & set(gc.AMX_VARIANTS)
    args = gc.variant_cmake_args("skylakex")
    assert args[0] == "-DGGML_NATIVE=OFF" and "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_VNNI=OFF" in args


def test_variant_modules_are_found_beside_the_library(tmp_path):
    lib = tmp_path / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    binf = tmp_path / "bin"
    binf.mkdir()
    for n in ("libggml.so", "libggml-base.so", "libggml-cuda.so"):
        (lib / n).write_bytes(b"")
    (binf / "libggml-cpu-zen4.so").write_bytes(b"")
    (binf / "libggml-cpu-haswell.so").write_bytes(b"")
    dirs = gc.lib_dirs(tmp_path / "llama_cpp")
    assert [n for n, _ in gc.variant_modules(dirs)] == ["haswell", "zen4"]
    assert [p.name for p in gc.other_backend_modules(dirs)] == ["libggml-cuda.so"]


VENDORED = """    if (GGML_SYSTEM_ARCH STREQUAL "x86")
        ggml_add_cpu_backend_variant(x64)
        ggml_add_cpu_backend_variant(haswell            SSE42 AVX F16C FMA AVX2 BMI2)
        ggml_add_cpu_backend_variant(skylakex           SSE42 AVX F16C FMA AVX2 BMI2 AVX512)
        if (NOT MSVC)
            ggml_add_cpu_backend_variant(zen4           SSE42 AVX F16C FMA AVX2 BMI2 AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16)
        endif()
        if (NOT MSVC)
            ggml_add_cpu_backend_variant(sapphirerapids SSE42 AVX F16C FMA AVX2 BMI2 AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8)
        endif()
    elseif(GGML_SYSTEM_ARCH STREQUAL "ARM")
            ggml_add_cpu_backend_variant(armv8.0_1)
"""


def test_the_build_keeps_only_the_asked_variants():
    out = lb.trim_variants(VENDORED, ["haswell", "zen4"])
    live = [ln.split("(")[1].split()[0].rstrip(")") for ln in out.splitlines()
            if ln.strip().startswith("ggml_add_cpu_backend_variant(")]
    assert live == ["haswell", "zen4", "armv8.0_1"]  # other architectures untouched
    assert out.count("# qeval: variant not built:") == 3 and out.count("endif()") == 2
    assert lb.trim_variants(VENDORED, ["icelake"]) is None  # not in this layout: build them all
    # auto: the AVX2 baseline and this machine's best (AMX only where granted)
    spr = frozenset(gc.VARIANT_FLAGS["sapphirerapids"])
    assert lb.resolve_variants("auto", amx_ok=False, flags=spr) == ["haswell", "zen4"]
    assert lb.resolve_variants("auto", amx_ok=True, flags=spr) == ["haswell", "sapphirerapids"]
    assert lb.resolve_variants("auto", amx_ok=False, flags=frozenset(gc.VARIANT_FLAGS["haswell"])) == ["haswell"]
    # an x86 machine without AVX2 gets its own best beside the baseline (its x86 lines only
    # are trimmed: another architecture's variants are left as llama.cpp lists them)
    assert lb.resolve_variants("auto", amx_ok=False, flags=frozenset({"sse4_2"})) == ["haswell", "sse42"]
    assert lb.resolve_variants("all") is None and lb.resolve_variants("haswell, zen4") == ["haswell", "zen4"]
    with pytest.raises(ValueError, match="unknown CPU variant 'zen9'"):
        lb.resolve_variants("haswell,zen9")
