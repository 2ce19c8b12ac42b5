"""The Ray executor: a local Ray instance runs the tiny recipe's two tiers as tasks; the
tier results match the local executor's (timings aside)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import stable_fields, write_recipe, TIERS, GATE

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_executor_matches_local(local_ray, reference_run, tmp_path, monkeypatch):
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    recipe_path, local_dir, _ = reference_run
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    r = load_recipe(recipe_path)
    run_dir = new_run_dir(r, tmp_path / "results")
    events = []
    res = Runner(r, run_dir, executor="ray", on_event=lambda t, s, m: events.append((t, s))).run()
    assert set(res) == {"bf16", "bf16-kv8"}
    assert ("bf16", "ray") in events and ("bf16-kv8", "ray") in events
    for tier in res:
        got = json.loads((run_dir / "tiers" / f"{tier}.json").read_text())
        want = json.loads((local_dir / "tiers" / f"{tier}.json").read_text())
        assert got["status"] == "ok", got.get("error")
        assert stable_fields(got) == stable_fields(want), tier


def test_ray_failed_stage_or_lost_task_fails_only_its_tier(local_ray, tiny_llama, tmp_path, monkeypatch):
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QEVAL_TEST_CRASH", "bf16-kv8:prepare")
    r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False))
    res = Runner(r, new_run_dir(r, tmp_path / "results"), executor="ray").run()
    assert res["bf16"]["status"] == "ok"
    assert res["bf16-kv8"]["status"] == "failed" and "SIGABRT" in res["bf16-kv8"]["error"]
    # the Ray worker process itself dies: the task is lost, only its tier fails
    monkeypatch.delenv("QEVAL_TEST_CRASH")
    monkeypatch.setenv("QEVAL_TEST_RAY_TASK_CRASH", "bf16")
    res = Runner(r, new_run_dir(r, tmp_path / "results"), executor="ray").run()
    assert res["bf16"]["status"] == "failed" and "ray task failed or was lost" in res["bf16"]["error"]
    assert res["bf16-kv8"]["status"] == "ok"
