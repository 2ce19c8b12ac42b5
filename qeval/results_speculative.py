"""The run format's speculative-decoding file: ``stages/_run.speculative.json``, one
:class:`SpecPair` per recipe ``speculative`` pair (part of the run-format module
:mod:`qeval.results`, kept beside it for size; :class:`qeval.results.RunLayout` still owns
every path).

Definitions of every figure: :mod:`qeval.measure.speculative` (drafted, accepted, acceptance
rate = accepted / drafted, verification steps = new tokens - accepted, mean accepted per
step = accepted / steps). Seconds, tokens/s, bytes. What the fidelity run predicts for a pair
is not stored here: :mod:`qeval.analysis.speculative` computes it from the draft tier's
``quality.fidelity.same_top_spec`` whenever a table or report is drawn.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Count = Annotated[int, Field(ge=0, le=1 << 62)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecAlone(_Closed):
    """The target alone at one depth (medians over the prompts)."""
    depth: int
    prompts: Count
    decode_tokens_per_s: float | None = None  # new tokens after the first / seconds after the first
    ttft_s: float | None = None


#: A differing answer counts as lossless up to rounding when the target's own top two logits
#: at its first differing position are at most this many rounding steps (units in the last
#: place of the logits' dtype at that magnitude) apart.
TIE_STEPS = 2


class SpecDivergence(_Closed):
    """Where one speculative answer first differs from the target's own (token positions
    from the answer's start; logits of the target's own pass over its own answer)."""
    prompt: Count
    position: Count
    alone_token: int
    speculative_token: int
    top_logits: list[float] = Field(default_factory=list)  # the target's top two logits there
    rounding_steps: float | None = None                     # their gap in units of the logits' dtype
    # llama.cpp: the largest logit difference between the target's own two passes (one batch,
    # one token at a time) over the positions before it (qeval.engines.llamacpp_spec.first_divergence)
    path_noise: float | None = None
    tie: bool | None = None                                 # a tie by its engine's rule (SpecRow)


class SpecRow(_Closed):
    """The pair at one depth and one draft length ``draft_tokens`` (k): counts summed over the
    prompts, rates their medians."""
    depth: int
    draft_tokens: int
    prompts: Count
    new_tokens: Count                      # over every prompt
    drafted: Count
    accepted: Count
    target_steps: Count                    # verification steps (new tokens - accepted)
    acceptance_rate: float | None = None   # accepted / drafted
    mean_accepted: float | None = None     # accepted / target_steps: draft tokens kept per step
    decode_tokens_per_s: float | None = None
    ttft_s: float | None = None
    speedup: float | None = None           # decode tok/s over the target alone's at this depth
    # expected accepted per step from the draft's teacher-forced agreement with the target's own
    # answers to these prompts (qeval.speculative_stage); the fidelity run's prediction is the report's
    predicted_same_prompts: float | None = None
    lossless_prompts: Count = 0            # prompts whose answer equals the target's own greedy answer
    lossless: bool = False                 # every prompt's did
    # answers that differ first at a tie of the target's own logits (SpecDivergence.tie:
    # transformers, within TIE_STEPS rounding steps of the logits' dtype; llama.cpp, the target's
    # own one-batch and one-token passes pick different tokens there), which the verification
    # pass (several tokens in one forward) may break the other way
    tie_divergences: Count | None = None
    lossless_to_rounding: bool | None = None  # every answer equal, or differing first at such a tie
    divergences: list[SpecDivergence] = Field(default_factory=list)


class SpecPair(_Closed):
    """One target + draft pair as it ran (``error`` and no rows when it could not)."""
    target: str
    draft: str
    engine: str | None = None              # transformers | llama.cpp (qeval.recipe.speculative_engine)
    how: str | None = None                 # what ran, in words (library call or server command)
    draft_tokens: list[int] = Field(default_factory=list)
    depths: list[int] = Field(default_factory=list)
    prompts: Count = 0                     # per depth
    new_tokens: Count = 0                  # per answer
    alone: list[SpecAlone] = Field(default_factory=list)
    rows: list[SpecRow] = Field(default_factory=list)
    peak_bytes: int | None = None          # both models together while serving
    memory_counter: str | None = None      # what peak_bytes counts
    seconds: float | None = None
    error: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    def row(self, depth: int, k: int) -> SpecRow | None:
        """The row at ``depth`` and draft length ``k``, or None."""
        return next((r for r in self.rows if r.depth == depth and r.draft_tokens == k), None)

    def alone_at(self, depth: int) -> SpecAlone | None:
        """The target alone at ``depth``, or None."""
        return next((a for a in self.alone if a.depth == depth), None)

    def best(self, depth: int | None = None) -> SpecRow | None:
        """The fastest lossless row (highest speed-up), at ``depth`` when given; None when none
        has a speed-up."""
        rows = [r for r in self.rows if r.speedup is not None and (depth is None or r.depth == depth)]
        return max(rows, key=lambda r: r.speedup) if rows else None
