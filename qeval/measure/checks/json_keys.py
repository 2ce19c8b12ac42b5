"""``json_keys``: the reply holds a JSON object (a fenced json block first, then bare ``{...}``)
with every key in ``keys``."""
from __future__ import annotations

import json
import re

from .base import CheckKind, short, str_list


def _validate_json_keys(p: dict) -> None:
    str_list(p, "keys", required=True)


_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|Json)?[ \t]*\r?\n(.*?)```", re.DOTALL)
_MAX_BARE_JSON_TRIES = 500


def _find_json_object(text: str) -> dict | None:
    """First JSON object in ``text``: fenced ```json blocks first, then bare ``{...}`` in text order."""
    for m in _FENCE_RE.finditer(text):
        try:
            obj = json.loads(m.group(1).strip())
        except (ValueError, RecursionError):  # a reply is model output: "{" x 100000 must not crash
            continue
        if isinstance(obj, dict):
            return obj
    decoder = json.JSONDecoder()
    pos, tries = 0, 0
    while tries < _MAX_BARE_JSON_TRIES:
        start = text.find("{", pos)
        if start < 0:
            return None
        tries += 1
        try:
            obj, _end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            pos = start + 1
            continue
        return obj  # raw_decode at "{" always yields a dict
    return None


def _check_json_keys(p: dict, text: str) -> tuple[bool, str]:
    obj = _find_json_object(text)
    if obj is None:
        return False, "no JSON object found"
    missing = [k for k in p["keys"] if k not in obj]
    if missing:
        return False, "JSON object lacks keys: " + ", ".join(short(k) for k in missing)
    return True, f"JSON object has all {len(p['keys'])} keys"


KINDS = (CheckKind("json_keys", frozenset({"keys"}), _validate_json_keys, _check_json_keys),)
