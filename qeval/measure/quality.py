"""Answering and scoring primitives of the quality stages (the stage drivers that run them
against a run folder and the artifact cache are :mod:`qeval.quality_stages`).

Answering: :func:`answer_all` makes greedy answers to every turn of every suite item, turn
by turn (in multi-turn conversations a model's own answers become the history, each next
prompt being the previous prompt + the answer's own token ids + the template's
continuation, :func:`continuation_ids`). Each answered turn is one segment
(:class:`qeval.results.Segment`).

Scoring: :func:`conversations` groups segments into sequences scored in one teacher-forced
pass, :func:`iter_answer_logprobs` yields an engine's log-probabilities at the answer
positions, and :func:`fidelity` scores them against the reference's
(:mod:`qeval.measure.fidelity`).

The reference pass computes in ``quality.reference_dtype`` (:func:`resolve_reference_dtype`:
float32 on CPU, the model dtype on CUDA); a tier on a slow kernel may compute quality on its
weights dequantized into a dense model (:func:`choose_quality_engine`: ``quality.engine:
dequantized``, or ``auto`` below ``dequantize_below_tokens_per_s`` measured decode); speed is
always measured with the real kernel.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .prompt_format import render_chat
from .fidelity import FidelityAccumulator
from .review import ReviewCollector
from .suites import load_suite, run_checks


def stop_token_ids(tokenizer: Any, source_path: str) -> list[int]:
    """End-of-answer ids: the tokenizer's eos, generation_config's eos ids, and ``<|im_end|>``
    / ``<|eot_id|>`` / ``<|end|>`` when the vocabulary has them."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        gc = json.loads((Path(source_path) / "generation_config.json").read_text())
        e = gc.get("eos_token_id")
        ids.update([e] if isinstance(e, int) else (e or []))
    except (OSError, ValueError):
        pass
    vocab = tokenizer.get_vocab()
    for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"):
        if t in vocab:
            ids.add(int(vocab[t]))
    return sorted(ids)


def _messages(system: str | None, history: list[tuple[str, str]], user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": user})
    return msgs


def prompt_ids(tokenizer: Any, system: str | None, history: list[tuple[str, str]], user: str) -> list[int]:
    """Token ids of the conversation in the recipe's prompt format (the chat template with a
    generation prompt appended, or plain text: :func:`qeval.measure.prompt_format.render_chat`)."""
    return render_chat(tokenizer, _messages(system, history, user), add_generation_prompt=True, tokenize=True)


_MARK = "\u2063qeval-answer\u2063"


def continuation_ids(tokenizer: Any, system: str | None, user: str, answer_ids: list[int],
                     finished: bool, stop: list[int]) -> list[int] | None:
    """Token ids that follow an assistant answer to start the next user turn, so that a
    conversation's prompt for turn k+1 is exactly turn k's prompt + answer ids + these ids
    (the answers stay the very tokens generated, not a re-tokenization of their text).

    Derived from the prompt format (:func:`qeval.measure.prompt_format.render_chat`): render
    a conversation whose assistant content is a marker, with and without the next user turn,
    and take what follows the marker (plain text: ``"\n\n"`` and the next user turn).
    Returns None when the template does not extend a conversation that way.
    """
    msgs = _messages(system, [("u", _MARK)], "v")
    try:
        closed = render_chat(tokenizer, msgs[:-1], add_generation_prompt=False)
        extended = render_chat(tokenizer, msgs[:-1] + [{"role": "user", "content": user}],
                               add_generation_prompt=True)
    except Exception:
        return None
    head = closed.split(_MARK)[0] + _MARK
    if not extended.startswith(head):
        return None
    ids = tokenizer(extended[len(head):], add_special_tokens=False)["input_ids"]
    ids = [int(i) for i in ids]
    if finished and answer_ids and ids and ids[0] == answer_ids[-1] and answer_ids[-1] in stop:
        ids = ids[1:]  # the answer already ends with the end-of-turn token
    return ids


def load_suites(recipe) -> list[tuple[Any, list]]:
    """``[(suite spec, items)]`` for every conversation suite in the recipe (items validated),
    each cut to its ``fidelity_limit`` first items when set (the items the reference answers);
    long_context suites are run by :mod:`qeval.measure.long_context`."""
    out = []
    for s in recipe.suites:
        if s.kind == "long_context":
            continue
        items = load_suite(recipe.resolve_path(s.path), s.name, multi_turn=(s.kind == "multi_turn"))
        out.append((s, items[: s.fidelity_limit] if s.fidelity_limit else items))
    return out


def answer_all(engine: Any, tokenizer: Any, stop: list[int], suite_items: list[tuple[Any, list]],
               batch_size: int, progress: Callable[[str], None], limit_items: bool,
               short_budget: int | None = None) -> list[dict]:
    """Greedy answers to every turn of every item, turn by turn (own answers become history).

    ``limit_items``: only the first ``limit`` items of each suite (free-running behaviour).
    ``short_budget``: for the reference pass, items beyond a suite's ``limit`` (used for
    teacher-forced fidelity only) are answered with at most this many tokens.

    An engine in ``prompt_mode`` chat (a served tier, :mod:`qeval.engines.openai`) is sent
    each turn's conversation as messages (``engine.generate_messages``: the system prompt, the
    earlier turns with its own answers' text, the user turn); the segment's ``prompt_ids`` stay
    the source template's rendering of the same turn. In ``text`` and ``chat`` modes each
    answer is asked with its own budget and kept whole: its ids are the source tokenizer's
    of the text, whose count may differ from the server's tokens within that budget.

    Returns one segment dict per answered turn: item, suite, turn, prompt_ids, answer_ids,
    finished, text, checks (list of bool; None for a check that timed out), check_details.
    """
    segments: list[dict] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    mode = getattr(engine, "prompt_mode", None) or "tokens"
    for spec, items in suite_items:
        chosen = items[: spec.limit] if (limit_items and spec.limit) else items
        histories: dict[str, list[tuple[str, str]]] = {it.id: [] for it in chosen}
        last: dict[str, tuple[list[int], list[int], bool]] = {}  # item -> (prompt, answer, finished)
        max_turns = max((len(it.turns) for it in chosen), default=0)
        index = {it.id: i for i, it in enumerate(chosen)}
        for t in range(max_turns):
            active = [it for it in chosen if len(it.turns) > t]
            # batches never mix full-budget items (within the limit) and short-budget ones
            cut = spec.limit if (short_budget and spec.limit) else len(chosen)
            groups = [[it for it in active if index[it.id] < cut], [it for it in active if index[it.id] >= cut]]
            batches = [g[b:b + batch_size] for g in groups for b in range(0, len(g), batch_size)]
            done = 0
            for batch in batches:
                b_index = [index[it.id] for it in batch]
                progress(f"{spec.name}: turn {t + 1}, items {done + 1}-{done + len(batch)} of {len(active)}")
                done += len(batch)
                prompts = [_next_prompt(tokenizer, it, t, histories[it.id], last.get(it.id), stop) for it in batch]
                budgets = [_budget(spec, it, i, short_budget) for it, i in zip(batch, b_index)]
                budget = max(budgets)
                if mode == "chat":  # the server renders its own template
                    outs = []
                    for it, bud in zip(batch, budgets):
                        g = engine.generate_messages(_messages(it.system, histories[it.id], it.turns[t].user),
                                                     bud, stop_ids=stop)
                        outs.append((g.token_ids, g.finished))
                elif engine.capabilities.batch:
                    outs = engine.generate_batch(prompts, budget, stop_ids=stop, pad_id=pad)
                else:
                    outs = []
                    for p, bud in zip(prompts, budgets):
                        g = engine.generate(p, bud if mode == "text" else budget, stop_ids=stop)
                        outs.append((g.token_ids, g.finished))
                for it, p, (ids, fin), bud in zip(batch, prompts, outs, budgets):
                    if len(ids) > bud and mode == "tokens":  # a shorter per-item budget inside a batch
                        ids, fin = ids[:bud], False
                    body = ids[:-1] if (fin and ids and ids[-1] in stop) else ids
                    text = tokenizer.decode(body, skip_special_tokens=True)
                    res = run_checks(it.turns[t], text)
                    histories[it.id].append((it.turns[t].user, text))
                    last[it.id] = (p, list(ids), bool(fin))
                    segments.append({"item": f"{spec.name}/{it.id}", "suite": spec.name, "kind": spec.kind,
                                     "turn": t, "prompt_ids": p, "answer_ids": list(ids), "finished": bool(fin),
                                     "text": text, "checks": [r.passed for r in res],
                                     "check_details": [f"{r.kind}: {r.detail}" for r in res]})
    return segments


def _next_prompt(tokenizer: Any, item: Any, t: int, history: list[tuple[str, str]],
                 last: tuple[list[int], list[int], bool] | None, stop: list[int]) -> list[int]:
    """Prompt ids for turn ``t``: the chat template for turn 0; afterwards the previous
    prompt + the previous answer's own ids + :func:`continuation_ids` (re-rendering the
    text history only when the template cannot be extended)."""
    user = item.turns[t].user
    if t > 0 and last is not None:
        prev_prompt, prev_answer, fin = last
        cont = continuation_ids(tokenizer, item.system, user, prev_answer, fin, stop)
        if cont is not None:
            return prev_prompt + prev_answer + cont
    return prompt_ids(tokenizer, item.system, history, user)


def conversations(segments: list[dict]) -> list[list[dict]]:
    """Segments grouped into sequences scored in one pass: the turns of one item whose
    prompts extend each other token for token; any other segment stands alone."""
    groups: list[list[dict]] = []
    by_item: dict[str, list[dict]] = {}
    for s in segments:
        by_item.setdefault(s["item"], []).append(s)
    for segs in by_item.values():
        segs = sorted(segs, key=lambda x: x["turn"])
        cur = [segs[0]]
        for s in segs[1:]:
            prev = cur[-1]
            full = prev["prompt_ids"] + prev["answer_ids"]
            if s["prompt_ids"][:len(full)] == full:
                cur.append(s)
            else:
                groups.append(cur)
                cur = [s]
        groups.append(cur)
    return groups


def iter_answer_logprobs(engine: Any, group: list[dict], window: int):
    """One teacher-forced pass over a conversation; yields ``(segment, j, logp)`` where
    ``logp`` rows predict answer tokens ``j .. j + len(logp) - 1`` of ``segment``."""
    seq = group[-1]["prompt_ids"] + group[-1]["answer_ids"]
    spans = [(s, len(s["prompt_ids"]) - 1, len(s["prompt_ids"]) - 1 + len(s["answer_ids"])) for s in group
             if s["answer_ids"]]
    if not spans:
        return
    first = spans[0][1]
    for start, logp in engine.iter_logprobs(seq, window, first):
        end = start + len(logp)
        for s, a, b in spans:  # answer rows are [a, b) in sequence positions
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                yield s, lo - a, logp[lo - start:hi - start]


def _budget(spec: Any, item: Any, position: int, short_budget: int | None) -> int:
    """Token budget of one answer: the recipe's ``max_new_tokens`` for the suite, or the
    item's own when that is smaller (the recipe caps what a run may spend); capped again
    at ``short_budget`` for items past the suite's behaviour ``limit``."""
    full = min(item.max_new_tokens or spec.max_new_tokens, spec.max_new_tokens)
    if short_budget and spec.limit and position >= spec.limit:
        return min(full, short_budget)
    return full


def resolve_reference_dtype(recipe, device: str) -> str:
    """The dtype the reference pass computes in: ``quality.reference_dtype``, where
    ``auto`` is float32 on CPU and the model dtype (``model.dtype``) on CUDA."""
    rd = recipe.quality.reference_dtype
    if rd == "auto":
        return "float32" if device == "cpu" else recipe.model.dtype
    return rd


def choose_quality_engine(recipe, spec, measured_decode: float | None, has_dequantized: bool) -> str:
    """``real`` or ``dequantized`` for a tier (see module docstring)."""
    choice = spec.quality_engine or recipe.quality.engine
    if choice == "dequantized":
        return "dequantized" if has_dequantized else "real"
    if choice == "real":
        return "real"
    if has_dequantized and measured_decode is not None and measured_decode < recipe.quality.dequantize_below_tokens_per_s:
        return "dequantized"
    return "real"


def fidelity(engine: Any, segments: list[dict], ref_logprobs: np.ndarray, window: int,
             progress: Callable[[str], None] = lambda s: None, review: ReviewCollector | None = None) -> dict:
    """Teacher-forced fidelity of ``engine`` on the reference segments (see fidelity.py);
    ``review`` also collects per-item KLD and the highest-KLD positions (review.py)."""
    acc = FidelityAccumulator(topk=getattr(engine, "score_topk", None))  # engines seeing all logits set none
    groups = conversations(segments)
    for i, group in enumerate(groups):
        progress(f"fidelity: sequence {i + 1}/{len(groups)}")
        for s, j, logp in iter_answer_logprobs(engine, group, window):
            m = len(logp)
            ref = np.asarray(ref_logprobs[s["offset"] + j: s["offset"] + j + m])
            targets = np.asarray(s["answer_ids"][j:j + m], dtype=np.int64)
            acc.add(ref, logp, targets, np.arange(j, j + m))
            if review is not None:
                review.add(s, j, acc.kld[-1], ref, logp)
    return acc.summary()
