"""Managed servers and executors, registered by name: the registry, each server's command
and dialect (vLLM and SGLang need a GPU to run, so their commands are checked here, not
run), the KV pool's state from each server's own counters, and a managed server's memory
measured from before it starts over its whole process tree."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import types
from pathlib import Path

import pytest

from conftest import REPO, write_recipe

MiB = 2 ** 20


# ---- the registries ------------------------------------------------------------------------

def test_managed_servers_are_registered_by_module():
    from qeval.engines.servers import dialect_for_owner, get_server, server_kinds
    from qeval.engines.servers.llama_server import LlamaServer
    from qeval.engines.servers.sglang import Sglang
    from qeval.engines.servers.vllm import Vllm
    assert server_kinds() == ("llama-server", "sglang", "vllm")
    assert (get_server("llama-server"), get_server("vllm"), get_server("sglang")) == (LlamaServer, Vllm, Sglang)
    with pytest.raises(KeyError, match="unknown server 'tgi' .known: llama-server, sglang, vllm"):
        get_server("tgi")
    assert [dialect_for_owner(o).name for o in ("llamacpp", "vllm", "sglang", "someone")] == \
        ["llama.cpp", "vllm", "sglang", "openai"]


def test_serve_settings_are_typed_per_server_and_the_shorthand_still_reads():
    from pydantic import ValidationError
    from qeval.engines.servers import parse_serve
    from qeval.engines.servers.llama_server import LlamaServerOptions
    from qeval.engines.servers.sglang import SglangOptions
    from qeval.engines.servers.vllm import VllmOptions
    assert isinstance(parse_serve("llama-server"), LlamaServerOptions)
    v = parse_serve({"server": "vllm", "gpu_memory_utilization": 0.8})  # the older key name
    assert isinstance(v, VllmOptions) and v.kind == "vllm" and v.gpu_memory_utilization == 0.8
    assert isinstance(parse_serve({"kind": "sglang", "mem_fraction_static": 0.7}), SglangOptions)
    with pytest.raises(ValidationError):  # a vLLM setting is not a llama-server one
        parse_serve({"kind": "llama-server", "gpu_memory_utilization": 0.8})
    with pytest.raises(ValidationError):
        parse_serve({"kind": "tgi"})


def test_a_recipe_serve_checks_the_server_against_the_method_in_one_line(tiny_llama, tmp_path):
    from qeval.errors import QevalInputError
    from qeval.recipe import load_recipe
    ok = write_recipe(tmp_path / "ok.yaml", tiny_llama, tiers="""  - {name: bf16, method: bf16}
  - {name: srv, method: gguf, type: Q8_0, engine: openai, serve: llama-server}
""")
    r = load_recipe(ok)
    assert r.tier("srv").serve.kind == "llama-server" and r.tier("srv").serve.parallel is not None
    bad = write_recipe(tmp_path / "bad.yaml", tiny_llama, tiers="""  - {name: bf16, method: bf16}
  - {name: srv, method: gguf, type: Q8_0, engine: openai, serve: {kind: sglang}}
""")
    with pytest.raises(QevalInputError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert "SGLang serves hf, gptqmodel artifacts, not gguf" in msg and "tiers[1].serve" in msg and "\n" not in msg


def test_executors_are_registered_by_module(tiny_llama, tmp_path):
    from qeval.errors import QevalInputError
    from qeval.executors import executor_names, make_executor
    from qeval.recipe import load_recipe
    assert executor_names() == ("local", "ray")
    local, ray = make_executor("local"), make_executor("ray", "auto")
    assert local.in_process and not ray.in_process and ray.address == "auto"
    with pytest.raises(QevalInputError) as e:
        make_executor("mars")
    assert e.value.field == "--executor" and "known: local, ray" in str(e.value)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tiers="  - {name: bf16, method: bf16}\n", extra="executor: mars")
    with pytest.raises(QevalInputError) as e:
        make_executor("mars", recipe=load_recipe(recipe))
    assert e.value.field == "executor" and e.value.line is not None


# ---- commands and dialects ---------------------------------------------------------------------

def _launch(tmp_path, fmt="hf", **kw):
    from qeval.engines.servers import Launch
    art = tmp_path / "artifact"
    art.mkdir(exist_ok=True)
    if fmt == "gguf":
        (art / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    base = dict(artifact=art, fmt=fmt, port=8123, threads=3, parallel=4, device="cuda", tokenizer="/src",
                tokens={"sequence": 1100, "load_sequence": 400, "model": 2048}, scratch=tmp_path / "scratch")
    base.update(kw)
    return Launch(**base)


def test_each_server_maps_the_context_to_its_own_flag(tmp_path):
    from qeval.engines.servers import get_server, parse_serve
    cmds = {}
    for kind, fmt in (("llama-server", "gguf"), ("vllm", "hf"), ("sglang", "hf")):
        s = get_server(kind)
        cmds[kind] = s.command("/bin/x", parse_serve(kind), _launch(tmp_path, fmt))
    flag = {"llama-server": "-c", "vllm": "--max-model-len", "sglang": "--context-length"}
    got = {k: c[c.index(flag[k]) + 1] for k, c in cmds.items()}
    # llama-server: one pool the slots share (4 load streams of 400 > one 1100 sequence);
    # vLLM and SGLang: tokens per sequence, at most the model's context
    assert got == {"llama-server": "1792", "vllm": "1280", "sglang": "1280"}
    c = get_server("vllm").command("/bin/x", parse_serve({"kind": "vllm", "ctx_size": 4000}), _launch(tmp_path))
    assert c[c.index("--max-model-len") + 1] == "4000"


def test_vllm_command_gives_the_gguf_file_and_the_source_tokenizer(tmp_path):
    from qeval.engines.servers import get_server, parse_serve
    vllm = get_server("vllm")
    gg = vllm.command("vllm", parse_serve({"kind": "vllm", "gpu_memory_utilization": 0.85}), _launch(tmp_path, "gguf"))
    assert gg[:3] == ["vllm", "serve", str(tmp_path / "artifact" / "model-Q4_K_M.gguf")]  # the file, not its folder
    s = " ".join(gg)
    assert "--tokenizer /src" in s and "--quantization gguf" in s and "--max-num-seqs 4" in s
    assert "--gpu-memory-utilization 0.85" in s and "--no-enable-prefix-caching" in s
    assert "--disable-log-requests" not in s  # vLLM 0.17 removed it (it would exit at start); 0.34 takes it again
    hf = vllm.command("vllm", parse_serve("vllm"), _launch(tmp_path, "hf", kv_cache="int8"))
    assert hf[2] == str(tmp_path / "artifact") and "--quantization" not in hf
    assert hf[hf.index("--kv-cache-dtype") + 1] == "fp8"
    assert vllm.env(parse_serve("vllm")) == {"VLLM_SERVER_DEV_MODE": "1"}  # routes /reset_prefix_cache
    assert vllm.check("hf", "cpu") == "vLLM serves on CUDA only and this stage runs on cpu"


# ---- vLLM's own parser ------------------------------------------------------------------------
# tools/vllm_args.py reads `vllm serve`'s parser at the vLLM version the README names into
# tests/data/vllm_serve_args-<version>.json; every command qeval builds must parse with it.

def _vllm_args():
    import importlib.util
    spec = importlib.util.spec_from_file_location("vllm_args_under_test", REPO / "tools" / "vllm_args.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _vllm_commands(tmp_path) -> list[tuple[dict, list[str]]]:
    """``(what, command)`` for every shape of command qeval builds for vLLM: each artifact
    format, both KV caches, the context from the recipe's sequences or ``ctx_size``, one or
    many sequences, a set memory share, with and without the source tokenizer, prefix
    caching off or asked for (a load stage with a shared prefix)."""
    from qeval.engines.servers import get_server, parse_serve
    vllm = get_server("vllm")
    out = []
    for fmt in vllm.formats:
        for kv in ("model", "int8"):
            for opts, parallel, tok, prefix in (({"kind": "vllm"}, 4, "/src", False),
                                                ({"kind": "vllm", "ctx_size": 4096, "gpu_memory_utilization": 0.85},
                                                 1, None, True)):
                what = dict(fmt=fmt, kv_cache=kv, parallel=parallel, tokenizer=tok, **opts)
                out.append((what, vllm.command("vllm", parse_serve(opts), _launch(
                    tmp_path, fmt, kv_cache=kv, parallel=parallel, tokenizer=tok, prefix_caching=prefix))))
    return out


def test_vllm_commands_parse_with_the_snapshot_of_vllm_serve_options(tmp_path):
    tool = _vllm_args()
    snap = tool.load_snapshot()
    assert snap["vllm"] == tool.VLLM_VERSION and tool.SNAPSHOT.name == f"vllm_serve_args-{tool.VLLM_VERSION}.json"
    assert f"vLLM {tool.VLLM_VERSION}" in (REPO / "README.md").read_text()  # the version the README names
    parser = tool.parser_from_snapshot(snap)
    cmds = _vllm_commands(tmp_path)
    assert len(cmds) == 12
    for what, cmd in cmds:
        assert cmd[:2] == ["vllm", "serve"], cmd
        ns = parser.parse_args(cmd[2:])  # ValueError: an option vLLM does not know, or a bad value
        assert ns.model_tag.endswith("model-Q4_K_M.gguf" if what["fmt"] == "gguf" else "artifact"), cmd
        assert (ns.host, ns.port, ns.served_model_name) == ("127.0.0.1", 8123, ["qeval"])
        assert ns.max_num_seqs == what["parallel"]
        assert ns.enable_prefix_caching is ("--enable-prefix-caching" in cmd)  # off unless a load stage asks
        assert ns.max_model_len == what.get("ctx_size", 1280)
        assert ns.gpu_memory_utilization == what.get("gpu_memory_utilization", 0.9)
        assert ns.tokenizer == what["tokenizer"]
        assert ns.kv_cache_dtype == ("fp8" if what["kv_cache"] == "int8" else None)
        assert ns.quantization == ("gguf" if what["fmt"] == "gguf" else None)  # any string: plugins add methods
        assert tool.unknown_values(snap, cmd) == [], cmd  # --kv-cache-dtype among the dtypes vLLM lists
    # what the snapshot refuses: an option vLLM does not have, a value that is not a number, a
    # missing value; and a KV cache dtype outside vLLM's list (its parser takes any string)
    base = cmds[0][1][2:]
    for extra, why in ((["--task", "generate"], "unrecognized arguments: --task generate"),
                       (["--max-num-seqs", "many"], "invalid int value: 'many'"),
                       (["--tokenizer"], "expected one argument")):
        with pytest.raises((ValueError, argparse.ArgumentError), match=why):
            parser.parse_args(base + extra)
    assert tool.unknown_values(snap, base + ["--kv-cache-dtype", "int8"]) == ["--kv-cache-dtype int8"]
    # 0.34 pairs every --enable-x flag with --disable-x: --disable-log-requests, which 0.17
    # removed, parses again (and is the default); qeval passes neither
    assert parser.parse_args(base + ["--disable-log-requests"]).enable_log_requests is False


def test_vllm_commands_parse_with_vllm_serve_own_parser(tmp_path):
    """The same commands through vLLM's own parser and its pre-load checks, in the venv
    ``python tools/vllm_args.py setup`` makes; and the snapshot is what that parser dumps."""
    tool = _vllm_args()
    py = tool.venv_python()
    if not py.exists():
        if os.environ.get("QEVAL_VLLM_PARSER") == "1":
            pytest.fail(f"QEVAL_VLLM_PARSER=1 but vLLM {tool.VLLM_VERSION}'s parser is not installed at {py}")
        pytest.skip(f"vLLM {tool.VLLM_VERSION}'s own parser is not installed (python tools/vllm_args.py setup)")
    import subprocess
    out = tmp_path / "snap.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "vllm_args.py"), "dump", "--out", str(out)], check=True)
    mine, committed = tool.load_snapshot(out), tool.load_snapshot()
    assert {k: v for k, v in mine.items() if k != "produced_by"} == \
        {k: v for k, v in committed.items() if k != "produced_by"}
    cmds = [c for _w, c in _vllm_commands(tmp_path)]
    res = tool.check_lines([c[2:] for c in cmds] + [cmds[0][2:] + ["--task", "generate"]])
    assert [r["error"] for r in res[:-1]] == [None] * len(cmds)
    assert not res[-1]["ok"] and "unrecognized arguments: --task generate" in res[-1]["error"]
    parsed = res[0]["args"]
    assert parsed["enable_prefix_caching"] is False and parsed["max_model_len"] == 1280
    assert parsed["served_model_name"] == ["qeval"] and parsed["tokenizer"] == "/src"


def test_sglang_command_and_dialect(tmp_path):
    from qeval.engines.servers import get_server, parse_serve
    sg = get_server("sglang")
    cmd = sg.command("/env/bin/python", parse_serve({"kind": "sglang", "mem_fraction_static": 0.8}),
                     _launch(tmp_path, "gptqmodel", kv_cache="int8"))
    assert cmd[:5] == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", str(tmp_path / "artifact")]
    s = " ".join(cmd)
    for part in ("--host 127.0.0.1 --port 8123", "--served-model-name qeval", "--max-running-requests 4",
                 "--context-length 1280", "--disable-radix-cache", "--enable-metrics", "--tokenizer-path /src",
                 "--mem-fraction-static 0.8", "--kv-cache-dtype fp8_e4m3"):
        assert part in s, part
    assert sg.check("gguf", "cuda") and sg.check("hf", "cpu") and sg.check("hf", "cuda") is None
    d = sg.dialect
    assert d.extras(logprobs=5, cache_prompt=False) == {"top_k": 1, "repetition_penalty": 1.0,
                                                        "return_token_ids": True}
    assert d.token_ids({"choices": [{"text": "ab", "token_ids": [11, 12]}]}) == [11, 12]
    assert not d.logprobs  # its log-probabilities are keyed by text: no scoring through it


def test_dialects_read_their_own_chunks():
    from qeval.engines.openai import chunk_token_ids
    from qeval.engines.servers import get_server
    llama = {"choices": [{"logprobs": {"content": [{"id": 7, "logprob": -0.5}]}}]}
    vllm = {"choices": [{"logprobs": {"tokens": ["token_id:9"]}}]}
    sglang = {"choices": [{"token_ids": [3]}]}
    assert get_server("llama-server").dialect.token_ids(llama) == [7]
    assert get_server("vllm").dialect.token_ids(vllm) == [9] and get_server("vllm").dialect.token_ids(llama) == []
    assert [chunk_token_ids(c) for c in (llama, vllm, sglang)] == [[7], [9], [3]]


# ---- the KV pool from each server's counters -----------------------------------------------------

class _Resp:
    def __init__(self, status=200, js=None, text=""):
        self.status_code, self._js, self.text = status, js, text

    def json(self):
        return self._js


class _Http:
    """An httpx.Client stand-in: answers by route, records the calls."""

    def __init__(self, routes):
        self.routes, self.calls = routes, []

    def get(self, path, **kw):
        self.calls.append(("GET", path))
        return self.routes[("GET", path)]

    def post(self, path, params=None, **kw):
        self.calls.append(("POST", path, params))
        return self.routes.get(("POST", path), _Resp(200, {}))


def test_pool_state_from_llama_server_slots_vllm_and_sglang_metrics():
    from qeval.engines.servers import get_server
    slots = [{"id": 0, "is_processing": False, "n_prompt_tokens": 4007}, {"id": 1, "is_processing": False}]
    http = _Http({("GET", "/slots"): _Resp(200, slots),
                  ("GET", "/metrics"): _Resp(200, text="# HELP x\nllamacpp:requests_processing 0\n"
                                                      "llamacpp:prompt_tokens_total 5006\n")})
    st = get_server("llama-server").pool_state(http)
    assert not st.empty and "slot 0 holds 4007 tokens" in st.why
    assert st.counters["slots_tokens"] == 4007 and st.counters["llamacpp:prompt_tokens_total"] == 5006
    assert get_server("llama-server").clear_pool(http, 2) == "erase_slots"
    assert [c for c in http.calls if c[0] == "POST"] == [("POST", "/slots/0", {"action": "erase"}),
                                                         ("POST", "/slots/1", {"action": "erase"})]
    vm = 'vllm:kv_cache_usage_perc{engine="0",model_name="qeval"} 0.25\nvllm:num_requests_running{engine="0"} 0\n'
    st = get_server("vllm").pool_state(_Http({("GET", "/metrics"): _Resp(200, text=vm)}))
    assert not st.empty and "25.0%" in st.why and st.counters["vllm:kv_cache_usage_perc"] == 0.25
    st = get_server("sglang").pool_state(_Http({("GET", "/metrics"): _Resp(
        200, text='sglang:num_used_tokens{model_name="q"} 0\nsglang:num_running_reqs{model_name="q"} 0\n')}))
    assert st.empty
    with pytest.raises(RuntimeError, match="POST /flush_cache answered HTTP 400"):
        get_server("sglang").clear_pool(_Http({("POST", "/flush_cache"): _Resp(400, text="busy")}), 1)


# ---- memory of a managed server: from before it starts, over its process tree -----------------

FAKE_SERVER = textwrap.dedent('''
    import os, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port, hold_mib, child_mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    # the child holds its memory (touched, so resident) and says so on stdout
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time\\nb = bytearray(%d * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
        "print('held', flush=True)\\ntime.sleep(3600)" % child_mib], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    mine = bytearray(hold_mib * 2**20)
    for i in range(0, len(mine), 4096):
        mine[i] = 1
    with open(sys.argv[4], "w") as f:
        f.write(str(child.pid))
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def _fake_server(tmp_path, device="cpu", nvml=None, hold_mib=32, child_mib=96):
    from qeval.engines.servers import ManagedServer, free_port
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    cmd = [sys.executable, str(script), str(port), str(hold_mib), str(child_mib), str(tmp_path / "child.pid")]
    return ManagedServer(cmd, port=port, log_path=tmp_path / "fake.log", name="fake-server", device=device,
                         nvml=nvml)


def test_a_servers_memory_is_counted_from_before_it_starts_over_its_process_tree(tmp_path):
    import psutil
    srv = _fake_server(tmp_path)
    try:
        srv.start(60)
        counter = srv.memory
        assert counter.kind == "server_rss_sampled"
        assert counter.baseline_pids == [] and counter.baseline == 0  # created before the server existed
        child = int((tmp_path / "child.pid").read_text())
        assert child in [c.pid for c in psutil.Process(srv.pid).children(recursive=True)]
        peak = counter.read()
        parent_rss = psutil.Process(srv.pid).memory_info().rss
        assert parent_rss < 96 * MiB  # the parent alone holds less than the child: the sum is the tree's
        assert peak >= (32 + 96) * MiB
    finally:
        srv.stop()
    assert not psutil.pid_exists(srv.pid) or psutil.Process(srv.pid).status() == psutil.STATUS_ZOMBIE


class _FakeNvml:
    """pynvml as far as NvmlMemory uses it: one GPU whose process list holds the pids the
    test says, each at ``per_pid`` bytes; ``used`` is the device's memory in use."""

    def __init__(self, used=5 * 2**30):
        self.used, self.listed, self.per_pid = used, set(), 100 * MiB

    def nvmlDeviceGetHandleByIndex(self, i):
        return "gpu0"

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=self.per_pid) for p in sorted(self.listed)]


def test_on_cuda_nvml_is_summed_over_the_servers_tree_and_device_wide_only_when_it_lists_none(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nv = _FakeNvml()
    srv = _fake_server(tmp_path, device="cuda", nvml=nv, hold_mib=1, child_mib=1)
    try:
        srv.start(60)
        counter = srv.memory
        assert counter.baseline_device == 5 * 2**30 and counter.baseline_process == 0  # before the start
        nv.used += 700 * MiB  # the server's load, seen device-wide while NVML lists none of its pids
        assert counter.read() == 700 * MiB and counter.kind == "cuda_nvml_device"
        child = int((tmp_path / "child.pid").read_text())
        nv.listed = {srv.pid, child, 999999}  # the server, its child (vLLM's EngineCore) and a stranger
        counter.reset()
        assert counter.read() == 2 * 100 * MiB and counter.kind == "cuda_nvml_process"  # the tree, summed
    finally:
        srv.stop()
