"""Wall time of one recipe with the local executor and with the Ray executor, side by side.

Four tiers of a small random llama (built here, no download), no quality suites, so the
figure is the orchestration: the local executor runs tiers one after another; Ray runs one
task per tier on ``--workers`` CPUs. A third run uses Ray with ``storage: s3://...`` on a
local S3 endpoint (moto, from the test extra) and an empty cache on the "nodes": each task
stages the run and fetches the source checkpoint and artifacts from the bucket, so the
difference to the second run is the cost of copying through the store. Prints the wall
times and their ratios.

    python benchmarks/executors.py [--workers 2] [--hidden 256] [--layers 4] [--no-url]

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
    ap.add_argument("--no-url", action="store_true", help="skip the storage-URL run")
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
    url_recipe = server = None
    if not a.no_url:  # warm the bucket (source, artifacts) from the driver, outside the timing
        from moto.server import ThreadedMotoServer
        import boto3
        import json
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                     region_name="us-east-1").create_bucket(Bucket="qeval-bench")
        opts = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        url_recipe = load_recipe(write_recipe(
            tmp / "r-url.yaml", model, tiers=TIERS, suites=False,
            extra="resources: {num_cpus: 1}\n"
                  f"calibration: {{path: {REPO}/datasets/calibration.jsonl, samples: 8, seq_len: 128}}\n"
                  f"storage: s3://qeval-bench/q\nstorage_options: {json.dumps(opts)}\n"))
        Runner(url_recipe, new_run_dir(url_recipe, tmp / "warm-url")).run()
    import ray
    ray.init(num_cpus=a.workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"QEVAL_CACHE": str(tmp / "node-cache")}})
    t = time.perf_counter()
    remote = Runner(recipe, new_run_dir(recipe, tmp / "ray"), executor="ray").run()
    t_ray = time.perf_counter() - t
    t_url = url = None
    if url_recipe is not None:
        t = time.perf_counter()
        url = Runner(url_recipe, new_run_dir(url_recipe, tmp / "ray-url"), executor="ray").run()
        t_url = time.perf_counter() - t
        server.stop()
    ray.shutdown()
    ok = lambda res: sum(r.status == "ok" for r in res.values())  # noqa: E731
    print(f"4 tiers, tiny llama hidden {a.hidden} x {a.layers} layers, artifacts cached")
    print(f"local executor:                  {t_local:7.1f} s  ({ok(local)}/4 tiers ok)")
    print(f"ray executor, {a.workers} workers:         {t_ray:7.1f} s  ({ok(remote)}/4 tiers ok)")
    print(f"ratio ray / local:               {t_ray / t_local:7.2f}")
    if t_url is not None:
        print(f"ray, {a.workers} workers, storage s3://: {t_url:7.1f} s  ({ok(url)}/4 tiers ok; nodes "
              "fetch source and artifacts from the bucket)")
        print(f"ratio ray s3:// / ray mounted:   {t_url / t_ray:7.2f}")


if __name__ == "__main__":
    main()
