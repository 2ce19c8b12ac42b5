"""The ``local`` executor: tier after tier on this machine, each stage in a child process
(:meth:`qeval.stages.TierRunner.run_tier`). With ``lanes`` > 1 the run pipelines untimed
stages of different tiers itself (:mod:`qeval.pipeline`), which it may because this
executor runs the tiers from the run's own process (``in_process``)."""
from __future__ import annotations

from ..results import TierResult
from ..stages import TierRunner


class LocalExecutor:
    """Tier after tier on this machine.

    Args:
        address: unused (the executors' common constructor).
    """
    name = "local"
    in_process = True

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def run_tiers(self, runner: TierRunner, tiers: list[str], reference_failed: str | None) -> dict[str, TierResult]:
        """Each tier's unfinished stages in turn (:meth:`~qeval.stages.TierRunner.run_tier`)."""
        return {tier: runner.run_tier(tier, reference_failed) for tier in tiers}


EXECUTOR = LocalExecutor
