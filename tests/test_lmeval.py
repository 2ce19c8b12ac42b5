"""Optional lm-eval suites: a local task YAML + JSONL runs offline on the tier's model."""
from __future__ import annotations

from pathlib import Path

import pytest

from qeval.errors import QevalInputError

pytest.importorskip("lm_eval")
REPO = Path(__file__).resolve().parent.parent


def test_local_task_runs_offline_on_the_loaded_model(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.measure.lmeval import run_lm_eval
    engine = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    task = REPO / "datasets" / "lm_eval" / "qeval_business_mc.yaml"
    res = run_lm_eval(engine, tok, [task], tmp_path / "tasks", limit=4)
    assert set(res) == {"qeval_business_mc"}
    assert 0.0 <= res["qeval_business_mc"]["acc"] <= 1.0


def test_bad_task_yaml_is_an_input_error(tmp_path):
    from qeval.measure.lmeval import resolve_tasks
    bad = tmp_path / "t.yaml"
    bad.write_text("task: x\ndataset_kwargs: {data_files: {test: missing.jsonl}}\n")
    with pytest.raises(QevalInputError, match="missing.jsonl"):
        resolve_tasks([bad], tmp_path / "out")
    bad.write_text("dataset_path: json\n")
    with pytest.raises(QevalInputError, match="task:"):
        resolve_tasks([bad], tmp_path / "out")
