"""What a reviewer reads: per-item KLD and the highest-KLD positions stored by the quality
stage, flipped and failing items in the report, ``qeval show``, ``qeval compare``'s item
changes and the JUnit file's worst items; the page in headless Chromium. Read-only on a
recorded run of the tiny model (tests/fixtures/run_review, made by
``tests/make_run_fixture.py --review``): no test here starts a run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

from qeval.measure.review import ReviewCollector
from qeval.report.review import divergence, offending_items, tier_review, verdict_changes

TIER = "bf16-kv8"
RUN = Path(__file__).parent / "fixtures" / "run_review"  # the conftest tiny recipe, run once and recorded


def _qeval(*args, env=None):
    return subprocess.run([sys.executable, "-m", "qeval.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_collector_keeps_the_highest_kld_positions_with_both_top_tokens():
    c = ReviewCollector(top=3, k=2)
    vocab = 6
    ref = np.log(np.full((5, vocab), 1 / vocab, dtype=np.float32))
    tier = ref.copy()
    tier[:, 4] = np.log(0.9)  # tier's top token is 4 everywhere
    seg = {"item": "s/a", "turn": 1, "prompt_ids": [9, 8], "answer_ids": [0, 1, 2, 3, 5]}
    c.add(seg, 0, np.array([0.2, 0.0, 0.7]), ref[:3], tier[:3])
    c.add(seg, 3, np.array([0.5, 0.1]), ref[3:], tier[3:])
    out = c.result(lambda ids: ",".join(map(str, ids)), lambda i: f"t{i}")
    assert out["items"] == [{"item": "s/a", "turn": 1, "kld_mean": pytest.approx(1.5 / 5), "kld_max": 0.7,
                             "n_tokens": 5}]
    worst = out["worst"]
    assert [w["position"] for w in worst] == [2, 3, 0] and [w["kld"] for w in worst] == [0.7, 0.5, 0.2]
    # the context is what precedes the position (prompt + earlier answer tokens), the target the answer token
    assert worst[0]["context"] == "9,8,0,1" and worst[0]["target"] == "t2"
    assert worst[0]["tier_top"][0] == ["t4", pytest.approx(0.9, rel=1e-5)]
    assert worst[0]["ref_top"][0][1] == pytest.approx(1 / vocab, rel=1e-5) and len(worst[0]["ref_top"]) == 2


def test_divergence_is_the_first_differing_character():
    assert divergence("abc", "abc") is None
    assert divergence("abcd", "abXd") == 2
    assert divergence("ab", "abc") == 2 and divergence("abc", "ab") == 2
    assert divergence(None, "x") is None


@pytest.fixture()
def flipped_run(tmp_path):
    """A copy of the tiny run where one answer of the int8-KV tier is rewritten so that its
    checks disagree with the reference's and its verdict changes: a flip the report, show,
    compare and JUnit must name."""
    dst, row = _flip_one_answer(RUN, tmp_path, TIER)
    return RUN, dst, row


def _flip_one_answer(run_dir: Path, tmp_path: Path, tier: str) -> tuple[Path, dict]:
    """Copy the run and rewrite one of ``tier``'s answers so that its checks flip against
    the reference pass; the copy's gate fails the int8-KV tier. Returns (copy, the row)."""
    dst = tmp_path / "tiny" / run_dir.name
    shutil.copytree(run_dir, dst)
    ans_p = dst / "answers" / f"{tier}.json"
    answers = json.loads(ans_p.read_text())
    refs = {(s["item"], s["turn"]): s for s in json.loads((dst / "reference" / "segments.json").read_text())}
    def rewritten(r):  # every check flipped to the verdict the tier's answer did not have
        return [not all(r["checks"])] * len(r["checks"])
    row = next(r for r in answers if r["checks"] and rewritten(r) != refs[(r["item"], r["turn"])]["checks"])
    ref = refs[(row["item"], row["turn"])]
    row["checks"] = rewritten(row)  # differs from the reference's (a flip) and from the tier's verdict
    row["check_details"] = [f"edited: check {i} set to {c}" for i, c in enumerate(row["checks"])]
    row["text"] = ref["text"][:3] + "<<a different answer>>"
    ans_p.write_text(json.dumps(answers))
    run = json.loads((dst / "run.json").read_text())
    run["recipe"]["gate"]["rules"] = {"max_kld_mean": 0.0}  # the int8-KV tier fails it: KLD > 0
    (dst / "run.json").write_text(json.dumps(run))
    return dst, row


def test_real_run_stores_prompts_item_kld_and_worst_positions():
    run_dir = RUN
    answers = json.loads((run_dir / "answers" / f"{TIER}.json").read_text())
    # each answered turn carries the user text it answers (suite files: tests/data/)
    users = {}
    for suite, f in (("lo", "suite_long.jsonl"), ("mt", "suite_multi.jsonl")):
        for line in (Path(__file__).parent / "data" / f).read_text().splitlines():
            it = json.loads(line)
            users.update({(f"{suite}/{it['id']}", t): turn["user"] for t, turn in enumerate(it["turns"])})
    assert answers and all(a["prompt"] == users[(a["item"], a["turn"])] for a in answers)
    review = json.loads((run_dir / "review" / f"{TIER}.json").read_text())
    tier = json.loads((run_dir / "tiers" / f"{TIER}.json").read_text())
    # per-item KLD means, weighted by their token counts, give the tier's KLD mean
    n = sum(i["n_tokens"] for i in review["items"])
    mean = sum(i["kld_mean"] * i["n_tokens"] for i in review["items"] if i["n_tokens"]) / n
    assert n == tier["quality"]["fidelity"]["n_tokens"]
    assert mean == pytest.approx(tier["quality"]["fidelity"]["kld_mean"], rel=1e-6)
    worst = review["worst"]
    assert worst and [w["kld"] for w in worst] == sorted((w["kld"] for w in worst), reverse=True)
    assert worst[0]["kld"] == pytest.approx(tier["quality"]["fidelity"]["kld_max"], rel=1e-6)
    for w in worst:
        assert 0 < sum(p for _, p in w["ref_top"]) <= 1.0001 and len(w["tier_top"]) == 5
    # the reference tier as served (bf16) against the float32 reference: its items hold the noise floor
    ref_review = json.loads((run_dir / "review" / "bf16.json").read_text())
    floor = json.loads((run_dir / "run.json").read_text())["noise_floor"]
    rn = sum(i["n_tokens"] for i in ref_review["items"])
    rmean = sum(i["kld_mean"] * i["n_tokens"] for i in ref_review["items"] if i["n_tokens"]) / rn
    assert floor["measured"] and rmean > 0 and rmean == pytest.approx(floor["kld_mean"], rel=1e-3)


def test_report_shows_flipped_items_with_both_answers(flipped_run):
    _, dst, row = flipped_run
    p = _qeval("report", dst)
    assert p.returncode == 0, p.stderr
    html = (dst / "report.html").read_text()
    sec = html[html.index('<h2 id="review">'):]
    tier_sec = sec[sec.index(f'id="rv-{TIER}"'):]
    flipped = tier_sec[tier_sec.index("<h3>Flipped</h3>"):tier_sec.index("<h3>Failing on")]
    assert f'id="rv-{TIER}-{row["item"]}' in flipped
    assert "&lt;&lt;a different answer&gt;&gt;" in flipped and "<mark>" in flipped  # escaped, divergence marked
    assert "first divergence at character 3" in flipped and "edited: check 0 set to" in flipped
    assert "Positions of highest KLD" in tier_sec


def test_reference_tier_flips_against_the_reference_pass_show_both_answers(tmp_path):
    """The reference tier (bf16 as served) is scored against the float32 reference pass: its
    flips are the noise floor's own, listed with both answers (the default run's report
    showed only one text, labelled "reference answer", beside checks that disagreed)."""
    dst, row = _flip_one_answer(RUN, tmp_path, "bf16")
    # the tiny random model's answers are noise; give the reference pass's answer a text to find
    seg_p = dst / "reference" / "segments.json"
    segs = json.loads(seg_p.read_text())
    ref_text = row["text"][:3] + " the reference pass answered this"
    next(s for s in segs if (s["item"], s["turn"]) == (row["item"], row["turn"]))["text"] = ref_text
    seg_p.write_text(json.dumps(segs))
    p = _qeval("report", dst)
    assert p.returncode == 0, p.stderr
    html = (dst / "report.html").read_text()
    sec = html[html.index('<details class="review" id="rv-bf16"'):]
    end = sec.find('<details class="review"', 10)
    sec = sec if end < 0 else sec[:end]
    assert "<h3>Flipped against the reference pass" in sec
    flipped = sec[sec.index("<h3>Flipped"):sec.index("<h3>Failing on")]
    assert f'id="rv-bf16-{row["item"]}' in flipped and "&lt;&lt;a different answer&gt;&gt;" in flipped
    assert "the reference pass answered this" in flipped  # the reference pass's answer beside it
    wide = dict(os.environ, COLUMNS="240")
    p = _qeval("show", dst, "bf16", "--flips", env=wide)
    assert p.returncode == 0, p.stderr
    assert "noise floor's own flips" in p.stdout and "a different answer" in p.stdout
    assert "the reference pass answered this" in p.stdout


def test_show_prints_the_flip_and_refuses_unknown_names(flipped_run):
    _, dst, row = flipped_run
    wide = dict(os.environ, COLUMNS="240")  # rich wraps at the terminal's width
    p = _qeval("show", dst, TIER, "--flips", env=wide)
    assert p.returncode == 0, p.stderr
    assert row["item"] in p.stdout and "first divergence at character 3" in p.stdout
    assert "a different answer" in p.stdout and ("pass→fail" in p.stdout or "fail→pass" in p.stdout)
    p = _qeval("show", dst, TIER, "--item", row["item"].split("/", 1)[1], env=wide)
    assert p.returncode == 0 and row["item"] in p.stdout
    p = _qeval("show", dst, TIER, env=wide)
    assert p.returncode == 0 and "positions of highest KLD" in p.stdout
    for args, field in (((dst, "nope"), "TIER"), ((dst, TIER, "--item", "nope/x"), "--item")):
        p = _qeval("show", *args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and field in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_compare_lists_the_items_that_changed_verdict(flipped_run):
    run_dir, dst, row = flipped_run
    p = _qeval("compare", run_dir, dst)
    assert p.returncode == 0, p.stderr
    section = p.stdout[p.stdout.index("## Items that changed verdict"):]
    assert f"`{row['item']}`" in section.split(f"- {TIER}:")[1]
    assert "- bf16: no item changed verdict" in section
    a, b = tier_review(run_dir, TIER, "bf16"), tier_review(dst, TIER, "bf16")
    assert [k for k, _, _ in verdict_changes(a, b)] == [row["item"] if not row["turn"] else f"{row['item']}#{row['turn']}"]


def test_junit_names_the_worst_items_of_a_failing_quality_rule(flipped_run, tmp_path):
    _, dst, _ = flipped_run
    junit = tmp_path / "gate.xml"
    p = _qeval("gate", dst, "--junit", junit)
    assert p.returncode == 1, p.stderr
    root = ET.parse(junit).getroot()
    case = next(c for c in root.iter("testcase") if c.get("classname") == f"qeval.gate.{TIER}"
                and c.get("name") == "max_kld_mean")
    fail = case.find("failure")
    assert fail is not None and "worst items:" in fail.text and "KLD mean" in fail.get("message")
    review = tier_review(dst, TIER, "bf16")
    top = max((v for v in review.items if v.kld_mean is not None), key=lambda v: v.kld_mean)
    assert fail.text.split("worst items:")[1].strip().startswith(f"{top.key}: KLD mean")
    assert offending_items(review, "peak_bytes") == []  # no item is to blame for memory


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium_without_console_errors(flipped_run, tmp_path):
    _, dst, row = flipped_run
    assert _qeval("report", dst).returncode == 0
    page = (dst / "report.html").resolve()
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
           "--v=0", "--virtual-time-budget=3000", "--dump-dom", page.as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, HOME=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-2000:]
    dom = p.stdout
    for needle in ('<h2 id="review">', "Pareto front", "Release gate", f'id="rv-{TIER}-{row["item"]}',
                   "&lt;&lt;a different answer&gt;&gt;", "Positions of highest KLD"):
        assert needle in dom, needle
    console = [ln for ln in p.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    # nothing of the page comes from a network: every src/href is a data: URI or an in-page anchor
    import re
    for url in re.findall(r'(?:src|href)="([^"]+)"', dom):
        assert url.startswith(("data:", "#")), url
