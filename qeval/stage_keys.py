"""What both sides of a stage agree on, below both: the run (:mod:`qeval.stages`, which
starts stages) and the stage process (:mod:`qeval.worker`, which runs one). Kept apart so
the stage process imports nothing of the run's side (no import circle through the fork
server's preload: ``stages`` -> ``stage_proc`` -> ``stage_preload`` -> ``worker``)."""
from __future__ import annotations

import hashlib
import json

#: Stages that time something: they run alone, with the recipe's pinned threads.
TIMED_STAGES = ("measure", "load", "env", "speculative")

#: Set to ``1`` in every stage's environment by ``qeval run --fresh``: the reference pass and
#: the tiers' quality results are recomputed instead of reused from the cache.
FRESH_ENV = "QEVAL_FRESH"


def load_fingerprint(recipe_dict: dict) -> str:
    """Hash of what shapes a load sweep beyond the tier's own fingerprint: the recipe's
    ``load`` section (16 hex digits of SHA-256 over its sorted JSON). A finished load stage
    whose hash differs is run again on resume (measure and quality stay valid)."""
    return hashlib.sha256(json.dumps(recipe_dict.get("load"), sort_keys=True).encode()).hexdigest()[:16]
