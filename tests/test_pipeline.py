"""The pipelined local executor (qeval/pipeline.py): untimed stages side by side, timed
stages alone, dependencies kept, failures confined to their tier.

The stages here are fakes (no child process, no sleep) that the test holds: each one blocks
in ``run_stage`` until released. The pipeline's main thread releases one only when it waits
for a finished stage (``done.get()``), that is once it has started everything it means to
start, so what ran beside what is the executor's choice alone, never a matter of timing. Each
release finishes the running stage with the earliest end on a virtual clock (a stage takes
one unit, gptq's prepare three), ties in start order. Every assertion is about the recorded
order of starts and ends and which stages ran together; no clock is read."""
from __future__ import annotations

import queue
import threading
import types
from unittest import mock

import pytest

import qeval.pipeline
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
#: Seconds any wait here may last before the test calls it a hang (a guard only: nothing
#: waits on time when the executor works; every wait ends on an event).
HANG_S = 60.0


class FakeRunner(TierRunner):
    """Stages the test holds: ``run_stage`` records the start and blocks until
    :meth:`release_next` lets it finish; ``fail`` names stages that then fail.

    Attributes (what tests read):
        starts: ``tier.stage`` in the order the pipeline started them (its ``starting``
            event, sent from its main thread).
        events: ``("start" | "end", tier.stage)`` in the order they happened.
        rounds: the stages running together each time the pipeline waited for one to end.
    """

    def __init__(self, recipe, run_dir, fail=(), units=None):
        super().__init__(recipe, run_dir, on_event=self._on_event)
        self.fail = set(fail)
        self.units = {"gptq.prepare": 3} if units is None else units
        self.cond = threading.Condition()
        self.starts: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.rounds: list[frozenset[str]] = []
        self.held: dict[str, threading.Event] = {}  # in run_stage, not yet released
        self.begin: dict[str, int] = {}  # virtual start of each stage
        self.now = 0
        self.hung: list[str] = []

    def _on_event(self, tier, stage, message):
        if message == "starting":
            with self.cond:
                self.starts.append(f"{RUN_SCOPE if tier == 'run' else tier}.{stage}")
                self.cond.notify_all()

    def run_stage(self, stage, tier=RUN_SCOPE, timeout=None, fingerprint=None, threads=None):
        name = f"{tier}.{stage}"
        gate = threading.Event()
        with self.cond:
            self.events.append(("start", name))
            self.held[name] = gate
            self.begin[name] = self.now
            self.cond.notify_all()
        if not gate.wait(HANG_S):
            self.hung.append(name)
            return StageOutcome(False, f"{name}: never released (hang guard)")
        if name in self.fail:
            return StageOutcome(False, f"{name} broke", "tail")
        return StageOutcome(True)

    def release_next(self) -> None:
        """Called by the pipeline's main thread as it waits for a stage to end: once every
        stage it started is inside ``run_stage``, record what runs together and let the
        one with the earliest virtual end finish."""
        with self.cond:
            ended = {n for kind, n in self.events if kind == "end"}
            if not self.cond.wait_for(lambda: set(self.starts) - ended <= set(self.held), HANG_S):
                raise AssertionError(f"started {self.starts}, in run_stage {sorted(self.held)}: a stage never ran")
            if not self.held:
                raise AssertionError("the pipeline waits for a stage, but none runs")
            self.rounds.append(frozenset(self.held))
            order = {n: i for i, (_, n) in enumerate(e for e in self.events if e[0] == "start")}
            name = min(self.held, key=lambda n: (self.begin[n] + self.units.get(n, 1), order[n]))
            self.now = self.begin[name] + self.units.get(name, 1)
            self.events.append(("end", name))
            self.held.pop(name).set()

    def release_all(self) -> None:
        with self.cond:
            for gate in self.held.values():
                gate.set()

    def _wants_load(self, tier):
        return True

    def finish(self, tier, status, error=None, log_tail=None):
        return TierResult(tier=tier, method=self.recipe.tier(tier).method, status=status, error=error,
                          log_tail=log_tail)

    def push(self, include):
        return 0


class _DrivenQueue(queue.Queue):
    """The pipeline's queue of finished stages: each ``get`` (the main thread, having started
    all it will) first releases one held stage (:meth:`FakeRunner.release_next`)."""

    def __init__(self, runner: FakeRunner) -> None:
        super().__init__()
        self.runner = runner

    def get(self, block=True, timeout=None):
        self.runner.release_next()
        try:
            return super().get(timeout=HANG_S)
        except queue.Empty:
            raise AssertionError("a released stage never reported its end") from None


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
    fake_queue = types.SimpleNamespace(Queue=lambda: _DrivenQueue(runner))
    try:
        with mock.patch.object(qeval.pipeline, "queue", fake_queue):
            results = pipe.run()
    finally:
        runner.release_all()
    assert not runner.hung, runner.hung
    return runner, pipe, results, floors


def _order(runner):
    """``{tier.stage: (position of its start, position of its end)}`` in the recorded events."""
    pos: dict[str, list[int]] = {}
    for i, (kind, name) in enumerate(runner.events):
        pos.setdefault(name, [None, None])[kind == "end"] = i
    return {name: tuple(p) for name, p in pos.items()}


def test_timed_stages_run_alone_and_untimed_pair_up(recipe, tmp_path):
    """A timed stage (measure, load) and gptqmodel's quantization (``prepare_alone``) never
    run beside anything; other stages run at most two at a time (two lanes) and some do
    pair up; run.json's schedule says the same, with each stage's threads."""
    runner, pipe, results, floors = _run(recipe, tmp_path)
    assert all(r.status == STATUS_OK for r in results.values())
    assert list(results) == ["bf16", "gptq", "kv8", "int8"]
    assert {n for r in runner.rounds for n in r} == set(runner.starts) == {n for _, n in runner.events}
    for together in runner.rounds:  # what ran at once, each time the pipeline waited
        alone = [n for n in together if n.split(".")[1] in TIMED_STAGES or n == "gptq.prepare"]
        assert not alone or len(together) == 1, f"{alone} ran beside {sorted(together)}"
        assert len(together) <= 2, sorted(together)  # two lanes
    assert any(len(together) == 2 for together in runner.rounds), "no untimed stages ran side by side"
    sched = {f"{s.tier}.{s.stage}": s for s in pipe.schedule()}
    assert set(sched) == set(runner.starts)
    for s in sched.values():  # what run.json says ran beside what agrees with the rule
        if s.timed:
            assert s.beside == [] and s.threads == recipe.threads
        elif s.tier == "gptq" and s.stage == "prepare":
            assert s.beside == [] and s.threads == 2  # every core
        else:
            assert s.threads == 1
    assert len(floors) == 1 and floors[0].ok


def test_dependencies_hold(recipe, tmp_path):
    """No stage starts before the stages it reads have ended: measure and quality after
    prepare, load after measure, every quality after the reference, the reference tier's
    after the floor, gptq's (engine chosen by measured speed) after its measure."""
    runner, pipe, results, _ = _run(recipe, tmp_path)
    t = _order(runner)
    for tier in ("bf16", "gptq", "kv8", "int8"):
        assert t[f"{tier}.prepare"][1] < t[f"{tier}.measure"][0]
        assert t[f"{tier}.measure"][1] < t[f"{tier}.load"][0]
        assert t[f"{tier}.prepare"][1] < t[f"{tier}.quality"][0]
        assert t["_run.reference"][1] < t[f"{tier}.quality"][0]
    assert t["_run.reference"][1] < t["_run.floor"][0] < t["_run.floor"][1] < t["bf16.quality"][0]
    # gptq's quality engine is chosen from its measured decode speed (auto): after measure
    assert t["gptq.measure"][1] < t["gptq.quality"][0]


def test_a_failed_prepare_fails_its_tier_alone(recipe, tmp_path):
    """A failed prepare fails its tier and starts none of its other stages; the other tiers
    finish."""
    runner, pipe, results, _ = _run(recipe, tmp_path, fail={"gptq.prepare"})
    assert results["gptq"].status == STATUS_FAILED and "gptq.prepare broke" in results["gptq"].error
    ran = set(runner.starts)
    assert not {"gptq.measure", "gptq.load", "gptq.quality"} & ran
    assert all(results[t].status == STATUS_OK for t in ("bf16", "kv8", "int8"))


def test_a_failed_reference_fails_every_quality_but_keeps_speed(recipe, tmp_path):
    """A failed reference pass fails every tier's quality (without running it) and the
    floor, but every tier's measure and load still run."""
    runner, pipe, results, floors = _run(recipe, tmp_path, fail={"_run.reference"})
    ran = set(runner.starts)
    assert not any(n.endswith(".quality") for n in ran) and "_run.floor" not in ran and not floors
    for tier, r in results.items():
        assert r.status == STATUS_FAILED and "reference pass failed: _run.reference broke" in r.error
        assert f"{tier}.measure" in ran and f"{tier}.load" in ran


def test_a_failed_load_or_floor_loses_nothing_else(recipe, tmp_path):
    """A failed load sweep or floor leaves every tier ok; the reference tier's quality still
    runs after a failed floor, whose outcome reaches ``on_floor``."""
    runner, pipe, results, floors = _run(recipe, tmp_path, fail={"kv8.load", "_run.floor"})
    assert all(r.status == STATUS_OK for r in results.values())
    assert "bf16.quality" in runner.starts  # the floor failing does not block it
    assert len(floors) == 1 and not floors[0].ok


def test_default_lanes():
    """Lanes are opt-in: the recipe's figure, else 1 on any device."""
    class R:
        lanes = None
    assert default_lanes(R, "cpu", cores=2) == 1  # opt-in: see default_lanes for the measurement
    assert default_lanes(R, "cuda", cores=16) == 1
    R.lanes = 3
    assert default_lanes(R, "cuda", cores=2) == 3


def test_longest_known_untimed_stage_starts_first(recipe, tmp_path):
    """Ready untimed stages start longest first by this machine's earlier times (LPT),
    those with a time before those without; with no history, in graph order with the
    reference first. Start order is the pipeline's (its main thread's ``starting`` events)."""
    runner, *_ = _run(recipe, tmp_path, expected={"gptq.prepare": 500.0, "int8.prepare": 20.0})
    starts = runner.starts
    assert starts[0] == "gptq.prepare"  # LPT: the long quantization first
    assert starts.index("int8.prepare") < starts.index("bf16.prepare")  # known before unknown
    runner, *_ = _run(recipe, tmp_path / "b")
    # no history: graph order, the reference first (it unlocks every quality stage)
    assert runner.starts[:2] == ["_run.reference", "bf16.prepare"]


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
    assert t["gptq.measure"][1] < t["gptq.quality"][0] and t["awq.measure"][1] < t["awq.quality"][0]
    assert any("gptq.quality" in r and len(r) == 2 for r in runner.rounds), runner.rounds
