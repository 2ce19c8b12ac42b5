"""Registries read entry points of other installed packages (qeval.plugins.GROUPS): a tier
method, an executor or a broken plugin, each from a package that is no part of qeval."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import qeval.plugins as plugins
from test_tier_registry import FAKE

REPO = Path(__file__).resolve().parent.parent


def _installed_plugin(site: Path, group: str, name: str, value: str, module: str, source: str) -> None:
    """An installed distribution in ``site`` as pip leaves one: its module and a dist-info
    folder whose ``entry_points.txt`` names ``value`` under ``group``."""
    (site / f"{module}.py").write_text(source)
    info = site / "qeval_plugin_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qeval-plugin-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")


def test_a_tier_method_from_another_installed_package(tmp_path):
    """A package that names its module under ``qeval.tiers`` adds a recipe method with its
    own fields; qeval's tiers package is not touched."""
    _installed_plugin(tmp_path, "qeval.tiers", "half", "halfplugin", "halfplugin", FAKE)
    code = ("from qeval.recipe import parse_recipe\nfrom qeval.tiers import method_names\n"
            "r = parse_recipe('name: x\\nmodel: {source: /m}\\ntiers: [{name: bf16, method: bf16}, "
            "{name: h, method: half, scale: 0.1}]\\n')\n"
            "print(r.tier('h').scale, 'half' in method_names())\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{REPO}")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)
    assert p.stdout.split() == ["0.1", "True"], p.stderr[-2000:]


EXECUTOR = '''
class SlurmExecutor:
    name = "slurm"
    in_process = False

    def __init__(self, address=None):
        self.address = address

    def run_tiers(self, runner, tiers, reference_failed):
        return {}
'''


def test_an_executor_named_as_an_object(tmp_path, monkeypatch):
    """``module:object`` entry points give the registered object itself."""
    import qeval.executors as ex
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "slurmplugin.py").write_text(EXECUTOR)
    eps = {"qeval.executors": (EntryPoint("slurm", "slurmplugin:SlurmExecutor", "qeval.executors"),)}
    monkeypatch.setattr(plugins, "_entry_points", lambda group: eps.get(group, ()))
    monkeypatch.setattr(ex, "_REGISTRY", None)
    assert ex.executor_names() == ("local", "ray", "slurm")
    e = ex.make_executor("slurm", "head:6379")
    assert type(e).__name__ == "SlurmExecutor" and e.address == "head:6379" and not e.in_process


def test_a_broken_plugin_is_named(tmp_path, monkeypatch):
    """A plugin that cannot be imported, or a module without the registry's attribute, is
    one line naming the entry point and its group."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "emptyplugin.py").write_text("X = 1\n")
    for value, why in (("nosuchplugin", "cannot be loaded: ModuleNotFoundError"),
                       ("emptyplugin", "module emptyplugin defines no ENGINE")):
        eps = (EntryPoint("bad", value, "qeval.engines"),)
        monkeypatch.setattr(plugins, "_entry_points", lambda group, eps=eps: eps if group == "qeval.engines" else ())
        with pytest.raises(RuntimeError) as e:
            list(plugins.plugin_entries("ENGINE"))
        assert str(e.value).startswith(f"entry point bad = {value!r} (qeval.engines)") and why in str(e.value)
        assert "\n" not in str(e.value)
