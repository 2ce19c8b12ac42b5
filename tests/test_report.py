"""Tables, gate.json, report.html and JUnit XML rebuilt from a recorded run of the tiny model
(tests/fixtures/run_synthetic, made by tests/make_run_fixture.py)."""
from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path

import pytest

from qeval.analysis import analyse_run, evaluate_gate
from qeval.report import (default_budget_bytes, junit_xml, rebuild_outputs, slow_path_flags,
                          write_junit, write_report, write_tables)
from qeval.report import plots
from qeval.results import RunInfo, RunLayout, TierResult, load_run, read_gate, read_tier_result, write_tier_result

FIXTURE = Path(__file__).parent / "fixtures" / "run_synthetic"  # a real tiny run: tests/make_run_fixture.py
TIERS = ["bf16", "bf16-kv8", "int8", "gptq", "awq", "q4_k_m", "q4_k_m-kv8"]
FAILED = "awq"  # made to fail at its prepare stage when the fixture was recorded
GIB = 2 ** 30


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    out = rebuild_outputs(d, junit=True)
    return d, out


@pytest.fixture(scope="module")
def analysis():
    run, tiers = load_run(FIXTURE)
    return run, analyse_run(run, tiers)


def _edit_tier(run_dir: Path, name: str, edit) -> None:
    """Change one stored tier result through its model (``edit(TierResult)``) and write it back."""
    layout = RunLayout(run_dir)
    t = read_tier_result(layout, name)
    edit(t)
    write_tier_result(layout, t)


def test_fixture_is_a_real_run():
    run, tiers = load_run(FIXTURE)
    assert list(tiers) == TIERS
    assert run.versions.get("torch") and run.cpu and run.bandwidth_bytes_per_s and run.started_at
    assert tiers[FAILED].status == "failed" and "SIGABRT" in tiers[FAILED].error
    assert all(t.status == "ok" for n, t in tiers.items() if n != FAILED)
    assert tiers["q4_k_m"].engine == "llamacpp" and tiers["gptq"].backend.startswith("gptqmodel")


def test_outputs_written(built):
    d, out = built
    for p in (out.table_md, out.table_csv, out.gate_json, out.report_html, out.junit_xml):
        assert p.is_file() and p.parent == d
    assert out.exit_code() == 1  # the failed candidate fails the gate


def test_report_html_content(built, analysis):
    d, out = built
    run, a = analysis
    html = out.report_html.read_text()
    for name in TIERS:
        assert name in html
    assert html.count("data:image/png;base64,") == 3
    assert "prepare process killed by SIGABRT" in html  # the failed tier's error
    for rule in a.gate.rules:
        assert rule in html
    for e in a.pareto.entries:
        assert escape(e.mark) in html
    assert "Fallback ladder" in html and "Capacity" in html
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org", "")


def test_report_shows_cpu_gpu_and_versions(built, analysis):
    d, out = built
    run, _ = analysis
    html = out.report_html.read_text()
    assert f"CPU {escape(run.cpu)}" in html
    assert f"GPU {escape(run.gpu or 'none')}" in html
    assert f"torch {run.versions['torch']}" in html and f"transformers {run.versions['transformers']}" in html


def test_slow_path_flags(tmp_path, analysis):
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    run, a = analysis
    deep = str(max(a.depths))
    ref = a.tiers["bf16"].speed[deep].decode_tokens_per_s

    def slow(t):
        t.speed[deep].decode_tokens_per_s = 0.4 * ref

    def fast(t):
        t.speed[deep].decode_tokens_per_s = ref

    _edit_tier(d, "q4_k_m-kv8", slow)
    for name in TIERS:
        if name not in ("bf16", "q4_k_m-kv8", FAILED):
            _edit_tier(d, name, fast)
    _, tiers = load_run(d)
    flags = slow_path_flags(tiers, "bf16", int(deep), 0.5)   # 0.4 x ref < 0.5 x ref
    assert list(flags) == ["q4_k_m-kv8"]
    assert flags["q4_k_m-kv8"].reference_tokens_per_s == ref
    assert slow_path_flags(tiers, "bf16", int(deep), 0.4) == {}  # 0.4 x ref is not below 0.4 x ref
    assert slow_path_flags(tiers, "missing", int(deep)) == {}
    html = rebuild_outputs(d).report_html.read_text()
    assert "q4_k_m-kv8: slow path at long context" in html
    assert "int8: slow path" not in html and "gptq: slow path" not in html


def test_tables(built, analysis):
    d, out = built
    run, a = analysis
    md = out.table_md.read_text()
    assert "| tier | status | weights GiB |" in md and f"peak GiB @{a.depth}" in md
    for name in TIERS:
        assert f"| {name} |" in md
    assert f"{FAILED}`: failed" in md
    rows = list(csv.DictReader(out.table_csv.open()))
    assert [r["tier"] for r in rows] == TIERS
    by = {r["tier"]: r for r in rows}
    for name in ("int8", "q4_k_m"):
        t = a.tiers[name]
        assert float(by[name][f"decode_tokens_per_s_{a.depth}"]) == t.speed[str(a.depth)].decode_tokens_per_s
        assert float(by[name][f"peak_gib_{a.depth}"]) == pytest.approx(
            t.memory.peak_bytes[str(a.depth)] / GIB, abs=1e-4)
        assert by[name]["pareto"] == a.pareto.entry(name).mark
    assert by[FAILED]["status"] == "failed" and by[FAILED][f"peak_gib_{a.depth}"] == ""


def test_gate_json(built, analysis):
    d, out = built
    run, a = analysis
    g = json.loads(out.gate_json.read_text())
    # the judged candidates fail a rule (min_pass_rate_rel, not enough evidence: fail), so the
    # gate is "fail", exit 1, though one candidate (the failed tier) could not be judged
    assert g["passed"] is False and g["exit_code"] == 1 and g["depth"] == a.depth == 48
    assert g["verdict"] == "fail" and "not judged: tier 'awq' did not finish (status failed" in g["reason"]
    verdicts = {c["tier"]: c["verdict"] for c in g["candidates"]}
    assert list(verdicts) == [n for n in TIERS if n != "bf16"] and verdicts[FAILED] == "error"
    assert verdicts == {c.tier: c.verdict for c in a.gate.candidates}
    awq = next(c for c in g["candidates"] if c["tier"] == FAILED)
    assert awq["error"].startswith("tier 'awq' did not finish (status failed: prepare process killed by SIGABRT")
    assert awq["failed_rules"] == [] and len(awq["not_judged_rules"]) == 10
    assert [r["outcome"] for r in awq["rules"]] == ["error"] + ["not judged"] * 10
    assert g["pareto"]["front"] == a.pareto.front and "bf16" in a.pareto.front
    steps = [s["tier"] for s in g["ladder"]["steps"]]
    assert steps == a.ladder.order and steps[0] == max(steps, key=lambda n: a.tiers[n].memory.peak_bytes["48"])
    # the file reads back through its model, as written
    typed = read_gate(RunLayout(d))
    assert typed == out.gate_file and typed.candidates[0].rules[0].rule == "status"
    assert [r.tier for r in typed.ladder.steps] == steps


def test_gate_json_is_validated_on_read(built, tmp_path):
    """A gate.json with a key the model does not declare is bad input naming the file and field."""
    from qeval.errors import QevalInputError
    d, out = built
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    g = json.loads((bad / "gate.json").read_text())
    g["ladder"]["stepz"] = g["ladder"].pop("steps")
    (bad / "gate.json").write_text(json.dumps(g))
    with pytest.raises(QevalInputError, match="gate.json") as e:
        read_gate(RunLayout(bad))
    assert e.value.field == "ladder.stepz"


def test_junit_from_run(built, analysis):
    d, out = built
    run, a = analysis
    root = ET.parse(out.junit_xml).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == 6 * (1 + 10)          # 6 candidates x (status + 10 set rules)
    failures = root.findall(".//testcase/failure")
    assert len(failures) == int(root.get("failures")) == sum(len(c.failed_rules) for c in a.gate.candidates) > 0
    names = {(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None}
    assert not any(cls == "qeval.gate.awq" for cls, _ in names)  # the failed tier is not a failure of the model
    # it is one <error> (on its status case) with the reason, and its 10 rules are skipped, not judged
    (err,) = root.findall(".//testcase/error")
    assert root.get("errors") == "1" and root.find("testsuite").get("errors") == "1"
    case = next(c for c in cases if c.find("error") is not None)
    assert (case.get("classname"), case.get("name")) == ("qeval.gate.awq", "status")
    assert err.get("message").startswith("tier 'awq' did not finish (status failed: prepare process killed by SIGABRT")
    assert err.get("type") == "GateCannotJudge" and "not judged: max_kld_mean" in err.text
    skipped = [c for c in cases if c.get("classname") == "qeval.gate.awq" and c.find("skipped") is not None]
    assert len(skipped) == 10 and all(c.find("skipped").get("message").startswith("not judged: tier has status failed")
                                      for c in skipped)
    assert root.get("skipped") == "10"


def test_write_junit_small(tmp_path):
    tiers = {n: TierResult.model_validate({"tier": n, "method": "bf16", **t}) for n, t in {
        "bf16": {"status": "ok"}, "a": {"status": "ok", "quality": {"fidelity": {"kld_mean": 0.2}}},
        "b": {"status": "failed", "error": "x"}}.items()}
    rep = evaluate_gate(None, tiers, {"rules": {"max_kld_mean": 0.1, "max_flip_rate": 0.1}}, 256)
    p = write_junit(rep, tmp_path / "j.xml")
    root = ET.parse(p).getroot()
    assert len(root.findall(".//testcase")) == 2 * 3
    fails = root.findall(".//failure")  # a measured KLD over the rule and the missing flips (fail closed)
    assert len(fails) == 2 and all(f.get("message") for f in fails)
    (err,) = root.findall(".//error")  # b did not finish: an error, its two rules skipped
    assert err.get("message") == "tier 'b' did not finish (status failed: x)"
    assert root.get("failures") == "2" and root.get("errors") == "1" and root.get("skipped") == "2"
    assert rep.verdict == "fail" and rep.exit_code() == 1  # a measured failure wins over the error
    assert junit_xml(rep).startswith('<?xml version="1.0" encoding="UTF-8"?>')


def test_recipe_override_changes_verdict(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    run, tiers = load_run(d)
    recipe = json.loads(json.dumps(run.recipe))
    recipe["gate"]["candidates"] = [n for n, t in tiers.items() if t.ok and n != "bf16"]
    recipe["gate"]["rules"] = {}
    out = rebuild_outputs(d, recipe)
    assert out.exit_code() == 0 and out.junit_xml is None
    assert json.loads(out.gate_json.read_text())["passed"] is True


def test_write_tables_and_report_alone(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    md, csv_path = write_tables(d)
    assert md.name == "table.md" and csv_path.name == "table.csv"
    html = write_report(d, budget_bytes=8 * GIB, users=2).read_text()
    assert "memory 8.00 GiB (given)" in html and "2 users x 48 tokens" in html and "KV budget" in html


def test_default_budget():
    assert default_budget_bytes(RunInfo(recipe={})) == (24 * GIB, "default 24 GiB (no GPU memory recorded in run.json)")
    assert default_budget_bytes(RunInfo(recipe={}, gpu_memory_bytes=80 * GIB))[0] == 80 * GIB


def test_plots_without_data():
    from qeval.analysis import pareto_front
    failed = {"a": TierResult(tier="a", method="bf16", status="failed")}
    assert plots.quality_vs_memory_png(pareto_front(failed, 256)) is None
    assert plots.decode_vs_depth_png(failed, [256]) is None
    assert plots.kld_by_bucket_png({"a": TierResult(tier="a", method="bf16", status="ok")}) is None


def test_report_needs_no_torch(tmp_path):
    d = tmp_path / "r"
    shutil.copytree(FIXTURE, d)
    # any 'import torch' now raises ImportError (a finder, not sys.modules['torch'] = None: scipy
    # reads sys.modules['torch'] to recognise tensors and would trip on a None there)
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked in this test')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from qeval.report import rebuild_outputs\n"
            f"o = rebuild_outputs({str(d)!r})\n"
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
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
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("ERROR awq"))
    assert "tier 'awq' did not finish (status failed: prepare process killed by SIGABRT" in line
    assert line.count("not judged") == 1 and re.search(r"\b10 rules not judged", line), line
    assert not any(ln.strip().startswith("FAIL awq") for ln in text.splitlines())
    assert code == 1  # the other candidates fail a rule (not enough evidence: fail)


def test_subset_run_reports_left_out_candidates_as_not_run(tmp_path):
    """A run folder made with `--tiers` (run.json tiers_run) whose left-out candidates have
    no result: the terminal, gate.json, JUnit and the report say "not run (--tiers)", the
    verdict is over the judged candidates, and the exit code follows them."""
    from qeval.report.outputs import build_outputs
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    run = json.loads((d / "run.json").read_text())
    run["recipe"]["gate"] = {**(run["recipe"].get("gate") or {}), "reference": "bf16",
                             "candidates": ["int8", "q4_k_m", "gptq"], "rules": {}}
    run["tiers_run"] = ["bf16", "q4_k_m"]
    (d / "run.json").write_text(json.dumps(run))
    for gone in ("int8", "gptq"):
        (d / "tiers" / f"{gone}.json").unlink()
    code, text = build_outputs(d, junit=d / "junit.xml")
    assert code == 0, text
    lines = text.splitlines()
    assert lines[-1] == "gate: PASS over 1 of 3 candidates (not run, --tiers: int8, gptq) (exit 0)"
    assert any(ln.split() == ["-", "int8", "--", "not", "run", "(--tiers)"] for ln in lines), text
    doc = json.loads((d / "gate.json").read_text())
    assert doc["passed"] is True and doc["judged"] == 1 and doc["not_run"] == ["int8", "gptq"]
    root = ET.parse(d / "junit.xml").getroot()
    assert root.get("failures") == "0" and root.get("skipped") == "2"
    html = (d / "report.html").read_text()
    assert "over 1 of 3 candidates" in html and "NOT RUN" in html
    # the same folder without the subset recorded: the missing candidates did not finish, so
    # the gate cannot judge them: ERROR, exit 4, not a failure of the model
    run.pop("tiers_run")
    (d / "run.json").write_text(json.dumps(run))
    code, text = build_outputs(d)
    assert code == 4 and text.splitlines()[-1] == (
        "gate: ERROR over 3 candidates: tier 'int8' has no result (tiers/int8.json missing); tier 'gptq' has no "
        "result (tiers/gptq.json missing): 2 of 3 not judged (int8, gptq), the other passes (exit 4)"), text


def test_gguf_fallbacks_are_named_in_the_table(tmp_path):
    """A "Q4_K_M" file whose tensors mostly fell back to Q5_0 says so in the notes; one
    without fallbacks says nothing."""
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    p = d / "tiers" / "q4_k_m.json"
    t = json.loads(p.read_text())
    t["quant"].update(fallback_tensors=180, fallbacks={"q4_K->q5_0": 166, "q6_K->q8_0": 14},
                      tensor_types={"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15})
    p.write_text(json.dumps(t))
    _edit_tier(d, "q4_k_m-kv8", lambda t: setattr(t.quant, "fallback_tensors", 0))  # a file without fallbacks
    md = rebuild_outputs(d).table_md.read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m |"))
    assert "180 of 211 quantized tensors fell back from the nominal type (q4_K->q5_0 ×166, q6_K->q8_0 ×14)" in row
    other = next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m-kv8 |"))
    assert "fell back" not in other


def test_the_table_names_the_cpu_variant_llama_cpp_ran(tmp_path):
    """A GGUF row whose runtime records llama.cpp's CPU variant shows it beside the backend
    (markdown and CSV); a row without one shows the backend alone."""
    import csv as _csv
    d = tmp_path / "run_synthetic"
    shutil.copytree(FIXTURE, d)
    isa = ["AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"]
    _edit_tier(d, "q4_k_m", lambda t: setattr(t, "runtime", {"libraries": ["llama_cpp 0.3.36"], "cpu_variant": "zen4",
                                                             "instruction_sets": isa}))
    out = rebuild_outputs(d)
    md = out.table_md.read_text()
    assert "| llama.cpp-cpu (zen4) |" in next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m |"))
    assert "(zen4)" not in next(ln for ln in md.splitlines() if ln.startswith("| q4_k_m-kv8 |"))
    rows = {r["tier"]: r for r in _csv.DictReader(out.table_csv.open())}
    assert rows["q4_k_m"]["cpu_variant"] == "zen4" and rows["q4_k_m"]["cpu_instruction_sets"] == " ".join(isa)
    assert rows["q4_k_m"]["backend"] == "llama.cpp-cpu" and rows["int8"]["cpu_variant"] == ""


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
    run = json.loads((d / "run.json").read_text())  # the tiny run's 5 items leave every pass-rate bound at 0:
    del run["recipe"]["gate"]["rules"]["min_pass_rate_rel"]  # judged on the other rules, tiers pass the gate
    (d / "run.json").write_text(json.dumps(run))
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


def test_html_speed_cells_are_grouped_by_depth(analysis):
    """The speed table's header groups columns by depth ("depth d tokens": peak, TTFT, tok/s,
    roofline), so each row's cells come depth by depth too."""
    from qeval.report.table import tier_table
    run, a = analysis
    tab = tier_table(a)
    n = len(tab.html_depth_headers)
    row = tab.html["speed"]["rows"][TIERS.index("int8")]
    t = a.tiers["int8"]
    for i, d in enumerate(a.depths):
        cells = row[1 + i * n: 1 + (i + 1) * n]
        assert cells[1] == f"{t.speed[str(d)].ttft_s:.3g}"
        assert cells[2] == f"{t.speed[str(d)].decode_tokens_per_s:.3g}"
    assert tab.html["long_context"]["rows"] == []  # no long_context suite in this run


def test_long_context_table_by_depth(tmp_path):
    """With long-context results: Markdown columns per document depth, the CSV fields, the
    int8-KV change against its base tier in the notes, and the report's section and plot."""
    from qeval.results import LongContext
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)

    def lc(recall, kld):
        return LongContext.model_validate({"depths": {
            str(dep): {"recall": r, "recall_ci_low": r / 2, "recall_ci_high": 1.0, "flip_rate": 0.0 if kld else None,
                       "fidelity": {"kld_mean": k, "n_tokens": 64} if k is not None else None}
            for dep, r, k in zip((1024, 4096), recall, kld or (None, None))}, "fidelity_tokens": {"lc": 64}})

    def put(name, value):
        def edit(t):
            t.quality.long_context = value
        _edit_tier(d, name, edit)
    put("bf16", lc((0.8, 0.6), None))
    put("bf16-kv8", lc((0.8, 0.4), (0.002, 0.01)))
    out = rebuild_outputs(d)
    md = out.table_md.read_text()
    assert "recall % [95% CI] @1024" in md and "KLD @4096" in md
    assert "int8 KV vs bf16 at long context: @1024 recall +0.0 pp, KLD +0.002; @4096 recall -20.0 pp, KLD +0.01" in md
    rows = {r["tier"]: r for r in csv.DictReader(out.table_csv.open())}
    assert float(rows["bf16-kv8"]["recall_4096"]) == 0.4 and float(rows["bf16-kv8"]["lc_kld_mean_4096"]) == 0.01
    assert float(rows["bf16"]["lc_kld_mean_1024"]) == 0.0  # the reference by definition
    assert rows["int8"]["recall_1024"] == ""
    html = out.report_html.read_text()
    assert "Long context: recall and fidelity by depth" in html and 'alt="Long context by depth"' in html
    assert "over the last 64 document tokens" in html


# ---- open loop: the rate table, its plots, the rate ladder and the plan's knees ---------------

def _rates(capacity_rps: float) -> dict:
    """A tier's ``load.arrivals`` from a scripted engine through the real sweep: one server
    of ``capacity_rps`` (service time 1 / capacity), constant arrivals at 0.5, 1, 2, 4 req/s,
    a queue of 2 and a 3 s timeout; the sweep stops at the first saturated rate."""
    from qeval.measure.arrivals import WaitingQueue
    from qeval.measure.load import RequestRecord, Slo
    from qeval.measure.openloop import OpenLoopRun
    from qeval.serving.open_loop import rate_sweep
    service = 1.0 / capacity_rps

    def serve(engine, prompt_for, *, arrivals, slots, max_waiting, timeout_s, output_tokens, stream, **_):
        q = WaitingQueue(arrivals, max_waiting, timeout_s)
        now, recs = 0.0, []
        while not q.done():
            took = q.admit(now, 1)
            if not took:
                now = max(now, q.next_arrival() if q.next_arrival() is not None else now)
                if q.next_arrival() is None:
                    q.admit(now + 10 * timeout_s, 0)  # what still waits has waited too long
                    break
                continue
            r = took[0]
            times = [now + service * (i + 1) / 4 for i in range(4)]
            now += service
            r.outcome, r.ended_s = "completed", now
            recs.append(RequestRecord(r.index, 16, r.arrival_s, times, [1, 2, 3, 4]))
        return OpenLoopRun(q.requests, recs, "continuous", kv_bytes_peak=4096, tally=q.tally)

    return rate_sweep(None, lambda s, k: [1], rates=[0.5, 1.0, 2.0, 4.0], sweep_points=None, process="constant",
                      seed=0, requests=8, duration_s=None, slots=1, max_waiting=2, timeout_s=3.0, output_tokens=4,
                      prefill_chunk=16, slo=Slo(1.0, 0.5), max_error_rate=0.05, saturation_share=0.25, serve=serve)


@pytest.fixture(scope="module")
def rated(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "run_rates"
    shutil.copytree(FIXTURE, d)
    run = json.loads((d / "run.json").read_text())
    del run["recipe"]["gate"]["rules"]["min_pass_rate_rel"]  # as `loaded`: judged on the other rules
    (d / "run.json").write_text(json.dumps(run))
    for name, cap in (("bf16", 1.2), ("int8", 2.5), ("q4_k_m", 5.0)):
        p = d / "tiers" / f"{name}.json"
        t = json.loads(p.read_text())
        t["load"] = {"depth": 16, "output_tokens": 4, "slo": {"ttft_p95_s": 1.0, "itl_p95_s": 0.5,
                                                              "max_error_rate": 0.05},
                     "points": [], "arrivals": _rates(cap)}
        p.write_text(json.dumps(t))
    return d, rebuild_outputs(d)


def test_rate_table_plots_ladder_and_plan_knees(rated):
    d, out = rated
    _, tiers = load_run(d)
    knees = {n: tiers[n].load.arrivals.knee.rate_rps for n in ("bf16", "int8", "q4_k_m")}
    assert knees == {"bf16": 1.0, "int8": 2.0, "q4_k_m": 4.0}
    assert tiers["bf16"].load.arrivals.stopped.startswith("saturated at 2 req/s")  # 1.2 req/s of service
    md = out.table_md.read_text()
    assert "## Load: request rates (open loop)" in md and "Open loop: constant arrivals (seed 0), 8 requests" in md
    assert re.search(r"\| bf16 \| 2 req/s \| 2 \| [0-9.]+ \|.*\| 8/0/0/0 \|.*misses, saturated \|", md), md
    assert "| bf16 | knee | 1 |" in md and "not extrapolated" in md
    assert "Rate ladder: serve bf16 up to 1 req/s; above 1 req/s step down to int8" in md
    assert "which holds to 4 req/s; above 4 req/s refuse (rate-limit here)." in md
    rows = {r["tier"]: r for r in csv.DictReader(out.table_csv.open())}
    assert rows["int8"]["load_knee_rps"] == "2.0" and rows["bf16"]["load_achieved_rps_r4"] == ""  # not run
    assert rows["gptq"]["load_knee_rps"] == ""
    html = out.report_html.read_text()
    assert "Load: request rates (open loop)" in html and "Rate ladder:" in html
    assert plots.rate_png(tiers, tiers["bf16"].load.slo) is not None
    assert plots.error_rate_png(tiers, 0.05) is not None and plots.rate_png(load_run(FIXTURE)[1], None) is None
    from qeval.report.outputs import plan_text
    text = plan_text(d, None, "24GiB", 4096, 8, "1GiB")
    assert "measured knees" in text and re.search(r"\| int8 \| 2 \| 1 \| 4 \| 0.5, 1, 2, 4 \|", text), text


EMULATED_NOTE = "emulated on this CPU: no AVX512_BF16"


def test_ladder_caption_says_when_a_rung_ran_emulated_bf16(tmp_path, monkeypatch):
    """bf16 and int8 rows measured on a CPU without AVX512_BF16 (their stored backend and
    ``dtype_emulated``, as qeval.engines.hf records them): the overload ladder's caption, the
    terminal's ladder, the load table's caption and the rate ladder say their figures are
    torch's emulated CPU path, not BF16 on a GPU, and name no llama.cpp tier; gate.json
    lists them. Rendered on a machine with AVX512_BF16: the rows decide, not the renderer.
    The same run without such rows (the ``loaded``/``rated`` runs' shape) says none of it."""
    from html import unescape
    from qeval.engines.ggml_cpu import CPU_KIND_ENV
    from qeval.report.outputs import build_outputs

    def make(name: str, emulated: bool) -> Path:
        d = tmp_path / name
        shutil.copytree(FIXTURE, d)
        run = json.loads((d / "run.json").read_text())
        del run["recipe"]["gate"]["rules"]["min_pass_rate_rel"]  # as `loaded`: judged on the other rules
        (d / "run.json").write_text(json.dumps(run))
        for tier, sweep, cap in (("bf16", _sweep(1, 5.0, refuse_at=8), 1.2), ("int8", _sweep(2, 8.0), 2.5),
                                 ("q4_k_m", _sweep(4, 12.0), 5.0)):
            p = d / "tiers" / f"{tier}.json"
            t = json.loads(p.read_text())
            t["load"] = {**sweep, "arrivals": _rates(cap)}
            if emulated and tier != "q4_k_m":
                t["backend"] = (f"torch-bfloat16 ({EMULATED_NOTE})" if tier == "bf16"
                                else f"torchao-int8-weight-only (bfloat16 {EMULATED_NOTE})")
                t["dtype_emulated"] = "bfloat16"
            p.write_text(json.dumps(t))
        return d

    sentence = ("bf16, int8: users at SLO on the run's CPU are torch's CPU path with BF16 emulated "
                "(no native BF16 instructions), not BF16 as served on a GPU.")
    monkeypatch.setenv(CPU_KIND_ENV, "avx512-bf16")
    d = make("emulated", True)
    out = rebuild_outputs(d)
    g = json.loads(out.gate_json.read_text())
    assert g["ladder"]["basis"] == "users_at_slo" and g["ladder"]["emulated"] == {"bf16": "bfloat16",
                                                                                 "int8": "bfloat16"}
    html = unescape(out.report_html.read_text())
    cap = html[html.index("<h2>Overload ladder</h2>"):]
    assert sentence in cap[:cap.index("</p>")]
    assert f"torch-bfloat16 ({EMULATED_NOTE})" in html
    md = out.table_md.read_text()
    load_cap = md[md.index("## Load: users at SLO"):].splitlines()[2]
    assert load_cap.endswith(sentence), load_cap
    assert re.search(r"Rate ladder: serve bf16 .*\(rate-limit here\)\. bf16, int8: knees on the run's CPU are "
                     r"torch's CPU path with BF16 emulated", md), md
    _, text = build_outputs(d)
    lad = text[text.index("overload ladder"):].splitlines()
    assert lad[1] == f"  note: {sentence}" and "q4_k_m" not in lad[1]

    monkeypatch.setenv(CPU_KIND_ENV, "avx2")  # a renderer without AVX512_BF16 adds nothing to native rows
    plain = make("native", False)
    out = rebuild_outputs(plain)
    assert json.loads(out.gate_json.read_text())["ladder"]["emulated"] == {}
    for text in (out.report_html.read_text(), out.table_md.read_text(), build_outputs(plain)[1]):
        assert "emulated" not in text
