"""Long-context suite: documents of an exact token depth with facts at set positions, and
questions whose answers are checked exactly.

Items are model-independent specs (``datasets/long_context.jsonl``, written by
``datasets/tools/make_long_context.py``; schema in ``datasets/README.md``). For each depth
a recipe asks for, :func:`render` builds the prompt with the model's own tokenizer:

    <title>\\n<preamble>\\n\\n<body>\\n\\n---\\n<instructions>\\n1. <question>\\n2. ...

inside the chat template (generation prompt appended). The body is filler lines of the
item's genre (from the filler file the item names, starting at ``filler_start``, tiled
when a depth needs more) with each fact line inserted where ``at`` (0..1) of the body's
tokens have gone by. Whole filler lines are added while the prompt fits, then words of
the next line, so the prompt is at most ``depth`` tokens and short of it by less than one
word's tokens. The filler never contains a question's ``key`` or text answer (checked on
load), so answers come from the placed facts alone.

Question kinds (checked on the reply's numbered line for that question, see
:func:`split_answers`):

- ``lookup``: the answer (an ID, name or number) is on the line.
- ``multi``: every one of several answers is on the line.
- ``update``: the later value is on the line and the earlier (stale) one is not.
- ``count`` / ``sum``: the count of entries with the key / the total of their values.
- ``absent``: the document does not answer it; the line says so (:data:`ABSTAIN_RE`).

Text answers match case-insensitively with whitespace and dashes normalised; numbers match
in the usual spellings (``12340``, ``12,340``, ``12 340``, ``£12,340.00``; ``3.5 million``
for round millions, ``410k`` / ``410 thousand`` for round thousands; words for 0..20).
RULER (Hsieh et al. 2024, arXiv:2404.06654) was the model for going past single-needle
lookup (multi-value, aggregation, and tracking a changed value); its filler and tasks are
not used here.
"""
from __future__ import annotations

import bisect
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import QevalInputError
from .prompt_format import render_chat
from .behaviour import bootstrap_ci
from .suites import CheckResult, describe_value, jsonl_rows

__all__ = ["ABSTAIN_RE", "INSTRUCTIONS", "QUESTION_KINDS", "Fact", "LongContextItem", "Question",
           "RenderedItem", "check_answers", "check_depths_hold_items", "check_question", "load_long_context",
           "min_depth", "number_pattern", "render", "split_answers"]

QUESTION_KINDS = ("lookup", "multi", "update", "count", "sum", "absent")

INSTRUCTIONS = ("Answer the questions below using only the document above. Reply with one numbered line per "
                "question, in the same order, giving only the answer. If the document does not contain the "
                "answer to a question, write \"not in the document\" on its line.")

#: Replies that say the document does not give an answer (``absent`` questions).
ABSTAIN_RE = re.compile(
    r"not (?:in|found in|mentioned in|stated in|given in|listed in|provided in|included in) the (?:document|text|"
    r"ledger|log|agreement|contract|transcript)|not (?:mentioned|stated|given|listed|provided|specified|found|"
    r"recorded|available)|(?:does|do|is|are)(?: not|n't) (?:say|state|mention|contain|list|give|include|specify|"
    r"provide|appear|mentioned|listed|stated)|no (?:mention|information|record|entry|data|answer)|cannot (?:be )?"
    r"(?:find|found|determined|answered)|can't (?:find|be determined|answer)|unknown|n/a", re.IGNORECASE)

_ROW_FIELDS = ("id", "genre", "filler", "filler_start", "title", "preamble", "facts", "questions")
_FACT_FIELDS = ("id", "at", "text", "value")
_Q_FIELDS = ("id", "kind", "key", "ask", "answer", "stale", "facts")
_FILLER_FIELDS = ("genre", "text")
_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen twenty").split()
_DASHES = str.maketrans({"\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2212": "-"})


@dataclass(frozen=True)
class Fact:
    """One line of the document that a question depends on.

    Attributes:
        id: unique within the item (``f1``).
        at: relative position in the body, 0 < at < 1 (share of the body's tokens before it).
        text: the line as placed (one line, no newline).
        value: the number a ``sum`` question adds up from this line, else None.
    """
    id: str
    at: float
    text: str
    value: int | None = None


@dataclass(frozen=True)
class Question:
    """One question asked after the document.

    Attributes:
        id: unique within the item (``q1``).
        kind: one of :data:`QUESTION_KINDS`.
        key: the entity or phrase the question is about (never in the filler).
        ask: the question text.
        answers: expected values (strings matched as text, ints as numbers); one for
            lookup/update/count/sum, several for multi, none for absent.
        stale: for ``update``, the earlier value that must not be given; else None.
        facts: ids of the facts the answer comes from.
    """
    id: str
    kind: str
    key: str
    ask: str
    answers: tuple[str | int, ...]
    stale: str | int | None
    facts: tuple[str, ...]


@dataclass(frozen=True)
class LongContextItem:
    """A long-context item as loaded (validated).

    Attributes:
        id: unique within the file; suite: the recipe's suite name; genre: filler genre.
        title, preamble: the document's first lines.
        facts, questions: as in the file, in file order.
        filler: the genre's filler lines (shared by items of the genre); filler_start: first line used.
        source: ``"file:line"`` of the row.
    """
    id: str
    suite: str
    genre: str
    title: str
    preamble: str
    facts: tuple[Fact, ...]
    questions: tuple[Question, ...]
    filler: tuple[str, ...]
    filler_start: int
    source: str

    def fact(self, fid: str) -> Fact:
        """The fact with id ``fid``; KeyError if absent."""
        for f in self.facts:
            if f.id == fid:
                return f
        raise KeyError(fid)


# ---- matching -----------------------------------------------------------------------------

def _norm(s: str) -> str:
    return " ".join(s.translate(_DASHES).casefold().split())


def number_pattern(n: int) -> re.Pattern:
    """A regex for the integer ``n`` in its usual spellings, not inside a longer number:
    digits with or without thousands separators (``,``, space, thin or no-break space),
    an optional ``.0``/``.00``; round thousands as ``410k``/``410 thousand``; round
    millions as ``3.5 million``/``3.5m``; 0..20 also as words."""
    digits = f"{abs(n):,}".split(",")
    core = r"[,\u202f\u00a0 ]?".join(digits)
    alts = [r"(?<![\d.,])" + ("-" if n < 0 else "") + core + r"(?:\.0{1,2})?(?![\d]|[.,]\d)"]
    if n >= 1000 and n % 1000 == 0:
        alts.append(r"(?<![\d.,])" + re.escape(f"{n // 1000:,}") + r"\s?(?:k\b|thousand\b)")
    if n >= 1_000_000 and n % 1000 == 0:
        m = f"{n / 1_000_000:.3f}".rstrip("0").rstrip(".")
        alts.append(r"(?<![\d.,])" + re.escape(m) + r"\s?(?:m\b|million\b|mn\b)")
    if 0 <= n < len(_NUMBER_WORDS):
        alts.append(r"\b" + _NUMBER_WORDS[n] + r"\b")
    return re.compile("|".join(alts), re.IGNORECASE)


def _hit(value: str | int, text: str) -> bool:
    if isinstance(value, int):
        return number_pattern(value).search(text) is not None
    return _norm(value) in _norm(text)


def _shown(value: str | int) -> str:
    return f"{value:,}" if isinstance(value, int) else repr(value)


def check_question(q: Question, answer: str) -> CheckResult:
    """Check one question's answer text (its numbered line); never raises for loaded questions.

    Returns:
        A :class:`~qeval.measure.suites.CheckResult` with ``kind`` = the question kind.
    """
    if q.kind == "absent":
        ok = ABSTAIN_RE.search(answer) is not None
        return CheckResult(q.kind, ok, "says the document does not answer" if ok else "gives no 'not in the document'")
    missing = [a for a in q.answers if not _hit(a, answer)]
    if missing:
        return CheckResult(q.kind, False, "missing " + ", ".join(_shown(a) for a in missing))
    if q.stale is not None and _hit(q.stale, answer):
        return CheckResult(q.kind, False, f"gives the superseded value {_shown(q.stale)}")
    return CheckResult(q.kind, True, "found " + ", ".join(_shown(a) for a in q.answers))


_MARK_LINE = r"(?m)^[ \t>*_#-]*(?:\*\*)?(?:(?:Q|Question|Answer)\s*)?{k}(?:\*\*)?\s*[.):](?!\d)(?:\*\*)?"
_MARK_INLINE = r"(?:^|(?<=\s)){k}[.)](?=\s)"


def split_answers(reply: str, n: int) -> list[str]:
    """The reply's answer to each of ``n`` numbered questions: the text after marker ``k``
    (``1.``, ``1)``, ``1:``, ``**1.**``, ``Q1:``, ``Answer 1:`` at a line start, or
    ``1.``/``1)`` after whitespace, whichever style finds more markers) up to the next
    marker found. Markers are found in order 1, 2, ..., n; a question whose marker is
    missing gets ``""``. Without any marker,
    a one-question item takes the whole reply, and a reply of exactly ``n`` non-empty lines
    gives one line per question."""
    best: list[tuple[int, int, int]] = []
    for pattern in (_MARK_LINE, _MARK_INLINE):  # the style that finds more markers wins
        spans: list[tuple[int, int, int]] = []  # (question index, marker start, answer start)
        pos = 0
        for k in range(1, n + 1):
            m = re.compile(pattern.format(k=k)).search(reply, pos)
            if m is None:
                continue
            spans.append((k - 1, m.start(), m.end()))
            pos = m.end()
        if len(spans) > len(best):
            best = spans
    if best:
        out = [""] * n
        for i, (qi, _s, a) in enumerate(best):
            end = best[i + 1][1] if i + 1 < len(best) else len(reply)
            out[qi] = reply[a:end].strip()
        return out
    if n == 1:
        return [reply.strip()]
    lines = [ln.strip() for ln in reply.splitlines() if ln.strip()]
    return lines if len(lines) == n else [""] * n


def check_answers(item: LongContextItem, reply: str) -> list[CheckResult]:
    """One :class:`CheckResult` per question of ``item`` (question order) for the model's reply."""
    parts = split_answers(reply, len(item.questions))
    return [check_question(q, a) for q, a in zip(item.questions, parts)]


# ---- loading ------------------------------------------------------------------------------

def _str(v: Any, *, single_line: bool = True) -> bool:
    return isinstance(v, str) and bool(v.strip()) and (not single_line or "\n" not in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_filler(path: Path, cache: dict) -> dict[str, tuple[str, ...]]:
    """``{genre: lines}`` of a filler file (cached per path)."""
    key = str(path.resolve())
    if key in cache:
        return cache[key]
    file = str(path)
    pools: dict[str, list[str]] = {}
    for lineno, row in jsonl_rows(path, what="filler file"):
        def err(field: str, message: str) -> QevalInputError:
            return QevalInputError(message, file=file, line=lineno, field=field)
        if not isinstance(row, dict):
            raise err("row", f"must be a JSON object, got {describe_value(row)}")
        for k in row:
            if k not in _FILLER_FIELDS:
                raise err(str(k), f"unknown field (allowed: {', '.join(_FILLER_FIELDS)})")
        for k in _FILLER_FIELDS:
            if k not in row:
                raise err(k, "missing required field")
            if not _str(row[k]):
                raise err(k, f"must be a non-empty one-line string, got {describe_value(row[k])}")
        pools.setdefault(row["genre"], []).append(row["text"])
    out = {g: tuple(v) for g, v in pools.items()}
    cache[key] = out
    return out


def load_long_context(path: str | Path, suite: str) -> list[LongContextItem]:
    """Load and validate a long-context item file and the filler files its rows name.

    Args:
        path: the JSONL item file (schema in ``datasets/README.md``).
        suite: suite name recorded on every item.

    Returns:
        Items in file order.

    Raises:
        QevalInputError: one line ``file:line: field: what is wrong`` for an unreadable
            file, invalid JSON, unknown/missing fields, wrong types, duplicate ids, an
            unknown question kind, a fact id a question names that the item lacks, an
            answer not written in its facts (lookup/multi/update), an update whose later
            fact is not after the earlier, a count that is not the number of its facts, a
            sum that is not the total of its facts' values, a key that occurs in the
            filler (or, for count/sum, in another fact; for absent, anywhere in the item),
            a missing or bad filler file, or a file with no items.
    """
    file = str(path)
    base = Path(path).parent
    cache: dict = {}
    items: list[LongContextItem] = []
    seen: dict[str, int] = {}
    for lineno, row in jsonl_rows(path, what="long_context file"):
        item = _parse_item(row, file=file, line=lineno, suite=suite, base=base, cache=cache)
        if item.id in seen:
            raise QevalInputError(f"duplicate id {item.id!r} (first on line {seen[item.id]})", file=file,
                                  line=lineno, field="id")
        seen[item.id] = lineno
        items.append(item)
    if not items:
        raise QevalInputError("long_context file has no items", file=file)
    return items


def _parse_item(row: Any, *, file: str, line: int, suite: str, base: Path, cache: dict) -> LongContextItem:
    def err(field: str, message: str) -> QevalInputError:
        return QevalInputError(message, file=file, line=line, field=field)

    if not isinstance(row, dict):
        raise err("row", f"must be a JSON object, got {describe_value(row)}")
    for k in row:
        if k not in _ROW_FIELDS:
            raise err(str(k), f"unknown field (allowed: {', '.join(_ROW_FIELDS)})")
    for k in _ROW_FIELDS:
        if k not in row:
            raise err(k, "missing required field")
    for k in ("id", "genre", "filler", "title", "preamble"):
        if not _str(row[k]):
            raise err(k, f"must be a non-empty one-line string, got {describe_value(row[k])}")
    if not _is_int(row["filler_start"]) or row["filler_start"] < 0:
        raise err("filler_start", f"must be an integer >= 0, got {describe_value(row['filler_start'])}")

    fpath = Path(row["filler"])
    fpath = fpath if fpath.is_absolute() else base / fpath
    if not fpath.is_file():
        raise err("filler", f"filler file {row['filler']!r} not found (looked for {fpath})")
    pool = _load_filler(fpath, cache).get(row["genre"])
    if not pool:
        raise err("genre", f"no filler lines for genre {row['genre']!r} in {row['filler']}")
    filler_text = _norm("\n".join(pool))

    if not isinstance(row["facts"], list) or not row["facts"]:
        raise err("facts", f"must be a non-empty list of fact objects, got {describe_value(row['facts'])}")
    facts: list[Fact] = []
    for i, f in enumerate(row["facts"]):
        ff = f"facts[{i}]"
        if not isinstance(f, dict):
            raise err(ff, f"must be an object, got {describe_value(f)}")
        for k in f:
            if k not in _FACT_FIELDS:
                raise err(f"{ff}.{k}", f"unknown field (allowed: {', '.join(_FACT_FIELDS)})")
        for k in ("id", "at", "text"):
            if k not in f:
                raise err(f"{ff}.{k}", "missing required field")
        if not _str(f["id"]):
            raise err(f"{ff}.id", f"must be a non-empty string, got {describe_value(f['id'])}")
        if f["id"] in [x.id for x in facts]:
            raise err(f"{ff}.id", f"duplicate fact id {f['id']!r}")
        at = f["at"]
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 < at < 1:
            raise err(f"{ff}.at", f"must be a number between 0 and 1 (exclusive), got {describe_value(at)}")
        if not _str(f["text"]):
            raise err(f"{ff}.text", f"must be a non-empty one-line string, got {describe_value(f['text'])}")
        if "value" in f and not _is_int(f["value"]):
            raise err(f"{ff}.value", f"must be an integer, got {describe_value(f['value'])}")
        facts.append(Fact(f["id"], float(at), f["text"], f.get("value")))
    by_id = {f.id: f for f in facts}

    if not isinstance(row["questions"], list) or not row["questions"]:
        raise err("questions", f"must be a non-empty list of question objects, got {describe_value(row['questions'])}")
    questions: list[Question] = []
    for i, q in enumerate(row["questions"]):
        questions.append(_parse_question(q, f"questions[{i}]", err, by_id, facts, questions, row, filler_text))
    return LongContextItem(id=row["id"], suite=suite, genre=row["genre"], title=row["title"],
                           preamble=row["preamble"], facts=tuple(facts), questions=tuple(questions),
                           filler=pool, filler_start=row["filler_start"], source=f"{file}:{line}")


def _parse_question(q: Any, qf: str, err, by_id: dict[str, Fact], facts: list[Fact], done: list[Question],
                    row: dict, filler_text: str) -> Question:
    if not isinstance(q, dict):
        raise err(qf, f"must be an object, got {describe_value(q)}")
    for k in q:
        if k not in _Q_FIELDS:
            raise err(f"{qf}.{k}", f"unknown field (allowed: {', '.join(_Q_FIELDS)})")
    for k in ("id", "kind", "key", "ask", "facts"):
        if k not in q:
            raise err(f"{qf}.{k}", "missing required field")
    for k in ("id", "key", "ask"):
        if not _str(q[k]):
            raise err(f"{qf}.{k}", f"must be a non-empty one-line string, got {describe_value(q[k])}")
    if q["id"] in [x.id for x in done]:
        raise err(f"{qf}.id", f"duplicate question id {q['id']!r}")
    kind = q["kind"]
    if kind not in QUESTION_KINDS:
        shown = repr(kind) if isinstance(kind, str) else describe_value(kind)
        raise err(f"{qf}.kind", f"unknown question kind {shown} (known: {', '.join(QUESTION_KINDS)})")
    fids = q["facts"]
    if not isinstance(fids, list) or any(not isinstance(x, str) for x in fids):
        raise err(f"{qf}.facts", f"must be a list of fact ids, got {describe_value(fids)}")
    for j, x in enumerate(fids):
        if x not in by_id:
            raise err(f"{qf}.facts[{j}]", f"no fact with id {x!r} in this item")
    key = q["key"]
    if _norm(key) in filler_text:
        raise err(f"{qf}.key", f"{key!r} occurs in the {row['genre']} filler, so the document would not "
                               "answer it from the facts alone")
    texts = [by_id[x].text for x in fids]

    def scalar(v: Any, field: str) -> str | int:
        if _is_int(v) or _str(v):
            return v
        raise err(field, f"must be a non-empty string or an integer, got {describe_value(v)}")

    stale = None
    if kind == "absent":
        if "answer" in q or "stale" in q:
            raise err(f"{qf}.{'answer' if 'answer' in q else 'stale'}", "an absent question has no answer")
        if fids:
            raise err(f"{qf}.facts", "an absent question names no facts")
        for field in ("title", "preamble"):
            if _norm(key) in _norm(row[field]):
                raise err(f"{qf}.key", f"{key!r} occurs in the item's {field}, so it is not absent")
        for f in facts:
            if _norm(key) in _norm(f.text):
                raise err(f"{qf}.key", f"{key!r} occurs in fact {f.id}, so it is not absent")
        return Question(q["id"], kind, key, q["ask"], (), None, ())
    if "answer" not in q:
        raise err(f"{qf}.answer", "missing required field")
    if "stale" in q and kind != "update":
        raise err(f"{qf}.stale", "only an update question has a stale value")
    a = q["answer"]
    if kind == "multi":
        if not isinstance(a, list) or len(a) < 2:
            raise err(f"{qf}.answer", f"must be a list of at least 2 values, got {describe_value(a)}")
        answers = tuple(scalar(v, f"{qf}.answer[{j}]") for j, v in enumerate(a))
    elif kind in ("count", "sum"):
        if not _is_int(a) or (kind == "count" and a < 1):
            raise err(f"{qf}.answer", f"must be an integer{' >= 1' if kind == 'count' else ''}, got {describe_value(a)}")
        answers = (a,)
    else:
        answers = (scalar(a, f"{qf}.answer"),)
    if not fids:
        raise err(f"{qf}.facts", f"a {kind} question names the facts its answer comes from")
    for j, v in enumerate(answers):
        if isinstance(v, str) and _norm(v) in filler_text:
            raise err(f"{qf}.answer" + (f"[{j}]" if kind == "multi" else ""),
                      f"{v!r} occurs in the {row['genre']} filler")

    if kind in ("lookup", "multi"):
        for j, v in enumerate(answers):
            if not any(_hit(v, t) for t in texts):
                raise err(f"{qf}.answer" + (f"[{j}]" if kind == "multi" else ""),
                          f"{_shown(v)} is not written in facts {', '.join(fids)}")
    elif kind == "update":
        if len(fids) != 2:
            raise err(f"{qf}.facts", f"an update question names 2 facts (earlier, later), got {len(fids)}")
        if "stale" not in q:
            raise err(f"{qf}.stale", "missing required field (the earlier, superseded value)")
        stale = scalar(q["stale"], f"{qf}.stale")
        if _norm(str(stale)) == _norm(str(answers[0])):
            raise err(f"{qf}.stale", "must differ from the answer")
        if isinstance(stale, str) and _norm(stale) in filler_text:
            raise err(f"{qf}.stale", f"{stale!r} occurs in the {row['genre']} filler")
        early, late = by_id[fids[0]], by_id[fids[1]]
        if not _hit(stale, early.text):
            raise err(f"{qf}.stale", f"{_shown(stale)} is not written in fact {early.id}")
        if not _hit(answers[0], late.text):
            raise err(f"{qf}.answer", f"{_shown(answers[0])} is not written in fact {late.id}")
        if not late.at > early.at:
            raise err(f"{qf}.facts", f"the later fact {late.id} (at {late.at}) must come after {early.id} "
                                     f"(at {early.at})")
    else:  # count, sum: entries with the key, and no other line of the document has it
        for j, x in enumerate(fids):
            if _norm(key) not in _norm(by_id[x].text):
                raise err(f"{qf}.facts[{j}]", f"fact {x} does not contain the key {key!r}")
        for f in facts:
            if f.id not in fids and _norm(key) in _norm(f.text):
                raise err(f"{qf}.facts", f"fact {f.id} also contains the key {key!r} but is not listed")
        for field in ("title", "preamble"):
            if _norm(key) in _norm(row[field]):
                raise err(f"{qf}.key", f"{key!r} occurs in the item's {field}")
        if len(set(fids)) != len(fids):
            raise err(f"{qf}.facts", "lists a fact twice")
        if kind == "count" and answers[0] != len(fids):
            raise err(f"{qf}.answer", f"count {answers[0]} is not the number of its facts ({len(fids)})")
        if kind == "sum":
            for j, x in enumerate(fids):
                v = by_id[x].value
                if v is None:
                    raise err(f"{qf}.facts[{j}]", f"fact {x} has no value to add up")
                if not _hit(v, by_id[x].text):
                    raise err(f"{qf}.facts[{j}]", f"fact {x}'s value {v:,} is not written in its text")
            total = sum(by_id[x].value for x in fids)  # type: ignore[misc]
            if answers[0] != total:
                raise err(f"{qf}.answer", f"sum {answers[0]:,} is not the total of its facts' values ({total:,})")
    return Question(q["id"], kind, key, q["ask"], answers, stale, tuple(fids))


# ---- rendering ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RenderedItem:
    """An item rendered to one depth for one tokenizer.

    Attributes:
        item: the item; depth: the target (tokens).
        prompt_ids: the chat-templated prompt, ``len(prompt_ids) <= depth`` (tokens).
        text: the user message (document and questions).
        doc_start, doc_end: token indices in ``prompt_ids`` of the document body
            (``[doc_start, doc_end)``; the questions follow it).
        fact_positions: fact id -> relative position of its first token in the body (0..1).
    """
    item: LongContextItem
    depth: int
    prompt_ids: list[int]
    text: str
    doc_start: int
    doc_end: int
    fact_positions: dict[str, float]

    @property
    def n_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_ids)


def _chat_text(tokenizer: Any, system: str | None, user: str) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_chat(tokenizer, msgs, add_generation_prompt=True)  # the recipe's model.chat_template


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _questions_text(item: LongContextItem) -> str:
    return "\n\n---\n" + INSTRUCTIONS + "\n" + "\n".join(f"{i + 1}. {q.ask}" for i, q in enumerate(item.questions))


def _head(item: LongContextItem) -> str:
    return f"{item.title}\n{item.preamble}\n\n"


def _need(overhead: int, fact_tokens: int) -> int:
    """The shallowest depth :func:`render` takes: the fixed parts plus filler of at least
    half the facts' tokens (facts at most two thirds of the body)."""
    return overhead + fact_tokens + (fact_tokens + 1) // 2


def _too_short(item: LongContextItem, depth: int, fixed: int, need: int) -> str:
    return (f"depth {depth} is too short for item {item.id!r}: its title, facts and questions take {fixed} tokens; "
            f"use a depth of at least {need}")


def min_depth(item: LongContextItem, tokenizer: Any, system: str | None = None) -> tuple[int, int]:
    """The shallowest depth ``item`` renders at with ``tokenizer`` (what :func:`render`
    checks first, without building the document).

    Returns:
        ``(fixed, need)`` in tokens: ``fixed`` the chat-templated title, preamble, questions
        and facts with no filler; ``need`` = ``fixed`` + half the facts' tokens (rounded up),
        the least depth :func:`render` accepts.
    """
    text = _head(item) + _questions_text(item)
    overhead = len(_encode(tokenizer, _chat_text(tokenizer, system, text)))
    facts = sum(len(_encode(tokenizer, "\n" + f.text)) for f in item.facts)
    return overhead + facts, _need(overhead, facts)


def deepest_needs(recipe, tokenizer: Any) -> dict[int, dict]:
    """Per long_context suite (by its index in ``recipe.suites``), the item that needs the
    deepest document among those a run renders (the first ``limit``) and what it needs with
    the model's ``tokenizer`` (:func:`min_depth`): ``{i: {"id", "source", "fixed", "need"}}``
    in tokens. Plain numbers, so a caller may cache them (``qeval validate``)."""
    out: dict[int, dict] = {}
    for i, s in enumerate(recipe.suites):
        if s.kind != "long_context":
            continue
        items = load_long_context(recipe.resolve_path(s.path), s.name)
        needs = [(it, *min_depth(it, tokenizer)) for it in (items[: s.limit] if s.limit else items)]
        it, fixed, need = max(needs, key=lambda x: x[2])  # the item that needs the deepest document
        out[i] = {"id": it.id, "source": it.source, "fixed": int(fixed), "need": int(need)}
    return out


def check_depths_against_needs(recipe, needs: dict[int, dict]) -> None:
    """Every depth of every long_context suite at least what :func:`deepest_needs` found.

    Raises:
        QevalInputError: naming the recipe's ``suites[i].depths[j]`` line (the first depth
            too short), the item that needs the deepest document with its file and line, and
            that depth.
    """
    for i, n in needs.items():
        for j, d in enumerate(recipe.suites[i].depths or []):
            if d < n["need"]:
                raise recipe.error(("suites", i, "depths", j),
                                   f"depth {d} is too short for item {n['id']!r}: its title, facts and questions "
                                   f"take {n['fixed']} tokens; use a depth of at least {n['need']} (item "
                                   f"{n['source']}; the model's tokenizer)")


def check_depths_hold_items(recipe, tokenizer: Any) -> None:
    """Every depth of every long_context suite holds each of the suite's items that a run
    renders (the first ``limit``), as :func:`render` will need with the model's
    ``tokenizer`` (:func:`min_depth`); run before any stage so the reference pass does not
    stop on it (:func:`deepest_needs`, then :func:`check_depths_against_needs`).

    Raises:
        QevalInputError: as :func:`check_depths_against_needs`.
    """
    check_depths_against_needs(recipe, deepest_needs(recipe, tokenizer))


def render(item: LongContextItem, tokenizer: Any, depth: int, system: str | None = None) -> RenderedItem:
    """Build ``item``'s prompt at ``depth`` tokens with ``tokenizer`` (a Hugging Face tokenizer
    with a chat template). Deterministic for a given item, tokenizer and depth.

    Returns:
        :class:`RenderedItem`; ``depth - few <= n_tokens <= depth`` (short by less than one
        word's tokens).

    Raises:
        QevalInputError: the depth cannot hold the item's fixed parts (title, facts,
            questions, template) with filler of at least half the facts' tokens (facts at
            most two thirds of the body); names the item's file and line and the needed depth.
    """
    head, tail = _head(item), _questions_text(item)

    def build(lines: list[str]) -> tuple[str, list[int]]:
        text = head + "\n".join(lines) + tail
        return text, _encode(tokenizer, _chat_text(tokenizer, system, text))

    facts = sorted(item.facts, key=lambda f: f.at)  # stable: file order among equal positions
    fact_tok = [len(_encode(tokenizer, "\n" + f.text)) for f in facts]
    overhead = len(build([])[1])
    budget = depth - overhead - sum(fact_tok)  # tokens left for filler
    if 2 * budget < sum(fact_tok):  # facts at most two thirds of the body (min_depth: the same sums)
        file, _, line = item.source.rpartition(":")
        raise QevalInputError(_too_short(item, depth, overhead + sum(fact_tok), _need(overhead, sum(fact_tok))),
                              file=file or None, line=int(line) if line.isdigit() else None, field="depths")

    # filler lines in order from filler_start (tiled), with per-line token estimates
    pool, start = item.filler, item.filler_start
    units: list[str] = []
    est: list[int] = []
    while sum(est) < budget + 64:
        batch = [pool[(start + len(units) + j) % len(pool)] for j in range(128)]
        est += [len(x) for x in tokenizer(["\n" + b for b in batch], add_special_tokens=False)["input_ids"]]
        units += batch
    used, total = 0, 0
    while used < len(units) and total + est[used] <= budget:
        total += est[used]
        used += 1

    body_total = total + sum(fact_tok)

    def assemble(n_units: int) -> list[str]:
        """The first n_units filler lines with each fact inserted once ``at`` of the planned
        body tokens (filler and facts) precede it (facts past the filler in use go at the end)."""
        lines: list[str] = []
        cum, fi = 0, 0
        for u in range(n_units):
            while fi < len(facts) and facts[fi].at * body_total <= cum:
                lines.append(facts[fi].text)
                cum += fact_tok[fi]
                fi += 1
            lines.append(units[u])
            cum += est[u]
        lines += [f.text for f in facts[fi:]]
        return lines

    n_units = used
    text, ids = build(assemble(n_units))
    while len(ids) > depth and n_units > 0:  # estimates ran over: drop whole lines from the end
        n_units -= 1
        text, ids = build(assemble(n_units))
    base_lines = assemble(n_units)
    nxt = n_units
    while nxt < len(units):  # estimates ran under: add whole lines while they fit
        text2, ids2 = build(base_lines + [units[nxt]])
        if len(ids2) > depth:
            break
        base_lines, text, ids, nxt = base_lines + [units[nxt]], text2, ids2, nxt + 1
    words = units[nxt % len(units)].split() if nxt < len(units) else []
    lo, hi = 0, len(words)  # the most words of the next line that still fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        t2, i2 = build(base_lines + [" ".join(words[:mid])])
        if len(i2) <= depth:
            lo = mid
        else:
            hi = mid - 1
    if lo:
        base_lines = base_lines + [" ".join(words[:lo])]
        text, ids = build(base_lines)

    body = "\n".join(base_lines)
    chat = _chat_text(tokenizer, system, text)
    u0 = chat.find(text)
    b0 = u0 + len(head)
    b1 = b0 + len(body)
    starts = _token_starts(tokenizer, chat, ids)
    doc_start = bisect.bisect_left(starts, b0)
    doc_end = bisect.bisect_left(starts, b1)
    span = max(doc_end - doc_start, 1)
    positions: dict[str, float] = {}
    search = b0
    for f in facts:
        c = chat.find(f.text, search)
        search = c + len(f.text)
        positions[f.id] = (bisect.bisect_right(starts, c) - 1 - doc_start) / span
    return RenderedItem(item=item, depth=depth, prompt_ids=ids, text=text, doc_start=doc_start, doc_end=doc_end,
                        fact_positions=positions)


def _token_starts(tokenizer: Any, chat: str, ids: list[int]) -> list[int]:
    """Character offset in ``chat`` where each token of ``ids`` starts (fast tokenizers
    give offsets; otherwise the length of the decoded prefix, which is close)."""
    try:
        enc = tokenizer(chat, add_special_tokens=False, return_offsets_mapping=True)
        offs = enc["offset_mapping"]
        if len(offs) == len(ids):
            out, last = [], 0
            for s, _e in offs:
                last = max(last, int(s))
                out.append(last)
            return out
    except (NotImplementedError, ValueError, KeyError, TypeError):
        pass
    out, last = [], 0
    for i in range(len(ids)):
        last = max(last, len(tokenizer.decode(ids[:i])))
        out.append(last)
    return out


# ---- running the suite: answers, fidelity at depth, per-depth summary ---------------------

def recipe_long_context(recipe) -> list[tuple[Any, list[LongContextItem]]]:
    """``[(suite spec, items)]`` for the recipe's long_context suites: the first ``limit``
    items of each file (all when unset), loaded and validated."""
    out = []
    for s in recipe.suites:
        if s.kind == "long_context":
            items = load_long_context(recipe.resolve_path(s.path), s.name)
            out.append((s, items[: s.limit] if s.limit else items))
    return out


def filler_files(recipe) -> list[Path]:
    """The filler files the recipe's long_context items name (for cache keys), sorted."""
    files: set[Path] = set()
    for s in recipe.suites:
        if s.kind != "long_context":
            continue
        path = recipe.resolve_path(s.path)
        for _line, row in jsonl_rows(path, what="long_context file"):
            if isinstance(row, dict) and isinstance(row.get("filler"), str):
                f = Path(row["filler"])
                files.add((f if f.is_absolute() else path.parent / f).resolve())
    return sorted(files)


def check_depths_fit(recipe, max_context: int | None) -> None:
    """Every long_context depth plus its suite's ``max_new_tokens`` within ``max_context``
    (tokens; None: not known, nothing checked).

    Raises:
        QevalInputError: naming the recipe's ``suites[i].depths[j]``.
    """
    if not max_context:
        return
    for i, s in enumerate(recipe.suites):
        for j, d in enumerate((s.depths or []) if s.kind == "long_context" else []):
            if d + s.max_new_tokens > max_context:
                raise recipe.error(("suites", i, "depths", j), f"depth {d} + max_new_tokens {s.max_new_tokens} "
                                   f"exceeds the model's maximum context of {max_context} tokens")


def _prompt_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def answer_long_context(engine: Any, tokenizer: Any, stop: list[int], suites: list[tuple[Any, list]],
                        progress=lambda s: None, window: int = 256, on_scores=None) -> list[dict]:
    """Greedy answers of ``engine`` to every item at every depth of its suite, and the
    teacher-forced log-probabilities of the last ``fidelity_tokens`` document tokens.

    Each prompt is prefilled once: through ``engine.generate_scored`` when the engine
    declares it (``capabilities.scored_generate``; the document tail is scored in that
    prefill), else :func:`document_logprobs` plus
    ``engine.generate``; the reference and every tier take the same path. ``on_scores(seg,
    rendered, rows)`` receives each segment's ``[(j, logp)]`` rows (see
    :func:`document_logprobs`) as they come, so only one document's rows are held at once.

    Returns one segment per (item, depth): ``item`` (suite/id), ``suite``, ``kind``
    (``long_context``), ``depth``, ``prompt_tokens``, ``prompt_sha`` (digest of the prompt
    ids), ``doc_end`` (token index where the questions start), ``score_tokens``,
    ``answer_ids``, ``finished``, ``text``, ``checks`` (one bool per question),
    ``check_details``, ``question_kinds``.
    """
    segments: list[dict] = []
    for spec, items in suites:
        w = spec.fidelity_tokens
        for d in spec.depths:
            for i, it in enumerate(items):
                progress(f"{spec.name}: depth {d}, item {i + 1} of {len(items)}")
                r = render(it, tokenizer, d)
                if engine.capabilities.scored_generate:
                    g, rows = engine.generate_scored(r.prompt_ids, r.doc_end - w, r.doc_end, spec.max_new_tokens,
                                                     stop_ids=stop, window=window)
                else:
                    rows = [] if getattr(engine, "fidelity_note", None) else \
                        list(document_logprobs(engine, r.prompt_ids, r.doc_end, w, window))  # a chat endpoint: none
                    g = engine.generate(r.prompt_ids, spec.max_new_tokens, stop_ids=stop)
                ids, fin = list(g.token_ids), bool(g.finished)
                body = ids[:-1] if (fin and ids and ids[-1] in stop) else ids
                text = tokenizer.decode(body, skip_special_tokens=True)
                res = check_answers(it, text)
                seg = {"item": f"{spec.name}/{it.id}", "suite": spec.name, "kind": "long_context",
                       "depth": d, "prompt_tokens": r.n_tokens, "prompt_sha": _prompt_digest(r.prompt_ids),
                       "doc_end": r.doc_end, "score_tokens": w, "answer_ids": ids, "finished": fin, "text": text,
                       "checks": [c.passed for c in res],
                       "check_details": [f"{q.id} {c.kind}: {c.detail}" for q, c in zip(it.questions, res)],
                       "question_kinds": [q.kind for q in it.questions]}
                segments.append(seg)
                if on_scores is not None:
                    on_scores(seg, r, rows)
                del rows
    return segments


def document_logprobs(engine: Any, prompt_ids: list[int], doc_end: int, n_tokens: int, window: int):
    """Teacher-forced log-probabilities of the last ``n_tokens`` document tokens (those
    before ``doc_end``) with the whole document before them in the cache, as llama.cpp's
    perplexity tool scores the tail of a long context.

    Yields ``(j, logp)``: ``logp`` ``[m, vocab]`` rows predict document tokens
    ``doc_end - n_tokens + j ...``; the target ids are ``prompt_ids[doc_end - n_tokens:doc_end]``.
    """
    first = doc_end - n_tokens - 1
    for start, logp in engine.iter_logprobs(list(prompt_ids[:doc_end]), window, first):
        yield start - first, logp


def summarise_long_context(segments: list[dict], ref_by_key: dict[tuple, dict] | None,
                           fidelity: dict[int, dict] | None, n_boot: int = 1000) -> dict:
    """Per-depth recall, flips and fidelity of one tier's long-context answers.

    Args:
        segments: the tier's segments from :func:`answer_long_context`.
        ref_by_key: the reference's segments keyed by ``(item, depth)`` (None for the reference itself).
        fidelity: per depth, a :meth:`~qeval.measure.fidelity.FidelityAccumulator.summary` (or None).

    Returns:
        ``{"depths": {"<depth>": {recall, recall_ci_low, recall_ci_high (percentile bootstrap
        95 % interval resampling items, as for the other suites), n_questions, n_items,
        by_kind {kind: share passed}, flips_pass_to_fail, flips_fail_to_pass, flip_rate,
        n_compared (questions decided on both sides; None for the reference)
        (Dutta et al. 2024, arXiv:2407.09141), budget_exhausted_rate, fidelity}}}``.
    """
    out: dict[str, dict] = {}
    for d in sorted({s["depth"] for s in segments}):
        segs = [s for s in segments if s["depth"] == d]
        rate, lo, hi = bootstrap_ci([s["checks"] for s in segs], n_boot)
        kinds: dict[str, list[bool]] = {}
        for s in segs:
            for k, c in zip(s["question_kinds"], s["checks"]):
                kinds.setdefault(k, []).append(bool(c))
        p2f = f2p = compared = 0
        for s in segs:
            ref = (ref_by_key or {}).get((s["item"], d))
            if ref is None:
                continue
            for mine, theirs in zip(s["checks"], ref["checks"]):
                compared += 1
                p2f += bool(theirs and not mine)
                f2p += bool(mine and not theirs)
        row = {"recall": rate, "recall_ci_low": lo, "recall_ci_high": hi,
               "n_questions": sum(len(s["checks"]) for s in segs), "n_items": len(segs),
               "by_kind": {k: sum(v) / len(v) for k, v in kinds.items()},
               "flips_pass_to_fail": p2f if ref_by_key is not None else None,
               "flips_fail_to_pass": f2p if ref_by_key is not None else None,
               "flip_rate": (p2f + f2p) / compared if compared else None,
               "n_compared": compared if ref_by_key is not None else None,
               "budget_exhausted_rate": sum(not s["finished"] for s in segs) / len(segs),
               "fidelity": (fidelity or {}).get(d)}
        out[str(d)] = row
    return {"depths": out}
