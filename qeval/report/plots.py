"""Report plots as PNG bytes (matplotlib, Agg canvas; pyplot's global state is never touched).

Each function returns ``None`` when there is nothing to draw, so the report can say so
instead of showing an empty chart.
"""
from __future__ import annotations

import io
import re
from typing import Any

from ..analysis.pareto import GIB, ParetoResult, decode_at
from ..metrics import metric, objective
from ..metrics import value as metric_value
from ..results import STATUS_OK, LoadSlo, TierResult, get_path

_DPI = 100
_SIZE = (8.0, 4.6)  # inches


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up time: only the report draws
    from matplotlib.figure import Figure  # start-up time: only the report draws

    fig = Figure(figsize=_SIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _finish(fig, ax, xlabel: str, ylabel: str, title: str) -> bytes:
    """Label a one-axes plot (y from 0, light grid, legend) and return its PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _color(i: int) -> str:
    """Colour of the i-th tier in recipe order (the same tier has the same colour in every plot)."""
    return f"C{i % 10}"


def quality_vs_memory_png(pareto: ParetoResult) -> bytes | None:
    """Scatter of quality (y) against peak memory at the depth (x, GiB); marker area grows
    with decode tokens/s at that depth. Front members are filled, dominated ones hollow.
    Only tiers that took part in the front are drawn; colours follow tier order as in the
    other plots."""
    color_of = {e.tier: _color(i) for i, e in enumerate(pareto.entries)}
    pts = [e for e in pareto.entries if e.status in ("front", "dominated")]
    if not pts:
        return None
    from matplotlib.lines import Line2D  # start-up time: only the report draws

    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    top = max(e.decode_tokens_per_s or 0.0 for e in pts) or 1.0
    handles = []
    for e in pts:
        c = color_of[e.tier]
        size = 40 + 460 * (e.decode_tokens_per_s or 0.0) / top
        on = e.status == "front"
        ax.scatter([e.memory_bytes / GIB], [e.quality], s=size, alpha=0.8, facecolors=c if on else "none",
                   edgecolors=c, linewidths=1.8)
        label = f"{e.tier}: {e.decode_tokens_per_s:.3g} tok/s" + ("  (front)" if on else "  (dominated)")
        handles.append(Line2D([], [], linestyle="", marker="o", markersize=7, color=c,
                              markerfacecolor=c if on else "none", label=label))
    ax.legend(handles=handles, fontsize=8, loc="best", framealpha=0.9)
    ax.set_xlabel(f"peak memory at depth {pareto.depth} (GiB)")
    ax.set_ylabel(objective(pareto.quality_metric).axis_label)
    ax.set_title("Quality vs memory (marker size = decode tokens/s; filled = Pareto front)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.25, y=0.2)
    return _png(fig)


def decode_vs_depth_png(tiers: dict[str, TierResult], depths: list[int]) -> bytes | None:
    """Decode tokens/s (y) against context depth (x, tokens, log scale) per ok tier."""
    series = {}
    color_of = {n: _color(i) for i, n in enumerate(tiers)}
    for name, t in tiers.items():
        if t.status != STATUS_OK:
            continue
        pts = [(d, decode_at(t, d)) for d in depths]
        pts = [(d, v) for d, v in pts if v is not None]
        if pts:
            series[name] = pts
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in series.items():
        ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=name, color=color_of[name])
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(depths))
    ax.set_xticklabels([str(d) for d in depths])
    return _finish(fig, ax, "context depth (tokens)", "decode tokens/s", "Decode speed vs context depth")


def _bucket_start(label: str) -> float:
    m = re.match(r"\s*(\d+)", str(label))
    return float(m.group(1)) if m else float("inf")


def kld_by_bucket_png(tiers: dict[str, TierResult]) -> bytes | None:
    """KLD mean (nats) per position bucket inside long outputs
    (``quality.fidelity.kld_by_bucket``), one line per ok tier; buckets ordered by start."""
    series: dict[str, dict[str, float]] = {}
    color_of = {n: _color(i) for i, n in enumerate(tiers)}
    for name, t in tiers.items():
        b = get_path(t, "quality", "fidelity", "kld_by_bucket")
        if t.status == STATUS_OK and isinstance(b, dict):
            vals = {k: float(v) for k, v in b.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if vals:
                series[name] = vals
    if not series:
        return None
    buckets = sorted({k for v in series.values() for k in v}, key=_bucket_start)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, vals in series.items():
        xs = [i for i, k in enumerate(buckets) if k in vals]
        ax.plot(xs, [vals[buckets[i]] for i in xs], marker="o", label=name, color=color_of[name])
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels(buckets)
    return _finish(fig, ax, "position inside long outputs (tokens)", "KLD mean (nats)",
                   "Drift along long outputs: KLD by position bucket")


def _load_series(tiers: dict[str, TierResult], key: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """Per ok tier with a load sweep: ``{tier: [(concurrency, value)]}`` of admitted points,
    ``{tier: [concurrency not admitted]}`` and ``{tier: colour}``."""
    color_of = {n: _color(i) for i, n in enumerate(tiers)}
    series: dict[str, list] = {}
    refused: dict[str, list] = {}
    for name, t in tiers.items():
        pts = t.load.points if t.load is not None else []
        if t.status != STATUS_OK or not pts:
            continue
        ok = [(p.concurrency, _attr(p, key)) for p in pts if p.admitted]
        ok = [(c, float(v)) for c, v in ok if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if ok:
            series[name] = ok
        bad = [p.concurrency for p in pts if not p.admitted]
        if bad:
            refused[name] = bad
    return series, refused, color_of


def _attr(obj: Any, key: tuple[str, ...]) -> Any:
    """``obj.k1.k2`` (a model's attributes, or a dict's keys), None when a level is missing."""
    for k in key:
        obj = obj.get(k) if isinstance(obj, dict) else getattr(obj, k, None)
        if obj is None:
            return None
    return obj


def _rate_series(tiers: dict[str, TierResult], key: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """Per ok tier with an open loop: ``{tier: [(offered rate rps, value)]}`` over its rate
    points (x: the rate asked), ``{tier: knee rps}`` and ``{tier: colour}``."""
    color_of = {n: _color(i) for i, n in enumerate(tiers)}
    series: dict[str, list] = {}
    knees: dict[str, float] = {}
    for name, t in tiers.items():
        ar = t.load.arrivals if t.load is not None else None
        if t.status != STATUS_OK or ar is None:
            continue
        pts = [(float(p.rate_rps), _attr(p, key)) for p in ar.rate_points if p.rate_rps and not p.reason]
        pts = [(x, float(v)) for x, v in pts if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if pts:
            series[name] = pts
        if ar.knee is not None and ar.knee.rate_rps is not None:
            knees[name] = float(ar.knee.rate_rps)
    return series, knees, color_of


def _rate_axis(ax: Any, xs: list[float]) -> None:
    """The offered-rate axis: log2 when the rates span 8x or more (a default recipe's 0.25 and
    4 req/s), else linear from 0; ticks at the measured rates."""
    if xs and xs[0] > 0 and xs[-1] / xs[0] >= 8:
        ax.set_xscale("log", base=2)
    else:
        ax.set_xlim(left=0)
    if xs:
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.set_xlabel("offered rate (req/s)")


def rate_png(tiers: dict[str, TierResult], slo: LoadSlo | None) -> bytes | None:
    """Three panels against the offered rate (req/s): achieved rate (the dotted diagonal:
    achieved = offered), TTFT p95 and ITL p95 (s; dashed: the SLO); one line per tier with
    an open loop, its knee a vertical dotted line in the tier's colour."""
    ach, knees, color_of = _rate_series(tiers, ("achieved_rps",))
    ttft, _, _ = _rate_series(tiers, ("ttft_s", "p95"))
    itl, _, _ = _rate_series(tiers, ("itl_s", "p95"))
    if not ach and not ttft:
        return None
    from matplotlib.figure import Figure  # start-up time: only the report draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up time: only the report draws
    fig = Figure(figsize=(_SIZE[0] * 2.0, _SIZE[1]), dpi=_DPI)
    FigureCanvasAgg(fig)
    panels = ((ach, "achieved req/s", None), (ttft, "TTFT p95 (s)", "ttft_p95_s"), (itl, "ITL p95 (s)", "itl_p95_s"))
    xs = sorted({x for pts in ach.values() for x, _ in pts} | {x for pts in ttft.values() for x, _ in pts})
    for i, (series, what, key) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        for name, pts in series.items():
            ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", label=name, color=color_of[name])
        for name, k in knees.items():
            ax.axvline(k, linestyle=":", color=color_of[name], linewidth=1.2)
        if key is None and xs:
            ax.plot([xs[0], xs[-1]], [xs[0], xs[-1]], linestyle=":", color="#777777", linewidth=1,
                    label="achieved = offered")
        limit = _attr(slo, (key,)) if key else None
        if isinstance(limit, (int, float)):
            ax.axhline(limit, linestyle="--", color="#9b1c1c", linewidth=1.2, label=f"SLO {limit:g} s")
        _rate_axis(ax, xs)
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{what.split(' (')[0]} vs offered rate", fontsize=10)
        ax.legend(fontsize=7, loc="best")
    return _png(fig)


def error_rate_png(tiers: dict[str, TierResult], max_error_rate: float | None) -> bytes | None:
    """Error rate in % (refused + timed out + failed, of arrived requests) against the
    offered rate (req/s), one line per tier with an open loop; dashed: the SLO's limit;
    dotted verticals: the knees."""
    series, knees, color_of = _rate_series(tiers, ("error_rate",))
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in series.items():
        ax.plot([x for x, _ in pts], [100 * v for _, v in pts], marker="o", label=name, color=color_of[name])
    for name, k in knees.items():
        ax.axvline(k, linestyle=":", color=color_of[name], linewidth=1.2)
    if isinstance(max_error_rate, (int, float)):
        ax.axhline(100 * max_error_rate, linestyle="--", color="#9b1c1c", linewidth=1.2,
                   label=f"limit {100 * max_error_rate:g}%")
    _rate_axis(ax, sorted({x for pts in series.values() for x, _ in pts}))
    ax.set_ylabel("error rate (% of requests)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title("Refused, timed out and failed vs offered rate", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _concurrency_axis(ax, series: dict, refused: dict) -> None:
    xs = sorted({c for pts in series.values() for c, _ in pts} | {c for v in refused.values() for c in v})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("concurrent streams (closed loop)")
    ax.grid(True, alpha=0.3)


def load_throughput_png(tiers: dict[str, TierResult]) -> bytes | None:
    """Aggregate decode tokens/s (y) against concurrency (x, log2), one line per tier with
    a load sweep; a point not admitted is an ``x`` on the x axis."""
    series, refused, color_of = _load_series(tiers, ("decode_tokens_per_s",))
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in series.items():
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name, color=color_of[name])
    for name, cs in refused.items():
        ax.scatter(cs, [0] * len(cs), marker="x", s=60, color=color_of[name],
                   label=f"{name}: not admitted" if name in series else name)
    _concurrency_axis(ax, series, refused)
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs concurrency (x on the axis: not admitted)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def load_latency_png(tiers: dict[str, TierResult], slo: LoadSlo | dict | None) -> bytes | None:
    """TTFT p95 (left) and ITL p95 (right) in seconds against concurrency (log2), one line
    per tier with a load sweep; the recipe's SLO drawn as a dashed line on each."""
    ttft, refused, color_of = _load_series(tiers, ("ttft_s", "p95"))
    itl, _, _ = _load_series(tiers, ("itl_s", "p95"))
    if not ttft and not itl:
        return None
    from matplotlib.figure import Figure  # start-up time: only the report draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up time: only the report draws
    fig = Figure(figsize=(_SIZE[0] * 1.4, _SIZE[1]), dpi=_DPI)
    FigureCanvasAgg(fig)
    for i, (series, what, key) in enumerate(((ttft, "TTFT p95 (s)", "ttft_p95_s"),
                                             (itl, "ITL p95 (s)", "itl_p95_s"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, pts in series.items():
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name, color=color_of[name])
        limit = _attr(slo, (key,))
        if isinstance(limit, (int, float)):
            ax.axhline(limit, linestyle="--", color="#9b1c1c", linewidth=1.2, label=f"SLO {limit:g} s")
        _concurrency_axis(ax, series or ttft, refused)
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{what.split(' (')[0]} vs concurrency", fontsize=10)
        ax.legend(fontsize=8, loc="best")
    return _png(fig)


def long_context_png(tiers: dict[str, TierResult], depths: list[int], reference: str | None = None) -> bytes | None:
    """Two panels against document depth (x, tokens, log scale): long-context recall in %
    (metric ``lc_recall``) and KLD mean in nats over the last document tokens (``lc_kld_mean``;
    the reference's is 0 by definition). One line per ok tier; tiers with an int8 KV cache
    are dashed."""
    color_of = {n: _color(i) for i, n in enumerate(tiers)}
    series: dict[str, tuple[list, list]] = {}
    for name, t in tiers.items():
        if t.status != STATUS_OK:
            continue
        rec, kld = [], []
        for d in depths:
            r = metric_value(t, "lc_recall", d)
            k = metric_value(t, "lc_kld_mean", d, is_reference=name == reference and r is not None)
            if r is not None:
                rec.append((d, 100 * r))
            if k is not None:
                kld.append((d, k))
        if rec or kld:
            series[name] = (rec, kld)
    if not series:
        return None
    fig = _figure()
    axes = (fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2))
    for name, (rec, kld) in series.items():
        style = "--" if tiers[name].kv_cache == "int8" else "-"
        for ax, pts in zip(axes, (rec, kld)):
            if pts:
                ax.plot([d for d, _ in pts], [v for _, v in pts], style, marker="o", label=name,
                        color=color_of[name])
    for ax, m in zip(axes, ("lc_recall", "lc_kld_mean")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(depths))
        ax.set_xticklabels([str(d) for d in depths])
        ax.set_xlabel("document depth (tokens)")
        ax.set_ylabel(("recall (% of questions)" if m == "lc_recall" else metric(m).axis_label), fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(0, 100)
    axes[0].set_title("Long-context recall vs depth", fontsize=10)
    axes[1].set_title("Fidelity at depth: KLD vs depth", fontsize=10)
    axes[0].legend(fontsize=7, loc="best")
    return _png(fig)


# ---- the workloads: shared prefix, interference, context x concurrency grid ----------------

def prefix_ttft_png(tiers: dict[str, TierResult]) -> bytes | None:
    """TTFT p95 (s) against concurrency (log2) per tier with a shared-prefix workload: solid
    line with the prefix's KV reused, dashed with it prefilled per request."""
    names = list(tiers)
    fig = None
    for i, (name, t) in enumerate(tiers.items()):
        pre = t.load.prefix if t.load is not None else None
        if pre is None:
            continue
        for run in pre.runs:
            pts = [(p.concurrency, p.ttft_s.p95) for p in run.points if p.admitted and p.ttft_s and p.ttft_s.p95
                   is not None]
            if not pts:
                continue
            if fig is None:
                fig = _figure()
                ax = fig.add_subplot(1, 1, 1)
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", color=_color(names.index(name)),
                    linestyle="-" if run.reuse else "--",
                    label=f"{name}: {'reused' if run.reuse else 'prefilled'}"
                          + (f" ({run.hit_rate:.0%} from cache)" if run.reuse and run.hit_rate is not None else ""))
    if fig is None:
        return None
    xs = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("concurrent streams (closed loop)")
    ax.set_ylabel("TTFT p95 (s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title("TTFT with a shared prefix: reused (solid) vs prefilled per request (dashed)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def interference_png(tiers: dict[str, TierResult]) -> bytes | None:
    """The running streams' largest inter-token gap (left) and ITL p99 (right) in the window
    a long prefill spans, per prefill chunk size (x: unchunked, then ascending chunks), one
    line per tier that measured it."""
    names = list(tiers)
    rows = {n: t.load.interference.rows for n, t in tiers.items()
            if t.load is not None and t.load.interference is not None and t.load.interference.rows}
    if not rows:
        return None
    from matplotlib.figure import Figure  # start-up time: only the report draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up time: only the report draws
    labels = ["unchunked"] + [str(c) for c in sorted({r.chunk_size for rs in rows.values() for r in rs
                                                       if r.chunk_size is not None})]
    fig = Figure(figsize=(_SIZE[0] * 1.4, _SIZE[1]), dpi=_DPI)
    FigureCanvasAgg(fig)
    for i, (what, key) in enumerate((("largest gap in the window (s)", "max_gap_s"),
                                     ("ITL p99 in the window (s)", "itl_p99_s"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, rs in rows.items():
            pts = [(labels.index("unchunked" if r.chunk_size is None else str(r.chunk_size)), getattr(r, key))
                   for r in rs if getattr(r, key) is not None]
            ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", label=name,
                    color=_color(names.index(name)))
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_xlabel("long prompt's prefill chunk (tokens per step)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return _png(fig)


def grid_heatmap_png(tiers: dict[str, TierResult]) -> bytes | None:
    """Users at SLO per depth as a heat map: one row per tier with a grid, one column per
    depth; each cell says the number (0: none met the SLO; grey "not admitted": the KV pool
    held no cell of that depth)."""
    grids = {n: t.load.grid for n, t in tiers.items() if t.load is not None and t.load.grid is not None}
    if not grids:
        return None
    depths = sorted({g.depth for grid in grids.values() for g in grid.depths})
    names = list(grids)
    import numpy as np  # start-up time: only the report draws
    vals = np.full((len(names), len(depths)), np.nan)
    label = [["-"] * len(depths) for _ in names]
    for i, n in enumerate(names):
        for g in grids[n].depths:
            j = depths.index(g.depth)
            if not any(p.admitted for p in g.points):
                label[i][j] = "not admitted"
            elif g.users_at_slo is not None:
                vals[i, j] = g.users_at_slo
                label[i][j] = f"{g.users_at_slo}"
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    top = float(np.nanmax(vals)) if np.isfinite(vals).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(vals), cmap="viridis", aspect="auto", vmin=0, vmax=max(top, 1.0))
    ax.set_facecolor("#dddddd")  # no figure (not admitted, not measured): grey
    for i in range(len(names)):
        for j in range(len(depths)):
            v = vals[i, j]
            dark = np.isnan(v) or v > 0.6 * max(top, 1.0)  # black text on grey and on the bright end
            ax.text(j, i, label[i][j], ha="center", va="center", color="k" if dark else "w", fontsize=9)
    ax.set_xticks(range(len(depths)))
    ax.set_xticklabels([str(d) for d in depths])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.set_xlabel("depth (prompt tokens)")
    ax.set_title("Users at SLO per depth (context x concurrency)", fontsize=10)
    fig.colorbar(im, ax=ax, label="users at SLO")
    return _png(fig)


def speculative_png(summaries: list) -> bytes | None:
    """Accepted draft tokens per verification step (y) against the draft length k (x), one
    colour per pair and depth: measured (solid, markers) and predicted from the fidelity run
    (dashed; :class:`qeval.analysis.speculative.PairSummary`), with y = k dotted (every drafted
    token accepted). None when no pair has figures."""
    series = []
    for s in summaries:
        for d in sorted({r.depth for r in s.pair.rows}):
            rows = sorted((r for r in s.pair.rows if r.depth == d and r.mean_accepted is not None),
                          key=lambda r: r.draft_tokens)
            if rows:
                series.append((f"{s.name} @{d}", [(r.draft_tokens, r.mean_accepted, s.predicted(r.draft_tokens))
                                                   for r in rows]))
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ks = sorted({k for _, pts in series for k, _, _ in pts})
    ax.plot(ks, ks, linestyle=":", color="grey", label="k (all accepted)")
    for i, (label, pts) in enumerate(series):
        ax.plot([k for k, _, _ in pts], [m for _, m, _ in pts], marker="o", color=_color(i), label=f"{label} measured")
        pred = [(k, p) for k, _, p in pts if p is not None]
        if pred:
            ax.plot([k for k, _ in pred], [p for _, p in pred], linestyle="--", color=_color(i),
                    label=f"{label} predicted")
    ax.set_xticks(ks)
    return _finish(fig, ax, "draft length k (tokens proposed per step)", "accepted draft tokens per step",
                   "Speculative decoding: acceptance against draft length")
