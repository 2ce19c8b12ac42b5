"""Progress of a run a person can plan around: an overall bar (stages done of all, elapsed,
time remaining estimated from this machine's earlier stage times) above one line per
running stage in a terminal, and one line per finished stage with its seconds and the same
estimate in non-interactive logs (CI). With no earlier time for some stages the estimate is
a lower bound and says how many stages it lacks; with none at all it says so.

The display is rich's (``rich.progress.Progress``: bars, elapsed and remaining columns);
what this module adds is the plan of a run's stages and the stage-time history the
estimate comes from: ``$QEVAL_CACHE/stage_times.json``, ``{recipe name: {"tier.stage":
seconds}}``, the last time each stage took on this machine (a warm run's reused stages are
short, so the estimate follows what the cache holds now).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .paths import cache_root
from .results import RUN_SCOPE, RunLayout, stage_done
from .stage_keys import TIMED_STAGES

HISTORY_NAME = "stage_times.json"


def history_path() -> Path:
    """``$QEVAL_CACHE/stage_times.json``."""
    return cache_root() / HISTORY_NAME


def read_history(recipe_name: str, path: Path | None = None) -> dict[str, float]:
    """``{"tier.stage": seconds}`` of ``recipe_name``'s last run here; {} when none or unreadable."""
    try:
        data = json.loads((path or history_path()).read_text())
        got = data.get(recipe_name) if isinstance(data, dict) else None
        return {str(k): float(v) for k, v in (got or {}).items() if isinstance(v, (int, float))}
    except (OSError, ValueError, AttributeError):
        return {}


def write_history(recipe_name: str, times: dict[str, float], path: Path | None = None) -> None:
    """Merge ``times`` into the history file (atomically; an unwritable cache is ignored)."""
    path = path or history_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data.setdefault(recipe_name, {}).update({k: round(v, 2) for k, v in times.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def planned_stages(recipe, tiers: list[str], layout: RunLayout) -> list[str]:
    """``tier.stage`` of every stage the run will start, less those already done (a
    resumed run): the run-wide source, env, reference and floor (with suites), then each
    tier's prepare, measure, load (when ``load.enabled``; engines that cannot batch skip
    it) and quality (with suites); the run-wide speculative stage last (with pairs)."""
    plan = [f"{RUN_SCOPE}.source", f"{RUN_SCOPE}.env"]
    if recipe.suites:
        plan += [f"{RUN_SCOPE}.reference", f"{RUN_SCOPE}.floor"]
    for t in tiers:
        plan += [f"{t}.prepare", f"{t}.measure"]
        if recipe.load.enabled:
            plan.append(f"{t}.load")
        if recipe.suites:
            plan.append(f"{t}.quality")
    if getattr(recipe, "speculative", None):
        plan.append(f"{RUN_SCOPE}.speculative")
    return [p for p in plan if not stage_done(layout, *p.split(".", 1))]


def estimate_left(todo: list[str], history: dict[str, float], lanes: int = 1,
                  running: dict[str, float] | None = None) -> tuple[float, list[str]]:
    """Seconds left for the stages of ``todo`` that ``history`` has a time for, and the
    stages it has none for.

    Timed stages (:data:`qeval.stages.TIMED_STAGES`) run one after another, untimed ones
    ``lanes`` at a time (:mod:`qeval.pipeline`); a running stage counts what its history
    says is left of it (``running``: seconds it has run so far, never below 0 left). A
    stage with no earlier time is not guessed from another tier's (a quantization can
    take a thousand times another's): it is returned in the second list.

    Returns:
        ``(seconds, [tier.stage without history])``.
    """
    running = running or {}
    timed = untimed = 0.0
    unknown: list[str] = []
    for name in todo:
        if name not in history:
            unknown.append(name)
            continue
        left = max(0.0, history[name] - running.get(name, 0.0))
        if name.split(".", 1)[1] in TIMED_STAGES:
            timed += left
        else:
            untimed += left
    return timed + untimed / max(1, lanes), unknown


def estimate_remaining(todo: list[str], history: dict[str, float], lanes: int = 1,
                       running: dict[str, float] | None = None) -> float | None:
    """Seconds left (:func:`estimate_left`); None when a stage still to run has no history
    (a first run), so no figure is invented."""
    left, unknown = estimate_left(todo, history, lanes, running)
    return None if unknown else left


def eta_text(todo: list[str], history: dict[str, float], lanes: int = 1,
             running: dict[str, float] | None = None) -> str:
    """The estimate as the progress line shows it: ``about 12:30 left``; ``at least 4:10
    left (3 stages not timed here before)`` when part of the plan has no earlier time on
    this machine; ``time left unknown: ...`` when none of it has."""
    if not todo:
        return "finishing"
    left, unknown = estimate_left(todo, history, lanes, running)
    if not unknown:
        return f"about {_clock(left)} left"
    if len(unknown) == len(todo):
        return "time left unknown: no earlier run of this recipe on this machine"
    n = len(unknown)
    return f"at least {_clock(left)} left ({n} stage{'s' if n != 1 else ''} not timed here before)"


def _clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    m, s = divmod(int(round(seconds)), 60)
    if m >= 60:
        h, m = divmod(m, 60)
        return f"{h}:{m:02d}:{s:02d}"
    return f"{m}:{s:02d}"


class RunProgress:
    """The display of one run (see the module docstring); fed by the runner's
    ``on_event`` and ``on_stage_end`` callbacks, from any thread.

    Args:
        console: where to draw (a terminal gets bars; anything else gets lines).
        recipe_name: the history's key.
        plan: ``tier.stage`` of the stages to run (:func:`planned_stages`).
        lanes: untimed stages side by side (for the estimate).
        history_file: default ``$QEVAL_CACHE/stage_times.json``.
        clock: seconds now (default ``time.time``): the elapsed time and the running stages'
            ages in the estimate read it (tests pass a fake one; rich's own elapsed column in
            a terminal keeps rich's clock).
    """

    def __init__(self, console: Console, recipe_name: str, plan: list[str], lanes: int = 1,
                 history_file: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.console = console
        self.name = recipe_name
        self.todo = list(plan)
        self.total = len(plan)
        self.lanes = lanes
        self.history_file = history_file
        self.history = read_history(recipe_name, history_file)
        self.times: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.clock = clock
        self.t0 = clock()
        self.lock = threading.Lock()
        self.interactive = console.is_terminal
        self.progress: Progress | None = None
        self.overall: Any = None
        self.lines: dict[str, Any] = {}

    # -- the rich display ---------------------------------------------------------------
    def __enter__(self) -> "RunProgress":
        if self.interactive:
            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
                                     console=self.console, transient=True)
            self.overall = self.progress.add_task("[bold]run[/]", total=max(1, self.total), eta=self._eta_text())
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
        write_history(self.name, self.times, self.history_file)

    def _eta_text(self) -> str:
        now = self.clock()
        return eta_text(self.todo, self.history, self.lanes, {k: now - v for k, v in self.started.items()})

    # -- callbacks ----------------------------------------------------------------------
    def event(self, tier: str, stage: str, msg: str) -> None:
        """``on_event``: a stage starting or reporting progress (``done``/``failed`` tier
        lines are the CLI's)."""
        if stage in ("done", "failed", "storage"):
            return
        key = f"{RUN_SCOPE if tier == 'run' else tier}.{stage}"
        with self.lock:
            if msg == "starting":
                self.started[key] = self.clock()
            if self.progress is None:
                return
            text = f"  [bold]{escape(stage)}[/] [cyan]{escape(tier)}[/] {escape(msg if msg != 'starting' else '')}"
            if key not in self.lines:
                self.lines[key] = self.progress.add_task(text, total=None, eta="")
            else:
                self.progress.update(self.lines[key], description=text)
            self.progress.update(self.overall, eta=self._eta_text())

    def stage_end(self, tier: str, stage: str, seconds: float, ok: bool, reason: str | None = None) -> None:
        """``on_stage_end``: count it, remember its time, print its line (a failed stage's
        line ends with ``reason``'s first line: ``FAILED quality t: killed by SIGILL ...``)."""
        key = f"{tier}.{stage}"
        with self.lock:
            self.times[key] = seconds
            if key in self.todo:
                self.todo.remove(key)
            self.started.pop(key, None)
            line = f"  {seconds:7.1f} s  {'' if ok else 'FAILED '}{stage} {'(run)' if tier == RUN_SCOPE else tier}"
            if not ok and reason and reason.strip():
                line += f": {reason.strip().splitlines()[0]}"
            if self.progress is not None:
                if key in self.lines:
                    self.progress.remove_task(self.lines.pop(key))
                self.progress.update(self.overall, completed=self.total - len(self.todo), eta=self._eta_text())
                self.progress.console.print(escape(line), highlight=False)
            else:
                done = self.total - len(self.todo)
                self.console.print(f"{escape(line)}  [{done}/{self.total}, {_clock(self.clock() - self.t0)} elapsed, "
                                   f"{escape(self._eta_text())}]", highlight=False)
