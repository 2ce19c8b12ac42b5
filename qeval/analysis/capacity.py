"""Capacity plan: how many sequences fit, and how long a context N users can each have.

Formula (docs/design.md "Capacity"; Kwon et al. 2023, vLLM / PagedAttention,
arXiv:2309.06180, §2: the KV cache grows linearly with tokens and what is left after the
weights bounds the batch)::

    free        = M - weights - overhead                        (bytes)
    sequences   = floor(free / (kv_bytes_per_token * c))        at context c tokens
    max context = floor(free / (kv_bytes_per_token * N))        for N concurrent users

When ``free`` is negative nothing fits: both are 0.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
(docs/glossary.md).

Sliding-window layers (Gemma 3, mistral; issue 64) keep at most ``window`` tokens, so a
sequence's KV at context c is ``full x c + sliding x min(c, window)`` (``full`` and
``sliding``: bytes per token of the full and of the sliding layers,
:func:`kv_split_from_config`); :func:`max_sequences` and :func:`max_context` take
``sliding=(sliding bytes per token, window)`` for it, ``kv_bytes_per_token`` then being the
full layers' figure. Without it a hybrid model's figure is either every layer's (an upper
bound past the window) or a run's slope between depths past the window (the full layers
only: too low by ``sliding x window`` per sequence).

Decode bound (docs/design.md "Roofline"): one decode step reads every weight once and the
K/V of every cached token, so at context c one stream makes at most
``bandwidth / (weights + kv_bytes_per_token * c)`` tokens/s and N streams batched together
at most ``N * bandwidth / (weights + N * kv_bytes_per_token * c)`` (:func:`decode_bound`).
:mod:`qeval.analysis.plan` builds ``qeval plan``'s table from these formulas.

Overhead default (:data:`DEFAULT_OVERHEAD_BYTES`): a flat 1 GiB for the CUDA context,
allocator slack and activations of one decode step. It is a deliberately simple,
documented allowance, not a measurement; pass ``overhead_bytes`` to use your own.

:mod:`qeval.analysis.plan` applies these per tier, to measured figures of a run or to
estimates from a Hugging Face ``config.json`` (:mod:`qeval.weight_formats`).

:func:`load_vs_formula` puts the formulas beside the load sweep's measured points: for N
streams at context c = load depth + output tokens the memory formula needs
``weights + overhead + N x c x kv_bytes_per_token`` bytes and the N-stream decode bound is
:func:`decode_bound`; the sweep measured the peak (``load.points[].peak_bytes``), the
aggregate decode tokens/s, and whether the point met the SLO.

Output length (:func:`requests_per_s_at_slo`): the load sweep gives every request the
recipe's fixed ``output_tokens``; a tier whose free-running answers run ``r`` times as long
as the reference's on the same turns (``quality.output_length.mean_ratio``,
:mod:`qeval.measure.output_length`) needs ``r x output_tokens`` decode tokens per request, so
at the same decode tokens/s it serves ``1 / r`` as many requests per second.
"""
from __future__ import annotations

import math
import re
import sys

from dataclasses import asdict, dataclass

from ..errors import QevalInputError
from ..model_config import model_shape
from ..results import STATUS_OK, TierResult, get_path
from .pareto import GIB, finite

#: Flat overhead allowance in bytes (1 GiB): CUDA context, allocator slack, activations.
DEFAULT_OVERHEAD_BYTES = GIB

_UNITS = {"": 1, "b": 1,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


#: Largest size :func:`parse_size` accepts (2**70 bytes, a zebibyte): anything above is a typo.
MAX_SIZE_BYTES = 2 ** 70


def parse_size(text: str | int, *, field: str | None = None) -> int:
    """Parse a memory size into bytes (the one size parser of qeval's flags and data files).

    Accepts a plain integer number of bytes (``"1073741824"`` or an int), or a number with
    a unit: decimal ``B, KB, MB, GB, TB`` (10**3 steps) or binary ``KiB, MiB, GiB, TiB``
    (2**10 steps), case-insensitive, optional space: ``"24GiB"``, ``"24 GB"``,
    ``"1.5GiB"``, ``"512MiB"``. Results are rounded to whole bytes.

    Raises:
        QevalInputError: empty, negative, non-numeric, fractional plain bytes, above
            :data:`MAX_SIZE_BYTES`, or an unknown or ambiguous unit (``"24G"``: say GiB or GB).
    """
    if isinstance(text, bool):
        raise QevalInputError(f"not a memory size: {text!r}", field=field)
    if isinstance(text, int):
        if text < 0:
            raise QevalInputError(f"memory size must not be negative (got {text})", field=field)
        return text
    if not isinstance(text, str):
        raise QevalInputError(f"not a memory size: {text!r}", field=field)
    m = _SIZE.match(text)
    if not m:
        raise QevalInputError(f"not a memory size: {text!r} (expected e.g. 24GiB, 24GB, 512MiB, "
                              "1073741824)", field=field)
    num, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        hint = " (ambiguous: write GiB for 2**30 or GB for 10**9)" if unit in ("k", "m", "g", "t") else ""
        raise QevalInputError(f"unknown size unit {m.group(2)!r} in {text!r}{hint}", field=field)
    value = float(num) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE_BYTES:
        raise QevalInputError(f"size {text[:40]!r} is too large (at most 2**70 bytes)", field=field)
    if _UNITS[unit] == 1 and "." in num and float(num) != int(float(num)):
        raise QevalInputError(f"a byte count must be whole: {text!r}", field=field)
    return int(round(value))


def parse_bandwidth(text: str | int | float, *, field: str | None = None) -> float:
    """Parse a memory bandwidth into bytes/s: a size as :func:`parse_size` reads it, with an
    optional ``/s`` (``"1008GB/s"``, ``"3.35 TB/s"``, ``"400GB"``, ``"1008000000000"``).

    Raises:
        QevalInputError: what :func:`parse_size` refuses, or zero.
    """
    if isinstance(text, float) and not isinstance(text, bool):
        if not math.isfinite(text) or text <= 0:
            raise QevalInputError(f"not a bandwidth: {text!r}", field=field)
        return text
    t = text.strip()[:-2].rstrip() if isinstance(text, str) and text.strip().lower().endswith("/s") else text
    v = parse_size(t, field=field)
    if v <= 0:
        raise QevalInputError(f"bandwidth must be positive (got {text!r})", field=field)
    return float(v)


def format_gib(n: float | None, digits: int = 2) -> str:
    """``n`` bytes as ``"x.xx GiB"``; ``"-"`` for None."""
    return "-" if n is None else f"{n / GIB:.{digits}f} GiB"


def decode_bound(bandwidth_bytes_per_s: float, weights_bytes: float, kv_bytes_per_token: float,
                 context: int, streams: int = 1) -> float:
    """Roofline bound on decode tokens/s (all streams together) when ``streams`` sequences
    of ``context`` tokens each decode in one batch:
    ``streams * bandwidth / (weights + streams * kv_bytes_per_token * context)``.

    Each step reads every weight once (shared by the batch) and each stream's cached K/V
    (docs/design.md "Roofline"; the same bound as :func:`qeval.measure.bandwidth.roofline_tokens_per_s`
    for one stream). Compute is not modelled: at large batches it, not memory, binds.

    Raises:
        QevalInputError: non-positive bandwidth or weights, negative KV or context, streams < 1.
    """
    if bandwidth_bytes_per_s <= 0 or weights_bytes <= 0 or kv_bytes_per_token < 0 or context < 0 or streams < 1:
        raise QevalInputError("decode bound needs positive bandwidth and weights, and at least one stream")
    return streams * bandwidth_bytes_per_s / (weights_bytes + streams * kv_bytes_per_token * context)


def _sliding_args(sliding: tuple[float, int] | None) -> tuple[float, int]:
    if sliding is None:
        return 0.0, 0
    per, window = sliding
    if per < 0 or int(window) <= 0:
        raise QevalInputError(f"sliding layers' KV bytes/token ({per}) and window ({window}) must be positive")
    return float(per), int(window)


def max_sequences(budget_bytes: float, weights_bytes: float, overhead_bytes: float,
                  kv_bytes_per_token: float, context: int, *, sliding: tuple[float, int] | None = None) -> int:
    """``floor((M - weights - overhead) / (kv_bytes_per_token * context))``, at least 0;
    with ``sliding=(bytes per token, window)`` of the sliding layers, a sequence holds
    ``kv_bytes_per_token * context + sliding bytes * min(context, window)``.

    Raises:
        QevalInputError: ``context`` or ``kv_bytes_per_token`` not positive (with
            ``sliding``: the full layers' figure may be 0, not both).
    """
    s_per, window = _sliding_args(sliding)
    if context <= 0 or kv_bytes_per_token < 0 or (kv_bytes_per_token <= 0 and (not sliding or s_per <= 0)):
        raise QevalInputError(f"context ({context}) and KV bytes/token ({kv_bytes_per_token}) must be positive")
    free = budget_bytes - weights_bytes - overhead_bytes
    return _floor_share(free, kv_bytes_per_token * context + s_per * min(context, window))


def max_context(budget_bytes: float, weights_bytes: float, overhead_bytes: float,
                kv_bytes_per_token: float, users: int, *, sliding: tuple[float, int] | None = None) -> int:
    """Longest context (tokens) each of ``users`` concurrent sequences can have:
    ``floor((M - weights - overhead) / (kv_bytes_per_token * users))``, at least 0. With
    ``sliding=(bytes per token, window)``: the largest c with ``users x
    (kv_bytes_per_token x c + sliding x min(c, window))`` within the budget (past the window
    only the full layers grow; no full layer: unbounded by the KV, ``sys.maxsize``).

    Raises:
        QevalInputError: ``users`` or ``kv_bytes_per_token`` not positive (with
            ``sliding``: the full layers' figure may be 0, not both).
    """
    s_per, window = _sliding_args(sliding)
    if users <= 0 or kv_bytes_per_token < 0 or (kv_bytes_per_token <= 0 and (not sliding or s_per <= 0)):
        raise QevalInputError(f"users ({users}) and KV bytes/token ({kv_bytes_per_token}) must be positive")
    free = budget_bytes - weights_bytes - overhead_bytes
    if not sliding:
        return _floor_share(free, kv_bytes_per_token * users)
    inside = _floor_share(free, (kv_bytes_per_token + s_per) * users)
    if inside <= window:  # the budget runs out inside the window: every layer grows
        return inside
    if kv_bytes_per_token <= 0:
        return sys.maxsize
    past = free / users - s_per * window
    return _floor_share(past, kv_bytes_per_token)


def kv_split_from_config(config: dict, kv_dtype_bytes: float = 2) -> tuple[float, float, int | None]:
    """``(full, sliding, window)``: KV bytes per token of the full-attention layers and of
    the sliding ones, and the window, from a HF config (:func:`qeval.model_config.model_shape`);
    ``sliding`` 0 and ``window`` None without sliding layers. A sequence at context c holds
    ``full x c + sliding x min(c, window)``.

    Raises:
        QevalInputError: as :func:`kv_bytes_per_token_from_config`.
    """
    shape = model_shape(config)
    per_layer = shape.kv_elements_per_layer_token * kv_dtype_bytes
    if not shape.sliding_layers:
        return per_layer * shape.layers, 0.0, None
    return per_layer * shape.full_layers, per_layer * shape.sliding_layers, shape.sliding_window


def _floor_share(free: float, per: float) -> int:
    """``max(0, floor(free / per))``.

    Raises:
        QevalInputError: the quotient is not a finite number (figures far out of range).
    """
    q = free / per
    if not math.isfinite(q):
        raise QevalInputError(f"capacity figures out of range ({free:.3g} bytes free, {per:.3g} bytes per unit)")
    return max(0, math.floor(q))


def kv_bytes_per_token_from_config(config: dict, kv_dtype_bytes: float = 2) -> float:
    """KV cache bytes per token: ``2 x num_hidden_layers x kv_heads x head_dim x kv_dtype_bytes``
    (every layer: for sliding layers an upper bound past their window, :func:`kv_split_from_config`).

    ``kv_heads`` is ``num_key_value_heads`` (default ``num_attention_heads``); ``head_dim``
    is ``head_dim`` (default ``hidden_size / num_attention_heads``).

    Raises:
        QevalInputError: a required field is missing or not a positive integer.
    """
    return model_shape(config).kv_elements_per_token * kv_dtype_bytes


def param_count_from_config(config: dict) -> int:
    """Parameter count of a llama/qwen2-style decoder from its HF config: the sum over the
    tensors :func:`qeval.model_config.model_shape` lists (attention q/k/v/o, q/k/v biases
    for qwen2 or ``attention_bias``, gated MLP, RMSNorms, embedding, final norm and an
    untied LM head).

    Raises:
        QevalInputError: a required field (``num_hidden_layers``, ``hidden_size``,
            ``num_attention_heads``, ``intermediate_size``, ``vocab_size``) is missing or bad.
    """
    return model_shape(config).params


@dataclass
class LoadCheck:
    """The capacity formulas at one measured load point.

    Attributes:
        tier: tier name.
        concurrency: N, streams served at once.
        context: tokens per sequence at its fullest (load depth + output tokens).
        predicted_bytes: weights + overhead + N x context x KV bytes/token (the formula).
        measured_peak_bytes: peak memory the sweep measured at N (None if not measured).
        memory_error_pct: 100 x (predicted - measured) / measured; positive: the formula
            asks for more memory than was used.
        bound_tokens_per_s: the N-stream decode bound at ``context`` (None without bandwidth).
        measured_tokens_per_s: the sweep's aggregate decode tokens/s at N (prefill included).
        share_of_bound: measured / bound.
        meets_slo: whether the point met the recipe's SLO.
        users_at_slo: the tier's users at SLO (whole sweep).
    """
    tier: str
    concurrency: int
    context: int
    predicted_bytes: float
    measured_peak_bytes: float | None
    memory_error_pct: float | None
    bound_tokens_per_s: float | None
    measured_tokens_per_s: float | None
    share_of_bound: float | None
    meets_slo: bool | None
    users_at_slo: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def load_vs_formula(tiers: dict[str, TierResult], overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                    bandwidth_bytes_per_s: float | None = None) -> list[LoadCheck]:
    """The formulas' memory and decode bound for every admitted load point, beside what the
    sweep measured there.

    Args:
        tiers: ``{tier name: tier result dict}``; uses ``memory.weight_bytes``,
            ``memory.kv_bytes_per_token`` and ``load`` (depth, output_tokens, points).
        overhead_bytes: the memory formula's fixed allowance (bytes).
        bandwidth_bytes_per_s: for the decode bound (None: no bound).

    Returns:
        One :class:`LoadCheck` per admitted point of every ok tier with a load sweep, in
        tier order, then concurrency.
    """
    out: list[LoadCheck] = []
    for name, t in tiers.items():
        load = t.load if t is not None else None
        w = finite(get_path(t, "memory", "weight_bytes"))
        kv = finite(get_path(t, "memory", "kv_bytes_per_token"))
        if t is None or t.status != STATUS_OK or load is None or not load.points or not w or not kv:
            continue
        ctx = int(load.depth or 0) + int(load.output_tokens or 0)
        users = load.users_at_slo
        for p in load.points:
            if not p.admitted:
                continue
            n = p.concurrency
            pred = w + overhead_bytes + n * ctx * kv
            meas = finite(p.peak_bytes)
            bound = decode_bound(bandwidth_bytes_per_s, w, kv, ctx, n) if bandwidth_bytes_per_s else None
            got = finite(p.decode_tokens_per_s)
            out.append(LoadCheck(name, n, ctx, pred, meas, 100.0 * (pred - meas) / meas if meas else None,
                                 bound, got, got / bound if got and bound else None, p.meets_slo, users))
    return out


@dataclass
class GridCheck:
    """The capacity formulas' prediction beside one measured cell of the context x
    concurrency grid (the load section's ``grid``).

    Attributes:
        tier, depth, concurrency: the cell.
        context: tokens per sequence at its fullest (depth + output tokens).
        predicted_admitted: the formula says it fits: ``context <= max_context`` (when
            known) and weights + overhead + N x context x KV bytes/token <= the run's memory
            budget (the load section's KV budget + what the loaded engine held).
        admitted: what the run did.
        reason: the run's reason when it did not admit the cell.
        predicted_bytes, measured_peak_bytes, memory_error_pct: as :class:`LoadCheck`.
        bound_tokens_per_s, measured_tokens_per_s, share_of_bound: as :class:`LoadCheck`.
        wrong: one line saying where the prediction was wrong and by how much (None: right).
    """
    tier: str
    depth: int
    concurrency: int
    context: int
    predicted_admitted: bool | None
    admitted: bool
    reason: str | None
    predicted_bytes: float | None
    measured_peak_bytes: float | None
    memory_error_pct: float | None
    bound_tokens_per_s: float | None
    measured_tokens_per_s: float | None
    share_of_bound: float | None
    wrong: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def grid_vs_formula(tiers: dict[str, TierResult], overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                    bandwidth_bytes_per_s: float | None = None, max_context: int | None = None,
                    tolerance_pct: float = 25.0) -> list[GridCheck]:
    """The formulas' prediction for every cell of every tier's context x concurrency grid,
    beside what the run measured (:class:`GridCheck`).

    A prediction is wrong when it admits a cell the run did not (or the reverse), or when
    the predicted memory is more than ``tolerance_pct`` % from the measured peak; ``wrong``
    says which and by how much. Memory formula: weights + overhead + N x (depth + output
    tokens) x KV bytes/token (vLLM, arXiv:2309.06180 §2; :func:`max_sequences`).

    Args:
        tiers: ``{tier name: tier result}``; uses ``memory.weight_bytes``,
            ``memory.kv_bytes_per_token`` and ``load`` (output_tokens, kv_budget_bytes,
            held_bytes, grid).
        max_context: the model's context (tokens), or None (not predicted).

    Returns:
        one :class:`GridCheck` per cell, in tier, depth, concurrency order.
    """
    out: list[GridCheck] = []
    for name, t in tiers.items():
        load = t.load if t is not None else None
        if t is None or t.status != STATUS_OK or load is None or load.grid is None:
            continue
        w = finite(get_path(t, "memory", "weight_bytes"))
        kv = finite(get_path(t, "memory", "kv_bytes_per_token"))
        budget = finite(load.kv_budget_bytes)
        budget = budget + (finite(load.held_bytes) or 0) if budget is not None else None
        for g in load.grid.depths:
            ctx = int(g.depth) + int(load.output_tokens or 0)
            for p in g.points:
                n = p.concurrency
                pred = w + overhead_bytes + n * ctx * kv if w and kv else None
                fits = None
                if pred is not None and budget is not None:
                    fits = pred <= budget
                if max_context is not None and ctx > max_context:
                    fits = False
                meas = finite(p.peak_bytes) if p.admitted else None
                err = 100.0 * (pred - meas) / meas if pred is not None and meas else None
                bound = decode_bound(bandwidth_bytes_per_s, w, kv, ctx, n) if bandwidth_bytes_per_s and w and kv \
                    else None
                got = finite(p.decode_tokens_per_s) if p.admitted else None
                wrong = None
                if fits is not None and fits != p.admitted:
                    wrong = (f"predicted {'admitted' if fits else 'not admitted'}, the run "
                             f"{'admitted it' if p.admitted else 'did not: ' + str(p.reason or '')}"
                             + (f" (formula {pred / GIB:.2f} GiB vs budget {budget / GIB:.2f} GiB)"
                                if pred is not None and budget is not None else ""))
                elif err is not None and abs(err) > tolerance_pct:
                    wrong = f"memory formula {err:+.0f}% from the measured peak"
                out.append(GridCheck(name, int(g.depth), n, ctx, fits, bool(p.admitted), p.reason, pred, meas, err,
                                     bound, got, got / bound if got and bound else None, wrong))
    return out


@dataclass
class RequestsAtSlo:
    """Requests/s a tier serves at the SLO at its own output length.

    Attributes:
        tier: tier name.
        users_at_slo: the sweep's users at SLO (streams).
        measured_requests_per_s: requests/s the sweep measured at that concurrency, every
            request ``load_output_tokens`` long.
        load_output_tokens: the recipe's fixed new tokens per request.
        output_tokens_rel: the tier's mean new tokens per answer / the reference's (1.0 for
            the reference, None when the tier has no free-running answers).
        own_output_tokens: ``load_output_tokens x output_tokens_rel`` (tokens).
        requests_per_s: ``measured_requests_per_s / output_tokens_rel`` (the measured figure
            when the ratio is unknown: ``basis`` says which).
        basis: ``"own output length"`` or ``"recipe output_tokens"``.
    """
    tier: str
    users_at_slo: int
    measured_requests_per_s: float
    load_output_tokens: int
    output_tokens_rel: float | None
    own_output_tokens: float
    requests_per_s: float
    basis: str

    def to_dict(self) -> dict:
        return asdict(self)


def requests_per_s_at_slo(name: str, tier: TierResult | None, *, is_reference: bool = False) -> RequestsAtSlo | None:
    """Requests/s at the SLO at the tier's own output length (module docstring): the load
    point at ``load.users_at_slo`` streams, its measured requests/s divided by the tier's
    output-length ratio against the reference (the typed load section,
    :class:`qeval.results_load.LoadSection`).

    Returns:
        None when the tier has no load sweep, no users at SLO (0 or missing) or no measured
        requests/s at that concurrency.
    """
    load = tier.load if tier is not None else None
    if load is None:
        return None
    users = finite(load.users_at_slo)
    out = finite(load.output_tokens)
    if not users or not out:
        return None
    point = next((p for p in load.points or [] if finite(p.concurrency) == users and p.admitted is not False), None)
    rps = finite(point.requests_per_s) if point is not None else None
    if not rps:
        return None
    rel = finite(get_path(tier, "quality", "output_length", "mean_ratio"))
    if rel is None and is_reference:
        rel = 1.0  # the reference against itself
    if rel is not None and rel <= 0:
        rel = None
    own = out * (rel if rel is not None else 1.0)
    return RequestsAtSlo(name, int(users), rps, int(out), rel, own, rps / rel if rel is not None else rps,
                         "own output length" if rel is not None else "recipe output_tokens")
