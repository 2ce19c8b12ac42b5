"""One GGUF file in process (llama-cpp-python) and through the managed llama-server, side
by side: what the server costs.

Both sides open the same GGUF file with the same threads, flash-attention setting and KV
cache type: in process through qeval's llama.cpp engine
(:class:`qeval.engines.llamacpp.LlamaCppEngine`, the ``gguf`` tiers' engine), served
through qeval's ``openai`` engine on a managed llama-server (:mod:`qeval.engines.servers`,
built from the same vendored llama.cpp; ``--parallel`` the largest concurrency, one
unified KV pool as the served tier has). Every served phase starts on an empty KV pool
(:meth:`qeval.engines.openai.OpenAIEngine.kv_pool_phase`, as the measure and load stages
do), so the figures measure the server, not what an earlier request left in its pool.

What is compared, per round, in pairs taken seconds apart (the 2-core machine's speed
drifts by +-20 % within minutes, so only neighbours are compared):

* speed at each depth: one request of ``depth`` prompt tokens and ``--decode-tokens`` new
  tokens (``ignore_eos``) on each side: TTFT (s), decode tokens/s
  (``(n - 1) / (t_last - t_first)``) and the median inter-token latency (ITL p50, s);
* load at each concurrency: the closed-loop sweep point of the load stage
  (:func:`qeval.serving.closed_loop.load_sweep`, one point) on each side: TTFT p50, aggregate
  decode tokens/s and ITL p50.

Printed: for every depth and concurrency the median over rounds of the per-pair ratios
server / in-process of TTFT, decode tokens/s and ITL p50, each marked against the target
(within 10 %). Never part of ``make test``; run it on a quiet machine.

    python benchmarks/served_vs_in_process.py RUN_DIR [--tier gguf-q4_k_m-server] [--rounds 3]
    python benchmarks/served_vs_in_process.py --gguf FILE --tokenizer DIR [--recipe recipes/smollm2-135m.yaml]

With RUN_DIR: the served GGUF tier of a finished run (default: the first whose
``serve`` is llama-server), its artifact, threads and KV cache, and the recipe's
``speed.depths`` and ``load`` section. Without: the GGUF file and tokenizer given, and the
settings of ``--recipe``. ``--depths``, ``--concurrency``, ``--decode-tokens``,
``--output-tokens`` and ``--requests-per-stream`` override the recipe's. llama-server comes
with ``make setup``'s llama-cpp-python build; where that wheel has none, the first run builds
it (10+ minutes on 2 cores; cached under ``$QEVAL_CACHE/llama_tools``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 0.10
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m.yaml"


def itl_p50(times: list[float]) -> float | None:
    """Median gap between consecutive token times (s); None under two tokens."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def speed_pair(local, served, ids: list[int], new_tokens: int, depth: int) -> dict[str, dict]:
    """One request on each side (the served one on an empty KV pool): TTFT, decode
    tokens/s and ITL p50 per side."""
    out = {}
    g = local.generate(ids, new_tokens, ignore_stop=True)
    out["local"] = {"ttft": g.prefill_s, "decode": g.decode_tokens_per_s, "itl": itl_p50(g.token_times_s)}
    with served.kv_pool_phase(f"speed at depth {depth}"):
        g = served.generate(ids, new_tokens, ignore_stop=True)
    out["served"] = {"ttft": g.prefill_s, "decode": g.decode_tokens_per_s, "itl": itl_p50(g.token_times_s)}
    return out


def load_pair(local, served, prompt_for, *, concurrency: int, depth: int, output_tokens: int,
              requests_per_stream: int, prefill_chunk: int) -> dict[str, dict]:
    """One load point on each side (:func:`qeval.serving.closed_loop.load_sweep`): TTFT p50,
    aggregate decode tokens/s, ITL p50."""
    from qeval.serving.closed_loop import load_sweep
    out = {}
    for side, eng in (("local", local), ("served", served)):
        p = load_sweep(eng, prompt_for, concurrency=[concurrency], depth=depth, output_tokens=output_tokens,
                       requests_per_stream=requests_per_stream, prefill_chunk=prefill_chunk, slo=None)["points"][0]
        if not p.get("admitted", True):
            raise SystemExit(f"{side}: concurrency {concurrency} not admitted: {p.get('reason')}")
        out[side] = {"ttft": (p.get("ttft_s") or {}).get("p50"), "decode": p.get("decode_tokens_per_s"),
                     "itl": (p.get("itl_s") or {}).get("p50")}
    return out


def ratio(pair: dict, key: str) -> float | None:
    a, b = pair["served"].get(key), pair["local"].get(key)
    return a / b if a and b else None


def settings(args):
    """``(gguf, tokenizer folder, recipe, threads, kv_cache, flash_attn)`` from a run folder or the flags."""
    from qeval.recipe import load_recipe
    if args.run_dir:
        from qeval.results import RUN_SCOPE, RunLayout, read_stage
        from qeval.worker import load_recipe_from_run
        recipe, _ = load_recipe_from_run(args.run_dir)
        layout = RunLayout(args.run_dir)
        served = [t for t in recipe.tiers if getattr(t, "serve", None) is not None and t.serve.kind == "llama-server"]
        tier = next((t for t in served if args.tier in (None, t.name)), None)
        if tier is None:
            raise SystemExit(f"no llama-server tier {args.tier or ''} in {args.run_dir}")
        art = read_stage(layout, tier.name, "prepare").artifact
        src = read_stage(layout, RUN_SCOPE, "source").path
        return Path(art), src, recipe, recipe.threads, tier.kv_cache, getattr(tier, "flash_attn", None)
    if not (args.gguf and args.tokenizer):
        raise SystemExit("give RUN_DIR, or --gguf FILE and --tokenizer DIR")
    recipe = load_recipe(args.recipe)
    return Path(args.gguf), str(args.tokenizer), recipe, args.threads or recipe.threads, args.kv_cache, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", type=Path)
    ap.add_argument("--tier")
    ap.add_argument("--gguf")
    ap.add_argument("--tokenizer")
    ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--kv-cache", default="model", choices=("model", "int8"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", help="comma-separated (default: the recipe's speed.depths)")
    ap.add_argument("--concurrency", help="comma-separated (default: the recipe's load.concurrency)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per speed request (default 64)")
    ap.add_argument("--output-tokens", type=int, help="new tokens per load request (default: the recipe's)")
    ap.add_argument("--requests-per-stream", type=int, help="default: the recipe's")
    ap.add_argument("--server-args", default="",
                    help="extra llama-server arguments, space-separated (e.g. '-b 128 -ub 128': the server "
                         "prefills as many prompt tokens per step as the in-process scheduler's prefill_chunk)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from qeval.engines.base import EngineOptions
    from qeval.engines.llamacpp import LlamaCppEngine, default_flash_attn
    from qeval.engines.openai import OpenAIEngine
    from qeval.measure.load import distinct_prompts
    from qeval.measure.speed import depth_prompt_ids

    gguf, tok_dir, recipe, threads, kv, fa = settings(args)
    depths = [int(x) for x in args.depths.split(",")] if args.depths else list(recipe.speed.depths)
    conc = [int(x) for x in args.concurrency.split(",")] if args.concurrency else list(recipe.load.concurrency)
    ld = recipe.load
    out_tokens = args.output_tokens or ld.output_tokens
    rps = args.requests_per_stream or ld.requests_per_stream
    load_depth = recipe.load_depth
    fa = default_flash_attn("cpu", kv) if fa is None else fa
    tok = AutoTokenizer.from_pretrained(tok_dir)
    text = recipe.resolve_path(recipe.speed.depth_text)
    prompts = {d: depth_prompt_ids(tok, text, d) for d in depths}
    base = depth_prompt_ids(tok, text, max(4 * load_depth, 4096))
    prompt_for = distinct_prompts(base, load_depth)
    seq = max(depths) + args.decode_tokens + 1
    print(f"gguf {gguf}  threads {threads}  flash_attn {fa}  kv_cache {kv}  depths {depths}  "
          f"concurrency {conc}  rounds {args.rounds}", flush=True)

    opts = EngineOptions(device="cpu", threads=threads, kv_cache=kv, flash_attn=fa)
    local = LlamaCppEngine.open("gguf", gguf, opts)
    log = Path(tempfile.mkdtemp(prefix="qeval-served-bench-")) / "server.log"
    served = OpenAIEngine.open("gguf", gguf, EngineOptions(
        device="cpu", threads=threads, kv_cache=kv, flash_attn=fa,
        server={"serve": {"kind": "llama-server", "parallel": max(conc), "args": args.server_args.split()}, "log": str(log), "tier": "benchmark",
                "tokenizer": tok_dir, "check_texts": [],
                "tokens": {"sequence": seq, "load_sequence": load_depth + out_tokens + 1}}))
    print(f"llama-server: {' '.join(served.server.cmd)}\n  log {log}", flush=True)
    speed: dict[int, list[dict]] = {d: [] for d in depths}
    load: dict[int, list[dict]] = {c: [] for c in conc}
    try:
        for r in range(args.rounds):
            for d in depths:
                speed[d].append(speed_pair(local, served, prompts[d], args.decode_tokens, d))
                print(f"round {r + 1} depth {d}: {speed[d][-1]}", flush=True)
            for c in conc:
                load[c].append(load_pair(local, served, prompt_for, concurrency=c, depth=load_depth,
                                         output_tokens=out_tokens, requests_per_stream=rps,
                                         prefill_chunk=ld.prefill_chunk))
                print(f"round {r + 1} concurrency {c}: {load[c][-1]}", flush=True)
    finally:
        local.close()
        served.close()

    def cell(pairs: list[dict], key: str) -> str:
        rs = [x for x in (ratio(p, key) for p in pairs) if x is not None]
        if not rs:
            return "n/a"
        m = statistics.median(rs)
        return f"{m:.3f} {'ok' if abs(m - 1) <= TARGET else 'OUTSIDE'}"

    print(f"\nserver / in-process, median over {args.rounds} rounds of paired ratios (target within "
          f"{TARGET:.0%}):")
    print(f"{'phase':<22} {'TTFT':>14} {'decode tok/s':>14} {'ITL p50':>14}")
    for d in depths:
        print(f"{'speed depth ' + str(d):<22} {cell(speed[d], 'ttft'):>14} {cell(speed[d], 'decode'):>14} "
              f"{cell(speed[d], 'itl'):>14}")
    for c in conc:
        print(f"{'load concurrency ' + str(c):<22} {cell(load[c], 'ttft'):>14} {cell(load[c], 'decode'):>14} "
              f"{cell(load[c], 'itl'):>14}")


if __name__ == "__main__":
    main()
