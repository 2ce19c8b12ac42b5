"""The Ray executor: a local Ray instance runs the tiny recipe's two tiers as tasks; the
tier results match the local executor's (timings aside)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import stable_fields, write_recipe, TIERS, GATE, s3_storage_yaml, s3_store

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def node_cache(tmp_path_factory) -> Path:
    """The Ray workers' own QEVAL_CACHE: what a cluster node has, apart from the driver's."""
    return tmp_path_factory.mktemp("ray-node") / "cache"


@pytest.fixture(scope="module")
def local_ray(node_cache):
    # Ray gives its raylet a fixed 30 s to register (ray/_private/node.py, 2.60); on 2 cores
    # shared with the other test worker's qeval run it sometimes needs longer: try again
    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"QEVAL_CACHE": str(node_cache)}})
            break
        except Exception:  # noqa: BLE001 - "timed out during startup" / "waiting for GCS"
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()


def test_ray_failed_stage_or_lost_task_fails_only_its_tier(local_ray, tiny_llama, tmp_path, monkeypatch):
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QEVAL_TEST_CRASH", "bf16-kv8:prepare")
    r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False, load=False))
    res = Runner(r, new_run_dir(r, tmp_path / "results"), executor="ray").run()
    assert res["bf16"].status == "ok"
    assert res["bf16-kv8"].status == "failed" and "SIGABRT" in res["bf16-kv8"].error
    # the Ray worker process itself dies: the task is lost, only its tier fails
    monkeypatch.delenv("QEVAL_TEST_CRASH")
    monkeypatch.setenv("QEVAL_TEST_RAY_TASK_CRASH", "bf16")
    res = Runner(r, new_run_dir(r, tmp_path / "results"), executor="ray").run()
    assert res["bf16"].status == "failed" and "ray task failed or was lost" in res["bf16"].error
    assert res["bf16-kv8"].status == "ok"


def test_ray_retries_a_lost_task(local_ray, tiny_llama, tmp_path, monkeypatch):
    """retries: 1 — the first attempt of bf16's task dies with its worker; Ray runs it again
    and the tier ends ok."""
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    marker = tmp_path / "bf16-crashed-once"
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QEVAL_TEST_RAY_TASK_CRASH_ONCE", f"bf16:{marker}")
    r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False,
                                 extra="retries: 1", load=False))
    res = Runner(r, new_run_dir(r, tmp_path / "results"), executor="ray").run()
    assert marker.exists()  # the first attempt did die
    assert res["bf16"].status == "ok", res["bf16"].error
    assert res["bf16-kv8"].status == "ok"


def test_ray_executor_through_a_storage_url(local_ray, node_cache, reference_run, s3, tmp_path, monkeypatch):
    """storage: s3://...: the tasks share nothing with the driver but the bucket. Each
    stages the run from the bucket into the node's own cache and copies its tier back; the
    driver's run folder ends up with the tier files, and results match the local run's
    (this is also the test that Ray's results match the local executor's: a run of its own
    for that alone cost minutes of CI)."""
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    recipe_path, local_dir, _ = reference_run
    text = recipe_path.read_text() + "\n" + s3_storage_yaml(s3, "ray")
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "driver-cache"))
    r = load_recipe(write_text(tmp_path / "tiny.yaml", text))
    run_dir = new_run_dir(r, tmp_path / "staging")
    events = []
    res = Runner(r, run_dir, executor="ray", on_event=lambda t, s, m: events.append((t, s))).run()
    assert set(res) == {"bf16", "bf16-kv8"}
    assert ("bf16", "ray") in events and ("bf16-kv8", "ray") in events
    st = s3_store(s3, "ray")
    rel = f"results/tiny/{run_dir.name}"
    for tier in ("bf16", "bf16-kv8"):
        assert res[tier].status == "ok", res[tier].error
        got = st.read_json(f"{rel}/tiers/{tier}.json")
        want = json.loads((local_dir / "tiers" / f"{tier}.json").read_text())
        assert stable_fields(got) == stable_fields(want), tier
        assert json.loads((run_dir / "tiers" / f"{tier}.json").read_text()) == got  # copied back to the driver
        assert (run_dir / "stages" / f"{tier}.measure.json").exists()
    # the tasks worked in the node's own cache (the source checkpoint and artifacts live
    # there), not in the driver's; their staging copies were dropped once in the store
    assert (node_cache / "nodes").is_dir()
    assert not any((node_cache / "nodes" / t / rel).exists() for t in ("bf16", "bf16-kv8"))
    assert not (tmp_path / "driver-cache" / "nodes").exists()


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
