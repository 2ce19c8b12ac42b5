"""Every machine-dependent branch of qeval, run both ways on one machine (issue 65).

What qeval decides from the CPU (which llama.cpp CPU variants to build and run, whether AMX
is granted and whether its kernels trap, whether torch's bfloat16 is native or emulated,
which quality matmul path the stages take, what a row says) is read through
:mod:`qeval.engines.ggml_cpu`; the test-only named point ``QEVAL_TEST_CPU_KIND``
(:data:`~qeval.engines.ggml_cpu.CPU_KIND_ENV`) makes those reads answer as another kind of
machine, and ``QEVAL_TEST_EXTRA_CPU_VARIANTS`` adds fake variant modules (copies of the AVX2
module, tests/conftest.py ``fake_cpu_variants``). So each branch runs here whatever this CPU
is: an AVX2-only Zen 3, an AVX-512 EPYC, an AMX virtual machine whose AMX traps. No test
here needs a CPU feature, and none is skipped on any kind.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qeval.engines import bf16_matmul as bm
from qeval.engines import ggml_cpu as gc
from qeval.engines import llama_build as lb

KINDS = tuple(gc.CPU_KINDS)


@pytest.fixture()
def kind(request, monkeypatch):
    """Force the CPU kind ``request.param`` for the test (and the processes it starts)."""
    monkeypatch.setenv(gc.CPU_KIND_ENV, request.param)
    return request.param


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_a_forced_kind_is_what_every_feature_read_answers(kind):
    k = gc.CPU_KINDS[kind]
    assert gc.cpu_flags() == k.flags and gc.amx_granted() is k.amx_granted
    assert gc.machine_kind() == kind
    # what the flags of the kind imply, read back through the same functions
    want_kind = "amx" if kind.startswith("amx") else kind
    assert gc.machine_kind(k.flags, k.amx_granted) == want_kind
    assert gc.cpu_flags("flags : avx2 fma") == frozenset({"avx2", "fma"})  # given text is read, not faked


def test_an_unknown_forced_kind_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(gc.CPU_KIND_ENV, "zen9")
    with pytest.raises(ValueError, match="QEVAL_TEST_CPU_KIND='zen9': expected one of avx2, avx512"):
        gc.cpu_flags()


@pytest.mark.parametrize("kind, built", [
    ("avx2", ["haswell"]),
    ("avx512", ["haswell", "icelake"]),
    ("avx512-bf16", ["haswell", "zen4"]),
    # AMX listed: its best AVX-512 variant without AMX too, the fallback when AMX traps
    ("amx", ["haswell", "sapphirerapids", "zen4"]),
    ("amx-trap", ["haswell", "sapphirerapids", "zen4"]),
], indirect=["kind"])
def test_make_setup_builds_the_baseline_and_the_kinds_best(kind, built):
    assert lb.resolve_variants("auto") == built


@pytest.mark.parametrize("kind, fast, native", [
    ("avx2", False, False), ("avx512", True, False), ("avx512-bf16", True, True), ("amx", True, True),
    ("amx-trap", True, True)], indirect=["kind"])
def test_bfloat16_is_fast_or_slow_native_or_emulated_by_kind(kind, fast, native):
    """oneDNN's bfloat16 path (fast: AVX-512 core) decides the quality stages' matmuls;
    native bfloat16 instructions (AVX512_BF16, AMX-BF16) decide what a row says."""
    assert bm.cpu_has_fast_bf16() is fast
    assert bm.resolve_bf16_matmul("auto", "cpu", "bfloat16") == ("native" if fast else "float32")
    assert bm.resolve_bf16_matmul("auto", "cuda", "bfloat16") == "native"
    note = gc.torch_bf16_note("bfloat16", "cpu")
    assert (note is None) is native
    if not native:
        assert note == "emulated on this CPU: no AVX512_BF16"
    assert gc.torch_bf16_note("bfloat16", "cuda") is None and gc.torch_bf16_note("float32", "cpu") is None
    assert gc.torch_bf16_note("float16", "cpu") == "emulated on this CPU: no AVX512_FP16"  # no kind lists it


def _real() -> tuple[frozenset[str], bool]:
    """This machine's own flags and AMX grant, whatever kind is forced."""
    return gc.cpu_flags(Path("/proc/cpuinfo").read_text()), gc.amx_granted(gc._libc_syscall)


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_the_probe_chooses_per_kind_and_passes_over_a_trapping_amx_variant(kind, tmp_path, monkeypatch):
    """The real probe (child processes, the installed build) under each forced kind, with a
    fake ``sapphirerapids`` (a copy of the AVX2 module, ranked best; it shadows a real one):
    where AMX is listed and granted it runs, or, on the kind whose AMX traps, is passed over
    for its SIGILL and the kind's best variant without AMX runs; elsewhere it is left out
    for the flags it lacks. One code path per branch, each taken here."""
    import llama_cpp
    for k, v in __import__("conftest").fake_cpu_variants(tmp_path / "variants", {"sapphirerapids": "best"}).items():
        monkeypatch.setenv(k, v)
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"))
    for k in ("QEVAL_LLAMA_CPU_VARIANT", gc.PROBE_FAULT_ENV):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(Path(gc.__file__)), "--choose"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    k = gc.CPU_KINDS[kind]
    here = Path(llama_cpp.__file__).resolve().parent
    # the build's own variants that this machine really runs (a forced kind never makes a
    # variant run that the CPU cannot: the probe would pass it over)
    flags, amx = _real()
    own = [n for n, _ in gc.variant_modules(gc.lib_dirs(here)[1:]) if n != "sapphirerapids"
           and set(gc.VARIANT_FLAGS.get(n, ())) <= flags and n not in gc.AMX_VARIANTS]
    if kind == "amx":
        assert lines == ["sapphirerapids"]
        return
    best = gc.machine_variant(k.flags, False, own)
    assert lines[0] == best, (lines, own)
    if kind == "amx-trap":
        assert "  passed over sapphirerapids: SIGILL (illegal instruction) in the probe" in lines
    else:
        # not in the kind's flags: left out before any probe, and the line says why
        over = [ln for ln in lines if ln.startswith("  passed over sapphirerapids: ")]
        assert len(over) == 1 and "not in /proc/cpuinfo:" in over[0] and "amx_tile" in over[0], lines


def test_the_forced_kinds_cover_every_branch():
    """Each branch the kinds exist for is taken by one of them: AVX2 only, AVX-512 without
    and with native BF16, AMX granted and working, AMX granted and trapping."""
    ks = gc.CPU_KINDS.values()
    assert any("avx512f" not in k.flags for k in ks)
    assert any("avx512f" in k.flags and not gc.bf16_native_flags(k.flags) for k in ks)
    assert any(gc.bf16_native_flags(k.flags) and not k.amx_granted for k in ks)
    assert any(k.amx_granted and not k.amx_traps for k in ks) and any(k.amx_traps for k in ks)
