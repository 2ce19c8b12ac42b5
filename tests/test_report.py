"""Tables, gate.json, report.html and JUnit XML rebuilt from the synthetic run folder."""
from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from qeval.analysis import evaluate_gate
from qeval.report import (default_budget_bytes, junit_xml, rebuild_outputs, slow_path_flags,
                          write_junit, write_report, write_tables)
from qeval.report import plots
from qeval.results import load_run

FIXTURE = Path(__file__).parent / "fixtures" / "run_synthetic"
TIERS = ["bf16", "int8", "gptq", "awq", "q4_k_m", "q4_k_m-kv8", "q2_k"]
GIB = 2 ** 30


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    out = rebuild_outputs(d, junit=True)
    return d, out


def test_outputs_written(built):
    d, out = built
    for p in (out.table_md, out.table_csv, out.gate_json, out.report_html, out.junit_xml):
        assert p.is_file() and p.parent == d
    assert out.exit_code() == 1


def test_report_html_content(built):
    d, out = built
    html = out.report_html.read_text()
    for name in TIERS:
        assert name in html
    assert html.count("data:image/png;base64,") == 3
    assert "slow path at long context" in html
    assert "q4_k_m-kv8: slow path at long context" in html
    assert "int8: slow path" not in html and "gptq: slow path" not in html
    assert "dominated by q4_k_m" in html
    assert "RuntimeError: AWQ GEMM kernel is not available on device cpu" in html  # failed tier's error
    assert "not_built" in html and "cannot quantize to Q2_K" in html
    assert "max_budget_exhaustion" in html and "max_flip_rate" in html     # failing rules named
    assert "Fallback ladder" in html and "Capacity" in html
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org", "")


def test_slow_path_flag_threshold():
    _, tiers = load_run(FIXTURE)
    flags = slow_path_flags(tiers, "bf16", 4096, 0.5)     # 4.1 < 0.5 * 8.9 = 4.45
    assert list(flags) == ["q4_k_m-kv8"]
    assert flags["q4_k_m-kv8"].reference_tokens_per_s == 8.9
    assert slow_path_flags(tiers, "bf16", 4096, 0.4) == {}  # 4.1 >= 3.56
    assert slow_path_flags(tiers, "missing", 4096) == {}


def test_tables(built):
    d, out = built
    md = out.table_md.read_text()
    assert "| tier | status | weights GiB |" in md and "peak GiB @1024" in md
    for name in TIERS:
        assert f"| {name} |" in md
    assert "dominated by q4_k_m" in md and "awq`: failed" in md
    rows = list(csv.DictReader(out.table_csv.open()))
    assert [r["tier"] for r in rows] == TIERS
    by = {r["tier"]: r for r in rows}
    assert float(by["int8"]["decode_tokens_per_s_1024"]) == 16.0
    assert float(by["q4_k_m"]["peak_gib_1024"]) == pytest.approx(1.15, abs=1e-3)
    assert by["awq"]["status"] == "failed" and by["awq"]["peak_gib_1024"] == ""
    assert by["q4_k_m-kv8"]["slow_path"] == "True" and by["gptq"]["pareto"] == "dominated by q4_k_m"


def test_gate_json(built):
    d, out = built
    g = json.loads(out.gate_json.read_text())
    assert g["passed"] is False and g["exit_code"] == 1 and g["depth"] == 1024
    verdicts = {c["tier"]: c["verdict"] for c in g["candidates"]}
    assert verdicts == {"int8": "pass", "gptq": "fail", "awq": "fail", "q4_k_m": "pass",
                        "q4_k_m-kv8": "fail", "q2_k": "fail"}
    assert g["pareto"]["front"] == ["bf16", "int8", "q4_k_m", "q4_k_m-kv8"]
    assert [s["tier"] for s in g["ladder"]["steps"]] == ["bf16", "int8", "q4_k_m"]


def test_junit_from_run(built):
    d, out = built
    root = ET.parse(out.junit_xml).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == 6 * (1 + 10)          # 6 candidates x (status + 10 set rules)
    failures = root.findall(".//testcase/failure")
    assert len(failures) == int(root.get("failures")) == 2 + 1 + 11 + 11
    names = {(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None}
    assert ("qeval.gate.gptq", "max_flip_rate") in names
    assert ("qeval.gate.q4_k_m-kv8", "max_budget_exhaustion") in names


def test_write_junit_small(tmp_path):
    tiers = {"bf16": {"status": "ok"}, "a": {"status": "ok", "quality": {"fidelity": {"kld_mean": 0.2}}},
             "b": {"status": "failed", "error": "x"}}
    rep = evaluate_gate(None, tiers, {"rules": {"max_kld_mean": 0.1, "max_flip_rate": 0.1}}, 256)
    p = write_junit(rep, tmp_path / "j.xml")
    root = ET.parse(p).getroot()
    assert len(root.findall(".//testcase")) == 2 * 3
    fails = root.findall(".//failure")
    assert len(fails) == 2 + 3 and all(f.get("message") for f in fails)
    assert junit_xml(rep).startswith('<?xml version="1.0" encoding="UTF-8"?>')


def test_recipe_override_changes_verdict(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    run, _ = load_run(d)
    recipe = json.loads(json.dumps(run["recipe"]))
    recipe["gate"]["candidates"] = ["int8", "q4_k_m"]
    out = rebuild_outputs(d, recipe)
    assert out.exit_code() == 0 and out.junit_xml is None
    assert json.loads(out.gate_json.read_text())["passed"] is True


def test_write_tables_and_report_alone(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    md, csv_path = write_tables(d)
    assert md.name == "table.md" and csv_path.name == "table.csv"
    html = write_report(d, budget_bytes=8 * GIB, users=2).read_text()
    assert "memory 8.00 GiB (given)" in html and "2 users x 4096 tokens" in html and "KV budget" in html


def test_default_budget():
    assert default_budget_bytes({}) == (24 * GIB, "default 24 GiB (no GPU memory recorded in run.json)")
    assert default_budget_bytes({"gpu": {"total_memory_bytes": 80 * GIB}})[0] == 80 * GIB


def test_plots_without_data():
    from qeval.analysis import pareto_front
    assert plots.quality_vs_memory_png(pareto_front({"a": {"status": "failed"}}, 256)) is None
    assert plots.decode_vs_depth_png({"a": {"status": "failed"}}, [256]) is None
    assert plots.kld_by_bucket_png({"a": {"status": "ok"}}) is None


def test_report_needs_no_torch(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    code = ("import sys; sys.modules['torch'] = None\n"   # any 'import torch' now raises
            "from qeval.report import rebuild_outputs\n"
            f"o = rebuild_outputs({str(d)!r})\n"
            "assert 'transformers' not in sys.modules\n"
            "print(o.exit_code())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1"


def test_not_a_run_folder(tmp_path):
    from qeval.errors import QevalInputError
    with pytest.raises(QevalInputError, match="not a qeval run folder"):
        write_report(tmp_path)


def test_terminal_gate_lines_name_a_failed_tier_once(tmp_path):
    """A failed tier's gate line gives its error once and counts the unjudged rules,
    instead of one "not judged" per rule."""
    from qeval.report.outputs import build_outputs
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    code, text = build_outputs(d)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("FAIL awq"))
    assert "AWQ GEMM kernel is not available" in line
    assert line.count("not judged") == 1 and re.search(r"\d+ rules? not judged", line), line
    assert code == 1


def test_gguf_fallbacks_are_named_in_the_table(tmp_path):
    """A "Q4_K_M" file whose tensors mostly fell back to Q5_0 says so in the notes."""
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    p = d / "tiers" / "q4_k_m.json"
    t = json.loads(p.read_text())
    t["quant"].update(fallback_tensors=180, fallbacks={"q4_K->q5_0": 166, "q6_K->q8_0": 14},
                      tensor_types={"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15})
    p.write_text(json.dumps(t))
    md = rebuild_outputs(d).table_md.read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m |"))
    assert "180 of 211 quantized tensors fell back from the nominal type (q4_K->q5_0 ×166, q6_K->q8_0 ×14)" in row
    other = next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m-kv8 |"))
    assert "fell back" not in other
