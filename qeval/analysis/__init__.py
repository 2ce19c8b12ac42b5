"""Decisions from stored tier results: Pareto front, release gate, fallback ladder,
capacity plan, run comparison. Pure Python over the JSON in a run folder; never imports
torch or loads a model."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..recipe import ParetoSpec, SpeedSpec
from ..results import RunInfo, SpeculativeStage, TierResult
from .capacity import (DEFAULT_OVERHEAD_BYTES, decode_bound, kv_bytes_per_token_from_config, max_context,
                       max_sequences, param_count_from_config, parse_bandwidth, parse_size)
from .compare import CompareRow, MetricDelta, compare_markdown, compare_runs
from .floor import FLOOR_FACTOR, INDISTINGUISHABLE, NoiseFloor, floor_not_measured, noise_floor
from .gate import (CandidateVerdict, GateReport, RuleResult, analysis_depth, as_gate_spec,
                   evaluate_gate, tier_order, validate_section)
from .ladder import Ladder, LadderStep, fallback_ladder
from .speculative import pair_summaries
from .pareto import (ParetoEntry, ParetoResult, decode_at, dominates, pareto_front, peak_bytes_at,
                     quality_value, users_at_slo_of)

__all__ = [
    "DEFAULT_OVERHEAD_BYTES", "decode_bound", "kv_bytes_per_token_from_config", "max_context", "max_sequences",
    "param_count_from_config", "parse_bandwidth", "parse_size",
    "CompareRow", "MetricDelta", "compare_markdown", "compare_runs",
    "CandidateVerdict", "GateReport", "RuleResult", "analysis_depth", "as_gate_spec",
    "evaluate_gate", "tier_order",
    "Ladder", "LadderStep", "fallback_ladder",
    "ParetoEntry", "ParetoResult", "decode_at", "dominates", "pareto_front", "peak_bytes_at",
    "quality_value", "users_at_slo_of",
    "FLOOR_FACTOR", "INDISTINGUISHABLE", "NoiseFloor", "noise_floor",
    "RunAnalysis", "analyse_run",
]


@dataclass
class RunAnalysis:
    """Everything decided from one run's stored results.

    Attributes:
        recipe: the recipe dict used (``run.json``'s unless overridden).
        depth: analysis depth in tokens (``gate.depth`` or ``speed.main_depth``).
        depths: the recipe's speed depths, ascending (tokens).
        reference: reference tier name; quality_metric: the gate's quality metric.
        tiers: ``{tier name: TierResult}`` in recipe order.
        pareto, gate, ladder: the three decisions.
        noise_floor: the run's measured noise floor (None: not measured).
        noise_floor_why: why the run's floor is missing, when it says.
        speculative: the run's speculative pairs with their predictions
            (:class:`qeval.analysis.speculative.PairSummary`; :func:`analyse_run` with
            ``speculative``); they are table rows, never gate or Pareto candidates.
    """
    recipe: dict
    depth: int
    depths: list[int]
    reference: str
    quality_metric: str
    tiers: dict[str, TierResult]
    pareto: ParetoResult
    gate: GateReport
    ladder: Ladder
    noise_floor: NoiseFloor | None = None
    noise_floor_why: str | None = None
    speculative: list = field(default_factory=list)  # PairSummary per recipe pair (qeval.analysis.speculative)


def analyse_run(run: RunInfo | None, tiers: dict[str, TierResult], recipe: dict | None = None,
                speculative: SpeculativeStage | None = None) -> RunAnalysis:
    """Pareto front, gate and ladder for a loaded run (see :func:`qeval.results.load_run`).

    Args:
        run: ``run.json`` (None: only ``recipe``).
        tiers: ``{tier name: tier result}``.
        recipe: a recipe dict (``Recipe.model_dump()``) to judge with instead of the one
            stored in ``run.recipe`` (e.g. a stricter gate on an old run).
        speculative: the run's speculative stage file (:func:`qeval.results.read_speculative`).

    Raises:
        QevalInputError: the recipe's ``speed`` or ``gate`` section does not validate.
    """
    recipe = dict(recipe if recipe is not None else (run.recipe if run is not None else {}))
    speed = validate_section(SpeedSpec, recipe.get("speed"), "speed")
    gate = as_gate_spec(recipe.get("gate"))
    depth = int(gate.depth or speed.main_depth)
    order_from = recipe if recipe.get("tiers") or run is None else run.recipe
    ordered = {n: tiers[n] for n in tier_order(order_from, tiers) if n in tiers}
    pspec = validate_section(ParetoSpec, recipe.get("pareto"), "pareto")
    floor = noise_floor(run)
    verdict = evaluate_gate(order_from, ordered, gate, depth, noise_floor=floor,
                            tiers_run=run.tiers_run if run is not None else None)
    # a candidate the gate could not judge (its reference did not finish) is kept off the front too
    errored = {c.tier: "gate error: not judged" for c in verdict.errored}
    pareto = pareto_front(ordered, depth, gate.quality_metric, reference=gate.reference, speed=pspec.speed,
                          excluded=errored)
    ladder = fallback_ladder(ordered, verdict, gate.quality_metric)
    return RunAnalysis(recipe=recipe, depth=depth, depths=sorted(speed.depths), reference=gate.reference,
                       quality_metric=gate.quality_metric, tiers=ordered, pareto=pareto, gate=verdict,
                       ladder=ladder, noise_floor=floor, noise_floor_why=floor_not_measured(run),
                       speculative=pair_summaries(speculative, ordered, gate.reference))
