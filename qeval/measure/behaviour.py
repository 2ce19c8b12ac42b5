"""Free-running behaviour against the BF16 reference: checks, flips, divergence,
text similarity, budget exhaustion.

- Check pass rate over every check of every answered turn, with a percentile bootstrap
  95 % interval (Efron & Tibshirani 1993) resampling *items* (checks of one conversation
  move together, as they are not independent).
- Flips (Dutta et al. 2024, arXiv:2407.09141): checks whose pass/fail differs from BF16's
  on the same item and turn, pass->fail and fail->pass counted apart.
- A check that could not be decided in bounded time (a regex that timed out, stored as
  ``null``) counts in neither the pass rate nor the flips; ``checks_timed_out`` counts them.
- First divergence: index of the first answer token that differs from BF16's answer.
- ROUGE-L F1 (``rouge-score``) and chrF (``sacrebleu``) of each answer against BF16's
  (Kurtic et al. 2024, arXiv:2411.02355 compare texts this way).
- Budget exhaustion: answers that hit max_new_tokens before a stop token; for a model
  with a thinking section, answers whose final part is empty because thinking spent the
  budget. The thinking is inline (``<think>...</think>`` in the text) or, from a chat
  server's reasoning parser, a field of its own (``reasoning`` / ``reasoning_content``:
  :class:`qeval.engines.openai.ChatAnswer`), carried as a segment's ``reasoning``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_thinking(text: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> tuple[str, str, bool]:
    """Split an answer into ``(thinking, final, has_thinking)``.

    A thinking section opens with ``open_tag`` (or starts implicitly when only ``close_tag``
    appears, as some chat templates put the open tag in the prompt). Without a close tag
    the whole rest is thinking and the final part is empty.
    """
    has_open = open_tag in text
    has_close = close_tag in text
    if not has_open and not has_close:
        return "", text, False
    start = text.index(open_tag) + len(open_tag) if has_open else 0
    if has_close and text.index(close_tag) >= start:
        end = text.index(close_tag)
        return text[start:end], text[end + len(close_tag):], True
    return text[start:], "", True


def thinking_exhausted(text: str, finished: bool, reasoning: str | None = None) -> bool:
    """True when a thinking-model answer has no final part: the thinking section never
    closed, or closed with nothing after it, and generation hit its budget.

    ``reasoning``: the thinking a server returned apart from the answer (None: none was;
    the thinking, if any, is inline in ``text``). With it, ``text`` is the final part (a
    null ``content`` read as ``""``)."""
    if reasoning is not None:
        return bool(reasoning.strip()) and not finished and not text.strip()
    _, final, has = split_thinking(text)
    return has and not finished and not final.strip()


def bootstrap_ci(groups: Sequence[Sequence[bool]], n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """Pass rate over all checks and its percentile bootstrap interval, resampling groups.

    Args:
        groups: per item, the pass/fail of its checks.
    Returns:
        ``(rate, low, high)``; NaN when there are no checks.
    """
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    passes = np.array([sum(bool(x) for x in g) for g in groups], dtype=np.float64)
    if sizes.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    rate = passes.sum() / sizes.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    tot = sizes[idx].sum(axis=1)
    rates = np.where(tot > 0, passes[idx].sum(axis=1) / np.maximum(tot, 1), rate)
    a = (1 - level) / 2
    return float(rate), float(np.quantile(rates, a)), float(np.quantile(rates, 1 - a))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two answers; None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def text_similarity(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float | None, float | None]:
    """Mean ROUGE-L F1 (rouge-score) and corpus chrF (sacrebleu, 0-100) of answers to references."""
    if not hyps:
        return None, None
    from rouge_score import rouge_scorer  # start-up time: only quality stages score text
    from sacrebleu.metrics import CHRF  # start-up time: only quality stages score text

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rl = [scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)]
    chrf = CHRF().corpus_score(list(hyps), [list(refs)]).score
    return float(np.mean(rl)), float(chrf)


def summarise_behaviour(tier_segments: list[dict], ref_segments: dict[tuple, dict],
                        n_boot: int = 1000) -> dict:
    """Behaviour metrics of a tier's free-running answers.

    Args:
        tier_segments: one dict per answered turn: ``item`` (suite/id), ``turn``,
            ``answer_ids``, ``text``, ``finished``, ``checks`` (list of bool, or None for a
            check that timed out); optional ``reasoning``, thinking a server returned apart
            from ``text`` (see :func:`thinking_exhausted`).
        ref_segments: the reference's segments keyed by ``(item, turn)``.
    Returns:
        dict with pass_rate, pass_ci_low/high, n_checks, flips_pass_to_fail,
        flips_fail_to_pass, flip_rate, n_compared (checks decided on both sides: the paired
        test's n), budget_exhausted_rate, thinking_exhausted_rate,
        rouge_l, chrf, first_divergence_mean, identical_rate, n_items, n_answers,
        checks_timed_out.
    """
    by_item: dict[str, list[bool]] = {}
    p2f = f2p = compared = timed_out = 0
    divs: list[int] = []
    identical = 0
    hyps, refs = [], []
    for s in tier_segments:
        by_item.setdefault(s["item"], []).extend(bool(c) for c in s["checks"] if c is not None)
        timed_out += sum(c is None for c in s["checks"])
        ref = ref_segments.get((s["item"], s["turn"]))
        if ref is None:
            continue
        for mine, theirs in zip(s["checks"], ref["checks"]):
            if mine is None or theirs is None:  # not decided on one side: no flip either way
                continue
            compared += 1
            if theirs and not mine:
                p2f += 1
            elif mine and not theirs:
                f2p += 1
        d = first_divergence(s["answer_ids"], ref["answer_ids"])
        if d is None:
            identical += 1
        else:
            divs.append(d)
        hyps.append(s["text"])
        refs.append(ref["text"])
    rate, lo, hi = bootstrap_ci(list(by_item.values()), n_boot)
    n = len(tier_segments)
    rl, chrf = text_similarity(hyps, refs)
    return {
        "pass_rate": rate, "pass_ci_low": lo, "pass_ci_high": hi,
        "n_checks": int(sum(len(v) for v in by_item.values())),
        "flips_pass_to_fail": p2f, "flips_fail_to_pass": f2p,
        "flip_rate": (p2f + f2p) / compared if compared else None, "n_compared": compared,
        "budget_exhausted_rate": sum(not s["finished"] for s in tier_segments) / n if n else None,
        "thinking_exhausted_rate": (sum(thinking_exhausted(s["text"], s["finished"], s.get("reasoning"))
                                        for s in tier_segments) / n if n else None),
        "rouge_l": rl, "chrf": chrf,
        "first_divergence_mean": float(np.mean(divs)) if divs else None,
        "identical_rate": identical / len(hyps) if hyps else None,
        "n_items": len(by_item), "n_answers": n, "checks_timed_out": timed_out,
    }


