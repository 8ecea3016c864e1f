"""aioxfer.kv: a tiered KV block store over host memory, disk, peers and
object storage, on one agent's one-sided transfers.

```python
from aioxfer import kv
keys = kv.chain(tokens, block_tokens=16, namespace=b"llama-3-8b/bf16/tp0")
async with kv.Store.open(agent, block_bytes=64 << 10, tiers=[
        kv.HostTier(capacity=8 << 30, eviction="s3fifo"),   # lru (default), fifo, s3fifo, arc
        kv.DiskTier("/nvme/kv", capacity=1 << 40, compress="lz4")]) as store:
    await store.put(keys, src)                 # src: registered memory, one block per key
    hit = await store.lookup(keys)             # hit.prefix, hit.tiers
    res = await store.get(keys, dst)           # res.prefix blocks landed in dst, verified
```

Eviction policies: ``aioxfer.kv.policy``; compression of lower tiers:
``aioxfer.kv.codec`` (blosc); Prometheus export:
``aioxfer.kv.metrics.StoreCollector`` (prometheus_client). The last two, and
their optional packages, are imported only when used.
"""

from __future__ import annotations

from aioxfer.kv.disk import DiskTier
from aioxfer.kv.errors import (
    BlockCorrupt,
    BlockMissing,
    BlockUnavailable,
    KVError,
    PinLimitExceeded,
    RemoveIncomplete,
)
from aioxfer.kv.host import HostTier
from aioxfer.kv.keys import KEY_BYTES, ROOT, chain, import_key
from aioxfer.kv.objects import ObjectTier
from aioxfer.kv.peer import PeerTier
from aioxfer.kv.pipeline import Channel, Pipeline
from aioxfer.kv.stats import StoreStatistics, TierStatistics
from aioxfer.kv.store import (
    BlockFailure,
    GetResult,
    LayerResult,
    LayerStream,
    LookupResult,
    PutResult,
    Store,
)
from aioxfer.kv.tier import Tier

__all__ = [
    "KEY_BYTES",
    "ROOT",
    "BlockCorrupt",
    "BlockFailure",
    "BlockMissing",
    "BlockUnavailable",
    "Channel",
    "DiskTier",
    "GetResult",
    "HostTier",
    "KVError",
    "LayerResult",
    "LayerStream",
    "LookupResult",
    "ObjectTier",
    "PeerTier",
    "PinLimitExceeded",
    "Pipeline",
    "PutResult",
    "RemoveIncomplete",
    "Store",
    "StoreStatistics",
    "Tier",
    "TierStatistics",
    "chain",
    "import_key",
]
