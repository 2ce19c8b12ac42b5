"""A tier of a finished run as the draft of another: speculative decoding measured, and the
fidelity run's prediction beside it (issue 51's first step: the measurement, not yet a stage).

For a target and a draft tier of one run folder, both transformers tiers (their artifacts:
``tiers/<tier>.json`` ``artifact.path``, the source checkpoint for BF16), on ``--prompts``
prompts of ``--depth`` tokens cut from the recipe's depth text:

* the target alone: its greedy answer of ``--new-tokens`` tokens (end of sequence ignored) and
  its tokens/s (prefill included);
* for each ``--draft-tokens`` k: :func:`qeval.measure.speculative.speculative_generate`
  (transformers' assisted generation): target steps, mean accepted draft tokens per step,
  acceptance rate, tokens/s and the speed-up over the target alone, and whether the answer
  is the target's own token for token (lossless at greedy);
* predicted from the run: the draft tier's fidelity same-top rate ``alpha`` gives the expected
  accepted tokens per step (:func:`~qeval.measure.speculative.expected_accepted`), and with
  the two tiers' decode tokens/s at the nearest measured depth (the cost ratio c = target /
  draft tok/s) the expected speed-up (:func:`~qeval.measure.speculative.expected_speedup`).

    python benchmarks/speculative.py RUN_DIR --target bf16 --draft int8 [--draft-tokens 2,4]
                                     [--new-tokens 32] [--depth 256] [--prompts 2] [--json OUT]

Prints one row per k; exit 0, or 2 on bad input. On 2 shared CPU cores a draft only a little
cheaper than its target (int8 against bf16 here decodes at about the same speed) cannot pay
for its own steps: the speed-up is below 1 there, and the row says what the prediction
expected; acceptance is deterministic (greedy) and is the figure to compare.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def refuse(msg: str) -> None:
    """Bad input: one line, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """Measure and predict (module docstring); exit code 0 or 2."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--draft-tokens", default="2,4")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        ks = sorted({int(k) for k in a.draft_tokens.split(",")})
    except ValueError:
        refuse(f"--draft-tokens {a.draft_tokens!r}: comma-separated whole numbers")
    if not ks or ks[0] < 1 or a.new_tokens < 2 or a.depth < 1 or a.prompts < 1:
        refuse("--draft-tokens >= 1, --new-tokens >= 2, --depth >= 1 and --prompts >= 1")
    from gpu_decode import hf_tiers  # the run's transformers tiers and their artifacts
    try:
        rows, _ = hf_tiers(a.run_dir, None, [a.target, a.draft])
    except ValueError as e:
        refuse(str(e))
    by = {r["tier"]: r for r in rows}
    for name in (a.target, a.draft):
        if name not in by:
            refuse(f"tier {name}: not a finished transformers tier of {a.run_dir}")
    tiers = {n: json.loads((a.run_dir / "tiers" / f"{n}.json").read_text()) for n in (a.target, a.draft)}
    run = json.loads((a.run_dir / "run.json").read_text())

    import torch
    from transformers import AutoTokenizer
    from qeval.engines.hf import load_hf_model
    from qeval.measure.speculative import expected_accepted, expected_speedup, speculative_generate
    from qeval.measure.speed import depth_prompt_ids

    source = (run.get("source") or {}).get("path")
    tok = AutoTokenizer.from_pretrained(source)
    text = (run.get("recipe") or {}).get("speed", {}).get("depth_text") or "builtin:depth_text"
    if text.startswith("builtin:"):
        from qeval import data as builtin_data
        text = str(builtin_data.builtin_path(text))
    base = depth_prompt_ids(tok, text, a.depth * (a.prompts + 1))
    prompts = [base[i * a.depth // 2:i * a.depth // 2 + a.depth] for i in range(a.prompts)]
    target = load_hf_model(by[a.target]["model"], "cpu", "float32").eval()
    draft = load_hf_model(by[a.draft]["model"], "cpu", "float32").eval()

    alone, ref = [], []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=0)
            alone.append(a.new_tokens / (time.perf_counter() - t0))
        ref.append(out[0, len(p):].tolist())
    alpha = ((tiers[a.draft].get("quality") or {}).get("fidelity") or {}).get("same_top_rate")
    depths = sorted(set((tiers[a.target].get("speed") or {})) & set((tiers[a.draft].get("speed") or {})), key=int)
    near = min(depths, key=lambda d: abs(int(d) - a.depth)) if depths else None
    tps = {n: ((tiers[n].get("speed") or {}).get(near) or {}).get("decode_tokens_per_s") for n in tiers} if near else {}
    cost = tps[a.target] / tps[a.draft] if tps.get(a.target) and tps.get(a.draft) else None
    print(f"target {a.target}, draft {a.draft} (same-top {alpha if alpha is None else round(alpha, 4)}; decode tok/s "
          f"at depth {near}: {tps.get(a.target)} / {tps.get(a.draft)}, cost ratio c {cost and round(cost, 3)}); "
          f"{a.prompts} prompts of {a.depth} tokens, {a.new_tokens} new tokens; target alone "
          f"{statistics.median(alone):.1f} tok/s")
    out_rows = []
    print(f"{'k':>3} {'steps':>6} {'accepted/step':>14} {'predicted':>10} {'accept rate':>12} {'tok/s':>8} "
          f"{'speed-up':>9} {'predicted':>10} {'lossless':>9}")
    for k in ks:
        runs = [speculative_generate(target, draft, p, draft_tokens=k, max_new_tokens=a.new_tokens, reference_ids=r)
                for p, r in zip(prompts, ref)]
        acc = statistics.mean(r.mean_accepted for r in runs)
        pred = expected_accepted(alpha, k) if alpha is not None else None
        tps_k = statistics.median(r.tokens_per_s for r in runs)
        speedup = tps_k / statistics.median(alone)
        pred_s = expected_speedup(alpha, k, cost) if alpha is not None and cost else None
        row = {"k": k, "target_steps": sum(r.target_steps for r in runs), "mean_accepted": acc,
               "predicted_accepted": pred, "acceptance_rate": acc / k, "tokens_per_s": tps_k, "speedup": speedup,
               "predicted_speedup": pred_s, "lossless": all(r.lossless for r in runs)}
        out_rows.append(row)
        print(f"{k:>3} {row['target_steps']:>6} {acc:>14.2f} {pred if pred is None else round(pred, 2)!s:>10} "
              f"{acc / k:>12.1%} {tps_k:>8.1f} {speedup:>9.2f} {pred_s if pred_s is None else round(pred_s, 2)!s:>10} "
              f"{str(row['lossless']):>9}")
    if a.json is not None:
        a.json.write_text(json.dumps({"target": a.target, "draft": a.draft, "alpha": alpha, "cost_ratio": cost,
                                      "target_alone_tokens_per_s": statistics.median(alone), "rows": out_rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
