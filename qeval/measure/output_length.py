"""Output length per tier: how many new tokens a tier's free-running answers take against
the reference's answers to the same turns.

A quantized tier can talk longer than its reference (loop until the token budget, or, for
a reasoning model, think longer: arXiv:2606.00206 reports a 3-bit AWQ model's chain of
thought growing from 5.2K to 23.4K tokens on MATH-500), so the same decode tokens/s serve
fewer requests. The figures come from the quality stage's free-running answers (the
long_output and multi_turn suites, :func:`qeval.measure.quality.answer_all`); the load
stage's fixed ``output_tokens`` cannot show it.

Definitions (one answered turn = one request):

* **new tokens** of an answer: every token the engine decoded for it, the stop token
  included (``len(answer_ids)``): the decode work the answer cost.
* Only turns answered by both sides count (paired on ``(item, turn)``), so both means run
  over the same requests; ``n_unpaired`` counts the tier's turns without a reference answer.
* **mean / p95 new tokens**: over the paired turns (``numpy.percentile``, linear
  interpolation, as :mod:`qeval.measure.load` computes its percentiles).
* **mean ratio** (``output_tokens_rel`` in :mod:`qeval.metrics`): tier mean / reference mean
  (a ratio of means: the requests/s a tier serves scale with it, see
  :func:`qeval.analysis.capacity.requests_per_s_at_slo`); the p95 ratio likewise.
* **budget hit rate**: share of answers that hit their token budget before a stop token
  (``finished`` false), for the tier and for the reference on the same turns.
* **thinking tokens** (a model with a ``<think>`` section, :func:`qeval.measure.behaviour.split_thinking`):
  tokens of the thinking part, counted by the caller's ``count_tokens`` (the tokenizer),
  mean over the paired answers that have one on either side (0 where a side has none).

Libraries checked: lm-eval and the serving benchmarks (vLLM bench, GuideLLM) report output
lengths of their own runs but never pair them with a reference's; the arithmetic is numpy's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .behaviour import split_thinking


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _p95(xs: Sequence[float]) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), 95)) if len(xs) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _n_new(seg: dict) -> int:
    return len(seg.get("answer_ids") or ())


def _figures(mine: list[dict], refs: list[dict]) -> dict:
    a = [_n_new(s) for s in mine]
    b = [_n_new(s) for s in refs]
    n = len(mine)
    return {"n_answers": n,
            "mean_new_tokens": _mean(a), "p95_new_tokens": _p95(a),
            "ref_mean_new_tokens": _mean(b), "ref_p95_new_tokens": _p95(b),
            "mean_ratio": _ratio(_mean(a), _mean(b)), "p95_ratio": _ratio(_p95(a), _p95(b)),
            "budget_hit_rate": sum(not s["finished"] for s in mine) / n if n else None,
            "ref_budget_hit_rate": sum(not s["finished"] for s in refs) / n if n else None}


def summarise_output_length(tier_segments: list[dict], ref_segments: dict[tuple, dict],
                            count_tokens: Callable[[str], int] | None = None) -> dict[str, Any]:
    """Output-length figures of a tier's free-running answers against the reference's.

    Args:
        tier_segments: one dict per answered turn: ``item``, ``turn``, ``answer_ids`` (new
            token ids, the stop token included), ``finished`` (False: hit the budget),
            ``text``; ``kind`` (suite kind) when known.
        ref_segments: the reference's segments keyed by ``(item, turn)``, same keys.
        count_tokens: tokens of a text (the tokenizer), for the thinking part; None: no
            thinking figures.

    Returns:
        a dict fitting :class:`qeval.results.OutputLength`: ``n_answers`` (paired turns),
        ``n_unpaired``, ``mean_new_tokens``, ``p95_new_tokens``, ``ref_mean_new_tokens``,
        ``ref_p95_new_tokens``, ``mean_ratio``, ``p95_ratio``, ``budget_hit_rate``,
        ``ref_budget_hit_rate`` (tokens, ratios, shares 0..1; None when nothing is paired),
        ``thinking`` (``n_answers``, ``mean_tokens``, ``ref_mean_tokens``, ``mean_ratio``,
        or None when no paired answer has a thinking section or no ``count_tokens``) and
        ``by_kind`` (the same figures per suite kind, without ``thinking``).
    """
    mine: list[dict] = []
    refs: list[dict] = []
    unpaired = 0
    for s in tier_segments:
        r = ref_segments.get((s["item"], s["turn"]))
        if r is None:
            unpaired += 1
            continue
        mine.append(s)
        refs.append(r)
    out = _figures(mine, refs)
    out["n_unpaired"] = unpaired
    kinds: dict[str, tuple[list[dict], list[dict]]] = {}
    for s, r in zip(mine, refs):
        k = s.get("kind") or r.get("kind")
        if k:
            kinds.setdefault(str(k), ([], []))
            kinds[str(k)][0].append(s)
            kinds[str(k)][1].append(r)
    out["by_kind"] = {k: _figures(a, b) for k, (a, b) in sorted(kinds.items())}
    out["thinking"] = None
    if count_tokens is not None:
        pairs = [(split_thinking(s.get("text") or ""), split_thinking(r.get("text") or "")) for s, r in zip(mine, refs)]
        think = [(count_tokens(a[0]) if a[2] else 0, count_tokens(b[0]) if b[2] else 0)
                 for a, b in pairs if a[2] or b[2]]
        if think:
            ma, mb = _mean([x for x, _ in think]), _mean([y for _, y in think])
            out["thinking"] = {"n_answers": len(think), "mean_tokens": ma, "ref_mean_tokens": mb,
                               "mean_ratio": _ratio(ma, mb)}
    return out
