"""The noise floor: how far the reference tier as served sits from the reference itself.

Every run with suites measures it (stage ``floor``, :func:`qeval.quality_stages.noise_floor_pass`):
the reference tier served in the model dtype (BF16), teacher-forced on the reference's
own tokens and scored against the reference pass, which computes in
``quality.reference_dtype`` (float32 on CPU by default). The same weights differ only
by compute precision there, so a KLD near that figure is not a measured effect of a
tier's quantization. llama.cpp's published KLD tables state theirs the same way (BF16
against FP16). Stored in ``run.json`` as ``noise_floor`` (:class:`qeval.results.NoiseFloorSummary`,
:func:`qeval.run.floor_summary`).

Rules (docs/design.md, "Noise floor"):

* a tier whose mean KLD is at most :data:`FLOOR_FACTOR` x the floor's mean KLD is
  "indistinguishable from the reference here" (table, report and gate messages);
* a gate ``max_kld_mean`` below the floor cannot be told apart from noise: ``qeval
  validate`` refuses it when the floor is known from a previous run
  (:func:`previous_floor`, or ``--floor-from RUN_DIR``), and the verdict flags it when
  the floor is only known from the run being judged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import QevalInputError
from ..metrics import finite
from ..recipe import stable_tier_dict
from ..results import NoiseFloorSummary, RunInfo, RunLayout, read_run_info

FLOOR_FACTOR = 2.0
"""A tier within this many times the floor's mean KLD is indistinguishable from the reference."""
INDISTINGUISHABLE = "indistinguishable from the reference here"


@dataclass
class NoiseFloor:
    """A measured noise floor.

    Attributes:
        kld_mean: mean KLD (nats) of the reference tier as served against the reference.
        kld_se: its standard error (nats), or None.
        tier: the reference tier's name.
        served_dtype: the dtype the tier was served in (``bfloat16``).
        reference_dtype: the dtype the reference pass computed in (``float32``).
        source: where the figure comes from (``this run`` or a run folder's path).
    """
    kld_mean: float
    kld_se: float | None = None
    tier: str | None = None
    served_dtype: str | None = None
    reference_dtype: str | None = None
    source: str = "this run"

    @property
    def threshold(self) -> float:
        """KLD (nats) at or below which a tier is indistinguishable: FLOOR_FACTOR x kld_mean."""
        return FLOOR_FACTOR * self.kld_mean

    def indistinguishable(self, kld: float | None) -> bool:
        """True when ``kld`` (nats) is a finite number within :attr:`threshold`."""
        k = finite(kld)
        return k is not None and k <= self.threshold

    @property
    def what(self) -> str:
        """``bf16 served in bfloat16 against the float32 reference``."""
        return (f"{self.tier or 'the reference tier'} served in {self.served_dtype or '?'} "
                f"against the {self.reference_dtype or '?'} reference")

    def text(self) -> str:
        """One line for tables and reports."""
        se = f" ± {self.kld_se:.2g}" if self.kld_se is not None else ""
        return (f"noise floor: KLD {self.kld_mean:.2g}{se} nats ({self.what}); a tier with KLD at most "
                f"{self.threshold:.2g} ({FLOOR_FACTOR:g}x) is {INDISTINGUISHABLE}")

    def to_dict(self) -> dict:
        return {**asdict(self), "threshold": self.threshold, "factor": FLOOR_FACTOR}


def _summary(run: RunInfo | None) -> NoiseFloorSummary | None:
    return run.noise_floor if run is not None else None


def noise_floor(run: RunInfo | None, source: str = "this run") -> NoiseFloor | None:
    """The measured floor of a run from its ``noise_floor``; None when the run has none,
    or it was not measured (reference computed in the served dtype, no suites, a failed
    floor stage), or its mean KLD is not a positive finite number."""
    f = _summary(run)
    if f is None or not f.measured:
        return None
    k = finite(f.kld_mean)
    if k is None or k <= 0:
        return None
    return NoiseFloor(kld_mean=k, kld_se=finite(f.kld_se), tier=f.tier, served_dtype=f.served_dtype,
                      reference_dtype=f.reference_dtype, source=source)


def floor_not_measured(run: RunInfo | None) -> str | None:
    """Why a run's floor is missing (its ``noise_floor.why``), or None."""
    f = _summary(run)
    return f.why if f is not None and not f.measured else None


def _same_floor_conditions(recipe: Any, old: dict) -> bool:
    """Whether a stored run's floor applies to ``recipe``: same model, reference tier spec,
    ``quality.reference_dtype`` and ``device``."""
    ref = recipe.gate.reference
    mine_ref = stable_tier_dict(recipe.tier(ref).model_dump(mode="json"))
    old_ref = next((t for t in old.get("tiers") or [] if isinstance(t, dict) and t.get("name") == ref), None)
    return (old.get("model") == recipe.model.model_dump(mode="json") and stable_tier_dict(old_ref) == mine_ref
            and (old.get("quality") or {}).get("reference_dtype", "auto") == recipe.quality.reference_dtype
            and old.get("device") == recipe.device
            and (old.get("gate") or {}).get("reference", "bf16") == ref)


def previous_floor(recipe: Any, roots: Iterable[Path]) -> NoiseFloor | None:
    """The floor of the newest earlier run of ``recipe`` measured under the same conditions.

    Looks in ``<root>/<recipe name>/*/run.json`` for every root (``qeval run`` writes to
    ``results/`` by default, or ``<storage>/results/`` for a mounted storage path), newest
    run folder first (folder names are UTC timestamps), and takes the first whose floor was
    measured with the same model, reference tier, ``quality.reference_dtype`` and device.
    """
    runs: list[Path] = []
    for root in roots:
        d = Path(root).expanduser() / recipe.name
        if d.is_dir():
            runs += [p for p in d.iterdir() if (p / "run.json").is_file()]
    for rd in sorted(runs, key=lambda p: p.name, reverse=True):
        try:
            run = read_run_info(RunLayout(rd))
        except QevalInputError:  # an unreadable or older-format run.json: not evidence of a floor
            continue
        nf = noise_floor(run, source=str(rd))
        if nf is not None and _same_floor_conditions(recipe, run.recipe or {}):
            return nf
    return None


def floor_from_run(run_dir: Path) -> NoiseFloor:
    """The floor measured in run folder ``run_dir`` (``--floor-from``).

    Raises:
        QevalInputError: not a run folder, or its run.json holds no measured floor (says why).
    """
    layout = RunLayout(run_dir)
    p = layout.run_json
    if not layout.is_run():
        raise QevalInputError("not a qeval run folder (no run.json)", file=run_dir, field="--floor-from")
    run = read_run_info(layout)
    nf = noise_floor(run, source=str(run_dir))
    if nf is None:
        why = floor_not_measured(run) or "the run predates noise floors or had no suites"
        raise QevalInputError(f"this run has no measured noise floor ({why})", file=p, field="--floor-from")
    return nf


def check_rules_against_floor(recipe: Any, floor: NoiseFloor | None) -> None:
    """Refuse a gate KLD rule the floor makes meaningless.

    Raises:
        QevalInputError: ``gate.rules.max_kld_mean`` is below ``floor.kld_mean`` (names the
            field's line, the floor's value and where it was measured).
    """
    if floor is None:
        return
    v = recipe.gate.rules.max_kld_mean
    if v is not None and v < floor.kld_mean:
        raise recipe.error(("gate", "rules", "max_kld_mean"),
                           f"{v:g} is below the noise floor {floor.kld_mean:.3g} nats measured in {floor.source} "
                           f"({floor.what}): even the reference tier as served does not meet it; set it to at "
                           f"least {floor.kld_mean:.3g} (KLD up to {floor.threshold:.3g} reads as "
                           f"{INDISTINGUISHABLE})")


def rule_below_floor(rules: dict, floor: NoiseFloor | None) -> str | None:
    """For a verdict: the warning when the set ``max_kld_mean`` is below the floor, else None."""
    v = finite(rules.get("max_kld_mean"))
    if floor is None or v is None or v >= floor.kld_mean:
        return None
    return (f"gate rule max_kld_mean = {v:g} is below the noise floor {floor.kld_mean:.3g} nats measured in "
            f"{floor.source} ({floor.what}): no tier can be told apart from the reference at that level")
