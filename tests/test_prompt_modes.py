"""Prompt modes of the ``openai`` engine (issue 50): ``tokens`` (token ids to
``/v1/completions``), ``text`` (the prompt as text there) and ``chat`` (messages to
``/v1/chat/completions``).

Fast tests talk to a scripted fake server (http.server in a thread, ``Fake`` of
tests/test_engine_openai.py): the bodies each mode sends, token counts from ``usage`` and
from the source tokenizer when ``usage`` is absent, the tokenizer check's difference in chat
mode, and ``qeval validate``'s one-line refusals. Slow tests start llama-server on the tiny
GGUF and measure the same file in all three modes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


@pytest.mark.parametrize("case", ["unknown mode", "chat with a fidelity rule", "without engine openai"])
def test_validate_refuses_a_prompt_mode_that_cannot_work_in_one_line(case, tiny_llama, tmp_path):
    url = "http://127.0.0.1:9"
    mode, rule, engine = {"unknown mode": ("voice", "max_kld_mean: 10.0", "engine: openai, "),
                          "chat with a fidelity rule": ("chat", "min_same_top_rate: 0.5", "engine: openai, "),
                          "without engine openai": ("text", "max_kld_mean: 10.0", "")}[case]
    served = f"endpoint: {{url: {url}}}, " if engine else ""
    tiers = (f"  - {{name: bf16, method: bf16}}\n"
             f"  - {{name: remote, method: bf16, {engine}{served}prompt_mode: {mode}}}\n")
    p, recipe = _validate(tmp_path, tiny_llama, tiers, f"gate: {{reference: bf16, rules: {{{rule}}}}}")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and str(recipe) in lines[0] and "Traceback" not in p.stderr, lines
    assert "tiers[1]" in lines[0] and "prompt_mode" in lines[0], lines[0]
    if case == "chat with a fidelity rule":
        assert "min_same_top_rate" in lines[0] and "remote" in lines[0]


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


# ---- llama-server on the tiny GGUF (slow) -------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GGUF (conftest.served_gguf_module)."""
    from conftest import served_gguf_module
    yield from served_gguf_module(tmp_path_factory, "modes")


@pytest.mark.slow
def test_the_same_file_on_llama_server_in_tokens_text_and_chat_modes(served, tmp_path):
    from qeval.engines.openai import COUNT_IDS, COUNT_USAGE, OpenAIEngine
    from qeval.serving.closed_loop import closed_loop
    tok = served["tok"]
    ids = served["ids"][:40]
    stop = [tok.eos_token_id]
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
            got[mode] = {"g": g, "chat": a, "info": eng.served_info(), "load": run.requests[0]}
        finally:
            eng.close()
    tokens, text, chat = got["tokens"], got["text"], got["chat"]
    assert tokens["info"]["token_counts"] == COUNT_IDS and tokens["info"]["fidelity"] is None
    assert text["info"]["token_counts"] == COUNT_USAGE == chat["info"]["token_counts"]  # llama-server sends usage
    assert text["info"]["fidelity"].startswith("fidelity not measurable")  # conservative for now (see fidelity_note)
    assert chat["info"]["fidelity"].startswith("fidelity not measurable")
    # the same prompt as text: the same greedy answer as the token ids gave (its text)
    assert tok.decode(text["g"].token_ids) == tok.decode(tokens["g"].token_ids)
    # chat: the server rendered its template; the check reports the difference, never fails
    check = chat["info"]["tokenizer_check"][0]
    assert check["difference"] is not None and check["server_tokens"] == check["text_tokens"] + check["difference"]
    assert chat["chat"].token_ids and len(chat["chat"].token_times_s) >= 1
    for mode in ("tokens", "text", "chat"):  # the load stage in every mode: 4 tokens timed
        assert len(got[mode]["load"].token_times_s) == 4, mode
    assert json.dumps(chat["info"])  # the row's record is plain JSON


@pytest.mark.slow
def test_a_run_with_text_and_chat_endpoint_tiers_says_mode_counts_and_fidelity_in_the_row(served, tmp_path):
    """A whole run (CLI) with two endpoint tiers on one llama-server: ``text`` and ``chat``
    (answers and checks; fidelity not measurable, said in the row);
    each row says its prompt mode and where its token counts came from."""
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
                          extra="gate: {reference: ref, candidates: [text], rules: {min_pass_rate_rel: 0.0}}")
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
    # min_pass_rate_rel 0 allows losing every reference pass: the candidate passes whatever it answers
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = {t: json.loads((run / "tiers" / f"{t}.json").read_text()) for t in ("text", "chat")}
    for t in ("text", "chat"):
        assert res[t]["status"] == "ok", res[t].get("error")
        assert res[t]["served"]["prompt_mode"] == t and res[t]["served"]["token_counts"] == "server usage"
        assert res[t]["quality"]["behaviour"]["n_checks"]  # the suites' answers were checked
    for t in ("text", "chat"):
        fid = res[t]["quality"]["fidelity"]
        assert fid["n_tokens"] == 0 and fid["not_measured"].startswith("fidelity not measurable on this endpoint")
    table = (run / "table.md").read_text()
    row = next(ln for ln in table.splitlines() if "| chat |" in ln)
    assert "prompt mode chat; token counts: server usage" in row and "fidelity not measurable" in row
