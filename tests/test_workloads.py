"""The load stage's workloads in the report and the plan (synthetic load sections, no
engine): the shared-prefix, interference and grid tables and plots, and the plan's
prediction beside each grid cell with where it was wrong. The engines' own tests are in
test_prefix_reuse.py (a reused prefix gives the fresh prefill's tokens, both in-process
closed loops), test_engine_openai.py (llama-server ``cache_prompt``) and
test_interference.py (a long prompt per chunk size on both engines, the grid)."""
from __future__ import annotations


def test_report_tables_and_plan_grid_check_on_a_synthetic_section():
    from qeval.analysis.capacity import grid_vs_formula
    from qeval.report.table import burst_table, grid_table, interference_table, prefix_table, workload_markdown
    from qeval.results import TierResult
    pt = {"concurrency": 1, "requests": 1, "ttft_s": {"p50": 0.1, "p95": 0.2}, "itl_s": {"p95": 0.01},
          "decode_tokens_per_s": 50.0, "meets_slo": True, "peak_bytes": 2 * 2**30, "prompt_tokens": 256,
          "cached_prompt_tokens": 128, "prefix_hit_rate": 0.5}
    no = {"concurrency": 2, "admitted": False, "reason": "beyond the model's context", "requests_not_admitted": 2}
    load = {"depth": 256, "output_tokens": 16, "kv_budget_bytes": 1.0 * 2**30, "held_bytes": 2**30,
            "prefix": {"shared_prefix_tokens": 128, "depth": 256, "runs": [
                {"reuse": True, "users_at_slo": 1, "hit_rate": 0.5, "points": [pt]}]},
            "interference": {"prompt_tokens": 512, "streams": 2, "rows": [
                {"chunk_size": None, "window_s": 1.0, "long_ttft_s": 1.0, "streams": 2, "n_gaps": 2, "max_gap_s": 0.9,
                 "lost_tokens_per_s": 10.0, "long_steps": 1}]},
            "grid": {"depths": [{"depth": 256, "users_at_slo": 1, "points": [pt, no]}]},
            "burst": {"requests": 4, "slots": 2, "completed": 3, "refused": 1, "ttft_s": {"p50": 0.5, "p95": 1.1},
                      "ttft_max_s": 1.2, "drain_s": 1.4, "decode_tokens_per_s": 17.0, "scheduling": "continuous"}}
    t = TierResult.model_validate({"tier": "q4", "method": "gguf", "status": "ok", "load": load,
                                   "memory": {"weight_bytes": 100 * 2**20, "kv_bytes_per_token": 4096.0}})
    tiers = {"q4": t}
    assert prefix_table(tiers)[0][:3] == ["q4", "reused", "1"] and prefix_table(tiers)[0][6] == "50%"
    assert interference_table(tiers)[0][3] == "unchunked"
    assert [r[3] for r in grid_table(tiers)] == ["yes", "no"]
    assert burst_table(tiers) == [["q4", "4", "2", "3/1/0/0", "0.5/1.1", "1.2", "1.4", "17", "continuous"]]
    md = "\n".join(workload_markdown(tiers))
    assert "## Load: shared prefix" in md and "## Load: context x concurrency" in md
    assert "## Load: a burst of requests at once" in md
    from types import SimpleNamespace
    from qeval.report.html import _workloads  # every workload section renders, with or without a plot
    sections = {w["key"]: w for w in _workloads(SimpleNamespace(tiers=tiers))}
    assert set(sections) == {"prefix", "interference", "burst", "grid"}
    assert sections["burst"]["src"] is None and sections["grid"]["src"].startswith("data:image/png;base64,")
    from qeval.report import plots
    for fn in (plots.prefix_ttft_png, plots.interference_png, plots.grid_heatmap_png):
        assert fn(tiers)[:8] == b"\x89PNG\r\n\x1a\n", fn.__name__
    assert plots.grid_heatmap_png({}) is None
    checks = grid_vs_formula(tiers, overhead_bytes=2**28, max_context=256)
    # 256 + 16 = 272 tokens is beyond a 256-token model: the formula admits neither cell, the run admitted c=1
    assert [c.predicted_admitted for c in checks] == [False, False] and [c.admitted for c in checks] == [True, False]
    assert checks[0].wrong.startswith("predicted not admitted, the run admitted it") and checks[1].wrong is None
    checks = grid_vs_formula(tiers, overhead_bytes=2**28)  # ~0.36 GiB predicted against 2 GiB measured
    assert checks[0].predicted_admitted is True and "memory formula -8" in checks[0].wrong
    assert checks[1].wrong.startswith("predicted admitted, the run did not: beyond the model's context")
