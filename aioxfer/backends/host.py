"""LocalBackendHost: what local backends need of their agent beyond its public API.

The file transport (the built-in backend "file"), the backend registry and
base class, the metrics server and the GPU <-> file stager reach their agent
through its public API (``name``, ``incarnation``, ``closed``, ``transports``,
``regions``, ``write``/``read``...) and, for the rest, only through this
Protocol (issue 10, item 8): never through an Agent's private attributes.

An Agent gives its host through ``host_of(agent)`` (the agent's
``__aioxfer_host__()`` hook, named like ``__dlpack__``: a protocol method, not
part of the user API). The one implementation, :class:`BackendHost`, is built
by the agent from narrow arguments; it shares the agent's region table and
engine rather than copying them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aioxfer.errors import ClosedResourceError

if TYPE_CHECKING:
    from aioxfer import _cyx
    from aioxfer.peer import Peer, PeerHost
    from aioxfer.region import Region
    from aioxfer.transfer import Transfer

__all__ = ["BackendHost", "LocalBackendHost", "RegionTable", "host_of"]


class RegionTable(Protocol):
    """The agent's region table (aioxfer.registration.Memory): names, and
    listing a region registered elsewhere."""

    def check_name(self, name: str) -> None: ...

    def default_name(self, rid: int, prefix: str = "region") -> str: ...

    def add_region(self, region: Region) -> None: ...


class LocalBackendHost(Protocol):
    """An agent's side for its local backends.

    ``engine``: the native engine (file registration, the FILE endpoint);
    ``peers``: what a Peer-shaped record of a local endpoint reaches its agent
    through; ``host_id``: the agent's host identity; ``cuda_why``: why CUDA is
    or is not in use (one line); ``file_peer``: the FILE endpoint's record,
    None until the first file transfer makes it. ``check_open()`` raises
    ClosedResourceError once the agent is closed; ``check_name(name)`` raises
    RegistrationError for a name taken or empty; ``default_name(rid,
    prefix)``: a free name for an unnamed region; ``add_region(region)``: the
    agent lists it (``agent.regions``, ``agent.region(name)``) and releases
    it at close; ``new_tag(label)``: a connection tag for a local endpoint,
    reported as ``label``; ``submit(...)``: posts a request to the engine (the
    agent's submission path) and returns its Transfer.
    """

    @property
    def engine(self) -> _cyx.Engine: ...

    @property
    def peers(self) -> PeerHost: ...

    @property
    def host_id(self) -> str: ...

    @property
    def cuda_why(self) -> str: ...

    file_peer: Peer | None

    def check_open(self) -> None: ...

    def check_name(self, name: str) -> None: ...

    def default_name(self, rid: int, prefix: str = "region") -> str: ...

    def add_region(self, region: Region) -> None: ...

    def new_tag(self, label: str) -> int: ...

    def submit(
        self, peer: Peer, opcode: int, descs: Any, notify: bytes | None, nbytes: int, op: str,
        priority: int, /,
    ) -> Transfer: ...


class _HasHost(Protocol):
    def __aioxfer_host__(self) -> LocalBackendHost: ...


def host_of(agent: _HasHost) -> LocalBackendHost:
    """The LocalBackendHost of ``agent``."""
    return agent.__aioxfer_host__()


class BackendHost:
    """An Agent's LocalBackendHost (see the module docstring).

    ``agent``: its name (errors); ``engine``, ``peers``, ``host_id``,
    ``cuda_why``: as in LocalBackendHost; ``regions``: the agent's region
    table (its names; file regions are added to it); ``closed()``: whether the agent is
    closed; ``new_tag(label)``: the agent's tag allocator for local
    endpoints; ``submit``: its submission path.
    """

    __slots__ = (
        "_agent",
        "engine",
        "peers",
        "host_id",
        "cuda_why",
        "file_peer",
        "_regions",
        "_closed",
        "new_tag",
        "submit",
    )

    def __init__(
        self,
        agent: str,
        *,
        engine: _cyx.Engine,
        peers: PeerHost,
        host_id: str,
        cuda_why: str,
        regions: RegionTable,
        closed: Callable[[], bool],
        new_tag: Callable[[str], int],
        submit: Callable[[Peer, int, Any, bytes | None, int, str, int], Transfer],
    ) -> None:
        self._agent = agent
        self.engine = engine
        self.peers = peers
        self.host_id = host_id
        self.cuda_why = cuda_why
        self.file_peer: Peer | None = None
        self._regions = regions
        self._closed = closed
        self.new_tag = new_tag
        self.submit = submit

    def check_open(self) -> None:
        if self._closed():
            raise ClosedResourceError(f"agent {self._agent!r} is closed")

    def check_name(self, name: str) -> None:
        self._regions.check_name(name)

    def default_name(self, rid: int, prefix: str = "region") -> str:
        """prefix-rid, made unique among the agent's regions."""
        return self._regions.default_name(rid, prefix)

    def add_region(self, region: Region) -> None:
        self._regions.add_region(region)
