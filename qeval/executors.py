"""Executors: where each tier's stages run.

``local`` (default): tier after tier on this machine, each stage in a child process
(:meth:`qeval.run.Runner.run_tier`). ``ray``: each tier's stages run as one Ray task asking
for the recipe's ``resources`` (num_cpus, num_gpus, memory), so tiers run side by side on
a cluster; inside the task the stages are the same child processes as locally. The run
folder and the artifact cache must be on storage every node reaches (the recipe's
``storage``, a shared mount). A failed or lost task (worker or node died, retries spent)
marks only its tier failed. Ray is the optional extra ``qeval[ray]``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import QevalInputError
from .results import STATUS_FAILED


_ENV_PREFIXES = ("QEVAL_", "HF_", "GPTQMODEL_")


def _tier_task(recipe_dict: dict, recipe_path: str | None, run_dir: str, tier: str,
               reference_failed: str | None, env: dict[str, str]) -> dict:
    """Body of the Ray task: run one tier's stages on this node; returns its tier result.

    Ray reuses worker processes, so the qeval-related environment of an earlier task is
    cleared before this task's is applied."""
    for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    if os.environ.get("QEVAL_TEST_RAY_TASK_CRASH") == tier:  # test-only: the Ray worker dies
        os._exit(3)
    from .recipe import Recipe
    from .run import Runner
    r = Recipe.model_validate(recipe_dict)
    r._path = Path(recipe_path) if recipe_path else None
    return Runner(r, Path(run_dir), [tier], executor="local").run_tier(tier, reference_failed)


def ray_init(address: str | None) -> Any:
    """Connect to Ray: an existing instance in this process, ``address`` (``auto`` or
    ``ray://host:10001``), or a new local instance.

    Raises:
        QevalInputError: ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray
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


def run_tiers_on_ray(runner: Any, reference_failed: str | None) -> dict[str, dict]:
    """Submit every tier of ``runner`` as a Ray task and collect the results (recipe order)."""
    from .source import cache_root

    ray = ray_init(runner.ray_address)
    res = runner.recipe.resources
    opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                            "max_retries": runner.recipe.retries, "retry_exceptions": False}
    if res.memory_gib:
        opts["memory"] = int(res.memory_gib * 2 ** 30)
    task = ray.remote(_tier_task).options(**opts)
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    env["QEVAL_CACHE"] = str(cache_root())
    recipe_path = str(runner.recipe.path) if runner.recipe.path else None
    pending = {}
    for tier in runner.tiers:
        runner.on_event(tier, "ray", "submitted")
        pending[tier] = task.remote(runner.recipe_dict, recipe_path, str(runner.run_dir.resolve()), tier,
                                    reference_failed, env)
    results: dict[str, dict] = {}
    for tier, ref in pending.items():
        try:
            results[tier] = ray.get(ref)
            st = results[tier].get("status")
            runner.on_event(tier, "failed" if st == STATUS_FAILED else "done", results[tier].get("error") or "")
        except Exception as e:  # RayTaskError, WorkerCrashedError, NodeDiedError, ...
            why = f"ray task failed or was lost: {e.__class__.__name__}: {str(e).splitlines()[0][:300]}"
            results[tier] = runner._finish(tier, STATUS_FAILED, error=why)
            runner.on_event(tier, "failed", why)
    return results
