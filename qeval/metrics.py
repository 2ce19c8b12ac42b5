"""The metric table: every figure the decisions and reports read from a tier result, with
its path, unit and direction, and the release-gate rules built on them.

Read by the gate (:mod:`qeval.analysis.gate`), the Pareto front, the fallback ladder, the
plots, the tier tables and ``qeval compare``; the recipe's ``gate.quality_metric`` choices
and ``gate.rules`` fields are made from it (:mod:`qeval.recipe`). Definitions of the
figures are in docs/design.md and the modules that measure them (``qeval.measure``).

Adding a metric is adding a :class:`Metric` to :data:`METRICS` (and, to gate on it, a
:class:`GateRule` to :data:`GATE_RULES`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from .errors import QevalInputError
from .results import get_path

GIB = 2 ** 30
DEPTH = "{depth}"  # placeholder in a path for the context depth (tokens), a string key
LC = ("quality", "long_context", "depths", DEPTH)  # a long_context suite's figures at one document depth


@dataclass(frozen=True)
class Metric:
    """One figure of a tier result.

    Attributes:
        name: the metric's name (recipe ``gate.quality_metric``, compare and table keys).
        path: keys into the tier result (:class:`qeval.results.TierResult`); ``DEPTH``
            stands for the depth (tokens) of a per-depth figure.
        unit: ``bytes``, ``bytes/token``, ``s``, ``tokens/s``, ``nats``, ``share`` (0..1),
            ``ratio`` or ``bits``.
        direction: ``min`` (lower is better) or ``max``.
        label: short name for people (tables, plots).
        objective: can be the quality objective of the Pareto front and the ladder
            (``gate.quality_metric``).
        reference_value: the reference tier's value by definition when its result lacks it
            (KLD 0, PPL ratio 1: the reference is not scored against itself).
    """
    name: str
    path: tuple[str, ...]
    unit: str
    direction: Literal["min", "max"]
    label: str
    objective: bool = False
    reference_value: float | None = None

    @property
    def per_depth(self) -> bool:
        return DEPTH in self.path

    def where(self, depth: int | None = None) -> str:
        """The dotted path, with the depth filled in (``speed.1024.decode_tokens_per_s``)."""
        return ".".join(str(depth) if p == DEPTH else p for p in self.path)

    @property
    def axis_label(self) -> str:
        """``KLD mean vs reference (nats, lower is better)`` style label for a plot axis."""
        unit = "" if self.unit in ("share", "ratio") else f"{self.unit}, "
        vs = " vs reference" if self.reference_value is not None else ""
        return f"{self.label}{vs} ({unit}{'lower' if self.direction == 'min' else 'higher'} is better)"


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("weight_bytes", ("memory", "weight_bytes"), "bytes", "min", "weights"),
    Metric("bits_per_weight", ("quant", "bits_per_weight"), "bits", "min", "bits/weight"),
    Metric("kv_bytes_per_token", ("memory", "kv_bytes_per_token"), "bytes/token", "min", "KV bytes/token"),
    Metric("peak_bytes", ("memory", "peak_bytes", DEPTH), "bytes", "min", "peak memory"),
    # the peak's split (qeval.measure.memory.peak_breakdown) and the runtime it sits on
    Metric("peak_weights_bytes", ("memory", "peak_breakdown", DEPTH, "weights_bytes"), "bytes", "min",
           "peak: weights"),
    Metric("peak_kv_cache_bytes", ("memory", "peak_breakdown", DEPTH, "kv_cache_bytes"), "bytes", "min",
           "peak: KV cache"),
    Metric("peak_other_bytes", ("memory", "peak_breakdown", DEPTH, "other_bytes"), "bytes", "min",
           "peak: rest"),
    Metric("reserved_unallocated_bytes", ("memory", "reserved_unallocated_bytes", DEPTH), "bytes", "min",
           "reserved, unallocated"),
    Metric("runtime_bytes", ("memory", "runtime_bytes"), "bytes", "min", "runtime memory"),
    Metric("runtime_engine_bytes", ("memory", "runtime_engine_bytes"), "bytes", "min", "engine libraries"),
    Metric("ttft_s", ("speed", DEPTH, "ttft_s"), "s", "min", "TTFT"),
    Metric("decode_tokens_per_s", ("speed", DEPTH, "decode_tokens_per_s"), "tokens/s", "max", "decode"),
    Metric("roofline_share", ("speed", DEPTH, "roofline_share"), "share", "max", "roofline share"),
    Metric("kld_mean", ("quality", "fidelity", "kld_mean"), "nats", "min", "KLD mean", objective=True,
           reference_value=0.0),
    Metric("kld_se", ("quality", "fidelity", "kld_se"), "nats", "min", "KLD standard error"),
    Metric("same_top_rate", ("quality", "fidelity", "same_top_rate"), "share", "max", "same-top rate",
           reference_value=1.0),
    Metric("ppl_ratio", ("quality", "fidelity", "ppl_ratio"), "ratio", "min", "PPL ratio", objective=True,
           reference_value=1.0),
    Metric("pass_rate", ("quality", "behaviour", "pass_rate"), "share", "max", "pass rate", objective=True),
    Metric("pass_ci_low", ("quality", "behaviour", "pass_ci_low"), "share", "max", "pass rate 95% lower bound"),
    Metric("pass_ci_high", ("quality", "behaviour", "pass_ci_high"), "share", "max", "pass rate 95% upper bound"),
    Metric("flip_rate", ("quality", "behaviour", "flip_rate"), "share", "min", "flip rate"),
    Metric("flips_down", ("quality", "behaviour", "flips_pass_to_fail"), "checks", "min", "pass->fail flips"),
    Metric("flips_up", ("quality", "behaviour", "flips_fail_to_pass"), "checks", "max", "fail->pass flips"),
    Metric("n_compared", ("quality", "behaviour", "n_compared"), "checks", "max", "checks paired with the reference"),
    Metric("n_checks", ("quality", "behaviour", "n_checks"), "checks", "max", "checks decided"),
    Metric("users_at_slo", ("load", "users_at_slo"), "users", "max", "users at SLO"),
    # long-context suite, per document depth (DEPTH: the long_context depth in tokens; the gate's is gate.depth)
    Metric("lc_recall", LC + ("recall",), "share", "max", "long-context recall"),
    Metric("lc_recall_ci_low", LC + ("recall_ci_low",), "share", "max", "long-context recall 95% lower bound"),
    Metric("lc_recall_ci_high", LC + ("recall_ci_high",), "share", "max", "long-context recall 95% upper bound"),
    Metric("lc_flip_rate", LC + ("flip_rate",), "share", "min", "long-context flip rate"),
    Metric("lc_flips_down", LC + ("flips_pass_to_fail",), "questions", "min", "long-context pass->fail flips"),
    Metric("lc_flips_up", LC + ("flips_fail_to_pass",), "questions", "max", "long-context fail->pass flips"),
    Metric("lc_n_compared", LC + ("n_compared",), "questions", "max", "long-context questions paired with the reference"),
    Metric("lc_n_questions", LC + ("n_questions",), "questions", "max", "long-context questions"),
    Metric("lc_kld_mean", LC + ("fidelity", "kld_mean"), "nats", "min", "KLD mean over the last document tokens",
           reference_value=0.0),
    Metric("lc_same_top_rate", LC + ("fidelity", "same_top_rate"), "share", "max",
           "same-top rate over the last document tokens", reference_value=1.0),
    Metric("lc_ppl_ratio", LC + ("fidelity", "ppl_ratio"), "ratio", "min", "PPL ratio over the last document tokens",
           reference_value=1.0),
    Metric("budget_exhausted_rate", ("quality", "behaviour", "budget_exhausted_rate"), "share", "min",
           "budget exhaustion rate"),
    # output length of the free-running answers against the reference's on the same turns
    # (qeval.measure.output_length): a tier that talks longer serves fewer requests per second
    Metric("output_tokens_mean", ("quality", "output_length", "mean_new_tokens"), "tokens", "min",
           "new tokens per answer"),
    Metric("output_tokens_p95", ("quality", "output_length", "p95_new_tokens"), "tokens", "min",
           "new tokens per answer, p95"),
    Metric("output_tokens_rel", ("quality", "output_length", "mean_ratio"), "ratio", "min",
           "new tokens per answer vs reference", reference_value=1.0),
)}

#: Metrics the Pareto front and the ladder can use as their quality objective.
OBJECTIVES: tuple[str, ...] = tuple(n for n, m in METRICS.items() if m.objective)
#: The Pareto front's memory objective (at the analysis depth) and its speed objectives by
#: the recipe's ``pareto.speed``: single-stream decode at the depth, or the load sweep's
#: users at SLO (capacity).
MEMORY_OBJECTIVE = "peak_bytes"
SPEED_OBJECTIVES: dict[str, str] = {"decode": "decode_tokens_per_s", "users_at_slo": "users_at_slo"}
SPEED_OBJECTIVE = SPEED_OBJECTIVES["decode"]


def finite(x: Any) -> float | None:
    """``float(x)`` when ``x`` is a finite number (not bool), else None (an integer beyond
    float range, e.g. 10**400 in a hostile tier JSON, counts as missing too)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        x = float(x)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def metric(name: str) -> Metric:
    """The :class:`Metric` called ``name``.

    Raises:
        QevalInputError: unknown name (lists the known ones).
    """
    try:
        return METRICS[name]
    except KeyError:
        raise QevalInputError(f"unknown metric {name!r} (expected one of: {', '.join(METRICS)})") from None


def objective(name: str) -> Metric:
    """The quality objective ``name`` (``kld_mean``, ``ppl_ratio``, ``pass_rate``).

    Raises:
        QevalInputError: not an objective metric.
    """
    if name not in OBJECTIVES:
        raise QevalInputError(f"unknown quality metric {name!r} (expected one of: {', '.join(OBJECTIVES)})")
    return METRICS[name]


def value(tier: Any, name: str, depth: int | None = None, *, is_reference: bool = False) -> float | None:
    """The finite value of metric ``name`` in a tier result (None when missing or not a
    finite number); per-depth metrics at ``depth`` (tokens). For the reference tier a
    missing value with a ``reference_value`` (KLD 0, PPL ratio 1) is that value.

    Raises:
        QevalInputError: unknown metric.
    """
    m = metric(name)
    keys = [str(depth) if p == DEPTH else p for p in m.path]
    v = finite(get_path(tier, *keys))
    if v is None and is_reference and m.reference_value is not None:
        return m.reference_value
    return v


# ---- gate rules ------------------------------------------------------------------------

@dataclass(frozen=True)
class GateRule:
    """A release-gate rule on one metric (a field of the recipe's ``gate.rules``).

    Attributes:
        name: the rule (``max_kld_mean``).
        metric: the candidate's metric it bounds.
        bound: ``max`` (value <= threshold) or ``min`` (value >= threshold).
        kind: ``absolute`` (value against the threshold), ``ratio`` (value / the
            reference's value of the same metric against the threshold) or ``of_reference``
            (value against threshold x the reference's ``reference_metric``).
        reference_metric: for ``of_reference``, the reference's metric.
        scale: the threshold's unit in the metric's (``max_peak_memory_gib``: GiB = 2**30 bytes).
        ge, gt, le: bounds of the threshold itself (recipe validation).
        description: for the recipe schema.
        missing_hint: said after "missing <figure>" when the candidate lacks it.
        evidence: how the rule decides (:mod:`qeval.analysis.evidence`): ``paired`` (the
            candidate's rate against ``threshold x`` the reference's on the same checks:
            McNemar's exact test on ``counts``' discordant pairs with the suite's power),
            ``share`` (a share's one-sided exact bounds against the threshold), or None (the
            figure against the threshold as it is).
        counts: the metrics of (checks down, checks up, checks paired) for ``evidence``.
        needs: what the recipe must compute for the figure to exist (``qeval validate``
            refuses the rule otherwise): ``suites`` (any quality suite: fidelity),
            ``behaviour`` (a long_output or multi_turn suite), ``long_context`` (a
            long_context suite at the gate depth), ``load`` (the load sweep), or None.
    """
    name: str
    metric: str
    bound: Literal["max", "min"]
    kind: Literal["absolute", "ratio", "of_reference"] = "absolute"
    reference_metric: str | None = None
    scale: float = 1.0
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    description: str | None = None
    missing_hint: str | None = None
    evidence: Literal["paired", "share"] | None = None
    counts: tuple[str, str, str] | None = None
    needs: Literal["suites", "behaviour", "long_context", "load"] | None = None


_BEHAVIOUR_COUNTS = ("flips_down", "flips_up", "n_compared")
_LC_COUNTS = ("lc_flips_down", "lc_flips_up", "lc_n_compared")

#: Every gate rule, in the order they are checked and reported.
GATE_RULES: dict[str, GateRule] = {r.name: r for r in (
    GateRule("max_kld_mean", "kld_mean", "max", ge=0, needs="suites",
             description="mean KLD (nats) of the tier's next-token distributions against the reference's <= this"),
    GateRule("min_same_top_rate", "same_top_rate", "min", ge=0, le=1, needs="suites",
             description="share of scored positions whose most likely token is the reference's >= this (0..1)"),
    GateRule("max_ppl_ratio", "ppl_ratio", "max", gt=0, needs="suites",
             description="perplexity on the reference's tokens / the reference's own perplexity <= this"),
    GateRule("min_pass_rate_rel", "pass_rate", "min", "of_reference", reference_metric="pass_rate", ge=0, le=1,
             evidence="paired", counts=_BEHAVIOUR_COUNTS, needs="behaviour",
             description="candidate pass rate >= this x the reference's, decided on the checks both answered "
                         "(McNemar's exact test on the discordant checks, with the suite's power; "
                         "gate.insufficient_evidence says what a suite too small to decide does)"),
    GateRule("min_recall_rel", "lc_recall", "min", "of_reference", reference_metric="lc_recall", ge=0, le=1,
             evidence="paired", counts=_LC_COUNTS, needs="long_context",
             description="long-context recall at the gate depth >= this x the reference's recall there, decided "
                         "on the questions both answered as min_pass_rate_rel (the gate depth must be a "
                         "long_context depth)",
             missing_hint="no long-context result at the gate depth"),
    GateRule("max_flip_rate", "flip_rate", "max", ge=0, le=1, evidence="share", counts=_BEHAVIOUR_COUNTS,
             needs="behaviour",
             description="share of suite checks whose verdict differs from the reference's (either way) <= this, "
                         "decided by its exact one-sided 95% bounds"),
    GateRule("max_peak_memory_gib", "peak_bytes", "max", scale=GIB, gt=0,
             description="model peak memory at the gate depth <= this many GiB (2**30 bytes)"),
    GateRule("max_peak_memory_rel", "peak_bytes", "max", "ratio", gt=0,
             description="model peak memory at the gate depth / the reference's <= this"),
    GateRule("min_decode_tokens_per_s", "decode_tokens_per_s", "min", ge=0,
             description="single-stream decode tokens/s at the gate depth >= this"),
    GateRule("min_decode_rel", "decode_tokens_per_s", "min", "ratio", ge=0,
             description="single-stream decode tokens/s at the gate depth / the reference's >= this"),
    GateRule("max_budget_exhaustion", "budget_exhausted_rate", "max", ge=0, le=1, needs="behaviour",
             description="share of free-running answers that hit their token budget <= this (0..1)"),
    GateRule("max_output_tokens_rel", "output_tokens_rel", "max", gt=0, needs="behaviour",
             description="candidate's mean new tokens per free-running answer / the reference's on the same "
                         "turns <= this (a tier that talks longer serves fewer requests at the same tokens/s)",
             missing_hint="no free-running answers (no long_output or multi_turn suite)"),
    GateRule("min_users_at_slo_rel", "users_at_slo", "min", "of_reference", reference_metric="users_at_slo", ge=0,
             needs="load",
             description="candidate users at SLO (load sweep) >= this x the reference's",
             missing_hint="no load sweep"),
)}


# ---- display -----------------------------------------------------------------------------

# unit -> (unit shown, multiplier, format): bytes as GiB (2**30), shares as %.
_DISPLAY: dict[str, tuple[str, float, str]] = {"bytes": ("GiB", 1 / GIB, ".2f"), "share": ("%", 100.0, ".1f"),
                                              "nats": ("nats", 1.0, ".4f")}


def display_unit(name: str) -> str:
    """The unit a metric is shown in (``GiB`` for bytes, ``%`` for shares, else its own)."""
    m = metric(name)
    return _DISPLAY.get(m.unit, (m.unit, 1.0, ".2f"))[0]


def format_value(name: str, v: float | None, signed: bool = False) -> str:
    """A metric's value in its display unit (``-`` for None); ``signed`` for deltas."""
    if v is None:
        return "-"
    m = metric(name)
    _, mult, fmt = _DISPLAY.get(m.unit, (m.unit, 1.0, ".2f"))
    return f"{v * mult:{'+' if signed else ''}{fmt}}"
