"""quality.bf16_matmul (qeval.engines.bf16_matmul): bfloat16 linear layers as float32
matmuls in the quality stages, on the tiny random llama."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qeval.engines import bf16_matmul as bm


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_float32_matmuls_round_once_and_stay_near_float32(tiny_llama):
    """Every bfloat16 linear layer is changed; the output stays bfloat16 and equals the
    float32 product of the bfloat16 operands rounded once; the model's logits move no
    further from a float32 forward than native bfloat16's do (both are bfloat16 paths:
    neither is exact)."""
    from transformers import AutoModelForCausalLM
    m32 = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ref, native = _logits(m32, ids), _logits(m, ids)
    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    assert bm.float32_matmuls(m) == len(linears) > 0
    x = torch.randn(3, linears[0].in_features).to(torch.bfloat16)
    y = linears[0](x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), linears[0].weight.float()).to(torch.bfloat16))
    emu = _logits(m, ids)

    def kld(p, q):
        p, q = p.log_softmax(-1), q.log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1).mean().item()
    assert kld(ref, emu) <= 2 * kld(ref, native) + 1e-6
    assert (emu.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_quantized_and_float32_layers_are_left_alone():
    """A float32 layer and a torchao int8 weight-only layer (a tensor subclass reporting
    bfloat16) are not changed: 0 layers."""
    lin32 = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert bm.float32_matmuls(lin32) == 0
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    q = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    quantize_(q, Int8WeightOnlyConfig())
    assert q[0].weight.dtype == torch.bfloat16 and type(q[0].weight.data) is not torch.Tensor
    assert bm.float32_matmuls(q) == 0


def test_auto_resolves_by_device_dtype_and_cpu(monkeypatch):
    monkeypatch.setattr(bm, "cpu_has_fast_bf16", lambda: False)
    assert bm.resolve_bf16_matmul("auto", "cpu", "bfloat16") == "float32"
    assert bm.resolve_bf16_matmul("auto", "cuda", "bfloat16") == "native"
    assert bm.resolve_bf16_matmul("auto", "cpu", "float16") == "native"
    assert bm.resolve_bf16_matmul("native", "cpu", "bfloat16") == "native"
    monkeypatch.setattr(bm, "cpu_has_fast_bf16", lambda: True)
    assert bm.resolve_bf16_matmul("auto", "cpu", "bfloat16") == "native"
    assert bm.resolve_bf16_matmul("float32", "cpu", "bfloat16") == "float32"
    with pytest.raises(ValueError, match="bf16_matmul"):
        bm.resolve_bf16_matmul("fast", "cpu", "bfloat16")


def test_apply_to_engine_reports_only_what_it_changed(monkeypatch, tiny_llama):
    """An engine without a transformers model (llama.cpp, a server) and a model with no
    bfloat16 linear layer report ("native", 0): a row never claims float32 matmuls it did
    not get."""
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(bm, "cpu_has_fast_bf16", lambda: False)

    class NoModel:
        backend = "llama.cpp"
    assert bm.apply_to_engine(NoModel(), "auto", "cpu", "bfloat16") == ("native", 0)

    class Eng:
        def __init__(self, model):
            self.model = model
    m32 = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert bm.apply_to_engine(Eng(m32), "float32", "cpu", "bfloat16") == ("native", 0)
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    got, n = bm.apply_to_engine(Eng(m), "auto", "cpu", "bfloat16")
    assert got == "float32" and n == sum(isinstance(x, torch.nn.Linear) for x in m.modules())


def test_float32_linear_calls_read_the_weight_at_each_call():
    """Inside the context every CPU bfloat16 F.linear (through nn.Linear) is the float32
    product rounded once, including after the weight was rewritten in place (what AWQ's
    scale search does between forwards); float32 calls pass through; outside the context
    F.linear is torch's again."""
    orig = F.linear
    lin = torch.nn.Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    with bm.float32_linear_calls():
        y = lin(x)
        assert torch.equal(y, orig(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16))
        with torch.no_grad():
            lin.weight.mul_(3)
        y3 = lin(x)
        assert torch.equal(y3, orig(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16))
        assert not torch.equal(y3, y)
        x32, w32 = torch.randn(2, 8), torch.randn(4, 8)
        assert torch.equal(F.linear(x32, w32), orig(x32, w32))
    assert F.linear is orig


def test_awq_calibration_matmul_enters_the_artifact_key_only_when_float32(monkeypatch):
    """AWQ's calibration_matmul resolves like quality.bf16_matmul; the artifact key gains
    ``calibration_matmul`` only when it is float32 (a native key stays what it was)."""
    from qeval.tiers import gptq
    monkeypatch.setattr(bm, "cpu_has_fast_bf16", lambda: False)
    m = gptq.METHODS["awq"]

    class Spec:
        calibration_matmul = "auto"
    class Ctx:
        device, dtype = "cpu", "bfloat16"
    assert m._calibration_matmul(Spec(), Ctx()) == "float32"
    Spec.calibration_matmul = "native"
    assert m._calibration_matmul(Spec(), Ctx()) == "native"
    Ctx.device = "cuda"
    Spec.calibration_matmul = "auto"
    assert m._calibration_matmul(Spec(), Ctx()) == "native"
    assert gptq.METHODS["gptq"]._calibration_matmul(Spec(), Ctx()) == "native"
