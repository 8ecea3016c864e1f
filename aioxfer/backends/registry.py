"""The registry of local backends: built-in ones and plugins.

A backend is found by name: first among the built-ins (one line each in
``BUILTIN``, imported only when first used, so that a backend's client
library stays an optional dependency), then among the entry points of the
group ``aioxfer.backends`` of installed distributions::

    [project.entry-points."aioxfer.backends"]
    dirstore = "aioxfer_dirstore:DirStoreBackend"

Each agent gets one instance per backend name, made on first use and closed
by ``agent.aclose()`` (which fails its transfers in flight first).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from aioxfer.backends.base import API_VERSION, BackendRegion, LocalBackend
from aioxfer.backends.host import host_of
from aioxfer.region import Region

if TYPE_CHECKING:
    from aioxfer.agent import Agent

__all__ = [
    "BUILTIN",
    "add_backend",
    "GROUP",
    "available",
    "backend_class",
    "backends_of",
    "instance",
    "local_target",
    "register_region",
]

GROUP = "aioxfer.backends"
BUILTIN: dict[str, str] = {
    "file": "aioxfer.file_transport:FileBackend",
    "object": "aioxfer.backends.objects:ObjectBackend",
}
# Kinds of the agent's own Regions (engine-registered) that a built-in local
# backend serves: their segments are plain Segments, not a BackendRegion's.
_REGION_KINDS = {"file": "file"}

_classes: dict[str, type[LocalBackend]] = {}
_added: dict[str, str] = {}


class _AgentState:
    """What the registry keeps per agent: its backend instances and things
    to close with it (e.g. a metrics server)."""

    __slots__ = ("backends", "closers")

    def __init__(self) -> None:
        self.backends: dict[str, LocalBackend] = {}
        self.closers: list[Callable[[], Awaitable[None]]] = []


_agents: weakref.WeakKeyDictionary[Agent, _AgentState] = weakref.WeakKeyDictionary()


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def available() -> dict[str, str]:
    """Backend names and where each comes from ("module:Class"), built-ins
    first, then plugins (a plugin cannot shadow a built-in)."""
    out = {**BUILTIN, **_added}
    for ep in entry_points(group=GROUP):
        out.setdefault(ep.name, ep.value)
    return out


def add_backend(name: str, cls: type[LocalBackend] | str) -> None:
    """Registers a backend in this process (a class, or "module:Class"
    imported on first use), as built-ins are: for applications that bring
    their own backend without packaging it. Raises ValueError if the name is
    taken by a built-in or an earlier add_backend."""
    if name in BUILTIN or name in _added:
        raise ValueError(f"a backend named {name!r} exists already")
    if isinstance(cls, str):
        _added[name] = cls
        return
    where = f"{cls.__module__}:{cls.__qualname__}"
    _check_class(name, cls, where)
    _added[name] = where
    _classes[name] = cls


def backend_class(name: str) -> type[LocalBackend]:
    """The backend class registered under ``name`` (imported on first use).
    Raises LookupError for an unknown name, TypeError for a class that does not
    implement this interface's version."""
    cls = _classes.get(name)
    if cls is not None:
        return cls
    where = available().get(name)
    if where is None:
        known = ", ".join(sorted(available())) or "none"
        raise LookupError(
            f"no aioxfer backend named {name!r} (known: {known}); plugins register under "
            f"the entry-point group {GROUP!r}"
        )
    loaded = _load(where)
    _check_class(name, loaded, where)
    _classes[name] = loaded
    return loaded  # type: ignore[no-any-return]


def _check_class(name: str, loaded: Any, where: str) -> None:
    if not (isinstance(loaded, type) and issubclass(loaded, LocalBackend)):
        raise TypeError(f"backend {name!r} ({where}) is not a LocalBackend subclass")
    if loaded.api_version != API_VERSION:
        raise TypeError(
            f"backend {name!r} ({where}) implements backend API version "
            f"{loaded.api_version}, this aioxfer has {API_VERSION}"
        )
    if not loaded.kind:
        raise TypeError(f"backend {name!r} ({where}) declares no region kind")


def _state(agent: Agent) -> _AgentState:
    state = _agents.get(agent)
    if state is None:
        state = _agents[agent] = _AgentState()
    return state


def instance(agent: Agent, name: str) -> LocalBackend:
    """The agent's instance of backend ``name`` (made on first use)."""
    host_of(agent).check_open()
    state = _state(agent)
    be = state.backends.get(name)
    if be is None:
        cls = backend_class(name)
        be = cls(agent)
        be.name = be.path = name  # the name it is registered under
        state.backends[name] = be
    return be


def backends_of(agent: Agent) -> list[LocalBackend]:
    """The backend instances the agent has made so far."""
    state = _agents.get(agent)
    return [] if state is None else list(state.backends.values())


def register_region(
    agent: Agent, backend: str, *args: Any, **kwargs: Any
) -> BackendRegion | Region:
    """A new region of ``backend`` on ``agent``: ``instance(agent,
    backend).register(*args, **kwargs)`` (the "file" backend's are the
    agent's own Regions of kind "file")."""
    be = instance(agent, backend)
    register = getattr(be, "register", None)
    if register is None:
        raise TypeError(f"backend {backend!r} has no register()")
    region = register(*args, **kwargs)
    if not isinstance(region, BackendRegion | Region):
        raise TypeError(f"backend {backend!r}.register() returned {type(region).__name__}")
    return region


def local_target(far: Any) -> LocalBackend | None:
    """The local backend whose region the far side of a write/read is in (a
    segment, a list of them, or a segment list): a backend's region, or one
    of this agent's file regions. None for a peer's memory (or host memory:
    the caller's checks say what is wrong then)."""
    region = getattr(far, "region", None)
    if region is None and isinstance(far, Sequence) and not isinstance(far, str | bytes):
        if len(far):
            region = getattr(far[0], "region", None)
    if isinstance(region, BackendRegion):
        return region.backend
    kind = getattr(region, "kind", "host")
    if kind in _REGION_KINDS and isinstance(region, Region):
        return instance(region._agent, _REGION_KINDS[kind])
    return None


def on_close(agent: Agent, closer: Callable[[], Awaitable[None]]) -> None:
    """Runs ``await closer()`` when the agent closes (after its backends)."""
    _state(agent).closers.append(closer)


async def aclose_agent(agent: Agent) -> None:
    """``agent.aclose()``: fails the backends' transfers in flight with
    ClosedResourceError, closes their regions and clients, then the closers;
    every one of them even if one fails (its error raised after)."""
    state = _agents.pop(agent, None)
    if state is None:
        return
    # One that fails does not leave the rest open (their clients, sessions,
    # servers): all are closed, then the first failure is raised.
    first: Exception | None = None
    for be in list(state.backends.values()):
        try:
            await be._aclose()
        except Exception as exc:
            first = first or exc
    for closer in state.closers:
        try:
            await closer()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first

