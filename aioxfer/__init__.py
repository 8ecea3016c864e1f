"""aioxfer: asyncio-first one-sided READ/WRITE into registered memory.

```python
async with aioxfer.Agent("decode-0") as agent:
    pool = agent.register(bytearray(1 << 20), name="kv")
    peer = await agent.connect("127.0.0.1:5555")
    await agent.write(pool[0:4096], peer.region("kv")[8192:12288], notify=b"req-17")
    msg = await agent.notifications.receive()
```
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from aioxfer import discovery, routing
from aioxfer._cyx import Prepared
from aioxfer.agent import Agent
from aioxfer.discovery import Etcd, Membership, PeerJoined, PeerLeft, PeerUpdated
from aioxfer.errors import (
    AccessDenied,
    ClosedResourceError,
    ObjectExists,
    ObjectNotFound,
    PeerLost,
    ProtocolError,
    RegistrationError,
    StalePeer,
    TransferTimeout,
    TransportError,
    XferError,
)
from aioxfer.limits import Limits
from aioxfer.notifications import Notification, Notifications
from aioxfer.peer import Peer
from aioxfer.region import Region, RemoteRegion, RemoteSegment, Segment, SegmentList
from aioxfer.routing import LeastLoaded, LowestExpectedCompletion, Router
from aioxfer.scheduling import PeerScheduler
from aioxfer.stats import AgentStatistics, PeerStatistics, RailStatistics
from aioxfer.transfer import Transfer, TransferResult

try:
    __version__ = version("aioxfer")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AccessDenied",
    "Agent",
    "AgentStatistics",
    "ClosedResourceError",
    "LeastLoaded",
    "ObjectExists",
    "ObjectNotFound",
    "Limits",
    "LowestExpectedCompletion",
    "Etcd",
    "Membership",
    "Notification",
    "Notifications",
    "Peer",
    "PeerJoined",
    "PeerLeft",
    "PeerLost",
    "PeerScheduler",
    "PeerStatistics",
    "PeerUpdated",
    "Prepared",
    "ProtocolError",
    "RailStatistics",
    "Region",
    "RegistrationError",
    "RemoteRegion",
    "RemoteSegment",
    "Router",
    "Segment",
    "SegmentList",
    "StalePeer",
    "Transfer",
    "TransferResult",
    "TransferTimeout",
    "TransportError",
    "XferError",
    "__version__",
    "discovery",
    "routing",
]
