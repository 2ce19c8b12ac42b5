"""Ollama's native dialect (issue 50, item 4; :mod:`qeval.engines.servers.ollama`) against a
scripted Ollama-shaped server (http.server in a thread, as tests/test_served_open_loop.py's
fake). Its answers have the shapes of Ollama's API reference (https://docs.ollama.com/api/chat
and /api/generate, the examples of ollama's docs/api.md): NDJSON lines with
``message.content`` or ``response``, a last object ``done: true`` with ``done_reason`` and
the timings in nanoseconds, per-token ``logprobs`` with ``top_logprobs`` by token text when
asked, ``GET /api/tags`` listing the pulled models, and ``404 {"error": "model '<name>' not
found"}`` for a model that is not pulled.

Covered: a streamed chat answer and its timings in the row (``served.ollama_timings``), the
request bodies (greedy options, ``num_predict``, ``seed``, ``num_ctx``, ``keep_alive``,
``stream``; ``raw`` text on ``/api/generate``), ``top_logprobs`` read into the top-k by
source token id, a model that is not pulled (at connect and at a request: one line naming
``ollama pull``), a stream cut before ``done`` (an exception for one answer, a failed
request under load, counted), a closed-loop load point through the served core, and a bad
``dialect:`` refused by ``qeval validate`` in one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO, write_recipe

DEPTH_TEXT = REPO / "qeval" / "data" / "depth_text.txt"
MODEL = "qwen2.5:0.5b-instruct-q4_K_M"
PIECES = ["Hello", " there", ",", " friend"]  # streamed one a line
CUT = "CUT-HERE"  # a prompt holding this is answered with two pieces, then the connection closes
#: Per-token durations of the script's timings (nanoseconds): 500 prompt tokens/s, 100 decode tokens/s.
PROMPT_NS, EVAL_NS, LOAD_NS = 2_000_000, 10_000_000, 1_334_875


class Ollama:
    """A scripted ``ollama serve``: ``pulled`` model names (``GET /api/tags``); ``requests``
    holds ``(path, body)`` of every POST; ``count(text)`` is its prompt token count;
    ``top`` maps each answer piece to its ``top_logprobs`` (``[(token text, logprob)]``)."""

    def __init__(self, pulled=(MODEL,), count=len, top=None) -> None:
        self.pulled = list(pulled)
        self.count, self.top = count, top or {}
        self.requests: list[tuple[str, dict]] = []
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, code: int, obj: dict) -> None:
                b = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

            def do_GET(self):
                if self.path != "/api/tags":
                    return self._json(404, {"error": "404 page not found"})
                return self._json(200, {"models": [{"name": n, "model": n, "size": 397821319,
                                                    "details": {"format": "gguf", "quantization_level": "Q4_K_M"}}
                                                   for n in srv.pulled]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                srv.requests.append((self.path, body))
                if body.get("model") not in srv.pulled:
                    return self._json(404, {"error": f"model '{body.get('model')}' not found"})
                chat = self.path == "/api/chat"
                prompt = "".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
                n = int(body["options"]["num_predict"])
                pieces = (PIECES * (1 + n // len(PIECES)))[:n]
                ended = len(pieces) < len(PIECES) * 4  # the script "stops" unless asked for more

                def obj(piece, done=False):
                    o = {"model": body["model"], "created_at": "2025-11-11T08:52:19.385406455-07:00"}
                    o.update({"message": {"role": "assistant", "content": piece}} if chat else {"response": piece})
                    if body.get("logprobs") and piece:
                        top = srv.top.get(piece, [(piece, -0.1)])[: body.get("top_logprobs", 0) or 1]
                        o["logprobs"] = [{"token": piece, "logprob": top[0][1], "bytes": list(piece.encode()),
                                          "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                                           for t, lp in top]}]
                    o["done"] = done
                    if done:
                        pc = srv.count(prompt)
                        o.update({"done_reason": "stop" if ended else "length", "total_duration":
                                  LOAD_NS + pc * PROMPT_NS + len(pieces) * EVAL_NS, "load_duration": LOAD_NS,
                                  "prompt_eval_count": pc, "prompt_eval_duration": pc * PROMPT_NS,
                                  "eval_count": len(pieces), "eval_duration": len(pieces) * EVAL_NS})
                    return o
                if not body.get("stream", True):
                    whole = obj("".join(pieces), done=True)
                    if body.get("logprobs"):  # one entry per token, as streamed
                        whole["logprobs"] = [e for p in pieces for e in obj(p)["logprobs"]]
                    return self._json(200, whole)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                if CUT in prompt:  # two pieces, then the connection closes: no done object
                    for p in pieces[:2]:
                        self.wfile.write((json.dumps(obj(p)) + "\n").encode())
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                for p in pieces:
                    self.wfile.write((json.dumps(obj(p)) + "\n").encode())
                    self.wfile.flush()
                self.wfile.write((json.dumps(obj("", done=True)) + "\n").encode())
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def ollama():
    made = []

    def make(**kw):
        s = Ollama(**kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def _tok(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def _open(srv, model_dir, **kw):
    from qeval.engines.base import EngineOptions
    from qeval.engines.openai import OpenAIEngine
    endpoint = {"url": srv.url, "dialect": "ollama", "model": kw.pop("model", MODEL)}
    server = dict(endpoint=endpoint, tokenizer=str(model_dir), depth_text=str(DEPTH_TEXT), depths=[16],
                  tokens={"sequence": 300, "load_sequence": 40}, **kw)
    return OpenAIEngine.open("gguf", None, EngineOptions(device="cpu", server=server))


# ---- the wire ------------------------------------------------------------------------------

def test_the_dialect_is_registered_and_reads_recorded_lines():
    """The registry knows ``ollama`` (not sniffed from an ``owned_by``); a recorded stream's
    lines read as OpenAI chunks, the last one with its usage and timings; an error line is
    an error; a request of token ids is refused."""
    from qeval.engines.servers import dialect_for_owner, dialect_named, dialect_names
    from qeval.engines.servers.ollama import summarise_timings, timings
    assert "ollama" in dialect_names() and dialect_for_owner("library").name == "openai"
    d = dialect_named("ollama")
    chunk, end = d.read_line('{"model":"m","created_at":"x","message":{"role":"assistant","content":"The"},'
                             '"done":false}')
    assert not end and chunk["choices"][0]["delta"] == {"content": "The"} and "usage" not in chunk
    final = ('{"model":"m","created_at":"x","message":{"role":"assistant","content":""},"done":true,'
             '"done_reason":"stop","total_duration":4883583458,"load_duration":1334875,"prompt_eval_count":26,'
             '"prompt_eval_duration":342546000,"eval_count":282,"eval_duration":4535599000}')
    chunk, end = d.read_line(final)
    assert end and chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["usage"] == {"prompt_tokens": 26, "completion_tokens": 282,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    t = chunk["ollama"]
    assert t == timings(json.loads(final))
    assert t["decode_tokens_per_s"] == pytest.approx(282 / 4.535599)  # eval_count / eval_duration * 1e9
    assert t["prompt_tokens_per_s"] == pytest.approx(26 / 0.342546) and t["load_s"] == pytest.approx(0.001334875)
    # a prompt partly served from Ollama's cache: its rate counts the evaluated tokens only
    part = timings({"prompt_eval_count": 100, "prompt_eval_cached_count": 60, "prompt_eval_duration": 80_000_000,
                    "eval_count": 0, "eval_duration": 0})
    assert part["prompt_tokens_per_s"] == pytest.approx(40 / 0.08) and part["decode_tokens_per_s"] is None
    both = summarise_timings([part, t])
    assert both["cached_prompt_tokens"] == 60 and both["answers"] == 2
    assert both["prompt_tokens_per_s"] == pytest.approx((40 + 26) / (0.08 + 0.342546))
    assert both["decode_tokens_per_s"] == pytest.approx(282 / 4.535599)
    assert set(both["by_prompt_tokens"]) == {"26", "100"}
    gen, _ = d.read_line('{"model":"m","created_at":"x","response":" sky","done":false}')
    assert gen["choices"][0]["text"] == " sky"
    assert d.read_line("") == (None, False)
    with pytest.raises(RuntimeError, match="Ollama: out of memory"):
        d.read_line('{"error":"out of memory"}')
    with pytest.raises(ValueError, match="prompt_mode to text or chat"):
        d.route("/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 2})


def test_a_streamed_chat_answer_its_request_and_its_timings_in_the_row(ollama, tiny_llama):
    """Chat mode (the dialect's default): the prompt goes to ``/api/chat`` as one user
    message with Ollama's greedy options, ``num_predict``, ``seed``, ``num_ctx`` (the tier's
    longest sequence, 300 -> 512) and ``keep_alive``, streamed; the answer's ids are the
    source tokenizer's of its text, its token count Ollama's ``eval_count``; the row carries
    Ollama's own rates beside the client's, from its nanosecond timings."""
    from qeval.engines.openai import _template_ids
    tok = _tok(tiny_llama)
    srv = ollama(count=lambda t: len(tok(t)["input_ids"]))
    eng = _open(srv, tiny_llama)
    try:
        assert eng.prompt_mode == "chat" and eng.client.dialect == "ollama" and eng.client.model == MODEL
        check = eng.tokenizer_check[0]  # chat mode: the difference reported, never failed
        assert check["server_tokens"] is not None and check["difference"] == check["server_tokens"] - \
            check["text_tokens"]
        prompt = _template_ids(tok, [{"role": "user", "content": "hi"}])
        g = eng.generate(prompt, 3, stop_ids=[tok.eos_token_id])
        path, body = srv.requests[-1]
        assert path == "/api/chat" and body["stream"] is True and body["model"] == MODEL
        assert body["options"] == {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "repeat_penalty": 1.0, "seed": 0,
                                   "num_predict": 3, "num_ctx": 512}
        assert body["keep_alive"] == "30m" and "logprobs" not in body
        assert body["messages"] == [{"role": "user", "content": eng.prompt_text(prompt)}]
        text_ids = tok("".join(PIECES[:3]), add_special_tokens=False)["input_ids"]
        assert g.finished and g.token_ids == text_ids + [tok.eos_token_id]
        assert len(g.token_times_s) == 3 and g.token_times_s == sorted(g.token_times_s)  # eval_count tokens
        g2 = eng.generate(prompt, 5, stop_ids=[tok.eos_token_id])
        assert len(g2.token_times_s) == 5
        info = eng.served_info()
        assert info["dialect"] == "ollama" and info["token_counts"] == "Ollama prompt_eval_count/eval_count"
        ot = info["ollama_timings"]
        assert ot["answers"] == 2  # the two generations (the tokenizer check is not a stream)
        assert ot["decode_tokens_per_s"] == pytest.approx(1e9 / EVAL_NS)
        assert ot["prompt_tokens_per_s"] == pytest.approx(1e9 / PROMPT_NS)
        assert ot["load_s_max"] == pytest.approx(LOAD_NS * 1e-9) and ot["load_s_total"] == pytest.approx(2 * LOAD_NS * 1e-9)
        n_prompt = srv.count(eng.prompt_text(prompt))
        assert list(ot["by_prompt_tokens"]) == [str(n_prompt)] and ot["by_prompt_tokens"][str(n_prompt)]["answers"] == 2
        assert "prompt_eval_duration" in ot["source"] and ot["cached_prompt_tokens"] == 0
    finally:
        eng.close()


def test_text_mode_goes_raw_to_generate_and_top_logprobs_score_by_source_id(ollama, tiny_llama):
    """Text mode: ``/api/generate`` with the rendered prompt and ``raw: true`` (Ollama adds
    no template); scoring asks ``logprobs`` with ``top_logprobs`` (at most 20) for one
    token and reads them by token text into source ids, most probable first; a text no
    source token decodes to alone is left out."""
    tok = _tok(tiny_llama)
    ids = list(dict.fromkeys(tok(" the cat sat", add_special_tokens=False)["input_ids"]))[:3]  # three tokens
    texts = [tok.decode([i]) for i in ids]
    assert len(set(texts)) == len(ids) == 3
    top = {"Hello": [(texts[1], -0.5), ("\u2603no-such-token\u2603", -1.0), (texts[0], -1.5), (texts[2], -3.0)]}
    srv = ollama(count=lambda t: len(tok(t)["input_ids"]), top=top)
    eng = _open(srv, tiny_llama, prompt_mode="text")
    try:
        assert eng.tokenizer_check[0]["server_tokens"] == eng.tokenizer_check[0]["text_tokens"]  # raw text: same count
        assert eng.fidelity_note is None  # text mode on a dialect with top-k: scored
        row = eng.topk_at([int(t) for t in tok("Once upon", add_special_tokens=False)["input_ids"]])
        path, body = srv.requests[-1]
        assert path == "/api/generate" and body["raw"] is True and body["prompt"] == "Once upon"
        assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["options"]["num_predict"] == 1
        assert body["stream"] is False
        assert row == [(ids[1], -0.5), (ids[0], -1.5), (ids[2], -3.0)]
        g = eng.generate(tok("Once", add_special_tokens=False)["input_ids"], 2)
        assert srv.requests[-1][0] == "/api/generate" and srv.requests[-1][1]["stream"] is True
        assert g.token_ids[:1] == tok("Hello", add_special_tokens=False)["input_ids"][:1]
    finally:
        eng.close()


def test_a_model_that_is_not_pulled_is_one_line_naming_ollama_pull(ollama, tiny_llama):
    """At connect (``/api/tags`` lacks it) and at a request (Ollama's 404, the model removed
    since): one line naming ``ollama pull <model>``; the preflight says the same."""
    from qeval.engines.openai import EndpointError, preflight_endpoint
    from qeval.engines.servers import EndpointSpec
    srv = ollama(pulled=["llama3.2:latest"])
    with pytest.raises(EndpointError) as e:
        _open(srv, tiny_llama)
    msg = str(e.value)
    assert "\n" not in msg and f"ollama pull {MODEL}" in msg and "llama3.2:latest" in msg
    assert e.value.field == "endpoint.model"
    spec = EndpointSpec(url=srv.url, dialect="ollama", model=MODEL)
    with pytest.raises(EndpointError, match=f"ollama pull {MODEL}"):
        preflight_endpoint(spec)
    assert preflight_endpoint(EndpointSpec(url=srv.url, dialect="ollama", model="llama3.2"))["model"] == \
        "llama3.2:latest"  # a name without a tag is :latest, as ollama list shows it
    srv.pulled.append(MODEL)
    eng = _open(srv, tiny_llama)
    try:
        srv.pulled.remove(MODEL)  # removed on the server since the tier connected
        with pytest.raises(EndpointError) as e:
            eng.generate([5, 6, 7], 2)
        msg = str(e.value)
        assert "\n" not in msg and "404" in msg and f"model '{MODEL}' not found" in msg
        assert f"run `ollama pull {MODEL}`" in msg
    finally:
        eng.close()


def test_prompt_mode_tokens_is_refused_on_the_ollama_dialect(ollama, tiny_llama):
    from qeval.engines.openai import EndpointError
    srv = ollama()
    with pytest.raises(EndpointError, match="takes text or messages, not token ids") as e:
        _open(srv, tiny_llama, prompt_mode="tokens")
    assert e.value.field == "prompt_mode" and srv.requests == []


def test_a_stream_cut_before_done_fails_the_answer_and_counts_a_failed_request(ollama, tiny_llama):
    """A stream whose connection closes before the ``done: true`` object: one answer raises
    (the stage fails the tier in one line, nothing half-read is kept); under load the
    request is counted failed, the others complete."""
    from qeval.serving.open_loop import open_loop
    tok = _tok(tiny_llama)
    srv = ollama()
    eng = _open(srv, tiny_llama)
    cut = tok(CUT, add_special_tokens=False)["input_ids"]
    assert CUT in eng.prompt_text(cut)
    try:
        with pytest.raises(RuntimeError, match="cut mid-answer"):
            eng.generate(cut, 4)
        ok = tok("fine " * 16, add_special_tokens=False)["input_ids"][:len(cut)]  # a point's prompts: one length
        assert len(ok) == len(cut)
        prompts = [ok, cut, ok]
        run = open_loop(eng, lambda s, i: prompts[i], arrivals=[0.0, 0.0, 0.0], slots=3, max_waiting=0,
                        timeout_s=30.0, output_tokens=3)
    finally:
        eng.close()
    assert [r.outcome for r in run.requests] == ["completed", "failed", "completed"]
    assert run.failed_by_status == {"error (stream cut before its end)": 1}
    assert all(len(r.token_ids) == 3 for r in run.completed)


def test_a_closed_loop_load_point_on_ollama(ollama, tiny_llama):
    """The closed loop through the served core on Ollama's native route: every request's
    three chunks are its tokens, each request went to ``/api/chat`` with ``num_predict`` 3
    and the tier's ``num_ctx``."""
    from qeval.serving.closed_loop import closed_loop
    tok = _tok(tiny_llama)
    srv = ollama()
    eng = _open(srv, tiny_llama)
    before = len(srv.requests)
    prompt = lambda s, k: tok(f"stream {s} request {k}", add_special_tokens=False)["input_ids"]  # noqa: E731
    try:
        run = closed_loop(eng, prompt, concurrency=2, output_tokens=3, requests_per_stream=2)
    finally:
        eng.close()
    assert run.scheduling == "server" and len(run.requests) == 4
    assert all(len(r.token_ids) == 3 for r in run.requests)
    sent = srv.requests[before:]
    assert len(sent) == 4 and {p for p, _ in sent} == {"/api/chat"}
    assert all(b["options"]["num_predict"] == 3 and b["options"]["num_ctx"] == 512 and b["stream"] for _, b in sent)
    assert sorted(b["messages"][0]["content"] for _, b in sent) == \
        sorted(f"stream {s} request {k}" for s in range(2) for k in range(2))
    assert run.details["dialect"] == "ollama"


def test_validate_refuses_an_unknown_dialect_in_one_line(tiny_llama, tmp_path):
    tiers = ("  - {name: bf16, method: bf16}\n"
             "  - {name: remote, method: bf16, engine: openai, endpoint: {url: 'http://127.0.0.1:9', "
             "dialect: olama, model: 'qwen2.5:0.5b'}}\n")
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(recipe)],
                       env=dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, lines
    assert str(recipe) in lines[0] and "tiers[1].endpoint.dialect" in lines[0] and "olama" in lines[0], lines[0]
    assert "ollama" in lines[0]  # the known names


def test_a_run_on_an_ollama_tier_whose_model_is_not_pulled_exits_2_in_one_line(ollama, tiny_llama, tmp_path):
    """``qeval run``'s endpoint check before any stage: the tier's ``endpoint.model`` field,
    one line naming ``ollama pull``, exit 2, no run folder."""
    srv = ollama(pulled=["llama3.2:latest"])
    tiers = ("  - {name: bf16, method: bf16}\n"
             f"  - {{name: q4, method: bf16, engine: openai, endpoint: {{url: '{srv.url}', dialect: ollama, "
             f"model: '{MODEL}'}}}}\n")
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers, suites=False)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "results")],
                       env=dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, lines
    assert str(recipe) in lines[0] and "tiers[1].endpoint.model" in lines[0], lines[0]
    assert f"run `ollama pull {MODEL}`" in lines[0], lines[0]
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("run.json"))
