"""Wall time of one recipe with the local executor and with the Ray executor, side by side.

Four tiers of a small random llama (built here, no download), no quality suites, so the
figure is the orchestration: the local executor runs tiers one after another; Ray runs one
task per tier on ``--workers`` CPUs. Prints both wall times and their ratio.

    python benchmarks/executors.py [--workers 2] [--hidden 256] [--layers 4]

On a 2-core machine the speed stages compete for the same cores under Ray, so speed
figures of a Ray run are only comparable on machines with a core per task.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

TIERS = """  - {name: bf16, method: bf16}
  - {name: bf16-kv8, method: bf16, kv_cache: int8}
  - {name: int8, method: int8}
  - {name: gptq, method: gptq, group_size: 64}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    from conftest import build_tiny_llama, write_recipe
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir

    tmp = Path(tempfile.mkdtemp(prefix="qeval-exec-"))
    os.environ["QEVAL_CACHE"] = str(tmp / "cache")
    model = build_tiny_llama(tmp / "model", hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2,
                             intermediate=2 * a.hidden)
    recipe = load_recipe(write_recipe(tmp / "r.yaml", model, tiers=TIERS, suites=False,
                                      extra="resources: {num_cpus: 1}\n"
                                            f"calibration: {{path: {REPO}/datasets/calibration.jsonl, samples: 8, seq_len: 128}}"))
    # warm the artifact cache once so both executors measure the same work
    Runner(recipe, new_run_dir(recipe, tmp / "warm")).run()
    t = time.perf_counter()
    local = Runner(recipe, new_run_dir(recipe, tmp / "local")).run()
    t_local = time.perf_counter() - t
    import ray
    ray.init(num_cpus=a.workers, include_dashboard=False, log_to_driver=False)
    t = time.perf_counter()
    remote = Runner(recipe, new_run_dir(recipe, tmp / "ray"), executor="ray").run()
    t_ray = time.perf_counter() - t
    ray.shutdown()
    ok = lambda res: sum(r["status"] == "ok" for r in res.values())  # noqa: E731
    print(f"4 tiers, tiny llama hidden {a.hidden} x {a.layers} layers, artifacts cached")
    print(f"local executor:            {t_local:7.1f} s  ({ok(local)}/4 tiers ok)")
    print(f"ray executor, {a.workers} workers:   {t_ray:7.1f} s  ({ok(remote)}/4 tiers ok)")
    print(f"ratio ray / local:         {t_ray / t_local:7.2f}")


if __name__ == "__main__":
    main()
