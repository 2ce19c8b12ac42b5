"""Tiny random checkpoints of several decoder families, built inside the test session (never
downloaded), each with a small BPE tokenizer trained on the project's depth text and the
chat template of ``tests/conftest.py``: what :func:`conftest.build_tiny_llama` does for
llama, for the families whose attention differs.

* :func:`build_tiny_gemma3`: Gemma 3's hybrid attention, ``layer_types`` mixing
  ``sliding_attention`` and ``full_attention`` (default 4 layers, 3 sliding with a window
  of 32, the pattern of the user's Gemma 3 270M: five sliding layers to one full); its
  ``sliding_window`` sits below the depths tests use, so the sliding layers drop positions.
* :func:`build_tiny_mistral`: every layer sliding (mistral's ``sliding_window`` applies to
  all layers; transformers infers ``sliding_attention`` for each).
* :func:`build_tiny_qwen2`, :func:`build_tiny_qwen3`, :func:`build_tiny_phi3`: full
  attention only (qwen2/qwen3 with ``use_sliding_window`` off, their default), for the
  families' own tensor layouts (qkv biases, q/k norms, phi3's fused qkv and gate_up).

About 100k to 300k parameters each; a build takes a second or two (most of it the BPE).
"""
from __future__ import annotations

from pathlib import Path

try:  # the fixtures' module: its chat template and repository root, not copied
    from conftest import CHAT_TEMPLATE, REPO
except ImportError:  # imported from outside pytest's rootdir conftest
    REPO = Path(__file__).resolve().parent.parent
    CHAT_TEMPLATE = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TOKENIZER_CACHE: dict[int, object] = {}


def tiny_tokenizer(vocab_size: int = 512):
    """A BPE tokenizer trained on ``datasets/depth_text.txt`` (byte-level, the specials of
    :func:`conftest.build_tiny_llama`), with the test chat template; trained once per
    session and vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = _TOKENIZER_CACHE.get(vocab_size)
    if tk is None:
        specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tk = Tokenizer(models.BPE(unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        text = (REPO / "datasets" / "depth_text.txt").read_text(encoding="utf-8")
        tk.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
        _TOKENIZER_CACHE[vocab_size] = tk
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _save(folder: Path, config_cls: str, model_cls: str, seed: int, tokenizer=None, **cfg) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id, **cfg)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def gemma3_layer_types(layers: int, full_every: int = 4) -> list[str]:
    """Gemma 3's pattern: every ``full_every``-th layer full attention, the others sliding
    (``full_every`` 6 in the released models; 4 here gives 3 sliding and 1 full in 4 layers)."""
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]


def build_tiny_gemma3(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 4, heads: int = 4,
                      kv_heads: int = 1, head_dim: int = 16, intermediate: int = 128, window: int = 32,
                      full_every: int = 4, max_pos: int = 2048, tokenizer=None) -> Path:
    """A tiny random Gemma 3 text model (``Gemma3ForCausalLM``): ``layers`` layers, every
    ``full_every``-th full attention and the rest sliding with window ``window``, 1 KV head
    as Gemma 3 270M has. Default: 4 layers, 3 sliding (window 32), about 150k parameters.
    ``tokenizer``: another tokenizer (llama.cpp's converter knows SmolLM2's pre-tokenizer,
    not the tiny BPE's: a GGUF tier needs it)."""
    return _save(folder, "Gemma3TextConfig", "Gemma3ForCausalLM", seed, tokenizer=tokenizer, hidden_size=hidden,
                 intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                 sliding_window=window, layer_types=gemma3_layer_types(layers, full_every),
                 max_position_embeddings=max_pos, tie_word_embeddings=True)


def build_tiny_mistral(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, intermediate: int = 128, window: int = 32, max_pos: int = 2048) -> Path:
    """A tiny random mistral with ``sliding_window`` set: every layer sliding (window 32)."""
    return _save(folder, "MistralConfig", "MistralForCausalLM", seed, hidden_size=hidden,
                 intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, sliding_window=window, max_position_embeddings=max_pos,
                 tie_word_embeddings=True)


def build_tiny_qwen2(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, max_pos: int = 2048) -> Path:
    """A tiny random qwen2 (qkv biases; full attention, ``use_sliding_window`` off)."""
    return _save(folder, "Qwen2Config", "Qwen2ForCausalLM", seed, hidden_size=hidden,
                 intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, max_position_embeddings=max_pos, tie_word_embeddings=True)


def build_tiny_qwen3(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128, max_pos: int = 2048) -> Path:
    """A tiny random qwen3 (per-head q/k RMSNorms; full attention)."""
    return _save(folder, "Qwen3Config", "Qwen3ForCausalLM", seed, hidden_size=hidden,
                 intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_pos,
                 tie_word_embeddings=True)


def build_tiny_phi3(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, max_pos: int = 2048) -> Path:
    """A tiny random phi3 (fused qkv and gate_up projections; full attention)."""
    return _save(folder, "Phi3Config", "Phi3ForCausalLM", seed, hidden_size=hidden,
                 intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                 original_max_position_embeddings=max_pos, tie_word_embeddings=True)


BUILDERS = {"gemma3": build_tiny_gemma3, "mistral": build_tiny_mistral, "qwen2": build_tiny_qwen2,
            "qwen3": build_tiny_qwen3, "phi3": build_tiny_phi3}
