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
    # AMX granted: the AMX variant and, beside it, the best AVX-512 one without AMX (the
    # fallback when the probe finds the AMX kernels trap: AVX-512 kept, not AVX2)
    assert lb.resolve_variants("auto", amx_ok=True, flags=spr) == ["haswell", "sapphirerapids", "zen4"]
    icx_amx = frozenset(gc.VARIANT_FLAGS["icelake"]) | {"amx_tile", "amx_int8", "amx_bf16"}
    assert lb.resolve_variants("auto", amx_ok=True, flags=icx_amx) == ["haswell", "icelake"]  # no SPR variant fits
    assert lb.resolve_variants("auto", amx_ok=False, flags=frozenset(gc.VARIANT_FLAGS["haswell"])) == ["haswell"]
    # an x86 machine without AVX2 gets its own best beside the baseline (its x86 lines only
    # are trimmed: another architecture's variants are left as llama.cpp lists them)
    assert lb.resolve_variants("auto", amx_ok=False, flags=frozenset({"sse4_2"})) == ["haswell", "sse42"]
    assert lb.resolve_variants("all") is None and lb.resolve_variants("haswell, zen4") == ["haswell", "zen4"]
    with pytest.raises(ValueError, match="unknown CPU variant 'zen9'"):
        lb.resolve_variants("haswell,zen9")


def _probe_log(verdicts: dict[str, dict]):
    calls = []

    def probe(_dir, variant):
        calls.append(variant)
        return dict(verdicts[variant], variant=variant)
    return probe, calls


SIGILL = {"ok": False, "reason": "SIGILL (illegal instruction) in the probe", "seconds": 0.1}
RAN = {"ok": True, "reason": None, "seconds": 0.1}


def test_a_variant_that_traps_in_its_probe_is_passed_over_and_the_verdicts_are_cached(tmp_path, monkeypatch):
    """A machine that lists and grants AMX whose AMX kernels die with SIGILL: the probe runs
    the best variant first, passes over the one that trapped, stops at the first that runs
    (the AVX-512 fallback, not AVX2), and a second process reads the verdicts instead of probing."""
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    spr = gc.cpu_flags(CPUINFO)
    probe, calls = _probe_log({"sapphirerapids": SIGILL, "zen4": RAN, "haswell": RAN})
    cands = gc.judge(_cands(haswell=63, zen4=1983, sapphirerapids=4031), spr, amx_ok=True)
    out = gc.run_probes(tmp_path, cands, spr, True, probe=probe)
    assert calls == ["sapphirerapids", "zen4"]  # best first; haswell never needed
    assert gc.choose(cands).name == "zen4"
    assert [c.excluded for c in cands if c.name == "sapphirerapids"] == ["SIGILL (illegal instruction) in the probe"]
    assert [v["cached"] for v in out] == [False, False]
    sel = gc.Selection(variant="zen4", candidates=[{"variant": c.name, "score": c.score, "excluded": c.excluded}
                                                   for c in cands])
    assert sel.passed_over() == ["sapphirerapids: SIGILL (illegal instruction) in the probe"]
    files = list((tmp_path / "cache" / "llama_cpu_probe").glob("*.json"))
    assert len(files) == 1
    # the same machine and build again: nothing probed, the same choice
    probe2, calls2 = _probe_log({})
    cands2 = gc.judge(_cands(haswell=63, zen4=1983, sapphirerapids=4031), spr, amx_ok=True)
    out2 = gc.run_probes(tmp_path, cands2, spr, True, probe=probe2)
    assert calls2 == [] and gc.choose(cands2).name == "zen4" and all(v["cached"] for v in out2)
    # another build (a module changed): the key changes and the probe runs again
    assert gc.probe_key(spr, True, [("zen4", files[0])]) != gc.probe_key(spr, True, [("zen4", tmp_path)])


def test_a_probe_that_cannot_be_made_decides_nothing_and_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    flags = frozenset(gc.VARIANT_FLAGS["zen4"])
    probe, calls = _probe_log({"zen4": {"ok": None, "reason": "not probed: no gguf", "seconds": 0}})
    cands = gc.judge(_cands(haswell=63, zen4=1983), flags, amx_ok=False)
    gc.run_probes(tmp_path, cands, flags, False, probe=probe)
    assert calls == ["zen4"] and gc.choose(cands).name == "zen4"  # judged by the flags alone
    assert not list((tmp_path / "cache" / "llama_cpu_probe").glob("*.json"))


def test_a_stage_killed_by_a_signal_names_it_the_variant_and_the_fix(tmp_path):
    from qeval.failures import LLAMA_CPU_MARK, signal_reason, signal_text
    log = tmp_path / "quality.log"
    log.write_text(f"--- first attempt\n{LLAMA_CPU_MARK}haswell (x)\n--- second attempt\n"
                   f"{LLAMA_CPU_MARK}sapphirerapids (/lib/libggml-cpu-sapphirerapids.so)\nfidelity: sequence 1/11\n")
    text = signal_reason(-4, "quality", log)
    assert text.startswith("quality process killed by SIGILL (illegal instruction) in llama.cpp's CPU backend "
                           "sapphirerapids: ")
    assert "QEVAL_LLAMA_CPU_VARIANT" in text and "llama_cpu_probe" in text
    log.write_text("--- only\nnothing of llama.cpp\n")
    plain = signal_reason(-4, "measure", log)
    assert plain.startswith("measure process killed by SIGILL (illegal instruction): ") and "llama.cpp" not in plain
    assert signal_reason(-9, "load", None).startswith("load process killed by SIGKILL (killed): ")
    assert signal_text(1) == "exit 1" and signal_text(-11) == "SIGSEGV (segmentation fault)"


def _installed_variants():
    import llama_cpp
    here = Path(llama_cpp.__file__).resolve().parent
    mods = gc.variant_modules(gc.lib_dirs(here))
    flags, amx = gc.cpu_flags(), gc.amx_granted()
    cands = gc.judge([gc.Candidate(n, p, gc._score(p)) for n, p in mods], flags, amx)
    return sorted((c for c in cands if c.excluded is None), key=lambda c: -c.score)


def test_the_real_probe_runs_each_variant_in_a_child_and_a_trapping_one_is_passed_over(tmp_path, monkeypatch):
    """The installed build, probed for real in child processes, with a fake best variant (a
    copy of the AVX2 module ranked above the build's, tests/conftest.py fake_cpu_variants:
    so there are two runnable variants on every machine kind, an AVX2-only one included)
    whose probe child is killed by SIGILL at its named point (QEVAL_TEST_PROBE_SIGNAL): the
    next variant is chosen and the first one is passed over with the signal as the reason.
    Without the fault the fake best runs (the probe is no false alarm): its code is the AVX2
    module, which every machine of this project runs, so this holds on an AMX virtual machine
    whose own AMX variant traps too."""
    import os
    import subprocess
    import sys

    from conftest import fake_cpu_variants
    for k, v in fake_cpu_variants(tmp_path / "variants", {"fake": "best"}).items():
        monkeypatch.setenv(k, v)
    ok = _installed_variants()
    assert len(ok) >= 2 and ok[0].name == "fake", [c.name for c in ok]
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_TEST_PROBE_SIGNAL="fake")
    env.pop("QEVAL_LLAMA_CPU_VARIANT", None)
    p = subprocess.run([sys.executable, str(Path(gc.__file__)), "--choose"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == ok[1].name
    assert "  passed over fake: SIGILL (illegal instruction) in the probe" in lines
    env2 = dict(env, QEVAL_CACHE=str(tmp_path / "cache2"))
    env2.pop("QEVAL_TEST_PROBE_SIGNAL")
    p2 = subprocess.run([sys.executable, str(Path(gc.__file__)), "--choose"], capture_output=True, text=True,
                        env=env2, timeout=600)
    assert p2.returncode == 0 and p2.stdout.splitlines() == ["fake"], p2.stderr[-2000:]


def test_a_build_whose_only_runnable_variant_traps_is_refused_naming_the_signal(tmp_path):
    """Forced to an AVX2-only machine (QEVAL_TEST_CPU_KIND=avx2: only ``haswell`` may run, on
    every kind), with haswell's probe killed by SIGILL: nothing is left, and the error names
    the signal instead of loading a variant that traps."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_TEST_PROBE_SIGNAL="haswell",
               QEVAL_TEST_CPU_KIND="avx2")
    for k in ("QEVAL_LLAMA_CPU_VARIANT", gc.EXTRA_VARIANTS_ENV):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(Path(gc.__file__)), "--choose"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode != 0 and "haswell: SIGILL (illegal instruction) in the probe" in p.stderr, p.stderr[-2000:]
