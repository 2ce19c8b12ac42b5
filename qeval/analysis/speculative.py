"""Speculative pairs in decisions: what the fidelity run predicts beside what the stage
measured, and each (pair, draft length) as a row of the tier table.

Prediction (:mod:`qeval.measure.speculative`): at greedy a drafted token is kept while it
equals the target's choice, so the greedy loop replayed along the reference's answers with
the draft tier's teacher-forced top tokens (``quality.fidelity.same_top_spec``: accepted and
steps per k) gives the expected accepted tokens per step; for a k past its table, or a run
from before it existed, the independent estimate from the same-top rate ``alpha``,
``alpha (1 - alpha^k) / (1 - alpha)`` (said so in the table's caption). Both compare
the draft with the *reference* tier; for another target they are an approximation, and the
row says so. A measured figure more than :data:`GAP_FLAG` away from the prediction is
flagged.

A pair's table row (:func:`pair_results`): the target's result with memory = both models
(the stage's peak with both loaded, and the two tiers' weight bytes), speed = the measured
speculative decode tokens/s and TTFT at the pair's depths, quality = the target's (the
output is the target's own, token for token, where the row says lossless).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..measure.speculative import expected_accepted
from ..results import Memory, SpecPair, SpecRow, SpeedPoint, SpeculativeStage, TierResult, get_path

#: |measured / predicted - 1| above this flags a row: the prediction's assumptions (greedy,
#: teacher-forced agreement on the reference's own answers) do not hold for this pair.
GAP_FLAG = 0.25


@dataclass
class PairSummary:
    """One measured pair with its prediction.

    Attributes:
        pair: the stage's record.
        alpha: the draft tier's same-top rate against the reference (None: not measured).
        spec: the draft tier's replayed loop, ``[accepted, steps]`` per k = 1.. (None: not in its result).
        basis: what the prediction compares ("the reference" or "the reference, not the
            target bf16-kv8: an approximation").
    """
    pair: SpecPair
    alpha: float | None = None
    spec: list[list[int]] | None = None
    basis: str = "the reference"
    notes: list[str] = field(default_factory=list)
    draft_quality_engine: str | None = None  # what computed the draft's fidelity (e.g. its dequantized weights)

    @property
    def name(self) -> str:
        """The pair's name in tables: ``target+draft``."""
        return f"{self.pair.target}+{self.pair.draft}"

    def predicted(self, k: int) -> float | None:
        """Expected draft tokens accepted per step at draft length ``k`` (module docstring)."""
        if self.spec and k <= len(self.spec) and self.spec[k - 1][1]:
            accepted, steps = self.spec[k - 1]
            return accepted / steps
        if self.alpha is not None:
            return expected_accepted(self.alpha, k)
        return None

    def predicted_source(self, k: int | None = None) -> str:
        """Where :meth:`predicted` comes from, in words (for ``k``, or the table's k)."""
        if self.spec and (k is None or k <= len(self.spec)) and self.spec[0][1]:
            how = f", the draft's quality engine: {self.draft_quality_engine}" if self.draft_quality_engine else ""
            return (f"the greedy loop replayed along the reference's answers with the draft's teacher-forced top tokens "
                    f"vs {self.basis} ({sum(self.spec[0])} positions{how})")
        if self.alpha is not None:
            return f"the draft's same-top rate vs {self.basis}, positions taken as independent"
        return "no fidelity figures for the draft"

    def gap(self, row: SpecRow) -> float | None:
        """measured / predicted - 1 of the accepted tokens per step (None without both)."""
        p = self.predicted(row.draft_tokens)
        if p is None or row.mean_accepted is None or p <= 0:
            return None
        return row.mean_accepted / p - 1.0

    def flagged(self, row: SpecRow) -> bool:
        """Whether the measured figure is more than :data:`GAP_FLAG` from the prediction."""
        g = self.gap(row)
        return g is not None and abs(g) > GAP_FLAG


def pair_summaries(stage: SpeculativeStage | None, tiers: dict[str, TierResult], reference: str) -> list[PairSummary]:
    """Every pair of the stage file with the draft tier's fidelity figures."""
    out = []
    for p in (stage.pairs if stage is not None else []):
        d = tiers.get(p.draft)
        fid = get_path(d, "quality", "fidelity") if d is not None else None
        basis = "the reference" if p.target == reference else \
            f"the reference {reference}, not the target {p.target}: an approximation"
        out.append(PairSummary(p, alpha=getattr(fid, "same_top_rate", None), spec=getattr(fid, "same_top_spec", None),
                               basis=basis, draft_quality_engine=get_path(d, "quality", "engine") if d is not None else None))
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2 ** 30:.2f}"


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


SPEC_HEADERS = ["pair", "depth", "k", "drafted", "accepted", "acceptance", "accepted/step", "predicted",
                "predicted (these prompts)",
                "decode tok/s", "alone tok/s", "speed-up", "TTFT s", "alone TTFT s", "lossless", "peak GiB (both)",
                "notes"]


def spec_table(summaries: list[PairSummary]) -> list[list[str]]:
    """One row per (pair, depth, k); a pair that did not run: one row with its error."""
    rows = []
    for s in summaries:
        p = s.pair
        if p.error or not p.rows:
            rows.append([s.name] + ["-"] * (len(SPEC_HEADERS) - 2) + [p.error or "no figures"])
            continue
        for r in p.rows:
            alone = p.alone_at(r.depth)
            pred = s.predicted(r.draft_tokens)
            notes = []
            if s.flagged(r):
                notes.append(f"measured {100 * s.gap(r):+.0f}% vs predicted")
            if not r.lossless:
                notes.append(_divergence_text(r))
            rows.append([s.name, str(r.depth), str(r.draft_tokens), str(r.drafted), str(r.accepted),
                         _f(r.acceptance_rate and 100 * r.acceptance_rate, ".0f") + ("%" if r.acceptance_rate is not None else ""),
                         _f(r.mean_accepted), _f(pred), _f(r.predicted_same_prompts), _f(r.decode_tokens_per_s, ".1f"),
                         _f(alone.decode_tokens_per_s if alone else None, ".1f"), _f(r.speedup),
                         _f(r.ttft_s, ".3f"), _f(alone.ttft_s if alone else None, ".3f"),
                         lossless_text(r), _gib(p.peak_bytes), "; ".join(notes)])
    return rows


def lossless_text(r: SpecRow) -> str:
    """``yes`` (every answer the target's own), ``to rounding`` (the others differ first at a
    tie of the target's logits, :data:`~qeval.results_speculative.TIE_STEPS`), else ``no``."""
    if r.lossless:
        return "yes"
    return "to rounding" if r.lossless_to_rounding else "no"


def _divergence_text(r: SpecRow) -> str:
    """Which answers differ from the target's own, and where (the first differing position
    and the target's own top-2 logit gap there, in rounding steps of its logits' dtype)."""
    n = r.prompts - r.lossless_prompts
    where = "; ".join(f"prompt {v.prompt} at token {v.position}: logits {v.top_logits[0]:.4g} vs "
                      f"{v.top_logits[1]:.4g} (" + (f"{v.rounding_steps:.1f} rounding steps" if v.rounding_steps is not None
                                                    else "the target's own passes " + ("disagree" if v.tie else "agree")
                                                    + " there") + ")"
                      for v in r.divergences[:3] if len(v.top_logits) == 2
                      and (v.rounding_steps is not None or v.path_noise is not None))
    tie = f", {r.tie_divergences} at a tie of the target's own logits" if r.tie_divergences else ""
    return f"{n} of {r.prompts} answers differ from the target's own{tie}" + (f" ({where})" if where else "")


def spec_caption(summaries: list[PairSummary]) -> str | None:
    """What the speculative table's figures are, and what ran (None without pairs)."""
    if not summaries:
        return None
    hows = sorted({s.pair.how for s in summaries if s.pair.how})
    bases = sorted({s.predicted_source() for s in summaries})
    slow = [s.name for s in summaries for r in s.pair.rows if r.speedup is not None and r.speedup < 1]
    text = ("The target served with a smaller tier as its draft (k tokens proposed per verification step), greedy. "
            "Acceptance = accepted / drafted; accepted/step = accepted / verification steps; predicted = the "
            f"fidelity run's expectation ({'; '.join(bases)}); predicted (these prompts) = the same expectation from "
            "the draft's teacher-forced agreement with the target's own answers to the measured prompts (a gap "
            "between the two predictions is the texts, the suites' answers against the depth text; one between "
            "this and the measurement is the engine's loop); decode tok/s and speed-up against the target alone "
            "on the same prompts (accepted/step leaves out the target's own token of each step: vLLM's mean "
            "acceptance length is 1 + accepted/step; TTFT with the draft includes the draft's prefill and first "
            "draft); lossless = every answer equals the target's own token for token, \"to rounding\" = "
            "the others first differ at a tie of the target's own top two logits, which the verification pass "
            "(several tokens in one forward) may break the other way: within two rounding steps of the logits' "
            "dtype (transformers); the target's own one-batch and one-token passes picking different tokens there "
            "(llama.cpp). "
            f"Ran: {'; '.join(hows) or 'see the pairs'}.")
    if slow:
        text += (" A speed-up below 1 means each step's k draft forward passes cost more than the target passes "
                 "they save: on a few CPU cores a draft of the same architecture costs nearly what the target "
                 "costs per token (the cost ratio c = draft step / target step is near 1, and speculation pays "
                 "only when (1 + accepted/step) > k c + 1); on a GPU, or with a much smaller draft, c falls.")
    return text


def _lossless_word(rows: list[SpecRow]) -> str:
    if all(r.lossless for r in rows):
        return "lossless"
    if all(r.lossless or r.lossless_to_rounding for r in rows):
        return "lossless up to rounding (differs only at ties of the target's logits)"
    return "NOT lossless"


def pair_results(summaries: list[PairSummary], tiers: dict[str, TierResult]) -> dict[str, TierResult]:
    """Each (pair, k) as a tier-table row (module docstring), named ``target+draft k=K``;
    none for a pair that did not run or whose target has no result."""
    out: dict[str, TierResult] = {}
    for s in summaries:
        p = s.pair
        t, d = tiers.get(p.target), tiers.get(p.draft)
        if p.error or not p.rows or t is None:
            continue
        for k in p.draft_tokens:
            rows = [r for r in p.rows if r.draft_tokens == k]
            if not rows:
                continue
            speed = {str(r.depth): SpeedPoint(decode_tokens_per_s=r.decode_tokens_per_s, ttft_s=r.ttft_s)
                     for r in rows}
            wt = get_path(t, "memory", "weight_bytes")
            wd = get_path(d, "memory", "weight_bytes") if d is not None else None
            kt = get_path(t, "memory", "kv_bytes_per_token")
            kd = get_path(d, "memory", "kv_bytes_per_token") if d is not None else None
            mem = Memory(weight_bytes=(wt + wd) if wt and wd else None,
                         kv_bytes_per_token=(kt + kd) if kt and kd else None,  # both models keep a KV cache
                         peak_bytes={str(r.depth): p.peak_bytes for r in rows} if p.peak_bytes else {},
                         kind=p.memory_counter)
            best = max(rows, key=lambda r: r.depth)
            pred = s.predicted(k)
            alone = p.alone_at(best.depth)
            note = (f"speculative: {p.target} with draft {p.draft}, k={k} ({p.engine}); at depth {best.depth}: "
                    f"{_f(best.mean_accepted)} accepted/step (predicted {_f(pred)}), acceptance "
                    f"{_f(best.acceptance_rate and 100 * best.acceptance_rate, '.0f')}%, decode speed-up "
                    f"{_f(best.speedup)} vs {p.target} alone measured beside it in the same stage "
                    f"({_f(alone.decode_tokens_per_s if alone else None, '.1f')} tok/s; the {p.target} row's figure "
                    f"is its own measure stage's), TTFT {_f(best.ttft_s, '.3f')} s vs "
                    f"{_f(alone.ttft_s if alone else None, '.3f')} s alone (the first token waits for the draft), "
                    f"{_lossless_word(rows)}; memory: both models; quality: {p.target}'s (its answers)")
            backend = f"{t.backend or t.engine} + draft {d.backend or d.engine}" if d is not None else t.backend
            out[f"{s.name} k={k}"] = t.model_copy(update={
                "tier": f"{s.name} k={k}", "speed": speed, "memory": mem, "load": None, "decode_note": note,
                "decode_mode": f"speculative k={k}", "engine": p.engine or t.engine, "backend": backend,
                "quant": None})  # bits per weight: two models, no one figure
    return out
