"""Executors: where each tier's stages run. The :class:`~qeval.run.Runner` is given one.

Registered by name, as engines, tier methods and managed servers are
(:mod:`qeval.plugins`): every module of this package that defines ``EXECUTOR`` (a class
with ``name``, ``in_process`` and ``run_tiers``, built as ``cls(ray_address)``) is an
executor, so adding one is adding its module:

* ``local`` (default, :mod:`qeval.executors.local`): tier after tier on this machine, each
  stage in a child process (:meth:`qeval.stages.TierRunner.run_tier`); with ``lanes`` > 1
  the run's own pipeline runs untimed stages side by side (:mod:`qeval.pipeline`).
* ``ray`` (:mod:`qeval.executors.ray`): each tier's stages run as one Ray task asking
  for the recipe's ``resources``, so tiers run side by side on a cluster.

A recipe's ``executor:`` (or ``--executor``) names one.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..errors import QevalInputError
from ..plugins import one_each, registered
from ..results import TierResult
from ..stages import TierRunner

_REGISTRY: dict[str, Any] | None = None


class Executor(Protocol):
    """Runs tiers of a run folder and returns their results.

    Attributes:
        name: the registered name (the recipe's ``executor``).
        in_process: it runs the tiers from this process, so the run may pipeline untimed
            stages of different tiers itself (:meth:`qeval.run.Runner.run_pipelined`).
    """
    name: str
    in_process: bool

    def run_tiers(self, runner: TierRunner, tiers: list[str], reference_failed: str | None) -> dict[str, TierResult]:
        """Run every tier in ``tiers`` (their unfinished stages) and return ``{tier: result}``
        in that order; ``reference_failed`` (why the reference pass failed, or None) fails
        each tier's quality stage. A tier's failure is its result, never an exception."""
        ...


def _registry() -> dict[str, Any]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = one_each(((m, cls.name, cls) for m, cls in registered(__name__, __path__, "EXECUTOR")),
                             "executor")
    return _REGISTRY


def executor_names() -> tuple[str, ...]:
    """Names of the registered executors, sorted."""
    return tuple(sorted(_registry()))


def make_executor(name: str, ray_address: str | None = None, recipe: Any = None) -> Executor:
    """The executor called ``name``, built with ``ray_address`` (executors that reach a
    cluster use it; the others ignore it).

    Raises:
        QevalInputError: an unknown name: the recipe's ``executor`` line when ``recipe``
            (a :class:`~qeval.recipe.Recipe`) is given, else ``--executor``.
    """
    cls = _registry().get(name)
    if cls is None:
        msg = f"unknown executor {name!r} (known: {', '.join(executor_names())})"
        if recipe is not None:
            raise recipe.error(("executor",), msg)
        raise QevalInputError(msg, field="--executor")
    return cls(ray_address)
