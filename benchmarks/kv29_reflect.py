"""What a placement from a sender that is no member makes an owner dial (kv29).

An owner (a store with a PeerTier) serves placements on its control agent.
A placement names "from", the agent to pull the blocks from; from a sender
the owner does not know (embedded mode: no discovery), "from" is dialled as
sent, and only then is the agent there checked to be the sender. Here a
plain agent (holding the token: it passed the handshake) sends ``--n``
placements, one after another, each naming as "from" a loopback port of
this script's that counts the connections made to it and the bytes the
owner sends there before the port closes them (a "victim" that speaks no
aioxfer). One JSON line: connections, bytes at the victim, bytes the
sender sent, the ratio, and how many placements a second reached the
victim (the sender pacing each on its dial, or 0.2 s when none comes)::

    cd / && python /path/to/benchmarks/kv29_reflect.py --n 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import aioxfer
from aioxfer import kv


async def main(n: int) -> dict[str, float | int | str]:
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0), backlog=512)
    lsock.setblocking(False)
    victim = f"127.0.0.1:{lsock.getsockname()[1]}"
    conns = 0
    got = 0
    arrived = asyncio.Condition()

    async def serve(sock: socket.socket) -> None:
        nonlocal got, conns
        try:
            async with asyncio.timeout(0.05):  # what the dialler sends unasked
                while data := await loop.sock_recv(sock, 65536):
                    got += len(data)
        except (TimeoutError, OSError):
            pass
        finally:
            sock.close()
            async with arrived:
                conns += 1
                arrived.notify_all()

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(lsock)
            loop.create_task(serve(sock))

    acceptor = loop.create_task(accept())
    owner = aioxfer.Agent("kv29-owner")
    sender = aioxfer.Agent("kv29-sender")
    tier = kv.PeerTier(group="kv29x")
    sent = 0
    async with owner, sender, kv.Store.open(owner, block_bytes=4096,
                                            tiers=[kv.HostTier(64 * 4096), tier]):
        assert tier.ctl is not None
        to_owner = await sender.connect(tier.ctl.address)
        key = bytes(32)
        t0 = time.perf_counter()
        for i in range(n):
            head = json.dumps({"op": "put", "req": i, "from": victim, "ctl": victim,
                               "region": "r"}).encode()
            msg = len(head).to_bytes(2, "little") + head + key + bytes(16)
            sent += len(msg)
            await to_owner.notify(msg)
            async with arrived:  # paced: the next once its dial is over (or 0.2 s without)
                try:
                    async with asyncio.timeout(0.2):
                        await arrived.wait_for(lambda i=i: conns > i)  # type: ignore[misc]
                except TimeoutError:
                    pass
        wall = time.perf_counter() - t0
        refused = tier.pulls_refused
        dropped = dict(tier.counters.dropped_stores)
    acceptor.cancel()
    lsock.close()
    return {"placements": n, "victim_connections": conns, "victim_bytes": got,
            "sender_bytes": sent, "bytes_ratio": round(got / max(sent, 1), 3),
            "dials_per_s": round(conns / wall, 1), "owner_refused": refused,
            "owner_dropped": json.dumps(dropped), "version": aioxfer.__version__}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.n))))
