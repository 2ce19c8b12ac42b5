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
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_dir_of, write_recipe

SECRET = "sk-qeval-test-5f3a9c1e7b"


# ---- a fake OpenAI-compatible server ------------------------------------------------------

class Fake:
    """A tiny /v1 server: ``key`` required when set; ``count`` maps a text prompt to its
    usage count; streams ``answer`` token ids llama-server style."""

    def __init__(self, key=None, count=None, answer=(5, 6, 7), owner="llamacpp"):
        self.key, self.count, self.answer, self.owner = key, count, list(answer), owner
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
    from qeval.engines.openai import EndpointError, TokenizerMismatch, preflight_endpoint
    from qeval.engines.servers import EndpointSpec, free_port
    count = _tok_count(tiny_llama)
    good = fake(key=SECRET, count=count)
    monkeypatch.setenv("QEVAL_TEST_KEY", SECRET)
    spec = EndpointSpec(url=good.url, api_key_env="QEVAL_TEST_KEY")
    ok = preflight_endpoint(spec, tokenizer=tiny_llama, texts=["one two three", "a longer text of words " * 20])
    assert ok["model"] == "fake-model" and ok["dialect"] == "llama.cpp"
    assert [c["server_tokens"] for c in ok["tokenizer_check"]] == [count("one two three"),
                                                                  count("a longer text of words " * 20)]
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
        preflight_endpoint(EndpointSpec(url=other.url), tokenizer=tiny_llama, texts=["one two three"])
    n = count("one two three")
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


def test_vllm_is_refused_off_cuda_in_one_line(tiny_llama):
    from qeval.engines.openai import OpenAIEngine
    from qeval.errors import TierUnavailable
    with pytest.raises(TierUnavailable, match="vLLM serves on CUDA only and this stage runs on cpu"):
        OpenAIEngine.open("hf", tiny_llama, _options(serve={"server": "vllm"}, tokenizer=str(tiny_llama)))


def test_server_commands():
    from qeval.engines.servers import llama_server_command, resolve_ctx_per_slot, vllm_command
    cmd = llama_server_command("/b/llama-server", "/m.gguf", port=5, threads=2, parallel=4, ctx_per_slot=512,
                               kv_cache="int8", flash_attn=True)
    s = " ".join(cmd)
    assert "--host 127.0.0.1 --port 5" in s and "-np 4 -c 2048 --no-kv-unified" in s and "-fa on" in s
    assert "-ctk q8_0 -ctv q8_0" in s and "-ngl 0" in s and "-t 2 -tb 2" in s
    v = " ".join(vllm_command("vllm", "/ckpt", "gptqmodel", port=7, parallel=8, ctx_per_slot=4096,
                              gpu_memory_utilization=0.85, tokenizer="/src"))
    assert v.startswith("vllm serve /ckpt --host 127.0.0.1 --port 7") and "--max-num-seqs 8" in v
    assert "--gpu-memory-utilization 0.85" in v and "--no-enable-prefix-caching" in v and "--max-model-len 4096" in v
    assert resolve_ctx_per_slot([300, 1000]) == 1024 and resolve_ctx_per_slot([5000], 4096) == 4096


# ---- llama-server on the tiny model's GGUF (slow) ----------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GGUF (conftest.build_tiny_gguf) and a llama-server on it (2 slots)."""
    from conftest import build_tiny_gguf
    from qeval.engines.llama_tools import tool_path
    try:
        tool_path("llama-server", build=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"llama-server not built here: {e}")
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("openai")
    mp.setenv("QEVAL_LLAMA_CONVERTER_DIR", os.environ.get(
        "QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))
    try:
        yield build_tiny_gguf(root)
    finally:
        mp.undo()


def _serve(tiny, log, parallel=2):
    from qeval.engines.openai import OpenAIEngine
    return OpenAIEngine.open("gguf", tiny["f16"], _options(
        serve={"server": "llama-server", "parallel": parallel, "ctx_per_slot": 512}, log=str(log),
        tokenizer=str(tiny["src"]), check_texts=[tiny["tok"].decode(tiny["ids"][:40])]))


@pytest.mark.slow
def test_llama_server_generates_what_llama_cpp_generates_and_serves_load(served, tmp_path):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.load import Slo, distinct_prompts
    from qeval.measure.serving import load_sweep
    from qeval.measure.speed import speed_sweep
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
        speed, peaks, _ = speed_sweep(eng, {16: ids[:16], 48: ids}, decode_tokens=4, repeats=2, warmup=1,
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
def test_a_server_killed_mid_request_is_the_error_with_its_log_tail(served, tmp_path):
    from qeval.engines.servers import ServerFailed
    eng = _serve(served, tmp_path / "server.log", parallel=1)
    try:
        threading.Timer(0.3, lambda: os.kill(eng.server.pid, signal.SIGKILL)).start()
        with pytest.raises(ServerFailed, match=r"llama-server \(pid \d+\) killed by SIGKILL mid-stage") as e:
            for _ in range(200):
                eng.generate(served["ids"][:200], 64, ignore_stop=True)
        assert "server.log" in str(e.value) and e.value.log_tail
    finally:
        eng.close()
