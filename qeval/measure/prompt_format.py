"""Prompt formats: how a conversation (system prompt, user and assistant turns) becomes the
prompt a model reads. Every prompt qeval renders from messages goes through
:func:`render_chat` (the quality suites' turns, the long-context suite, a served tier's
token counts in chat mode), so the recipe's ``model.chat_template`` holds everywhere:

* unset: the tokenizer's own chat template (``prompt_format: "tokenizer"`` in ``run.json``);
  a tokenizer without one is refused before the run (:func:`check_prompt_format`);
* a Jinja file (relative to the recipe): used as the tokenizer's chat template
  (``"file:<name>"``);
* ``none``: plain text, as lm-evaluation-harness renders a conversation for a model without
  a chat template (``"plain"``, :func:`plain_text`).

The tokenizer carries its format (:func:`apply_prompt_format`, :func:`load_tokenizer`), so the
rendering needs nothing else.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import QevalInputError

#: ``model.chat_template`` value for plain-text prompts.
NONE = "none"
#: lm-eval's ``target_delimiter`` (default ``" "``): after a user turn an answer follows.
PLAIN_TARGET_DELIMITER = " "
#: lm-eval's ``fewshot_delimiter`` (default ``"\n\n"``): after each assistant answer.
PLAIN_TURN_DELIMITER = "\n\n"
_ATTR = "qeval_prompt_format"
FIELD = "model.chat_template"


def no_template_message(where: str) -> str:
    """The one line that refuses a tokenizer without a chat template and no setting."""
    return (f"the tokenizer of {where} has no chat template: set model.chat_template: <file> (a Jinja chat "
            "template, relative to the recipe) or model.chat_template: none (plain-text prompts, as "
            "lm-evaluation-harness renders them for base models)")


def prompt_format(model: Any) -> str:
    """What ``run.json`` records for the recipe's ``model`` section: ``"tokenizer"``,
    ``"file:<file name>"`` or ``"plain"``."""
    ct = getattr(model, "chat_template", None)
    if ct is None:
        return "tokenizer"
    if ct == NONE:
        return "plain"
    return f"file:{Path(ct).name}"


def prompt_format_text(fmt: str | None) -> str:
    """How the table and the report say a run's prompt format (``run.json``
    ``prompt_format``, :func:`prompt_format`): ``the tokenizer's chat template``, ``chat
    template file x.jinja`` or ``plain text (model.chat_template: none; lm-eval's base-model
    format)``; a run recorded before the field existed: ``the tokenizer's chat template``."""
    if fmt in (None, "tokenizer"):
        return "the tokenizer's chat template"
    if fmt == "plain":
        return "plain text (model.chat_template: none, as lm-evaluation-harness prompts base models)"
    return f"chat template file {fmt[len('file:'):]}" if fmt.startswith("file:") else str(fmt)


def plain_text(messages: Sequence[dict]) -> str:
    """A conversation as plain text, the way lm-evaluation-harness (0.4.13,
    ``ConfigurableTask.fewshot_context`` with ``apply_chat_template=False``) joins its
    messages for a base model: each message's content followed by its delimiter, nothing
    else: the system prompt with none (lm-eval's system message has no delimiter), a user
    turn with ``" "`` when an answer follows it (``target_delimiter``), an assistant answer
    with ``"\\n\\n"`` (``fewshot_delimiter``), the last user turn with none (the model
    continues from it; there is no generation prompt). No role names, no special tokens.

    ``[system S, user U1, assistant A1, user U2]`` -> ``S + U1 + " " + A1 + "\\n\\n" + U2``.
    """
    out = []
    for i, m in enumerate(messages):
        role, content = m["role"], str(m["content"])
        if role == "assistant":
            out.append(content + PLAIN_TURN_DELIMITER)
        elif role == "user":
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
            out.append(content + (PLAIN_TARGET_DELIMITER if nxt == "assistant" else ""))
        else:
            out.append(content)
    return "".join(out)


def apply_prompt_format(tok: Any, model: Any, base: str | Path | None = None) -> Any:
    """Give tokenizer ``tok`` the recipe's prompt format (``model``: the recipe's ``model``
    section; ``base``: the recipe's folder): a file becomes its ``chat_template``; ``none``
    marks it plain. Returns ``tok``.

    Raises:
        QevalInputError: the template file cannot be read (field ``model.chat_template``).
    """
    ct = getattr(model, "chat_template", None)
    if ct is None:
        fmt = "tokenizer"
    elif ct == NONE:
        fmt = "plain"
    else:
        tok.chat_template = read_template(ct, base)
        fmt = f"file:{Path(ct).name}"
    setattr(tok, _ATTR, fmt)
    return tok


def load_tokenizer(path: str | Path, model: Any, base: str | Path | None = None) -> Any:
    """The source checkpoint's tokenizer (transformers ``AutoTokenizer``) with the recipe's
    prompt format (:func:`apply_prompt_format`)."""
    from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes
    return apply_prompt_format(AutoTokenizer.from_pretrained(str(path)), model, base)


def template_path(value: str, base: str | Path | None = None) -> Path:
    """The file ``model.chat_template`` names (``~`` expanded, relative to ``base``)."""
    p = Path(value).expanduser()
    return p if p.is_absolute() or base is None else Path(base) / p


def read_template(value: str, base: str | Path | None = None) -> str:
    """The chat template file's text, checked to be a Jinja template.

    Raises:
        QevalInputError: missing, unreadable, not UTF-8, empty or not Jinja (one line).
    """
    p = template_path(value, base)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise QevalInputError(f"chat template file {value!r} does not exist ({p}; relative paths start at the "
                              "recipe's folder; `none` for plain-text prompts)", field=FIELD) from None
    except IsADirectoryError:
        raise QevalInputError(f"chat template {value!r} is a folder, not a Jinja file", field=FIELD) from None
    except OSError as e:
        raise QevalInputError(f"cannot read chat template file {p}: {e.strerror or e}", field=FIELD) from None
    except UnicodeDecodeError as e:
        raise QevalInputError(f"chat template file {p} is not UTF-8 text (byte {e.start})", field=FIELD) from None
    if not text.strip():
        raise QevalInputError(f"chat template file {p} is empty", field=FIELD)
    try:
        import jinja2  # start-up time: only a recipe naming a template file parses one
        jinja2.Environment().parse(text)
    except ImportError:
        pass
    except jinja2.TemplateSyntaxError as e:
        raise QevalInputError(f"chat template file {p} is not a Jinja template: line {e.lineno}: {e.message}",
                              field=FIELD) from None
    return text


def render_chat(tok: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                tokenize: bool = False) -> str | list[int]:
    """``messages`` (``[{"role", "content"}]``) rendered in the tokenizer's prompt format:
    the text, or its token ids (``tokenize``; the text encoded without adding special
    tokens, as a chat template's text is). Plain text is :func:`plain_text` after the BOS
    token where the tokenizer adds one by default (:func:`bos_prefix`: lm-eval encodes with
    the tokenizer's defaults); a chat template renders its own.

    Raises:
        QevalInputError: the tokenizer has no chat template and no format was set.
    """
    msgs = [dict(m) for m in messages]
    if getattr(tok, _ATTR, None) == "plain":
        text = bos_prefix(tok) + plain_text(msgs)
        if not tokenize:
            return text
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    if not getattr(tok, "chat_template", None):
        raise QevalInputError(no_template_message(getattr(tok, "name_or_path", None) or "the source"), field=FIELD)
    out = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
    if not tokenize:
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def bos_prefix(tok: Any) -> str:
    """The BOS token's text when the tokenizer puts it before a text by default (Llama,
    Gemma), else ``""`` (GPT-2, SmolLM2): encoding ``"a"`` with and without special tokens
    tells."""
    cached = getattr(tok, "_qeval_bos_prefix", None)
    if cached is not None:
        return cached
    out = ""
    bos = getattr(tok, "bos_token_id", None)
    if bos is not None and getattr(tok, "bos_token", None):
        with_special = tok("a")["input_ids"]
        plain = tok("a", add_special_tokens=False)["input_ids"]
        if with_special[:1] == [bos] and plain[:1] != [bos]:
            out = str(tok.bos_token)
    try:
        setattr(tok, "_qeval_bos_prefix", out)
    except AttributeError:
        pass
    return out


def folder_has_template(folder: str | Path) -> bool | None:
    """Whether a checkpoint folder's tokenizer carries a chat template, read from its files
    without transformers (``chat_template.jinja``, ``chat_template.json``, or
    ``tokenizer_config.json``'s ``chat_template``); None when there is no tokenizer config
    to read."""
    f = Path(folder)
    if (f / "chat_template.jinja").is_file() or (f / "chat_template.json").is_file():
        return True
    if (f / "additional_chat_templates").is_dir() and any((f / "additional_chat_templates").iterdir()):
        return True
    cfg = f / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        d = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(d.get("chat_template")) if isinstance(d, dict) else None


def prompt_format_key(model: Any, base: str | Path | None = None) -> dict:
    """What the prompt format adds to the reference pass's cache key: nothing for the
    tokenizer's own template (keys made before ``model.chat_template`` existed stay), else
    the format and, for a file, its SHA-256."""
    ct = getattr(model, "chat_template", None)
    if ct is None:
        return {}
    if ct == NONE:
        return {"prompt_format": "plain"}
    return {"prompt_format": "file", "chat_template_sha256":
            hashlib.sha256(read_template(ct, base).encode("utf-8")).hexdigest()}
