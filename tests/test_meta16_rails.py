"""A peer's metadata whose address or rails are not "host:port" addresses
fails to decode (ProtocolError, a typed XferError), as every other field of it
does: it used to escape connect() as a builtin ValueError or UnicodeError from
the dialling code (found by rev16)."""
from __future__ import annotations

import msgspec
import pytest

import aioxfer
from aioxfer import metadata
from aioxfer.errors import ProtocolError

BAD = ["no-port-here", "host:99999", "host:+1", "bad\x00host:1", "a" * 70 + ":1", ":80"]


@pytest.mark.parametrize("bad", BAD)
async def test_a_malformed_rail_fails_connect_typed(bad: str) -> None:
    async with aioxfer.Agent("m16-b", listen="127.0.0.1:0", transports=("tcp",)) as b, \
            aioxfer.Agent("m16-a", listen="127.0.0.1:0", transports=("tcp",)) as a:
        served = b._localmeta.meta_with

        def hostile(memfd):  # type: ignore[no-untyped-def]
            m = served(memfd)
            msgspec.structs.force_setattr(m, "rails", [b.address, bad])
            return m

        b._localmeta.meta_with = hostile  # type: ignore[method-assign]
        with pytest.raises(ProtocolError, match="host:port"):
            await a.connect(b.address)
        assert not a.peers


@pytest.mark.parametrize("bad", BAD)
def test_decoding_checks_address_and_rails(bad: str) -> None:
    good = metadata.AgentMeta(version=2, name="x", incarnation=1, host_id="h", pid=1,
                              address="127.0.0.1:5", transports=["tcp"], regions=[],
                              rails=["127.0.0.1:5", "[::1]:6", "node-3.example:65535"])
    raw = msgspec.msgpack.encode(good)
    assert msgspec.msgpack.decode(raw, type=metadata.AgentMeta) == good
    for field in ("address", "rails"):
        m = msgspec.structs.replace(good)
        msgspec.structs.force_setattr(m, field, bad if field == "address" else [bad])
        with pytest.raises(msgspec.ValidationError, match="host:port"):
            msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=metadata.AgentMeta)


COMPAT_BAD = ["not-an-address", "host:99999", "h:-1", "\x00:1", "a" * 300 + ":1", ":"]


@pytest.mark.parametrize("bad", COMPAT_BAD)
def test_compat_metadata_with_a_malformed_address_is_invalid(bad: str) -> None:
    """aioxfer.nixl: loadRemoteMD of metadata whose address is not host:port
    raises NIXL's invalid-parameter error (it raised the dialling code's
    builtin ValueError or UnicodeError: rev16), and dials nothing."""
    from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config
    from aioxfer.nixl._bindings import nixlInvalidParamError

    a = nixl_agent("m16-compat", nixl_agent_config(enable_listen_thread=False))
    try:
        md = _wire.encode_md(_wire.AgentMD("m16-other", address=bad, incarnation=1))
        with pytest.raises(nixlInvalidParamError, match="address"):
            a.add_remote_agent(md)
    finally:
        a.close()
