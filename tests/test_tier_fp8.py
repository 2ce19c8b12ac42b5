"""FP8 weight-only tier (torchao Float8WeightOnlyConfig) on the tiny random llama: the
recipe takes it, the artifact round-trips through safetensors, weights are stored as
float8 with a scale per output channel, and the logits stay close to BF16's (on CPU the
matmul dequantizes the weights, and the row says so)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from qeval.recipe import parse_recipe  # noqa: E402
from qeval.tiers import get_method  # noqa: E402
from qeval.tiers.base import TierContext  # noqa: E402


@pytest.fixture(scope="module")
def built(tiny_llama, tmp_path_factory):
    """(spec, ctx, artifact folder, prepare info) of an fp8 tier of the tiny model."""
    r = parse_recipe(f"name: x\nmodel: {{source: {tiny_llama}}}\ntiers: [{{name: bf16, method: bf16}}, "
                     "{name: f8, method: fp8}]\n")
    spec = r.tier("f8")
    ctx = TierContext(source_path=str(tiny_llama), source_sha256="0" * 64, device="cpu", threads=1)
    m = get_method("fp8")
    m.check(spec, ctx)
    out = tmp_path_factory.mktemp("fp8")
    info = m.prepare(spec, ctx, out)
    return spec, ctx, out, info


def _logprobs(engine, ids):
    return np.concatenate([lp for _, lp in engine.iter_logprobs(ids, window=64)])


def test_recipe_and_key(tiny_llama):
    m, i8 = get_method("fp8"), get_method("int8")
    assert m.engines() == ("hf", "openai") and m.needs_artifact and m.has_dequantized  # openai: served by vLLM
    r = parse_recipe("name: x\nmodel: {source: /m}\ntiers: [{name: bf16, method: bf16}, {name: f, method: fp8}]\n")
    ctx = TierContext(source_path="/m", source_sha256="a" * 64, device="cpu")
    key = m.key_fields(r.tier("f"), ctx)
    assert key["method"] == "fp8" and "float8_e4m3fn" in key["scheme"]
    assert key != i8.key_fields(parse_recipe("name: x\nmodel: {source: /m}\ntiers: [{name: bf16, method: bf16}, "
                                             "{name: i, method: int8}]\n").tier("i"), ctx)


def test_artifact_is_float8_and_close_to_bf16(built):
    spec, ctx, out, info = built
    assert any(p.suffix == ".safetensors" for p in out.iterdir())
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in out.rglob("*"))
    m = get_method("fp8")
    eng = m.open_engine(spec, ctx, out)
    assert eng.name == "hf" and "dequantized per matmul" in eng.backend
    lin = eng.model.model.layers[0].self_attn.q_proj
    assert type(lin.weight).__name__ == "Float8Tensor" and lin.weight.qdata.dtype == torch.float8_e4m3fn
    n_linear = sum(1 for _, mod in eng.model.named_modules() if isinstance(mod, torch.nn.Linear)
                   and mod is not eng.model.get_output_embeddings())
    assert info["quantized_layers"] == n_linear
    q = m.quant_info(spec, ctx, out, eng)
    bf16 = get_method("bf16")
    ref = bf16.open_engine(spec, ctx, None)
    assert q["stored_bytes"] < bf16.quant_info(spec, ctx, None, ref)["stored_bytes"]
    # 1 byte per weight plus one float32 scale per output row: 8 + 32 / in_features bits
    layers = [(mod.in_features, mod.out_features) for _, mod in eng.model.named_modules()
              if type(getattr(mod, "weight", None)).__name__ == "Float8Tensor"]
    expected = 8 * sum(o * i + 4 * o for i, o in layers) / sum(o * i for i, o in layers)
    assert q["bits_per_weight_quantized"] == pytest.approx(expected)
    ids = list(np.random.default_rng(0).integers(0, eng.vocab_size, 96))
    lp, lr = _logprobs(eng, ids), _logprobs(ref, ids)
    kld = float((np.exp(lr) * (lr - lp)).sum(-1).mean())
    assert 0 < kld < 0.05
    deq = m.load_dequantized(spec, ctx, out)  # the same weights, dense: the same math
    np.testing.assert_allclose(_logprobs(deq, ids), lp, atol=2e-2)
