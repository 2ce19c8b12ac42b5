"""Recipe checks beyond its schema, before any model is loaded (``qeval validate`` and
the start of ``qeval run``): the model source, depths against its context, every data
file the recipe names, every suite row, long-context depths against the documents they must
hold (with the model's tokenizer, where it is on this machine), lm-eval task files, the
storage URL, and each tier method's own checks that need no model
(:meth:`~qeval.tiers.base.TierMethod.check_at_validate`)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .engines.servers import dialects, get_server
from .errors import QevalInputError
from .executors import executor_names
from .measure.lmeval import check_task
from .hashing import file_sha256
from .measure.long_context import (check_depths_against_needs, check_depths_fit,
                                   deepest_needs, load_long_context)
from .measure.suites import load_suite
from .osutil import stderr_fd_to
from .paths import cache_root
from .results import atomic_write_json
from .recipe import check_context, check_data_paths, fidelity_rules
from .measure.prompt_format import (apply_prompt_format, folder_has_template, no_template_message,
                                    prompt_format_key, read_template)
from .source import (check_gguf_file, find_package_gguf, gguf_context_length, gguf_has_key, is_gguf_path,
                     is_package_function, model_max_context, model_source_path, package_function, resolve_source)
from .storage import check_protocol, is_url
from .model_config import model_structure
from .tiers import get_method
from .tiers.base import TierContext


def static_checks(recipe, gguf_tokenizer: bool = True) -> bool:
    """Checks that need no model load: the executor is a registered one; the model source exists (local folder with
    config.json, relative to the recipe's folder, or an installed GGUF package); every data
    file the recipe names exists and is readable (:func:`qeval.recipe.check_data_paths`), and
    every suite row (long_context items and their filler too) and lm-eval task file parses;
    every depth plus decode_tokens (the load depth plus output_tokens, every long_context
    depth plus its suite's max_new_tokens) fits the model's maximum context when it can be read;
    every long_context depth holds its suite's documents (:func:`check_long_context_depths`).
    Hub ids are checked at run time (the long_context depths right after the source stage).

    Args:
        gguf_tokenizer: whether the long_context check may read the tokenizer out of a GGUF
            package's file when no earlier run expanded it (``qeval validate``: yes; ``qeval
            run``: no, the source stage expands it first, which costs about 11 s of the GGUF
            reader the source stage then does again).

    Returns:
        Whether the long_context depths were checked (False: check them after the source
        stage, :meth:`qeval.run.Runner.run`).

    Raises:
        QevalInputError: naming the recipe file, line and field.
    """
    if recipe.executor not in executor_names():  # a registered executor (qeval.executors)
        raise recipe.error(("executor",), f"unknown executor {recipe.executor!r} "
                                          f"(known: {', '.join(executor_names())})")
    check_prompt_mode_fidelity(recipe)
    m = recipe.model
    maxctx = None
    gguf: Path | None = None
    if m.gguf_package and is_package_function(m.gguf_package):
        try:  # imported and checked callable here; called once, by the source stage
            package_function(m.gguf_package)
        except QevalInputError as e:
            raise recipe.error(("model", "gguf_package"), e.message) from None
    elif m.gguf_package:
        try:
            gguf = find_package_gguf(m.gguf_package)
        except QevalInputError as e:
            raise recipe.error(("model", "gguf_package"), e.message) from None
        maxctx = gguf_context_length(gguf)
    else:
        src = m.source or ""
        p = model_source_path(src, recipe.base_dir)
        if p is not None:
            if not p.exists():
                raise recipe.error(("model", "source"), f"model path {src!r} does not exist ({p}; relative "
                                                        "paths start at the recipe's folder)")
            if is_gguf_path(src) and not p.is_dir():
                try:
                    check_gguf_file(p, "file", "model.source")
                except QevalInputError as e:
                    raise recipe.error(("model", "source"), e.message) from None
                gguf = p
                maxctx = gguf_context_length(p)
            elif p.is_file():
                raise recipe.error(("model", "source"), f"{src} is a file, not a Hugging Face checkpoint folder "
                                                        "(a GGUF file must end in .gguf)")
            elif not (p / "config.json").is_file():
                raise recipe.error(("model", "source"), f"{src} has no config.json (not a Hugging Face checkpoint)")
            else:
                try:
                    with open(p / "config.json", "rb") as f:
                        f.read(1)
                except OSError as e:
                    raise recipe.error(("model", "source"), f"cannot read {p / 'config.json'}: "
                                                            f"{e.strerror or e}") from None
                maxctx = model_max_context(p)
    check_prompt_format(recipe, _local_checkpoint(m, recipe.base_dir), gguf)
    check_context(recipe, maxctx)
    check_data_paths(recipe)
    for s in recipe.suites:  # bad rows: file:line
        if s.kind == "long_context":
            load_long_context(recipe.resolve_path(s.path), s.name)
        else:
            load_suite(recipe.resolve_path(s.path), s.name, multi_turn=(s.kind == "multi_turn"))
    check_depths_fit(recipe, maxctx)
    depths_checked = check_long_context_depths(recipe, gguf_file=gguf_tokenizer)
    for i, t in enumerate(recipe.quality.lm_eval_tasks):
        check_lm_eval_task(recipe, i, t)
    if is_url(recipe.storage):
        try:
            check_protocol(recipe.storage)
        except QevalInputError as e:
            raise recipe.error(("storage",), e.message) from None
    elif recipe.storage_options:
        raise recipe.error(("storage_options",), "storage_options need a storage URL (s3://..., gs://...)")
    tier_shape_checks(recipe, checkpoint=_local_checkpoint(m, recipe.base_dir))
    tier_capabilities(recipe, _local_checkpoint(m, recipe.base_dir))
    return depths_checked


def tier_capabilities(recipe, checkpoint: Path | None) -> list[tuple[str, str, str]]:
    """Whether each tier runs on the model's structure, decided from its ``config.json``
    (:func:`qeval.model_config.model_structure`: layer types, window, experts; never the
    model's name) and each method's declaration (:meth:`qeval.tiers.base.TierMethod.capability`).
    Without the checkpoint on this machine (a hub id, a GGUF package not expanded yet)
    nothing is said: ``[]``, and each tier's own stage decides.

    Returns:
        ``[(tier, "runs" | "untested", text)]`` for every tier (``qeval validate`` prints them).

    Raises:
        QevalInputError: a tier cannot run (named with its line in the recipe, the reason, and
            the tiers that would run).
    """
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return []
    try:
        structure = model_structure(json.loads((Path(checkpoint) / "config.json").read_text()))
    except (QevalInputError, ValueError, OSError):
        return []  # the config's own errors are read_model_config's to report
    out, refused = [], []
    for i, spec in enumerate(recipe.tiers):
        verdict, text = get_method(spec.method).capability(spec, structure)
        if verdict == "refused":
            refused.append((i, spec.name, text))
        out.append((spec.name, verdict, text))
    if refused:
        i, name, text = refused[0]
        ok = [t for t, v, _ in out if v != "refused"]
        raise recipe.error(("tiers", i, "method"), f"tier {name!r} cannot run on this model ({structure.describe()}): "
                                                   f"{text}; tiers that would run: {', '.join(ok) or 'none'}")
    return [(t, v, f"{structure.describe()}" + (f"; {x}" if x else "")) for t, v, x in out]


def _dialect_scores(t) -> tuple[bool | None, str]:
    """Whether tier ``t``'s server returns top-k log-probabilities by token id (the text
    mode's fidelity needs them), as far as the recipe says: a managed server by its kind's
    dialect; an endpoint by the ``dialect`` it names, where its spec has one (None: not
    known before the run connects; the endpoint's ``owned_by`` decides then). Returns
    ``(scores, the dialect's name)``."""
    if t.serve is not None:
        d = get_server(t.serve.kind).dialect
        return bool(d.logprobs), d.name
    named = getattr(t.endpoint, "dialect", None) if t.endpoint is not None else None
    if not named:
        return None, "unknown"
    d = next((d for d in dialects() if d.name == named), None)  # EndpointSpec checked the name
    return (bool(d.logprobs), d.name) if d is not None else (None, str(named))


def check_prompt_mode_fidelity(recipe) -> None:
    """Refuse a ``prompt_mode: text`` tier the gate judges (or scores against) with a
    fidelity rule when its server is known to return no top-k log-probabilities by token
    id (SGLang, a plain OpenAI dialect): the rule could only fail it for a missing figure
    (the row would say "fidelity not measurable on this endpoint"). Chat mode is refused
    the same way by the schema (:func:`qeval.recipe._check_prompt_modes`). An endpoint
    whose dialect the recipe does not name is checked when the run connects.

    Raises:
        QevalInputError: one line naming the tier's ``prompt_mode`` field and the rule.
    """
    rules = fidelity_rules(recipe)
    if not rules:
        return
    g = recipe.gate
    judged = set(g.candidates) if g.candidates else {t.name for t in recipe.tiers} - {g.reference}
    for i, t in enumerate(recipe.tiers):
        if getattr(t, "prompt_mode", None) != "text" or not (t.name in judged or t.name == g.reference):
            continue
        scores, name = _dialect_scores(t)
        if scores is False:
            raise recipe.error(("tiers", i, "prompt_mode"),
                               f"prompt_mode text on the {name} dialect returns no top-k log-probabilities by "
                               f"token id, so gate rule {rules[0]} cannot be measured on tier {t.name}: serve it "
                               "with llama-server or vLLM, or leave the tier out of gate.candidates")


def check_lm_eval_task(recipe, i: int, task: str) -> None:
    """``quality.lm_eval_tasks[i]`` names a ``.yaml``/``.yml`` file holding a mapping with a
    plain ``task:`` name (it names a file in the run folder) whose data files exist
    (:func:`qeval.measure.lmeval.check_task`, read with the bounded YAML loader).

    Raises:
        QevalInputError: naming the recipe line, or the task file itself when it is bad.
    """
    loc = ("quality", "lm_eval_tasks", i)
    p = recipe.resolve_path(task)
    if p.suffix.lower() not in (".yaml", ".yml"):
        raise recipe.error(loc, f"lm-eval task {task!r} must be a .yaml file")
    doc = check_task(p)  # the task's own data files: task file and field
    name = doc["task"]
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 200:
        raise QevalInputError(f"task name {name[:80]!r} must be a plain name (it names a file)", file=p,
                              field="task")


def check_long_context_depths(recipe, folder: Path | None = None, gguf_file: bool = True) -> bool:
    """Every long_context depth holds the documents of its suite with the model's tokenizer
    (:func:`qeval.measure.long_context.check_depths_hold_items`: the reference stage would
    stop on the first item a depth cannot hold). The tokenizer comes from ``folder`` when
    given (the source stage's checkpoint), else from this machine without converting or
    downloading anything: the local checkpoint folder (or a GGUF package's folder an earlier
    run expanded), else the GGUF package's file itself (transformers' GGUF tokenizer: the one
    the source stage saves beside the expanded checkpoint; not with ``gguf_file=False``).
    A hub id not given a ``folder`` is left to :meth:`qeval.run.Runner.run`, after the
    source stage.

    Returns:
        True when the depths were checked (or there is no long_context suite), False when
        no tokenizer was on this machine.

    Raises:
        QevalInputError: a depth too short (the recipe's ``suites[i].depths[j]``), or a
            tokenizer that does not load (``model.source`` / ``model.gguf_package``).
    """
    if not any(s.kind == "long_context" for s in recipe.suites):
        return True
    m = recipe.model
    field = ("model", "gguf_package" if m.gguf_package else "source")
    gguf: Path | None = None
    if folder is None:
        folder = _local_checkpoint(m, recipe.base_dir)
        if folder is None and gguf_file:
            try:
                gguf = _known_gguf(m, recipe.base_dir)
            except QevalInputError as e:
                raise recipe.error(field, e.message) from None
        if folder is None and gguf is None:
            return False
    cache = _needs_cache_file(recipe, folder, gguf)
    needs = _read_needs(cache)
    if needs is None:
        try:
            from transformers import AutoTokenizer  # start-up time: transformers loads only where a tokenizer is needed
            with open(os.devnull, "w") as devnull, stderr_fd_to(devnull.fileno()):  # GGUF reading prints notices
                tok = (AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name) if gguf is not None
                       else AutoTokenizer.from_pretrained(str(folder)))
            apply_prompt_format(tok, m, recipe.base_dir)  # the prompts as the reference renders them
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise recipe.error(field, f"cannot load the model's tokenizer from {gguf or folder} to check the "
                                      f"long_context depths: {e.__class__.__name__}: "
                                      f"{' '.join(str(e).split())[:200]}") from None
        needs = deepest_needs(recipe, tok)
        _write_needs(cache, needs)
    check_depths_against_needs(recipe, needs)
    return True


#: Part of the key of the cached long-context needs: bump when min_depth's arithmetic changes.
NEEDS_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt")


def _needs_cache_file(recipe, folder: Path | None, gguf: Path | None) -> Path | None:
    """Where the tokens each long_context suite's deepest item needs are kept for this
    tokenizer and these suite files (``$QEVAL_CACHE/validate/lc-needs-<key>.json``): the key
    hashes the tokenizer's files (name, size, modification time), each long_context suite's
    file content and limit, the transformers version and :data:`NEEDS_VERSION`. So the
    tokenizer (and transformers, seconds of start-up) loads once per change, not per
    ``qeval validate``. None when it cannot be formed (the check then runs uncached)."""
    try:
        from importlib.metadata import version  # start-up time: stdlib, only with a long_context suite
        tf = version("transformers")
    except Exception:  # noqa: BLE001 - no metadata: no cache, the check still runs
        return None
    src = gguf if gguf is not None else folder
    try:
        files = [src] if gguf is not None else [src / n for n in _TOKENIZER_FILES if (src / n).is_file()]
        ident = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        suites = [[i, file_sha256(recipe.resolve_path(s.path)), s.limit] for i, s in enumerate(recipe.suites)
                  if s.kind == "long_context"]
    except OSError:
        return None
    try:
        fmt = prompt_format_key(recipe.model, recipe.base_dir)  # model.chat_template: other prompts, other needs
    except QevalInputError:
        return None
    parts = [ident, suites, tf, NEEDS_VERSION] + ([fmt] if fmt else [])  # unset: the key it always had
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return cache_root() / "validate" / f"lc-needs-{key}.json"


def _read_needs(path: Path | None) -> dict[int, dict] | None:
    if path is None:
        return None
    try:
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return None


def _write_needs(path: Path | None, needs: dict[int, dict]) -> None:
    if path is None:
        return
    try:
        atomic_write_json(path, {str(k): v for k, v in needs.items()})
    except OSError:
        pass  # a read-only cache: checked again next time


def _local_checkpoint(model, base: Path | None = None) -> Path | None:
    """The recipe's checkpoint folder when it is on this machine without converting or
    downloading anything (a local folder, relative to ``base``, or a GGUF file or package
    expanded by an earlier run; a ``package:function`` is not called here: None)."""
    if model.gguf_package or is_gguf_path(model.source or ""):
        try:
            return Path(resolve_source(model, convert=False, base=base).path)
        except QevalInputError:
            return None
    p = model_source_path(model.source or "", base)
    return p if p is not None and (p / "config.json").is_file() else None


def _known_gguf(model, base: Path | None = None) -> Path | None:
    """The GGUF file the recipe's model comes from when it is known without calling
    anything: a ``.gguf`` ``source`` or a package's single ``.gguf`` (None otherwise)."""
    if model.gguf_package:
        return None if is_package_function(model.gguf_package) else find_package_gguf(model.gguf_package)
    src = model.source or ""
    p = model_source_path(src, base) if is_gguf_path(src) else None
    return p if p is not None and p.is_file() else None


def check_prompt_format(recipe, folder: Path | None = None, gguf: Path | None = None) -> bool:
    """The prompt format the suites' conversations need (:mod:`qeval.measure.prompt_format`):
    ``model.chat_template`` names a readable Jinja file (or ``none``); unset, the tokenizer
    must carry a chat template, read from the checkpoint ``folder``'s files or the GGUF
    file's ``tokenizer.chat_template`` key without loading transformers. A recipe without
    suites renders no conversation and passes.

    Returns:
        True when checked; False when no tokenizer is on this machine yet (a hub id, a
        ``package:function``: checked again after the source stage, :meth:`qeval.run.Runner.run`).

    Raises:
        QevalInputError: one line naming ``model.chat_template`` and both ways to set it.
    """
    m = recipe.model
    loc = ("model", "chat_template")
    if m.chat_template is not None:
        if m.chat_template != "none":
            try:
                read_template(m.chat_template, recipe.base_dir)
            except QevalInputError as e:
                raise recipe.error(loc, e.message) from None
        return True
    if not recipe.suites:
        return True
    if folder is not None:
        has, where = folder_has_template(folder), str(folder)
    elif gguf is not None:
        has, where = gguf_has_key(gguf, "tokenizer.chat_template"), str(gguf)
    else:
        return False
    if has is False:
        raise recipe.error(loc, no_template_message(m.source or m.gguf_package or where))
    return True


def tier_shape_checks(recipe, checkpoint: Path | None) -> None:
    """Run at validate time the tier checks a method can do before any model load
    (:meth:`~qeval.tiers.base.TierMethod.check_at_validate`: the GGUF type name on any
    machine with llama.cpp; for GPTQ/AWQ the group size against every Linear's input
    features, when the checkpoint's config is on this machine; otherwise the check runs at
    the start of the tier). Each method's own ``check`` does the work, so validate and run
    say the same thing.

    Raises:
        QevalInputError: naming the recipe file, the tier's line and its field.
    """
    for i, spec in enumerate(recipe.tiers):
        method = get_method(spec.method)
        if not method.check_at_validate(checkpoint):
            continue
        ctx = TierContext(source_path=str(checkpoint or ""), source_sha256="", device="cpu",
                          dtype=recipe.model.dtype, trust_remote_code=recipe.model.trust_remote_code)
        try:
            with open(os.devnull, "w") as devnull, stderr_fd_to(devnull.fileno()):
                method.check(spec, ctx)  # importing transformers/torchao prints load notices: validate is one line
        except QevalInputError as e:
            fld = (e.field or "").rsplit(".", 1)[-1] or "method"
            raise recipe.error(("tiers", i, fld), e.message) from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # transformers could not build the model from the checkpoint's config.json: the
            # user's file (read_model_config checked the fields qeval itself uses)
            raise QevalInputError(f"transformers cannot build the model from this config for tier "
                                  f"{spec.name!r}: {e.__class__.__name__}: {' '.join(str(e).split())[:200]}",
                                  file=Path(checkpoint or ".") / "config.json") from None
