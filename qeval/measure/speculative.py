"""Speculative decoding with a quantized tier as the draft of a bigger one: the measured
figures of one (target, draft, draft length) and what the fidelity run predicts for them.

A draft model proposes ``k`` tokens; the target verifies them in one forward pass and keeps
the longest prefix that equals its own greedy choice, plus one token of its own (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318). At greedy the output is the target's own, token for token
(lossless); what changes is how many target forward passes it takes.

Measured, one definition for every engine (:class:`SpeculativeRun`): **drafted** tokens (the
draft's proposals), **accepted** (those the target kept), **verification steps** = new tokens
- accepted (each step, the prefill's first token included, yields its accepted drafts plus one
token of the target's own), **acceptance rate** = accepted / drafted (llama.cpp's "accept"
figure: ``llama-speculative`` prints n_drafted, n_accept and their ratio; llama-server reports
``timings.draft_n`` and ``draft_n_accepted``), **mean accepted per step** = accepted / steps,
decode tokens/s, TTFT, and whether the tokens equal the target's own greedy answer.
Engines: :func:`speculative_generate` (transformers' assisted generation, ``generate(...,
assistant_model=draft)`` with a constant ``num_assistant_tokens``: checked first, and it is
the library's own loop, so nothing of it is written here; drafted = the draft's forward
passes, counted by a hook), and llama-server's ``-md`` draft model
(:mod:`qeval.engines.llamacpp_spec`).

Predicted from the fidelity run's same-top agreement (the draft tier's top token equals the
reference's at a position with probability ``alpha``):

* independent positions: expected accepted per step ``sum_{i=1..k} alpha^i = alpha (1 -
  alpha^k) / (1 - alpha)`` (:func:`expected_accepted`; Leviathan et al. eq. 1 counts the
  target's own token too: ``(1 - alpha^(k+1)) / (1 - alpha)``);
* from agreement along greedy continuations (:func:`speculative_steps`): the loop itself
  replayed along each answer, drafts kept while the draft's teacher-forced top token agrees
  (agreement comes in stretches and a step starts right after a disagreement, which the
  independent formula does not see);
* the speed-up a cost ratio ``c`` (one draft step / one target step) allows:
  ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` (Leviathan et al., theorem 3.8).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence


def expected_accepted(alpha: float, k: int) -> float:
    """Expected draft tokens accepted per verification step (module docstring), for a
    per-token agreement ``alpha`` in [0, 1] and ``k`` >= 1 drafted tokens.

    Raises:
        ValueError: ``alpha`` outside [0, 1] or ``k`` < 1.
    """
    if not 0.0 <= alpha <= 1.0 or k < 1:
        raise ValueError(f"alpha must be in [0, 1] and k >= 1 (got {alpha}, {k})")
    if alpha == 1.0:
        return float(k)
    return alpha * (1.0 - alpha ** k) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.'s expected wall-time speed-up over the target alone: tokens per step
    ``(1 - alpha^(k+1)) / (1 - alpha)`` over the step's cost ``k c + 1`` in target steps, for a
    draft step costing ``cost_ratio`` (c > 0) of a target step.

    Raises:
        ValueError: as :func:`expected_accepted`, or ``cost_ratio`` <= 0.
    """
    if not cost_ratio > 0:
        raise ValueError(f"cost_ratio must be > 0 (got {cost_ratio})")
    return (expected_accepted(alpha, k) + 1.0) / (k * cost_ratio + 1.0)


#: Draft lengths the fidelity run predicts for (``quality.fidelity.same_top_spec``): past 16
#: drafted tokens per step no setting in use gains from knowing more.
SPEC_K_MAX = 16


def speculative_steps(agree: Sequence[bool], k: int) -> tuple[int, int]:
    """The greedy speculative loop replayed along one answer of the target: ``agree[j]`` is
    True where the draft's top token after the answer's first ``j`` tokens is the answer's
    ``j``-th. Each step, from position ``pos``, keeps the drafted tokens while they agree, at
    most ``k`` and at most the tokens left - 1, then the target's own token: ``pos += kept +
    1`` (Leviathan et al. 2023 at greedy; llama.cpp's and transformers' loops draft no more
    than the tokens left). Returns ``(accepted, steps)``; accepted / steps is the expected
    accepted tokens per step, the teacher-forced agreement standing in for the draft's own
    run (equal at greedy, up to rounding).

    Raises:
        ValueError: ``k`` < 1.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    flags = [bool(x) for x in agree]
    n, pos, accepted, steps = len(flags), 0, 0, 0
    while pos < n:
        kept, room = 0, min(k, n - pos - 1)
        while kept < room and flags[pos + kept]:
            kept += 1
        accepted, steps, pos = accepted + kept, steps + 1, pos + kept + 1
    return accepted, steps


def accepted_per_step(answers: Sequence[Sequence[bool]], k: int) -> float | None:
    """Expected accepted draft tokens per step over several answers' agreement
    (:func:`speculative_steps`, accepted and steps summed); None without positions."""
    acc = steps = 0
    for agree in answers:
        a, st = speculative_steps(agree, k)
        acc, steps = acc + a, steps + st
    return acc / steps if steps else None


@dataclass
class SpeculativeRun:
    """One speculative answer (module docstring; seconds, tokens/s).

    Attributes:
        draft_tokens: ``k``, the most tokens the draft proposes per step.
        token_ids: the new tokens.
        new_tokens: how many.
        target_steps: verification steps = new tokens - accepted (the prefill's one included).
        seconds: wall time of the whole answer (prefill included).
        mean_accepted: accepted / target_steps.
        acceptance_rate: accepted / drafted (None when nothing was drafted).
        drafted: tokens the draft proposed.
        accepted: drafted tokens the target kept.
        ttft_s: seconds to the first new token (the target's prefill and the first draft);
            None where the engine does not say.
        decode_tokens_per_s: new tokens after the first / seconds after the first (None where
            there is no TTFT or one token only).
        lossless: the tokens equal ``reference_ids`` (None when none was given).
        details: what ran (engine, its own counters).
    """
    draft_tokens: int
    token_ids: list[int]
    new_tokens: int
    target_steps: int
    seconds: float
    mean_accepted: float
    acceptance_rate: float | None
    drafted: int | None = None
    accepted: int | None = None
    ttft_s: float | None = None
    lossless: bool | None = None
    details: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        """New tokens / seconds (prefill included, as the answer's own rate)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """(new tokens - 1) / (seconds - TTFT): the decode rate after the first token."""
        if self.ttft_s is None or self.new_tokens < 2 or self.seconds <= self.ttft_s:
            return None
        return (self.new_tokens - 1) / (self.seconds - self.ttft_s)

    @classmethod
    def from_counts(cls, *, draft_tokens: int, token_ids: Sequence[int], drafted: int, accepted: int,
                    seconds: float, ttft_s: float | None = None, reference_ids: Sequence[int] | None = None,
                    details: dict | None = None) -> "SpeculativeRun":
        """A run from an engine's drafted and accepted counts (module docstring's definitions).

        Raises:
            ValueError: ``accepted`` > ``drafted``, a negative count, or more accepted than new tokens.
        """
        new = [int(t) for t in token_ids]
        if drafted < 0 or accepted < 0 or accepted > drafted or accepted > len(new):
            raise ValueError(f"drafted {drafted}, accepted {accepted}, new tokens {len(new)}: inconsistent counts")
        steps = max(len(new) - accepted, 1)
        return cls(draft_tokens=int(draft_tokens), token_ids=new, new_tokens=len(new), target_steps=steps,
                   seconds=float(seconds), mean_accepted=accepted / steps,
                   acceptance_rate=accepted / drafted if drafted else None, drafted=int(drafted),
                   accepted=int(accepted), ttft_s=ttft_s,
                   lossless=None if reference_ids is None else new == [int(t) for t in reference_ids],
                   details=dict(details or {}))


class FirstTokenClock:
    """A transformers streamer (the ``BaseStreamer`` interface: put, end) that notes when the
    first new token arrives: generate() puts the prompt first, then the tokens it keeps."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:  # noqa: ANN001 - a tensor
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def speculative_generate(target: Any, draft: Any, prompt_ids: Sequence[int], *, draft_tokens: int,
                         max_new_tokens: int, reference_ids: Sequence[int] | None = None) -> SpeculativeRun:
    """Greedy answer of transformers model ``target`` to ``prompt_ids`` with ``draft`` (a
    model with the same tokenizer) proposing ``draft_tokens`` tokens per step, end of sequence
    ignored (exactly ``max_new_tokens`` tokens).

    Args:
        target, draft: transformers causal LMs on one device.
        prompt_ids: prompt token ids (at least one).
        draft_tokens: ``k`` >= 1 (constant schedule, no confidence cut-off: the k asked is the k run).
        max_new_tokens: new tokens (>= 1).
        reference_ids: the target's own greedy answer; ``lossless`` compares with it.

    Returns:
        :class:`SpeculativeRun`.

    Raises:
        ValueError: an empty prompt, ``draft_tokens`` or ``max_new_tokens`` < 1.
    """
    import torch  # start-up time: torch loads only where a speculative pair is measured

    if not prompt_ids or draft_tokens < 1 or max_new_tokens < 1:
        raise ValueError("a prompt, draft_tokens >= 1 and max_new_tokens >= 1 are needed")
    dev = next(target.parameters()).device
    ids = torch.tensor([[int(t) for t in prompt_ids]], dtype=torch.long, device=dev)
    steps, drafts = [0], [0]
    # transformers' candidate generator reads its draft length, schedule and confidence cut-off
    # from the draft model's own generation config (AssistedCandidateGenerator.__init__), not
    # from generate()'s arguments: set there for this call, put back after
    gc = draft.generation_config
    saved = {k: getattr(gc, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                "assistant_confidence_threshold")}
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = int(draft_tokens), "constant"
    gc.assistant_confidence_threshold = 0.0  # falsy: no confidence stop, the k asked is the k drafted
    hook = target.register_forward_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    dhook = draft.register_forward_hook(lambda *a: drafts.__setitem__(0, drafts[0] + 1))
    first = FirstTokenClock()
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=False,
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0,
                                  streamer=first)
            seconds = time.perf_counter() - t0
    finally:
        hook.remove()
        dhook.remove()
        for k, v in saved.items():
            setattr(gc, k, v)
    new = [int(t) for t in out[0, ids.shape[1]:].tolist()]
    # each target forward verifies one draft and keeps its accepted tokens plus one of its own
    accepted = max(0, min(len(new) - steps[0], drafts[0]))
    return SpeculativeRun.from_counts(
        draft_tokens=draft_tokens, token_ids=new, drafted=drafts[0], accepted=accepted, seconds=seconds,
        ttft_s=None if first.first is None else first.first - t0, reference_ids=reference_ids,
        details={"engine": "transformers assisted generation (constant num_assistant_tokens, no confidence "
                           "cut-off)", "target_forwards": steps[0], "draft_forwards": drafts[0]})


@dataclass
class PairRuns:
    """What one engine measured for one (target, draft) pair on one set of prompts.

    Attributes:
        alone: the target alone, one run per prompt (``draft_tokens`` 0, nothing drafted):
            its greedy answer is the reference of ``lossless``.
        runs: ``{k: one run per prompt}`` with the draft proposing ``k`` tokens per step.
        peak_bytes: peak memory of both models together while serving (None: not measured).
        memory_counter: what ``peak_bytes`` counts (e.g. "process RSS (llama-server)").
        how: what ran, in words (engine, binary or library call, flags).
        details: the engine's own extra figures.
    """
    alone: list[SpeculativeRun]
    runs: dict[int, list[SpeculativeRun]]
    peak_bytes: int | None = None
    memory_counter: str | None = None
    how: str = ""
    details: dict = field(default_factory=dict)
