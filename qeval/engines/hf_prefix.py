"""Prefix KV reuse on transformers: a shared prefix (a system prompt, a RAG template)
prefilled once into a KV cache, and every request started from a copy of that cache, so
only the request's own part is prefilled.

The copy is ``copy.deepcopy`` of the cache object (``DynamicCache``, or the int8
``QuantizedCache`` the engine uses): transformers' own way to reuse a prompt cache across
generations (its "Re-use a cache" recipe in the KV-cache docs: a prefilled
``DynamicCache`` deep-copied per prompt and passed as ``past_key_values``). Checked first:
transformers' continuous-batching manager (``generate_batch`` / ``ContinuousBatchingManager``)
has no prefix sharing between requests in the installed version, and ``DynamicCache`` has no
copy method of its own (``crop`` cuts back one cache, it does not fork it).

Greedy only (argmax of the last position's logits, as :mod:`qeval.engines.hf`). Each request
counts its prompt tokens and those served from the cache
(:class:`qeval.engines.llamacpp_prefix.PrefixStats`).
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

from .llamacpp_prefix import PrefixStats


class HFPrefixCache:
    """A transformers KV cache holding one shared prefix, copied per request.

    Args:
        engine: a loaded :class:`qeval.engines.hf.HFEngine` (its model, device and cache kind).
        prefix_ids: the shared prefix's token ids (at least one).

    Attributes:
        stats: :class:`PrefixStats` of the requests served.
        forwards: model forward calls made (the prefix's prefill included).

    Raises:
        ValueError: an empty prefix.
    """

    def __init__(self, engine: Any, prefix_ids: Sequence[int]) -> None:
        self.engine = engine
        self.prefix = [int(t) for t in prefix_ids]
        if not self.prefix:
            raise ValueError("a prefix of at least one token is needed")
        self._torch = engine._torch
        self.stats = PrefixStats()
        self.forwards = 0
        self._cache = engine.new_cache()
        with self._torch.inference_mode():
            self._forward(self.prefix, self._cache)

    def _forward(self, ids: Sequence[int], cache: Any) -> int:
        """One forward pass of ``ids`` on ``cache``; the greedy next token."""
        torch = self._torch
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.engine.device)
        out = self.engine.model(input_ids=x, **{self.engine._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        self.forwards += 1
        return int(out.logits[0, -1].argmax())

    def generate(self, own_ids: Sequence[int], max_new_tokens: int, *, reuse: bool = True,
                 stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy answer to ``prefix + own_ids``.

        ``reuse``: start from a deep copy of the prefilled prefix cache and prefill only
        ``own_ids``; otherwise prefill the whole prompt into a new cache (a fresh prefill,
        for comparison). Counts the request in :attr:`stats`.

        Returns:
            the new token ids (up to and including a stop token, at most ``max_new_tokens``).

        Raises:
            ValueError: an empty own part or ``max_new_tokens`` < 1.
        """
        own = [int(t) for t in own_ids]
        if not own or max_new_tokens < 1:
            raise ValueError("a request needs at least one own token and max_new_tokens >= 1")
        stop = {int(t) for t in stop_ids}
        with self._torch.inference_mode():
            if reuse:
                cache = copy.deepcopy(self._cache)
                out = [self._forward(own, cache)]
            else:
                cache = self.engine.new_cache()
                out = [self._forward(self.prefix + own, cache)]
            while len(out) < max_new_tokens and out[-1] not in stop:
                out.append(self._forward([out[-1]], cache))
        self.stats.requests += 1
        self.stats.prompt_tokens += len(self.prefix) + len(own)
        self.stats.cached_tokens += len(self.prefix) if reuse else 0
        return out

    def cached_tokens(self) -> int:
        """Tokens held in the prefix cache (``get_seq_length``)."""
        return int(self._cache.get_seq_length())
