"""A decoder's tensors read from its Hugging Face ``config.json``, without weights.

:func:`model_shape` lists every stored tensor of a llama-style decoder (llama, mistral,
qwen2, qwen3 and their relatives: attention with grouped KV heads, a gated MLP of three
matrices, RMSNorm) with its shape and role, so each weight format can count its bytes per
tensor (:mod:`qeval.weight_formats`) and the KV cache its bytes per token.

Tensors per decoder layer (shapes ``rows x cols`` = ``out_features x in_features``, as
``nn.Linear`` stores them):

* ``q`` ``heads*head_dim x hidden``, ``k`` and ``v`` ``kv_heads*head_dim x hidden``,
  ``o`` ``hidden x heads*head_dim``;
* ``gate`` and ``up`` ``intermediate x hidden``, ``down`` ``hidden x intermediate``;
* 1-D: two RMSNorm weights of ``hidden``; q/k/v biases when ``model_type`` starts with
  ``qwen2`` or ``attention_bias`` is true (llama's ``attention_bias`` also biases ``o``);
  MLP biases when ``mlp_bias``; per-head q/k RMSNorms of ``head_dim`` for ``qwen3`` and
  ``gemma3``; two more RMSNorms of ``hidden`` (around the MLP) for ``gemma2``/``gemma3``.

Plus the token embedding ``vocab x hidden``, the final norm ``hidden`` and, unless
``tie_word_embeddings`` is true, the LM head ``vocab x hidden`` (absent counts as untied,
the llama/qwen2 default). These follow transformers' ``modeling_llama.py``,
``modeling_qwen2.py`` and ``modeling_qwen3.py``; transformers itself was checked and not
used here: building the model on the meta device needs torch and a known architecture,
and ``qeval plan`` answers from a config file alone in well under a second.

Mixture-of-experts configs (``num_experts``, ``num_local_experts``) are refused: their
expert routing is not modelled.

Sliding-window and hybrid attention (issue 64): a layer of type ``sliding_attention`` keeps
only the last ``sliding_window`` tokens' K and V, so the KV cache at a depth is not
``depth x`` a per-token figure but, per layer's bytes per token,
``full_layers x depth + sliding_layers x min(depth, window)`` (:meth:`ModelShape.kv_bytes_at`).
The layer types are read as transformers' ``cache_utils.get_layer_types_and_kwargs`` reads
them (:func:`attention_layer_types`): ``layer_types`` when the config lists them, else
every layer sliding when ``sliding_window`` is set (mistral, phi3), with the older
configs' own rules first (qwen2/qwen3 ``use_sliding_window`` from ``max_window_layers`` on;
gemma2/gemma3 ``sliding_window_pattern``). :func:`int8_kv_layers` says which layers the
transformers engine's int8 KV cache quantizes (the full-attention ones).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import QevalInputError

#: Largest integer a config field may hold here (2**31 - 1): beyond it a value is a typo
#: or hostile, and float arithmetic on it would overflow.
MAX_CONFIG_INT = 2 ** 31 - 1

#: Roles of the 2-D weight matrices inside a decoder layer.
LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class TensorShape:
    """One stored tensor.

    Attributes:
        role: ``embed``, ``lm_head``, one of :data:`LAYER_MATRICES`, ``norm`` or ``bias``.
        layer: decoder layer index, or None outside the layers.
        rows: first dimension (out_features; vocab for embed and lm_head; length of a 1-D tensor).
        cols: second dimension (in_features; hidden for embed and lm_head), None for 1-D.
    """
    role: str
    layer: int | None
    rows: int
    cols: int | None = None

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
        return self.rows * (self.cols or 1)

    @property
    def is_matrix(self) -> bool:
        return self.cols is not None

    @property
    def is_decoder_linear(self) -> bool:
        """A Linear inside a decoder layer: what GPTQ, AWQ, torchao INT8/FP8 quantize."""
        return self.role in LAYER_MATRICES


@dataclass(frozen=True)
class ModelShape:
    """What a weight format and the KV cache need to know about a decoder.

    Attributes:
        model_type: ``config.model_type`` (lower case; "" when absent).
        layers, hidden, heads, kv_heads, head_dim, intermediate, vocab: from the config.
        tied: whether the LM head shares the embedding.
        max_position: ``max_position_embeddings`` (tokens) or None.
        dtype: ``torch_dtype`` / ``dtype`` of the checkpoint ("bfloat16" when absent).
        tensors: every stored tensor (a tied LM head is not listed again).
    """
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_position: int | None
    dtype: str
    tensors: tuple[TensorShape, ...] = field(repr=False)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    @property
    def sliding_layers(self) -> int:
        """Layers whose cache keeps only the last :attr:`sliding_window` tokens."""
        return sum(t in SLIDING_TYPES for t in self.layer_types) if self.sliding_window else 0

    @property
    def full_layers(self) -> int:
        """Layers whose cache grows with the depth (every layer but the sliding ones)."""
        return self.layers - self.sliding_layers

    @property
    def kv_elements_per_layer_token(self) -> int:
        """K and V elements one layer caches per token: ``2 x kv_heads x head_dim``."""
        return 2 * self.kv_heads * self.head_dim

    def kv_elements_at(self, depth: int) -> int:
        """K and V elements cached at ``depth`` tokens:
        ``2 x kv_heads x head_dim x (full_layers x depth + sliding_layers x min(depth, window))``
        (every layer full without a sliding window: ``kv_elements_per_token x depth``)."""
        d = max(0, int(depth))
        held = self.full_layers * d + self.sliding_layers * min(d, self.sliding_window or d)
        return self.kv_elements_per_layer_token * held

    def kv_bytes_at(self, depth: int, bytes_per_element: float = 2.0) -> float:
        """Bytes of the KV cache at ``depth`` tokens (:meth:`kv_elements_at`), at
        ``bytes_per_element`` (2: BF16/FP16)."""
        return self.kv_elements_at(depth) * float(bytes_per_element)

    def kv_layout(self) -> str:
        """``18 layers: 3 full, 15 sliding (window 512)``, or ``18 layers, full attention``."""
        if not self.sliding_layers:
            return f"{self.layers} layers, full attention"
        return (f"{self.layers} layers: {self.full_layers} full, {self.sliding_layers} sliding "
                f"(window {self.sliding_window})")

    @property
    def params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(t.numel for t in self.tensors)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements cached per token: ``2 x layers x kv_heads x head_dim`` (every
        layer: with sliding layers, the figure up to the window; :meth:`kv_elements_at`
        is the cache at a depth)."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def in_features(self) -> dict[str, int]:
        """``{name: in_features}`` of the decoder Linears (what group sizes must divide)."""
        return {f"layers.{t.layer}.{t.role}": int(t.cols) for t in self.tensors
                if t.is_decoder_linear and t.cols is not None}


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key)
    if v is None:
        if default is not None:
            return default
        raise QevalInputError("config lacks a required field", field=key)
    if isinstance(v, int) and not isinstance(v, bool) and v > MAX_CONFIG_INT:
        raise QevalInputError(f"too large ({v.bit_length()}-bit number; at most {MAX_CONFIG_INT})", field=key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        shown = f"a {v.bit_length()}-bit number" if isinstance(v, int) and v.bit_length() > 64 else repr(v)[:40]
        raise QevalInputError(f"must be a positive integer (got {shown})", field=key)
    return v


def text_config(config: dict) -> dict:
    """The decoder part of a config: ``text_config`` when the top level has no layers
    (multimodal configs), else the config itself.

    Raises:
        QevalInputError: the config is not a JSON object.
    """
    if not isinstance(config, dict):
        raise QevalInputError(f"model config must be a JSON object (got a {type(config).__name__})")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


#: transformers' layer types whose cache keeps a window of tokens (``cache_utils``:
#: ``DynamicSlidingWindowLayer``; ``chunked_attention`` is windowed by
#: ``attention_chunk_size`` instead and is counted as full here, an upper bound).
SLIDING_TYPES = ("sliding_attention",)


def attention_layer_types(config: dict) -> tuple[list[str], int | None]:
    """``(layer type per layer, sliding window or None)`` of a HF ``config.json`` dict, as
    transformers builds its cache (module notes): ``layer_types`` as listed; else the older
    configs' rules (qwen2/qwen3: sliding from ``max_window_layers`` on when
    ``use_sliding_window``; gemma2: every other layer; gemma3: ``sliding_window_pattern``,
    default 6, every pattern-th layer full); else every layer sliding when
    ``sliding_window`` is set, full otherwise. The window is None (and every layer full)
    without a positive ``sliding_window``.

    Raises:
        QevalInputError: ``num_hidden_layers`` missing or not a positive integer;
            ``layer_types`` not a list of one string per layer.
    """
    cfg = text_config(config)
    layers = _int(cfg, "num_hidden_layers")
    window = cfg.get("sliding_window")
    window = window if isinstance(window, int) and not isinstance(window, bool) and 0 < window <= MAX_CONFIG_INT \
        else None
    mtype = str(cfg.get("model_type") or "").lower()
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
            raise QevalInputError(f"must list one layer type (a string) per layer ({layers})", field="layer_types")
        types = list(types)
    elif mtype.startswith(("qwen2", "qwen3")):
        start = cfg.get("max_window_layers") if isinstance(cfg.get("max_window_layers"), int) else layers
        types = ["sliding_attention" if cfg.get("use_sliding_window") and window and i >= start
                 else "full_attention" for i in range(layers)]
    elif mtype.startswith("gemma2"):
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif mtype.startswith("gemma3"):
        pattern = cfg.get("sliding_window_pattern")
        pattern = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0 else 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    else:
        types = ["sliding_attention" if window else "full_attention"] * layers
    if window is None:
        types = ["full_attention" if t in SLIDING_TYPES else t for t in types]
    return types, window


#: The attention structures a tier method or engine declares what it does on
#: (:class:`Structure`; README "Your own model" is generated from the declarations).
STRUCTURES = ("full", "sliding", "hybrid", "experts", "recurrent")
#: Layer types that carry a recurrent or linear-attention state instead of a KV cache
#: (transformers' ``layer_types`` names of Mamba/linear-attention hybrids).
RECURRENT_TYPES = ("linear_attention", "mamba", "conv", "recurrent", "rwkv", "ssm")


@dataclass(frozen=True)
class Structure:
    """A decoder's structure as read from its ``config.json`` (never its name): layer
    counts by kind, the sliding window, experts, the architectures listed. ``kinds`` are the
    :data:`STRUCTURES` that apply: ``full`` (every layer full attention), ``sliding`` (every
    layer windowed), ``hybrid`` (both, or attention beside recurrent layers), ``experts``
    (a mixture of experts), ``recurrent`` (a recurrent or linear-attention layer)."""
    layers: int
    full_layers: int
    sliding_layers: int
    window: int | None
    experts: int | None
    other_layers: tuple[str, ...]
    architectures: tuple[str, ...]
    model_type: str

    @property
    def kinds(self) -> tuple[str, ...]:
        out = []
        if self.sliding_layers and self.full_layers == 0 and not self.other_layers:
            out.append("sliding")
        elif self.sliding_layers or (self.other_layers and self.full_layers):
            out.append("hybrid")
        elif not self.other_layers:
            out.append("full")
        if self.experts:
            out.append("experts")
        if any(t in RECURRENT_TYPES for t in self.other_layers):
            out.append("recurrent")
        return tuple(out)

    def describe(self) -> str:
        """``hybrid attention: 3 full, 15 sliding (window 512) of 18 layers`` and the like."""
        head = "+".join(self.kinds)
        parts = [f"{self.full_layers} full"]
        if self.sliding_layers:
            parts.append(f"{self.sliding_layers} sliding (window {self.window})")
        if self.other_layers:
            parts.append(f"{len(self.other_layers)} {'/'.join(sorted(set(self.other_layers)))}")
        text = f"{head}: {', '.join(parts)} of {self.layers} layers"
        return text + (f", {self.experts} experts" if self.experts else "")


def model_structure(config: dict) -> Structure:
    """:class:`Structure` of a HF ``config.json`` dict (layer types as transformers builds
    its cache: :func:`attention_layer_types`; experts from ``num_experts`` /
    ``num_local_experts`` / ``n_routed_experts``).

    Raises:
        QevalInputError: as :func:`attention_layer_types`.
    """
    cfg = text_config(config)
    types, window = attention_layer_types(config)
    experts = next((int(cfg[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool) and cfg[k] > 1), None)
    arch = config.get("architectures") if isinstance(config, dict) else None
    return Structure(layers=len(types), full_layers=sum(t == "full_attention" for t in types),
                     sliding_layers=sum(t in SLIDING_TYPES for t in types), window=window, experts=experts,
                     other_layers=tuple(t for t in types if t != "full_attention" and t not in SLIDING_TYPES),
                     architectures=tuple(str(a) for a in arch) if isinstance(arch, list) else (),
                     model_type=str(cfg.get("model_type") or "").lower())


def int8_kv_layers(config: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(quantized, kept)`` layer indices of the transformers engine's int8 KV cache for a
    HF config dict: the full-attention layers quantized (HQQ int8, transformers'
    ``HQQQuantizedLayer``), the sliding ones kept in the model's dtype within their window
    (``DynamicSlidingWindowLayer``: at most ``window`` tokens, where int8 saves least, and
    transformers' quantized layers do not slide). ``quantized`` empty means the tier
    cannot run (every layer sliding, e.g. mistral with ``sliding_window`` set): the
    engine refuses it with a ValueError, and validation may refuse it earlier from this.

    Raises:
        QevalInputError: as :func:`attention_layer_types`.
    """
    types, _ = attention_layer_types(config)
    kept = tuple(i for i, t in enumerate(types) if t in SLIDING_TYPES)
    return tuple(i for i in range(len(types)) if i not in kept), kept


def kv_bytes_at_depth(config: dict, depth: int, bytes_per_element: float = 2.0) -> float:
    """KV cache bytes at ``depth`` tokens for a HF config dict:
    ``2 x kv_heads x head_dim x bytes_per_element x (full x depth + sliding x min(depth, window))``
    (:meth:`ModelShape.kv_bytes_at`).

    Raises:
        QevalInputError: as :func:`model_shape`.
    """
    return model_shape(config).kv_bytes_at(depth, bytes_per_element)


def model_shape(config: dict) -> ModelShape:
    """The tensors of a llama-style decoder described by a HF ``config.json`` dict.

    Raises:
        QevalInputError: not an object; a required field (``num_hidden_layers``,
            ``hidden_size``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``)
            missing, not a positive integer or above :data:`MAX_CONFIG_INT`; a
            mixture-of-experts config.
    """
    cfg = text_config(config)
    for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(cfg.get(moe), int) and cfg[moe] > 1:
            raise QevalInputError("mixture-of-experts configs are not modelled (expert routing); "
                                  "plan from a run's measured figures instead", field=moe)
    layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    inter = _int(cfg, "intermediate_size")
    vocab = _int(cfg, "vocab_size")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads or 1)
    mtype = str(cfg.get("model_type") or "").lower()
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv_bias = mtype.startswith("qwen2") or bool(cfg.get("attention_bias"))
    o_bias = bool(cfg.get("attention_bias")) and not mtype.startswith("qwen2")
    mlp_bias = bool(cfg.get("mlp_bias"))
    qk_norm = mtype.startswith(("qwen3", "gemma3"))
    # gemma2/gemma3: RMSNorms before and after the MLP too (modeling_gemma3.py: pre_ and
    # post_feedforward_layernorm beside input_ and post_attention_layernorm)
    ffn_norms = mtype.startswith(("gemma2", "gemma3"))
    out: list[TensorShape] = [TensorShape("embed", None, vocab, hidden)]
    for i in range(layers):
        out += [TensorShape("q", i, q_dim, hidden), TensorShape("k", i, kv_dim, hidden),
                TensorShape("v", i, kv_dim, hidden), TensorShape("o", i, hidden, q_dim),
                TensorShape("gate", i, inter, hidden), TensorShape("up", i, inter, hidden),
                TensorShape("down", i, hidden, inter),
                TensorShape("norm", i, hidden), TensorShape("norm", i, hidden)]
        if ffn_norms:
            out += [TensorShape("norm", i, hidden), TensorShape("norm", i, hidden)]
        if qkv_bias:
            out += [TensorShape("bias", i, q_dim), TensorShape("bias", i, kv_dim), TensorShape("bias", i, kv_dim)]
        if o_bias:
            out.append(TensorShape("bias", i, hidden))
        if mlp_bias:
            out += [TensorShape("bias", i, inter), TensorShape("bias", i, inter), TensorShape("bias", i, hidden)]
        if qk_norm:
            out += [TensorShape("norm", i, head_dim), TensorShape("norm", i, head_dim)]
    out.append(TensorShape("norm", None, hidden))
    tied = bool(cfg.get("tie_word_embeddings"))
    if not tied:
        out.append(TensorShape("lm_head", None, vocab, hidden))
    mpe = cfg.get("max_position_embeddings")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    types, window = attention_layer_types(config)
    return ModelShape(model_type=mtype, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, intermediate=inter, vocab=vocab, tied=tied,
                      max_position=mpe if isinstance(mpe, int) and not isinstance(mpe, bool) and mpe > 0 else None,
                      dtype=str(dtype), tensors=tuple(out), layer_types=tuple(types), sliding_window=window)
