"""qeval's decode against a bare compiled static-cache loop, per transformers tier of a run.

For each transformers tier of a finished run folder (``tiers/<tier>.json`` with engine
``hf``, status ok), on the same artifact (the tier's ``artifact.path``; the source
checkpoint for a tier without one, e.g. BF16):

* the bare loop: transformers' model (``from_pretrained``), a ``StaticCache``, the prompt
  prefilled uncompiled, then one decode step under ``torch.compile(fullgraph=True,
  dynamic=False, mode="reduce-overhead")`` (CUDA graphs), greedy argmax, no qeval code in
  the loop; timed as qeval times its decode: ``(n - 1) / (t_last - t_first)`` over the n
  new tokens, each token's time taken when its id is on the host
  (:meth:`qeval.engines.base.Generation.decode_tokens_per_s`), median over ``--repeats``;
* qeval's figure: the tier's ``speed[<depth>].decode_tokens_per_s``, over the same
  ``decode_tokens``;
* their ratio qeval / bare (:func:`decode_ratio`); goal >= 0.9 for every tier (issue 48).

The prompt is ``depth`` seeded random token ids: a decode step's work at batch 1 depends on
the cache length and the shapes, not on which tokens are in it (the static cache's
attention reads every preallocated row, masked).

    python benchmarks/gpu_decode.py RUN_DIR [--depth D] [--tiers a,b] [--repeats 3]
                                    [--budget-s 300] [--json OUT] [--device cuda]

``--device cpu --backend eager`` runs the same loop on the CPU (dynamo without code
generation, no CUDA graphs): for checking the script, not for figures. Prints one line per
tier and the ``proved:`` / ``not proved:`` lines (:func:`proved_lines`); ``--json`` writes
the rows. Exit 0 when every tier met the goal, 1 otherwise, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOAL = 0.9  # issue 48: qeval's decode at least 0.9 of the bare loop's, every tier
STATIC_CACHE_ROUND = 256  # as qeval.engines.hf: the same preallocated length, the same attention work


def refuse(msg: str) -> None:
    """One line on stderr, exit 2 (bad input)."""
    print(f"gpu_decode: {msg}", file=sys.stderr)
    sys.exit(2)


def decode_ratio(qeval_tps: float | None, bare_tps: float | None) -> float | None:
    """qeval's decode tokens/s over the bare loop's on the same artifact and depth (1.0:
    qeval's loop costs nothing; below 1: its overhead, or a step that did not run as the
    bare loop's one graph). None when either figure is missing or not positive."""
    if qeval_tps is None or bare_tps is None or qeval_tps <= 0 or bare_tps <= 0:
        return None
    return float(qeval_tps) / float(bare_tps)


def ratio_rows(qeval: dict[str, float | None], bare: dict[str, float | None], goal: float = GOAL) -> list[dict]:
    """One row per tier of ``qeval`` (tier -> qeval's decode tokens/s), in its order:
    ``{"tier", "qeval_tokens_per_s", "bare_tokens_per_s", "ratio", "meets_goal"}``;
    ``meets_goal`` is None where the ratio is (a figure missing)."""
    rows = []
    for tier, q in qeval.items():
        b = bare.get(tier)
        r = decode_ratio(q, b)
        rows.append({"tier": tier, "qeval_tokens_per_s": q, "bare_tokens_per_s": b, "ratio": r,
                     "meets_goal": None if r is None else r >= goal})
    return rows


def proved_lines(rows: list[dict], depth: int, goal: float = GOAL, why: dict[str, str] | None = None) -> list[str]:
    """``proved:`` for a tier whose ratio meets ``goal``, ``not proved:`` for one below it or
    without a figure (``why``: tier -> the reason a bare figure is missing)."""
    out = []
    for r in rows:
        t = r["tier"]
        if r["ratio"] is None:
            reason = (why or {}).get(t) or ("no qeval figure" if r["qeval_tokens_per_s"] is None else "no bare figure")
            out.append(f"not proved: {t} decode against a bare compiled static-cache loop: {reason}")
            continue
        verb = "proved" if r["meets_goal"] else "not proved"
        out.append(f"{verb}: {t} decode is {r['ratio']:.2f} of a bare compiled static-cache loop "
                   f"({r['qeval_tokens_per_s']:.1f} vs {r['bare_tokens_per_s']:.1f} tokens/s at depth {depth}; "
                   f"goal >= {goal:.2f})")
    return out


def hf_tiers(run_dir: Path, depth: int | None = None, only: list[str] | None = None) -> tuple[list[dict], int]:
    """The run's transformers tiers that finished: ``[{"tier", "model", "qeval_tokens_per_s",
    "decode_tokens", "dtype", "decode_mode", "kv_cache"}]`` at ``depth`` (default: the deepest speed depth
    every such tier has), and that depth.

    Raises:
        ValueError: no run.json, no transformers tier, or ``depth`` not measured.
    """
    run_json = run_dir / "run.json"
    if not run_json.is_file():
        raise ValueError(f"{run_dir}: no run.json (not a qeval run folder)")
    run = json.loads(run_json.read_text())
    source = (run.get("source") or {}).get("path")
    dtype = ((run.get("recipe") or {}).get("model") or {}).get("dtype") or "bfloat16"
    found = []
    for p in sorted((run_dir / "tiers").glob("*.json")):
        t = json.loads(p.read_text())
        if t.get("engine") != "hf" or t.get("status") != "ok" or (only and t.get("tier") not in only):
            continue
        model = (t.get("artifact") or {}).get("path") or source
        found.append((t, model))
    if not found:
        raise ValueError(f"{run_dir}: no finished transformers tier" + (f" among {', '.join(only)}" if only else ""))
    depths = set.intersection(*(set((t.get("speed") or {}).keys()) for t, _ in found))
    if depth is None:
        if not depths:
            raise ValueError(f"{run_dir}: the transformers tiers share no speed depth")
        depth = max(int(d) for d in depths)
    if str(depth) not in depths:
        raise ValueError(f"--depth {depth}: not measured by every transformers tier (have {sorted(depths)})")
    order = [t.get("name") for t in (run.get("recipe") or {}).get("tiers") or []]
    found.sort(key=lambda tm: order.index(tm[0]["tier"]) if tm[0]["tier"] in order else len(order))
    rows = [{"tier": t["tier"], "model": model, "dtype": dtype, "decode_mode": t.get("decode_mode"),
             "kv_cache": t.get("kv_cache"),
             "decode_tokens": int(t.get("decode_tokens") or 64),
             "qeval_tokens_per_s": ((t.get("speed") or {}).get(str(depth)) or {}).get("decode_tokens_per_s")}
            for t, model in found]
    return rows, depth


def bare_decode_tokens_per_s(model: Any, depth: int, n_tokens: int, repeats: int, *, device: str = "cuda",
                             backend: str = "inductor", mode: str | None = "reduce-overhead",
                             seed: int = 0) -> list[float]:
    """The bare loop's decode tokens/s, one figure per repeat (module notes): a static cache
    of ``depth + n_tokens`` rounded up to 256, ``depth`` seeded random prompt ids prefilled
    uncompiled, then ``n_tokens - 1`` compiled steps (warmed up first: three steps, CUDA
    graphs record on the second call and replay from the third).

    Raises:
        torch._dynamo.exc.Unsupported: the model breaks the graph (``fullgraph=True``:
            the bare loop is one graph or nothing).
    """
    import torch
    from transformers import StaticCache

    from qeval.engines.hf import cache_kwarg  # the keyword only: `cache` or `past_key_values`
    kwname = cache_kwarg(model)
    n = -(-(depth + n_tokens) // STATIC_CACHE_ROUND) * STATIC_CACHE_ROUND
    torch._dynamo.reset()  # each tier compiles the same model code: no earlier tier's entries count against its limit
    cache = StaticCache(config=model.config, max_cache_len=n)
    step = torch.compile(model, fullgraph=True, dynamic=False, backend=backend, mode=mode)
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, depth), generator=g).to(device)

    out = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first run warms the compiled step up (compiled at this length)
            cache.reset()
            nxt = model(input_ids=ids, **{kwname: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(
                -1, keepdim=True)
            int(nxt)  # the first token on the host: the decode's clock starts here, as qeval's
            times = [time.perf_counter()]
            steps = 3 if r == 0 else n_tokens - 1
            for _ in range(steps):
                nxt = step(input_ids=nxt, **{kwname: cache}, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                int(nxt)  # the host copy synchronises CUDA, as qeval's loop does
                times.append(time.perf_counter())
            if r > 0 and times[-1] > times[0]:
                out.append((len(times) - 1) / (times[-1] - times[0]))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module notes)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a finished qeval run folder (run.json, tiers/)")
    ap.add_argument("--depth", type=int, default=None, help="speed depth to compare at (default: the deepest)")
    ap.add_argument("--tiers", default=None, help="transformers tiers to check (default: every one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting tiers after this many seconds")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: checks on the CPU)")
    ap.add_argument("--goal", type=float, default=GOAL)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (module notes); exit code 0, 1 or 2."""
    a = parse_args(argv)
    if a.repeats < 1:
        refuse(f"--repeats {a.repeats}: at least 1")
    try:
        tiers, depth = hf_tiers(a.run_dir, a.depth, [t.strip() for t in a.tiers.split(",")] if a.tiers else None)
    except ValueError as e:
        refuse(str(e))
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda: torch sees no CUDA device (--device cpu --backend eager checks the script)")
    from qeval.engines.hf import load_hf_model
    t0 = time.time()
    bare: dict[str, float | None] = {}
    why: dict[str, str] = {}
    mode = "reduce-overhead" if (a.device == "cuda" and a.backend == "inductor") else None
    for t in tiers:
        if time.time() - t0 > a.budget_s:
            bare[t["tier"]], why[t["tier"]] = None, f"no time left (--budget-s {a.budget_s:.0f})"
            continue
        if not t["model"] or not Path(t["model"]).is_dir():
            bare[t["tier"]], why[t["tier"]] = None, f"its model folder {t['model']} is not here"
            continue
        if t["kv_cache"] not in (None, "model"):
            bare[t["tier"]], why[t["tier"]] = None, (f"KV cache {t['kv_cache']}: the bare loop's StaticCache is not "
                                                     "this tier's cache (no like-for-like loop)")
            continue
        try:
            model = load_hf_model(t["model"], a.device, t["dtype"])
            figs = bare_decode_tokens_per_s(model, depth, t["decode_tokens"], a.repeats, device=a.device,
                                            backend=a.backend, mode=mode)
            bare[t["tier"]] = statistics.median(figs) if figs else None
        except Exception as e:  # noqa: BLE001 - one tier's failure is its row, the others go on
            bare[t["tier"]] = None
            why[t["tier"]] = f"bare loop failed: {e.__class__.__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        finally:
            model = None
            if a.device == "cuda":
                torch.cuda.empty_cache()
        print(f"{t['tier']:<14} qeval {t['qeval_tokens_per_s'] or float('nan'):9.1f} tok/s   bare "
              f"{bare[t['tier']] or float('nan'):9.1f} tok/s   (decode {t['decode_mode']}, {t['decode_tokens']} "
              f"tokens, depth {depth})", flush=True)
    rows = ratio_rows({t["tier"]: t["qeval_tokens_per_s"] for t in tiers}, bare, a.goal)
    for r in rows:
        r["why"] = why.get(r["tier"])
    lines = proved_lines(rows, depth, a.goal, why)
    print()
    for ln in lines:
        print(ln)
    if a.json is not None:
        a.json.write_text(json.dumps({"depth": depth, "goal": a.goal, "rows": rows, "proved": lines}, indent=1))
    return 0 if all(r["meets_goal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
