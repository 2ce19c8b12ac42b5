"""Issue 64, items 1 and 2: the sources a user has (a ``.gguf`` file as ``model.source``,
``gguf_package: package:function``) and the prompt format (``model.chat_template``: a Jinja
file or ``none`` for lm-eval's plain text; a tokenizer without a template refused at
validate, exit 2, naming both choices)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import REPO, run_dir_of, tiny_gguf_module, write_recipe
from qeval.cli import app
from qeval.errors import QevalInputError
from qeval.measure.prompt_format import load_tokenizer, plain_text, prompt_format, render_chat
from qeval.recipe import ModelSpec

CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "My order number is 5521."},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "Option B costs 250 dollars."},
                {"role": "assistant", "content": "Understood."},
                {"role": "user", "content": "Remind me of my order number."}]
#: The documented plain-text format (docs/design.md, "Prompt format") of CONVERSATION.
DOCUMENTED = ("You answer briefly.My order number is 5521. Noted.\n\n"
              "Option B costs 250 dollars. Understood.\n\nRemind me of my order number.")


def build_tiny_llama_without_template(folder: Path, seed: int = 0) -> Path:
    """conftest's ``build_tiny_llama`` without ``tok.chat_template``: a tiny random llama
    whose tokenizer has no chat template (a base model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import tiny_tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    tok.chat_template = None  # a base model's tokenizer
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert not (folder / "chat_template.jinja").exists()
    assert not json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    return folder


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return build_tiny_llama_without_template(tmp_path_factory.mktemp("base") / "tiny-base")


def _recipe(tmp_path: Path, model: Path, model_extra: str = "", name: str = "r.yaml") -> Path:
    r = write_recipe(tmp_path / name, model, tiers="  - {name: bf16, method: bf16}", load=False)
    if model_extra:
        r.write_text(r.read_text().replace(f"model: {{source: {model}}}", f"model: {{source: {model}, {model_extra}}}"))
    return r


def _one_line_exit_2(args: list[str], *needles: str) -> str:
    res = CliRunner().invoke(app, args)
    err = (res.stderr if hasattr(res, "stderr") else res.output).strip()
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


# ---- the plain-text format ----------------------------------------------------------------------

def test_plain_text_is_the_documented_format():
    assert plain_text(CONVERSATION) == DOCUMENTED
    assert plain_text([{"role": "user", "content": "Hi."}]) == "Hi."
    design = (REPO / "docs" / "design.md").read_text()
    assert "S + U1 + \" \" + A1 + \"\\n\\n\" + U2" in design  # the format, written down


def test_plain_text_is_lm_evals_rendering():
    """lm-eval's own building blocks (ConfigurableTask.fewshot_context without a chat
    template: the system message, build_qa_turn per answered turn, the last question, joined
    by Message.to_text) give the same text."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.api.utils import Message, maybe_delimit

    msgs = [Message("system", maybe_delimit(CONVERSATION[0]["content"], "", "\n\n"))]
    turns = CONVERSATION[1:]
    for u, a in zip(turns[0:-1:2], turns[1:-1:2]):
        msgs += ConfigurableTask.build_qa_turn(None, q=u["content"], a=a["content"], tgt_delim=" ",
                                               few_delim="\n\n")
    msgs += ConfigurableTask.build_qa_turn(None, q=turns[-1]["content"], tgt_delim=" ", few_delim="")
    assert "".join(m.to_text() for m in msgs) == plain_text(CONVERSATION)


def test_render_chat_plain_and_continuation(base_model):
    from qeval.measure.quality import continuation_ids, prompt_ids
    tok = load_tokenizer(base_model, ModelSpec(source=str(base_model), chat_template="none"))
    assert render_chat(tok, CONVERSATION) == DOCUMENTED  # this tokenizer adds no BOS by default
    ids = prompt_ids(tok, "You answer briefly.", [("My order number is 5521.", "Noted.")], "Option B costs 250 dollars.")
    assert tok.decode(ids) == "You answer briefly.My order number is 5521. Noted.\n\nOption B costs 250 dollars."
    cont = continuation_ids(tok, None, "Which office?", [5, 6], False, [])
    assert tok.decode(cont) == "\n\nWhich office?"
    with pytest.raises(QevalInputError, match="model.chat_template"):  # no format set, no template
        render_chat(load_tokenizer(base_model, ModelSpec(source=str(base_model))), CONVERSATION)


def test_plain_text_puts_bos_where_the_tokenizer_adds_one(base_model):
    from tokenizers import processors
    tok = load_tokenizer(base_model, ModelSpec(source=str(base_model), chat_template="none"))
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                 special_tokens=[("<|endoftext|>", bos)])
    text = render_chat(tok, CONVERSATION[:2])
    assert text == "<|endoftext|>" + plain_text(CONVERSATION[:2])
    ids = render_chat(tok, CONVERSATION[:2], tokenize=True)
    assert ids[0] == bos and ids.count(bos) == 1


# ---- validate: a tokenizer without a template -------------------------------------------------

def test_validate_refuses_a_tokenizer_without_template(base_model, tmp_path, qeval_cache):
    r = _recipe(tmp_path, base_model)
    err = _one_line_exit_2(["validate", str(r)], "model.chat_template:", "model.chat_template: <file>",
                           "model.chat_template: none", "has no chat template")
    assert f"{r}:2:" in err
    _one_line_exit_2(["run", str(r), "--out", str(tmp_path / "out")], "model.chat_template: none")
    assert not list((tmp_path / "out").glob("*/*/stages/_run.reference*"))  # refused before any reference
    # without suites nothing is rendered: no refusal
    r2 = write_recipe(tmp_path / "nosuites.yaml", base_model, tiers="  - {name: bf16, method: bf16}",
                      suites=False, load=False)
    assert CliRunner().invoke(app, ["validate", str(r2)]).exit_code == 0


def test_chat_template_file_is_used(base_model, tmp_path, qeval_cache):
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "t.jinja").write_text(
        "{% for m in messages %}[[{{ m['role'] }}]]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[[assistant]]{% endif %}")
    r = _recipe(tmp_path, base_model, "chat_template: tpl/t.jinja")
    res = CliRunner().invoke(app, ["validate", str(r)])
    assert res.exit_code == 0, res.output
    spec = ModelSpec(source=str(base_model), chat_template="tpl/t.jinja")
    assert prompt_format(spec) == "file:t.jinja"
    tok = load_tokenizer(base_model, spec, base=tmp_path)
    from qeval.measure.quality import prompt_ids
    assert tok.decode(prompt_ids(tok, "S.", [], "Hi.")) == "[[system]]S.[[user]]Hi.[[assistant]]"
    (tmp_path / "tpl" / "t.jinja").write_text("{% for m in messages %}{{ m.content }")
    _one_line_exit_2(["validate", str(r)], "model.chat_template:", "is not a Jinja template")
    (tmp_path / "tpl" / "t.jinja").unlink()
    _one_line_exit_2(["validate", str(r)], "model.chat_template:", "does not exist")
    assert prompt_format(ModelSpec(source="x/y")) == "tokenizer"
    assert prompt_format(ModelSpec(source="x/y", chat_template="None")) == "plain"


def test_run_with_plain_prompts(base_model, tmp_path, qeval_cache):
    """A real short run (one bf16 tier, load off) on the template-less model with
    ``chat_template: none``: the reference's prompts are the plain text, run.json says so."""
    r = _recipe(tmp_path, base_model, "chat_template: none")
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(r), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "QEVAL_CACHE": str(qeval_cache)})
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]  # 1: a gate with no candidate
    run = run_dir_of(out)
    info = json.loads((run / "run.json").read_text())
    assert info["prompt_format"] == "plain"
    assert json.loads((run / "tiers" / "bf16.json").read_text())["status"] == "ok"
    said = "prompts: plain text (model.chat_template: none, as lm-evaluation-harness prompts base models)"
    import html
    assert said in (run / "table.md").read_text() and html.escape(said) in (run / "report.html").read_text()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(base_model))
    segs = json.loads((run / "reference" / "segments.json").read_text())
    segs = segs["segments"] if isinstance(segs, dict) else segs
    items = {json.loads(l)["id"]: json.loads(l) for l in (REPO / "tests/data/suite_multi.jsonl").read_text().splitlines()}
    mt = [s for s in segs if s["suite"] == "mt" and s["item"].endswith(next(iter(items)))]
    first = items[next(iter(items))]
    assert tok.decode(mt[0]["prompt_ids"]) == first["turns"][0]["user"]
    assert mt[1]["prompt_ids"] == (mt[0]["prompt_ids"] + mt[0]["answer_ids"]
                                   + tok("\n\n" + first["turns"][1]["user"], add_special_tokens=False)["input_ids"])


# ---- GGUF sources ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_gguf_module(tmp_path_factory, "pf-gguf")


def test_gguf_file_source_and_package_function(tiny, tmp_path, monkeypatch):
    """``source: ./x.gguf`` (relative to the recipe) expands once and is cached by the file's
    SHA-256; ``gguf_package: pkg:function`` returning the same file reuses that expansion."""
    from qeval.source import resolve_source
    shutil.copy(tiny["f16"], tmp_path / "m.gguf")
    r = tmp_path / "r.yaml"
    r.write_text((REPO / "tests" / "bad_recipes" / "gguf-source-missing.yaml").read_text()
                 .replace("./no-such-model.gguf", "./m.gguf"))
    res = CliRunner().invoke(app, ["validate", str(r)])
    assert res.exit_code == 0, res.output
    a = resolve_source(ModelSpec(source="./m.gguf"), base=tmp_path)
    assert a.converted and (Path(a.path) / "config.json").is_file() and a.gguf == str((tmp_path / "m.gguf").resolve())
    b = resolve_source(ModelSpec(source="./m.gguf"), base=tmp_path)
    assert not b.converted and b.path == a.path and b.sha256 == a.sha256
    pkg = tmp_path / "site" / "mygguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"def path():\n    return {str(tmp_path / 'm.gguf')!r}\n"
                                     "def boom():\n    raise RuntimeError('no file today')\n"
                                     "def nothing():\n    return None\n"
                                     f"def folder():\n    return {str(tmp_path)!r}\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    c = resolve_source(ModelSpec(gguf_package="mygguf:path"))
    assert not c.converted and c.path == a.path  # the same content: the same expansion
    assert c.locate_seconds is not None and c.origin == "gguf_package:mygguf:path -> m.gguf"
    for fn, needle in (("boom", "mygguf:boom() raised RuntimeError: no file today"),
                       ("nothing", "mygguf:nothing() returned None"),
                       ("folder", "which is a folder"), ("nope", "has no 'nope'")):
        with pytest.raises(QevalInputError, match="model.gguf_package") as e:
            resolve_source(ModelSpec(gguf_package=f"mygguf:{fn}"))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_package_function_raising_fails_the_run_with_exit_2(tmp_path, qeval_cache):
    pkg = tmp_path / "site" / "badgguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def path():\n    raise FileNotFoundError('weights not downloaded')\n")
    r = tmp_path / "r.yaml"
    r.write_text((REPO / "tests" / "bad_recipes" / "gguf-package-function-module-missing.yaml").read_text()
                 .replace("no_such_module_xyz:gguf_path", "badgguf:path"))
    env = {**os.environ, "QEVAL_CACHE": str(qeval_cache),
           "PYTHONPATH": os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")])}
    v = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(r)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert v.returncode == 0, v.stderr  # validate imports it and does not call it
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(r), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert any("model.gguf_package" in ln and "badgguf:path() raised FileNotFoundError: weights not downloaded" in ln
               for ln in err), p.stderr
    assert "Traceback" not in p.stderr


def test_package_gguf_counts_and_bad_files(tmp_path, monkeypatch, qeval_cache):
    from qeval.source import find_package_gguf
    for name, files in (("twogguf", ["a.gguf", "b.gguf"]), ("nogguf", [])):
        d = tmp_path / "site" / name
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        for f in files:
            (d / f).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(QevalInputError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\).*twogguf:<function"):
        find_package_gguf("twogguf")
    with pytest.raises(QevalInputError, match="holds no .gguf file"):
        find_package_gguf("nogguf")
    (tmp_path / "fake.gguf").write_text("not a gguf")
    r = tmp_path / "r.yaml"
    r.write_text((REPO / "tests" / "bad_recipes" / "gguf-source-missing.yaml").read_text()
                 .replace("./no-such-model.gguf", "./fake.gguf"))
    _one_line_exit_2(["validate", str(r)], "model.source:", "is not a GGUF file")
    r.write_text(r.read_text().replace("./fake.gguf", "./r.yaml"))
    _one_line_exit_2(["validate", str(r)], "model.source:", "is a file, not a Hugging Face checkpoint folder")
