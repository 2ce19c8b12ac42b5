"""qeval's llama.cpp load sweep against ``llama-batched-bench``, side by side in one run.

For the GGUF tier of a finished run folder (default: the first finished tier whose engine
opens GGUF files): aggregate decode tokens/s at 1, 2, 4 and 8 streams, measured now with
qeval's own continuous-batching loop (the engine's ``capabilities.serve``, which the load
stage runs: :func:`qeval.serving.closed_loop.closed_loop` on the llama.cpp core, :mod:`qeval.engines.llamacpp_core`) and with llama.cpp's
``llama-batched-bench`` (built from the same vendored llama.cpp that llama-cpp-python
compiled, :func:`qeval.engines.llama_tools.tool_path`) on the same file, threads,
flash-attention setting, KV cache type, prompt depth and new tokens.

What is compared. ``llama-batched-bench -npp D -ntg T -npl N`` prefills N prompts of D
tokens, then times T decode steps of N tokens each: ``S_TG = N x T / T_TG`` (tokens/s).
qeval serves N streams of one request each (a fresh D-token prompt, T new tokens) on
batched-bench's schedule: ``prefill_chunk`` is N x D here, so all N prompts are prefilled
in the first step and every later step is a decode step of all N sequences. (With the
load stage's smaller chunk the first stream starts decoding while the last ones still
prefill, and the steps that hold no prompt tokens are mostly narrower than N: at 64 new
tokens and N = 8 that lowered qeval's figure by about 7 % here.) qeval's
``decode_step_tokens_per_s`` (new tokens of steps holding no prompt tokens / their
seconds, :func:`qeval.measure.load.point_stats`) is then the same quantity as S_TG, and
the ratio qeval / llama-batched-bench is printed per N. Target: >= 0.9. Also printed:
qeval's aggregate decode tokens/s over the whole point (all new tokens / first request to
last token, prefill included: the load table's figure), which is lower by definition.

New tokens default to at least 64: the load stage's 16 give 15 timed steps (under half a
second at N = 1), too short a window for a stable figure on a shared 2-core machine.

Pairs, not blocks: each round runs, for every N, qeval's point and then
llama-batched-bench at that N alone, and the printed ratio is the median over rounds of
each pair's ratio. The 2-core machine's speed drifts by +-20 % within minutes (2026-12-02:
batched-bench's own S_TG at N = 1 read 35.1 to 55.5 over five rounds), so only figures taken
seconds apart are compared; the per-round figures are printed too. The KV cache is llama.cpp's default non-unified one on both
sides (each sequence owns n_ctx / n_seq_max cells). Never part of ``make test``.

    python benchmarks/load_vs_llama_cpp.py RUN_DIR [--tier gguf-q4_k_m] [--streams 1,2,4,8]
                                           [--depth D] [--output-tokens T] [--rounds 3]

Depth defaults to the recipe's ``load.depth``, new tokens to max(``load.output_tokens``, 64),
threads to the tier's (``threads`` of the recipe).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 0.9
MIN_OUTPUT_TOKENS = 64  # default floor on new tokens: a window long enough to time (docstring)
_CTX_ROUND = 256  # llama.cpp pads a sequence's cells to 256 (as qeval.engines.llamacpp_core)


def batched_bench(tool: Path, gguf: Path, *, threads: int, flash_attn: bool, kv: str, depth: int,
                  output_tokens: int, streams: list[int], env: dict) -> dict[int, dict]:
    """``llama-batched-bench`` once over every N: per N its ``S_TG`` (decode tokens/s,
    ``speed_tg``) and ``S_PP`` (prefill tokens/s, ``speed_pp``) from its JSONL output."""
    per_seq = -(-(depth + output_tokens) // _CTX_ROUND) * _CTX_ROUND
    cmd = [str(tool), "-m", str(gguf), "-c", str(per_seq * max(streams)), "-b", "2048", "-ub", "512",
           "-t", str(threads), "-tb", str(threads), "-fa", "on" if flash_attn else "off", "-ctk", kv, "-ctv", kv,
           "-ngl", "0", "-no-kvu", "-npp", str(depth), "-ntg", str(output_tokens),
           "-npl", ",".join(map(str, streams)), "--output-format", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    out: dict[int, dict] = {}
    for line in p.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "pl" in row:
            out[int(row["pl"])] = {"decode": float(row["speed_tg"]), "prefill": float(row["speed_pp"])}
    missing = [n for n in streams if n not in out]
    if missing:
        raise SystemExit(f"llama-batched-bench printed no row for N = {missing}:\n{p.stdout[-2000:]}")
    return out


def qeval_points(engine, prompt_for, *, streams: list[int], depth: int, output_tokens: int) -> dict[int, dict]:
    """qeval's closed loop at every N (one request per stream, all N prompts
    prefilled in one step as batched-bench does: ``prefill_chunk = N x depth``): per N the
    pure-decode-step tokens/s and the point's aggregate decode tokens/s."""
    from qeval.measure.load import point_stats
    from qeval.serving.closed_loop import closed_loop
    from qeval.serving.core import can_serve
    if not can_serve(engine):
        raise SystemExit(f"engine {engine.name} cannot batch")
    out = {}
    for n in streams:
        run = closed_loop(engine, prompt_for, concurrency=n, output_tokens=output_tokens, requests_per_stream=1,
                    prefill_chunk=n * depth)
        p = point_stats(run)
        out[n] = {"decode": p["decode_step_tokens_per_s"], "aggregate": p["decode_tokens_per_s"]}
    return out


def main() -> None:
    from transformers import AutoTokenizer

    from qeval.engines import get_engine
    from qeval.engines.base import EngineOptions
    from qeval.engines.llama_tools import tool_path
    from qeval.measure.load import distinct_prompts
    from qeval.measure.speed import depth_prompt_ids
    from qeval.results import RUN_SCOPE, RunLayout, load_run, read_stage
    from qeval.stages import child_env
    from qeval.worker import load_recipe_from_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tier", default=None, help="the GGUF tier (default: the first finished one)")
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts")
    ap.add_argument("--depth", type=int, default=None, help="prompt tokens per request (default: load.depth)")
    ap.add_argument("--output-tokens", type=int, default=None, help="new tokens per request (default: load.output_tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating qeval / llama-batched-bench rounds")
    a = ap.parse_args()

    recipe, _ = load_recipe_from_run(a.run_dir)
    run, tiers = load_run(a.run_dir)
    env = child_env(recipe)
    os.environ.update(env)  # threads and OpenMP policy of qeval's stages, for this process too

    def gguf_tier(t) -> bool:
        return t.ok and bool(t.engine) and "gguf" in get_engine(t.engine).formats

    name = a.tier or next((n for n, t in tiers.items() if gguf_tier(t)), None)
    if name is None or name not in tiers or not gguf_tier(tiers[name]):
        raise SystemExit(f"no finished GGUF tier {a.tier or ''} in {a.run_dir}")
    t = tiers[name]
    files = sorted(Path(t.artifact.path).glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(f"{name}: expected one .gguf in {t.artifact.path}, found {len(files)}")
    gguf = files[0]
    streams = sorted({int(x) for x in a.streams.split(",")})
    depth = a.depth or recipe.load_depth
    ntg = a.output_tokens or max(recipe.load.output_tokens, MIN_OUTPUT_TOKENS)
    threads = int(t.threads or recipe.threads)
    fa = bool(t.flash_attn)
    kv = t.kv_cache_dtype or ("q8_0" if t.kv_cache == "int8" else "f16")

    src = read_stage(RunLayout(a.run_dir), RUN_SCOPE, "source").path
    tok = AutoTokenizer.from_pretrained(src)
    base = depth_prompt_ids(tok, recipe.resolve_path(recipe.speed.depth_text), max(4 * depth, 4096))
    prompt_for = distinct_prompts(base, depth)
    tool = tool_path("llama-batched-bench", log=lambda s: print(f"[llama_tools] {s}", flush=True))
    print(f"{name}: {gguf.name}; threads {threads}; flash attention {'on' if fa else 'off'}; KV {kv}; "
          f"depth {depth}; {ntg} new tokens; streams {streams}; {a.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores", flush=True)

    engine = get_engine(t.engine).open("gguf", gguf, EngineOptions(device="cpu", threads=threads,
                                                                   kv_cache=t.kv_cache or "model", flash_attn=fa))
    q = {n: {"decode": [], "aggregate": []} for n in streams}
    b = {n: {"decode": [], "prefill": []} for n in streams}
    pair = {n: [] for n in streams}  # qeval / batched-bench, one per round, taken seconds apart
    try:
        for r in range(a.rounds):
            print(f"  round {r + 1}/{a.rounds}: per N, qeval then llama-batched-bench", flush=True)
            for n in streams:
                v = qeval_points(engine, prompt_for, streams=[n], depth=depth, output_tokens=ntg)[n]
                w = batched_bench(tool, gguf, threads=threads, flash_attn=fa, kv=kv, depth=depth,
                                  output_tokens=ntg, streams=[n], env=env)[n]
                for k in q[n]:
                    if v[k]:
                        q[n][k].append(v[k])
                for k in b[n]:
                    b[n][k].append(w[k])
                if v["decode"] and w["decode"]:
                    pair[n].append(v["decode"] / w["decode"])
    finally:
        engine.close()

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    print(f"\n  {'streams':>7} {'qeval decode':>13} {'batched-bench S_TG':>19} {'pair ratio':>10}  "
          f"{'qeval aggregate':>15} {'gain vs 1':>9}")
    one = med(q[streams[0]]["decode"])
    for n in streams:
        mq, mb, agg, ratio = med(q[n]["decode"]), med(b[n]["decode"]), med(q[n]["aggregate"]), med(pair[n])
        gain = mq / one if mq and one else None
        verdict = "n/a" if ratio is None else ("ok" if ratio >= TARGET else "BELOW TARGET")
        print(f"  {n:>7} {mq or float('nan'):13.2f} {mb or float('nan'):19.2f} {ratio or float('nan'):10.3f}  "
              f"{agg or float('nan'):15.2f} {gain or float('nan'):8.2f}x  {verdict}", flush=True)
    print(f"  (tokens/s, medians of {a.rounds} rounds; pair ratio: median of the rounds' qeval / batched-bench; "
          f"target >= {TARGET}; load average now {os.getloadavg()[0]:.2f})")
    for n in streams:
        print(f"  N = {n}: qeval {', '.join(f'{x:.1f}' for x in q[n]['decode'])}; "
              f"batched-bench {', '.join(f'{x:.1f}' for x in b[n]['decode'])}; "
              f"ratios {', '.join(f'{x:.2f}' for x in pair[n])}")


if __name__ == "__main__":
    main()
