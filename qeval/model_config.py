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
  MLP biases when ``mlp_bias``; per-head q/k RMSNorms of ``head_dim`` for ``qwen3``.

Plus the token embedding ``vocab x hidden``, the final norm ``hidden`` and, unless
``tie_word_embeddings`` is true, the LM head ``vocab x hidden`` (absent counts as untied,
the llama/qwen2 default). These follow transformers' ``modeling_llama.py``,
``modeling_qwen2.py`` and ``modeling_qwen3.py``; transformers itself was checked and not
used here: building the model on the meta device needs torch and a known architecture,
and ``qeval plan`` answers from a config file alone in well under a second.

Mixture-of-experts configs (``num_experts``, ``num_local_experts``) are refused: their
expert routing is not modelled.
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

    @property
    def params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(t.numel for t in self.tensors)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements cached per token: ``2 x layers x kv_heads x head_dim``."""
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
    qk_norm = mtype.startswith("qwen3")
    out: list[TensorShape] = [TensorShape("embed", None, vocab, hidden)]
    for i in range(layers):
        out += [TensorShape("q", i, q_dim, hidden), TensorShape("k", i, kv_dim, hidden),
                TensorShape("v", i, kv_dim, hidden), TensorShape("o", i, hidden, q_dim),
                TensorShape("gate", i, inter, hidden), TensorShape("up", i, inter, hidden),
                TensorShape("down", i, hidden, inter),
                TensorShape("norm", i, hidden), TensorShape("norm", i, hidden)]
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
    return ModelShape(model_type=mtype, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, intermediate=inter, vocab=vocab, tied=tied,
                      max_position=mpe if isinstance(mpe, int) and not isinstance(mpe, bool) and mpe > 0 else None,
                      dtype=str(dtype), tensors=tuple(out))
