"""The speculative stage (run-wide, timed, after every tier's stages): each recipe
``speculative`` pair measured on the engine that holds both models, written to
``stages/_run.speculative.json`` (:class:`qeval.results.SpeculativeStage`).

Per pair, at each depth (``depths``, default ``speed.depths``), on ``prompts`` prompts of
exactly that many tokens cut from ``speed.depth_text`` at different offsets:

* the target alone: its greedy answer of ``new_tokens`` tokens (end of sequence ignored),
  TTFT and decode tokens/s;
* for each draft length k: the speculative answer, its drafted and accepted tokens, TTFT,
  decode tokens/s, the speed-up over the target alone, and whether it equals the target's
  own answer token for token (lossless at greedy); where it does not, the first differing
  position with the target's own top two logits there: a gap of one or two rounding steps of
  the logits' dtype is a tie that the verification pass (several tokens in one forward, other
  matmul shapes, other rounding) may break the other way, seen on SmolLM2 in BF16 (logits
  12.8125 and 12.75: one BF16 step); a wider gap is a real difference;
* the draft's teacher-forced agreement with the target's own answers to these prompts, as
  a second prediction beside the fidelity run's (``predicted_same_prompts``): a gap between
  the two predictions is the texts (the suites' answers against the depth text), a gap
  between this one and the measurement is the engine's loop;
* peak memory with both models loaded (the process's VmHWM above the baseline taken before
  they load on the CPU; torch's peak allocation on CUDA; llama-server's own RSS).

Engines: transformers (:func:`qeval.measure.speculative.speculative_generate`, both tiers
opened by their tier methods as the measure stage opens them) and llama.cpp
(:func:`qeval.engines.llamacpp_spec.speculative_server`, one llama-server with ``-md``). A pair
that fails records its error and the next one runs; a pair whose target or draft tier failed
is not run (its error says which).
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from .engines.hf import pick_device
from .measure.memory import PeakMemory, release_freed_memory, rss_bytes
from .measure.speculative import FirstTokenClock, PairRuns, SpeculativeRun, accepted_per_step, speculative_generate
from .measure.speed import depth_prompt_ids
from .recipe import Recipe, SpeculativeSpec, speculative_depths, speculative_engine
from .results import (STATUS_OK, RunLayout, SpecAlone, SpecDivergence, SpecPair, SpecRow, read_stage, read_tier_result,
                      stage_done)
from .results_speculative import TIE_STEPS
from .tiers import get_method


def pair_prompts(tokenizer: Any, text: str | Path, depth: int, n: int) -> list[list[int]]:
    """``n`` prompts of exactly ``depth`` token ids from the depth text, the i-th starting
    ``i x depth / 2`` tokens in (the text tiled as :func:`~qeval.measure.speed.depth_prompt_ids`
    tiles it), so they differ yet come from one text."""
    base = depth_prompt_ids(tokenizer, text, depth + (n - 1) * max(1, depth // 2))
    step = max(1, depth // 2)
    return [base[i * step:i * step + depth] for i in range(n)]


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(pair: SpeculativeSpec, depth: int, runs: PairRuns) -> tuple[SpecAlone, list[SpecRow]]:
    """The stage file's figures at one depth from an engine's :class:`PairRuns` (counts
    summed over prompts, rates their medians; speed-up = the medians' ratio)."""
    alone_tps = _median([r.decode_tokens_per_s for r in runs.alone])
    agree = runs.details.get("agreement") or []
    alone = SpecAlone(depth=depth, prompts=len(runs.alone), decode_tokens_per_s=alone_tps,
                      ttft_s=_median([r.ttft_s for r in runs.alone]))
    rows = []
    for k in sorted(runs.runs):
        rs = runs.runs[k]
        drafted = sum(r.drafted or 0 for r in rs)
        accepted = sum(r.accepted or 0 for r in rs)
        steps = sum(r.target_steps for r in rs)
        tps = _median([r.decode_tokens_per_s for r in rs])
        same = sum(1 for r in rs if r.lossless)
        divs = [r.details.get("divergence") for r in rs if not r.lossless and r.details.get("divergence")]
        ties = sum(1 for v in divs if v.tie)
        checked = bool(runs.details.get("checks_ties"))
        rows.append(SpecRow(depth=depth, draft_tokens=k, prompts=len(rs), new_tokens=sum(r.new_tokens for r in rs),
                            drafted=drafted, accepted=accepted, target_steps=steps,
                            acceptance_rate=accepted / drafted if drafted else None,
                            mean_accepted=accepted / steps if steps else None, decode_tokens_per_s=tps,
                            ttft_s=_median([r.ttft_s for r in rs]),
                            speedup=tps / alone_tps if tps and alone_tps else None,
                            lossless_prompts=same, lossless=bool(rs) and same == len(rs),
                            tie_divergences=ties if checked else None,
                            lossless_to_rounding=(bool(rs) and same + ties == len(rs)) if checked else None,
                            divergences=divs, predicted_same_prompts=accepted_per_step(agree, k)))
    return alone, rows


def transformers_divergence(model: Any, prompt: list[int], alone: list[int], spec: list[int], index: int) -> SpecDivergence | None:
    """Where ``spec`` first differs from the target's own answer ``alone``, with the target's
    top two logits there (one forward pass over the prompt and ``alone`` up to that position)
    and their gap in rounding steps of the logits' dtype (``eps x 2^floor(log2 |top logit|)``,
    the spacing of floats at that magnitude). None when they are equal."""
    import torch  # start-up time: torch loads only in stage processes
    i = next((j for j, (x, y) in enumerate(zip(alone, spec)) if x != y), None)
    if i is None:
        return None
    dev = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + alone[:i]], dtype=torch.long, device=dev)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values.tolist()
    step = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top[0]), 1e-30)))
    steps = (top[0] - top[1]) / step
    return SpecDivergence(prompt=index, position=i, alone_token=int(alone[i]), speculative_token=int(spec[i]),
                          top_logits=top, rounding_steps=steps, tie=steps <= TIE_STEPS)


def transformers_agreement(draft: Any, prompt: list[int], answer: list[int]) -> list[bool]:
    """Teacher-forced agreement of the draft with the target's own answer: ``out[j]`` is True
    where the draft's top token after the prompt and ``answer[:j]`` is ``answer[j]`` (one
    forward pass over both)."""
    import torch  # start-up time: torch loads only in stage processes
    dev = next(draft.parameters()).device
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt + answer[:-1]], dtype=torch.long, device=dev)).logits[0, len(prompt) - 1:]
    return [int(t) == int(a) for t, a in zip(logits.argmax(dim=-1).tolist(), answer)]


def _timed_greedy(model: Any, prompt: list[int], new_tokens: int) -> SpeculativeRun:
    """The target alone through the same ``generate`` call as the speculative answer, no
    assistant: its greedy tokens, TTFT (a streamer's first new token) and wall time."""
    import torch  # start-up time: torch loads only in stage processes
    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    first = FirstTokenClock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, streamer=first)
        seconds = time.perf_counter() - t0
    return SpeculativeRun.from_counts(draft_tokens=0, token_ids=out[0, len(prompt):].tolist(), drafted=0, accepted=0,
                                      seconds=seconds, ttft_s=None if first.first is None else first.first - t0,
                                      details={"engine": "transformers generate, greedy"})


def transformers_pair(pair: SpeculativeSpec, prompts: dict[int, list[list[int]]], open_tier: Callable[[str], Any],
                      device: str, progress: Callable[[str], None]) -> tuple[dict[int, PairRuns], int | None, str, list[str]]:
    """Both tiers opened on transformers (``open_tier(name)`` -> an engine with ``.model``),
    a warm-up answer each way, then per depth the target alone and each k. Returns
    ``({depth: PairRuns}, peak bytes of both models, what the peak counts, notes)``; the
    notes name a model whose dtype torch emulates on this CPU (the engines'
    ``dtype_emulated``: on an AVX2-only CPU the BF16 target decodes on torch's emulated
    path, several times slower than with AVX512_BF16, and the pair's speed is that path's)."""
    release_freed_memory()
    peak = PeakMemory(device, rss_bytes() if device == "cpu" else None)
    peak.reset()
    target = open_tier(pair.target)
    draft = open_tier(pair.draft)
    tm, dm = target.model, draft.model
    warm = prompts[min(prompts)][0][:32]
    _timed_greedy(tm, warm, 4)
    speculative_generate(tm, dm, warm, draft_tokens=min(pair.draft_tokens), max_new_tokens=4)
    out: dict[int, PairRuns] = {}
    for d, ps in prompts.items():
        progress(f"{pair.target} + draft {pair.draft}: depth {d}, target alone")
        alone = [_timed_greedy(tm, p, pair.new_tokens) for p in ps]
        runs = {}
        for k in pair.draft_tokens:
            progress(f"{pair.target} + draft {pair.draft}: depth {d}, k = {k}")
            runs[k] = [speculative_generate(tm, dm, p, draft_tokens=k, max_new_tokens=pair.new_tokens,
                                            reference_ids=a.token_ids) for p, a in zip(ps, alone)]
            for i, (p, a, r) in enumerate(zip(ps, alone, runs[k])):  # why an answer differs: a tie, or not
                if not r.lossless:
                    r.details["divergence"] = transformers_divergence(tm, p, a.token_ids, r.token_ids, i)
        out[d] = PairRuns(alone=alone, runs=runs, details={"checks_ties": True, "agreement": [
            transformers_agreement(dm, p, a.token_ids) for p, a in zip(ps, alone)]})
    used = peak.read()
    notes = [f"{name}: {e.dtype_emulated} emulated on this CPU (no native instructions): torch's CPU path"
             for name, e in ((pair.target, target), (pair.draft, draft)) if getattr(e, "dtype_emulated", None)]
    for e in (target, draft):
        e.close()
    return out, used, peak.kind, notes


def llamacpp_pair(pair: SpeculativeSpec, prompts: dict[int, list[list[int]]], artifacts: dict[str, Path],
                  recipe: Recipe, device: str, progress: Callable[[str], None]) -> tuple[dict[int, PairRuns], int | None, str, str]:
    """Both GGUF files in llama-server (``-md``), every depth's prompts through one set of
    servers (:func:`qeval.engines.llamacpp_spec.speculative_server` starts one per k and one
    alone), then split by depth; a divergence met at several k is examined once."""
    from .engines.llamacpp_spec import (draft_agreement, first_divergence,  # start-up time: a llama.cpp pair only
                                        speculative_server)
    flat = [(d, p) for d, ps in prompts.items() for p in ps]
    progress(f"{pair.target} + draft {pair.draft}: depths {', '.join(map(str, prompts))} on llama-server -md")
    runs = speculative_server(artifacts[pair.target], artifacts[pair.draft], [p for _, p in flat],
                              list(pair.draft_tokens), pair.new_tokens, threads=recipe.threads,
                              ctx_size=max(prompts) + pair.new_tokens + max(pair.draft_tokens) + 16, device=device,
                              kv_cache=recipe.tier(pair.target).kv_cache)
    agreement = [draft_agreement(artifacts[pair.draft], p, a.token_ids, threads=recipe.threads)
                 for (_, p), a in zip(flat, runs.alone)]
    seen: dict[tuple, SpecDivergence | None] = {}
    for rs in runs.runs.values():  # why an answer differs: a tie of the target's own paths, or not
        for j, ((d, p), a, r) in enumerate(zip(flat, runs.alone, rs)):
            i = next((n for n, (x, y) in enumerate(zip(a.token_ids, r.token_ids)) if x != y), None)
            if i is None:
                continue
            key = (j, i, r.token_ids[i])  # the same prompt parting at the same token: the same examination
            if key not in seen:
                v = first_divergence(artifacts[pair.target], p, a.token_ids, r.token_ids, threads=recipe.threads)
                seen[key] = None if v is None else SpecDivergence(
                    prompt=prompts[d].index(p), position=v["position"], alone_token=v["reference_token"],
                    speculative_token=v["answer_token"], top_logits=v["top_logits"], path_noise=v["path_noise"],
                    tie=v["paths_disagree"])
            r.details["divergence"] = seen[key]
    out: dict[int, PairRuns] = {}
    for d in prompts:
        at = [j for j, (dd, _) in enumerate(flat) if dd == d]
        out[d] = PairRuns(alone=[runs.alone[j] for j in at], runs={k: [rs[j] for j in at] for k, rs in runs.runs.items()},
                          details={"checks_ties": True, "agreement": [agreement[j] for j in at]})
    return out, runs.peak_bytes, runs.memory_counter or "", runs.how


def run_pair(recipe: Recipe, run_dir: Path, pair: SpeculativeSpec, tokenizer: Any,
             open_tier: Callable[[str], Any], progress: Callable[[str], None]) -> SpecPair:
    """One pair as it ran, or with ``error`` (a failed tier, or the measurement's exception)."""
    layout = RunLayout(run_dir)
    engine, _ = speculative_engine(recipe.tier(pair.target))
    depths = speculative_depths(recipe, pair)
    rec = SpecPair(target=pair.target, draft=pair.draft, engine=engine, draft_tokens=list(pair.draft_tokens),
                   depths=depths, prompts=pair.prompts, new_tokens=pair.new_tokens)
    for name in (pair.target, pair.draft):
        try:
            status = read_tier_result(layout, name).status
        except Exception:  # noqa: BLE001 - no tier result: the tier did not run
            status = None
        if status != STATUS_OK:
            rec.error = f"tier {name} did not finish ({status or 'not run'}): the pair needs both tiers"
            return rec
    text = recipe.resolve_path(recipe.speed.depth_text)
    prompts = {d: pair_prompts(tokenizer, text, d, pair.prompts) for d in depths}
    device = pick_device(recipe.device)
    t0 = time.time()
    if engine == "transformers":
        by_depth, peak, counter, notes = transformers_pair(pair, prompts, open_tier, device, progress)
        rec.how = ("transformers generate(assistant_model=draft), greedy, constant num_assistant_tokens = k, "
                   "no confidence cut-off" + "".join(f"; {n}" for n in notes))
    else:
        artifacts = {n: Path(read_stage(layout, n, "prepare").artifact) for n in (pair.target, pair.draft)}
        by_depth, peak, counter, rec.how = llamacpp_pair(pair, prompts, artifacts, recipe, device, progress)
    for d in depths:
        alone, rows = summarize(pair, d, by_depth[d])
        rec.alone.append(alone)
        rec.rows.extend(rows)
    rec.peak_bytes, rec.memory_counter, rec.seconds = peak, counter, time.time() - t0
    return rec


def stage_speculative(recipe: Recipe, run_dir: Path, open_tier: Callable[[str], Any],
                      progress: Callable[[str], None]) -> dict:
    """Every pair of ``recipe.speculative`` (:func:`run_pair`); a pair's exception is its
    ``error`` (type and first line), and the next pair runs. Returns the stage file's dict."""
    from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes
    layout = RunLayout(run_dir)
    src = read_stage(layout, "_run", "source") if stage_done(layout, "_run", "source") else None
    tok = AutoTokenizer.from_pretrained(src.path) if src is not None else None
    pairs = []
    for pair in recipe.speculative:
        progress(f"speculative pair {pair.target} + draft {pair.draft}")
        try:
            rec = run_pair(recipe, run_dir, pair, tok, open_tier, progress)
        except Exception as e:  # noqa: BLE001 - one pair's failure never loses another's figures
            msg = (str(e).strip().splitlines() or [""])[0]
            rec = SpecPair(target=pair.target, draft=pair.draft, engine=speculative_engine(recipe.tier(pair.target))[0],
                           draft_tokens=list(pair.draft_tokens), error=f"{type(e).__name__}: {msg}"[:500])
        pairs.append(rec.model_dump(mode="json"))
    return {"pairs": pairs, "spec": [p.model_dump(mode="json") for p in recipe.speculative]}


def method_engine(recipe: Recipe, ctx: Any, run_dir: Path) -> Callable[[str], Any]:
    """``open_tier(name)``: the tier's engine opened by its method on its prepared artifact,
    as the measure stage opens it."""
    layout = RunLayout(run_dir)

    def open_tier(name: str) -> Any:
        spec = recipe.tier(name)
        prep = read_stage(layout, name, "prepare")
        return get_method(spec.method).open_engine(spec, ctx, Path(prep.artifact) if prep.artifact else None)
    return open_tier
