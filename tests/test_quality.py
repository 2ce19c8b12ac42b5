"""Fidelity and behaviour metrics: BF16 against itself is exactly 0 with no flips; a
perturbed model has KLD > 0; budget exhaustion counts a scripted thinking output."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qeval.engines.hf import HFEngine, load_hf_model
from qeval.measure.behaviour import (bootstrap_ci, first_divergence, split_thinking, summarise_behaviour,
                                     thinking_exhausted)
from qeval.measure.fidelity import FidelityAccumulator, kld_rows
from qeval.measure.fidelity import ROUND
from qeval.measure.quality import fidelity


def _segments(engine, n=3, prompt_len=6, answer_len=20, seed=0):
    rng = np.random.default_rng(seed)
    segs, off = [], 0
    for i in range(n):
        p = rng.integers(0, engine.vocab_size, prompt_len).tolist()
        a = engine.generate(p, answer_len, ignore_stop=True).token_ids
        segs.append({"item": f"s/{i}", "turn": 0, "prompt_ids": p, "answer_ids": a, "offset": off})
        off += len(a)
    return segs, off


def _ref_logprobs(engine, segs, total, window):
    out = np.zeros((total, engine.vocab_size), dtype=ROUND)
    for s in segs:
        first = len(s["prompt_ids"]) - 1
        for start, lp in engine.iter_logprobs(s["prompt_ids"] + s["answer_ids"], window, first):
            j = start - first
            out[s["offset"] + j: s["offset"] + j + len(lp)] = lp
    return out


@pytest.fixture(scope="module")
def bf16_engine(tiny_llama):
    torch.set_num_threads(1)
    return HFEngine(load_hf_model(str(tiny_llama), "cpu", "bfloat16"), "cpu")


def test_bf16_against_itself_is_exactly_zero(bf16_engine):
    segs, total = _segments(bf16_engine)
    ref = _ref_logprobs(bf16_engine, segs, total, window=8)
    f = fidelity(bf16_engine, segs, ref, window=8)
    assert f["n_tokens"] == total == 60
    assert f["kld_mean"] == 0.0 and f["kld_max"] == 0.0
    assert f["same_top_rate"] == 1.0 and f["ppl_ratio"] == 1.0 and f["delta_p_rms"] == 0.0
    beh_segs = [dict(s, text="x", finished=True, checks=[True, False]) for s in segs]
    b = summarise_behaviour(beh_segs, {(s["item"], s["turn"]): s for s in beh_segs}, n_boot=50)
    assert b["flips_pass_to_fail"] == 0 and b["flips_fail_to_pass"] == 0 and b["flip_rate"] == 0.0
    assert b["identical_rate"] == 1.0 and b["first_divergence_mean"] is None


def test_perturbed_model_has_positive_kld(tiny_llama, bf16_engine):
    segs, total = _segments(bf16_engine)
    ref = _ref_logprobs(bf16_engine, segs, total, window=8)
    noisy = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.model.layers[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    f = fidelity(HFEngine(noisy, "cpu"), segs, ref, window=8)
    assert f["kld_mean"] > 1e-4
    assert f["kld_se"] > 0 and f["kld_max"] >= f["kld_p99"] >= f["kld_median"] >= 0
    assert "0-255" in f["kld_by_bucket"]


def test_kld_matches_hand_computation():
    p = np.log(np.array([[0.5, 0.25, 0.25]]))
    q = np.log(np.array([[0.25, 0.5, 0.25]]))
    # 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2
    assert kld_rows(p, q)[0] == pytest.approx(0.25 * math.log(2))
    acc = FidelityAccumulator()
    acc.add(p, q, np.array([0]), np.array([300]))
    s = acc.summary()
    assert s["same_top_rate"] == 0.0
    assert s["ppl_ratio"] == pytest.approx(2.0, rel=1e-3)  # NLL of token 0: ln 4 vs ln 2
    assert s["delta_p_mean"] == pytest.approx(-0.25, abs=1e-3)
    assert list(s["kld_by_bucket"]) == ["256-1023"]


def test_budget_exhaustion_on_scripted_thinking_outputs():
    ref = {("a", 0): {"checks": [True], "answer_ids": [1, 2], "text": "final"}}
    segs = [
        {"item": "a", "turn": 0, "answer_ids": [1, 2], "text": "<think>long reasoning never closed", "finished": False,
         "checks": [False]},
    ]
    assert split_thinking("<think>abc</think> answer") == ("abc", " answer", True)
    assert split_thinking("reasoning</think>done") == ("reasoning", "done", True)
    assert split_thinking("plain") == ("", "plain", False)
    assert thinking_exhausted("<think>still going", finished=False)
    assert thinking_exhausted("<think>done</think>   ", finished=False)
    assert not thinking_exhausted("<think>done</think> 42", finished=False)
    assert not thinking_exhausted("no thinking here", finished=False)
    b = summarise_behaviour(segs + [
        {"item": "b", "turn": 0, "answer_ids": [3], "text": "<think>x</think>The answer is 7.", "finished": True,
         "checks": [True]},
        {"item": "c", "turn": 0, "answer_ids": [4], "text": "no think, cut off", "finished": False, "checks": [True]},
    ], ref, n_boot=50)
    assert b["budget_exhausted_rate"] == pytest.approx(2 / 3)
    assert b["thinking_exhausted_rate"] == pytest.approx(1 / 3)
    assert b["flips_pass_to_fail"] == 1 and b["flips_fail_to_pass"] == 0


def test_bootstrap_interval_brackets_the_rate():
    groups = [[True, True], [False], [True, False, True], [True]] * 5
    rate, lo, hi = bootstrap_ci(groups, n_boot=500)
    assert rate == pytest.approx(25 / 35)
    assert lo < rate < hi and 0 <= lo and hi <= 1
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_multi_turn_prompts_keep_the_answers_token_exact(tiny_llama, bf16_engine):
    from transformers import AutoTokenizer
    from qeval.measure.quality import answer_all, conversations, fidelity, iter_answer_logprobs
    from qeval.measure.suites import load_suite
    from pathlib import Path
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    items = load_suite(Path(__file__).parent / "data" / "suite_multi.jsonl", "mt", multi_turn=True)

    class Spec:
        name, kind, limit, max_new_tokens = "mt", "multi_turn", None, 6

    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    segs = answer_all(bf16_engine, tok, stop, [(Spec, items)], 4, lambda s: None, limit_items=False)
    assert len(segs) == 6
    for a, b in zip(segs, segs[1:]):
        if a["item"] == b["item"]:
            full = a["prompt_ids"] + a["answer_ids"]
            assert b["prompt_ids"][:len(full)] == full  # the generated ids are inside the next prompt
            tail = tok.decode(b["prompt_ids"][len(full):])
            assert "<|im_start|>user" in tail and tail.rstrip().endswith("<|im_start|>assistant")
    groups = conversations(segs)
    assert [len(g) for g in groups] == [3, 3]  # one scoring pass per conversation
    # one pass per conversation gives the same rows as one pass per turn
    for g in groups:
        joint_rows = list(iter_answer_logprobs(bf16_engine, g, 4))
        for s in g:
            alone = [lp for _, _, lp in iter_answer_logprobs(bf16_engine, [s], 4)]
            joint = [lp for seg, _, lp in joint_rows if seg is s]
            assert sum(len(x) for x in joint) == len(s["answer_ids"])
            np.testing.assert_allclose(np.concatenate(alone), np.concatenate(joint), atol=0.05)


def test_recipe_caps_the_item_budget():
    from qeval.measure.quality import _budget

    class Spec:
        max_new_tokens, limit = 100, 2

    class Item:
        def __init__(self, n):
            self.max_new_tokens = n

    assert _budget(Spec, Item(768), 0, None) == 100   # the recipe caps a longer item budget
    assert _budget(Spec, Item(40), 0, None) == 40     # a smaller item budget applies
    assert _budget(Spec, Item(None), 0, None) == 100
    assert _budget(Spec, Item(768), 5, 32) == 32      # past the limit: fidelity-only answers are short
