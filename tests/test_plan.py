"""``qeval plan``: weight formats and KV formats from a config, the GPU table, the classic
14B-on-24 GB example (issue 20), measured figures replacing estimates, bad flags."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qeval import cli
from qeval.analysis.capacity import decode_bound, parse_bandwidth
from qeval.analysis.gpus import find_gpu, known_gpus
from qeval.analysis.plan import build_plan, plan_markdown
from qeval.errors import QevalInputError
from qeval.model_config import model_shape
from qeval.results import LoadSection, RunLayout, load_run, read_tier_result, write_tier_result
from qeval.weight_formats import (Dense, FlatBits, GgufMix, GroupWise, gguf_tensor_types, kv_format)

REPO = Path(__file__).resolve().parent.parent
QWEN25_14B = REPO / "tests" / "fixtures" / "qwen2.5-14b-instruct" / "config.json"
FIXTURE_RUN = REPO / "tests" / "fixtures" / "run_synthetic"
GB = 1e9


def _qeval(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the console entry point in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["qeval", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    got = capsys.readouterr()
    return int(e.value.code or 0), got.out, got.err


def _plan(monkeypatch, capsys, *args: str) -> dict:
    rc, out, err = _qeval(monkeypatch, capsys, "plan", *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _rows(plan: dict) -> dict[str, dict]:
    return {r["tier"]: r for r in plan["rows"]}


def _v(row: dict, cell: str):
    return row[cell]["value"]


# ---- the model and its formats ------------------------------------------------------------------

def test_qwen25_14b_config_fixture():
    shape = model_shape(json.loads(QWEN25_14B.read_text()))
    assert shape.params == 14_770_033_664            # "about 14.8B parameters"
    assert shape.kv_elements_per_token * 2 == 196_608  # 48 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    assert kv_format("hf", "model").bytes_per_token(shape) == 196_608
    assert kv_format("llamacpp", "model").bytes_per_token(shape) == 196_608
    # int8 KV: 8.5 bits per element (q8_0: 34 bytes per 32; HQQ: 8 bits + 16-bit scale and zero per 64)
    assert kv_format("llamacpp", "int8").bytes_per_token(shape) == 196_608 * 34 / 32 / 2
    assert kv_format("hf", "int8").bytes_per_token(shape) == 104_448
    assert Dense().estimate(shape).bytes == 29_540_067_328  # BF16: about 29.5 GB


def test_w4_g128_and_q4_k_m_count_their_scales():
    shape = model_shape(json.loads(QWEN25_14B.read_text()))
    flat = FlatBits(4).estimate(shape)
    assert flat.bytes == pytest.approx(7.4 * GB, rel=0.05)  # plain 4-bit: 0.5 bytes per parameter
    w4 = GroupWise(method="gptq", bits=4, group_size=128).estimate(shape)
    # per quantized Linear: 4 bits + (16-bit scale + 4-bit zero) / 128 + an int32 g_idx per column
    assert 4.156 < w4.bits_per_weight_quantized < 4.17
    # the "about 7.8 GB" is that rate (4 + scales and zeros) over every parameter ...
    assert w4.bits_per_weight_quantized * shape.params / 8 == pytest.approx(7.8 * GB, rel=0.03)
    # ... but gptqmodel (like Qwen's published GPTQ-Int4 and AWQ files) keeps the embedding and
    # the LM head (2 x 152064 x 5120) in BF16: about 10 GB stored
    assert w4.quantized_bytes == pytest.approx(6.87 * GB, rel=0.005)
    assert w4.bytes - w4.quantized_bytes == pytest.approx(2 * 152064 * 5120 * 2, rel=0.001)
    assert w4.bytes == pytest.approx(9.99 * GB, rel=0.005) and w4.bytes > flat.bytes
    awq = GroupWise(method="awq", bits=4, group_size=128, g_idx=False).estimate(shape)
    assert awq.bytes < w4.bytes and w4.bytes - awq.bytes == sum(t.cols for t in shape.tensors if t.is_decoder_linear) * 4
    q4km = GgufMix("Q4_K_M").estimate(shape)
    # the published Qwen2.5-14B-Instruct Q4_K_M file is about 9.0 GB (8.99 GB with its tokenizer metadata)
    assert q4km.bytes == pytest.approx(9.0 * GB, rel=0.01)
    assert 4.8 < q4km.bits_per_weight < 4.9          # "about 4.85"
    assert q4km.tensor_types == {"F32": 241, "Q4_K": 289, "Q6_K": 49} and q4km.fallback_tensors == 0


def test_q4_k_m_mix_follows_llama_cpp():
    shape = model_shape(json.loads(QWEN25_14B.read_text()))
    types = {(t.role, t.layer): ty for t, ty, _ in gguf_tensor_types(shape, "Q4_K_M")}
    assert types[("lm_head", None)] == "Q6_K" and types[("embed", None)] == "Q4_K"
    # use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2 -> Q6_K on attn_v and ffn_down
    more = [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert len(more) == 24
    for i in range(48):
        want = "Q6_K" if i in more else "Q4_K"
        assert types[("v", i)] == want and types[("down", i)] == want
        assert types[("q", i)] == types[("k", i)] == types[("o", i)] == types[("gate", i)] == "Q4_K"
    # SmolLM2-135M (hidden 576, not a multiple of 256): llama.cpp falls back on 180 of its 272
    # tensors (qeval/tiers/gguf.py), the tied embedding becomes the Q8_0 output
    smol = model_shape({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                        "vocab_size": 49152, "tie_word_embeddings": True})
    st = gguf_tensor_types(smol, "Q4_K_M")
    assert len(st) == 272 and sum(f for _, _, f in st) == 180
    assert {ty for t, ty, f in st if f and t.role == "v"} <= {"Q5_0", "Q8_0"}
    assert [ty for t, ty, _ in st if t.role == "embed"] == ["Q8_0"]
    with pytest.raises(QevalInputError, match="IQ2_XS"):
        gguf_tensor_types(smol, "IQ2_XS")


# Qwen3-14B (hidden 5120, intermediate 17408, 40 layers, 40 heads / 8 KV heads of 128, vocab
# 151936, untied): GGUF file sizes published at huggingface.co/bartowski/Qwen_Qwen3-14B-GGUF
# (llama.cpp b5200), in GB. Those files were made with an importance matrix, which moves five
# Q4_0 ffn_down tensors to Q4_1 (+0.03 GB); the mix here is the one without.
QWEN3_14B = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
             "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": False}
PUBLISHED_QWEN3_14B = {"BF16": 29.54, "Q8_0": 15.70, "Q6_K": 12.12, "Q5_K_M": 10.51, "Q5_K_S": 10.26,
                       "Q4_1": 9.39, "Q4_K_M": 9.00, "Q4_K_S": 8.57, "Q4_0": 8.54}


@pytest.mark.parametrize("ftype", sorted(PUBLISHED_QWEN3_14B))
def test_gguf_sizes_match_published_files(ftype):
    got = GgufMix(ftype).estimate(model_shape(QWEN3_14B)).bytes / GB
    assert got == pytest.approx(PUBLISHED_QWEN3_14B[ftype], rel=0.005), got


def test_group_size_that_does_not_divide_is_a_row_note():
    shape = model_shape(json.loads(QWEN25_14B.read_text()))
    with pytest.raises(QevalInputError, match="does not divide the input features 5120"):
        GroupWise(group_size=384).estimate(shape)


@pytest.mark.parametrize("cfg, field", [
    ([1, 2], None), ({"num_hidden_layers": "48"}, "num_hidden_layers"),
    ({"num_hidden_layers": 10 ** 400, "hidden_size": 8}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
      "vocab_size": 8, "num_local_experts": 8}, "num_local_experts")])
def test_bad_configs_are_input_errors(cfg, field):
    with pytest.raises(QevalInputError) as e:
        model_shape(cfg)
    assert e.value.field == field


# ---- GPUs ---------------------------------------------------------------------------------------

def test_gpu_table_is_complete_and_sourced():
    gpus = known_gpus()
    assert {"rtx4090", "rtx3090", "l4", "l40s", "a10", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200",
            "mi300x", "m2-max", "m2-ultra", "m3-max", "m3-ultra"} <= set(gpus)
    for g in gpus.values():
        assert g.memory_bytes >= 16 * 2 ** 30 and g.bandwidth_bytes_per_s >= 1e11 and len(g.source) > 20
    assert find_gpu("RTX 4090") is gpus["rtx4090"] and gpus["rtx4090"].bandwidth_bytes_per_s == 1008e9
    assert gpus["h100-sxm"].bandwidth_bytes_per_s == 3.35e12 and gpus["m3-max"].usable == 0.75
    assert parse_bandwidth("1008GB/s") == parse_bandwidth("1008 GB") == 1.008e12 / 1000 * 1000
    with pytest.raises(QevalInputError, match="rtx4090, rtx3090"):
        find_gpu("nosuch")


# ---- the classic example ------------------------------------------------------------------------

def test_classic_14b_on_24gb_example(monkeypatch, capsys):
    p4k = _plan(monkeypatch, capsys, "--model", str(QWEN25_14B), "--gpu", "rtx4090", "--context", "4096",
                "--users", "8")
    rows = _rows(p4k)
    flat, w4, q4 = rows["4bit-flat"], rows["gptq-w4g128"], rows["gguf-q4_k_m"]
    assert p4k["memory_bytes"] == 24 * 2 ** 30 and p4k["bandwidth_bytes_per_s"] == 1008e9 and p4k["usable"] == 0.95
    # plain 4-bit: 7.4 GB and a decode bound of 1008 / 7.4 = 136 tokens/s
    assert _v(flat, "weights_bytes") == pytest.approx(7.4 * GB, rel=0.05)
    assert _v(flat, "decode_bound_empty") == pytest.approx(136, rel=0.05)
    assert _v(flat, "kv_bytes_per_token") == 196_608
    # the real W4 g128 and Q4_K_M rows are larger by their scales (and BF16 embedding/head), so slower
    assert _v(w4, "weights_bytes") == pytest.approx(9.99 * GB, rel=0.01)
    assert _v(q4, "weights_bytes") == pytest.approx(9.0 * GB, rel=0.01)
    assert _v(w4, "decode_bound_empty") == pytest.approx(1008 / 9.99, rel=0.01)
    assert _v(q4, "decode_bound_empty") == pytest.approx(1008 / 8.98, rel=0.01)
    assert _v(flat, "decode_bound_empty") > _v(q4, "decode_bound_empty") > _v(w4, "decode_bound_empty")
    # expected speed: the bound at 4096 tokens x the stated default 0.5-0.8
    lo, hi = _v(flat, "decode_expected")
    assert lo == pytest.approx(0.5 * _v(flat, "decode_bound")) and hi == pytest.approx(0.8 * _v(flat, "decode_bound"))
    assert _v(flat, "decode_bound") == pytest.approx(1008e9 / (7.385e9 + 196_608 * 4096), rel=0.001)
    # 8 x 4K fits for every 4-bit row; BF16 weights alone exceed the card
    for r in (flat, w4, q4, rows["awq-w4g128"]):
        assert _v(r, "fits") is True and r["fits"]["source"] == "estimate"
    assert _v(rows["bf16"], "fits") is False and _v(rows["bf16"], "kv_budget_bytes") < 0
    assert all(r["weights_bytes"]["source"] == "estimate" and r["weights_bytes"]["formula"] for r in p4k["rows"])
    assert all(r["prefill_tokens_per_s"]["value"] is None for r in p4k["rows"])
    # 8 x 32K does not fit; an int8 KV cache about doubles the users that fit at 32K
    p32 = _rows(_plan(monkeypatch, capsys, "--model", str(QWEN25_14B), "--gpu", "rtx4090", "--context", "32768"))
    for name in ("4bit-flat", "gptq-w4g128", "gguf-q4_k_m", "gptq-w4g128-kv8", "gguf-q4_k_m-kv8"):
        assert _v(p32[name], "fits") is False
    for base in ("gptq-w4g128", "gguf-q4_k_m", "awq-w4g128", "int8"):
        kv16, kv8 = p32[base], p32[f"{base}-kv8"]
        assert _v(kv16, "kv_budget_bytes") == _v(kv8, "kv_budget_bytes")
        assert 2 * _v(kv16, "sequences") - 1 <= _v(kv8, "sequences") <= 2 * _v(kv16, "sequences")
        ratio = _v(kv8, "max_context_tokens") / _v(kv16, "max_context_tokens")
        assert ratio == pytest.approx(2 / (34 / 32), rel=0.01)        # 1.88 x: int8 plus its scales
    assert (_v(p32["gguf-q4_k_m"], "sequences"), _v(p32["gguf-q4_k_m-kv8"], "sequences")) == (2, 4)
    assert (_v(p32["4bit-flat"], "sequences"), _v(p32["gptq-w4g128-kv8"], "sequences")) == (2, 3)


def test_example_kv_budget_on_a_24_gb_card():
    """The example's own arithmetic: 24 GB x 0.95 = 22.8 GB usable, minus 7.4 GB of weights
    and 1.7 GB of overhead leaves 13.7 GB of KV; 8 x 4K needs 6.4 GB, 8 x 32K 51.5 GB."""
    cfg = json.loads(QWEN25_14B.read_text())
    from qeval.analysis.plan import PlanTier
    flat = PlanTier("4bit-flat", "-", "hf", "model", FlatBits(4), kv_format("hf", "model"))
    p = build_plan(config=cfg, tiers=[flat], gpu=find_gpu("rtx4090"), memory_bytes=24 * 10 ** 9,
                   overhead_bytes=int(1.7e9), context=4096, users=8)
    row = p.rows[0]
    assert p.budget_bytes == 22.8e9
    assert row.kv_budget_bytes.value == pytest.approx(13.7e9, rel=0.01)
    assert 8 * 4096 * 196_608 == pytest.approx(6.4e9, rel=0.01) and row.fits.value is True
    p32 = build_plan(config=cfg, tiers=[flat], gpu=find_gpu("rtx4090"), memory_bytes=24 * 10 ** 9,
                     overhead_bytes=int(1.7e9), context=32768, users=8)
    assert 8 * 32768 * 196_608 == pytest.approx(51.5e9, rel=0.01) and p32.rows[0].fits.value is False
    assert decode_bound(1008e9, 7.4e9, 196_608, 0) == pytest.approx(136, rel=0.01)


def test_table_marks_every_cell(monkeypatch, capsys):
    rc, out, err = _qeval(monkeypatch, capsys, "plan", "--model", str(QWEN25_14B), "--gpu", "rtx4090",
                          "--context", "4096")
    assert rc == 0 and err == ""
    assert "ESTIMATES from" in out and "NVIDIA GeForce RTX 4090" in out and "1,008 GB/s" in out
    line = next(x for x in out.splitlines() if x.startswith("| 4bit-flat "))
    assert "7.39 GB est" in line and "136 -> 123 est" in line and "measure it" in line and "not measured" in line
    assert "gptq-w4g128: decoder Linears 4 bits + 2-byte scale and 4-bit zero per 128 inputs" in out
    assert "Q4_K_M: llama.cpp Q4_K_M type per tensor (F32 x241, Q4_K x289, Q6_K x49)" in out


def test_recipe_tiers(monkeypatch, capsys):
    plan = _plan(monkeypatch, capsys, "--recipe", str(REPO / "recipes" / "qwen14b.yaml"), "--model", str(QWEN25_14B),
                 "--gpu", "h100-sxm", "--context", "8192")
    rows = _rows(plan)
    assert list(rows) == ["bf16", "int8", "gptq", "awq", "gguf-q4_k_m", "gguf-q4_k_m-kv8", "bf16-kv8",
                          "gptq-vllm", "awq-vllm", "int8-vllm", "gguf-q4_k_m-server"]
    assert rows["gptq-vllm"]["format"] == rows["gptq"]["format"]  # a served tier stores the same weights
    assert rows["gptq"]["format"] == "gptq-w4g128" and rows["gguf-q4_k_m-kv8"]["kv_bytes_per_token"]["value"] == 104_448
    assert _v(rows["bf16"], "fits") is True  # 29.5 GB + 8 x 8K x 196,608 B fits 80 GiB x 0.95


# ---- measured figures replace estimates ---------------------------------------------------------

def test_run_figures_replace_estimates_row_by_row(tmp_path, monkeypatch, capsys):
    d = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, d)  # a recorded run of the tiny model (tests/make_run_fixture.py)
    layout = RunLayout(d)
    q4 = read_tier_result(layout, "q4_k_m")
    q4.load = LoadSection(users_at_slo=6, depth=48)  # what the load stage will record
    write_tier_result(layout, q4)
    run, tiers = load_run(d)
    plan = _plan(monkeypatch, capsys, str(d), "--model", str(QWEN25_14B), "--gpu", "rtx4090", "--context", "1024",
                 "--users", "4")
    rows = _rows(plan)
    g, gt = rows["gptq"], tiers["gptq"]
    # the estimate is the run's gptq spec (W4, group 32) applied to the 14B config
    fmt = GroupWise(method="gptq", bits=4, group_size=gt.spec["group_size"], g_idx=True, dtype="bfloat16")
    est = fmt.estimate(model_shape(json.loads(QWEN25_14B.read_text()))).bytes
    assert g["weights_bytes"] == {"value": gt.memory.weight_bytes, "source": "measured",
                                  "formula": "run: memory.weight_bytes", "estimate": est}
    assert g["kv_bytes_per_token"]["source"] == "measured"
    assert g["kv_bytes_per_token"]["value"] == gt.memory.kv_bytes_per_token
    shares = [p.roofline_share for p in gt.speed.values()]
    assert g["efficiency"]["source"] == "measured" and g["efficiency"]["value"] == [min(shares), max(shares)]
    assert g["decode_expected"]["source"] == "measured"
    assert g["decode_expected"]["value"][0] == pytest.approx(min(shares) * g["decode_bound"]["value"])
    assert g["prefill_tokens_per_s"] == {"value": gt.speed["48"].prefill_tokens_per_s, "source": "measured",
                                         "estimate": None,
                                         "formula": "run: prefill at depth 48 on cpu (compute bound: does not "
                                                    "carry over to another GPU)"}
    assert rows["q4_k_m"]["users_at_slo"]["value"] == 6 and rows["q4_k_m"]["users_at_slo"]["source"] == "measured"
    assert g["users_at_slo"]["value"] is None
    # a tier that failed keeps its estimate, marked as one
    awq = rows["awq"]
    assert awq["weights_bytes"]["source"] == "estimate" and awq["fits"]["source"] == "estimate"
    assert any("status failed" in n for n in awq["notes"])
    # the table says which is which, cell by cell
    rc, out, _ = _qeval(monkeypatch, capsys, "plan", str(d), "--gpu", "rtx4090", "--context", "1024")
    line = next(x for x in out.splitlines() if x.startswith("| q4_k_m "))
    assert rc == 0 and f"{q4.memory.weight_bytes / 1e9:.2f} GB meas" in line and "6 meas" in line and " est" not in line


def test_report_capacity_section_is_the_plan_table(tmp_path):
    from qeval.report import write_report
    d = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, d)
    html = write_report(d).read_text()
    cap = html[html.index("<h2>Capacity</h2>"):html.index("<h2>Plots</h2>")]
    run, tiers = load_run(d)
    gptq = f"{tiers['gptq'].memory.weight_bytes / 1e9:.2f} GB meas"
    assert "decode bound tok/s (ctx 0 -&gt; c)" in cap and "KV budget" in cap and gptq in cap
    assert "memory 24.00 GiB (default 24 GiB (no GPU memory recorded in run.json))" in cap
    md = plan_markdown(build_plan(results=tiers, run=run, context=4096, users=8))
    assert f"| gptq | {gptq} |" in md


def test_plan_notes_cpu_rows_measured_through_emulated_bf16(tmp_path, monkeypatch, capsys):
    """A run's bf16 row measured on a CPU without AVX512_BF16 (its stored ``dtype_emulated``)
    gets a note that its measured speed and users at SLO are torch's emulated CPU path, on
    the command line (JSON and table) and in the report's capacity section; a native row, a
    llama.cpp row and the same run without the field get none. The plan is drawn on a
    machine with AVX512_BF16: the row decides."""
    from qeval.engines.ggml_cpu import CPU_KIND_ENV
    from qeval.report import write_report
    monkeypatch.setenv(CPU_KIND_ENV, "avx512-bf16")
    d = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, d)
    layout = RunLayout(d)
    t = read_tier_result(layout, "bf16")
    t.backend, t.dtype_emulated = "torch-bfloat16 (emulated on this CPU: no AVX512_BF16)", "bfloat16"
    write_tier_result(layout, t)
    note = ("run on a CPU without native BF16 instructions: torch emulated BF16, so the measured decode, "
            "roofline share, prefill and users at SLO are torch's CPU path, not BF16 as served on a GPU")
    rows = _rows(_plan(monkeypatch, capsys, str(d), "--gpu", "rtx4090", "--context", "1024"))
    assert note in rows["bf16"]["notes"]
    assert all(note not in r["notes"] for n, r in rows.items() if n != "bf16")
    rc, out, _ = _qeval(monkeypatch, capsys, "plan", str(d), "--gpu", "rtx4090", "--context", "1024")
    assert rc == 0 and note in next(x for x in out.splitlines() if x.startswith("| bf16 "))
    assert note in write_report(d).read_text().replace("&#39;", "'")
    run, tiers = load_run(FIXTURE_RUN)  # the recorded run: no row says emulated
    assert not any("emulated" in n for r in build_plan(results=tiers, run=run, context=1024).rows for n in r.notes)


# ---- bad flags: one line, exit 2 ----------------------------------------------------------------

@pytest.mark.parametrize("args, want", [
    (["--gpu", "nosuch"], "--gpu: unknown GPU 'nosuch'; known: rtx4090, rtx3090, l4, l40s, a10, a100-40gb"),
    (["--gpu-mem", "24G"], "--gpu-mem: unknown size unit 'G'"),
    (["--gpu-mem", "1" + "0" * 400 + "GiB"], "--gpu-mem: size"),
    (["--bandwidth", "fast"], "--bandwidth: not a memory size"),
    (["--bandwidth", "0GB/s"], "--bandwidth: bandwidth must be positive"),
    (["--usable", "1.5"], "--usable: must be a share of memory in (0, 1]"),
    (["--usable", "abc"], "Invalid value for '--usable'"),
    (["--users", "-1"], "--users: must be a positive number"),
    (["--context", "0"], "--context: must be a positive number"),
    (["--overhead", "-1GiB"], "--overhead: not a memory size"),
])
def test_bad_flags_are_one_line_exit_2(args, want, monkeypatch, capsys):
    rc, out, err = _qeval(monkeypatch, capsys, "plan", "--model", str(QWEN25_14B), *args)
    lines = (out + err).strip().splitlines()
    assert rc == 2 and len(lines) == 1 and want in lines[0] and "Traceback" not in err, out + err


def test_bad_inputs_name_the_file(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_hidden_layers": 2}))
    rc, _, err = _qeval(monkeypatch, capsys, "plan", "--model", str(bad))
    assert rc == 2 and f"{bad}: hidden_size: config lacks a required field" in err
    bad.write_text("[1]")
    rc, _, err = _qeval(monkeypatch, capsys, "plan", "--model", str(bad))
    assert rc == 2 and "must be a JSON object" in err
    rc, _, err = _qeval(monkeypatch, capsys, "plan")
    assert rc == 2 and "give RUN_DIR, --model or --recipe" in err


def test_unknown_gpu_in_a_subprocess():
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "plan", "--model", str(QWEN25_14B), "--gpu", "nosuch"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert "known: rtx4090" in p.stderr and "m3-ultra" in p.stderr and "Traceback" not in p.stderr
