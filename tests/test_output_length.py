"""Output length per tier on synthetic answers: means, p95, ratios against the reference on
the same turns, budget hits, the thinking part; requests/s at the SLO at the tier's own
output length; the table column and the gate rule's metric."""
from __future__ import annotations

import numpy as np
import pytest

from qeval.analysis.capacity import requests_per_s_at_slo
from qeval.measure.output_length import summarise_output_length
from qeval.metrics import value as metric_value
from qeval.results import OutputLength, TierResult


def _seg(item: str, turn: int, n: int, finished: bool = True, text: str = "x", kind: str = "long_output") -> dict:
    return {"item": item, "turn": turn, "answer_ids": list(range(n)), "finished": finished, "text": text,
            "kind": kind}


def test_means_p95_ratios_and_budget_hits_over_paired_turns():
    ref = [_seg("lo/a", 0, 10), _seg("lo/b", 0, 20), _seg("mt/c", 0, 30, kind="multi_turn"),
           _seg("mt/c", 1, 40, finished=False, kind="multi_turn")]
    mine = [_seg("lo/a", 0, 10), _seg("lo/b", 0, 40, finished=False), _seg("mt/c", 0, 30, kind="multi_turn"),
            _seg("mt/c", 1, 80, finished=False, kind="multi_turn"),
            _seg("lo/zz", 0, 999)]  # no reference answer: left out of every figure
    got = summarise_output_length(mine, {(s["item"], s["turn"]): s for s in ref})
    OutputLength.model_validate(got)  # fits the tier result's typed section
    assert got["n_answers"] == 4 and got["n_unpaired"] == 1
    assert got["mean_new_tokens"] == pytest.approx((10 + 40 + 30 + 80) / 4)
    assert got["ref_mean_new_tokens"] == pytest.approx(25.0)
    assert got["mean_ratio"] == pytest.approx(40.0 / 25.0)
    assert got["p95_new_tokens"] == pytest.approx(np.percentile([10, 40, 30, 80], 95))
    assert got["p95_ratio"] == pytest.approx(np.percentile([10, 40, 30, 80], 95) / np.percentile([10, 20, 30, 40], 95))
    assert got["budget_hit_rate"] == pytest.approx(0.5) and got["ref_budget_hit_rate"] == pytest.approx(0.25)
    lo, mt = got["by_kind"]["long_output"], got["by_kind"]["multi_turn"]
    assert lo["n_answers"] == 2 and lo["mean_ratio"] == pytest.approx(25.0 / 15.0)
    assert mt["n_answers"] == 2 and mt["mean_ratio"] == pytest.approx(55.0 / 35.0)
    assert got["thinking"] is None  # no counter given


def test_thinking_part_counted_with_the_callers_tokenizer():
    words = lambda t: len(t.split())  # noqa: E731  (a stand-in tokenizer: one token per word)
    ref = [_seg("lo/a", 0, 12, text="<think>a b c</think>yes"), _seg("lo/b", 0, 5, text="plain")]
    mine = [_seg("lo/a", 0, 30, text="<think>a b c d e f g h i</think>yes"),
            _seg("lo/b", 0, 40, finished=False, text="<think>x y z")]  # never closed: all thinking
    got = summarise_output_length(mine, {(s["item"], s["turn"]): s for s in ref}, words)
    th = got["thinking"]
    assert th["n_answers"] == 2
    assert th["mean_tokens"] == pytest.approx((9 + 3) / 2) and th["ref_mean_tokens"] == pytest.approx((3 + 0) / 2)
    assert th["mean_ratio"] == pytest.approx(6.0 / 1.5)


def test_nothing_paired_gives_no_figures():
    got = summarise_output_length([_seg("lo/a", 0, 5)], {})
    assert got["n_answers"] == 0 and got["n_unpaired"] == 1 and got["mean_ratio"] is None
    assert got["budget_hit_rate"] is None and got["by_kind"] == {}


def _tier(name: str, rel: float | None, users: int = 4, rps: float = 2.0) -> TierResult:
    q = {"output_length": {"n_answers": 3, "mean_ratio": rel}} if rel is not None else None
    pts = [{"concurrency": c, "admitted": True, "requests_per_s": rps * c / max(users, 1)} for c in (1, 2, 4, 8)]
    return TierResult.model_validate({"tier": name, "method": "gguf", "status": "ok", "quality": q,
                                      "load": {"users_at_slo": users, "output_tokens": 32, "points": pts}})


def test_requests_per_s_at_slo_uses_the_tiers_own_output_length():
    longer = requests_per_s_at_slo("q3", _tier("q3", 1.6))
    assert longer.users_at_slo == 4 and longer.measured_requests_per_s == pytest.approx(2.0)
    assert longer.own_output_tokens == pytest.approx(32 * 1.6)
    assert longer.requests_per_s == pytest.approx(2.0 / 1.6) and longer.basis == "own output length"
    # the reference is 1.0 by definition; a tier without answers keeps the measured figure, said so
    assert requests_per_s_at_slo("bf16", _tier("bf16", None), is_reference=True).requests_per_s == pytest.approx(2.0)
    plain = requests_per_s_at_slo("x", _tier("x", None))
    assert plain.requests_per_s == pytest.approx(2.0) and plain.basis == "recipe output_tokens"
    assert requests_per_s_at_slo("none", _tier("none", 1.2, users=0)) is None


def test_metric_and_ladder_read_the_ratio():
    from qeval.analysis.gate import evaluate_gate
    from qeval.analysis.ladder import fallback_ladder
    t = _tier("q3", 1.6)
    assert metric_value(t, "output_tokens_rel") == pytest.approx(1.6)
    assert metric_value(_tier("bf16", None), "output_tokens_rel", is_reference=True) == 1.0
    tiers = {"bf16": _tier("bf16", None, users=2), "q3": t}
    lad = fallback_ladder(tiers, evaluate_gate(None, tiers, {"reference": "bf16", "rules": {}}, 1024))
    assert lad.basis == "users_at_slo" and lad.order == ["bf16", "q3"]
    steps = {s.tier: s for s in lad.steps}
    assert steps["q3"].requests_per_s_at_slo == pytest.approx(2.0 / 1.6) and steps["q3"].output_tokens_rel == 1.6
    assert steps["bf16"].requests_per_s_at_slo == pytest.approx(2.0) and steps["bf16"].output_tokens_rel == 1.0
