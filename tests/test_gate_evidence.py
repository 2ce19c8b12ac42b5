"""The release gate decides on evidence (qeval.analysis.evidence, qeval.analysis.gate):
scripted answer sets where the old unpaired rule flips on two answers and the paired one
does not, a suite too small for its rule ("not enough evidence" and the recipe's policy),
the power figures against their closed forms, and a tier with real damage that every
shipped recipe's gate fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qeval.analysis.evidence import (FAIL, INSUFFICIENT, PASS, detectable_drop, fewest_significant_flips,
                                     mcnemar_worse_p, paired_rate_rule, share_rule)
from qeval.analysis.gate import evaluate_gate
from qeval.measure.behaviour import summarise_behaviour
from qeval.metrics import GATE_RULES, METRICS
from qeval.results import TierResult

REPO = Path(__file__).resolve().parent.parent
D = 1024


def _segments(passes: list[list[bool]]) -> list[dict]:
    """One answered turn per item, its checks as given (answer ids differ per verdict)."""
    return [{"item": f"s/{i}", "turn": 0, "answer_ids": [int(c) for c in checks], "text": "x", "finished": True,
             "checks": list(checks)} for i, checks in enumerate(passes)]


# the default run's shape: 7 items x 3 checks, the reference passing 7 of 21 (33 %)
REF_CHECKS = [[True, False, False]] * 7


def typed(tiers: dict[str, dict]) -> dict[str, TierResult]:
    return {n: TierResult.model_validate({"tier": n, "method": "bf16", **t}) for n, t in tiers.items()}


def _tier(behaviour: dict, kld: float = 0.003) -> dict:
    return {"status": "ok", "memory": {"peak_bytes": {str(D): 1 << 28}}, "speed": {str(D): {"decode_tokens_per_s": 5}},
            "quality": {"fidelity": {"kld_mean": kld, "same_top_rate": 0.98, "ppl_ratio": 1.01},
                        "behaviour": behaviour}}


def _behaviour(cand: list[list[bool]]) -> dict:
    ref = {(s["item"], s["turn"]): s for s in _segments(REF_CHECKS)}
    return summarise_behaviour(_segments(cand), ref, n_boot=1000)


def _unpaired_verdict(b: dict, ref_rate: float, rule: float) -> bool:
    """The rule as it was: the candidate's own bootstrap lower bound >= rule x reference rate."""
    return b["pass_ci_low"] >= rule * ref_rate


def test_two_changed_answers_flip_the_unpaired_rule_but_not_the_paired_one():
    same = _behaviour(REF_CHECKS)                                    # identical to the reference
    two_down = _behaviour([[False, False, False]] * 2 + [[True, False, False]] * 5)
    ref_rate = 7 / 21
    assert same["flips_pass_to_fail"] == 0 and two_down["flips_pass_to_fail"] == 2
    assert same["n_compared"] == two_down["n_compared"] == 21
    # the unpaired own-rate interval passes one and fails the other: two greedy answers decide
    assert _unpaired_verdict(same, ref_rate, 0.5) != _unpaired_verdict(two_down, ref_rate, 0.5)
    ref = _tier(_behaviour(REF_CHECKS))
    gates = [evaluate_gate(None, typed({"bf16": ref, "c": _tier(b)}),
                           {"reference": "bf16", "rules": {"min_pass_rate_rel": 0.5}}, D).candidate("c").rules[1]
             for b in (same, two_down)]
    # the paired rule: the same outcome for both, and it says why (21 checks cannot see 0.167)
    assert [r.outcome for r in gates] == [INSUFFICIENT, INSUFFICIENT]
    assert gates[1].evidence["p_value"] == pytest.approx(0.25)  # McNemar exact: 2 down, 0 up
    assert gates[1].evidence["detectable"] > gates[1].evidence["tolerance"] == pytest.approx(0.5 * ref_rate)
    assert "2 down, 0 up of 21 paired checks" in gates[1].message


@pytest.mark.parametrize("policy,passed,code", [("fail", False, 1), ("warn", True, 0), ("pass", True, 0)])
def test_a_suite_too_small_for_its_rule_says_not_enough_evidence_and_the_policy_decides(policy, passed, code):
    tiers = typed({"bf16": _tier(_behaviour(REF_CHECKS)), "c": _tier(_behaviour(REF_CHECKS))})
    g = evaluate_gate(None, tiers, {"reference": "bf16", "rules": {"min_pass_rate_rel": 0.5, "max_kld_mean": 0.1},
                                    "insufficient_evidence": policy}, D)
    c = g.candidate("c")
    (r,) = c.undecided_rules
    assert r.rule == "min_pass_rate_rel" and r.passed is passed and g.exit_code() == code
    assert f"not enough evidence ({policy})" in r.message
    assert ("1 rule without enough evidence" in g.verdict_line()) and g.to_dict()["candidates"][0][
        "undecided_rules"] == ["min_pass_rate_rel"]


def test_a_suite_with_power_decides_both_ways():
    # 100 items x 3 checks, reference 50 %; tolerance (1 - 0.9) x 0.5 = 0.05, detectable 0.023
    ok = paired_rate_rule(b=9, c=6, n=300, ref_rate=0.5, rule=0.9)
    assert ok.outcome == PASS and ok.detectable < ok.tolerance
    bad = paired_rate_rule(b=40, c=5, n=300, ref_rate=0.5, rule=0.9)
    assert bad.outcome == FAIL and bad.p_value < 1e-6 and bad.observed > bad.tolerance
    # damage shown but inside the tolerance: it passes
    inside = paired_rate_rule(b=20, c=8, n=300, ref_rate=0.5, rule=0.9)
    assert inside.p_value < 0.05 and inside.outcome == PASS
    # a drop beyond the tolerance that the flips do not show: no verdict
    unclear = paired_rate_rule(b=20, c=4, n=300, ref_rate=0.5, rule=0.99)
    assert unclear.p_value < 0.05 and unclear.outcome == FAIL
    murky = paired_rate_rule(b=30, c=16, n=300, ref_rate=0.5, rule=0.99)  # p 0.027, drop 0.047 > 0.005
    assert murky.outcome == FAIL
    murky2 = paired_rate_rule(b=60, c=44, n=300, ref_rate=0.5, rule=0.9)  # drop 0.053 > 0.05, p 0.07
    assert murky2.p_value > 0.05 and murky2.outcome == INSUFFICIENT and "not shown" in murky2.why
    small = paired_rate_rule(b=25, c=16, n=300, ref_rate=0.5, rule=0.99)  # 300 checks cannot see 0.005
    assert small.outcome == INSUFFICIENT and "more than the 0.005 the rule guards against" in small.why


def test_the_power_figures_match_their_closed_forms():
    assert fewest_significant_flips(0.05) == 5 and fewest_significant_flips(0.01) == 7
    assert mcnemar_worse_p(5, 0) == pytest.approx(1 / 32) and mcnemar_worse_p(0, 0) == 1.0
    assert mcnemar_worse_p(2, 1) == pytest.approx(0.5)  # P(X >= 2), X ~ Bin(3, 1/2) = 4/8
    # P(Bin(n, d) >= 5) = 0.8 at the detectable drop, and the drop shrinks as the suite grows
    from scipy.stats import binom
    for n in (21, 100, 400):
        d = detectable_drop(n)
        assert binom.sf(4, n, d) == pytest.approx(0.8, abs=1e-3)
    assert detectable_drop(4) is None and detectable_drop(400) < detectable_drop(100) < detectable_drop(21)


def test_a_share_rule_decides_by_its_exact_bounds():
    assert share_rule(2, 21, 0.5).outcome == PASS
    assert share_rule(15, 21, 0.5).outcome == FAIL
    mid = share_rule(8, 21, 0.5)
    assert mid.outcome == INSUFFICIENT and mid.interval[0] < 0.5 < mid.interval[1]
    assert share_rule(0, 0, 0.5).outcome == INSUFFICIENT


def _recipe_gate(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["gate"]


def _damaged(rule_names: list[str], ref: dict) -> dict:
    """A tier broken the way a wrong quantizer breaks one (scale off by 2x, random weights):
    every figure of every quality rule at its worst plausible value, memory and speed equal
    to the reference's (so only quality can fail it)."""
    t = json.loads(json.dumps(ref))
    t["quality"]["fidelity"] = {"kld_mean": 6.5, "same_top_rate": 0.02, "ppl_ratio": 900.0}
    n = 300
    t["quality"]["behaviour"] = {"pass_rate": 0.0, "pass_ci_low": 0.0, "flips_pass_to_fail": 150,
                                 "flips_fail_to_pass": 0, "n_compared": n, "flip_rate": 0.5,
                                 "budget_exhausted_rate": 1.0, "n_checks": n}
    t["quality"]["output_length"] = {"n_answers": 10, "mean_ratio": 4.0}
    t["quality"]["long_context"] = {"depths": {str(d): {"recall": 0.0, "recall_ci_low": 0.0, "flips_pass_to_fail": 60,
                                                        "flips_fail_to_pass": 0, "n_compared": 80, "flip_rate": 0.75}
                                               for d in (256, 1024, 4096, 8192, 16384, 32768)}}
    return t


def _reference(depth: int) -> dict:
    return {"status": "ok", "memory": {"peak_bytes": {str(depth): 1 << 30}},
            "speed": {str(depth): {"decode_tokens_per_s": 10.0}}, "load": {"users_at_slo": 4},
            "quality": {"fidelity": {}, "behaviour": {"pass_rate": 0.5, "n_checks": 300},
                        "long_context": {"depths": {str(d): {"recall": 0.8} for d in
                                                    (256, 1024, 4096, 8192, 16384, 32768)}}}}


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_fails_a_tier_with_real_damage(recipe):
    gate = _recipe_gate(REPO / "recipes" / recipe)
    depth = int(gate.get("depth") or 1024)
    ref = _reference(depth)
    cand = _damaged(list(gate.get("rules", {})), ref)
    cand["load"] = {"users_at_slo": 4}
    tiers = typed({gate.get("reference", "bf16"): ref, "broken": cand})
    g = evaluate_gate(None, tiers, dict(gate, candidates=["broken"]), depth)
    c = g.candidate("broken")
    quality_rules = [r for r in c.failed_rules if r.rule in GATE_RULES
                     and METRICS[GATE_RULES[r.rule].metric].path[0] == "quality"]
    assert not c.passed and quality_rules, [r.message for r in c.rules]
    # and the primary fidelity rule sees it on its own
    assert any(r.rule in ("max_kld_mean", "min_same_top_rate", "max_ppl_ratio") for r in quality_rules)


def test_a_rule_that_allows_losing_everything_passes_without_power():
    """min_pass_rate_rel 0 tolerates a drop of the whole reference rate: no suite size is
    needed to see that it holds."""
    r = paired_rate_rule(b=3, c=0, n=7, ref_rate=3 / 7, rule=0.0)
    assert r.outcome == PASS and "losing every check" in r.why
