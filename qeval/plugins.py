"""Finding the modules of a package that register something: engines (``ENGINE``), tier
methods (``METHODS``), check kinds (``KINDS``), managed servers (``SERVER``,
:mod:`qeval.engines.servers`) and executors (``EXECUTOR``, :mod:`qeval.executors`) are each
one module of their package, found by the attribute it defines (the way ``pkgutil`` lists a
package's modules)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Iterable, Iterator


def registered(package: str, path: Iterable[str], attr: str) -> Iterator[tuple[str, Any]]:
    """``(module name, module.<attr>)`` for every module of ``package`` (its ``__path__``)
    that defines ``attr``, in name order; private modules and ``base`` are skipped."""
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        if hasattr(mod, attr):
            yield mod.__name__, getattr(mod, attr)


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
