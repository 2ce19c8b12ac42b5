"""Rows say when the CPU emulates a dtype (issue 65 item 5): a transformers tier that torch
computes in BF16 on a CPU without AVX512_BF16 / AMX-BF16 says so in its engine's backend,
its measured row (``backend``, ``dtype_emulated``) and the table's backend cell; on a CPU
with them it does not. The CPU kind is forced (``QEVAL_TEST_CPU_KIND``), so every branch
runs, with the same outcome, on any machine."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from conftest import measure_run_dir

torch = pytest.importorskip("torch")

from qeval.engines.ggml_cpu import CPU_KIND_ENV, torch_bf16_note  # noqa: E402
from qeval.engines.hf import HFEngine, emulated_label, load_hf_model  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "run_synthetic"
NOTE = "emulated on this CPU: no AVX512_BF16"
#: What a CPU kind decides for a BF16 model: emulated (no AVX512_BF16, no AMX-BF16) or native.
EMULATED = {"avx2": True, "avx512": True, "avx512-bf16": False, "amx": False, "amx-trap": False}


@pytest.fixture(scope="module")
def bf16_model(tiny_llama):
    torch.set_num_threads(1)
    return load_hf_model(str(tiny_llama), "cpu", "bfloat16")


@pytest.mark.parametrize("kind", list(EMULATED))
def test_engine_backend_says_when_this_cpu_emulates_bf16(kind, bf16_model, monkeypatch):
    monkeypatch.setenv(CPU_KIND_ENV, kind)
    eng = HFEngine(bf16_model, "cpu", backend="torch-bfloat16")
    kv8 = HFEngine(bf16_model, "cpu", backend="torch-bfloat16", kv_cache="int8")
    if EMULATED[kind]:
        assert eng.backend == f"torch-bfloat16 ({NOTE})" and eng.dtype_emulated == "bfloat16"
        assert kv8.backend == f"torch-bfloat16 ({NOTE}) + KV int8 (HQQ)" and kv8.dtype_emulated == "bfloat16"
    else:
        assert eng.backend == "torch-bfloat16" and eng.dtype_emulated is None
        assert kv8.backend == "torch-bfloat16 + KV int8 (HQQ)" and kv8.dtype_emulated is None


def test_float32_is_never_emulated_and_labels_keep_their_shape(tiny_llama, monkeypatch):
    monkeypatch.setenv(CPU_KIND_ENV, "avx2")
    e32 = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu", backend="torch-float32")
    assert e32.backend == "torch-float32" and e32.dtype_emulated is None
    # labels of the other tiers the transformers engine computes in bf16 (int8, fp8, gptq/awq)
    assert emulated_label("torchao-int8-weight-only", "bfloat16", NOTE) == \
        f"torchao-int8-weight-only (bfloat16 {NOTE})"
    assert emulated_label("torch-bfloat16 (dequantized gptq)", "bfloat16", NOTE) == \
        f"torch-bfloat16 (dequantized gptq; {NOTE})"
    assert emulated_label("torchao-float8-weight-only (weights dequantized per matmul)", "bfloat16", NOTE) == \
        f"torchao-float8-weight-only (weights dequantized per matmul; bfloat16 {NOTE})"
    assert torch_bf16_note("bfloat16", "cuda") is None  # a GPU is never this CPU's emulation


@pytest.mark.parametrize("kind", ["avx2", "avx512-bf16"])
def test_measured_row_and_table_say_what_ran(kind, tiny_llama, tmp_path, monkeypatch):
    """The measure stage of the BF16 tier on a forced CPU kind, merged into its tier result
    as a run does, then that row in a recorded run's table: the backend cell and the CSV's
    ``dtype_emulated`` say emulated on an AVX2 machine, not on one with AVX512_BF16. The
    table is rendered on the other kind of machine: it shows the row as measured."""
    from qeval.report import rebuild_outputs
    from qeval.results import RunLayout, read_tier_result, write_stage, write_tier_result
    from qeval.stages import TierRunner
    from qeval.worker import stage_measure

    monkeypatch.setenv(CPU_KIND_ENV, kind)
    recipe, layout = measure_run_dir(tmp_path, tiny_llama, "bf16", load=False)
    threads = torch.get_num_threads()
    try:
        m = stage_measure(recipe, layout.root, "bf16")
    finally:
        torch.set_num_threads(threads)
    write_stage(layout, "bf16", "measure", m)
    row = TierRunner(recipe, layout.root).finish("bf16", "ok")
    want = f"torch-bfloat16 ({NOTE})" if EMULATED[kind] else "torch-bfloat16"
    assert m["backend"] == row.backend == want
    assert row.dtype_emulated == ("bfloat16" if EMULATED[kind] else None)
    assert read_tier_result(layout, "bf16").dtype_emulated == row.dtype_emulated  # as written

    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    rl = RunLayout(d)
    t = read_tier_result(rl, "bf16")
    t.backend, t.dtype_emulated = row.backend, row.dtype_emulated
    write_tier_result(rl, t)
    monkeypatch.setenv(CPU_KIND_ENV, "avx512-bf16" if kind == "avx2" else "avx2")  # the machine that renders
    out = rebuild_outputs(d)
    md = out.table_md.read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| bf16 |"))
    assert f"| {want} |" in line and (NOTE in line) == EMULATED[kind]
    rows = {r["tier"]: r for r in csv.DictReader(out.table_csv.open())}
    assert rows["bf16"]["backend"] == want
    assert rows["bf16"]["dtype_emulated"] == ("bfloat16" if EMULATED[kind] else "")
    assert rows["q4_k_m"]["dtype_emulated"] == "" and NOTE not in rows["q4_k_m"]["backend"]  # llama.cpp: never
    assert (NOTE in out.report_html.read_text()) == EMULATED[kind]
