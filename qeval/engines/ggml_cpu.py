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
import platform
import re
import sys
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
        syscall: ``syscall(number, *args) -> int`` (tests inject the result); default libc's.

    Returns:
        False on anything but x86-64 Linux, or when the request fails.
    """
    if syscall is None:
        if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
            return False
        syscall = _libc_syscall
    try:
        return syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (or in ``text``); empty
    where there is no such file (not Linux)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return frozenset(m.group(1).split()) if m else frozenset()


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
    """``(variant, path)`` of every ``libggml-cpu-<variant>.so`` in ``lib_dirs``."""
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
    kernels: the score lives in the ``-feats`` object built without the variant's flags)."""
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


_SELECTION: Selection | None = None


def lib_dirs(llama_cpp_dir: Path) -> list[Path]:
    """Where a llama-cpp-python install keeps ggml's modules: ``llama_cpp/lib`` and the
    ``bin``/``lib`` folders scikit-build-core installs llama.cpp's own targets into."""
    site = llama_cpp_dir.parent
    return [llama_cpp_dir / "lib", site / "bin", site / "lib"]


def load_backends(llama_cpp_dir: Path, *, amx_ok: bool | None = None,
                  flags: frozenset[str] | None = None) -> Selection:
    """Register ggml's backends in this process before llama.cpp does (once per process):
    the best CPU variant this machine may run (module notes) and every other backend
    module (GPU) found. Without variant modules (a build with the CPU backend linked in)
    nothing is loaded and the selection says ``built-in``.

    Args:
        llama_cpp_dir: the ``llama_cpp`` package folder (``llama_cpp/lib`` beside it).
        amx_ok, flags: the AMX grant and cpuinfo flags (default: asked of this machine).

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
    sel.amx_granted = amx_granted() if amx_ok is None else amx_ok
    fl = cpu_flags() if flags is None else flags
    cands = judge([Candidate(n, p, _score(p)) for n, p in mods], fl, sel.amx_granted)
    sel.candidates = [{"variant": c.name, "score": c.score, "excluded": c.excluded} for c in cands]
    best = choose(cands)
    if best is None:
        raise RuntimeError("none of llama.cpp's CPU variants may run on this machine: "
                           + "; ".join(f"{c.name}: {c.excluded}" for c in cands))
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
    "variants": [{"variant", "score", "excluded"}]}``; ``instruction_sets`` are the
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
            "variants": sel.candidates, "other_backends": sel.others}


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
    sel = load_backends(here)
    if sel.variant == "built-in":
        raise RuntimeError(f"{here} has no CPU variant modules (libggml-cpu-*.so): built without GGML_BACKEND_DL")
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        raise RuntimeError("this llama-cpp-python has no GPU offload")
    return str(sel.variant)


def main(argv: list[str] | None = None) -> int:
    """``--amx-granted``: exit 0 when this machine grants AMX (prints yes/no);
    ``--variant [NAME,...]``: print the variant this machine would run among NAMEs;
    ``--check [--gpu]``: exit 0 when the installed llama-cpp-python loads a CPU variant
    (and offloads to a GPU), printing the variant; exit 1 with the reason otherwise."""
    argv = sys.argv[1:] if argv is None else argv
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
    print("usage: ggml_cpu.py --amx-granted | --variant [NAME,...] | --check [--gpu]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
