"""The run's progress display (qeval/progress.py): the plan of stages, the estimate from
earlier stage times, one line per finished stage in a log, the history it keeps."""
from __future__ import annotations

import io
import json

from rich.console import Console

from conftest import write_recipe
from qeval.progress import (RunProgress, estimate_left, estimate_remaining, eta_text, planned_stages, read_history,
                            write_history)
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


class FakeClock:
    """Seconds that move only when the test says (``RunProgress(clock=...)``): the elapsed
    time and the running stages' ages on each line are then exact."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_log_lines_and_history(tmp_path):
    """One line per finished stage in a log: its seconds, done of total, the time elapsed
    since the display began (from its clock) and the estimate, which counts a running
    stage's age against its earlier time; the history keeps the last time of each stage."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    hist = tmp_path / "times.json"
    write_history("r", {"t.measure": 12.0}, hist)
    clock = FakeClock(100.0)
    with RunProgress(console, "r", ["_run.source", "t.measure", "t.quality"], lanes=2, history_file=hist,
                     clock=clock) as p:
        p.event("run", "source", "starting")
        p.event("t", "measure", "starting")          # beside source (two lanes)
        clock.now = 103.25
        p.stage_end("_run", "source", 3.25, True)    # measure has run 3.25 s of its earlier 12
        clock.now = 105.0
        p.event("t", "measure", "depth 1024")
        clock.now = 110.0
        p.stage_end("t", "measure", 10.0, True)
        clock.now = 175.0
        p.stage_end("t", "quality", 7.5, False)
    lines = [ln.strip() for ln in buf.getvalue().splitlines() if ln.strip()]
    # source had no earlier time; measure had 12 s (8.75 of it left), quality none: a lower
    # bound, and what it lacks; then only quality, never timed here; then nothing left
    assert lines == [
        "3.2 s  source (run)  [1/3, 0:03 elapsed, at least 0:09 left (1 stage not timed here before)]",
        "10.0 s  measure t  [2/3, 0:10 elapsed, time left unknown: no earlier run of this recipe on this machine]",
        "7.5 s  FAILED quality t  [3/3, 1:15 elapsed, finishing]",
    ]  # no spinner frames in a log
    assert read_history("r", hist) == {"t.measure": 10.0, "_run.source": 3.25, "t.quality": 7.5}
    hist.write_text("not json")
    assert read_history("r", hist) == {}  # a broken history file is no error


def test_eta_from_a_synthetic_stage_history():
    """The line's estimate from this machine's stage history: the full figure when every
    stage to run has an earlier time, a lower bound naming how many lack one, and a plain
    statement when none has."""
    hist = {"_run.source": 30.0, "_run.env": 5.0, "_run.reference": 100.0, "_run.floor": 20.0,
            "bf16.prepare": 1.0, "bf16.measure": 40.0, "bf16.load": 25.0, "bf16.quality": 60.0,
            "awq.prepare": 900.0, "awq.measure": 50.0, "awq.load": 30.0, "awq.quality": 80.0}
    todo = list(hist)
    total = sum(hist.values())
    assert estimate_left(todo, hist) == (total, [])
    assert eta_text(todo, hist) == "about 22:21 left"  # 1341 s
    # two lanes: measure and load (timed) alone, the rest two at a time
    timed = 40.0 + 25.0 + 50.0 + 30.0 + 5.0
    assert estimate_left(todo, hist, lanes=2)[0] == timed + (total - timed) / 2
    # a running stage counts what is left of it, never below zero
    assert estimate_left(["awq.prepare"], hist, running={"awq.prepare": 600.0})[0] == 300.0
    assert estimate_left(["awq.prepare"], hist, running={"awq.prepare": 1200.0})[0] == 0.0
    # a tier never run here: a lower bound from what is known, never another tier's times
    more = todo + ["gptq.prepare", "gptq.measure"]
    left, unknown = estimate_left(more, hist)
    assert left == total and unknown == ["gptq.prepare", "gptq.measure"]
    assert eta_text(more, hist) == "at least 22:21 left (2 stages not timed here before)"
    assert estimate_remaining(more, hist) is None
    # no history at all (a first run on this machine)
    assert eta_text(todo, {}) == "time left unknown: no earlier run of this recipe on this machine"
    assert eta_text([], hist) == "finishing"
    assert eta_text(["awq.prepare"], {"awq.prepare": 4000.0}) == "about 1:06:40 left"


def test_eta_in_the_log_follows_the_history_file(tmp_path):
    """The progress display reads the history file of this recipe only and prints the
    estimate on every finished stage's line."""
    hist = tmp_path / "times.json"
    write_history("r", {"a.measure": 100.0, "a.quality": 50.0}, hist)
    write_history("other", {"b.measure": 999.0}, hist)
    buf = io.StringIO()
    with RunProgress(Console(file=buf, force_terminal=False, width=200), "r", ["a.measure", "a.quality"],
                     history_file=hist) as p:
        p.stage_end("a", "measure", 90.0, True)
        p.stage_end("a", "quality", 55.0, True)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    assert lines[0].endswith("about 0:50 left]"), lines
    assert lines[1].endswith("finishing]"), lines
    assert read_history("r", hist) == {"a.measure": 90.0, "a.quality": 55.0}
    buf = io.StringIO()
    with RunProgress(Console(file=buf, force_terminal=False, width=200), "new", ["a.measure", "a.quality"],
                     history_file=hist) as p:
        p.stage_end("a", "measure", 1.0, True)
    assert buf.getvalue().strip().endswith("time left unknown: no earlier run of this recipe on this machine]")
