"""A failed stage says why: the exception type and message, the library frame and failed
condition of an assertion, then the last lines of its log, in the tier's row, the terminal
and `qeval gate`; and AWQ's output-feature constraints found before quantizing."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qeval.errors import QevalInputError
from qeval.results import RunLayout, read_tier_result, write_tier_result

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "run_synthetic"


# ---- what the child records ----------------------------------------------------------------

def _fake_library(tmp_path: Path, monkeypatch) -> object:
    """A module installed like a library (under site-packages) with a multi-line assertion."""
    root = tmp_path / "lib" / "python3" / "site-packages"
    (root / "fakelib").mkdir(parents=True)
    (root / "fakelib" / "__init__.py").write_text("")
    (root / "fakelib" / "clip.py").write_text(textwrap.dedent("""\
        def best_clip(rows, batch):
            n = rows * 2
            assert (n %
                    batch == 0)
            return n


        def wrapped(rows):
            try:
                best_clip(rows, 64)
            except AssertionError as e:
                raise RuntimeError("clip search failed") from e
        """))
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("fakelib.clip", None)
    return importlib.import_module("fakelib.clip")


def test_assertion_in_a_library_names_its_frame_and_failed_condition(tmp_path, monkeypatch):
    from qeval.failures import describe_exception
    lib = _fake_library(tmp_path, monkeypatch)
    with pytest.raises(AssertionError) as e:
        lib.best_clip(16, 64)
    info = describe_exception(e.value)
    assert info["exception"] == "AssertionError" and info["where"] == "fakelib/clip.py:3"
    assert info["condition"] == "assert (n % batch == 0)"  # both lines of the statement
    assert info["error"] == "AssertionError (at fakelib/clip.py:3: assert (n % batch == 0))"
    with pytest.raises(RuntimeError) as e:
        lib.wrapped(16)
    info = describe_exception(e.value)
    assert info["error"].startswith("RuntimeError: clip search failed (at fakelib/clip.py:12); caused by "
                                    "AssertionError (at fakelib/clip.py:3: assert (n % batch == 0))"), info["error"]
    assert "\n" not in info["error"]


def test_worker_records_the_reason_of_a_library_assertion(tmp_path, monkeypatch):
    from qeval import worker
    from qeval.recipe import parse_recipe
    from qeval.run import Runner
    lib = _fake_library(tmp_path, monkeypatch)
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}, {name: t, method: bf16}]\n", tmp_path / "r.yaml")
    run_dir = tmp_path / "run"
    Runner(r, run_dir).write_run_json()
    monkeypatch.setitem(worker.STAGES, "prepare", lambda recipe, rd, tier: lib.best_clip(3, 64))
    assert worker.main(["prepare", str(run_dir), "t"]) == 1
    err = json.loads(RunLayout(run_dir).stage("t", "prepare", error=True).read_text())
    assert err["error"] == "AssertionError (at fakelib/clip.py:3: assert (n % batch == 0))"
    assert err["type"] == "exception" and "Traceback" in err["traceback"]


def test_reason_from_a_log_uses_the_last_attempt_only(tmp_path):
    from qeval.failures import reason_from_log
    log = tmp_path / "awq.prepare.log"
    log.write_text(
        "--- 2026-01-01T00:00:00 python -m qeval.worker prepare run awq\n"
        "Traceback (most recent call last):\n  File \"/x/y.py\", line 1, in f\n    g()\nValueError: old\n"
        "--- 2026-01-01T01:00:00 python -m qeval.worker prepare run awq\n"
        "Quantizing layer 0 of 1 50.0%Traceback (most recent call last):\n"
        "  File \"/v/lib/python3.11/site-packages/gptqmodel/utils/threadx.py\", line 503, in _run\n"
        "    result = fn(*args, **kwargs)\n"
        "  File \"/v/lib/python3.11/site-packages/gptqmodel/looper/awq_processor.py\", line 1686, in clip\n"
        "    assert org_w_shape[0] % oc_batch_size == 0\n"
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "AssertionError\n")
    assert reason_from_log(log) == ("AssertionError (at gptqmodel/looper/awq_processor.py:1686: "
                                    "assert org_w_shape[0] % oc_batch_size == 0)")
    log.write_text("--- 2026 cmd\nno traceback here\n")
    assert reason_from_log(log) is None


def test_terminal_text_is_the_reason_then_the_log_tail():
    from qeval.failures import failure_text
    text = failure_text("ValueError: bad (at x.py:1)\nsecond line", "\n".join(f"line {i}" for i in range(20)))
    lines = text.splitlines()
    assert lines[0] == "ValueError: bad (at x.py:1)"
    assert [ln.strip() for ln in lines[1:]] == [f"| line {i}" for i in range(12, 20)]


def test_gate_and_table_give_the_first_line_and_the_log_tail(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    p = d / "tiers" / "awq.json"
    t = json.loads(p.read_text())
    t.update(error="AssertionError (at gptqmodel/looper/awq_processor.py:1686: assert a % b == 0)\nmore detail",
             log_tail="loading\nquantizing layer 0\nTraceback (most recent call last):\nAssertionError")
    p.write_text(json.dumps(t))
    out = subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(d)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1  # the fixture's other candidates fail a rule (not enough evidence: fail)
    # the crashed tier is not judged: ERROR with the reason's first line, never FAIL
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("ERROR awq"))
    assert ("did not finish (status failed: AssertionError (at gptqmodel/looper/awq_processor.py:1686: "
            "assert a % b == 0) (+1 more lines))") in line
    assert "more detail" not in out.stdout.split("gate (reference")[1]
    md = (d / "table.md").read_text()
    assert "  quantizing layer 0\n" in md and "  AssertionError\n" in md  # the log's last lines


def _gate_cli(d: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(d), *args], capture_output=True,
                          text=True, timeout=300)


def test_a_reference_that_did_not_finish_is_exit_4_not_a_failed_model(tmp_path):
    """`qeval gate` on a run whose reference tier failed: every candidate is ERROR with the
    reason, gate.json says "error", JUnit has one <error> per candidate and no <failure>,
    the report shows ERROR, and the exit code is 4 (EXIT_GATE_ERROR), not 1."""
    from qeval.errors import EXIT_GATE_ERROR
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    layout = RunLayout(d)
    ref = read_tier_result(layout, "bf16")
    ref.status, ref.error = "failed", "RuntimeError: test fault QEVAL_TEST_CRASH at bf16:measure:mid\nTraceback ..."
    write_tier_result(layout, ref)
    out = _gate_cli(d, "--junit", str(tmp_path / "j.xml"))
    assert out.returncode == EXIT_GATE_ERROR == 4, out.stdout[-3000:] + out.stderr[-2000:]
    why = ("the reference tier 'bf16' did not finish (status failed: RuntimeError: test fault QEVAL_TEST_CRASH "
           "at bf16:measure:mid (+1 more lines))")
    lines = out.stdout.splitlines()
    assert lines[-1] == f"gate: ERROR over 6 candidates: {why}: nothing was judged (exit 4)", lines[-1]
    gate_lines = out.stdout.split("gate (reference")[1].splitlines()
    assert not any(ln.strip().startswith(("FAIL", "PASS")) for ln in gate_lines), gate_lines
    cand = [ln for ln in gate_lines if ln.strip().startswith("ERROR ")]
    assert len(cand) == 6 and all(why in ln and "10 rules not judged" in ln for ln in cand), cand
    g = json.loads((d / "gate.json").read_text())
    assert g["verdict"] == "error" and g["exit_code"] == 4 and g["passed"] is False and g["reason"] == why
    assert {c["verdict"] for c in g["candidates"]} == {"error"} and all(c["failed_rules"] == [] for c in g["candidates"])
    assert g["pareto"]["front"] == [] and g["ladder"]["steps"] == []  # nothing unjudged is recommended
    import xml.etree.ElementTree as ET
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert root.get("failures") == "0" and root.get("errors") == "6"
    assert root.findall(".//failure") == [] and len(root.findall(".//error")) == 6
    assert all(e.get("message").endswith(why) for e in root.findall(".//error"))
    html = (d / "report.html").read_text()
    assert '<span class="badge error">ERROR</span>' in html and "exit code 4" in html
    # the report command rebuilds the same outputs and exits 0 whatever the gate says
    rep = subprocess.run([sys.executable, "-m", "qeval.cli", "report", str(d)], capture_output=True, text=True,
                         timeout=300)
    assert rep.returncode == 0 and rep.stdout.splitlines()[-1].startswith("gate: ERROR"), rep.stdout[-2000:]


def test_one_candidate_that_did_not_finish_is_exit_4_when_the_rest_pass(tmp_path):
    """A failed candidate is ERROR alone, the others are judged (and pass): exit 4; with a
    candidate that fails a rule beside it: exit 1 (damage measured wins)."""
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    run = json.loads((d / "run.json").read_text())
    run["recipe"]["gate"]["rules"] = {"max_kld_mean": 5.0}
    (d / "run.json").write_text(json.dumps(run))
    out = _gate_cli(d)
    assert out.returncode == 4, out.stdout[-3000:]
    verdicts = {c["tier"]: c["verdict"] for c in json.loads((d / "gate.json").read_text())["candidates"]}
    assert verdicts == {"bf16-kv8": "pass", "int8": "pass", "gptq": "pass", "awq": "error", "q4_k_m": "pass",
                        "q4_k_m-kv8": "pass"}
    assert out.stdout.splitlines()[-1] == (
        "gate: ERROR over 6 candidates: tier 'awq' did not finish (status failed: prepare process killed by "
        "SIGABRT): 1 of 6 not judged (awq), the others pass (exit 4)")
    run["recipe"]["gate"]["rules"] = {"max_kld_mean": 5.0, "min_decode_tokens_per_s": 1e9}  # every ok tier fails
    (d / "run.json").write_text(json.dumps(run))
    out = _gate_cli(d)
    assert out.returncode == 1, out.stdout[-3000:]
    assert out.stdout.splitlines()[-1] == (
        "gate: FAIL over 6 candidates; not judged: tier 'awq' did not finish (status failed: prepare process "
        "killed by SIGABRT) (exit 1)")
    verdicts = {c["tier"]: c["verdict"] for c in json.loads((d / "gate.json").read_text())["candidates"]}
    assert verdicts["awq"] == "error" and {v for t, v in verdicts.items() if t != "awq"} == {"fail"}


# ---- AWQ's output features -------------------------------------------------------------

def test_awq_constants_match_the_installed_gptqmodel_source():
    """The constraints qeval checks are the ones in gptqmodel's source (read, not imported)."""
    import importlib.util
    spec = importlib.util.find_spec("gptqmodel")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gptqmodel not installed")
    from qeval.tiers.gptq import AWQ_CLIP_OUT_MULTIPLE, AWQ_CLIP_SKIPPED, AWQ_KERNEL_OUT_MULTIPLE
    root = Path(list(spec.submodule_search_locations)[0])
    proc = (root / "looper" / "awq_processor.py").read_text()
    m = re.search(r"oc_batch_size = (\d+) if org_w_shape\[0\] % \1 == 0 else (\d+)", proc)
    assert m and int(m.group(2)) == AWQ_CLIP_OUT_MULTIPLE and int(m.group(1)) % AWQ_CLIP_OUT_MULTIPLE == 0
    assert "assert org_w_shape[0] % oc_batch_size == 0" in proc
    m = re.search(r"avoid_clipping = (\[.*?\])", proc)
    assert m and tuple(eval(m.group(1))) == AWQ_CLIP_SKIPPED  # noqa: S307 - a literal list from the source
    torch_awq = (root / "nn_modules" / "qlinear" / "torch_awq.py").read_text()
    assert f"SUPPORTS_OUT_FEATURES_DIVISIBLE_BY = [{AWQ_KERNEL_OUT_MULTIPLE}]" in torch_awq


def test_awq_check_refuses_output_features_the_clip_search_cannot_batch(tiny_llama):
    """The tiny llama's v_proj has 32 output features: AWQ's clip search asserts a multiple
    of 64 (q_proj and k_proj are not clipped); GPTQ takes the same model."""
    from qeval.tiers import get_method
    from qeval.tiers.base import TierContext
    from qeval.tiers.gptq import AwqTier, GptqTier
    ctx = TierContext(source_path=str(tiny_llama), source_sha256="0" * 64, device="cpu")
    with pytest.raises(QevalInputError) as e:
        get_method("awq").check(AwqTier(name="a", method="awq", group_size=64), ctx)
    msg = str(e.value)
    assert e.value.field == "tiers.a.method"
    assert "layer model.layers.0.self_attn.v_proj (and 1 more layer) has 32" in msg
    assert "multiples of 64" in msg and "\n" not in msg
    assert get_method("gptq").check(GptqTier(name="g", method="gptq", group_size=64), ctx) == {"group_size": 64}


def test_awq_out_feature_rules():
    from qeval.tiers.gptq import awq_clipped, check_awq_out_features
    assert not awq_clipped("model.layers.3.self_attn.q_proj") and not awq_clipped("model.layers.3.self_attn.k_proj")
    assert awq_clipped("model.layers.3.self_attn.v_proj") and awq_clipped("model.layers.3.mlp.down_proj")
    check_awq_out_features({"model.layers.0.self_attn.k_proj": (64, 40), "model.layers.0.mlp.up_proj": (64, 192)},
                           "f")  # k_proj is not clipped: 40 only needs the kernel's multiple of 8
    with pytest.raises(QevalInputError, match=r"GEMM packing .* multiple of 8; layer model.layers.0.self_attn.k_proj "
                                              r"has 36"):
        check_awq_out_features({"model.layers.0.self_attn.k_proj": (64, 36)}, "f")


def test_validate_names_the_awq_tier_line(tiny_llama, tmp_path):
    from conftest import write_recipe
    r = write_recipe(tmp_path / "a.yaml", tiny_llama, suites=False,
                     tiers="  - {name: bf16, method: bf16}\n  - {name: awq, method: awq, group_size: 64}\n")
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(r)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"a\.yaml:7: tiers\[1\]\.method: AWQ's clip search", lines[0]), p.stderr


def _awq_run(tiny_llama, tmp_path, monkeypatch, runner_cls=None):
    """Run only the awq tier of a tiny recipe through the Runner (no validate first, as when
    the checkpoint is a hub id validate cannot read); returns (tier result, terminal events)."""
    from conftest import write_recipe
    from qeval.recipe import load_recipe
    from qeval.run import Runner
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    rec = write_recipe(tmp_path / "a.yaml", tiny_llama, suites=False,
                       tiers="  - {name: bf16, method: bf16}\n  - {name: awq, method: awq, group_size: 64}\n",
                       extra="calibration: {path: builtin:calibration, samples: 4, seq_len: 32}\n"
                             "gate: {reference: bf16}")
    events = []
    runner = (runner_cls or Runner)(load_recipe(rec), tmp_path / "run", ["awq"],
                                    on_event=lambda t, s, m: events.append((t, s, m)))
    res = runner.run()["awq"]
    assert res == read_tier_result(RunLayout(tmp_path / "run"), "awq")
    return res, events


@pytest.mark.slow
def test_awq_refused_before_quantizing_says_why_in_the_row(tiny_llama, tmp_path, monkeypatch):
    res, events = _awq_run(tiny_llama, tmp_path, monkeypatch)
    assert res.status == "failed"
    assert "v_proj" in res.error and "multiples of 64" in res.error and "exit" not in res.error
    assert "quantizing" not in (res.log_tail or "")  # refused before any work
    failed = [m for t, s, m in events if s == "failed"]
    assert failed and failed[0].splitlines()[0] == res.error


class _NoAwqPrecheck:
    """Stage processes with qeval's AWQ output-feature check switched off, so gptqmodel's
    own assertion fires (in a worker thread that then calls os._exit(1))."""

    def worker_command(self, stage, tier):
        code = ("import sys, qeval.tiers.gptq as g; g.check_awq_out_features = lambda *a, **k: None; "
                "from qeval.worker import main; sys.exit(main(sys.argv[1:]))")
        return [sys.executable, "-c", code, stage, str(self.run_dir), tier]


@pytest.mark.slow
def test_library_assertion_in_awq_shows_the_failed_condition_in_the_row(tiny_llama, tmp_path, monkeypatch):
    from qeval.run import Runner
    res, events = _awq_run(tiny_llama, tmp_path, monkeypatch, type("R", (_NoAwqPrecheck, Runner), {}))
    assert res.status == "failed"
    err = res.error
    assert re.match(r"AssertionError \(at gptqmodel/looper/awq_processor\.py:\d+: "
                    r"assert org_w_shape\[0\] % oc_batch_size == 0\)", err), err
    assert "prepare process exited with code 1" in err  # how the process ended, after the reason
    failed = next(m for t, s, m in events if s == "failed").splitlines()
    assert failed[0] == err and any("AssertionError" in ln for ln in failed[1:])  # then the log's last lines


def test_a_failed_run_wide_stage_prints_why_and_exits_3(tiny_llama, tmp_path, monkeypatch):
    """The source stage failing (not on bad input) ends the run with its reason and log
    lines on the terminal, exit 3 (internal), not a traceback or the gate's exit 1."""
    from typer.testing import CliRunner
    from conftest import write_recipe
    from qeval.cli import app
    from qeval.run import Runner
    code = "import sys; print('converter said: no space left'); sys.exit(4)"
    monkeypatch.setattr(Runner, "worker_command", lambda self, stage, tier: [sys.executable, "-c", code])
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    rec = write_recipe(tmp_path / "r.yaml", tiny_llama, suites=False, tiers="  - {name: bf16, method: bf16}\n",
                       extra="gate: {reference: bf16}")
    res = CliRunner().invoke(app, ["run", str(rec), "--out", str(tmp_path / "res")])
    assert res.exit_code == 3, res.output
    out = res.stderr if hasattr(res, "stderr") else res.output
    assert "error: stage source failed: source process exited with code 4" in out
    assert "| converter said: no space left" in out and "Traceback" not in out
