"""Speculative decoding's figures (qeval.measure.speculative): the predictions' arithmetic on
known cases, and on a tiny random llama the measured run against the target alone: lossless
at greedy, full acceptance with the target as its own draft, less with a perturbed draft."""
from __future__ import annotations

import copy

import pytest

from qeval.measure.speculative import (accepted_from_runs, expected_accepted, expected_speedup,
                                       speculative_generate)


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


def test_accepted_from_agreement_runs_caps_each_stretch_at_k():
    # stretches starting at each position: 2, 1, 0, 3, 2, 1 -> capped at 2: 2, 1, 0, 2, 2, 1
    assert accepted_from_runs([True, True, False, True, True, True], 2) == pytest.approx(8 / 6)
    assert accepted_from_runs([True] * 5, 3) == pytest.approx((3 + 3 + 3 + 2 + 1) / 5)
    assert accepted_from_runs([], 2) is None
    # agreement in stretches accepts more than independent positions of the same rate predict
    flags = [True] * 8 + [False] * 2
    assert accepted_from_runs(flags, 4) > expected_accepted(0.8, 4) * 0.9


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
