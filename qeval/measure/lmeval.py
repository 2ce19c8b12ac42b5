"""Optional lm-evaluation-harness suites on a tier's loaded model.

A recipe lists local task YAMLs (``quality.lm_eval_tasks``); each may point at local JSONL
through ``dataset_kwargs.data_files`` (relative to the YAML). qeval writes resolved copies
(absolute data paths) into the run folder and runs them offline through
``lm_eval.simple_evaluate`` with the tier's already loaded transformers model (``HFLM``
wraps it; nothing is loaded twice). Engines without a transformers model
(``capabilities.lm_eval`` false: llama.cpp) are reported as skipped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..bounded import expand_user, load_yaml, safe_join
from ..errors import QevalInputError


def check_task(path: Path) -> dict:
    """Read a local lm-eval task YAML and make its data files absolute (relative ones start
    at the YAML's folder, as lm-eval's own ``include`` paths do). Returns the task document.

    Raises:
        QevalInputError: a missing or malformed YAML, a task without ``task:``, a missing
            data file (naming the task file and its ``dataset_kwargs.data_files`` field).
    """
    p = Path(path)
    doc, _ = load_yaml(p, what="lm-eval task file", field="quality.lm_eval_tasks")  # bounded (qeval.bounded)
    if not isinstance(doc, dict) or not isinstance(doc.get("task"), str):
        raise QevalInputError("an lm-eval task YAML needs a 'task:' name", file=p, field="task")
    kwargs = doc.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if isinstance(files, dict):
        for split, f in files.items():
            if not isinstance(f, str):
                raise QevalInputError("must be a file path", file=p, field=f"dataset_kwargs.data_files.{split}")
            q = expand_user(f, file=p, field=f"dataset_kwargs.data_files.{split}")
            if not q.is_absolute():
                q = (p.parent / q).resolve()
            if not q.is_file():
                raise QevalInputError(f"data file {f!r} not found ({q})", file=p,
                                      field=f"dataset_kwargs.data_files.{split}")
            files[split] = str(q)
    return doc


def resolve_tasks(task_paths: list[Path], out_dir: Path) -> list[str]:
    """Copy task YAMLs into ``out_dir`` with data file paths made absolute; return task names.

    Raises:
        QevalInputError: as :func:`check_task`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for p in task_paths:
        doc = check_task(p)
        dest = safe_join(out_dir, f"{doc['task']}.yaml", what="lm-eval task name", file=p)  # never outside the run
        dest.write_text(yaml.safe_dump(doc, sort_keys=False))
        names.append(doc["task"])
    return names


def run_lm_eval(engine: Any, tokenizer: Any, task_paths: list[Path], out_dir: Path,
                limit: int | None = None) -> dict[str, Any]:
    """Scores ``{task: {metric: value}}`` of the tier's model on the local tasks.

    Returns ``{"skipped": reason}`` for an engine lm-eval cannot drive.
    """
    if not task_paths:
        return {}
    if not engine.capabilities.lm_eval:
        return {"skipped": f"lm-eval runs on the transformers engine; this tier runs on {engine.name}"}
    from lm_eval import simple_evaluate  # optional: the qeval[lmeval] extra
    from lm_eval.models.huggingface import HFLM  # optional: the qeval[lmeval] extra
    from lm_eval.tasks import TaskManager  # optional: the qeval[lmeval] extra

    names = resolve_tasks(task_paths, out_dir)
    lm = HFLM(pretrained=engine.model, tokenizer=tokenizer, batch_size=1, device=engine.device)
    tm = TaskManager(include_path=str(out_dir), include_defaults=False)
    res = simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=limit, log_samples=False,
                          bootstrap_iters=0)
    out: dict[str, Any] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not k.startswith(("alias", "sample_len"))
                     and "stderr" not in k}
    return out
