"""``qeval show RUN_DIR TIER``: a tier's flipped and failing items in the terminal (rich),
with the reference's answer beside the tier's, the first divergence marked, every check of
both sides, and the positions of highest KLD; the same content as the report's review
section (:mod:`qeval.report.review`), for CI logs and people who live in a shell.
"""
from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .review import ItemView, TierReview


def _answer(text: str | None, d: int | None, missing: str) -> Text:
    if text is None:
        return Text(missing, style="dim")
    t = Text(text[:d] if d is not None else text)
    if d is not None:
        t.append(text[d:] or "⟂ (ends here)", style="black on yellow")
    return t


def item_panel(v: ItemView, tier: str, is_reference: bool) -> Panel:
    """One item as a rich panel: prompt, both answers side by side, checks."""
    tags = []
    if v.flips_down:
        tags.append(f"[red]↓ {v.flips_down} pass→fail[/red]")
    if v.flips_up:
        tags.append(f"[green]↑ {v.flips_up} fail→pass[/green]")
    if v.failing:
        tags.append("[yellow]fails here[/yellow]")
    if not v.tier_finished:
        tags.append("[yellow]hit its token budget[/yellow]")
    if v.kld_mean is not None:
        tags.append(f"KLD mean {v.kld_mean:.4g}, max {v.kld_max:.4g} nats")
    parts: list = []
    if v.prompt is not None:
        parts.append(Text("prompt: ", style="bold") + Text(v.prompt))
    if is_reference and v.ref_text is None:  # no reference pass answer beside it (served dtype = reference dtype)
        parts.append(Text("answer: ", style="bold") + Text(v.tier_text))
    else:
        pair = Table(expand=True, show_lines=False, box=None)
        pair.add_column("reference" + ("" if v.ref_finished is not False else " (hit its budget)"), ratio=1)
        div = "identical" if v.divergence is None else f"first divergence at character {v.divergence}"
        pair.add_column(f"{tier} · {div}", ratio=1)
        pair.add_row(_answer(v.ref_text, v.divergence, "(no reference answer)"),
                     _answer(v.tier_text, v.divergence, ""))
        parts.append(pair)
    checks = Table(box=None, show_header=True, header_style="bold")
    checks.add_column("check")
    checks.add_column("ref")
    checks.add_column(tier)
    checks.add_column("why")
    for c in v.checks:
        mark = "" if c.flip is None else (" ↓" if c.flip == "down" else " ↑")
        checks.add_row((c.detail_ref or c.detail_tier or "").split(":")[0],
                       "-" if c.ref is None else ("✔" if c.ref else "✘"),
                       ("-" if c.tier is None else ("✔" if c.tier else "✘")) + mark, c.detail_tier or "")
    if v.checks:
        parts.append(checks)
    return Panel(Group(*parts), title=f"{v.key}  {'  '.join(tags)}", title_align="left")


def show(console: Console, review: TierReview, *, item: str | None = None, flips: bool = False,
         failing: bool = False) -> int:
    """Print a tier's review. ``item``: that item's turns only; ``flips``/``failing``: only
    those lists (both when neither is set); the highest-KLD positions close a full listing.

    Returns:
        the number of items printed.
    """
    if item is not None:
        views = review.find(item)
        for v in views:
            console.print(item_panel(v, review.tier, review.is_reference))
        return len(views)
    both = not flips and not failing
    n = 0
    head = f"{review.tier}{' (reference)' if review.is_reference else ''}: {len(review.flipped)} flipped, " \
           f"{len(review.failing_items)} failing of {len(review.items)} answered turns"
    console.print(Text(head, style="bold"))
    if (flips or both) and (not review.is_reference or review.flipped):
        # the reference tier's own flips are against the reference pass (float32 by default): the noise floor's
        console.rule("flipped against the reference" + (" pass (the noise floor's own flips)" if review.is_reference else ""))
        for v in review.flipped:
            console.print(item_panel(v, review.tier, False))
            n += 1
        if not review.flipped:
            console.print("no item flipped", style="dim")
    if failing or both:
        console.rule(f"failing on {review.tier}")
        for v in review.failing_items:
            console.print(item_panel(v, review.tier, review.is_reference))
            n += 1
        if not review.failing_items:
            console.print("no failing item", style="dim")
    if both and review.worst:
        console.rule("positions of highest KLD")
        t = Table(show_header=True, header_style="bold")
        for c in ("item", "token", "KLD", "context → reference token", "reference top", f"{review.tier} top"):
            t.add_column(c)
        for w in review.worst:
            t.add_row(w.item + (f"#{w.turn}" if w.turn else ""), str(w.position), f"{w.kld:.4g}",
                      Text("…" + w.context[-60:]) + Text(" → ") + Text(repr(w.target), style="black on yellow"),
                      "\n".join(f"{tok!r} {p:.3f}" for tok, p in w.ref_top),
                      "\n".join(f"{tok!r} {p:.3f}" for tok, p in w.tier_top))
        console.print(t)
    return n
