"""Fidelity of a tier's next-token distributions to the BF16 reference, teacher-forced on
the reference's own tokens.

Definitions (docs/design.md; llama.cpp ``perplexity --kl-divergence`` conventions):
- KLD per position = KL(P_ref || P_tier) = sum_v p_ref(v) (log p_ref(v) - log p_tier(v)),
  natural log (nats), full vocabulary; mean +- standard error, median, p99, max.
- Same top token: share of positions where both argmax tokens agree ("Same top p").
- PPL ratio = exp(mean NLL_tier - mean NLL_ref) over the same tokens, with the standard
  error of the mean NLL difference propagated (delta method).
- Delta p = p_tier(ref token) - p_ref(ref token): mean and RMS.
- Drift: KLD by position bucket inside long outputs (position counted from the first answer token).
- Top-k estimate (engines that see only the top ``k`` log-probabilities of a server:
  ``engine.score_topk``): KL between the two distributions coarse-grained to the tier's
  top ``k`` tokens plus one bucket holding the remaining mass of each,
  sum_{v in S} p_ref(v) log(p_ref(v)/p_tier(v)) + R_ref log(R_ref / R_tier), with S the
  tier's top k, R = 1 - sum_S p. Coarse-graining never increases KL (data-processing
  inequality), so it is a lower bound of the full KLD; ``kld_estimate`` names it with k.

Log-probabilities are stored and compared in float16 (``ROUND``): the reference's are kept
on disk in float16, and the tier's are rounded the same way, so a tier identical to the
reference scores exactly 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .speculative import SPEC_K_MAX, speculative_steps

ROUND = np.float16
DEFAULT_BUCKETS = ((0, 255), (256, 1023), (1024, None))


def bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def topk_kld_rows(ref_logp: np.ndarray, tier_logp: np.ndarray, k: int) -> np.ndarray:
    """Per-row top-``k`` KL estimate (nats; module notes): the tier's top ``k`` tokens of
    each ``[m, vocab]`` row, the remaining mass of both distributions in one bucket."""
    r = ref_logp.astype(np.float64)
    t = tier_logp.astype(np.float64)
    k = max(1, min(int(k), t.shape[1]))
    top = np.argpartition(-t, k - 1, axis=1)[:, :k]
    rs = np.take_along_axis(r, top, axis=1)
    ts = np.take_along_axis(t, top, axis=1)
    p = np.exp(rs)
    head = np.where(p > 0, p * (rs - ts), 0.0).sum(axis=1)
    r_rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
    t_rest = np.clip(1.0 - np.exp(ts).sum(axis=1), 1e-30, 1.0)
    tail = np.where(r_rest > 0, r_rest * (np.log(np.maximum(r_rest, 1e-300)) - np.log(t_rest)), 0.0)
    return np.maximum(head + tail, 0.0)


def kld_rows(ref_logp: np.ndarray, tier_logp: np.ndarray) -> np.ndarray:
    """Per-row KL(P_ref || P_tier) in nats for ``[m, vocab]`` log-probability arrays.

    Terms are computed in float32 (inputs are float16-rounded) and summed in float64;
    terms with p_ref == 0 contribute 0.
    """
    r = ref_logp.astype(np.float32)
    t = tier_logp.astype(np.float32)
    p = np.exp(r)
    d = np.where(p > 0, p * (r - t), np.float32(0.0))
    return np.maximum(d.sum(axis=1, dtype=np.float64), 0.0)


def contiguous_segments(values: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
    """``values`` cut where ``positions`` stop counting up by one (another answer or window):
    each piece one stretch of consecutive positions of one answer. Shapes ``[m]``."""
    pos = np.asarray(positions)
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    return [seg for seg in np.split(np.asarray(values), cuts) if len(seg)]


@dataclass
class FidelityAccumulator:
    """Collects per-position figures window by window; :meth:`summary` gives the metrics.

    Feed it with :meth:`add` (``[m, vocab]`` reference and tier log-probabilities, the
    ``[m]`` reference token ids those rows predict, and each row's position inside its answer).
    ``topk``: the tier's rows are a server's top-k (the rest of their mass spread evenly):
    KLD is the top-k estimate (:func:`topk_kld_rows`), labelled so in the summary.
    """
    buckets: tuple = DEFAULT_BUCKETS
    topk: int | None = None
    kld: list = field(default_factory=list)
    same_top: list = field(default_factory=list)
    nll_ref: list = field(default_factory=list)
    nll_tier: list = field(default_factory=list)
    dp: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    spec: np.ndarray = field(default_factory=lambda: np.zeros((SPEC_K_MAX, 2), dtype=np.int64))

    def add(self, ref_logp: np.ndarray, tier_logp: np.ndarray, target_ids: np.ndarray,
            positions: np.ndarray) -> None:
        ref = ref_logp.astype(ROUND)
        tier = tier_logp.astype(ROUND)
        rows = np.arange(len(target_ids))
        self.kld.append(topk_kld_rows(ref, tier, self.topk) if self.topk else kld_rows(ref, tier))
        self.same_top.append(ref.argmax(axis=1) == tier.argmax(axis=1))
        for seg in contiguous_segments(self.same_top[-1], positions):  # the greedy speculative loop replayed
            for k in range(1, SPEC_K_MAX + 1):
                self.spec[k - 1] += speculative_steps(seg, k)
        lr = ref[rows, target_ids].astype(np.float64)
        lt = tier[rows, target_ids].astype(np.float64)
        self.nll_ref.append(-lr)
        self.nll_tier.append(-lt)
        self.dp.append(np.exp(lt) - np.exp(lr))
        self.pos.append(np.asarray(positions))

    def summary(self) -> dict:
        """Metrics over every position added (keys as in qeval/results.py ``fidelity``)."""
        if not self.kld:
            return {"n_tokens": 0}
        k = np.concatenate(self.kld)
        n = len(k)
        st = np.concatenate(self.same_top)
        d_nll = np.concatenate(self.nll_tier) - np.concatenate(self.nll_ref)
        dp = np.concatenate(self.dp)
        pos = np.concatenate(self.pos)
        mean_d = float(d_nll.mean())
        se_d = float(d_nll.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        ratio = math.exp(mean_d)
        by_bucket = {}
        for lo, hi in self.buckets:
            sel = (pos >= lo) & ((pos <= hi) if hi is not None else True)
            if sel.any():
                by_bucket[bucket_name(lo, hi)] = float(k[sel].mean())
        return {
            "n_tokens": int(n),
            "kld_mean": float(k.mean()),
            "kld_se": float(k.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "kld_median": float(np.median(k)),
            "kld_p99": float(np.percentile(k, 99)),
            "kld_max": float(k.max()),
            "same_top_rate": float(st.mean()),
            "ppl_ratio": ratio,
            "ppl_ratio_se": ratio * se_d,
            "delta_p_mean": float(dp.mean()),
            "delta_p_rms": float(math.sqrt(float((dp ** 2).mean()))),
            "kld_by_bucket": by_bucket,
            "kld_estimate": f"top-{self.topk} (remaining mass in one bucket; a lower bound)" if self.topk else None,
            "kld_topk": self.topk,
            "same_top_spec": [[int(a), int(st)] for a, st in self.spec],
        }


#: Why a served text-mode position has no top-k (the row's words; llama.cpp
#: tools/server/server-context.cpp ``process_token``: a token that leaves the answer text
#: ending in an incomplete UTF-8 character is held back, its log-probabilities with it).
NO_TOPK_REASON = ("the server returned no top-k there (llama-server, for one, holds back a token ending in an "
                  "incomplete UTF-8 character)")


def note_skipped(summary: dict, skipped: int, why: str = NO_TOPK_REASON) -> dict:
    """``summary`` (:meth:`FidelityAccumulator.summary`) with ``skipped`` positions that
    could not be scored said in its ``kld_estimate``: "...; 3 of 500 positions skipped:
    <why>". The figures are over the scored positions only; every position skipped leaves
    ``n_tokens`` 0 and ``not_measured`` saying why. ``skipped`` 0: ``summary`` unchanged.

    Raises:
        ValueError: ``skipped`` is negative.
    """
    if skipped < 0:
        raise ValueError(f"skipped positions must be >= 0, not {skipped}")
    if not skipped:
        return summary
    n = int(summary.get("n_tokens") or 0)
    said = f"{skipped} of {n + skipped} positions skipped: {why}"
    if n == 0:
        return {**summary, "n_tokens": 0, "not_measured": f"fidelity not measured: {said}"}
    return {**summary, "kld_estimate": f"{summary.get('kld_estimate') or 'full vocabulary'}; {said}"}
