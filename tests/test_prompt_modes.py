"""Prompt modes of the ``openai`` engine (issue 50): ``tokens`` (token ids to
``/v1/completions``), ``text`` (the prompt as text there) and ``chat`` (messages to
``/v1/chat/completions``).

Fast tests talk to a scripted fake server (http.server in a thread, ``Fake`` of
tests/test_engine_openai.py): the bodies each mode sends, token counts from ``usage`` and
from the source tokenizer when ``usage`` is absent, the tokenizer check's difference in chat
mode, text-mode fidelity from top-k by id with a position without a top-k skipped and
counted, ``qeval validate``'s one-line refusals and the manual's example recipes. Slow
tests start llama-server on the tiny GGUF and measure the same file in all three modes
(figures' sources and structure; their decode rates are benchmarks/prompt_modes.py's, not
asserted here), and run a whole recipe with text and chat endpoint tiers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, write_recipe
from test_engine_openai import DEPTH_TEXT, _options, fake  # noqa: F401 - fake: the fixture, shared

ANSWER = ["Hello", " there,", " friend"]  # streamed one piece a chunk


def _text_script(usage: bool, count=None, chat_extra: int = 0, pieces=ANSWER, finish="stop"):
    """A server answering text prompts and chat messages with ``pieces`` (streamed, one per
    chunk, then ``finish``), ``usage`` on or off (``completion_tokens`` 7: not the source
    tokenizer's count of the text, so the test sees which count the engine took);
    ``count(text)`` counts prompt tokens; a chat prompt counts ``chat_extra`` more (the
    server's own template)."""
    def script(path, body):
        if path == "/v1/chat/completions":
            prompt = "".join(m["content"] for m in body["messages"])
            n_prompt = (count(prompt) if count else len(prompt)) + chat_extra
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                return None
            n_prompt = count(prompt) if count else len(prompt)
        u = {"prompt_tokens": n_prompt, "completion_tokens": 7}
        chat = path == "/v1/chat/completions"

        def piece(p, fin=None):
            ch = {"index": 0, "finish_reason": fin}
            ch.update({"delta": {"content": p}} if chat else {"text": p})
            return {"choices": [ch]}
        if not body.get("stream"):
            whole = "".join(pieces)[: body["max_tokens"] * 10]
            ch = {"index": 0, "finish_reason": finish,
                  **({"message": {"role": "assistant", "content": whole}} if chat else {"text": whole})}
            return {"choices": [ch], **({"usage": u} if usage else {})}
        chunks = [piece(p) for p in pieces] + [piece("", finish)]
        if usage:
            chunks.append({"choices": [], "usage": u})
        return chunks
    return script


def _tok(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("usage", [True, False])
def test_text_mode_sends_the_decoded_prompt_and_counts_from_usage_or_the_source_tokenizer(fake, tiny_llama, usage):
    from qeval.engines.openai import COUNT_SOURCE, COUNT_USAGE, OpenAIEngine, _template_ids
    tok = _tok(tiny_llama)
    f = fake(owner="library", script=_text_script(usage, count=lambda t: len(tok(t)["input_ids"])))
    eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama),
                                                       prompt_mode="text", depth_text=str(DEPTH_TEXT), depths=[16]))
    try:
        assert eng.client.dialect == "openai"  # an unknown server: no token ids, no top-k by id
        check = eng.tokenizer_check[0]
        assert check["server_tokens"] == (check["text_tokens"] if usage else None)  # no usage: not checkable
        prompt = _template_ids(tok, [{"role": "user", "content": "hi"}])
        g = eng.generate(prompt, 16, stop_ids=[tok.eos_token_id])
        body = f.requests[-1]
        assert body["prompt"] == tok.decode(prompt) and "<|im_start|>user" in body["prompt"]  # text, template kept
        assert "logprobs" not in body and body["stream"] is True and body["temperature"] == 0
        text_ids = tok("".join(ANSWER), add_special_tokens=False)["input_ids"]
        assert g.finished and g.token_ids == text_ids + [tok.eos_token_id]  # answer ids: the source tokenizer's
        n = 7 if usage else len(text_ids) + 1  # the server's count, else the source tokenizer's
        assert len(g.token_times_s) == n and n != len(text_ids) + 1 or not usage
        assert g.token_times_s == sorted(g.token_times_s) and g.prefill_s == g.token_times_s[0] > 0
        info = eng.served_info()
        assert info["prompt_mode"] == "text" and info["token_counts"] == (COUNT_USAGE if usage else COUNT_SOURCE)
        assert "fidelity not measurable on this endpoint" in info["fidelity"]  # plain dialect: no top-k by id
        # the load stage's requests go the same way
        path, lb = eng.wire_request(prompt[:5], 4)
        assert path == "/v1/completions" and lb["prompt"] == tok.decode(prompt[:5]) and lb["ignore_eos"] is True
    finally:
        eng.close()


def test_chat_mode_sends_messages_and_reports_the_template_difference_instead_of_failing(fake, tiny_llama):
    from qeval.engines.openai import OpenAIEngine, _template_ids
    from qeval.measure.quality import answer_all
    from qeval.measure.suites import load_suite
    tok = _tok(tiny_llama)
    count = lambda t: len(tok(t)["input_ids"])  # noqa: E731
    f = fake(owner="lmstudio", script=_text_script(True, count=count, chat_extra=3))
    eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama),
                                                       prompt_mode="chat", depth_text=str(DEPTH_TEXT), depths=[16]))
    try:
        check = eng.tokenizer_check[0]
        source = len(_template_ids(tok, [{"role": "user", "content": "x"}])) - count("x")  # the template's own
        assert source > 3
        assert check["server_tokens"] - check["text_tokens"] == check["difference"] == 3 - source
        assert eng.fidelity_note.startswith("fidelity not measurable on this endpoint")
        with pytest.raises(RuntimeError, match="fidelity not measurable"):
            eng.topk_at([1, 2, 3])
        # the suite's conversation goes as messages, the earlier turns with the answers' text
        items = load_suite(REPO / "tests" / "data" / "suite_multi.jsonl", "mt", multi_turn=True)[:1]

        class Spec:
            name, kind, limit, max_new_tokens = "mt", "multi_turn", None, 8
        before = len(f.requests)
        segs = answer_all(eng, tok, [tok.eos_token_id], [(Spec, items)], 1, lambda s: None, limit_items=True)
        sent = f.requests[before:]
        assert len(sent) == len(items[0].turns) == len(segs) >= 2
        assert all("messages" in b and "prompt" not in b for b in sent)
        second = sent[1]["messages"]
        assert second[-1] == {"role": "user", "content": items[0].turns[1].user}
        assert second[-2] == {"role": "assistant", "content": "".join(ANSWER)}  # the first answer, as text
        assert segs[0]["text"] == "".join(ANSWER) and segs[0]["finished"]
        assert eng.served_info()["token_counts"] == "server usage"
    finally:
        eng.close()


def test_chat_thinking_is_kept_inline_and_an_unfinished_thought_stays_open():
    from qeval.engines.openai import _TextJoin, chunk_text
    from qeval.measure.behaviour import thinking_exhausted
    j = _TextJoin()
    for d in ({"reasoning_content": "let me"}, {"reasoning_content": " think"}, {"content": "Paris"}):
        j.add(chunk_text({"choices": [{"delta": d}]})[0])
    assert j.text() == "<think>let me think</think>Paris"
    cut = _TextJoin()
    cut.add(chunk_text({"choices": [{"delta": {"reasoning": "still", "content": None}}]})[0])
    assert cut.text() == "<think>still" and thinking_exhausted(cut.text(), False)


def test_text_mode_tokenizer_check_still_fails_on_another_tokenizer(fake, tiny_llama):
    from qeval.engines.openai import OpenAIEngine, TokenizerMismatch
    tok = _tok(tiny_llama)
    f = fake(script=_text_script(True, count=lambda t: len(tok(t)["input_ids"]) + 2))
    with pytest.raises(TokenizerMismatch, match="prompt tokens where the source tokenizer counts"):
        OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama),
                                                     prompt_mode="text", depth_text=str(DEPTH_TEXT), depths=[16]))


def _llama_text_scorer(tok, vocab, empty_after):
    """A llama-server-shaped answer to text prompts (``logprobs.content[].top_logprobs`` by
    id, ``usage`` by the source tokenizer): the top token after a prefix is
    ``len(prefix text) % vocab``, so a row's position can be read back from its argmax; the
    prefix texts in ``empty_after`` get an empty ``content`` (llama-server holding back a
    token that ends in an incomplete UTF-8 character)."""
    def script(path, body):
        p = body.get("prompt")
        if path != "/v1/completions" or not isinstance(p, str) or body.get("stream"):
            return None
        usage = {"prompt_tokens": len(tok(p)["input_ids"]), "completion_tokens": 1}
        top = len(p) % vocab
        k = max(1, int(body.get("n_probs") or 1))
        tops = [{"id": top, "logprob": -0.5}] + [{"id": (top + i) % vocab, "logprob": -3.0 - i} for i in range(1, k)]
        content = [] if p in empty_after else [{"id": top, "logprob": -0.5, "top_logprobs": tops}]
        return {"choices": [{"text": "x", "logprobs": {"content": content}}], "usage": usage}
    return script


def test_text_mode_scores_top_k_by_id_and_skips_a_position_without_one(fake, tiny_llama):
    """Text mode on a llama.cpp dialect: fidelity is measurable (the top-k estimate, k
    stated); a position answered with an empty top-k is left out of the rows and counted,
    the rows either side keep their positions."""
    from qeval.engines.openai import OpenAIEngine, _template_ids
    from qeval.measure.fidelity import FidelityAccumulator, note_skipped
    tok = _tok(tiny_llama)
    vocab = len(tok)
    seq = _template_ids(tok, [{"role": "user", "content": "Name three colours, please."}])
    first, skip = 3, 9  # the row predicting token 9 (prefix seq[:9]) has no top-k
    probe = OpenAIEngine.__new__(OpenAIEngine)  # prompt_text needs only the tokenizer
    probe.tok = tok
    f = fake(owner="llamacpp", script=_llama_text_scorer(tok, vocab, {probe.prompt_text(seq[:skip])}))
    eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama),
                                                       prompt_mode="text", depth_text=str(DEPTH_TEXT), depths=[16]))
    try:
        assert eng.client.dialect == "llama.cpp" and eng.fidelity_note is None and eng.served_info()["fidelity"] is None
        got = {}
        for start, rows in eng.iter_logprobs(seq, window=4, first=first):
            for r, row in enumerate(rows):
                got[start + r] = int(row.argmax())
        sent = [b["prompt"] for b in f.requests if b.get("n_probs") == eng.topk]
        assert all(isinstance(x, str) for x in sent) and len(sent) == len(seq) - 1 - first  # text, one per position
        assert eng.topk_skipped == 1
        assert sorted(got) == [i for i in range(first, len(seq) - 1) if i != skip - 1]
        for i, top in got.items():  # row i predicts token i + 1 after prefix seq[:i + 1]
            assert top == len(eng.prompt_text(seq[:i + 1])) % vocab, i
        # the fidelity stage's path: the answer's rows scored, the skipped one counted in the row
        from qeval.measure.quality import fidelity
        seg = {"item": "a", "turn": 0, "prompt_ids": seq[:first + 1], "answer_ids": seq[first + 1:], "offset": 0}
        ref = np.log(np.full((len(seq) - first - 1, vocab), 1 / vocab, dtype=np.float32))
        eng.topk_skipped = 0
        row = note_skipped(fidelity(eng, [seg], ref, 4), eng.topk_skipped)
        assert row["n_tokens"] == len(seq) - first - 2 and row["kld_topk"] == eng.topk == 20
        assert row["kld_estimate"].endswith(f"1 of {len(seq) - first - 1} positions skipped: the server returned no "
                                            "top-k there (llama-server, for one, holds back a token ending in an "
                                            "incomplete UTF-8 character)")
    finally:
        eng.close()
    # the row: figures over the scored positions, the skipped ones counted beside k
    acc = FidelityAccumulator(topk=20)
    ref = np.log(np.full((2, 8), 1 / 8, dtype=np.float32))
    acc.add(ref, ref, np.array([1, 2]), np.array([0, 1]))
    row = note_skipped(acc.summary(), 1)
    assert row["n_tokens"] == 2 and row["kld_topk"] == 20
    assert row["kld_estimate"].startswith("top-20") and "1 of 3 positions skipped: the server returned no top-k" \
        in row["kld_estimate"]
    assert note_skipped({"n_tokens": 0}, 4)["not_measured"].startswith("fidelity not measured: 4 of 4 positions")
    assert note_skipped(acc.summary(), 0) == acc.summary()
    with pytest.raises(ValueError):
        note_skipped(acc.summary(), -1)


def test_tokens_mode_still_fails_a_position_without_top_k(fake, tiny_llama):
    """Tokens mode keeps its contract: an empty top-k is an error, not a skipped position."""
    from qeval.engines.openai import OpenAIEngine

    def script(path, body):
        if path == "/v1/completions" and not body.get("stream") and body.get("n_probs") == 20:
            return {"choices": [{"text": "", "logprobs": {"content": []}}],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}}
        return None
    f = fake(owner="llamacpp", script=script)
    eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama)))
    try:
        with pytest.raises(RuntimeError, match="no top-20 log-probabilities"):
            list(eng.iter_logprobs([1, 2, 3, 4], window=4))
    finally:
        eng.close()


def test_a_served_row_says_its_prompt_mode_and_count_source():
    from qeval.report.table import served_text
    assert served_text(None) is None
    assert served_text({"prompt_mode": "tokens", "token_counts": "server token ids"}) is None  # as before
    assert served_text({"prompt_mode": "text", "token_counts": "source tokenizer on the text"}) == \
        "prompt mode text; token counts: source tokenizer on the text"
    s = served_text({"prompt_mode": "chat", "token_counts": "server usage",
                     "tokenizer_check": [{"difference": 3}, {"difference": 3}]})
    assert s == "prompt mode chat; token counts: server usage; tokenizer check: the server's template +3 tokens " \
        "against the source's"


# ---- qeval validate ------------------------------------------------------------------------

def _validate(tmp_path, model, tiers, extra=""):
    recipe = write_recipe(tmp_path / "tiny.yaml", model, tiers=tiers, extra=extra)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(recipe)],
                       env=dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    return p, recipe


@pytest.mark.parametrize("case", ["unknown mode", "chat with a fidelity rule", "without engine openai",
                                  "text on sglang with a fidelity rule"])
def test_validate_refuses_a_prompt_mode_that_cannot_work_in_one_line(case, tiny_llama, tmp_path):
    url = "http://127.0.0.1:9"
    mode, rule, engine = {"unknown mode": ("voice", "max_kld_mean: 10.0", "engine: openai, "),
                          "chat with a fidelity rule": ("chat", "min_same_top_rate: 0.5", "engine: openai, "),
                          "without engine openai": ("text", "max_kld_mean: 10.0", ""),
                          "text on sglang with a fidelity rule": ("text", "max_ppl_ratio: 2.0",
                                                                  "engine: openai, ")}[case]
    served = f"endpoint: {{url: {url}}}, " if engine else ""
    if case == "text on sglang with a fidelity rule":  # a dialect without top-k by id (SGLang: CUDA only)
        served = "serve: {kind: sglang}, "
    tiers = (f"  - {{name: bf16, method: bf16}}\n"
             f"  - {{name: remote, method: bf16, {engine}{served}prompt_mode: {mode}}}\n")
    extra = f"gate: {{reference: bf16, rules: {{{rule}}}}}"
    if "sglang" in case:
        recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers, extra=extra)
        recipe.write_text(recipe.read_text().replace("device: cpu", "device: cuda"))
        p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(recipe)],
                           env=dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO)),
                           capture_output=True, text=True, timeout=300)
    else:
        p, recipe = _validate(tmp_path, tiny_llama, tiers, extra)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and str(recipe) in lines[0] and "Traceback" not in p.stderr, lines
    assert "tiers[1]" in lines[0] and "prompt_mode" in lines[0], lines[0]
    if case == "chat with a fidelity rule":
        assert "min_same_top_rate" in lines[0] and "remote" in lines[0]
    if "sglang" in case:
        assert "max_ppl_ratio" in lines[0] and "sglang dialect" in lines[0] and "remote" in lines[0], lines[0]


def test_validate_accepts_text_mode_fidelity_where_the_server_gives_top_k_by_id(tiny_llama, tmp_path):
    """A text tier on llama-server (top-k by id) or on an endpoint whose dialect the recipe
    does not name (checked when the run connects) keeps its fidelity rules."""
    from qeval.recipe import load_recipe
    from qeval.validate import check_prompt_mode_fidelity
    tiers = ("  - {name: bf16, method: bf16}\n"
             "  - {name: q, method: gguf, type: Q4_K_M, engine: openai, serve: {kind: llama-server}, prompt_mode: text}\n"
             "  - {name: remote, method: bf16, engine: openai, endpoint: {url: 'http://127.0.0.1:9'}, "
             "prompt_mode: text}\n")
    r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers,
                                 extra="gate: {reference: bf16, rules: {max_kld_mean: 1.0, min_same_top_rate: 0.5}}"))
    check_prompt_mode_fidelity(r)  # no error


def test_a_chat_tier_outside_the_gate_or_without_fidelity_rules_is_accepted(tiny_llama, tmp_path):
    from qeval.recipe import load_recipe, stable_tier_dict
    tiers = ("  - {name: bf16, method: bf16}\n"
             "  - {name: q, method: bf16, kv_cache: int8}\n"
             "  - {name: remote, method: bf16, engine: openai, endpoint: {url: 'http://127.0.0.1:9'}, "
             "prompt_mode: chat}\n")
    for extra in ("gate: {reference: bf16, candidates: [q], rules: {max_kld_mean: 10.0}}",
                  "gate: {reference: bf16, rules: {min_pass_rate_rel: 0.5}}"):
        r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers, extra=extra))
        assert r.tier("remote").prompt_mode == "chat"
    # a tier without the field keeps its fingerprint: the field is left out at its default
    assert "prompt_mode" not in stable_tier_dict(r.tier("q").model_dump(mode="json"))
    assert stable_tier_dict(r.tier("remote").model_dump(mode="json"))["prompt_mode"] == "chat"


@pytest.mark.parametrize("name", ["ollama.yaml", "hosted.yaml"])
def test_the_manuals_example_recipes_validate(name, tmp_path):
    """recipes/examples/ (the README's "Measuring a server you already run"; tests/test_recipe.py
    validates recipes/*.yaml only): each passes ``qeval validate`` (exit 0) with no server
    running and no key set (endpoints are checked by ``qeval run``); Ollama's three tiers are
    one model in three quant tags on the native dialect; the hosted one names its key's
    environment variable and holds no key."""
    from qeval.recipe import load_recipe
    path = REPO / "recipes" / "examples" / name
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(path)],
                       env={k: v for k, v in dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"),
                                                   PYTHONPATH=str(REPO)).items() if k != "HOSTED_API_KEY"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    r = load_recipe(path)
    served = [t for t in r.tiers if t.endpoint is not None]
    if name == "ollama.yaml":
        assert [t.endpoint.model.rsplit("-", 1)[1] for t in served] == ["q4_K_M", "q8_0", "fp16"]
        assert len({t.endpoint.model.rsplit("-", 1)[0] for t in served}) == 1  # one model, three tags
        assert all(t.endpoint.dialect == "ollama" and t.endpoint.url == "http://127.0.0.1:11434" for t in served)
    else:
        assert served and all(t.endpoint.api_key_env == "HOSTED_API_KEY" for t in served)
        assert {t.prompt_mode for t in served} == {"chat", "text"}
        assert "api_key:" not in path.read_text() and "Bearer" not in path.read_text()


# ---- llama-server on the tiny GGUF (slow) -------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GGUF (conftest.served_gguf_module)."""
    from conftest import served_gguf_module
    yield from served_gguf_module(tmp_path_factory, "modes")


@pytest.mark.slow
def test_the_same_file_on_llama_server_in_tokens_text_and_chat_modes(served, tmp_path):
    from qeval.engines.openai import COUNT_IDS, COUNT_USAGE, OpenAIEngine, _template_ids
    from qeval.serving.closed_loop import closed_loop
    tok = served["tok"]
    ids = served["ids"][:40]
    stop = [tok.eos_token_id]
    prompt = _template_ids(tok, [{"role": "user", "content": "Name three colours, then count to five."}])
    scored = prompt + ids[:16]
    got = {}
    for mode in ("tokens", "text", "chat"):
        eng = OpenAIEngine.open("gguf", served["f16"], _options(
            serve={"kind": "llama-server", "parallel": 1, "ctx_size": 1024}, log=str(tmp_path / f"{mode}.log"),
            tier=mode, tokenizer=str(served["src"]), depth_text=str(DEPTH_TEXT), depths=[40], prompt_mode=mode))
        try:
            g = eng.generate(ids, 8, ignore_stop=True)  # the speed sweep's request
            assert len(g.token_times_s) == 8 and g.prefill_s > 0 and g.decode_tokens_per_s, (mode, g)
            msgs = [{"role": "user", "content": "Name a colour."}]
            a = eng.generate_messages(msgs, 6, stop_ids=stop) if mode == "chat" else None
            run = closed_loop(eng, lambda s, k: ids[:32], concurrency=1, output_tokens=4, requests_per_stream=1)
            rows = {}  # teacher-forced top-k over a chat-templated prompt and answer (the fidelity stage's rows)
            if mode != "chat":
                for start, lp in eng.iter_logprobs(scored, window=8, first=len(prompt) - 1):
                    for r, row in enumerate(lp):
                        rows[start + r] = int(row.argmax())
            got[mode] = {"g": g, "chat": a, "info": eng.served_info(), "load": run.requests[0], "rows": rows,
                         "skipped": eng.topk_skipped}
        finally:
            eng.close()
    tokens, text, chat = got["tokens"], got["text"], got["chat"]
    assert tokens["info"]["token_counts"] == COUNT_IDS and tokens["info"]["fidelity"] is None
    assert text["info"]["token_counts"] == COUNT_USAGE == chat["info"]["token_counts"]  # llama-server sends usage
    # fidelity: text mode scored by top-k by id, as tokens mode; chat mode has no teacher forcing
    assert text["info"]["fidelity"] is None and tokens["rows"] and not chat["rows"]
    assert chat["info"]["fidelity"].startswith("fidelity not measurable on this endpoint (prompt_mode chat")
    # the same positions (a skipped one counted), and the same top token where the decoded
    # prefix is tokenized back by the server: the same weights seen through text
    assert len(text["rows"]) + text["skipped"] == len(tokens["rows"]) == len(scored) - len(prompt) and \
        tokens["skipped"] == 0
    assert all(text["rows"][i] == top for i, top in tokens["rows"].items() if i in text["rows"])
    # the same prompt as text: the same greedy answer as the token ids gave (its text)
    assert tok.decode(text["g"].token_ids) == tok.decode(tokens["g"].token_ids)
    # chat: the server rendered its template; the check reports the difference, never fails
    check = chat["info"]["tokenizer_check"][0]
    assert check["difference"] is not None and check["server_tokens"] == check["text_tokens"] + check["difference"]
    # text mode counts the prompt as the source tokenizer does (its check failed otherwise); the
    # rows say each mode's count source and chat's template difference, with its sign
    assert all(c["server_tokens"] == c["text_tokens"] for c in text["info"]["tokenizer_check"])
    assert all(c["server_tokens"] == c["text_tokens"] for c in tokens["info"]["tokenizer_check"])
    from qeval.report.table import served_text
    assert served_text(tokens["info"]) is None  # tokens mode: the row as before
    assert served_text(text["info"]) == "prompt mode text; token counts: server usage"
    diffs = sorted({c["difference"] for c in chat["info"]["tokenizer_check"]})
    assert served_text(chat["info"]) == ("prompt mode chat; token counts: server usage; tokenizer check: the "
                                         "server's template " + ", ".join(f"{d:+d}" for d in diffs) +
                                         " tokens against the source's")
    assert chat["chat"].token_ids and len(chat["chat"].token_times_s) >= 1
    for mode in ("tokens", "text", "chat"):  # the load stage in every mode: 4 tokens timed
        assert len(got[mode]["load"].token_times_s) == 4, mode
    assert json.dumps(chat["info"])  # the row's record is plain JSON


@pytest.mark.slow
def test_a_run_with_text_and_chat_endpoint_tiers_says_mode_counts_and_fidelity_in_the_row(served, tmp_path):
    """A whole run (CLI) with two endpoint tiers on one llama-server: ``text`` (answers,
    checks and fidelity: the top-20 estimate, judged by a fidelity rule) and ``chat``
    (answers and checks; fidelity not measurable, said in the row); each row says its
    prompt mode and where its token counts came from."""
    from conftest import run_dir_of
    from qeval.engines.llama_tools import tool_path
    from qeval.engines.servers import ManagedServer, free_port
    from qeval.engines.servers.llama_server import llama_server_command
    from qeval.paths import cache_root
    port = free_port()
    remote = ManagedServer(llama_server_command(tool_path("llama-server"), served["f16"], port=port, threads=1,
                                                parallel=1, ctx_size=4096),
                           port=port, log_path=tmp_path / "remote-server.log", name="llama-server").start(120)
    url = f"{remote.url}/v1"
    tiers = (f"  - {{name: ref, method: bf16}}\n"
             f"  - {{name: text, method: bf16, engine: openai, endpoint: {{url: {url}}}, prompt_mode: text}}\n"
             f"  - {{name: chat, method: bf16, engine: openai, endpoint: {{url: {url}}}, prompt_mode: chat}}\n")
    recipe = write_recipe(tmp_path / "tiny.yaml", served["src"], tiers=tiers, load=False,
                          extra="gate: {reference: ref, candidates: [text], "
                                "rules: {min_pass_rate_rel: 0.0, max_kld_mean: 100.0}}")
    recipe.write_text(recipe.read_text().replace("model: {source: " + str(served["src"]) + "}",
                                                 "model: {source: " + str(served["src"]) + ", dtype: float32}"))
    cache = tmp_path / "cache"
    cache.mkdir()
    for built in ("llama_tools", "llama_cpp_src"):
        if (cache_root() / built).exists():
            (cache / built).symlink_to(cache_root() / built)
    env = dict(os.environ, QEVAL_CACHE=str(cache), PYTHONPATH=str(REPO))
    try:
        p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "out")],
                           env=env, capture_output=True, text=True, timeout=1500)
    finally:
        remote.stop()
    run = run_dir_of(tmp_path / "out")
    # min_pass_rate_rel 0 allows losing every reference pass, max_kld_mean 100 any measured KLD: the
    # candidate passes whatever it answers, but fails closed when its fidelity was not measured
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = {t: json.loads((run / "tiers" / f"{t}.json").read_text()) for t in ("text", "chat")}
    for t in ("text", "chat"):
        assert res[t]["status"] == "ok", res[t].get("error")
        assert res[t]["served"]["prompt_mode"] == t and res[t]["served"]["token_counts"] == "server usage"
        assert res[t]["quality"]["behaviour"]["n_checks"]  # the suites' answers were checked
    fid = res["text"]["quality"]["fidelity"]
    assert fid["n_tokens"] > 0 and fid["kld_topk"] == 20 and fid["kld_estimate"].startswith("top-20"), fid
    assert fid["kld_mean"] is not None and 0 <= fid["same_top_rate"] <= 1 and not fid.get("not_measured")
    assert res["text"]["served"]["fidelity"] is None
    fid = res["chat"]["quality"]["fidelity"]
    assert fid["n_tokens"] == 0 and fid["not_measured"].startswith("fidelity not measurable on this endpoint")
    table = (run / "table.md").read_text()
    row = next(ln for ln in table.splitlines() if "| chat |" in ln)
    assert "prompt mode chat; token counts: server usage" in row and "fidelity not measurable" in row
