"""What a reviewer reads: per-item KLD and the positions of highest KLD, collected during
the teacher-forced fidelity pass of a tier's quality stage (``review/<tier>.json``).

Per answered turn (item, turn): the mean and max KL(P_ref || P_tier) in nats over its
answer positions (the same per-position KLD as :func:`qeval.measure.fidelity.kld_rows`).
Over all items: the ``top`` positions of highest KLD, each with the reference token it
predicts, the text before it and the ``k`` most likely tokens of both sides with their
probabilities, as llama.cpp's ``perplexity --kl-divergence`` reports its worst positions.

Checked first: lm-evaluation-harness ``--log_samples`` keeps per-sample outputs but no
per-position distributions, and inspect_ai logs keep samples, not logits; neither gives
the top tokens at a position, so this small collector is qeval's own.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

#: Positions kept per tier, tokens shown per side, tokens of context before a position.
TOP_POSITIONS = 10
TOP_TOKENS = 5
CONTEXT_TOKENS = 24


class ReviewCollector:
    """Collects per-item KLD and the highest-KLD positions of one tier.

    Feed it with :meth:`add` after each window of the fidelity pass; :meth:`result` gives
    the ``review/<tier>.json`` content (:class:`qeval.results.ReviewFile`).

    Args:
        top: how many positions of highest KLD to keep (over all items).
        k: tokens shown per side at each kept position.
    """

    def __init__(self, top: int = TOP_POSITIONS, k: int = TOP_TOKENS) -> None:
        self.top, self.k = top, k
        self._items: dict[tuple[str, int], list[float]] = {}  # (item, turn) -> [sum, max, n]
        self._heap: list[tuple[float, int, dict]] = []  # min-heap of the largest KLDs
        self._seq = 0

    def add(self, segment: dict, start: int, kld: np.ndarray, ref_logp: np.ndarray,
            tier_logp: np.ndarray) -> None:
        """One window: rows ``[m, vocab]`` predicting answer tokens ``start .. start + m - 1``
        of ``segment`` (a reference segment: item, turn, prompt_ids, answer_ids); ``kld``
        the ``[m]`` per-row KLD in nats."""
        key = (segment["item"], int(segment["turn"]))
        acc = self._items.setdefault(key, [0.0, 0.0, 0])
        if len(kld):
            acc[0] += float(kld.sum())
            acc[1] = max(acc[1], float(kld.max()))
            acc[2] += len(kld)
        floor = self._heap[0][0] if len(self._heap) >= self.top else 0.0
        for r in np.flatnonzero(kld > floor):
            v = float(kld[r])
            if len(self._heap) >= self.top and v <= self._heap[0][0]:
                continue
            j = start + int(r)
            entry = {"item": key[0], "turn": key[1], "position": j, "kld": v,
                     "target_id": int(segment["answer_ids"][j]),
                     "context_ids": (list(segment["prompt_ids"]) + list(segment["answer_ids"][:j]))[-CONTEXT_TOKENS:],
                     "ref_top": _top(ref_logp[r], self.k), "tier_top": _top(tier_logp[r], self.k)}
            self._seq += 1
            item = (v, self._seq, entry)
            if len(self._heap) < self.top:
                heapq.heappush(self._heap, item)
            else:
                heapq.heapreplace(self._heap, item)

    def result(self, decode: Callable[[list[int]], str], token: Callable[[int], str]) -> dict:
        """``{"items": [...], "worst": [...]}`` with token ids turned into text.

        Args:
            decode: token ids -> text (the context before a position).
            token: one token id -> its text (the top tokens and the target).
        """
        items = [{"item": i, "turn": t, "kld_mean": s / n if n else None, "kld_max": mx if n else None,
                  "n_tokens": n} for (i, t), (s, mx, n) in self._items.items()]
        worst = []
        for _, _, e in sorted(self._heap, key=lambda x: -x[0]):
            worst.append({"item": e["item"], "turn": e["turn"], "position": e["position"], "kld": e["kld"],
                          "context": decode(e["context_ids"]), "target": token(e["target_id"]),
                          "ref_top": [[token(i), p] for i, p in e["ref_top"]],
                          "tier_top": [[token(i), p] for i, p in e["tier_top"]]})
        return {"items": items, "worst": worst}


def _top(logp_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one ``[vocab]`` log-probability row: ``[(id, p)]``."""
    row = np.asarray(logp_row, dtype=np.float32)
    k = min(k, len(row))
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx])]
    return [(int(i), float(np.exp(row[i]))) for i in idx]
