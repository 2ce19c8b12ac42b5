"""Speculative decoding's figures (qeval.measure.speculative): the predictions' arithmetic on
known cases, and on a tiny random llama the measured run against the target alone: lossless
at greedy, full acceptance with the target as its own draft, less with a perturbed draft."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from qeval.measure.speculative import (accepted_per_step, expected_accepted, expected_speedup,
                                       speculative_generate, speculative_steps)


def test_expected_accepted_and_speedup_on_known_cases():
    assert expected_accepted(1.0, 4) == 4.0 and expected_accepted(0.0, 4) == 0.0
    assert expected_accepted(0.5, 2) == pytest.approx(0.5 + 0.25)
    # Leviathan et al.: tokens per step (1 - a^(k+1)) / (1 - a) over the step's cost k c + 1
    assert expected_speedup(0.5, 2, 0.1) == pytest.approx((1 - 0.5 ** 3) / 0.5 / 1.2)
    assert expected_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    with pytest.raises(ValueError):
        expected_accepted(1.5, 2)
    with pytest.raises(ValueError):
        expected_speedup(0.5, 2, 0.0)


def test_the_greedy_loop_replayed_along_an_answer():
    # k=2 along T T F T T T: step 1 keeps 2 (pos 0-1) + own (pos 2); step 2 keeps 2 (3-4) + own (5): 4 in 2 steps
    assert speculative_steps([True, True, False, True, True, True], 2) == (4, 2)
    # a step after a disagreement starts fresh: F T T T with k=4 keeps 0 (own at 0), then 2 (room: 3 - 1) + own
    assert speculative_steps([False, True, True, True], 4) == (2, 2)
    # never more than the tokens left - 1: 5 agreeing tokens, k=8 -> 4 kept + the target's own
    assert speculative_steps([True] * 5, 8) == (4, 1)
    assert speculative_steps([], 2) == (0, 0) and accepted_per_step([[], []], 2) is None
    assert accepted_per_step([[True, True, False], [False]], 2) == pytest.approx(2 / 2)
    # full agreement: every step keeps k (50 = 10 steps of 4 kept + 1 own)
    assert accepted_per_step([[True] * 50], 4) == 4.0
    with pytest.raises(ValueError):
        speculative_steps([True], 0)


def test_speculative_answer_is_the_targets_own_and_counts_its_steps(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompt = list(range(5, 21))
    with torch.inference_mode():
        alone = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                pad_token_id=0)[0, len(prompt):].tolist()
    same = speculative_generate(target, copy.deepcopy(target), prompt, draft_tokens=3, max_new_tokens=12,
                                reference_ids=alone)
    assert same.lossless and same.token_ids == alone and same.new_tokens == 12
    assert same.mean_accepted >= 2.0 and same.target_steps <= 4  # its own draft: every drafted token accepted
    noisy = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.std() if p.numel() > 1 else 1.0))  # a different model
    other = speculative_generate(target, noisy, prompt, draft_tokens=3, max_new_tokens=12, reference_ids=alone)
    assert other.lossless  # greedy verification keeps the target's tokens whatever the draft proposes
    assert other.target_steps > same.target_steps and other.acceptance_rate < same.acceptance_rate
    assert other.new_tokens == 12 and 0.0 <= other.acceptance_rate <= 1.0


# ---- the fidelity run's prediction: agreeing stretches ------------------------------------------

def test_fidelity_summary_replays_the_loop_within_each_answer():
    import numpy as np
    from qeval.measure.fidelity import FidelityAccumulator
    acc = FidelityAccumulator()
    ref = np.log(np.full((6, 3), 1 / 3))
    ref[:, 0] += 0.5  # the reference's top token is 0 everywhere
    tier = ref.copy()
    tier[2, 1] += 1.0  # the tier's top is 1 at row 2
    # rows 0-3 one answer (positions 0..3), rows 4-5 another (positions 0, 1): the loop does not cross
    acc.add(ref, tier, np.zeros(6, dtype=int), np.array([0, 1, 2, 3, 0, 1]))
    s = acc.summary()
    assert s["same_top_rate"] == pytest.approx(5 / 6) and len(s["same_top_spec"]) == 16
    # k=2: answer 1 (T T F T): keep 2 + own, then own -> (2, 2); answer 2 (T T): keep 1 + own -> (1, 1)
    assert s["same_top_spec"][1] == [3, 3]
    # k=1: answer 1: keep 1 + own (0-1), own at 2 (F), own at 3 -> (1, 3); answer 2: (1, 1)
    assert s["same_top_spec"][0] == [2, 4]


# ---- into decisions: the stage file read by the table, the report and the plan ------------------

FIXTURE_RUN = Path(__file__).resolve().parent / "fixtures" / "run_synthetic"


def _pair_run(tmp_path, *, error: str | None = None, lossless: bool = True):
    import shutil
    from qeval.results import RunLayout, SpecAlone, SpecPair, SpecRow, SpeculativeStage, read_tier_result, write_stage
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run_dir)
    layout = RunLayout(run_dir)
    draft = read_tier_result(layout, "int8")
    draft.quality.fidelity.same_top_spec = [[10, 10], [17, 10], [20, 9]]  # k = 1, 2, 3 replayed
    from qeval.results import write_tier_result
    write_tier_result(layout, draft)
    rows = [SpecRow(depth=64, draft_tokens=k, prompts=2, new_tokens=64, drafted=20 * k, accepted=acc,
                    target_steps=64 - acc, acceptance_rate=acc / (20 * k), mean_accepted=acc / (64 - acc),
                    decode_tokens_per_s=tps, ttft_s=0.05, speedup=tps / 40.0, lossless_prompts=2 if lossless else 1,
                    lossless=lossless)
            for k, acc, tps in ((2, 30, 36.0), (4, 40, 30.0))]
    pair = SpecPair(target="bf16", draft="int8", engine="transformers", how="transformers generate(assistant_model)",
                    draft_tokens=[2, 4], depths=[64], prompts=2, new_tokens=32,
                    alone=[SpecAlone(depth=64, prompts=2, decode_tokens_per_s=40.0, ttft_s=0.04)],
                    rows=[] if error else rows, peak_bytes=3 << 28, memory_counter="cpu_vmhwm", error=error)
    write_stage(layout, "_run", "speculative", SpeculativeStage(pairs=[pair]))
    return run_dir


def test_pair_rows_in_the_table_report_and_plan(tmp_path, monkeypatch):
    from qeval.analysis import analyse_run
    from qeval.analysis.plan import build_plan
    from qeval.analysis.speculative import pair_results, pair_summaries
    from qeval.report.html import write_report, write_tables
    from qeval.results import RunLayout, load_run, read_speculative
    run_dir = _pair_run(tmp_path)
    run, tiers = load_run(run_dir)
    stage = read_speculative(RunLayout(run_dir))
    (s,) = pair_summaries(stage, tiers, "bf16")
    # predicted from the replayed loop: k=2 17 / 10; k=4 is past the table: the independent formula
    assert s.predicted(2) == pytest.approx(1.7)
    assert s.predicted(4) == pytest.approx(expected_accepted(tiers["int8"].quality.fidelity.same_top_rate, 4))
    r2, r4 = s.pair.rows
    assert r2.mean_accepted == pytest.approx(30 / 34) and s.flagged(r2)  # 0.88 vs 1.7: flagged
    rows = pair_results([s], tiers)
    row = rows["bf16+int8 k=4"]
    assert row.speed["64"].decode_tokens_per_s == 30.0 and row.memory.peak_bytes["64"] == 3 << 28
    assert row.memory.weight_bytes == tiers["bf16"].memory.weight_bytes + tiers["int8"].memory.weight_bytes
    assert row.quality == tiers["bf16"].quality and "lossless" in row.decode_note
    a = analyse_run(run, tiers, speculative=stage)
    assert [p.name for p in a.speculative] == ["bf16+int8"]
    assert "bf16+int8 k=2" not in a.gate.candidates and all("+" not in e.tier for e in a.pareto.entries)
    md, _ = write_tables(run_dir)
    text = md.read_text()
    assert "| bf16+int8 k=2 |" in text and "## Speculative decoding" in text
    assert "measured -48% vs predicted" in text  # 0.88 / 1.7 - 1
    assert "speed-up below 1 means" in text  # 36 / 40 = 0.9: the caption says why
    html = write_report(run_dir).read_text()
    assert "Speculative decoding: a tier as another&#39;s draft" in html or "Speculative decoding: a tier as another's draft" in html
    # the plan counts both models' weights and KV caches
    run_dict = run.recipe | {"speculative": [{"target": "bf16", "draft": "int8"}]}
    plan = build_plan(results=tiers, run=run.model_copy(update={"recipe": run_dict}))
    prow = {r.tier: r for r in plan.rows}["bf16+int8"]
    assert prow.weights_bytes.value == tiers["bf16"].memory.weight_bytes + tiers["int8"].memory.weight_bytes
    assert prow.kv_bytes_per_token.value == pytest.approx(tiers["bf16"].memory.kv_bytes_per_token
                                                          + tiers["int8"].memory.kv_bytes_per_token)
    assert prow.decode_bound.value is None and "speculative" in prow.decode_bound.formula


def test_a_failed_pair_keeps_the_table_and_says_why(tmp_path):
    from qeval.report.html import write_tables
    run_dir = _pair_run(tmp_path, error="tier int8 did not finish (failed): the pair needs both tiers")
    text = write_tables(run_dir)[0].read_text()
    assert "bf16+int8 k=2" not in text and "tier int8 did not finish" in text
    assert "| bf16 |" in text  # the tiers' rows stand


@pytest.mark.parametrize("kind, emulated", [("avx2", True), ("avx512-bf16", False)])
def test_a_transformers_pair_says_when_its_bf16_models_run_emulated(tiny_llama, monkeypatch, kind, emulated):
    """The pair's ``how`` names each model torch computes in emulated BF16 on this CPU (the
    kind forced at its named point, QEVAL_TEST_CPU_KIND): an AVX2-only CPU's BF16 target
    decodes several times slower there, and the pair's speed is that path's (issue 65)."""
    import torch
    from transformers import AutoModelForCausalLM

    from qeval.engines.hf import HFEngine
    from qeval.recipe import SpeculativeSpec
    from qeval.speculative_stage import transformers_pair
    monkeypatch.setenv("QEVAL_TEST_CPU_KIND", kind)

    def open_tier(name):
        m = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16).eval()
        return HFEngine(m, "cpu", backend="torch-bfloat16")
    pair = SpeculativeSpec(target="bf16", draft="int8", draft_tokens=[2], new_tokens=4, prompts=1)
    out, _, _, notes = transformers_pair(pair, {16: [list(range(5, 21))]}, open_tier, "cpu", lambda s: None)
    assert out[16].runs[2][0].new_tokens == 4
    want = [f"{t}: bfloat16 emulated on this CPU (no native instructions): torch's CPU path" for t in ("bf16", "int8")]
    assert notes == (want if emulated else [])
