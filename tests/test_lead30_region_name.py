"""A region's name is held to the rule metadata enforces on the wire.

A name over 256 characters registered fine, then every peer's connect
failed decoding our metadata (ProtocolError: Expected str of length <= 256)
and close waited 10 s for nothing (sec29's lead). Now register refuses it
at once (alloc too).
"""

from __future__ import annotations

import pytest

import aioxfer
from aioxfer.errors import RegistrationError


async def test_a_region_name_the_wire_would_refuse_is_refused() -> None:
    async with aioxfer.Agent("lead30-a", listen="127.0.0.1:0") as a:
        with pytest.raises(RegistrationError, match="region name"):
            a.register(bytearray(4096), name="n" * 257)
        with pytest.raises(RegistrationError, match="region name"):
            a.alloc(4096, name="n" * 257)


async def test_a_256_character_region_name_reaches_a_peer() -> None:
    async with aioxfer.Agent("lead30-a", listen="127.0.0.1:0") as a, \
            aioxfer.Agent("lead30-b", listen="127.0.0.1:0") as b:
        a.register(bytearray(4096), name="n" * 256)
        peer = await b.connect(a.address)
        assert peer.region("n" * 256).nbytes == 4096
