"""Finding what registers something: engines (``ENGINE``), tier methods (``METHODS``),
check kinds (``KINDS``), managed servers (``SERVER``, :mod:`qeval.engines.servers`),
executors (``EXECUTOR``, :mod:`qeval.executors`), load workloads (``WORKLOAD``,
:mod:`qeval.serving`) and wire dialects of servers qeval does not start (``DIALECT``,
:mod:`qeval.engines.servers`) are each one module of their package,
found by the attribute it defines (the way ``pkgutil`` lists a package's modules), or one
module of another installed package that names it under the registry's entry-point group
(:data:`GROUPS`), as lm-evaluation-harness and pytest find plugins::

    # pyproject.toml of the other package
    [project.entry-points."qeval.tiers"]
    half = "mypkg.half"            # a module that defines METHODS
    [project.entry-points."qeval.executors"]
    slurm = "mypkg.slurm:EXECUTOR"  # or the registered object itself
"""
from __future__ import annotations

import importlib
import pkgutil
import types
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, Iterable, Iterator

#: The entry-point group each registry reads, by the attribute its modules define.
GROUPS = {"METHODS": "qeval.tiers", "ENGINE": "qeval.engines", "KINDS": "qeval.checks",
          "SERVER": "qeval.servers", "EXECUTOR": "qeval.executors",
          "WORKLOAD": "qeval.workloads", "DIALECT": "qeval.dialects"}


def registered(package: str, path: Iterable[str], attr: str) -> Iterator[tuple[str, Any]]:
    """``(module name, module.<attr>)`` for every module of ``package`` (its ``__path__``)
    that defines ``attr``, in name order (private modules and ``base`` are skipped), then
    the entry points of ``attr``'s group (:func:`plugin_entries`).

    Raises:
        RuntimeError: an entry point that cannot be loaded or whose module lacks ``attr``.
    """
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        if hasattr(mod, attr):
            yield mod.__name__, getattr(mod, attr)
    yield from plugin_entries(attr)


@lru_cache(maxsize=1)
def _installed() -> Any:
    """Every installed entry point (importlib.metadata), read once per process."""
    return entry_points()


def _entry_points(group: str) -> tuple[Any, ...]:
    """The installed entry points of ``group``, by name."""
    return tuple(sorted(_installed().select(group=group), key=lambda e: e.name))


def plugin_entries(attr: str) -> Iterator[tuple[str, Any]]:
    """``(entry point value, registered object)`` for every entry point of the group of
    ``attr`` (:data:`GROUPS`) in the installed packages, by name: an entry point naming a
    module gives the module's ``attr``; one naming an object (``module:object``) gives it.

    Raises:
        RuntimeError: an entry point that cannot be loaded, or a module without ``attr``
            (one line naming the group, the entry point and the reason).
    """
    group = GROUPS.get(attr)
    if group is None:
        return
    for ep in _entry_points(group):
        where = f"entry point {ep.name} = {ep.value!r} ({group})"
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - another package's import error, named here
            raise RuntimeError(f"{where} cannot be loaded: {e.__class__.__name__}: {e}") from e
        if isinstance(obj, types.ModuleType):
            if not hasattr(obj, attr):
                raise RuntimeError(f"{where}: module {obj.__name__} defines no {attr}")
            obj = getattr(obj, attr)
        yield ep.value, obj


def one_each(entries: Iterable[tuple[str, str, Any]], what: str) -> dict[str, Any]:
    """``{name: value}`` from ``(module, name, value)`` entries.

    Raises:
        RuntimeError: a name defined twice (names the ``what`` and the module).
    """
    found: dict[str, Any] = {}
    for module, name, value in entries:
        if name in found:
            raise RuntimeError(f"{what} {name!r} is defined twice ({module})")
        found[name] = value
    return found
