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

Overhead default (:data:`DEFAULT_OVERHEAD_BYTES`): a flat 1 GiB for the CUDA context,
allocator slack and activations of one decode step. It is a deliberately simple,
documented allowance, not a measurement; pass ``overhead_bytes`` to use your own.

Two sources of figures:

* :func:`capacity_from_run`: measured ``memory.weight_bytes`` and
  ``memory.kv_bytes_per_token`` of each tier (source ``"measured"``).
* :func:`estimate_from_config`: parameter count and KV size computed from a Hugging Face
  ``config.json`` for a llama/qwen2-style decoder (source ``"estimate"``, labelled so).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ..errors import QevalInputError
from ..results import STATUS_OK, get_path
from .pareto import GIB, finite

#: Flat overhead allowance in bytes (1 GiB): CUDA context, allocator slack, activations.
DEFAULT_OVERHEAD_BYTES = GIB

_UNITS = {"": 1, "b": 1,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int, *, field: str | None = None) -> int:
    """Parse a memory size into bytes.

    Accepts a plain integer number of bytes (``"1073741824"`` or an int), or a number with
    a unit: decimal ``B, KB, MB, GB, TB`` (10**3 steps) or binary ``KiB, MiB, GiB, TiB``
    (2**10 steps), case-insensitive, optional space: ``"24GiB"``, ``"24 GB"``,
    ``"1.5GiB"``, ``"512MiB"``. Results are rounded to whole bytes.

    Raises:
        QevalInputError: empty, negative, non-numeric, fractional plain bytes, or an
            unknown or ambiguous unit (``"24G"``: say GiB or GB).
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
    if _UNITS[unit] == 1 and "." in num and float(num) != int(float(num)):
        raise QevalInputError(f"a byte count must be whole: {text!r}", field=field)
    return int(round(value))


def format_gib(n: float | None, digits: int = 2) -> str:
    """``n`` bytes as ``"x.xx GiB"``; ``"-"`` for None."""
    return "-" if n is None else f"{n / GIB:.{digits}f} GiB"


def max_sequences(budget_bytes: float, weights_bytes: float, overhead_bytes: float,
                  kv_bytes_per_token: float, context: int) -> int:
    """``floor((M - weights - overhead) / (kv_bytes_per_token * context))``, at least 0.

    Raises:
        QevalInputError: ``context`` or ``kv_bytes_per_token`` not positive.
    """
    if context <= 0 or kv_bytes_per_token <= 0:
        raise QevalInputError(f"context ({context}) and KV bytes/token ({kv_bytes_per_token}) must be positive")
    free = budget_bytes - weights_bytes - overhead_bytes
    return max(0, math.floor(free / (kv_bytes_per_token * context)))


def max_context(budget_bytes: float, weights_bytes: float, overhead_bytes: float,
                kv_bytes_per_token: float, users: int) -> int:
    """Longest context (tokens) each of ``users`` concurrent sequences can have:
    ``floor((M - weights - overhead) / (kv_bytes_per_token * users))``, at least 0.

    Raises:
        QevalInputError: ``users`` or ``kv_bytes_per_token`` not positive.
    """
    if users <= 0 or kv_bytes_per_token <= 0:
        raise QevalInputError(f"users ({users}) and KV bytes/token ({kv_bytes_per_token}) must be positive")
    free = budget_bytes - weights_bytes - overhead_bytes
    return max(0, math.floor(free / (kv_bytes_per_token * users)))


@dataclass
class CapacityRow:
    """Capacity of one tier (or one configuration estimate) in a memory budget.

    Attributes:
        tier: tier name, or the model type for an estimate.
        source: ``"measured"`` (from a run) or ``"estimate"`` (from a config).
        budget_bytes: memory budget M, bytes.
        weights_bytes, overhead_bytes, kv_bytes_per_token: inputs, bytes.
        free_bytes: M - weights - overhead (may be negative).
        context: context length c (tokens) for ``sequences``.
        users: N for ``max_context_tokens``.
        sequences: sequences of c tokens that fit (None when inputs are missing).
        max_context_tokens: longest context for N users (None when inputs are missing).
        fits: whether N users at c tokens fit (None when inputs are missing).
        params: parameter count (estimates only).
        note: why figures are missing, or the assumptions of an estimate.
    """
    tier: str
    source: str
    budget_bytes: int
    context: int
    users: int
    overhead_bytes: int
    weights_bytes: float | None = None
    kv_bytes_per_token: float | None = None
    free_bytes: float | None = None
    sequences: int | None = None
    max_context_tokens: int | None = None
    fits: bool | None = None
    params: int | None = None
    note: str = ""

    @property
    def label(self) -> str:
        return "estimate from config (not measured)" if self.source == "estimate" else "measured"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        return d


def _check_plan_args(gpu_mem_bytes: int, context: int, users: int, overhead_bytes: int) -> None:
    if gpu_mem_bytes <= 0:
        raise QevalInputError(f"memory budget must be positive (got {gpu_mem_bytes} bytes)")
    if context <= 0:
        raise QevalInputError(f"context must be a positive number of tokens (got {context})")
    if users <= 0:
        raise QevalInputError(f"users must be a positive number (got {users})")
    if overhead_bytes < 0:
        raise QevalInputError(f"overhead must not be negative (got {overhead_bytes} bytes)")


def _fill(row: CapacityRow) -> CapacityRow:
    free = row.budget_bytes - row.weights_bytes - row.overhead_bytes  # type: ignore[operator]
    row.free_bytes = free
    row.sequences = max_sequences(row.budget_bytes, row.weights_bytes, row.overhead_bytes,  # type: ignore[arg-type]
                                  row.kv_bytes_per_token, row.context)  # type: ignore[arg-type]
    row.max_context_tokens = max_context(row.budget_bytes, row.weights_bytes, row.overhead_bytes,  # type: ignore[arg-type]
                                         row.kv_bytes_per_token, row.users)  # type: ignore[arg-type]
    row.fits = row.max_context_tokens >= row.context
    if free < 0:
        row.note = (row.note + "; " if row.note else "") + "weights + overhead exceed the budget"
    return row


def capacity_from_run(tiers: dict[str, dict], gpu_mem_bytes: int, context: int, users: int,
                      overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> list[CapacityRow]:
    """Capacity of every tier from its measured weights and KV bytes per token.

    Args:
        tiers: ``{tier name: tier result dict}``; uses ``memory.weight_bytes`` and
            ``memory.kv_bytes_per_token`` (bytes).
        gpu_mem_bytes: memory budget M in bytes.
        context: context c in tokens for the sequence count.
        users: concurrent users N for the longest context.
        overhead_bytes: fixed allowance (default 1 GiB, see module doc).

    Returns:
        One :class:`CapacityRow` per tier, in the given order; tiers that did not finish or
        lack a figure get a row with ``sequences=None`` and a note.

    Raises:
        QevalInputError: non-positive budget, context or users; negative overhead.
    """
    _check_plan_args(gpu_mem_bytes, context, users, overhead_bytes)
    rows = []
    for name, t in tiers.items():
        row = CapacityRow(tier=name, source="measured", budget_bytes=int(gpu_mem_bytes), context=int(context),
                          users=int(users), overhead_bytes=int(overhead_bytes))
        row.weights_bytes = finite(get_path(t, "memory", "weight_bytes"))
        row.kv_bytes_per_token = finite(get_path(t, "memory", "kv_bytes_per_token"))
        status = (t or {}).get("status")
        if status != STATUS_OK:
            row.note = f"status {status}"
        elif row.weights_bytes is None:
            row.note = "no memory.weight_bytes"
        elif not row.kv_bytes_per_token or row.kv_bytes_per_token <= 0:
            row.note = "no memory.kv_bytes_per_token"
        else:
            _fill(row)
        rows.append(row)
    return rows


def _cfg_int(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        if v is None:
            raise QevalInputError("config lacks a required field", field=key)
        raise QevalInputError(f"must be a positive integer (got {v!r})", field=key)
    return v


def _text_config(config: dict) -> dict:
    if not isinstance(config, dict):
        raise QevalInputError("model config must be a JSON object")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def kv_bytes_per_token_from_config(config: dict, kv_dtype_bytes: float = 2) -> float:
    """KV cache bytes per token: ``2 x num_hidden_layers x kv_heads x head_dim x kv_dtype_bytes``.

    ``kv_heads`` is ``num_key_value_heads`` (default ``num_attention_heads``); ``head_dim``
    is ``head_dim`` (default ``hidden_size / num_attention_heads``).

    Raises:
        QevalInputError: a required field is missing or not a positive integer.
    """
    cfg = _text_config(config)
    layers = _cfg_int(cfg, "num_hidden_layers")
    heads = _cfg_int(cfg, "num_attention_heads")
    kv_heads = _cfg_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    head_dim = _cfg_int(cfg, "head_dim") if cfg.get("head_dim") is not None else _cfg_int(cfg, "hidden_size") // heads
    return 2 * layers * kv_heads * head_dim * kv_dtype_bytes


def param_count_from_config(config: dict) -> int:
    """Parameter count of a llama/qwen2-style decoder from its HF config.

    Per layer: q ``hidden x heads*head_dim``, k and v ``hidden x kv_heads*head_dim``,
    o ``heads*head_dim x hidden``; q/k/v biases when ``model_type`` is ``qwen2`` or
    ``attention_bias`` is true (llama's ``attention_bias`` also biases o_proj); gated MLP
    ``3 x hidden x intermediate_size`` (+ biases when ``mlp_bias``); two RMSNorm weight
    vectors of ``hidden``. Plus the embedding ``vocab x hidden``, a final norm ``hidden`` and,
    unless ``tie_word_embeddings`` is true, an LM head ``vocab x hidden``
    (``tie_word_embeddings`` absent counts as untied, the llama/qwen2 default).

    Raises:
        QevalInputError: a required field (``num_hidden_layers``, ``hidden_size``,
            ``num_attention_heads``, ``intermediate_size``, ``vocab_size``) is missing or bad.
    """
    cfg = _text_config(config)
    layers = _cfg_int(cfg, "num_hidden_layers")
    hidden = _cfg_int(cfg, "hidden_size")
    heads = _cfg_int(cfg, "num_attention_heads")
    inter = _cfg_int(cfg, "intermediate_size")
    vocab = _cfg_int(cfg, "vocab_size")
    kv_heads = _cfg_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    head_dim = _cfg_int(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    mtype = str(cfg.get("model_type", "")).lower()
    if mtype.startswith("qwen2"):
        attn += q_dim + 2 * kv_dim
    elif cfg.get("attention_bias"):
        attn += q_dim + 2 * kv_dim + hidden
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if cfg.get("mlp_bias") else 0)
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden
    head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    return layers * per_layer + embed + head + hidden


def estimate_from_config(config: dict, gpu_mem_bytes: int, context: int, users: int,
                         weight_dtype_bytes: float = 2, kv_dtype_bytes: float = 2,
                         overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> CapacityRow:
    """Capacity *estimate* from a Hugging Face ``config.json`` dict, without a model.

    weights = :func:`param_count_from_config` x ``weight_dtype_bytes`` (2 for BF16; e.g.
    0.5 for a flat 4-bit estimate, which ignores scales and unquantized layers);
    KV bytes/token from :func:`kv_bytes_per_token_from_config` with ``kv_dtype_bytes``
    (2 for BF16, 1 for an int8 cache). Then the formula in the module doc.

    Returns:
        :class:`CapacityRow` with ``source="estimate"`` and ``params`` set; its ``note``
        states the assumptions (and when the longest context exceeds
        ``max_position_embeddings``).

    Raises:
        QevalInputError: bad config field; non-positive budget, context, users or dtype bytes.
    """
    _check_plan_args(gpu_mem_bytes, context, users, overhead_bytes)
    if weight_dtype_bytes <= 0 or kv_dtype_bytes <= 0:
        raise QevalInputError("bytes per weight and per KV element must be positive")
    cfg = _text_config(config)
    params = param_count_from_config(cfg)
    row = CapacityRow(tier=str(cfg.get("model_type") or "model"), source="estimate",
                      budget_bytes=int(gpu_mem_bytes), context=int(context), users=int(users),
                      overhead_bytes=int(overhead_bytes), params=params,
                      weights_bytes=int(round(params * weight_dtype_bytes)),
                      kv_bytes_per_token=kv_bytes_per_token_from_config(cfg, kv_dtype_bytes))
    row.note = (f"estimate from config: {params:,} parameters x {weight_dtype_bytes:g} bytes, "
                f"KV {kv_dtype_bytes:g} bytes/element, overhead {overhead_bytes / GIB:.2f} GiB")
    _fill(row)
    mpe = cfg.get("max_position_embeddings")
    if isinstance(mpe, int) and row.max_context_tokens and row.max_context_tokens > mpe:
        row.note += f"; longest context exceeds max_position_embeddings ({mpe})"
    return row
