"""INT8 (torchao), GPTQ and AWQ tiers on a tiny random llama: prepare -> save -> reload
round trips, stored bytes, group-size checks, dequantized models.

The tiny model (hidden 128, intermediate 256, 2 layers) and its word-level tokenizer
are built inside the test; nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qeval.errors import QevalInputError  # noqa: E402
from qeval.tiers import get_method  # noqa: E402
from qeval.tiers.base import TierContext  # noqa: E402

TEXTS = [
    "the quarterly invoice was paid by the finance team on time and the ledger was closed",
    "our warehouse ships orders to customers every morning before nine",
    "the sales report shows revenue growth in the northern region this year",
    "please review the contract before the meeting on friday with the supplier",
    "the board approved the budget for new hires in the support team",
    "customer tickets are answered within one business day by the service desk",
    "inventory counts are reconciled at the end of each month by the auditors",
    "the marketing plan lists three campaigns for the spring product launch",
]


def _label(base: str, eng) -> str:
    """``base`` as the engine labels it on this CPU: with the note of a compute dtype torch
    emulates here (``(bfloat16 emulated on this CPU: no AVX512_BF16)``, qeval.engines.hf),
    so the assertion holds on every kind of CPU."""
    from qeval.engines.ggml_cpu import torch_bf16_note
    from qeval.engines.hf import compute_dtype, emulated_label
    dtype = compute_dtype(eng.model)
    note = torch_bf16_note(dtype, eng.device)
    return emulated_label(base, dtype, note) if note else base


def _build_tiny(path: Path, hidden: int = 128, intermediate: int = 256) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tiny_llama")
    _build_tiny(p)
    return p


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GPTQMODEL_TORCH_EXTENSIONS_DIR",
                       os.environ.get("GPTQMODEL_TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")))


def _ctx(src: Path, samples: int = 8) -> TierContext:
    return TierContext(source_path=str(src), source_sha256="0" * 64, device="cpu", threads=1,
                       calibration=lambda: (TEXTS * 4)[:samples],
                       calibration_fields={"sha256": "test", "samples": samples, "seq_len": 32},
                       log=lambda m: None)


def _spec(method: str, **kw):
    base = {"name": f"t-{method}", "method": method, "kv_cache": "model"}
    if method == "int8":
        base["backend"] = "torchao"
    if method in ("gptq", "awq"):
        base.update(bits=4, group_size=64, sym=True, desc_act=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _ids() -> "torch.Tensor":
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 60, (1, 24), generator=g)


def _logprobs(model, ids):
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def _kld(ref, other) -> float:
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def _ref_logprobs(src: Path):
    from qeval.engines.hf import load_hf_model
    return _logprobs(load_hf_model(str(src), "cpu"), _ids())


def _bf16_bytes(src: Path) -> int:
    from qeval.engines.hf import load_hf_model, model_weight_bytes
    return model_weight_bytes(load_hf_model(str(src), "cpu"))


def _estimate(method_name: str, spec, src: Path):
    """The weight bytes ``qeval plan`` estimates for this tier from ``config.json`` alone."""
    from qeval.model_config import model_shape
    shape = model_shape(json.loads((src / "config.json").read_text()))
    return get_method(method_name).weight_format(spec, shape, "bfloat16").estimate(shape)


def _prepare(method_name: str, spec, ctx, tmp_path: Path) -> tuple[Path, dict]:
    m = get_method(method_name)
    resolved = m.check(spec, ctx)
    fields = m.key_fields(spec, ctx)
    assert fields["source_sha256"] == ctx.source_sha256 and fields["method"] == method_name
    out = tmp_path / f"{method_name}-artifact"
    out.mkdir()
    info = m.prepare(spec, ctx, out)
    assert info["quant_seconds"] > 0
    assert not [p for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert list(out.glob("*.safetensors"))
    return out, {**info, "resolved": resolved}


# ---- INT8 -------------------------------------------------------------------------------

def test_int8_round_trip(tiny, tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    m = get_method("int8")
    spec, ctx = _spec("int8"), _ctx(tiny)
    art, info = _prepare("int8", spec, ctx, tmp_path)
    assert info["backend"] == "torchao-int8-weight-only" and info["quantized_layers"] == 14
    eng = m.open_engine(spec, ctx, art)  # fresh open of the saved artifact
    assert eng.backend == _label("torchao-int8-weight-only", eng)
    w = eng.model.model.layers[0].self_attn.q_proj.weight
    assert type(w).__name__ not in ("Tensor", "Parameter")  # still int8 after reload
    ref = _ref_logprobs(tiny)
    got = _logprobs(eng.model, _ids())
    assert float((ref - got).abs().max()) < 0.1
    q = m.quant_info(spec, ctx, art, eng)
    bf16 = _bf16_bytes(tiny)
    assert q["stored_bytes"] < bf16
    from qeval.tiers.int8 import source_parameter_count
    assert q["parameters"] == source_parameter_count(str(tiny))
    # 14 Linear layers of 128x128/128x64/256x128... int8 + one bf16 scale (and zero) per row
    assert 8.0 < q["bits_per_weight_quantized"] < 8.6
    # qeval plan's estimate from the config alone is the stored size, byte for byte
    assert _estimate("int8", spec, tiny).bytes == q["stored_bytes"]
    assert q["bits_per_weight"] < 16
    # the dequantized dense model gives the same logits as the int8 kernels
    deq = m.load_dequantized(spec, ctx, art)
    assert type(deq.model.model.layers[0].self_attn.q_proj.weight.data).__name__ == "Tensor"
    assert float((_logprobs(deq.model, _ids()) - got).abs().max()) < 0.05
    kd = _kld(_logprobs(deq.model, _ids()), got)
    print(f"KLD dequantized vs real kernel (int8): {kd:.2e}")
    assert kd < 1e-3, kd  # issue 5: the two quality paths agree
    # generation works through the engine, with the int8 KV cache too
    from qeval.engines.hf import HFEngine
    g = HFEngine(eng.model, "cpu", kv_cache="int8").generate(list(range(3, 40)), 5, ignore_stop=True)
    assert len(g.token_ids) == 5
    # its activations run in bf16: on a CPU without AVX512_BF16 the row says torch emulated them
    from qeval.engines.ggml_cpu import CPU_KIND_ENV
    note = "emulated on this CPU: no AVX512_BF16"
    monkeypatch.setenv(CPU_KIND_ENV, "avx2")
    emu = m.open_engine(spec, ctx, art)
    assert emu.backend == f"torchao-int8-weight-only (bfloat16 {note})" and emu.dtype_emulated == "bfloat16"
    deq = m.load_dequantized(spec, ctx, art)
    assert deq.backend == f"torch-bfloat16 (dequantized torchao-int8-weight-only; {note})"
    monkeypatch.setenv(CPU_KIND_ENV, "avx512-bf16")
    assert m.open_engine(spec, ctx, art).backend == "torchao-int8-weight-only"


def test_int8_bitsandbytes_round_trip(tiny, tmp_path):
    pytest.importorskip("bitsandbytes")
    m = get_method("int8")
    spec, ctx = _spec("int8", backend="bitsandbytes"), _ctx(tiny)
    try:
        art, info = _prepare("int8", spec, ctx, tmp_path)
    except RuntimeError as e:  # a bitsandbytes build without a kernel for this device
        assert "bitsandbytes 8-bit quantization failed" in str(e)
        pytest.skip(str(e))
    eng = m.open_engine(spec, ctx, art)
    assert eng.backend == _label("bitsandbytes-llm.int8", eng)
    got = _logprobs(eng.model, _ids())
    assert float((_ref_logprobs(tiny) - got).abs().max()) < 0.1
    q = m.quant_info(spec, ctx, art, eng)
    assert q["stored_bytes"] < _bf16_bytes(tiny) and 8.0 < q["bits_per_weight_quantized"] < 8.6
    deq = m.load_dequantized(spec, ctx, art)
    assert float((_logprobs(deq.model, _ids()) - got).abs().max()) < 0.1


def test_int8_missing_package_is_input_error(tiny, monkeypatch):
    import qeval.tiers.int8 as mod
    monkeypatch.setattr(mod, "lib_version", lambda name: None)
    with pytest.raises(QevalInputError, match="bitsandbytes"):
        get_method("int8").check(_spec("int8", backend="bitsandbytes"), _ctx(tiny))


def test_int8_key_changes_with_backend(tiny):
    m = get_method("int8")
    ctx = _ctx(tiny)
    a = m.key_fields(_spec("int8"), ctx)
    b = m.key_fields(_spec("int8", backend="bitsandbytes"), ctx)
    assert a != b and a["library"]["torchao"]


def test_parameter_count_is_logical(tiny):
    from qeval.tiers.int8 import source_parameter_count
    from transformers import AutoModelForCausalLM
    dense = AutoModelForCausalLM.from_pretrained(str(tiny))
    assert source_parameter_count(str(tiny)) == sum(p.numel() for p in dense.parameters())


# ---- group size ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """hidden 192, intermediate 320: 128 divides neither, 64 divides both."""
    p = tmp_path_factory.mktemp("tiny_wide")
    _build_tiny(p, hidden=192, intermediate=320)
    return p


def test_group_size_error_names_layer_and_sizes(wide):
    pytest.importorskip("gptqmodel")
    m = get_method("gptq")
    with pytest.raises(QevalInputError) as e:
        m.check(_spec("gptq", group_size=128), _ctx(wide))
    msg = str(e.value)
    assert e.value.field == "tiers.t-gptq.group_size"
    assert "model.layers.0.self_attn.q_proj" in msg and "192" in msg
    assert "16, 32, 64" in msg and "128" not in msg.split("sizes that work")[1]


def test_group_size_auto_picks_divisor(wide, tiny):
    # gptq: the wide model's v_proj (96 outputs) is refused by AWQ's out-feature precheck
    # (tests/test_failures.py::test_awq_out_feature_rules), which is not what this test is about
    pytest.importorskip("gptqmodel")
    m = get_method("gptq")
    assert m.check(_spec("gptq", group_size="auto"), _ctx(wide)) == {"group_size": 64}
    assert m.check(_spec("gptq", group_size="auto"), _ctx(tiny)) == {"group_size": 128}
    assert m.check(_spec("gptq", group_size=32), _ctx(wide)) == {"group_size": 32}
    assert m.check(_spec("gptq", group_size=-1), _ctx(wide)) == {"group_size": -1}


def test_group_size_pure_logic():
    from qeval.tiers.gptq import resolve_group_size
    feats = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.mlp.down_proj": 1536}
    assert resolve_group_size(SimpleNamespace(name="x", group_size="auto"), feats) == 64
    assert resolve_group_size(SimpleNamespace(name="x", group_size="auto"), {"a": 100}) == -1
    with pytest.raises(QevalInputError, match="96 is not one"):
        resolve_group_size(SimpleNamespace(name="x", group_size=96), feats)


def test_awq_rejects_desc_act(tiny):
    pytest.importorskip("gptqmodel")
    with pytest.raises(QevalInputError, match="desc_act"):
        get_method("awq").check(_spec("awq", desc_act=True), _ctx(tiny))


def test_w4_keys_include_calibration(tiny):
    m = get_method("gptq")
    ctx = _ctx(tiny)
    k = m.key_fields(_spec("gptq"), ctx)
    assert k["calibration"] == ctx.calibration_fields and k["bits"] == 4 and k["group_size"] == 64
    assert k["library"]["gptqmodel"]
    assert m.key_fields(_spec("gptq", sym=False), ctx) != k
    assert get_method("awq").key_fields(_spec("awq"), ctx)["method"] == "awq"


# ---- GPTQ / AWQ round trips ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_w4_round_trip(method, tiny, tmp_path, monkeypatch):
    pytest.importorskip("gptqmodel")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # gptqmodel would write ./logs/ here
    m = get_method(method)
    spec, ctx = _spec(method), _ctx(tiny)
    art, info = _prepare(method, spec, ctx, tmp_path)
    assert not list(cwd.iterdir()), list(cwd.iterdir())
    assert info["group_size"] == 64 and info["library"]["gptqmodel"]
    assert json.loads((art / "quantize_config.json").read_text())["group_size"] == 64
    assert not list(art.parent.glob(".*offload*"))  # the offload folder is gone
    eng = m.open_engine(spec, ctx, art)
    assert eng.backend.startswith("gptqmodel:")
    q = m.quant_info(spec, ctx, art, eng)
    assert q["stored_bytes"] < 0.7 * _bf16_bytes(tiny)  # the bf16 embedding dominates this tiny model
    assert 4.0 < q["bits_per_weight_quantized"] < 5.0  # 4-bit codes + per-group scales/zeros
    est = _estimate(method, spec, tiny)  # qeval plan's estimate from the config alone
    assert (est.bytes, est.quantized_bytes) == (q["stored_bytes"], q["quantized_layers_bytes"])
    assert q["group_size"] == 64 and q["quantized_layers"] == 14
    ref = _ref_logprobs(tiny)
    got = _logprobs(eng.model, _ids())
    kld = _kld(ref, got)
    assert 0 < kld < 0.05, kld
    g = eng.generate(list(range(3, 40)), 4, ignore_stop=True)
    assert len(g.token_ids) == 4
    # dequantized dense model ~ the real kernel
    deq = m.load_dequantized(spec, ctx, art)
    assert "dequantized" in deq.backend
    assert all(type(x).__name__ == "Linear" for x in deq.model.model.layers[0].mlp.children() if hasattr(x, "in_features"))
    kd = _kld(_logprobs(deq.model, _ids()), got)
    print(f"KLD dequantized vs real kernel ({method}): {kd:.2e}")
    assert kd < 1e-3, kd  # issue 5: the two quality paths agree


def test_awq_clip_search_off_changes_the_key_only_when_off(tiny):
    m, ctx = get_method("awq"), _ctx(tiny)
    on = m.key_fields(_spec("awq"), ctx)
    assert "clip_search" not in on  # the default (clipping on) keeps earlier artifacts' keys
    assert on == m.key_fields(_spec("awq", clip_search=True), ctx)
    assert m.key_fields(_spec("awq", clip_search=False), ctx) == {**on, "clip_search": False}


@pytest.mark.slow
def test_awq_without_clip_search_never_searches_clipping(tiny, tmp_path, monkeypatch):
    pytest.importorskip("gptqmodel")
    from gptqmodel.looper import awq_processor
    from qeval.tiers.gptq import awq_clip_search

    monkeypatch.chdir(tmp_path)
    original = awq_processor.AWQProcessor.__init__

    def refuse(*a, **k):
        raise AssertionError("the clipping search ran with clip_search: false")

    monkeypatch.setattr(awq_processor.AWQProcessor, "_search_best_clip", refuse)
    spec, ctx = _spec("awq", clip_search=False), _ctx(tiny)
    art, info = _prepare("awq", spec, ctx, tmp_path)
    assert info["clip_search"] is False
    assert awq_processor.AWQProcessor.__init__ is original  # the constructor is restored after
    eng = get_method("awq").open_engine(spec, ctx, art)
    kld = _kld(_ref_logprobs(tiny), _logprobs(eng.model, _ids()))
    assert 0 < kld < 0.05, kld  # the scale search alone still quantizes well
    with awq_clip_search(True):  # on: nothing is wrapped
        assert awq_processor.AWQProcessor.__init__ is original


def test_gptq_packing_compiles_the_extension_only_when_it_pays(tmp_path):
    from qeval.tiers.gptq import pack_extension_choice

    small, big = 100_000_000, 14_000_000_000
    assert pack_extension_choice(small, tmp_path, env={})[0] is False  # 13 s in torch < compiling
    assert pack_extension_choice(big, tmp_path, env={})[0] is True
    assert pack_extension_choice(small, tmp_path, env={"GPTQMODEL_FORCE_PACK_EXT": "1"}) == (True, "set in the environment")
    assert pack_extension_choice(big, tmp_path, env={"GPTQMODEL_DISABLE_PACK_EXT": "1"})[0] is False
    built = tmp_path / "pack_block_cpu" / "aa3e410a044f011c"
    built.mkdir(parents=True)
    (built / "gptqmodel_pack_block_cpu.so").write_bytes(b"")
    assert pack_extension_choice(small, tmp_path, env={}) == (True, "already compiled")


# ---- a hybrid model: sliding-window layers with local RoPE beside full ones (issue 64) -------

def _build_tiny_gemma3(path: Path) -> None:
    """A tiny random Gemma 3 text model: 4 layers, 3 sliding-window (window 16) with local
    RoPE and 1 full-attention with global RoPE (``Gemma3RotaryEmbedding.forward(x,
    position_ids, layer_type)``), 1 KV head; the word-level tokenizer of :func:`_build_tiny`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    _build_tiny(path)  # its tokenizer (the llama weights are overwritten below)
    for f in path.glob("*.safetensors"):
        f.unlink()
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=16,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def test_per_layer_rotary_is_read_from_the_rotary_modules_signature(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from qeval.tiers.gptq import per_layer_rotary
    g3 = tmp_path / "g3"
    _build_tiny_gemma3(g3)
    assert per_layer_rotary(AutoModelForCausalLM.from_pretrained(str(g3)))
    assert not per_layer_rotary(AutoModelForCausalLM.from_pretrained(str(tiny)))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_w4_on_a_hybrid_sliding_window_model_round_trips(method, tmp_path, monkeypatch):
    """gptqmodel 7.6's AWQ scale search recomputed RoPE with one argument and died on Gemma 3
    (``Gemma3RotaryEmbedding.forward() missing 1 required positional argument: 'layer_type'``,
    issue 64); with the captured position embeddings kept (qeval.tiers.gptq
    keep_captured_position_embeddings) both methods quantize it, say what calibration could not
    do per layer type, and the quantized model stays close to the source."""
    pytest.importorskip("gptqmodel")
    monkeypatch.chdir(tmp_path)
    g3 = tmp_path / "g3"
    _build_tiny_gemma3(g3)
    m = get_method(method)
    logs: list[str] = []
    spec, ctx = _spec(method), _ctx(g3)
    ctx.log = logs.append
    art, info = _prepare(method, spec, ctx, tmp_path)
    assert "layer 0's captured attention mask and RoPE" in info["calibration_note"]
    assert any("keeps the captured position_embeddings" in x for x in logs), logs
    eng = m.open_engine(spec, ctx, art)
    kld = _kld(_ref_logprobs(g3), _logprobs(eng.model, _ids()))
    assert 0 < kld < 0.05, kld
