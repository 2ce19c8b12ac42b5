"""A tier's model peak under the old and the current CPU baseline rule, in one process.

The measure stage's rule (``qeval.worker.stage_measure``): the baseline is the resident
size once the tier's engine libraries are imported and warmed, before the model loads. The
rule before it took the baseline after importing torch and transformers only, so every
tier was charged for its tokenizer, modeling code, kernel set-up and (GPTQ, AWQ) the import
of gptqmodel. This script takes both baselines in one fresh process and runs the measure
stage's own steps (``prepare_runtime``, ``load``, ``speed_sweep`` at one depth), so the two
peaks come from the same run of the same code:

    python benchmarks/memory_baseline_rules.py RUN_DIR --tiers bf16,gptq,awq,gguf-q4_k_m [--depth 1024]

Each tier runs in its own child process (a peak is per process). CPU only. Prints MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
MIB = 2 ** 20


def one(run_dir: Path, tier: str, depth: int) -> dict:
    """In this process: old baseline (torch + transformers imported), the measure stage's
    steps, new baseline (runtime warmed), peak at ``depth``; bytes."""
    import torch  # noqa: F401 - the old rule's baseline: torch and transformers imported
    import transformers  # noqa: F401
    from qeval.measure.memory import PeakMemory, reset_cpu_peak, rss_bytes
    old_base = rss_bytes()
    from transformers import AutoTokenizer
    from qeval.measure.speed import depth_prompt_ids, speed_sweep
    from qeval.results import RunLayout, read_stage
    from qeval.tiers import get_method
    from qeval.worker import load_recipe_from_run, pin_threads, tier_context
    recipe, _ = load_recipe_from_run(run_dir)
    pin_threads(recipe.threads)
    spec = recipe.tier(tier)
    ctx = tier_context(recipe, run_dir, "cpu")
    method = get_method(spec.method)
    prep = read_stage(RunLayout(run_dir), tier, "prepare")
    artifact = Path(prep.artifact) if prep.artifact else None
    tok = AutoTokenizer.from_pretrained(ctx.source_path)
    prompts = {depth: depth_prompt_ids(tok, recipe.resolve_path(recipe.speed.depth_text), depth)}
    method.prepare_runtime(spec, ctx, artifact)
    new_base = rss_bytes()
    reset_cpu_peak()
    peak = PeakMemory("cpu", 0)
    engine = method.open_engine(spec, ctx, artifact)
    _, peaks, _, _ = speed_sweep(engine, prompts, decode_tokens=recipe.speed.decode_tokens, repeats=1,
                                 warmup=0, peak=peak, prefill_repeats=1, progress=lambda m: None)
    hwm = peaks[str(depth)]
    return {"tier": tier, "old_baseline": old_base, "new_baseline": new_base,
            "peak_old_rule": hwm - old_base, "peak_new_rule": hwm - new_base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tiers", required=True)
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.run_dir, a.child, a.depth)))
        return
    from qeval.run import child_env
    from qeval.worker import load_recipe_from_run
    recipe, _ = load_recipe_from_run(a.run_dir)
    env = dict(os.environ, **child_env(recipe))
    print(f"model peak at depth {a.depth}, MiB (one process per tier; VmHWM less each baseline)")
    print(f"{'tier':<14} {'old rule':>9} {'new rule':>9} {'baseline moved':>15}")
    for t in a.tiers.split(","):
        p = subprocess.run([sys.executable, __file__, str(a.run_dir), "--tiers", t, "--depth", str(a.depth),
                            "--child", t], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            print(f"{t:<14} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{t:<14} {r['peak_old_rule'] / MIB:>9.1f} {r['peak_new_rule'] / MIB:>9.1f} "
              f"{(r['new_baseline'] - r['old_baseline']) / MIB:>15.1f}", flush=True)


if __name__ == "__main__":
    main()
