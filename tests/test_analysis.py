"""Pareto front, release gate, fallback ladder, capacity plan, run comparison (no model)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qeval.analysis import (analyse_run, compare_markdown, compare_runs,
                            evaluate_gate, fallback_ladder,
                            kv_bytes_per_token_from_config, max_context, max_sequences,
                            param_count_from_config, pareto_front, parse_size)
from qeval.analysis.gate import RULES
from qeval.analysis.plan import PlanTier, build_plan
from qeval.errors import QevalInputError
from qeval.results import TierResult, load_run
from qeval.weight_formats import Dense, FlatBits, kv_format

GIB = 2 ** 30
D = 1024
FIXTURE = Path(__file__).parent / "fixtures" / "run_synthetic"  # a real tiny run: tests/make_run_fixture.py


def typed(tiers: dict[str, dict]) -> dict[str, TierResult]:
    """``{name: tier dict}`` as the :class:`TierResult` models analysis reads."""
    return {n: TierResult.model_validate({"tier": n, "method": "bf16", **t}) for n, t in tiers.items()}


def tier(mem_gib=None, dec=None, kld=None, status="ok", **kw):
    """A minimal tier result (dict form) with figures at depth ``D``; ``kw`` sets other figures."""
    t: dict = {"status": status, "memory": {"peak_bytes": {}}, "speed": {},
               "quality": {"fidelity": {}, "behaviour": {}}}
    if mem_gib is not None:
        t["memory"]["peak_bytes"][str(D)] = int(mem_gib * GIB)
    if dec is not None:
        t["speed"][str(D)] = {"decode_tokens_per_s": dec}
    if kld is not None:
        t["quality"]["fidelity"]["kld_mean"] = kld
    for k, v in kw.items():
        if k in ("same_top_rate", "ppl_ratio"):
            t["quality"]["fidelity"][k] = v
        elif k in ("pass_rate", "pass_ci_low", "flip_rate", "budget_exhausted_rate", "flips_pass_to_fail",
                   "flips_fail_to_pass", "n_compared"):
            t["quality"]["behaviour"][k] = v
        else:
            t[k] = v
    return t


# ---- Pareto -------------------------------------------------------------------------------

def test_front_dominated_names_a_front_dominator():
    tiers = {
        "bf16": tier(4.0, 10.0, None),       # reference: KLD 0 by definition
        "int8": tier(2.0, 15.0, 0.004),
        "bad": tier(2.5, 12.0, 0.05),         # dominated by int8 (and by q4)
        "worse": tier(2.6, 11.0, 0.06),       # dominated by bad, int8, q4: must name a front member
        "q4": tier(1.0, 20.0, 0.03),
    }
    res = pareto_front(typed(tiers), D, "kld_mean", reference="bf16")
    assert res.front == ["bf16", "int8", "q4"]
    assert res.dominated == {"bad": "int8", "worse": "int8"}
    assert res.entry("bf16").quality == 0.0
    assert res.entry("bad").mark == "dominated by int8"


def test_ties_are_all_on_the_front():
    tiers = {"a": tier(2.0, 10.0, 0.01), "b": tier(2.0, 10.0, 0.01), "c": tier(3.0, 9.0, 0.02)}
    res = pareto_front(typed(tiers), D, "kld_mean")
    assert res.front == ["a", "b"]
    assert res.dominated == {"c": "a"}


def test_one_strictly_better_objective_is_enough():
    tiers = {"a": tier(2.0, 10.0, 0.01), "b": tier(2.0, 10.0, 0.011)}
    assert pareto_front(typed(tiers), D).dominated == {"b": "a"}


def test_not_compared_failed_missing_and_no_default_kld_for_non_reference():
    tiers = {"ref": tier(4.0, 10.0, None), "fail": tier(status="failed"), "nb": tier(status="not_built"),
             "nokld": tier(1.0, 30.0, None), "nomem": tier(None, 30.0, 0.01)}
    res = pareto_front(typed(tiers), D, reference="ref")
    assert res.front == ["ref"]
    nc = res.not_compared
    assert nc["fail"] == "status failed" and nc["nb"] == "status not_built"
    assert "kld_mean" in nc["nokld"]
    assert f"peak memory at depth {D}" in nc["nomem"]


def test_pass_rate_is_maximised():
    tiers = {"a": tier(2.0, 10.0, pass_rate=0.9), "b": tier(2.0, 10.0, pass_rate=0.8)}
    res = pareto_front(typed(tiers), D, "pass_rate")
    assert res.front == ["a"] and res.dominated == {"b": "a"}


def test_unknown_quality_metric():
    with pytest.raises(QevalInputError):
        pareto_front(typed({"a": tier(1, 1, 0.1)}), D, "bleu")


# ---- gate -----------------------------------------------------------------------------------

REF = tier(4.0, 10.0, None, pass_rate=0.80, load={"users_at_slo": 2})
# 400 checks paired with the reference: 20 pass->fail, 8 fail->pass (drop 0.03, flip rate 0.07)
CAND = tier(2.0, 20.0, 0.02, same_top_rate=0.92, ppl_ratio=1.02, pass_ci_low=0.70, pass_rate=0.77,
            flip_rate=0.07, flips_pass_to_fail=20, flips_fail_to_pass=8, n_compared=400,
            budget_exhausted_rate=0.05, load={"users_at_slo": 4})
REF["quality"]["long_context"] = {"depths": {str(D): {"recall": 0.90}, "4096": {"recall": 0.5}}}
# 200 questions paired at the gate depth: 10 down, 2 up (drop 0.04); at 4096 all 100 lost
CAND["quality"]["long_context"] = {"depths": {
    str(D): {"recall": 0.86, "recall_ci_low": 0.75, "flips_pass_to_fail": 10, "flips_fail_to_pass": 2,
             "n_compared": 200, "flip_rate": 0.06},
    "4096": {"recall": 0.0, "recall_ci_low": 0.0, "flips_pass_to_fail": 50, "flips_fail_to_pass": 0,
             "n_compared": 100, "flip_rate": 0.5}}}
CAND["quality"]["output_length"] = {"n_answers": 4, "mean_new_tokens": 90.0, "ref_mean_new_tokens": 60.0,
                                   "mean_ratio": 1.5}

# rule: (threshold that passes, threshold that fails) for CAND against REF
RULE_CASES = {
    "max_kld_mean": (0.03, 0.01),
    "min_same_top_rate": (0.90, 0.95),
    "max_ppl_ratio": (1.05, 1.01),
    "min_pass_rate_rel": (0.90, 0.99),        # drop 0.03 <= 0.08 tolerated (seen from 0.017) ; 0.03 > 0.008, p 0.018
    "min_recall_rel": (0.90, 0.99),           # at the gate depth: drop 0.04 <= 0.09 ; 0.04 > 0.009, p 0.019
    "max_flip_rate": (0.15, 0.03),            # 28/400: bounds [0.051, 0.095]
    "max_peak_memory_gib": (2.5, 1.5),
    "max_peak_memory_rel": (0.6, 0.4),        # 2 GiB / 4 GiB = 0.5
    "min_decode_tokens_per_s": (15.0, 25.0),
    "min_decode_rel": (1.5, 2.5),             # 20 / 10 = 2
    "max_budget_exhaustion": (0.10, 0.01),
    "min_users_at_slo_rel": (2.0, 2.5),       # 4 >= 2 x 2 ; 4 < 2.5 x 2
    "max_output_tokens_rel": (1.6, 1.4),      # 90 / 60 new tokens per answer = 1.5
}


def _gate(rules, tiers=None, **kw):
    tiers = tiers if tiers is not None else {"bf16": REF, "cand": CAND}
    return evaluate_gate(None, typed(tiers), {"reference": "bf16", "rules": rules, **kw}, D)


def test_rule_cases_cover_every_gate_rule():
    assert set(RULE_CASES) == set(RULES)


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_each_rule_passes_and_fails(rule):
    ok_t, bad_t = RULE_CASES[rule]
    good = _gate({rule: ok_t}).candidate("cand")
    assert good.passed, good.rules
    bad = _gate({rule: bad_t}).candidate("cand")
    assert not bad.passed
    assert [r.rule for r in bad.failed_rules] == [rule]
    assert "is not" in bad.failed_rules[0].message or "FAILS" in bad.failed_rules[0].message


def test_boundary_value_passes():
    r = _gate({"max_kld_mean": 0.02, "min_decode_rel": 2.0}).candidate("cand")
    assert r.passed


def test_pass_rate_rel_is_paired_with_the_reference_and_its_tolerance_is_relative():
    res = _gate({"min_pass_rate_rel": 0.9}).candidate("cand").rules[1]
    assert res.value == pytest.approx(0.03) and res.threshold == pytest.approx(0.08)  # (1 - 0.9) x 0.8
    assert "reference pass rate 0.800" in res.message and "McNemar exact" in res.message
    ev = res.evidence
    assert ev["n"] == 400 and ev["p_value"] == pytest.approx(0.0178, abs=1e-3) and ev["detectable"] < 0.08
    assert res.outcome == "pass"


MISSING = {  # rule -> a CAND copy without the figure it needs
    "max_kld_mean": ("quality", "fidelity", "kld_mean"),
    "min_same_top_rate": ("quality", "fidelity", "same_top_rate"),
    "max_ppl_ratio": ("quality", "fidelity", "ppl_ratio"),
    "min_pass_rate_rel": ("quality", "behaviour", "flips_pass_to_fail"),
    "min_recall_rel": ("quality", "long_context", "depths", str(D), "flips_pass_to_fail"),
    "max_flip_rate": ("quality", "behaviour", "flips_fail_to_pass"),
    "max_peak_memory_gib": ("memory", "peak_bytes", str(D)),
    "max_peak_memory_rel": ("memory", "peak_bytes", str(D)),
    "min_decode_tokens_per_s": ("speed", str(D)),
    "min_decode_rel": ("speed", str(D)),
    "max_budget_exhaustion": ("quality", "behaviour", "budget_exhausted_rate"),
    "max_output_tokens_rel": ("quality", "output_length", "mean_ratio"),
}


@pytest.mark.parametrize("rule", sorted(MISSING))
def test_missing_metric_fails_closed(rule):
    cand = json.loads(json.dumps(CAND))
    *path, last = MISSING[rule]
    obj = cand
    for k in path:
        obj = obj[k]
    del obj[last]
    res = _gate({rule: RULE_CASES[rule][0]}, {"bf16": REF, "cand": cand}).candidate("cand")
    assert not res.passed
    (r,) = res.failed_rules
    assert r.rule == rule and "missing" in r.message and r.value is None


def test_recall_rel_is_judged_at_the_gate_depth():
    res = _gate({"min_recall_rel": 0.9}).candidate("cand").rules[1]
    assert res.value == pytest.approx(0.04) and res.threshold == pytest.approx(0.09)
    assert res.evidence["n"] == 200 and res.passed
    assert "reference long-context recall 0.900" in res.message
    # the candidate lost every question at 4096; that does not count at the gate depth 1024; at 4096 it fails
    deep = evaluate_gate(None, typed({"bf16": REF, "cand": CAND}),
                         {"reference": "bf16", "rules": {"min_recall_rel": 0.8}}, 4096).candidate("cand")
    assert not deep.passed and deep.rules[1].value == pytest.approx(0.5) and deep.rules[1].outcome == "fail"
    ref = json.loads(json.dumps(REF))
    del ref["quality"]["long_context"]["depths"][str(D)]
    r = _gate({"min_recall_rel": 0.8}, {"bf16": ref, "cand": CAND}).candidate("cand").rules[1]
    assert not r.passed and f"lacks quality.long_context.depths.{D}.recall" in r.message


@pytest.mark.parametrize("rule", ["min_pass_rate_rel", "max_peak_memory_rel", "min_decode_rel", "min_recall_rel"])
def test_relative_rule_without_reference_is_an_error_not_a_fail(rule):
    """A reference with no result, or one that did not finish: qeval could not measure what
    the rule compares with, so the candidate is ERROR (exit 4), never FAIL."""
    rep = _gate({rule: RULE_CASES[rule][0]}, {"cand": CAND})
    res = rep.candidate("cand")
    assert res.verdict == "error" and not res.passed and res.failed_rules == []
    assert res.error == "the reference tier 'bf16' has no result (tiers/bf16.json missing)"
    assert rep.verdict == "error" and rep.exit_code() == 4
    failed_ref = {"bf16": {"status": "failed", "error": "RuntimeError: boom\ntraceback"}, "cand": CAND}
    rep = _gate({rule: RULE_CASES[rule][0]}, failed_ref)
    res = rep.candidate("cand")
    assert res.verdict == "error" and res.failed_rules == [] and rep.exit_code() == 4
    assert res.error == "the reference tier 'bf16' did not finish (status failed: RuntimeError: boom (+1 more lines))"
    (r,) = res.unjudged_rules
    assert r.rule == rule and r.outcome == "not judged" and r.message == "not judged: reference tier 'bf16' has status failed"


def test_reference_that_did_not_finish_makes_every_candidate_an_error():
    """Every candidate ERROR, whatever its own figures and even for absolute rules (the
    run is broken, not the model); the verdict line and the dict say why; exit 4."""
    tiers = {"bf16": {"status": "failed", "error": "ZeroDivisionError: division by zero (at qeval/x.py:3)"},
             "cand": CAND, "bad": tier(9.0, 0.1, 9.0)}  # "bad" would fail every rule if it were judged
    rep = _gate({r: RULE_CASES[r][0] for r in RULES}, tiers)
    why = "the reference tier 'bf16' did not finish (status failed: ZeroDivisionError: division by zero (at qeval/x.py:3))"
    assert [(c.tier, c.verdict, c.error) for c in rep.candidates] == [("cand", "error", why), ("bad", "error", why)]
    for c in rep.candidates:
        assert c.failed_rules == [] and len(c.unjudged_rules) == len(RULES) and not c.passed
        assert c.rules[0].rule == "status" and c.rules[0].outcome == "error" and c.rules[0].message == why
    assert rep.verdict == "error" and rep.exit_code() == 4 and not rep.passed
    assert rep.verdict_line() == f"gate: ERROR over 2 candidates: {why}: nothing was judged (exit 4)"
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["verdict"] == "error" and d["reason"] == why and d["exit_code"] == 4
    assert [c["verdict"] for c in d["candidates"]] == ["error", "error"] and d["candidates"][1]["failed_rules"] == []
    # the same with no rule set at all, and with the reference's result missing
    assert _gate({}, tiers).exit_code() == 4
    assert _gate({"max_kld_mean": 1.0}, {"cand": CAND}).candidate("cand").verdict == "error"


def test_long_error_is_cut_in_the_verdict_line_but_kept_on_the_candidate():
    err = "RuntimeError: " + "x" * 400
    rep = _gate({}, {"bf16": REF, "cand": CAND, "f": {"status": "failed", "error": err}})
    assert len(rep.candidate("f").error) > 290  # short_error's 300 characters
    line = rep.verdict_line()
    assert line.startswith("gate: ERROR over 2 candidates: tier 'f' did not finish (status failed: RuntimeError: xxx")
    assert len(line) < 250 and line.endswith("…): 1 of 2 not judged (f), the other passes (exit 4)"), line


def test_reference_left_out_by_tiers_errors_only_rules_that_read_it():
    """`qeval run --tiers cand` (the reference tier not run): absolute rules are judged
    without it; a rule comparing with the reference tier cannot be, so ERROR."""
    sub = evaluate_gate(None, typed({"cand": CAND}), {"reference": "bf16", "rules": {"max_kld_mean": 0.03}}, D,
                        tiers_run=["cand"])
    assert sub.candidate("cand").verdict == "pass" and sub.exit_code() == 0
    rel = evaluate_gate(None, typed({"cand": CAND}), {"reference": "bf16", "rules": {"min_decode_rel": 0.5}}, D,
                        tiers_run=["cand"])
    assert rel.candidate("cand").error == "the reference tier 'bf16' was not run (--tiers)" and rel.exit_code() == 4


def test_failed_and_not_built_tiers_are_errors_with_every_rule_not_judged():
    tiers = {"bf16": REF, "cand": CAND, "f": {"status": "failed", "error": "boom"},
             "nb": {"status": "not_built", "error": None}}
    rules = {r: RULE_CASES[r][0] for r in RULES}
    rep = _gate(rules, tiers)
    assert rep.candidate("cand").passed and rep.candidate("cand").verdict == "pass"  # the others are judged
    for name in ("f", "nb"):
        c = rep.candidate(name)
        assert c.verdict == "error" and c.failed_rules == []
        assert len(c.rules) == 1 + len(RULES) and not any(r.passed for r in c.rules)
        assert [r.outcome for r in c.rules] == ["error"] + ["not judged"] * len(RULES)
        assert all(r.message == f"not judged: tier has status {c.status}" for r in c.rules[1:])
    assert rep.candidate("f").error == "tier 'f' did not finish (status failed: boom)"
    assert rep.candidate("nb").error == "tier 'nb' did not finish (status not_built)"
    assert rep.verdict == "error" and rep.exit_code() == 4
    assert rep.verdict_line() == ("gate: ERROR over 3 candidates: tier 'f' did not finish (status failed: boom); "
                                  "tier 'nb' did not finish (status not_built): 2 of 3 not judged (f, nb), "
                                  "the other passes (exit 4)")


def test_a_measured_fail_beside_an_error_exits_1():
    """Precedence: 1 when any candidate failed a rule (damage measured), else 4, else 0."""
    tiers = {"bf16": REF, "cand": CAND, "worse": tier(2.0, 20.0, 0.5), "f": {"status": "failed", "error": "boom"}}
    rep = _gate({"max_kld_mean": 0.03}, tiers)
    assert [c.verdict for c in rep.candidates] == ["pass", "fail", "error"]
    assert rep.verdict == "fail" and rep.exit_code() == 1
    assert [r.rule for r in rep.candidate("worse").failed_rules] == ["max_kld_mean"]
    assert rep.verdict_line() == ("gate: FAIL over 3 candidates; not judged: tier 'f' did not finish "
                                  "(status failed: boom) (exit 1)")
    assert rep.reason() == "worse failed max_kld_mean; not judged: tier 'f' did not finish (status failed: boom)"
    del tiers["worse"]
    assert _gate({"max_kld_mean": 0.03}, tiers).exit_code() == 4
    del tiers["f"]
    assert _gate({"max_kld_mean": 0.03}, tiers).exit_code() == 0


def test_errored_tiers_stay_off_the_pareto_front_and_the_ladder():
    """The reference's measure failed: the candidates' own figures exist, but the gate could
    not judge them, so neither the front nor the ladder uses them."""
    from qeval.results import RunInfo
    tiers = typed({"bf16": {"status": "failed", "error": "boom"}, "int8": tier(2.0, 15.0, 0.004),
                   "q4": tier(1.0, 20.0, 0.03)})
    a = analyse_run(RunInfo(recipe={"gate": {"reference": "bf16", "rules": {}}, "speed": {"depths": [D]}}), tiers)
    assert [c.verdict for c in a.gate.candidates] == ["error", "error"]
    assert a.pareto.front == [] and a.pareto.not_compared == {"bf16": "status failed", "int8": "gate error: not judged",
                                                              "q4": "gate error: not judged"}
    assert a.ladder.order == [] and a.gate.passing == []
    # judged, the same tiers are on the front and the ladder
    tiers["bf16"] = typed({"bf16": tier(4.0, 10.0, None)})["bf16"]
    a = analyse_run(RunInfo(recipe={"gate": {"reference": "bf16", "rules": {}}, "speed": {"depths": [D]}}), tiers)
    assert set(a.pareto.front) == {"int8", "q4", "bf16"} - set(a.pareto.dominated) and "q4" in a.pareto.front
    assert set(a.ladder.order) == {"bf16", "int8", "q4"}


def test_failed_tier_is_an_error_even_without_rules_and_absent_candidate_too():
    rep = _gate({}, {"bf16": REF, "cand": CAND, "f": {"status": "failed"}},
                candidates=["cand", "f", "ghost"])
    assert [c.verdict for c in rep.candidates] == ["pass", "error", "error"]
    assert rep.candidate("ghost").rules[0].message == "tier 'ghost' has no result (tiers/ghost.json missing)"
    assert rep.candidate("f").error == "tier 'f' did not finish (status failed)"
    assert rep.exit_code() == 4


def test_subset_run_judges_only_the_candidates_asked_to_run():
    """`qeval run --tiers bf16,cand`: a candidate left out (no result) is "not run", neither
    pass nor fail; the verdict is over the judged ones; an asked-for candidate without a
    result still fails closed."""
    tiers = {"bf16": REF, "cand": CAND}
    rules = {"max_kld_mean": 0.03}
    rep = _gate(rules, tiers, candidates=["cand", "left-out"])
    assert rep.exit_code() == 4  # no subset recorded: the missing candidate did not finish (not judged)
    sub = evaluate_gate(None, typed(tiers), {"reference": "bf16", "rules": rules, "candidates": ["cand", "left-out"]},
                        D, tiers_run=["bf16", "cand"])
    assert [c.verdict for c in sub.candidates] == ["pass", "not run"]
    left = sub.candidate("left-out")
    assert left.not_run and not left.passed and left.rules == [] and left.notes == ["not run (--tiers)"]
    assert [c.tier for c in sub.judged] == ["cand"] and sub.not_run == ["left-out"]
    assert sub.passed and sub.exit_code() == 0
    assert sub.verdict_line() == "gate: PASS over 1 of 2 candidates (not run, --tiers: left-out) (exit 0)"
    d = json.loads(json.dumps(sub.to_dict()))
    assert d["judged"] == 1 and d["not_run"] == ["left-out"] and d["candidates"][1]["verdict"] == "not run"
    # asked to run, but no result: an error even in a subset run (it did not finish)
    ghost = evaluate_gate(None, typed(tiers), {"reference": "bf16", "rules": rules,
                                               "candidates": ["cand", "ghost", "left-out"]},
                          D, tiers_run=["bf16", "cand", "ghost"])
    assert [c.verdict for c in ghost.candidates] == ["pass", "error", "not run"]
    assert "no result" in ghost.candidate("ghost").rules[0].message
    assert ghost.exit_code() == 4 and ghost.verdict_line() == (
        "gate: ERROR over 2 of 3 candidates (not run, --tiers: left-out): tier 'ghost' has no result "
        "(tiers/ghost.json missing): 1 of 2 not judged (ghost), the other passes (exit 4)")
    # a failing judged candidate still fails the subset
    bad = evaluate_gate(None, typed(tiers), {"reference": "bf16", "rules": {"max_kld_mean": 0.01},
                                             "candidates": ["cand", "left-out"]}, D, tiers_run=["bf16", "cand"])
    assert bad.exit_code() == 1
    # a left-out candidate whose result is in the folder (an earlier part of a resumed run) is judged
    both = evaluate_gate(None, typed({**tiers, "left-out": CAND}), {"reference": "bf16", "rules": rules,
                                                                    "candidates": ["cand", "left-out"]},
                         D, tiers_run=["bf16", "cand"])
    assert [c.verdict for c in both.candidates] == ["pass", "pass"]
    # nothing judged (only the reference run): a gate that judges nothing does not pass
    none = evaluate_gate(None, typed({"bf16": REF}), {"reference": "bf16", "rules": rules,
                                                      "candidates": ["cand"]}, D, tiers_run=["bf16"])
    assert none.judged == [] and not none.passed and none.exit_code() == 1
    assert none.verdict_line().startswith("gate: FAIL over 0 of 1 candidates")


def test_exit_code_and_dict_form():
    rep = _gate({"max_kld_mean": 0.03})
    assert rep.exit_code() == 0 and rep.passed
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["passed"] is True and d["candidates"][0]["verdict"] == "pass"
    assert _gate({"max_kld_mean": 0.01}).exit_code() == 1


def test_default_candidates_follow_recipe_order_without_reference():
    recipe = {"tiers": [{"name": "bf16"}, {"name": "z"}, {"name": "a"}]}
    rep = evaluate_gate(recipe, typed({"a": CAND, "z": CAND, "bf16": REF}), {"reference": "bf16"}, D)
    assert [c.tier for c in rep.candidates] == ["z", "a"]


def test_bad_gate_dict_is_input_error():
    with pytest.raises(QevalInputError, match="quality_metric"):
        evaluate_gate(None, {}, {"quality_metric": "bleu"}, D)


# ---- ladder -----------------------------------------------------------------------------------

def test_ladder_order_savings_and_quality_lost():
    tiers = {"bf16": tier(4.0, 10.0, None), "int8": tier(2.0, 15.0, 0.004),
             "q4": tier(1.0, 20.0, 0.03), "bad": tier(0.5, 30.0, 0.2), "f": tier(status="failed")}
    rep = _gate({"max_kld_mean": 0.05}, tiers)
    lad = fallback_ladder(typed(tiers), rep, "kld_mean")
    assert lad.order == ["bf16", "int8", "q4"]
    s = lad.steps
    assert s[0].saved_vs_prev_bytes == 0 and s[0].quality_lost_vs_first == 0
    assert s[1].saved_vs_prev_bytes == 2 * GIB and s[1].saved_vs_prev_pct == pytest.approx(50.0)
    assert s[2].saved_vs_prev_pct == pytest.approx(50.0)
    assert s[2].saved_vs_first_bytes == 3 * GIB and s[2].saved_vs_first_pct == pytest.approx(75.0)
    assert s[2].quality_lost_vs_prev == pytest.approx(0.026)
    assert s[2].quality_lost_vs_first == pytest.approx(0.03)


def test_ladder_pass_rate_loss_is_positive_when_worse_and_unplaced():
    tiers = {"bf16": tier(4.0, 10.0, pass_rate=0.8), "a": tier(2.0, 10.0, pass_rate=0.7),
             "nomem": tier(None, 10.0, pass_rate=0.7)}
    rep = _gate({}, tiers)
    lad = fallback_ladder(typed(tiers), rep, "pass_rate")
    assert lad.order == ["bf16", "a"]
    assert lad.steps[1].quality_lost_vs_prev == pytest.approx(0.1)
    assert "nomem" in lad.unplaced


def test_users_at_slo_rule_fails_closed_without_a_load_sweep():
    tiers = {"bf16": REF, "cand": {**CAND, "load": None}}
    r = _gate({"min_users_at_slo_rel": 0.5}, tiers).candidate("cand")
    assert not r.passed and "no load sweep" in r.failed_rules[0].message
    tiers = {"bf16": {**REF, "load": {"error": "boom", "points": []}}, "cand": CAND}
    r = _gate({"min_users_at_slo_rel": 0.5}, tiers).candidate("cand")
    assert not r.passed and "lacks load.users_at_slo" in r.failed_rules[0].message


def _loaded(mem_gib, kld, users, dec=10.0, **kw):
    return tier(mem_gib, dec, kld, load={"users_at_slo": users, "depth": 256, "max_decode_tokens_per_s": 3.0 * users},
                **kw)


def test_overload_ladder_orders_by_users_at_slo_with_users_gained_memory_and_quality():
    tiers = {"bf16": _loaded(4.0, None, 2), "int8": _loaded(2.0, 0.004, 4), "q4": _loaded(1.0, 0.03, 8),
             "q4kv": _loaded(1.2, 0.035, 8), "noload": tier(0.5, 30.0, 0.01),
             "bad": _loaded(0.5, 0.2, 16)}
    rep = _gate({"max_kld_mean": 0.05}, tiers)
    lad = fallback_ladder(typed(tiers), rep, "kld_mean")
    assert lad.basis == "users_at_slo" and lad.load_depth == 256
    # fewest users first; q4 and q4kv tie on users: better KLD first
    assert lad.order == ["bf16", "int8", "q4", "q4kv"]
    assert lad.unplaced == {"noload": "no load sweep (users at SLO)"}
    s = lad.steps
    assert [x.users_gained_vs_prev for x in s] == [0, 2, 4, 0]
    assert [x.users_gained_vs_first for x in s] == [0, 2, 6, 6]
    assert s[2].saved_vs_prev_bytes == 1 * GIB and s[2].saved_vs_first_pct == pytest.approx(75.0)
    assert s[3].saved_vs_prev_bytes == pytest.approx(-0.2 * GIB, rel=1e-3)  # more memory than the rung above
    assert s[2].quality_lost_vs_prev == pytest.approx(0.026) and s[1].max_decode_tokens_per_s == 12.0
    d = lad.to_dict()
    assert d["basis"] == "users_at_slo" and d["steps"][1]["users_at_slo"] == 4


def test_pareto_can_take_users_at_slo_as_its_speed_objective():
    # int8 decodes faster alone but serves fewer users than q4 at the SLO
    tiers = typed({"bf16": _loaded(4.0, None, 2, dec=10.0), "int8": _loaded(2.0, 0.01, 2, dec=30.0),
                   "q4": _loaded(2.0, 0.01, 6, dec=20.0), "noload": tier(5.0, 50.0, 0.001)})
    by_decode = pareto_front(tiers, D, "kld_mean", reference="bf16")
    assert by_decode.speed == "decode" and "int8" in by_decode.front and "q4" not in by_decode.front
    by_users = pareto_front(tiers, D, "kld_mean", reference="bf16", speed="users_at_slo")
    assert by_users.speed == "users_at_slo" and by_users.front == ["bf16", "q4"]
    assert by_users.dominated == {"int8": "q4"}
    assert "users at SLO" in by_users.not_compared["noload"]
    assert by_users.speed_of(by_users.entry("q4")) == 6
    with pytest.raises(QevalInputError):
        pareto_front(tiers, D, speed="tokens")


# ---- capacity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2 ** 30), ("24GB", 24 * 10 ** 9), ("512MiB", 512 * 2 ** 20),
    ("1073741824", 1073741824), ("1.5 GiB", 3 * 2 ** 29), ("24gib", 24 * 2 ** 30), (4096, 4096),
    ("100B", 100), ("2TiB", 2 * 2 ** 40)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "24G", "24 gigs", "-1GiB", "1.5", "abc", -5, None, True, "1e9"])
def test_parse_size_errors(bad):
    with pytest.raises(QevalInputError):
        parse_size(bad)


QWEN14 = {"model_type": "qwen2", "num_hidden_layers": 48, "num_attention_heads": 40,
          "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120, "intermediate_size": 13824,
          "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 131072}


def test_capacity_arithmetic_against_hand_computation():
    # KV bytes/token = 2 (K,V) * 48 layers * 8 kv heads * 128 head_dim * 2 bytes
    assert kv_bytes_per_token_from_config(QWEN14) == 196608
    # parameters, by hand:
    #   embed = lm_head = 152064 * 5120 = 778,567,680 (untied: both counted)
    #   per layer: q 5120*5120 = 26,214,400; k = v = 5120*1024 = 5,242,880 each; o 26,214,400
    #              q/k/v biases 5120 + 1024 + 1024 = 7,168; MLP 3*5120*13824 = 212,336,640
    #              two RMSNorms 10,240  -> 275,268,608 per layer, * 48 = 13,212,893,184
    #   final norm 5,120 -> total 13,212,893,184 + 1,557,135,360 + 5,120 = 14,770,033,664
    assert param_count_from_config(QWEN14) == 14_770_033_664

    M = 24 * GIB                                   # 25,769,803,776 bytes (usable 1.0 here)
    bf16_t = PlanTier("bf16", "bf16", "hf", "model", Dense(), kv_format("hf", "model"))
    flat_t = PlanTier("w4", "-", "hf", "model", FlatBits(4), kv_format("hf", "model"))
    bf16, w4 = build_plan(config=QWEN14, tiers=[bf16_t, flat_t], memory_bytes=M, usable=1.0, context=32768,
                          users=8).rows
    assert bf16.weights_bytes.source == "estimate" and bf16.fits.source == "estimate"
    assert bf16.weights_bytes.value == 29_540_067_328    # 2 bytes per parameter: does not fit 24 GiB
    assert bf16.kv_budget_bytes.value == 25_769_803_776 - 29_540_067_328 - GIB
    assert bf16.sequences.value == 0 and bf16.max_context_tokens.value == 0 and bf16.fits.value is False
    # weights 14,770,033,664 * 0.5 = 7,385,016,832; free = 25,769,803,776 - 7,385,016,832
    # - 1,073,741,824 = 17,311,045,120. One 32768-token sequence: 196608 * 32768 = 6,442,450,944
    # -> floor(17,311,045,120 / 6,442,450,944) = floor(2.687) = 2 sequences.
    # 8 users: 17,311,045,120 / (196608 * 8 = 1,572,864) = 11,006.1 -> 11,006 tokens each.
    assert w4.weights_bytes.value == 7_385_016_832
    assert w4.kv_budget_bytes.value == 17_311_045_120
    assert w4.sequences.value == 2
    assert w4.max_context_tokens.value == 11_006
    assert w4.fits.value is False                   # 8 x 32768 does not fit


def test_param_count_tied_and_llama_biases():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True}
    per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert param_count_from_config(cfg) == 2 * per_layer + 1000 * 64 + 64
    biased = dict(cfg, attention_bias=True)
    assert param_count_from_config(biased) - param_count_from_config(cfg) == 2 * (64 * 3 + 64)
    with pytest.raises(QevalInputError, match="vocab_size"):
        param_count_from_config({k: v for k, v in cfg.items() if k != "vocab_size"})


def test_capacity_from_run_and_formula_helpers():
    tiers = typed({"a": {"status": "ok", "memory": {"weight_bytes": 2 * GIB, "kv_bytes_per_token": 1024}},
                   "f": {"status": "failed"}, "nokv": {"status": "ok", "memory": {"weight_bytes": GIB}}})
    rows = build_plan(results=tiers, memory_bytes=8 * GIB, usable=1.0, overhead_bytes=GIB, context=4096,
                      users=4).rows
    a = rows[0]
    assert a.weights_bytes.source == "measured" and a.kv_budget_bytes.value == 5 * GIB
    assert a.sequences.value == (5 * GIB) // (1024 * 4096) == 1280 and a.sequences.source == "measured"
    assert a.max_context_tokens.value == (5 * GIB) // (1024 * 4) and a.fits.value
    assert rows[1].sequences.value is None and rows[1].notes[0] == "run: status failed"
    assert rows[2].sequences.value is None and rows[2].kv_bytes_per_token.value is None
    assert max_sequences(GIB, 2 * GIB, 0, 10, 10) == 0
    assert max_context(10_000, 0, 0, 10, 3) == 333
    with pytest.raises(QevalInputError):
        build_plan(results=tiers, memory_bytes=8 * GIB, context=0, users=4)


# ---- the recorded run and compare -------------------------------------------------------------

def test_recorded_run_decisions():
    run, tiers = load_run(FIXTURE)
    a = analyse_run(run, tiers)
    assert a.depth == 48 and a.reference == "bf16" and a.depths == [16, 48]
    assert a.pareto.not_compared == {"awq": "status failed"}  # the tier that failed when recorded
    assert "bf16" in a.pareto.front
    for loser, winner in a.pareto.dominated.items():  # each dominated tier names a front member
        assert winner in a.pareto.front and loser not in a.pareto.front
    assert "awq" not in a.gate.passing and a.gate.exit_code() == 1
    peaks = [tiers[n].memory.peak_bytes["48"] for n in a.ladder.order]
    assert peaks == sorted(peaks, reverse=True) and set(a.ladder.order) <= {"bf16", *a.gate.passing}


def test_compare_runs(tmp_path):
    from qeval.results import RunLayout, read_tier_result, write_tier_result
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(FIXTURE, a)
    shutil.copytree(FIXTURE, b)
    t = read_tier_result(RunLayout(b), "int8")
    before = t.speed["48"].decode_tokens_per_s
    t.speed["48"].decode_tokens_per_s = before + 4.0
    write_tier_result(RunLayout(b), t)
    (b / "tiers" / "gptq.json").unlink()
    rows = compare_runs(a, b)
    by = {r.tier: r for r in rows}
    m = by["int8"].metrics["decode_tokens_per_s"]
    assert (m.a, m.b) == (before, before + 4.0)
    assert m.delta == pytest.approx(4.0) and m.rel == pytest.approx(4.0 / before)
    assert by["int8"].metrics["weight_bytes"].delta == 0
    assert by["gptq"].in_b is False and by["gptq"].metrics["kld_mean"].delta is None
    assert by["bf16"].metrics["kld_mean"].a == 0.0
    md = compare_markdown(rows)
    assert "| int8 |" in md and "+4.00 (" in md and "ok → absent" in md
    md = compare_markdown(rows, str(a), str(b))
    assert md.count(str(a)) == 1 and md.count(str(b)) == 1  # named once, above the table
