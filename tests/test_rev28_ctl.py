"""rev28: with discovery, a placement from an unjoined sender that etcd
holds is checked on "from" only: its "ctl" (where the ack goes, sent even
when the pull fails) is dialled as sent."""
from __future__ import annotations

import asyncio
import json
import uuid

from conftest import make_agent, wait_until, within  # noqa: F401
from test_discovery import TTL, etcd_server  # noqa: F401
from test_kv27_put_from import BB, listener

from aioxfer import kv
from aioxfer.discovery import Etcd


async def test_discovery_unjoined_sender_ctl_not_dialled(make_agent, etcd_server) -> None:  # noqa: F811
    etcd = Etcd(etcd_server, prefix=f"/aioxfer-test/rev28-{uuid.uuid4().hex[:12]}", ttl=TTL)
    a = await make_agent("rev28-a", discovery=etcd)
    c = await make_agent("rev28-c", discovery=etcd)  # in etcd, not a member
    ta = kv.PeerTier(group="rev28")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            listener() as (elsewhere, accepted):
        assert ta.ctl is not None
        await within(wait_until(lambda: any(ev.name == c.name for ev in a._membership.snapshot()),
                                seconds=10, what="c in etcd"), 20)
        # "from": c's own address (as etcd holds it); "ctl": anywhere
        head = {"op": "put", "req": 1, "from": c.address, "ctl": elsewhere, "region": "r"}
        raw = json.dumps(head).encode()
        to_a = await within(c.connect(ta.ctl.address))
        await within(to_a.notify(len(raw).to_bytes(2, "little") + raw + bytes(48)))
        await asyncio.sleep(2.0)
        assert accepted == [], "A dialled the ctl address it was sent"
