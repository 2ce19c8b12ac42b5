"""The ``ray`` executor: each tier's stages run as one Ray task asking for the recipe's
``resources`` (num_cpus, num_gpus, memory), so tiers run side by side on a cluster; inside
the task the stages are the same child processes as locally, run by the same
:class:`~qeval.stages.TierRunner`. The run folder and the artifact cache are on storage
every node reaches, the recipe's ``storage``:

- a mounted path (NFS, a bucket through s3fs/gcsfuse): tasks use the run folder and the
  artifact cache there directly;
- an fsspec URL (``s3://bucket/qeval``): each task copies the run-wide files (run.json,
  the run stages, the reference pass) and its tier's finished stages into a staging folder
  in the node's own cache, fetches the source checkpoint and any cached artifact from the
  store, and copies each finished stage back (see :mod:`qeval.storage`). The driver then
  copies the tier's files into its own run folder.

A failed or lost task (worker or node died, retries spent) marks only its tier failed;
a retried task resumes from the stages its earlier attempt stored. Ray is the optional
extra ``qeval[ray]`` (imported only when a task is submitted).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import QevalInputError
from ..failures import failure_text
from ..paths import cache_root, node_dir
from ..recipe import Recipe
from ..results import STATUS_FAILED, RunLayout, TierResult, write_tier_result
from ..stages import FRESH_ENV, TierRunner
from ..storage import localize_source, storage_for

_ENV_PREFIXES = ("QEVAL_", "HF_", "GPTQMODEL_")
_WORKER_ENV: dict[str, str] | None = None  # this Ray worker's own environment, before any task


def _tier_task(recipe_dict: dict, recipe_path: str | None, run_dir: str, tier: str,
               reference_failed: str | None, env: dict[str, str]) -> TierResult:
    """Body of the Ray task: run one tier's stages on this node; returns its tier result.

    ``run_dir`` is the driver's run folder (mounted storage) or, with a storage URL, the
    run's relative path in the store (``results/<name>/<timestamp>``).

    Ray reuses worker processes, so the qeval-related environment is reset to the
    worker's own before this task's ``env`` is applied."""
    global _WORKER_ENV
    if _WORKER_ENV is None:
        _WORKER_ENV = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES)]:
        del os.environ[k]
    os.environ.update(_WORKER_ENV)
    os.environ.update(env)
    if os.environ.get("QEVAL_TEST_RAY_TASK_CRASH") == tier:  # test-only: the Ray worker dies
        os._exit(3)
    once = os.environ.get("QEVAL_TEST_RAY_TASK_CRASH_ONCE", "")  # test-only: "<tier>:<marker file>"
    if once.startswith(f"{tier}:") and not Path(once.split(":", 1)[1]).exists():
        Path(once.split(":", 1)[1]).touch()
        os._exit(3)  # the first attempt dies; Ray's retry (recipe ``retries``) runs the tier again
    r = Recipe.model_validate(recipe_dict)
    r._path = Path(recipe_path) if recipe_path else None
    remote = storage_for(r)
    if remote is None:
        return TierRunner(r, Path(run_dir)).run_tier(tier, reference_failed)
    local = stage_from_store(remote, run_dir, tier)
    runner = TierRunner(r, local)
    result = runner.run_tier(tier, reference_failed)
    if runner.push_error is None:  # all in the store: drop the node's copy (the reference
        shutil.rmtree(local, ignore_errors=True)  # log-probabilities alone can be GiBs per run)
    return result


def stage_from_store(remote: Any, rel: str, tier: str) -> Path:
    """Copy what one tier task needs from the store into this node's staging folder
    (``$QEVAL_CACHE/nodes/<tier>/<rel>``): run.json, the run stages, the reference pass and the
    tier's finished stages; point the source stage at a local copy of the exact source
    checkpoint (fetched from the store unless this node has one with the same hash).

    Returns the local run folder.

    Raises:
        RuntimeError: the source checkpoint is not in the store or hashes differently.
    """
    local = node_dir(tier) / rel
    wanted = RunLayout.tier_files(tier)
    remote.download_dir(rel, local, include=lambda f: RunLayout.run_wide_file(f) or wanted(f))
    localize_source(remote, local)
    return local


def ray_init(address: str | None) -> Any:
    """Connect to Ray: an existing instance in this process, ``address`` (``auto`` or
    ``ray://host:10001``), or a new local instance.

    Raises:
        QevalInputError: ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray  # optional: the qeval[ray] extra
    except ImportError:
        raise QevalInputError("executor ray needs the extra: pip install 'qeval[ray]'",
                              field="executor") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                     include_dashboard=False)
        except Exception as e:  # connection errors are the user's address
            raise QevalInputError(f"cannot connect to Ray at {address or 'a new local instance'}: "
                                  f"{e.__class__.__name__}: {str(e)[:200]}", field="--ray-address") from None
    return ray


class RayExecutor:
    """One Ray task per tier (see the module docstring).

    Args:
        address: the cluster (``auto``, ``ray://host:10001``); None: an instance in this
            process or a new local one.
    """
    name = "ray"
    in_process = False

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def run_tiers(self, runner: TierRunner, tiers: list[str], reference_failed: str | None) -> dict[str, TierResult]:
        """Submit every tier as a Ray task and collect the results (in ``tiers`` order)."""
        ray = ray_init(self.address)
        res = runner.recipe.resources
        opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                                "max_retries": runner.recipe.retries, "retry_exceptions": False}
        if res.memory_gib:
            opts["memory"] = int(res.memory_gib * 2 ** 30)
        task = ray.remote(_tier_task).options(**opts)
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        if runner.env.get(FRESH_ENV):  # qeval run --fresh reaches the tasks' stages too
            env[FRESH_ENV] = runner.env[FRESH_ENV]
        if runner.remote is None:  # mounted storage: the driver's cache is every node's
            env["QEVAL_CACHE"] = str(cache_root())
            where = str(runner.run_dir.resolve())
        else:  # a storage URL: each node keeps its own cache and copies through the store
            env.pop("QEVAL_CACHE", None)
            where = runner.remote_rel
        # absolute: a node's working folder is not the driver's (the recipe's relative paths start at its folder)
        recipe_path = os.path.abspath(Path(runner.recipe.path).expanduser()) if runner.recipe.path else None
        pending = {}
        for tier in tiers:
            runner.on_event(tier, "ray", "submitted")
            pending[tier] = task.remote(runner.recipe_dict, recipe_path, where, tier, reference_failed, env)
        results: dict[str, TierResult] = {}
        for tier, ref in pending.items():
            try:
                results[tier] = ray.get(ref)
                if runner.remote is not None:  # the tier's stages, logs and result into the driver's folder
                    runner.remote.download_dir(runner.remote_rel, runner.run_dir, include=RunLayout.tier_files(tier))
                    if not runner.layout.tier_result(tier).exists():  # the node could not copy it
                        write_tier_result(runner.layout, results[tier])
                st = results[tier].status
                runner.on_event(tier, "failed" if st == STATUS_FAILED else "done",
                                failure_text(results[tier].error, results[tier].log_tail) if st == STATUS_FAILED else "")
            except Exception as e:  # RayTaskError, WorkerCrashedError, NodeDiedError, ...
                why = f"ray task failed or was lost: {e.__class__.__name__}: {str(e).splitlines()[0][:300]}"
                if runner.remote is not None:  # keep the stages the task stored before it was lost
                    try:
                        runner.remote.download_dir(runner.remote_rel, runner.run_dir,
                                                   include=RunLayout.tier_files(tier))
                    except Exception:  # noqa: BLE001 - the failure above is the one to report
                        pass
                results[tier] = runner.finish(tier, STATUS_FAILED, error=why)
                runner.on_event(tier, "failed", why)
        return results


EXECUTOR = RayExecutor
