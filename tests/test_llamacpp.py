"""GGUF tier and llama.cpp engine (issue 4).

Fast tests check the recipe validation and the converter extraction. Slow tests build a
tiny random llama (SmolLM2's tokenizer, vocabulary 49152) from a ``LlamaConfig``, convert
it with llama.cpp's converter and check that the llama.cpp engine scores the very same
token ids as the transformers engine (KLD ~ 0 against an F16 GGUF), that quantization
reports its storage and leaves nothing behind when it fails, and that the int8 KV cache
holds fewer bytes per token.

The converter is fetched once (pip download of the llama-cpp-python sdist) into
``$QEVAL_LLAMA_CONVERTER_DIR`` (default ``~/.cache/qeval/llama_cpp_convert``), shared
between test runs; everything else goes to a temporary ``QEVAL_CACHE``.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from qeval.errors import QevalInputError  # noqa: E402
from qeval.tiers.gguf import GgufTier  # noqa: E402
from qeval.tiers.base import TierContext  # noqa: E402

SHARED_CONVERTER = Path(os.environ.get("QEVAL_LLAMA_CONVERTER_DIR",
                                       Path.home() / ".cache" / "qeval" / "llama_cpp_convert")).expanduser()


def _ctx(source: str = "/nonexistent", dtype: str = "float32") -> TierContext:
    return TierContext(source_path=source, source_sha256="0" * 64, device="cpu", dtype=dtype, threads=1,
                       log=lambda s: None)


def _spec(**kw) -> GgufTier:
    return GgufTier(**{"name": "g", "method": "gguf", **kw})


# ---- fast --------------------------------------------------------------------------------

def test_check_accepts_llama_cpp_types_case_insensitively():
    from qeval.tiers import get_method
    m = get_method("gguf")
    assert m.default_engine == "llamacpp" and m.artifact_format == "gguf"
    assert m.check(_spec(type="q4_k_m"), _ctx()) == {"type": "Q4_K_M", "ftype": 15}
    for t in ("Q8_0", "Q5_K_S", "Q6_K", "F16", "IQ4_XS"):
        assert m.check(_spec(type=t), _ctx())["type"] == t


def test_check_rejects_unknown_type_naming_the_field_and_listing_valid_ones():
    from qeval.tiers import get_method
    with pytest.raises(QevalInputError) as e:
        get_method("gguf").check(_spec(name="small", type="Q4_K_Q"), _ctx())
    msg = str(e.value)
    assert e.value.field == "tiers.small.type"
    assert "Q4_K_Q" in msg and "Q4_K_M" in msg and "Q8_0" in msg and "\n" not in msg


def test_check_rejects_imatrix_types_and_int8_kv_without_flash_attention():
    from qeval.tiers import get_method
    m = get_method("gguf")
    with pytest.raises(QevalInputError, match="importance matrix"):
        m.check(_spec(type="IQ2_XS"), _ctx())
    with pytest.raises(QevalInputError) as e:
        m.check(_spec(kv_cache="int8", flash_attn=False), _ctx())
    assert e.value.field == "tiers.g.flash_attn"
    assert m.check(_spec(kv_cache="int8"), _ctx())["type"] == "Q4_K_M"


def test_kv_cache_and_flash_attention_share_one_artifact():
    from qeval.tiers import get_method
    m = get_method("gguf")
    a = m.key_fields(_spec(), _ctx())
    assert a == m.key_fields(_spec(kv_cache="int8", flash_attn=True), _ctx())
    assert a != m.key_fields(_spec(type="Q8_0"), _ctx())


def test_converter_dir_defaults_to_the_cache_without_the_env_var(tmp_path, monkeypatch):
    # CI's fresh machine has no $QEVAL_LLAMA_CONVERTER_DIR: the default path must resolve
    # (a local name once shadowed paths.converter_dir and recursed forever).
    from qeval.engines.gguf_convert import converter_dir, converter_root
    monkeypatch.delenv("QEVAL_LLAMA_CONVERTER_DIR", raising=False)
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "c"))
    assert converter_root() == tmp_path / "c" / "llama_cpp_convert"
    assert converter_dir("9.9.9") == tmp_path / "c" / "llama_cpp_convert" / "9.9.9"
    monkeypatch.setenv("QEVAL_LLAMA_CONVERTER_DIR", str(tmp_path / "x"))
    assert converter_dir("9.9.9") == tmp_path / "x" / "9.9.9"


def test_extract_converter_keeps_only_the_converter(tmp_path):
    from qeval.engines.gguf_convert import converter_present, extract_converter
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    files = {"convert_hf_to_gguf.py": b"print('hi')\n", "conversion/__init__.py": b"", "conversion/llama.py": b"",
             "gguf-py/gguf/__init__.py": b"", "gguf-py/gguf/lazy.py": b"", "gguf-py/tests/test_x.py": b"",
             "LICENSE": b"MIT", "src/llama.cpp": b"int main(){}", "convert_lora_to_gguf.py": b""}
    with tarfile.open(sdist, "w:gz") as tf:
        for rel, data in list(files.items()) + [("../../evil.py", b"")]:
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/vendor/llama.cpp/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    out = tmp_path / "conv"
    assert extract_converter(sdist, out) == 6
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["LICENSE", "conversion/__init__.py", "conversion/llama.py", "convert_hf_to_gguf.py",
                   "gguf-py/gguf/__init__.py", "gguf-py/gguf/lazy.py"]
    assert not converter_present(out)  # no completion marker: not trusted


def test_int8_kv_cache_needs_flash_attention_in_the_engine(tmp_path):
    from qeval.engines.llamacpp import LlamaCppEngine
    with pytest.raises(ValueError, match="flash attention"):
        LlamaCppEngine(tmp_path / "none.gguf", kv_cache="int8", flash_attn=False)


# ---- slow: a tiny llama through the converter -------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (F32) with SmolLM2's tokenizer, and its F16 GGUF (conftest)."""
    from conftest import build_tiny_gguf
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("llamacpp")
    mp.setenv("QEVAL_CACHE", str(root / "cache"))
    mp.setenv("QEVAL_LLAMA_CONVERTER_DIR", str(SHARED_CONVERTER))
    try:
        yield build_tiny_gguf(root)
    finally:
        mp.undo()


# A fresh process: the CPU variant is chosen once per process, before llama.cpp loads any.
_VARIANT_RUN = r"""
import json, sys
from pathlib import Path
import llama_cpp
from qeval.engines import ggml_cpu
if sys.argv[2] != "machine":  # a machine with only these cpuinfo flags
    ggml_cpu.load_backends(Path(llama_cpp.__file__).resolve().parent, flags=frozenset(sys.argv[2].split(",")))
from qeval.engines.llamacpp import LlamaCppEngine, warm_runtime
rt = warm_runtime()
eng = LlamaCppEngine(sys.argv[1], threads=1)
g = eng.generate(json.loads(sys.argv[3]), 4, ignore_stop=True)
print("RESULT " + json.dumps({"tokens": len(g.token_ids), **rt}))
"""


def _run_variant(tiny, flags: str) -> dict:
    import subprocess
    import sys
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", _VARIANT_RUN, str(tiny["f16"]), flags, json.dumps(tiny["ids"][:24])],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(repo)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # -4 would be SIGILL
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_a_fresh_process_runs_the_cpu_variant_the_machine_supports_and_records_it(tiny):
    from qeval.engines import ggml_cpu
    r = _run_variant(tiny, "machine")
    assert r["tokens"] == 4 and r["system_info"] and r["devices"] and r["devices"][0].startswith("CPU")
    v = r["cpu_variant"]
    assert "AVX2" in r["instruction_sets"] or v == "built-in" or not ggml_cpu.cpu_flags() >= {"avx2"}
    if v == "built-in":  # llama-cpp-python built with its CPU backend linked in: nothing to choose
        assert not r["variants"]
        return
    flags, amx = ggml_cpu.cpu_flags(), ggml_cpu.amx_granted()
    assert set(ggml_cpu.VARIANT_FLAGS[v]) <= flags  # every instruction set of the variant is the machine's
    assert amx or v not in ggml_cpu.AMX_VARIANTS and "AMX_INT8" not in r["instruction_sets"]
    built = [c["variant"] for c in r["variants"]]
    # and it is the best of those built that the probe let run: on an AMX virtual machine whose
    # AMX kernels trap, sapphirerapids is passed over for its SIGILL (a real trap, rightly)
    # (a variant built but not for this CPU's flags is passed over before any probe: a forced
    # AVX2 kind on an AVX-512 machine, or LLAMA_CPU_VARIANTS=all)
    over = {x.split(":")[0] for x in r["passed_over"] if x.endswith(" in the probe")}
    assert all(x.endswith(" in the probe") or ": not in /proc/cpuinfo: " in x for x in r["passed_over"]), \
        r["passed_over"]
    assert v == ggml_cpu.machine_variant(flags, amx, [b for b in built if b not in over])
    assert ("AVX512" in r["instruction_sets"]) == ("avx512f" in ggml_cpu.VARIANT_FLAGS[v])


@pytest.mark.slow
def test_a_machine_without_avx512_still_runs_the_build(tiny):
    from qeval.engines import ggml_cpu
    r0 = _run_variant(tiny, "machine")
    built = [c["variant"] for c in r0["variants"]]
    if "haswell" not in built:
        pytest.skip(f"this llama-cpp-python has no haswell variant (CPU variant {r0['cpu_variant']})")
    if not ggml_cpu.cpu_flags() >= set(ggml_cpu.VARIANT_FLAGS["haswell"]):
        pytest.skip("this machine has no AVX2")
    r = _run_variant(tiny, ",".join(ggml_cpu.VARIANT_FLAGS["haswell"]))  # cpuinfo of an AVX2-only machine
    assert r["tokens"] == 4 and r["cpu_variant"] == "haswell"
    assert "AVX2" in r["instruction_sets"] and "AVX512" not in r["instruction_sets"]
    assert all(c["excluded"] for c in r["variants"] if c["variant"] != "haswell")


def _kld(p_logp: np.ndarray, q_logp: np.ndarray) -> np.ndarray:
    return (np.exp(p_logp) * (p_logp - q_logp)).sum(-1)


def _all_logp(engine, ids, window):
    parts = []
    for start, logp in engine.iter_logprobs(ids, window):
        assert start == sum(p.shape[0] for p in parts)
        assert logp.dtype == np.float32 and logp.shape[0] <= window
        parts.append(logp)
    return np.concatenate(parts)


@pytest.mark.slow
def test_f16_gguf_scores_the_same_tokens_as_the_hf_engine(tiny):
    from qeval.engines.hf import HFEngine
    from qeval.engines.llamacpp import LlamaCppEngine
    ids = tiny["ids"]
    assert len(ids) > 150
    hf = HFEngine(tiny["model"], "cpu", backend="torch-float32")
    ref = _all_logp(hf, ids, 64)
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        assert eng.vocab_size == 49152 and eng.name == "llamacpp" and eng.flash_attn is False
        got = _all_logp(eng, ids, 50)  # other window edges than the reference's
    finally:
        eng.close()
    assert ref.shape == got.shape == (len(ids) - 1, 49152)
    kld = _kld(ref, got)
    same_top = (ref.argmax(-1) == got.argmax(-1)).mean()
    # a negative control: the same distributions one position apart are far from each other
    shifted = _kld(ref[1:], got[:-1]).mean()
    assert kld.mean() < 1e-3, kld.mean()
    assert same_top > 0.97
    assert shifted > 100 * max(kld.mean(), 1e-6)
    # a prefix that only fills the cache: the same rows from `first` on
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        first = 70
        parts = list(eng.iter_logprobs(ids, 32, first))
        assert parts[0][0] == first and sum(len(p) for _, p in parts) == len(ids) - 1 - first
        assert np.abs(np.concatenate([p for _, p in parts]) - got[first:]).max() < 1e-3
        assert list(eng.iter_logprobs(ids, 32, len(ids) - 1)) == []
    finally:
        eng.close()
    # flash attention changes the kernels, not the distributions
    fa = LlamaCppEngine(tiny["f16"], threads=1, flash_attn=True)
    try:
        assert fa.flash_attn is True
        assert _kld(got, _all_logp(fa, ids, 256)).mean() < 1e-4
    finally:
        fa.close()


@pytest.mark.slow
def test_generate_is_greedy_on_its_own_scores_with_per_token_times(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        prompt = tiny["ids"][:40]
        g = eng.generate(prompt, 12, ignore_stop=True)
        assert len(g.token_ids) == 12 and not g.finished
        assert g.token_times_s[0] == g.prefill_s and all(b >= a for a, b in zip(g.token_times_s, g.token_times_s[1:]))
        assert g.decode_tokens_per_s and g.decode_tokens_per_s > 0
        logp = _all_logp(eng, prompt + g.token_ids, 256)
        assert list(logp[len(prompt) - 1:].argmax(-1)[:12]) == g.token_ids
        assert eng.last_cache_tokens == len(prompt) + 11
        # stop token ends generation
        g2 = eng.generate(prompt, 12, stop_ids=[g.token_ids[2]])
        assert g2.finished and g2.token_ids == g.token_ids[:3]
        # a longer prompt than the first context grows it
        long = (tiny["ids"] * 8)[:700]
        g3 = eng.generate(long, 4, ignore_stop=True)
        assert eng.n_ctx >= 704 and len(g3.token_ids) == 4
    finally:
        eng.close()
    # asked for CUDA on a build without GPU offload, it refuses (never a "cuda" row measured on the CPU)
    import llama_cpp
    from qeval.errors import TierUnavailable
    if llama_cpp.llama_supports_gpu_offload():
        eng = LlamaCppEngine(tiny["f16"], threads=1, device="cuda")
        try:
            assert eng.device == "cuda" and eng.backend == "llama.cpp-cuda" and eng.flash_attn is True
        finally:
            eng.close()
    else:
        with pytest.raises(TierUnavailable, match="GPU offload"):
            LlamaCppEngine(tiny["f16"], threads=1, device="cuda")


@pytest.mark.slow
def test_generate_ignores_the_sampling_defaults_the_gguf_carries(tiny):
    """The file carries the model's sampling defaults (temperature, top-k/p, repeat
    penalty); qeval's decode is the plain argmax of llama.cpp's own logits all the same."""
    import shutil
    from gguf import GGUFReader
    from qeval.engines.gguf_convert import convert_hf_to_gguf
    from qeval.engines.llamacpp import LlamaCppEngine
    src = tiny["root"] / "tiny-sampling"
    shutil.copytree(tiny["src"], src, dirs_exist_ok=True)
    tok = tiny["tok"]
    (src / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": True,
         "temperature": 0.7, "top_k": 3, "top_p": 0.8, "repetition_penalty": 1.8}))
    f16 = tiny["root"] / "tiny-sampling-f16.gguf"
    convert_hf_to_gguf(src, f16, "f16")
    r = GGUFReader(str(f16))
    assert "general.sampling.penalty_repeat" in r.fields and "general.sampling.temp" in r.fields
    del r
    eng = LlamaCppEngine(f16, threads=1)
    try:
        ignored = eng.sampling["ignored_file_defaults"]
        assert eng.sampling["decode"] == "argmax"
        assert float(ignored["penalty_repeat"]) == pytest.approx(1.8) and float(ignored["temp"]) == pytest.approx(0.7)
        prompt = tiny["ids"][:24]
        g = eng.generate(prompt, 24, ignore_stop=True)
        seq = list(prompt)
        for _ in range(24):  # plain argmax loop over teacher-forced scores
            seq.append(int(_all_logp(eng, seq + [0], 256)[-1].argmax()))
        assert g.token_ids == seq[len(prompt):]
    finally:
        eng.close()


@pytest.mark.slow
def test_int8_kv_cache_holds_fewer_bytes_per_token(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    out = {}
    for kv in ("model", "int8"):
        eng = LlamaCppEngine(tiny["f16"], threads=1, kv_cache=kv)
        try:
            eng.generate(tiny["ids"][:64], 8, ignore_stop=True)
            mem = eng.memory()
            out[kv] = (eng.flash_attn, mem.kv_bytes_per_token, mem.details["kv_bytes_per_token_analytic"],
                       eng.last_cache_bytes, eng.last_state_bytes, mem.weight_bytes, eng.attention_info(),
                       eng.last_cache_allocated_bytes, eng.n_ctx)
        finally:
            eng.close()
    # 2 layers x 2 KV heads x (64 + 64) dims: F16 2 bytes, q8_0 34/32 bytes per element
    assert out["model"][0] is False and out["int8"][0] is True
    assert out["model"][2] == 2 * 2 * 128 * 2 and out["int8"][2] == 2 * 2 * 128 * 34 / 32
    for kv in out:  # measured from llama.cpp's state: K/V rows plus ~12 bytes of cell metadata
        assert out[kv][2] <= out[kv][1] <= out[kv][2] + 16
        assert out[kv][3] == round(out[kv][2] * 71) and out[kv][4] >= out[kv][3]
    assert out["int8"][1] < 0.6 * out["model"][1]
    assert out["model"][5] == out["int8"][5] > 0
    # the attention path as run: flash attention set explicitly, the cache type named
    assert out["model"][6] == {"engine": "llama.cpp", "implementation": "standard", "flash_attn": False,
                               "kv_cache_dtype": "f16", "kv_type_k": "f16", "kv_type_v": "f16"}
    assert out["int8"][6]["flash_attn"] is True and out["int8"][6]["kv_cache_dtype"] == "q8_0"
    for kv in out:  # llama.cpp allocates K and V for the whole context (256-token steps)
        assert out[kv][7] == round(out[kv][2] * out[kv][8]) >= out[kv][3]


@pytest.mark.slow
def test_quantize_reports_storage_and_failed_quantize_leaves_nothing(tiny, tmp_path):
    from qeval.engines.llamacpp import LlamaCppEngine, gguf_tensor_stats, quantize_gguf
    f16 = gguf_tensor_stats(tiny["f16"])
    n = sum(p.numel() for p in tiny["model"].parameters())  # tied embedding counted once
    assert f16["parameters"] == n
    q8 = tmp_path / "q8.gguf"
    r8 = quantize_gguf(tiny["f16"], q8, "Q8_0")
    s8 = gguf_tensor_stats(q8)
    assert s8["tensor_types"].get("Q8_0", 0) >= 14 and abs(s8["bits_per_weight_quantized"] - 8.5) < 1e-6
    assert r8["fallback_tensors"] == 0 and s8["parameters"] == n
    q4 = tmp_path / "q4.gguf"
    r4 = quantize_gguf(tiny["f16"], q4, "Q4_K_M")
    s4 = gguf_tensor_stats(q4)
    assert r4["fallback_tensors"] == 0  # 256 columns: every matrix takes a K-quant
    assert s4["non_kquant_matrices"] == 0 and "Q4_K" in s4["tensor_types"]
    assert 4.5 <= s4["bits_per_weight_quantized"] < 6.6 and s4["stored_bytes"] < s8["stored_bytes"]
    # qeval plan's size model of llama.cpp's type mix gives the same bytes and types, tensor for tensor
    from qeval.model_config import model_shape
    from qeval.weight_formats import GgufMix
    shape = model_shape(json.loads((tiny["src"] / "config.json").read_text()))
    for stats, ftype in ((s8, "Q8_0"), (s4, "Q4_K_M"), (f16, "F16")):
        est = GgufMix(ftype).estimate(shape)
        assert est.bytes == stats["stored_bytes"], (ftype, est.bytes, stats["stored_bytes"])
        assert {k.upper(): v for k, v in est.tensor_types.items()} == \
            {k.upper(): v for k, v in stats["tensor_types"].items()}, ftype
    eng = LlamaCppEngine(q4, threads=1)
    try:
        assert eng.memory().weight_bytes == s4["stored_bytes"]
        assert len(eng.generate(tiny["ids"][:16], 3, ignore_stop=True).token_ids) == 3
    finally:
        eng.close()
    # failures: an unknown name; a type llama.cpp refuses (needs an imatrix) with a stale
    # partial file from an earlier crash in the way
    with pytest.raises(ValueError, match="Q4_K_M"):
        quantize_gguf(tiny["f16"], tmp_path / "x.gguf", "Q4_K_Z")
    bad = tmp_path / "bad.gguf"
    bad.with_name("bad.gguf.part").write_bytes(b"GGUF partial")
    with pytest.raises(RuntimeError, match="imatrix|importance"):
        quantize_gguf(tiny["f16"], bad, "IQ2_XS")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4.gguf", "q8.gguf"]


@pytest.mark.slow
def test_tier_prepare_load_and_quant_info(tiny, tmp_path):
    from qeval.tiers import get_method
    m = get_method("gguf")
    spec = _spec(type="Q8_0")
    ctx = _ctx(str(tiny["src"]), "float32")
    resolved = m.check(spec, ctx)
    out = tmp_path / "artifact"
    out.mkdir()
    info = m.prepare(spec, ctx, out)
    assert sorted(p.name for p in out.iterdir()) == ["model-Q8_0.gguf", "quantize.json"]
    assert resolved["type"] == "Q8_0" and info["intermediate"] == "f32"
    assert info["convert_seconds"] > 0 and info["quantize_seconds"] > 0 and info["quant_peak_bytes"] > 0
    assert info["fallback_tensors"] == 0 and abs(info["bits_per_weight_quantized"] - 8.5) < 1e-6
    for kv, fa in (("model", False), ("int8", True)):
        eng = m.open_engine(_spec(type="Q8_0", kv_cache=kv), ctx, out)
        try:
            assert eng.flash_attn is fa and eng.backend == "llama.cpp-cpu"
            q = m.quant_info(spec, ctx, out, eng)
            assert q["stored_bytes"] == eng.memory().weight_bytes and q["parameters"] == info["parameters"]
            assert q["fallback_tensors"] == 0 and q["tensor_types"]["Q8_0"] >= 14
            assert 8.0 < q["bits_per_weight"] < 8.6
        finally:
            eng.close()


@pytest.mark.slow
def test_generate_scored_gives_iter_logprobs_rows_and_a_greedy_answer(tiny):
    """Long-context scoring in the generation prefill: the rows are iter_logprobs' rows for
    the scored span, and the answer is greedy on the same cache."""
    from qeval.engines.llamacpp import LlamaCppEngine
    ids = (tiny["ids"] * 3)[:300]
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        g, rows = eng.generate_scored(ids, 200, 260, 6, window=32)
        want = list(eng.iter_logprobs(ids[:260], 32, 199))
        assert [j for j, _ in rows] == [s - 199 for s, _ in want] and sum(len(x) for _, x in rows) == 60
        assert max(np.abs(a - b).max() for (_, a), (_, b) in zip(rows, want)) < 1e-4
        logp = _all_logp(eng, ids + g.token_ids, 256)
        assert list(logp[len(ids) - 1:].argmax(-1)[:6]) == g.token_ids
        # a scored span of whole windows (64 = 2 x 32): llama.cpp once refused the decode after
        # it ("inconsistent sequence positions", the default recipe's 256-token window and span)
        for start, end in ((200, 264), (236, 300)):
            g2, _ = eng.generate_scored(ids, start, end, 6, window=32)
            assert g2.token_ids == eng.generate(ids, 6).token_ids
        with pytest.raises(ValueError):
            eng.generate_scored(ids, 0, 10, 2)
    finally:
        eng.close()


def test_gguf_context_length_scans_to_the_key_and_refuses_non_gguf(tmp_path):
    """The header scan reads past a large string array and other types to the key, agrees
    with gguf's GGUFReader, and a file that is not GGUF gives None (no exception)."""
    import gguf

    from qeval.source import _gguf_scan_uint, gguf_context_length
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_token_list([f"tok{i}" for i in range(5000)])
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("llama.some_ints", [1, 2, 3])
    w.add_bool("llama.flag", True)
    w.add_context_length(12345)
    w.add_tensor("t", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _gguf_scan_uint(path, ".context_length") == 12345 == gguf_context_length(path)
    r = gguf.GGUFReader(str(path))
    f = r.fields["llama.context_length"]
    assert int(f.parts[f.data[0]][0]) == 12345
    assert _gguf_scan_uint(path, ".no_such_key") is None
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert gguf_context_length(bad) is None


def test_a_run_on_a_machine_whose_best_variant_traps_finishes_its_gguf_tier_and_a_killed_stage_says_why(
        tiny, tmp_path, monkeypatch):
    """The default run's failure on an AMX virtual machine, faked at named points: the best
    CPU variant's probe child dies with SIGILL (QEVAL_TEST_PROBE_SIGNAL), so the run's
    environment stage passes it over and the GGUF tier measures on the next one, saying so in
    its row and in run.json; then a second GGUF tier's quality stage is killed by SIGILL after
    llama.cpp loaded (QEVAL_TEST_CRASH with a signal): its progress line, its log, its row and
    the gate name the signal, the variant and the fix, and the other tiers finish."""
    from conftest import fake_cpu_variants, write_recipe
    from qeval.engines import ggml_cpu
    import llama_cpp
    # two variants that run on every machine kind (an AVX2-only one builds haswell alone): a
    # fake best one (a copy of the AVX2 module ranked first, conftest), and the build's own best
    fake = fake_cpu_variants(tmp_path / "variants", {"fake": "best"})
    monkeypatch.setenv(ggml_cpu.EXTRA_VARIANTS_ENV, fake[ggml_cpu.EXTRA_VARIANTS_ENV])
    here = Path(llama_cpp.__file__).resolve().parent
    mods = ggml_cpu.variant_modules(ggml_cpu.lib_dirs(here))
    flags, amx = ggml_cpu.cpu_flags(), ggml_cpu.amx_granted()
    ok = sorted((c for c in ggml_cpu.judge([ggml_cpu.Candidate(n, p, ggml_cpu._score(p)) for n, p in mods],
                                            flags, amx) if c.excluded is None), key=lambda c: -c.score)
    assert len(ok) >= 2 and ok[0].name == "fake", [c.name for c in ok]
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny["src"],
                          tiers="  - {name: bf16, method: bf16}\n  - {name: q8, method: gguf, type: Q8_0}\n"
                                "  - {name: q8-b, method: gguf, type: Q8_0, kv_cache: int8}\n",
                          extra="gate: {reference: bf16, rules: {max_kld_mean: 100.0}}", load=False)
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_LLAMA_CONVERTER_DIR=str(SHARED_CONVERTER),
               QEVAL_TEST_PROBE_SIGNAL=ok[0].name, QEVAL_TEST_CRASH="q8-b:quality:mid:SIGILL")
    env.pop("QEVAL_LLAMA_CPU_VARIANT", None)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=1500)
    assert p.returncode == 4, p.stderr[-3000:]  # the killed candidate is not judged (ERROR, exit 4); nothing crashed
    run_dir = next((tmp_path / "res" / "tiny").iterdir())
    passed = f"{ok[0].name}: SIGILL (illegal instruction) in the probe"

    def probed(over: list[str]) -> list[str]:
        """The variants passed over by the probe; the others must be built variants this
        CPU's flags rule out (a forced AVX2 kind on an AVX-512 machine lists zen4 so)."""
        assert all(x.endswith(" in the probe") or ": not in /proc/cpuinfo: " in x for x in over), over
        return [x for x in over if x.endswith(" in the probe")]
    env_stage = json.loads((run_dir / "stages" / "_run.env.json").read_text())
    assert env_stage["llama_cpu"]["variant"] == ok[1].name and probed(env_stage["llama_cpu"]["passed_over"]) == [passed]
    q8 = json.loads((run_dir / "tiers" / "q8.json").read_text())
    assert q8["status"] == "ok" and q8["quality"]["fidelity"]["kld_mean"] >= 0
    assert q8["runtime"]["cpu_variant"] == ok[1].name and probed(q8["runtime"]["passed_over"]) == [passed]
    run = json.loads((run_dir / "run.json").read_text())
    assert [(e["cpu_variant"], probed(e["passed_over"])) for e in run["llama_cpp"]] == [(ok[1].name, [passed])]
    why = (f"quality process killed by SIGILL (illegal instruction) in llama.cpp's CPU backend {ok[1].name}: "
           "a kernel used an instruction this CPU does not execute")
    killed = json.loads((run_dir / "tiers" / "q8-b.json").read_text())
    assert killed["status"] == "failed" and killed["error"].startswith(why)
    assert f"FAILED quality q8-b: {why}" in p.stderr  # the progress line (the console is stderr)
    assert f"[qeval] {why}" in (run_dir / "logs" / "q8-b.quality.log").read_text()
    gate = json.loads((run_dir / "gate.json").read_text())
    verdict = {c["tier"]: c for c in gate["candidates"]}
    assert verdict["q8"]["verdict"] == "pass" and verdict["q8-b"]["verdict"] == "error"
    assert why in verdict["q8-b"]["rules"][0]["message"] and why in verdict["q8-b"]["error"]
