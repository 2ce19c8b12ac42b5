"""The pipelined local executor: untimed stages of different tiers side by side, timed
stages alone.

On a CPU machine most of a run's stages time nothing (prepare: quantizing; reference,
floor, quality: scoring and answering), and on few cores one such stage leaves cores idle
(a 135M model's greedy decode does not scale past one thread). Timed stages (measure,
load) must run alone, with the recipe's pinned threads, or their figures measure the
neighbours. This executor keeps both: it runs the run-wide reference and floor stages and
every tier's prepare, measure, load and quality as one dependency graph, and

- starts untimed stages while fewer than ``lanes`` run (each with ``cores // lanes``
  threads), preferring them, since every one it finishes can unlock more;
- runs alone, with every core, an untimed stage that scales with threads and loses more
  beside another than pairing gains (a tier method's ``prepare_alone``: gptqmodel's GPTQ
  and AWQ quantization);
- starts a timed stage only when nothing else runs, and nothing beside it until it ends;
  runs one first when fewer untimed stages are ready than lanes and it unlocks another
  (a GPTQ or AWQ tier's quality waits for its measure: both qualities then pair up);
- records in ``run.json`` ``schedule`` what ran when and beside what.

Dependencies: prepare first; measure, then load, after prepare; quality after prepare and
the reference pass (and after measure when the tier's quality engine is ``auto`` and the
measured decode speed chooses it; the reference tier's quality after the floor); the
reference after the reference tier's prepare when it has an artifact. A failed prepare or
measure ends its tier's other stages; a failed quality stage or load sweep does not stop the
speed figures; a failed reference pass fails every quality stage; a failed floor leaves the
noise floor unmeasured (as in the plain order, :meth:`qeval.stages.TierRunner.run_tier`).

Checked before writing this: Ray (the ``ray`` executor, :mod:`qeval.executors`) schedules
whole tiers by resources, not stages against a "run alone" rule; ``concurrent.futures``
runs the stages here, the policy is this module's.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .failures import failure_text
from .results import (RUN_SCOPE, STATUS_FAILED, STATUS_NOT_BUILT, STATUS_OK, TIER_STAGES, ScheduledStage,
                      TierResult, stage_done)
from .stages import TIMED_STAGES, StageOutcome, TierRunner, tier_fingerprint
from .tiers import get_method


def default_lanes(recipe, device: str | None, cores: int | None = None) -> int:
    """The recipe's ``lanes``, else 1 (the plain tier-after-tier order).

    Not every core by default: measured on the 2-core machine (cold default run,
    2026-12-01), gptqmodel's GPTQ and AWQ quantization side by side at one thread each
    estimated 13 and 128 minutes where each alone at two threads had taken about 2 and 9,
    so a stage that scales with threads loses far more than pairing gains. ``device``
    and ``cores`` are kept for a default that knows which stages pair well."""
    if recipe.lanes:
        return recipe.lanes
    return 1


@dataclass(eq=False)
class _Step:
    tier: str
    stage: str
    deps: list["_Step"] = field(default_factory=list)
    state: str = "pending"  # pending | running | ok | failed | skipped
    outcome: StageOutcome | None = None
    start: float | None = None
    end: float | None = None
    threads: int = 1
    exclusive: bool = False  # untimed, but run alone with every core (TierMethod.prepare_alone)

    @property
    def timed(self) -> bool:
        return self.stage in TIMED_STAGES

    @property
    def alone(self) -> bool:
        """Nothing may run beside it: a timed stage, or an exclusive untimed one."""
        return self.timed or self.exclusive

    @property
    def name(self) -> str:
        return f"{self.tier}.{self.stage}"


class Pipeline:
    """Runs the reference, the floor and the tiers' stages of one run folder as a graph.

    Args:
        runner: the run's :class:`~qeval.run.Runner` (its ``run_stage`` runs each stage).
        tiers: the tiers to run, in recipe order (ties between ready stages go in that order).
        lanes: at most this many untimed stages at once.
        cores: the machine's cores (default ``os.cpu_count()``): each untimed stage gets
            ``max(1, cores // lanes)`` threads.
        on_floor: called with the floor stage's outcome in the main thread (``run.json``).
        expected: ``{"tier.stage": seconds}`` from this machine's earlier runs
            (:func:`qeval.progress.read_history`): ready untimed stages start longest first
            (LPT order: a long quantization begins while the short ones pair up beside it);
            stages without a figure keep the graph's order after those with one.
    """

    def __init__(self, runner: TierRunner, tiers: list[str], lanes: int, cores: int | None = None,
                 on_floor: Callable[[StageOutcome], None] = lambda out: None,
                 expected: dict[str, float] | None = None) -> None:
        self.runner = runner
        self.recipe = runner.recipe
        self.tiers = tiers
        self.lanes = max(1, lanes)
        self.cores = max(1, cores or os.cpu_count() or 1)
        self.threads = max(1, self.cores // self.lanes)
        self.on_floor = on_floor
        self.expected = expected or {}
        self.steps: list[_Step] = []
        self.reference_failed: str | None = None
        self._t0 = time.time()

    # -- the graph --------------------------------------------------------------------
    def build(self) -> None:
        """The steps still to run (finished stages are skipped, as on resume)."""
        r = self.recipe
        layout = self.runner.layout
        self.ref_step = self.floor_step = None
        prep: dict[str, _Step] = {}
        for tier in self.tiers:
            method = get_method(r.tier(tier).method)
            if method is not None:
                prep[tier] = self._add(tier, "prepare", [])
                prep[tier].exclusive = bool(getattr(method, "prepare_alone", False))
        if r.suites:
            ref_tier = r.gate.reference
            ref_method = get_method(r.tier(ref_tier).method)
            deps = []
            if ref_method is not None and ref_method.needs_artifact:
                deps.append(prep.get(ref_tier) or self._add(ref_tier, "prepare", []))
            self.ref_step = self._add(RUN_SCOPE, "reference", deps)
            self.floor_step = self._add(RUN_SCOPE, "floor", [self.ref_step])
        self.tier_steps: dict[str, list[_Step]] = {}
        for tier in self.tiers:
            if tier not in prep:
                self.tier_steps[tier] = []
                continue
            measure = self._add(tier, "measure", [prep[tier]])
            steps = [prep[tier], measure]
            if r.load.enabled:
                steps.append(self._add(tier, "load", [measure]))
            if r.suites:
                deps = [prep[tier], self.ref_step]
                if self._quality_reads_measure(tier):
                    deps.append(measure)
                if tier == r.gate.reference:
                    deps.append(self.floor_step)
                steps.append(self._add(tier, "quality", deps))
            self.tier_steps[tier] = steps
        if self.ref_step is not None:  # the reference unlocks every quality stage: it goes first
            head = [*self.ref_step.deps, self.ref_step, self.floor_step]
            ids = {id(x) for x in head}
            self.steps = head + [x for x in self.steps if id(x) not in ids]
        for s in self.steps:  # finished stages (a resumed run) are done already
            if s.stage == "load" and stage_done(layout, s.tier, "load"):
                self.runner._wants_load(s.tier)  # a load stage of another load section is removed
            if stage_done(layout, s.tier, s.stage):
                s.state = "ok"

    def _add(self, tier: str, stage: str, deps: list[_Step]) -> _Step:
        s = _Step(tier, stage, [d for d in deps if d is not None])
        self.steps.append(s)
        return s

    def _quality_reads_measure(self, tier: str) -> bool:
        """The quality engine is chosen from the measured decode speed (``auto`` with a
        dequantized form): quality waits for measure."""
        spec = self.recipe.tier(tier)
        choice = spec.quality_engine or self.recipe.quality.engine
        return choice == "auto" and get_method(spec.method).has_dequantized

    # -- running ----------------------------------------------------------------------
    def _ready(self) -> list[_Step]:
        """Pending steps whose dependencies are met, in graph order. Settles on the way the
        steps that can no longer run: ``skipped`` behind a failed dependency (the floor
        failing is not one: it only leaves the noise floor unmeasured), ``failed`` at once
        for a quality stage behind a failed reference pass."""
        out = []
        for s in self.steps:
            if s.state != "pending":
                continue
            if self._tier_stopped(s):
                s.state = "skipped"
                continue
            deps = [d for d in s.deps if not (d is self.floor_step and d.state in ("failed", "skipped"))]
            if s.stage == "quality" and self.ref_step is not None and self.ref_step.state == "failed":
                if all(d.state == "ok" for d in deps if d is not self.ref_step):
                    s.state = "failed"
                    s.outcome = StageOutcome(False, f"reference pass failed: {self.reference_failed}")
                elif any(d.state in ("failed", "skipped") for d in deps if d is not self.ref_step):
                    s.state = "skipped"
                continue
            if any(d.state in ("failed", "skipped") for d in deps):
                s.state = "skipped"
                continue
            if all(d.state == "ok" for d in deps):
                out.append(s)
        return out

    def _tier_stopped(self, s: _Step) -> bool:
        """A failed prepare or measure ends its tier's other stages (as in the plain order,
        where quality came after them); a failed quality or load sweep does not stop the
        speed figures."""
        if s.tier == RUN_SCOPE:
            return False
        return any(o.state == "failed" and o.stage in ("prepare", "measure") for o in self.tier_steps.get(s.tier, ()))

    def _wants_load(self, s: _Step) -> bool:
        return self.runner._wants_load(s.tier)

    def run(self) -> dict[str, TierResult]:
        """Run every step; returns ``{tier: result}`` in ``tiers`` order. Raises
        KeyboardInterrupt (after killing the running stages) when interrupted."""
        self.build()
        done: queue.Queue = queue.Queue()
        running: list[_Step] = []
        results: dict[str, TierResult] = {}
        try:
            while True:
                ready = self._ready()
                order = {id(s): i for i, s in enumerate(ready)}
                ready.sort(key=lambda s: (s.name not in self.expected, -self.expected.get(s.name, 0.0), order[id(s)]))
                first = self._timed_to_pair(ready, running)
                if first is not None:
                    ready = [first]  # alone: nothing else starts beside a timed stage
                for s in ready:
                    if running and (s.alone or any(x.alone for x in running)):
                        continue
                    if not s.timed and len(running) >= self.lanes:
                        continue
                    if s.timed and s is not first and any(not x.timed for x in self._ready() if x is not s):
                        continue  # untimed work first: it unlocks more and can pair up
                    if not self._start(s, done, running):
                        continue
                    if s.alone:
                        break
                self._finish_tiers(results)
                if not running:
                    if not self._ready():
                        break
                    continue
                s = done.get()
                running.remove(s)
                self._complete(s)
        except KeyboardInterrupt:
            self.runner.kill_stages()
            raise
        self._finish_tiers(results, final=True)
        return {t: results[t] for t in self.tiers}

    def _timed_to_pair(self, ready: list[_Step], running: list[_Step]) -> _Step | None:
        """A timed step to run before the untimed ones that are ready, or None.

        Untimed work goes first, since it can pair up; but when fewer untimed steps are
        ready than there are lanes and nothing runs, a ready timed step that some pending
        untimed step waits for runs first, so that untimed step can pair with the ready
        ones after it (e.g. a GPTQ tier's quality waits for its measure, which chooses the
        quality engine: measuring first lets the GPTQ and AWQ quality stages run side by side
        instead of one after the other)."""
        if running or self.lanes < 2:
            return None
        untimed = [s for s in ready if not s.timed]
        if not untimed or len(untimed) >= self.lanes or any(s.exclusive for s in untimed):
            return None  # an exclusive stage (GPTQ, AWQ quantizing) runs alone anyway: it goes first
        waiting = [x for x in self.steps if x.state == "pending" and not x.timed and x not in ready]
        for s in ready:
            if s.timed and any(s in x.deps for x in waiting) and (s.stage != "load" or self._wants_load(s)):
                return s
        return None

    def _start(self, s: _Step, done: queue.Queue, running: list[_Step]) -> bool:
        """Start ``s`` in a thread (False when it ends without a process: skipped or failed at once)."""
        if s.stage == "load" and not self._wants_load(s):
            s.state = "skipped"
            return False
        s.state, s.start = "running", time.time()
        s.threads = self.recipe.threads if s.timed else self.cores if s.exclusive else self.threads
        running.append(s)
        fp = tier_fingerprint(self.runner.recipe_dict, s.tier) if s.tier != RUN_SCOPE else None
        self.runner.on_event(s.tier if s.tier != RUN_SCOPE else "run", s.stage, "starting")

        def work() -> None:
            try:
                out = self.runner.run_stage(s.stage, s.tier, timeout=self.runner.stage_timeout(s.stage),
                                            fingerprint=fp, threads=s.threads)
            except BaseException as e:  # noqa: BLE001 - a crash here is this stage's failure, never lost
                out = StageOutcome(False, f"{e.__class__.__name__}: {e}")
            s.outcome = out
            done.put(s)

        threading.Thread(target=work, name=f"qeval-{s.name}", daemon=True).start()
        return True

    def _complete(self, s: _Step) -> None:
        s.end = time.time()
        out = s.outcome
        s.state = "ok" if out is not None and out.ok else "failed"
        if s.tier != RUN_SCOPE:
            self.runner.push(self.runner.layout.tier_files(s.tier))
        else:
            self.runner.push(lambda rel: self.runner.layout.run_wide_file(rel) or self.runner.layout.run_log(rel))
        if s is self.ref_step and s.state == "failed":
            self.reference_failed = (out.reason or "failed").splitlines()[0]
        if s is self.floor_step:
            self.on_floor(out)
        if s.stage == "load" and s.state == "failed":
            self.runner.on_event(s.tier, "load", f"load sweep failed: {out.reason}")

    def _finish_tiers(self, results: dict[str, TierResult], final: bool = False) -> None:
        """Write ``tiers/<tier>.json`` for every tier whose steps have all ended."""
        for tier in self.tiers:
            if tier in results:
                continue
            steps = self.tier_steps.get(tier)
            if steps is None:
                continue
            if not steps:  # a method not built yet
                results[tier] = self.runner.finish(tier, STATUS_NOT_BUILT,
                                                   error=f"method {self.recipe.tier(tier).method!r} is not built yet")
                continue
            if any(s.state in ("pending", "running") for s in steps) and not final:
                continue
            failed = next((s for s in steps if s.state == "failed" and s.stage != "load"), None)
            if failed is not None:
                o = failed.outcome or StageOutcome(False, "failed")
                results[tier] = self.runner.finish(tier, STATUS_FAILED, error=o.reason, log_tail=o.log_tail)
                self.runner.on_event(tier, "failed", failure_text(o.reason, o.log_tail))
            else:
                results[tier] = self.runner.finish(tier, STATUS_OK)
                self.runner.on_event(tier, "done", "")

    # -- what ran beside what -----------------------------------------------------------
    def schedule(self) -> list[ScheduledStage]:
        """The steps that ran, in start order, with the ones that overlapped each."""
        ran = sorted((s for s in self.steps if s.start is not None and s.end is not None), key=lambda s: s.start)
        out = []
        for s in ran:
            beside = [o.name for o in ran if o is not s and o.start < s.end and s.start < o.end]
            out.append(ScheduledStage(tier=s.tier, stage=s.stage, start_s=round(s.start - self._t0, 3),
                                      seconds=round(s.end - s.start, 3), threads=s.threads, timed=s.timed,
                                      ok=s.state == "ok", beside=beside))
        return out
