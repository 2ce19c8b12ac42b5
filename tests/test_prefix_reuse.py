"""Prefix KV reuse on both in-process engines (tiny models): a request served from a reused
shared prefix produces the same greedy tokens as a fresh prefill of the whole prompt, alone
(the primitives) and in the load stage's closed loops, and the prompt tokens served from the
cache are counted."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random llama with SmolLM2's tokenizer and its F16 GGUF (conftest.tiny_gguf_module)."""
    from conftest import tiny_gguf_module
    yield from tiny_gguf_module(tmp_path_factory, "prefix")


def _parts(ids: list[int]) -> tuple[list[int], list[list[int]]]:
    """A 40-token shared prefix and three own parts of different lengths (different texts)."""
    return ids[:40], [ids[40:47], ids[60:72], ids[90:93]]


def _answer(core, rid: int, prompt: list[int], n: int, prefix: bool) -> list[int]:
    """Submit one request to ``core`` and step until it is done; its tokens."""
    core.submit(rid, prompt, n, prefix=prefix)
    toks: list[int] = []
    while True:
        for ev in core.step():
            toks += ev.tokens
            if ev.done:
                core.release(rid)
                return toks


def test_llamacpp_reused_prefix_gives_the_fresh_prefill_tokens(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.arrivals import WallClock
    from qeval.serving.core import CoreSpec
    prefix, owns = _parts(tiny["ids"])
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        fresh = [eng.generate(prefix + own, 8, ignore_stop=True).token_ids for own in owns]
        spec = CoreSpec(slots=2, max_seq_tokens=24, prefill_chunk=16, prefix_tokens=len(prefix))
        with eng.open_core(spec, WallClock()) as core:
            core.cache_prefix(prefix)
            mem, L = core._mem, core._L
            assert L.llama_memory_seq_pos_max(mem, 2) + 1 == len(prefix)  # the prefix's own sequence
            steps0 = core.stats().steps
            got = [_answer(core, i, own, 8, prefix=True) for i, own in enumerate(owns)]
            # the prefix was prefilled once: each reused request prefilled only its own part
            # (one chunk each here) and then decoded 7 tokens one step at a time
            assert core.stats().steps - steps0 == sum(-(-len(o) // 16) + 7 for o in owns)
            assert L.llama_memory_seq_pos_max(mem, 2) + 1 == len(prefix)
            assert L.llama_memory_seq_pos_max(mem, 0) == -1 and L.llama_memory_seq_pos_max(mem, 1) == -1
        assert got == fresh, (got, fresh)
        assert len({tuple(g) for g in got}) == 3  # different own parts, different answers
    finally:
        eng.close()


def test_llamacpp_core_refuses_what_does_not_fit(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.arrivals import WallClock
    from qeval.measure.load import NotAdmitted
    from qeval.serving.core import CoreSpec
    prefix, owns = _parts(tiny["ids"])
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        with pytest.raises(NotAdmitted, match="context"):
            eng.open_core(CoreSpec(slots=1, max_seq_tokens=eng.n_ctx_train, prefix_tokens=len(prefix)), WallClock())
        with eng.open_core(CoreSpec(slots=1, max_seq_tokens=10, prefix_tokens=len(prefix)), WallClock()) as core:
            with pytest.raises(ValueError, match="cache_prefix"):
                core.submit(0, owns[2], 4, prefix=True)
            core.cache_prefix(prefix)
            with pytest.raises(ValueError, match="exceed"):
                core.submit(0, owns[1], 4, prefix=True)
            core.submit(0, owns[2], 4, prefix=True)
            with pytest.raises(ValueError, match="no free sequence"):
                core.submit(1, owns[2], 4, prefix=True)
            with pytest.raises(ValueError, match="vocabulary"):
                core.release(0) or core.submit(1, [10**9], 2)
    finally:
        eng.close()


def test_hf_reused_prefix_gives_the_fresh_prefill_tokens(tiny_llama):
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.measure.arrivals import WallClock
    from qeval.serving.core import CoreSpec
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("Quantization trades memory for accuracy. The quick brown fox jumps over the lazy dog. " * 12,
              add_special_tokens=False)["input_ids"]
    prefix, owns = _parts(ids)
    eng = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    fresh = [eng.generate(prefix + own, 8, ignore_stop=True).token_ids for own in owns]
    spec = CoreSpec(slots=2, max_seq_tokens=len(prefix) + 20, prefill_chunk=16, prefix_tokens=len(prefix))
    with eng.open_core(spec, WallClock()) as core:
        assert core.scheduling == "static" and core.controls_steps  # a cached prefix: qeval's batches
        with pytest.raises(ValueError, match="cache_prefix"):
            core.submit(0, owns[0], 8, prefix=True)
        core.cache_prefix(prefix)
        assert core._held.get_seq_length() == len(prefix)
        steps0 = core.stats().steps
        # one request at a time: a group of 1 row keeps row 0 of the copied 2-row prefix cache
        got = [_answer(core, i, own, 8, prefix=True) for i, own in enumerate(owns)]
        # each reused request prefilled only its own part (one chunk here) and decoded 7 tokens
        assert core.stats().steps - steps0 == 3 * 8
        assert core._held.get_seq_length() == len(prefix)  # the shared cache is never extended by a request
        again = [_answer(core, 10 + i, prefix + own, 8, prefix=False) for i, own in enumerate(owns)]
        # two prefix requests in one batch (own parts of one length), each told the prefix it was served
        core.submit(20, owns[0], 8, prefix=True)
        core.submit(21, ids[100:107], 8, prefix=True)
        both: dict[int, list[int]] = {20: [], 21: []}
        cached = {}
        while len(cached) < 2:
            for ev in core.step():
                both[ev.rid] += ev.tokens
                if ev.done:
                    cached[ev.rid] = ev.cached_tokens
                    core.release(ev.rid)
        assert cached == {20: len(prefix), 21: len(prefix)}
        assert core.stats().details["batches"] == 7
        with pytest.raises(ValueError, match="one length"):  # a reused prefix is not padded
            core.submit(30, owns[0], 4, prefix=True)
            core.submit(31, owns[1], 4, prefix=True)
            core.step()
    assert got == fresh and again == fresh
    assert both[20] == fresh[0] and both[21] == eng.generate(prefix + ids[100:107], 8, ignore_stop=True).token_ids
    assert len({tuple(g) for g in got}) == 3


# ---- the load stage's closed loops with a shared prefix -----------------------------------

def _by_request(run) -> dict[tuple[int, int], list[int]]:
    """``(stream, k) -> token ids`` of a closed loop's records (a stream's records in order)."""
    seen: dict[int, int] = {}
    out = {}
    for r in sorted(run.requests, key=lambda r: (r.stream, r.start_s)):
        k = seen.get(r.stream, 0)
        seen[r.stream] = k + 1
        out[(r.stream, k)] = list(r.token_ids)
    return out


def test_prefixed_prompts_share_the_prefix_and_differ_after_it():
    from qeval.serving.prefix import prefixed_prompts
    pf = prefixed_prompts(list(range(1, 300)), 50, 40)
    a, b, c = pf(0, 0), pf(0, 1), pf(1, 0)
    assert len(a) == 50 and a[:40] == b[:40] == c[:40] and len({tuple(a), tuple(b), tuple(c)}) == 3
    with pytest.raises(ValueError, match="shared prefix"):
        prefixed_prompts([1, 2, 3], 40, 40)


def test_llamacpp_closed_loop_reused_prefix_gives_fresh_prefill_tokens(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.closed_loop import closed_loop as serve_closed_loop
    from qeval.serving.prefix import prefixed_prompts
    llama = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        pf = prefixed_prompts(tiny["ids"], 56, 40)
        kw = dict(concurrency=2, output_tokens=6, requests_per_stream=2, prefill_chunk=16, shared_prefix=40)
        off = serve_closed_loop(llama, pf, reuse_prefix=False, **kw)
        on = serve_closed_loop(llama, pf, reuse_prefix=True, **kw)
        fresh = {(s, k): llama.generate(pf(s, k), 6, ignore_stop=True).token_ids for s in range(2) for k in range(2)}
        assert _by_request(off) == fresh and _by_request(on) == fresh
        assert off.cached_prompt_tokens == 0 and on.cached_prompt_tokens == 4 * 40
        assert on.details["kv_unified"] is True and off.details["kv_unified"] is False
        assert on.steps < off.steps  # only the own parts (16 tokens, one chunk each) were prefilled
    finally:
        llama.close()


def test_hf_closed_loop_reused_prefix_gives_fresh_prefill_tokens(tiny_llama):
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.serving.closed_loop import closed_loop as serve_closed_loop
    from qeval.serving.prefix import prefixed_prompts
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("Quantization trades memory for accuracy. The quick brown fox jumps over the lazy dog. " * 12,
              add_special_tokens=False)["input_ids"]
    eng = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    pf = prefixed_prompts(ids, 48, 32)
    kw = dict(concurrency=2, output_tokens=5, requests_per_stream=2, prefill_chunk=16, shared_prefix=32)
    off = serve_closed_loop(eng, pf, reuse_prefix=False, **kw)
    on = serve_closed_loop(eng, pf, reuse_prefix=True, **kw)
    fresh = {(s, k): eng.generate(pf(s, k), 5, ignore_stop=True).token_ids for s in range(2) for k in range(2)}
    assert _by_request(off) == fresh and _by_request(on) == fresh
    assert off.scheduling == on.scheduling == "static"
    assert off.cached_prompt_tokens == 0 and on.cached_prompt_tokens == 4 * 32
    # 2 batches each: 48 columns in 3 chunks of 16 prefilled per request, 16 (the own parts) reused; 4 decodes
    assert off.steps == 2 * (3 + 4) and on.steps == 2 * (1 + 4)
    assert on.decode_step_tokens == off.decode_step_tokens == 2 * 2 * 4


# ---- the recipe fields -------------------------------------------------------------------

_RECIPE = "name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}]\nspeed: {depths: [64, 128]}\n"


def test_recipe_prefix_fields_validate_against_the_depth():
    from qeval.errors import QevalInputError
    from qeval.recipe import parse_recipe
    r = parse_recipe(_RECIPE + "load:\n  depth: 96\n  shared_prefix_tokens: 64\n  prefix_cache: on\n")
    assert r.load.shared_prefix_tokens == 64 and r.load.prefix_cache == "on"  # YAML's bare on read as the word
    assert parse_recipe(_RECIPE + "load: {shared_prefix_tokens: 32}\n").load.prefix_cache == "both"
    assert parse_recipe(_RECIPE).load.shared_prefix_tokens is None
    with pytest.raises(QevalInputError) as e:  # the prefix is part of the depth (main_depth 128 here)
        parse_recipe(_RECIPE + "load:\n  shared_prefix_tokens: 128\n", "r.yaml")
    assert str(e.value).startswith("r.yaml:6: load.shared_prefix_tokens: ") and "shorter" in str(e.value)
    with pytest.raises(QevalInputError, match=r"r\.yaml:6: load\.prefix_cache: .*needs load\.shared_prefix_tokens"):
        parse_recipe(_RECIPE + "load:\n  prefix_cache: off\n", "r.yaml")
    with pytest.raises(QevalInputError, match=r"load\.prefix_cache: Input should be 'on', 'off' or 'both'"):
        parse_recipe(_RECIPE + "load: {shared_prefix_tokens: 8, prefix_cache: sometimes}\n")
    with pytest.raises(QevalInputError, match=r"load\.shared_prefix_tokens: Input should be greater than 0"):
        parse_recipe(_RECIPE + "load: {shared_prefix_tokens: 0}\n")
