"""fuzz31's nixl_wire finding: msgpack nested past the interpreter's
recursion limit in a field the Struct does not have (msgspec skips an
unknown field's value recursively) makes aioxfer/nixl/_wire.py's
request_decoder, reply_decoder and decode_md raise RecursionError instead of
msgspec.DecodeError / NotMetadata (decode_dlist converts it already; so do
aioxfer.protocol.decode_body and discovery's etcd decoder).

Where it shows: loadRemoteMD / add_remote_agent of such a blob (metadata a
peer hands over) raises RecursionError, not NIXL's nixlMismatchError; a
listener's reply of that shape escapes _request's ``except ValueError``
(its background fetch ends with a RecursionError). The listener itself
catches it (``except Exception``: logged, that connection closed).

Fixed: _wire.py's decoders turn the RecursionError into a DecodeError
(_wire._Decoder); the inputs are in fuzz/corpus/nixl_wire/ (deep-nesting-*),
replayed by tests/test_fuzz_replay.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

import aioxfer.nixl as nixl
from aioxfer.nixl import _wire

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
DEEP = b"\x91" * 3000 + b"\xc0"  # [[[...[nil]...]]], 3000 levels

@pytest.mark.parametrize("which", ["request", "reply"])
def test_listener_decoders_say_decode_error(which: str) -> None:
    dec, tag = {"request": (_wire.request_decoder, b"push"),
                "reply": (_wire.reply_decoder, b"reply")}[which]
    body = b"\x82\xa4type" + bytes([0xA0 | len(tag)]) + tag + b"\xa3zzz" + DEEP
    with pytest.raises(msgspec.DecodeError):
        dec.decode(body)


def test_decode_md_says_not_metadata() -> None:
    with pytest.raises(_wire.NotMetadata):
        _wire.decode_md(_wire.MD_MAGIC + b"\x81\xa3zzz" + DEEP)


def test_add_remote_agent_of_deep_metadata(agents: Any) -> None:
    a = agents()
    with pytest.raises(nixl.nixlMismatchError):
        a.add_remote_agent(_wire.MD_MAGIC + b"\x81\xa3zzz" + DEEP)


def test_findings_replay_clean() -> None:
    """The harness takes each finding's input without a finding now."""
    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    import fuzz_nixl_wire

    found = sorted((FUZZ / "corpus" / "nixl_wire").glob("deep-nesting-*"))
    assert len(found) >= 3
    for p in found:
        assert fuzz_nixl_wire.check(p.read_bytes()) is None, p.name
