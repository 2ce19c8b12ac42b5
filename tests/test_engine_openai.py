"""The ``openai`` engine: an OpenAI-compatible endpoint, or llama-server started on a GGUF.

Fast tests talk to a fake server in this process (http.server): the wire format of both
dialects, the endpoint checks (unreachable, refused key, another tokenizer) as one line
and exit 2 before any stage, the API key kept out of the run folder. Slow tests start
llama-server (built from the vendored llama.cpp, cached) on the tiny model's GGUF.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from conftest import REPO, run_dir_of, write_recipe

SECRET = "sk-qeval-test-5f3a9c1e7b"
DEPTH_TEXT = REPO / "qeval" / "data" / "depth_text.txt"


# ---- a fake OpenAI-compatible server ------------------------------------------------------

class Fake:
    """A tiny /v1 server: ``key`` required when set; ``count`` maps a text prompt to its
    usage count; streams ``answer`` token ids llama-server style; ``script(path, body)``,
    when given, answers first (a dict: that JSON; a list: those chunks streamed; None: the
    default answer)."""

    def __init__(self, key=None, count=None, answer=(5, 6, 7), owner="llamacpp", script=None):
        self.key, self.count, self.answer, self.owner, self.script = key, count, list(answer), owner, script
        self.requests: list[dict] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _auth(self) -> bool:
                if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self.send_response(401)
                    self.end_headers()
                    return False
                return True

            def _json(self, obj):
                b = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

            def do_GET(self):
                if self._auth():
                    self._json({"object": "list", "data": [{"id": "fake-model", "owned_by": fake.owner}]})

            def do_POST(self):
                if not self._auth():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                scripted = fake.script(self.path, body) if fake.script else None
                if isinstance(scripted, dict):
                    return self._json(scripted)
                if isinstance(scripted, list):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for ch in scripted:
                        self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                p = body["prompt"]
                n_prompt = fake.count(p) if isinstance(p, str) else len(p)
                ids = fake.answer[:body["max_tokens"]]
                usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids)}
                if not body.get("stream"):
                    content = [{"id": i, "logprob": -0.1, "top_logprobs": [{"id": i, "logprob": -0.1}]} for i in ids]
                    return self._json({"choices": [{"text": "x", "logprobs": {"content": content}}], "usage": usage})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in ids:
                    ch = {"choices": [{"text": "x", "logprobs": {"content": [{"id": i, "logprob": -0.1}]}}]}
                    self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.01)
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    made = []

    def make(**kw):
        f = Fake(**kw)
        made.append(f)
        return f
    yield make
    for f in made:
        f.close()


def _options(**server):
    from qeval.engines.base import EngineOptions
    return EngineOptions(device="cpu", server=server)


# ---- wire format ------------------------------------------------------------------------

def test_chunk_token_ids_and_topk_in_both_dialects():
    from qeval.engines.openai import chunk_token_ids, chunk_topk
    llama = {"choices": [{"logprobs": {"content": [{"id": 7, "logprob": -0.5, "top_logprobs": [
        {"id": 7, "logprob": -0.5}, {"id": 3, "logprob": -1.5}]}]}}]}
    vllm = {"choices": [{"logprobs": {"tokens": ["token_id:9"], "top_logprobs": [{"token_id:9": -0.2,
                                                                                   "token_id:4": -2.0}]}}]}
    assert chunk_token_ids(llama) == [7] and chunk_topk(llama) == [[(7, -0.5), (3, -1.5)]]
    assert chunk_token_ids(vllm) == [9] and sorted(chunk_topk(vllm)[0]) == [(4, -2.0), (9, -0.2)]
    assert chunk_token_ids({"tokens": [1, 2]}) == [1, 2]
    assert chunk_token_ids({"choices": [], "usage": {}}) == []


def test_topk_row_keeps_the_top_k_and_spreads_the_rest():
    from qeval.engines.openai import topk_row
    row = topk_row([(2, np.log(0.5)), (0, np.log(0.3))], 6)
    p = np.exp(row.astype(np.float64))
    assert p.sum() == pytest.approx(1.0, abs=1e-6)
    assert p[2] == pytest.approx(0.5) and p[0] == pytest.approx(0.3)
    assert np.allclose(p[[1, 3, 4, 5]], 0.2 / 4)


def test_topk_kld_is_exact_for_k_equal_vocab_and_a_lower_bound_below():
    from qeval.engines.openai import topk_row
    from qeval.measure.fidelity import FidelityAccumulator, kld_rows, topk_kld_rows
    rng = np.random.default_rng(0)
    v = 50

    def logsm(x):
        return x - np.log(np.exp(x).sum(1, keepdims=True))
    ref = logsm(rng.normal(size=(30, v)) * 2)
    tier = logsm(ref + rng.normal(size=(30, v)) * 0.5)
    full = kld_rows(ref, tier)
    assert np.allclose(topk_kld_rows(ref, tier, v), full, atol=1e-9)  # nothing left in the bucket: exact
    for k in (1, 5, 20):
        est = topk_kld_rows(ref, tier, k)
        assert (est <= full + 1e-9).all() and est.mean() > 0  # coarse-graining: a lower bound
    # rows a server gives (top-k at their ids, the rest spread evenly) yield the same estimate
    served = np.stack([topk_row([(int(i), float(tier[r, i])) for i in np.argsort(-tier[r])[:5]], v)
                       for r in range(30)])
    assert np.allclose(topk_kld_rows(ref, served, 5), topk_kld_rows(ref, tier, 5), atol=1e-5)
    acc = FidelityAccumulator(topk=5)
    acc.add(ref, served, ref.argmax(1), np.arange(30))
    s = acc.summary()
    assert s["kld_topk"] == 5 and s["kld_estimate"].startswith("top-5 (remaining mass in one bucket")
    assert s["kld_mean"] == pytest.approx(topk_kld_rows(ref.astype(np.float16), served.astype(np.float16), 5).mean(),
                                          rel=1e-3)
    assert FidelityAccumulator().summary() == {"n_tokens": 0}


def _scripted_scorer(vocab, prompt_logprobs=True):
    """A vLLM-like scorer: the next-token distribution after a prefix is a fixed function of
    the prefix (seeded by it); per-position requests (``max_tokens`` 1, ``logprobs`` k) get
    the top-k of the generated token as ``token_id:N``, ``prompt_logprobs`` requests every
    prompt position's top-k plus the prompt's own token (its rank) when outside them."""
    def logp(prefix):
        x = np.random.default_rng(abs(hash(tuple(prefix))) % 2**32).normal(size=vocab) * 3
        return x - np.log(np.exp(x).sum())

    def script(path, body):
        p = body.get("prompt")
        if path != "/v1/completions" or not isinstance(p, list) or body.get("stream"):
            return None
        usage = {"prompt_tokens": len(p), "completion_tokens": 1}
        if "prompt_logprobs" in body:
            if not prompt_logprobs:  # a server that ignores the field
                return {"choices": [{"text": "x"}], "usage": usage}
            k, rows = body["prompt_logprobs"], [None]
            for i in range(1, len(p)):
                lp = logp(p[:i])
                order = [int(t) for t in np.argsort(-lp)]
                row = {str(t): {"logprob": float(lp[t]), "rank": r + 1, "decoded_token": "x"}
                       for r, t in enumerate(order[:k])}
                row.setdefault(str(p[i]), {"logprob": float(lp[p[i]]), "rank": order.index(p[i]) + 1,
                                           "decoded_token": "x"})
                rows.append(row)
            return {"choices": [{"text": "x", "prompt_logprobs": rows}], "usage": usage}
        lp = logp(p)
        order = [int(t) for t in np.argsort(-lp)][:body["logprobs"]]
        return {"choices": [{"text": "x", "logprobs": {"tokens": [f"token_id:{order[0]}"], "top_logprobs": [
            {f"token_id:{t}": float(lp[t]) for t in order}]}}], "usage": usage}
    return script


def test_prompt_logprobs_scoring_equals_the_per_position_path_in_one_request(fake, tiny_llama):
    from transformers import AutoTokenizer

    from qeval.engines.openai import OpenAIEngine
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_llama)))
    ids = [int(t) for t in np.random.default_rng(1).integers(0, vocab, size=40)]

    def rows(f, **server):
        eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama),
                                                           **server))
        try:
            before = len(f.requests)
            out = list(eng.iter_logprobs(ids, window=16, first=3))
            return out, f.requests[before:], eng
        finally:
            eng.close()

    f = fake(owner="vllm", script=_scripted_scorer(vocab))
    one, reqs_one, eng = rows(f)  # vLLM's dialect: prompt_logprobs by default
    assert eng.prompt_logprobs and len(reqs_one) == 1
    assert reqs_one[0]["prompt"] == ids and reqs_one[0]["prompt_logprobs"] == eng.topk == 20
    assert reqs_one[0]["stream"] is False and reqs_one[0]["max_tokens"] == 1
    per, reqs_per, _ = rows(f, prompt_logprobs=False)  # declared off: one request per position
    assert len(reqs_per) == len(ids) - 1 - 3 and all("prompt_logprobs" not in r for r in reqs_per)
    assert [s for s, _ in one] == [s for s, _ in per] == [3, 19, 35]
    a, b = np.concatenate([r for _, r in one]), np.concatenate([r for _, r in per])
    assert a.shape == (len(ids) - 1 - 3, vocab) and np.array_equal(a, b)
    # the reference token outside the top k is dropped, so each row still holds exactly k exact entries
    assert all(int((np.abs(r - r.min()) > 1e-6).sum()) == 20 for r in a[:5])
    # a server that ignores prompt_logprobs is scored per position, with the same rows
    g = fake(owner="vllm", script=_scripted_scorer(vocab, prompt_logprobs=False))
    fb, reqs_fb, eng = rows(g)
    assert not eng.prompt_logprobs and len(reqs_fb) == 1 + len(ids) - 1 - 3
    assert np.array_equal(np.concatenate([r for _, r in fb]), b)


def _chat_script(field, thinking, answer, finish):
    """Chat answers of a reasoning model: ``thinking`` in ``field`` (vLLM ``reasoning``,
    llama-server ``reasoning_content``), ``answer`` as content (None: null, as when thinking
    spent ``max_tokens``); streamed as deltas, thinking first, or whole."""
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 7}}

    def script(path, body):
        if path != "/v1/chat/completions":
            return None
        if not body.get("stream"):
            msg = {"role": "assistant", "content": answer, field: thinking}
            return {"choices": [{"index": 0, "message": msg, "finish_reason": finish}], "usage": usage}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        for piece in (thinking[:4], thinking[4:]):  # content null while thinking, as vLLM sends
            chunks.append({"choices": [{"index": 0, "delta": {field: piece, "content": None}}]})
        for piece in ([answer[:3], answer[3:]] if answer else []):
            chunks.append({"choices": [{"index": 0, "delta": {"content": piece}}]})
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        chunks.append({"choices": [], "usage": usage})
        return chunks
    return script


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_chat_reasoning_fields_are_kept_apart_and_count_thinking_exhaustion(fake, tiny_llama, field):
    from qeval.engines.openai import OpenAIEngine, message_parts
    from qeval.measure.behaviour import summarise_behaviour, thinking_exhausted
    done = fake(owner="vllm", script=_chat_script(field, "let me think", "Paris is the capital.", "stop"))
    cut = fake(owner="vllm", script=_chat_script(field, "let me think", None, "length"))
    answers = {}
    for name, f in (("done", done), ("cut", cut)):
        eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url}, tokenizer=str(tiny_llama)))
        try:
            for stream in (True, False):
                a = eng.chat([{"role": "user", "content": "capital of France?"}], 16, stream=stream)
                answers[name, stream] = a
                body = f.requests[-1]
                assert body["messages"][0]["content"] == "capital of France?" and body["max_tokens"] == 16
                assert body["stream"] is stream and body["temperature"] == 0
        finally:
            eng.close()
    for stream in (True, False):  # both shapes: the same split
        a, b = answers["done", stream], answers["cut", stream]
        assert (a.content, a.reasoning, a.finished) == ("Paris is the capital.", "let me think", True)
        assert (b.content, b.reasoning, b.finished) == ("", "let me think", False)
        assert a.reasoning_tokens == 7 and a.completion_tokens == 9
        assert (a.first_content_s is not None) == stream and b.first_content_s is None
    # counted from the fields: thinking never inline, the answer never holds it
    assert not thinking_exhausted(**answers["done", True].segment())
    assert thinking_exhausted(**answers["cut", False].segment())
    segs = [{"item": f"s/{i}", "turn": 0, "answer_ids": [], "checks": [], **answers[k].segment()}
            for i, k in enumerate([("done", True), ("cut", True), ("cut", False), ("done", False)])]
    m = summarise_behaviour(segs, {}, n_boot=10)
    assert m["budget_exhausted_rate"] == 0.5 and m["thinking_exhausted_rate"] == 0.5
    # an answer cut in the middle of its answer text spent the budget, not on thinking
    assert not thinking_exhausted("Paris is", False, "let me think")
    # no reasoning field: the thinking is inline and read from the tags, as before
    assert message_parts({"content": "<think>hm</think>Paris"}) == ("<think>hm</think>Paris", None)
    assert thinking_exhausted("<think>still thinking", False) and not thinking_exhausted("<think>a</think>B", False)
    # a server filling both names with the same text is read once
    assert message_parts({"content": None, "reasoning": "x", "reasoning_content": "x"}) == ("", "x")


def test_generate_streams_token_ids_with_chunk_times_and_stops_on_a_stop_token(fake, tiny_llama):
    from qeval.engines.openai import OpenAIEngine
    f = fake(answer=[5, 6, 7, 8])
    eng = OpenAIEngine.open("hf", tiny_llama, _options(endpoint={"url": f.url + "/v1"}, tokenizer=str(tiny_llama)))
    try:
        g = eng.generate([1, 2, 3], 4, ignore_stop=True)
        assert g.token_ids == [5, 6, 7, 8] and not g.finished
        assert g.prefill_s == g.token_times_s[0] > 0 and g.token_times_s == sorted(g.token_times_s)
        assert g.token_times_s[-1] - g.token_times_s[0] >= 0.025  # the fake's 10 ms between chunks
        body = f.requests[-1]
        assert body["prompt"] == [1, 2, 3] and body["temperature"] == 0 and body["stream"] is True
        assert body["ignore_eos"] is True and body["cache_prompt"] is False  # llama.cpp dialect
        g = eng.generate([1, 2, 3], 4, stop_ids=[6])
        assert g.token_ids == [5, 6] and g.finished
        assert eng.backend == "endpoint (llama.cpp)" and eng.vocab_size == len(eng.tok)
    finally:
        eng.close()


# ---- endpoint checks ------------------------------------------------------------------------

def _tok_count(folder):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    return lambda text: len(tok(text)["input_ids"])


def test_endpoint_checks_name_the_problem_in_one_line(fake, tiny_llama, monkeypatch):
    from transformers import AutoTokenizer
    from qeval.engines.openai import EndpointError, TokenizerMismatch, depth_texts, preflight_endpoint
    from qeval.engines.servers import EndpointSpec, free_port
    count = _tok_count(tiny_llama)
    good = fake(key=SECRET, count=count)
    monkeypatch.setenv("QEVAL_TEST_KEY", SECRET)
    spec = EndpointSpec(url=good.url, api_key_env="QEVAL_TEST_KEY")
    ok = preflight_endpoint(spec, tokenizer=tiny_llama, depth_text=DEPTH_TEXT, depths=[8, 64])
    assert ok["model"] == "fake-model" and ok["dialect"] == "llama.cpp"
    texts = depth_texts(AutoTokenizer.from_pretrained(str(tiny_llama)), DEPTH_TEXT, [8, 64])
    assert [c["server_tokens"] for c in ok["tokenizer_check"]] == [count(t) for t in texts]
    assert [r["prompt"] for r in good.requests[-2:]] == texts  # the depth prompts, as text
    monkeypatch.setenv("QEVAL_TEST_KEY", "wrong")
    with pytest.raises(EndpointError, match="refused the API key .HTTP 401") as e:
        preflight_endpoint(spec)
    assert "wrong" not in str(e.value) and e.value.field == "endpoint.api_key_env"
    monkeypatch.delenv("QEVAL_TEST_KEY")
    with pytest.raises(EndpointError, match="QEVAL_TEST_KEY .* is not set"):
        preflight_endpoint(spec)
    with pytest.raises(EndpointError, match="cannot reach") as e:
        preflight_endpoint(EndpointSpec(url=f"http://127.0.0.1:{free_port()}"))
    assert "\n" not in str(e.value)
    other = fake(count=lambda text: count(text) + 1)
    with pytest.raises(TokenizerMismatch, match=r"counts (\d+) prompt tokens where the source tokenizer counts") as e:
        preflight_endpoint(EndpointSpec(url=other.url), tokenizer=tiny_llama, depth_text=DEPTH_TEXT, depths=[8])
    n = count(texts[0])
    assert f"counts {n + 1} prompt tokens where the source tokenizer counts {n} " in str(e.value)


def _endpoint_recipe(tmp_path, model, url, key_env="QEVAL_TEST_KEY"):
    tiers = (f"  - {{name: bf16, method: bf16}}\n"
             f"  - {{name: remote, method: bf16, engine: openai, endpoint: {{url: {url}, api_key_env: {key_env}}}}}\n")
    return write_recipe(tmp_path / "tiny.yaml", model, tiers=tiers, suites=False)


@pytest.mark.parametrize("case", ["unreachable", "wrong key", "tokenizer"])
def test_bad_endpoint_settings_exit_2_in_one_line_before_any_stage(case, fake, tiny_llama, tmp_path):
    from qeval.engines.servers import free_port
    count = _tok_count(tiny_llama)
    if case == "unreachable":
        url, want = f"http://127.0.0.1:{free_port()}", "tiers[1].endpoint.url: cannot reach"
    elif case == "wrong key":
        url, want = fake(key=SECRET, count=count).url, "tiers[1].endpoint.api_key_env: http://127.0.0.1"
    else:
        url, want = fake(count=lambda t: count(t) + 3).url, "tiers[1].endpoint: the server counts"
    recipe = _endpoint_recipe(tmp_path, tiny_llama, url)
    env = dict(os.environ, QEVAL_TEST_KEY="not-" + SECRET, QEVAL_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "results")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and want in lines[0] and str(recipe) in lines[0], lines
    assert "Traceback" not in p.stderr and SECRET not in p.stdout + p.stderr
    assert run_dir_of(tmp_path / "results") is None  # before any stage: no run folder at all


def test_a_served_tier_counts_its_weights_from_the_files(tiny_llama):
    from qeval.tiers import get_method
    from qeval.tiers.base import TierContext, safetensors_sizes
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once, as stored
    assert safetensors_sizes(tiny_llama) == (2 * n, n)  # BF16: 2 bytes per weight
    spec = get_method("bf16").spec(name="r", method="bf16")
    info = get_method("bf16").stored_info(spec, TierContext(source_path=str(tiny_llama), source_sha256="x",
                                                            device="cpu"), None)
    assert info["stored_bytes"] == 2 * n and info["bits_per_weight"] == 16.0 and info["stored_from"] == "files"


def test_vllm_is_refused_off_cuda_in_one_line(tiny_llama):
    from qeval.engines.openai import OpenAIEngine
    from qeval.errors import TierUnavailable
    with pytest.raises(TierUnavailable, match="vLLM serves on CUDA only and this stage runs on cpu"):
        OpenAIEngine.open("hf", tiny_llama, _options(serve={"server": "vllm"}, tokenizer=str(tiny_llama)))


def test_server_commands():
    from qeval.engines.servers import round_ctx
    from qeval.engines.servers.llama_server import llama_server_command
    from qeval.engines.servers.vllm import vllm_command
    cmd = llama_server_command("/b/llama-server", "/m.gguf", port=5, threads=2, parallel=4, ctx_size=2048,
                               kv_cache="int8", flash_attn=True, slot_dir="/tmp/slots")
    s = " ".join(cmd)
    assert "--host 127.0.0.1 --port 5" in s and "-np 4 -c 2048 --kv-unified" in s and "-fa on" in s
    assert "-ctk q8_0 -ctv q8_0" in s and "-ngl 0" in s and "-t 2 -tb 2" in s
    assert "--metrics" in cmd and "--slots" in cmd and "--slot-save-path /tmp/slots" in s  # slot erase needs it
    v = " ".join(vllm_command("vllm", "/ckpt", "gptqmodel", port=7, parallel=8, max_model_len=4096,
                              gpu_memory_utilization=0.85, tokenizer="/src"))
    assert v.startswith("vllm serve /ckpt --host 127.0.0.1 --port 7") and "--max-num-seqs 8" in v
    assert "--gpu-memory-utilization 0.85" in v and "--no-enable-prefix-caching" in v and "--max-model-len 4096" in v
    assert round_ctx(1000) == 1024 and round_ctx(5000, 4096) == 4096 and round_ctx(256) == 256


# ---- llama-server on the tiny model's GGUF (slow) ----------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GGUF (conftest.served_gguf_module) and a llama-server on it (2 slots)."""
    from conftest import served_gguf_module
    yield from served_gguf_module(tmp_path_factory, "openai")


def _serve(tiny, log, parallel=2, tier="t1"):
    from qeval.engines.openai import OpenAIEngine
    return OpenAIEngine.open("gguf", tiny["f16"], _options(
        serve={"server": "llama-server", "parallel": parallel, "ctx_size": 1024}, log=str(log), tier=tier,
        tokenizer=str(tiny["src"]), depth_text=str(DEPTH_TEXT), depths=[40]))


def _slot_tokens(eng) -> list[int]:
    """Tokens each llama-server slot holds, from the server's own ``GET /slots``."""
    import httpx
    return [int(s.get("n_prompt_tokens") or 0) for s in httpx.get(eng.server.url + "/slots").json()]


@pytest.mark.slow
def test_each_timed_phase_starts_on_an_empty_kv_pool_after_a_long_request(served, tmp_path):
    from qeval.measure.memory import PeakMemory
    from qeval.measure.load import distinct_prompts
    from qeval.measure.speed import speed_sweep
    from qeval.serving.closed_loop import load_sweep
    ids = served["ids"]
    long = (ids * 4)[:500]
    eng = _serve(served, tmp_path / "server.log")
    try:
        assert sum(_slot_tokens(eng)) == 0  # the tokenizer check's prompt did not stay in the pool
        eng.generate(long, 8, ignore_stop=True)
        assert sum(_slot_tokens(eng)) >= 500  # a finished request's sequence stays in the unified pool
        with eng.kv_pool_phase("speed at depth 16") as rec:
            assert _slot_tokens(eng) == [0, 0]  # what the server itself says at the phase's start
            eng.generate(ids[:16], 4, ignore_stop=True)
        assert rec["cleared_by"] == "erase_slots" and rec["before"]["slots_tokens"] == 0
        assert rec["after"]["slots_tokens"] > 0
        assert rec["after"]["llamacpp:prompt_tokens_total"] > rec["before"]["llamacpp:prompt_tokens_total"]
        eng.generate(long, 8, ignore_stop=True)
        speed, *_ = speed_sweep(eng, {16: ids[:16], 48: ids[:48]}, decode_tokens=4, repeats=1, warmup=0,
                                peak=PeakMemory("cpu"))
        assert all(speed[d]["kv_pool"]["before"]["slots_tokens"] == 0 for d in ("16", "48"))
        eng.generate(long, 8, ignore_stop=True)
        out = load_sweep(eng, distinct_prompts(ids, 32), concurrency=[2], depth=32, output_tokens=4,
                         requests_per_stream=1, prefill_chunk=16, slo=None)
        pool = out["points"][0]["details"]["kv_pool"]
        assert pool["phase"] == "load at concurrency 2" and pool["before"]["slots_tokens"] == 0
    finally:
        eng.close()


@pytest.mark.slow
def test_a_kv_pool_that_cannot_be_cleared_fails_the_phase_in_one_line(served, tmp_path, monkeypatch):
    from qeval.engines.servers import PoolNotCleared
    from qeval.measure.memory import PeakMemory
    from qeval.measure.speed import speed_sweep
    ids = served["ids"]
    eng = _serve(served, tmp_path / "server.log", tier="gguf-q8-server")
    try:
        monkeypatch.setenv("QEVAL_TEST_POOL_NOT_CLEARED", "gguf-q8-server")  # the clear does nothing
        eng.generate(ids[:100], 4, ignore_stop=True)
        with pytest.raises(PoolNotCleared) as e:
            speed_sweep(eng, {16: ids[:16]}, decode_tokens=4, repeats=1, warmup=0, peak=PeakMemory("cpu"))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("tier gguf-q8-server: the KV pool of llama-server")
        assert "speed at depth 16" in msg and "holds" in msg
    finally:
        eng.close()


@pytest.mark.slow
def test_llama_server_generates_what_llama_cpp_generates_and_serves_load(served, tmp_path):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.load import Slo, distinct_prompts
    from qeval.measure.speed import speed_sweep
    from qeval.serving.closed_loop import load_sweep
    ids = served["ids"][:48]
    local = LlamaCppEngine(served["f16"], threads=1)
    try:
        want = local.generate(ids, 8, ignore_stop=True).token_ids
    finally:
        local.close()
    eng = _serve(served, tmp_path / "server.log")
    try:
        assert eng.tokenizer_check and eng.tokenizer_check[0]["server_tokens"] == eng.tokenizer_check[0]["text_tokens"]
        g = eng.generate(ids, 8, ignore_stop=True)
        assert g.token_ids == want  # greedy over HTTP = greedy in process, token for token
        assert len(g.token_times_s) == 8 and g.decode_tokens_per_s
        counter = eng.peak_counter()
        speed, peaks, *_ = speed_sweep(eng, {16: ids[:16], 48: ids}, decode_tokens=4, repeats=2, warmup=1,
                                      peak=counter)
        assert set(speed) == {"16", "48"} and all(v["ttft_s"] > 0 for v in speed.values())
        assert peaks["48"] > 10 * 2**20 and counter.kind == "server_rss_sampled"  # the server's RSS, not ours
        out = load_sweep(eng, distinct_prompts(served["ids"], 32), concurrency=[1, 2], depth=32, output_tokens=4,
                         requests_per_stream=2, prefill_chunk=16, slo=Slo(30.0, 30.0), peak=counter)
        pts = out["points"]
        assert [p["concurrency"] for p in pts] == [1, 2] and all(p["requests"] == 2 * p["concurrency"] for p in pts)
        assert out["scheduling"] == ["server"] and out["users_at_slo"] == 2
        counter.close()
    finally:
        eng.close()
    assert eng.server.proc.returncode is not None  # stopped and reaped
    assert "llama-server" in (tmp_path / "server.log").read_text().splitlines()[0]


@pytest.mark.slow
def test_a_server_killed_mid_stage_is_the_error_with_its_log_tail(served, tmp_path):
    """The server dies between two requests of a stage (killed, then reaped: no timer): the
    next request is the ServerFailed error naming the signal, with the server log's tail."""
    from qeval.engines.servers import ServerFailed
    eng = _serve(served, tmp_path / "server.log", parallel=1)
    try:
        assert eng.generate(served["ids"][:32], 4, ignore_stop=True).token_ids  # serving
        os.kill(eng.server.pid, signal.SIGKILL)
        eng.server.proc.wait(timeout=60)
        with pytest.raises(ServerFailed, match=r"llama-server \(pid \d+\) killed by SIGKILL mid-stage") as e:
            eng.generate(served["ids"][:32], 4, ignore_stop=True)
        assert "server.log" in str(e.value) and e.value.log_tail
    finally:
        eng.close()


# ---- a whole run with served tiers (slow) -----------------------------------------------------

@pytest.mark.slow
def test_a_run_serves_tiers_on_llama_server_and_a_killed_server_fails_its_tier_alone(served, tmp_path):
    import psutil
    from qeval.engines.llama_tools import tool_path
    from qeval.engines.servers import ManagedServer, free_port
    from qeval.engines.servers.llama_server import llama_server_command
    port = free_port()
    remote = ManagedServer(llama_server_command(tool_path("llama-server"), served["f16"], port=port, threads=1,
                                                parallel=2, ctx_size=4096, args=["--api-key", SECRET]),
                           port=port, log_path=tmp_path / "remote-server.log", name="llama-server").start(120)
    tiers = f"""  - {{name: ref, method: bf16}}
  - {{name: srv, method: gguf, type: Q8_0, engine: openai, serve: llama-server}}
  - {{name: srv-killed, method: gguf, type: Q8_0, engine: openai, serve: llama-server}}
  - {{name: remote, method: bf16, engine: openai, endpoint: {{url: {remote.url}/v1, api_key_env: QEVAL_TEST_KEY}}}}
"""
    recipe = write_recipe(tmp_path / "tiny.yaml", served["src"], tiers=tiers,
                          extra="gate: {reference: ref, rules: {max_kld_mean: 10.0}}")
    recipe.write_text(recipe.read_text().replace("model: {source: " + str(served["src"]) + "}",
                                                 "model: {source: " + str(served["src"]) + ", dtype: float32}"))
    out = tmp_path / "results"
    from qeval.paths import cache_root
    cache = tmp_path / "cache"
    cache.mkdir()
    for built in ("llama_tools", "llama_cpp_src"):  # llama-server as built for this machine (cached by flags)
        if (cache_root() / built).exists():
            (cache / built).symlink_to(cache_root() / built)
    # srv-killed's server is killed at the start of its first timed phase (measure, speed at
    # depth 16): a named point (QEVAL_TEST_KILL_SERVER), not a watcher racing the run
    env = dict(os.environ, QEVAL_TEST_KEY=SECRET, QEVAL_CACHE=str(cache), PYTHONPATH=str(REPO),
               QEVAL_TEST_KILL_SERVER="srv-killed")
    proc = subprocess.Popen([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
        remote.stop()
    run = run_dir_of(out)
    # srv-killed is a candidate (every tier but the reference): the gate cannot judge it
    # (ERROR, not a failure of the model), the others pass: exit 4
    assert proc.returncode == 4, stdout[-3000:]
    verdicts = {c["tier"]: c["verdict"] for c in json.loads((run / "gate.json").read_text())["candidates"]}
    assert verdicts == {"srv": "pass", "srv-killed": "error", "remote": "pass"}, verdicts
    res = {t: json.loads((run / "tiers" / f"{t}.json").read_text()) for t in ("ref", "srv", "srv-killed", "remote")}
    # the killed server fails its tier alone, with its reason and the server's log tail in the row
    measure_log = (run / "logs" / "srv-killed.measure.log").read_text()
    assert "test fault QEVAL_TEST_KILL_SERVER at speed at depth 16" in measure_log, measure_log[-2000:]
    bad = res["srv-killed"]
    assert bad["status"] == "failed" and "killed by SIGKILL mid-stage" in bad["error"], bad["error"]
    assert "--- log tail of what failed ---" in bad["log_tail"] and "srv-killed.server.log" in bad["error"]
    server_log = (run / "logs" / "srv-killed.server.log").read_text().splitlines()
    assert server_log[-1].strip() and server_log[-1].strip() in bad["log_tail"]
    # the served tier: speed from the stream, load through the server, quality from its top-k
    srv = res["srv"]
    assert srv["status"] == "ok" and srv["engine"] == "openai" and srv["backend"] == "llama-server-cpu"
    assert all(srv["speed"][d]["decode_tokens_per_s"] for d in ("16", "48"))
    assert srv["memory"]["kind"] == "server_rss_sampled" and srv["memory"]["peak_bytes"]["48"] > 10 * 2**20
    assert [p["concurrency"] for p in srv["load"]["points"]] == [1, 2] and srv["load"]["scheduling"] == ["server"]
    fid = srv["quality"]["fidelity"]
    assert fid["kld_mean"] < 0.5 and fid["same_top_rate"] > 0.8, fid
    assert fid["kld_topk"] == 20 and fid["kld_estimate"].startswith("top-20")
    assert "(top-20 est.)" in next(ln for ln in (run / "table.md").read_text().splitlines() if "| srv |" in ln)
    assert res["ref"]["status"] == "ok" and res["remote"]["status"] == "ok"
    assert res["remote"]["backend"] == "endpoint (llama.cpp)" and res["remote"]["quality"]["fidelity"]["kld_mean"] < 0.1
    # the API key: read from the environment, never written to the run folder (run.json, logs, results)
    for f in run.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    assert SECRET not in stdout
    # every server qeval started is stopped and reaped
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "llama-server" in " ".join(p.info["cmdline"] or [])
                 and str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


def _records_by_request(run) -> dict[tuple[int, int], list[int]]:
    """``(stream, k) -> token ids`` of a closed loop's records (a stream's records in order)."""
    seen: dict[int, int] = {}
    out = {}
    for r in sorted(run.requests, key=lambda r: (r.stream, r.start_s)):
        k = seen.get(r.stream, 0)
        seen[r.stream] = k + 1
        out[(r.stream, k)] = list(r.token_ids)
    return out


@pytest.mark.slow
def test_llama_server_cache_prompt_reuses_the_prefix_with_the_same_tokens(served, tmp_path):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.engines.openai import OpenAIEngine
    from qeval.serving.closed_loop import closed_loop
    from qeval.serving.prefix import prefixed_prompts
    pf = prefixed_prompts(served["ids"], 56, 40)
    local = LlamaCppEngine(served["f16"], threads=1)
    try:
        fresh = {(0, k): local.generate(pf(0, k), 6, ignore_stop=True).token_ids for k in range(3)}
    finally:
        local.close()
    eng = OpenAIEngine.open("gguf", served["f16"], _options(
        serve={"kind": "llama-server", "parallel": 1, "ctx_size": 512}, log=str(tmp_path / "server.log"), tier="t",
        tokenizer=str(served["src"])))
    try:
        assert eng.kv_pool_tokens() == 512
        kw = dict(concurrency=1, output_tokens=6, requests_per_stream=3, shared_prefix=40)
        off = closed_loop(eng, pf, reuse_prefix=False, **kw)
        eng.clear_kv_pool("test")
        on = closed_loop(eng, pf, reuse_prefix=True, **kw)
    finally:
        eng.close()
    by = _records_by_request
    assert by(off) == fresh and by(on) == fresh
    assert off.cached_prompt_tokens == 0
    # the first request found an empty slot; the next two found the prefix there (the server's own count)
    assert on.cached_prompt_tokens is not None and on.cached_prompt_tokens >= 2 * 40


@pytest.mark.slow
def test_top_k_kld_from_llama_server_agrees_with_the_full_vocabulary_kld(served, tmp_path):
    """The server's top-20 log-probabilities are llama.cpp's own, and the top-k KLD estimate
    of a Q4_K_M file against the F16 reference stays within the stated bound of the full
    KLD the in-process engine gives: a lower bound, and at least TOPK_SHARE of it."""
    from qeval.engines.llamacpp import LlamaCppEngine, quantize_gguf
    from qeval.measure.fidelity import kld_rows, topk_kld_rows
    ids = served["ids"][:90]
    first = 40

    def rows(engine):
        try:
            return np.concatenate([lp for _, lp in engine.iter_logprobs(ids, 64, first)])
        finally:
            engine.close()
    ref = rows(LlamaCppEngine(served["f16"], threads=1))
    q4 = tmp_path / "q4.gguf"
    quantize_gguf(served["f16"], q4, "Q4_K_M")
    full = rows(LlamaCppEngine(q4, threads=1))
    from qeval.engines.openai import OpenAIEngine
    eng = OpenAIEngine.open("gguf", q4, _options(serve={"server": "llama-server", "parallel": 1, "ctx_size": 512},
                                                 log=str(tmp_path / "s.log"), tokenizer=str(served["src"])))
    assert eng.score_topk == 20
    top = rows(eng)
    assert top.shape == full.shape == ref.shape == (len(ids) - 1 - first, 49152)
    k = 20
    idx = np.argsort(-top, axis=1)[:, :k]
    # the top-k are llama.cpp's log-probabilities: the server evaluates one position per request
    # on its cached prefix, the in-process engine a window at once (other kernels: small differences)
    diff = np.abs(np.take_along_axis(top, idx, 1) - np.take_along_axis(full, idx, 1))
    kld_full = kld_rows(ref, full).mean()
    kld_top = topk_kld_rows(ref, top, k).mean()
    kld_top_inproc = topk_kld_rows(ref, full, k).mean()
    print(f"KLD full {kld_full:.5f}, top-{k} estimate from the server {kld_top:.5f}, in process {kld_top_inproc:.5f}; "
          f"top-k logprob differences median {np.median(diff):.2e} max {diff.max():.2e}")
    assert np.median(diff) < 1e-2 and diff.max() < 0.2
    assert (top.argmax(1) == full.argmax(1)).mean() > 0.9
    assert kld_full > 1e-4  # Q4_K_M differs measurably from F16
    assert kld_top_inproc <= kld_full * 1.001 + 1e-9  # coarse-graining never increases KL
    assert kld_top == pytest.approx(kld_top_inproc, rel=0.05)  # the same estimate from the server's data
    assert TOPK_SHARE * kld_full <= kld_top <= kld_full * 1.05, (kld_top, kld_full)


#: The stated bound: on the tiny random model the top-20 estimate keeps at least this share of the
#: full KLD. Its next-token distributions are nearly flat over 49,152 tokens, so the top 20 hold little
#: mass and the estimate is a loose lower bound (seen: full 0.0912, top-20 0.0018 from the server and
#: 0.0018 in process); a trained model's peaked distributions keep far more (not measured here).
TOPK_SHARE = 0.01


@pytest.mark.slow
def test_interference_and_a_burst_run_on_a_served_tier_as_the_server_schedules_them(served, tmp_path):
    """The serving layer's workloads run unchanged on the served core: the long prompt lands
    among decoding streams (the server's own batching: its first token is the answer alone's,
    the chunk size recorded), and a burst past the slots is served, queued by the server."""
    from qeval.measure.interference import interference_stats
    from qeval.measure.load import distinct_prompts
    from qeval.serving.burst import burst
    from qeval.serving.interference import interference_sweep, long_prompt_run
    ids = served["ids"]
    long = (ids * 2)[:100]
    eng = _serve(served, tmp_path / "server.log", parallel=3)
    try:
        want = eng.generate(long, 1, ignore_stop=True).token_ids[0]
        run = long_prompt_run(eng, [ids[0:12], ids[20:29]], long, chunk_size=16, before_tokens=3, after_tokens=2)
        assert run.long_first_token == want and run.arrival_s <= run.first_token_s
        assert all(len(t) >= 3 + 2 for t in run.stream_times)  # before and after the long prompt's first token
        st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s)
        assert st.long_ttft_s > 0 and run.details["dialect"] == "llama.cpp"
        out = interference_sweep(eng, [ids[0:12], ids[20:29]], long, chunk_sizes=[16], before_tokens=3,
                                 after_tokens=2)
        assert out["not_measured"] is None and [r["chunk_size"] for r in out["rows"]] == [None, 16]
        b = burst(eng, distinct_prompts(ids, 24), requests=5, slots=3, max_waiting=8, timeout_s=120.0,
                  output_tokens=4)
        assert (b["completed"], b["refused"], b["timed_out"], b["failed"]) == (5, 0, 0, 0)
        assert b["scheduling"] == "server" and b["ttft_max_s"] >= b["ttft_s"]["p50"] and b["drain_s"] > 0
    finally:
        eng.close()
