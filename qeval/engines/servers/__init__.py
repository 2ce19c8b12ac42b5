"""Managed servers for the ``openai`` engine (:mod:`qeval.engines.openai`): the servers
qeval starts on a tier's artifact (``serve:``), and the ``endpoint:`` settings of one that
already runs.

Registered by name, as engines and tier methods are (:mod:`qeval.plugins`): every module
of this package that defines ``SERVER`` (a :class:`~qeval.engines.servers.base.ServerKind`
subclass) is a managed server: its typed recipe options (``kind: <name>``), its command,
readiness route, wire dialect (token ids, top-k log-probabilities), the formats and
devices it serves, and how its KV pool is cleared and read. Adding a server is adding its
module: ``llama_server`` (llama.cpp's llama-server), ``vllm``, ``sglang``.

A module that defines ``DIALECT`` (a :class:`~qeval.engines.servers.base.Dialect`) and no
``SERVER`` is a wire dialect of a server qeval does not start, chosen by an endpoint's
``dialect:`` (:func:`dialect_named`): ``ollama`` (Ollama's native API).

A recipe's ``serve:`` is discriminated by ``kind``; ``serve: llama-server`` is short for
``serve: {kind: llama-server}``, and ``server:`` is read as ``kind:``.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Field, TypeAdapter

from ...plugins import one_each, registered
from .base import (DIALECT_NAMES, OPENAI, Dialect, EndpointSpec, Launch, ManagedServer, PoolNotCleared, PoolState, ServeOptions,
                   ServerFailed, ServerKind, TreeRss, free_port, round_ctx, tree_memory_counter, tree_pids)

__all__ = ["OPENAI", "Dialect", "EndpointSpec", "Launch", "ManagedServer", "PoolNotCleared", "PoolState",
           "ServeOptions", "ServeSpec", "ServerFailed", "ServerKind", "TreeRss", "dialect_for_owner", "dialect_named",
           "dialect_names", "dialects", "free_port", "get_server", "parse_serve", "round_ctx", "server_kinds", "tree_memory_counter", "tree_pids"]

_REGISTRY: dict[str, type[ServerKind]] = one_each(
    ((m, cls.kind, cls) for m, cls in registered(__name__, __path__, "SERVER")), "managed server")


def server_kinds() -> tuple[str, ...]:
    """Names of the registered managed servers, sorted."""
    return tuple(sorted(_REGISTRY))


def get_server(kind: str) -> type[ServerKind]:
    """The managed server registered as ``kind``.

    Raises:
        KeyError: no such server (the message lists the known ones).
    """
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise KeyError(f"unknown server {kind!r} (known: {', '.join(server_kinds())})") from None


#: Dialects of servers qeval does not start (modules defining ``DIALECT``), by name.
_DIALECTS: dict[str, Dialect] = one_each(
    ((m, d.name, d) for m, d in registered(__name__, __path__, "DIALECT")), "dialect")


def dialects() -> list[Dialect]:
    """Every registered server's dialect (server name order), the dialects of servers qeval
    does not start (name order), then the plain OpenAI one."""
    return [_REGISTRY[k].dialect for k in server_kinds()] + [_DIALECTS[k] for k in sorted(_DIALECTS)] + [OPENAI]


def dialect_names() -> tuple[str, ...]:
    """Names of every dialect an endpoint's ``dialect:`` may name, sorted."""
    return tuple(sorted({d.name for d in dialects()}))


DIALECT_NAMES.update(dialect_names())  # what EndpointSpec.dialect accepts


def dialect_named(name: str) -> Dialect:
    """The dialect called ``name`` (:attr:`Dialect.name`: ``llama.cpp``, ``vllm``,
    ``sglang``, ``ollama``, ``openai``).

    Raises:
        KeyError: no such dialect (the message lists the known ones).
    """
    for d in dialects():
        if d.name == name:
            return d
    raise KeyError(f"unknown dialect {name!r} (known: {', '.join(dialect_names())})")


def dialect_for_owner(owned_by: str) -> Dialect:
    """The dialect of an endpoint from its ``GET /v1/models`` ``owned_by``: the first
    registered server whose :attr:`Dialect.owned_by` it contains, else plain OpenAI."""
    owner = (owned_by or "").lower()
    return next((d for d in dialects() if d.owned_by and d.owned_by in owner), OPENAI)


def _shorthand(v: Any) -> Any:
    """``"llama-server"`` -> ``{"kind": "llama-server"}``; ``{"server": ...}`` -> ``{"kind": ...}``."""
    if isinstance(v, str):
        return {"kind": v}
    if isinstance(v, dict) and "server" in v and "kind" not in v:
        v = dict(v)
        v["kind"] = v.pop("server")
    return v


#: The recipe's ``serve:``: one registered server's options, discriminated by ``kind``.
ServeSpec = Annotated[Union[tuple(_REGISTRY[k].options for k in server_kinds())],  # type: ignore[valid-type]
                      Field(discriminator="kind"), BeforeValidator(_shorthand)]

_ADAPTER: TypeAdapter = TypeAdapter(ServeSpec)


def parse_serve(value: Any) -> ServeOptions:
    """A ``serve:`` value (shorthand string, dict, or options object) as its server's options.

    Raises:
        pydantic.ValidationError: an unknown kind or a bad field.
    """
    return value if isinstance(value, ServeOptions) else _ADAPTER.validate_python(value)
