"""The pipelined local executor (qeval/pipeline.py): untimed stages side by side, timed
stages alone, dependencies kept, failures confined to their tier.

The stages here are fakes (a short sleep each, no child process), so the tests check the
schedule's rules, not speed: every assertion is about which stage overlapped which."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import write_recipe
from qeval.pipeline import Pipeline, default_lanes
from qeval.recipe import load_recipe
from qeval.results import RUN_SCOPE, STATUS_FAILED, STATUS_OK, TierResult
from qeval.stages import TIMED_STAGES, StageOutcome, TierRunner

TIERS = """  - {name: bf16, method: bf16}
  - {name: gptq, method: gptq, bits: 4, group_size: 32}
  - {name: kv8, method: bf16, kv_cache: int8}
  - {name: int8, method: int8, quality_engine: dequantized}
"""


class FakeRunner(TierRunner):
    """run_stage sleeps and records start/end; ``fail`` names stages that fail."""

    def __init__(self, recipe, run_dir, fail=(), seconds=0.05):
        super().__init__(recipe, run_dir)
        self.fail = set(fail)
        self.seconds = seconds
        self.log: list[tuple[str, float, float, int | None]] = []
        self.lock = threading.Lock()
        self.active: set[str] = set()
        self.overlaps: list[tuple[str, frozenset]] = []

    def run_stage(self, stage, tier=RUN_SCOPE, timeout=None, fingerprint=None, threads=None):
        name = f"{tier}.{stage}"
        with self.lock:
            self.overlaps.append((name, frozenset(self.active)))
            self.active.add(name)
        t0 = time.time()
        time.sleep(self.seconds * (3 if stage == "prepare" and tier == "gptq" else 1))
        with self.lock:
            self.active.discard(name)
            self.log.append((name, t0, time.time(), threads))
        if name in self.fail:
            return StageOutcome(False, f"{name} broke", "tail")
        return StageOutcome(True)

    def _wants_load(self, tier):
        return True

    def finish(self, tier, status, error=None, log_tail=None):
        return TierResult(tier=tier, method=self.recipe.tier(tier).method, status=status, error=error,
                          log_tail=log_tail)

    def push(self, include):
        return 0


@pytest.fixture()
def recipe(tmp_path, tiny_llama):
    return load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tiers=TIERS,
                                    extra="gate: {reference: bf16}\nlanes: 2"))


def _run(recipe, tmp_path, expected=None, **kw):
    runner = FakeRunner(recipe, tmp_path / "run", **kw)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    floors = []
    pipe = Pipeline(runner, [t.name for t in recipe.tiers], lanes=2, cores=2, on_floor=floors.append,
                    expected=expected)
    results = pipe.run()
    return runner, pipe, results, floors


def _order(runner):
    return {name: (t0, t1) for name, t0, t1, _ in runner.log}


def test_timed_stages_run_alone_and_untimed_pair_up(recipe, tmp_path):
    runner, pipe, results, floors = _run(recipe, tmp_path)
    assert all(r.status == STATUS_OK for r in results.values())
    assert list(results) == ["bf16", "gptq", "kv8", "int8"]
    for name, beside in runner.overlaps:  # at the moment each stage started
        if name.split(".")[1] in TIMED_STAGES or name == "gptq.prepare":  # gptqmodel: alone (prepare_alone)
            assert not beside, f"{name} started beside {sorted(beside)}"
            assert all(name not in b for _, b in runner.overlaps), f"a stage started beside {name}"
        else:
            assert not any(b.split(".")[1] in TIMED_STAGES for b in beside), (name, beside)
            assert len(beside) <= 1  # two lanes
    assert any(beside for name, beside in runner.overlaps), "no untimed stages ran side by side"
    sched = {f"{s.tier}.{s.stage}": s for s in pipe.schedule()}
    for s in sched.values():  # what run.json says ran beside what agrees with the rule
        if s.timed:
            assert s.beside == [] and s.threads == recipe.threads
        elif s.tier == "gptq" and s.stage == "prepare":
            assert s.beside == [] and s.threads == 2  # every core
        else:
            assert s.threads == 1
    assert len(floors) == 1 and floors[0].ok


def test_dependencies_hold(recipe, tmp_path):
    runner, pipe, results, _ = _run(recipe, tmp_path)
    t = _order(runner)
    for tier in ("bf16", "gptq", "kv8", "int8"):
        assert t[f"{tier}.prepare"][1] <= t[f"{tier}.measure"][0]
        assert t[f"{tier}.measure"][1] <= t[f"{tier}.load"][0]
        assert t[f"{tier}.prepare"][1] <= t[f"{tier}.quality"][0]
        assert t["_run.reference"][1] <= t[f"{tier}.quality"][0]
    assert t["_run.reference"][1] <= t["_run.floor"][0] <= t["_run.floor"][1] <= t["bf16.quality"][0]
    # gptq's quality engine is chosen from its measured decode speed (auto): after measure
    assert t["gptq.measure"][1] <= t["gptq.quality"][0]


def test_a_failed_prepare_fails_its_tier_alone(recipe, tmp_path):
    runner, pipe, results, _ = _run(recipe, tmp_path, fail={"gptq.prepare"})
    assert results["gptq"].status == STATUS_FAILED and "gptq.prepare broke" in results["gptq"].error
    ran = {name for name, *_ in runner.log}
    assert not {"gptq.measure", "gptq.load", "gptq.quality"} & ran
    assert all(results[t].status == STATUS_OK for t in ("bf16", "kv8", "int8"))


def test_a_failed_reference_fails_every_quality_but_keeps_speed(recipe, tmp_path):
    runner, pipe, results, floors = _run(recipe, tmp_path, fail={"_run.reference"})
    ran = {name for name, *_ in runner.log}
    assert not any(n.endswith(".quality") for n in ran) and "_run.floor" not in ran and not floors
    for tier, r in results.items():
        assert r.status == STATUS_FAILED and "reference pass failed: _run.reference broke" in r.error
        assert f"{tier}.measure" in ran and f"{tier}.load" in ran


def test_a_failed_load_or_floor_loses_nothing_else(recipe, tmp_path):
    runner, pipe, results, floors = _run(recipe, tmp_path, fail={"kv8.load", "_run.floor"})
    assert all(r.status == STATUS_OK for r in results.values())
    assert "bf16.quality" in {name for name, *_ in runner.log}  # the floor failing does not block it
    assert len(floors) == 1 and not floors[0].ok


def test_default_lanes():
    class R:
        lanes = None
    assert default_lanes(R, "cpu", cores=2) == 1  # opt-in: see default_lanes for the measurement
    assert default_lanes(R, "cuda", cores=16) == 1
    R.lanes = 3
    assert default_lanes(R, "cuda", cores=2) == 3


def test_longest_known_untimed_stage_starts_first(recipe, tmp_path):
    runner, *_ = _run(recipe, tmp_path, expected={"gptq.prepare": 500.0, "int8.prepare": 20.0})
    starts = [name for name, _ in runner.overlaps]
    assert starts[0] == "gptq.prepare"  # LPT: the long quantization first
    assert starts.index("int8.prepare") < starts.index("bf16.prepare")  # known before unknown
    runner, *_ = _run(recipe, tmp_path / "b")
    # no history: graph order, the reference first (it unlocks every quality stage)
    assert [name for name, _ in runner.overlaps][:2] == ["_run.reference", "bf16.prepare"]


def test_a_quality_stage_that_waits_for_measure_does_not_run_alone(tmp_path, tiny_llama):
    """A GPTQ tier's quality waits for its measure (the engine is chosen from the measured
    speed). When it is the only untimed stage ready, a ready timed stage that unlocks more
    untimed work runs first, so the quality stage starts beside another one instead of
    alone between timed stages (on the 2-core machine: GPTQ's and AWQ's quality paired)."""
    tiers = """  - {name: bf16, method: bf16}
  - {name: gptq, method: gptq, bits: 4, group_size: 32}
  - {name: awq, method: awq, bits: 4, group_size: 32}
"""
    r = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tiers=tiers, extra="gate: {reference: bf16}\nlanes: 2"))
    runner, pipe, results, _ = _run(r, tmp_path)
    assert all(x.status == STATUS_OK for x in results.values())
    t = _order(runner)
    assert t["gptq.measure"][1] <= t["gptq.quality"][0] and t["awq.measure"][1] <= t["awq.quality"][0]
    started_beside = dict(runner.overlaps)
    assert started_beside["gptq.quality"], runner.overlaps
