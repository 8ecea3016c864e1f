"""An agent's own metadata: what it serves to peers and publishes in etcd.

A collaborator of :class:`aioxfer.Agent`: it builds our ``AgentMeta`` three
ways from the agent's identity (fixed once the agent is built) and its live
region table: as served over tcp (``meta``: no memfds), as served on the unix
socket to a peer the kernel vouched for (``local``: alloc'd regions name their
memfd, passed with SCM_RIGHTS), and as published in etcd (``published``: no
access keys, addresses or memfds; peers fetch those from us over an
authenticated connection). It reaches the agent only through the narrow
arguments it was built with, never its state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import msgspec

from aioxfer.discovery import encode_meta
from aioxfer.metadata import AgentMeta, RegionMeta

if TYPE_CHECKING:
    from aioxfer.region import Region

__all__ = ["LocalMeta"]


class LocalMeta:
    """Our metadata (see the module docstring).

    ``identity``: everything of our AgentMeta but its regions (and pid, read
    when built: a forked child is another process); ``regions``: the agent's
    region table (name -> Region), shared; ``verbs_keys(rid)``: a region's
    per-device RDMA keys, None when the agent has no verbs devices.

    ``meta_with`` is an attribute, not a slot: the tests replace it on one
    agent to make it a hostile peer (what it advertises, not how it serves).
    """

    def __init__(
        self,
        agent: str,
        *,
        identity: AgentMeta,
        regions: Mapping[str, Region],
        verbs_keys: Callable[[int], list[tuple[int, int]]] | None,
    ) -> None:
        self._agent = agent
        self._identity = identity
        self._regions = regions
        self._verbs_keys = verbs_keys

    def meta(self) -> AgentMeta:
        """As served over tcp (and, stripped, etcd): no memfds."""
        return self.meta_with(lambda r: -1)

    def local(self) -> tuple[AgentMeta, list[int]]:
        """As served on the unix socket to a peer the kernel vouched for: each
        alloc'd region names its memfd's index among the fds that follow
        (SCM_RIGHTS)."""
        fds: list[int] = []

        def index(r: Region) -> int:
            if r._memfd < 0:
                return -1
            fds.append(r._memfd)
            return len(fds) - 1

        return self.meta_with(index), fds

    def meta_with(self, memfd: Callable[[Region], int]) -> AgentMeta:
        """Our metadata, each region's memfd field from ``memfd(region)``."""
        keys = self._verbs_keys
        return msgspec.structs.replace(
            self._identity,
            pid=os.getpid(),
            regions=[
                RegionMeta(
                    name=r.name,
                    rid=r.rid,
                    key=r.key,
                    nbytes=r.nbytes,
                    access=r.access,
                    addr=r.addr,
                    memfd=memfd(r),
                    verbs=keys(r.rid) if keys is not None else [],
                    kind=r.kind,
                    cuda=r._cuda,
                )
                for r in self._regions.values()
                if r.kind != "file"  # file regions are ours alone
            ],
        )

    def published(self) -> bytes:
        """As published in etcd: no access keys, no memory addresses, no memfd
        numbers; peers fetch those from us over our control connection
        (authenticated when we have a token)."""
        meta = self.meta()
        regions = [
            RegionMeta(name=r.name, rid=r.rid, key=0, nbytes=r.nbytes, access=r.access, addr=0)
            for r in meta.regions
        ]
        return encode_meta(msgspec.structs.replace(meta, regions=regions))
