"""``markdown_table``: a Markdown table (header, ``|---|`` separator) with ``min_rows`` to
``max_rows`` data rows."""
from __future__ import annotations

import re

from .base import CheckKind, ParamError, integer


def _validate_markdown_table(p: dict) -> None:
    integer(p, "min_rows", required=True, minimum=1)
    integer(p, "max_rows", required=False, minimum=1)
    if "max_rows" in p and p["max_rows"] < p["min_rows"]:
        raise ParamError("max_rows", f"must be >= min_rows ({p['min_rows']}), got {p['max_rows']}")


_TABLE_SEP_CELL = re.compile(r"^\s*:?-+:?\s*$")


def _is_table_separator(line: str) -> bool:
    s = line.strip()
    if "|" not in s:
        return False
    s = s.strip("|")
    cells = s.split("|")
    return bool(cells) and all(_TABLE_SEP_CELL.match(c) for c in cells)


def _table_row_counts(text: str) -> list[int]:
    """Data-row count of every Markdown table (header row, ``|---|`` separator, rows with ``|``)."""
    lines = text.splitlines()
    counts: list[int] = []
    i = 0
    while i + 1 < len(lines):
        header, sep = lines[i], lines[i + 1]
        if "|" in header and header.strip().strip("|").strip() and not _is_table_separator(header) \
                and _is_table_separator(sep):
            j = i + 2
            while j < len(lines) and "|" in lines[j] and lines[j].strip():
                j += 1
            counts.append(j - (i + 2))
            i = j
        else:
            i += 1
    return counts


def _check_markdown_table(p: dict, text: str) -> tuple[bool, str]:
    lo, hi = p["min_rows"], p.get("max_rows")
    want = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    counts = _table_row_counts(text)
    if not counts:
        return False, f"no Markdown table found (need {want} data rows)"
    ok = any(c >= lo and (hi is None or c <= hi) for c in counts)
    return ok, f"table data rows {counts}; need {want}"


KINDS = (CheckKind("markdown_table", frozenset({"min_rows", "max_rows"}), _validate_markdown_table,
                   _check_markdown_table),)
