"""`qeval validate` learns what needs the model's tokenizer or its architecture once per
change (qeval.validate's long-context needs, qeval.tiers.int8.decoder_linear_shapes): a
second validation of the same recipe imports neither torch nor transformers, and still
refuses a depth too short for the documents."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import sys
from qeval.recipe import load_recipe
from qeval.validate import static_checks
from qeval.errors import QevalInputError
r = load_recipe(sys.argv[1])
try:
    static_checks(r)
    print("ok")
except QevalInputError as e:
    print("refused:", e)
print("torch" in sys.modules, "transformers" in sys.modules)
"""


def _validate(recipe: Path, cache: Path) -> list[str]:
    env = dict(os.environ, QEVAL_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", CHECK, str(recipe)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()


def test_a_second_validation_imports_neither_torch_nor_transformers(tmp_path):
    recipe = tmp_path / "r.yaml"
    r = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    for s in r["suites"]:
        s["path"] = str(REPO / "qeval" / "data" / (s["path"].split(":", 1)[1] + ".jsonl"))
    r["quality"]["lm_eval_tasks"] = []
    recipe.write_text(yaml.safe_dump(r))
    cache = tmp_path / "cache"
    first = _validate(recipe, cache)
    assert first[0] == "ok" and first[1].split()[1] == "True"  # the tokenizer was loaded once
    assert list((cache / "validate").glob("lc-needs-*.json"))
    second = _validate(recipe, cache)
    assert second == ["ok", "False False"]
    # the cached needs still refuse a depth the documents do not fit in
    lc = next(s for s in r["suites"] if s["kind"] == "long_context")
    lc["depths"] = [256]
    recipe.write_text(yaml.safe_dump(r))
    third = _validate(recipe, cache)
    assert third[0].startswith("refused:") and "depth 256 is too short" in third[0] and third[1] == "False False"
