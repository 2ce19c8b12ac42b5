"""Calibration text for GPTQ/AWQ: ``datasets/calibration.jsonl`` (business-domain text
written for this project), loaded with the ``datasets`` library's JSON loader."""
from __future__ import annotations

from .errors import QevalInputError
from .hashing import file_sha256


def calibration_fields(recipe) -> dict:
    """What identifies the calibration set in an artifact key: file hash, samples, seq_len."""
    p = recipe.resolve_path(recipe.calibration.path)
    return {"sha256": file_sha256(p) if p.is_file() else None,
            "samples": recipe.calibration.samples, "seq_len": recipe.calibration.seq_len}


def load_calibration_texts(recipe) -> list[str]:
    """The first ``calibration.samples`` texts of the calibration JSONL (field ``text``).

    Raises:
        QevalInputError: missing file, a row without a string ``text``, or fewer rows
            than ``samples``.
    """
    import datasets  # start-up time: only calibration loads datasets

    p = recipe.resolve_path(recipe.calibration.path)
    if not p.is_file():
        raise QevalInputError("calibration file not found", file=p, field="calibration.path")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("json", data_files=str(p), split="train")
    except Exception as e:
        raise QevalInputError(f"cannot load calibration JSONL: {e.__class__.__name__}: {str(e)[:200]}",
                              file=p, field="calibration.path") from None
    if "text" not in ds.column_names:
        raise QevalInputError("rows need a 'text' field", file=p, line=1, field="text")
    texts = []
    for i, t in enumerate(ds["text"]):
        if not isinstance(t, str) or not t.strip():
            raise QevalInputError("'text' must be a non-empty string", file=p, line=i + 1, field="text")
        texts.append(t)
    n = recipe.calibration.samples
    if len(texts) < n:
        raise QevalInputError(f"has {len(texts)} rows, the recipe asks for {n} samples",
                              file=p, field="calibration.samples")
    return texts[:n]
