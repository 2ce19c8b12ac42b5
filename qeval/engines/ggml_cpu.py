"""llama.cpp's CPU kernels: which variant of ggml's CPU backend runs, chosen at run time.

The Makefile builds llama-cpp-python as llama.cpp's release builds are made
(``GGML_BACKEND_DL=ON`` with ``GGML_CPU_ALL_VARIANTS=ON``, trimmed to the AVX2 baseline
and the best variant of the build machine, see :mod:`qeval.engines.llama_build`): ggml's CPU backend is
one module per instruction-set variant (``libggml-cpu-haswell.so``,
``libggml-cpu-zen4.so``, ...) and the process loads one of them. llama.cpp's own loader
(``ggml_backend_load_all`` -> ``ggml_backend_load_best`` in ``ggml-backend-reg.cpp``)
picks the variant whose ``ggml_backend_score()`` is highest, and that score reads CPUID
only ("FIXME: this does not check for OS support" in ``ggml-cpu/arch/x86/cpu-feats.cpp``):
on a virtual machine that lists AMX without granting the tile state it would pick the
AMX variant, whose kernels die with SIGILL at the first ``tileloadd``. So qeval loads the
CPU variant itself (:func:`load_backends`, before ``llama_backend_init``, which then finds
a backend registered and skips ``ggml_backend_load_all``), with llama.cpp's own score
(the variant module's ``ggml_backend_score``) and two checks of what the kernel allows:

* every instruction set the variant was compiled for (:data:`VARIANT_FLAGS`, the table of
  ``ggml/src/CMakeLists.txt``) is listed in ``/proc/cpuinfo`` (the kernel's view: it
  clears the flags of state it does not enable), and
* a variant with AMX runs only when ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
  succeeds (:func:`amx_granted`; Linux's documented way to ask for the AMX tile data
  state, Documentation/arch/x86/xstate.rst; ggml's ``ggml_amx_init`` asks the same but
  too late: a variant's AMX matmul kernels run regardless).

Both checks are necessary and not sufficient: a virtual machine can list AMX, grant it
through ``arch_prctl`` and still trap its first ``tileloadd`` with SIGILL. So the
variants that pass them are then *run*: best first, each in a child process, a probe
(:func:`probe_variant`: the variant loaded alone, a tiny Q4_K_M model with a ``q8_0`` KV
cache and flash attention, one 32-token prefill and four decode steps, the kernels the
GGUF tiers use) must exit cleanly; the first that does is chosen, and the ones passed over
say why (``zen4: SIGILL in the probe``). The verdicts are cached per machine in
``$QEVAL_CACHE/llama_cpu_probe/<key>.json`` (key: the cpuinfo flags, the AMX grant and
the variant modules' sizes and times: the library build), so one machine probes once.

Nothing else is excluded. A build without variant modules (llama-cpp-python built the
old way, ``GGML_BACKEND_DL=OFF``) has its CPU backend linked in: nothing is selected and
the record says ``built-in``.

Only the standard library is imported here (ctypes): the Makefile runs this file by
path (``python qeval/engines/ggml_cpu.py --amx-granted``) before qeval's dependencies
are installed.
"""
from __future__ import annotations

import ctypes
import _ctypes  # dlclose: ctypes has no public unload
import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

# x86-64 Linux: arch/x86/include/uapi/asm/prctl.h and asm/unistd_64.h
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

# ggml's x86 CPU variants (ggml/src/CMakeLists.txt, GGML_CPU_ALL_VARIANTS): the ggml
# options (GGML_<name>=ON) each is compiled with, in ggml's own table order.
VARIANT_OPTIONS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                       "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}
# The /proc/cpuinfo flags of each ggml option. GGML_AVX512 is AVX512 F, CD, VL, DQ and BW
# together (-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw in ggml-cpu/CMakeLists.txt).
OPTION_FLAGS: dict[str, tuple[str, ...]] = {
    "SSE42": ("sse4_2",), "AVX": ("avx",), "F16C": ("f16c",), "FMA": ("fma",), "AVX2": ("avx2",),
    "BMI2": ("bmi2",), "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",), "AVX512_VNNI": ("avx512_vnni",), "AVX512_BF16": ("avx512_bf16",),
    "AMX_TILE": ("amx_tile",), "AMX_INT8": ("amx_int8",), "AMX_BF16": ("amx_bf16",),
}
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    v: tuple(f for o in opts for f in OPTION_FLAGS[o]) for v, opts in VARIANT_OPTIONS.items()}
"""cpuinfo flags each variant's instructions need."""
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")

# The AVX2 baseline (what the portable build ran everywhere) and the AVX-512 families of
# the x86-64 servers this project meets (Skylake-SP/Cascade Lake, Ice Lake, Zen 4/5):
# `LLAMA_CPU_VARIANTS=haswell,skylakex,icelake,zen4` builds a wheel for all of them; `auto`
# builds haswell and the build machine's best (llama_build.resolve_variants); `all` ggml's 14.
DEFAULT_VARIANTS = ("haswell", "skylakex", "icelake", "zen4")
AMX_VARIANTS = tuple(v for v, f in VARIANT_FLAGS.items() if "amx_int8" in f)

# instruction-set names among the features ggml's CPU backend reports (ggml_backend_get_features)
ISA_FEATURES = ("SSE3", "SSSE3", "AVX", "AVX_VNNI", "AVX2", "F16C", "FMA", "BMI2", "AVX512", "AVX512_VBMI",
                "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "NEON", "ARM_FMA", "FP16_VA", "MATMUL_INT8", "SVE",
                "DOTPROD", "SME", "SME2", "RISCV_V", "VSX", "VXE", "WASM_SIMD")

_PREFIX, _SUFFIX = "libggml-cpu-", ".so"


def _libc_syscall(*args: int) -> int:
    """``syscall(2)`` through libc; returns its result (-1 on error)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(*[ctypes.c_long(a) for a in args]))


def amx_granted(syscall: Callable[..., int] | None = None) -> bool:
    """Whether this process may execute AMX tile instructions: the kernel grants the AMX
    tile data state on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
    returns 0). A CPU flag alone (``amx_tile`` in /proc/cpuinfo) is not enough: a virtual
    machine can list it and refuse the state, and then ``tileloadd`` raises SIGILL.

    Args:
        syscall: ``syscall(number, *args) -> int`` (tests inject the result); default libc's,
            or the grant of the forced CPU kind (:data:`CPU_KIND_ENV`) when one is set.

    Returns:
        False on anything but x86-64 Linux, or when the request fails.
    """
    if syscall is None:
        kind = forced_kind()
        if kind is not None:
            return CPU_KINDS[kind].amx_granted
        if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
            return False
        syscall = _libc_syscall
    try:
        return syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (or in ``text``); empty
    where there is no such file (not Linux). With a forced CPU kind (:data:`CPU_KIND_ENV`)
    and no ``text``, that kind's flags."""
    if text is None:
        kind = forced_kind()
        if kind is not None:
            return CPU_KINDS[kind].flags
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return frozenset(m.group(1).split()) if m else frozenset()


# ---- CPU kinds: what a machine has, and the kinds a test may force ---------------------------

#: Test-only named point: ``QEVAL_TEST_CPU_KIND=<kind>`` (a key of :data:`CPU_KINDS`) makes
#: every CPU-feature probe of qeval (:func:`cpu_flags`, :func:`amx_granted`, the variant probe,
#: :func:`torch_bf16_native`, :func:`qeval.engines.bf16_matmul.cpu_has_fast_bf16`) answer as
#: that kind of machine would, so the suite's machine-dependent branches run on any machine.
#: It changes what qeval *decides*, never what the CPU executes: a variant the machine cannot
#: run is still caught by the probe (it runs in a child), and only variants that were built
#: are candidates.
CPU_KIND_ENV = "QEVAL_TEST_CPU_KIND"

_BASE_FLAGS = ("fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "f16c", "fma", "bmi1", "bmi2",
               "avx2", "movbe")
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni")


@dataclass(frozen=True)
class CpuKind:
    """A kind of x86-64 machine this project meets: its cpuinfo ``flags``, whether the kernel
    grants AMX (``amx_granted``), whether AMX kernels trap although granted (``amx_traps``: a
    virtual machine that lists AMX, grants it and kills ``tileloadd`` with SIGILL) and a
    ``label`` for rows and the README."""
    label: str
    flags: frozenset[str]
    amx_granted: bool = False
    amx_traps: bool = False


CPU_KINDS: dict[str, CpuKind] = {
    "avx2": CpuKind("AVX2 only (no AVX-512, no AVX512_BF16, no AMX; e.g. Zen 3)", frozenset(_BASE_FLAGS)),
    "avx512": CpuKind("AVX-512 without AVX512_BF16 (e.g. Ice Lake)", frozenset(_BASE_FLAGS + _AVX512)),
    "avx512-bf16": CpuKind("AVX-512 with AVX512_BF16, no AMX (e.g. Zen 4)",
                           frozenset(_BASE_FLAGS + _AVX512 + ("avx512_bf16",))),
    "amx": CpuKind("AVX-512 and AMX, granted and working (e.g. Sapphire Rapids)",
                   frozenset(_BASE_FLAGS + _AVX512 + ("avx512_bf16",) + AMX_FLAGS), amx_granted=True),
    "amx-trap": CpuKind("AVX-512 and AMX listed and granted, AMX kernels trap (SIGILL; a virtual machine)",
                        frozenset(_BASE_FLAGS + _AVX512 + ("avx512_bf16",) + AMX_FLAGS), amx_granted=True,
                        amx_traps=True),
}
"""The kinds :data:`CPU_KIND_ENV` may force (and the README's per-kind rows)."""


def forced_kind() -> str | None:
    """The CPU kind forced by :data:`CPU_KIND_ENV` (tests only), None when unset.

    Raises:
        ValueError: the variable names no kind of :data:`CPU_KINDS`.
    """
    kind = os.environ.get(CPU_KIND_ENV, "").strip()
    if not kind:
        return None
    if kind not in CPU_KINDS:
        raise ValueError(f"{CPU_KIND_ENV}={kind!r}: expected one of {', '.join(CPU_KINDS)}")
    return kind


def machine_kind(flags: Iterable[str] | None = None, amx_ok: bool | None = None) -> str:
    """The :data:`CPU_KINDS` key that best describes a machine with ``flags`` and the AMX
    grant ``amx_ok`` (default: this machine, or the forced kind): ``amx`` where AMX is
    listed and granted (whether its kernels trap is known only by running them: the probe),
    ``avx512-bf16``, ``avx512`` (AVX-512 F), else ``avx2``."""
    kind = forced_kind()
    if kind is not None and flags is None and amx_ok is None:
        return kind
    fl = set(cpu_flags() if flags is None else flags)
    ok = amx_granted() if amx_ok is None else amx_ok
    if ok and "amx_tile" in fl:
        return "amx"
    if "avx512f" in fl:
        return "avx512-bf16" if "avx512_bf16" in fl else "avx512"
    return "avx2"


def bf16_native_flags(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The instruction sets among ``flags`` (default :func:`cpu_flags`) that compute bfloat16
    natively on the CPU: ``avx512_bf16`` (VDPBF16PS) and ``amx_bf16`` (TDPBF16PS). Empty: a
    bfloat16 matmul is emulated (widened to float32 in software, or torch's reference GEMM)."""
    fl = set(cpu_flags() if flags is None else flags)
    return tuple(f for f in ("avx512_bf16", "amx_bf16") if f in fl)


def torch_bf16_note(dtype: str, device: str = "cpu", flags: Iterable[str] | None = None) -> str | None:
    """What a row says of a tier that torch computes in ``dtype`` on ``device`` when this
    CPU has no native instructions for it: ``"emulated on this CPU: no AVX512_BF16"`` for
    bfloat16 without :func:`bf16_native_flags`, ``"emulated on this CPU: no AVX512_FP16"``
    for float16 without ``avx512_fp16`` (AMX-FP16 needs AMX too); None where the CPU has
    them, on a GPU, and for other dtypes. Source of the rule: oneDNN's CPU ISA table
    (``avx512_core_bf16`` for bf16 dot products; ``avx512_core_fp16``) and torch's
    ``mkldnn_bf16_supported`` / ``mkldnn_fp16_supported`` checks."""
    if device != "cpu":
        return None
    fl = set(cpu_flags() if flags is None else flags)
    if dtype in ("bfloat16", "bf16") and not bf16_native_flags(fl):
        return "emulated on this CPU: no AVX512_BF16"
    if dtype in ("float16", "fp16") and "avx512_fp16" not in fl:
        return "emulated on this CPU: no AVX512_FP16"
    return None


def variant_cmake_args(variant: str) -> list[str]:
    """CMake options of a static (non-DL) ggml build with the instruction sets of
    ``variant``: ``-DGGML_NATIVE=OFF`` and every x86 option of ggml set ON or OFF.

    Raises:
        KeyError: not one of :data:`VARIANT_OPTIONS`.
    """
    on = set(VARIANT_OPTIONS[variant])
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{o}={'ON' if o in on else 'OFF'}" for o in OPTION_FLAGS]


def machine_variant(flags: Iterable[str], amx_ok: bool, built: Iterable[str] = tuple(VARIANT_FLAGS)) -> str | None:
    """The best variant among ``built`` that a machine with ``flags`` (cpuinfo names) may
    run: all its instruction sets listed, AMX only when ``amx_ok``; best = the most
    instruction sets, as ggml's score (every feature adds to it). None when none fits."""
    fl = set(flags)
    ok = [v for v in built if v in VARIANT_FLAGS and set(VARIANT_FLAGS[v]) <= fl
          and (amx_ok or not set(VARIANT_FLAGS[v]) & set(AMX_FLAGS))]
    return max(ok, key=lambda v: len(VARIANT_FLAGS[v]), default=None)


@dataclass
class Candidate:
    """One CPU variant module: ``name`` (``zen4``), ``path``, llama.cpp's ``score``
    (0: CPUID lacks an instruction set), and why qeval leaves it out (None: it may run)."""
    name: str
    path: Path
    score: int
    excluded: str | None = None


def judge(cands: list[Candidate], flags: frozenset[str], amx_ok: bool) -> list[Candidate]:
    """Mark which candidates may not run (``excluded``): score 0 (llama.cpp's CPUID check),
    an instruction set missing from the kernel's cpuinfo flags, or AMX not granted.
    Unknown variant names are judged by their score alone."""
    for c in cands:
        need = set(VARIANT_FLAGS.get(c.name, ()))
        if c.score <= 0:
            c.excluded = "llama.cpp's CPUID score is 0"
        elif flags and need - flags:
            c.excluded = "not in /proc/cpuinfo: " + " ".join(sorted(need - flags))
        elif (need & set(AMX_FLAGS) or c.name in AMX_VARIANTS) and not amx_ok:
            c.excluded = "AMX listed but not granted by the kernel (arch_prctl ARCH_REQ_XCOMP_PERM failed)"
    return cands


def choose(cands: list[Candidate]) -> Candidate | None:
    """The allowed candidate with llama.cpp's highest score (ties: the first by name)."""
    ok = sorted((c for c in cands if c.excluded is None), key=lambda c: c.name)
    return max(ok, key=lambda c: c.score, default=None)


def variant_modules(lib_dirs: Iterable[Path]) -> list[tuple[str, Path]]:
    """``(variant, path)`` of every ``libggml-cpu-<variant>.so`` in ``lib_dirs`` (the first
    folder holding a name wins)."""
    out: dict[str, Path] = {}
    for d in lib_dirs:
        if d.is_dir():
            for p in sorted(d.iterdir()):
                n = p.name
                if n.startswith(_PREFIX) and n.endswith(_SUFFIX) and p.is_file():
                    out.setdefault(n[len(_PREFIX):-len(_SUFFIX)], p)
    return sorted(out.items())


def other_backend_modules(lib_dirs: Iterable[Path]) -> list[Path]:
    """Backend modules other than the CPU ones (``libggml-cuda.so``, ...): a
    ``GGML_BACKEND_DL`` build's GPU backends, loaded as ``ggml_backend_load_all`` would."""
    skip = {"libggml.so", "libggml-base.so", "libggml-cpu.so"}
    out: dict[str, Path] = {}
    for d in lib_dirs:
        if d.is_dir():
            for p in sorted(d.glob("libggml-*.so")):
                if p.name not in skip and not p.name.startswith(_PREFIX) and p.is_file():
                    out.setdefault(p.name, p)
    return list(out.values())


def _score(path: Path) -> int:
    """llama.cpp's ``ggml_backend_score()`` of a variant module (dlopen runs none of its
    kernels: the score lives in the ``-feats`` object built without the variant's flags).
    A module in the test-only :data:`EXTRA_VARIANTS_ENV` folder with a ``<module>.score``
    file beside it scores that file's integer instead (a fake variant ranked where the test
    needs it)."""
    extra = os.environ.get(EXTRA_VARIANTS_ENV, "").strip()
    fake = Path(str(path) + ".score")
    if extra and Path(path).parent == Path(extra) and fake.is_file():
        return int(fake.read_text().strip())
    lib = ctypes.CDLL(str(path))
    try:
        fn = getattr(lib, "ggml_backend_score", None)
        if fn is None:
            return 0
        fn.restype = ctypes.c_int
        return int(fn())
    finally:  # unloaded again (as ggml_backend_load_best does); the chosen one is loaded by ggml
        _ctypes.dlclose(lib._handle)


def _libggml_path(lib_dir: Path) -> Path:
    """The ``libggml`` file llama.cpp's ``libllama`` runs with. The wheel holds copies, not
    links (``libggml.so``, ``libggml.so.0``, ...): a copy opened by another name would be a
    second library with a registry of its own, so take the one already mapped into this
    process (``libllama``'s ``DT_NEEDED`` ``libggml.so.0``), else that name."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            f = Path(line.split(None, 5)[-1]) if line.count(" ") >= 5 else None
            if f is not None and f.parent == lib_dir and f.name.startswith("libggml.so"):
                return f
    except OSError:
        pass
    for name in ("libggml.so.0", "libggml.so"):
        if (lib_dir / name).exists():
            return lib_dir / name
    return lib_dir / "libggml.so"


def _ggml(lib_dir: Path) -> Any:
    lib = ctypes.CDLL(str(_libggml_path(lib_dir.resolve())))
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_reg_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    return lib


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


def _features(ggml: Any, reg: int) -> dict[str, str]:
    """``ggml_backend_get_features`` of a backend (name -> value), {} when it has none."""
    addr = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not addr:
        return {}
    fn = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(addr)
    arr = fn(reg)
    out: dict[str, str] = {}
    i = 0
    while arr and arr[i].name:
        out[arr[i].name.decode()] = (arr[i].value or b"").decode()
        i += 1
    return out


# ---- the probe: a variant is chosen by running it -----------------------------------------

PROBE_VERSION = 1
"""Part of the probe cache key: bump when the probe runs other kernels."""
PROBE_TIMEOUT_S = 120.0
#: Test fault at a named point (never set in normal use): ``VARIANT[:SIGNAL]`` makes the probe
#: child of that variant kill itself with SIGNAL (default SIGILL) right after the variant is
#: loaded, as an AMX kernel on a virtual machine that lists AMX but cannot run it does.
PROBE_FAULT_ENV = "QEVAL_TEST_PROBE_SIGNAL"
#: Test-only named point: a folder of extra ``libggml-cpu-<variant>.so`` modules (e.g. a copy
#: of the AVX2 ``haswell`` module named ``x64``) searched before the build's own, so a test
#: has two variants that run on any machine, an AVX2-only one included (tests/conftest.py
#: ``second_variant``).
EXTRA_VARIANTS_ENV = "QEVAL_TEST_EXTRA_CPU_VARIANTS"
#: ``0`` turns the probe off (the choice is then by cpuinfo and the AMX grant alone).
PROBE_ENV = "QEVAL_LLAMA_CPU_PROBE"
#: A variant name: run that one and no other (the user's way out when a variant traps).
VARIANT_ENV = "QEVAL_LLAMA_CPU_VARIANT"


def signal_text(rc: int) -> str:
    """:func:`qeval.failures.signal_text` (``SIGILL (illegal instruction)`` for ``-4``);
    where qeval is not importable (this file run by path before it is installed), the
    signal's name alone."""
    try:
        from qeval.failures import signal_text as text  # optional: absent when run by path before install
    except ImportError:
        try:
            return signal.Signals(-rc).name if rc < 0 else f"exit {rc}"
        except ValueError:
            return f"signal {-rc}"
    return text(rc)


def _cache_root() -> Path:
    """``$QEVAL_CACHE`` or ``~/.cache/qeval`` (as :func:`qeval.paths.cache_root`; this module
    imports the standard library only)."""
    env = os.environ.get("QEVAL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qeval"


def probe_key(flags: Iterable[str], amx_ok: bool, mods: Iterable[tuple[str, Path]]) -> str:
    """Cache key of a machine's probe verdicts: sha256 over the cpuinfo flags, the AMX grant,
    every variant module's name, size and modification time (the library build) and
    :data:`PROBE_VERSION`; 16 hex digits."""
    def stat(p: Path) -> list:
        try:
            st = p.stat()
            return [st.st_size, st.st_mtime_ns]
        except OSError:
            return [None, None]
    src = json.dumps([sorted(flags), bool(amx_ok), [[n, *stat(Path(p))] for n, p in mods], PROBE_VERSION]
                     + ([forced_kind()] if forced_kind() else []))  # a forced kind's verdicts apart
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def probe_cache_file(key: str) -> Path:
    """``$QEVAL_CACHE/llama_cpu_probe/<key>.json``."""
    return _cache_root() / "llama_cpu_probe" / f"{key}.json"


def _read_verdicts(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
        return {str(k): dict(v) for k, v in data.get("verdicts", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _write_verdicts(path: Path, verdicts: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"verdicts": verdicts, "machine": platform.node(), "probe_version": PROBE_VERSION},
                              indent=1) + "\n")
    os.replace(tmp, path)


def probe_variant(llama_cpp_dir: Path, variant: str, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Run ``variant`` in a child process (``python ggml_cpu.py --probe VARIANT DIR``:
    :func:`_probe_child`) and say whether it ran.

    Returns:
        ``{"variant", "ok": bool, "reason": None | "SIGILL (illegal instruction) in the probe"
        | "exit 1 in the probe: <last line>" | "probe timed out after 120 s", "seconds"}``.
        A probe that could not be made (no ``gguf`` package to write its model) is
        ``ok: None`` with the reason: nothing is known about the variant.
    """
    t0 = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", variant, str(llama_cpp_dir)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "ok": False, "reason": f"probe timed out after {timeout:.0f} s",
                "seconds": round(time.time() - t0, 2)}
    secs = round(time.time() - t0, 2)
    if p.returncode == 0:
        return {"variant": variant, "ok": True, "reason": None, "seconds": secs}
    last = [ln.strip() for ln in (p.stderr or "").splitlines() if ln.strip()]
    if p.returncode == _PROBE_UNAVAILABLE:
        return {"variant": variant, "ok": None, "reason": f"not probed: {last[-1] if last else 'no reason'}",
                "seconds": secs}
    why = signal_text(p.returncode) + " in the probe"
    if p.returncode > 0 and last:
        why += f": {last[-1][:200]}"
    return {"variant": variant, "ok": False, "reason": why, "seconds": secs}


_PROBE_UNAVAILABLE = 3  # the probe child's exit code when it cannot build its model


def _probe_model(folder: Path) -> Path:
    """A tiny Q4_K_M llama GGUF for the probe (``probe-q4_k_m-v<N>.gguf`` in ``folder``), made
    once: an F32 model written with gguf-py (1 layer, hidden 256, 4 heads, 2 KV heads, FFN
    512, a 259-token SentencePiece vocabulary of byte tokens; seeded random weights), then
    quantized by llama.cpp's own ``llama_model_quantize`` (Q4_K and Q6_K blocks, as a
    Q4_K_M model of any size).

    Raises:
        ImportError: gguf-py or numpy is not installed.
        RuntimeError: llama.cpp's quantizer failed.
    """
    out = folder / f"probe-q4_k_m-v{PROBE_VERSION}.gguf"
    if out.is_file():
        return out
    import gguf  # optional: qeval's gguf extra; the probe is skipped without it
    import numpy as np  # optional: installed with gguf; this module imports the standard library only
    import llama_cpp  # optional: the probe runs only where llama-cpp-python is installed

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n_embd, n_ff, n_head, n_kv, n_vocab = 256, 512, 4, 2, 259
    head = n_embd // n_head
    f32 = folder / f".probe-f32.{os.getpid()}.gguf"
    w = gguf.GGUFWriter(str(f32), "llama")
    w.add_name("qeval-probe")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # ALL_F32
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([2, 3, 3] + [6] * 256)  # UNKNOWN, CONTROL, CONTROL, BYTE
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def t(name: str, *shape: int) -> None:  # numpy shape (rows, cols) = ggml (ne1, ne0)
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    t("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("blk.0.attn_q.weight", n_embd, n_embd)
    t("blk.0.attn_k.weight", n_kv * head, n_embd)
    t("blk.0.attn_v.weight", n_kv * head, n_embd)
    t("blk.0.attn_output.weight", n_embd, n_embd)
    t("blk.0.ffn_gate.weight", n_ff, n_embd)
    t("blk.0.ffn_up.weight", n_ff, n_embd)
    t("blk.0.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp = folder / f".probe-q4.{os.getpid()}.gguf"
    try:
        qp = llama_cpp.llama_model_quantize_default_params()
        qp.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        qp.nthread = 1
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(qp)) != 0:
            raise RuntimeError("llama_model_quantize failed on the probe model")
        os.replace(tmp, out)
    finally:
        f32.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def _probe_child(variant: str, llama_cpp_dir: Path) -> int:
    """The probe's child process: load ``variant`` alone, then run the kernels of a GGUF tier
    (a Q4_K_M model, ``q8_0`` K and V with flash attention, a 32-token prefill in one batch
    and 4 single-token decodes, 1 thread). Exit 0 when it ran; a trapping kernel kills
    this process with its signal (the parent reads it from the return code)."""
    load_backends(llama_cpp_dir, only=variant)
    fault = os.environ.get(PROBE_FAULT_ENV, "")
    kind = forced_kind()
    if kind is not None and CPU_KINDS[kind].amx_traps and variant in AMX_VARIANTS:
        fault = f"{variant}:SIGILL"  # the forced kind's AMX kernels trap, as on such a virtual machine
    if fault and fault.split(":")[0] == variant:
        sig = signal.Signals[fault.split(":")[1]] if ":" in fault else signal.SIGILL
        why = PROBE_FAULT_ENV if os.environ.get(PROBE_FAULT_ENV) else f"{CPU_KIND_ENV}={kind}"
        print(f"[qeval] test fault {why} in the probe of {variant}: {sig.name}", file=sys.stderr, flush=True)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    try:
        model_path = _probe_model(_cache_root() / "llama_cpu_probe")
    except ImportError as e:
        print(f"cannot write the probe model ({e})", file=sys.stderr)
        return _PROBE_UNAVAILABLE
    import llama_cpp as L  # optional: the probe runs only where llama-cpp-python is installed

    quiet = L.llama_log_callback(lambda level, text, user: None)  # kept alive: llama.cpp calls it later
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        print("llama.cpp cannot load the probe model", file=sys.stderr)
        return 1
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
    cp.n_threads = cp.n_threads_batch = 1
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k = cp.type_v = L.GGML_TYPE_Q8_0
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        print("llama.cpp cannot create the probe context", file=sys.stderr)
        return 1
    ids = [3 + (i * 37) % 256 for i in range(32)]
    arr = (L.llama_token * len(ids))(*ids)
    if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(ids))) != 0:
        print("llama_decode failed on the probe prefill", file=sys.stderr)
        return 1
    for i in range(4):
        one = (L.llama_token * 1)(3 + i)
        if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
            print("llama_decode failed on a probe decode step", file=sys.stderr)
            return 1
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


def probe_enabled() -> bool:
    """The probe runs unless ``QEVAL_LLAMA_CPU_PROBE=0``."""
    return os.environ.get(PROBE_ENV, "1") != "0"


def run_probes(llama_cpp_dir: Path, cands: list[Candidate], flags: frozenset[str], amx_ok: bool,
               probe: Callable[[Path, str], dict] = probe_variant) -> list[dict]:
    """Probe the allowed candidates best first (llama.cpp's score) until one runs; cached
    verdicts are reused and new ones written to :func:`probe_cache_file`. Marks each
    candidate that failed its probe ``excluded`` with the probe's reason.

    Args:
        probe: ``(llama_cpp_dir, variant) -> verdict`` (default :func:`probe_variant`).

    Returns:
        The verdicts consulted, best first (``{"variant", "ok", "reason", "seconds",
        "cached"}``).
    """
    path = probe_cache_file(probe_key(flags, amx_ok, [(c.name, c.path) for c in cands]))
    known = _read_verdicts(path)
    out: list[dict] = []
    changed = False
    for c in sorted((c for c in cands if c.excluded is None), key=lambda c: -c.score):
        v = known.get(c.name)
        if v is None or v.get("ok") is None:
            v = probe(llama_cpp_dir, c.name)
            if v.get("ok") is not None:
                known[c.name] = v
                changed = True
            v = dict(v, cached=False)
        else:
            v = dict(v, cached=True)
        out.append(v)
        if v.get("ok") is False:
            c.excluded = str(v.get("reason") or "failed in the probe")
            continue
        break  # ran (or could not be probed: judged by flags alone)
    if changed:
        try:
            _write_verdicts(path, known)
        except OSError:
            pass  # a read-only cache: the probe runs again next time
    return out


@dataclass
class Selection:
    """What :func:`load_backends` did: ``variant`` (``zen4``; ``built-in`` when the CPU
    backend is linked in, None before anything is loaded), its ``path``, the variants
    found with their scores and exclusions, and ``amx_granted``."""
    variant: str | None = None
    path: str | None = None
    candidates: list[dict] = field(default_factory=list)
    amx_granted: bool | None = None
    others: list[str] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)

    def passed_over(self) -> list[str]:
        """``["zen4: SIGILL (illegal instruction) in the probe", ...]``: the variants that
        llama.cpp's score ranks above or level with the chosen one (a tie is tried first by
        name, as :func:`run_probes` does), and why each was not run."""
        chosen = next((c["score"] for c in self.candidates if c["variant"] == self.variant), None)
        return [f"{c['variant']}: {c['excluded']}" for c in sorted(self.candidates, key=lambda c: -c["score"])
                if c["excluded"] and c["variant"] != self.variant and (chosen is None or c["score"] >= chosen)]


_SELECTION: Selection | None = None


def lib_dirs(llama_cpp_dir: Path) -> list[Path]:
    """Where a llama-cpp-python install keeps ggml's modules: ``llama_cpp/lib`` and the
    ``bin``/``lib`` folders scikit-build-core installs llama.cpp's own targets into; first,
    the test-only folder named by :data:`EXTRA_VARIANTS_ENV` when set."""
    site = llama_cpp_dir.parent
    extra = os.environ.get(EXTRA_VARIANTS_ENV, "").strip()
    return ([Path(extra)] if extra else []) + [llama_cpp_dir / "lib", site / "bin", site / "lib"]


def select_variant(llama_cpp_dir: Path, *, amx_ok: bool | None = None, flags: frozenset[str] | None = None,
                   probe: bool | None = None, only: str | None = None) -> tuple[Selection, Candidate | None]:
    """Choose the CPU variant without registering any backend (the run's environment stage
    calls it before the first GGUF stage; :func:`load_backends` then loads the choice):
    llama.cpp's score of each variant module, :func:`judge`, then the probes
    (:func:`run_probes`) or the one variant ``only`` names. Arguments as :func:`load_backends`.

    Returns:
        ``(selection, chosen candidate or None)``; the selection's ``variant`` is the choice
        (None when nothing may run), ``candidates`` and ``probes`` say why.
    """
    _ggml(llama_cpp_dir / "lib")  # libggml and libggml-base mapped: the variant modules link to them
    sel = Selection()
    mods = variant_modules(lib_dirs(llama_cpp_dir))
    sel.amx_granted = amx_granted() if amx_ok is None else amx_ok
    fl = cpu_flags() if flags is None else flags
    cands = judge([Candidate(n, p, _score(p)) for n, p in mods], fl, sel.amx_granted)
    only = only or os.environ.get(VARIANT_ENV) or None
    if only is not None:
        cands = [c for c in cands if c.name == only]
        if not cands:
            raise RuntimeError(f"no CPU variant {only!r} in this llama-cpp-python build "
                               f"(built: {', '.join(n for n, _ in mods)})")
    elif probe if probe is not None else probe_enabled():
        sel.probes = run_probes(llama_cpp_dir, cands, fl, bool(sel.amx_granted))
    sel.candidates = [{"variant": c.name, "score": c.score, "excluded": c.excluded} for c in cands]
    best = choose(cands)
    if best is not None:
        sel.variant, sel.path = best.name, str(best.path)
    return sel, best


def load_backends(llama_cpp_dir: Path, *, amx_ok: bool | None = None,
                  flags: frozenset[str] | None = None, probe: bool | None = None,
                  only: str | None = None) -> Selection:
    """Register ggml's backends in this process before llama.cpp does (once per process):
    the best CPU variant this machine may run and that ran its probe (module notes;
    :func:`run_probes`, verdicts cached per machine) and every other backend module (GPU)
    found. Without variant modules (a build with the CPU backend linked in) nothing is
    loaded and the selection says ``built-in``.

    Args:
        llama_cpp_dir: the ``llama_cpp`` package folder (``llama_cpp/lib`` beside it).
        amx_ok, flags: the AMX grant and cpuinfo flags (default: asked of this machine).
        probe: run (or read) the probes; default :func:`probe_enabled`. ``make setup``'s
            check passes False (qeval's dependencies are not installed yet).
        only: load this variant and no other (the probe child; default
            ``$QEVAL_LLAMA_CPU_VARIANT``), judged all the same and not probed.

    Raises:
        RuntimeError: variant modules exist but none may run on this machine.
    """
    global _SELECTION
    if _SELECTION is not None:
        return _SELECTION
    dirs = lib_dirs(llama_cpp_dir)
    mods = variant_modules(dirs)
    sel = Selection()
    if not mods:
        sel.variant = "built-in"
        ggml = _ggml(llama_cpp_dir / "lib")
        if int(ggml.ggml_backend_reg_count()) == 0:  # GGML_BACKEND_DL with one CPU module, no variants
            one = [d / "libggml-cpu.so" for d in dirs if (d / "libggml-cpu.so").is_file()]
            if one and ggml.ggml_backend_load(str(one[0]).encode()):
                sel.variant, sel.path = "single module", str(one[0])
        _SELECTION = sel
        return sel
    ggml = _ggml(llama_cpp_dir / "lib")
    sel, best = select_variant(llama_cpp_dir, amx_ok=amx_ok, flags=flags, probe=probe, only=only)
    if best is None:
        raise RuntimeError("none of llama.cpp's CPU variants may run on this machine: "
                           + "; ".join(f"{c['variant']}: {c['excluded']}" for c in sel.candidates))
    for p in other_backend_modules(dirs):
        if ggml.ggml_backend_load(str(p).encode()):
            sel.others.append(p.name)
    if not ggml.ggml_backend_load(str(best.path).encode()):
        raise RuntimeError(f"llama.cpp could not load its CPU backend {best.path}")
    sel.variant, sel.path = best.name, str(best.path)
    _SELECTION = sel
    return sel


def describe(llama_cpp_dir: Path) -> dict:
    """The backends llama.cpp registered in this process (call after ``llama_backend_init``):

    ``{"cpu_variant": "zen4" | "built-in", "cpu_variant_path": str | None,
    "instruction_sets": ["AVX", "AVX2", ..., "AVX512_BF16"], "cpu_features": {name: value},
    "devices": ["CPU (AMD EPYC ...)", ...], "amx_granted": bool | None,
    "variants": [{"variant", "score", "excluded"}], "passed_over": ["zen4: SIGILL
    (illegal instruction) in the probe"], "probes": [...]}``; ``instruction_sets`` are the
    features of the CPU backend that ran whose value is "1" (ggml_backend_get_features).
    """
    sel = _SELECTION or Selection(variant="built-in")
    ggml = _ggml(llama_cpp_dir / "lib")
    feats: dict[str, str] = {}
    for i in range(int(ggml.ggml_backend_reg_count())):
        reg = ggml.ggml_backend_reg_get(i)
        if (ggml.ggml_backend_reg_name(reg) or b"").decode() == "CPU":
            feats = _features(ggml, reg)
            break
    devices = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        d = ggml.ggml_backend_dev_get(i)
        devices.append(f"{(ggml.ggml_backend_dev_name(d) or b'').decode()} "
                       f"({(ggml.ggml_backend_dev_description(d) or b'').decode().strip()})")
    return {"cpu_variant": sel.variant, "cpu_variant_path": sel.path,
            "instruction_sets": [k for k in ISA_FEATURES if feats.get(k) == "1"],
            "cpu_features": feats, "devices": devices, "amx_granted": sel.amx_granted,
            "variants": sel.candidates, "other_backends": sel.others,
            "passed_over": sel.passed_over(), "probes": sel.probes}


def check_installed(gpu: bool = False) -> str:
    """Load the installed llama-cpp-python's backends as qeval does and say which CPU
    variant runs (``make setup``'s check that the build is the one it asked for).

    Raises:
        RuntimeError: llama-cpp-python is missing, its CPU backend is built in (no variant
            modules: an older build), no variant may run here, or ``gpu`` and it has no
            GPU offload.
    """
    try:
        import llama_cpp  # optional: the qeval[gguf] extra; checked here only
    except ImportError as e:
        raise RuntimeError(f"llama-cpp-python is not installed ({e})") from None
    here = Path(llama_cpp.__file__).resolve().parent
    sel = load_backends(here, probe=False)  # qeval's dependencies (gguf) may not be installed yet
    if sel.variant == "built-in":
        raise RuntimeError(f"{here} has no CPU variant modules (libggml-cpu-*.so): built without GGML_BACKEND_DL")
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        raise RuntimeError("this llama-cpp-python has no GPU offload")
    return str(sel.variant)


def _print_choice() -> int:
    try:
        import llama_cpp  # optional: the qeval[gguf] extra
    except ImportError as e:
        print(f"llama-cpp-python is not installed ({e})", file=sys.stderr)
        return 1
    try:
        sel = load_backends(Path(llama_cpp.__file__).resolve().parent)
    except RuntimeError as e:
        print(f"llama-cpp-python: {e}", file=sys.stderr)
        return 1
    print(sel.variant)
    for line in sel.passed_over():
        print(f"  passed over {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``--probe VARIANT DIR``: the probe child (:func:`_probe_child`);
    ``--choose``: probe the installed build's variants (cached) and print the choice and
    why better ones were passed over; ``--amx-granted``: exit 0 when this machine grants AMX (prints yes/no);
    ``--variant [NAME,...]``: print the variant this machine would run among NAMEs;
    ``--check [--gpu]``: exit 0 when the installed llama-cpp-python loads a CPU variant
    (and offloads to a GPU), printing the variant; exit 1 with the reason otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"] and len(argv) == 3:
        return _probe_child(argv[1], Path(argv[2]))
    if argv[:1] == ["--choose"]:
        return _print_choice()
    if argv[:1] == ["--check"]:
        try:
            print(check_installed(gpu="--gpu" in argv))
            return 0
        except RuntimeError as e:
            print(f"llama-cpp-python: {e}", file=sys.stderr)
            return 1
    if argv[:1] == ["--amx-granted"]:
        ok = amx_granted()
        print("yes" if ok else "no")
        return 0 if ok else 1
    if argv[:1] == ["--variant"]:
        built = argv[1].split(",") if len(argv) > 1 else list(VARIANT_FLAGS)
        print(machine_variant(cpu_flags(), amx_granted(), built) or "none")
        return 0
    print("usage: ggml_cpu.py --amx-granted | --variant [NAME,...] | --check [--gpu] | --choose", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
