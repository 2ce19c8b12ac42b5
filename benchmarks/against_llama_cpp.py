"""qeval's GGUF figures against llama.cpp's own tools and an independent KLD, in one run.

Two checks on a finished qeval run folder:

1. **Speed.** For each GGUF tier: qeval's prefill tokens/s (depth / TTFT) and decode
   tokens/s at the recipe's depths, measured now with qeval's own engine and sweep
   (``LlamaCppEngine`` + ``measure.speed.speed_sweep``, the measure stage's code), side by
   side with ``llama-bench`` (built from the same vendored llama.cpp that llama-cpp-python
   compiled, :func:`qeval.engines.llama_tools.tool_path`) on the same file, threads,
   flash-attention setting, KV cache type and batch sizes. Pairs, not blocks: each round
   runs, for every depth, qeval and then llama-bench at that depth alone, and the printed
   ratio is the median over rounds of each pair's ratio (the 2-core machine's speed drifts
   by +-20 % within minutes, so only figures taken seconds apart are compared).
   New tokens default to max(the recipe's ``speed.decode_tokens``, 64): 15 timed decode
   steps (the default recipe's 16 tokens) last under half a second, too short a window to
   time on a shared machine (2026-12-02: 0.73 and 1.16 at one round of 16 tokens). A ratio
   outside the target is printed as "within llama-bench's own spread" when llama-bench's
   own samples of that figure, over their median, span it (its decode at depth 1024 read
   32.3 to 43.4 tokens/s in one process here): the machine then cannot tell the two apart.
   llama-bench's ``pp<d>`` is a prompt of d
   tokens from an empty cache (qeval's TTFT at depth d); its ``tg<n-1> @ d<d>`` is n - 1
   single-token decodes after a context of d tokens, the same positions qeval's
   ``(n - 1) / (t_last - t_first)`` times. Target: ratios within 5 %.
   The same rounds also run the fastest llama-bench that runs on this machine (the
   ``native`` flavour of :mod:`qeval.engines.llama_tools`: ``-march=native``, without
   AMX where the CPU lists it and the kernel does not grant it; built once and cached,
   only when this benchmark runs; ``--no-native`` leaves it out): the ``qeval/native``
   column is qeval's figure over that build's, paired in the same round, and says what
   qeval's choice of CPU variant (printed first) leaves on the table. Target: within 10 %.
2. **KLD.** For each GGUF tier (and the reference tier as served, the noise floor): the
   KLD stored in the run against an independent float64 recomputation from raw logits
   over the same reference tokens: the reference model through transformers in the
   run's reference dtype, one forward over each whole sequence; the tier through
   llama-cpp-python's high-level ``Llama`` (``logits_all``); log-softmax and
   KL(P_ref || P_tier) in float64 on the answer positions, no float16 rounding, no
   qeval scoring code. Target: ratio within 2 %.

    python benchmarks/against_llama_cpp.py RUN_DIR [--tiers gguf-q4_k_m] [--rounds 3]
                                             [--decode-tokens N] [--depths 256,1024]
                                             [--skip-speed] [--skip-kld] [--no-native]

The ``qeval`` flavour's tools come with ``make setup``'s llama-cpp-python build (where that
wheel has none, the first run builds them); the ``native`` flavour is built on its first run
(about 5 minutes on 2 cores; cached under ``$QEVAL_CACHE/llama_tools``). Shortest mode (proves it runs, figures meaningless):
``--rounds 1 --depths 64 --decode-tokens 8 --skip-kld``. A run folder for it: a copy of the default recipe with
``--tiers bf16,gguf-q4_k_m`` (the reference and floor come with bf16).

GGUF tiers are the finished tiers whose engine opens GGUF files (the engine registry's
``formats``); the reference tier is recomputed through transformers when it is served from
the source checkpoint (a method without an artifact) with the model's KV cache.
Speed ratios on a shared machine are noisy: run it when the machine is quiet, and read
a ratio outside the target against the load average.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPEED_TARGET = 0.05
NATIVE_TARGET = 0.10  # qeval's run-time CPU variant against the fastest build that runs here
MIN_DECODE_TOKENS = 64  # default floor on new tokens: a decode window long enough to time
KLD_TARGET = 0.02


# ---- shared ----------------------------------------------------------------------------

def load(run_dir: Path):
    """``(recipe, run, tiers, source path)`` of a run folder (:class:`qeval.results.RunInfo`,
    ``{name: TierResult}``)."""
    from qeval.results import RUN_SCOPE, RunLayout, load_run, read_stage
    from qeval.worker import load_recipe_from_run
    recipe, _ = load_recipe_from_run(run_dir)
    run, tiers = load_run(run_dir)
    src = read_stage(RunLayout(run_dir), RUN_SCOPE, "source").path
    return recipe, run, tiers, src


def opens_gguf(tier) -> bool:
    """Whether the tier ran on an engine that opens GGUF files (llama.cpp's)."""
    from qeval.engines import get_engine
    return bool(tier.engine) and "gguf" in get_engine(tier.engine).formats


def gguf_file(tier) -> Path:
    """The GGUF file of a tier's artifact."""
    files = sorted(Path(tier.artifact.path).glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(f"{tier.tier}: expected one .gguf in {tier.artifact.path}, found {len(files)}")
    return files[0]


def kv_type(tier) -> str:
    """llama.cpp cache type name the tier ran with (``f16`` / ``q8_0``), as its row records it."""
    return tier.kv_cache_dtype or ("q8_0" if tier.kv_cache == "int8" else "f16")


def within(r: float | None, target: float, own: tuple[float, float] | None = None) -> str:
    """Verdict on a ratio: ``ok`` within ``target`` of 1; else, when ``own`` (the lowest and
    highest of llama-bench's own samples over its median) brackets it, ``within
    llama-bench's own spread``: the outside tool disagrees with itself by as much on this
    machine; else ``OUTSIDE TARGET``."""
    if r is None or not math.isfinite(r):
        return "n/a"
    if abs(r - 1) <= target:
        return "ok"
    if own is not None and own[0] <= r <= own[1]:
        return f"within llama-bench's own spread ({own[0]:.2f} to {own[1]:.2f})"
    return "OUTSIDE TARGET"


# ---- speed -----------------------------------------------------------------------------

def llama_bench(bench: Path, gguf: Path, *, threads: int, flash_attn: bool, kv: str, depths: list[int],
                decode_tokens: int, repeats: int, env: dict) -> dict[int, dict]:
    """llama-bench's prefill (``pp<d>``) and decode (``tg<n-1>`` at depth d) tokens/s per depth:
    the median of its ``samples_ts`` over ``repeats`` repetitions."""
    base = [str(bench), "-m", str(gguf), "-t", str(threads), "-fa", "on" if flash_attn else "off",
            "-ctk", kv, "-ctv", kv, "-b", "512", "-ub", "512", "-ngl", "0", "-r", str(repeats), "-o", "json"]
    runs = {"prefill": base + ["-p", ",".join(map(str, depths)), "-n", "0"],
            "decode": base + ["-p", "0", "-n", str(decode_tokens - 1), "-d", ",".join(map(str, depths))]}
    out: dict[int, dict] = {d: {} for d in depths}
    for kind, cmd in runs.items():
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"llama-bench failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
        for row in json.loads(p.stdout):
            d = int(row["n_prompt"]) if kind == "prefill" else int(row.get("n_depth", 0))
            if d in out:
                ts = row.get("samples_ts") or [row["avg_ts"]]
                out[d][f"{kind}_tokens_per_s"] = ts
    return out


def qeval_speed(engine_name: str, gguf: Path, prompts: dict[int, list[int]], *, threads: int, kv_cache: str,
                flash_attn: bool, decode_tokens: int, repeats: int) -> dict[int, dict]:
    """qeval's measure-stage sweep (warm-up, then ``repeats`` runs per depth) on the GGUF file,
    opened by the tier's engine as the measure stage opens it: per depth the lists of
    prefill and decode tokens/s."""
    from qeval.engines import get_engine
    from qeval.engines.base import EngineOptions
    from qeval.measure.memory import PeakMemory
    from qeval.measure.speed import speed_sweep
    eng = get_engine(engine_name).open("gguf", gguf, EngineOptions(device="cpu", threads=threads, kv_cache=kv_cache,
                                                                   flash_attn=flash_attn))
    try:
        speed, _, _, _ = speed_sweep(eng, prompts, decode_tokens=decode_tokens, repeats=repeats, warmup=1,
                                     peak=PeakMemory("cpu"))
    finally:
        eng.close()
    return {int(d): {"prefill_tokens_per_s": [int(d) / t for t in row["ttft_s_all"]],
                     "decode_tokens_per_s": list(row["decode_tokens_per_s_all"])} for d, row in speed.items()}


def speed_check(run_dir: Path, tier_names: list[str], rounds: int, decode_tokens: int | None = None,
                depths: list[int] | None = None, native: bool = True) -> list[dict]:
    """Side-by-side speed of qeval, llama-bench built as qeval runs (same CPU variant) and,
    with ``native``, the fastest llama-bench that runs here, for each GGUF tier; returns
    the rows printed."""
    from transformers import AutoTokenizer

    from qeval.engines.llama_tools import cmake_args, tool_path
    from qeval.engines.llamacpp import cpu_backend
    from qeval.measure.speed import depth_prompt_ids
    from qeval.run import child_env

    recipe, run, tiers, src = load(run_dir)
    env = child_env(recipe)  # what qeval's measure stage runs under (main() set it for this process too)
    bench = tool_path("llama-bench", log=lambda s: print(f"[llama_tools] {s}", flush=True))
    cpu = cpu_backend()
    print(f"qeval's llama.cpp CPU variant: {cpu['cpu_variant']} ({' '.join(cpu['instruction_sets'])}); "
          f"llama-bench built with {' '.join(a for a in cmake_args() if 'GGML' in a and '=ON' in a)}", flush=True)
    fastest = None
    if native:
        fastest = tool_path("llama-bench", flavor="native", log=lambda s: print(f"[llama_tools] {s}", flush=True))
        print(f"fastest llama-bench here: {' '.join(a for a in cmake_args('native') if 'GGML' in a or 'FLAGS' in a)} "
              f"({fastest.parent.parent.name})", flush=True)
    tok = AutoTokenizer.from_pretrained(src)
    depths = list(depths or recipe.speed.depths)
    prompts = {d: depth_prompt_ids(tok, recipe.resolve_path(recipe.speed.depth_text), d) for d in depths}
    n = decode_tokens or max(recipe.speed.decode_tokens, MIN_DECODE_TOKENS)
    rows = []
    for name in tier_names:
        t = tiers[name]
        gguf, threads, fa, kv = gguf_file(t), int(t.threads or recipe.threads), bool(t.flash_attn), kv_type(t)
        print(f"\n== {name}: {gguf.name}, threads {threads}, flash attention {'on' if fa else 'off'}, KV {kv}, "
              f"batch 512, {n} new tokens, {rounds} rounds x {recipe.speed.repeats} repeats", flush=True)
        q: dict[int, dict] = {d: {"prefill_tokens_per_s": [], "decode_tokens_per_s": []} for d in depths}
        b: dict[int, dict] = {d: {"prefill_tokens_per_s": [], "decode_tokens_per_s": []} for d in depths}
        nb: dict[int, dict] = {d: {"prefill_tokens_per_s": [], "decode_tokens_per_s": []} for d in depths}
        pair: dict[tuple[int, str], list[float]] = {}  # (depth, metric) -> qeval / llama-bench per round
        npair: dict[tuple[int, str], list[float]] = {}  # (depth, metric) -> qeval / native llama-bench per round
        for r in range(rounds):  # per depth: qeval, then llama-bench, seconds apart
            print(f"   round {r + 1}/{rounds}: per depth, qeval then llama-bench"
                  + (" then the native llama-bench" if fastest else ""), flush=True)
            for d in depths:
                v = qeval_speed(t.engine, gguf, {d: prompts[d]}, threads=threads, kv_cache=t.kv_cache or "model",
                                flash_attn=fa, decode_tokens=n, repeats=recipe.speed.repeats)[d]
                w = llama_bench(bench, gguf, threads=threads, flash_attn=fa, kv=kv, depths=[d],
                                decode_tokens=n, repeats=recipe.speed.repeats, env=env)[d]
                for k in v:
                    q[d][k] += v[k]
                for k in w:
                    b[d][k] += w[k]
                x = llama_bench(fastest, gguf, threads=threads, flash_attn=fa, kv=kv, depths=[d], decode_tokens=n,
                                repeats=recipe.speed.repeats, env=env)[d] if fastest else {}
                for k in x:
                    nb[d][k] += x[k]
                for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                    if v.get(k) and w.get(k):
                        pair.setdefault((d, k), []).append(statistics.median(v[k]) / statistics.median(w[k]))
                    if v.get(k) and x.get(k):
                        npair.setdefault((d, k), []).append(statistics.median(v[k]) / statistics.median(x[k]))
        print(f"   {'depth':>6} {'':8} {'qeval':>9} {'llama-bench':>12} {'pair ratio':>10}  {'stored run':>10}  rounds' ratios"
              + ("\n   (native): the fastest llama-bench here, its pair ratio qeval/native" if fastest else ""))
        for d in depths:
            for k, label in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
                mq = statistics.median(q[d][k]) if q[d][k] else None
                mb = statistics.median(b[d][k]) if b[d][k] else None
                ratios = pair.get((d, k), [])
                ratio = statistics.median(ratios) if ratios else None
                point = (t.speed or {}).get(str(d))
                stored = getattr(point, k) if point is not None else None
                own = (min(b[d][k]) / mb, max(b[d][k]) / mb) if mb else None
                rows.append({"tier": name, "depth": d, "metric": label, "qeval": mq, "llama_bench": mb,
                             "ratio": ratio, "round_ratios": ratios, "llama_bench_own_range": own, "stored": stored})
                print(f"   {d:>6} {label:8} {mq or float('nan'):9.2f} {mb or float('nan'):12.2f} "
                      f"{ratio or float('nan'):10.3f}  {stored or float('nan'):10.2f}  "
                      f"{within(ratio, SPEED_TARGET, own)}  {', '.join(f'{x:.3f}' for x in ratios)}", flush=True)
                if fastest:
                    mn = statistics.median(nb[d][k]) if nb[d][k] else None
                    nr = npair.get((d, k), [])
                    nratio = statistics.median(nr) if nr else None
                    nown = (min(nb[d][k]) / mn, max(nb[d][k]) / mn) if mn else None
                    rows[-1].update({"native_llama_bench": mn, "native_ratio": nratio, "native_round_ratios": nr,
                                     "native_own_range": nown})
                    print(f"   {'':>6} {'':8} {'':>9} {mn or float('nan'):12.2f} "
                          f"{nratio or float('nan'):10.3f}  {'(native)':>10}  "
                          f"{within(nratio, NATIVE_TARGET, nown)}  {', '.join(f'{x:.3f}' for x in nr)}", flush=True)
        print(f"   (stored run: the run folder's figure at the recipe's {recipe.speed.decode_tokens} new tokens)")
    return rows


# ---- KLD -------------------------------------------------------------------------------

def _log_softmax64(x) -> "object":
    import numpy as np
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _sequences(run_dir: Path) -> list[tuple[list[int], list[int]]]:
    """``(token ids, answer row positions)`` per scored sequence: the reference's own
    tokens, grouped as qeval scores them (a conversation's turns in one sequence); row i
    is the distribution at position i, predicting token i + 1."""
    from qeval.measure.quality import conversations
    from qeval.results import RunLayout
    segments = json.loads(RunLayout(run_dir).reference_segments.read_text())
    out = []
    for group in conversations(segments):
        seq = group[-1]["prompt_ids"] + group[-1]["answer_ids"]
        rows: list[int] = []
        for s in group:
            a = len(s["prompt_ids"]) - 1
            rows += list(range(a, a + len(s["answer_ids"])))
        if rows:
            out.append((seq, rows))
    return out


def _hf_rows(path: str, dtype: str, seqs, threads: int, float32_matmuls: bool = False):
    """float64 log-probabilities of the answer rows from a transformers model: one forward
    over each whole sequence, no cache, no windows. ``float32_matmuls``: bfloat16 linear
    layers as float32 matmuls, as the run's quality stages computed them
    (``quality.bf16_matmul``; torch arithmetic, not qeval's scoring)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    if float32_matmuls:
        from qeval.engines.bf16_matmul import float32_matmuls as widen
        widen(model)
    res = []
    with torch.inference_mode():
        for seq, rows in seqs:
            logits = model(input_ids=torch.tensor([seq])).logits[0, rows]
            res.append(_log_softmax64(logits.float().numpy()))
    del model
    return res


def _llama_rows(gguf: Path, seqs, *, threads: int, flash_attn: bool, kv: str):
    """float64 log-probabilities of the answer rows from llama-cpp-python's high-level
    ``Llama`` (``logits_all``, ``eval`` of each whole sequence)."""
    import llama_cpp

    from qeval.engines.llamacpp import cpu_backend
    cpu_backend()  # ggml's backends loaded as qeval loads them (a variant build has none linked in)
    n_ctx = -(-max(len(s) for s, _ in seqs) // 256) * 256
    ktype = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, flash_attn=flash_attn, type_k=ktype,
                          type_v=ktype, n_gpu_layers=0, verbose=False)
    res = []
    for seq, rows in seqs:
        llm.reset()
        llm.eval(seq)
        res.append(_log_softmax64(llm.scores[rows]))
    llm.close()
    return res


def independent_kld(run_dir: Path, tier_names: list[str], threads: int | None = None) -> list[dict]:
    """Stored KLD against the float64 recomputation for each tier (GGUF tiers, and the
    reference tier as served when it is a bf16 tier); returns the rows printed."""
    import numpy as np
    from qeval.measure.quality import resolve_reference_dtype
    from qeval.tiers import get_method

    recipe, run, tiers, src = load(run_dir)
    threads = threads or os.cpu_count() or 1
    seqs = _sequences(run_dir)
    floor = run.noise_floor
    ref_dtype = (floor.reference_dtype if floor is not None else None) or \
        resolve_reference_dtype(recipe, run.device or "cpu")
    print(f"\n== KLD: {sum(len(r) for _, r in seqs)} reference answer tokens in {len(seqs)} sequences; "
          f"reference recomputed in {ref_dtype} through transformers (one forward per sequence)", flush=True)
    ref = _hf_rows(src, ref_dtype, seqs, threads)
    rows = []
    for name in tier_names:
        t = tiers[name]
        if opens_gguf(t):
            tier_lp = _llama_rows(gguf_file(t), seqs, threads=threads, flash_attn=bool(t.flash_attn), kv=kv_type(t))
            how = "llama-cpp-python Llama(logits_all)"
        elif not get_method(t.method).needs_artifact and (t.kv_cache or "model") == "model":
            widened = floor is not None and floor.bf16_matmul == "float32"
            tier_lp = _hf_rows(src, recipe.model.dtype, seqs, threads, widened)  # the source checkpoint as served
            how = f"transformers in {recipe.model.dtype}" + (", float32 matmuls as the run's" if widened else "")
        else:
            print(f"   {name}: skipped (only GGUF tiers and a tier served from the source are recomputed)")
            continue
        k = np.concatenate([(np.exp(r) * (r - q)).sum(axis=-1) for r, q in zip(ref, tier_lp)])
        fid = t.quality.fidelity if t.quality is not None else None
        stored_kld = fid.kld_mean if fid is not None else None
        stored_n = fid.n_tokens if fid is not None else None
        mine = float(k.mean())
        ratio = stored_kld / mine if stored_kld is not None and mine > 0 else None
        is_floor = name == recipe.gate.reference
        rows.append({"tier": name, "stored": stored_kld, "recomputed": mine, "ratio": ratio,
                     "n_tokens": int(k.size), "stored_n_tokens": stored_n, "noise_floor": is_floor})
        verdict = ("noise floor: rounding noise itself, which the windowing changes; no target" if is_floor
                   else within(ratio, KLD_TARGET))
        print(f"   {name:<18} stored {stored_kld or float('nan'):.6f}  recomputed {mine:.6f} "
              f"({how}, float64)  ratio {ratio or float('nan'):.4f}  tokens {k.size}/{stored_n}  "
              f"{verdict}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tiers", default=None, help="comma-separated tiers (default: every GGUF tier that finished)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating qeval / llama-bench rounds")
    ap.add_argument("--decode-tokens", type=int, default=None,
                    help=f"new tokens per decode run (default: max(speed.decode_tokens, {MIN_DECODE_TOKENS}))")
    ap.add_argument("--depths", default=None, help="comma-separated depths (default: the recipe's speed.depths)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-kld", action="store_true")
    ap.add_argument("--no-native", action="store_true", help="leave out the native (fastest) llama-bench build")
    a = ap.parse_args()
    recipe, run, tiers, _ = load(a.run_dir)
    from qeval.run import child_env
    os.environ.update(child_env(recipe))  # threads and OpenMP policy of the measure stage, before torch loads
    ok = {n: t for n, t in tiers.items() if t.ok}
    names = [n.strip() for n in a.tiers.split(",")] if a.tiers else [n for n, t in ok.items() if opens_gguf(t)]
    missing = [n for n in names if n not in ok]
    if missing:
        raise SystemExit(f"tiers without an ok result in {a.run_dir}: {', '.join(missing)}")
    print(f"run {a.run_dir}: {', '.join(names)}; depths {recipe.speed.depths}; "
          f"llama-cpp-python {run.versions.get('llama-cpp-python')}; load average {os.getloadavg()[0]:.2f} "
          f"(1 min) on {os.cpu_count()} cores")
    if not a.skip_speed:
        speed_check(a.run_dir, [n for n in names if opens_gguf(ok[n])], a.rounds, a.decode_tokens,
                    [int(x) for x in a.depths.split(",")] if a.depths else None, native=not a.no_native)
    if not a.skip_kld:
        ref = recipe.gate.reference
        extra = [ref] if ref in ok and ref not in names else []
        independent_kld(a.run_dir, extra + names)


if __name__ == "__main__":
    main()
