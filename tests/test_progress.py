"""The run's progress display (qeval/progress.py): the plan of stages, the estimate from
earlier stage times, one line per finished stage in a log, the history it keeps."""
from __future__ import annotations

import io
import json

from rich.console import Console

from conftest import write_recipe
from qeval.progress import RunProgress, estimate_remaining, planned_stages, read_history, write_history
from qeval.recipe import load_recipe
from qeval.results import RunLayout


def test_plan_lists_every_stage_less_the_finished(tmp_path, tiny_llama):
    r = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tiers="  - {name: bf16, method: bf16}\n"))
    layout = RunLayout(tmp_path / "run")
    plan = planned_stages(r, ["bf16"], layout)
    assert plan == ["_run.source", "_run.env", "_run.reference", "_run.floor",
                    "bf16.prepare", "bf16.measure", "bf16.load", "bf16.quality"]
    layout.stage("bf16", "prepare").parent.mkdir(parents=True)
    layout.stage("bf16", "prepare").write_text(json.dumps({"artifact": None, "reused": True}))
    assert "bf16.prepare" not in planned_stages(r, ["bf16"], layout)


def test_estimate_pairs_untimed_stages_and_needs_history():
    hist = {"_run.reference": 100.0, "a.prepare": 60.0, "a.measure": 30.0, "a.quality": 40.0}
    todo = list(hist)
    assert estimate_remaining(todo, hist, lanes=1) == 230.0
    assert estimate_remaining(todo, hist, lanes=2) == 30.0 + 200.0 / 2  # measure alone, the rest paired
    assert estimate_remaining(todo, hist, lanes=1, running={"_run.reference": 90.0}) == 140.0
    assert estimate_remaining(todo + ["b.measure"], hist) is None  # a first run: no figure invented


def test_log_lines_and_history(tmp_path):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    hist = tmp_path / "times.json"
    write_history("r", {"t.measure": 12.0}, hist)
    with RunProgress(console, "r", ["_run.source", "t.measure", "t.quality"], lanes=2, history_file=hist) as p:
        p.event("run", "source", "starting")
        p.stage_end("_run", "source", 3.25, True)
        p.event("t", "measure", "starting")
        p.event("t", "measure", "depth 1024")
        p.stage_end("t", "measure", 10.0, True)
        p.stage_end("t", "quality", 7.5, False)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    assert lines[0].split() == ["3.2", "s", "source", "(run)", "[1/3,", "0:00", "elapsed]"]
    assert "measure t" in lines[1] and "[2/3" in lines[1]
    assert "FAILED quality t" in lines[2] and "[3/3" in lines[2]
    assert len(lines) == 3  # no spinner frames in a log
    assert read_history("r", hist) == {"t.measure": 10.0, "_run.source": 3.25, "t.quality": 7.5}
    hist.write_text("not json")
    assert read_history("r", hist) == {}  # a broken history file is no error
