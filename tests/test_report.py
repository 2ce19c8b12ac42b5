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


# ---- load sweep: table, plots, overload ladder, plan beside the formula --------------------

def _sweep(users_ok: int, base_tps: float, refuse_at: int | None = None) -> dict:
    """A tier's load section from synthetic request timings through the real statistics:
    latency grows with concurrency; points up to ``users_ok`` meet a 1 s / 0.1 s SLO."""
    from qeval.measure.load import LoadRun, RequestRecord, Slo, not_admitted_point, point_stats, summarize
    slo = Slo(1.0, 0.1)
    points = []
    for c in (1, 2, 4, 8):
        if refuse_at is not None and c >= refuse_at:
            points.append(not_admitted_point(c, 2, "KV cache of 8 x 272 tokens exceeds the KV budget"))
            continue
        itl = 0.05 if c <= users_ok else 0.2
        reqs = []
        for s in range(c):
            for k in range(2):
                start = k * 1.0
                times = [start + 0.3 + i * itl for i in range(8)]
                reqs.append(RequestRecord(s, 256, start, times, list(range(8))))
        run = LoadRun(c, "continuous", reqs, duration_s=16 * c / (base_tps * c ** 0.5))
        p = point_stats(run, slo)
        p["peak_bytes"] = int((0.5 + 0.01 * c) * GIB)
        points.append(p)
    out = {"depth": 256, "output_tokens": 16, "requests_per_stream": 2, "prefill_chunk": 64,
           "slo": {"ttft_p95_s": 1.0, "itl_p95_s": 0.1}, "scheduling": ["continuous"], "points": points}
    out.update(summarize(points, slo))
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "run_load"
    shutil.copytree(FIXTURE, d)
    for name, sweep in (("bf16", _sweep(1, 5.0, refuse_at=8)), ("int8", _sweep(2, 8.0)),
                        ("q4_k_m", _sweep(4, 12.0))):
        p = d / "tiers" / f"{name}.json"
        t = json.loads(p.read_text())
        t["load"] = sweep
        p.write_text(json.dumps(t))
    return d, rebuild_outputs(d)


def test_load_table_plots_and_overload_ladder(loaded):
    d, out = loaded
    md = out.table_md.read_text()
    assert "## Load: users at SLO" in md and "SLO: TTFT p95 <= 1.0 s and ITL p95 <= 0.1 s" in md
    assert re.search(r"\| q4_k_m \| continuous \| 4 \| [0-9.]+ \| [0-9.]+x \|", md)
    assert "| bf16 | - | 8 |" in md and "not admitted (16 requests): KV cache of 8" in md
    assert "| users @SLO |" in md
    rows = {r["tier"]: r for r in csv.DictReader(out.table_csv.open())}
    assert rows["q4_k_m"]["users_at_slo"] == "4" and rows["int8"]["users_at_slo"] == "2"
    assert rows["bf16"]["load_admitted_c8"] == "False" and rows["bf16"]["load_decode_tokens_per_s_c8"] == ""
    assert float(rows["int8"]["load_batching_gain_c4"]) == pytest.approx(2.0)  # sqrt(4) by construction
    assert rows["gptq"]["users_at_slo"] == ""                               # no sweep: empty, not 0
    g = json.loads(out.gate_json.read_text())
    lad = g["ladder"]
    assert lad["basis"] == "users_at_slo" and lad["load_depth"] == 256
    assert [s["tier"] for s in lad["steps"]] == ["bf16", "int8", "q4_k_m"]
    assert [s["users_gained_vs_first"] for s in lad["steps"]] == [0, 1, 3]
    html = out.report_html.read_text()
    assert "Overload ladder" in html and "Load: throughput and latency under concurrency" in html
    assert html.count("data:image/png;base64,") == 5
    assert plots.load_throughput_png(load_run(d)[1]) is not None
    assert plots.load_latency_png(load_run(d)[1], {"ttft_p95_s": 1.0, "itl_p95_s": 0.1}) is not None
    assert plots.load_latency_png(load_run(FIXTURE)[1], None) is None  # no sweep: nothing drawn


def test_plan_puts_measured_load_points_beside_the_formula(loaded):
    from qeval.report.outputs import plan_text
    d, _ = loaded
    text = plan_text(d, None, "24GiB", 4096, 8, "1GiB")
    assert "measured under load" in text
    # q4_k_m at 4 streams: measured peak 0.54 GiB = 0.58 GB; the run's bandwidth gives a bound
    assert re.search(r"\| q4_k_m \| 4 \| 272 \| [0-9.]+ GB \| 0\.58 GB \| \+[0-9]+% \| [0-9.]+ \| [0-9.]+ \| "
                     r"[0-9]+% \| yes \| 4 \|", text), text
    assert "the memory formula was" in text and "from the measured peaks on average" in text
    js = json.loads(plan_text(d, None, "24GiB", 4096, 8, "1GiB", as_json=True))
    assert {c["concurrency"] for c in js["load_checks"] if c["tier"] == "q4_k_m"} == {1, 2, 4, 8}
    plain = plan_text(FIXTURE, None, "24GiB", 4096, 8, "1GiB")  # no sweep: no such section
    assert "measured under load" not in plain
