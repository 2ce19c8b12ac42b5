"""What a reviewer reads before signing a release: per tier, the items that flipped against
the reference (pass->fail and fail->pass), the items that fail on the tier, each with both
answers side by side, and the positions of highest KLD.

Read from a run folder (``answers/``, ``reference/segments.json``, ``review/``; see
:mod:`qeval.results`) by the HTML report, ``qeval show``, ``qeval compare`` (item verdict
changes) and the JUnit file (a failing rule's worst items). Flips are defined as in
:mod:`qeval.measure.behaviour`: a check whose pass/fail differs from the reference's on the
same item and turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..metrics import metric
from ..results import (AnswerRow, ReviewFile, RunLayout, WorstPosition, read_answers, read_reference_answers,
                       read_reference_long_context, read_review)

#: Items listed per tier and kind in the HTML report (``qeval show`` lists all).
REPORT_LIMIT = 40


@dataclass
class CheckPair:
    """One check of an item: its one-line reasons and pass/fail on both sides (None: that
    side has no such check, or it was not decided in bounded time: a regex timeout)."""
    detail_ref: str | None
    detail_tier: str | None
    ref: bool | None
    tier: bool | None

    @property
    def flip(self) -> str | None:
        """``down`` (reference passes, tier fails), ``up`` (the reverse) or None."""
        if self.ref is None or self.tier is None or self.ref == self.tier:
            return None
        return "down" if self.ref else "up"


@dataclass
class ItemView:
    """One answered turn of a tier beside the reference's.

    Attributes:
        item: ``<suite>/<id>``; turn: 0-based turn of a conversation.
        prompt, system: the text answered (None when the run did not store it).
        ref_text, tier_text: both answers; ref_finished/tier_finished: False when the
            answer hit its token budget.
        divergence: index of the first character where the answers differ (None: identical).
        checks: per check, both sides' verdicts.
        kld_mean, kld_max: the item's KLD in nats over its answer positions (None: not scored).
        depth: a long-context answer's document depth in tokens (None for other suites).
    """
    item: str
    turn: int
    prompt: str | None
    system: str | None
    ref_text: str | None
    tier_text: str
    ref_finished: bool | None
    tier_finished: bool
    divergence: int | None
    checks: list[CheckPair] = field(default_factory=list)
    kld_mean: float | None = None
    kld_max: float | None = None
    depth: int | None = None

    @property
    def key(self) -> str:
        if self.depth is not None:
            return f"{self.item}@{self.depth}"
        return f"{self.item}#{self.turn}" if self.turn else self.item

    @property
    def flips_down(self) -> int:
        return sum(c.flip == "down" for c in self.checks)

    @property
    def flips_up(self) -> int:
        return sum(c.flip == "up" for c in self.checks)

    @property
    def failing(self) -> bool:
        return any(c.tier is False for c in self.checks)

    @property
    def verdict(self) -> str:
        """``pass`` (every check passes), ``fail`` or ``no checks``."""
        if not self.checks:
            return "no checks"
        return "fail" if self.failing else "pass"


@dataclass
class TierReview:
    """A tier's reviewable items. ``items``: every answered turn in suite order; ``flipped``
    and ``failing`` select from them; ``worst``: positions of highest KLD, largest first."""
    tier: str
    items: list[ItemView]
    worst: list[WorstPosition]
    is_reference: bool = False

    @property
    def flipped(self) -> list[ItemView]:
        return [v for v in self.items if v.flips_down or v.flips_up]

    @property
    def failing_items(self) -> list[ItemView]:
        return [v for v in self.items if v.failing]

    def find(self, item: str) -> list[ItemView]:
        """The turns of ``item`` (``suite/id``, or the bare id when unique)."""
        hits = [v for v in self.items if v.item == item]
        return hits or [v for v in self.items if v.item.split("/", 1)[-1] == item]


def divergence(a: str | None, b: str | None) -> int | None:
    """Index of the first differing character of two texts; None when equal."""
    if a is None or a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _pairs(ref: AnswerRow | None, mine: AnswerRow) -> list[CheckPair]:
    n = max(len(mine.checks), len(ref.checks) if ref else 0)

    def at(xs: list, i: int):
        return xs[i] if i < len(xs) else None
    return [CheckPair(at(ref.check_details, i) if ref else None, at(mine.check_details, i),
                      at(ref.checks, i) if ref else None, at(mine.checks, i)) for i in range(n)]


def tier_review(run_dir: str | Path, tier: str, reference: str) -> TierReview | None:
    """The review of one tier from a run folder; None when the tier has no answers.

    Args:
        run_dir: the run folder.
        tier: the tier's name; reference: the reference tier's name (``gate.reference``).

    Raises:
        QevalInputError: a malformed answers, reference or review file (names the file).
    """
    layout = RunLayout(run_dir)
    mine = read_answers(layout, tier)
    if mine is None:
        return None
    refs = (read_reference_answers(layout) or []) + (read_reference_long_context(layout) or [])
    by_key = {(r.item, r.turn, r.depth): r for r in refs}
    review: ReviewFile | None = read_review(layout, tier)
    kld = {(k.item, k.turn): k for k in (review.items if review else [])}
    items = []
    for row in mine:
        ref = by_key.get((row.item, row.turn, row.depth))
        k = kld.get((row.item, row.turn)) if row.depth is None else None
        items.append(ItemView(
            item=row.item, turn=row.turn, prompt=row.prompt, system=row.system,
            ref_text=ref.text if ref else None, tier_text=row.text,
            ref_finished=ref.finished if ref else None, tier_finished=row.finished,
            divergence=divergence(ref.text if ref else None, row.text), checks=_pairs(ref, row),
            kld_mean=k.kld_mean if k else None, kld_max=k.kld_max if k else None, depth=row.depth))
    worst = [w for w in (review.worst if review else []) if w.kld > 0]
    return TierReview(tier=tier, items=items, worst=worst, is_reference=(tier == reference))


def offending_items(review: TierReview | None, metric_name: str, n: int = 5) -> list[str]:
    """The items that most explain a failed gate rule on ``metric_name``, worst first, as
    one-line descriptions: by item KLD for fidelity metrics, pass->fail flips then failing
    items for behaviour metrics, budget-exhausted answers for budget exhaustion; empty for
    memory, speed and load metrics (no item is to blame).
    """
    if review is None:
        return []
    m = metric(metric_name)
    if m.path[:2] == ("quality", "fidelity"):
        scored = sorted((v for v in review.items if v.kld_mean is not None), key=lambda v: -v.kld_mean)
        return [f"{v.key}: KLD mean {v.kld_mean:.4g}, max {v.kld_max:.4g} nats" for v in scored[:n]]
    if m.name == "budget_exhausted_rate":
        return [f"{v.key}: answer hit its token budget" for v in review.items if not v.tier_finished][:n]
    if m.path[:2] == ("quality", "behaviour"):
        ranked = sorted(review.items, key=lambda v: (-v.flips_down, not v.failing))
        out = []
        for v in ranked:
            if not (v.flips_down or v.failing):
                break
            why = [c.detail_tier for c in v.checks if c.tier is False and c.detail_tier]
            tag = f"{v.flips_down} check(s) pass->fail" if v.flips_down else "fails"
            out.append(f"{v.key}: {tag}" + (f" ({'; '.join(why[:2])})" if why else ""))
        return out[:n]
    return []


def verdict_changes(a: TierReview | None, b: TierReview | None) -> list[tuple[str, str, str]]:
    """Items whose verdict (pass / fail / no checks) differs between two runs of one tier:
    ``[(item key, verdict in A, verdict in B)]``; an item answered in one run only shows
    ``absent`` on the other side."""
    va = {v.key: v.verdict for v in (a.items if a else [])}
    vb = {v.key: v.verdict for v in (b.items if b else [])}
    keys = list(dict.fromkeys([*va, *vb]))
    return [(k, va.get(k, "absent"), vb.get(k, "absent")) for k in keys if va.get(k, "absent") != vb.get(k, "absent")]


def run_reviews(run_dir: str | Path, tiers: list[str], reference: str) -> dict[str, TierReview]:
    """:func:`tier_review` of each named tier that has answers, in the given order.

    Raises:
        QevalInputError: a malformed answers, reference or review file (names the file).
    """
    out = {}
    for t in tiers:
        r = tier_review(run_dir, t, reference)
        if r is not None:
            out[t] = r
    return out


def item_changes_markdown(run_a: str | Path, run_b: str | Path, tiers: list[str]) -> str:
    """``qeval compare``'s per-item section: for each tier, the items whose verdict changed
    from run A to run B (:func:`verdict_changes`), as a markdown list; says so when none did.

    Raises:
        QevalInputError: a malformed answers, reference or review file (names the file).
    """
    lines = ["", "## Items that changed verdict (A → B)", ""]
    any_change = False
    for t in tiers:
        a, b = tier_review(run_a, t, ""), tier_review(run_b, t, "")
        if a is None and b is None:
            continue
        ch = verdict_changes(a, b)
        if not ch:
            lines.append(f"- {t}: no item changed verdict ({len(a.items) if a else 0} / "
                         f"{len(b.items) if b else 0} answered turns)")
            continue
        any_change = True
        lines.append(f"- {t}: {len(ch)} item(s) changed")
        lines += [f"  - `{k}`: {va} → {vb}" for k, va, vb in ch]
    if len(lines) == 3:
        lines.append("no tier has stored answers in both runs")
    elif not any_change:
        lines.append("")
    return "\n".join(lines) + "\n"
